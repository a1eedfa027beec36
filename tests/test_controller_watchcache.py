"""controller.watchcache: whole passes reading kopf's indexes instead of the API server.

The in-memory API server (tests/support/fakekube.py) stands for the cluster; `Watches` stands for kopf's watches:
`deliver()` brings every watched object's current version into real kopf indexes (and drops the deleted ones),
as kopf's watch events would, with the label selectors the controller's watches use. What a user (or the API
server's load) sees: the passes' requests to the API server, the objects and statuses they write."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kopf._core.engines.indexing import OperatorIndexer

from controller.config import ControllerConfig
from controller.kubeapi import NAMESPACES, SECRETS, SERVICES, STATEFULSETS
from controller.model import Parent
from controller.reconcile import PENDING_RECHECK, Reconciler
from controller.render import base_name, child_labels, secret_name
from controller.watchcache import (
    CHILDREN,
    PARENTS,
    WATCHED,
    CachedKube,
    WatchCache,
    index_entries,
    parse_selector,
)
from tests.support.fakekube import FakeKube, FakeProvider

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1",
                       login_server="http://hs.test:8080")


class Watches:
    """kopf's watches over the fake: one real kopf index per watched kind, brought up to date by `deliver`."""

    def __init__(self, kube: FakeKube, cache: WatchCache) -> None:
        self.kube, self.cache = kube, cache
        self.indexers = {w.index_id: OperatorIndexer() for w in WATCHED}
        self.keys: dict[str, set] = {w.index_id: set() for w in WATCHED}

    def deliver(self) -> None:
        for w in WATCHED:
            now = set()
            for (plural, ns, _), o in self.kube.objects.items():
                labels = o["metadata"].get("labels") or {}
                if plural != w.res.plural or (w.operator == CHILDREN and w.res.namespaced and
                                              ns != self.cache.namespace) or \
                        any(labels.get(k) != v for k, v in w.selector) or not w.covers(o["metadata"]["name"]):
                    continue
                key = (ns or None, o["metadata"]["name"], o["metadata"]["uid"])
                now.add(key)
                self.cache.seen(w.res, o)
                self.indexers[w.index_id].replace(key, index_entries(o))
            for gone in self.keys[w.index_id] - now:
                self.indexers[w.index_id].discard(gone)
            self.keys[w.index_id] = now
        for op in (PARENTS, CHILDREN):
            self.cache.attach(op, {k: i.index for k, i in self.indexers.items()})


def setup(poll=None):
    log: list = []
    api, prov = FakeKube(log), FakeProvider(log)
    api.put(NAMESPACES, {"metadata": {"name": "tailscale"}})
    t = [0.0]
    cache = WatchCache("tailscale", clock=lambda: t[0])
    kube = CachedKube(api, cache, poll if poll is not None else {NAMESPACES.plural: 20.0})
    rec = Reconciler(kube, prov, CFG)
    return api, cache, Watches(api, cache), rec, t


def expose(api: FakeKube, name: str = "web") -> dict:
    return api.put(SERVICES, {"metadata": {"name": name, "namespace": "apps",
                                           "annotations": {"tailscale.com/expose": "true"}},
                              "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                                       "ipFamilies": ["IPv4"]}})


def reads(api: FakeKube) -> list:
    return [c for c in api.calls if c[0] in ("GET", "LIST")]


async def test_a_service_is_exposed_reading_the_cache_and_a_recheck_sends_nothing():
    api, cache, watches, rec, _ = setup()
    svc = expose(api)
    watches.deliver()
    assert await rec.reconcile("svc", "apps", "web") == PENDING_RECHECK
    name = base_name(Parent("svc", "web", "apps", svc["metadata"]["uid"]))
    assert api.obj(STATEFULSETS, name, "tailscale") is not None
    # the first pass asks the API server only for what no watch holds: the namespace's Pod Security level and
    # whether a Secret of the proxy's name exists without our labels
    assert sorted({(c[0], c[1]) for c in reads(api)}) == [("GET", "namespaces"), ("GET", "secrets")]
    api.calls.clear()
    watches.deliver()
    assert await rec.reconcile("svc", "apps", "web") == PENDING_RECHECK
    assert api.calls == []              # no read, no write: everything came from the watches


async def test_a_pass_reads_back_its_own_writes_before_the_watch_brings_them():
    api, cache, watches, rec, _ = setup()
    expose(api)
    watches.deliver()
    await rec.reconcile("svc", "apps", "web")
    api.calls.clear()
    # the watch has not brought anything yet: the second pass must not create the objects again
    assert await rec.reconcile("svc", "apps", "web") == PENDING_RECHECK
    assert api.writes() == []
    assert reads(api) == []


async def exposed(api: FakeKube, watches: Watches, rec: Reconciler) -> tuple[dict, str]:
    """Service apps/web exposed, its pass run and everything it wrote delivered by the watches: the Service as
    created and its proxy's StatefulSet's name."""
    svc = expose(api)
    watches.deliver()
    await rec.reconcile("svc", "apps", "web")
    watches.deliver()
    return svc, base_name(Parent("svc", "web", "apps", svc["metadata"]["uid"]))


async def test_a_deleted_object_is_absent_until_the_watch_says_more():
    api, cache, watches, rec, _ = setup()
    svc, name = await exposed(api, watches, rec)
    assert await rec.kube.get(STATEFULSETS, name, "tailscale") is not None
    await rec.kube.delete(STATEFULSETS, name, "tailscale")
    assert await rec.kube.get(STATEFULSETS, name, "tailscale") is None     # the watch lags: still hidden
    sel = ",".join(f"{k}={v}" for k, v in child_labels(Parent("svc", "web", "apps", svc["metadata"]["uid"])).items())
    assert await rec.kube.list(STATEFULSETS, "tailscale", sel) == []
    watches.deliver()
    assert await rec.kube.get(STATEFULSETS, name, "tailscale") is None


async def test_a_secret_made_by_hand_under_the_proxys_name_is_adopted():
    api, cache, watches, rec, _ = setup()
    svc = expose(api)
    p = Parent("svc", "web", "apps", svc["metadata"]["uid"])
    api.put(SECRETS, {"metadata": {"name": secret_name(p, 0), "namespace": "tailscale"}, "data": {}})
    watches.deliver()          # not in the cache: the watch selects the managed label
    await rec.reconcile("svc", "apps", "web")
    labels = api.obj(SECRETS, secret_name(p, 0), "tailscale")["metadata"]["labels"]
    assert labels["tailscale.com/managed"] == "true"


async def test_an_object_not_watched_is_polled_once_for_every_pass():
    api, cache, watches, rec, t = setup()
    for i in range(3):
        expose(api, f"web{i}")
    watches.deliver()
    for i in range(3):
        await rec.reconcile("svc", "apps", f"web{i}")
    assert [c for c in api.calls if c[1] == "namespaces"] == [("GET", "namespaces", "", "tailscale")]
    # a new label on the namespace is seen once the poll period has passed
    t[0] += 21.0
    api.calls.clear()
    watches.deliver()
    await rec.reconcile("svc", "apps", "web0")
    assert [c for c in api.calls if c[1] == "namespaces"] == [("GET", "namespaces", "", "tailscale")]


async def test_reads_go_to_the_api_server_until_the_watches_have_listed():
    api, cache, watches, rec, _ = setup()
    expose(api)
    assert await rec.kube.get(SERVICES, "web", "apps") is not None
    assert ("GET", "services", "apps", "web") in api.calls


def test_selectors():
    assert parse_selector("a=b,c==d") == {"a": "b", "c": "d"}
    assert parse_selector("a=") == {"a": ""}
    assert parse_selector("a!=b") is None
    assert parse_selector("a in (b)") is None
    assert parse_selector("a") is None


async def deleted_in_the_foreground(api: FakeKube, watches: Watches, rec: Reconciler) -> str:
    """An exposed Service deleted: its pass deletes the proxy's StatefulSet in the foreground (its Pods are
    going); the StatefulSet's name."""
    _, name = await exposed(api, watches, rec)
    api.objects[("services", "apps", "web")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    watches.deliver()
    await rec.reconcile("svc", "apps", "web")
    assert api.obj(STATEFULSETS, name, "tailscale") is not None
    return name


def finalizer_gone(api: FakeKube) -> bool:
    svc = api.obj(SERVICES, "web", "apps")
    return svc is None or "tailscale.com/finalizer" not in (svc["metadata"].get("finalizers") or [])


async def test_a_statefulset_deleted_in_the_foreground_holds_the_cleanup_until_the_watch_shows_it_gone():
    api, cache, watches, rec, _ = setup()
    name = await deleted_in_the_foreground(api, watches, rec)
    # the watch has not shown anything since: the next pass must still wait, and keep our finalizer
    await rec.reconcile("svc", "apps", "web")
    assert not finalizer_gone(api)
    api.finish_deletions()
    watches.deliver()
    await rec.reconcile("svc", "apps", "web")
    watches.deliver()
    assert api.obj(STATEFULSETS, name, "tailscale") is None
    assert finalizer_gone(api)


async def test_a_foreground_deletion_that_ended_unseen_by_the_watch_releases_the_cleanup():
    """The StatefulSet's end reaches the API server but not (yet) the watch (a watch reconnecting after an API
    server restart): the cleanup learns it from the server, and the parent's finalizer goes."""
    api, cache, watches, rec, _ = setup()
    name = await deleted_in_the_foreground(api, watches, rec)
    watches.deliver()                                   # the watch shows it going
    await rec.reconcile("svc", "apps", "web")
    assert not finalizer_gone(api)                      # still going
    api.finish_deletions()                              # gone at the server; the watch says nothing
    await rec.reconcile("svc", "apps", "web")
    assert api.obj(STATEFULSETS, name, "tailscale") is None
    assert finalizer_gone(api)


async def test_a_class_refused_for_the_missing_servicemonitor_crd_is_valid_once_the_crd_is_installed():
    """With the controller's own polling: the CRD is watched, so the class's next pass (queued by the CRD's event,
    tests/test_controller_queue.py) sees it at once, not a poll period later."""
    from controller.__main__ import polled
    from controller.kinds.proxyclass import SERVICE_MONITOR_CRD
    from controller.kubeapi import CRDS, PROXYCLASSES
    api, cache, watches, rec, _ = setup(poll=polled(CFG))
    api.put(PROXYCLASSES, {"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyClass",
                           "metadata": {"name": "monitored"},
                           "spec": {"metrics": {"enable": True, "serviceMonitor": {"enable": True}}}})
    api.put(CRDS, {"metadata": {"name": "other.example.com"}})
    watches.deliver()

    def ready() -> tuple[str, str]:
        (c,) = api.obj(PROXYCLASSES, "monitored")["status"]["conditions"]
        return c["status"], c["reason"]
    await rec.reconcile("proxyclass", "", "monitored")
    assert ready() == ("False", "ProxyClassInvalid")
    api.put(CRDS, {"metadata": {"name": SERVICE_MONITOR_CRD}})
    watches.deliver()
    api.calls.clear()
    await rec.reconcile("proxyclass", "", "monitored")      # no time has passed
    assert ready() == ("True", "ProxyClassValid")
    assert not [c for c in api.calls if c[1] == "customresourcedefinitions"]    # read from the watch
    # a CRD the watch does not select is read from the API server, not taken as absent
    assert await rec.kube.get(CRDS, "other.example.com") is not None
    assert ("GET", "customresourcedefinitions", "", "other.example.com") in api.calls


async def test_an_object_written_then_deleted_is_absent_once_the_watch_shows_only_its_end():
    """kopf folds the events of one object that come close together and drops a deleted object from its indexes
    without a call of the index handler: a version the controller wrote may never be seen before the deletion.
    What was written must not outlive the object."""
    api, cache, watches, rec, t = setup()
    svc, name = await exposed(api, watches, rec)
    await rec.kube.patch(STATEFULSETS, name, {"metadata": {"annotations": {"x": "1"}}}, "tailscale")
    del api.objects[("statefulsets", "tailscale", name)]      # deleted (by a user) before the watch brought it
    watches.deliver()                                           # its deletion alone
    assert await rec.kube.get(STATEFULSETS, name, "tailscale") is None
    # created, then deleted before the watch showed either: read back for a minute at most
    await rec.kube.create(SECRETS, {"metadata": {"name": "brief", "namespace": "tailscale",
                                                 "labels": {"tailscale.com/managed": "true"}}}, "tailscale")
    del api.objects[("secrets", "tailscale", "brief")]
    watches.deliver()
    assert await rec.kube.get(SECRETS, "brief", "tailscale") is not None
    t[0] += 61.0
    assert await rec.kube.get(SECRETS, "brief", "tailscale") is None


async def test_a_write_whose_version_the_watch_brought_first_does_not_outlive_the_object():
    """The watch's event for a write can be handled before the write's answer: the answer is then not kept, and
    the object's deletion (the DNSConfig's, whose status the controller writes) is what the passes see."""
    from controller.kubeapi import DNSCONFIGS
    api, cache, watches, rec, _ = setup()
    api.put(DNSCONFIGS, {"metadata": {"name": "ts-dns"}, "spec": {"nameserver": {}}})
    watches.deliver()
    answer = await api.patch(DNSCONFIGS, "ts-dns", {"status": {"x": 1}}, "", "status")
    watches.deliver()                       # the watch first
    cache.remember(DNSCONFIGS, answer)      # then the answer
    del api.objects[("dnsconfigs", "", "ts-dns")]
    watches.deliver()
    assert await rec.kube.list(DNSCONFIGS) == []
    assert await rec.kube.get(DNSCONFIGS, "ts-dns") is None


async def test_an_object_whose_last_finalizer_the_controller_removed_is_gone():
    from controller.kubeapi import PROXYGROUPS
    api, cache, watches, rec, _ = setup()
    api.put(PROXYGROUPS, {"metadata": {"name": "pg", "finalizers": ["tailscale.com/finalizer"],
                                       "deletionTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"type": "egress"}})
    watches.deliver()
    pg = await rec.kube.get(PROXYGROUPS, "pg")
    await rec.writer.remove_finalizer("proxygroup", pg)
    api.finish_deletions()
    assert await rec.kube.get(PROXYGROUPS, "pg") is None        # before the watch shows its end
    watches.deliver()
    assert await rec.kube.get(PROXYGROUPS, "pg") is None


async def test_the_echo_of_a_passs_own_writes_brings_no_pass_and_anybody_elses_change_does():
    api, cache, watches, rec, _ = setup()
    svc = expose(api)
    watches.deliver()
    await rec.reconcile("svc", "apps", "web")
    p = Parent("svc", "web", "apps", svc["metadata"]["uid"])
    # what the watch brings next is what the pass wrote (its finalizer and status, the proxy's objects): echoes
    wrote = [api.obj(SERVICES, "web", "apps"), api.obj(STATEFULSETS, base_name(p), "tailscale"),
             api.obj(SECRETS, secret_name(p, 0), "tailscale")]
    assert [cache.own_write("MODIFIED", o) for o in wrote] == [True, True, True]
    # once only: the same version seen again (a relist) is news
    assert not cache.own_write("MODIFIED", wrote[0])
    # a user's change is news
    watches.deliver()
    cur = api.obj(SERVICES, "web", "apps")
    changed = api.put(SERVICES, {**cur, "metadata": {**cur["metadata"], "labels": {"team": "a"}}})
    assert not cache.own_write("MODIFIED", changed)


async def test_a_write_that_carries_somebody_elses_change_is_not_taken_for_an_echo():
    api, cache, watches, rec, _ = setup()
    expose(api)
    watches.deliver()
    await rec.reconcile("svc", "apps", "web")
    watches.deliver()
    # the user annotates the Service; before the watch brings it, a pass patches the Service's status
    cur = api.obj(SERVICES, "web", "apps")
    api.put(SERVICES, {**cur, "metadata": {**cur["metadata"], "annotations": {
        **cur["metadata"]["annotations"], "tailscale.com/hostname": "other"}}})
    answer = await rec.kube.patch(SERVICES, "web", {"status": {"loadBalancer": {"ingress": [{"ip": "100.64.0.9"}]}}},
                                  "apps", "status")
    # the answer holds the user's change, which no pass has seen: its event must bring one
    assert not cache.own_write("MODIFIED", answer)
