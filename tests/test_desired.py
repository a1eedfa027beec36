"""The desired data path as a pure function of settings, node state and DNS answers."""
from __future__ import annotations

import ipaddress

from containerboot.desired import DNSAnswer, compute, tailscaled_port
from containerboot.settings import load
from containerboot.state import NodeState, apply_notify
from netfilter.model import Dnat, EgressForward, PortMatch

ip = ipaddress.ip_address
KERNEL = {"TS_USERSPACE": "false"}


def node(*ips, peers=()):
    init = {"BackendState": "Running",
            "Self": {"ID": "n1", "NodeID": 1, "DNSName": "proxy.t.test.", "TailscaleIPs": list(ips)},
            "Peer": {f"k{i}": p for i, p in enumerate(peers)}}
    return apply_notify(NodeState(), {"InitialStatus": init}, 1.0)


def peer(node_id, name, ips):
    return {"ID": f"n{node_id}", "NodeID": node_id, "DNSName": name, "TailscaleIPs": ips, "AllowedIPs": [
        f"{i}/{128 if ':' in i else 32}" for i in ips]}


def test_ingress_v4_and_v6_pick_the_same_family():
    st = node("100.64.0.5", "fd7a:115c:a1e0::5")
    d = compute(load(dict(KERNEL, TS_DEST_IP="10.98.0.2")), st)
    assert d.rules.dnats == (Dnat(original_dst=ip("100.64.0.5"), targets=(ip("10.98.0.2"),)),)
    assert d.rules.clamp_mss
    d6 = compute(load(dict(KERNEL, TS_DEST_IP="fd98::2")), st)
    assert d6.rules.dnats == (Dnat(original_dst=ip("fd7a:115c:a1e0::5"), targets=(ip("fd98::2"),)),)
    assert d6.forwarding == (False, True)


def test_no_rules_before_the_node_has_addresses():
    d = compute(load(dict(KERNEL, TS_DEST_IP="10.98.0.2")), NodeState())
    assert d.rules.dnats == () and not d.rules.clamp_mss
    assert d.targets[0].resolved == (ip("10.98.0.2"),)


def test_dns_name_ingress_balances_over_every_answer_of_each_family():
    st = node("100.64.0.5", "fd7a:115c:a1e0::5")
    ans = DNSAnswer(addresses=(ip("10.0.0.1"), ip("10.0.0.2"), ip("fd00::1")))
    d = compute(load(dict(KERNEL, TS_EXPERIMENTAL_DEST_DNS_NAME="backend.example")), st, ans)
    assert set(d.rules.dnats) == {Dnat(original_dst=ip("100.64.0.5"), targets=(ip("10.0.0.1"), ip("10.0.0.2"))),
                                  Dnat(original_dst=ip("fd7a:115c:a1e0::5"), targets=(ip("fd00::1"),))}
    assert d.forwarding == (True, True)
    failed = compute(load(dict(KERNEL, TS_EXPERIMENTAL_DEST_DNS_NAME="backend.example")), st,
                     DNSAnswer(error="NXDOMAIN"))
    assert failed.rules.dnats == () and failed.targets[0].error == "NXDOMAIN"
    # a failure after a success keeps the last good backends (and reports the error)
    kept = compute(load(dict(KERNEL, TS_EXPERIMENTAL_DEST_DNS_NAME="backend.example")), st,
                   DNSAnswer(addresses=(ip("10.0.0.1"),), error="timeout"))
    assert kept.rules.dnats and kept.targets[0].error == "timeout"


def test_egress_ip_exempts_tailscaled_port_and_local_http_port():
    st = node("100.64.0.5", "fd7a:115c:a1e0::5")
    env = dict(KERNEL, TS_TAILNET_TARGET_IP="100.64.0.9", TS_ENABLE_HEALTH_CHECK="true",
               TS_LOCAL_ADDR_PORT="[::]:9002", TS_TAILSCALED_EXTRA_ARGS="--port=41000")
    d = compute(load(env), st)
    assert d.rules.egress == (EgressForward(target=ip("100.64.0.9"), snat_source=ip("100.64.0.5"),
                                            exempt=(PortMatch("udp", 41000), PortMatch("tcp", 9002))),)


def test_egress_fqdn_follows_the_peer_through_a_nothing_a_and_a_move():
    s = load(dict(KERNEL, TS_TAILNET_TARGET_FQDN="client.t.test"))
    base = node(
        "100.64.0.5", "fd7a:115c:a1e0::5", peers=[peer(2, "client.t.test.", ["100.64.0.2", "fd7a:115c:a1e0::2"])]
    )
    d1 = compute(s, base)
    assert {e.target for e in d1.rules.egress} == {ip("100.64.0.2"), ip("fd7a:115c:a1e0::2")}
    gone = apply_notify(base, {"PeersRemoved": [2]}, 2.0)
    d2 = compute(s, gone)
    assert d2.rules.egress == () and "could not find" in d2.targets[0].error
    back = apply_notify(gone, {"PeersChanged": [{"ID": 2, "StableID": "n2", "Name": "client.t.test.",
                                                 "Addresses": ["100.64.0.77/32"]}]}, 3.0)
    d3 = compute(s, back)
    assert [e.target for e in d3.rules.egress] == [ip("100.64.0.77")]
    assert d3.targets[0].error == ""


def test_tailscaled_port_default_and_override():
    assert tailscaled_port(load({})) == 41641
    assert tailscaled_port(load({"TS_TAILSCALED_EXTRA_ARGS": "--port 5000"})) == 5000


def test_dual_stack_dest_ip_maps_each_family_to_its_own_target():
    st = node("100.64.0.5", "fd7a:115c:a1e0::5")
    d = compute(load(dict(KERNEL, TS_DEST_IP="10.98.0.2,fd98::2")), st)
    assert set(d.rules.dnats) == {Dnat(original_dst=ip("100.64.0.5"), targets=(ip("10.98.0.2"),)),
                                  Dnat(original_dst=ip("fd7a:115c:a1e0::5"), targets=(ip("fd98::2"),))}
    assert d.forwarding == (True, True)
    assert d.targets[0].has_rules and d.targets[0].value == "10.98.0.2,fd98::2"
