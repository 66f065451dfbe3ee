"""What a cost read from a file may say: the bounds that make a learned-costs file or a profile a hint.

A file on disk is written by this library, but it may be damaged, hand-edited, of an older build, or
simply absurd (a link of 1 B/s). Before anything read from one is used, every field is checked here;
a file with any field out of bounds is logged and ignored (learning starts again), so no file can make
a restore fail or take a value the planner cannot compute with. The bounds are wide: they refuse what
no real machine or link can be, not what is merely unusual.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from kvrestore.costs.compute import ChunkCost, LayerCost
from kvrestore.costs.links import LinkCost

#: a link slower than 1 kB/s or faster than 10 TB/s is no link a chunk store has
LINK_BYTES_PER_S = (1e3, 1e13)
#: a round trip longer than 10 s is a store that is down, not a latency to plan with
LINK_LATENCY_S = (0.0, 10.0)
#: tokens in one compute unit, or of past KV before it
TOKENS = (0.0, 1e7)
#: bytes of one load
BYTES = (0.0, 1e15)
#: attention pairs a step computes (tokens times the tokens each attends to)
PAIRS = (0.0, 1e15)
#: seconds of one compute unit (or one layer of one)
UNIT_SECONDS = (0.0, 1e5)
#: seconds per unit (token, token^2, ...) of a fitted cost term
COST_TERM_S = (0.0, 1e4)
#: |log(measured / predicted)| of a calibration
CALIBRATION_LOG = 50.0


def within(x: object, lo: float, hi: float, *, low_open: bool = False) -> bool:
    """Whether `x` is a finite real number in [lo, hi] ((lo, hi] with `low_open`)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return False
    return (lo < x if low_open else lo <= x) and x <= hi


def link_problem(link: LinkCost | None) -> str | None:
    """What is wrong with a link read from a file, or None."""
    if link is None:
        return None
    if not within(link.bytes_per_s, *LINK_BYTES_PER_S):
        return f"link bandwidth {link.bytes_per_s!r} B/s is outside {LINK_BYTES_PER_S}"
    if not within(link.latency_s, *LINK_LATENCY_S):
        return f"link latency {link.latency_s!r} s is outside {LINK_LATENCY_S}"
    return None


def samples_problem(
    name: str, rows: Sequence[Sequence[float]], bounds: Sequence[tuple[float, float]]
) -> str | None:
    """What is wrong with [x, ..., seconds] samples read from a file (each of len(bounds) values, the
    last one seconds > 0), or None."""
    for i, row in enumerate(rows):
        if len(row) != len(bounds):
            return f"{name} sample {i} has {len(row)} values, not {len(bounds)}"
        for j, (x, (lo, hi)) in enumerate(zip(row, bounds, strict=True)):
            if not within(x, lo, hi, low_open=j == len(bounds) - 1):
                return f"{name} sample {i} value {x!r} is outside {(lo, hi)}"
    return None


def cost_problem(name: str, cost: ChunkCost | LayerCost) -> str | None:
    """What is wrong with a fitted compute cost read from a file, or None."""
    for field in cost.__struct_fields__:
        x = getattr(cost, field)
        if not within(x, *COST_TERM_S):
            return f"{name}.{field} {x!r} is outside {COST_TERM_S}"
    return None


def counts_problem(name: str, counts: Iterable[object]) -> str | None:
    """What is wrong with counts read from a file (each a non-negative int), or None."""
    for x in counts:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            return f"{name} count {x!r} is not a non-negative integer"
    return None


def calibration_problem(logs: dict[str, float]) -> str | None:
    """What is wrong with calibration logs read from a file, or None."""
    for name, x in logs.items():
        if not within(x, -CALIBRATION_LOG, CALIBRATION_LOG):
            return f"calibration of {name} {x!r} is outside +-{CALIBRATION_LOG}"
    return None


def first_problem(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


__all__ = [
    "LINK_BYTES_PER_S",
    "LINK_LATENCY_S",
    "calibration_problem",
    "cost_problem",
    "counts_problem",
    "first_problem",
    "link_problem",
    "samples_problem",
    "within",
]
