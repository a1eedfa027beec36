"""The DNSConfig pass (shell): read the cluster, compute with `dnsconfig` (pure), write what differs.

One pass keeps everything at once: the refusal of extra DNSConfigs, the nameserver's objects, the records in
the ``dnsrecords`` ConfigMap, the DNSConfig's status and, when configured, the stub zone in CoreDNS's
ConfigMap. Any event that can change one of them pokes the same queue key (`dnsconfig.QUEUE_KEY`: a DNSConfig,
any Service or Ingress, an EndpointSlice in the controller's namespace), so records follow proxies and parents
level-triggered: a missed event delays them until the next one or the periodic re-check, never leaves them
wrong.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..kinds import dnsconfig as dc
from ..kinds import meta
from ..kindtable import KINDS
from ..kubeapi import (
    CONFIGMAPS,
    DEPLOYMENTS,
    DNSCONFIGS,
    ENDPOINTSLICES,
    SERVICEACCOUNTS,
    SERVICES,
    KubeError,
    Resource,
)
from ..model import DNSCONFIG, LABEL_MANAGED
from ..writer import Writer

log = logging.getLogger("controller")

#: Safety-net re-check (hand edits of the ConfigMaps are undone then at the latest).
RECHECK = 600.0


class DNSConfigPass:
    def __init__(self, w: Writer) -> None:
        self.w = w

    async def run(self, kind: str = DNSCONFIG, namespace: str = "", name: str = "") -> float | None:
        kube, cfg = self.w.kube, self.w.cfg
        try:
            dnsconfigs = await kube.list(DNSCONFIGS)
        except KubeError as e:
            if e.status == 404:    # the CRD is not installed: nothing to do
                return None
            raise
        choice = dc.choose(dnsconfigs)
        for extra in choice.extra:
            await self.refuse(extra, dc.REASON_MULTIPLE, dc.MESSAGE_MULTIPLE)
        if choice.active is None:
            await self.stub_zone("", "")
            return None
        obj = choice.active
        try:
            dc.validate(obj)
        except dc.DNSConfigInvalid as e:
            await self.refuse(obj, dc.REASON_FAILED, str(e))
            return None
        ns = cfg.namespace
        headless = await kube.list(SERVICES, ns, f"{LABEL_MANAGED}=true")
        parents: dict[tuple[str, str, str], Mapping[str, Any]] = {}
        for key in dc.parent_keys(headless):
            if (p := await kube.get(KINDS[key[0]].resource, key[2], key[1])) is not None:
                parents[key] = p
        slices = await kube.list(ENDPOINTSLICES, ns)
        ip4, ip6 = dc.records(headless, parents, slices)
        domain = dc.domain(cfg, [*ip4, *ip6])
        if problem := dc.image_problem(obj, cfg, domain):
            await self.refuse(obj, dc.REASON_FAILED, problem)
            return None
        objs = dc.render(obj, cfg, domain)
        await self.apply(SERVICEACCOUNTS, objs.service_account)
        await self.apply_records(obj, dc.records_text(headless, parents, slices))
        await self.apply(DEPLOYMENTS, objs.deployment)
        svc = await self.apply_service(objs.service)
        ip = ((svc or {}).get("spec") or {}).get("clusterIP") or ""
        if ip and ip != "None":
            await self.status(obj, True, dc.REASON_CREATED, dc.REASON_CREATED, ip)
            await self.stub_zone(domain, ip)
        return RECHECK

    # ---- writes

    async def apply(self, res: Resource, desired: dict) -> dict | None:
        md = desired["metadata"]
        cur = await self.w.kube.get(res, md["name"], md["namespace"])
        if cur is None:
            log.info("DNSConfig: creating %s %s/%s", desired["kind"], md["namespace"], md["name"])
        return await self.w.apply_known(res, desired, cur)

    async def apply_service(self, desired: dict) -> dict | None:
        md = desired["metadata"]
        cur = await self.w.kube.get(SERVICES, md["name"], md["namespace"])
        want_ip = desired["spec"].get("clusterIP")
        if cur is not None and want_ip and (cur.get("spec") or {}).get("clusterIP") != want_ip:
            # A Service's clusterIP cannot change in place: a new address means a new Service.
            log.info("DNSConfig: the nameserver Service moves to %s", want_ip)
            await self.w.kube.delete(SERVICES, md["name"], md["namespace"])
        return await self.apply(SERVICES, desired)

    async def apply_records(self, obj: Mapping[str, Any], text: str) -> None:
        kube = self.w.kube
        desired = dc.records_configmap(obj, self.w.cfg, text)
        md = desired["metadata"]
        cur = await kube.get(CONFIGMAPS, md["name"], md["namespace"])
        if cur is None:
            await kube.create(CONFIGMAPS, desired, md["namespace"])
        elif (cur.get("data") or {}).get(dc.RECORDS_KEY) != text:
            await kube.patch(CONFIGMAPS, md["name"], {"data": desired["data"]}, md["namespace"])
        else:
            return
        log.info("DNSConfig: records are now %s", " ".join(text.split()))

    async def stub_zone(self, zone: str, ip: str) -> None:
        cfg, kube = self.w.cfg, self.w.kube
        if not cfg.stub_zone_configmap:
            return
        ns, name = cfg.stub_zone_configmap.split("/", 1)
        cm = await kube.get(CONFIGMAPS, name, ns)
        if cm is None:
            log.warning("DNSConfig: DNS_STUB_ZONE_CONFIGMAP names %s/%s, which does not exist; add the stub zone "
                        "to your cluster DNS by hand (docs/dns.md)", ns, name)
            return
        cur = (cm.get("data") or {}).get("Corefile", "")
        new = dc.with_stub_zone(cur, zone, ip)
        if new != cur:
            await kube.patch(CONFIGMAPS, name, {"data": {"Corefile": new},
                                                "metadata": {"resourceVersion": meta(cm).get("resourceVersion")}}, ns)
            log.info("DNSConfig: stub zone %s in %s/%s", f"{zone} -> {ip}" if zone else "removed", ns, name)

    # ---- status and events

    async def status(self, obj: Mapping[str, Any], ok: bool, reason: str, message: str, ip: str = "") -> None:
        cur = obj.get("status") or {}
        want: dict[str, Any] = {}
        conds = self.w.conditions(obj, dc.COND_NAMESERVER_READY, ok, reason, message)
        if conds != list(cur.get("conditions") or []):
            want["conditions"] = conds
        nameserver = {"ip": ip} if ip else None
        if (cur.get("nameserver") or None) != nameserver:
            want["nameserver"] = nameserver
        await self.w.patch_status(DNSCONFIG, obj, want)

    async def refuse(self, obj: Mapping[str, Any], reason: str, message: str) -> None:
        """The DNSConfig's condition False and one Warning event per problem (the last one only is
        remembered: a DNSConfig refused for one reason at a time)."""
        await self.status(obj, False, reason, message)
        self.w.keep_warnings(obj, {f"{reason}:{message}"})
        await self.w.warn(obj, DNSCONFIG, reason, message)
