"""netfilter.model: validation, normalisation, family split and JSON round trip (pure, no root)."""
from __future__ import annotations

import dataclasses
import ipaddress

import pytest

from netfilter.model import Dnat, EgressForward, PodToTailnet, PortMatch, RuleSet, ServiceDnat, ServicePortMap

ip = ipaddress.ip_address


def full() -> RuleSet:
    return RuleSet(
        dnats=(Dnat("100.64.0.5", ("10.0.0.1", "10.0.0.2")), Dnat("fd7a:115c:a1e0::5", ("fd00::7",))),
        egress=(EgressForward("100.99.99.99", "100.64.0.5", (PortMatch("UDP", 41641), PortMatch("tcp", 9002))),),
        port_maps=(ServicePortMap("default-mysvc", "TCP", 10001, 5432, "fd7a:115c:a1e0::701:b62a",
                                  "fd7a:115c:a1e0::5"),),
        service_dnats=(ServiceDnat("svc:web", "100.100.1.1", "10.96.0.10"),),
        clamp_mss=True,
    )


def test_strings_are_normalised_to_addresses_and_lowercase_protocols():
    d = Dnat("100.64.0.5", ["10.0.0.1"])
    assert d.original_dst == ip("100.64.0.5") and d.targets == (ip("10.0.0.1"),)
    assert PortMatch("UDP", "41641") == PortMatch("udp", 41641)
    p = ServicePortMap("s", "TCP", 10001, 80, "100.1.1.1", "100.64.0.1")
    assert p.protocol == "tcp"
    assert PodToTailnet is Dnat


def test_single_target_may_be_given_bare():
    assert Dnat("10.1.2.3", "100.64.0.5").targets == (ip("100.64.0.5"),)


def test_duplicate_targets_are_dropped_in_order():          # [E10]
    d = Dnat("100.64.0.5", ("10.0.0.2", "10.0.0.1", "10.0.0.2"))
    assert d.targets == (ip("10.0.0.2"), ip("10.0.0.1"))


@pytest.mark.parametrize("make, needle", [
    (lambda: Dnat("100.64.0.5", ("fd00::1",)), "mix IPv4 and IPv6"),
    (lambda: Dnat("100.64.0.5", ()), "must not be empty"),
    (lambda: Dnat("nonsense", ("10.0.0.1",)), "not an IP address"),
    (lambda: Dnat("10.0.0.0/8", ("10.0.0.1",)), "not an IP address"),
    (lambda: Dnat("0.0.0.0", ("10.0.0.1",)), "unspecified"),                   # [E23]
    (lambda: ServiceDnat("svc:web", "::", "fd00::1"), "unspecified"),          # [E23]
    (lambda: Dnat("::ffff:10.0.0.1", ("::ffff:10.0.0.2",)), "IPv4-mapped"),    # [E4]
    (lambda: EgressForward("100.99.99.99", "fd7a::1"), "mix IPv4 and IPv6"),
    (lambda: EgressForward("100.99.99.99", "100.64.0.5", (PortMatch("sctp", 1),)), "not one of tcp, udp"),
    (lambda: PortMatch("tcp", 0), "outside 1-65535"),
    (lambda: PortMatch("tcp", 65536), "outside 1-65535"),
    (lambda: PortMatch("tcp", "http"), "not a port number"),
    (lambda: PortMatch("tcp", True), "not a port number"),
    (lambda: ServicePortMap("s", "tcp", 10001, 0, "100.1.1.1", "100.64.0.1"), "target_port"),
    (lambda: ServicePortMap("s", "icmp", 10001, 80, "100.1.1.1", "100.64.0.1"), "protocol"),
    (lambda: ServicePortMap("s", "tcp", 10001, 80, "100.1.1.1", "fd7a::1"), "mix IPv4 and IPv6"),
    (lambda: ServicePortMap("", "tcp", 10001, 80, "100.1.1.1", "100.64.0.1"), "non-empty"),
    (lambda: ServicePortMap('a"b', "tcp", 10001, 80, "100.1.1.1", "100.64.0.1"), "quotes"),
    (lambda: ServiceDnat("svc:web", "100.100.1.1", "fd00::10"), "mix IPv4 and IPv6"),
    (lambda: RuleSet(tun="bad name"), "interface name"),
    (lambda: RuleSet(tun="x" * 16), "interface name"),
    (lambda: RuleSet(dnats=("100.64.0.5",)), "expected Dnat"),
])
def test_invalid_inputs_fail_with_a_clear_message(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


def test_conflicting_intents_are_refused():
    with pytest.raises(ValueError, match="two DNATs for 100.64.0.5"):
        RuleSet(dnats=(Dnat("100.64.0.5", ("10.0.0.1",)), Dnat("100.64.0.5", ("10.0.0.2",))))
    with pytest.raises(ValueError, match="two DNATs for 100.100.1.1"):
        RuleSet(dnats=(Dnat("100.100.1.1", ("10.0.0.1",)),),
                service_dnats=(ServiceDnat("svc:a", "100.100.1.1", "10.96.0.1"),))
    with pytest.raises(ValueError, match="tcp/10001 is mapped twice"):
        RuleSet(port_maps=(ServicePortMap("a", "tcp", 10001, 80, "100.1.1.1", "100.64.0.1"),
                           ServicePortMap("b", "tcp", 10001, 80, "100.1.1.2", "100.64.0.1")))
    with pytest.raises(ValueError, match="SNATed to both"):
        RuleSet(egress=(EgressForward("100.1.1.1", "100.64.0.1"),),
                port_maps=(ServicePortMap("b", "tcp", 10001, 80, "100.1.1.1", "100.64.0.2"),))


def test_same_port_number_in_both_families_and_protocols_is_fine():
    maps = (ServicePortMap("a", "tcp", 10001, 80, "100.1.1.1", "100.64.0.1"),
            ServicePortMap("a", "udp", 10001, 80, "100.1.1.1", "100.64.0.1"),
            ServicePortMap("a", "tcp", 10001, 80, "fd7a::1", "fd7a::5"))
    assert RuleSet(port_maps=maps).port_maps == maps     # accepted, none merged or dropped


def test_identical_entries_are_deduplicated():
    d = Dnat("100.64.0.5", ("10.0.0.1",))
    r = RuleSet(dnats=(d, d, Dnat("100.64.0.5", ["10.0.0.1"])))
    assert r.dnats == (d,)


def test_exempt_is_a_canonical_set():
    a = EgressForward("100.99.99.99", "100.64.0.5", (PortMatch("udp", 41641), PortMatch("tcp", 9002)))
    b = EgressForward("100.99.99.99", "100.64.0.5", [PortMatch("tcp", 9002), ("udp", 41641), ("UDP", 41641)])
    assert a == b and hash(a) == hash(b)
    assert a.exempt == (PortMatch("tcp", 9002), PortMatch("udp", 41641))


def test_family_split():
    r = full()
    v4, v6 = r.family(4), r.family(6)
    assert [d.original_dst for d in v4.dnats] == [ip("100.64.0.5")]
    assert [d.original_dst for d in v6.dnats] == [ip("fd7a:115c:a1e0::5")]
    assert v4.egress == r.egress and v6.egress == ()
    assert v4.port_maps == () and v6.port_maps == r.port_maps
    assert v4.service_dnats == r.service_dnats and v6.service_dnats == ()
    assert v4.clamp_mss and v6.clamp_mss and v4.tun == "tailscale0"
    assert r.versions() == (4, 6) and v6.versions() == (6,)
    assert RuleSet().empty and RuleSet(clamp_mss=True).empty and not v6.empty
    with pytest.raises(ValueError):
        r.family(5)


def test_snat_pairs_are_deduplicated():
    r = RuleSet(egress=(EgressForward("100.1.1.1", "100.64.0.1"),),
                port_maps=(ServicePortMap("a", "tcp", 1, 2, "100.1.1.1", "100.64.0.1"),
                           ServicePortMap("a", "tcp", 3, 4, "100.1.1.2", "100.64.0.1")))
    assert r.snat_pairs() == ((ip("100.1.1.1"), ip("100.64.0.1")), (ip("100.1.1.2"), ip("100.64.0.1")))


def test_json_round_trip():
    r = full()
    text = r.to_json()
    assert RuleSet.from_json(text) == r
    assert RuleSet.from_json(RuleSet().to_json()) == RuleSet()
    assert '"original_dst": "100.64.0.5"' in text


@pytest.mark.parametrize("text, needle", [
    ("not json", "not valid JSON"),
    ("[]", "must be an object"),
    ('{"dnats": [{"targets": ["10.0.0.1"]}]}', "missing or has a malformed field"),
    ('{"bogus": 1}', "unknown keys: bogus"),
    ('{"dnats": [{"original_dst": "1.2.3.4", "targets": ["fd00::1"]}]}', "mix IPv4 and IPv6"),
])
def test_json_errors(text, needle):
    with pytest.raises(ValueError, match=needle):
        RuleSet.from_json(text)


def test_objects_are_frozen_and_hashable():
    r = full()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.tun = "x"  # type: ignore[misc]
    assert len({r, full()}) == 1
