"""The Kubernetes variant of the demo (``make demo DEMO_ARGS=--kube``): the agent as a real StatefulSet Pod.

Builds the lab (headscale, a ``client`` tailscaled node), a real cluster with one node in the island
(labtools.kubecluster), imports the proxy image (``make image``), deploys a backend Deployment + ClusterIP
Service and the agent as a StatefulSet Pod exposing that ClusterIP to the tailnet (TS_DEST_IP), then prints
the Pod, the device keys the agent wrote to its state Secret, and a curl from the tailnet client through the
Pod. With ``--once`` it exits after printing: status 0 only if the curl worked.
"""
from __future__ import annotations

import base64
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from labtools import image as labimage
from labtools import kubecluster, kubemanifests
from labtools import lab as labmod
from labtools.lab import Lab, LabError, ensure_binaries, wait_until

REPO = Path(__file__).resolve().parent.parent
IMAGE = labimage.IMAGE


def _say(msg: str) -> None:
    print(msg, flush=True)


# What both cluster demos (this one and labtools.controllerdemo) do the same way.

def controller_images() -> tuple[Path, Path]:
    """Both images the controller's demos run (the proxy's and the controller's), built or found current."""
    from labtools import kubecontroller
    t0 = time.monotonic()
    proxy_tar, ctl_tar = kubecontroller.build_images()
    _say(f"images {kubecontroller.PROXY_IMAGE} and {kubecontroller.CONTROLLER_IMAGE} built "
         f"({time.monotonic() - t0:.1f}s): {proxy_tar}, {ctl_tar}")
    return proxy_tar, ctl_tar


def deploy_backend(kc: kubecluster.KubeCluster, lab: Lab) -> str:
    """The echo backend Deployment and its ClusterIP Service demo/backend, rolled out; returns the marker its
    answers carry."""
    marker = f"echo-ok-{lab.prefix}"
    kc.apply([kubemanifests.namespace("demo"),
              *kubemanifests.echo_backend("demo", "backend", marker, kubecluster.ECHO_IMAGE)])
    kc.kubectl("-n", "demo", "rollout", "status", "deployment/backend", "--timeout=90s", timeout=100)
    return marker


def curl_from_client(lab: Lab, ip: str, path: str, marker: str, route: str) -> None:
    """A curl from the tailnet client to http://<ip>:8080<path>, printed with the route it takes."""
    t0 = time.monotonic()
    body = lab.wait_curl("client", lab.url(ip, 8080, path), marker, timeout=60)
    _say(f"curl client -> http://{ip}:8080{path} ({route}): OK in {time.monotonic() - t0:.1f}s: "
         f"{body.strip().replace(chr(10), ' | ')}")


def report_failure(kc: kubecluster.KubeCluster, e: Exception, *logs: str) -> None:
    _say(f"FAILED: {e}")
    for log in logs:
        _say(log)
    _say(kc.diagnostics())


def hold_open(kc: kubecluster.KubeCluster, k8s_bin: Path, once: bool) -> None:
    """Unless --once, keep the cluster up for a look with kubectl until Ctrl-C."""
    if once:
        return
    _say("cluster is up; press Ctrl-C to tear it down "
         f"(kubectl: ip netns exec {kc.netns} {k8s_bin}/kubectl --kubeconfig {kc.kubeconfig} ...)")
    while True:
        time.sleep(1)


@dataclass(frozen=True)
class Stage:
    """What a controller demo's story runs on: the lab, its one-node cluster, and both images' OCI archives
    (not yet imported: the story installs the controller as it chooses)."""
    lab: Lab
    kc: kubecluster.KubeCluster
    proxy_tar: Path
    ctl_tar: Path
    firewall: str


def run_controller_demo(firewall: str, once: bool, story: Callable[[Stage], bool],
                        logs: Callable[[kubecluster.KubeCluster], list[str]] | None = None) -> int:
    """The frame of every demo with the controller (--controller, --proxygroup, --dns, --apiserver-proxy): the
    binaries and both images, the lab, a one-node cluster, then `story`, whose True is the demo's success. A
    lab, cluster or timeout failure prints the error, `logs` (default: the controller's log) and the cluster's
    diagnostics. Unless `once`, the cluster stays up until Ctrl-C; everything is torn down after. Exit status
    0 only on success."""
    from labtools import kubecontroller
    t_all = time.monotonic()
    bin_dir = ensure_binaries(upstream=False)
    k8s_bin = kubecluster.ensure_binaries()
    proxy_tar, ctl_tar = controller_images()
    ok = False
    with Lab.create(bin_dir=bin_dir, firewall_mode=firewall) as lab:
        _say(f"lab {lab.prefix} up; headscale {lab.login_server}; client tailnet IPs: "
             f"{' '.join(i for i in lab.tailnet_ips('client') if i)}")
        with kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin) as kc:
            _say(f"cluster up: API {kc.server}, node Ready {kc.timings['node_ready']:.1f}s after start")
            try:
                ok = story(Stage(lab, kc, proxy_tar, ctl_tar, firewall))
            except (TimeoutError, LabError, kubecluster.ClusterError) as e:
                report_failure(kc, e, *(logs(kc) if logs else [kubecontroller.controller_log(kc)]))
            hold_open(kc, k8s_bin, once)
    _say(f"done in {time.monotonic() - t_all:.1f}s; everything torn down")
    return 0 if ok else 1


def _image_archive() -> Path:
    t0 = time.monotonic()
    subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--image"], check=True)
    build = ["bash", str(REPO / "images" / "build.sh"), "--name", IMAGE]
    subprocess.run(build, check=True, stdout=subprocess.DEVNULL)
    p = Path(subprocess.run([*build, "--print-archive"], check=True,
                            capture_output=True, text=True).stdout.strip())
    _say(f"proxy image {IMAGE}: {p} ({time.monotonic() - t0:.1f}s)")
    return p


def run(firewall: str, once: bool, timeout: float = 120.0) -> int:
    t_all = time.monotonic()
    bin_dir = ensure_binaries(upstream=False)
    t0 = time.monotonic()
    k8s_bin = kubecluster.ensure_binaries()
    _say(f"Kubernetes {kubecluster.K8S_VER} binaries: {k8s_bin} ({time.monotonic() - t0:.1f}s)")
    t0 = time.monotonic()
    archive = _image_archive()
    figures: dict = {"image_s": time.monotonic() - t0}     # with BENCH_RECORD=1: labcluster.json (bench/runs.py)
    ok = False
    with Lab.create(bin_dir=bin_dir, firewall_mode=firewall) as lab:
        _say(f"lab {lab.prefix} up; client tailnet IPs: {' '.join(i for i in lab.tailnet_ips('client') if i)}")
        with kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin) as kc:
            t = kc.timings
            _say(f"cluster up: API {kc.server}, node {kubecluster.NODE_NAME} Ready {t['node_ready']:.1f}s after "
                 f"start (control plane {t['control_plane']:.1f}s, kubelet to Ready {t['kubelet_to_ready']:.1f}s); "
                 f"kubeconfig {kc.kubeconfig}")
            figures.update(control_plane_s=t["control_plane"], node_ready_s=t["node_ready"],
                           kubelet_to_ready_s=t["kubelet_to_ready"])
            t0 = time.monotonic()
            kc.import_image(archive)
            figures["import_s"] = time.monotonic() - t0
            _say(f"imported {IMAGE} into the node's containerd ({time.monotonic() - t0:.1f}s)")
            marker = deploy_backend(kc, lab)
            cip = kc.get("service", "backend", "demo")["spec"]["clusterIP"]
            _say(f"backend Deployment ready behind Service demo/backend, ClusterIP {cip}:8080")
            env = {k: v for k, v in lab.tailscaled_env(Path("/tmp"), Path("/tmp")).items()
                   if k not in ("PATH", "HOME", "TS_LOGS_DIR")}
            env.update({"TS_DEBUG_FIREWALL_MODE": firewall, "TS_HOSTNAME": "kube-proxy-demo",
                        "TS_AUTHKEY": lab.authkey, "TS_AUTH_ONCE": "true",
                        "TS_EXTRA_ARGS": f"--login-server={labmod.LOGIN_SERVER}",
                        "TS_TAILSCALED_EXTRA_ARGS": "--no-logs-no-support --port=41641"})
            kc.apply([*kubemanifests.proxy_rbac("demo", "proxy", "proxy-0"), kubemanifests.secret("demo", "proxy-0")])
            kc.wait_dns()
            kc.apply(kubemanifests.proxy_statefulset("demo", "proxy", IMAGE, service_account="proxy", dest_ip=cip,
                                                     env=env))
            t0 = time.monotonic()
            try:
                pod = kc.wait_pod_ready("demo", "proxy-0", timeout)
                _say(kc.kubectl("-n", "demo", "get", "pods", "-o", "wide").stdout.rstrip())

                def device() -> dict | None:
                    s = kc.get("secret", "proxy-0", "demo") or {}
                    d = {k: base64.b64decode(v).decode(errors="replace") for k, v in (s.get("data") or {}).items()}
                    return d if d.get("device_ips") else None
                d = wait_until(device, timeout, 0.5, "device keys in Secret demo/proxy-0")
                figures["device_keys_s"] = time.monotonic() - t0
                _say(f"agent Pod {pod['metadata']['name']} (IP {pod['status']['podIP']}) wrote its device keys "
                     f"{time.monotonic() - t0:.1f}s after the StatefulSet was applied; Secret demo/proxy-0 has "
                     f"{sorted(d)}:")
                for k in ("device_id", "device_fqdn", "device_ips", "tailscale_capver", "pod_uid"):
                    _say(f"  {k} = {d.get(k)}")
                v4 = next(i for i in json.loads(d["device_ips"]) if ":" not in i)
                lab.wait_peer("client", "kube-proxy-demo", 60)
                curl_from_client(lab, v4, "/demo-kube", marker,
                                 f"tailnet -> Pod -> ClusterIP {cip} -> kube-proxy -> backend Pod")
                ok = True
            except (TimeoutError, LabError, kubecluster.ClusterError) as e:
                report_failure(kc, e, kc.kubectl("-n", "demo", "logs", "proxy-0", "--tail=80", check=False).stdout)
            rss = figures["rss_mb"] = kc.rss_mb()
            _say("memory (RSS MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(rss.items())))
            hold_open(kc, k8s_bin, once)
    figures["total_s"] = time.monotonic() - t_all
    _say(f"done in {figures['total_s']:.1f}s; everything torn down")
    if ok and once:
        from bench import runs
        if path := runs.record_labcluster(figures):
            _say(f"figures recorded in {path}; the docs are rendered")
    return 0 if ok else 1
