"""Egress and ingress *services* of ProxyGroup Pods, as pure functions: config in, rules and status out.

A ProxyGroup Pod serves many Kubernetes Services at once. The operator describes them in two files:

* ``TS_EGRESS_PROXIES_CONFIG_PATH/egress-services`` -- cluster traffic to a Pod port (``matchPort``) goes to a
  tailnet target (an IP or a MagicDNS name) on ``targetPort``, SNATed to the node's tailnet address
  (netfilter O5); ``hep-pings`` in the same directory feeds the pre-shutdown drain hook;
* ``TS_INGRESS_PROXIES_CONFIG_PATH`` -- traffic to a Tailscale Service VIP goes to a ClusterIP (O6).

The agent answers through its state Secret: ``egress-services`` and ``ingress-config.json`` record, per service,
what is installed, and the operator routes a service to this Pod only when the record matches what it asked for
(spec 4.11, netfilter-spec 4.1-4.3). Formats and field names are upstream's.

Differences from upstream, on purpose:
* A service is recorded in the status only when its rules are in the kernel. Upstream records a service whose
  FQDN does not resolve (with no target IPs) and the operator then routes to a Pod that drops the traffic.
* One bad service (a malformed entry, a port another service already maps) is reported and skipped; the others
  keep working. Upstream fails the whole sync and exits.
* Removing a service removes its SNAT and MSS-clamp rules too (the whole rule set is recomputed).
* IPv6 targets are kept where the namespace has IPv6 NAT, dropped with a reason where it does not.
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from netfilter.model import ServiceDnat, ServicePortMap

# The egress-services document is the ProxyGroup contract's (tscommon.pgcontract); its types are used here.
from tscommon.pgcontract import ConfigError as ConfigError
from tscommon.pgcontract import EgressConfig as EgressConfig
from tscommon.pgcontract import EgressService as EgressService
from tscommon.pgcontract import PortMap as PortMap
from tscommon.pgcontract import load_object
from tscommon.pgcontract import parse_egress_services as parse_egress_services
from tscommon.pgcontract import parse_hep_pings as parse_hep_pings

from .state import IP, NodeState, ResolveError, resolve_tailnet_fqdn

# ----------------------------------------------------------------------------------------------- ingress config

@dataclass(frozen=True)
class IngressMapping:
    vip: IP              # the Tailscale Service address
    cluster_ip: IP

    def to_json(self) -> dict[str, str]:
        return {"TailscaleServiceIP": str(self.vip), "ClusterIP": str(self.cluster_ip)}


@dataclass(frozen=True)
class IngressService:
    name: str
    v4: IngressMapping | None = None
    v6: IngressMapping | None = None

    @property
    def mappings(self) -> tuple[IngressMapping, ...]:
        return tuple(m for m in (self.v4, self.v6) if m is not None)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.v4 is not None:
            out["IPv4Mapping"] = self.v4.to_json()
        if self.v6 is not None:
            out["IPv6Mapping"] = self.v6.to_json()
        return out


@dataclass(frozen=True)
class IngressConfig:
    services: tuple[IngressService, ...] = ()
    problems: tuple[tuple[str, str], ...] = ()


def _parse_mapping(name: str, key: str, raw: Any, version: int) -> IngressMapping | None:
    if raw is None:
        return None
    where = f"ingress config: service {name!r}: {key}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object with TailscaleServiceIP and ClusterIP")
    addrs = []
    for field_name in ("TailscaleServiceIP", "ClusterIP"):
        value = raw.get(field_name)
        try:
            addr = ipaddress.ip_address(value) if isinstance(value, str) else None
        except ValueError:
            addr = None
        if addr is None:
            raise ConfigError(f"{where}.{field_name} {json.dumps(value)} is not an IP address")
        if addr.version != version:
            raise ConfigError(f"{where}.{field_name} {value} is not an IPv{version} address")
        if addr.is_unspecified:
            # The operator writes the zero address for a family the Tailscale Service lacks (netfilter E23).
            return None
        addrs.append(addr)
    return IngressMapping(addrs[0], addrs[1])


def parse_ingress_config(text: str | None) -> IngressConfig:
    """Parse the ingress services file ({name: {IPv4Mapping, IPv6Mapping}}); missing or empty means none."""
    doc = load_object(text, "ingress config", "Tailscale Service name -> mappings")
    if doc is None:
        return IngressConfig()
    services: list[IngressService] = []
    problems: list[tuple[str, str]] = []
    vips: dict[IP, str] = {}
    for name in sorted(doc):
        raw = doc[name]
        try:
            if not name.strip() or any(c in name for c in "\"\n\r\t\\"):
                raise ConfigError(f"ingress config: service {name!r}: the name must be non-empty, without quotes, "
                                  "backslashes or control characters")
            if not isinstance(raw, dict):
                raise ConfigError(f"ingress config: service {name!r}: expected an object")
            svc = IngressService(name, _parse_mapping(name, "IPv4Mapping", raw.get("IPv4Mapping"), 4),
                                 _parse_mapping(name, "IPv6Mapping", raw.get("IPv6Mapping"), 6))
            for m in svc.mappings:
                if m.vip in vips:
                    raise ConfigError(f"ingress config: service {name!r}: Tailscale Service IP {m.vip} is already "
                                      f"mapped by service {vips[m.vip]!r}")
        except ConfigError as e:
            problems.append((name, str(e)))
            continue
        for m in svc.mappings:
            vips[m.vip] = name
        services.append(svc)
    return IngressConfig(tuple(services), tuple(problems))


# ----------------------------------------------------------------------------------------------- desired state

@dataclass(frozen=True)
class ServiceResult:
    """What one configured service gets this pass."""

    name: str
    kind: str                       # "egress-service" | "ingress-service"
    value: str                      # the target (egress) or VIPs (ingress), for /status
    resolved: tuple[IP, ...] = ()
    error: str = ""
    installed: bool = False         # the desired rule set carries all of its rules


@dataclass(frozen=True)
class ServicesDesired:
    port_maps: tuple[ServicePortMap, ...] = ()
    service_dnats: tuple[ServiceDnat, ...] = ()
    results: tuple[ServiceResult, ...] = ()
    egress_status: bytes | None = None      # value for the Secret key, None when egress services are off
    ingress_status: bytes | None = None
    families: frozenset[int] = field(default_factory=frozenset)   # IP versions that need forwarding


@dataclass(frozen=True)
class ServicesInput:
    """The agent's view of the two files (None: that feature is not configured)."""

    egress: EgressConfig | None = None
    ingress: IngressConfig | None = None
    egress_error: str = ""      # the file is unusable; the last good `egress` stays in force
    ingress_error: str = ""


def _dump(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _pod_ips(pod_ipv4: IP | None, pod_ipv6: IP | None) -> dict[str, str]:
    return {"podIPv4": str(pod_ipv4) if pod_ipv4 else "", "podIPv6": str(pod_ipv6) if pod_ipv6 else ""}


def compute_services(inp: ServicesInput, node: NodeState, *, families: tuple[int, ...] = (4, 6),
                     pod_ipv4: IP | None = None, pod_ipv6: IP | None = None,
                     reserved: frozenset[IP] = frozenset(), no_data_path: str = "") -> ServicesDesired:
    """Rules and Secret status for every configured service, from the whole current state.

    `families`: IP versions the firewall can translate. `reserved`: addresses the agent already DNATs for
    another purpose (the node's own tailnet IPs under TS_DEST_IP); a VIP among them is refused.
    `no_data_path`: when set, the reason no service can have rules (userspace networking): each service
    reports it and none is recorded."""
    own = node.tailnet_ips
    port_maps: list[ServicePortMap] = []
    dnats: list[ServiceDnat] = []
    results: list[ServiceResult] = []
    used: set[int] = set()
    egress_status = ingress_status = None
    pods = _pod_ips(pod_ipv4, pod_ipv6)

    for which, err in (("egress", inp.egress_error), ("ingress", inp.ingress_error)):
        if err:
            results.append(ServiceResult(f"{which}-services-config", f"{which}-service", "",
                                         error=f"{err} (the last good configuration stays in force)"))
    if inp.egress is not None:
        recorded: dict[str, Any] = {}
        for name, problem in inp.egress.problems:
            results.append(ServiceResult(name, "egress-service", "", error=problem))
        for svc in inp.egress.services:
            r = _egress_service(svc, node, own, families)
            if no_data_path:
                r = (replace(r[0], installed=False, error=no_data_path), [])
            results.append(r[0])
            if r[0].installed:
                port_maps.extend(r[1])
                used.update(ip.version for ip in r[0].resolved)
                recorded[svc.name] = {"ports": [pm.to_json() for pm in svc.ports],
                                      "tailnetTargetIPs": [str(ip) for ip in r[0].resolved],
                                      "tailnetTarget": svc.target_json()}
        doc: dict[str, Any] = {"podIPv4": pods["podIPv4"]}
        if pods["podIPv6"]:
            doc["podIPv6"] = pods["podIPv6"]
        doc["services"] = recorded or None
        egress_status = _dump(doc)

    if inp.ingress is not None:
        configs: dict[str, Any] = {}
        for name, problem in inp.ingress.problems:
            results.append(ServiceResult(name, "ingress-service", "", error=problem))
        for isvc in inp.ingress.services:
            vips = ",".join(str(m.vip) for m in isvc.mappings)
            missing = [m for m in isvc.mappings if m.vip.version not in families]
            if not isvc.mappings:
                results.append(ServiceResult(isvc.name, "ingress-service", vips, error="no address mapping"))
                continue
            if no_data_path:
                results.append(ServiceResult(isvc.name, "ingress-service", vips, error=no_data_path))
                continue
            clash = next((m.vip for m in isvc.mappings if m.vip in reserved), None)
            if clash is not None:
                results.append(ServiceResult(isvc.name, "ingress-service", vips, error=(
                    f"Tailscale Service IP {clash} is already forwarded by this proxy for another purpose")))
                continue
            if missing:
                results.append(ServiceResult(isvc.name, "ingress-service", vips, error=(
                    f"IPv{missing[0].vip.version} NAT is not available in this network namespace, so "
                    f"{missing[0].vip} cannot be forwarded")))
                continue
            dnats.extend(ServiceDnat(isvc.name, m.vip, m.cluster_ip) for m in isvc.mappings)
            used.update(m.vip.version for m in isvc.mappings)
            results.append(ServiceResult(isvc.name, "ingress-service", vips,
                                         tuple(m.cluster_ip for m in isvc.mappings), installed=True))
            configs[isvc.name] = isvc.to_json()
        doc = {}
        if configs:
            doc["configs"] = configs
        doc.update({k: v for k, v in pods.items() if v})
        ingress_status = _dump(doc)

    return ServicesDesired(tuple(port_maps), tuple(dnats), tuple(results), egress_status, ingress_status,
                           frozenset(used))


def _egress_service(svc: EgressService, node: NodeState, own: tuple[IP, ...],
                    families: tuple[int, ...]) -> tuple[ServiceResult, list[ServicePortMap]]:
    base = ServiceResult(svc.name, "egress-service", svc.target)
    if not own:
        return ServiceResult(svc.name, "egress-service", svc.target,
                             error="waiting for the node's tailnet addresses"), []
    if svc.target_ip:
        targets: tuple[IP, ...] = (ipaddress.ip_address(svc.target_ip),)
    else:
        try:
            targets = resolve_tailnet_fqdn(node, svc.target_fqdn)
        except ResolveError as e:
            return ServiceResult(svc.name, "egress-service", svc.target, error=str(e)), []
    chosen: list[IP] = []
    skipped: list[str] = []
    for version in (4, 6):
        target = next((ip for ip in targets if ip.version == version), None)
        if target is None:
            continue
        if version not in families:
            skipped.append(f"IPv{version} NAT is not available in this network namespace")
        elif not any(ip.version == version for ip in own):
            skipped.append(f"the node has no tailnet IPv{version} address")
        else:
            chosen.append(target)
    if not chosen:
        return ServiceResult(svc.name, "egress-service", svc.target, targets,
                             error="; ".join(skipped) or "no usable target address"), []
    # A service without ports (`"ports": []`) has no rules, and is recorded with its targets all the same, as
    # upstream does: the operator waits for that record.
    maps: list[ServicePortMap] = []
    for target in chosen:
        src = next(ip for ip in own if ip.version == target.version)
        # ServicePortMap lower-cases the protocol: "tcp" and "TCP" make one rule (de-duplicated below).
        maps.extend(ServicePortMap(svc.name, pm.protocol, pm.match_port, pm.target_port, target, src)
                    for pm in svc.ports)
    return ServiceResult(base.name, base.kind, base.value, tuple(chosen), installed=True), list(dict.fromkeys(maps))
