"""Waiting for an event in the unit tests, instead of sleeping a fixed time (tests/support/sleepcheck.py).

`until` (threads, subprocesses) and `until_async` (inside the event loop) re-check a condition until it holds
and fail with what was awaited when it never does; the timeout is a bound for a broken system, never a figure
a passing run depends on. The netns tests use `labtools.lab.wait_until`, the same for the lab.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


def until(pred: Callable[[], Any], timeout: float = 15.0, what: str = "", interval: float = 0.05) -> Any:
    """Re-check `pred` until it returns something truthy (returned); AssertionError naming `what` after `timeout`."""
    end = time.monotonic() + timeout
    while not (v := pred()):
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}")
        time.sleep(interval)   # poll: spaces the checks of `pred` until its deadline
    return v


async def until_async(pred: Callable[[], Any | Awaitable[Any]], timeout: float = 10.0, what: str = "",
                      interval: float = 0.01) -> Any:
    """`until` inside the event loop: `pred` may be a coroutine function; the loop runs between checks."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        if time.monotonic() >= end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}")
        await asyncio.sleep(interval)   # poll: lets the code under test run between the checks of `pred`


class WatchedEvent(asyncio.Event):
    """An asyncio.Event that counts the waits begun on it. A "nothing happens before the event" check waits
    for `waits` first: the code under test has then run up to its wait point (it had its chance to go too far)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    async def wait(self) -> bool:   # type: ignore[override]
        self.waits += 1
        return await super().wait()
