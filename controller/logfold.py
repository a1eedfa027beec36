"""Repeated log lines folded: one line per kind per window, the next one saying how many were held back.

kopf logs every failed attempt of every watch at ERROR ("Request attempt #3 failed; will retry: ..."): with the
API server gone, a dozen watches make a dozen lines every few seconds, for as long as the outage lasts. The
filter lets the first line of a kind through, holds the others back for `window` seconds, and the next line let
through says how many there were (the work queue's `FaultLog` does the same for failed passes).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable


def kopf_retry_kind(record: logging.LogRecord) -> str | None:
    """kopf's per-attempt request failures are one kind; every other line is let through."""
    if record.name.startswith("kopf") and str(record.msg).startswith("Request attempt"):
        return "kopf request retry"
    return None


class FoldRepeats(logging.Filter):
    def __init__(self, kind: Callable[[logging.LogRecord], str | None] = kopf_retry_kind, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.kind, self.window, self.clock = kind, window, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        k = self.kind(record)
        if k is None:
            return True
        now = self.clock()
        last = self._last.get(k)
        if last is not None and now - last < self.window:
            self._held[k] = self._held.get(k, 0) + 1
            return False
        self._last[k] = now
        n = self._held.pop(k, 0)
        if n:
            record.msg = f"{record.getMessage()} ({n} more like it in the last {self.window:.0f}s not logged)"
            record.args = ()
        return True


def install(logger: logging.Logger | None = None, **kw) -> FoldRepeats:
    """Fold on every handler of `logger` (the root logger by default): records of child loggers reach them."""
    f = FoldRepeats(**kw)
    for h in (logger or logging.getLogger()).handlers:
        h.addFilter(f)
    return f
