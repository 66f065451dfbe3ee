"""`Progress` is written by the bookkeeping only: no other module of kvrestore assigns to a progress's
fields after making it (a policy reads it; a driver changes it through `runtime.bookkeeping`)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from kvrestore.policies.base import LaneTraits, Progress
from kvrestore.runtime.bookkeeping import observe, set_capabilities

PACKAGE = Path(__file__).resolve().parent.parent / "kvrestore"
WRITER = PACKAGE / "runtime" / "bookkeeping.py"
FIELDS = {f.name for f in dataclasses.fields(Progress)}


def _progress_writes(source: str) -> set[int]:
    """Lines that assign to a field of a progress: `<...>progress.<field> = ...` (or `+=`, or an item of
    it, `progress.status[i] = ...`), the progress named as the codebase names it."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Subscript):
                    t = t.value
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr in FIELDS
                    and isinstance(t.value, (ast.Name, ast.Attribute))
                    and (t.value.id if isinstance(t.value, ast.Name) else t.value.attr).endswith("progress")
                ):
                    lines.add(node.lineno)
    return lines


def test_only_the_bookkeeping_writes_a_progress():
    found = {
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in PACKAGE.rglob("*.py")
        if path != WRITER
        for line in _progress_writes(path.read_text())
    }
    assert not found, f"a Progress written outside runtime/bookkeeping.py: {sorted(found)}"


@pytest.mark.parametrize(
    "line",
    [
        "progress.now = 1.0",
        "job.progress.free_load_lanes += 1",
        "self.progress.status[i] = s",
        "progress.lanes.can_race: bool = True",
        "progress.running.aside[i] = True",
    ],
)
def test_the_check_sees_every_kind_of_write(line):
    assert _progress_writes(line) == {1}
    assert _progress_writes(line.replace("progress", "other")) == set()


def test_observe_and_capabilities_are_bookkeeping_and_a_view_leaves_the_progress_alone():
    p = Progress([16] * 3, [True] * 3, lanes=LaneTraits(min_unit_chunks=2))
    set_capabilities(p, can_race=True, can_overtake=False)
    observe(p, 1.5, free_load_lanes=2)
    assert (p.now, p.free_load_lanes, p.lanes.can_race, p.lanes.can_overtake) == (1.5, 2, True, False)
    observe(p, 2.0)  # a batch job's clock: the lanes are the scheduler's to hand out
    assert (p.now, p.free_load_lanes) == (2.0, 2)
    view = p.as_if(now=9.0, free_load_lanes=0, compute_busy=True)
    assert (view.now, view.free_load_lanes, view.compute_busy, view.lanes.min_unit_chunks) == (
        9.0,
        0,
        True,
        2,
    )
    assert (p.now, p.free_load_lanes, p.compute_busy) == (2.0, 2, False)
