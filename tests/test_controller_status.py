"""controller.status: the state Secret keys the agent writes → device info, key decisions, parent status."""
from __future__ import annotations

import json

from containerboot.kube import secretstate as agent_ss
from controller import status as st
from controller.config import ControllerConfig
from controller.kinds import ingress


def agent_written(*, fqdn="web.tail1.ts.net", ips=("100.64.0.7", "fd7a:115c:a1e0::7"), https=None,
                  capver=142, pod_uid="pod-1") -> dict[str, bytes]:
    """Secret data as the agent writes it (through the agent's own patch functions: one contract)."""
    data: dict[str, bytes] = {}
    for patch in (agent_ss.boot_reset_patch(None, capver=capver, pod_uid=pod_uid, config_authkey=""),
                  agent_ss.device_id_patch("12"), agent_ss.device_endpoints_patch(fqdn, ips)):
        data.update({k: v for k, v in patch.items() if v is not None})
    if https is not None:
        data.update(agent_ss.https_endpoint_patch(https))
    return data


def test_device_info_reads_what_the_agent_writes():
    d = st.device_info("s-0", agent_written(), pod_uid="pod-1")
    assert (d.device_id, d.hostname, d.ips) == ("12", "web.tail1.ts.net", ("100.64.0.7", "fd7a:115c:a1e0::7"))
    assert d.ingress_dns_name == ""               # capver >= 109 and no https_endpoint yet: not ready
    d = st.device_info("s-0", agent_written(https="web.tail1.ts.net."), pod_uid="pod-1")
    assert d.ingress_dns_name == "web.tail1.ts.net"
    assert st.device_info("s-0", agent_written(https="no-https")).ingress_dns_name == ""
    # Written by another Pod than the current one: the capability is unknown, fall back to the device name (upstream).
    assert (
        st.device_info("s-0", agent_written(https="no-https"), pod_uid="pod-2").ingress_dns_name == "web.tail1.ts.net"
    )
    # An old proxy (no capver): fall back to the device name, as upstream.
    old = agent_written()
    del old["tailscale_capver"]
    assert st.device_info("s-0", old).ingress_dns_name == "web.tail1.ts.net"
    assert st.device_info("s-0", None) == st.DeviceInfo("s-0")


def _config(key: str) -> bytes:
    return json.dumps({"AuthKey": key} if key else {}).encode()


def test_authkey_action():
    assert st.authkey_action(None) == "new"
    assert st.authkey_action({"cap-107.hujson": _config("k1")}) == "keep"
    assert st.authkey_action({"cap-107.hujson": _config("")}) == "new"
    registered = {"cap-107.hujson": _config("k1"), "device_id": b"12"}
    assert st.authkey_action(registered) == "omit"
    # The proxy asks for a new key (the agent writes the failed key, possibly "").
    assert st.authkey_action({**registered, **agent_ss.reissue_request_patch("k1")}) == "reissue"
    assert st.authkey_action({"cap-107.hujson": _config(""), **agent_ss.reissue_request_patch("")}) == "reissue"
    # Already answered: the config carries a different key than the one that failed.
    assert st.authkey_action({"cap-107.hujson": _config("k2"), **agent_ss.reissue_request_patch("k1")}) == "keep"
    assert st.config_authkey({"cap-107.hujson": b"not json"}) == ""


def test_readiness_messages_say_what_is_missing():
    none = [st.DeviceInfo("s-0")]
    r = st.readiness("svc", none, replicas=1, ready_replicas=0)
    assert (r.ok, r.reason) == (False, "ProxyPending") and "device not yet registered" in r.message
    r = st.readiness("svc", [st.DeviceInfo("s-0", "12")], replicas=1, ready_replicas=0)
    assert "no Tailscale hostname known yet" in r.message
    r = st.readiness("svc", [st.DeviceInfo("s-0", "12", "web.ts.net")], replicas=1, ready_replicas=0)
    assert r.message == "proxy Pod not ready (0/1 ready)"
    r = st.readiness("svc", [st.DeviceInfo("s-0", "12", "web.ts.net")], replicas=1, ready_replicas=1)
    assert (r.ok, r.reason, r.message) == (True, "ProxyCreated", "proxy ready: web.ts.net")
    r = st.readiness("connector", none, replicas=1, ready_replicas=0, failure="no auth key: control plane unreachable")
    assert (r.ok, r.reason) == (False, "ConnectorCreationFailed")
    assert st.readiness("connector", none, replicas=1, ready_replicas=0, invalid="x").reason == "ConnectorInvalid"


def test_condition_keeps_transition_time_while_status_holds():
    c1 = st.condition("TailscaleProxyReady", False, "ProxyPending", "m1", generation=1, previous=[], now="T1")
    c2 = st.condition("TailscaleProxyReady", False, "ProxyPending", "m2", generation=1, previous=[c1], now="T2")
    assert c2["lastTransitionTime"] == "T1"
    c3 = st.condition("TailscaleProxyReady", True, "ProxyCreated", "ok", generation=1, previous=[c2], now="T3")
    assert c3["lastTransitionTime"] == "T3"
    assert st.with_condition([{"type": "Other"}, c1], c3) == [{"type": "Other"}, c3]


def test_service_load_balancer_families():
    dev = [st.DeviceInfo("s-0", "12", "web.tail1.ts.net", ("100.64.0.7", "fd7a:115c:a1e0::7"))]
    assert st.service_load_balancer(dev, ("IPv4",)) == {
        "ingress": [{"hostname": "web.tail1.ts.net"}, {"ip": "100.64.0.7"}]}
    assert st.service_load_balancer(dev, ("IPv4", "IPv6")) == {
        "ingress": [{"hostname": "web.tail1.ts.net"}, {"ip": "100.64.0.7"}, {"ip": "fd7a:115c:a1e0::7"}]}
    assert st.service_load_balancer([st.DeviceInfo("s-0", "12")], ("IPv4",)) == {}
    assert st.service_families({"spec": {"clusterIPs": ["fd00::1"]}}) == ("IPv6",)


def test_ingress_and_connector_status():
    backend = {"metadata": {"name": "be"}, "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80}]}}
    ing = {"metadata": {"name": "s", "namespace": "a", "uid": "u",
                        "annotations": {"tailscale.com/http-redirect": "true"}},
           "spec": {"ingressClassName": "tailscale",
                    "defaultBackend": {"service": {"name": "be", "port": {"number": 80}}}}}
    spec = ingress.decide(ing, ControllerConfig(), {"be": backend}).spec
    dev = [st.DeviceInfo("s-0", "12", "s.tail1.ts.net", ("100.64.0.7",), "s.tail1.ts.net")]
    assert st.ingress_load_balancer(dev, spec) == {"ingress": [{"hostname": "s.tail1.ts.net", "ports": [
        {"port": 443, "protocol": "TCP"}, {"port": 80, "protocol": "TCP"}]}]}
    from controller.kinds import connector
    # Upstream's HTTPS status never comes from a proxy that says no-https.
    nohttps = st.device_info("s-0", agent_written(fqdn="s.tail1.ts.net", https="no-https"))
    assert st.ingress_load_balancer([nohttps], spec) == {}
    cspec = connector.decide({"metadata": {"name": "c", "uid": "u"},
                              "spec": {"subnetRouter": {"advertiseRoutes": ["10.0.0.0/8", "fd00::/64"]}}},
                             ControllerConfig()).spec
    assert st.connector_status(cspec, dev) == {
        "subnetRoutes": "10.0.0.0/8,fd00::/64", "isExitNode": False, "isAppConnector": False,
        "devices": [{"hostname": "s.tail1.ts.net", "tailnetIPs": ["100.64.0.7"]}],
        "hostname": "s.tail1.ts.net", "tailnetIPs": ["100.64.0.7"]}


def test_ingress_http_status_is_the_device_name_on_port_80_once_applied():
    backend = {"metadata": {"name": "be"}, "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80}]}}
    ing = {"metadata": {"name": "s", "namespace": "a", "uid": "u"},
           "spec": {"ingressClassName": "tailscale",
                    "defaultBackend": {"service": {"name": "be", "port": {"number": 80}}}}}
    cfg = ControllerConfig(provider="headscale", login_server="http://hs:8080")
    spec = ingress.decide(ing, cfg, {"be": backend}, "s.tail.example.").spec
    registered = st.device_info("s-0", agent_written(fqdn="s.tail.example"))
    assert not registered.serve_applied
    assert st.ingress_load_balancer([registered], spec) == {}                  # config not applied yet
    applied = st.device_info("s-0", agent_written(fqdn="s.tail.example", https="no-https"))
    assert applied.serve_applied and applied.ingress_dns_name == ""
    assert st.ingress_load_balancer([applied], spec) == {
        "ingress": [{"hostname": "s.tail.example", "ports": [{"port": 80, "protocol": "TCP"}]}]}
    # The config names another device name (the proxy was renamed since): no status until it is re-rendered.
    renamed = st.device_info("s-0", agent_written(fqdn="s-1.tail.example", https="no-https"))
    assert st.ingress_load_balancer([renamed], spec) == {}
    # Nothing known yet (no suffix, no device): an empty config and no status.
    spec0 = ingress.decide(ing, cfg, {"be": backend}).spec
    assert spec0.serve_config == {} and st.ingress_load_balancer([applied], spec0) == {}
