"""kopf's warning and error lines (and the leader election's), folded: one line per kind per window, the next
one says how many were held.

kopf logs every failed API request it retries ("Request attempt #1/9 failed; will retry: GET ... ->
APIServerError(...)"), one line each: against an API server that answers 500s and 429s, or drops watch streams,
that is a line for every watch restart of every watched kind, many a minute, all alike. The reconciler's own
failures are folded the same way by `controller.queue.FaultLog`; this does it for the lines of kopf's loggers
and of the leader election's failed renewals (each is retried 2 s later), as a filter on the handler, so
nothing in kopf changes. A lost leadership is its own kind and always said.

A kind is the logger and the exception named in the line (its class, e.g. ``APIServerError``), else the line
with its numbers taken out. Lines below WARNING pass untouched. A count held when the failures stop is said by
`flush_all`, which the controller calls every few seconds.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from .queue import FAULT_LOG_WINDOW

log = logging.getLogger("controller.logfold")

#: kopf's loggers, and the leader election's (a failed renewal is retried every 2 s: a line each, else)
FOLDED = ("kopf", "controller.leader")

_EXC = re.compile(r"-> ([A-Za-z_][A-Za-z0-9_]*)\(")
_STATUS = re.compile(r": ([1-5]\d\d) ")
_NUMBERS = re.compile(r"\d+")


def line_kind(record: logging.LogRecord) -> str:
    """The logger and what failed: the exception's class in kopf's lines, the HTTP status in the controller's
    (``GET /api/...: 500 etcdserver: ...``), else the line's first part without its numbers."""
    msg = record.getMessage()
    m = _EXC.search(msg)
    s = _STATUS.search(msg)
    what = m.group(1) if m else f"HTTP {s.group(1)}" if s else _NUMBERS.sub("#", msg.split(":", 1)[0])[:80]
    return f"{record.name} {what}"


class FoldRepeats(logging.Filter):
    """Passes the first WARNING-or-worse line of each kind, holds the others for `window` seconds, and adds the
    count held to the next line of that kind (or, when none comes, `flush` says it once the window has passed).
    Only for the loggers named in `prefixes` and their children."""

    def __init__(self, prefixes: tuple[str, ...] = FOLDED, window: float = FAULT_LOG_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.prefixes, self.window, self.clock = prefixes, window, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._latest: dict[str, float] = {}         # kind -> when the last one held came

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not any(
                record.name == p or record.name.startswith(p + ".") for p in self.prefixes):
            return True
        kind = line_kind(record)
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.window:
            self._held[kind] = self._held.get(kind, 0) + 1
            self._latest[kind] = now
            return False
        self._last[kind] = now
        n = self._held.pop(kind, 0)
        if n:
            record.msg = (f"{record.getMessage()} ({n} more like this in the last {self.window:.0f}s not logged)")
            record.args = ()
        return True

    def flush(self) -> None:
        """Say the counts held for a window that has passed with no line of their kind to carry them (the
        failures stopped), as a line of this module's logger (not folded itself). Only a kind quiet for a
        quarter of the window: while it keeps failing, its next line carries the count."""
        now = self.clock()
        for kind in [k for k in self._held if now - self._last.get(k, now) >= self.window
                     and now - self._latest.get(k, now) >= self.window / 4]:
            n = self._held.pop(kind)
            log.warning("%s: not logged in the last %.0fs, %d more like this", kind, self.window, n)


def flush_all(handlers: list[logging.Handler] | None = None) -> None:
    """`FoldRepeats.flush` of every filter `install` put on the root logger's handlers (each filter once)."""
    seen: set[int] = set()
    for h in handlers if handlers is not None else logging.getLogger().handlers:
        for f in h.filters:
            if isinstance(f, FoldRepeats) and id(f) not in seen:
                seen.add(id(f))
                f.flush()


def install(handlers: list[logging.Handler] | None = None) -> FoldRepeats:
    """Fold kopf's lines on every handler of the root logger (those `logging.basicConfig` made)."""
    f = FoldRepeats()
    for h in handlers if handlers is not None else logging.getLogger().handlers:
        h.addFilter(f)
    return f
