"""controller.kopfready: a listed object's handlers run as soon as kopf has indexed it (kopf's own watcher holds
every listed object until all the operator's indexes are filled), and the watch cache is complete only once every
watched kind's first listing has ended and every object of it has been indexed (it counts them)."""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import kopf
import pytest
from kopf._cogs.aiokits import aiotoggles
from kopf._cogs.clients import fetching, watching
from kopf._core.reactor import queueing

from controller import kopfready
from controller.watchcache import CHILDREN, PARENTS, WATCHED, WatchCache
from tests.support import kopfloop


@pytest.mark.parametrize("patched", [False, True], ids=["kopf", "kopfready"])
async def test_a_listed_object_is_handled_once_indexed_without_waiting_for_other_kinds(monkeypatch, patched):
    def sts(name: str) -> dict:
        return {"metadata": {"name": name, "namespace": "tailscale", "uid": f"u-{name}", "resourceVersion": "1"}}

    async def fetch_objs(**_):
        yield [sts("a"), sts("b")], "5"

    async def watch_objs(**_):
        await asyncio.Event().wait()      # the watch after the listing stays open
        yield {}

    monkeypatch.setattr(fetching, "fetch_objs", fetch_objs)
    monkeypatch.setattr(watching, "watch_objs", watch_objs)
    registry, handled, indexed = kopf.OperatorRegistry(), [], asyncio.Event()

    @kopf.on.event("apps", "v1", "statefulsets", registry=registry)
    async def on_event(body, **_):
        handled.append(body["metadata"]["name"])

    @kopf.index("apps", "v1", "statefulsets", id="names", registry=registry)
    async def names(body, **_):
        if body["metadata"]["name"] == "b":
            indexed.set()
        return {"name": body["metadata"]["name"]}

    settings = kopf.OperatorSettings()
    resource = kopf.Resource("apps", "v1", "statefulsets")
    processor, _ = kopfloop.processor(registry, settings, resource)
    # as kopf's orchestrator starts a watcher: the operator's set holds a toggle for each indexed kind, and
    # another kind's (the Secrets', say) is still listing
    operator_indexed = aiotoggles.ToggleSet(all)
    other_kind = await operator_indexed.make_toggle(name="secrets")
    this_kind = await operator_indexed.make_toggle(name="statefulsets")
    run = kopfready.watcher if patched else queueing.watcher
    task = asyncio.create_task(run(namespace="tailscale", settings=settings, resource=resource,
                                   processor=processor, operator_indexed=operator_indexed,
                                   resource_indexed=this_kind))
    try:
        await asyncio.wait_for(indexed.wait(), 10)
        for _ in range(20):
            await asyncio.sleep(0)      # not a wait: turns of the loop in which the handlers would run
        if patched:
            assert sorted(handled) == ["a", "b"]
        else:
            # kopf: both indexed, neither handled until the other kind's listing is indexed too
            assert handled == []
            await operator_indexed.drop_toggle(other_kind)
            for _ in range(20):
                await asyncio.sleep(0)      # not a wait: turns of the loop in which the handlers run
            assert sorted(handled) == ["a", "b"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_cache_is_complete_once_every_kind_is_listed_and_indexed():
    cache = WatchCache("tailscale", count_listings=True)
    kinds = sorted({w.res.plural for w in WATCHED if w.operator == PARENTS})
    objs = {plural: [{"n": i} for i in range(3)] for plural in kinds}
    # a handler ran (it does after the first object indexed): that alone no longer says the indexes are filled
    cache.attach(PARENTS, {})
    for plural in kinds:
        for o in objs[plural]:
            cache.listed(plural, o)
    assert PARENTS not in cache.synced_ops
    for plural in kinds:
        cache.listing_ended(plural)
        for o in objs[plural][:2]:
            cache.indexed(plural, o)
    assert PARENTS not in cache.synced_ops      # one object of each kind is not indexed yet
    for plural in kinds[:-1]:
        cache.indexed(plural, objs[plural][2])
    assert PARENTS not in cache.synced_ops
    cache.indexed(kinds[-1], objs[kinds[-1]][2])
    assert PARENTS in cache.synced_ops and CHILDREN not in cache.synced_ops


async def test_a_kind_listed_empty_is_complete_at_its_end_and_a_late_handler_attaches():
    cache = WatchCache("tailscale", count_listings=True)
    kinds = {w.res.plural for w in WATCHED if w.operator == CHILDREN}
    for plural in kinds:
        cache.listing_ended(plural)
    assert CHILDREN not in cache.synced_ops      # the indexes are not handed over yet (no handler ran)
    cache.attach(CHILDREN, {})
    assert CHILDREN in cache.synced_ops
    waiting = asyncio.create_task(cache.wait_synced(timeout=10))
    cache.attach(PARENTS, {})
    for plural in {w.res.plural for w in WATCHED if w.operator == PARENTS}:
        cache.listing_ended(plural)
    await asyncio.wait_for(waiting, 10)


async def test_an_index_handed_over_before_its_listings_are_indexed_is_not_read():
    from kopf._core.engines.indexing import OperatorIndexer

    from controller.kubeapi import PROXYCLASSES
    from controller.watchcache import index_entries
    cache = WatchCache("tailscale", count_listings=True)
    idx = OperatorIndexer()
    idx.replace((None, "a", "u-a"), index_entries({"metadata": {"name": "a", "uid": "u-a", "resourceVersion": "1"}}))
    w = next(w for w in WATCHED if w.res == PROXYCLASSES)
    cache.attach(PARENTS, {w.index_id: idx.index})
    # a pass that has waited past SYNC_TIMEOUT reads the API server, not a partial index
    assert cache.watched(PROXYCLASSES, "") is None and cache.names(PROXYCLASSES) == []
    for plural in {w.res.plural for w in WATCHED if w.operator == PARENTS}:
        cache.listing_ended(plural)
    assert cache.watched(PROXYCLASSES, "") == w and cache.names(PROXYCLASSES) == ["a"]
