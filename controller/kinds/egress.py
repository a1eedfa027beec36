"""Egress Services on a ProxyGroup (pure): validation, port allocation, the ConfigMap entry, the ClusterIP
Service, and which replicas an EndpointSlice lists.

A user's ExternalName Service with `tailscale.com/proxy-group: <pg>` and `tailscale.com/tailnet-ip` or
`tailscale.com/tailnet-fqdn` is served by every replica of the group: each of its ports gets a port on the
replicas (`matchPort`, unique in the group) that the replicas forward to the tailnet target's port; a
ClusterIP Service in the controller's namespace maps the user's ports to those, and its EndpointSlices list
the replicas that report the forwarding in place. The user's Service then names the ClusterIP Service.
Names and formats are upstream's (`<ns>-<name>` entries, the `tailscale.com/proxy-group` and
`tailscale.com/svc-type` labels, EndpointSlices `<svc>-ipv4`/`<svc>-ipv6`).

Differences, on purpose: ports are allocated lowest-free in [3000, 13000) instead of at random, and a port
keeps its allocation as long as the Service has it (so allocation is a pure function of what is there);
EndpointSlices are made for both families of the ClusterIP Service (upstream: IPv4 only); removing the
annotation (not only deleting the Service) removes the Service's objects.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tscommon import jsontext
from tscommon import pgcontract as pgc

from ..config import ControllerConfig
from ..model import (
    ANN_PROXY_GROUP,
    LABEL_MANAGED,
    LABEL_PARENT_NAME,
    LABEL_PARENT_NS,
    LABEL_PARENT_TYPE,
    LABEL_PROXY_GROUP,
    LABEL_SVC_TYPE,
    SVC,
    Invalid,
    Parent,
)
from . import annotations_of, meta, tailnet
from .proxygroup import TYPE_EGRESS

PORT_MIN, PORT_MAX = 3000, 13000          # matchPorts: [PORT_MIN, PORT_MAX)
HEALTH_PORT = pgc.LOCAL_PORT              # the replicas' /healthz
RESERVED_PORTS = frozenset({9001, HEALTH_PORT})   # tailscaled's debug and the agent's local listener
HEALTH_PORT_NAME = "tailscale-health-check"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
MANAGED_BY = "tailscale.com"
FAMILIES = {"IPv4": 4, "IPv6": 6}


def group_of(svc: Mapping[str, Any]) -> str:
    return annotations_of(svc).get(ANN_PROXY_GROUP, "").strip()


def handled(svc: Mapping[str, Any]) -> bool:
    """An egress Service for a ProxyGroup (upstream's test: the group and one of the two targets)."""
    return bool(group_of(svc)) and tailnet.is_egress(annotations_of(svc))


@dataclass(frozen=True)
class Port:
    name: str
    protocol: str       # TCP | UDP | SCTP, as Kubernetes spells it
    port: int           # the user's port = the tailnet target's port

    @property
    def key(self) -> tuple[str, int]:
        return self.protocol.upper(), self.port


@dataclass(frozen=True)
class EgressTarget:
    """One valid egress Service."""

    namespace: str
    name: str
    uid: str
    group: str
    ip: str = ""
    fqdn: str = ""
    ports: tuple[Port, ...] = ()

    @property
    def parent(self) -> Parent:
        return Parent(SVC, self.name, self.namespace, self.uid)

    @property
    def entry(self) -> str:
        """The Service's key in the group's `egress-services` (upstream's `<namespace>-<name>`)."""
        return f"{self.namespace}-{self.name}"


def decide(svc: Mapping[str, Any], cfg: ControllerConfig, pg: Mapping[str, Any] | None) -> EgressTarget:
    """The Service's target and ports, or Invalid naming every problem; `pg`: the ProxyGroup it names."""
    m, ann, spec = meta(svc), annotations_of(svc), svc.get("spec") or {}
    group = group_of(svc)
    tip, tfqdn = tailnet.target_of(ann)
    problems = tailnet.target_problems(tip, tfqdn, cfg.magicdns_suffix)
    raw_ports = spec.get("ports") or []
    if not raw_ports:
        problems.append("spec.ports is empty; an egress Service for a ProxyGroup needs at least one port (the "
                        "tailnet target's port)")
    if spec.get("type") != "ExternalName":
        problems.append(f"spec.type={spec.get('type')!r}: an egress Service for a ProxyGroup must be of type "
                        "ExternalName (set spec.type: ExternalName and any spec.externalName, e.g. placeholder)")
    if pg is None:
        problems.append(f"annotation {ANN_PROXY_GROUP}: ProxyGroup {group!r} does not exist; create it (type "
                        "egress) or name an existing one")
    elif ((pg.get("spec") or {}).get("type") or "") != TYPE_EGRESS:
        problems.append(f"annotation {ANN_PROXY_GROUP}: ProxyGroup {group!r} is of type "
                        f"{(pg.get('spec') or {}).get('type')!r}; egress Services need a ProxyGroup of type egress")
    ports: list[Port] = []
    seen: set[tuple[str, int]] = set()
    for i, p in enumerate(raw_ports):
        proto = str(p.get("protocol") or "TCP")
        port = p.get("port")
        if not isinstance(port, int) or not 0 < port < 65536:
            problems.append(f"spec.ports[{i}].port={port!r} is not a port number; use 1-65535")
            continue
        if (proto.upper(), port) in seen:
            problems.append(f"spec.ports[{i}]: {proto}/{port} is listed twice; list each port once")
            continue
        seen.add((proto.upper(), port))
        ports.append(Port(str(p.get("name") or ""), proto, port))
    if any(p.key == ("TCP", HEALTH_PORT) for p in ports):
        problems.append(f"spec.ports: TCP/{HEALTH_PORT} is the replicas' health-check port on the group's "
                        "Service; reach the target through another port number")
    if problems:
        raise Invalid("; ".join(problems))
    return EgressTarget(m.get("namespace", ""), m.get("name", ""), m.get("uid", ""), group, tip,
                        tfqdn, tuple(ports))


# ---- the group's egress-services document


#: The ConfigMap's `egress-services`: {entry name: config}; a missing or broken document is empty (the passes
#: write it back whole). The document is the ProxyGroup contract's (tscommon.pgcontract), which the agent parses.
parse_entries = pgc.parse_entries
dump_entries = pgc.render_egress_services


def entry_ports(entry: Mapping[str, Any] | None) -> dict[tuple[str, int], int]:
    """{(PROTOCOL, target port): matchPort} of an existing entry."""
    out: dict[tuple[str, int], int] = {}
    ports = (entry or {}).get("ports") or []
    for p in ports if isinstance(ports, list) else []:
        try:
            out[(str(p["protocol"]).upper(), int(p["targetPort"]))] = int(p["matchPort"])
        except (KeyError, TypeError, ValueError):
            continue
    return out


def used_ports(entries: Mapping[str, Any], *, but: str) -> set[int]:
    """matchPorts of every entry except `but`."""
    return {mp for name, e in entries.items() if name != but for mp in entry_ports(e).values()}


def allocate(ports: Iterable[Port], current: Mapping[tuple[str, int], int],
             used: set[int]) -> dict[tuple[str, int], int]:
    """{(PROTOCOL, port): matchPort}: a port keeps its current matchPort unless another Service holds it; a new
    one gets the lowest free port. Raises Invalid when the group has no port left."""
    taken = set(used) | set(RESERVED_PORTS)
    out: dict[tuple[str, int], int] = {}
    for p in ports:
        mp = current.get(p.key)
        if mp is not None and PORT_MIN <= mp < PORT_MAX and mp not in taken:
            out[p.key] = mp
            taken.add(mp)
    free = (n for n in range(PORT_MIN, PORT_MAX) if n not in taken)
    for p in ports:
        if p.key not in out:
            mp = next(free, None)
            if mp is None:
                raise Invalid(f"the ProxyGroup has no free port left ({PORT_MAX - PORT_MIN - len(RESERVED_PORTS)} "
                              "in use); put this Service on another ProxyGroup")
            out[p.key] = mp
    return out


def health_endpoint(svc_name: str, cfg: ControllerConfig) -> str:
    return f"http://{svc_name}.{cfg.namespace}.svc.{cfg.cluster_domain}:{HEALTH_PORT}/healthz"


def entry(t: EgressTarget, mapping: Mapping[tuple[str, int], int], svc_name: str, cfg: ControllerConfig) -> dict:
    """The Service's `egress-services` entry (upstream's egressservices.Config)."""
    return pgc.render_entry(pgc.EgressService(
        t.entry, t.ip, t.fqdn, tuple(pgc.PortMap(p.protocol, mapping[p.key], p.port) for p in t.ports),
        health_endpoint(svc_name, cfg)))


# ---- objects


def child_labels(t: EgressTarget) -> dict[str, str]:
    return {LABEL_MANAGED: "true", LABEL_PARENT_TYPE: SVC, LABEL_PARENT_NAME: t.name,
            LABEL_PARENT_NS: t.namespace, LABEL_PROXY_GROUP: t.group, LABEL_SVC_TYPE: "egress"}


def parent_selector(namespace: str, name: str) -> str:
    """Every egress object of one user Service, whichever group it was made for."""
    return (f"{LABEL_MANAGED}=true,{LABEL_PARENT_TYPE}={SVC},{LABEL_PARENT_NAME}={name},{LABEL_PARENT_NS}={namespace},"
            f"{LABEL_SVC_TYPE}=egress")


def group_selector(group: str) -> str:
    return f"{LABEL_MANAGED}=true,{LABEL_PROXY_GROUP}={group},{LABEL_SVC_TYPE}=egress"


def _port_name(p: Port) -> str:
    return p.name or f"{p.protocol.lower()}-{p.port}"


def clusterip_service(t: EgressTarget, mapping: Mapping[tuple[str, int], int], name: str,
                      cfg: ControllerConfig) -> dict:
    from ..render import hashed
    ports = [{"name": _port_name(p), "protocol": p.protocol, "port": p.port, "targetPort": mapping[p.key]}
             for p in t.ports]
    ports.append({"name": HEALTH_PORT_NAME, "protocol": "TCP", "port": HEALTH_PORT, "targetPort": HEALTH_PORT})
    return hashed({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": cfg.namespace, "labels": child_labels(t)},
        # No selector: its EndpointSlices are ours, listing only replicas that forward this Service.
        "spec": {"type": "ClusterIP", "ipFamilyPolicy": "PreferDualStack", "ports": ports},
    })


def slice_name(svc_name: str, family: str) -> str:
    return f"{svc_name}-{family.lower()}"


def endpoint_slice(svc: Mapping[str, Any], family: str, addresses: Iterable[str]) -> dict:
    """The EndpointSlice of one family of the ClusterIP Service `svc` (as the API server returned it)."""
    from ..render import hashed
    m = svc["metadata"]
    labels = {**m["labels"], LABEL_SERVICE_NAME: m["name"], LABEL_MANAGED_BY: MANAGED_BY}
    ports = [{"name": p.get("name", ""), "protocol": p.get("protocol", "TCP"), "port": p["targetPort"]}
             for p in (svc.get("spec") or {}).get("ports") or []]
    return hashed({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": slice_name(m["name"], family), "namespace": m["namespace"], "labels": labels},
        "addressType": family, "ports": ports,
        "endpoints": [{"addresses": [a], "conditions": {"ready": True, "serving": True, "terminating": False}}
                      for a in sorted(addresses, key=lambda a: ipaddress.ip_address(a))],
    })


def families(svc: Mapping[str, Any]) -> tuple[str, ...]:
    """The ClusterIP Service's IP families (as the API server assigned them)."""
    fams = (svc.get("spec") or {}).get("ipFamilies") or ["IPv4"]
    return tuple(f for f in fams if f in FAMILIES)


# ---- membership


@dataclass(frozen=True)
class Replica:
    """One replica as the controller sees it: its Pod's addresses (none while it is not running or is
    terminating) and its state Secret's `egress-services` status document."""

    name: str
    pod_ips: tuple[str, ...] = ()
    status: Mapping[str, Any] | None = None


def _same_target(want: Mapping[str, Any], have: Mapping[str, Any] | None) -> bool:
    h = have or {}
    return (str(want.get("ip") or ""), str(want.get("fqdn") or "")) == (str(h.get("ip") or ""),
                                                                          str(h.get("fqdn") or ""))


def _port_set(ports: Any) -> set[tuple[str, int, int]]:
    out = set()
    for p in ports or []:
        try:
            out.add((str(p["protocol"]).upper(), int(p["matchPort"]), int(p["targetPort"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def serves(r: Replica, name: str, want: Mapping[str, Any]) -> bool:
    """The replica reports entry `name`'s rules applied, for the config `want`, from its current Pod."""
    st = r.status or {}
    have = (st.get("services") or {}).get(name)
    if not r.pod_ips or not isinstance(have, dict):
        return False
    mine = {str(ipaddress.ip_address(ip)) for ip in r.pod_ips}
    reported = {str(ipaddress.ip_address(v)) for k in ("podIPv4", "podIPv6") if (v := st.get(k))}
    if not reported or not reported <= mine:       # a previous Pod's status
        return False
    return _same_target(want.get("tailnetTarget") or {}, have.get("tailnetTarget")) and \
        _port_set(want.get("ports")) == _port_set(have.get("ports"))


def addresses(replicas: Iterable[Replica], name: str, want: Mapping[str, Any] | None, family: str) -> list[str]:
    """The Pod IPs of `family` of the replicas that serve entry `name` (none when there is no entry)."""
    if want is None:
        return []
    v = FAMILIES[family]
    return sorted({ip for r in replicas if serves(r, name, want)
                   for ip in r.pod_ips if ipaddress.ip_address(ip).version == v})


def parse_status(raw: bytes | None) -> dict | None:
    """A state Secret's `egress-services` value."""
    try:
        doc = jsontext.loads(raw) if raw else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


#: TailscaleEgressSvcReady, upstream's condition, reasons and message on an egress Service of a ProxyGroup
COND_READY = "TailscaleEgressSvcReady"
REASON_RESOURCES_NOT_READY = "ClusterResourcesNotReady"
REASON_NO_PROXIES = "NoProxiesConfigured"
REASON_NOT_READY = "NotReadyToRouteTraffic"
REASON_PARTIALLY_READY = "PartiallyReadyToRouteTraffic"
REASON_READY = "ReadyToRouteTraffic"


def ready_condition(pg: Mapping[str, Any] | None, replicas: Iterable[Replica], name: str,
                    want: Mapping[str, Any] | None, families: Iterable[str]) -> tuple[bool, str, str]:
    """(status, reason, message) of TailscaleEgressSvcReady, as upstream: true once at least one of the group's
    replicas routes the Service's traffic (it reports entry `name`'s rules and has a Pod IP of each family its
    EndpointSlices list), false while the group is not available or has no replicas."""
    conds = ((pg or {}).get("status") or {}).get("conditions") or []
    available = any(c.get("type") == "ProxyGroupAvailable" and c.get("status") == "True" for c in conds)
    if pg is None or want is None or not available:
        return False, REASON_RESOURCES_NOT_READY, REASON_RESOURCES_NOT_READY
    n = (pg.get("spec") or {}).get("replicas")
    n = 2 if n is None else n
    if n == 0:
        return False, REASON_NO_PROXIES, REASON_NO_PROXIES
    versions = {FAMILIES[f] for f in families}
    ready = sum(1 for r in replicas if serves(r, name, want) and
                versions <= {ipaddress.ip_address(ip).version for ip in r.pod_ips})
    message = f"{ready} out of {n} replicas are ready to route traffic"
    if ready == 0:
        return False, REASON_NOT_READY, message
    return True, (REASON_PARTIALLY_READY if ready < n else REASON_READY), message
