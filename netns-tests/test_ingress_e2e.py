"""L3 ingress end to end: real headscale, real tailscaled, our agent, real packets through real kernel rules.

The client node (a plain tailscaled) reaches the backend's HTTP server through the proxy's tailnet address,
for both firewall backends and both address families; the agent's rules are gone after SIGTERM and nothing is
left running in the proxy namespace.
"""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(240)]

MODES = ("nftables", "iptables")


def own_rules(lab, mode: str) -> str:
    """What of the agent's own firewall objects is in the proxy namespace right now."""
    if mode == "nftables":
        out = lab.exec("proxy", ["nft", "-j", "list", "tables"], check=True).stdout
        tables = [t["table"] for t in json.loads(out)["nftables"] if "table" in t]
        return " ".join(f"{t['family']} {t['name']}" for t in tables if t["name"].startswith("containerboot"))
    dump = ""
    for tool in ("iptables-save", "ip6tables-save"):
        dump += lab.exec("proxy", [tool], check=True).stdout
    return "\n".join(line for line in dump.splitlines() if "CB-" in line)


@pytest.mark.parametrize("mode", MODES)
def test_ingress_ipv4_and_ipv6_then_clean_shutdown(lab, lab_backend, start_agent, mode):
    backend_v4, backend_v6 = lab.backend_ipv4, lab.backend_ipv6
    agent = start_agent({"TS_DEST_IP": backend_v4, "TS_DEBUG_FIREWALL_MODE": mode})
    agent.wait_for_log("Startup complete, waiting for shutdown signal", timeout=90)
    proxy_v4, proxy_v6 = agent.tailnet_ips()
    body = lab.wait_curl("client", lab.url(proxy_v4, 8080, "/?ingress4"), lab_backend.marker, timeout=45)
    assert lab_backend.marker in body
    assert own_rules(lab, mode), "no rules of the agent's own are installed"
    assert agent.stop() == 0
    assert lab.wait_ns_empty("proxy", 15) == [], "processes left in the proxy namespace after SIGTERM"
    assert own_rules(lab, mode) == "", "the agent's rules are left behind after shutdown"
    lab.delete_node(agent.hostname)

    assert backend_v6, "the lab has no IPv6 underlay (Lab.create builds one unless told not to)"
    agent6 = start_agent({"TS_DEST_IP": backend_v6, "TS_DEBUG_FIREWALL_MODE": mode})
    agent6.wait_for_log("Startup complete, waiting for shutdown signal", timeout=90)
    _, proxy_v6 = agent6.tailnet_ips()
    assert proxy_v6, "the proxy has no tailnet IPv6 address"
    body = lab.wait_curl("client", lab.url(proxy_v6, 8080, "/?ingress6"), lab_backend.marker, timeout=45)
    assert lab_backend.marker in body


def test_invalid_configuration_exits_1_and_starts_nothing(lab, start_agent):
    agent = start_agent({"TS_DEST_IP": "10.98.0.2", "TS_USERSPACE": "true"})
    assert agent.wait_exit(30) == 1
    log = agent.log_text()
    assert "invalid configuration" in log and "TS_DEST_IP" in log
    assert "Starting tailscaled" not in log
    assert lab.ns_pids("proxy") == []
