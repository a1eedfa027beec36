"""controller.queue and the kopf shell's event mapping: events coalesce, failures back off, children map to
their parent by upstream's labels."""
from __future__ import annotations

import asyncio

from controller.config import ControllerConfig
from controller.handlers import State, child_key, parent_key, registries, settings
from controller.queue import WorkQueue
from tests.support.waits import until_async


async def _until(pred, timeout: float = 10.0) -> None:
    await until_async(pred, timeout, interval=0.005)


async def test_events_during_a_pass_coalesce_into_one_more_pass():
    runs, gate = [], asyncio.Event()

    async def work(key):
        runs.append(key)
        if len(runs) == 1:
            await gate.wait()
        return None
    q = WorkQueue(work)
    q.poke("a")
    await _until(lambda: runs == ["a"])
    for _ in range(5):
        q.poke("a")
    gate.set()
    await _until(lambda: not q._tasks)       # the key's worker finished: every poke was handled
    assert runs == ["a", "a"]
    await q.aclose()


async def test_failures_retry_with_growing_delay_then_recover():
    times = []
    loop = asyncio.get_running_loop()

    async def work(key):
        times.append(loop.time())
        if len(times) < 4:
            raise RuntimeError("api down")
        return None
    q = WorkQueue(work, base_delay=0.02, max_delay=1.0)
    q.poke("k")
    await _until(lambda: len(times) >= 4)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(times) == 4 and gaps[0] >= 0.02 and gaps[1] >= 0.04 and gaps[2] >= 0.08
    await _until(lambda: not q._tasks)
    assert q.failures == {}
    await q.aclose()


async def test_an_event_does_not_cut_a_429s_retry_after_short():
    """A watch event for a parent that is waiting out a 429's Retry-After waits for it too (the hostile API
    server test against a real API server found passes retried at once when an event arrived), while an event
    still ends the queue's own backoff early."""
    from controller.kubeapi import KubeError
    loop = asyncio.get_running_loop()
    times: list[float] = []

    async def work(key):
        times.append(loop.time())
        if len(times) == 1:
            raise KubeError("429", status=429, reason="TooManyRequests", retry_after=0.6)
        if len(times) == 3:
            raise KubeError("500", status=500, reason="InternalError")
        return None
    q = WorkQueue(work, base_delay=5.0)
    q.poke("a")
    await _until(lambda: q.failures == {"a": 1})
    q.poke("a")                   # an event during the Retry-After (the backoff alone would be 5 s) ...
    await _until(lambda: len(times) == 2)
    assert times[1] - times[0] >= 0.6          # ... ran the pass only once the Retry-After had passed
    q.poke("a")                   # fails with a 500: the queue's backoff (5 s) ...
    await _until(lambda: len(times) == 3 and q.failures == {"a": 1})
    q.poke("a")                   # ... which an event ends at once
    await _until(lambda: len(times) == 4)
    assert times[3] - times[2] < 5.0
    await q.aclose()


async def test_a_returned_delay_schedules_a_recheck():
    runs = []

    async def work(key):
        runs.append(key)
        return 0.03 if len(runs) < 3 else None
    q = WorkQueue(work)
    q.poke("k")
    await _until(lambda: not q._tasks)       # the third pass asked for no recheck: the worker is done
    assert runs == ["k", "k", "k"]
    await q.aclose()


def test_event_mapping():
    cfg = ControllerConfig()
    svc = {"metadata": {"name": "web", "namespace": "apps", "annotations": {"tailscale.com/expose": "true"}}}
    assert parent_key("svc", svc, cfg) == ("svc", "apps", "web")
    plain = {"metadata": {"name": "x", "namespace": "apps"}}
    assert parent_key("svc", plain, cfg) is None
    # No longer selected but still holding our finalizer: its proxy must be cleaned up.
    plain["metadata"]["finalizers"] = ["tailscale.com/finalizer"]
    assert parent_key("svc", plain, cfg) == ("svc", "apps", "x")
    child = {"metadata": {"labels": {"tailscale.com/managed": "true", "tailscale.com/parent-resource": "office",
                                     "tailscale.com/parent-resource-ns": "",
                                     "tailscale.com/parent-resource-type": "connector"}}}
    assert child_key(child) == ("connector", "", "office")
    assert child_key({"metadata": {"labels": {"tailscale.com/parent-resource-type": "proxygroup",
                                              "tailscale.com/parent-resource": "pg",
                                              "tailscale.com/managed": "true"}}}) == ("proxygroup", "", "pg")
    assert child_key({"metadata": {"labels": {"tailscale.com/parent-resource-type": "dnsconfig",
                                              "tailscale.com/managed": "true"}}}) is None
    # An egress Service for a ProxyGroup is the controller's too.
    pg_svc = {"metadata": {"name": "db", "namespace": "apps", "annotations": {
        "tailscale.com/proxy-group": "pg", "tailscale.com/tailnet-ip": "100.64.0.9"}}}
    assert parent_key("svc", pg_svc, cfg) == ("svc", "apps", "db")
    assert parent_key("proxygroup", {"metadata": {"name": "pg"}}, cfg) == ("proxygroup", "", "pg")


class Queue:
    """The work queue as the handlers see it: the keys they poke, in order."""

    def __init__(self) -> None:
        self.keys: list = []

    def poke(self, key) -> None:
        self.keys.append(key)


def kopf_event_handlers(monkeypatch) -> dict[str, tuple]:
    """What the controller registers at kopf's public decorator `kopf.on.event`: resource plural ->
    (registry, label filter, handler)."""
    import kopf
    watched: dict[str, tuple] = {}

    def event(*resource: str, registry, labels=None, **_):
        def register(fn):
            watched[resource[-1]] = (registry, labels, fn)
            return fn
        return register
    monkeypatch.setattr(kopf.on, "event", event)
    return watched


async def test_kopf_watches_map_events_to_queue_keys_and_children_are_filtered_server_side(monkeypatch):
    # What the controller asks of kopf, seen at kopf's public decorator: which resources each operator watches,
    # with which label filter, and what each handler puts on the queue.
    watched = kopf_event_handlers(monkeypatch)
    queue = Queue()
    parents, children = registries(State(ControllerConfig(), None, queue))
    assert {r: (reg is parents, labels) for r, (reg, labels, _) in watched.items()} == {
        "services": (True, None), "ingresses": (True, None), "connectors": (True, None),
        "proxygroups": (True, None), "proxyclasses": (True, None), "dnsconfigs": (True, None),
        "recorders": (True, None), "endpointslices": (False, None),
        "secrets": (False, {"tailscale.com/managed": "true"}),
        "statefulsets": (False, {"tailscale.com/managed": "true"}),
        "pods": (False, {"tailscale.com/managed": "true", "tailscale.com/parent-resource-type": "proxygroup"}),
        "configmaps": (False, {"tailscale.com/apiserver-proxy": "true"}),
        # for the watch cache only (controller/watchcache.py): every ServiceAccount (the proxies' Roles and
        # RoleBindings are watched by their indexes alone, below: no handler call per event)
        "serviceaccounts": (False, None),
        # the ServiceMonitor CRD alone (a field selector, below)
        "customresourcedefinitions": (False, None)}
    exposed = {"metadata": {"name": "web", "namespace": "apps", "annotations": {"tailscale.com/expose": "true"}}}
    await watched["services"][2](body=exposed)
    await watched["services"][2](body={"metadata": {"name": "other", "namespace": "apps"}})   # not ours
    child = {"metadata": {"labels": {"tailscale.com/managed": "true", "tailscale.com/parent-resource": "web",
                                     "tailscale.com/parent-resource-ns": "apps",
                                     "tailscale.com/parent-resource-type": "svc"}}}
    await watched["statefulsets"][2](body=child)
    await watched["recorders"][2](body={"metadata": {"name": "rec"}})
    # a Recorder's Secret (upstream's recorder label, no parent labels) brings a pass of its Recorder
    await watched["secrets"][2](body={"metadata": {"labels": {"tailscale.com/managed": "true",
                                                              "tailscale.com/recorder": "rec"}}})
    # every Service event also queues the DNSConfig pass (an egress Service's tailnet name may have changed)
    dns = ("dnsconfig", "", "")
    assert queue.keys == [("svc", "apps", "web"), dns, dns, ("svc", "apps", "web"), ("recorder", "", "rec"),
                          ("recorder", "", "rec")]
    s = settings(True)
    assert sorted(s.watching.label_selectors.values()) == ["tailscale.com/apiserver-proxy=true"] + [
        "tailscale.com/managed=true"] * 4 + ["tailscale.com/managed=true,tailscale.com/parent-resource-type=proxygroup"]
    # the watch cache knows what each watch selects: a miss there is "absent" only for what the watch would show
    from controller.watchcache import CHILDREN, WATCHED
    assert {"roles", "rolebindings"} <= {w.res.plural for w in WATCHED if w.operator == CHILDREN}
    for w in WATCHED:
        if w.operator == CHILDREN and w.selector:
            assert s.watching.label_selectors[w.res.plural] == w.selector_text, w.res.plural
        else:
            assert w.res.plural not in s.watching.label_selectors, w.res.plural
    assert [(k.any_name, v) for k, v in s.watching.field_selectors.items()] == [
        ("customresourcedefinitions", "metadata.name=servicemonitors.monitoring.coreos.com")]
    assert not settings(False).posting.enabled
    assert not list(settings(False).watching.field_selectors.items())
    # neither operator lists or watches the CRDs (kopf resolves its kinds once, at start: controller.crdcheck)
    assert settings(False).scanning.disabled and settings(True).scanning.disabled
    # no watch asks for a length: the API server draws each one (1800-3600 s by default), so watches started
    # together do not reconnect together; a dead stream is found by its silence (no bookmark for over a minute)
    for op in (settings(False), settings(True)):
        assert op.watching.server_timeout is None and op.watching.client_timeout is None
        assert 60 < op.watching.inactivity_timeout <= 90


async def test_the_servicemonitor_crds_events_queue_every_proxyclass(monkeypatch):
    """A class refused because the CRD was missing is judged again when it is installed (and one that relied on
    it, when it is removed): each of the CRD's events queues every class, whose pass queues its parents."""
    from kopf._core.engines.indexing import OperatorIndexer

    from controller.watchcache import PARENTS, WATCHED, WatchCache, index_entries
    watched = kopf_event_handlers(monkeypatch)
    queue, cache = Queue(), WatchCache("tailscale")
    registries(State(ControllerConfig(), None, queue, cache=cache))
    handlers = {plural: fn for plural, (_, _, fn) in watched.items()}
    indexers = {w.index_id: OperatorIndexer() for w in WATCHED}
    for name in ("monitored", "plain"):
        indexers["cache_proxyclasses"].replace((None, name, name), index_entries({"metadata": {"name": name}}))
    cache.attach(PARENTS, {k: i.index for k, i in indexers.items()})
    await handlers["customresourcedefinitions"](body={"metadata": {"name": "servicemonitors.monitoring.coreos.com"}},
                                                **{k: i.index for k, i in indexers.items()})
    assert sorted(queue.keys) == [("proxyclass", "", "monitored"), ("proxyclass", "", "plain")]


def test_a_proxygroup_event_brings_a_pass_of_the_services_that_name_it():
    s = State(ControllerConfig(), None, None)
    s.index_service(("svc", "apps", "a"), "pg")
    s.index_service(("svc", "apps", "b"), "pg")
    s.index_service(("svc", "apps", "c"), "other")
    assert s.group_services == {"pg": {("svc", "apps", "a"), ("svc", "apps", "b")}, "other": {("svc", "apps", "c")}}
    s.index_service(("svc", "apps", "a"), "other")     # moved to another group
    s.index_service(("svc", "apps", "b"), "")          # no longer names one (or deleted)
    assert s.group_services == {"other": {("svc", "apps", "a"), ("svc", "apps", "c")}}


async def test_retry_now_runs_the_waiting_keys_at_once_and_starts_their_backoff_over():
    runs: list[str] = []
    down = True

    async def work(key):
        runs.append(key)
        if key == "waits":
            return 60.0 if down else None        # e.g. fenced: come back later
        if down:
            raise RuntimeError("api down")
        return None
    q = WorkQueue(work, base_delay=30.0)
    q.poke("fails")
    q.poke("waits")
    await _until(lambda: len(runs) == 2 and q.failures == {"fails": 1})
    assert sorted(runs) == ["fails", "waits"]
    down = False
    q.retry_now()
    await _until(lambda: len(runs) == 4 and not q.failures)
    assert sorted(runs) == ["fails", "fails", "waits", "waits"] and q.failures == {}
    await q.aclose()


def test_kopf_retries_watches_for_ever_and_each_request_starts_over():
    import itertools

    from controller.handlers import RetryForever
    b = settings(False).networking.error_backoffs
    assert isinstance(b, RetryForever)
    first = list(itertools.islice(iter(b), 12))
    assert first == [1, 1, 2, 3, 5, 5, 5, 5, 5, 5, 5, 5]
    assert list(itertools.islice(iter(b), 3)) == [1, 1, 2]        # a fresh sequence for every request


def test_kopf_attempt_lines_fold_to_one_a_minute_and_say_how_many_were_held():
    import logging

    from controller.logfold import FoldRepeats
    now = [0.0]
    f = FoldRepeats(window=60.0, clock=lambda: now[0])

    def rec(name: str, msg: str) -> logging.LogRecord:
        return logging.LogRecord(name, logging.ERROR, "", 0, msg, None, None)
    passed = []
    for i in range(30):                              # a dozen watches failing for a minute and a half
        now[0] = i * 3.0
        for w in ("services", "secrets"):
            r = rec("kopf._cogs.clients.watching", f"Request attempt #{i} failed; will retry: GET /{w}")
            if f.filter(r):
                passed.append(r.getMessage())
        other = rec("controller", "leader election: something")
        assert f.filter(other)                       # other lines are never held back
    assert len(passed) == 2
    assert passed[0] == "Request attempt #0 failed; will retry: GET /services"
    assert passed[1].startswith("Request attempt #20 failed; will retry: GET /services (39 more like this in the last")


async def test_the_echo_of_the_controllers_own_write_pokes_no_pass_and_any_other_event_does(monkeypatch):
    from controller.watchcache import WatchCache
    watched = kopf_event_handlers(monkeypatch)
    queue, cache = Queue(), WatchCache("tailscale")
    registries(State(ControllerConfig(), None, queue, cache=cache))
    handlers = {plural: fn for plural, (_, _, fn) in watched.items()}
    labels = {"tailscale.com/managed": "true", "tailscale.com/parent-resource": "web",
              "tailscale.com/parent-resource-ns": "apps", "tailscale.com/parent-resource-type": "svc"}
    sts = {"kind": "StatefulSet", "metadata": {"name": "ts-web-abcde", "namespace": "tailscale",
                                               "resourceVersion": "7", "labels": labels}}
    cache.wrote(sts, None, None)            # the controller created it: this version is its own
    await handlers["statefulsets"](body=sts, type="ADDED")
    assert queue.keys == []
    # a user's edit (a newer version), or the same version seen again, is news
    await handlers["statefulsets"](body={**sts, "metadata": {**sts["metadata"], "resourceVersion": "9"}},
                                   type="MODIFIED")
    await handlers["statefulsets"](body=sts, type="MODIFIED")
    assert queue.keys == [("svc", "apps", "web")] * 2
    # so is its deletion, even of the version the controller wrote
    cache.wrote(sts, None, None)
    await handlers["statefulsets"](body=sts, type="DELETED")
    assert queue.keys == [("svc", "apps", "web")] * 3
