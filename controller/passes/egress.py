"""The egress Service pass (shell around the pure `kinds.egress`): a Service served by a ProxyGroup.

Its ClusterIP Service with allocated ports, its entry in the group's ConfigMap (the ProxyGroup contract's
`egress-services`, tscommon/pgcontract.py; writes to one group's ConfigMap are serialised in this process and
guarded by its resourceVersion), its EndpointSlices (a Service's removal holds the same per-group lock as the
group pass's `sync_slices`, which would otherwise write the slices of a Service half removed), the user's
Service pointed at the ClusterIP Service, and its conditions. Invalid input: a False condition and a Warning
event, and whatever an earlier valid version made is removed. The parents' pass hands such a Service here
(`kindtable.KindInfo.on_group`), and asks here for what an egress Service leaves when it no longer names a group
(`cleanup_service`, `clear_conditions`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from tscommon import pgcontract as pgc

from .. import pgrender, render
from ..kinds import egress, meta
from ..kinds.egress import EgressTarget
from ..kubeapi import CONFIGMAPS, ENDPOINTSLICES, PROXYGROUPS, SERVICES, STATEFULSETS
from ..model import COND_EGRESS_CONFIGURED, COND_EGRESS_VALID, LABEL_PROXY_GROUP, SVC, Invalid
from ..replicaprober import ReplicaProber
from ..sameness import same
from ..writer import Writer
from .proxygroup import PENDING_RECHECK, RETIRING_RECHECK, replicas

log = logging.getLogger("controller")


class EgressPass:
    def __init__(self, w: Writer, prober: ReplicaProber | None = None) -> None:
        self.w = w
        self.prober = prober    # the leader's health probes of the replicas, shared with the groups' pass
        #: group -> the lock on its ConfigMap's writes and on its egress Services' removal (shared with the
        #: group pass's `sync_slices`: `Reconciler`)
        self.locks: dict[str, asyncio.Lock] = {}

    def lock(self, group: str) -> asyncio.Lock:
        return self.locks.setdefault(group, asyncio.Lock())

    async def run_service(self, svc: Mapping[str, Any]) -> float | None:
        w, kube, cfg = self.w, self.w.kube, self.w.cfg
        ns_ctl = cfg.namespace
        group = egress.group_of(svc)
        pg = await kube.get(PROXYGROUPS, group)
        try:
            t = egress.decide(svc, cfg, pg)
        except Invalid as e:
            await self.invalid(svc, e.message)
            return None
        await w.add_finalizer(SVC, svc)
        # A single proxy made for this Service before it named a group goes first.
        if await kube.list(STATEFULSETS, ns_ctl, render.child_selector(t.parent)):
            if not await w.remove_proxy(SVC, svc):
                return RETIRING_RECHECK
        await self.cleanup_service(svc, keep_group=t.group)
        svc_name = render.base_name(t.parent)
        cm_name = pgrender.configmap_name(t.group)
        async with self.lock(t.group):
            cm = await kube.get(CONFIGMAPS, cm_name, ns_ctl)
            if cm is None:
                await self.status(svc, (True, "EgressSvcValid", "EgressSvcValid"),
                                  (False, "ProxyGroupNotReady",
                                   f"waiting for ProxyGroup {t.group}'s ConfigMap {ns_ctl}/{cm_name}"))
                return PENDING_RECHECK
            entries = egress.parse_entries((cm.get("data") or {}).get(pgc.KEY_EGRESS_SERVICES))
            cur_svc = await kube.get(SERVICES, svc_name, ns_ctl)
            current = egress.entry_ports(entries.get(t.entry)) or _service_ports(cur_svc)
            try:
                mapping = egress.allocate(t.ports, current, egress.used_ports(entries, but=t.entry))
            except Invalid as e:
                await self.invalid(svc, e.message)
                return None
            cip = await w.apply_known(SERVICES, egress.clusterip_service(t, mapping, svc_name, cfg), cur_svc)
            want = egress.entry(t, mapping, svc_name, cfg)
            if entries.get(t.entry) != want:
                entries[t.entry] = want
                await kube.patch(CONFIGMAPS, cm_name, {
                    "metadata": {"resourceVersion": cm["metadata"].get("resourceVersion")},
                    "data": {pgc.KEY_EGRESS_SERVICES: egress.dump_entries(entries)}}, ns_ctl)
        reps = await replicas(w, t.group, prober=self.prober)
        for fam in egress.families(cip):
            desired = egress.endpoint_slice(cip, fam, egress.addresses(reps, t.entry, want, fam))
            cur = await kube.get(ENDPOINTSLICES, desired["metadata"]["name"], ns_ctl)
            await w.apply_known(ENDPOINTSLICES, desired, cur)
        svc = await self.point_at(svc, t, svc_name)
        await self.status(svc, (True, "EgressSvcValid", "EgressSvcValid"),
                          (True, f"ConfiguredFor:ProxyGroup:{t.group}",
                           f"forwarded by ProxyGroup {t.group} through Service {ns_ctl}/{svc_name}; "
                           "each replica serves it once it reports the rules in place"),
                          egress.ready_condition(pg, reps, t.entry, want, egress.families(cip)))
        return None

    async def point_at(self, svc: Mapping[str, Any], t: EgressTarget, svc_name: str) -> Mapping[str, Any]:
        cfg = self.w.cfg
        target = f"{svc_name}.{cfg.namespace}.svc.{cfg.cluster_domain}"
        if (svc.get("spec") or {}).get("externalName") == target:
            return svc
        return await self.w.kube.patch(SERVICES, t.name, {"spec": {"externalName": target}}, t.namespace)

    async def invalid(self, svc: Mapping[str, Any], message: str) -> None:
        await self.cleanup_service(svc)
        await self.w.warn(svc, SVC, "EgressSvcInvalid", f"invalid egress Service: {message}")
        await self.status(svc, (False, "EgressSvcInvalid", f"invalid egress Service: {message}"), None)

    async def status(self, svc: Mapping[str, Any], valid: tuple[bool, str, str] | None,
                     configured: tuple[bool, str, str] | None, ready: tuple[bool, str, str] | None = None) -> None:
        """The three upstream conditions on the user's Service; None removes one."""
        cur = svc.get("status") or {}
        conds: list[dict] = [dict(c) for c in cur.get("conditions") or []]
        for ctype, val in ((COND_EGRESS_VALID, valid), (COND_EGRESS_CONFIGURED, configured),
                           (egress.COND_READY, ready)):
            if val is None:
                conds = [c for c in conds if c.get("type") != ctype]
            else:
                conds = self.w.conditions(svc, ctype, *val, previous=conds)
        if not same(list(cur.get("conditions") or []), conds) or len(conds) != len(cur.get("conditions") or []):
            await self.w.patch_status(SVC, svc, {"conditions": conds or None})

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
        rest = [c for c in conds if c.get("type") not in (COND_EGRESS_VALID, COND_EGRESS_CONFIGURED, egress.COND_READY)]
        return await self.w.patch_status(SVC, svc, {"conditions": rest or None}) or svc

    async def cleanup_service(self, svc: Mapping[str, Any], *, keep_group: str = "") -> None:
        """Remove what was made for this Service on any group but `keep_group`: its ConfigMap entry, its
        EndpointSlices and its ClusterIP Service. Nothing else is touched."""
        kube, ns_ctl = self.w.kube, self.w.cfg.namespace
        m = meta(svc)
        ns, name = m.get("namespace", ""), m.get("name", "")
        entry = f"{ns}-{name}"
        sel = egress.parent_selector(ns, name)
        for o in await kube.list(SERVICES, ns_ctl, sel):
            group = (o["metadata"].get("labels") or {}).get(LABEL_PROXY_GROUP, "")
            if group == keep_group:
                continue
            cm_name = pgrender.configmap_name(group)
            # All three under the group's lock: the group's pass (`sync_slices`) writes the slices of every
            # ClusterIP Service it lists, and would bring back slices deleted here before their Service is.
            async with self.lock(group):
                cm = await kube.get(CONFIGMAPS, cm_name, ns_ctl)
                entries = egress.parse_entries((cm or {}).get("data", {}).get(pgc.KEY_EGRESS_SERVICES))
                if cm is not None and entry in entries:
                    del entries[entry]
                    await kube.patch(CONFIGMAPS, cm_name, {
                        "metadata": {"resourceVersion": cm["metadata"].get("resourceVersion")},
                        "data": {pgc.KEY_EGRESS_SERVICES: egress.dump_entries(entries)}}, ns_ctl)
                for s in await kube.list(ENDPOINTSLICES, ns_ctl, f"{sel},{LABEL_PROXY_GROUP}={group}"):
                    await kube.delete(ENDPOINTSLICES, s["metadata"]["name"], ns_ctl)
                await kube.delete(SERVICES, o["metadata"]["name"], ns_ctl)
            log.info("Service %s/%s: egress through ProxyGroup %s removed", ns, name, group)


def _service_ports(svc: Mapping[str, Any] | None) -> dict[tuple[str, int], int]:
    """{(PROTOCOL, port): targetPort} of an existing ClusterIP Service (the health-check port aside)."""
    out: dict[tuple[str, int], int] = {}
    for p in ((svc or {}).get("spec") or {}).get("ports") or []:
        if p.get("name") == egress.HEALTH_PORT_NAME or not isinstance(p.get("targetPort"), int):
            continue
        out[(str(p.get("protocol") or "TCP").upper(), int(p["port"]))] = int(p["targetPort"])
    return out
