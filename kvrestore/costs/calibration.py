"""How each strategy's restores compare with what the cost model predicted for them."""

from __future__ import annotations

import math

from kvrestore.core.errors import InvalidInputError


class Calibration:
    """How each strategy's restores actually compare with the profile's predictions (EWMA of the log
    ratio measured / predicted, per policy name).

    The profile measures compute and the link one at a time; a restore runs them together on the same
    machine, and a hybrid pays for that (threads competing for cores, memory traffic) in its own way. A
    restorer observes every restore it runs and `Auto` scales each strategy's prediction by its factor,
    so a strategy the model flatters stops being picked after a few restores. Factors stay within
    [1 / `limit`, `limit`]; a strategy never observed has factor 1.
    """

    def __init__(self, weight: float = 0.5, limit: float = 2.0) -> None:
        if not 0 < weight <= 1:
            raise InvalidInputError(f"weight must be in (0, 1], got {weight}")
        if limit < 1:
            raise InvalidInputError(f"limit must be >= 1, got {limit}")
        self.weight = weight
        self.limit = limit
        self._log: dict[str, float] = {}
        self.observations: dict[str, int] = {}

    def observe(self, name: str, predicted_s: float, measured_s: float) -> None:
        if not (
            predicted_s > 0 and measured_s > 0 and math.isfinite(predicted_s) and math.isfinite(measured_s)
        ):
            return
        x = math.log(measured_s / predicted_s)
        old = self._log.get(name)
        self._log[name] = x if old is None else (1 - self.weight) * old + self.weight * x
        self.count(name)

    def count(self, name: str) -> None:
        """One more run of `name` (the strategy was tried), set against no prediction."""
        self.observations[name] = self.observations.get(name, 0) + 1

    def forget(self) -> None:
        """Drop every factor (each strategy's prediction is taken as it is again) but keep the counts
        (which strategies were run): what `Planner.learn` does when the link changes speed, since how a
        strategy compared with its prediction over one link says little of how it compares over another
        (lanes sharing a machine interfere by how busy the loads keep it)."""
        self._log = {}

    def factor(self, name: str) -> float:
        x = self._log.get(name, 0.0)
        bound = math.log(self.limit)
        return math.exp(min(bound, max(-bound, x)))

    def factors(self) -> dict[str, float]:
        return {name: self.factor(name) for name in self._log}

    def logs(self) -> dict[str, float]:
        """log(measured / predicted) per strategy (what `resume` takes back)."""
        return dict(self._log)

    def resume(self, logs: dict[str, float], observations: dict[str, int]) -> None:
        """Continue from what an earlier calibration learned (`logs`, `observations`)."""
        self._log = dict(logs)
        self.observations = dict(observations)
