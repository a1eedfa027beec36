"""tscommon.aio.wait_event: a timed wait on an event that never swallows a cancellation."""
from __future__ import annotations

import asyncio

import pytest

from tscommon.aio import wait_event


async def test_returns_whether_the_event_was_set():
    ev = asyncio.Event()
    assert await wait_event(ev, 0.01) is False
    ev.set()
    assert await wait_event(ev, 10) is True


async def test_a_cancellation_arriving_with_the_event_is_not_lost():
    """The event is set and the task cancelled in the same loop iteration. asyncio.wait_for on Python 3.11
    returns normally here (the cancellation is dropped), so a watch loop built on it never ends."""
    ev = asyncio.Event()
    after: list[str] = []

    async def loop_body():
        await wait_event(ev, 10)
        after.append("ran on after cancel")

    task = asyncio.create_task(loop_body())
    await asyncio.sleep(0)   # not a wait: one turn of the loop parks the task on the event
    ev.set()                        # the wait is completing...
    task.cancel()                   # ...and the cancellation arrives before the task has run again
    with pytest.raises(asyncio.CancelledError):
        await task
    assert after == []
