"""A real Kubernetes (v1.34.4, built by scripts/install-kubernetes.sh) in the lab: labtools.kubecluster.

1. The control plane alone, on 127.0.0.1 with free ports (what the controller's tests and benchmark use):
   real RBAC (a Role's resourceNames give 403, not 404), TokenRequest, 409 on a stale write; close() leaves
   no process and no file.
2. A node in the island (containerd + kubelet + kube-proxy + CNI in the namespace <prefix>-k8s), with
   kube-proxy in iptables and in nftables mode: Node Ready,
   a Deployment behind a ClusterIP Service answers through kube-proxy, from the node and from the island's
   proxy namespace routed through the node; close() leaves no namespace, cgroup, mount or process.
The agent's own scenarios in this cluster are in test_realkube_agent_e2e.py.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from labtools import kubecluster, kubemanifests
from labtools.lab import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(600)]


def _host_firewall() -> list[str]:
    """KUBE-*/CNI-* chains or kube-proxy tables in the host's own firewall (there must never be any)."""
    found = []
    for tool in ("iptables-save", "ip6tables-save"):
        cp = subprocess.run([tool], capture_output=True, text=True)
        found += [ln for ln in cp.stdout.splitlines() if "KUBE-" in ln or "CNI-" in ln]
    cp = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    return found + [ln for ln in cp.stdout.splitlines() if "kube-proxy" in ln]


def _leftovers(kc: kubecluster.KubeCluster) -> list[str]:
    """Whatever of the cluster is still on the machine: processes, mounts, cgroups, its namespace, files."""
    left = []
    run = str(kc.run_dir)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if run in cmd:
                left.append(f"process {d.name}: {cmd[:150]}")
    left += [f"mount {ln}" for ln in Path("/proc/self/mounts").read_text().splitlines() if run in ln]
    for m in Path("/sys/fs/cgroup").iterdir():
        if (m / kc.cfg.cgroup_root.lstrip("/")).exists():
            left.append(f"cgroup {m / kc.cfg.cgroup_root.lstrip('/')}")
    if kc.netns and Path(f"/run/netns/{kc.netns}").exists():
        left.append(f"netns {kc.netns}")
    if kc.lab is not None and "sw" in kc.lab.namespaces:
        sw = kc.lab.namespaces["sw"].netns
        if subprocess.run(["ip", "-n", sw, "link", "show", "v-k8s"], capture_output=True).returncode == 0:
            left.append("the node's veth v-k8s on the island bridge (a next cluster could not attach)")
    if kc.run_dir.exists():
        left.append(f"run dir {run}")
    return left


def test_control_plane_alone_real_rbac_and_clean_close(k8s_bin_dir):
    kc = kubecluster.KubeCluster.start(bin_dir=k8s_bin_dir)
    try:
        assert kc.server.startswith("https://127.0.0.1:")
        ver = json.loads(kc.kubectl("version", "-o", "json").stdout)
        assert ver["serverVersion"]["gitVersion"] == kubecluster.K8S_VER
        ns = "rbac-check"
        kc.apply([kubemanifests.namespace(ns), *kubemanifests.proxy_rbac(ns, "px", "px-state", verbs=("get",)),
                  kubemanifests.secret(ns, "px-state"), kubemanifests.secret(ns, "other")])
        sa_token = kc.service_account_token(ns, "px")
        kcfg = kc.write_kubeconfig(kc.run_dir / "px.json", sa_token)
        cp = kc.run([str(k8s_bin_dir / "kubectl"), f"--kubeconfig={kcfg}", "auth", "whoami", "-o", "json"])
        assert json.loads(cp.stdout)["status"]["userInfo"]["username"] == f"system:serviceaccount:{ns}:px"
        assert kc.request("GET", f"/api/v1/namespaces/{ns}/secrets/px-state", token=sa_token)[0] == 200
        # outside the Role's resourceNames: 403 for the ServiceAccount (the admin gets 404 for a missing one)
        assert kc.request("GET", f"/api/v1/namespaces/{ns}/secrets/other", token=sa_token)[0] == 403
        assert kc.request("GET", f"/api/v1/namespaces/{ns}/secrets/missing")[0] == 404
        code, body = kc.request("PATCH", f"/api/v1/namespaces/{ns}/secrets/px-state", {"data": {"a": "YQ=="}},
                                token=sa_token, content_type="application/strategic-merge-patch+json")
        assert code == 403 and "patch" in body["message"], body
        # a write with a stale resourceVersion is a 409 Conflict
        _, s = kc.request("GET", f"/api/v1/namespaces/{ns}/secrets/px-state")
        assert kc.request("PUT", f"/api/v1/namespaces/{ns}/secrets/px-state", {**s, "data": {"a": "YQ=="}})[0] == 200
        assert kc.request("PUT", f"/api/v1/namespaces/{ns}/secrets/px-state", {**s, "data": {"b": "Yg=="}})[0] == 409
        rss = kc.rss_mb()
        print(f"control plane: timings {kc.timings}, RSS MiB {rss}")
        assert set(rss) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
    finally:
        kc.close()
    assert _leftovers(kc) == []


@pytest.fixture(scope="module", params=["iptables", "nftables"])
def cluster(request, lab, k8s_bin_dir):
    """A cluster with a node, per kube-proxy mode."""
    kc = kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin_dir, proxy_mode=request.param)
    try:
        yield kc
    finally:
        kc.close()
        assert _leftovers(kc) == []
        assert "k8s" not in lab.namespaces


def test_node_ready_and_a_clusterip_through_kube_proxy(lab, cluster):
    kc = cluster
    print(f"node cluster: timings {kc.timings}, RSS MiB {kc.rss_mb()}")
    assert kc.node_ready()
    node = kc.get("node", kubecluster.NODE_NAME)
    assert node["status"]["nodeInfo"]["kubeletVersion"] == kubecluster.K8S_VER
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://1.")
    # the controller-manager publishes the cluster CA into every namespace, asynchronously: the node can be Ready
    # before its root-CA publisher has run for "default" (seen once with an 8 s Ready)
    cm = wait_until(lambda: kc.get("configmap", "kube-root-ca.crt", "default"), 30, 0.2,
                    "the controller-manager's kube-root-ca.crt in namespace default")
    assert cm["data"]["ca.crt"] == kc.ca_cert.read_text()
    ns = "echo"
    kc.apply([kubemanifests.namespace(ns), *kubemanifests.echo_backend(ns, "echo", "echo-ok", kubecluster.ECHO_IMAGE)])
    kc.kubectl("-n", ns, "rollout", "status", "deployment/echo", "--timeout=90s", timeout=100)
    svc = kc.get("service", "echo", ns)
    cip = svc["spec"]["clusterIP"]
    pod = json.loads(kc.kubectl("-n", ns, "get", "pods", "-l", "app=echo", "-o", "json").stdout)["items"][0]
    assert pod["status"]["podIP"].startswith(kc.pod_cidr.rsplit(".", 2)[0])
    # kube-proxy programs the Service once it sees the ready endpoint (its sync is rate-limited to 1/s)
    out = wait_until(lambda: kc.run(["curl", "-sS", "-m", "5", f"http://{cip}:8080/via-clusterip"]).stdout, 30, 0.5,
                     "the ClusterIP answering from the node")
    assert out.startswith("echo-ok\n") and f"host={pod['metadata']['name']}" in out
    # from the island: the proxy namespace routes the service range through the node, as a Pod would not
    # need to; kube-proxy DNATs it to the Pod
    lab.exec("proxy", ["ip", "route", "replace", kc.cfg.service_cidr, "via", kc.cfg.api_host], check=True)
    try:
        body = lab.wait_curl("proxy", f"http://{cip}:8080/from-island", "echo-ok", timeout=20)
        assert "path=/from-island" in body
    finally:
        lab.exec("proxy", ["ip", "route", "del", kc.cfg.service_cidr], check=False)
    # the Pod's logs go through the kubelet with the API server's client certificate
    assert kc.kubectl("-n", ns, "logs", pod["metadata"]["name"]).returncode == 0
    assert _host_firewall() == []
    # kube-proxy's own rules, in its mode, live in the cluster's namespace only
    if kc.cfg.proxy_mode == "nftables":
        assert "kube-proxy" in kc.run(["nft", "list", "tables"]).stdout
    else:
        assert "KUBE-SERVICES" in kc.run(["iptables-save", "-t", "nat"]).stdout


def test_a_killed_owner_is_reaped(k8s_bin_dir, tmp_path):
    """The test process SIGKILLed with its cluster running: `make clean-lab` (kubecluster.reap_stale) removes
    the cluster's processes, cgroups and run directory."""
    import signal
    import sys
    script = tmp_path / "owner.py"
    script.write_text("import sys, time\nfrom labtools.kubecluster import KubeCluster\n"
                      f"kc = KubeCluster.start(bin_dir={str(k8s_bin_dir)!r})\n"
                      # not a wait: the owner keeps running until killed
                      "print(kc.run_dir, kc.cfg.name, flush=True)\ntime.sleep(600)\n")
    repo = str(Path(__file__).resolve().parent.parent)
    # the lab tooling is not part of the installed package: the script imports it from the checkout
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=repo,
                         env={**os.environ, "PYTHONPATH": repo})
    try:
        run_dir, name = p.stdout.readline().split()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    kc = kubecluster.KubeCluster(kubecluster.ClusterConfig(name, Path(run_dir), k8s_bin_dir, "127.0.0.1"))
    assert _leftovers(kc), "nothing was running?"
    assert name in kubecluster.reap_stale()
    assert _leftovers(kc) == []
