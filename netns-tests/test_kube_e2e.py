"""TS_KUBE_SECRET end to end: a Kubernetes API server in the island, the agent run like a Pod, real tailscaled.

The test API server (tests/support/kubeapi.py) runs in the lab's hs namespace on 10.99.0.1:6443. The agent
(ours, and upstream's Go containerboot for comparison) runs in the proxy namespace inside a private mount
namespace where the ServiceAccount files sit at /var/run/secrets/kubernetes.io/serviceaccount, so that its
tailscaled child, started with --state=kube:<secret>, keeps the node's state in the Secret. No TS_STATE_DIR.

Scenarios:
1. the proxy starts (``Startup complete``) and a client reaches the backend through the proxy's tailnet IP;
2. the Secret holds tailscaled's keys and the agent's device_id/device_fqdn/device_ips (matching
   ``tailscale status``), tailscale_capver and pod_uid;
3. SIGTERM exits 0 and leaves nothing in the proxy namespace; a restart with the same Secret (fresh socket)
   is the same node (same tailnet IP, same headscale node id and machine key, one ``proxy`` node);
4. TS_AUTH_ONCE=true with the auth key only in the Secret: the agent logs in and deletes the key, and a
   restart without any key runs on the Secret's state alone;
5. first boot with no Secret at all (tailscaled's store creates it; ours also writes capver/pod_uid);
6. an IPv6 API server address (upstream fails by design; ours works);
7. only the Role the controller gives each proxy (controller/proxyrbac.py: its own Secret, events): boot,
   proxy, state, restart, nothing refused.
Every scenario runs with our agent and with upstream's containerboot (the ``agent_cmd`` parameter).
"""
from __future__ import annotations

import json
import re

import kubelab
import pytest

from containerboot.kube import secretstate
from controller.config import ControllerConfig
from controller.kinds import service
from controller.proxyrbac import role
from controller.render import base_name

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(300)]

STARTUP = "Startup complete, waiting for shutdown signal"
POD_UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
TAILSCALED_KEYS = ("_machinekey", "_profiles", "_current-profile")
AGENT_KEYS = ("device_id", "device_fqdn", "device_ips", "tailscale_capver", "pod_uid")


@pytest.fixture
def kube(lab, request):
    """The test's API servers (named after the test) and Pod agents, all stopped at its end."""
    with kubelab.PodAgents(lab, re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-")) as k:
        yield k


@pytest.fixture(params=["ours", "upstream"])
def agent_cmd(request, lab):
    return None if request.param == "ours" else [str(lab.bin_dir / "containerboot")]


def kube_env(lab, secret: str, **extra: str) -> dict[str, str]:
    return {"TS_KUBE_SECRET": secret, "POD_UID": POD_UID, "TS_DEST_IP": lab.backend_ipv4, **extra}


def check_secret(api, secret: str, status: dict) -> dict[str, bytes]:
    """Scenario 2: tailscaled's keys and the agent's keys are in the Secret and agree with tailscale status."""
    data = api.secret_data(secret)
    assert data is not None, f"Secret {secret} does not exist"
    why = f"Secret keys: {sorted(data)}"
    for k in TAILSCALED_KEYS + AGENT_KEYS:
        assert data.get(k), f"{k} missing or empty; {why}"
    profiles = [k for k in data if k.startswith("profile-")]
    assert len(profiles) == 1, why
    assert data["_current-profile"].decode() == profiles[0], why
    assert secretstate.is_consistent(data), why
    me = status["Self"]
    assert data["device_id"].decode() == me["ID"]
    assert data["device_fqdn"].decode() == me["DNSName"] and me["DNSName"].endswith(".")
    assert json.loads(data["device_ips"]) == me["TailscaleIPs"]
    assert re.fullmatch(rb"[0-9]+", data["tailscale_capver"]), data["tailscale_capver"]
    assert data["pod_uid"] == POD_UID.encode()
    assert "authkey" not in data
    return data


def assert_no_new_login(agent) -> None:
    """tailscaled (its output is in the agent's log) reused the machine and node keys from the Secret."""
    log = agent.log_text()
    assert "generating new machine key" not in log, "a new machine key: the state was not found in the Secret"
    assert "doLogin(regen=true" not in log, "a new node key was generated on restart"


def test_kube_state_start_restart(lab, lab_backend, kube, agent_cmd):
    secret = "ts-proxy-state"
    api = kube.api("state", secrets=[secret])     # pre-created and empty, as the operator does
    env = kube_env(lab, secret)

    # 1. it starts and proxies
    agent = kube.agent(api, env, agent_cmd)
    kubelab.wait_log(agent, STARTUP)
    st = agent.wait_running(30)
    proxy_v4, _ = agent.tailnet_ips()
    body = lab.wait_curl("client", lab.url(proxy_v4, 8080, "/?kube1"), lab_backend.marker, timeout=60)
    assert lab_backend.marker in body

    # 2. the Secret holds tailscaled's state and the agent's keys
    data1 = check_secret(api, secret, st)
    nodes = kubelab.hs_nodes_named(lab, "proxy")
    assert len(nodes) == 1, nodes
    node1 = nodes[0]

    # 3. SIGTERM: exit 0, nothing left, state consistent in the Secret
    assert agent.stop(timeout=40) == 0, agent.log_text()[-3000:]
    assert lab.wait_ns_empty("proxy", 15) == [], "processes left in the proxy namespace after SIGTERM"
    after_stop = api.secret_data(secret)
    assert secretstate.is_consistent(after_stop), sorted(after_stop)
    assert after_stop["_machinekey"] == data1["_machinekey"]

    # ... restart with the same Secret and a fresh socket: the same node comes back
    agent2 = kube.agent(api, env, agent_cmd)
    assert agent2.socket != agent.socket
    kubelab.wait_log(agent2, STARTUP)
    st2 = agent2.wait_running(30)
    assert st2["Self"]["TailscaleIPs"] == st["Self"]["TailscaleIPs"]
    assert st2["Self"]["ID"] == st["Self"]["ID"]
    nodes = kubelab.hs_nodes_named(lab, "proxy")
    assert len(nodes) == 1, nodes
    assert nodes[0]["id"] == node1["id"], (node1, nodes[0])
    assert nodes[0].get("machine_key") == node1.get("machine_key")
    assert nodes[0].get("node_key") == node1.get("node_key")
    assert_no_new_login(agent2)
    body = lab.wait_curl("client", lab.url(proxy_v4, 8080, "/?kube2"), lab_backend.marker, timeout=60)
    assert lab_backend.marker in body
    data2 = check_secret(api, secret, st2)
    assert data2["_machinekey"] == data1["_machinekey"]
    assert agent2.stop(timeout=40) == 0, agent2.log_text()[-3000:]
    assert lab.wait_ns_empty("proxy", 15) == []


def test_the_controllers_proxy_role_is_all_the_agent_needs(lab, lab_backend, kube, agent_cmd):
    """The Role the controller gives each proxy (controller/proxyrbac.py: get/update/patch on its own state
    Secret only, events) is enough for ours and for stock upstream containerboot with tailscaled's kube store:
    each boots on the Secret the controller pre-created, proxies, writes its state and restarts on it, and the
    API server refuses none of its requests; it never asks for another Secret."""
    cfg = ControllerConfig(namespace="default", proxy_image="x")
    spec = service.decide({"metadata": {"name": "web", "namespace": "apps", "uid": "0f1e2d3c",
                                        "annotations": {"tailscale.com/expose": "true"}},
                           "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10"}}, cfg).spec
    secret = f"{base_name(spec.parent)}-0"
    api = kube.api("role", secrets=[secret])          # created by the controller before the StatefulSet
    api.set_rules([[r["verbs"], r["resources"], r.get("resourceNames", [])] for r in role(spec, cfg)["rules"]])
    env = kube_env(lab, secret, POD_NAME=secret)      # TS_KUBE_SECRET=$(POD_NAME): the Pod is named so
    agent = kube.agent(api, env, agent_cmd)
    kubelab.wait_log(agent, STARTUP)
    st = agent.wait_running(30)
    proxy_v4, _ = agent.tailnet_ips()
    assert lab_backend.marker in lab.wait_curl("client", lab.url(proxy_v4, 8080, "/?role"), lab_backend.marker,
                                               timeout=60)
    data = api.secret_data(secret)
    for k in TAILSCALED_KEYS + ("device_id", "device_ips"):
        assert data.get(k), f"{k} missing; keys {sorted(data)}"
    assert agent.stop(timeout=40) == 0, agent.log_text()[-3000:]
    assert lab.wait_ns_empty("proxy", 15) == []
    agent2 = kube.agent(api, env, agent_cmd)
    kubelab.wait_log(agent2, STARTUP)
    assert agent2.wait_running(30)["Self"]["ID"] == st["Self"]["ID"]
    assert_no_new_login(agent2)
    assert agent2.stop(timeout=40) == 0, agent2.log_text()[-3000:]
    reqs = api.requests()
    assert [(r["method"], r["resource"], r["name"]) for r in reqs if r["status"] == 403] == []
    assert {r["name"] for r in reqs if r["resource"] == "secrets"} == {secret}
    assert any(r["resource"] == "secrets" and r["method"] == "PATCH" and r["status"] == 200 for r in reqs)


def test_auth_once_key_only_in_secret(lab, lab_backend, kube, agent_cmd):
    secret = "ts-authonce"
    api = kube.api("authonce")
    api.put_secret(secret, {"authkey": lab.authkey})
    env = kube_env(lab, secret, TS_AUTH_ONCE="true")
    agent = kube.agent(api, env, agent_cmd, drop=("TS_STATE_DIR", "TS_AUTHKEY"))
    assert "TS_AUTHKEY" not in agent.env
    kubelab.wait_log(agent, STARTUP)
    st = agent.wait_running(30)
    proxy_v4, _ = agent.tailnet_ips()
    assert lab.backend_ipv4 and lab_backend.marker in lab.wait_curl(
        "client", lab.url(proxy_v4, 8080, "/?authonce"), lab_backend.marker, timeout=60)
    assert "Deleting authkey from Kubernetes Secret" in agent.log_text()
    data = check_secret(api, secret, st)
    assert "authkey" not in data
    removes = [r for r in api.requests() if r["method"] == "PATCH" and r["name"] == secret
               and '"/data/authkey"' in r["body"]]
    assert removes and removes[0]["status"] == 200, removes
    node = kubelab.hs_nodes_named(lab, "proxy")
    assert len(node) == 1, node
    assert agent.stop(timeout=40) == 0, agent.log_text()[-3000:]
    assert lab.wait_ns_empty("proxy", 15) == []

    # the key is gone for good: a restart runs on the state in the Secret alone, with no `tailscale up`
    agent2 = kube.agent(api, env, agent_cmd, drop=("TS_STATE_DIR", "TS_AUTHKEY"))
    kubelab.wait_log(agent2, STARTUP)
    st2 = agent2.wait_running(30)
    assert st2["Self"]["TailscaleIPs"] == st["Self"]["TailscaleIPs"]
    log2 = agent2.log_text()
    assert "Running 'tailscale up'" not in log2 and " up --accept-dns" not in log2, log2[-3000:]
    assert_no_new_login(agent2)
    nodes = kubelab.hs_nodes_named(lab, "proxy")
    assert [n["id"] for n in nodes] == [node[0]["id"]], nodes
    assert "authkey" not in api.secret_data(secret)
    assert agent2.stop(timeout=40) == 0, agent2.log_text()[-3000:]
    assert lab.wait_ns_empty("proxy", 15) == []


def test_first_boot_without_secret(lab, lab_backend, kube, agent_cmd, request):
    """No Secret at all (create allowed): tailscaled's store creates it. Ours also writes tailscale_capver and
    pod_uid on this first boot; upstream only on the next one (spec 3 step 5c, a documented upstream gap)."""
    secret = "ts-fresh"
    api = kube.api("fresh")
    agent = kube.agent(api, kube_env(lab, secret), agent_cmd)
    kubelab.wait_log(agent, STARTUP)
    st = agent.wait_running(30)
    data = api.secret_data(secret)
    assert data is not None
    for k in TAILSCALED_KEYS + ("device_id", "device_fqdn", "device_ips"):
        assert data.get(k), f"{k} missing; keys {sorted(data)}"
    assert data["device_id"].decode() == st["Self"]["ID"]
    if request.node.callspec.params["agent_cmd"] == "ours":
        assert data.get("pod_uid") == POD_UID.encode() and data.get("tailscale_capver"), sorted(data)
        creates = [r for r in api.requests() if r["method"] == "POST" and r["resource"] == "secrets"]
        assert creates and creates[0]["status"] == 201, creates
    else:
        assert "pod_uid" not in data and "tailscale_capver" not in data, sorted(data)
    assert agent.stop(timeout=40) == 0, agent.log_text()[-3000:]
    assert lab.wait_ns_empty("proxy", 15) == []



def test_ipv6_api_server_address(lab, lab_backend, kube, agent_cmd, request):
    """KUBERNETES_SERVICE_HOST is an IPv6 address (IPv6-only cluster) with the read-from-env flag.

    Upstream containerboot and tailscaled's kube store both build ``https://%s:%s`` with a bare IPv6 host, so
    upstream fails in its own client and exits 1. Ours brackets the host for its own client and in the
    environment it gives tailscaled, whose kube store then works too."""
    assert lab.ipv6, "the lab has no IPv6 underlay (Lab.create builds one unless told not to)"
    ours = request.node.callspec.params["agent_cmd"] == "ours"
    secret = "ts-v6api"
    api = kube.api("v6api", host=kubelab.labmod.HS_V6, secrets=[secret])
    agent = kube.agent(api, kube_env(lab, secret), agent_cmd)
    if not ours:
        assert agent.wait_exit(60) == 1
        assert re.search(r'parse "https://fd99::1:6443/.*invalid port', agent.log_text())
        assert not [r for r in api.requests() if r["resource"] == "secrets"], "upstream reached the API?"
        assert lab.wait_ns_empty("proxy", 15) == []
        return

    def reset_done() -> bool:     # our own client's boot reset: before tailscaled starts
        return any(r["method"] == "PATCH" and r["status"] == 200 and "tailscale_capver" in r["body"]
                   for r in api.requests())
    kubelab.wait_alive(reset_done, agent.proc, 60, "our boot reset over IPv6", agent.log_path)
    kubelab.wait_log(agent, STARTUP, timeout=90)
    st = agent.wait_running(30)
    check_secret(api, secret, st)
    assert agent.stop(timeout=40) == 0, agent.log_text()[-3000:]
