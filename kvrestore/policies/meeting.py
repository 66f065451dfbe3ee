"""The two-pointer policies, along tokens and along layers, and where their pointers meet.

A unit is what one pointer step covers: a chunk of tokens (`TokenTwoPointer`) or a layer over the whole
stored prefix (`LayerTwoPointer`); `Progress.chunk_tokens` holds each unit's tokens. Both decide alike
(`Meeting`); only their units differ. The compute lane
takes units from the front, the load lanes fetch stored units from the back, and the two meet in the
middle. Where they meet is never planned: each side simply keeps going, so when the store slows down or
the compute lane gets a smaller share, the meeting point moves by itself.

The one real decision is at the meeting: the next unit to compute is already being fetched. Computing
it costs about as much as the last computed unit; waiting costs whatever is left of the fetch
(`Estimates.landing`). The pointers wait only while that estimate is the smaller, and never much longer
than computing would have taken (`GRACE`), so a stalled store costs at most about one unit's compute
time. Where the driver can race (`LaneTraits.can_race`: the engine and the simulator), computing does
not drop the fetch: both run and the first to finish wins, so a fetch that was nearly there still
counts. The last unit left, when nothing says which lane is faster (a one-unit restore), is raced from
the start: such a restore is never slower than the faster of computing and loading it.

Every estimate of the lanes comes from `costs.estimates` (through the `Estimates` the driver hands
over); this module only decides.
"""

from __future__ import annotations

from kvrestore.core.settings import check_int
from kvrestore.policies.base import ChunkStatus, Decision, Estimates, Policy, Progress

#: how far past its estimated landing (as a fraction of computing the chunk) a fetch is still awaited
GRACE = 0.1
#: how long a restore that knows nothing of its link waits for two fetches to land before computing, as
#: a fraction of the floor of computing every chunk left (`Estimates.floor_s`)
PROBE_SHARE = 0.05
#: stored chunks per compute unit: 2 x 256-token chunks = 512 tokens, Cake's compute granularity
DEFAULT_COMPUTE_CHUNKS = 2
#: layers per compute unit (the first unit is one layer, to measure the lane; units shrink near the meeting)
DEFAULT_COMPUTE_LAYERS = 2


class TokenTwoPointer(Policy):
    """Cake's bidirectional restore along tokens (Cake §4, Appendix A; CacheFlow §3.1): compute chunks
    from the front, load chunks from the back, meet in the middle. Along tokens the first chunks are
    cheaper to compute than the last (attention grows with position), which lets the meeting fall past
    the middle of a long prompt when the link and the compute lane are equally fast.

    `compute_chunks` stored chunks make one compute unit (the fetch granularity is the store's chunk
    size, `Restorer(chunk_size=...)`); a unit is cut short where it would reach a chunk being fetched.
    """

    name = "two-pointer"

    def __init__(self, compute_chunks: int = DEFAULT_COMPUTE_CHUNKS) -> None:
        self.compute_chunks = check_int("compute_chunks", compute_chunks)
        self._meeting = Meeting(self.compute_chunks)

    def __repr__(self) -> str:
        return f"TokenTwoPointer(compute_chunks={self.compute_chunks})"

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        return self._meeting.decide(progress, estimates)


class LayerTwoPointer(Policy):
    """The two-pointer along layers (CacheFlow §3.1, "layer-wise parallelism"): compute layers from the
    bottom, load layers from the top, meet at a cutover layer nobody planned. The compute lane runs
    layer 0, 1, 2, ... over every token of the stored prefix at once; the load lanes fetch layer L-1,
    L-2, ..., each one range read per stored chunk (`layers.LayerReader`). Computing layer l needs the
    hidden states out of layer l-1, which only computing gives, so the computed layers are always a
    bottom run and the loaded ones a top run.

    Why a second axis: along tokens a prompt splits only at chunk boundaries, so a prompt of one or two
    chunks cannot be split at all, while a model has dozens of layers. Along layers every unit costs
    the same, though, whereas along tokens the first chunks are cheaper, which the token-wise pointer
    exploits on long prompts. `planning.Auto` picks between the two at the profiled crossover length.
    """

    name = "layer-wise"
    axis = "layers"

    def __init__(self, compute_layers: int = DEFAULT_COMPUTE_LAYERS) -> None:
        self.compute_layers = check_int("compute_layers", compute_layers)
        self._meeting = Meeting(self.compute_layers, stacked=True)

    def __repr__(self) -> str:
        return f"LayerTwoPointer(compute_layers={self.compute_layers})"

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        return self._meeting.decide(progress, estimates)


class Meeting:
    """The two pointers over units: `unit` units make one compute unit (at least the lane's
    `LaneTraits.min_unit_chunks`); a compute unit is cut short where it would reach a unit being
    fetched.

    `stacked`: each unit needs the compute lane's output of the one below (layers: only computing gives
    the hidden states a higher layer reads), so computing a unit above loaded ones runs those again.
    Where the loads took units below the compute lane's next one (a compute lane that was not given
    a turn, on a batch engine), the lane then never takes a unit being fetched (it waits for the
    fetch, which the meeting rule would drop for about one unit's compute, not the many it costs)
    nor races the last one: the computed units stay a bottom run and the loaded ones the top. A unit
    whose load failed is computed whatever lies below it."""

    def __init__(self, unit: int, stacked: bool = False) -> None:
        self.unit = unit
        self.stacked = stacked

    def decide(self, progress: Progress, estimates: Estimates) -> Decision:
        contested = None if self._loaded_below(progress) else self._contested(progress)
        if contested is not None:  # the last chunk, stored: fetch it and compute it, the first wins
            return Decision(compute=(contested, contested + 1), loads=(contested,), race=True)
        compute, drop, wake_at, hopeless = self._compute_step(progress, estimates)
        if drop and compute == (drop[0], drop[0] + 1) and progress.lanes.can_race:
            # the meeting chunk alone: race its fetch instead of dropping it, it may still land first
            return Decision(compute=compute, race=True)
        frontier = compute[1] if compute else progress.compute_frontier()
        loads = self._loads(progress, frontier)
        free = progress.free_load_lanes - len(loads)
        overtake = _overtake(progress, estimates, free, compute, loads)
        if hopeless and not overtake:
            overtake = _probe_aside(progress, free, compute)
        return Decision(compute=compute, loads=loads, drop=drop, wake_at=wake_at, overtake=overtake)

    def _loaded_below(self, p: Progress, a: int | None = None) -> bool:
        """Whether a `stacked` unit below unit a (default: the compute lane's next) was loaded."""
        if not self.stacked:
            return False
        a = p.done_prefix() if a is None else a
        return any(p.status[j] is ChunkStatus.LOADED for j in range(min(a, p.n_chunks)))

    @staticmethod
    def _contested(p: Progress) -> int | None:
        """The one chunk left, stored and untouched, on a driver that can race (a one-chunk prompt, or
        the last chunk of one): neither lane's speed is known to say which should take it."""
        if not p.lanes.can_race or p.compute_busy or p.free_load_lanes < 1:
            return None
        a = p.done_prefix()
        if a == p.n_chunks - 1 and p.status[a] is ChunkStatus.PENDING and p.stored[a]:
            return a
        return None

    # -- the load pointer ------------------------------------------------------------------------

    @staticmethod
    def _loads(p: Progress, frontier: int) -> tuple[int, ...]:
        """Stored pending chunks from the back, down to the compute frontier, one per free lane."""
        loads: list[int] = []
        for i in range(p.n_chunks - 1, frontier - 1, -1):
            if len(loads) >= p.free_load_lanes:
                break
            if p.status[i] is ChunkStatus.PENDING and p.stored[i]:
                loads.append(i)
        return tuple(loads)

    # -- the compute pointer ---------------------------------------------------------------------

    def _compute_step(
        self, p: Progress, e: Estimates
    ) -> tuple[tuple[int, int] | None, tuple[int, ...], float | None, bool]:
        """(compute unit, loads to drop, when to ask again, whether the unit takes every chunk left
        because no fetch can land in time) for the compute lane."""
        if p.compute_busy:
            return None, (), None, False
        a = p.done_prefix()
        if a >= p.n_chunks:
            return None, (), None, False
        if p.status[a] is ChunkStatus.PENDING:
            held = _hold(p, e, a)
            if held is not None:  # the loads land every chunk left before computing chunk a could
                return None, (), held, False
            if _last_stored(p, a) > a and _loads_too_late(p, e, a):
                # smaller units would only add a unit's fixed cost each: one unit to the end (the last
                # stored chunk is fetched aside meanwhile, `_probe_aside`)
                b, drop = _extend(p, e, a, a + 1, p.n_chunks, floors=True)
                return (a, b), drop, None, True
            # the stored chunks past the unit are the loads' to take: the unit is not grown over them
            b, drop = _extend(p, e, a, a + 1, a + self._unit_length(p, e, a))
            return *self._unit(p, e, a, b, drop, over_stored=False), False
        # the pointers met: chunk a is being fetched
        if self._loaded_below(p, a):
            return None, (), None, False  # computing it would compute the loaded units too: the fetch
        compute_s = e.compute_s(a)
        if compute_s is None:  # nothing computed or learned yet: the least computing it can take
            compute_s = e.floor_s(a)
        landing = e.landing(a)
        if compute_s is None:
            if p.lanes.can_race:  # nothing computed yet to compare with: compute it too, the first wins
                return (a, a + 1), (a,), None, False
            return None, (), None, False  # the fetch will say
        if landing is not None and landing - p.now < compute_s:
            due = landing + GRACE * compute_s  # a fetch landing right on time is not late
            if p.now < due:
                # waiting is cheaper; look again when the fetch is due if it has not landed by then
                return None, (), due, False
        b, drop = _extend(p, e, a, a + 1, a + max(self.unit, p.lanes.min_unit_chunks))
        return *self._unit(p, e, a, b, (a, *drop)), False

    def _unit(
        self, p: Progress, e: Estimates, a: int, b: int, drop: tuple[int, ...], over_stored: bool = True
    ) -> tuple[tuple[int, int], tuple[int, ...], None]:
        """The unit [a, b) dropping `drop`, or to the end of the compute lane's run where less than a
        unit would be left of it (a runt unit pays a unit's fixed cost for little work). Not
        `over_stored`: the run ends at the first stored chunk not fetched yet (a unit shortened because
        the loads are to take the chunks past it is not grown back over them)."""
        end, rest = _extend(p, e, a, b, p.n_chunks)  # how far computing goes before a fetch meets it
        if not over_stored:
            end = next((j for j in range(b, end) if p.stored[j] and p.status[j] is ChunkStatus.PENDING), end)
            rest = tuple(j for j in rest if j < end)
        if b < end < b + max(self.unit, p.lanes.min_unit_chunks):
            b, drop = end, drop + rest
        return (a, b), drop, None

    def _unit_length(self, p: Progress, e: Estimates, a: int) -> int:
        """`compute_chunks` (at least the lane's `min_unit_chunks`), or fewer near the meeting: only the
        share of the chunks left before the load pointer that computing will cover at the current speeds
        (a larger unit would compute chunks the loads reach first, and make the meeting wait for the
        whole unit). Never more, except where no fetch can land in time (`_loads_too_late`): a unit
        cannot be cut short if the compute lane slows down, so a larger one could hold the restore up
        by more than one unit, and restores sharing the compute lane take turns between units. The
        exception is the first unit of a restore that knows its costs and its link (`_planned_split`):
        the model's split, since units of two chunks each pay a unit's fixed cost again and meet loads
        that queued behind them (a unit that runs slow is overtaken by the fetches aside)."""
        unit = max(self.unit, p.lanes.min_unit_chunks)
        if not any(p.stored[j] and not p.status[j].done for j in range(a + 1, p.n_chunks)):
            return unit  # nothing left to load: compute runs alone
        rate = e.compute_rate(a)
        compute_s = e.compute_at(a, rate)
        if compute_s is None:
            # nothing computed yet: measure the lane with one unit before committing to more (the
            # smallest unit that is not launch-bound, where the lane has such a floor)
            return p.lanes.min_unit_chunks
        link = e.link()
        if link is not None and rate is None:
            planned = _planned_split(p, e, a, link)
            if planned is not None:
                return planned
        overdue = e.overdue()
        per_token = link[0] if link is not None else None if overdue is None else 2 * overdue
        if per_token is None:
            return unit
        load_ptr = _extend(p, e, a, a, p.n_chunks)[
            0
        ]  # the first fetch that lands before computing gets there
        load_s = per_token * p.chunk_tokens[a]
        share = int((load_ptr - a) * load_s / (compute_s + load_s))
        return max(1, min(unit, share))


def _planned_split(p: Progress, e: Estimates, a: int, link: tuple[float, float]) -> int | None:
    """Chunks of the first unit from chunk a, by the cost model and the link (nothing computed yet):
    the unit that ends the restore soonest, with the loads taking every chunk past it. A unit's time is
    the sum of its chunks' priors less the fixed cost they repeat (`Estimates.unit_fixed_s`:
    the unit pays it once); the loads' is the link's latency and the tokens left past the unit at
    its rate. None where the model cannot say: a chunk past a not stored, or a prior missing."""
    if not _all_loadable(p, a):
        return None
    per_token, latency = link
    fixed = e.unit_fixed_s
    unit_s, best = 0.0, None
    rest = sum(p.chunk_tokens[j] for j in range(a, p.n_chunks) if not p.status[j].done)
    for b in range(a + 1, p.n_chunks + 1):
        prior = e.prior_compute_s(b - 1)
        if prior is None or p.status[b - 1] is not ChunkStatus.PENDING:
            break
        unit_s += prior - (fixed if b > a + 1 else 0.0)
        rest -= p.chunk_tokens[b - 1]  # the tokens past the unit, left to the loads
        ends = max(unit_s, latency + per_token * rest if rest else 0.0)
        if best is None or ends < best[0]:
            best = (ends, b - a)
    return None if best is None else best[1]


def _last_stored(p: Progress, a: int) -> int:
    """The last stored chunk not done, from chunk a on (a if none is)."""
    return max((j for j in range(a, p.n_chunks) if p.stored[j] and not p.status[j].done), default=a)


def _loads_too_late(p: Progress, e: Estimates, a: int) -> bool:
    """Whether no fetch could land before computing every chunk left from chunk a would end (by the
    link's estimate and the compute estimates, else their floors): the loads cannot help this restore,
    so the compute lane takes every chunk left as one unit. The last stored chunk's fetch aside
    (`_probe_aside`) measures the link meanwhile (an estimate that is wrong is then corrected by the
    next restore, not trusted for ever)."""
    link = e.link()
    left = [j for j in range(a, p.n_chunks) if not p.status[j].done]
    rate = e.compute_rate(a)
    estimates = [e.compute_at(j, rate) for j in left]
    from_model = rate is None and None not in estimates
    if None in estimates:
        estimates = [e.floor_s(j) for j in left]
    stored = [p.chunk_tokens[j] for j in left if p.stored[j] and p.status[j] is ChunkStatus.PENDING]
    if link is None or None in estimates:
        return False
    computing_s: float = sum(estimates)  # type: ignore[arg-type]
    if from_model:  # the cost model's: every chunk left as one unit pays its fixed cost once
        computing_s -= e.unit_fixed_s * (len(left) - 1)
    per_token, latency = link
    landings = [e.landing(j, guess=True) for j in range(p.n_chunks) if p.status[j] is ChunkStatus.LOADING]
    if stored:  # a fetch issued now
        landings.append(p.now + latency + per_token * min(stored))
    known = [t for t in landings if t is not None]
    return bool(known) and min(known) >= p.now + computing_s


def _extend(
    p: Progress, e: Estimates, a: int, b: int, limit: int, floors: bool = False
) -> tuple[int, tuple[int, ...]]:
    """(end, fetches to drop) of a compute unit from chunk a, grown from [a, b) up to `limit` over
    pending chunks and over chunks whose fetch would land only after computing from a would have
    finished them (a fetch that cannot win: computing takes the chunk and the fetch is dropped, which
    also frees the link for the fetches that can). With `floors`, a chunk with no compute estimate is
    taken to need its floor (`_loads_too_late` judged so)."""
    rate = e.compute_rate(a)  # a is the done prefix: no chunk from it on is computed

    def estimate(j: int) -> float | None:
        s = e.compute_at(j, rate)
        return e.floor_s(j) if s is None and floors else s

    finish = p.now
    for j in range(a, b):
        finish += estimate(j) or 0.0
    drop: list[int] = []
    limit = min(p.n_chunks, limit)
    while b < limit:
        status = p.status[b]
        compute_s = estimate(b)
        if status is ChunkStatus.LOADING:
            landing = e.landing(b, guess=True)
            if compute_s is None or landing is None or landing <= finish + compute_s:
                break
            drop.append(b)
        elif status is not ChunkStatus.PENDING:
            break
        finish += compute_s or 0.0
        b += 1
    return b, tuple(drop)


def _hold(p: Progress, e: Estimates, a: int) -> float | None:
    """Until when the compute lane waits before chunk a, stored and next to compute (None: it computes
    now): while the loads would land every chunk left first (`_loads_first`), or, with nothing known
    of computing but its floor, while it probes a link it knows nothing of (`_probe`)."""
    if not _all_loadable(p, a):
        return None  # chunks only computing can restore: the lane has work regardless
    estimate = e.compute_s(a)
    compute_s = estimate if estimate is not None else e.floor_s(a)
    held = _loads_first(p, e, compute_s)
    if held is None and estimate is None:
        held = _probe(p, e, a)
    return held


def _loads_first(p: Progress, e: Estimates, compute_s: float | None) -> float | None:
    """When the loads would have landed every stored chunk left, if that comes before computing the
    next chunk (`compute_s`: its estimate, else its floor) would end, else None. The compute lane then
    waits until that time instead of taking CPU, GIL or link time from the loads, and is asked again."""
    link = e.link()
    if link is None or compute_s is None:
        return None
    per_token, latency = link
    left = sum(
        n
        for j, n in enumerate(p.chunk_tokens)
        if p.stored[j] and p.status[j] in (ChunkStatus.PENDING, ChunkStatus.LOADING)
    )
    done = p.now + latency + left * per_token
    return done + GRACE * compute_s if done < p.now + compute_s else None


def _all_loadable(p: Progress, a: int) -> bool:
    """Chunk a and every chunk not yet done are stored."""
    return p.stored[a] and all(p.stored[j] or p.status[j].done for j in range(p.n_chunks))


def _probe(p: Progress, e: Estimates, a: int) -> float | None:
    """Before anything is known of the link (no prior, fewer than two fetches landed: one fetch's own
    time ignores the lanes beside it; no rate from bytes seen arriving, `Estimates.arrival_rate`): the compute
    lane waits for two fetches to land, or for the store's arrivals to give a rate, so that
    `_loads_first` and `_loads_too_late` can judge, but no longer than `PROBE_SHARE` of the floor of
    computing every chunk left (the most a restore whose loads turn out useless loses). Returns until
    when, or None."""
    if e.prior_link is not None or e.landed_count() >= min(2, sum(p.stored)) or e.arrival_rate() is not None:
        return None
    floors = [e.floor_s(j) for j in range(a, p.n_chunks) if not p.status[j].done]
    if None in floors:
        return None
    until = PROBE_SHARE * sum(floors)  # type: ignore[arg-type]
    if p.now >= until:
        return None
    # a store that shows its bytes arriving is looked at after an eighth of the wait, then at twice
    # the time each time: two looks while bytes arrive give its rate, and end the wait
    return min(until, max(2 * p.now, until / 8)) if e.sees_arrivals() else until


def _overtake(
    p: Progress,
    e: Estimates,
    free: int,
    starting: tuple[int, int] | None = None,
    loading: tuple[int, ...] = (),
) -> tuple[int, ...]:
    """Chunks of the compute unit running in place (or `starting` now, beside the fetches `loading`)
    to fetch aside on `free` idle load lanes (`Decision.overtake`), back to front: when they are all
    stored and would land before the unit ends (or nothing says when either happens: the lanes are
    idle anyway)."""
    unit = (starting or p.computing()) if p.lanes.can_overtake and free > 0 else None
    if unit is None:
        return ()
    a, b = unit
    started = p.now if starting else p.running.started
    todo = [j for j in range(b - 1, a - 1, -1) if j not in p.running.aside]
    if not todo or not all(p.stored[j] for j in range(a, b)):
        return ()
    link = e.link()
    if link is None:  # nothing known of the link but what the fetches in flight have not delivered yet
        overdue = e.overdue()
        link = None if overdue is None else (overdue, 0.0)
    estimates = [e.compute_s(j) for j in range(a, b)]
    if link is not None and started is not None and None not in estimates:
        per_token, latency = link
        in_flight = sum(
            p.chunk_tokens[j] for j in range(p.n_chunks) if p.status[j] is ChunkStatus.LOADING or j in loading
        ) + sum(p.chunk_tokens[j] for j, landed in p.running.aside.items() if not landed)
        landing = p.now + latency + (in_flight + sum(p.chunk_tokens[j] for j in todo)) * per_token
        if landing >= started + sum(estimates):  # type: ignore[arg-type]
            return ()
    return tuple(todo[:free])


def _probe_aside(p: Progress, free: int, starting: tuple[int, int] | None) -> tuple[int, ...]:
    """The last stored chunk of a unit `starting` now that takes every chunk left because no fetch can
    land in time (`_loads_too_late`), fetched aside: it cannot stop the unit, but it is the one fetch
    this restore still makes, so its landing (or its time in flight without landing) keeps what the
    restorer knows of the link current for the next restore."""
    if starting is None or not p.lanes.can_overtake or free < 1 or starting[1] != p.n_chunks:
        return ()
    last = _last_stored(p, starting[0])
    return (last,) if p.stored[last] and last not in p.running.aside else ()
