"""Crash consistency of the agent: SIGKILL just before each of its writes, then start it again.

Real kernel, real tailscaled and headscale, the test Kubernetes API server holding the state Secret (as
test_kube_e2e.py runs it), both firewall backends. A clean boot with CB_TEST_CRASH_LOG lists the crash points
(tscommon/crashpoint.py: each state Secret write, each rule set applied); then for each point the agent is
killed there (with everything else in the proxy namespace, as a container dies), started again, and:
* the node keeps its identity: one `proxy` node in headscale, the same node ID, no new machine or node key;
* the rules converge with none missing or duplicated: the agent's own rules equal the clean boot's (every
  point with nftables; the rule applies with iptables, as the Secret writes do not depend on the backend);
* the Secret is whole: tailscaled's state consistent, the agent's keys present and agreeing with the node;
* the data path works: a client reaches the backend through the proxy.
"""
from __future__ import annotations

import json
import re
import time

import kubelab
import pytest
from labextras import own_rules

from containerboot.kube import secretstate
from labtools.lab import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(900)]

STARTUP = "Startup complete, waiting for shutdown signal"
POD_UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def _normalized(rules: str) -> str:
    """The rules without packet counters (they differ between any two dumps)."""
    rules = re.sub(r"counter packets \d+ bytes \d+", "counter", rules)
    return re.sub(r"\[\d+:\d+\]", "[0:0]", rules)


def _crash_points(path) -> list[str]:
    return [f"{name}:{n}" for name, n in (line.split() for line in path.read_text().splitlines())]


@pytest.fixture
def kube(lab):
    with kubelab.PodAgents(lab) as k:
        yield k


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_kill_at_each_write_then_restart(lab, lab_backend, kube, mode) -> None:
    secret = f"ts-crash-{mode}"
    api = kube.api(f"crash-{mode}", secrets=[secret])
    env = {"TS_KUBE_SECRET": secret, "POD_UID": POD_UID, "TS_DEST_IP": lab.backend_ipv4,
           "TS_DEBUG_FIREWALL_MODE": mode}
    points_log = lab.run_dir / f"crash-points-{mode}"   # the Pod's /tmp is its own; the run dir is shared
    points_log.unlink(missing_ok=True)

    # The clean boot: what every crashed run must come back to.
    agent = kube.agent(api, {**env, "CB_TEST_CRASH_LOG": str(points_log)})
    kubelab.wait_log(agent, STARTUP)
    st = agent.wait_running(30)
    proxy_v4, _ = agent.tailnet_ips()
    assert lab_backend.marker in lab.wait_curl("client", lab.url(proxy_v4, 8080, "/?clean"), lab_backend.marker,
                                               timeout=60)
    (node,) = kubelab.hs_nodes_named(lab, "proxy")
    rules = _normalized(own_rules(lab, mode))
    assert rules, "the clean boot installed no rules"
    # the Secret writes that follow Running are done (device_ips, once traffic is routed, the last of them)
    wait_until(lambda: json.loads((api.secret_data(secret) or {}).get("device_ips") or b"null")
               == st["Self"]["TailscaleIPs"], 30, 0.2, "device_ips in the Secret")
    assert agent.stop(timeout=40) == 0
    assert lab.wait_ns_empty("proxy", 15) == []
    points = _crash_points(points_log)
    assert any(p.startswith("secret-write:") for p in points) and any(p.startswith("rules-apply:") for p in points)
    if mode == "iptables":
        # The Secret writes do not depend on the backend (nftables covers them): only the rule applies here.
        points = [p for p in points if p.startswith("rules-apply:")]

    timings = {}
    for point in points:
        t0 = time.monotonic()
        crashed = kube.agent(api, {**env, "CB_TEST_CRASH_AT": point})
        assert crashed.wait_exit(90) != 0, f"{point}: the agent did not stop there"
        lab.kill_ns_leftovers("proxy")           # the container dies with it: tailscaled too
        data = api.secret_data(secret) or {}
        assert secretstate.is_consistent(data), f"{point}: {sorted(data)}"
        if "device_ips" in data:
            json.loads(data["device_ips"])       # whole, never half-written

        again = kube.agent(api, env)
        kubelab.wait_log(again, STARTUP)
        st2 = again.wait_running(30)
        assert st2["Self"]["ID"] == st["Self"]["ID"], f"{point}: a new node"
        nodes = kubelab.hs_nodes_named(lab, "proxy")
        assert [n["id"] for n in nodes] == [node["id"]], f"{point}: {nodes}"
        log = again.log_text()
        assert "generating new machine key" not in log and "doLogin(regen=true" not in log, point
        assert lab_backend.marker in lab.wait_curl("client", lab.url(proxy_v4, 8080, f"/?{point}"),
                                                   lab_backend.marker, timeout=60)
        got = _normalized(own_rules(lab, mode))
        assert got == rules, f"{point}: rules differ from the clean boot's:\n{got}\n--- want ---\n{rules}"
        data = api.secret_data(secret) or {}
        assert data.get("device_id", b"").decode() == st2["Self"]["ID"], point
        assert json.loads(data["device_ips"]) == st2["Self"]["TailscaleIPs"], point
        assert secretstate.is_consistent(data), point
        assert again.stop(timeout=40) == 0
        assert lab.wait_ns_empty("proxy", 15) == []
        timings[point] = round(time.monotonic() - t0, 1)
    print(f"crash points ({mode}): {timings}")
