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
from tscommon import jsontext

from .state import IP, NodeState, ResolveError, resolve_tailnet_fqdn

EGRESS_FILE = "egress-services"
HEP_PINGS_FILE = "hep-pings"
PRESHUTDOWN_PATH = "/internal-egress-services-preshutdown"


class ConfigError(ValueError):
    """A whole config file is unusable (the last good one stays in force)."""


# ----------------------------------------------------------------------------------------------- egress config

@dataclass(frozen=True)
class PortMap:
    protocol: str        # as configured ("TCP" as Kubernetes spells it, or "tcp"): the status echoes it exactly
    match_port: int      # the Pod port the operator's ClusterIP Service targets
    target_port: int     # the port on the tailnet target

    @property
    def key(self) -> tuple[str, int]:
        """What the rule matches on: the protocol in any spelling, and the Pod port."""
        return self.protocol.upper(), self.match_port

    def to_json(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "matchPort": self.match_port, "targetPort": self.target_port}


@dataclass(frozen=True)
class EgressService:
    name: str
    target_ip: str = ""
    target_fqdn: str = ""
    ports: tuple[PortMap, ...] = ()
    health_check_endpoint: str = ""

    def target_json(self) -> dict[str, str]:
        return {"ip": self.target_ip, "fqdn": self.target_fqdn}

    @property
    def target(self) -> str:
        return self.target_ip or self.target_fqdn


@dataclass(frozen=True)
class EgressConfig:
    """The parsed egress-services file. `problems` are per-service errors: those services are skipped."""

    services: tuple[EgressService, ...] = ()
    problems: tuple[tuple[str, str], ...] = ()   # (service name, what is wrong)


def _where(name: str) -> str:
    return f"egress-services: service {name!r}"


def _parse_port(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(f"{what} must be a port number 1-65535, not {json.dumps(value)}")
    return value


def _parse_egress_service(name: str, raw: Any) -> EgressService:
    where = _where(name)
    if not name.strip() or any(c in name for c in "\"\n\r\t\\"):
        raise ConfigError(f"{where}: the name must be non-empty, without quotes, backslashes or control characters")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object, got {json.dumps(raw)[:60]}")
    tt = raw.get("tailnetTarget") or {}
    if not isinstance(tt, dict):
        raise ConfigError(f"{where}: tailnetTarget must be an object with \"ip\" or \"fqdn\"")
    ip, fqdn = tt.get("ip") or "", tt.get("fqdn") or ""
    if not isinstance(ip, str) or not isinstance(fqdn, str):
        raise ConfigError(f"{where}: tailnetTarget.ip and tailnetTarget.fqdn must be strings")
    if bool(ip) == bool(fqdn):
        raise ConfigError(f"{where}: set exactly one of tailnetTarget.ip and tailnetTarget.fqdn "
                          f"(got ip={ip!r}, fqdn={fqdn!r})")
    if ip:
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            raise ConfigError(f"{where}: tailnetTarget.ip {ip!r} is not an IP address") from None
        if addr.is_unspecified:
            raise ConfigError(f"{where}: tailnetTarget.ip {ip!r} is the unspecified address")
    ports_raw = raw.get("ports") or []
    if not isinstance(ports_raw, list):
        raise ConfigError(f"{where}: ports must be a list of {{protocol, matchPort, targetPort}}")
    ports: dict[PortMap, None] = {}
    for i, p in enumerate(ports_raw):
        if not isinstance(p, dict):
            raise ConfigError(f"{where}: ports[{i}] must be an object")
        proto = p.get("protocol")
        if not isinstance(proto, str) or proto.upper() not in ("TCP", "UDP"):
            raise ConfigError(f"{where}: ports[{i}].protocol must be TCP or UDP, not {json.dumps(proto)}")
        # The protocol is kept as written: the operator compares the status with what it wrote, byte for byte.
        pm = PortMap(proto, _parse_port(p.get("matchPort"), f"{where}: ports[{i}].matchPort"),
                     _parse_port(p.get("targetPort"), f"{where}: ports[{i}].targetPort"))
        other = next((q for q in ports if q.key == pm.key), None)
        if other is not None and other.target_port != pm.target_port:
            raise ConfigError(f"{where}: {pm.key[0]} port {pm.match_port} is mapped twice (to target ports "
                              f"{other.target_port} and {pm.target_port}); map each matchPort once")
        ports.setdefault(pm)
    hep = raw.get("healthCheckEndpoint") or ""
    if not isinstance(hep, str):
        raise ConfigError(f"{where}: healthCheckEndpoint must be a string URL")
    return EgressService(name, ip, fqdn, tuple(ports), hep)


def _load_object(text: str | None, what: str, shape: str) -> dict | None:
    """The file's JSON object; None for a missing, empty or null file (no services)."""
    if text is None or not text.strip():
        return None
    try:
        doc = jsontext.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} is not valid JSON: {e}") from None
    if doc is not None and not isinstance(doc, dict):
        raise ConfigError(f"{what} must be a JSON object of {shape}")
    return doc


def parse_egress_services(text: str | None) -> EgressConfig:
    """Parse the egress-services file. A missing or empty file means no services.

    Raises ConfigError when the file as a whole is unusable; a bad service is only listed in `problems`.
    Services come out sorted by name, so that which of two conflicting services wins does not depend on
    the order of keys in the file."""
    doc = _load_object(text, "egress-services", "service name -> config")
    if doc is None:
        return EgressConfig()
    services: list[EgressService] = []
    problems: list[tuple[str, str]] = []
    taken: dict[tuple[str, int], str] = {}
    for name in sorted(doc):
        try:
            svc = _parse_egress_service(name, doc[name])
        except ConfigError as e:
            problems.append((name, str(e)))
            continue
        clash = next(((pm, taken[pm.key]) for pm in svc.ports if pm.key in taken), None)
        if clash is not None:
            pm, other = clash
            problems.append((name, f"{_where(name)}: {pm.key[0]} port {pm.match_port} is already mapped by "
                                   f"service {other!r}; each matchPort can serve one service"))
            continue
        for pm in svc.ports:
            taken[pm.key] = name
        services.append(svc)
    return EgressConfig(tuple(services), tuple(problems))


def parse_hep_pings(text: str | None) -> int:
    """Health-check pings per drain round: missing or empty is 0, negative is 0 (as upstream)."""
    if text is None or not text.strip():
        return 0
    try:
        return max(0, int(text.strip(), 10))
    except ValueError:
        raise ConfigError(f"hep-pings must be an integer, not {text.strip()[:40]!r}") from None


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
    doc = _load_object(text, "ingress config", "Tailscale Service name -> mappings")
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
