"""State Secret keys → what the parent's status says (pure).

The proxy's only channel back is its state Secret (`tscommon.secretcontract`): `device_id` (registered),
`device_fqdn` and `device_ips` (forwarding is in place), `https_endpoint` (serve config applied),
`reissue_authkey` (asks for a new key). From them come the Service's LoadBalancer ingress, the Ingress's
status (upstream's from `https_endpoint`; for the plain-HTTP scheme, ours, the device's MagicDNS name on port
80 once the proxy has applied a serve config naming it), the Connector's status and the conditions, whose
reasons are upstream's and whose messages say what is missing. No key or token ever reaches a status: messages
are built from our own words and the control plane's redacted errors.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tscommon import jsontext
from tscommon import secretcontract as sc

from .kindfacts import FACTS
from .model import ProxySpec


@dataclass(frozen=True)
class DeviceInfo:
    secret: str
    device_id: str = ""
    hostname: str = ""               # device_fqdn without the trailing dot
    ips: tuple[str, ...] = ()
    ingress_dns_name: str = ""       # https_endpoint (only from a proxy new enough to write it, as upstream)
    reissue_requested: bool = False
    serve_applied: bool = False      # the proxy has applied a serve config (it wrote https_endpoint, any value)


def device_info(name: str, data: Mapping[str, bytes] | None, pod_uid: str | None = None) -> DeviceInfo:
    """One replica's device from its state Secret. pod_uid, when known, must match the Secret's `pod_uid` for
    `https_endpoint` to count (a previous Pod's value is stale)."""
    d = data or {}
    dev = d.get(sc.KEY_DEVICE_ID, b"").decode(errors="replace").strip()
    host = sc.parse_device_fqdn(d.get(sc.KEY_DEVICE_FQDN))
    ingress, applied = "", False
    try:
        capver = int(d.get(sc.KEY_CAPVER, b"0").decode() or 0)
    except ValueError:
        capver = 0
    same_pod = pod_uid is None or d.get(sc.KEY_POD_UID, b"").decode(errors="replace") == pod_uid
    if capver >= 109 and same_pod and sc.KEY_POD_UID in d:
        ingress = sc.parse_https_endpoint(d.get(sc.KEY_HTTPS_ENDPOINT))
        applied = sc.KEY_HTTPS_ENDPOINT in d
    elif host:
        ingress, applied = host, True     # a proxy that cannot say: assumed applied, as upstream assumes HTTPS
    return DeviceInfo(name, dev, host, sc.parse_device_ips(d.get(sc.KEY_DEVICE_IPS)) if dev else (),
                      ingress, sc.KEY_REISSUE_AUTHKEY in d, applied)


def config_authkey(data: Mapping[str, bytes] | None) -> str:
    """The AuthKey currently in the replica's config file ("" when none)."""
    raw = (data or {}).get(sc.config_key(max(sc.CONFIG_CAPVERS)))
    try:
        conf = jsontext.loads(raw) if raw else {}
    except ValueError:
        return ""
    return str(conf.get("AuthKey") or "") if isinstance(conf, dict) else ""


def authkey_action(data: Mapping[str, bytes] | None) -> str:
    """What replica i's config needs: "new" (mint a key), "reissue" (the proxy asked: delete its old device,
    mint a key), "keep" (the current key is still needed) or "omit" (the proxy is registered: no key in its
    config, as upstream)."""
    if data is None:
        return "new"
    current = config_authkey(data)
    if sc.KEY_REISSUE_AUTHKEY in data:
        asked = data[sc.KEY_REISSUE_AUTHKEY].decode(errors="replace")
        # The agent names the key that failed; a config that already carries another one was answered before.
        return "reissue" if (not current or asked == current) else "keep"
    if data.get(sc.KEY_DEVICE_ID):
        return "omit"
    return "keep" if current else "new"


# ---- conditions


def condition(ctype: str, ok: bool, reason: str, message: str, *, generation: int | None,
              previous: Sequence[Mapping[str, Any]] | None, now: str) -> dict:
    """A metav1.Condition; lastTransitionTime is kept while the status does not change (idempotent writes)."""
    status = "True" if ok else "False"
    ltt = now
    for c in previous or ():
        if c.get("type") == ctype and c.get("status") == status and c.get("lastTransitionTime"):
            ltt = c["lastTransitionTime"]
    out: dict[str, Any] = {"type": ctype, "status": status, "reason": reason, "message": message,
                           "lastTransitionTime": ltt}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def with_condition(previous: Sequence[Mapping[str, Any]] | None, cond: dict) -> list[dict]:
    rest = [dict(c) for c in previous or () if c.get("type") != cond["type"]]
    return sorted(rest + [cond], key=lambda c: c["type"])


@dataclass(frozen=True)
class Readiness:
    ok: bool
    reason: str
    message: str


def readiness(kind: str, devices: Sequence[DeviceInfo], *, replicas: int, ready_replicas: int,
              failure: str = "", invalid: str = "") -> Readiness:
    """Ready, or the first thing that is missing, in the order a user would fix it."""
    facts = FACTS[kind]
    if invalid:
        return Readiness(False, facts.invalid_reason, invalid)
    if failure:
        return Readiness(False, facts.failed_reason, failure)
    pending = facts.pending_reason
    if replicas == 0:
        return Readiness(True, facts.ready_reason, "scaled to 0 replicas")
    registered = [d for d in devices if d.device_id]
    if len(registered) < replicas:
        pods = f"{ready_replicas}/{replicas} proxy Pods ready"
        return Readiness(False, pending, f"device not yet registered with the control plane ({pods})")
    named = [d for d in registered if d.hostname]
    if len(named) < replicas:
        return Readiness(False, pending, "no Tailscale hostname known yet: the device is registered, the "
                                         "proxy is still setting up forwarding")
    if ready_replicas < replicas:
        return Readiness(False, pending, f"proxy Pod not ready ({ready_replicas}/{replicas} ready)")
    names = ", ".join(d.hostname for d in named)
    return Readiness(True, facts.ready_reason, f"proxy ready: {names}")


# ---- per kind status bodies


def service_load_balancer(devices: Sequence[DeviceInfo], service_families: Sequence[str]) -> dict:
    """status.loadBalancer for a Tailscale LoadBalancer Service: the hostname, then the tailnet IPs of the
    Service's families (both for a dual-stack Service, where upstream gives only IPv4)."""
    ingress: list[dict] = []
    for d in devices:
        if not d.hostname:
            continue
        ingress.append({"hostname": d.hostname})
        for ip in d.ips:
            fam = "IPv6" if ipaddress.ip_address(ip).version == 6 else "IPv4"
            if fam in service_families:
                ingress.append({"ip": ip})
    return {"ingress": ingress} if ingress else {}


def service_families(svc: Mapping[str, Any]) -> tuple[str, ...]:
    spec = svc.get("spec") or {}
    fams = tuple(spec.get("ipFamilies") or ())
    if not fams:
        fams = tuple("IPv6" if ":" in ip else "IPv4" for ip in (spec.get("clusterIPs") or []) if ip != "None")
    return fams or ("IPv4",)


def ingress_load_balancer(devices: Sequence[DeviceInfo], spec: ProxySpec) -> dict:
    """Upstream's: https_endpoint on 443 (+80 with the redirect). The user's certificate (ours): the MagicDNS
    name on 443 (+80). The HTTP scheme (ours): the device's MagicDNS
    name on port 80 once its serve config names that device and the proxy has applied a config."""
    if spec.tls_secret:
        # The user's certificate (ours): the MagicDNS name the serve config answers to, once it is applied.
        ports = [{"port": 443, "protocol": "TCP"}]
        if spec.serve_config and "80" in (spec.serve_config.get("TCP") or {}):
            ports.append({"port": 80, "protocol": "TCP"})
        ingress = [{"hostname": d.hostname, "ports": ports} for d in devices
                   if d.hostname and d.hostname == spec.ingress_http_name and d.serve_applied]
        return {"ingress": ingress} if ingress else {}
    if spec.ingress_http:
        ingress = [{"hostname": d.hostname, "ports": [{"port": 80, "protocol": "TCP"}]} for d in devices
                   if d.hostname and d.hostname == spec.ingress_http_name and d.serve_applied]
        return {"ingress": ingress} if ingress else {}
    ports = [{"port": 443, "protocol": "TCP"}]
    if spec.serve_config and "80" in (spec.serve_config.get("TCP") or {}):
        ports.append({"port": 80, "protocol": "TCP"})
    ingress = [{"hostname": d.ingress_dns_name, "ports": ports} for d in devices if d.ingress_dns_name]
    return {"ingress": ingress} if ingress else {}


def connector_status(spec: ProxySpec | None, devices: Sequence[DeviceInfo]) -> dict:
    devs = [{"hostname": d.hostname, "tailnetIPs": list(d.ips)} for d in devices if d.hostname]
    out: dict[str, Any] = {"subnetRoutes": ",".join(spec.subnet_routes) if spec else "",
                           "isExitNode": bool(spec and spec.exit_node), "isAppConnector": False,
                           "devices": devs}
    if devs:
        out["hostname"] = devs[0]["hostname"]
        out["tailnetIPs"] = devs[0]["tailnetIPs"]
    return out
