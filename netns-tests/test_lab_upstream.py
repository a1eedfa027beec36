"""The lab is faithful: UPSTREAM containerboot (the reference agent) behaves as documented in it.

If these pass, a failure of the same scenario with our agent is an agent bug, not a harness bug.
Each scenario runs with the agent's (and so its tailscaled's) firewall pinned through
TS_DEBUG_FIREWALL_MODE, for both iptables and nftables.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

STARTUP = "Startup complete, waiting for shutdown signal"
FIREWALLS = ("iptables", "nftables")


def _firewall_shows_dnat(lab, fw: str, target: str) -> str:
    """The proxy namespace's DNAT rule to ``target``, from the tool of firewall mode ``fw``."""
    if fw == "iptables":
        tool = "ip6tables-save" if ":" in target else "iptables-save"
        out = lab.exec("proxy", [tool, "-t", "nat"], timeout=10).stdout
        lines = [ln for ln in out.splitlines() if "DNAT" in ln and target in ln]
    else:
        out = lab.exec("proxy", ["nft", "list", "ruleset"], timeout=10).stdout
        lines = [ln for ln in out.splitlines() if "dnat" in ln and target in ln and "xt target" not in ln]
    return "\n".join(lines)


def test_lab_control_plane_and_client(lab):
    """headscale serves both prefixes and the client node is Running with an IPv4 and an IPv6."""
    st = lab.status("client")
    assert st["BackendState"] == "Running"
    v4, v6 = lab.tailnet_ips("client")
    assert v4 and v4.startswith("100.") and v6 and v6.startswith("fd7a:115c:a1e0:")
    node = lab.hs_node("client")
    assert node is not None and set(node["ip_addresses"]) == {v4, v6}
    assert st["Self"]["DNSName"].rstrip(".").endswith(".tailnet.test")


@pytest.mark.parametrize("fw", FIREWALLS)
def test_upstream_ingress_dest_ip(lab, lab_backend, start_agent, upstream_agent_cmd, fw):
    """TS_DEST_IP=<backend v4>: Startup complete; client -> proxy tailnet IPv4 -> backend page; the backend
    sees tailscaled's MASQUERADE source (the proxy's backend-link address)."""
    t0 = time.monotonic()
    agent = start_agent({"TS_DEST_IP": lab.backend_ipv4, "TS_DEBUG_FIREWALL_MODE": fw}, upstream_agent_cmd)
    agent.wait_for_log(STARTUP, 90)
    t_startup = time.monotonic() - t0
    st = agent.wait_running(30)
    v4, _ = agent.tailnet_ips()
    assert v4, st["Self"]
    lab.wait_peer("client", agent.hostname, 30)  # peer known with a home DERP: the first packet can go
    path = f"/ingress-{fw}-{lab.prefix}"
    body = lab.wait_curl("client", lab.url(v4, 8080, path), lab_backend.marker, timeout=30)
    t_curl = time.monotonic() - t0
    assert f"path={path}" in body
    seen = [r for r in lab.http_peer_log(lab_backend) if r["path"] == path]
    assert seen and {r["peer"] for r in seen} == {"10.98.0.1"}, seen
    assert _firewall_shows_dnat(lab, fw, lab.backend_ipv4), f"no {fw} DNAT rule to the backend"
    assert f"netfilter running in {fw} mode" in agent.log_text()  # TS_DEBUG_FIREWALL_MODE was honoured
    print(f"[timing] fw={fw} agent start->'{STARTUP}': {t_startup:.1f}s; ->first good curl: {t_curl:.1f}s")


@pytest.mark.parametrize("fw", FIREWALLS)
def test_upstream_ingress_dest_ipv6(lab, lab_backend, start_agent, upstream_agent_cmd, fw):
    """TS_DEST_IP=<backend v6>: the IPv6 half of the lab works end to end (client -> [proxy v6] -> fd98::2)."""
    agent = start_agent({"TS_DEST_IP": lab.backend_ipv6, "TS_DEBUG_FIREWALL_MODE": fw}, upstream_agent_cmd)
    agent.wait_for_log(STARTUP, 90)
    _, v6 = agent.tailnet_ips()
    assert v6
    lab.wait_peer("client", agent.hostname, 30)
    path = f"/ingress6-{fw}-{lab.prefix}"
    lab.wait_curl("client", lab.url(v6, 8080, path), lab_backend.marker, timeout=30)
    seen = [r for r in lab.http_peer_log(lab_backend) if r["path"] == path]
    assert seen and {r["local"] for r in seen} == {lab.backend_ipv6}, seen
    assert _firewall_shows_dnat(lab, fw, lab.backend_ipv6), f"no {fw} IPv6 DNAT rule to the backend"


@pytest.mark.parametrize("fw", FIREWALLS)
def test_upstream_sigterm_leaves_no_process(lab, start_agent, upstream_agent_cmd, fw):
    """After SIGTERM the agent exits and its tailscaled is gone too: nothing is left in the proxy namespace."""
    agent = start_agent({"TS_DEST_IP": lab.backend_ipv4, "TS_DEBUG_FIREWALL_MODE": fw}, upstream_agent_cmd)
    agent.wait_for_log(STARTUP, 90)
    assert len(lab.ns_pids("proxy")) >= 2  # the agent and its tailscaled
    t0 = time.monotonic()
    code = agent.stop(signal.SIGTERM, 30)
    t_stop = time.monotonic() - t0
    left = lab.wait_ns_empty("proxy", 15)
    assert left == [], f"processes left in the proxy namespace: {left}"
    assert code >= 0, f"agent had to be SIGKILLed (rc={code})"
    print(f"[timing] fw={fw} SIGTERM->exit {t_stop:.1f}s rc={code}")


def test_upstream_invalid_config_exits_1(lab, start_agent, upstream_agent_cmd):
    """TS_DEST_IP with TS_USERSPACE=true is rejected: exit 1, and no tailscaled was ever started."""
    agent = start_agent({"TS_DEST_IP": lab.backend_ipv4, "TS_USERSPACE": "true"}, upstream_agent_cmd)
    code = agent.wait_exit(30)
    assert code == 1, agent.log_text()
    assert not os.path.exists(agent.socket), "a tailscaled socket appeared"
    assert lab.wait_ns_empty("proxy", 5) == []
    log = agent.log_text()
    assert "TS_DEST_IP" in log and "TS_USERSPACE" in log, log  # the message names the conflicting variables
    assert "Starting tailscaled" not in log, log
    assert lab.hs_node(agent.hostname) is None, "the invalid agent registered a node"
