"""The companion controller installed in the lab's real Kubernetes, as a user would (tests, demo, bench).

API (root; a running ``labtools.lab.Lab`` and a ``KubeCluster`` with a node)::

    proxy_tar, controller_tar = build_images()          # images/build.sh, both images (podman cache: seconds)
    install(kc, lab, proxy_tar, controller_tar)         # import both, helm install the chart with the lab's
                                                        # headscale, rollout status (method="kubectl": deploy/)
    uninstall(kc)                                       # helm uninstall
    svc = wait_service_ip(kc, "apps", "web")            # the Service once its status has a tailnet IP
    controller_log(kc)                                  # the controller Pod's log (for failures)

What ``install`` sets is the headscale user story of docs/controller.md, nothing test-only in the controller. With helm
(the default): ``helm install`` of charts/tailscale-controller with ``provider=headscale``, ``headscale.url``,
``magicDNSSuffix``, the proxy image, and an API key made with the lab's headscale passed as
``credentials.headscaleAPIKey`` through stdin (never on a command line); helm's output (its NOTES) is kept in
``kc.helm_output``. With ``method="kubectl"`` (``make demo DEMO_ARGS=--controller``): ``kubectl apply -R -f
deploy/``, the key in Secret ``headscale-api`` and ``kubectl set env`` of the same settings. Either way the
controller image is imported into the node's containerd (no registry). What the lab itself needs is
``PROXY_ENV`` (chart value ``proxy.env``, upstream's ProxyClass ``tailscaleContainer.env``): tailscaled's lab
knobs (DERP over plain HTTP to headscale's embedded DERP, no log upload, no port mapper). The proxies find the
API server as in any cluster, at ``kubernetes.default.svc`` through the cluster's CoreDNS.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from labtools import helmchart, kubecluster
from labtools import image as labimage
from labtools import lab as labmod
from labtools.lab import wait_until

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
#: LAB_PROXY_IMAGE / LAB_CONTROLLER_IMAGE build and install the images under other names: image archives are
#: shared by every checkout on a machine, so a branch whose images differ tests its own under its own tag
PROXY_IMAGE = labimage.IMAGE
CONTROLLER_IMAGE = os.environ.get("LAB_CONTROLLER_IMAGE") or "localhost/containerboot-py-controller:latest"
CONTROLLER_DOCKERFILE = "images/controller/Dockerfile"
NS = "tailscale"
#: Where a lab cluster with CoreDNS (labtools.coredns) has its Corefile: the controller keeps the stub zone there.
STUB_ZONE = "kube-system/coredns"
#: tailscaled's knobs for the lab's island (as labtools.lab.Lab.tailscaled_env)
LAB_PROXY_ENV = {"TS_NO_LOGS_NO_SUPPORT": "true", "TS_DEBUG_USE_DERP_HTTP": "true", "TS_DISABLE_PORTMAPPER": "1",
                 "TS_ASSUME_NETWORK_UP_FOR_TEST": "1"}


def _build(*args: str) -> Path:
    cp = subprocess.run(["bash", str(REPO / "images" / "build.sh"), *args], capture_output=True, text=True,
                        timeout=3600)
    if cp.returncode != 0:
        raise RuntimeError(f"images/build.sh {' '.join(args)} failed:\n{cp.stderr[-4000:]}")
    p = Path(subprocess.run(["bash", str(REPO / "images" / "build.sh"), *args, "--print-archive"],
                            capture_output=True, text=True, check=True).stdout.strip())
    if not p.is_file():
        raise RuntimeError(f"images/build.sh {' '.join(args)}: no archive at {p}")
    return p


def build_images() -> tuple[Path, Path]:
    """Both images' OCI archives, built (or found up to date) by the project's image build: the proxy
    (``make image``) and the controller (``images/controller/Dockerfile``). Raises RuntimeError with the build's
    log tail; ``scripts/setup.sh --image`` installs the build's packages first."""
    cp = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--image"], capture_output=True, text=True,
                        timeout=1800)
    if cp.returncode != 0:
        raise RuntimeError(f"scripts/setup.sh --image failed: {cp.stderr[-1500:]}")
    return _build("--name", PROXY_IMAGE), _build("--dockerfile", CONTROLLER_DOCKERFILE, "--name", CONTROLLER_IMAGE)


def lab_values(firewall: str = "", api_key: str = "", stub_zone: str = "", user: str = "") -> dict:
    """The chart's values for the lab: its headscale, the project's proxy image (imported, never pulled);
    `stub_zone`: CoreDNS's ConfigMap for the DNSConfig stub zone (a cluster with CoreDNS); `user`: headscale.user
    (a headscale older than 0.28 mints no key without one)."""
    # <registry>/<repository>:<tag>, the chart's three parts; both lab images are under localhost/
    reg, _, crepo = CONTROLLER_IMAGE.rpartition(":")[0].partition("/")
    ctag = CONTROLLER_IMAGE.rpartition(":")[2]
    preg, _, repo = PROXY_IMAGE.rpartition(":")[0].partition("/")
    tag = PROXY_IMAGE.rpartition(":")[2]
    if preg != reg:
        raise ValueError(f"the chart takes one registry for both images: {PROXY_IMAGE} and {CONTROLLER_IMAGE}")
    v: dict = {"imageRegistry": reg, "image": {"repository": crepo, "tag": ctag, "pullPolicy": "Never"},
               "provider": "headscale", "headscale": {"url": labmod.LOGIN_SERVER}, "magicDNSSuffix": "tailnet.test",
               "proxy": {"image": {"repository": repo, "tag": tag, "pullPolicy": "Never"}, "firewallMode": firewall,
                         "env": LAB_PROXY_ENV}}
    if api_key:
        v["credentials"] = {"headscaleAPIKey": api_key}
    if user:
        v["headscale"]["user"] = user
    if stub_zone:
        v["dns"] = {"stubZoneConfigMap": stub_zone}
    return v


def helm(kc: kubecluster.KubeCluster, *args: str, input: str | None = None, timeout: float = 120.0,
         check: bool = True) -> subprocess.CompletedProcess:
    """The pinned helm as the cluster's admin, in the cluster's network namespace."""
    h = helmchart.helm_bin()
    if h is None:
        raise kubecluster.ClusterError("helm is not built: run make setup-bin (scripts/install-helm.sh)")
    return kc.run([str(h), "--kubeconfig", str(kc.kubeconfig), *args], input=input, check=check, timeout=timeout)


def install(kc: kubecluster.KubeCluster, lab: labmod.Lab, proxy_tar: Path, controller_tar: Path, *,
            firewall: str = "", method: str = "helm", timeout: float = 120.0,
            values: dict | None = None) -> dict[str, float]:
    """Import both images, install the controller (the chart with helm, or deploy/ with kubectl) configured for
    the lab's headscale; returns timings (s). `values`: more chart values (helm only), e.g.
    ``{"apiServerProxy": {"mode": "auth"}}``."""
    t: dict[str, float] = {}
    t0 = time.monotonic()
    kc.import_image(proxy_tar)
    kc.import_image(controller_tar)
    t["import"] = time.monotonic() - t0
    t0 = time.monotonic()
    key = lab.hs("apikeys", "create", "--expiration", "2h")
    key = key if isinstance(key, str) else str((key or {}).get("key") or key)
    # as the install guide says for headscale 0.26 and 0.27: keys for a user (the lab's), tag-only from 0.28
    user = str(lab.user_id) if lab.hs_minor < (0, 28) and lab.user_id is not None else ""
    if method == "helm":
        # the key goes in through stdin (a values file "-"), never on a command line
        cp = helm(kc, "install", helmchart.RELEASE, str(helmchart.CHART), "--namespace", NS, "--create-namespace",
                  "-f", "-", input=json.dumps({**lab_values(firewall, key, STUB_ZONE if kc.cfg.cluster_dns else "",
                                                            user), **(values or {})}), timeout=timeout)
        kc.helm_output = cp.stdout + cp.stderr
    elif method == "kubectl":
        # deploy/ names the controller's image in a placeholder registry: replaced before applying, as a kubectl
        # user edits deploy/20-controller.yaml (PROXY_IMAGE is set below, with the other settings)
        placeholder = f"{helmchart.DEPLOY_REGISTRY}/containerboot-py-controller:{helmchart.chart_meta()['appVersion']}"
        docs = [f.read_text() for f in sorted(DEPLOY.rglob("*.yaml"))]
        assert any(placeholder in d for d in docs), f"deploy/ does not name {placeholder}"
        kc.kubectl("apply", "-f", "-", input="\n---\n".join(d.replace(placeholder, CONTROLLER_IMAGE) for d in docs),
                   timeout=60)
        kc.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "headscale-api", "namespace": NS},
            "type": "Opaque", "data": {"key": base64.b64encode(key.encode()).decode()}}))
        env = {"CONTROL_PLANE": "headscale", "HEADSCALE_URL": labmod.LOGIN_SERVER,
               "TS_MAGICDNS_SUFFIX": "tailnet.test", "PROXY_IMAGE": PROXY_IMAGE, "PROXY_IMAGE_PULL_POLICY": "Never",
               "PROXY_FIREWALL_MODE": firewall, "PROXY_ENV": json.dumps(LAB_PROXY_ENV, sort_keys=True),
               **({"HEADSCALE_USER": user} if user else {})}
        kc.kubectl("-n", NS, "set", "env", "deployment/tailscale-controller", *[f"{k}={v}" for k, v in env.items()])
    else:
        raise ValueError(f"method={method!r}; use helm or kubectl")
    cp = kc.kubectl("-n", NS, "rollout", "status", "deployment/tailscale-controller", f"--timeout={int(timeout)}s",
                    check=False, timeout=timeout + 10)
    if cp.returncode != 0:
        raise kubecluster.ClusterError(f"the controller's Deployment did not roll out: {cp.stderr.strip()}\n"
                                       f"{controller_log(kc)}")
    # a rolled-out Deployment can still crash right after (kopf starting its operators): wait for both to log in
    try:
        wait_until(lambda: controller_log(kc, 400).count("Initial authentication has finished") >= 2, 60, 0.5,
                   "the controller's two kopf operators to start")
    except TimeoutError:
        raise kubecluster.ClusterError(f"the controller did not start:\n{controller_log(kc, 200)}") from None
    t["rollout"] = time.monotonic() - t0
    return t


def uninstall(kc: kubecluster.KubeCluster, timeout: float = 120.0) -> str:
    """``helm uninstall --wait --cascade foreground`` of the controller's release (so the Deployment's Pods are
    gone too when it returns); returns helm's output."""
    cp = helm(kc, "uninstall", helmchart.RELEASE, "--namespace", NS, "--wait", "--cascade", "foreground",
              f"--timeout={int(timeout)}s", timeout=timeout + 10)
    return cp.stdout + cp.stderr


def controller_pod(kc: kubecluster.KubeCluster) -> dict | None:
    cp = kc.kubectl("-n", NS, "get", "pods", "-l", "app=tailscale-controller", "-o", "json", check=False)
    items = json.loads(cp.stdout or "{}").get("items") or [] if cp.returncode == 0 else []
    running = [p for p in items if not p["metadata"].get("deletionTimestamp")]
    return running[0] if running else None


def controller_log(kc: kubecluster.KubeCluster, tail: int = 80) -> str:
    cp = kc.kubectl("-n", NS, "logs", "deployment/tailscale-controller", f"--tail={tail}", check=False)
    return f"--- controller log\n{cp.stdout}{cp.stderr}"


def lb_ips(svc: dict | None) -> list[str]:
    return [i["ip"] for i in ((svc or {}).get("status", {}).get("loadBalancer", {}).get("ingress") or []) if "ip" in i]


def wait_service_ip(kc: kubecluster.KubeCluster, namespace: str, name: str, timeout: float = 150.0) -> dict:
    """The Service once the controller wrote a tailnet IP into its LoadBalancer status."""
    def ready() -> dict | None:
        s = kc.get("service", name, namespace)
        return s if lb_ips(s) else None
    return wait_until(ready, timeout, 0.5, f"a tailnet IP in Service {namespace}/{name}'s status")


#: What the controller makes for a parent: its proxy, and the proxy's own identity (controller/proxyrbac.py).
CHILD_KINDS = ("statefulsets", "secrets", "services", "pods", "serviceaccounts", "roles", "rolebindings")
#: children() once a parent's proxy is gone.
NO_CHILDREN = {k: [] for k in CHILD_KINDS}


def children(kc: kubecluster.KubeCluster, namespace: str, name: str, kind: str = "svc") -> dict[str, list[str]]:
    """What the controller made for a parent (by its labels), in the controller's namespace."""
    sel = f"tailscale.com/parent-resource={name},tailscale.com/parent-resource-ns={namespace}," \
          f"tailscale.com/parent-resource-type={kind}"
    out: dict[str, list[str]] = {}
    for k in CHILD_KINDS:
        cp = kc.kubectl("-n", NS, "get", k, "-l", sel, "-o", "json")
        out[k] = [i["metadata"]["name"] for i in json.loads(cp.stdout).get("items") or []]
    return out


def secret_data(kc: kubecluster.KubeCluster, namespace: str, name: str) -> dict[str, bytes] | None:
    s: Any = kc.get("secret", name, namespace)
    return None if s is None else {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}
