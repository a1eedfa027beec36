"""kopf's warning and error lines, folded: one line per kind per window, the next one says how many were held.

kopf logs every failed API request it retries ("Request attempt #1/9 failed; will retry: GET ... ->
APIServerError(...)"), one line each: against an API server that answers 500s and 429s, or drops watch streams,
that is a line for every watch restart of every watched kind, many a minute, all alike. The reconciler's own
failures are folded the same way by `controller.queue.FaultLog`; this does it for the lines of kopf's loggers,
as a filter on the handler, so nothing in kopf changes.

A kind is the logger and the exception named in the line (its class, e.g. ``APIServerError``), else the line
with its numbers taken out. Lines below WARNING pass untouched.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from .queue import FAULT_LOG_WINDOW

_EXC = re.compile(r"-> ([A-Za-z_][A-Za-z0-9_]*)\(")
_NUMBERS = re.compile(r"\d+")


def line_kind(record: logging.LogRecord) -> str:
    msg = record.getMessage()
    m = _EXC.search(msg)
    what = m.group(1) if m else _NUMBERS.sub("#", msg.split(":", 1)[0])[:80]
    return f"{record.name} {what}"


class FoldRepeats(logging.Filter):
    """Passes the first WARNING-or-worse line of each kind, holds the others for `window` seconds, and adds the
    count held to the next line of that kind. Only for loggers under `prefix`."""

    def __init__(self, prefix: str = "kopf", window: float = FAULT_LOG_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.prefix, self.window, self.clock = prefix, window, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not (record.name == self.prefix or
                                                    record.name.startswith(self.prefix + ".")):
            return True
        kind = line_kind(record)
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.window:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        self._last[kind] = now
        n = self._held.pop(kind, 0)
        if n:
            record.msg = (f"{record.getMessage()} ({n} more like this in the last {self.window:.0f}s not logged)")
            record.args = ()
        return True


def install(handlers: list[logging.Handler] | None = None) -> FoldRepeats:
    """Fold kopf's lines on every handler of the root logger (those `logging.basicConfig` made)."""
    f = FoldRepeats()
    for h in handlers if handlers is not None else logging.getLogger().handlers:
        h.addFilter(f)
    return f
