"""The companion controller installed in the lab's real Kubernetes, as a user would (tests, demo, bench).

API (root; a running ``labtools.lab.Lab`` and a ``KubeCluster`` with a node)::

    proxy_tar, controller_tar = build_images()          # images/build.sh, both images (podman cache: seconds)
    install(kc, lab, proxy_tar, controller_tar)         # import both, kubectl apply -R -f deploy/, headscale
                                                        # API key Secret, kubectl set env, rollout status
    svc = wait_service_ip(kc, "apps", "web")            # the Service once its status has a tailnet IP
    controller_log(kc)                                  # the controller Pod's log (for failures)

What ``install`` sets is the README's headscale user story, nothing test-only in the controller: the
Deployment from ``deploy/`` (its image imported into the node's containerd, no registry), an API key made with
the lab's headscale in Secret ``headscale-api``, and ``kubectl set env`` of ``CONTROL_PLANE=headscale``,
``HEADSCALE_URL`` and ``TS_MAGICDNS_SUFFIX``. What the lab itself needs is ``PROXY_ENV`` (upstream's
ProxyClass ``tailscaleContainer.env``): tailscaled's lab knobs (DERP over plain HTTP to headscale's
embedded DERP, no log upload, no port mapper), and ``TS_KUBERNETES_READ_API_SERVER_ADDRESS_FROM_ENV=true``
because the lab has no cluster DNS to resolve ``kubernetes.default.svc``.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from labtools import kubecluster
from labtools import lab as labmod
from labtools.lab import wait_until

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
DEPLOY_CONTROLLER_IMAGE = "localhost/containerboot-py-controller:latest"     # what deploy/ names
#: LAB_PROXY_IMAGE / LAB_CONTROLLER_IMAGE build and install the images under other names: image archives are
#: shared by every checkout on a machine, so a branch whose images differ tests its own under its own tag
PROXY_IMAGE = os.environ.get("LAB_PROXY_IMAGE") or "localhost/containerboot-py:latest"
CONTROLLER_IMAGE = os.environ.get("LAB_CONTROLLER_IMAGE") or DEPLOY_CONTROLLER_IMAGE
CONTROLLER_DOCKERFILE = "images/controller/Dockerfile"
NS = "tailscale"
#: tailscaled's knobs for the lab's island (as labtools.lab.Lab.tailscaled_env), and the API server by address
LAB_PROXY_ENV = {"TS_NO_LOGS_NO_SUPPORT": "true", "TS_DEBUG_USE_DERP_HTTP": "true", "TS_DISABLE_PORTMAPPER": "1",
                 "TS_ASSUME_NETWORK_UP_FOR_TEST": "1", "TS_KUBERNETES_READ_API_SERVER_ADDRESS_FROM_ENV": "true"}


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


def install(kc: kubecluster.KubeCluster, lab: labmod.Lab, proxy_tar: Path, controller_tar: Path, *,
            firewall: str = "", extra_env: dict[str, str] | None = None, timeout: float = 120.0) -> dict[str, float]:
    """Import both images, install deploy/ and configure it for the lab's headscale; returns timings (s)."""
    t: dict[str, float] = {}
    t0 = time.monotonic()
    kc.import_image(proxy_tar)
    kc.import_image(controller_tar)
    t["import"] = time.monotonic() - t0
    t0 = time.monotonic()
    kc.kubectl("apply", "-R", "-f", str(DEPLOY), timeout=60)
    if CONTROLLER_IMAGE != DEPLOY_CONTROLLER_IMAGE:
        kc.kubectl("-n", NS, "set", "image", "deployment/tailscale-controller", f"controller={CONTROLLER_IMAGE}")
    key = lab.hs("apikeys", "create", "--expiration", "2h")
    key = key if isinstance(key, str) else str((key or {}).get("key") or key)
    # the key goes in through stdin, never on a command line
    kc.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "headscale-api", "namespace": NS},
        "type": "Opaque", "data": {"key": base64.b64encode(key.encode()).decode()}}))
    env = {"CONTROL_PLANE": "headscale", "HEADSCALE_URL": labmod.LOGIN_SERVER, "TS_MAGICDNS_SUFFIX": "tailnet.test",
           "PROXY_IMAGE": PROXY_IMAGE, "PROXY_IMAGE_PULL_POLICY": "Never", "PROXY_FIREWALL_MODE": firewall,
           "PROXY_ENV": json.dumps(LAB_PROXY_ENV, sort_keys=True), **(extra_env or {})}
    kc.kubectl("-n", NS, "set", "env", "deployment/tailscale-controller", *[f"{k}={v}" for k, v in env.items()])
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


def children(kc: kubecluster.KubeCluster, namespace: str, name: str, kind: str = "svc") -> dict[str, list[str]]:
    """What the controller made for a parent (by its labels), in the controller's namespace."""
    sel = f"tailscale.com/parent-resource={name},tailscale.com/parent-resource-ns={namespace}," \
          f"tailscale.com/parent-resource-type={kind}"
    out: dict[str, list[str]] = {}
    for k in ("statefulsets", "secrets", "services", "pods"):
        cp = kc.kubectl("-n", NS, "get", k, "-l", sel, "-o", "json")
        out[k] = [i["metadata"]["name"] for i in json.loads(cp.stdout).get("items") or []]
    return out


def secret_data(kc: kubecluster.KubeCluster, namespace: str, name: str) -> dict[str, bytes] | None:
    s: Any = kc.get("secret", name, namespace)
    return None if s is None else {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}
