"""The verbs every pass shares (shell): apply what differs, events once per problem, finalizers, devices.

One `Writer` per controller, handed to every pass (controller/passes/), so that the rules below hold for all
kinds alike. A rendered object carries the hash of its rendering (`render.SPEC_HASH`): it is created when
missing, merge-patched when the hash differs, left alone when equal. A Secret is compared key by key (its
data is not hashed: the agent writes into it too). A Warning event is sent once per distinct problem of an
object (`warn`), and a problem the object's pass no longer reports is forgotten (`keep_warnings`), so one that
goes and comes back is sent again. A device is deleted from the control plane before its Secret (the Secret
holds its id); its tags are brought to what its parent wants, and re-read after `TAGS_RECHECK`.
"""
from __future__ import annotations

import base64
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tscommon.redact import redact

from . import render
from . import status as st
from .config import ControllerConfig
from .kinds import meta
from .kinds import proxyclass as pcl
from .kindtable import KINDS
from .kubeapi import (
    CLUSTERROLEBINDINGS,
    CONFIGMAPS,
    CRDS,
    EVENTS,
    ROLEBINDINGS,
    ROLES,
    SECRETS,
    SERVICEACCOUNTS,
    SERVICEMONITORS,
    SERVICES,
    STATEFULSETS,
    KubeClient,
    KubeError,
    Resource,
)
from .model import FINALIZER, LABEL_PROXY_GROUP, Parent, ProxySpec
from .providers import Provider, ProviderError

log = logging.getLogger("controller")

#: A device's tags, once seen equal to the wanted ones, are read again after this long (a re-tag by hand in
#: the admin console is undone then); a change of the wanted tags is acted on at the next pass.
TAGS_RECHECK = 3600.0
#: A proxy's own identity (controller/proxyrbac.py), in creation order.
RBAC_RESOURCES = (SERVICEACCOUNTS, ROLES, ROLEBINDINGS)


@dataclass(frozen=True)
class Opened:
    """What `Writer.open` found: the object to reconcile, or None when there is nothing to do for it (it is
    gone, or its deletion was handled); `waiting`: its cleanup waits for something, the pass checks again."""

    obj: Mapping[str, Any] | None
    waiting: bool = False


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def decode(secret: Mapping[str, Any] | None) -> dict[str, bytes] | None:
    """A Secret's data as bytes (None for no Secret)."""
    if secret is None:
        return None
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


def ref(p: Parent) -> str:
    return f"{p.namespace}/{p.name}" if p.namespace else p.name


class Writer:
    def __init__(self, kube: KubeClient, provider: Provider, cfg: ControllerConfig, *,
                 now: Callable[[], str] = now_utc, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.provider, self.cfg, self.now, self.clock = kube, provider, cfg, now, clock
        self.warned: dict[str, set[str]] = {}     # object UID -> problems already sent as events
        self.tags_ok: dict[str, tuple[tuple[str, ...], float]] = {}   # device -> (tags seen equal, when)

    # ---- objects

    async def apply(self, res: Resource, desired: dict) -> dict | None:
        """Create, or merge-patch when the rendering's hash differs; nothing when it is equal."""
        md = desired["metadata"]
        cur = await self.kube.get_own(res, md["name"], md.get("namespace", ""), md.get("labels") or {})
        return await self.apply_known(res, desired, cur)

    async def apply_known(self, res: Resource, desired: dict, cur: Mapping[str, Any] | None) -> dict:
        """`apply` with the object as it is now already read (`cur`)."""
        md = desired["metadata"]
        ns = md.get("namespace", "")
        if cur is None:
            try:
                return await self.kube.create(res, desired, ns)
            except KubeError as e:
                # There after all: made by hand without our labels (a cache knows only what carries them), or
                # not yet seen by the watch. Read it and go on as if it had been read first.
                if e.reason != "AlreadyExists" or (cur := await self.kube.get(res, md["name"], ns)) is None:
                    raise
        if (cur["metadata"].get("annotations") or {}).get(render.SPEC_HASH) == md["annotations"][render.SPEC_HASH]:
            return dict(cur)
        return await self.kube.patch(res, md["name"], desired, ns)

    async def apply_secret(self, desired: dict, cur: Mapping[str, Any] | None, *,
                           state: Mapping[str, bytes] | None = None) -> None:
        """A rendered Secret (stringData): created, or the keys that differ and our labels patched. `state`: a
        device's state taken over from upstream's proxy (controller/adoption.py), written by the same create, so
        the Secret never exists without it."""
        md = desired["metadata"]
        data = {k: base64.b64encode(v.encode()).decode() for k, v in desired["stringData"].items()}
        if cur is None:
            body = {k: v for k, v in desired.items() if k != "stringData"}
            kept = {k: base64.b64encode(v).decode() for k, v in (state or {}).items()}
            await self.kube.create(SECRETS, {**body, "data": {**kept, **data}}, md["namespace"])
            return
        have = cur.get("data") or {}
        changed = {k: v for k, v in data.items() if have.get(k) != v}
        labels_ok = all((cur["metadata"].get("labels") or {}).get(k) == v for k, v in md["labels"].items())
        if changed or not labels_ok:
            await self.kube.patch(SECRETS, md["name"], {"metadata": {"labels": md["labels"]}, "data": changed},
                                  md["namespace"])

    async def patch_status(self, kind: str, obj: Mapping[str, Any], want: Mapping[str, Any]) -> dict | None:
        """The status fields in `want` (already only what differs); nothing when empty."""
        if not want:
            return None
        m = meta(obj)
        return await self.kube.patch(KINDS[kind].resource, m["name"], {"status": dict(want)}, m.get("namespace", ""),
                                     subresource="status")

    def conditions(self, obj: Mapping[str, Any], ctype: str, ok: bool, reason: str, message: str,
                   previous: Sequence[Mapping[str, Any]] | None = None) -> list[dict]:
        """The object's conditions with `ctype` set (its lastTransitionTime kept when the status is unchanged);
        `previous`: the conditions to start from, else the object's."""
        prev = previous if previous is not None else (obj.get("status") or {}).get("conditions")
        cond = st.condition(ctype, ok, reason, message, generation=meta(obj).get("generation"), previous=prev,
                            now=self.now())
        return st.with_condition(prev, cond)

    # ---- finalizers

    async def open(self, kind: str, name: str, namespace: str,
                   cleanup: Callable[[Mapping[str, Any]], Awaitable[bool]]) -> Opened:
        """The opening of a pass of an object that carries our finalizer: read it; when it is being deleted,
        clean up (`cleanup` returns True when done, False while it waits for something, e.g. Pods to go) and
        then drop the finalizer, which lets the deletion complete."""
        obj = await self.kube.get(KINDS[kind].resource, name, namespace)
        if obj is None:
            return Opened(None)
        m = meta(obj)
        if not m.get("deletionTimestamp"):
            return Opened(obj)
        if FINALIZER in (m.get("finalizers") or []):
            if not await cleanup(obj):
                return Opened(None, waiting=True)
            await self.remove_finalizer(kind, obj)
        return Opened(None)

    async def add_finalizer(self, kind: str, obj: Mapping[str, Any]) -> None:
        m = meta(obj)
        fins = list(m.get("finalizers") or [])
        if FINALIZER not in fins:
            await self.kube.patch(KINDS[kind].resource, m["name"], {"metadata": {
                "finalizers": fins + [FINALIZER], "resourceVersion": m.get("resourceVersion")}},
                m.get("namespace", ""))

    async def remove_finalizer(self, kind: str, obj: Mapping[str, Any]) -> None:
        """Our finalizer goes (the object's deletion, if any, completes) and its warned-once memory with it."""
        m = meta(obj)
        fins = [f for f in m.get("finalizers") or [] if f != FINALIZER]
        await self.kube.patch(KINDS[kind].resource, m["name"], {"metadata": {
            "finalizers": fins or None, "resourceVersion": m.get("resourceVersion")}}, m.get("namespace", ""))
        self.warned.pop(m.get("uid", ""), None)

    # ---- events

    def keep_warnings(self, obj: Mapping[str, Any], current: Iterable[str]) -> None:
        """Only what this pass still reports (`reason:message`) stays remembered: a problem that goes and comes
        back is sent again."""
        if (seen := self.warned.get(meta(obj).get("uid", ""))) is not None:
            seen &= set(current)

    async def warn(self, obj: Mapping[str, Any], kind: str, reason: str, message: str, *,
                   etype: str = "Warning") -> None:
        """A Warning (or `etype`) event, once per distinct problem of an object (a pass every few seconds must
        not flood). Cluster-scoped objects' events go to the `default` namespace, as Kubernetes' own."""
        m = meta(obj)
        uid = m.get("uid", "")
        key = f"{reason}:{message}"
        if key in self.warned.get(uid, set()):
            return
        self.warned.setdefault(uid, set()).add(key)
        ns = m.get("namespace") or "default"
        now = self.now()
        info = KINDS[kind]
        ev = {"apiVersion": "v1", "kind": "Event",
              "metadata": {"generateName": f"{m.get('name', 'x')}.", "namespace": ns},
              "involvedObject": {"apiVersion": info.api_version, "kind": info.kind, "name": m.get("name", ""),
                                 "namespace": m.get("namespace", ""), "uid": uid},
              "reason": reason, "message": redact(message), "type": etype,
              "source": {"component": "tailscale-controller"}, "reportingComponent": "tailscale-controller",
              "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        where = f"{m['namespace']}/{m.get('name', '')}" if m.get("namespace") else m.get("name", "")
        log.log(logging.WARNING if etype == "Warning" else logging.INFO, "%s %s: %s", info.kind, where,
                redact(message))
        try:
            await self.kube.create(EVENTS, ev, ns)
        except KubeError as e:
            log.warning("could not record an event: %s", e)

    # ---- devices

    async def auth_keys(self, datas: Sequence[Mapping[str, bytes] | None], tags: tuple[str, ...], who: str,
                        description: str, *, logged_in: Iterable[int] = ()) -> list[str]:
        """Replica i's auth key for its config: a new one where it has none and no device, or where its proxy
        asked for one (its old device deleted first); else the key it has (or "" once it is used). Replicas
        `logged_in` (a device's state taken over: controller/adoption.py) get none. Raises ProviderError."""
        keys: list[str] = []
        skip = set(logged_in)
        for i, data in enumerate(datas):
            action = "omit" if i in skip else st.authkey_action(data)
            if action in ("new", "reissue"):
                if action == "reissue":
                    await self.delete_device_of(data)
                    log.info("%s replica %d asked for a new auth key; issuing one", who, i)
                keys.append(await self.provider.create_auth_key(tags, description=description))
            else:
                keys.append(st.config_authkey(data) if action == "keep" else "")
        return keys

    async def delete_device_of(self, data: Mapping[str, bytes] | None) -> None:
        """The device a state Secret names, deleted from the control plane (nothing when it names none)."""
        dev = (data or {}).get("device_id", b"").decode(errors="replace").strip()
        if dev:
            await self.provider.delete_device(dev)
            self.tags_ok.pop(dev, None)

    async def retire_secrets(self, secrets: Iterable[Mapping[str, Any]]) -> None:
        """Secrets of replicas that are gone: the device each names, then the Secret."""
        for s in secrets:
            await self.delete_device_of(decode(s))
            await self.kube.delete(SECRETS, s["metadata"]["name"], self.cfg.namespace)

    async def sync_tags(self, kind: str, p: Parent, tags: tuple[str, ...],
                        datas: Sequence[Mapping[str, bytes] | None]) -> ProviderError | None:
        """Registered devices get the tags the parent now wants (`tailscale.com/tags`, `spec.tags` or
        PROXY_TAGS): upstream applies tags to newly minted keys only, so a changed annotation left existing
        devices with their old tags. Read, compare as sets, write only when they differ."""
        want = tuple(sorted(set(tags)))
        for data in datas:
            dev = (data or {}).get("device_id", b"").decode(errors="replace").strip()
            if not dev or st.authkey_action(data) == "reissue":
                continue
            ok = self.tags_ok.get(dev)
            if ok is not None and ok[0] == want and self.clock() - ok[1] < TAGS_RECHECK:
                continue
            try:
                have = await self.provider.device_tags(dev)
                if have is None:             # gone, or a provider that cannot tell
                    continue
                if have != want:
                    await self.provider.set_device_tags(dev, want)
                    log.info("%s %s: device %s re-tagged from %s to %s", kind, ref(p), dev, ",".join(have) or "-",
                             ",".join(want))
            except ProviderError as e:
                self.tags_ok.pop(dev, None)
                return ProviderError(f"device tags not applied ({','.join(want)} on device {dev}): {e}",
                                     transient=e.transient)
            self.tags_ok[dev] = (want, self.clock())
        return None

    # ---- the proxies' shared objects

    async def metrics(self, kind: str, spec: ProxySpec, sts: Mapping[str, Any], pc: pcl.ProxyClass | None) -> None:
        """The metrics Service (and a ServiceMonitor) of a class with metrics.enable; removed when no longer
        asked for."""
        p = spec.parent
        name = f"{sts['metadata']['name']}-metrics"
        if pc is not None and pc.metrics:
            svc = render.rehash(pcl.metrics_service(sts, KINDS[kind].proxy_type, p.name, p.namespace))
            await self.apply(SERVICES, svc)
            if pc.service_monitor:
                await self.apply(SERVICEMONITORS, render.rehash(pcl.service_monitor(svc, pc)))
                return
        elif await self.kube.get(SERVICES, name, self.cfg.namespace) is not None:
            await self.kube.delete(SERVICES, name, self.cfg.namespace)
        else:
            return
        await self.delete_service_monitors(p)

    async def delete_service_monitors(self, p: Parent) -> None:
        try:
            for o in await self.kube.list(SERVICEMONITORS, self.cfg.namespace, render.child_selector(p)):
                await self.kube.delete(SERVICEMONITORS, o["metadata"]["name"], self.cfg.namespace)
        except KubeError as e:
            if e.status != 404:          # no ServiceMonitor CRD: there is nothing to delete
                raise

    async def remove_children(self, p: Parent, sel: str, resources: Sequence[Resource], *,
                              cluster: Sequence[Resource] = (),
                              keep: Callable[[Mapping[str, Any]], bool] = lambda o: False) -> bool:
        """A proxy's objects (`sel`): the StatefulSet (foreground: its Pods drain first), then each device and
        the Secrets, then `resources` in the controller's namespace in order (but those `keep` says) and
        `cluster`'s cluster-wide, then its ServiceMonitors. True when done; False while the Pods are going."""
        ns = self.cfg.namespace
        stss = await self.kube.list(STATEFULSETS, ns, sel)
        if stss:
            for s in stss:
                if not s["metadata"].get("deletionTimestamp"):
                    await self.kube.delete(STATEFULSETS, s["metadata"]["name"], ns, propagation="Foreground")
            return False
        await self.retire_secrets(await self.kube.list(SECRETS, ns, sel))
        for res in resources:
            for o in await self.kube.list(res, ns, sel):
                if not keep(o):
                    await self.kube.delete(res, o["metadata"]["name"], ns)
        for res in cluster:
            for o in await self.kube.list(res, "", sel):
                await self.kube.delete(res, o["metadata"]["name"])
        if await self.kube.get(CRDS, pcl.SERVICE_MONITOR_CRD) is not None:
            await self.delete_service_monitors(p)
        return True

    async def remove_proxy(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """A parent's single proxy: StatefulSet (foreground), then each device, the Secrets, the headless
        Service, the proxy's ServiceAccount, Role and RoleBinding (its Pods are gone by then), and its
        ClusterRoleBinding if its kind has one, and the Role and RoleBinding for a TLS Secret in the parent's
        namespace if its kind has them. True when done."""
        info, m = KINDS[kind], meta(obj)
        p = Parent(kind, m.get("name", ""), info.parent_namespace(obj), m.get("uid", ""))
        done = await self.remove_children(
            p, render.child_selector(p), (SERVICES, *reversed(RBAC_RESOURCES)),
            cluster=(CLUSTERROLEBINDINGS,) if info.cluster_binding else (),
            # a ProxyGroup egress Service's ClusterIP Service is the egress pass's (EgressPass.cleanup_service)
            keep=lambda o: bool((o["metadata"].get("labels") or {}).get(LABEL_PROXY_GROUP)))
        if done and info.tls_role and p.namespace != self.cfg.namespace:
            # the Role and RoleBinding that let the proxy read the user's TLS Secret (proxyrbac.tls_secret_access)
            for res in (ROLEBINDINGS, ROLES):
                for o in await self.kube.list(res, p.namespace, render.child_selector(p)):
                    await self.kube.delete(res, o["metadata"]["name"], p.namespace)
        if done:
            log.info("%s %s: proxy removed", kind, ref(p))
        return done

    async def ca_trust_problem(self) -> str:
        """Why PROXY_CA_CONFIGMAP's ConfigMap cannot give the proxies the control server's CA ("" when it can, when
        the setting is unset, and when the ConfigMap cannot be read: a controller without `get` on ConfigMaps goes
        on, and the kubelet's event names a missing one)."""
        if not self.cfg.proxy_ca_configmap:
            return ""
        try:
            cm = await self.kube.get(CONFIGMAPS, self.cfg.proxy_ca_configmap, self.cfg.namespace)
        except KubeError as e:
            if e.status not in (401, 403):
                raise
            log.debug("ConfigMap %s not readable (%s): not checked", self.cfg.proxy_ca_configmap, e)
            return ""
        return render.ca_trust_problem(self.cfg, cm)
