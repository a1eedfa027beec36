"""The controller's read cache: kopf's own indexes, filled by the watches kopf runs, behind the API client (shell).

Every kind the controller watches (`WATCHED`: the parents cluster-wide, the proxies' objects in the controller's
namespace, selected on the server by their label, and the ServiceMonitor CRD alone, by its name) gets a kopf
index (`@kopf.index`, registered by `controller.handlers`), keyed by name, by namespace and by each label pair,
holding the object without its `managedFields`. The first handler call of each operator hands its indexes over
(`attach`); each operator is sure to have one, from an object that always exists: the API server's own
`kubernetes` Service in `default` for the cluster-wide one, the ServiceAccounts of the controller's namespace (its
own and `default`) for the namespaced one. An operator's indexes are complete (`synced`) once every watched kind of
it has ended its first listing and kopf has indexed every object of it: the cache counts them
(`count_listings`), as kopf runs each object's handlers as soon as it is indexed (`controller.kopfready`).
Without the count (the unit tests' set-up), kopf's own rule holds: it runs no handler of an operator before its
indexes are filled, so the first handler call is that moment.

`CachedKube` is the API client the passes use: reads of what is watched come from the indexes, everything else
(and everything before its operator is synced) from the API server; writes go to the API server, and what they
answer is kept (`overlay`) until the watch brings that version or a newer one, so a pass never reads back an
older object than it wrote. A few single objects nobody watches are polled, once for every pass
(`CachedKube.poll`): the proxies' namespace (its Pod Security level), the CA ConfigMap, the static key's
Secret. The ServiceMonitor CRD is watched rather than polled: a ProxyClass refused for its absence is judged
again as soon as it is installed (`controller.handlers` queues the classes on its events). An object whose
watch is selected by a label is found in the index only when it carries that label: a miss there is read from
the API server (a user's Secret), except for an object the controller renders with the label itself
(`get_own`): a miss is then "absent", and an object made by hand under that name meets a create's 409, after
which the writer reads it and adopts it.
"""
from __future__ import annotations

import asyncio
import builtins
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .kinds import apiserverproxy
from .kinds.proxyclass import SERVICE_MONITOR_CRD
from .kubeapi import (
    CONFIGMAPS,
    CONNECTORS,
    CRDS,
    DNSCONFIGS,
    ENDPOINTSLICES,
    INGRESSES,
    PODS,
    PROXYCLASSES,
    PROXYGROUPS,
    RECORDERS,
    ROLEBINDINGS,
    ROLES,
    SECRETS,
    SERVICEACCOUNTS,
    SERVICES,
    STATEFULSETS,
    KubeClient,
    Resource,
)
from .model import LABEL_MANAGED, LABEL_PARENT_NS, LABEL_PARENT_TYPE, PROXYGROUP

log = logging.getLogger("controller")

#: the two kopf operators (controller.handlers): cluster-wide parents, the children in the controller's namespace
PARENTS, CHILDREN = "parents", "children"
#: how long the passes wait for both operators' first listings before reading the API server instead
SYNC_TIMEOUT = 60.0
#: how long what a write answered is read back at most without the watch bringing it (seconds)
OVERLAY_TTL = 60.0


@dataclass(frozen=True)
class Watched:
    """A kind kopf watches, its index, and what its watch selects."""

    res: Resource
    operator: str
    selector: tuple[tuple[str, str], ...] = ()     # the watch's label selector (equalities); () selects all
    name: str = ""      # the one object the watch selects (field selector metadata.name); "" selects all

    def covers(self, name: str) -> bool:
        """A read of `name` can be answered by this watch (a miss is then absence, or a miss of the selector)."""
        return not self.name or name == self.name

    @property
    def index_id(self) -> str:
        """The kopf index's id, which is also the keyword kopf hands it to handlers with."""
        return f"cache_{self.res.plural}"

    @property
    def selector_text(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.selector)

    @property
    def field_selector(self) -> str:
        return f"metadata.name={self.name}" if self.name else ""


_MANAGED = ((LABEL_MANAGED, "true"),)
WATCHED: tuple[Watched, ...] = (
    Watched(SERVICES, PARENTS), Watched(INGRESSES, PARENTS), Watched(CONNECTORS, PARENTS),
    Watched(PROXYGROUPS, PARENTS), Watched(PROXYCLASSES, PARENTS), Watched(RECORDERS, PARENTS),
    Watched(DNSCONFIGS, PARENTS),
    Watched(SECRETS, CHILDREN, _MANAGED), Watched(STATEFULSETS, CHILDREN, _MANAGED),
    Watched(ROLES, CHILDREN, _MANAGED), Watched(ROLEBINDINGS, CHILDREN, _MANAGED),
    # every ServiceAccount of the namespace: the controller's own is always there, so the namespaced operator
    # always has an object to call a handler for once its indexes are filled (`synced`)
    Watched(SERVICEACCOUNTS, CHILDREN),
    Watched(PODS, CHILDREN, (*_MANAGED, (LABEL_PARENT_TYPE, PROXYGROUP))),
    Watched(ENDPOINTSLICES, CHILDREN),
    Watched(CONFIGMAPS, CHILDREN, ((apiserverproxy.LABEL, "true"),)),
    # whether a class may ask for a ServiceMonitor; with the namespaced operator, whose scanning of CRDs is off
    # (the cluster-wide one's would see this selector too)
    Watched(CRDS, CHILDREN, name=SERVICE_MONITOR_CRD),
)


#: what the cache leaves out of every object: nothing in the controller reads them, and they are often the
#: largest part of an object (kubectl apply's copy of the whole object in an annotation)
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"

#: labels not worth an index entry of their own: shared by nearly every object of a kind (a selector naming one
#: is answered from a more selective label it names too, or from the namespace's objects)
UNINDEXED_LABELS = frozenset({LABEL_MANAGED, LABEL_PARENT_TYPE, LABEL_PARENT_NS})


def slim(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object as the cache keeps it: without `metadata.managedFields` and kubectl's last-applied
    annotation."""
    md = obj.get("metadata") or {}
    out = dict(obj)
    ann = md.get("annotations") or {}
    if "managedFields" in md or LAST_APPLIED in ann:
        out["metadata"] = {k: v for k, v in md.items() if k != "managedFields"}
        if LAST_APPLIED in ann:
            out["metadata"]["annotations"] = {k: v for k, v in ann.items() if k != LAST_APPLIED}
    return out


@dataclass(frozen=True, slots=True)
class Cached:
    """One watched object as the cache holds it: its identity and labels (for lookups and selectors), the rest
    as compact JSON, parsed again for each read (`obj`). Parsed JSON costs about five times its text in Python
    objects (a proxy's StatefulSet: 3 KB of JSON, 17 KB parsed), and every read hands out a copy of its own
    anyway, which parsing makes as fast as a deep copy would."""

    namespace: str
    name: str
    rv: int
    labels: tuple[tuple[str, str], ...]
    raw: bytes

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> "Cached":
        s = slim(obj)
        md = s.get("metadata") or {}
        # interned: the same namespace, name and label strings are shared by an object's index keys and by the
        # objects of one parent
        labels = tuple((sys.intern(str(k)), sys.intern(str(v))) for k, v in (md.get("labels") or {}).items())
        return cls(sys.intern(md.get("namespace") or ""), sys.intern(md.get("name") or ""), resource_version(s),
                   labels, json.dumps(s, separators=(",", ":")).encode())

    def obj(self) -> dict[str, Any]:
        """A copy of the object, the caller's own."""
        out: dict[str, Any] = json.loads(self.raw)
        return out

    def has_labels(self, want: Mapping[str, str]) -> bool:
        have = dict(self.labels)
        return all(have.get(k) == v for k, v in want.items())


def index_entries(obj: Mapping[str, Any]) -> dict[tuple[str, ...], Cached]:
    """What a kopf index handler returns for one object: the object (`Cached`) under its name, its namespace and
    each of its selective labels (one shared value)."""
    c = Cached.of(obj)
    out: dict[tuple[str, ...], Cached] = {("n", c.namespace, c.name): c, ("ns", c.namespace): c}
    for k, v in c.labels:
        if k not in UNINDEXED_LABELS:
            out[("l", k, v)] = c
    return out


def parse_selector(selector: str) -> dict[str, str] | None:
    """A label selector made of equalities (`a=b,c=d`) as a dict; None for anything else (set-based, `!=`)."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in selector.split(",") if p.strip()):
        if "!" in part or "(" in part or " " in part:
            return None
        k, sep, v = part.partition("==") if "==" in part else part.partition("=")
        if not sep:
            return None
        out[k] = v
    return out


def resource_version(obj: Mapping[str, Any] | None) -> int:
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0


def merge_patch(target: Any, patch: Any) -> Any:
    """`patch` applied to `target` as the API server applies a JSON merge patch (RFC 7386); a new value."""
    if not isinstance(patch, Mapping):
        return patch
    out = dict(target) if isinstance(target, Mapping) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


#: what changes with any write, besides what it sends
_VOLATILE = frozenset({"resourceVersion", "generation", "managedFields"})


def _essence(obj: Mapping[str, Any]) -> dict[str, Any]:
    s = slim(obj)
    return {**s, "metadata": {k: v for k, v in (s.get("metadata") or {}).items() if k not in _VOLATILE}}


def echo_key(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    md = obj.get("metadata") or {}
    return (str(obj.get("kind") or ""), md.get("namespace") or "", md.get("name") or "")


def copy_json(o: Any) -> Any:
    """A copy of a JSON value (dicts, lists, scalars): what a pass gets is its own, the cache's stays as it was."""
    if isinstance(o, dict):
        return {k: copy_json(v) for k, v in o.items()}
    if isinstance(o, list):
        return [copy_json(v) for v in o]
    return o


@dataclass
class WatchCache:
    """The indexes kopf fills (handed over by the first handler call of each operator) and the objects written
    since that the watch has not brought yet (`overlay`: resource plural -> (namespace, name) ->
    (resourceVersion, object or None once deleted, when, the version the index held then or 0))."""

    namespace: str
    clock: Callable[[], float] = time.monotonic
    indices: dict[str, Any] = field(default_factory=dict)
    overlay: dict[str, dict[tuple[str, str], tuple[int, Cached | None, float, int]]] = field(default_factory=dict)
    synced_ops: set[str] = field(default_factory=set)
    #: the controller's own writes whose answer is exactly what the pass knew plus what it sent: (kind, namespace,
    #: name) -> {resourceVersion: when}. Their watch events bring no new pass (`own_write`).
    echoes: dict[tuple[str, str, str], dict[int, float]] = field(default_factory=dict)
    _echoes_limit: int = 256
    _overlay_limit: dict[str, int] = field(default_factory=dict)
    _events: dict[str, asyncio.Event] = field(default_factory=dict)
    _warned: bool = False
    #: kopf runs each object's handlers as soon as it is indexed (`controller.kopfready`), so a handler's call no
    #: longer means its operator's indexes are filled: the first listings are counted instead (`listed`,
    #: `listing_ended`, `indexed`). False: kopf's own wait, the first handler call is the moment (`attach`).
    count_listings: bool = False
    #: kind plural -> the objects of its first listing not indexed yet (by identity: kopf's own event objects)
    _unindexed: dict[str, set[int]] = field(default_factory=dict)
    #: the kinds whose first listing has ended
    _listed: set[str] = field(default_factory=set)
    _attached: set[str] = field(default_factory=set)

    def _event(self, operator: str) -> asyncio.Event:
        return self._events.setdefault(operator, asyncio.Event())

    def attach(self, operator: str, kwargs: Mapping[str, Any]) -> None:
        """A handler of `operator` was called: its indexes come in `kwargs` (filled, unless `count_listings`)."""
        if operator in self._attached:
            return
        for w in WATCHED:
            if w.operator == operator and (idx := kwargs.get(w.index_id)) is not None:
                self.indices[w.index_id] = idx
        self._attached.add(operator)
        self._check(operator)

    def listed(self, plural: str, obj: object) -> None:
        """The first listing of a watched kind yielded `obj` (kopf's own event object, which it indexes next)."""
        if plural not in self._listed:
            self._unindexed.setdefault(plural, set()).add(id(obj))

    def listing_ended(self, plural: str) -> None:
        """The first listing of a watched kind has ended (every object of it yielded)."""
        if plural not in self._listed:
            self._listed.add(plural)
            self._unindexed.setdefault(plural, set())
            self._check_kind(plural)

    def indexed(self, plural: str, obj: object) -> None:
        """kopf has indexed `obj` (the index handler, with kopf's own event object)."""
        pending = self._unindexed.get(plural)
        if pending:
            pending.discard(id(obj))
            if not pending:
                self._check_kind(plural)

    def _check_kind(self, plural: str) -> None:
        for op in {w.operator for w in WATCHED if w.res.plural == plural}:
            self._check(op)

    def _filled(self, operator: str) -> bool:
        if not self.count_listings:
            return True
        return all(w.res.plural in self._listed and not self._unindexed.get(w.res.plural)
                   for w in WATCHED if w.operator == operator)

    def _check(self, operator: str) -> None:
        if operator in self.synced_ops or operator not in self._attached or not self._filled(operator):
            return
        self.synced_ops.add(operator)
        self._event(operator).set()
        log.debug("watch cache: the %s operator's indexes are filled", operator)

    async def wait_synced(self, timeout: float = SYNC_TIMEOUT) -> None:
        """Until both operators' indexes are filled (or `timeout`: reads then go to the API server)."""
        missing = [op for op in (PARENTS, CHILDREN) if op not in self.synced_ops]
        if not missing:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*(self._event(op).wait() for op in missing)), timeout)
        except asyncio.TimeoutError:
            if not self._warned:
                self._warned = True
                log.warning("watch cache: the %s watches not listed after %.0fs; reading the API server meanwhile",
                            " and ".join(op for op in missing if op not in self.synced_ops), timeout)

    def watched(self, res: Resource, namespace: str) -> Watched | None:
        """The kind's watch if its index is complete and covers `namespace` ("" = every namespace). An index
        handed over before its operator's listings are all indexed is not read (the API server is, meanwhile)."""
        for w in WATCHED:
            if w.res == res:
                if w.index_id not in self.indices or w.operator not in self.synced_ops:
                    return None
                if w.operator == CHILDREN and res.namespaced and namespace != self.namespace:
                    return None
                return w
        return None

    # ---- reads

    def _fresh(self, plural: str, key: tuple[str, str], found: Cached | None) -> Cached | None:
        """The newer of the index's object and the one last written."""
        mine = self.overlay.get(plural, {}).get(key)
        if mine is None:
            return found
        rv, obj, when, over = mine
        if found is not None and found.rv >= rv:
            return found
        if obj is not None and over and found is None:
            # Written over an object the index held, which no longer holds it: the watch showed it deleted since
            # (kopf drops a deleted object from its indexes without calling the index handler, `seen`, and folds
            # the events of one object that come close together, so the written version may never be seen).
            del self.overlay[plural][key]
            return None
        if self.clock() - when > OVERLAY_TTL:
            # A write the watch never brought (created and deleted before it listed either): by now the watch has
            # shown what happened since.
            del self.overlay[plural][key]
            return found
        return obj

    def lookup(self, w: Watched, namespace: str, name: str) -> Cached | None:
        ns = namespace if w.res.namespaced else ""
        idx = self.indices[w.index_id]
        found = next(iter(idx[("n", ns, name)]), None) if ("n", ns, name) in idx else None
        return self._fresh(w.res.plural, (ns, name), found)

    def select(self, w: Watched, namespace: str, labels: Mapping[str, str]) -> list[Cached]:
        idx = self.indices[w.index_id]
        # the smallest set among the selector's indexed labels (a parent's name rather than the managed label)
        keys = [("l", k, v) for k, v in labels.items() if k not in UNINDEXED_LABELS]
        candidates: Iterable[Cached]
        if keys:
            if all(k in idx for k in keys):
                smallest = min(keys, key=lambda k: len(idx[k]))
                candidates = list(idx[smallest])
            else:
                candidates = ()
        elif namespace or not w.res.namespaced:
            key = ("ns", namespace if w.res.namespaced else "")
            candidates = list(idx[key]) if key in idx else ()
        else:
            candidates = [o for k in list(idx) if k[0] == "ns" for o in idx[k]]
        found: dict[tuple[str, str], Cached | None] = {}
        for c in candidates:
            found[(c.namespace, c.name)] = c
        for written in self.overlay.get(w.res.plural, {}):     # written since, not yet seen by the watch
            if written not in found:
                found[written] = self._index_object(w, written)
        out = []
        for (ns, name), o in sorted(found.items()):
            if namespace and w.res.namespaced and ns != namespace:
                continue
            o2 = self._fresh(w.res.plural, (ns, name), o)
            if o2 is not None and o2.has_labels(labels):
                out.append(o2)
        return out

    def names(self, res: Resource) -> list[str]:
        """The names of a cluster-scoped kind's objects, as the watch has them ([] before it has listed)."""
        w = self.watched(res, "")
        return [o.name for o in self.select(w, "", {})] if w else []

    def _index_object(self, w: Watched, key: tuple[str, str]) -> Cached | None:
        idx = self.indices[w.index_id]
        k = ("n", *key)
        return next(iter(idx[k]), None) if k in idx else None

    # ---- what the watches bring, what writes answer

    def seen(self, res: Resource, obj: Mapping[str, Any]) -> None:
        """The watch brought `obj` (called by the index handler): a write it covers need not be kept."""
        mine = self.overlay.get(res.plural)
        if not mine:
            return
        md = obj.get("metadata") or {}
        key = ((md.get("namespace") or "") if res.namespaced else "", md.get("name") or "")
        if (entry := mine.get(key)) is not None and resource_version(obj) >= entry[0]:
            del mine[key]

    def _keep(self, res: Resource, key: tuple[str, str], entry: tuple[int, Cached | None, float, int]) -> None:
        mine = self.overlay.setdefault(res.plural, {})
        mine[key] = entry
        # A deletion the watch ended, or a write it somehow never brought: forgotten after a minute (the watch
        # has long shown what happened since).
        now = entry[2]
        if len(mine) > self._overlay_limit.get(res.plural, 64):
            for k in [k for k, e in mine.items() if now - e[2] > OVERLAY_TTL]:
                del mine[k]
            # looked at again when twice as many: a burst of writes costs no scan per write
            self._overlay_limit[res.plural] = max(64, 2 * len(mine))

    def remember(self, res: Resource, obj: Mapping[str, Any] | None) -> None:
        """What a write answered: read back until the watch brings it (or something newer)."""
        if not isinstance(obj, Mapping) or not (obj.get("metadata") or {}).get("name"):
            return
        w = next((w for w in WATCHED if w.res == res), None)
        md = obj["metadata"]
        labels = md.get("labels") or {}
        if w is None or not all(labels.get(k) == v for k, v in w.selector):
            return          # not watched: the next read asks the API server anyway
        key = ((md.get("namespace") or "") if res.namespaced else "", md["name"])
        if md.get("deletionTimestamp") and not md.get("finalizers"):
            # the last finalizer removed from an object being deleted: the answer is its last version, it is gone
            self._keep(res, key, (resource_version(obj) + 1, None, self.clock(), 0))
            return
        held = self._index_object(w, key) if w.index_id in self.indices else None
        if held is not None and held.rv >= resource_version(obj):
            return          # the watch brought it (or newer) already: the index answers
        self._keep(res, key, (resource_version(obj), Cached.of(obj), self.clock(), held.rv if held is not None else 0))

    def wrote(self, answer: Mapping[str, Any], before: Mapping[str, Any] | None, patch: Mapping[str, Any] | None,
              ) -> None:
        """A write's `answer`: when it is `before` (what the cache held when it was sent; None for a create) with
        `patch` applied and nothing else changed, its watch event will only echo it (`own_write`)."""
        if not isinstance(answer, Mapping) or not resource_version(answer):
            return
        if patch is not None and (before is None or
                                  _essence(merge_patch(before, patch)) != _essence(answer)):
            return          # somebody else's change came with it: its event brings a pass
        now = self.clock()
        mine = self.echoes.setdefault(echo_key(answer), {})
        mine[resource_version(answer)] = now
        if len(self.echoes) > self._echoes_limit:   # events never seen (a watch restarted meanwhile): forgotten
            for k in [k for k, v in self.echoes.items() if all(now - t > 60.0 for t in v.values())]:
                del self.echoes[k]
            # looked at again when twice as many: a burst of writes costs no scan per write
            self._echoes_limit = max(256, 2 * len(self.echoes))

    def own_write(self, event_type: str | None, body: Mapping[str, Any]) -> bool:
        """The watch event of `body` shows the controller's own write and nothing else (`wrote`): the pass that
        wrote it knew all of it, so none other is needed. Every other event is news."""
        key = echo_key(body)
        mine = self.echoes.get(key)
        if not mine or event_type == "DELETED":
            return False
        rv = resource_version(body)
        hit = mine.pop(rv, None) is not None
        for older in [r for r in mine if r < rv]:
            del mine[older]
        if not mine:
            del self.echoes[key]
        return hit

    def forget(self, res: Resource, namespace: str, name: str) -> None:
        """A deleted object: absent until the watch shows a newer version (a finalizer's deletionTimestamp) or its
        end."""
        w = next((w for w in WATCHED if w.res == res), None)
        if w is None or w.index_id not in self.indices:
            return
        ns = namespace if res.namespaced else ""
        cur = self.lookup(w, ns, name)
        # hidden until a version newer than the last one known (every later write has a higher one)
        self._keep(res, (ns, name), ((cur.rv if cur is not None else 0) + 1, None, self.clock(), 0))


class CachedKube:
    """The API client of the passes (`kubeapi.KubeClient`): watched reads from `WatchCache`, the rest from the
    API server; `poll` (resource plural, or (plural, namespace, name)) -> seconds: single objects read at most
    once in that long for every pass together."""

    def __init__(self, kube: KubeClient, cache: WatchCache,
                 poll: Mapping[str | tuple[str, str, str], float] | None = None) -> None:
        self.kube, self.cache = kube, cache
        self.poll = dict(poll or {})
        self._polled: dict[tuple[str, str, str], tuple[float, dict | None]] = {}
        self._polling: dict[tuple[str, str, str], asyncio.Future] = {}

    async def get(self, res: Resource, name: str, namespace: str = "") -> dict | None:
        w = self.cache.watched(res, namespace)
        if w is not None and w.covers(name):
            found = self.cache.lookup(w, namespace, name)
            if found is not None:
                return found.obj()
            if not w.selector:
                return None
        return await self._read(res, name, namespace)

    async def get_own(self, res: Resource, name: str, namespace: str, labels: Mapping[str, str]) -> dict | None:
        """An object the controller renders with `labels`: when those include its watch's selector, a miss in the
        index is absence (no read)."""
        w = self.cache.watched(res, namespace)
        if w is not None and w.covers(name) and all(labels.get(k) == v for k, v in w.selector):
            found = self.cache.lookup(w, namespace, name)
            return found.obj() if found is not None else None
        return await self.get(res, name, namespace)

    async def _read(self, res: Resource, name: str, namespace: str) -> dict | None:
        key = (res.plural, namespace if res.namespaced else "", name)
        ttl = self.poll.get(key, self.poll.get(res.plural))
        if ttl is None:
            return await self.kube.get(res, name, namespace)
        now = self.cache.clock()
        if (hit := self._polled.get(key)) is not None and now - hit[0] < ttl:
            return copy_json(hit[1])
        if (pending := self._polling.get(key)) is not None:      # another pass is reading it now: share it
            return copy_json(await asyncio.shield(pending))
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._polling[key] = fut
        try:
            obj = await self.kube.get(res, name, namespace)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()          # retrieved: the passes sharing it see it raised
            raise
        finally:
            self._polling.pop(key, None)
        self._polled[key] = (now, obj)
        fut.set_result(obj)
        return copy_json(obj)

    async def list(self, res: Resource, namespace: str = "", selector: str = "") -> list[dict]:
        w = self.cache.watched(res, namespace)
        labels = parse_selector(selector)
        if w is None or w.name or labels is None or not all(labels.get(k) == v for k, v in w.selector):
            return await self.kube.list(res, namespace, selector)
        return await self._confirm_going(res, [o.obj() for o in self.cache.select(w, namespace, labels)])

    async def _confirm_going(self, res: Resource, objs: Iterable[dict]) -> "builtins.list[dict]":
        """Objects being deleted (a deletionTimestamp: a proxy's StatefulSet in a foreground deletion, whose Pods
        go first) are read from the API server: a pass that waits for one to be gone (before a proxy's devices,
        Secrets and RBAC, and the parent's finalizer) then learns its end from the server, not only from the watch
        (whose event may come late: after an API server restart, a watch reconnecting under load). One GET per
        such object per pass, only while deletions are in progress; a gone one is hidden until the watch says
        more, as after a delete."""
        out: builtins.list[dict] = []
        for o in objs:
            md = o.get("metadata") or {}
            if md.get("deletionTimestamp"):
                ns = md.get("namespace") or ""
                fresh = await self.kube.get(res, md.get("name") or "", ns)
                if fresh is None:
                    self.cache.forget(res, ns, md.get("name") or "")
                    continue
                o = fresh
            out.append(o)
        return out

    async def create(self, res: Resource, obj: Mapping[str, Any], namespace: str = "") -> dict:
        out = await self.kube.create(res, obj, namespace)
        self.cache.remember(res, out)
        self.cache.wrote(out, None, None)
        return out

    async def patch(self, res: Resource, name: str, patch: Mapping[str, Any], namespace: str = "",
                    subresource: str = "") -> dict:
        w = self.cache.watched(res, namespace)
        before = self.cache.lookup(w, namespace, name) if w is not None and w.covers(name) else None
        out = await self.kube.patch(res, name, patch, namespace, subresource)
        self.cache.remember(res, out)
        if before is not None:
            self.cache.wrote(out, before.obj(), patch)
        return out

    async def delete(self, res: Resource, name: str, namespace: str = "", *, propagation: str = "") -> bool:
        out = await self.kube.delete(res, name, namespace, propagation=propagation)
        if propagation != "Foreground":
            # A foreground deletion leaves the object (its dependents go first): the watch shows it going, and a
            # pass waiting for it to be gone (the proxy's StatefulSet before its devices and finalizer) must not
            # see it gone any sooner.
            self.cache.forget(res, namespace, name)
        return out
