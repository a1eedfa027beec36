"""L3 egress end to end: a cluster workload reaches a tailnet node through the proxy (real headscale, real
tailscaled, our agent, real kernel rules), for both firewall backends and both address families.

The workload is the `backend` namespace; it connects to the proxy's cluster-side address (eth1: 10.98.0.1 /
fd98::1), the agent's rules DNAT that to the tailnet target and SNAT it to the proxy's tailnet address.

* by `TS_TAILNET_TARGET_IP` (one agent per family: the setting takes one address);
* by `TS_TAILNET_TARGET_FQDN` (the MagicDNS name headscale assigned), both families from one agent; then the
  target leaves the tailnet (stopped and deleted in headscale) and a NEW node with the same name and new
  addresses joins: while the name does not resolve the agent keeps running, removes the rules and reports
  why, and then the traffic follows the name without a restart. (Upstream v1.102.3, same scenario: it never
  notices the deletion, because headscale sends a full netmap and no PeersRemoved, so it keeps DNATing to the
  dead address and never follows the new node.) The moving target is a node of this test's own ("mover"),
  not the session's `client`, which other tests keep using;
* the catch-all egress DNAT does not capture what is not the workload's: packets arriving on tailscale0,
  tailscaled's own UDP port and the agent's health port; `tailscale ping --until-direct` forms a direct path.
"""
from __future__ import annotations

import json
import re
import sys

import labextras as lx
import pytest

from labtools.lab import BACKEND_LINK_PROXY_V4, BACKEND_LINK_PROXY_V6, Lab, wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(300)]

MODES = ("nftables", "iptables")
PORT = 8081          # the tailnet-side HTTP servers
LOCAL_PORT = 8082    # a server inside the proxy namespace (must never be captured)
HEALTH_PORT = 9002   # the agent's own HTTP port (exempt from the catch-all)
TS_PORT = 41641      # tailscaled's UDP port (lab: --port=41641)


@pytest.fixture(scope="module")
def client_server(lab):
    """An HTTP server on the lab's client node, on every address (so on its tailnet addresses too)."""
    return lab.start_http_server("client", ("0.0.0.0", "::"), PORT, f"client-ok-{lab.prefix}")


def requests_for(lab, srv, tag: str) -> list[dict]:
    return [r for r in lab.http_peer_log(srv) if tag in r["path"]]


def egress_url(version: int, tag: str) -> str:
    return Lab.url(BACKEND_LINK_PROXY_V4 if version == 4 else BACKEND_LINK_PROXY_V6, PORT, f"/?{tag}")


def check_egress(lab, srv, version: int, tag: str, proxy_ip: str, target_ip: str, timeout: float = 45) -> None:
    """From the backend (the cluster workload) through the proxy's cluster-side address to the target; the
    target sees the proxy's tailnet address as the source and its own tailnet address as the destination."""
    body = lab.wait_curl("backend", egress_url(version, tag), srv.marker, timeout=timeout)
    assert body.startswith(srv.marker)
    seen = requests_for(lab, srv, tag)
    assert seen, f"the target's server logged no request for {tag}"
    assert {r["peer"] for r in seen} == {proxy_ip}, f"not SNATed to the proxy's tailnet address: {seen}"
    assert {r["local"] for r in seen} == {target_ip}, f"not DNATed to the target's tailnet address: {seen}"


def restart_free(lab, agent) -> None:
    """Stop an agent this test started and forget its node, so the next agent registers afresh as `proxy`."""
    assert agent.stop() == 0, agent.log_text()[-3000:]
    assert lab.wait_ns_empty("proxy", 15) == []
    lab.delete_node(agent.hostname)


# ------------------------------------------------------------------------------------------------ by IP

@pytest.mark.parametrize("mode", MODES)
def test_egress_by_tailnet_ip_both_families(lab, client_server, start_agent, mode):
    client_v4, client_v6 = lab.tailnet_ips("client")
    agent = start_agent({"TS_TAILNET_TARGET_IP": client_v4, "TS_DEBUG_FIREWALL_MODE": mode})
    agent.wait_for_log("Startup complete, waiting for shutdown signal", timeout=90)
    proxy_v4, _ = agent.tailnet_ips()
    check_egress(lab, client_server, 4, f"ip4-{mode}", proxy_v4, client_v4)
    assert lx.own_rules(lab, mode), "no rules of the agent's own are installed"
    restart_free(lab, agent)
    assert lx.own_rules(lab, mode) == "", "the agent's rules are left behind after shutdown"

    # The lab always has IPv6 (its island and headscale's fd7a:115c:a1e0::/48): a client without a tailnet
    # IPv6 address is a fault of the lab, not a reason to leave the IPv6 path unchecked.
    assert client_v6, "the lab's client has no tailnet IPv6 address"
    agent6 = start_agent({"TS_TAILNET_TARGET_IP": client_v6, "TS_DEBUG_FIREWALL_MODE": mode})
    agent6.wait_for_log("Startup complete, waiting for shutdown signal", timeout=90)
    _, proxy_v6 = agent6.tailnet_ips()
    assert proxy_v6, "the proxy has no tailnet IPv6 address"
    check_egress(lab, client_server, 6, f"ip6-{mode}", proxy_v6, client_v6)


# ------------------------------------------------------------------------------------------------ by FQDN

NFT_PROBE = """
table inet cbtest {
    chain input {
        type filter hook input priority 0; policy accept;
        udp sport 50001 udp dport %(port)d counter
    }
    chain forward {
        type filter hook forward priority 0; policy accept;
        udp sport 50001 counter
    }
}
""" % {"port": TS_PORT}


def _probe_counters(lab) -> dict[str, int]:
    out = json.loads(lab.exec("proxy", ["nft", "-j", "list", "table", "inet", "cbtest"], check=True).stdout)
    counts: dict[str, int] = {}
    for item in out["nftables"]:
        rule = item.get("rule")
        if rule:
            c = next((e["counter"] for e in rule["expr"] if "counter" in e), None)
            if c is not None:
                counts[rule["chain"]] = c["packets"]
    return counts


def _send_udp(lab, ns: str, src: str, dst: str, port: int, n: int = 3) -> None:
    fam = "AF_INET6" if ":" in dst else "AF_INET"
    code = (f"import socket\ns = socket.socket(socket.{fam}, socket.SOCK_DGRAM)\ns.bind(({src!r}, 50001))\n"
            f"for _ in range({n}): s.sendto(b'not-wireguard', ({dst!r}, {port}))\n")
    lab.exec(ns, [sys.executable, "-I", "-c", code], check=True)


def check_not_captured(lab, agent, mode: str, target_srv) -> None:
    """What the catch-all egress DNAT must leave alone (anchors-and-pain row 12, netfilter-spec E18)."""
    proxy_v4, proxy_v6 = agent.tailnet_ips()
    # (1) Traffic arriving on tailscale0: a server inside the proxy namespace, reached from the tailnet.
    local = lab.start_http_server("proxy", tuple(a for a in (proxy_v4, proxy_v6) if a), LOCAL_PORT,
                                  f"proxy-local-{mode}")
    try:
        for ip in (proxy_v4, proxy_v6):
            if ip:
                body = lab.wait_curl("client", lab.url(ip, LOCAL_PORT, "/?from-tailnet"), local.marker, timeout=30)
                assert body.startswith(local.marker)
    finally:
        local.proc.terminate()
        local.proc.wait(10)
    # (2) tailscaled's UDP port: new flows from another host to <proxy underlay>:41641 are delivered locally
    # (INPUT), not DNATed to the target (FORWARD).
    lab.exec("proxy", ["nft", "-f", "-"], check=True, input=NFT_PROBE)
    try:
        px, cl = lab.namespaces["proxy"], lab.namespaces["client"]
        sent = 0
        for src, dst in ((cl.ipv4, px.ipv4), (cl.ipv6, px.ipv6)):
            if src and dst:
                _send_udp(lab, "client", src, dst, TS_PORT)
                sent += 3
        counts = wait_until(lambda: (c := _probe_counters(lab)).get("input", 0) >= sent and c, 10, 0.2,
                            "probe datagrams counted")
        assert counts.get("forward", 0) == 0, f"datagrams to tailscaled's port were forwarded: {counts}"
    finally:
        lab.exec("proxy", ["nft", "delete", "table", "inet", "cbtest"])
    # (3) The agent's own HTTP port on the Pod (underlay) address still answers the agent's health check,
    # while another port on the same address IS captured (that is the catch-all's job).
    px = lab.namespaces["proxy"]
    health = lab.curl("client", lab.url(px.ipv4, HEALTH_PORT, "/healthz"), 5)
    assert health.returncode == 0 and "ok" in health.stdout.lower(), \
        f"the agent's health port was captured or is down: {health.stdout}{health.stderr}"
    body = lab.wait_curl("client", lab.url(px.ipv4, PORT, "/?captured"), target_srv.marker, timeout=20)
    assert body.startswith(target_srv.marker)
    # (4) A direct WireGuard path between the proxy and a tailnet peer can form.
    cp = lab.ts("client", "ping", "--until-direct", "--c", "30", "--timeout", "3s", proxy_v4, timeout=90,
                check=False)
    direct = re.search(rf"via (\[?({re.escape(px.ipv4)}|{re.escape(px.ipv6 or px.ipv4)})\]?):{TS_PORT}", cp.stdout)
    assert cp.returncode == 0 and direct, f"no direct path client -> proxy: {cp.stdout}{cp.stderr}"


def agent_status(lab) -> dict:
    """The agent's /status ({} when it does not answer)."""
    cp = lab.curl("proxy", f"http://127.0.0.1:{HEALTH_PORT}/status", 5)
    return json.loads(cp.stdout) if cp.returncode == 0 else {}


def fqdn_target_status(lab) -> dict | None:
    """The TS_TAILNET_TARGET_FQDN entry of the agent's /status (asked from inside the proxy namespace)."""
    cp = lab.curl("proxy", f"http://127.0.0.1:{HEALTH_PORT}/status", 5)
    if cp.returncode != 0:
        return None
    return next((t for t in json.loads(cp.stdout).get("targets", ()) if t["name"] == "TS_TAILNET_TARGET_FQDN"), None)


def readyz(lab) -> int:
    """The HTTP status of the agent's /readyz (0 when it does not answer)."""
    cp = lab.exec("proxy", ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", "5",
                            f"http://127.0.0.1:{HEALTH_PORT}/readyz"], timeout=10)
    return int(cp.stdout or 0)


@pytest.fixture
def mover(lab, request):
    """A namespace with an HTTP server on every address, in which the test runs (and replaces) tailnet nodes;
    removed with everything in it at the end."""
    mode = request.node.callspec.params["mode"]
    ns = f"mv-{mode[:3]}"
    lab.add_namespace(ns)
    srv = lab.start_http_server(ns, ("0.0.0.0", "::"), PORT, f"mover-ok-{mode}")
    yield ns, srv
    for key, node in list(lab.nodes.items()):
        if node.ns == ns:
            lx.stop_node(lab, key)
    lab.delete_node(f"mover-{mode[:3]}")
    lx.remove_namespace(lab, ns)


@pytest.mark.parametrize("mode", MODES)
def test_egress_by_fqdn_follows_the_target_and_spares_tailscaled(lab, client_server, mover, start_agent, mode):
    ns, srv = mover
    hostname = f"mover-{mode[:3]}"
    lab.start_node(hostname, ns)
    fqdn = lx.magicdns_name(lab, hostname)
    old_v4, old_v6 = lab.tailnet_ips(hostname)
    agent = start_agent({"TS_TAILNET_TARGET_FQDN": fqdn, "TS_DEBUG_FIREWALL_MODE": mode,
                         "TS_ENABLE_HEALTH_CHECK": "true", "TS_LOCAL_ADDR_PORT": f"[::]:{HEALTH_PORT}"})
    agent.wait_for_log("Startup complete, waiting for shutdown signal", timeout=90)
    proxy_v4, proxy_v6 = agent.tailnet_ips()
    check_egress(lab, srv, 4, f"fqdn4-{mode}-a", proxy_v4, old_v4)
    if old_v6 and proxy_v6:
        check_egress(lab, srv, 6, f"fqdn6-{mode}-a", proxy_v6, old_v6)

    check_not_captured(lab, agent, mode, srv)
    assert readyz(lab) == 200, "ready while traffic flows"

    # The target leaves: stopped, and deleted from the control server, so the name no longer resolves.
    lx.stop_node(lab, hostname)
    assert lab.delete_node(hostname) == 1
    lx.wait_peer_gone(lab, "proxy", fqdn, 30)
    wait_until(lambda: "DNAT" not in lx.own_rules(lab, mode) and "dnat" not in lx.own_rules(lab, mode), 20, 0.3,
               "egress rules for the vanished target removed")
    # The agent has handled the vanished target (its /status says why it has no rules) and its loop has beaten
    # since: it survives the unresolvable target, it did not just take a moment to die.
    target = wait_until(lambda: (lambda t: t if t and "could not find" in t["last_error"] else None)(
        fqdn_target_status(lab)), 30, 0.5, "the FQDN target's error in the agent's /status")
    beat = agent_status(lab).get("loop_heartbeat_at") or 0
    wait_until(lambda: (agent_status(lab).get("loop_heartbeat_at") or 0) > beat, 30, 0.5,
               "another beat of the agent's loop")
    assert agent.running(), f"the agent exited while the target was gone:\n{agent.log_text()[-3000:]}"
    cp = lab.curl("backend", egress_url(4, "while-gone"), 3)
    assert srv.marker not in cp.stdout
    assert not target["rules_installed"], target
    assert readyz(lab) == 503, "/readyz must say not ready while the target's rules are removed"

    # A NEW node with the same name joins, with new addresses; the traffic follows without a restart.
    lx.rejoin_as_new_node(lab, hostname)
    assert lx.magicdns_name(lab, hostname) == fqdn
    new_v4, new_v6 = lab.tailnet_ips(hostname)
    assert new_v4 != old_v4, "headscale gave the new node the old address; the move proves nothing"
    check_egress(lab, srv, 4, f"fqdn4-{mode}-b", proxy_v4, new_v4, timeout=60)
    if new_v6 and proxy_v6:
        check_egress(lab, srv, 6, f"fqdn6-{mode}-b", proxy_v6, new_v6)
    assert agent.running() and agent.tailnet_ips() == (proxy_v4, proxy_v6), "the agent restarted"
    assert wait_until(lambda: readyz(lab) == 200, 20, 0.3, "ready again once the rules are back")

    # It said why there was nothing to forward to while the target was gone (checked last: a log wording
    # problem must not hide the data-path results above).
    log = agent.log_text()
    assert re.search(r"could not find Tailscale node.*" + re.escape(fqdn), log), \
        f"the agent did not log the unresolvable target; log tail:\n{log[-3000:]}"


def test_egress_fqdn_target_that_joins_after_the_agent(lab, start_agent):
    """The target does not exist yet when the agent starts (upstream's run loop `break`s out on the first
    unresolvable FQDN, spec 4.4 step 2): the agent runs, reports the target as unresolved, and forwards as
    soon as the node joins."""
    ns, hostname = "late", "late-target"
    lab.add_namespace(ns)
    try:
        srv = lab.start_http_server(ns, ("0.0.0.0", "::"), PORT, "late-ok")
        fqdn = f"{hostname}.{lx.magicdns_name(lab, 'client').split('.', 1)[1]}"  # same tailnet domain
        agent = start_agent({"TS_TAILNET_TARGET_FQDN": fqdn, "TS_DEBUG_FIREWALL_MODE": "nftables",
                             "TS_ENABLE_HEALTH_CHECK": "true", "TS_LOCAL_ADDR_PORT": f"[::]:{HEALTH_PORT}"})
        agent.wait_running(90)
        target = wait_until(lambda: fqdn_target_status(lab), 30, 0.5, "the FQDN target in the agent's /status")
        assert "could not find" in target["last_error"] and not target["rules_installed"], target
        assert agent.running()

        lab.start_node(hostname, ns)
        assert lx.magicdns_name(lab, hostname) == fqdn
        v4, v6 = lab.tailnet_ips(hostname)
        proxy_v4, proxy_v6 = agent.tailnet_ips()
        check_egress(lab, srv, 4, "late4", proxy_v4, v4, timeout=60)
        if v6 and proxy_v6:
            check_egress(lab, srv, 6, "late6", proxy_v6, v6)
    finally:
        if hostname in lab.nodes:
            lx.stop_node(lab, hostname)
        lab.delete_node(hostname)
        lx.remove_namespace(lab, ns)
