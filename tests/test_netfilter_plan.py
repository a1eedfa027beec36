"""netfilter.plan: exact rule sets for every operation (O1-O6), both backends, both families (pure, no root).

The iptables idempotency tests run the planner against a small simulator of `iptables-restore --noflush`
semantics (declaring a chain flushes it, -D removes the first identical rule, -I/-A insert/append, -X deletes),
so "apply N times" is checked without a kernel; the netns tests check the same against real kernels.
"""
from __future__ import annotations

import json

import pytest

from netfilter.model import Dnat, EgressForward, PortMatch, RuleSet, ServiceDnat, ServicePortMap
from netfilter.plan import (
    IptState,
    canonical_iptables,
    filter_iptables_save,
    normalize_nft_text,
    plan_iptables,
    plan_nft,
    plan_nft_script,
    render_iptables,
    render_nft,
)

TS4, TS6 = "100.64.0.5", "fd7a:115c:a1e0::5"
EXEMPT = (PortMatch("udp", 41641), PortMatch("tcp", 9002))

CLAMP_IPT = [
    "-A CB-FORWARD -o tailscale0 -p tcp -m tcp --tcp-flags SYN,RST SYN -j TCPMSS --clamp-mss-to-pmtu",
    "-A CB-FORWARD -i tailscale0 -p tcp -m tcp --tcp-flags SYN,RST SYN -j TCPMSS --clamp-mss-to-pmtu",
]
CLAMP_NFT = """
\tchain forward {
\t\ttype filter hook forward priority mangle; policy accept;
\t\toifname "tailscale0" tcp flags syn / syn,rst tcp option maxseg size set rt mtu
\t\tiifname "tailscale0" tcp flags syn / syn,rst tcp option maxseg size set rt mtu
\t}"""
PRE = "\tchain prerouting {\n\t\ttype nat hook prerouting priority dstnat - 10; policy accept;\n"
POST = "\tchain postrouting {\n\t\ttype nat hook postrouting priority srcnat - 10; policy accept;\n"


def fresh_restore(nat: list[str], mangle: list[str] | None = None) -> str:
    """Expected restore input when none of our chains exists yet."""
    out = []
    decl = sorted({ln.split()[1] for ln in nat})
    if nat:
        out += ["*nat", *[f":{c} - [0:0]" for c in ("CB-PREROUTING", "CB-POSTROUTING") if c in decl]]
        for c, b in (("CB-PREROUTING", "PREROUTING"), ("CB-POSTROUTING", "POSTROUTING")):
            if c in decl:
                out.append(f"-I {b} 1 -j {c}")
                out += [ln for ln in nat if ln.split()[1] == c]
        out.append("COMMIT")
    if mangle:
        out += ["*mangle", ":CB-FORWARD - [0:0]", "-I FORWARD 1 -j CB-FORWARD", *mangle, "COMMIT"]
    return "\n".join(out) + "\n"


# ====================================================================================================== O1 - O6

CASES = {
    # O1: TS_DEST_IP, everything to the tailnet IP goes to the backend.
    "O1-v4": (RuleSet(dnats=(Dnat(TS4, ("10.0.0.7",)),), clamp_mss=True), 4,
              ["-A CB-PREROUTING -d 100.64.0.5/32 -j DNAT --to-destination 10.0.0.7"], CLAMP_IPT,
              "table ip containerboot {\n" + PRE +
              "\t\tip daddr 100.64.0.5 dnat to 10.0.0.7\n\t}\n" + CLAMP_NFT + "\n}\n"),
    "O1-v6": (RuleSet(dnats=(Dnat(TS6, ("fd00::7",)),), clamp_mss=True), 6,
              ["-A CB-PREROUTING -d fd7a:115c:a1e0::5/128 -j DNAT --to-destination fd00::7"], CLAMP_IPT,
              "table ip6 containerboot {\n" + PRE +
              "\t\tip6 daddr fd7a:115c:a1e0::5 dnat to fd00::7\n\t}\n" + CLAMP_NFT + "\n}\n"),
    # O2: DNS name with several backends: load-balanced in BOTH backends [E3].
    "O2-v4": (RuleSet(dnats=(Dnat(TS4, ("10.0.0.1", "10.0.0.2", "10.0.0.3")),), clamp_mss=True), 4,
              ["-A CB-PREROUTING -d 100.64.0.5/32 -m statistic --mode nth --every 3 --packet 0 -j DNAT --to-destination 10.0.0.3",  # noqa: E501 -- a rule verbatim
               "-A CB-PREROUTING -d 100.64.0.5/32 -m statistic --mode nth --every 2 --packet 0 -j DNAT --to-destination 10.0.0.2",  # noqa: E501 -- a rule verbatim
               "-A CB-PREROUTING -d 100.64.0.5/32 -j DNAT --to-destination 10.0.0.1"], CLAMP_IPT,
              "table ip containerboot {\n" + PRE +
              "\t\tip daddr 100.64.0.5 dnat to numgen random mod 3 map { 0 : 10.0.0.1, 1 : 10.0.0.2, 2 : 10.0.0.3 }\n"
              "\t}\n" + CLAMP_NFT + "\n}\n"),
    "O2-v6": (RuleSet(dnats=(Dnat(TS6, ("fd00::1", "fd00::2")),), clamp_mss=True), 6,
              ["-A CB-PREROUTING -d fd7a:115c:a1e0::5/128 -m statistic --mode nth --every 2 --packet 0 -j DNAT --to-destination fd00::2",  # noqa: E501 -- a rule verbatim
               "-A CB-PREROUTING -d fd7a:115c:a1e0::5/128 -j DNAT --to-destination fd00::1"], CLAMP_IPT,
              "table ip6 containerboot {\n" + PRE +
              "\t\tip6 daddr fd7a:115c:a1e0::5 dnat to numgen random mod 2 map { 0 : fd00::1, 1 : fd00::2 }\n"
              "\t}\n" + CLAMP_NFT + "\n}\n"),
    # O3: egress to a tailnet target: iifname (not oifname) [E1], exempt ports [E18], SNAT /32 and /128 [E6].
    "O3-v4": (RuleSet(egress=(EgressForward("100.99.99.99", TS4, EXEMPT),), clamp_mss=True), 4,
              ["-A CB-PREROUTING ! -i tailscale0 -p tcp -m tcp --dport 9002 -j RETURN",
               "-A CB-PREROUTING ! -i tailscale0 -p udp -m udp --dport 41641 -j RETURN",
               "-A CB-PREROUTING ! -i tailscale0 -j DNAT --to-destination 100.99.99.99",
               "-A CB-POSTROUTING -d 100.99.99.99/32 -j SNAT --to-source 100.64.0.5"], CLAMP_IPT,
              "table ip containerboot {\n" + PRE +
              '\t\tiifname != "tailscale0" meta l4proto . th dport != { tcp . 9002, udp . 41641 } dnat to 100.99.99.99\n'  # noqa: E501 -- a rule verbatim
              "\t}\n\n" + POST + "\t\tip daddr 100.99.99.99 snat to 100.64.0.5\n\t}\n" + CLAMP_NFT + "\n}\n"),
    "O3-v6": (RuleSet(egress=(EgressForward("fd7a:115c:a1e0::99", TS6, EXEMPT),), clamp_mss=True), 6,
              ["-A CB-PREROUTING ! -i tailscale0 -p tcp -m tcp --dport 9002 -j RETURN",
               "-A CB-PREROUTING ! -i tailscale0 -p udp -m udp --dport 41641 -j RETURN",
               "-A CB-PREROUTING ! -i tailscale0 -j DNAT --to-destination fd7a:115c:a1e0::99",
               "-A CB-POSTROUTING -d fd7a:115c:a1e0::99/128 -j SNAT --to-source fd7a:115c:a1e0::5"], CLAMP_IPT,
              "table ip6 containerboot {\n" + PRE +
              '\t\tiifname != "tailscale0" meta l4proto . th dport != { tcp . 9002, udp . 41641 } dnat to fd7a:115c:a1e0::99\n'  # noqa: E501 -- a rule verbatim
              "\t}\n\n" + POST + "\t\tip6 daddr fd7a:115c:a1e0::99 snat to fd7a:115c:a1e0::5\n\t}\n" + CLAMP_NFT +
              "\n}\n"),
    # O4: Pod IP -> own tailnet IP (local delivery: no clamp).
    "O4-v4": (RuleSet(dnats=(Dnat("10.1.2.3", (TS4,)),)), 4,
              ["-A CB-PREROUTING -d 10.1.2.3/32 -j DNAT --to-destination 100.64.0.5"], [],
              "table ip containerboot {\n" + PRE + "\t\tip daddr 10.1.2.3 dnat to 100.64.0.5\n\t}\n}\n"),
    "O4-v6": (RuleSet(dnats=(Dnat("fd00:10::3", (TS6,)),)), 6,
              ["-A CB-PREROUTING -d fd00:10::3/128 -j DNAT --to-destination fd7a:115c:a1e0::5"], [],
              "table ip6 containerboot {\n" + PRE + "\t\tip6 daddr fd00:10::3 dnat to fd7a:115c:a1e0::5\n\t}\n}\n"),
    # O5: egress services: one map lookup per packet in nftables; brackets for IPv6 in iptables [E2].
    "O5-v4": (RuleSet(port_maps=(
                  ServicePortMap("default-mysvc", "TCP", 10001, 5432, "100.99.99.99", TS4),
                  ServicePortMap("default-dns", "UDP", 10002, 53, "100.99.99.98", TS4)), clamp_mss=True), 4,
              ['-A CB-PREROUTING ! -i tailscale0 -p tcp -m tcp --dport 10001 -m comment --comment "svc default-mysvc tcp/10001" -j DNAT --to-destination 100.99.99.99:5432',  # noqa: E501 -- a rule verbatim
               '-A CB-PREROUTING ! -i tailscale0 -p udp -m udp --dport 10002 -m comment --comment "svc default-dns udp/10002" -j DNAT --to-destination 100.99.99.98:53',  # noqa: E501 -- a rule verbatim
               "-A CB-POSTROUTING -d 100.99.99.98/32 -j SNAT --to-source 100.64.0.5",
               "-A CB-POSTROUTING -d 100.99.99.99/32 -j SNAT --to-source 100.64.0.5"], CLAMP_IPT,
              "table ip containerboot {\n"
              "\tmap portmap {\n\t\ttype inet_proto . inet_service : ipv4_addr . inet_service\n"
              "\t\telements = { tcp . 10001 : 100.99.99.99 . 5432, udp . 10002 : 100.99.99.98 . 53 }\n\t}\n\n"
              "\tmap snatmap {\n\t\ttype ipv4_addr : ipv4_addr\n"
              "\t\telements = { 100.99.99.98 : 100.64.0.5, 100.99.99.99 : 100.64.0.5 }\n\t}\n\n" + PRE +
              '\t\tiifname != "tailscale0" dnat ip to meta l4proto . th dport map @portmap\n'
              "\t}\n\n" + POST +
              "\t\tsnat to ip daddr map @snatmap\n\t}\n"
              + CLAMP_NFT + "\n}\n"),
    "O5-v6": (RuleSet(port_maps=(
                  ServicePortMap("default-mysvc", "tcp", 10001, 80, "fd7a:115c:a1e0::701:b62a", TS6),),
                      clamp_mss=True), 6,
              ['-A CB-PREROUTING ! -i tailscale0 -p tcp -m tcp --dport 10001 -m comment --comment "svc default-mysvc tcp/10001" -j DNAT --to-destination [fd7a:115c:a1e0::701:b62a]:80',  # noqa: E501 -- a rule verbatim
               "-A CB-POSTROUTING -d fd7a:115c:a1e0::701:b62a/128 -j SNAT --to-source fd7a:115c:a1e0::5"], CLAMP_IPT,
              "table ip6 containerboot {\n"
              "\tmap portmap {\n\t\ttype inet_proto . inet_service : ipv6_addr . inet_service\n"
              "\t\telements = { tcp . 10001 : fd7a:115c:a1e0::701:b62a . 80 }\n\t}\n\n" + PRE +
              '\t\tiifname != "tailscale0" dnat ip6 to meta l4proto . th dport map @portmap\n'
              "\t}\n\n" + POST +
              "\t\tip6 daddr fd7a:115c:a1e0::701:b62a snat to fd7a:115c:a1e0::5\n\t}\n" + CLAMP_NFT + "\n}\n"),
    # O6: ingress services, VIP -> ClusterIP, no interface restriction.
    "O6-v4": (RuleSet(service_dnats=(ServiceDnat("svc:web", "100.100.1.1", "10.96.0.10"),
                                     ServiceDnat("svc:db", "100.100.1.2", "10.96.0.11")), clamp_mss=True), 4,
              ['-A CB-PREROUTING -d 100.100.1.1/32 -m comment --comment "svc svc:web" -j DNAT --to-destination 10.96.0.10',  # noqa: E501 -- a rule verbatim
               '-A CB-PREROUTING -d 100.100.1.2/32 -m comment --comment "svc svc:db" -j DNAT --to-destination 10.96.0.11'],  # noqa: E501 -- a rule verbatim
              CLAMP_IPT,
              "table ip containerboot {\n" + PRE +
              "\t\tdnat to ip daddr map { 100.100.1.1 : 10.96.0.10, 100.100.1.2 : 10.96.0.11 }\n\t}\n" + CLAMP_NFT
              + "\n}\n"),
    "O6-v6": (RuleSet(service_dnats=(ServiceDnat("svc:web", "fd7a:115c:a1e0::1", "fd00:96::10"),), clamp_mss=True), 6,
              ['-A CB-PREROUTING -d fd7a:115c:a1e0::1/128 -m comment --comment "svc svc:web" -j DNAT --to-destination fd00:96::10'],  # noqa: E501 -- a rule verbatim
              CLAMP_IPT,
              "table ip6 containerboot {\n" + PRE +
              "\t\tip6 daddr fd7a:115c:a1e0::1 dnat to fd00:96::10\n\t}\n" + CLAMP_NFT + "\n}\n"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_iptables_restore_input(case):
    rules, fam, nat, mangle, _ = CASES[case]
    assert plan_iptables(rules, fam) == fresh_restore(nat, mangle)
    other = 6 if fam == 4 else 4
    assert plan_iptables(rules, other) == ""          # nothing for the family without rules


@pytest.mark.parametrize("case", sorted(CASES))
def test_iptables_render(case):
    rules, fam, nat, mangle, _ = CASES[case]
    expect = []
    natlines = []
    for c, b in (("CB-PREROUTING", "PREROUTING"), ("CB-POSTROUTING", "POSTROUTING")):
        if any(ln.split()[1] == c for ln in nat):
            natlines.append(f"-A {b} -j {c}")
    decl = sorted({f":{ln.split()[1]} - [0:0]" for ln in nat})
    pre = [ln for ln in nat if ln.split()[1] == "CB-PREROUTING"]
    post = [ln for ln in nat if ln.split()[1] == "CB-POSTROUTING"]
    expect += ["*nat", *decl, *natlines, *post, *pre]     # iptables-save order: built-ins, then ours by name
    if mangle:
        expect += ["*mangle", ":CB-FORWARD - [0:0]", "-A FORWARD -j CB-FORWARD", *mangle]
    assert render_iptables(rules, fam) == "\n".join(expect) + "\n"


@pytest.mark.parametrize("case", sorted(CASES))
def test_nft_render(case):
    rules, fam, _, _, text = CASES[case]
    assert render_nft(rules) == text
    assert render_nft(rules, (4,) if fam == 6 else (6,)) == ""


@pytest.mark.parametrize("case", sorted(CASES))
def test_nft_batch_replaces_both_tables_atomically(case):
    rules, fam, *_ = CASES[case]
    if case.startswith("O5"):       # named maps: the text batch
        script = plan_nft_script(rules).splitlines()
        assert script[:2] == ["add table ip containerboot", "delete table ip containerboot"]
        assert "delete table ip6 containerboot" in script
        assert render_nft(rules) in "\n".join(script) + "\n"     # the tables are written as rendered
        with pytest.raises(ValueError, match="plan_nft_script"):
            plan_nft(rules)
        return
    cmds = plan_nft(rules)["nftables"]
    fam_name = "ip" if fam == 4 else "ip6"
    other = "ip6" if fam == 4 else "ip"
    # add+delete of both tables first (so a missing table cannot fail the batch), then our family rebuilt.
    assert cmds[:2] == [{"add": {"table": {"family": "ip", "name": "containerboot"}}},
                        {"delete": {"table": {"family": "ip", "name": "containerboot"}}}]
    assert {"delete": {"table": {"family": other, "name": "containerboot"}}} in cmds
    assert sum(1 for c in cmds if c == {"add": {"table": {"family": fam_name, "name": "containerboot"}}}) == 2
    # Every object we create is inside our table; nothing else is ever addressed.
    for c in cmds:
        (verb, obj), = c.items()
        (kind, body), = obj.items()
        assert verb in ("add", "delete") and kind in ("table", "chain", "rule")
        assert body.get("table", body.get("name")) == "containerboot"
    rules_of = [c["add"]["rule"] for c in cmds if "rule" in c.get("add", {})]
    assert all(r["family"] == fam_name for r in rules_of)
    assert plan_nft(rules) == plan_nft(rules)              # a function of the desired state only


# ================================================================================================ exact JSON

def test_nft_json_egress_uses_iifname_and_exempt_set():       # [E1], [E18]
    cmds = plan_nft(CASES["O3-v4"][0], (4,))["nftables"]
    pre = [c["add"]["rule"] for c in cmds if c.get("add", {}).get("rule", {}).get("chain") == "prerouting"]
    assert pre == [{"family": "ip", "table": "containerboot", "chain": "prerouting", "expr": [
        {"match": {"op": "!=", "left": {"meta": {"key": "iifname"}}, "right": "tailscale0"}},
        {"match": {"op": "!=", "left": {"concat": [{"meta": {"key": "l4proto"}},
                                                  {"payload": {"protocol": "th", "field": "dport"}}]},
                   "right": {"set": [{"concat": ["tcp", 9002]}, {"concat": ["udp", 41641]}]}}},
        {"dnat": {"addr": "100.99.99.99"}}]}]
    assert "oifname" not in json.dumps(pre)


def test_nft_json_chains_and_priorities():
    cmds = plan_nft(CASES["O3-v6"][0], (6,))["nftables"]
    chains = [c["add"]["chain"] for c in cmds if "chain" in c.get("add", {})]
    assert chains == [
        {"family": "ip6", "table": "containerboot", "name": "prerouting", "type": "nat", "hook": "prerouting",
         "prio": -110, "policy": "accept"},
        {"family": "ip6", "table": "containerboot", "name": "postrouting", "type": "nat", "hook": "postrouting",
         "prio": 90, "policy": "accept"},
        {"family": "ip6", "table": "containerboot", "name": "forward", "type": "filter", "hook": "forward",
         "prio": -150, "policy": "accept"}]


def test_nft_port_map_is_one_rule_with_a_named_map():
    maps = tuple(ServicePortMap(f"ns-svc{i}", "tcp", 10000 + i, 80, f"100.99.{i // 250}.{i % 250 + 1}", TS4)
                 for i in range(500))
    lines = render_nft(RuleSet(port_maps=maps), (4,)).splitlines()
    rules = [ln for ln in lines if " to " in ln]
    # per-packet cost independent of the service count: one rule each, a hash map lookup
    assert rules == ['\t\tiifname != "tailscale0" dnat ip to meta l4proto . th dport map @portmap',
                     "\t\tsnat to ip daddr map @snatmap"]
    elements = [ln for ln in lines if "elements" in ln]
    assert len(elements) == 2 and all(ln.count(" : ") == 500 for ln in elements)
    assert "tcp . 10000 : 100.99.0.1 . 80, " in elements[0]
    # iptables is allowed to be linear: one rule per map.
    assert plan_iptables(RuleSet(port_maps=maps), 4).count("-j DNAT") == 500


def test_nft_json_lb_and_clamp():
    cmds = plan_nft(CASES["O2-v4"][0], (4,))["nftables"]
    rules = [c["add"]["rule"] for c in cmds if "rule" in c.get("add", {})]
    assert rules[0]["expr"][1] == {"dnat": {"addr": {"map": {
        "key": {"numgen": {"mode": "random", "mod": 3, "offset": 0}},
        "data": {"set": [[0, "10.0.0.1"], [1, "10.0.0.2"], [2, "10.0.0.3"]]}}}}}
    clamp = [r for r in rules if r["chain"] == "forward"]
    assert len(clamp) == 2                                 # [E7]: exactly two, once
    assert clamp[0]["expr"][1] == {"match": {"op": "==", "left": {"&": [
        {"payload": {"protocol": "tcp", "field": "flags"}}, {"|": ["syn", "rst"]}]}, "right": "syn"}}   # [E17]
    assert clamp[0]["expr"][0]["match"]["right"] == "tailscale0"      # exact name, no prefix match [E16]


def test_nft_empty_rules_delete_our_tables_only():
    assert plan_nft(RuleSet()) == {"nftables": [
        {"add": {"table": {"family": "ip", "name": "containerboot"}}},
        {"delete": {"table": {"family": "ip", "name": "containerboot"}}},
        {"add": {"table": {"family": "ip6", "name": "containerboot"}}},
        {"delete": {"table": {"family": "ip6", "name": "containerboot"}}}]}
    assert plan_nft(RuleSet(clamp_mss=True), (4,))["nftables"][2:] == []
    assert render_nft(RuleSet()) == ""


def test_nft_ipv6_table_skipped_when_family_unavailable():
    r = RuleSet(dnats=(Dnat(TS4, ("10.0.0.7",)),))
    assert all(c[next(iter(c))]["table"].get("family") == "ip" if "table" in c[next(iter(c))] else True
               for c in plan_nft(r, (4,))["nftables"])
    assert "ip6" not in json.dumps(plan_nft(r, (4,)))


def test_combined_rule_order_specific_before_catch_all():
    r = RuleSet(dnats=(Dnat(TS4, ("10.0.0.1", "10.0.0.2")), Dnat("10.1.2.3", (TS4,))),
                service_dnats=(ServiceDnat("svc:web", "100.100.1.1", "10.96.0.10"),),
                port_maps=(ServicePortMap("s", "tcp", 10001, 80, "100.99.99.98", TS4),),
                egress=(EgressForward("100.99.99.99", TS4, EXEMPT),), clamp_mss=True)
    lines = [ln.strip() for ln in render_nft(r).splitlines()]
    pre = lines[lines.index("type nat hook prerouting priority dstnat - 10; policy accept;") + 1:][:4]
    assert pre[0].startswith("ip daddr 100.64.0.5 dnat to numgen")
    assert pre[1] == "dnat to ip daddr map { 10.1.2.3 : 100.64.0.5, 100.100.1.1 : 10.96.0.10 }"
    assert pre[2].startswith('iifname != "tailscale0" dnat ip to meta l4proto . th dport map')
    assert pre[3].endswith("dnat to 100.99.99.99")
    ipt = [ln for ln in plan_iptables(r, 4).splitlines() if ln.startswith("-A CB-PREROUTING")]
    assert ipt[-1] == "-A CB-PREROUTING ! -i tailscale0 -j DNAT --to-destination 100.99.99.99"
    assert ipt[-3:-1] == ["-A CB-PREROUTING ! -i tailscale0 -p tcp -m tcp --dport 9002 -j RETURN",
                          "-A CB-PREROUTING ! -i tailscale0 -p udp -m udp --dport 41641 -j RETURN"]


def test_several_egress_targets_are_load_balanced():
    r = RuleSet(egress=(EgressForward("100.99.99.99", TS4), EgressForward("100.99.99.98", TS4)))
    assert ('iifname != "tailscale0" dnat to numgen random mod 2 map { 0 : 100.99.99.99, 1 : 100.99.99.98 }'
            in render_nft(r))
    assert ("-A CB-PREROUTING ! -i tailscale0 -m statistic --mode nth --every 2 --packet 0 -j DNAT "
            "--to-destination 100.99.99.98") in plan_iptables(r, 4)


def test_custom_tun_name_everywhere():
    r = RuleSet(egress=(EgressForward("100.99.99.99", TS4),), clamp_mss=True, tun="ts1")
    assert "tailscale0" not in render_nft(r) + plan_iptables(r, 4) + json.dumps(plan_nft(r))
    assert '"ts1"' in render_nft(r) and "! -i ts1 " in plan_iptables(r, 4)


def test_normalize_sorts_elements_naturally():
    text = "x {\n\t\tdnat to ip daddr map { 10.0.0.10 : 1.1.1.1, 10.0.0.9 : 1.1.1.2 }\n}\n"
    assert normalize_nft_text(text) == "x {\n\t\tdnat to ip daddr map { 10.0.0.9 : 1.1.1.2, 10.0.0.10 : 1.1.1.1 }\n}\n"
    assert normalize_nft_text("") == ""


# ================================================================ iptables: simulated restore, idempotency

BUILTINS = {"nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
            "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING")}


class FakeIptables:
    """Minimal model of one family's nat+mangle tables and `iptables-restore --noflush`."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, list[str]]] = {
            t: {c: [] for c in chains} for t, chains in BUILTINS.items()}

    def save(self) -> str:
        out = []
        for t, chains in self.tables.items():
            out.append(f"*{t}")
            builtins = [c for c in chains if c in BUILTINS[t]]
            others = sorted(c for c in chains if c not in BUILTINS[t])
            out += [f":{c} ACCEPT [0:0]" for c in builtins] + [f":{c} - [0:0]" for c in others]
            for c in builtins + others:
                out += [f"-A {c} {r}" for r in chains[c]]
            out.append("COMMIT")
        return "\n".join(out) + "\n"

    def restore(self, text: str) -> None:
        table = None
        staged = None
        for line in text.splitlines():
            if line.startswith("*"):
                table = line[1:]
                staged = {c: list(r) for c, r in self.tables[table].items()}
            elif line == "COMMIT":
                self.tables[table] = staged      # atomic per table
            elif line.startswith(":"):
                staged[line[1:].split()[0]] = []
            else:
                op, chain, *rest = line.split(" ")
                spec = " ".join(rest)
                if op == "-A":
                    staged[chain].append(spec)
                elif op == "-I":
                    pos, spec = rest[0], " ".join(rest[1:])
                    staged[chain].insert(int(pos) - 1, spec)
                elif op == "-D":
                    staged[chain].remove(spec)          # ValueError = iptables-restore would fail
                elif op == "-X":
                    assert not staged[chain], "deleting a non-empty chain"
                    assert not any(f"-j {chain}" == r for rules in staged.values() for r in rules)
                    del staged[chain]
                else:
                    raise AssertionError(line)

    def apply(self, rules: RuleSet, fam: int) -> str:
        text = plan_iptables(rules, fam, self.save())
        self.restore(text)
        return text


@pytest.mark.parametrize("case", sorted(CASES))
def test_iptables_apply_three_times_is_stable(case):
    rules, fam, *_ = CASES[case]
    ipt = FakeIptables()
    ipt.tables["nat"]["PREROUTING"] += ["-d 10.9.9.9/32 -j DNAT --to-destination 10.8.8.8"]   # someone else's
    ipt.tables["nat"]["ts-postrouting"] = ["-m mark --mark 0x40000/0xff0000 -j MASQUERADE"]    # tailscaled's
    ipt.tables["nat"]["POSTROUTING"] += ["-j ts-postrouting"]
    ipt.apply(rules, fam)
    first = ipt.save()
    for _ in range(2):
        ipt.apply(rules, fam)
        assert ipt.save() == first
    # the installed view equals the rendered desired state
    tables = filter_iptables_save(first)
    assert "".join("\n".join(canonical_iptables(t, tables.get(t, []))) + "\n"
                   for t in ("nat", "mangle") if tables.get(t)) == render_iptables(rules, fam)
    # exactly one jump per used chain, first in its built-in chain; foreign rules untouched
    state = IptState.parse(first)
    assert all(v == (0,) for v in state.jumps.values())
    assert "-d 10.9.9.9/32 -j DNAT --to-destination 10.8.8.8" in ipt.tables["nat"]["PREROUTING"]
    assert ipt.tables["nat"]["ts-postrouting"] == ["-m mark --mark 0x40000/0xff0000 -j MASQUERADE"]
    # clamp rules present once
    assert sum(ln.count("TCPMSS") for ln in first.splitlines()) == (2 if rules.clamp_mss else 0)


def test_iptables_converged_plan_only_refreshes_our_chains():
    rules = CASES["O1-v4"][0]
    ipt = FakeIptables()
    ipt.apply(rules, 4)
    second = plan_iptables(rules, 4, ipt.save())
    assert "-I " not in second and "-D " not in second      # jump already first and single: left alone


def test_iptables_duplicate_and_misplaced_jumps_are_repaired():
    rules = CASES["O1-v4"][0]
    ipt = FakeIptables()
    ipt.apply(rules, 4)
    ipt.tables["nat"]["PREROUTING"] = ["-j DOCKER", "-j CB-PREROUTING", "-j CB-PREROUTING"]
    ipt.tables["nat"]["DOCKER"] = []
    text = ipt.apply(rules, 4)
    assert text.count("-D PREROUTING -j CB-PREROUTING") == 2
    assert ipt.tables["nat"]["PREROUTING"] == ["-j CB-PREROUTING", "-j DOCKER"]


def test_iptables_changing_a_target_removes_the_old_rule():
    ipt = FakeIptables()
    ipt.apply(RuleSet(egress=(EgressForward("100.99.99.99", TS4),), clamp_mss=True), 4)
    ipt.apply(RuleSet(egress=(EgressForward("100.99.99.98", "100.64.0.6"),), clamp_mss=True), 4)
    dump = ipt.save()
    assert "100.99.99.99" not in dump and "100.64.0.5" not in dump
    assert dump.count("-j DNAT") == 1 and dump.count("-j SNAT") == 1


def test_iptables_unneeded_chains_are_removed_and_cleanup_removes_all():
    ipt = FakeIptables()
    ipt.apply(CASES["O3-v4"][0], 4)
    ipt.apply(CASES["O4-v4"][0], 4)           # no SNAT, no clamp any more
    assert "CB-POSTROUTING" not in ipt.save() and "CB-FORWARD" not in ipt.save()
    ipt.apply(RuleSet(), 4)
    assert "CB-" not in ipt.save()
    assert plan_iptables(RuleSet(), 4, ipt.save()) == ""        # cleaning up twice is a no-op


def test_iptables_cleanup_text():
    ipt = FakeIptables()
    ipt.apply(CASES["O3-v6"][0], 6)
    assert plan_iptables(RuleSet(), 6, ipt.save()) == (
        "*nat\n:CB-PREROUTING - [0:0]\n:CB-POSTROUTING - [0:0]\n"
        "-D PREROUTING -j CB-PREROUTING\n-X CB-PREROUTING\n-D POSTROUTING -j CB-POSTROUTING\n-X CB-POSTROUTING\n"
        "COMMIT\n*mangle\n:CB-FORWARD - [0:0]\n-D FORWARD -j CB-FORWARD\n-X CB-FORWARD\nCOMMIT\n")


def test_iptables_family_validation():
    with pytest.raises(ValueError):
        plan_iptables(RuleSet(), 5)


def test_iptables_comment_is_sanitised_and_bounded():
    r = RuleSet(port_maps=(ServicePortMap("ns-" + "x" * 250 + "$(rm)", "tcp", 10001, 80, "100.99.99.99", TS4),))
    line = next(ln for ln in plan_iptables(r, 4).splitlines() if "--comment" in ln)
    comment = line.split('--comment "')[1].split('"')[0]
    assert len(comment) <= 200 and "$" not in comment and "(" not in comment


def test_egress_and_port_maps_never_capture_traffic_from_the_tun():        # [E1]
    for v in (4, 6):
        ts = TS4 if v == 4 else TS6
        tgt = "100.99.99.99" if v == 4 else "fd7a:115c:a1e0::99"
        r = RuleSet(egress=(EgressForward(tgt, ts, EXEMPT),),
                    port_maps=(ServicePortMap("s", "udp", 10001, 53, tgt, ts),))
        ipt = [ln for ln in plan_iptables(r, v).splitlines() if "-j DNAT" in ln or "-j RETURN" in ln]
        assert ipt and all(ln.startswith("-A CB-PREROUTING ! -i tailscale0 ") for ln in ipt)
        nft = [ln.strip() for ln in render_nft(r).splitlines() if "dnat" in ln]
        assert len(nft) == 2 and all(ln.startswith('iifname != "tailscale0" ') for ln in nft)
        assert "oifname" not in plan_nft_script(r)      # (no clamp here, so no legitimate oifname)


def test_exempt_ports_come_from_all_egress_entries():                       # [E18]
    r = RuleSet(egress=(EgressForward("100.99.99.99", TS4, (PortMatch("udp", 41641),)),
                        EgressForward("100.99.99.98", TS4, (PortMatch("tcp", 9002),))))
    assert "meta l4proto . th dport != { tcp . 9002, udp . 41641 }" in render_nft(r)
    text = plan_iptables(r, 4)
    assert text.index("--dport 9002 -j RETURN") < text.index("-j DNAT")
    assert text.index("--dport 41641 -j RETURN") < text.index("-j DNAT")


def test_snat_source_change_replaces_the_rule():                            # [E14]
    ipt = FakeIptables()
    ipt.apply(RuleSet(egress=(EgressForward("100.99.99.99", "100.64.0.5"),)), 4)
    ipt.apply(RuleSet(egress=(EgressForward("100.99.99.99", "100.64.0.6"),)), 4)
    assert ipt.tables["nat"]["CB-POSTROUTING"] == ["-d 100.99.99.99/32 -j SNAT --to-source 100.64.0.6"]


def test_cli_render_without_root(tmp_path, capsys):
    from netfilter.cli import main
    rules = CASES["O5-v4"][0]
    path = tmp_path / "rules.json"
    path.write_text(rules.to_json())
    assert main(["render", str(path), "--mode", "nftables", "--no-ipv6"]) == 0
    assert capsys.readouterr().out == render_nft(rules, (4,))
    assert main(["render", str(path), "--mode", "iptables", "--variant", "legacy", "--no-ipv6"]) == 0
    assert capsys.readouterr().out == "# IPv4 (iptables-legacy)\n" + render_iptables(rules, 4)
    path.write_text("{]")
    assert main(["render", str(path), "--mode", "nftables", "--no-ipv6"]) == 2
    assert "not valid JSON" in capsys.readouterr().err


# ============================================================================== conntrack oracle (pure)

def test_nat_oracle_decides_staleness_like_the_chains():
    import ipaddress

    from netfilter.plan import NatOracle
    a = ipaddress.ip_address
    r = RuleSet(dnats=(Dnat(TS4, ("10.0.0.1", "10.0.0.2")), Dnat("10.1.2.3", (TS4,))),
                port_maps=(ServicePortMap("s", "udp", 10002, 53, "100.99.99.98", TS4),),
                egress=(EgressForward("100.99.99.99", TS4, EXEMPT),))
    o = NatOracle(r, 4)
    # load-balanced DNAT: any current backend is fine, a removed one is stale
    assert not o.is_stale("udp", a(TS4), 53, a("10.0.0.2"), 53)
    assert o.is_stale("udp", a(TS4), 53, a("10.0.0.3"), 53)
    assert not o.is_stale("udp", a("10.1.2.3"), 53, a(TS4), 53)
    # port map: address AND port must match
    assert not o.is_stale("udp", a("10.7.0.1"), 10002, a("100.99.99.98"), 53)
    assert o.is_stale("udp", a("10.7.0.1"), 10002, a("100.99.99.98"), 5353)
    # egress catch-all: old target is stale, exempt ports are never ours
    assert o.is_stale("udp", a("10.7.0.1"), 5000, a("100.99.99.97"), 5000)
    assert not o.is_stale("udp", a("10.7.0.1"), 5000, a("100.99.99.99"), 5000)
    assert not o.is_stale("udp", a("10.7.0.1"), 41641, a("10.9.9.9"), 41641)
    # flows no current rule captures are left alone (they may be someone else's)
    o6 = NatOracle(RuleSet(dnats=(Dnat(TS6, ("fd00::1",)),)), 6)
    assert not o6.is_stale("udp", a("fd00:10::3"), 53, a("fd00::9"), 53)
    assert o6.is_stale("udp", a(TS6), 53, a("fd00::2"), 53)
    assert not NatOracle(RuleSet(), 4).is_stale("udp", a(TS4), 53, a("10.0.0.3"), 53)


def test_backends_satisfy_the_protocol():
    from netfilter.backend import Backend
    from netfilter.fake import FakeBackend
    from netfilter.iptables import IptablesBackend
    from netfilter.nft import NftBackend
    assert isinstance(NftBackend(ipv6=False), Backend)
    assert isinstance(IptablesBackend(ipv6=False, variant="legacy"), Backend)
    assert isinstance(FakeBackend(ipv6=False), Backend)
    assert NftBackend.name == "nftables" and IptablesBackend.name == "iptables"


def test_nat_oracle_covers_what_the_rules_translate():
    import ipaddress

    from netfilter.model import Dnat, RuleSet, ServicePortMap
    from netfilter.plan import NatOracle

    rules = RuleSet(dnats=(Dnat("100.64.0.5", ("10.0.0.7",)),),
                    port_maps=(ServicePortMap("svc", "udp", 10003, 53, "100.99.0.9", "100.64.0.5"),))
    o = NatOracle(rules, 4)
    assert o.covers("udp", ipaddress.ip_address("100.64.0.5"), 1)
    assert o.covers("udp", ipaddress.ip_address("10.200.0.1"), 10003)
    assert not o.covers("udp", ipaddress.ip_address("10.200.0.1"), 10004)


def test_conntrack_flush_is_skipped_when_a_change_only_adds_translations():
    from netfilter.conntrack import _only_additions
    from netfilter.model import Dnat, RuleSet

    one = RuleSet(dnats=(Dnat("100.64.0.5", ("10.0.0.7",)),))
    two = RuleSet(dnats=(Dnat("100.64.0.5", ("10.0.0.7",)), Dnat("fd7a:115c:a1e0::5", ("fd00::7",))))
    moved = RuleSet(dnats=(Dnat("100.64.0.5", ("10.0.0.8",)),))
    assert _only_additions(one, two)
    assert not _only_additions(two, one)
    assert not _only_additions(one, moved)
