"""The nftables delta planner (`netfilter.plan.nft_state` / `plan_nft_delta`): which changes become a few map
elements added and removed, and which need the whole tables replaced. Pure; the kernel side is
`netns-tests/test_netfilter_kernel.py::test_nft_delta_leaves_the_same_ruleset_as_a_full_apply`."""
from __future__ import annotations

import itertools
from ipaddress import ip_address

from netfilter.model import Dnat, EgressForward, RuleSet, ServicePortMap
from netfilter.plan import ipt_chain_rules, nft_state, plan_iptables_delta, plan_nft_delta, render_nft

TS4, TS6 = "100.64.0.5", "fd7a:115c:a1e0::5"


def svc(i: int, v: int = 4, port: int = 5432, target: str = "", proto: str = "tcp") -> ServicePortMap:
    t = target or (f"100.100.{i // 250}.{i % 250 + 1}" if v == 4 else f"fd7a:115c:a1e0::{i + 1:x}")
    return ServicePortMap(f"default-svc{i}", proto, 10000 + i, port, ip_address(t), ip_address(TS4 if v == 4 else TS6))


def rs(*maps: ServicePortMap, **kw) -> RuleSet:
    return RuleSet(port_maps=maps, clamp_mss=True, **kw)


def delta(a: RuleSet, b: RuleSet) -> str | None:
    return plan_nft_delta(nft_state(a), nft_state(b))


BASE = tuple(svc(i) for i in range(1000))


def test_adding_one_service_to_a_thousand_adds_its_two_elements():
    assert delta(rs(*BASE), rs(*BASE, svc(1000))) == (
        "add element ip containerboot portmap { tcp . 11000 : 100.100.4.1 . 5432 }\n"
        "add element ip containerboot snatmap { 100.100.4.1 : 100.64.0.5 }\n")


def test_removing_one_service_deletes_its_keys_only():
    assert delta(rs(*BASE), rs(*BASE[:500], *BASE[501:])) == (
        "delete element ip containerboot portmap { tcp . 10500 }\n"
        "delete element ip containerboot snatmap { 100.100.2.1 }\n")


def test_a_moved_target_is_deleted_and_added_in_one_script():
    moved = rs(*BASE[:3], svc(3, target="100.101.0.9"), *BASE[4:])
    assert delta(rs(*BASE), moved) == (
        "delete element ip containerboot portmap { tcp . 10003 }\n"
        "add element ip containerboot portmap { tcp . 10003 : 100.101.0.9 . 5432 }\n"
        "delete element ip containerboot snatmap { 100.100.0.4 }\n"
        "add element ip containerboot snatmap { 100.101.0.9 : 100.64.0.5 }\n")


def test_a_changed_target_port_touches_the_port_map_only():
    assert delta(rs(*BASE), rs(svc(0, port=80), *BASE[1:])) == (
        "delete element ip containerboot portmap { tcp . 10000 }\n"
        "add element ip containerboot portmap { tcp . 10000 : 100.100.0.1 . 80 }\n")


def test_ipv6_elements_go_to_the_ip6_table():
    base = rs(*BASE[:3], svc(0, 6), svc(1, 6))
    assert delta(base, rs(*BASE[:3], svc(0, 6), svc(1, 6), svc(2, 6))) == (
        "add element ip6 containerboot portmap { tcp . 10002 : fd7a:115c:a1e0::3 . 5432 }\n"
        "add element ip6 containerboot snatmap { fd7a:115c:a1e0::3 : fd7a:115c:a1e0::5 }\n")


def test_nothing_changed_is_an_empty_script():
    assert delta(rs(*BASE), rs(*reversed(BASE))) == ""      # order of the input does not matter


def test_changes_outside_the_maps_need_a_full_replacement():
    two = rs(*BASE[:2])
    assert delta(two, rs(*BASE[:2], dnats=(Dnat(TS4, ("10.0.0.1",)),))) is None     # a new rule
    assert delta(two, RuleSet(port_maps=BASE[:2], clamp_mss=False)) is None          # clamping gone
    assert delta(two, rs(*BASE[:2], tun="ts1")) is None                              # interface name
    assert delta(two, rs(*BASE[:2], egress=(EgressForward("100.99.99.99", TS4),))) is None
    # Crossing the map boundaries changes rules: the first port map, the second SNAT pair (a rule before).
    assert delta(RuleSet(clamp_mss=True), rs(svc(0))) is None
    assert delta(rs(svc(0)), rs(svc(0), svc(1))) is None
    assert delta(rs(svc(0), svc(1)), rs(svc(0))) is None
    assert delta(rs(svc(0), svc(1)), rs(svc(0), svc(1), svc(2))) is not None


def _split(text: str) -> tuple[str, dict[tuple[str, str], frozenset[tuple[str, str]]]]:
    """render_nft text -> (the text without map elements, {(table, map): elements})."""
    rest: list[str] = []
    maps: dict[tuple[str, str], frozenset[tuple[str, str]]] = {}
    table = name = ""
    for line in text.splitlines():
        if line.startswith("table "):
            table = line.split()[1]
        elif line.strip().startswith("map "):
            name = line.split()[1]
        if line.strip().startswith("elements = { "):
            body = line.strip()[len("elements = { "):-2]
            pairs = [e.split(" : ") for e in body.split(", ")]
            maps[(table, name)] = frozenset((k, d) for k, d in pairs)
            continue
        rest.append(line)
    return "\n".join(rest), maps


V4, V6 = ip_address(TS4), ip_address(TS6)
VARIANTS = [
    RuleSet(), RuleSet(clamp_mss=True), rs(svc(0)), rs(svc(0), svc(1)), rs(svc(0), svc(0, 6)),
    rs(svc(0), svc(1, target="100.100.0.1")),                          # two Services, one target: one SNAT pair
    rs(svc(0), svc(1), svc(2, 6), svc(3, 6), egress=(EgressForward(ip_address("100.100.0.1"), V4),)),
    rs(svc(0), egress=(EgressForward(ip_address("100.99.99.99"), V4),)),
    rs(svc(0), svc(1), tun="ts1"), rs(svc(0), svc(1), dnats=(Dnat(V4, (ip_address("10.0.0.1"),)),)),
    RuleSet(port_maps=(svc(0), svc(1))), RuleSet(port_maps=(svc(0, 6),)),
    RuleSet(egress=(EgressForward(ip_address("100.99.99.99"), V4), EgressForward(ip_address("100.99.99.98"), V4))),
]


def test_the_state_agrees_with_the_rendered_tables():
    """Two rule sets give the same shape exactly when their rendered tables differ in map elements only, and
    the state's elements are the rendered ones: a delta can only ever reach what a full apply writes."""
    for a, b in itertools.product(VARIANTS, repeat=2):
        (rest_a, maps_a), (rest_b, _) = _split(render_nft(a)), _split(render_nft(b))
        sa, sb = nft_state(a), nft_state(b)
        assert (sa.shape == sb.shape) == (rest_a == rest_b), (a, b)
        fam = {4: "ip", 6: "ip6"}
        assert {(fam[v], n): e for (v, n), e in sa.elements} == maps_a


# ============================================================================== iptables (iptables-nft deltas)

def ipt_delta(a: RuleSet, b: RuleSet, v: int = 4) -> str | None:
    return plan_iptables_delta(ipt_chain_rules(a, v), ipt_chain_rules(b, v))


def _replay(old: tuple[str, ...], script: str, chain: str) -> list[str]:
    """What `iptables-restore --noflush` does to `chain` with the -D/-I lines of `script` (by position)."""
    rules = [ln[len(f"-A {chain} "):] for ln in old]
    for line in script.splitlines():
        parts = line.split(" ", 3)
        if parts[0] == "-D" and parts[1] == chain:
            del rules[int(parts[2]) - 1]
        elif parts[0] == "-I" and parts[1] == chain:
            rules.insert(int(parts[2]) - 1, parts[3])
    return [f"-A {chain} {r}" for r in rules]


def test_iptables_delta_replayed_gives_the_new_chains():
    cases = [(rs(*BASE[:50]), rs(*BASE[:51])), (rs(*BASE[:50]), rs(*BASE[:20], *BASE[21:50])),
             (rs(*BASE[:50]), rs(*BASE[:3], svc(3, target="100.101.0.9"), *BASE[4:50])),
             (rs(*BASE[:50]), rs(*BASE[10:60])),
             (rs(*BASE[:50], egress=(EgressForward(ip_address("100.99.99.99"), V4),)),
              rs(*BASE[:49], egress=(EgressForward(ip_address("100.99.99.99"), V4),)))]
    for a, b in cases:
        script = ipt_delta(a, b)
        assert script and script.startswith("*nat\n") and script.endswith("COMMIT\n")
        old, new = ipt_chain_rules(a, 4), ipt_chain_rules(b, 4)
        for chain in old:
            assert _replay(old[chain], script, chain) == list(new[chain]), chain
    assert ipt_delta(rs(*BASE[:50]), rs(*BASE[:51])).count("\n-I ") == 2       # its DNAT and its SNAT rule
    assert "-D CB-PREROUTING 21\n" in ipt_delta(rs(*BASE[:50]), rs(*BASE[:20], *BASE[21:50]))


def test_iptables_delta_refuses_what_needs_the_chains_rewritten():
    assert ipt_delta(rs(*BASE[:5]), rs(*BASE[:5])) == ""
    assert ipt_delta(RuleSet(clamp_mss=True), rs(svc(0))) is None                   # a chain appears
    assert ipt_delta(rs(svc(0)), RuleSet(clamp_mss=True)) is None                   # ... or goes away
    assert ipt_delta(rs(svc(0), svc(0, 6)), rs(svc(0), svc(1, 6)), 6) is not None


def test_the_generation_is_read_from_a_newgen_reply_only():
    import struct

    from netfilter.generation import advanced_by, parse_generation
    attrs = struct.pack("=HH", 8, 1) + struct.pack(">I", 4242) + struct.pack("=HH", 8, 2) + struct.pack(">I", 7)
    reply = struct.pack("=IHHII", 20 + len(attrs), (10 << 8) | 15, 0, 0, 0) + struct.pack("=BBH", 0, 0, 0) + attrs
    assert parse_generation(reply) == 4242
    error = struct.pack("=IHHII", 36, 2, 0, 0, 0) + struct.pack("=i", -1) + reply[:16]      # NLMSG_ERROR
    assert parse_generation(error) is None and parse_generation(reply[:12]) is None
    assert advanced_by(7, 8, 1) and advanced_by(7, 7, 0) and advanced_by(2**32 - 1, 0, 1)
    assert not advanced_by(7, 9, 1) and not advanced_by(None, 8, 1) and not advanced_by(7, None, 0)
