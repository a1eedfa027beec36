"""The agent as a real Pod: a StatefulSet in the lab's real Kubernetes (labtools.kubecluster, one node in the
island), from the proxy image (``make image``, images/build.sh), privileged as upstream's operator runs proxies.

Per firewall backend of the agent (iptables, nftables; the node's kube-proxy runs in the same mode), one
cluster each:
1. state in the real Secret through real RBAC (SA token projected by the kubelet, SSARs answered by the real
   authorizer), tailscaled's kube store keys + the agent's device keys; a tailnet client reaches the backend
   Deployment through the Pod (L3 ingress DNATed to a real ClusterIP, then kube-proxy to the Pod);
2. faults: the API server stops and restarts while the agent runs (the data path never stops; a device
   name change made while it was down reaches the Secret afterwards), the Pod deleted and re-created by the
   StatefulSet controller (same node: same ID, same tailnet IP, no new login), the Secret deleted under the
   running Pod (data path kept; a device change meanwhile is reported as a failed write and retried, and
   lands in the Secret once it is re-created, without a restart);
3. a Role without ``patch`` with the auth key in the Secret: the Pod fails with the message naming the rule;
4. one-step mode: the config Secret mounted by the kubelet is rewritten, the kubelet swaps ``..data``, the
   agent has tailscaled reload it (a new advertised route reaches headscale);
5. another writer patching the Secret while the proxy boots (no conflict, nothing lost), and real 409
   Conflicts on the agent's writes from a validating admission webhook (labtools.conflictwebhook): logged,
   retried, the keys land, no restart (iptables cluster only).
"""
from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path

import pytest
from needs import unavailable

from labtools import image as labimage
from labtools import kubecluster, kubemanifests
from labtools import lab as labmod
from labtools.lab import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
IMAGE = labimage.IMAGE      # LAB_PROXY_IMAGE: a checkout's own name (names and archives are one per machine)


@pytest.fixture(scope="session")
def agent_image_archive(lab_bin_dir) -> Path:
    """The proxy image's OCI archive, built (or found up to date) by the project's own image build."""
    cp = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--image"], capture_output=True, text=True,
                        timeout=1800)
    if cp.returncode != 0:
        unavailable(f"the image build's packages cannot be installed: {cp.stderr[-1500:]}")
    build = ["bash", str(REPO / "images" / "build.sh"), "--name", IMAGE]
    cp = subprocess.run(build, capture_output=True, text=True, timeout=3600)
    assert cp.returncode == 0, f"make image failed:\n{cp.stderr[-4000:]}"
    path = Path(subprocess.run([*build, "--print-archive"], capture_output=True,
                               text=True, check=True).stdout.strip())
    assert path.is_file(), path
    return path


@pytest.fixture(scope="module", params=["iptables", "nftables"])
def kube(request, lab, agent_image_archive, k8s_bin_dir):
    """A cluster with a node, the proxy image imported, and the echo backend behind a ClusterIP Service."""
    # the node's kube-proxy uses the same netfilter backend as the agent under test
    kc = kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin_dir, proxy_mode=request.param)
    try:
        kc.import_image(agent_image_archive)
        kc.apply([kubemanifests.namespace("backend"),
                  *kubemanifests.echo_backend("backend", "echo", f"echo-ok-{lab.prefix}", kubecluster.ECHO_IMAGE)])
        kc.kubectl("-n", "backend", "rollout", "status", "deployment/echo", "--timeout=90s", timeout=100)
        kc.firewall = request.param
        kc.backend_ip = kc.get("service", "echo", "backend")["spec"]["clusterIP"]
        kc.marker = f"echo-ok-{lab.prefix}"
        yield kc
    except BaseException:
        print(kc.diagnostics())
        raise
    finally:
        kc.close()


def _proxy_env(lab, kc, hostname: str) -> dict[str, str]:
    """The lab's tailscaled environment (no logs to Tailscale, DERP over HTTP, ...) for the Pod."""
    env = lab.tailscaled_env(Path("/tmp"), Path("/tmp/logs"))
    for k in ("PATH", "HOME", "TS_LOGS_DIR"):
        env.pop(k)
    env.update({"TS_DEBUG_FIREWALL_MODE": kc.firewall, "TS_HOSTNAME": hostname,
                "TS_EXTRA_ARGS": f"--login-server={labmod.LOGIN_SERVER}",
                "TS_TAILSCALED_EXTRA_ARGS": "--no-logs-no-support --port=41641"})
    return env


def _secret(kc, ns: str, name: str) -> dict[str, bytes] | None:
    s = kc.get("secret", name, ns)
    if s is None:
        return None
    return {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}


def _deploy_proxy(lab, kc, ns: str, name: str, *, verbs=("get", "update", "patch"), secret_data=None,
                  env=None, config_secret: str | None = None, authkey_env: bool = True) -> None:
    hostname = f"{name}-{kc.firewall[:3]}"
    e = _proxy_env(lab, kc, hostname)
    if authkey_env:
        e.update({"TS_AUTHKEY": lab.authkey, "TS_AUTH_ONCE": "true"})
    e.update(env or {})
    objs = [kubemanifests.namespace(ns), *kubemanifests.proxy_rbac(ns, name, f"{name}-0", verbs=verbs),
            kubemanifests.secret(ns, f"{name}-0", secret_data)]
    kc.apply(objs)
    kc.wait_dns()    # upstream's containerboot asks https://kubernetes.default.svc (CoreDNS answers)
    kc.apply(kubemanifests.proxy_statefulset(ns, name, IMAGE, service_account=name, dest_ip=kc.backend_ip,
                                             env=e, config_secret=config_secret))


def _wait_device(kc, ns: str, secret: str, timeout: float = 120) -> dict[str, bytes]:
    def ready():
        d = _secret(kc, ns, secret) or {}
        return d if d.get("device_ips") and d.get("device_fqdn") else None
    try:
        return wait_until(ready, timeout, 0.5, f"device keys in Secret {ns}/{secret}")
    except TimeoutError:
        logs = kc.kubectl("-n", ns, "logs", f"{secret}", "--tail=60", check=False)
        print(kc.diagnostics())
        raise AssertionError(f"no device keys in {ns}/{secret}; Pod log:\n{logs.stdout}{logs.stderr}") from None


def _logs(kc, ns: str, pod: str, previous: bool = False) -> str:
    cp = kc.kubectl("-n", ns, "logs", pod, *(["--previous"] if previous else []), check=False)
    return cp.stdout + cp.stderr


def _curl(lab, ip: str, marker: str, tag: str, timeout: float = 60) -> str:
    return lab.wait_curl("client", lab.url(ip, 8080, f"/{tag}"), marker, timeout=timeout)


def test_agent_pod_state_ingress_and_faults(lab, kube):
    kc, ns, name = kube, "tsproxy", "px"
    hostname = f"{name}-{kc.firewall[:3]}"
    lab.delete_node(hostname)
    _deploy_proxy(lab, kc, ns, name)
    pod = kc.wait_pod_ready(ns, f"{name}-0", 120)
    data = _wait_device(kc, ns, f"{name}-0")

    # 1. the Secret: tailscaled's kube store and the agent's keys, through the real authorizer
    for k in ("_machinekey", "_profiles", "_current-profile", "device_id", "tailscale_capver", "pod_uid"):
        assert data.get(k), f"{k} missing; keys {sorted(data)}"
    assert data["pod_uid"].decode() == pod["metadata"]["uid"]
    assert "authkey" not in data
    ips = json.loads(data["device_ips"])
    v4 = next(i for i in ips if ":" not in i)
    nodes = [n for n in lab.hs_nodes() if n.get("given_name") == hostname or n.get("name") == hostname]
    assert len(nodes) == 1, nodes
    assert data["device_fqdn"].decode().startswith(nodes[0]["given_name"] + ".")

    # the tailnet client reaches the backend Deployment through the Pod: tailnet -> Pod (DNAT to the
    # ClusterIP, SNAT to the Pod IP) -> kube-proxy -> echo Pod
    lab.wait_peer("client", hostname, 60)
    body = _curl(lab, v4, kc.marker, "through-pod", 90)
    assert f"peer={pod['status']['podIP']}:" in body, body

    # 2a. the API server goes away while the agent runs: the data path does not notice; a device name
    # change made meanwhile reaches the Secret once the API server is back
    kc.stop_component("kube-apiserver")
    try:
        for i in range(3):
            assert kc.marker in _curl(lab, v4, kc.marker, f"api-down-{i}", 20)
        lab.hs("nodes", "rename", "--identifier", str(nodes[0]["id"]), f"{hostname}-renamed")
        # not a wait: the outage outlasts the rename; the write it owes lands after the return whenever seen
        time.sleep(5)
    finally:
        ready_after = kc.restart_apiserver(0)
    print(f"kube-apiserver back in {ready_after:.1f}s")
    wait_until(lambda: (_secret(kc, ns, f"{name}-0") or {}).get("device_fqdn", b"").startswith(
        f"{hostname}-renamed.".encode()), 90, 1, "the renamed device's FQDN in the Secret")
    p = kc.get("pod", f"{name}-0", ns)
    assert p["metadata"]["uid"] == pod["metadata"]["uid"]
    assert p["status"]["containerStatuses"][0]["restartCount"] == 0, "the agent restarted"

    # 2b. the Pod is deleted; the StatefulSet controller makes a new one, which is the same tailnet node
    kc.kubectl("-n", ns, "delete", "pod", f"{name}-0", "--wait=true", timeout=90)
    pod2 = kc.wait_pod_ready(ns, f"{name}-0", 120)
    assert pod2["metadata"]["uid"] != pod["metadata"]["uid"]
    wait_until(lambda: (_secret(kc, ns, f"{name}-0") or {}).get("pod_uid", b"").decode() == pod2["metadata"]["uid"],
               90, 0.5, "the new Pod's UID in the Secret")
    log2 = _logs(kc, ns, f"{name}-0")
    assert "generating new machine key" not in log2, log2[-3000:]
    data2 = _wait_device(kc, ns, f"{name}-0")
    assert data2["device_id"] == data["device_id"] and json.loads(data2["device_ips"]) == ips
    assert [n["id"] for n in lab.hs_nodes() if n["id"] == nodes[0]["id"]] and len(
        [n for n in lab.hs_nodes() if n.get("name") == hostname]) == 1
    body = _curl(lab, v4, kc.marker, "after-pod-restart", 90)
    assert f"peer={pod2['status']['podIP']}:" in body, body

    # 2c. the Secret is deleted under the running Pod: the data path is kept
    kc.kubectl("-n", ns, "delete", "secret", f"{name}-0")
    for i in range(3):
        assert kc.marker in _curl(lab, v4, kc.marker, f"secret-gone-{i}", 20)
        time.sleep(1)   # not a wait: spreads the requests over the seconds after the deletion
    # ... a change the agent must record meanwhile fails (reported, retried), and once the operator re-creates
    # the Secret the agent writes it there, without restarting
    lab.hs("nodes", "rename", "--identifier", str(nodes[0]["id"]), f"{hostname}-again")
    wait_until(lambda: "failed to update Secret" in _logs(kc, ns, f"{name}-0"), 60, 1,
               "the agent reporting the failed Secret write")
    assert kc.marker in _curl(lab, v4, kc.marker, "secret-gone-after-change", 20)
    kc.apply(kubemanifests.secret(ns, f"{name}-0"))
    wait_until(lambda: (_secret(kc, ns, f"{name}-0") or {}).get("device_fqdn", b"").startswith(
        f"{hostname}-again.".encode()), 90, 1, "the device's new FQDN in the re-created Secret")
    p = kc.get("pod", f"{name}-0", ns)
    assert p["metadata"]["uid"] == pod2["metadata"]["uid"]
    assert p["status"]["containerStatuses"][0]["restartCount"] == 0
    kc.kubectl("-n", ns, "delete", "statefulset", name, "--wait=true", timeout=90)
    for n in (hostname, f"{hostname}-renamed", f"{hostname}-again"):
        lab.delete_node(n)


def test_role_without_patch_gives_the_message_users_see(lab, kube):
    kc, ns, name = kube, "tsnopatch", "np"
    _deploy_proxy(lab, kc, ns, name, verbs=("get", "update"), secret_data={"authkey": lab.authkey},
                  authkey_env=False)

    def failed() -> str | None:
        text = _logs(kc, ns, f"{name}-0") + _logs(kc, ns, f"{name}-0", previous=True)
        return text if "grant patch" in text else None
    text = wait_until(failed, 120, 1, "the Pod's failure message")
    assert ("authkey found in TS_KUBE_SECRET, but the pod doesn't have patch permissions on the Secret to manage "
            f'the authkey (Secret "{name}-0")') in text     # upstream's words first, then ours
    assert "resourceNames" in text or "patch" in text
    assert lab.authkey not in text

    def exit_code() -> int | None:     # the container's exit, as the kubelet recorded it
        st = kc.get("pod", f"{name}-0", ns)["status"]["containerStatuses"][0]
        term = (st.get("state") or {}).get("terminated") or (st.get("lastState") or {}).get("terminated") or {}
        return term.get("exitCode")
    assert wait_until(exit_code, 60, 1, "the agent container's exit") == 1
    kc.kubectl("-n", ns, "delete", "statefulset", name, "--wait=true", timeout=90)


def test_config_secret_reloaded_on_data_swap(lab, kube):
    kc, ns, name = kube, "tsconfig", "cf"
    hostname = f"{name}-{kc.firewall[:3]}"
    lab.delete_node(hostname)
    cfg_secret = f"{name}-config"
    conf = lambda routes: kubemanifests.tailscaled_config(  # noqa: E731
        authkey=lab.authkey, hostname=hostname, server_url=labmod.LOGIN_SERVER, advertise_routes=routes)
    kc.apply([kubemanifests.namespace(ns), kubemanifests.proxy_config_secret(ns, cfg_secret, conf(()))])
    _deploy_proxy(lab, kc, ns, name, config_secret=cfg_secret, authkey_env=False,
                  env={"TS_EXTRA_ARGS": "", "TS_HOSTNAME": ""})
    kc.wait_pod_ready(ns, f"{name}-0", 120)
    _wait_device(kc, ns, f"{name}-0")
    route = "10.77.0.0/24"
    kc.apply(kubemanifests.proxy_config_secret(ns, cfg_secret, conf((route,))))

    def announced() -> bool:
        n = next((n for n in lab.hs_nodes() if n.get("name") == hostname), None)
        return bool(n) and route in (n.get("available_routes") or [])
    wait_until(announced, 90, 1, f"{route} announced to headscale after the config Secret changed")
    log = _logs(kc, ns, f"{name}-0")
    assert "config was reloaded" in log, log[-3000:]
    p = kc.get("pod", f"{name}-0", ns)
    assert p["status"]["containerStatuses"][0]["restartCount"] == 0
    kc.kubectl("-n", ns, "delete", "statefulset", name, "--wait=true", timeout=90)
    lab.delete_node(hostname)


WRITER = r"""
import http.client, json, ssl, sys, time
host, port, token, ca, path, seconds = sys.argv[1:7]
ctx = ssl.create_default_context(cafile=ca)
conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=10)
n, codes, end = 0, {}, time.monotonic() + float(seconds)
while time.monotonic() < end:
    n += 1
    body = json.dumps({"metadata": {"annotations": {"lab/other-writer": str(n)}},
                       "stringData": {"operator-key": str(n)}})
    conn.request("PATCH", path, body, {"Authorization": "Bearer " + token,
                                       "Content-Type": "application/strategic-merge-patch+json"})
    r = conn.getresponse(); r.read()
    codes[r.status] = codes.get(r.status, 0) + 1
    time.sleep(0.005)   # not a wait: paces the other writer
print(json.dumps({"writes": n, "codes": codes}))
"""


def test_concurrent_writer_no_conflict_nothing_lost(lab, kube):
    """Another writer (as an operator would) patches the state Secret about 100 times a second while the proxy
    boots, logs in and writes its keys. A real API server answers 409 Conflict to a write based on a stale
    resourceVersion (test_realkube_e2e checks that); the agent's and tailscaled's writes carry none
    (strategic-merge and JSON patches), so none of them conflicts, none is retried, and no key of either
    writer is lost. The audit log is the API server's own record of every request and its status."""
    import sys
    kc, ns, name = kube, "tsconcur", "cc"
    hostname = f"{name}-{kc.firewall[:3]}"
    lab.delete_node(hostname)
    kc.apply([kubemanifests.namespace(ns), kubemanifests.secret(ns, f"{name}-0")])
    host, port = kc.cfg.api_host, str(kc.cfg.api_port)
    w = kc.popen([sys.executable, "-c", WRITER, host, port, kc.token, str(kc.ca_cert),
                  f"/api/v1/namespaces/{ns}/secrets/{name}-0", "40"], stdout=subprocess.PIPE, text=True)
    try:
        _deploy_proxy(lab, kc, ns, name)
        kc.wait_pod_ready(ns, f"{name}-0", 120)
        data = _wait_device(kc, ns, f"{name}-0")
        out, _ = w.communicate(timeout=90)
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    stats = json.loads(out)
    assert stats["codes"] == {"200": stats["writes"]}, stats
    assert stats["writes"] > 200, stats
    proxy_writes = [e for e in kc.audit(user=f"system:serviceaccount:{ns}:{name}", name=f"{name}-0")
                    if e.get("verb") in ("patch", "update", "create")]
    assert proxy_writes, "the proxy wrote nothing?"
    other = [(e["verb"], e.get("userAgent"), e["responseStatus"].get("code")) for e in proxy_writes
             if e["responseStatus"].get("code") != 200]
    print(f"proxy writes: {len(proxy_writes)}; not 200: {other}")
    # the one expected non-200: TS_AUTH_ONCE's JSON-patch removal of an `authkey` key that is not there (the
    # key came from TS_AUTHKEY), which the API server answers 422 and the agent counts as done
    assert all(code == 422 and verb == "patch" for verb, _, code in other), other
    assert len(other) <= 1, other
    assert "Deleting authkey from Kubernetes Secret" in _logs(kc, ns, f"{name}-0") or not other
    final = _secret(kc, ns, f"{name}-0")
    for k in ("_machinekey", "_profiles", "_current-profile", "device_id", "device_ips", "pod_uid"):
        assert final.get(k), f"{k} lost; keys {sorted(final)}"
    assert final["operator-key"] == str(stats["writes"]).encode()
    v4 = next(i for i in json.loads(data["device_ips"]) if ":" not in i)
    lab.wait_peer("client", hostname, 60)
    assert kc.marker in _curl(lab, v4, kc.marker, "after-concurrent-writes", 60)
    kc.kubectl("-n", ns, "delete", "statefulset", name, "--wait=true", timeout=90)
    lab.delete_node(hostname)


def test_conflicts_on_secret_writes_are_retried(lab, kube, tmp_path):
    """A 409 Conflict on the agent's Secret writes, from the real API server: a validating admission webhook
    (labtools.conflictwebhook, TLS from the lab CA, scoped to the proxy's ServiceAccount and state Secret) denies
    the first 2 writes of each new value of ``pod_uid`` (the boot write) and ``device_fqdn`` (the first device
    keys, and again after a device rename) with ``code: 409, reason: Conflict``. The agent logs each conflict,
    writes again and the keys land; the data path works; the container never restarts (upstream's exits on any
    failed Secret write, so Kubernetes restarts it). The 409 path does not depend on the firewall backend: this
    runs in the iptables cluster only."""
    import sys

    from labtools import conflictwebhook as cw
    kc, ns, name = kube, "tsconflict", "co"
    if kc.firewall != "iptables":
        pytest.skip("the 409 path does not depend on the firewall backend; it runs in the iptables cluster")
    hostname = f"{name}-{kc.firewall[:3]}"
    user = f"system:serviceaccount:{ns}:{name}"
    lab.delete_node(hostname)
    kc.apply([kubemanifests.namespace(ns), *kubemanifests.proxy_rbac(ns, name, f"{name}-0"),
              kubemanifests.secret(ns, f"{name}-0")])
    crt, key = kc.serving_cert("conflict-webhook", (f"IP:{kc.cfg.api_host}",))
    record = tmp_path / "reviews.jsonl"
    hook = kc.popen([sys.executable, "-m", "labtools.conflictwebhook", "--listen", f"{kc.cfg.api_host}:0",
                     "--cert", str(crt), "--key", str(key), "--deny", "pod_uid=2", "--deny", "device_fqdn=2",
                     "--deny", "lab-probe=1", "--record", str(record)],
                    env={"PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True)
    cfg_name = f"lab-conflict-{ns}"
    try:
        port = json.loads(hook.stdout.readline())["port"]
        kc.apply(cw.webhook_configuration(cfg_name, f"https://{kc.cfg.api_host}:{port}/validate",
                                          kc.ca_cert.read_bytes(), namespace=ns, username=user,
                                          secret=f"{name}-0"))
        # the API server uses the configuration once its informer has it: probe as the proxy's ServiceAccount
        # until a write gets the webhook's 409 (each new probe value is denied once)
        sa_token = kc.service_account_token(ns, name)
        probe = iter(range(1000))

        def webhook_live() -> bool:
            code, body = kc.request("PATCH", f"/api/v1/namespaces/{ns}/secrets/{name}-0",
                                    {"stringData": {"lab-probe": str(next(probe))}}, token=sa_token,
                                    content_type="application/strategic-merge-patch+json")
            assert code in (200, 409), (code, body)
            if code == 409:
                assert body["reason"] == "Conflict" and cw.WEBHOOK_NAME in body["message"], body
            return code == 409
        wait_until(webhook_live, 30, 0.5, "the conflict webhook in force")

        _deploy_proxy(lab, kc, ns, name)
        pod = kc.wait_pod_ready(ns, f"{name}-0", 120)
        data = _wait_device(kc, ns, f"{name}-0")
        assert data["pod_uid"].decode() == pod["metadata"]["uid"]
        nodes = [n for n in lab.hs_nodes() if n.get("name") == hostname]
        assert len(nodes) == 1, nodes
        v4 = next(i for i in json.loads(data["device_ips"]) if ":" not in i)
        lab.wait_peer("client", hostname, 60)
        assert kc.marker in _curl(lab, v4, kc.marker, "after-boot-conflicts", 60)

        # a device rename: the new FQDN meets 2 conflicts too, and lands
        lab.hs("nodes", "rename", "--identifier", str(nodes[0]["id"]), f"{hostname}-renamed")
        wait_until(lambda: (_secret(kc, ns, f"{name}-0") or {}).get("device_fqdn", b"").startswith(
            f"{hostname}-renamed.".encode()), 90, 1, "the renamed device's FQDN in the Secret")
        assert kc.marker in _curl(lab, v4, kc.marker, "after-rename-conflicts", 30)
    finally:
        kc.kubectl("delete", "validatingwebhookconfiguration", cfg_name, "--ignore-not-found", check=False)
        hook.terminate()
        try:
            hook.wait(10)
        except subprocess.TimeoutExpired:
            hook.kill()
            hook.wait()

    # what the webhook denied: the proxy's writes of the boot keys and of each FQDN, 2 each
    reviews = [json.loads(ln) for ln in record.read_text().splitlines()]
    denied = [r for r in reviews if not r["allowed"] and "lab-probe" not in r["denied"]]
    print(f"webhook reviews: {len(reviews)}, denied: {[r['denied'] for r in denied]}")
    assert all(r["user"] == user and r["name"] == f"{name}-0" and r["code"] == 409 for r in denied), denied
    assert sorted(r["denied"].split(" ")[0] for r in denied) == ["device_fqdn"] * 4 + ["pod_uid"] * 2, denied
    # ... the API server's own record: the proxy's writes answered 409, as many as the webhook denied
    conflicts = [e for e in kc.audit(user=user, name=f"{name}-0")
                 if e.get("verb") == "patch" and e["responseStatus"].get("code") == 409
                 and (e.get("userAgent") or "").startswith("containerboot-py")]
    assert len(conflicts) == len(denied), [(e.get("userAgent"), e["responseStatus"]) for e in conflicts]
    # what the user sees: each conflict logged with the webhook's reason, then the write done; no failed write,
    # no restart, no secret value in the log
    log = _logs(kc, ns, f"{name}-0")
    lines = [ln for ln in log.splitlines() if "answered 409 Conflict" in ln]
    print("\n".join(lines))
    assert len(lines) == len(denied), log[-4000:]
    assert all("retrying in" in ln and cw.WEBHOOK_NAME in ln for ln in lines), lines
    assert "failed to update Secret" not in log and "error clearing previous state" not in log, log[-4000:]
    assert lab.authkey not in log
    p = kc.get("pod", f"{name}-0", ns)
    assert p["metadata"]["uid"] == pod["metadata"]["uid"]
    assert p["status"]["containerStatuses"][0]["restartCount"] == 0, "the agent restarted"
    final = _secret(kc, ns, f"{name}-0")
    for k in ("_machinekey", "_profiles", "_current-profile", "device_id", "device_ips", "pod_uid",
              "tailscale_capver"):
        assert final.get(k), f"{k} lost; keys {sorted(final)}"
    kc.kubectl("-n", ns, "delete", "statefulset", name, "--wait=true", timeout=90)
    for n in (hostname, f"{hostname}-renamed"):
        lab.delete_node(n)
