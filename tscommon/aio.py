"""Small asyncio helpers that behave the same on every supported Python."""
from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until `event` is set or `timeout` seconds pass; True if it was set.

    Uses asyncio.timeout rather than asyncio.wait_for: on Python 3.11, wait_for drops a cancellation that
    arrives just as the awaited event completes, so a loop built on it could outlive the task cancelling it
    (shutdown then waits forever). asyncio.timeout lets the cancellation through."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True
