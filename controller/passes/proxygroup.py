"""The ProxyGroup pass (shell around the pure `kinds.proxygroup`, `pgrender` and `kinds.egress`).

The group's pass: auth keys (one per new replica, never again for a replica that has its config or a device),
the ConfigMap, per-replica config and state Secrets, the group's own ServiceAccount/Role/RoleBinding, the
StatefulSet, all with the group's ProxyClass merged in (spec.proxyClass or PROXY_DEFAULT_CLASS; nothing is
made or changed while it is missing or invalid), and its metrics Service when the class asks; replicas scaled
away lose their device and Secrets once their Pod is gone; the status lists the devices from the state Secrets;
and every egress Service's EndpointSlices are brought to what the replicas report (their state Secrets'
`egress-services`), so one replica's change costs one pass of the group. The egress Services themselves have
their own pass (controller/passes/egress.py), which uses `replicas` from here. On the leader, a replica that
stops answering the controller's health probes (controller/replicaprober.py) leaves them within seconds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from tscommon import pgcontract as pgc
from tscommon import secretcontract as sc

from .. import pgrender, render
from .. import status as st
from ..kinds import egress, meta, proxygroup
from ..kinds import proxyclass as pcl
from ..kinds.egress import Replica
from ..kubeapi import CONFIGMAPS, ENDPOINTSLICES, PODS, SECRETS, SERVICES, STATEFULSETS
from ..model import (
    COND_PG_AVAILABLE,
    COND_PG_READY,
    LABEL_PARENT_NAME,
    LABEL_PARENT_NS,
    PROXYGROUP,
    SVC,
    Invalid,
    Parent,
)
from ..providers import ProviderError
from ..replicaprober import ReplicaProber, Target, target_of
from ..sameness import same
from ..writer import RBAC_RESOURCES, Writer, decode
from .proxyclass import class_state

log = logging.getLogger("controller")

PENDING_RECHECK = 60.0
#: a group waiting for PROXY_CA_CONFIGMAP's ConfigMap (not watched: one GET)
CA_RECHECK = 10.0
READY_RECHECK = 600.0
RETIRING_RECHECK = 2.0


def group_labels(name: str) -> dict[str, str]:
    return render.child_labels(Parent(PROXYGROUP, name, "", ""))


def group_selector(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in group_labels(name).items())


async def replicas(w: Writer, group: str, pods: list[dict] | None = None,
                   secrets: Mapping[str, Mapping[str, Any]] | None = None, *,
                   prober: ReplicaProber | None = None) -> list[Replica]:
    """The group's replicas as the EndpointSlices need them (`pods` and `secrets`: already read). With the
    leader's `prober`, its live replicas are the probe's candidates, and one it no longer hears has no address."""
    kube, ns = w.kube, w.cfg.namespace
    sel = group_selector(group)
    if pods is None:
        pods = await kube.list(PODS, ns, sel)
    if secrets is None:
        secrets = {s["metadata"]["name"]: s for s in await kube.list(SECRETS, ns, sel)}
    lives = {p["metadata"]["name"]: _live(p) for p in pods}
    # A replica the controller's own probe no longer hears (its node lost, long before the node lifecycle
    # controller marks its Pod not Ready) leaves them too (controller.replicahealth).
    probed = {p["metadata"]["name"]: target_of(p) for p in pods if lives[p["metadata"]["name"]]}
    answering: frozenset[Target] = frozenset()
    if prober is not None:
        prober.track(group, (t for t in probed.values() if t is not None))
        answering = prober.serving(t for t in probed.values() if t is not None)
    out = []
    for p in pods:
        name = p["metadata"]["name"]
        t = probed.get(name)
        live = lives[name] and (prober is None or t is None or t in answering)
        ips = tuple(a["ip"] for a in (p.get("status") or {}).get("podIPs") or [] if a.get("ip")) if live else ()
        data = decode(secrets.get(name)) or {}
        out.append(Replica(name, ips, egress.parse_status(data.get(sc.KEY_EGRESS_SERVICES))))
    return out


def _live(pod: Mapping[str, Any]) -> bool:
    """A terminating Pod leaves the EndpointSlices at once: that is what its pre-stop drain waits for. A Pod
    that is not Ready (its tailscaled down, its container restarting, its node lost) leaves them too, until its
    readiness probe passes again."""
    pst = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in pst.get("conditions") or [])
    return not pod["metadata"].get("deletionTimestamp") and pst.get("phase") == "Running" and ready


class ProxyGroupPass:
    def __init__(self, w: Writer, prober: ReplicaProber | None = None) -> None:
        self.w = w
        #: the leader's health probes of the replicas (controller.replicaprober); None: Pod readiness alone
        self.prober = prober
        #: queues another pass of a key (the work queue's poke): `sync_slices` wakes each user egress Service
        self.poke: Callable[[Hashable], None] = lambda key: None
        #: group -> the lock `sync_slices` holds, shared with the egress pass's removal of a Service (`Reconciler`)
        self.lock: Callable[[str], asyncio.Lock] = lambda group: self._locks.setdefault(group, asyncio.Lock())
        self._locks: dict[str, asyncio.Lock] = {}

    async def run(self, kind: str, namespace: str, name: str) -> float | None:
        w, kube, cfg = self.w, self.w.kube, self.w.cfg
        if (opened := await w.open(PROXYGROUP, name, "", self.cleanup)).obj is None:
            return RETIRING_RECHECK if opened.waiting else None
        obj = opened.obj
        try:
            g = proxygroup.decide(obj, cfg, getattr(w.provider, "name", ""))
        except Invalid as e:
            w.keep_warnings(obj, {f"ProxyGroupInvalid:{e.message}"})
            await w.warn(obj, PROXYGROUP, "ProxyGroupInvalid", e.message)
            await self.status(obj, [], (False, "ProxyGroupInvalid", e.message))
            return None
        await w.add_finalizer(PROXYGROUP, obj)
        ns = cfg.namespace
        # The class: spec.proxyClass, else PROXY_DEFAULT_CLASS (as upstream). Nothing is created or changed until
        # it is there and valid; a running group keeps running as it was (its Services' EndpointSlices still
        # follow the replicas), and the class's pass brings the next pass of this group.
        class_name = pcl.select(True, obj, cfg.default_proxy_class).name
        pc: pcl.ProxyClass | None = None
        if class_name:
            pc_obj, v = await class_state(w, class_name)
            if pc_obj is None or not v.ok:
                up = await kube.get(STATEFULSETS, g.name, ns) is not None
                waiting = pcl.not_ready_message(class_name, pc_obj, running=up, validation=v)
                w.keep_warnings(obj, {f"{pcl.REASON_NOT_READY}:{waiting}"})
                await w.warn(obj, PROXYGROUP, pcl.REASON_NOT_READY, waiting)
                await self.ready_condition(obj, pcl.REASON_NOT_READY, waiting)
                if up:
                    await self.sync_slices(g.name)
                return PENDING_RECHECK if pc_obj is not None and v.crd_missing else None
            pc = pcl.ProxyClass.from_object(pc_obj)
            if pc.tags and not g.tags_given:
                # the class's TS_EXTRA_ARGS --advertise-tags: under the group's spec.tags, over PROXY_TAGS
                g = dataclasses.replace(g, tags=pc.tags)
        notices = {f"{pcl.REASON_LOCAL_ADDR_PORT}:{pcl.local_addr_port_message(class_name)}"} \
            if pcl.sets_local_addr_port(pc) else set()
        ca_problem = await w.ca_trust_problem()
        notices |= {f"{render.REASON_CA_TRUST}:{ca_problem}"} if ca_problem else set()
        w.keep_warnings(obj, notices)
        for n in sorted(notices):
            reason, _, message = n.partition(":")
            await w.warn(obj, PROXYGROUP, reason, message)
        secrets = {s["metadata"]["name"]: s for s in await kube.list(SECRETS, ns, pgrender.selector(g))}
        if ca_problem and not secrets:
            # a group its replicas' CA could not be given: nothing minted or created until the ConfigMap is right
            await self.status(obj, [], (False, "ProxyGroupCreationFailed", ca_problem))
            return CA_RECHECK
        states = [decode(secrets.get(pgrender.state_secret_name(g.name, i))) for i in range(g.replicas)]
        datas = []
        for i in range(g.replicas):
            conf = decode(secrets.get(pgrender.config_secret_name(g.name, i)))
            datas.append(None if conf is None and states[i] is None else {**(conf or {}), **(states[i] or {})})
        try:
            keys = await w.auth_keys(datas, g.tags, f"ProxyGroup {g.name}", f"ProxyGroup {g.name}")
        except ProviderError as e:
            await self.status(obj, [], (False, "ProxyGroupCreationFailed", f"no auth key: {e}"))
            if e.reason:        # the control plane's version cannot do it: said once as an event too
                await w.warn(obj, PROXYGROUP, e.reason, str(e))
            raise
        cm = await kube.get(CONFIGMAPS, pgrender.configmap_name(g.name), ns)
        if cm is None:
            await kube.create(CONFIGMAPS, pgrender.configmap(g, cfg), ns)
        elif (cm.get("data") or {}).get(pgc.KEY_HEP_PINGS) != pgrender.hep_pings(g):
            await kube.patch(CONFIGMAPS, pgrender.configmap_name(g.name),
                             {"data": {pgc.KEY_HEP_PINGS: pgrender.hep_pings(g)}}, ns)
        for i in range(g.replicas):
            for desired in (pgrender.config_secret(g, cfg, i, keys[i], pc), pgrender.state_secret(g, cfg, i)):
                await w.apply_secret(desired, secrets.get(desired["metadata"]["name"]))
        pods = {p["metadata"]["name"]: p for p in await kube.list(PODS, ns, pgrender.selector(g))}
        retired = sorted({j for n in secrets if (j := _index(g.name, n)) is not None and j >= g.replicas})
        running = [i for i in retired if pgrender.state_secret_name(g.name, i) in pods]
        # A replica scaled away keeps its Secret in the Role until its Pod is gone (its pre-stop drain and
        # shutdown still write its state), and the new replicas' Secrets are in it before their Pods exist.
        allowed = [pgrender.state_secret_name(g.name, i) for i in [*range(g.replicas), *running]]
        for res, desired in zip(RBAC_RESOURCES, pgrender.rbac(g, cfg, allowed), strict=True):
            await w.apply(res, desired)
        desired_sts = pgrender.statefulset(g, cfg, pc)
        sts = await w.apply(STATEFULSETS, desired_sts)
        await w.metrics(PROXYGROUP, g.proxy_spec(), desired_sts, pc)
        for i in retired:
            if i in running:
                continue
            names = (pgrender.state_secret_name(g.name, i), pgrender.config_secret_name(g.name, i))
            await w.retire_secrets(secrets[n] for n in names if n in secrets)
            log.info("ProxyGroup %s: replica %d removed (device and Secrets)", g.name, i)
        tags_error = await w.sync_tags(PROXYGROUP, g.parent, g.tags, states)
        devices = [st.device_info(pgrender.state_secret_name(g.name, i), states[i]) for i in range(g.replicas)]
        ready_replicas = int(((sts or {}).get("status") or {}).get("readyReplicas") or 0)
        blocked = ca_problem if ready_replicas < g.replicas else ""
        r = st.readiness(PROXYGROUP, devices, replicas=g.replicas, ready_replicas=ready_replicas,
                         failure=str(tags_error or "") or blocked)
        reason = "ProxyGroupReady" if r.ok else \
            ("ProxyGroupCreationFailed" if tags_error or blocked else "ProxyGroupCreating")
        await self.status(obj, devices, (r.ok, reason, r.message))
        await self.sync_slices(g.name, pods=list(pods.values()), secrets=secrets)
        if tags_error is not None:
            raise tags_error
        if running:
            return RETIRING_RECHECK
        return READY_RECHECK if r.ok else PENDING_RECHECK

    async def ready_condition(self, obj: Mapping[str, Any], reason: str, message: str) -> None:
        """ProxyGroupReady False alone: the rest of the status (devices, availability) stays as the replicas are."""
        cur = obj.get("status") or {}
        conds = self.w.conditions(obj, COND_PG_READY, False, reason, message)
        if not same(list(cur.get("conditions") or []), conds):
            await self.w.patch_status(PROXYGROUP, obj, {"conditions": conds})

    async def status(self, obj: Mapping[str, Any], devices: list[st.DeviceInfo],
                     ready: tuple[bool, str, str]) -> None:
        w, cur = self.w, obj.get("status") or {}
        ok, reason, message = ready
        conds = w.conditions(obj, COND_PG_READY, ok, reason, message)
        named = [d for d in devices if d.hostname]
        avail = (True, "ProxyGroupAvailable", f"{len(named)} of {len(devices)} replicas have a device") if named \
            else (False, reason if not ok else "ProxyGroupCreating", "no replica has a device yet")
        conds = w.conditions(obj, COND_PG_AVAILABLE, *avail, previous=conds)
        want: dict[str, Any] = {}
        if not same(list(cur.get("conditions") or []), conds):
            want["conditions"] = conds
        devs = [{"hostname": d.hostname, "tailnetIPs": list(d.ips)} for d in named] or None
        if not same(cur.get("devices"), devs) or (devs is None and cur.get("devices")):
            want["devices"] = devs
        await w.patch_status(PROXYGROUP, obj, want)

    async def cleanup(self, obj: Mapping[str, Any]) -> bool:
        """StatefulSet (foreground: the Pods drain first), then each device, the Secrets, the ConfigMap and the
        group's ServiceAccount, Role and RoleBinding. True when done."""
        name = meta(obj).get("name", "")
        if self.prober is not None:
            self.prober.track(name, ())
        # The metrics Service (a class's metrics.enable) carries the group's labels; its egress Services do not.
        done = await self.w.remove_children(Parent(PROXYGROUP, name, "", meta(obj).get("uid", "")),
                                            group_selector(name), (CONFIGMAPS, SERVICES, *reversed(RBAC_RESOURCES)))
        if done:
            log.info("ProxyGroup %s removed", name)
        return done

    async def sync_slices(self, group: str, *, pods: list[dict] | None = None,
                          secrets: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Every egress Service's EndpointSlices of this group: only the replicas that report its rules. Under the
        group's lock: a Service being removed (`EgressPass.cleanup_service`) is either still whole or gone."""
        async with self.lock(group):
            await self._sync_slices(group, pods=pods, secrets=secrets)

    async def _sync_slices(self, group: str, *, pods: list[dict] | None,
                           secrets: Mapping[str, Mapping[str, Any]] | None) -> None:
        w, kube, ns = self.w, self.w.kube, self.w.cfg.namespace
        svcs = await kube.list(SERVICES, ns, egress.group_selector(group))
        if not svcs:
            if self.prober is not None:
                self.prober.track(group, ())   # nothing to steer: no probes
            return
        cm = await kube.get(CONFIGMAPS, pgrender.configmap_name(group), ns)
        entries = egress.parse_entries((cm or {}).get("data", {}).get(pgc.KEY_EGRESS_SERVICES))
        reps = await replicas(w, group, pods, secrets, prober=self.prober)
        slices = {s["metadata"]["name"]: s for s in await kube.list(ENDPOINTSLICES, ns, egress.group_selector(group))}
        for svc in svcs:
            labels = svc["metadata"].get("labels") or {}
            entry = f"{labels.get(LABEL_PARENT_NS, '')}-{labels.get(LABEL_PARENT_NAME, '')}"
            for fam in egress.families(svc):
                desired = egress.endpoint_slice(svc, fam, egress.addresses(reps, entry, entries.get(entry), fam))
                await w.apply_known(ENDPOINTSLICES, desired, slices.get(desired["metadata"]["name"]))
            # the user's Service: its TailscaleEgressSvcReady follows the replicas
            self.poke((SVC, labels.get(LABEL_PARENT_NS, ""), labels.get(LABEL_PARENT_NAME, "")))


def _index(group: str, secret: str) -> int | None:
    """The replica a state or config Secret belongs to."""
    return pgrender.replica_index(group, secret.removesuffix("-config"))
