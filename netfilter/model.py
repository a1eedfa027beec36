"""The agent's desired firewall state as pure, validated, immutable data.

Nothing here does I/O. The agent builds one `RuleSet` describing *everything* it wants in the kernel; the planner
(`netfilter.plan`) turns it into one transaction per backend, so there is never an "add this rule" call to get
wrong. Validation happens at construction time so that a bad input (wrong family mix, port 0, protocol "sctp",
the zero address that the operator writes for a missing family [E23]) fails with a message naming the field,
long before anything touches the kernel.

Inputs are normalised so that equal intents compare equal: addresses may be given as strings, protocols in any
case ("TCP" from Kubernetes becomes "tcp"), lists become tuples, and duplicate targets are dropped in first-seen
order (upstream could get the same Tailscale Service IP once per advertising peer, [E10]).
"""
from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, TypeVar, Union

_T = TypeVar("_T")

IP = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

PROTOCOLS = ("tcp", "udp")


# ----------------------------------------------------------------------------------------------------- helpers

def _ip(value: Any, what: str) -> IP:
    """Coerce a str/IP into an address; reject networks, garbage and the unspecified address."""
    if isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        addr = value
    elif isinstance(value, str):
        try:
            addr = ipaddress.ip_address(value.strip())
        except ValueError:
            raise ValueError(f"{what}: {value!r} is not an IP address") from None
    else:
        raise ValueError(f"{what}: expected an IP address, got {type(value).__name__} {value!r}")
    if addr.is_unspecified:
        # The operator writes the zero address when a Tailscale Service lacks a family [E23]; programming it
        # would crash-loop upstream. Refuse it here with a clear message instead.
        raise ValueError(f"{what}: the unspecified address {addr} cannot be used in a rule")
    # ::ffff:a.b.c.d would land an IPv4 destination in the IPv6 tables [E4]; make the caller decide.
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        raise ValueError(f"{what}: {addr} is an IPv4-mapped IPv6 address; use {addr.ipv4_mapped} instead")
    return addr


def _port(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(str(value), 10)
        except ValueError:
            raise ValueError(f"{what}: {value!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise ValueError(f"{what}: port {value} is outside 1-65535")
    return value


def _proto(value: Any, what: str) -> str:
    p = str(value).strip().lower()
    if p not in PROTOCOLS:
        raise ValueError(f"{what}: protocol {value!r} is not one of tcp, udp")
    return p


def _dedupe(items: Iterable[Any]) -> tuple:
    """Order-preserving de-duplication, so repeated inputs never become repeated rules."""
    seen: dict[Any, None] = {}
    for i in items:
        seen.setdefault(i, None)
    return tuple(seen)


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def _same_family(what: str, *addrs: IP) -> None:
    versions = {a.version for a in addrs}
    if len(versions) > 1:
        raise ValueError(f"{what}: addresses mix IPv4 and IPv6 ({', '.join(map(str, addrs))}); "
                         "one rule can only translate within one family")


# ----------------------------------------------------------------------------------------------------- objects

@dataclass(frozen=True)
class PortMatch:
    """A transport protocol + destination port, e.g. tailscaled's WireGuard UDP port."""

    protocol: str
    port: int

    def __post_init__(self) -> None:
        _set(self, "protocol", _proto(self.protocol, "PortMatch.protocol"))
        _set(self, "port", _port(self.port, "PortMatch.port"))


@dataclass(frozen=True)
class Dnat:
    """O1/O2/O4: traffic addressed to `original_dst` is sent to `targets` (new flows spread evenly if > 1)."""

    original_dst: IP
    targets: tuple[IP, ...]

    def __post_init__(self) -> None:
        _set(self, "original_dst", _ip(self.original_dst, "Dnat.original_dst"))
        if isinstance(self.targets, (str, ipaddress.IPv4Address, ipaddress.IPv6Address)):
            targets: Iterable[Any] = (self.targets,)
        else:
            targets = self.targets
        t = _dedupe(_ip(x, "Dnat.targets") for x in targets)
        if not t:
            raise ValueError(f"Dnat for {self.original_dst}: targets must not be empty")
        _same_family(f"Dnat {self.original_dst} -> {', '.join(map(str, t))}", self.original_dst, *t)
        _set(self, "targets", t)

    @property
    def version(self) -> int:
        return self.original_dst.version


@dataclass(frozen=True)
class EgressForward:
    """O3: traffic arriving on any non-tun interface goes to a tailnet target, SNATed to `snat_source`.

    `exempt` lists (protocol, port) pairs that must never be captured, such as tailscaled's own UDP port and the
    agent's health/metrics port (kubelet probes would otherwise be sent to the tailnet target [E18]).
    """

    target: IP
    snat_source: IP
    exempt: tuple[PortMatch, ...] = ()

    def __post_init__(self) -> None:
        _set(self, "target", _ip(self.target, "EgressForward.target"))
        _set(self, "snat_source", _ip(self.snat_source, "EgressForward.snat_source"))
        _same_family(f"EgressForward to {self.target}", self.target, self.snat_source)
        ex = []
        for e in self.exempt:
            if isinstance(e, PortMatch):
                ex.append(e)
            elif isinstance(e, dict):
                ex.append(PortMatch(e.get("protocol", ""), e.get("port", 0)))
            else:
                ex.append(PortMatch(*e))
        # Sorted: the exemption is a set, and a canonical order keeps rendered rules stable.
        _set(self, "exempt", tuple(sorted(set(ex), key=lambda p: (p.protocol, p.port))))

    @property
    def version(self) -> int:
        return self.target.version


@dataclass(frozen=True)
class ServicePortMap:
    """O5 (egress services): non-tun traffic to `protocol/match_port` goes to `target:target_port`, SNATed."""

    service: str
    protocol: str
    match_port: int
    target_port: int
    target: IP
    snat_source: IP

    def __post_init__(self) -> None:
        if not isinstance(self.service, str) or not self.service.strip():
            raise ValueError("ServicePortMap.service must be a non-empty name")
        if any(c in self.service for c in "\"\n\r\t\\"):
            raise ValueError(f"ServicePortMap.service {self.service!r} contains quotes, backslashes or control "
                             "characters")
        _set(self, "protocol", _proto(self.protocol, f"ServicePortMap {self.service}: protocol"))
        _set(self, "match_port", _port(self.match_port, f"ServicePortMap {self.service}: match_port"))
        _set(self, "target_port", _port(self.target_port, f"ServicePortMap {self.service}: target_port"))
        _set(self, "target", _ip(self.target, f"ServicePortMap {self.service}: target"))
        _set(self, "snat_source", _ip(self.snat_source, f"ServicePortMap {self.service}: snat_source"))
        _same_family(f"ServicePortMap {self.service}", self.target, self.snat_source)

    @property
    def version(self) -> int:
        return self.target.version


@dataclass(frozen=True)
class ServiceDnat:
    """O6 (ingress services): traffic to a Tailscale Service VIP goes to the Kubernetes ClusterIP."""

    service: str
    vip: IP
    cluster_ip: IP

    def __post_init__(self) -> None:
        if not isinstance(self.service, str) or not self.service.strip():
            raise ValueError("ServiceDnat.service must be a non-empty name")
        if any(c in self.service for c in "\"\n\r\t\\"):
            raise ValueError(f"ServiceDnat.service {self.service!r} contains quotes, backslashes or control "
                             "characters")
        _set(self, "vip", _ip(self.vip, f"ServiceDnat {self.service}: vip"))
        _set(self, "cluster_ip", _ip(self.cluster_ip, f"ServiceDnat {self.service}: cluster_ip"))
        _same_family(f"ServiceDnat {self.service}", self.vip, self.cluster_ip)

    @property
    def version(self) -> int:
        return self.vip.version


# O4 ("forward cluster traffic via ingress", Pod IP -> own tailnet IP) is a plain single-target Dnat.
PodToTailnet = Dnat


@dataclass(frozen=True)
class RuleSet:
    """Everything the agent wants installed. Equal RuleSets always produce identical kernel state."""

    dnats: tuple[Dnat, ...] = ()
    egress: tuple[EgressForward, ...] = ()
    port_maps: tuple[ServicePortMap, ...] = ()
    clamp_mss: bool = False
    tun: str = "tailscale0"
    service_dnats: tuple[ServiceDnat, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.tun, str) or not (1 <= len(self.tun) <= 15) or any(
                c in self.tun for c in " /\"'\\\t\n*"):
            raise ValueError(f"RuleSet.tun: {self.tun!r} is not a valid interface name (1-15 characters)")
        for name, typ in (("dnats", Dnat), ("egress", EgressForward), ("port_maps", ServicePortMap),
                          ("service_dnats", ServiceDnat)):
            items = getattr(self, name)
            if isinstance(items, typ):
                items = (items,)
            items = tuple(items)
            for i in items:
                if not isinstance(i, typ):
                    raise ValueError(f"RuleSet.{name}: expected {typ.__name__}, got {type(i).__name__}")
            _set(self, name, _dedupe(items))
        _set(self, "clamp_mss", bool(self.clamp_mss))
        self._check_conflicts()

    def entries(self) -> int:
        """How many translations the set holds (the size of an apply)."""
        return len(self.dnats) + len(self.egress) + len(self.port_maps) + len(self.service_dnats)

    def _check_conflicts(self) -> None:
        """Refuse intents that cannot all hold at once, instead of letting rule order pick silently."""
        by_dst: dict[IP, object] = {}
        for d in self.dnats:
            if d.original_dst in by_dst:
                raise ValueError(f"two DNATs for {d.original_dst}: {by_dst[d.original_dst]} and {d}")
            by_dst[d.original_dst] = d
        for s in self.service_dnats:
            if s.vip in by_dst:
                raise ValueError(f"two DNATs for {s.vip}: {by_dst[s.vip]} and {s}")
            by_dst[s.vip] = s
        by_port: dict[tuple[int, str, int], ServicePortMap] = {}
        for p in self.port_maps:
            key = (p.version, p.protocol, p.match_port)
            old = by_port.get(key)
            if old is not None and (old.target, old.target_port) != (p.target, p.target_port):
                raise ValueError(
                    f"IPv{p.version} {p.protocol}/{p.match_port} is mapped twice: service {old.service} -> "
                    f"{old.target}:{old.target_port} and service {p.service} -> {p.target}:{p.target_port}")
            by_port.setdefault(key, p)
        snat: dict[IP, IP] = {}
        for target, src in self._all_snat_pairs():
            if snat.setdefault(target, src) != src:
                raise ValueError(f"traffic to {target} would be SNATed to both {snat[target]} and {src}")

    def _all_snat_pairs(self) -> list[tuple[IP, IP]]:
        return [(e.target, e.snat_source) for e in self.egress] + [
            (p.target, p.snat_source) for p in self.port_maps]

    def snat_pairs(self) -> tuple[tuple[IP, IP], ...]:
        """(destination, new source) pairs, de-duplicated, in first-seen order."""
        return _dedupe(self._all_snat_pairs())

    def family(self, version: int) -> "RuleSet":
        """The part of the rule set for IPv4 (4) or IPv6 (6)."""
        if version not in (4, 6):
            raise ValueError(f"family must be 4 or 6, not {version!r}")
        # Building one re-validates every entry (~25 ms at 10,000 maps), and one apply asks several times.
        return self.memo(("family", version), lambda: RuleSet(
            dnats=tuple(d for d in self.dnats if d.version == version),
            egress=tuple(e for e in self.egress if e.version == version),
            port_maps=tuple(p for p in self.port_maps if p.version == version),
            clamp_mss=self.clamp_mss,
            tun=self.tun,
            service_dnats=tuple(s for s in self.service_dnats if s.version == version),
        ))

    def memo(self, key: Hashable, make: Callable[[], _T]) -> _T:
        """What `make` derives from this set, computed once per instance (the set is immutable): one apply
        renders, plans and records the same set several times. Kept beside the fields, not among them:
        equality, hashing and the JSON form ignore it."""
        cache: dict[Hashable, Any] = self.__dict__.setdefault("_memo", {})
        if key not in cache:
            cache[key] = make()
        return cache[key]

    @property
    def empty(self) -> bool:
        """True when there is nothing to translate (MSS clamping alone is never installed)."""
        return not (self.dnats or self.egress or self.port_maps or self.service_dnats)

    def versions(self) -> tuple[int, ...]:
        """Families that have at least one rule."""
        return tuple(v for v in (4, 6) if not self.family(v).empty)

    # ---- JSON, for `containerboot rules` / `python -m netfilter.cli` ----------------------------------------

    def to_dict(self) -> dict:
        return {
            "tun": self.tun,
            "clamp_mss": self.clamp_mss,
            "dnats": [{"original_dst": str(d.original_dst), "targets": [str(t) for t in d.targets]}
                      for d in self.dnats],
            "egress": [{"target": str(e.target), "snat_source": str(e.snat_source),
                        "exempt": [{"protocol": x.protocol, "port": x.port} for x in e.exempt]}
                       for e in self.egress],
            "port_maps": [{"service": p.service, "protocol": p.protocol, "match_port": p.match_port,
                           "target_port": p.target_port, "target": str(p.target),
                           "snat_source": str(p.snat_source)} for p in self.port_maps],
            "service_dnats": [{"service": s.service, "vip": str(s.vip), "cluster_ip": str(s.cluster_ip)}
                              for s in self.service_dnats],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "RuleSet":
        if not isinstance(data, dict):
            raise ValueError("rule set JSON must be an object")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"rule set JSON has unknown keys: {', '.join(sorted(unknown))}")
        try:
            return cls(
                dnats=tuple(Dnat(d["original_dst"], tuple(d["targets"])) for d in data.get("dnats", ())),
                egress=tuple(EgressForward(e["target"], e["snat_source"],
                                           tuple(PortMatch(x["protocol"], x["port"]) for x in e.get("exempt", ())))
                             for e in data.get("egress", ())),
                port_maps=tuple(ServicePortMap(p["service"], p["protocol"], p["match_port"], p["target_port"],
                                               p["target"], p["snat_source"]) for p in data.get("port_maps", ())),
                clamp_mss=bool(data.get("clamp_mss", False)),
                tun=data.get("tun", "tailscale0"),
                service_dnats=tuple(ServiceDnat(s["service"], s["vip"], s["cluster_ip"])
                                    for s in data.get("service_dnats", ())),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"rule set JSON is missing or has a malformed field: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "RuleSet":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"rule set is not valid JSON: {e}") from None
        return cls.from_dict(data)
