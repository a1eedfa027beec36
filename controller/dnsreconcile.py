"""The DNSConfig pass (shell): read the cluster, compute with `dnsconfig` (pure), write what differs.

One pass keeps everything at once: the refusal of extra DNSConfigs, the nameserver's objects, the records in
the ``dnsrecords`` ConfigMap, the DNSConfig's status and, when configured, the stub zone in CoreDNS's
ConfigMap. Any event that can change one of them pokes the same queue key (a DNSConfig, any Service or
Ingress, an EndpointSlice in the controller's namespace), so records follow proxies and parents level-
triggered: a missed event delays them until the next one or the periodic re-check, never leaves them wrong.
"""
from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any

from . import dnsconfig as dc, render, status as st
from .config import ControllerConfig
from .kinds import meta
from .kubeapi import (CONFIGMAPS, DEPLOYMENTS, DNSCONFIGS, ENDPOINTSLICES, EVENTS, INGRESSES, SERVICEACCOUNTS,
                      SERVICES, Kube, KubeError, Resource)
from .model import LABEL_MANAGED, SVC

log = logging.getLogger("controller")

#: Safety-net re-check (hand edits of the ConfigMaps are undone then at the latest).
RECHECK = 600.0


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class DNSReconciler:
    def __init__(self, kube: Kube, cfg: ControllerConfig, *, now: Callable[[], str] = _now) -> None:
        self.kube, self.cfg, self.now = kube, cfg, now
        self._warned: dict[str, str] = {}   # DNSConfig UID -> the problem last sent as a Warning event

    async def reconcile(self) -> float | None:
        try:
            dnsconfigs = await self.kube.list(DNSCONFIGS)
        except KubeError as e:
            if e.status == 404:    # the CRD is not installed: nothing to do
                return None
            raise
        choice = dc.choose(dnsconfigs)
        for extra in choice.extra:
            await self._refuse(extra, dc.REASON_MULTIPLE, dc.MESSAGE_MULTIPLE)
        if choice.active is None:
            await self._stub_zone("", "")
            return None
        obj = choice.active
        try:
            dc.validate(obj)
        except dc.DNSConfigInvalid as e:
            await self._refuse(obj, dc.REASON_FAILED, str(e))
            return None
        ns = self.cfg.namespace
        headless = await self.kube.list(SERVICES, ns, f"{LABEL_MANAGED}=true")
        parents: dict[tuple[str, str, str], Mapping[str, Any]] = {}
        for key in dc.parent_keys(headless):
            res = SERVICES if key[0] == SVC else INGRESSES
            if (p := await self.kube.get(res, key[2], key[1])) is not None:
                parents[key] = p
        slices = await self.kube.list(ENDPOINTSLICES, ns)
        ip4, ip6 = dc.records(headless, parents, slices)
        domain = dc.domain(self.cfg, [*ip4, *ip6])
        if problem := dc.image_problem(obj, self.cfg, domain):
            await self._refuse(obj, dc.REASON_FAILED, problem)
            return None
        objs = dc.render(obj, self.cfg, domain)
        await self._apply(SERVICEACCOUNTS, objs.service_account)
        await self._apply_records(obj, dc.records_text(headless, parents, slices))
        await self._apply(DEPLOYMENTS, objs.deployment)
        svc = await self._apply_service(objs.service)
        ip = ((svc or {}).get("spec") or {}).get("clusterIP") or ""
        if ip and ip != "None":
            await self._status(obj, True, dc.REASON_CREATED, dc.REASON_CREATED, ip)
            await self._stub_zone(domain, ip)
        return RECHECK

    # ---- writes

    async def _apply(self, res: Resource, desired: dict) -> dict | None:
        md = desired["metadata"]
        cur = await self.kube.get(res, md["name"], md["namespace"])
        if cur is None:
            log.info("DNSConfig: creating %s %s/%s", desired["kind"], md["namespace"], md["name"])
            return await self.kube.create(res, desired, md["namespace"])
        if (cur["metadata"].get("annotations") or {}).get(render.SPEC_HASH) == md["annotations"][render.SPEC_HASH]:
            return cur
        return await self.kube.patch(res, md["name"], desired, md["namespace"])

    async def _apply_service(self, desired: dict) -> dict | None:
        md = desired["metadata"]
        cur = await self.kube.get(SERVICES, md["name"], md["namespace"])
        want_ip = desired["spec"].get("clusterIP")
        if cur is not None and want_ip and (cur.get("spec") or {}).get("clusterIP") != want_ip:
            # A Service's clusterIP cannot change in place: a new address means a new Service.
            log.info("DNSConfig: the nameserver Service moves to %s", want_ip)
            await self.kube.delete(SERVICES, md["name"], md["namespace"])
        return await self._apply(SERVICES, desired)

    async def _apply_records(self, obj: Mapping[str, Any], text: str) -> None:
        desired = dc.records_configmap(obj, self.cfg, text)
        md = desired["metadata"]
        cur = await self.kube.get(CONFIGMAPS, md["name"], md["namespace"])
        if cur is None:
            await self.kube.create(CONFIGMAPS, desired, md["namespace"])
        elif (cur.get("data") or {}).get(dc.RECORDS_KEY) != text:
            await self.kube.patch(CONFIGMAPS, md["name"], {"data": desired["data"]}, md["namespace"])
        else:
            return
        log.info("DNSConfig: records are now %s", " ".join(text.split()))

    async def _stub_zone(self, zone: str, ip: str) -> None:
        if not self.cfg.stub_zone_configmap:
            return
        ns, name = self.cfg.stub_zone_configmap.split("/", 1)
        cm = await self.kube.get(CONFIGMAPS, name, ns)
        if cm is None:
            log.warning("DNSConfig: DNS_STUB_ZONE_CONFIGMAP names %s/%s, which does not exist; add the stub zone "
                        "to your cluster DNS by hand (docs/dns.md)", ns, name)
            return
        cur = (cm.get("data") or {}).get("Corefile", "")
        new = dc.with_stub_zone(cur, zone, ip)
        if new != cur:
            await self.kube.patch(CONFIGMAPS, name, {"data": {"Corefile": new},
                                                     "metadata": {"resourceVersion": meta(cm).get("resourceVersion")}},
                                  ns)
            log.info("DNSConfig: stub zone %s in %s/%s", f"{zone} -> {ip}" if zone else "removed", ns, name)

    # ---- status and events

    async def _status(self, obj: Mapping[str, Any], ok: bool, reason: str, message: str, ip: str = "") -> None:
        m, cur = meta(obj), obj.get("status") or {}
        cond = st.condition(dc.COND_NAMESERVER_READY, ok, reason, message, generation=m.get("generation"),
                            previous=cur.get("conditions"), now=self.now())
        want: dict[str, Any] = {}
        conds = st.with_condition(cur.get("conditions"), cond)
        if conds != list(cur.get("conditions") or []):
            want["conditions"] = conds
        nameserver = {"ip": ip} if ip else None
        if (cur.get("nameserver") or None) != nameserver:
            want["nameserver"] = nameserver
        if want:
            await self.kube.patch(DNSCONFIGS, m["name"], {"status": want}, subresource="status")

    async def _refuse(self, obj: Mapping[str, Any], reason: str, message: str) -> None:
        await self._status(obj, False, reason, message)
        m = meta(obj)
        uid = m.get("uid", "")
        if self._warned.get(uid) == f"{reason}:{message}":
            return
        self._warned[uid] = f"{reason}:{message}"
        log.warning("DNSConfig %s: %s", m.get("name", ""), message)
        now = self.now()
        ev = {"apiVersion": "v1", "kind": "Event",
              "metadata": {"generateName": f"{m.get('name', 'x')}.", "namespace": "default"},
              "involvedObject": {"apiVersion": f"{dc.GROUP}/{dc.VERSION}", "kind": dc.KIND, "name": m.get("name", ""),
                                 "uid": uid},
              "reason": reason, "message": message, "type": "Warning",
              "source": {"component": "tailscale-controller"}, "reportingComponent": "tailscale-controller",
              "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        try:
            await self.kube.create(EVENTS, ev, "default")
        except KubeError as e:
            log.warning("could not record an event: %s", e)

