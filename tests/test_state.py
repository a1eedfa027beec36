"""Node state from IPN bus notifications, and tailnet FQDN resolution."""
from __future__ import annotations

import ipaddress

import pytest

from containerboot.state import (
    NodeState,
    ResolveError,
    apply_notify,
    carries_netmap,
    notify_backend_state,
    resolve_tailnet_fqdn,
    via_4via6,
    with_dns_config,
)

ip = ipaddress.ip_address


def peer_status(node_id, name, ips, allowed=None):
    d = {"ID": f"n{node_id}", "NodeID": node_id, "DNSName": name, "PublicKey": f"nodekey:{node_id:02x}",
         "TailscaleIPs": ips}
    if allowed is not None:
        d["AllowedIPs"] = allowed
    return d


def tailcfg_node(node_id, name, addrs, allowed=None):
    return {"ID": node_id, "StableID": f"n{node_id}", "Name": name, "Key": f"nodekey:{node_id:02x}",
            "Addresses": addrs, "AllowedIPs": allowed if allowed is not None else addrs}


INITIAL = {"InitialStatus": {
    "BackendState": "Running",
    "Self": peer_status(1, "proxy.tailnet.test.", ["100.64.0.1", "fd7a:115c:a1e0::1"]),
    "Peer": {"nodekey:02": peer_status(2, "client.tailnet.test.", ["100.64.0.2", "fd7a:115c:a1e0::2"],
                                       ["100.64.0.2/32", "fd7a:115c:a1e0::2/128", "10.1.0.0/16"])},
    "CertDomains": ["proxy.tailnet.test"],
    "ExtraRecords": [{"Name": "web.tailnet.test.", "Value": "100.100.0.9"}],
}}


def test_initial_status_builds_self_and_peers():
    st = apply_notify(NodeState(), INITIAL, now=10.0)
    assert st.backend_state == "Running"
    assert st.tailnet_ips == (ip("100.64.0.1"), ip("fd7a:115c:a1e0::1"))
    assert st.self_node.stable_id == "n1" and st.self_node.id == 1
    assert st.cert_domain == "proxy.tailnet.test"
    assert [p.name for p in st.peers.values()] == ["client.tailnet.test."]
    assert st.netmap_seen_at == 10.0


def test_state_comes_from_State_int_or_initial_status():
    assert notify_backend_state({"State": 6}) == "Running"
    assert notify_backend_state({"State": 2}) == "NeedsLogin"
    assert notify_backend_state({"InitialStatus": {"BackendState": "Starting"}}) == "Starting"
    assert notify_backend_state({"InitialStatus": {"BackendState": "Bogus"}}) is None
    assert notify_backend_state({"Health": {}}) is None


def test_self_change_replaces_self_and_peers_changed_upserts():
    st = apply_notify(NodeState(), INITIAL, 1)
    st = apply_notify(st, {"SelfChange": tailcfg_node(1, "proxy.tailnet.test.", ["100.64.0.7/32"])}, 2)
    assert st.tailnet_ips == (ip("100.64.0.7"),)
    st = apply_notify(st, {"PeersChanged": [tailcfg_node(2, "client.tailnet.test.", ["100.64.0.22/32"])]}, 3)
    assert resolve_tailnet_fqdn(st, "client.tailnet.test") == (ip("100.64.0.22"),)
    st = apply_notify(st, {"PeersChanged": [tailcfg_node(3, "other.tailnet.test.", ["100.64.0.3/32"])]}, 4)
    assert len(st.peers) == 2


def test_peers_removed_and_back_again():
    """A, nothing, A: the level-triggered state follows every step."""
    st = apply_notify(NodeState(), INITIAL, 1)
    assert resolve_tailnet_fqdn(st, "client.tailnet.test.")
    st = apply_notify(st, {"PeersRemoved": [2]}, 2)
    with pytest.raises(ResolveError, match="could not find"):
        resolve_tailnet_fqdn(st, "client.tailnet.test.")
    st = apply_notify(st, {"PeersChanged": [tailcfg_node(2, "client.tailnet.test.", ["100.64.0.9/32"])]}, 3)
    assert resolve_tailnet_fqdn(st, "CLIENT.tailnet.test") == (ip("100.64.0.9"),)


def test_service_vip_needs_a_peer_that_routes_it_and_is_deduplicated():
    st = apply_notify(NodeState(), INITIAL, 1)
    with pytest.raises(ResolveError):
        resolve_tailnet_fqdn(st, "web.tailnet.test")  # no peer has 100.100.0.9/32 in AllowedIPs
    both = [tailcfg_node(n, f"svc{n}.tailnet.test.", [f"100.64.0.{n}/32"], [f"100.64.0.{n}/32", "100.100.0.9/32"])
            for n in (5, 6)]
    st = apply_notify(st, {"PeersChanged": both}, 2)
    assert resolve_tailnet_fqdn(st, "web.tailnet.test.") == (ip("100.100.0.9"),)


def test_4via6_names():
    assert via_4via6("10-1-2-3-via-7") == ip("fd7a:115c:a1e0:b1a:0:7:a01:203")
    assert via_4via6("10-1-2-3-via-0x10.foo.ts.net") == ip("fd7a:115c:a1e0:b1a:0:10:a01:203")
    assert via_4via6("10-1-2-3-via-7.example.com") is None
    assert via_4via6("plainname") is None
    st = apply_notify(NodeState(), INITIAL, 1)
    with pytest.raises(ResolveError, match="no peer advertises"):
        resolve_tailnet_fqdn(st, "10-1-2-3-via-7")
    st = apply_notify(st, {"PeersChanged": [tailcfg_node(4, "router.tailnet.test.", ["100.64.0.4/32"],
                                                         ["100.64.0.4/32", "fd7a:115c:a1e0:b1a::/64"])]}, 2)
    assert resolve_tailnet_fqdn(st, "10-1-2-3-via-7") == (ip("fd7a:115c:a1e0:b1a:0:7:a01:203"),)


def test_health_login_warning_and_dns_config_refresh():
    st = apply_notify(NodeState(), {"Health": {"Warnings": {"login-state": {"Severity": "high"}}}}, 1)
    assert st.login_failed
    st = apply_notify(st, {"Health": {"Warnings": None}}, 2)
    assert not st.login_failed
    st = with_dns_config(st, {"CertDomains": ["x.tailnet.test"], "ExtraRecords": [{"Name": "a.", "Value": "1.2.3.4"}]})
    assert st.cert_domain == "x.tailnet.test" and st.extra_records[0].value == "1.2.3.4"


def test_carries_netmap():
    assert carries_netmap(INITIAL)
    assert carries_netmap({"PeersRemoved": [3]})
    assert not carries_netmap({"State": 6})
    assert not carries_netmap({"Health": {"Warnings": None}})


def test_unknown_fields_are_ignored():
    n = dict(INITIAL, SomethingNew={"x": 1}, Version="1.999")
    assert apply_notify(NodeState(), n, 1).tailnet_ips


def test_a_new_netmap_replaces_the_peer_set():
    """tailscaled sends SelfChange with the full PeersChanged list when it installs a new netmap; a peer
    missing from it is gone (headscale sends a full netmap after a node is deleted, no PeersRemoved)."""
    st = apply_notify(NodeState(), INITIAL, 1)
    me = tailcfg_node(1, "proxy.tailnet.test.", ["100.64.0.1/32"])
    st2 = apply_notify(st, {"SelfChange": me, "PeersChanged": []}, 2)
    with pytest.raises(ResolveError):
        resolve_tailnet_fqdn(st2, "client.tailnet.test")
    st3 = apply_notify(st, {"SelfChange": me}, 2)  # no peer list: peers are kept
    assert resolve_tailnet_fqdn(st3, "client.tailnet.test")


def test_health_warnings_are_kept_for_the_status():
    st = apply_notify(NodeState(), {"Health": {"Warnings": {
        "not-in-map-poll": {"Severity": "medium", "Text": "Unable to connect to the coordination server"},
        "login-state": {"Text": "Logged out."}}}}, 1)
    assert st.health_warnings == (("login-state", "Logged out."),
                                  ("not-in-map-poll", "Unable to connect to the coordination server"))
    assert apply_notify(st, {"Health": {"Warnings": None}}, 2).health_warnings == ()
    assert apply_notify(st, {"Health": {"Warnings": ["junk"]}}, 3).health_warnings == ()
    assert apply_notify(st, {"NetMap": None}, 4).health_warnings == st.health_warnings  # no Health: kept
