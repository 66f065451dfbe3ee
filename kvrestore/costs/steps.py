"""An engine's forward passes as samples of what computing costs (`StepTimer`), for a connector inside an
engine that runs its own steps (vLLM's).

On CUDA the host only launches a step's kernels, so a step is timed on the device, by events on the
engine's stream, and learned once the device has done it: the timer never waits for one. Each sample is
the step's time less what it waited for loads (`observe_pass`); a step that computed one request beside
a load is also a sample of computing beside one (`observe_loading`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from kvrestore.core.streams import HostEvent, timing_event
from kvrestore.costs.learned import CostLearner


def mark(device: torch.device) -> torch.cuda.Event | HostEvent:
    """Now, on `device`'s current stream (the host's clock off CUDA)."""
    event = timing_event(device)
    event.record(torch.cuda.current_stream(device) if device.type == "cuda" else None)
    return event


class StepTimer:
    """The timed steps of one engine worker, learned into `costs` (module doc); at most `keep` not read."""

    def __init__(self, costs: CostLearner, num_layers: int, keep: int = 16) -> None:
        self.costs = costs
        self.num_layers = num_layers
        self._start: torch.cuda.Event | HostEvent = HostEvent()
        #: ((n new, past) of each request, start, end, seconds waited, load seconds or None)
        self._steps: deque[tuple[list[tuple[int, int]], Any, Any, float, float | None]] = deque(maxlen=keep)

    def begin(self, device: torch.device) -> None:
        """A step begins (before its kernels are launched)."""
        self._start = mark(device)

    def end(
        self, device: torch.device, requests: list[tuple[int, int]], waited_s: float, load_s: float | None = None
    ) -> None:
        """The step begun last computed `requests` ((n new, past) each), waited `waited_s` for loads, and
        ran beside a load of `load_s` seconds (None: none)."""
        self._steps.append((requests, self._start, mark(device), waited_s, load_s))

    def learn(self) -> None:
        """Learn from the timed steps the device has completed (never waits for one)."""
        while self._steps and self._steps[0][2].query():
            requests, start, end, waited, load_s = self._steps.popleft()
            seconds = start.elapsed_time(end) / 1e3
            self.costs.observe_pass(requests, max(0.0, seconds - waited))
            if load_s is not None:
                ((n_new, past),) = requests
                self.costs.observe_loading(n_new, past, load_s, seconds, self.num_layers)
