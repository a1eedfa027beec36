"""ProxyGroup egress/ingress services: config parsing, desired rules and the Secret status, without root."""
from __future__ import annotations

import ipaddress
import json

import pytest

from containerboot import proxyservices as ps
from containerboot import settings as settings_mod
from containerboot.desired import compute
from containerboot.state import Node, NodeState

ip = ipaddress.ip_address
OWN = (ip("100.64.0.5"), ip("fd7a:115c:a1e0::5"))


def mk(stable_id: str, name: str, *ips: str, id_: int = 1) -> Node:
    nets = tuple(ipaddress.ip_network(a) for a in ips)
    return Node(id=id_, stable_id=stable_id, name=name, key=f"nodekey:{stable_id}", addresses=nets, allowed_ips=nets)


def node(*peers: Node, own=OWN) -> NodeState:
    me = mk("nSelf", "proxy.tailnet.test.", *(str(a) for a in own))
    return NodeState(backend_state="Running", self_node=me, peers={p.stable_id: p for p in peers})


DB = mk("nDB", "db.tailnet.test.", "100.64.0.9", "fd7a:115c:a1e0::9", id_=2)


def egress_doc(**services) -> str:
    return json.dumps(services)


def svc(ip_="", fqdn="", ports=(("TCP", 10001, 5432),), hep=""):
    d = {"tailnetTarget": {"ip": ip_, "fqdn": fqdn},
         "ports": [{"protocol": p, "matchPort": m, "targetPort": t} for p, m, t in ports]}
    if hep:
        d["healthCheckEndpoint"] = hep
    return d


# ------------------------------------------------------------------------------------------------ parsing

def test_operator_example_parses():
    cfg = ps.parse_egress_services(json.dumps({"default-mysvc": {
        "healthCheckEndpoint": "http://ts-mysvc-8k2lp.tailscale.svc.cluster.local:9002/healthz",
        "tailnetTarget": {"ip": "", "fqdn": "db.tailnet-xyz.ts.net"},
        "ports": [{"protocol": "TCP", "matchPort": 10001, "targetPort": 5432}]}}))
    assert cfg.problems == ()
    (s,) = cfg.services
    assert s.name == "default-mysvc" and s.target_fqdn == "db.tailnet-xyz.ts.net" and s.target_ip == ""
    assert s.ports == (ps.PortMap("TCP", 10001, 5432),)
    assert s.health_check_endpoint.endswith(":9002/healthz")


@pytest.mark.parametrize("text", [None, "", "  \n", "null", "{}"])
def test_missing_or_empty_file_means_no_services(text):
    assert ps.parse_egress_services(text).services == ()
    assert ps.parse_ingress_config(text).services == ()


@pytest.mark.parametrize("text, fragment", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_unusable_file_raises(text, fragment):
    with pytest.raises(ps.ConfigError, match=fragment):
        ps.parse_egress_services(text)
    with pytest.raises(ps.ConfigError):
        ps.parse_ingress_config(text)


@pytest.mark.parametrize("raw, fragment", [
    (svc(), "exactly one of tailnetTarget.ip and tailnetTarget.fqdn"),
    (svc(ip_="100.64.0.9", fqdn="db.ts.net"), "exactly one"),
    (svc(ip_="banana"), "tailnetTarget.ip 'banana' is not an IP address"),
    (svc(ip_="0.0.0.0"), "unspecified"),
    (svc(ip_="100.64.0.9", ports=(("SCTP", 1, 2),)), 'ports[0].protocol must be TCP or UDP, not "SCTP"'),
    (svc(ip_="100.64.0.9", ports=(("TCP", 0, 2),)), "ports[0].matchPort must be a port number 1-65535, not 0"),
    (svc(ip_="100.64.0.9", ports=(("TCP", 1, 70000),)), "ports[0].targetPort"),
    ({"tailnetTarget": {"ip": "100.64.0.9"}, "ports": {"a": 1}}, "ports must be a list"),
    ("nope", "expected an object"),
])
def test_a_bad_service_is_skipped_with_a_message_naming_it_and_the_field(raw, fragment):
    cfg = ps.parse_egress_services(egress_doc(bad=raw, good=svc(ip_="100.64.0.9", ports=(("UDP", 10002, 53),))))
    assert [s.name for s in cfg.services] == ["good"]
    ((name, problem),) = cfg.problems
    assert name == "bad" and "service 'bad'" in problem and fragment in problem


def test_two_services_on_one_match_port_the_second_by_name_is_refused():
    cfg = ps.parse_egress_services(egress_doc(
        **{"z-svc": svc(ip_="100.64.0.8"), "a-svc": svc(ip_="100.64.0.9")}))
    assert [s.name for s in cfg.services] == ["a-svc"]
    assert "TCP port 10001 is already mapped by service 'a-svc'" in cfg.problems[0][1]
    # the same port number in another protocol is fine
    cfg = ps.parse_egress_services(egress_doc(
        a=svc(ip_="100.64.0.9"), b=svc(ip_="100.64.0.8", ports=(("UDP", 10001, 53),))))
    assert len(cfg.services) == 2 and cfg.problems == ()


def test_protocol_is_kept_as_written_and_exact_duplicates_merge():
    cfg = ps.parse_egress_services(egress_doc(a=svc(ip_="100.64.0.9",
                                                    ports=(("tcp", 1, 2), ("tcp", 1, 2), ("TCP", 1, 2)))))
    assert cfg.services[0].ports == (ps.PortMap("tcp", 1, 2), ps.PortMap("TCP", 1, 2))
    out = ps.compute_services(ps.ServicesInput(egress=cfg), node(DB))
    # one rule: "tcp" and "TCP" are the same match
    assert [(p.protocol, p.match_port, p.target_port) for p in out.port_maps] == [("tcp", 1, 2)]
    assert json.loads(out.egress_status)["services"]["a"]["ports"] == [
        {"protocol": "tcp", "matchPort": 1, "targetPort": 2}, {"protocol": "TCP", "matchPort": 1, "targetPort": 2}]


def test_one_match_port_to_two_target_ports_is_refused():
    cfg = ps.parse_egress_services(egress_doc(a=svc(ip_="100.64.0.9", ports=(("tcp", 1, 2), ("TCP", 1, 3)))))
    assert cfg.services == () and "TCP port 1 is mapped twice" in cfg.problems[0][1]


def test_status_echoes_the_protocol_exactly_as_configured():
    """The operator compares the record with what it wrote: "tcp" must stay "tcp", "Udp" stay "Udp"."""
    out = ps.compute_services(egress_input(a=svc(ip_="100.64.0.9", ports=(("tcp", 10001, 5432),
                                                                          ("Udp", 10002, 53)))), node(DB))
    assert json.loads(out.egress_status)["services"]["a"]["ports"] == [
        {"protocol": "tcp", "matchPort": 10001, "targetPort": 5432},
        {"protocol": "Udp", "matchPort": 10002, "targetPort": 53}]
    assert sorted((p.protocol, p.match_port) for p in out.port_maps) == [("tcp", 10001), ("udp", 10002)]


def test_a_service_without_ports_is_recorded_with_its_targets_and_follows_them():
    """Upstream records `"ports": []` with the target's IPs; the operator waits for that record."""
    inp = egress_input(db=svc(fqdn="db.tailnet.test", ports=()))
    moved = mk("nDB", "db.tailnet.test.", "100.64.0.19", id_=2)
    seen = []
    for n in (node(DB), node(moved), node()):
        out = ps.compute_services(inp, n, pod_ipv4=ip("10.1.2.3"))
        assert out.port_maps == ()
        seen.append(json.loads(out.egress_status)["services"])
    assert seen[0] == {"db": {"ports": [], "tailnetTargetIPs": ["100.64.0.9", "fd7a:115c:a1e0::9"],
                              "tailnetTarget": {"ip": "", "fqdn": "db.tailnet.test"}}}
    assert seen[1]["db"]["tailnetTargetIPs"] == ["100.64.0.19"] and seen[1]["db"]["ports"] == []
    assert seen[2] is None      # the target is gone: not recorded (a deliberate difference, docs/agent.md)
    # a missing "ports" field reads like an empty list
    raw = ps.parse_egress_services(json.dumps({"x": {"tailnetTarget": {"ip": "100.64.0.9"}}}))
    out = ps.compute_services(ps.ServicesInput(egress=raw), node(DB))
    assert json.loads(out.egress_status)["services"]["x"]["ports"] == []


def test_userspace_services_start_but_get_no_rules_and_no_record():
    out = ps.compute_services(egress_input(db=svc(ip_="100.64.0.9")), node(DB), no_data_path="no kernel path")
    assert out.port_maps == () and json.loads(out.egress_status)["services"] is None
    (r,) = out.results
    assert not r.installed and r.error == "no kernel path"


@pytest.mark.parametrize("text, value", [(None, 0), ("", 0), ("4\n", 4), ("-3", 0)])
def test_hep_pings(text, value):
    assert ps.parse_hep_pings(text) == value


def test_hep_pings_garbage():
    with pytest.raises(ps.ConfigError, match="hep-pings must be an integer"):
        ps.parse_hep_pings("four")


def test_ingress_config_parses_and_drops_zero_address_families():
    cfg = ps.parse_ingress_config(json.dumps({"svc:web": {
        "IPv4Mapping": {"TailscaleServiceIP": "100.100.1.1", "ClusterIP": "10.96.0.10"},
        "IPv6Mapping": {"TailscaleServiceIP": "::", "ClusterIP": "::"}}}))
    (s,) = cfg.services
    assert s.v4 == ps.IngressMapping(ip("100.100.1.1"), ip("10.96.0.10")) and s.v6 is None


@pytest.mark.parametrize("mapping, fragment", [
    ({"IPv4Mapping": {"TailscaleServiceIP": "fd00::1", "ClusterIP": "10.96.0.10"}},
     "IPv4Mapping.TailscaleServiceIP fd00::1 is not an IPv4 address"),
    ({"IPv6Mapping": {"TailscaleServiceIP": "fd00::1", "ClusterIP": "x"}}, 'IPv6Mapping.ClusterIP "x"'),
    ({"IPv4Mapping": "100.100.1.1"}, "must be an object"),
])
def test_ingress_bad_mapping_names_service_and_field(mapping, fragment):
    cfg = ps.parse_ingress_config(json.dumps({"svc:bad": mapping}))
    assert cfg.services == () and "svc:bad" in cfg.problems[0][1] and fragment in cfg.problems[0][1]


def test_ingress_duplicate_vip_is_refused_for_the_second_service():
    m = {"IPv4Mapping": {"TailscaleServiceIP": "100.100.1.1", "ClusterIP": "10.96.0.10"}}
    cfg = ps.parse_ingress_config(json.dumps({"svc:a": m, "svc:b": m}))
    assert [s.name for s in cfg.services] == ["svc:a"]
    assert "already mapped by service 'svc:a'" in cfg.problems[0][1]


# ------------------------------------------------------------------------------------------------ compute

def egress_input(**services) -> ps.ServicesInput:
    return ps.ServicesInput(egress=ps.parse_egress_services(egress_doc(**services)))


def test_egress_by_ip_yields_port_maps_snat_and_status():
    out = ps.compute_services(egress_input(**{"default-mysvc": svc(ip_="100.64.0.9")}), node(DB),
                              pod_ipv4=ip("10.1.2.3"))
    (pm,) = out.port_maps
    assert (pm.service, pm.protocol, pm.match_port, pm.target_port, str(pm.target), str(pm.snat_source)) == (
        "default-mysvc", "tcp", 10001, 5432, "100.64.0.9", "100.64.0.5")
    assert json.loads(out.egress_status) == {"podIPv4": "10.1.2.3", "services": {"default-mysvc": {
        "ports": [{"protocol": "TCP", "matchPort": 10001, "targetPort": 5432}],
        "tailnetTargetIPs": ["100.64.0.9"], "tailnetTarget": {"ip": "100.64.0.9", "fqdn": ""}}}}
    assert out.families == {4}


def test_egress_by_fqdn_uses_both_families_and_records_them():
    out = ps.compute_services(egress_input(db=svc(fqdn="db.tailnet.test")), node(DB),
                              pod_ipv4=ip("10.1.2.3"), pod_ipv6=ip("fd00:10::3"))
    assert sorted(str(p.target) for p in out.port_maps) == ["100.64.0.9", "fd7a:115c:a1e0::9"]
    doc = json.loads(out.egress_status)
    assert doc["podIPv6"] == "fd00:10::3"
    assert doc["services"]["db"]["tailnetTargetIPs"] == ["100.64.0.9", "fd7a:115c:a1e0::9"]
    assert doc["services"]["db"]["tailnetTarget"] == {"ip": "", "fqdn": "db.tailnet.test"}


def test_egress_without_ipv6_nat_keeps_ipv4_only():
    out = ps.compute_services(egress_input(db=svc(fqdn="db.tailnet.test")), node(DB), families=(4,))
    assert [str(p.target) for p in out.port_maps] == ["100.64.0.9"]
    assert json.loads(out.egress_status)["services"]["db"]["tailnetTargetIPs"] == ["100.64.0.9"]


def test_an_unresolvable_service_is_not_recorded_and_the_others_still_work():
    out = ps.compute_services(egress_input(db=svc(fqdn="db.tailnet.test"),
                                           gone=svc(fqdn="gone.tailnet.test", ports=(("TCP", 10002, 80),))),
                              node(DB))
    assert {p.service for p in out.port_maps} == {"db"}
    assert set(json.loads(out.egress_status)["services"]) == {"db"}
    gone = next(r for r in out.results if r.name == "gone")
    assert not gone.installed and "could not find" in gone.error


def test_sequence_target_present_gone_present():
    inp = egress_input(db=svc(fqdn="db.tailnet.test"))
    states = [node(DB), node(), node(DB)]
    seen = [json.loads(ps.compute_services(inp, n).egress_status)["services"] for n in states]
    assert seen[0] == seen[2] and seen[0] is not None and seen[1] is None


def test_no_services_configured_writes_null_services():
    out = ps.compute_services(ps.ServicesInput(egress=ps.EgressConfig()), node(), pod_ipv4=ip("10.1.2.3"))
    assert json.loads(out.egress_status) == {"podIPv4": "10.1.2.3", "services": None}
    assert out.port_maps == ()


def test_before_the_node_has_addresses_nothing_is_installed():
    out = ps.compute_services(egress_input(db=svc(ip_="100.64.0.9")), NodeState())
    assert out.port_maps == () and "waiting for the node's tailnet addresses" in out.results[0].error


def test_ingress_services_dnat_and_status():
    inp = ps.ServicesInput(ingress=ps.parse_ingress_config(json.dumps({"svc:web": {
        "IPv4Mapping": {"TailscaleServiceIP": "100.100.1.1", "ClusterIP": "10.96.0.10"},
        "IPv6Mapping": {"TailscaleServiceIP": "fd7a:115c:a1e0::1", "ClusterIP": "fd00:96::10"}}})))
    out = ps.compute_services(inp, node(), pod_ipv4=ip("10.1.2.3"))
    assert [(d.service, str(d.vip), str(d.cluster_ip)) for d in out.service_dnats] == [
        ("svc:web", "100.100.1.1", "10.96.0.10"), ("svc:web", "fd7a:115c:a1e0::1", "fd00:96::10")]
    assert json.loads(out.ingress_status) == {"configs": {"svc:web": {
        "IPv4Mapping": {"TailscaleServiceIP": "100.100.1.1", "ClusterIP": "10.96.0.10"},
        "IPv6Mapping": {"TailscaleServiceIP": "fd7a:115c:a1e0::1", "ClusterIP": "fd00:96::10"}}},
        "podIPv4": "10.1.2.3"}
    # without IPv6 NAT the service is not half-installed and not recorded
    out = ps.compute_services(inp, node(), families=(4,))
    assert out.service_dnats == () and json.loads(out.ingress_status) == {}
    assert "IPv6 NAT is not available" in out.results[0].error


def test_ingress_vip_already_forwarded_is_refused():
    inp = ps.ServicesInput(ingress=ps.parse_ingress_config(json.dumps({"svc:web": {
        "IPv4Mapping": {"TailscaleServiceIP": "100.64.0.5", "ClusterIP": "10.96.0.10"}}})))
    out = ps.compute_services(inp, node(), reserved=frozenset({ip("100.64.0.5")}))
    assert out.service_dnats == () and "already forwarded" in out.results[0].error


# ------------------------------------------------------------------------------------------------ desired.compute

def settings(**env):
    base = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443", "TS_KUBE_SECRET": "s",
            "POD_IPS": "10.1.2.3", "TS_USERSPACE": "false"}
    return settings_mod.load({**base, **env})


def test_desired_carries_services_rules_targets_and_forwarding():
    s = settings(TS_EGRESS_PROXIES_CONFIG_PATH="/etc/proxies")
    want = compute(s, node(DB), services=egress_input(db=svc(fqdn="db.tailnet.test"),
                                                     gone=svc(fqdn="gone.tailnet.test", ports=(("UDP", 1, 2),))))
    assert len(want.rules.port_maps) == 2 and want.rules.clamp_mss
    assert want.forwarding == (True, True)
    by_name = {t.name: t for t in want.targets}
    assert by_name["db"].has_rules and not by_name["db"].gates_readiness
    assert by_name["gone"].error and not by_name["gone"].has_rules
    assert json.loads(want.services.egress_status)["podIPv4"] == "10.1.2.3"


def test_a_broken_file_is_visible_as_a_target_error():
    s = settings(TS_EGRESS_PROXIES_CONFIG_PATH="/etc/proxies")
    inp = ps.ServicesInput(egress=ps.EgressConfig(), egress_error="egress-services is not valid JSON: x")
    want = compute(s, node(), services=inp)
    assert any("not valid JSON" in t.error and "last good" in t.error for t in want.targets)


def test_without_ipv6_nat_an_ipv6_dest_ip_is_an_error_not_a_failed_apply():
    s = settings(TS_DEST_IP="10.0.0.7,fd00::7")
    want = compute(s, node(), families=(4,))
    assert [str(d.original_dst) for d in want.rules.dnats] == ["100.64.0.5"]
    (t,) = want.targets
    assert t.has_rules and "IPv6 NAT is not available" in t.error


def test_without_ipv6_nat_an_fqdn_egress_keeps_ipv4():
    s = settings(TS_TAILNET_TARGET_FQDN="db.tailnet.test")
    want = compute(s, node(DB), families=(4,))
    assert [str(e.target) for e in want.rules.egress] == ["100.64.0.9"]
    six = compute(s, node(mk("n6", "db.tailnet.test.", "fd7a:115c:a1e0::9", id_=3)),
                  families=(4,))
    assert six.rules.egress == () and "IPv6 NAT is not available" in six.targets[0].error
