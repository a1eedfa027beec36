"""The work queue between kopf's watch events and the reconciler: level-triggered, coalescing, with backoff.

Any number of events for one parent while a pass runs become one more pass; at most one pass per parent runs
at a time, and `concurrency` passes overall. A pass that fails is retried after 1 s, 2 s, 4 s ... up to 5 min
(kopf does not retry event handlers, and its own retrying handlers would write their progress into every
parent), and never sooner than the API server asked (a 429's or 503's Retry-After, which an event for the
parent waits for too, while it ends the queue's own backoff); a pass that returns a delay is run again after it
unless an event comes first.

Failures are logged without flooding: the first failure of each kind (an API status and reason, or an
exception type) is logged at once; more of that kind within FAULT_LOG_WINDOW seconds are counted, and the
next line of that kind after the window says how many there were and for how many parents (or, when none comes,
a line of its own once the window has passed: `FaultLog.flush`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable

from tscommon.aio import wait_event
from tscommon.redact import redact

log = logging.getLogger("controller")

FAULT_LOG_WINDOW = 60.0


def fault_kind(e: BaseException) -> str:
    """What a failure is, for grouping log lines: "HTTP 429 TooManyRequests", "ProviderError", ..."""
    status = getattr(e, "status", 0)
    if status:
        return f"HTTP {status} {getattr(e, 'reason', '') or ''}".strip()
    return type(e).__name__


class FaultLog:
    """One log line per kind of failure per window, with the count of those not logged."""

    def __init__(self, window: float = FAULT_LOG_WINDOW, clock: Callable[[], float] | None = None) -> None:
        self.window = window
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, tuple[int, set[Hashable]]] = {}
        self._latest: dict[str, float] = {}         # kind -> when the last one held came

    def failed(self, key: Hashable, attempt: int, after: float, e: BaseException) -> None:
        now = self._clock() if self._clock is not None else asyncio.get_running_loop().time()
        kind = fault_kind(e)
        last = self._last.get(kind)
        if last is not None and now - last < self.window:
            n, keys = self._held.get(kind, (0, set()))
            keys.add(key)
            self._held[kind] = (n + 1, keys)
            self._latest[kind] = now
            return
        self._last[kind] = now
        n, keys = self._held.pop(kind, (0, set()))
        more = (f" ({n} more {kind} failure(s) of {len(keys)} parent(s) in the last {self.window:.0f}s not "
                "logged)") if n else ""
        log.warning("reconcile %s failed (attempt %d, retry in %.0fs): %s%s", key, attempt, after,
                    redact(str(e) or type(e).__name__), more)

    def flush(self) -> None:
        """Say the counts held for a window that has passed with no line of their kind to carry them (the
        failures stopped): without this the last minute of an outage would never be counted in the log. Only a
        kind quiet for a quarter of the window: while it keeps failing, its next line carries the count."""
        now = self._clock() if self._clock is not None else asyncio.get_running_loop().time()
        for kind in [k for k in self._held if now - self._last.get(k, now) >= self.window
                     and now - self._latest.get(k, now) >= self.window / 4]:
            n, keys = self._held.pop(kind)
            # the kind first and no ": <number> " after it: a reader (and logfold.line_kind, which would take
            # such a number for an HTTP status) tells one kind's count from another's
            log.warning("%s: not logged in the last %.0fs, %d more reconcile failure(s) of %d parent(s)", kind,
                        self.window, n, len(keys))


#: Passes running at once. A pass mostly waits for the API server (a new Service's nine requests go one after
#: another), so this bounds the load a burst puts on it, not the controller's CPU: with 16, 500 new Services
#: went through at about 25 passes a second whatever the cores could do (docs/benchmarks.md).
CONCURRENCY = 64


class WorkQueue:
    def __init__(self, work: Callable[[Hashable], Awaitable[float | None]], *, concurrency: int = CONCURRENCY,
                 base_delay: float = 1.0, max_delay: float = 300.0) -> None:
        self._work = work
        self._sem = asyncio.Semaphore(concurrency)
        self._base, self._max = base_delay, max_delay
        self._pokes: dict[Hashable, asyncio.Event] = {}
        self._tasks: dict[Hashable, asyncio.Task] = {}
        self.failures: dict[Hashable, int] = {}
        self.fault_log = FaultLog()

    def poke(self, key: Hashable) -> None:
        """Something about `key` changed: make sure a pass runs after now."""
        ev = self._pokes.setdefault(key, asyncio.Event())
        ev.set()
        if key not in self._tasks or self._tasks[key].done():
            self._tasks[key] = asyncio.get_running_loop().create_task(self._worker(key), name=f"reconcile {key}")

    async def _worker(self, key: Hashable) -> None:
        ev = self._pokes[key]
        loop = asyncio.get_running_loop()
        while True:
            ev.clear()
            not_before = 0.0
            try:
                async with self._sem:
                    after = await self._work(key)
                self.failures.pop(key, None)
                # OPERATOR_LOGGING=debug: one line per pass, what upstream's debug level shows per reconcile
                log.debug("reconciled %s; next check %s", key, "on change" if after is None else f"in {after:.0f}s")
            except asyncio.CancelledError:
                raise
            except Exception as e:   # any failure: retried with backoff, the loop survives
                n = self.failures[key] = self.failures.get(key, 0) + 1
                after = min(self._max, self._base * 2 ** (n - 1))
                # The server said when to come back: never sooner (its own ceiling, not ours, applies).
                server = getattr(e, "retry_after", None) or 0.0
                after = max(after, server)
                not_before = loop.time() + server
                self.fault_log.failed(key, n, after, e)
            if after is None:
                if not ev.is_set():
                    self._tasks.pop(key, None)
                    self._pokes.pop(key, None)
                    return
                continue
            await wait_event(ev, after)
            # An event ends our own backoff early (something changed: try now), but not the server's
            # Retry-After: an event arriving meanwhile waits for it too.
            if (rest := not_before - loop.time()) > 0:
                await asyncio.sleep(rest)


    def retry_now(self) -> None:
        """Run every waiting key now and start its backoff over (the API server answers again: the passes that
        failed or waited while it was gone need not wait out a backoff of up to 5 minutes)."""
        self.failures.clear()
        for key, task in self._tasks.items():
            if not task.done():
                self._pokes[key].set()

    async def aclose(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
