"""controller.kopfready: kopf's wait for its indexes releases every waiting object once the last one is indexed,
none before, with work in proportion to the objects listed (kopf's own set woke every waiter at each drop)."""
from __future__ import annotations

import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import pytest
from kopf._cogs.aiokits.aiotoggles import ToggleSet

from controller import kopfready


@pytest.fixture(params=[False, True], ids=["kopf", "patched"])
def patched(request, monkeypatch):
    if request.param:
        for name in ("make_toggle", "drop_toggle", "drop_toggles"):
            monkeypatch.setattr(ToggleSet, name, getattr(kopfready, name))
    return request.param


async def _index_all(n: int) -> tuple[int, list[int]]:
    """n listed objects, as kopf's workers handle them: each indexed, its toggle dropped, then a wait for every
    other; returns how often the set's state was computed, and how many toggles were left when each waiter went."""
    calls = 0

    def every(states) -> bool:
        nonlocal calls
        calls += 1
        return all(states)
    indexed = ToggleSet(every)
    blocker = await indexed.make_toggle(name="orchestration blocker")
    toggles = [await indexed.make_toggle(name=f"object {i}") for i in range(n)]
    left_when_released: list[int] = []

    async def worker(i: int, t) -> None:
        for _ in range(i):
            await asyncio.sleep(0)      # not a wait: one turn of the loop per object, indexed one after the other
        await indexed.drop_toggle(t)
        await indexed.wait_for(True)
        left_when_released.append(len(indexed))
    calls = 0
    tasks = [asyncio.create_task(worker(i, t)) for i, t in enumerate(toggles)]
    for _ in range(n + 5):
        await asyncio.sleep(0)          # not a wait: the turns of the loop in which every object is indexed
    assert left_when_released == []           # the listing is not over: nobody goes
    await indexed.drop_toggle(blocker)
    await asyncio.gather(*tasks)
    return calls, left_when_released


async def test_every_object_waits_for_the_last_one_and_then_goes(patched):
    calls, left = await _index_all(300)
    assert left == [0] * 300


async def test_the_wait_costs_in_proportion_to_the_objects():
    # kopf's set: each drop wakes every waiter so far (about n²/2 state checks); patched: a few per object
    for name in ("make_toggle", "drop_toggle", "drop_toggles"):
        assert getattr(ToggleSet, name) is not getattr(kopfready, name)
    kopf_calls, _ = await _index_all(300)
    saved = {name: getattr(ToggleSet, name) for name in ("make_toggle", "drop_toggle", "drop_toggles")}
    kopfready.install()
    try:
        calls, _ = await _index_all(300)
    finally:
        for name, f in saved.items():
            setattr(ToggleSet, name, f)
    assert kopf_calls > 300 * 300 / 4
    assert calls < 300 * 5


async def test_a_set_turned_off_by_a_new_toggle_wakes_its_waiters(patched):
    s = ToggleSet(all)          # empty: on
    waiter = asyncio.create_task(s.wait_for(False))
    await asyncio.sleep(0)      # not a wait: one turn of the loop parks the waiter on the set
    assert not waiter.done()
    t = await s.make_toggle(False)
    await asyncio.wait_for(waiter, 1)
    await s.drop_toggles([t])
    assert s.is_on()
