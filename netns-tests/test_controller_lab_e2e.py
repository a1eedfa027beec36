"""The controller, the agent and headscale together, without Kubernetes: the Secret contract end to end.

The controller's passes (netns-tests/controller_pass.py) run on the island: the parent Service and the
StatefulSet live in an in-memory API, the proxy's config/state Secret in the real test API server, keys and
device deletion in the real headscale. The test then plays kubelet: it mounts the rendered Secret's files and
starts our agent with the rendered StatefulSet's env, as a Pod with that Secret as its state. The agent logs
in with the minted key, writes device_id/device_fqdn/device_ips, the next pass puts the tailnet name and IPs
into the Service's status, and the lab's client reaches the backend through the IP in that status. A pass with
nothing changed writes nothing to the Secret; deleting the Service removes the node from headscale and the
Secret from the API server, then releases the Service.

What this cannot show (needs the real cluster of the real-cluster issue): the StatefulSet run by a kubelet,
the image, kube-proxy ClusterIPs (the backend's address stands in for the ClusterIP), kopf's watches.
"""
from __future__ import annotations

import json
import pathlib
import sys
import uuid

import kubelab
import pytest

from controller.model import Parent
from controller.reconcile import PENDING_RECHECK, READY_RECHECK
from controller.render import base_name

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = str(pathlib.Path(__file__).resolve().parents[1])
HERE = str(pathlib.Path(__file__).resolve().parent)
STARTUP = "Startup complete, waiting for shutdown signal"


@pytest.fixture
def api_key(lab) -> str:
    out = lab.hs("apikeys", "create", "--expiration", "1h")
    return out if isinstance(out, str) else str(out.get("key") or out)


class Controller:
    def __init__(self, lab, api, api_key, state: pathlib.Path) -> None:
        self.lab, self.api, self.api_key, self.state = lab, api, api_key, state

    def objects(self) -> dict:
        return {tuple(k): v for k, v in json.loads(self.state.read_text())} if self.state.exists() else {}

    def write(self, objects: dict) -> None:
        self.state.write_text(json.dumps([[list(k), v] for k, v in objects.items()]))

    def pass_(self, kind="svc", ns="apps", name="web") -> dict:
        cp = self.lab.exec("client", [sys.executable, f"{HERE}/controller_pass.py", str(self.state), kind, ns, name],
                           timeout=60, env={"PYTHONPATH": REPO, "SA_DIR": str(self.api.dir), "PROXY_NS": "tailscale",
                                            "HS_URL": self.lab.login_server, "HS_API_KEY": self.api_key,
                                            # headscale before 0.28 mints keys for a user only (install guide)
                                            "HS_USER": str(self.lab.user_id) if self.lab.hs_minor < (0, 28) else ""})
        assert cp.returncode == 0, cp.stderr[-3000:]
        out = json.loads(cp.stdout.strip().splitlines()[-1])
        assert "error" not in out, out
        return out


def test_expose_service_through_controller_agent_and_headscale(lab, lab_backend, api_key):
    api = kubelab.KubeAPI.start(lab, f"ctl-{uuid.uuid4().hex[:6]}")
    ctl = Controller(lab, api, api_key, lab.run_dir / f"ctl-{uuid.uuid4().hex[:6]}.json")
    uid = str(uuid.uuid4())
    ctl.write({("services", "apps", "web"): {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "apps", "uid": uid, "resourceVersion": "1", "generation": 1},
        "spec": {"type": "LoadBalancer", "loadBalancerClass": "tailscale", "clusterIP": lab.backend_ipv4,
                 "clusterIPs": [lab.backend_ipv4], "ipFamilies": ["IPv4"], "ports": [{"port": 8080}]}}})
    name = base_name(Parent("svc", "web", "apps", uid))
    secret = f"{name}-0"
    agent = None
    try:
        assert ctl.pass_()["requeue"] == PENDING_RECHECK
        data = api.secret_data(secret)
        conf = json.loads(data["cap-107.hujson"])
        assert conf["ServerURL"] == lab.login_server and conf["Hostname"] == "apps-web" and conf["AuthKey"]
        sts = ctl.objects()[("statefulsets", "tailscale", name)]

        # kubelet: the Secret mounted at the rendered path, the container's env with its references resolved.
        root = lab.run_dir / f"tsconfig-{uid[:8]}"
        (root / secret).mkdir(parents=True)
        for k, v in data.items():
            if k.startswith("cap-"):
                (root / secret / k).write_bytes(v)
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        env = {}
        for e in c["env"]:
            if "value" in e:
                env[e["name"]] = e["value"].replace("$(POD_NAME)", secret).replace("/etc/tsconfig/", f"{root}/")
            elif e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name":
                env[e["name"]] = secret
            elif e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid":
                env[e["name"]] = "pod-" + uid[:8]
        assert env["TS_KUBE_SECRET"] == secret and env["TS_DEST_IP"] == lab.backend_ipv4
        agent = kubelab.start_pod_agent(lab, api, env, drop=("TS_STATE_DIR", "TS_AUTHKEY", "TS_EXTRA_ARGS",
                                                              "TS_HOSTNAME"))
        kubelab.wait_log(agent, STARTUP)

        # kubelet: the Pod is ready.
        objs = ctl.objects()
        objs[("statefulsets", "tailscale", name)]["status"] = {"readyReplicas": 1}
        ctl.write(objs)
        assert ctl.pass_()["requeue"] == READY_RECHECK
        svc = ctl.objects()[("services", "apps", "web")]
        cond = svc["status"]["conditions"][0]
        assert (cond["type"], cond["status"], cond["reason"]) == ("TailscaleProxyReady", "True", "ProxyCreated")
        ingress = svc["status"]["loadBalancer"]["ingress"]
        assert ingress[0]["hostname"].startswith("apps-web.")
        ip = ingress[1]["ip"]
        assert ip == agent.tailnet_ips()[0]
        node = lab.hs_node("apps-web")
        assert node and "tag:k8s" in set(node.get("tags") or node.get("forced_tags") or node.get("valid_tags") or [])
        body = lab.wait_curl("client", lab.url(ip, 8080, "/?controller"), lab_backend.marker, timeout=60)
        assert lab_backend.marker in body
        # Registered: the key left the config; the next pass writes nothing.
        assert "AuthKey" not in json.loads(api.secret_data(secret)["cap-107.hujson"])
        before = len(api.requests())
        ctl.pass_()
        writes = [r for r in api.requests()[before:] if r.get("method") not in ("GET",)]
        assert writes == [], writes

        # Delete the Service: StatefulSet first (kubelet stops the Pod), then the device, the Secret, the finalizer.
        objs = ctl.objects()
        objs[("services", "apps", "web")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        ctl.write(objs)
        assert ctl.pass_()["requeue"] == 2.0
        assert ctl.objects()[("statefulsets", "tailscale", name)]["metadata"].get("deletionTimestamp")
        assert agent.stop(timeout=40) == 0
        objs = ctl.objects()
        del objs[("statefulsets", "tailscale", name)]
        ctl.write(objs)
        assert ctl.pass_()["requeue"] is None
        assert lab.hs_node("apps-web") is None
        assert api.secret(secret) is None
        assert ("services", "apps", "web") not in ctl.objects()
    finally:
        problems = lab.reset_proxy([agent] if agent else [], ["apps-web"])
        api.stop()
        assert not problems, problems


def _mount(root: pathlib.Path, secret: str, data: dict) -> None:
    """kubelet: the Secret's cap files in the mounted directory (rewritten whole, as an atomic update)."""
    d = root / secret
    d.mkdir(parents=True, exist_ok=True)
    for k, v in data.items():
        if k.startswith("cap-"):
            tmp = d / f".{k}.tmp"
            tmp.write_bytes(v)
            tmp.replace(d / k)


def _pod_env(sts: dict, secret: str, root: pathlib.Path, uid: str) -> dict:
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    env = {}
    for e in c["env"]:
        if "value" in e:
            env[e["name"]] = e["value"].replace("$(POD_NAME)", secret).replace("/etc/tsconfig/", f"{root}/")
        elif e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name":
            env[e["name"]] = secret
        elif e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid":
            env[e["name"]] = "pod-" + uid[:8]
    return env


def test_rejected_key_is_reissued_and_the_proxy_logs_in(lab, lab_backend, api_key):
    """Beyond upstream (which reissues only for ProxyGroups): the agent reports its key failed
    (`reissue_authkey`), the controller mints a new one into the config, the restarted Pod logs in."""
    api = kubelab.KubeAPI.start(lab, f"ctl-{uuid.uuid4().hex[:6]}")
    ctl = Controller(lab, api, api_key, lab.run_dir / f"ctl-{uuid.uuid4().hex[:6]}.json")
    uid = str(uuid.uuid4())
    ctl.write({("services", "apps", "web"): {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "apps", "uid": uid, "resourceVersion": "1", "generation": 1,
                     "annotations": {"tailscale.com/expose": "true"}},
        "spec": {"type": "ClusterIP", "clusterIP": lab.backend_ipv4, "clusterIPs": [lab.backend_ipv4],
                 "ports": [{"port": 8080}]}}})
    name = base_name(Parent("svc", "web", "apps", uid))
    secret = f"{name}-0"
    root = lab.run_dir / f"tsconfig-{uid[:8]}"
    agents = []
    try:
        ctl.pass_()
        # The key in the config no longer works (expired, used up, revoked): here, one headscale never issued.
        data = api.secret_data(secret)
        bad = {k: json.dumps({**json.loads(v), "AuthKey": "hskey-auth-notissued-0123456789abcdef"},
                             sort_keys=True, separators=(",", ":")) for k, v in data.items() if k.startswith("cap-")}
        api.put_secret(secret, bad)
        _mount(root, secret, api.secret_data(secret))
        env = _pod_env(ctl.objects()[("statefulsets", "tailscale", name)], secret, root, uid)
        drop = ("TS_STATE_DIR", "TS_AUTHKEY", "TS_EXTRA_ARGS", "TS_HOSTNAME")
        agents.append(kubelab.start_pod_agent(lab, api, env, drop=drop))
        from labtools.lab import wait_until
        wait_until(lambda: "reissue_authkey" in (api.secret_data(secret) or {}), 90, 0.5, "the reissue request")
        ctl.pass_()
        new = json.loads(api.secret_data(secret)["cap-107.hujson"])["AuthKey"]
        assert new and new != "hskey-auth-notissued-0123456789abcdef"
        _mount(root, secret, api.secret_data(secret))
        assert agents[0].wait_exit(60) == 0, agents[0].log_text()[-3000:]     # "restarting to apply"
        assert "Successfully received new auth key" in agents[0].log_text()
        agents.append(kubelab.start_pod_agent(lab, api, env, drop=drop))     # the container restarts
        kubelab.wait_log(agents[1], STARTUP)
        assert "reissue_authkey" not in api.secret_data(secret)
        objs = ctl.objects()
        objs[("statefulsets", "tailscale", name)]["status"] = {"readyReplicas": 1}
        ctl.write(objs)
        ctl.pass_()
        cond = ctl.objects()[("services", "apps", "web")]["status"]["conditions"][0]
        assert (cond["status"], cond["reason"]) == ("True", "ProxyCreated"), cond
    finally:
        problems = lab.reset_proxy(agents, ["apps-web"])
        api.stop()
        assert not problems, problems
