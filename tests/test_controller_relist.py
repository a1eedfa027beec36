"""controller.relist: an object deleted while a watch was away leaves the watch cache when kopf lists again.

kopf's own stream (`kopf._cogs.clients.watching.infinite_watch`, with the controller's wrapper installed) runs over
a stand-in for the API server: a listing, a watch the API server ends with 410 Gone (its resourceVersion expired
during a partition), then a listing afresh. The events it yields are applied to the real kopf index as kopf applies
them (`index_resource`: a DELETED event discards the object, any other indexes it); then a pass reads the cache.
The last test runs kopf's own watcher and event processing instead, to show what kopf does with the deletion sent."""
from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import aiohttp
import kopf
import pytest
from kopf._cogs.clients import fetching, watching
from kopf._core.reactor import queueing

from controller import relist
from controller.kubeapi import STATEFULSETS
from controller.watchcache import WATCHED, index_entries
from tests.support import kopfloop
from tests.test_controller_watchcache import exposed, setup

STS_WATCH = next(w for w in WATCHED if w.res == STATEFULSETS)


@pytest.fixture
def kopf_watch(monkeypatch):
    """kopf's watch of the StatefulSets over `listings` (each a list of objects, or an exception raised after the
    objects before it); every watch between two listings ends in 410 Gone. The wrapper is removed afterwards."""
    monkeypatch.setattr(watching, "continuous_watch", watching.continuous_watch)
    monkeypatch.setattr(relist, "_shown", {})
    monkeypatch.setattr(relist, "_kinds", set())
    listings: list[list] = []

    async def fetch_objs(**_):
        items = listings.pop(0)
        for i, o in enumerate(items):
            if isinstance(o, Exception):
                raise o
            yield [o], str(i)

    async def watch_objs(**_):
        yield {"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}

    monkeypatch.setattr(fetching, "fetch_objs", fetch_objs)
    monkeypatch.setattr(watching, "watch_objs", watch_objs)
    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0

    async def run(watches, *, fix: bool = True) -> None:
        if fix:
            relist.install([STATEFULSETS])
        indexer = watches.indexers[STS_WATCH.index_id]
        async for ev in watching.infinite_watch(settings=settings, resource=kopf.Resource("apps", "v1", "statefulsets"),
                                                namespace="tailscale", _iterations=len(listings)):
            if isinstance(ev, watching.Bookmark):
                continue
            md = ev["object"]["metadata"]
            key = (md.get("namespace"), md.get("name"), md.get("uid"))
            if ev["type"] == "DELETED":
                indexer.discard(key)
            else:
                watches.cache.seen(STATEFULSETS, ev["object"])
                indexer.replace(key, index_entries(ev["object"]))
    return listings, run


async def _exposed():
    api, cache, watches, rec, _ = setup()
    _, name = await exposed(api, watches, rec)
    return api, rec, watches, name


@pytest.mark.parametrize("fix", [True, False])
async def test_a_statefulset_deleted_while_the_watch_was_away_is_created_again_after_the_listing(kopf_watch, fix):
    listings, run = kopf_watch
    api, rec, watches, name = await _exposed()
    sts = api.obj(STATEFULSETS, name, "tailscale")
    # listed, then deleted by someone while the controller was cut off: the next listing does not return it
    listings += [[sts], []]
    del api.objects[("statefulsets", "tailscale", name)]
    await run(watches, fix=fix)
    api.calls.clear()
    await rec.reconcile("svc", "apps", "web")
    if fix:
        assert ("POST", "statefulsets", "tailscale", name) in [c[:4] for c in api.calls]
        assert api.obj(STATEFULSETS, name, "tailscale") is not None
    else:
        # kopf alone: the cache still holds it, and the pass believes it present (what the wrapper is for)
        assert api.obj(STATEFULSETS, name, "tailscale") is None


async def test_a_listing_cut_short_drops_nothing_and_the_next_one_decides(kopf_watch):
    listings, run = kopf_watch
    api, rec, watches, name = await _exposed()
    sts = api.obj(STATEFULSETS, name, "tailscale")
    other = {**sts, "metadata": {**sts["metadata"], "name": "other", "uid": "u-other"}}
    # the second listing breaks off after `other` (it never returned the proxy's): nothing is dropped on its word
    listings += [[sts, other], [other, aiohttp.ClientConnectionError("reset")]]
    await run(watches)
    assert await rec.kube.get(STATEFULSETS, name, "tailscale") is not None
    assert await rec.kube.get(STATEFULSETS, "other", "tailscale") is not None
    # the next complete one returns the proxy's StatefulSet and no longer `other`, which goes
    listings += [[sts]]
    await run(watches)
    assert await rec.kube.get(STATEFULSETS, name, "tailscale") is not None
    assert await rec.kube.get(STATEFULSETS, "other", "tailscale") is None


async def test_kopf_drops_the_missed_object_from_its_index_and_calls_the_handlers_with_its_deletion(monkeypatch):
    """The same, through kopf's own watcher and event processing (an index and an event handler registered as
    `controller.handlers` registers them): what kopf does with the DELETED event sent for the missed object."""
    monkeypatch.setattr(watching, "continuous_watch", watching.continuous_watch)
    monkeypatch.setattr(relist, "_shown", {})
    monkeypatch.setattr(relist, "_kinds", set())

    def sts(name: str) -> dict:
        return {"metadata": {"name": name, "namespace": "tailscale", "uid": f"u-{name}", "resourceVersion": "1"}}
    listings = [[sts("kept"), sts("gone")], [sts("kept")]]

    async def fetch_objs(**_):
        yield listings.pop(0), "5"

    async def watch_objs(**_):
        if listings:
            yield {"type": "ERROR", "object": {"code": 410}}
        else:
            await asyncio.Event().wait()      # the watch after the last listing stays open
            yield {}

    monkeypatch.setattr(fetching, "fetch_objs", fetch_objs)
    monkeypatch.setattr(watching, "watch_objs", watch_objs)
    relist.install([STATEFULSETS])
    registry, seen, deleted = kopf.OperatorRegistry(), [], asyncio.Event()

    @kopf.on.event("apps", "v1", "statefulsets", registry=registry)
    async def on_event(type, body, **_):
        seen.append((type, body["metadata"]["name"]))
        if type == "DELETED":
            deleted.set()

    @kopf.index("apps", "v1", "statefulsets", id="names", registry=registry)
    async def names(body, **_):
        return {"name": body["metadata"]["name"]}

    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0
    resource = kopf.Resource("apps", "v1", "statefulsets")
    processor, indexers = kopfloop.processor(registry, settings, resource)
    task = asyncio.create_task(queueing.watcher(namespace="tailscale", settings=settings, resource=resource,
                                                processor=processor))
    try:
        await asyncio.wait_for(deleted.wait(), 10)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert ("DELETED", "gone") in seen
    assert {k: list(v) for k, v in indexers.indices["names"].items()} == {"name": ["kept"]}


def test_what_is_kept_of_a_watched_object_is_what_a_deletion_handler_reads():
    """A parent keeps its spec (whether it is ours: its class); a Secret or StatefulSet only its metadata; nobody
    keeps managedFields, kubectl's last-applied annotation or a status."""
    md = {"name": "x", "namespace": "apps", "uid": "u1", "labels": {"a": "b"}, "managedFields": [{"big": 1}],
          "annotations": {relist._LAST_APPLIED: "{...}", "keep": "me"}}
    svc = relist.skeleton({"apiVersion": "v1", "kind": "Service", "metadata": md,
                           "spec": {"loadBalancerClass": "tailscale"}, "status": {"loadBalancer": {}}}, "services")
    assert svc == {"apiVersion": "v1", "kind": "Service", "spec": {"loadBalancerClass": "tailscale"},
                   "metadata": {"name": "x", "namespace": "apps", "uid": "u1", "labels": {"a": "b"},
                                "annotations": {"keep": "me"}}}
    sec = relist.skeleton({"apiVersion": "v1", "kind": "Secret", "metadata": md, "data": {"authkey": "c2VjcmV0"},
                           "type": "Opaque"}, "secrets")
    assert sec == {"apiVersion": "v1", "kind": "Secret", "metadata": svc["metadata"]}
    sts = relist.skeleton({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": md,
                           "spec": {"template": {}}}, "statefulsets")
    assert "spec" not in sts and sts["metadata"]["labels"] == {"a": "b"}


async def test_kopf_gets_the_watched_objects_without_managed_fields_or_last_applied(monkeypatch):
    """What kopf holds of each listed or watched object (until its indexes are filled, for every object listed at
    start) has no managedFields and no kubectl last-applied annotation; other kinds' objects pass untouched."""
    monkeypatch.setattr(watching, "continuous_watch", watching.continuous_watch)
    monkeypatch.setattr(relist, "_shown", {})
    monkeypatch.setattr(relist, "_kinds", set())

    def obj(name: str) -> dict:
        return {"metadata": {"name": name, "uid": f"u-{name}", "labels": {"a": "b"}, "managedFields": [{"big": 1}],
                             "annotations": {relist._LAST_APPLIED: "{...}", "keep": "me"}}, "spec": {"replicas": 1}}

    async def fetch_objs(**_):
        yield [obj("listed")], "1"

    async def watch_objs(**_):
        yield {"type": "MODIFIED", "object": obj("watched")}
        yield {"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}

    monkeypatch.setattr(fetching, "fetch_objs", fetch_objs)
    monkeypatch.setattr(watching, "watch_objs", watch_objs)
    relist.install([STATEFULSETS])
    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0
    seen = {}
    for plural in ("statefulsets", "deployments"):
        seen[plural] = [ev["object"] async for ev in watching.infinite_watch(
            settings=settings, resource=kopf.Resource("apps", "v1", plural), namespace="tailscale", _iterations=1)
            if isinstance(ev, dict)]
    assert seen["statefulsets"] == [
        {"metadata": {"name": n, "uid": f"u-{n}", "labels": {"a": "b"}, "annotations": {"keep": "me"}},
         "spec": {"replicas": 1}} for n in ("listed", "watched")]
    assert seen["deployments"] == [obj("listed"), obj("watched")]


def test_kopf_keeps_only_the_skeleton_of_an_object_once_the_cache_has_it():
    """The cache's entry holds the whole StatefulSet (a pass reads its spec); kopf's own event object, held until
    its handlers have run, keeps only what they read; a plain mapping (not kopf's) is left alone."""
    from controller.watchcache import Cached
    raw = {"apiVersion": "apps/v1", "kind": "StatefulSet", "spec": {"replicas": 1, "template": {"x": "y"}},
           "status": {"replicas": 1},
           "metadata": {"name": "ts-web", "namespace": "tailscale", "uid": "u1", "resourceVersion": "7",
                        "labels": {"tailscale.com/managed": "true"}, "managedFields": [{"big": 1}]}}
    entries = index_entries(raw)
    relist.shrink(kopf.Body(raw), "statefulsets")
    assert raw == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                   "metadata": {"name": "ts-web", "namespace": "tailscale", "uid": "u1", "resourceVersion": "7",
                                "labels": {"tailscale.com/managed": "true"}}}
    cached = next(v for v in entries.values() if isinstance(v, Cached))
    assert cached.obj()["spec"] == {"replicas": 1, "template": {"x": "y"}}
    plain = {"metadata": {"name": "x"}, "spec": {"a": 1}}
    relist.shrink(plain, "statefulsets")
    assert plain == {"metadata": {"name": "x"}, "spec": {"a": 1}}
