"""The ProxyGroup contract between the controller and the agent: the group's ConfigMap and its Pods' hooks.

One module below both, as ``secretcontract`` is for the state Secret, so the two sides cannot drift. The
controller (``controller.pgrender``, ``controller.kinds.egress``) renders the ConfigMap mounted at
`CONFIG_DIR` in every replica: `KEY_EGRESS_SERVICES`, a JSON object {entry name: egress service}, and
`KEY_HEP_PINGS`, the health-check requests per drain round; it points the replicas' pre-stop hook and readiness
probe at the agent's local listener (`LOCAL_PORT`, `PRESHUTDOWN_PATH`, `HEALTHZ_PATH`). The agent
(``containerboot.proxyservices``, ``containerboot.egressdrain``) parses the same files and serves the same
paths. Formats and names are upstream's. Pure, no I/O.
"""
from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tscommon import jsontext

#: where the group's ConfigMap is mounted in each replica (TS_EGRESS_PROXIES_CONFIG_PATH)
CONFIG_DIR = "/etc/proxies"
#: the ConfigMap's keys (files in CONFIG_DIR)
KEY_EGRESS_SERVICES = "egress-services"
KEY_HEP_PINGS = "hep-pings"
#: the agent's local listener in a replica (TS_LOCAL_ADDR_PORT's port): /healthz and the pre-stop hook
LOCAL_PORT = 9002
HEALTHZ_PATH = "/healthz"
PRESHUTDOWN_PATH = "/internal-egress-services-preshutdown"
#: health-check requests per replica the hook sends before deciding the Pod no longer gets traffic (upstream)
HEP_PINGS_PER_REPLICA = 3

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
    return f"{KEY_EGRESS_SERVICES}: service {name!r}"


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


def load_object(text: str | None, what: str, shape: str) -> dict | None:
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
    doc = load_object(text, "egress-services", "service name -> config")
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


def render_hep_pings(replicas: int) -> str:
    """`KEY_HEP_PINGS` for a group of `replicas` replicas."""
    return str(replicas * HEP_PINGS_PER_REPLICA)


def render_entry(svc: EgressService) -> dict[str, Any]:
    """One `KEY_EGRESS_SERVICES` entry as the controller writes it (upstream's egressservices.Config): the
    target names only the field that is set."""
    return {"tailnetTarget": {"ip": svc.target_ip} if svc.target_ip else {"fqdn": svc.target_fqdn},
            "ports": [p.to_json() for p in svc.ports],
            "healthCheckEndpoint": svc.health_check_endpoint}


def render_egress_services(entries: Mapping[str, Any]) -> str:
    """The whole `KEY_EGRESS_SERVICES` document (sorted, compact: equal entries give equal bytes)."""
    return json.dumps(entries, sort_keys=True, separators=(",", ":"))


def parse_entries(text: str | None) -> dict[str, dict]:
    """The controller's reading of its own `KEY_EGRESS_SERVICES`: {entry name: entry as JSON}; a missing or broken
    document is empty (the controller writes it back whole). The agent reads it with `parse_egress_services`."""
    try:
        doc = jsontext.loads(text) if text else {}
    except ValueError:
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, dict)} if isinstance(doc, dict) else {}
