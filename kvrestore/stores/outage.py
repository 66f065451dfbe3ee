"""Outage: what a store over a network knows of its server being reachable, shared by every such store.

A store whose server cannot be reached (connection refused, reset, timed out) would otherwise pay a
connection attempt, and its client library's retries, for every chunk of every restore while the server
is down. After such a failure the store instead fails fast for `cooloff_s` seconds (a `StoreError` at
once, no request), then asks again; the first call that reaches the server ends the outage, so a server
that comes back is used again by the same process without a restart.

Each failure is counted (`failures`: calls that failed, those refused during a cool-off included;
`outages`: times the server went from reachable to unreachable) and logged once: one warning when an
outage begins (with its cause), one line when the server answers again; errors the server itself answered
(out of memory, a wrong password) are logged once per kind until a call succeeds.
"""

from __future__ import annotations

import logging
import time

from kvrestore.core.errors import StoreError
from kvrestore.core.settings import check_number

log = logging.getLogger("kvrestore.stores")

#: seconds a store fails fast after its server could not be reached
COOLOFF_S = 2.0


class Outage:
    """Reachability of one store's server (see the module docstring). `name` names the store in messages."""

    def __init__(self, name: str, cooloff_s: float = COOLOFF_S) -> None:
        self.name = name
        self.cooloff_s = check_number("unreachable_cooloff_s", cooloff_s, 0, finite=True)
        self.failures = 0  # calls that failed, whatever the cause
        self.outages = 0  # times the server became unreachable
        self._down_until = 0.0  # monotonic time before which calls fail fast
        self._down = False  # within an outage (until a call reaches the server)
        self._reason = ""
        self._logged: set[str] = set()  # kinds of answered errors logged since the last success

    @property
    def down(self) -> bool:
        """Whether calls fail fast now."""
        return time.monotonic() < self._down_until

    @property
    def retry_in(self) -> float:
        """Seconds until calls reach the server again (0: they do now)."""
        return max(0.0, self._down_until - time.monotonic())

    def check(self) -> None:
        """StoreError at once while the store fails fast (counted as a failure, not logged again)."""
        if self.down:
            self.failures += 1
            raise StoreError(
                f"{self.name} is unreachable ({self._reason}); asking again in "
                f"{self._down_until - time.monotonic():.1f} s"
            )

    def unreachable(self, exc: BaseException) -> None:
        """A call could not reach the server: fail fast for `cooloff_s`; a warning when an outage begins."""
        self.failures += 1
        self._reason = f"{type(exc).__name__}: {exc}"
        self._down_until = time.monotonic() + self.cooloff_s
        if not self._down:
            self._down = True
            self.outages += 1
            log.warning(
                "%s is unreachable (%s): its calls fail at once for %.1f s at a time until it answers",
                self.name,
                self._reason,
                self.cooloff_s,
            )

    def refused(self, exc: BaseException) -> None:
        """The server answered with an error: counted, and logged once per kind until a call succeeds."""
        self.failures += 1
        kind = type(exc).__name__
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s refused a call (%s: %s)", self.name, kind, exc)

    def answered(self) -> None:
        """A call reached the server: any outage is over."""
        if self._down:
            self._down = False
            log.warning("%s answers again after %s", self.name, self._reason)
        self._down_until = 0.0
        self._logged.clear()


__all__ = ["COOLOFF_S", "Outage"]
