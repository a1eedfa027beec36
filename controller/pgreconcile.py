"""ProxyGroups and their egress Services: the two level-triggered passes (shell around the pure modules
`kinds.proxygroup`, `pgrender` and `kinds.egress`).

The group's pass: auth keys (one per new replica, never again for a replica that has its config or a device),
the ConfigMap, per-replica config and state Secrets, the group's own ServiceAccount/Role/RoleBinding, the
StatefulSet, all with the group's ProxyClass merged in (spec.proxyClass or PROXY_DEFAULT_CLASS; nothing is
made or changed while it is missing or invalid), and its metrics Service when the class asks; replicas scaled
away lose their device and Secrets once their Pod is gone; the status lists the devices from the state Secrets;
and every egress Service's EndpointSlices are brought to what the replicas report (their state Secrets'
`egress-services`), so one replica's change costs one pass of the group.

An egress Service's pass: its ClusterIP Service with allocated ports, its entry in the group's ConfigMap (writes
to one group's ConfigMap are serialised in this process and guarded by its resourceVersion), its
EndpointSlices, the user's Service pointed at the ClusterIP Service, and its conditions. Invalid input: a
False condition and a Warning event, and whatever an earlier valid version made is removed.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tscommon import secretcontract as sc

from . import pgrender, proxyclass as pcl, render, status as st
from .kinds import egress, meta, proxygroup
from .kinds.egress import EgressTarget, Replica
from .kubeapi import (CONFIGMAPS, CRDS, ENDPOINTSLICES, PODS, PROXYGROUPS, ROLEBINDINGS, ROLES, SECRETS,
                      SERVICEACCOUNTS, SERVICES, STATEFULSETS, Resource)
from .model import (COND_EGRESS_CONFIGURED, COND_EGRESS_VALID, COND_PG_AVAILABLE, COND_PG_READY, FINALIZER,
                    LABEL_PARENT_NAME, LABEL_PARENT_NS, LABEL_PROXY_GROUP, PROXYGROUP, SVC, Invalid, Parent)
from .providers import ProviderError

if TYPE_CHECKING:
    from .reconcile import Reconciler

log = logging.getLogger("controller")

RBAC_RESOURCES = (SERVICEACCOUNTS, ROLES, ROLEBINDINGS)
PENDING_RECHECK = 60.0
#: a group waiting for PROXY_CA_CONFIGMAP's ConfigMap (not watched: one GET)
CA_RECHECK = 10.0
READY_RECHECK = 600.0
RETIRING_RECHECK = 2.0


def _decode(obj: Mapping[str, Any] | None) -> dict[str, bytes] | None:
    if obj is None:
        return None
    return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}


def group_labels(name: str) -> dict[str, str]:
    return render.child_labels(Parent(PROXYGROUP, name, "", ""))


def group_selector(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in group_labels(name).items())


class GroupReconciler:
    def __init__(self, rec: "Reconciler") -> None:
        self.rec = rec
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, group: str) -> asyncio.Lock:
        return self._locks.setdefault(group, asyncio.Lock())

    # ---------------------------------------------------------------------------------------- the group

    async def reconcile_group(self, name: str) -> float | None:
        rec, kube, cfg = self.rec, self.rec.kube, self.rec.cfg
        obj = await kube.get(PROXYGROUPS, name)
        if obj is None:
            return None
        m = meta(obj)
        if m.get("deletionTimestamp"):
            if FINALIZER in (m.get("finalizers") or []):
                if not await self.cleanup_group(obj):
                    return RETIRING_RECHECK
                await rec._remove_finalizer(PROXYGROUP, obj)
            return None
        try:
            g = proxygroup.decide(obj, cfg, getattr(rec.provider, "name", ""))
        except Invalid as e:
            self._forget_warnings(obj, {f"ProxyGroupInvalid:{e.message}"})
            await rec._warn(obj, PROXYGROUP, "ProxyGroupInvalid", e.message)
            await self._group_status(obj, [], (False, "ProxyGroupInvalid", e.message))
            return None
        await rec._ensure_finalizer(PROXYGROUP, obj)
        ns = cfg.namespace
        # The class: spec.proxyClass, else PROXY_DEFAULT_CLASS (as upstream). Nothing is created or changed until
        # it is there and valid; a running group keeps running as it was (its Services' EndpointSlices still
        # follow the replicas), and the class's pass brings the next pass of this group.
        class_name = pcl.select(True, obj, cfg.default_proxy_class).name
        pc: pcl.ProxyClass | None = None
        if class_name:
            pc_obj, v = await rec._class_state(class_name)
            if pc_obj is None or not v.ok:
                up = await kube.get(STATEFULSETS, g.name, ns) is not None
                waiting = pcl.not_ready_message(class_name, pc_obj, running=up, validation=v)
                self._forget_warnings(obj, {f"{pcl.REASON_NOT_READY}:{waiting}"})
                await rec._warn(obj, PROXYGROUP, pcl.REASON_NOT_READY, waiting)
                await self._ready_condition(obj, pcl.REASON_NOT_READY, waiting)
                if up:
                    await self.sync_slices(g.name)
                return PENDING_RECHECK if pc_obj is not None and v.crd_missing else None
            pc = pcl.ProxyClass.from_object(pc_obj)
            if pc.tags and not g.tags_given:
                # the class's TS_EXTRA_ARGS --advertise-tags: under the group's spec.tags, over PROXY_TAGS
                g = dataclasses.replace(g, tags=pc.tags)
        notices = {f"{pcl.REASON_LOCAL_ADDR_PORT}:{pcl.local_addr_port_message(class_name)}"} \
            if pcl.sets_local_addr_port(pc) else set()
        ca_problem = await rec.ca_trust_problem()
        notices |= {f"{render.REASON_CA_TRUST}:{ca_problem}"} if ca_problem else set()
        self._forget_warnings(obj, notices)
        for n in sorted(notices):
            reason, _, message = n.partition(":")
            await rec._warn(obj, PROXYGROUP, reason, message)
        secrets = {s["metadata"]["name"]: s for s in await kube.list(SECRETS, ns, pgrender.selector(g))}
        if ca_problem and not secrets:
            # a group its replicas' CA could not be given: nothing minted or created until the ConfigMap is right
            await self._group_status(obj, [], (False, "ProxyGroupCreationFailed", ca_problem))
            return CA_RECHECK
        states = [_decode(secrets.get(pgrender.state_secret_name(g.name, i))) for i in range(g.replicas)]
        keys: list[str] = []
        try:
            for i in range(g.replicas):
                conf = _decode(secrets.get(pgrender.config_secret_name(g.name, i)))
                data = None if conf is None and states[i] is None else {**(conf or {}), **(states[i] or {})}
                action = st.authkey_action(data)
                if action in ("new", "reissue"):
                    if action == "reissue":
                        await rec._delete_device_of(data)
                        log.info("ProxyGroup %s replica %d asked for a new auth key; issuing one", g.name, i)
                    keys.append(await rec.provider.create_auth_key(g.tags, description=f"ProxyGroup {g.name}"))
                else:
                    keys.append(st.config_authkey(data) if action == "keep" else "")
        except ProviderError as e:
            await self._group_status(obj, [], (False, "ProxyGroupCreationFailed", f"no auth key: {e}"))
            raise
        cm = await kube.get(CONFIGMAPS, pgrender.configmap_name(g.name), ns)
        if cm is None:
            await kube.create(CONFIGMAPS, pgrender.configmap(g, cfg), ns)
        elif (cm.get("data") or {}).get(pgrender.HEP_PINGS_KEY) != pgrender.hep_pings(g):
            await kube.patch(CONFIGMAPS, pgrender.configmap_name(g.name),
                             {"data": {pgrender.HEP_PINGS_KEY: pgrender.hep_pings(g)}}, ns)
        for i in range(g.replicas):
            for desired in (pgrender.config_secret(g, cfg, i, keys[i], pc), pgrender.state_secret(g, cfg, i)):
                await rec._apply_secret(desired, secrets.get(desired["metadata"]["name"]))
        pods = {p["metadata"]["name"]: p for p in await kube.list(PODS, ns, pgrender.selector(g))}
        retired = sorted({j for n in secrets if (j := _index(g.name, n)) is not None and j >= g.replicas})
        running = [i for i in retired if pgrender.state_secret_name(g.name, i) in pods]
        # A replica scaled away keeps its Secret in the Role until its Pod is gone (its pre-stop drain and
        # shutdown still write its state), and the new replicas' Secrets are in it before their Pods exist.
        allowed = [pgrender.state_secret_name(g.name, i) for i in [*range(g.replicas), *running]]
        for res, desired in zip(RBAC_RESOURCES, pgrender.rbac(g, cfg, allowed)):
            await rec._apply(res, desired)
        desired_sts = pgrender.statefulset(g, cfg, pc)
        sts = await rec._apply(STATEFULSETS, desired_sts)
        await rec._metrics(PROXYGROUP, g.proxy_spec(), desired_sts, pc)
        for i in retired:
            if i in running:
                continue
            state_name = pgrender.state_secret_name(g.name, i)
            await rec._delete_device_of(_decode(secrets.get(state_name)))
            for n in (state_name, pgrender.config_secret_name(g.name, i)):
                if n in secrets:
                    await kube.delete(SECRETS, n, ns)
            log.info("ProxyGroup %s: replica %d removed (device and Secrets)", g.name, i)
        tags_error = await rec._sync_tags(PROXYGROUP, g.parent, g.tags, states)
        devices = [st.device_info(pgrender.state_secret_name(g.name, i), states[i]) for i in range(g.replicas)]
        ready_replicas = int(((sts or {}).get("status") or {}).get("readyReplicas") or 0)
        blocked = ca_problem if ready_replicas < g.replicas else ""
        r = st.readiness(PROXYGROUP, devices, replicas=g.replicas, ready_replicas=ready_replicas,
                         failure=str(tags_error or "") or blocked)
        reason = "ProxyGroupReady" if r.ok else \
            ("ProxyGroupCreationFailed" if tags_error or blocked else "ProxyGroupCreating")
        await self._group_status(obj, devices, (r.ok, reason, r.message))
        await self.sync_slices(g.name, pods=list(pods.values()), secrets=secrets)
        if tags_error is not None:
            raise tags_error
        if running:
            return RETIRING_RECHECK
        return READY_RECHECK if r.ok else PENDING_RECHECK

    def _forget_warnings(self, obj: Mapping[str, Any], current: set[str]) -> None:
        """Only what this pass still reports stays remembered: a problem that goes and comes back is sent again."""
        if (seen := self.rec._warned.get(meta(obj).get("uid", ""))) is not None:
            seen &= current

    async def _ready_condition(self, obj: Mapping[str, Any], reason: str, message: str) -> None:
        """ProxyGroupReady False alone: the rest of the status (devices, availability) stays as the replicas are."""
        rec, m, cur = self.rec, meta(obj), obj.get("status") or {}
        conds = st.with_condition(cur.get("conditions"), st.condition(
            COND_PG_READY, False, reason, message, generation=m.get("generation"), previous=cur.get("conditions"),
            now=rec.now()))
        from .sameness import same
        if not same(list(cur.get("conditions") or []), conds):
            await rec.kube.patch(PROXYGROUPS, m["name"], {"status": {"conditions": conds}}, subresource="status")

    async def _group_status(self, obj: Mapping[str, Any], devices: list[st.DeviceInfo],
                            ready: tuple[bool, str, str]) -> None:
        rec, m, cur = self.rec, meta(obj), obj.get("status") or {}
        gen, now = m.get("generation"), rec.now()
        conds = cur.get("conditions")
        ok, reason, message = ready
        conds = st.with_condition(conds, st.condition(COND_PG_READY, ok, reason, message, generation=gen,
                                                      previous=conds, now=now))
        named = [d for d in devices if d.hostname]
        avail = (True, "ProxyGroupAvailable", f"{len(named)} of {len(devices)} replicas have a device") if named \
            else (False, reason if not ok else "ProxyGroupCreating", "no replica has a device yet")
        conds = st.with_condition(conds, st.condition(COND_PG_AVAILABLE, avail[0], avail[1], avail[2],
                                                      generation=gen, previous=conds, now=now))
        want: dict[str, Any] = {}
        from .sameness import same
        if not same(list(cur.get("conditions") or []), conds):
            want["conditions"] = conds
        devs = [{"hostname": d.hostname, "tailnetIPs": list(d.ips)} for d in named] or None
        if not same(cur.get("devices"), devs) or (devs is None and cur.get("devices")):
            want["devices"] = devs
        if want:
            await rec.kube.patch(PROXYGROUPS, m["name"], {"status": want}, subresource="status")

    async def cleanup_group(self, obj: Mapping[str, Any]) -> bool:
        """StatefulSet (foreground: the Pods drain first), then each device, the Secrets, the ConfigMap and the
        group's ServiceAccount, Role and RoleBinding. True when done."""
        kube, ns = self.rec.kube, self.rec.cfg.namespace
        name = meta(obj).get("name", "")
        sel = group_selector(name)
        stss = await kube.list(STATEFULSETS, ns, sel)
        if stss:
            for s in stss:
                if not s["metadata"].get("deletionTimestamp"):
                    await kube.delete(STATEFULSETS, s["metadata"]["name"], ns, propagation="Foreground")
            return False
        for s in await kube.list(SECRETS, ns, sel):
            await self.rec._delete_device_of(_decode(s))
            await kube.delete(SECRETS, s["metadata"]["name"], ns)
        # The metrics Service (a class's metrics.enable) carries the group's labels; its egress Services do not.
        for res in (CONFIGMAPS, SERVICES, *reversed(RBAC_RESOURCES)):
            for o in await kube.list(res, ns, sel):
                await kube.delete(res, o["metadata"]["name"], ns)
        if await kube.get(CRDS, pcl.SERVICE_MONITOR_CRD) is not None:
            await self.rec._delete_service_monitors(Parent(PROXYGROUP, name, "", meta(obj).get("uid", "")))
        log.info("ProxyGroup %s removed", name)
        return True

    # ---------------------------------------------------------------------------------- EndpointSlices

    async def _replicas(self, group: str, pods: list[dict] | None = None,
                        secrets: Mapping[str, Mapping[str, Any]] | None = None) -> list[Replica]:
        kube, ns = self.rec.kube, self.rec.cfg.namespace
        sel = group_selector(group)
        if pods is None:
            pods = await kube.list(PODS, ns, sel)
        if secrets is None:
            secrets = {s["metadata"]["name"]: s for s in await kube.list(SECRETS, ns, sel)}
        out = []
        for p in pods:
            name = p["metadata"]["name"]
            pst = p.get("status") or {}
            # A terminating Pod leaves the EndpointSlices at once: that is what its pre-stop drain waits for.
            # A Pod that is not Ready (its tailscaled down, its container restarting, its node lost) leaves them
            # too, until its readiness probe passes again.
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in pst.get("conditions") or [])
            live = not p["metadata"].get("deletionTimestamp") and pst.get("phase") == "Running" and ready
            ips = tuple(a["ip"] for a in pst.get("podIPs") or [] if a.get("ip")) if live else ()
            data = _decode(secrets.get(name)) or {}
            out.append(Replica(name, ips, egress.parse_status(data.get(sc.KEY_EGRESS_SERVICES))))
        return out

    async def sync_slices(self, group: str, *, pods: list[dict] | None = None,
                          secrets: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Every egress Service's EndpointSlices of this group: only the replicas that report its rules."""
        kube, ns = self.rec.kube, self.rec.cfg.namespace
        svcs = await kube.list(SERVICES, ns, egress.group_selector(group))
        if not svcs:
            return
        cm = await kube.get(CONFIGMAPS, pgrender.configmap_name(group), ns)
        entries = egress.parse_entries((cm or {}).get("data", {}).get(pgrender.EGRESS_SERVICES_KEY))
        replicas = await self._replicas(group, pods, secrets)
        slices = {s["metadata"]["name"]: s for s in await kube.list(ENDPOINTSLICES, ns, egress.group_selector(group))}
        for svc in svcs:
            labels = svc["metadata"].get("labels") or {}
            entry = f"{labels.get(LABEL_PARENT_NS, '')}-{labels.get(LABEL_PARENT_NAME, '')}"
            for fam in egress.families(svc):
                desired = egress.endpoint_slice(svc, fam, egress.addresses(replicas, entry, entries.get(entry), fam))
                await self._apply_known(ENDPOINTSLICES, desired, slices.get(desired["metadata"]["name"]))
            # the user's Service: its TailscaleEgressSvcReady follows the replicas
            self.rec.poke((SVC, labels.get(LABEL_PARENT_NS, ""), labels.get(LABEL_PARENT_NAME, "")))

    async def _apply_known(self, res: Resource, desired: dict, cur: Mapping[str, Any] | None) -> dict:
        """Create, or merge-patch when the rendering's hash differs from `cur`'s (already read)."""
        kube, md = self.rec.kube, desired["metadata"]
        if cur is None:
            return await kube.create(res, desired, md["namespace"])
        if (cur["metadata"].get("annotations") or {}).get(render.SPEC_HASH) == md["annotations"][render.SPEC_HASH]:
            return dict(cur)
        return await kube.patch(res, md["name"], desired, md["namespace"])

    # --------------------------------------------------------------------------------- egress Services

    async def reconcile_service(self, svc: Mapping[str, Any]) -> float | None:
        rec, kube, cfg = self.rec, self.rec.kube, self.rec.cfg
        ns_ctl = cfg.namespace
        group = egress.group_of(svc)
        pg = await kube.get(PROXYGROUPS, group)
        try:
            t = egress.decide(svc, cfg, pg)
        except Invalid as e:
            await self._invalid(svc, e.message)
            return None
        await rec._ensure_finalizer(SVC, svc)
        # A single proxy made for this Service before it named a group goes first.
        if await kube.list(STATEFULSETS, ns_ctl, render.child_selector(t.parent)):
            if not await rec.cleanup(SVC, svc):
                return RETIRING_RECHECK
        await self.cleanup_service(svc, keep_group=t.group)
        svc_name = render.base_name(t.parent)
        cm_name = pgrender.configmap_name(t.group)
        async with self._lock(t.group):
            cm = await kube.get(CONFIGMAPS, cm_name, ns_ctl)
            if cm is None:
                await self._svc_status(svc, (True, "EgressSvcValid", "EgressSvcValid"),
                                       (False, "ProxyGroupNotReady",
                                        f"waiting for ProxyGroup {t.group}'s ConfigMap {ns_ctl}/{cm_name}"))
                return PENDING_RECHECK
            entries = egress.parse_entries((cm.get("data") or {}).get(pgrender.EGRESS_SERVICES_KEY))
            cur_svc = await kube.get(SERVICES, svc_name, ns_ctl)
            current = egress.entry_ports(entries.get(t.entry)) or _service_ports(cur_svc)
            try:
                mapping = egress.allocate(t.ports, current, egress.used_ports(entries, but=t.entry))
            except Invalid as e:
                await self._invalid(svc, e.message)
                return None
            cip = await self._apply_known(SERVICES, egress.clusterip_service(t, mapping, svc_name, cfg), cur_svc)
            want = egress.entry(t, mapping, svc_name, cfg)
            if entries.get(t.entry) != want:
                entries[t.entry] = want
                await kube.patch(CONFIGMAPS, cm_name, {
                    "metadata": {"resourceVersion": cm["metadata"].get("resourceVersion")},
                    "data": {pgrender.EGRESS_SERVICES_KEY: egress.dump_entries(entries)}}, ns_ctl)
        replicas = await self._replicas(t.group)
        for fam in egress.families(cip):
            desired = egress.endpoint_slice(cip, fam, egress.addresses(replicas, t.entry, want, fam))
            cur = await kube.get(ENDPOINTSLICES, desired["metadata"]["name"], ns_ctl)
            await self._apply_known(ENDPOINTSLICES, desired, cur)
        svc = await self._point_at(svc, t, svc_name)
        await self._svc_status(svc, (True, "EgressSvcValid", "EgressSvcValid"),
                               (True, f"ConfiguredFor:ProxyGroup:{t.group}",
                                f"forwarded by ProxyGroup {t.group} through Service {ns_ctl}/{svc_name}; "
                                "each replica serves it once it reports the rules in place"),
                               egress.ready_condition(pg, replicas, t.entry, want, egress.families(cip)))
        return None

    async def _point_at(self, svc: Mapping[str, Any], t: EgressTarget, svc_name: str) -> Mapping[str, Any]:
        cfg = self.rec.cfg
        target = f"{svc_name}.{cfg.namespace}.svc.{cfg.cluster_domain}"
        if (svc.get("spec") or {}).get("externalName") == target:
            return svc
        return await self.rec.kube.patch(SERVICES, t.name, {"spec": {"externalName": target}}, t.namespace)

    async def _invalid(self, svc: Mapping[str, Any], message: str) -> None:
        await self.cleanup_service(svc)
        await self.rec._warn(svc, SVC, "EgressSvcInvalid", f"invalid egress Service: {message}")
        await self._svc_status(svc, (False, "EgressSvcInvalid", f"invalid egress Service: {message}"), None)

    async def _svc_status(self, svc: Mapping[str, Any], valid: tuple[bool, str, str] | None,
                          configured: tuple[bool, str, str] | None, ready: tuple[bool, str, str] | None = None
                          ) -> None:
        """The three upstream conditions on the user's Service; None removes one."""
        rec, m, cur = self.rec, meta(svc), svc.get("status") or {}
        conds: list[dict] = [dict(c) for c in cur.get("conditions") or []]
        for ctype, val in ((COND_EGRESS_VALID, valid), (COND_EGRESS_CONFIGURED, configured),
                           (egress.COND_READY, ready)):
            if val is None:
                conds = [c for c in conds if c.get("type") != ctype]
            else:
                conds = st.with_condition(conds, st.condition(ctype, val[0], val[1], val[2],
                                                              generation=m.get("generation"), previous=conds,
                                                              now=rec.now()))
        from .sameness import same
        if not same(list(cur.get("conditions") or []), conds) or len(conds) != len(cur.get("conditions") or []):
            await rec.kube.patch(SERVICES, m["name"], {"status": {"conditions": conds or None}},
                                 m.get("namespace", ""), subresource="status")

    @staticmethod
    def has_conditions(svc: Mapping[str, Any]) -> bool:
        """The Service carries the egress conditions: it was (or was refused as) an egress Service on a group."""
        conds = (svc.get("status") or {}).get("conditions") or []
        return any(c.get("type") in (COND_EGRESS_VALID, COND_EGRESS_CONFIGURED, egress.COND_READY) for c in conds)

    async def clear_conditions(self, svc: Mapping[str, Any]) -> Mapping[str, Any]:
        """The Service no longer asks for a group: its egress conditions go (the Service stays as it is)."""
        conds = (svc.get("status") or {}).get("conditions") or []
        if not self.has_conditions(svc) or meta(svc).get("deletionTimestamp"):
            return svc
        m = meta(svc)
        rest = [c for c in conds if c.get("type") not in (COND_EGRESS_VALID, COND_EGRESS_CONFIGURED, egress.COND_READY)]
        return await self.rec.kube.patch(SERVICES, m["name"], {"status": {"conditions": rest or None}},
                                         m.get("namespace", ""), subresource="status")

    async def cleanup_service(self, svc: Mapping[str, Any], *, keep_group: str = "") -> None:
        """Remove what was made for this Service on any group but `keep_group`: its ConfigMap entry, its
        EndpointSlices and its ClusterIP Service. Nothing else is touched."""
        kube, ns_ctl = self.rec.kube, self.rec.cfg.namespace
        m = meta(svc)
        ns, name = m.get("namespace", ""), m.get("name", "")
        entry = f"{ns}-{name}"
        sel = egress.parent_selector(ns, name)
        for o in await kube.list(SERVICES, ns_ctl, sel):
            group = (o["metadata"].get("labels") or {}).get(LABEL_PROXY_GROUP, "")
            if group == keep_group:
                continue
            cm_name = pgrender.configmap_name(group)
            async with self._lock(group):
                cm = await kube.get(CONFIGMAPS, cm_name, ns_ctl)
                entries = egress.parse_entries((cm or {}).get("data", {}).get(pgrender.EGRESS_SERVICES_KEY))
                if cm is not None and entry in entries:
                    del entries[entry]
                    await kube.patch(CONFIGMAPS, cm_name, {
                        "metadata": {"resourceVersion": cm["metadata"].get("resourceVersion")},
                        "data": {pgrender.EGRESS_SERVICES_KEY: egress.dump_entries(entries)}}, ns_ctl)
            for s in await kube.list(ENDPOINTSLICES, ns_ctl, f"{sel},{LABEL_PROXY_GROUP}={group}"):
                await kube.delete(ENDPOINTSLICES, s["metadata"]["name"], ns_ctl)
            await kube.delete(SERVICES, o["metadata"]["name"], ns_ctl)
            log.info("Service %s/%s: egress through ProxyGroup %s removed", ns, name, group)


def _index(group: str, secret: str) -> int | None:
    """The replica a state or config Secret belongs to."""
    return pgrender.replica_index(group, secret.removesuffix("-config"))


def _service_ports(svc: Mapping[str, Any] | None) -> dict[tuple[str, int], int]:
    """{(PROTOCOL, port): targetPort} of an existing ClusterIP Service (the health-check port aside)."""
    out: dict[tuple[str, int], int] = {}
    for p in ((svc or {}).get("spec") or {}).get("ports") or []:
        if p.get("name") == egress.HEALTH_PORT_NAME or not isinstance(p.get("targetPort"), int):
            continue
        out[(str(p.get("protocol") or "TCP").upper(), int(p["port"]))] = int(p["targetPort"])
    return out

