"""Node state built from IPN bus notifications, and tailnet name resolution (pure).

tailscaled sends two shapes of node: `ipnstate.PeerStatus` inside `InitialStatus` (fields `ID` = stable ID
string, `NodeID` = int, `DNSName`, `TailscaleIPs`) and `tailcfg.Node` in `SelfChange`/`PeersChanged` (`ID` =
int, `StableID`, `Name`, `Addresses` as prefixes). Both are normalised to one `Node` here. Every notification
produces a new immutable `NodeState`; the desired state is computed from it, never from the notification
itself, so a missed notification can only delay convergence.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Net = ipaddress.IPv4Network | ipaddress.IPv6Network

BACKEND_STATES = ("NoState", "InUseOtherUser", "NeedsLogin", "NeedsMachineAuth", "Stopped", "Starting", "Running")


class ResolveError(Exception):
    """A tailnet name could not be resolved from the current netmap."""


@dataclass(frozen=True)
class DNSRecord:
    name: str
    type: str
    value: str


@dataclass(frozen=True)
class Node:
    id: int
    stable_id: str
    name: str  # MagicDNS FQDN with a trailing dot
    key: str
    addresses: tuple[Net, ...]
    allowed_ips: tuple[Net, ...] = ()

    @property
    def ips(self) -> tuple[IP, ...]:
        """The node's own addresses (single-IP prefixes only), in netmap order."""
        return tuple(n.network_address for n in self.addresses if n.num_addresses == 1)

    def ip_of_family(self, version: int) -> IP | None:
        return next((ip for ip in self.ips if ip.version == version), None)


def _nets(values: Any) -> tuple[Net, ...]:
    out = []
    for v in values or ():
        try:
            out.append(ipaddress.ip_network(v, strict=False))
        except ValueError:
            continue
    return tuple(out)


def node_from_peer_status(ps: Mapping[str, Any]) -> Node:
    return Node(
        id=int(ps.get("NodeID") or 0),
        stable_id=str(ps.get("ID") or ""),
        name=str(ps.get("DNSName") or ""),
        key=str(ps.get("PublicKey") or ""),
        addresses=_nets(ps.get("TailscaleIPs")),
        allowed_ips=_nets(ps.get("AllowedIPs")),
    )


def node_from_tailcfg(n: Mapping[str, Any]) -> Node:
    return Node(
        id=int(n.get("ID") or 0),
        stable_id=str(n.get("StableID") or ""),
        name=str(n.get("Name") or ""),
        key=str(n.get("Key") or ""),
        addresses=_nets(n.get("Addresses")),
        allowed_ips=_nets(n.get("AllowedIPs")),
    )


def _peer_key(node: Node) -> str | None:
    if node.id:
        return f"id:{node.id}"
    if node.name:
        return f"name:{node.name.lower()}"
    return None


@dataclass(frozen=True)
class NodeState:
    backend_state: str = ""
    self_node: Node | None = None
    peers: Mapping[str, Node] = field(default_factory=lambda: MappingProxyType({}))
    cert_domains: tuple[str, ...] = ()
    extra_records: tuple[DNSRecord, ...] = ()
    login_failed: bool = False  # tailscaled reports the "login-state" health warning
    # tailscaled's health warnings as (code, text), sorted: what it says is wrong beyond the backend state (the
    # control plane unreachable, DNS failing, ...). Reported in /status; readiness does not depend on them, as
    # the data path often keeps working through them (a control plane outage).
    health_warnings: tuple[tuple[str, str], ...] = ()
    netmap_seen_at: float | None = None  # when the last netmap-bearing notification arrived

    @property
    def tailnet_ips(self) -> tuple[IP, ...]:
        return self.self_node.ips if self.self_node else ()

    @property
    def cert_domain(self) -> str:
        return self.cert_domains[0] if self.cert_domains else ""


def notify_backend_state(notify: Mapping[str, Any]) -> str | None:
    """The backend state a notification carries, if any (`State` int, else InitialStatus.BackendState)."""
    st = notify.get("State")
    if isinstance(st, int) and 0 <= st < len(BACKEND_STATES):
        return BACKEND_STATES[st]
    init = notify.get("InitialStatus")
    if isinstance(init, Mapping):
        bs = init.get("BackendState")
        if bs in BACKEND_STATES:
            return bs
    return None


def carries_netmap(notify: Mapping[str, Any]) -> bool:
    return bool(notify.get("InitialStatus") or notify.get("SelfChange") or notify.get("PeersChanged")
                or notify.get("PeersRemoved") or notify.get("PeerChangedPatch"))


def _records(values: Any) -> tuple[DNSRecord, ...]:
    return tuple(DNSRecord(str(r.get("Name", "")), str(r.get("Type", "") or ""), str(r.get("Value", "")))
                 for r in values or () if isinstance(r, Mapping))


def apply_notify(state: NodeState, notify: Mapping[str, Any], now: float) -> NodeState:
    """Fold one IPN bus notification into the node state."""
    changes: dict[str, Any] = {}
    bs = notify_backend_state(notify)
    if bs is not None:
        changes["backend_state"] = bs
    peers = dict(state.peers)
    init = notify.get("InitialStatus")
    if isinstance(init, Mapping) and init:
        changes["cert_domains"] = tuple(init.get("CertDomains") or ())
        changes["extra_records"] = _records(init.get("ExtraRecords"))
        if isinstance(init.get("Self"), Mapping):
            changes["self_node"] = node_from_peer_status(init["Self"])
        peer_map = init.get("Peer") or {}
        if peer_map:
            peers = {}
            for ps in peer_map.values():
                node = node_from_peer_status(ps)
                if (k := _peer_key(node)) is not None:
                    peers[k] = node
    if isinstance(notify.get("SelfChange"), Mapping) and notify["SelfChange"]:
        changes["self_node"] = node_from_tailcfg(notify["SelfChange"])
        if isinstance(notify.get("PeersChanged"), list):
            # tailscaled sends SelfChange only when a whole new netmap is installed (LocalBackend.setNetMap), and
            # then, to watchers of peer changes, PeersChanged holds EVERY peer of that netmap (possibly `[]`).
            # A peer missing from it is gone: control servers that send full netmaps (headscale after a node is
            # deleted) never produce a PeersRemoved for it, so upserting alone would keep a deleted peer, and a
            # tailnet FQDN target would stay resolved to the addresses of a node that no longer exists.
            peers = {}
    for raw in notify.get("PeersChanged") or ():
        if not isinstance(raw, Mapping):
            continue
        node = node_from_tailcfg(raw)
        if (k := _peer_key(node)) is None:
            continue
        if node.id and node.name:
            peers.pop(f"name:{node.name.lower()}", None)
        peers[k] = node
    for nid in notify.get("PeersRemoved") or ():
        peers.pop(f"id:{nid}", None)
    if peers != dict(state.peers):
        changes["peers"] = MappingProxyType(peers)
    health = notify.get("Health")
    if isinstance(health, Mapping):
        warnings = health.get("Warnings") or {}
        warnings = warnings if isinstance(warnings, Mapping) else {}
        changes["login_failed"] = "login-state" in warnings
        changes["health_warnings"] = tuple(sorted(
            (str(code), str((w.get("Text") if isinstance(w, Mapping) else "") or "")) for code, w in warnings.items()))
    if carries_netmap(notify):
        changes["netmap_seen_at"] = now
    return replace(state, **changes) if changes else state


def with_dns_config(state: NodeState, dns_config: Mapping[str, Any]) -> NodeState:
    """Replace cert domains and extra records from LocalAPI `dns-config` (fresher after a SelfChange)."""
    return replace(state, cert_domains=tuple(dns_config.get("CertDomains") or ()),
                   extra_records=_records(dns_config.get("ExtraRecords")))


def to_fqdn(name: str) -> str:
    name = name.strip()
    if not name or " " in name or ".." in name.strip("."):
        raise ResolveError(f"invalid DNS name {name!r}")
    return name.lower() if name.endswith(".") else name.lower() + "."


def _host_net(ip: IP) -> Net:
    return ipaddress.ip_network(ip)


_VIA_PREFIX = bytes.fromhex("fd7a115ca1e00b1a")


def via_4via6(name: str) -> IP | None:
    """Map a `<a-b-c-d>-via-<site>` name to its 4via6 address, or None if it is not such a name."""
    label, _, domain = name.rstrip(".").partition(".")
    if domain and not (domain == "ts.net" or domain.endswith(".ts.net")
                       or domain == "tailscale.net" or domain.endswith(".tailscale.net")):
        return None
    v4part, sep, site = label.partition("-via-")
    if not sep or len(name) < 13:
        return None
    try:
        v4 = ipaddress.IPv4Address(v4part.replace("-", "."))
        site_id = int(site, 0)
    except ValueError:
        return None
    if not 0 <= site_id <= 0xFFFFFFFF:
        return None
    return ipaddress.IPv6Address(_VIA_PREFIX + site_id.to_bytes(4, "big") + v4.packed)


def resolve_tailnet_fqdn(state: NodeState, fqdn: str) -> tuple[IP, ...]:
    """Resolve a tailnet name to addresses: a peer, a Tailscale Service VIP, or a 4via6 name.

    Unlike upstream, Service VIPs are returned once each even when several peers advertise them.
    """
    want = to_fqdn(fqdn)
    for peer in state.peers.values():
        if peer.name.lower() == want:
            return peer.ips
    vips: list[IP] = []
    for rec in state.extra_records:
        try:
            if to_fqdn(rec.name) != want:
                continue
            ip = ipaddress.ip_address(rec.value)
        except (ResolveError, ValueError):
            continue
        host = _host_net(ip)
        if ip not in vips and any(host in p.allowed_ips for p in state.peers.values()):
            vips.append(ip)
    if vips:
        return tuple(vips)
    via = via_4via6(want)
    if via is not None:
        if any(via in net for p in state.peers.values() for net in p.allowed_ips):
            return (via,)
        raise ResolveError(f"resolved 4via6 address {via} for {fqdn!r} but no peer advertises a route containing it")
    raise ResolveError(f"could not find Tailscale node, service or 4via6 address {fqdn!r}; "
                       "it either does not exist, or is not reachable because of ACLs")
