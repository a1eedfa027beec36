"""The desired data path, as a pure function of settings, node state and DNS answers.

Level-triggered: every event recomputes the whole desired state from scratch; the reconciler converges the
kernel to it. A target that disappears yields no rules (so its old rules are removed), and one that comes
back yields them again, whatever happened in between.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace

from netfilter.model import Dnat, EgressForward, PortMatch, RuleSet

from .proxyservices import ServicesDesired, ServicesInput, compute_services
from .settings import Settings
from .state import IP, NodeState, ResolveError, resolve_tailnet_fqdn

DEFAULT_TAILSCALED_PORT = 41641


@dataclass(frozen=True)
class Target:
    """One configured target and what it resolved to this time."""

    name: str  # the setting, e.g. "TS_DEST_IP"
    kind: str  # "ingress" | "egress" | "ingress-dns" | "cluster-via-ingress"
    value: str  # what the user configured
    resolved: tuple[IP, ...] = ()
    error: str = ""
    has_rules: bool = False  # the desired rule set carries rules for this target
    # Whether /readyz waits for this target. Egress/ingress services do not: each reports its own readiness to
    # the operator through the Secret, and one broken service must not take the Pod's other services down.
    gates_readiness: bool = True


@dataclass(frozen=True)
class DNSAnswer:
    """The last successful resolution of TS_EXPERIMENTAL_DEST_DNS_NAME (empty until one succeeds)."""

    addresses: tuple[IP, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class Desired:
    rules: RuleSet
    targets: tuple[Target, ...]
    forwarding: tuple[bool, bool]  # IPv4, IPv6 forwarding needed
    services: ServicesDesired | None = None  # egress/ingress services of a ProxyGroup Pod, when configured


def tailscaled_port(s: Settings) -> int:
    """The UDP port tailscaled listens on (from TS_TAILSCALED_EXTRA_ARGS, else its default)."""
    args = list(s.tailscaled_extra_args)
    for i, a in enumerate(args):
        value = None
        if a.startswith(("--port=", "-port=")):
            value = a.split("=", 1)[1]
        elif a in ("--port", "-port") and i + 1 < len(args):
            value = args[i + 1]
        if value is not None and value.isdigit() and 0 < int(value) < 65536:
            return int(value)
    return DEFAULT_TAILSCALED_PORT


def _port_of(addr_port: str) -> int | None:
    try:
        port = int(addr_port.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def local_ports(s: Settings) -> tuple[int, ...]:
    """TCP ports on which the Pod itself listens (agent endpoints, the deprecated health listener,
    tailscaled's debug listener): the egress catch-all must not send connections to them to the tailnet."""
    ports: list[int] = []
    for addr_port in ((s.local_addr_port if s.local_server_enabled else ""), s.healthcheck_addr_port,
                      s.debug_addr_port):
        if addr_port and (p := _port_of(addr_port)) is not None and p not in ports:
            ports.append(p)
    return tuple(ports)


#: Why ProxyGroup services get no rules in userspace mode (upstream starts there too; its rules could not carry
#: traffic, since there is no tailscale0 to forward through).
USERSPACE_NO_RULES = ("userspace networking (TS_USERSPACE=true) has no kernel data path, so no forwarding rules "
                      "are installed; set TS_USERSPACE=false")


def _same_family(ips: tuple[IP, ...], version: int) -> IP | None:
    return next((ip for ip in ips if ip.version == version), None)


def _no_nat(version: int) -> str:
    return f"IPv{version} NAT is not available in this network namespace (see the firewall probe in the log)"


def compute(s: Settings, node: NodeState, dns: DNSAnswer | None = None, *,
            services: ServicesInput | None = None, families: tuple[int, ...] = (4, 6)) -> Desired:
    """The whole desired data path. `families` are the IP versions the firewall can translate: rules of any
    other family are left out and the target says why, so that one family's gap never fails the whole apply."""
    own = node.tailnet_ips
    dnats: list[Dnat] = []
    egress: list[EgressForward] = []
    targets: list[Target] = []
    v4, v6 = s.forwarding_families

    if s.dest_ips:
        errs = []
        before = len(dnats)
        for dest in s.dest_ips:
            src = _same_family(own, dest.version)
            if dest.version not in families:
                errs.append(_no_nat(dest.version))
            elif src:
                dnats.append(Dnat(original_dst=src, targets=(dest,)))
            elif own:
                errs.append(f"the node has no tailnet IPv{dest.version} address to forward from")
        targets.append(Target("TS_DEST_IP", "ingress", ",".join(map(str, s.dest_ips)), s.dest_ips, "; ".join(errs),
                              len(dnats) > before))

    if s.dest_dns_name:
        answer = dns or DNSAnswer()
        before = len(dnats)
        for version in families:
            backends = tuple(ip for ip in answer.addresses if ip.version == version)
            src = _same_family(own, version)
            if backends and src:
                dnats.append(Dnat(original_dst=src, targets=backends))
        v4 = v4 or any(ip.version == 4 for ip in answer.addresses)
        v6 = v6 or any(ip.version == 6 for ip in answer.addresses)
        targets.append(Target("TS_EXPERIMENTAL_DEST_DNS_NAME", "ingress-dns", s.dest_dns_name,
                              answer.addresses, answer.error, len(dnats) > before))

    egress_targets: tuple[IP, ...] = ()
    egress_target: Target | None = None
    if s.tailnet_target_ip is not None:
        egress_targets = (s.tailnet_target_ip,)
        egress_target = Target("TS_TAILNET_TARGET_IP", "egress", str(s.tailnet_target_ip), egress_targets)
    elif s.tailnet_target_fqdn:
        err = ""
        try:
            egress_targets = resolve_tailnet_fqdn(node, s.tailnet_target_fqdn) if own else ()
            err = "" if own else "waiting for the node's tailnet addresses"
        except ResolveError as e:
            err = str(e)
        egress_target = Target("TS_TAILNET_TARGET_FQDN", "egress", s.tailnet_target_fqdn, egress_targets, err)
    if egress_targets:
        exempt = [PortMatch("udp", tailscaled_port(s))]
        for lp in local_ports(s):
            exempt.append(PortMatch("tcp", lp))
        for version in families:
            target = _same_family(egress_targets, version)
            src = _same_family(own, version)
            if target and src:
                egress.append(EgressForward(target=target, snat_source=src, exempt=tuple(exempt)))
    if egress_target is not None:
        if egress_targets and not egress and not egress_target.error:
            missing = [ip.version for ip in egress_targets if ip.version not in families]
            egress_target = replace(egress_target, error=_no_nat(missing[0]) if missing else
                                    "the node has no tailnet address of the target's family")
        targets.append(replace(egress_target, has_rules=bool(egress)))

    if s.allow_proxying_cluster_traffic_via_ingress and s.serve_config:
        before = len(dnats)
        for pod_ip in (s.pod_ipv4, s.pod_ipv6, _parse_ip(s.pod_ip)):
            if pod_ip is None:
                continue
            src = _same_family(own, pod_ip.version)
            if src and pod_ip.version in families and not any(d.original_dst == pod_ip for d in dnats):
                dnats.append(Dnat(original_dst=pod_ip, targets=(src,)))
        targets.append(Target("EXPERIMENTAL_ALLOW_PROXYING_CLUSTER_TRAFFIC_VIA_INGRESS", "cluster-via-ingress",
                              s.pod_ip or str(s.pod_ipv4 or s.pod_ipv6 or ""), has_rules=len(dnats) > before))

    svc: ServicesDesired | None = None
    if services is not None and (services.egress is not None or services.ingress is not None):
        svc = compute_services(services, node, families=families, pod_ipv4=s.pod_ipv4, pod_ipv6=s.pod_ipv6,
                               reserved=frozenset(d.original_dst for d in dnats),
                               no_data_path=USERSPACE_NO_RULES if s.userspace and not s.test_fake_netfilter
                               else "")
        for r in svc.results:
            targets.append(Target(r.name, r.kind, r.value, r.resolved, r.error, r.installed, gates_readiness=False))
        v4 = v4 or (4 in svc.families and not s.userspace)
        v6 = v6 or (6 in svc.families and not s.userspace)

    rules = RuleSet(dnats=tuple(dnats), egress=tuple(egress),
                    port_maps=svc.port_maps if svc else (), service_dnats=svc.service_dnats if svc else (),
                    clamp_mss=bool(dnats or egress or (svc and (svc.port_maps or svc.service_dnats))))
    return Desired(rules=rules, targets=tuple(targets), forwarding=(v4, v6), services=svc)


def _parse_ip(value: str) -> IP | None:
    try:
        return ipaddress.ip_address(value) if value else None
    except ValueError:
        return None

