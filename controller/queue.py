"""The work queue between kopf's watch events and the reconciler: level-triggered, coalescing, with backoff.

Any number of events for one parent while a pass runs become one more pass; at most one pass per parent runs
at a time, and `concurrency` passes overall. A pass that fails is retried after 1 s, 2 s, 4 s ... up to 5 min
(kopf does not retry event handlers, and its own retrying handlers would write their progress into every
parent); a pass that returns a delay is run again after it unless an event comes first.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable

from tscommon.aio import wait_event
from tscommon.redact import redact

log = logging.getLogger("controller")


class WorkQueue:
    def __init__(self, work: Callable[[Hashable], Awaitable[float | None]], *, concurrency: int = 16,
                 base_delay: float = 1.0, max_delay: float = 300.0) -> None:
        self._work = work
        self._sem = asyncio.Semaphore(concurrency)
        self._base, self._max = base_delay, max_delay
        self._pokes: dict[Hashable, asyncio.Event] = {}
        self._tasks: dict[Hashable, asyncio.Task] = {}
        self.failures: dict[Hashable, int] = {}

    def poke(self, key: Hashable) -> None:
        """Something about `key` changed: make sure a pass runs after now."""
        ev = self._pokes.setdefault(key, asyncio.Event())
        ev.set()
        if key not in self._tasks or self._tasks[key].done():
            self._tasks[key] = asyncio.get_running_loop().create_task(self._worker(key), name=f"reconcile {key}")

    async def _worker(self, key: Hashable) -> None:
        ev = self._pokes[key]
        while True:
            ev.clear()
            try:
                async with self._sem:
                    after = await self._work(key)
                self.failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # any failure: retried with backoff, the loop survives
                n = self.failures[key] = self.failures.get(key, 0) + 1
                after = min(self._max, self._base * 2 ** (n - 1))
                log.warning("reconcile %s failed (attempt %d, retry in %.0fs): %s", key, n, after,
                            redact(str(e) or type(e).__name__))
            if after is None:
                if not ev.is_set():
                    self._tasks.pop(key, None)
                    self._pokes.pop(key, None)
                    return
                continue
            await wait_event(ev, after)


    async def aclose(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
