"""Every change to a restore's `Progress` after it is made: what the driver observed, the decisions
it began and the units that finished.

Kept apart from both the policies (which only decide) and the drivers (the engine on a real clock, the
simulator on a simulated one), so every driver enforces the same rules: a compute unit starts only at
the end of the done prefix on a free lane; a chunk is loaded only while pending and stored; a dropped
load never lands; each chunk is applied once. Nothing else writes a `Progress`.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvrestore.core.trace import TraceEvent
from kvrestore.policies.base import ChunkStatus, Decision, Policy, Progress
from kvrestore.policies.batch import BatchJob, ComputeStep, LoadGrant


class PolicyError(RuntimeError):
    """A policy asked for something the rules of a restore do not allow."""


def set_capabilities(progress: Progress, can_race: bool, can_overtake: bool) -> None:
    """What the driver that runs the restore can do (`Decision.race`, `Decision.overtake`): set once,
    before its first decision, by a driver that learns it from its request (`Engine.run`)."""
    progress.lanes.can_race = can_race
    progress.lanes.can_overtake = can_overtake


def observe(progress: Progress, now: float, free_load_lanes: int | None = None) -> None:
    """What the driver sees before it asks for a decision: its clock (seconds since the restore began)
    and, where it hands the load lanes to this restore alone, how many are free."""
    progress.now = now
    if free_load_lanes is not None:
        progress.free_load_lanes = free_load_lanes


def begin(progress: Progress, decision: Decision, policy: Policy | None = None) -> None:
    """Mark the units of `decision` as started: drops first (a compute unit may take their chunks),
    then loads (a racing compute unit may race one of them), then the compute unit."""
    who = repr(policy) if policy is not None else "policy"
    for i in decision.drop:
        if progress.status[i] is not ChunkStatus.LOADING:
            raise PolicyError(f"{who} dropped the load of chunk {i}, which is {progress.status[i].value}")
        progress.status[i] = ChunkStatus.PENDING  # the load still holds its lane until it stops
        progress.load_started[i] = None
    for i in decision.loads:
        if progress.status[i] is not ChunkStatus.PENDING or not progress.stored[i]:
            state = progress.status[i].value if progress.stored[i] else "not stored"
            raise PolicyError(f"{who} asked to load chunk {i}, which is {state}")
        progress.status[i] = ChunkStatus.LOADING
        progress.load_started[i] = progress.now
        progress.loads_in_flight += 1
    if decision.race:
        _begin_race(progress, decision, who)
    elif decision.compute is not None:
        a, b = decision.compute
        check_compute(progress, a, b, who)
        for j in range(a, b):
            progress.status[j] = ChunkStatus.COMPUTING
        progress.compute_busy = True
        progress.running.started = progress.now
    if decision.overtake:
        _begin_overtake(progress, decision.overtake, who)


def _begin_overtake(progress: Progress, chunks: tuple[int, ...], who: str) -> None:
    """Fetches aside of chunks of the compute unit running in place (`Decision.overtake`)."""
    if not progress.lanes.can_overtake:
        raise PolicyError(f"{who} overtook a compute unit on a driver that cannot")
    unit = progress.computing()
    for i in chunks:
        if (
            unit is None
            or not unit[0] <= i < unit[1]
            or i in progress.running.aside
            or not progress.stored[i]
        ):
            raise PolicyError(
                f"{who} fetched chunk {i} aside, which is not a stored chunk of the running unit"
            )
        progress.running.aside[i] = False
        progress.load_started[i] = progress.now
        progress.loads_in_flight += 1


def _begin_race(progress: Progress, decision: Decision, who: str) -> None:
    """A compute unit of one chunk whose fetch is in flight: the chunk stays LOADING (with `racing`
    set) until one of the two finishes."""
    if not progress.lanes.can_race:
        raise PolicyError(f"{who} raced a compute unit against a fetch on a driver that cannot race")
    if decision.compute is None or decision.compute[1] != decision.compute[0] + 1:
        raise PolicyError(f"{who} raced a compute unit of {decision.compute}: a race is for one chunk")
    a = decision.compute[0]
    if progress.compute_busy or progress.done_prefix() != a or progress.status[a] is not ChunkStatus.LOADING:
        raise PolicyError(
            f"{who} raced for chunk {a}, which is {progress.status[a].value} (needs every chunk before it "
            "done, a free compute lane and its fetch in flight)"
        )
    progress.compute_busy = True
    progress.running.racing = a


def check_compute(progress: Progress, a: int, b: int, who: str = "policy") -> None:
    """A compute unit starts only on a free lane, at the end of the done prefix, over pending chunks."""
    if progress.compute_busy:
        raise PolicyError(f"{who} started a compute unit while the compute lane is busy")
    if not (0 <= a < b <= progress.n_chunks) or progress.done_prefix() != a:
        raise PolicyError(f"{who}: compute of chunks [{a}, {b}) needs every chunk before {a} done")
    if any(progress.status[j] is not ChunkStatus.PENDING for j in range(a, b)):
        raise PolicyError(f"{who}: compute of chunks [{a}, {b}) covers a chunk that is not pending")


def apply_event(progress: Progress, event: TraceEvent) -> None:
    """Update a restore's progress with a finished unit (kept apart from decisions, as in vLLM)."""
    if progress.running.racing is not None and event.first_chunk == progress.running.racing:
        _apply_race(progress, event)
        return
    if event.kind.startswith("aside") or event.kind == "compute-overtaken":
        _apply_aside(progress, event)
        return
    chunks = range(event.first_chunk, event.last_chunk + 1)
    expect = ChunkStatus.COMPUTING if event.kind == "compute" else ChunkStatus.LOADING
    if event.kind != "load-dropped" and any(progress.status[j] is not expect for j in chunks):
        raise PolicyError(f"{event.kind} of chunks {list(chunks)} finished, but they are not {expect.value}")
    if event.kind == "compute":
        progress.compute_busy = False
        progress.running.started = None
        progress.running.aside = {
            i: False for i, landed in progress.running.aside.items() if not landed
        }  # still stopping
        n = event.last_chunk - event.first_chunk + 1
        for j in range(event.first_chunk, event.last_chunk + 1):
            progress.status[j] = ChunkStatus.COMPUTED
            progress.compute_seconds[j] = event.seconds / n
        return
    progress.loads_in_flight -= 1
    i = event.first_chunk
    if event.kind == "load-dropped":  # its chunk went to the compute lane when the drop was decided
        return
    if event.kind == "load":
        progress.status[i] = ChunkStatus.LOADED
        progress.load_seconds[i] = event.seconds
    else:  # a fault: the chunk is a miss from now on
        progress.load_started[i] = None
        progress.status[i] = ChunkStatus.PENDING
        progress.stored[i] = False


def _apply_aside(progress: Progress, event: TraceEvent) -> None:
    """A fetch aside ended ("aside": landed in its own buffer; "aside-failed"; "aside-dropped": the
    unit computed first), or the unit it overtook stopped ("compute-overtaken": every chunk of it
    landed aside and was written instead)."""
    i = event.first_chunk
    if event.kind == "compute-overtaken":
        chunks = range(event.first_chunk, event.last_chunk + 1)
        if not all(progress.running.aside.get(j) for j in chunks):
            raise PolicyError(f"the compute unit of chunks {list(chunks)} was overtaken before they landed")
        for j in chunks:
            progress.status[j] = ChunkStatus.LOADED
            del progress.running.aside[j]
        progress.compute_busy = False
        progress.running.started = None
        return
    progress.loads_in_flight -= 1
    if event.kind == "aside" and progress.status[i] is ChunkStatus.COMPUTING:
        progress.running.aside[i] = True
        progress.load_seconds[i] = event.seconds
        return
    progress.running.aside.pop(i, None)
    if progress.status[i] is ChunkStatus.COMPUTING:
        progress.load_started[i] = None
    if event.kind == "aside-failed":
        progress.stored[i] = False


def _apply_race(progress: Progress, event: TraceEvent) -> None:
    """A unit of a race ended. The fetch landing first wins (the compute unit, stopped, then ends as
    "compute-dropped"); a fetch that failed or was dropped leaves the chunk to the compute unit, whose
    "compute" then applies it."""
    i = event.first_chunk
    if event.kind == "compute-dropped":
        progress.compute_busy = False
        progress.running.racing = None
        return
    if event.kind == "compute":
        if progress.status[i] is not ChunkStatus.COMPUTING:
            raise PolicyError(f"the compute unit of chunk {i} won its race after the fetch did")
        progress.running.racing = None
        progress.compute_busy = False
        progress.status[i] = ChunkStatus.COMPUTED
        progress.compute_seconds[i] = event.seconds
        return
    if progress.status[i] is not ChunkStatus.LOADING:
        raise PolicyError(f"{event.kind} of chunk {i}, which is {progress.status[i].value}, in a race")
    progress.loads_in_flight -= 1
    if event.kind == "load":
        progress.status[i] = ChunkStatus.LOADED
        progress.load_seconds[i] = event.seconds
        return
    progress.load_started[i] = None
    progress.status[i] = ChunkStatus.COMPUTING  # the compute unit has it now
    if event.kind == "load-failed":
        progress.stored[i] = False


def stalled(progress: Progress) -> bool:
    """Nothing runs and chunks are left: unless the policy asked to be woken, the restore cannot finish."""
    return not progress.finished and not progress.compute_busy and progress.loads_in_flight == 0


def note_step(jobs: Mapping[int, BatchJob], step: ComputeStep) -> None:
    """Update the jobs' starvation counters from a step (the scheduler only decides; this keeps the
    state that its starvation bound reads)."""
    for u in step.units:
        jobs[u.job].skipped = 0
    for j in step.passed_over:
        job = jobs[j]
        job.skipped += 1
        job.most_skipped = max(job.most_skipped, job.skipped)


def begin_step(jobs: Mapping[int, BatchJob], step: ComputeStep) -> None:
    """Mark a batch compute step's units (and the loads they take over) as started."""
    drops: dict[int, list[int]] = {}
    for j, i in step.drops:
        drops.setdefault(j, []).append(i)
    for u in step.units:
        job = jobs[u.job]
        begin(job.progress, Decision(compute=(u.a, u.b), drop=tuple(drops.pop(u.job, ()))), job.policy)
    if drops:
        raise PolicyError(f"a step dropped loads of jobs {sorted(drops)} without computing their chunks")


def begin_loads(jobs: Mapping[int, BatchJob], grant: LoadGrant) -> None:
    """Mark a batch load grant's loads as started, job by job."""
    by_job: dict[int, list[int]] = {}
    for j, i in grant.loads:
        by_job.setdefault(j, []).append(i)
    for j, chunks in by_job.items():
        begin(jobs[j].progress, Decision(loads=tuple(chunks)), jobs[j].policy)
