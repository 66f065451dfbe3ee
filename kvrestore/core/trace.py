"""Per-unit events of a restore and the summary built from them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TraceEvent:
    """One unit of work: a compute of chunks [first, last] or a load of one chunk."""

    kind: str  # "compute" | "load" | "load-failed" | "load-dropped" | "compute-dropped" (lost a race)
    first_chunk: int
    last_chunk: int
    start_s: float  # seconds since the restore began
    end_s: float
    nbytes: int = 0
    error: str | None = None
    #: a compute unit stopped part-way ("compute-overtaken"): the decoder layers it had run over all its
    #: tokens, and the seconds they took (what the cost model learns from a unit that never finished)
    partial: tuple[int, float] | None = None

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Trace:
    events: list[TraceEvent] = field(default_factory=list)

    def add(self, event: TraceEvent) -> None:
        self.events.append(event)

    def of_kind(self, kind: str) -> list[TraceEvent]:
        return [e for e in self.events if e.kind == kind]

    def chunks(self, *kinds: str) -> list[int]:
        """The chunks (or layers) the events of `kinds` cover, in event order."""
        return [j for e in self.events if e.kind in kinds for j in range(e.first_chunk, e.last_chunk + 1)]

    def computed(self) -> list[int]:
        """The chunks whose computed KV was applied."""
        return self.chunks("compute")

    def bytes_loaded(self) -> int:
        """Bytes of the loads whose KV was applied (a dropped or failed load's, and a fetch aside's whose
        unit computed first, are not)."""
        return sum(e.nbytes for e in self.events if e.kind in ("load", "compute-overtaken"))

    def loaded(self) -> list[int]:
        """The chunks whose loaded KV was applied: fetched in place, or aside by fetches that overtook
        the compute unit holding them ("compute-overtaken")."""
        return self.chunks("load", "compute-overtaken")

    def table(self) -> str:
        """A plain-text table, one row per unit, in start order."""
        rows = ["  kind         chunks      start_s    end_s    MB"]
        for e in sorted(self.events, key=lambda e: e.start_s):
            chunks = (
                f"{e.first_chunk}" if e.first_chunk == e.last_chunk else f"{e.first_chunk}-{e.last_chunk}"
            )
            rows.append(
                f"  {e.kind:<12} {chunks:<10} {e.start_s:8.3f} {e.end_s:8.3f} {e.nbytes / 1e6:6.2f}"
                + (f"  ({e.error})" if e.error else "")
            )
        return "\n".join(rows)
