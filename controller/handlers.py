"""The kopf shell: watches turn into work-queue keys; everything else is in `reconcile`.

Two kopf operators run in one event loop: one watches the parents cluster-wide (Services, Ingresses,
Connectors) and the ProxyClasses (a class's pass queues the parents using it), the other watches the proxies'
StatefulSets and Secrets in the controller's namespace only,
filtered by the `tailscale.com/managed` label on the server, so the controller's RBAC needs no cluster-wide
Secret access. Event handlers only compute the parent's key and poke the queue: kopf's watches and reconnects
are used; its peering is not (a Lease decides which replica runs, `controller.leader`), nor its per-handler
progress records (they would be a write to every parent on every change, and a pass that changes nothing
must write nothing). Kopf's posting of its own log
lines as Kubernetes events is off: the reconciler writes the events users should see. The same watches fill
kopf indexes, one per watched kind (`controller.watchcache.WATCHED`), which the passes read instead of the API
server; the first handler call of each operator hands them over (`WatchCache.attach`), and the cache counts the
first listings to know when they are filled (`controller.kopfready`). An event that only echoes
a pass's own write (`WatchCache.own_write`) pokes no pass of its parent. kopf's change detection (a deep copy of
every event's object) is off (`NoDiffBase`): it serves creation/update handlers, and there are none.
"""
from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from tscommon.kubeconn import tls_context

from . import relist
from .config import ControllerConfig
from .kinds import apiserverproxy, connector, dnsconfig, egress, proxyclass, proxygroup, recorder
from .kindtable import GROUP, KINDS, PARENT_KINDS, handled
from .kubeapi import PROXYCLASSES, USER_AGENT
from .model import (
    APISERVER,
    CONNECTOR,
    FINALIZER,
    INGRESS,
    LABEL_MANAGED,
    LABEL_PARENT_NAME,
    LABEL_PARENT_NS,
    LABEL_PARENT_TYPE,
    PROXYCLASS,
    PROXYGROUP,
    SVC,
)
from .queue import WorkQueue
from .reconcile import Reconciler
from .watchcache import CHILDREN, PARENTS, WATCHED, WatchCache, index_entries

log = logging.getLogger("controller")


@dataclass
class State:
    cfg: ControllerConfig
    reconciler: Reconciler
    queue: WorkQueue
    #: ProxyGroup name -> the keys of the Services that name it: a group's change (created, became egress,
    #: deleted) brings a pass of each, without listing every Service of the cluster
    group_services: dict[str, set[tuple[str, str, str]]] = field(default_factory=dict)
    #: the read cache kopf's indexes fill (controller.watchcache); None: every read goes to the API server
    cache: WatchCache | None = None

    def index_service(self, key: tuple[str, str, str], group: str) -> None:
        for g, keys in list(self.group_services.items()):
            if g != group:
                keys.discard(key)
                if not keys:
                    del self.group_services[g]
        if group:
            self.group_services.setdefault(group, set()).add(key)


def parent_key(kind: str, body: Any, cfg: ControllerConfig) -> tuple[str, str, str] | None:
    """The queue key for a parent event, or None when the object is none of the controller's business."""
    meta = body.get("metadata") or {}
    if handled(kind, body, cfg) or FINALIZER in (meta.get("finalizers") or []):
        return (kind, meta.get("namespace") or "", meta.get("name") or "")
    return None


def child_key(body: Any) -> tuple[str, str, str] | None:
    """The parent's key from a child's labels (upstream's managedResourceHandlerForType)."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    if labels.get(LABEL_MANAGED) == "true" and labels.get(recorder.LABEL_RECORDER):
        # a Recorder's objects carry upstream's recorder label instead of the parent labels
        return (recorder.QUEUE_KIND, "", labels[recorder.LABEL_RECORDER])
    kind = labels.get(LABEL_PARENT_TYPE)
    if labels.get(LABEL_MANAGED) != "true" or kind not in PARENT_KINDS:
        return None
    return (kind, labels.get(LABEL_PARENT_NS, ""), labels.get(LABEL_PARENT_NAME, ""))


def kopf_login(url: str, token: Callable[[], str], ca_file: str, namespace: str,
               operator: str) -> Callable[..., Awaitable[kopf.AiohttpSession]]:
    """A kopf login handler with the controller's own credentials (the token re-read at each login: kopf logs in
    again after a 401) and a User-Agent naming the operator, so that the API server's audit log, and a proxy
    counting requests, can tell the two operators' watches from each other and from the reconciler's client.
    kopf names itself only as `kopf/VERSION` and its ConnectionInfo has no header of its own; a session made
    here is kopf's documented way to bring one (kopf closes it when it logs in again or stops)."""
    agent = f"{USER_AGENT} ({operator}) kopf/{importlib.metadata.version('kopf')}"

    async def login(**_: Any) -> kopf.AiohttpSession:
        headers = {"User-Agent": agent}
        if bearer := token():
            headers["Authorization"] = f"Bearer {bearer}"
        connector = aiohttp.TCPConnector(limit=0, ssl=tls_context(ca_file) if ca_file else True)
        return kopf.AiohttpSession(server=url, default_namespace=namespace,
                                   aiohttp_session=aiohttp.ClientSession(connector=connector, headers=headers))
    return login


def registries(state: State, login: Callable[[str], Callable[..., Any]] | None = None,
               ) -> tuple[kopf.OperatorRegistry, kopf.OperatorRegistry]:
    """The two operators' handlers. `login(operator)` (a kopf login handler for that operator, `kopf_login`)
    makes kopf use the controller's own credentials instead of guessing them."""
    parents, children = kopf.OperatorRegistry(), kopf.OperatorRegistry()
    if login is not None:
        kopf.on.login(registry=parents)(login("cluster-wide watches"))
        kopf.on.login(registry=children)(login("namespace watches"))

    def attach(operator: str, kwargs: dict[str, Any]) -> None:
        # kopf calls an operator's handlers only once its indexes hold its first listing: the cache is complete
        if state.cache is not None:
            state.cache.attach(operator, kwargs)

    def own_write(event_type: str | None, body: Any) -> bool:
        # the echo of a pass's own write (watchcache.WatchCache.wrote): that pass knew it all, so no pass more
        return state.cache is not None and state.cache.own_write(event_type, body)

    def on_parent(kind: str, operator: str = PARENTS):
        async def handler(body: Any, type: str | None = None, **kw: Any) -> None:   # async: no threads
            attach(operator, kw)
            key, info = parent_key(kind, body, state.cfg), KINDS[kind]
            if info.on_group is not None:
                meta = body.get("metadata") or {}
                k = (kind, meta.get("namespace") or "", meta.get("name") or "")
                state.index_service(k, "" if type == "DELETED" else egress.group_of(body))
            if key is not None and not own_write(type, body):
                state.queue.poke(key)
            if info.dns_records:
                state.queue.poke(dnsconfig.QUEUE_KEY)   # an egress name or an Ingress's MagicDNS name may change
            if info.runs == GROUP:
                for k in sorted(state.group_services.get((body.get("metadata") or {}).get("name") or "", ())):
                    state.queue.poke(k)
        return handler

    def on_dns(operator: str):
        async def handler(**kw: Any) -> None:
            attach(operator, kw)
            state.queue.poke(dnsconfig.QUEUE_KEY)
        return handler

    kopf.on.event("v1", "services", registry=parents)(on_parent(SVC))
    kopf.on.event("networking.k8s.io", "v1", "ingresses", registry=parents)(on_parent(INGRESS))
    kopf.on.event(connector.GROUP, connector.VERSION, connector.PLURAL, registry=parents)(on_parent(CONNECTOR))
    kopf.on.event(dnsconfig.GROUP, dnsconfig.VERSION, dnsconfig.PLURAL, registry=parents)(on_dns(PARENTS))
    kopf.on.event(proxygroup.GROUP, proxygroup.VERSION, proxygroup.PLURAL, registry=parents)(on_parent(PROXYGROUP))
    # Recorders (cluster-scoped); their Secrets and StatefulSet lead back to them through child_key
    kopf.on.event(recorder.GROUP, recorder.VERSION, recorder.PLURAL,
                  registry=parents)(on_parent(recorder.QUEUE_KIND))

    async def on_class(body: Any, **kw: Any) -> None:
        attach(PARENTS, kw)
        # The class's own pass writes its status and then queues every parent that uses it.
        name = (body.get("metadata") or {}).get("name")
        if name:
            state.queue.poke((PROXYCLASS, "", name))

    kopf.on.event(proxyclass.GROUP, proxyclass.VERSION, proxyclass.PLURAL, registry=parents)(on_class)

    async def on_monitor_crd(**kw: Any) -> None:
        """The ServiceMonitor CRD was installed, changed or removed: every class is judged again (one asking for a
        ServiceMonitor is valid only while it exists), and each then queues the parents that use it."""
        attach(CHILDREN, kw)
        if state.cache is not None:
            for name in state.cache.names(PROXYCLASSES):
                state.queue.poke((PROXYCLASS, "", name))
    # Only that CRD (a field selector, settings()); with the namespaced operator, whose scanning is off.
    kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions", registry=children)(on_monitor_crd)

    async def on_child(body: Any, type: str | None = None, **kw: Any) -> None:
        attach(CHILDREN, kw)
        key = child_key(body)
        if key is not None and not own_write(type, body):
            state.queue.poke(key)

    kopf.on.event("v1", "secrets", labels={LABEL_MANAGED: "true"}, registry=children)(on_child)
    # The API server proxy's ConfigMap: in the controller's namespace, so watched with the children.
    kopf.on.event("v1", "configmaps", labels={apiserverproxy.LABEL: "true"},
                  registry=children)(on_parent(APISERVER, CHILDREN))
    kopf.on.event("apps", "v1", "statefulsets", labels={LABEL_MANAGED: "true"}, registry=children)(on_child)
    # The proxies' Pod IPs (the DNS records) as the headless Services' EndpointSlices report them.
    kopf.on.event("discovery.k8s.io", "v1", "endpointslices", registry=children)(on_dns(CHILDREN))

    async def on_group_pod(body: Any, **kw: Any) -> None:
        """A ProxyGroup replica's Pod started, got its IPs or began terminating: its EndpointSlice membership."""
        attach(CHILDREN, kw)
        key = child_key(body)
        if key is not None and KINDS[key[0]].runs == GROUP:
            state.queue.poke(key)
    kopf.on.event("v1", "pods", labels={LABEL_MANAGED: "true", LABEL_PARENT_TYPE: PROXYGROUP},
                  registry=children)(on_group_pod)
    # The proxies' ServiceAccounts, Roles and RoleBindings are watched for the cache only (their pass is brought
    # by the StatefulSet's and Secret's events): the Roles and RoleBindings have indexes and no handler (each
    # handler call is kopf's machinery for every event, two of a new Service's nine); a ServiceAccount always
    # exists in the namespace (the controller's own), so the handler of the ServiceAccounts makes this operator
    # call a handler once its indexes are filled.
    async def on_cached(body: Any, **kw: Any) -> None:
        attach(CHILDREN, kw)
    kopf.on.event("v1", "serviceaccounts", registry=children)(on_cached)
    if state.cache is not None:
        cache = state.cache
        for w in WATCHED:
            def indexer(res=w.res):
                async def index(body: Any, **_: Any) -> dict:
                    cache.seen(res, body)
                    entries = index_entries(body)
                    cache.indexed(res.plural, relist.source(body))
                    # kopf holds the event's object until the handlers have run and the object's worker has
                    # idled: only what they read of it is left (controller.relist.shrink)
                    relist.shrink(body, res.plural)
                    return entries
                return index
            group, _, version = w.res.prefix.removeprefix("/apis/").removeprefix("/api/").rpartition("/")
            kopf.index(group or None, version, w.res.plural, id=w.index_id,
                       registry=parents if w.operator == PARENTS else children)(indexer())
    return parents, children


class RetryForever:
    """kopf's error backoffs: 1, 1, 2, 3 s, then every 5 s for as long as it takes. With kopf's default (eight
    backoffs, 54 s in all) a watch gives up during a longer API-server outage and kopf stops; this controller keeps
    its watches through one (`controller.leader`: fenced, not restarted), and they resume within 5 s of the
    server's return (an attempt on a server that is down is a refused connection: cheap; the log lines are
    folded, `controller.logfold`)."""

    def __iter__(self) -> Iterator[float]:
        yield from (1, 1, 2, 3)
        while True:
            yield 5


class NoDiffBase(kopf.DiffBaseStorage):
    """No "last handled" state for kopf's change detection. kopf builds it for every event it processes (a deep
    copy of the object, then a diff against the one before), but only creation/update handlers read it, and this
    controller has none: event handlers and indexes only. That copy was about 5 % of the controller's CPU with
    500 Services coming at once (docs/benchmarks.md)."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: Any) -> Any:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


#: the objects per page of a watch's listing (`limit`, then `continue`): a listing is read, parsed and handed on a
#: page at a time instead of all at once (client-go's reflector pages by 500 too)
LIST_PAGE = 500


#: how long kopf keeps an object's worker after its last event (kopf's default: 5 s); the worker holds that event
#: parsed meanwhile, so a listing of thousands of objects would be held whole for that long
WORKER_IDLE = 0.5


#: how long a watch stream may stay silent before it is taken for dead and reconnected: the API server's watch
#: cache sends a bookmark about every 60 s, so 70 s (kopf's default, set here so it stays) allows for its jitter
WATCH_SILENCE = 70.0


def settings(child_watch: bool) -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    s.networking.error_backoffs = RetryForever()
    s.posting.enabled = False
    s.persistence.diffbase_storage = NoDiffBase()
    # Each watch's length is the API server's choice: without timeoutSeconds it draws one at random between its
    # --min-request-timeout and twice that (1800-3600 s by default), so the watches started together at start-up
    # do not reconnect together (a fixed length had all of them reconnect in the same minute, every time). A dead
    # stream is not waited for that long: the API server sends a bookmark about every minute, and kopf reconnects
    # a stream silent for WATCH_SILENCE.
    s.watching.server_timeout = None
    s.watching.client_timeout = None
    s.watching.inactivity_timeout = WATCH_SILENCE
    # Nothing to discover while running: kopf resolves the kinds once at its start (API discovery) and lists and
    # watches no CRD. With scanning on, the cluster-wide operator would list and watch every CRD to serve one
    # installed later (a restart would list the CRDs twice, with the ServiceMonitor CRD's watch by name), and the
    # namespaced one would also list and watch every namespace. The controller checks instead that the project's
    # CRDs are installed before kopf starts, and stops if one is removed (controller.crdcheck).
    s.scanning.disabled = True
    s.watching.chunk_size = LIST_PAGE
    s.queueing.idle_timeout = WORKER_IDLE
    if child_watch:
        for plural in ("secrets", "statefulsets", "roles", "rolebindings"):
            s.watching.label_selectors[plural] = f"{LABEL_MANAGED}=true"
        s.watching.label_selectors["pods"] = f"{LABEL_MANAGED}=true,{LABEL_PARENT_TYPE}={PROXYGROUP}"
        s.watching.label_selectors["configmaps"] = f"{apiserverproxy.LABEL}=true"
        # the ServiceMonitor CRD alone (controller.watchcache.WATCHED)
        for w in WATCHED:
            if w.operator == CHILDREN and w.name:
                s.watching.field_selectors[w.res.plural] = w.field_selector
    return s
