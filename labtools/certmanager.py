"""cert-manager v1.19.1 in the lab's real cluster, installed as a user installs it: its own Helm chart.

scripts/install-cert-manager.sh builds one static program from the Go module proxy (``cert-manager controller|
webhook|cainjector``, scripts/certmanager/main.go, driving the published module's packages) and copies the
module's CRDs and chart. Here each component becomes a one-file image (labtools.ociimage; entrypoint
``/cert-manager <component>``, user 1000, since the chart's Pods run as non-root) imported into the node's
containerd under the name the chart is told (``image.repository`` and the webhook's and cainjector's), and
``helm install`` of the module's chart with ``crds.enabled=true`` makes everything else: namespace objects,
ServiceAccounts, the ClusterRoles and Roles, the three Deployments with the chart's own arguments, the webhook's
Service and its Validating/MutatingWebhookConfigurations, whose CA bundle the cainjector fills in from the
Secret the webhook makes for itself. The one value changed besides the images: ``startupapicheck.enabled=
false`` (that Job runs cmctl, which is another module, not built here); ``install()`` makes the same check
instead: a ClusterIssuer created through the webhook.

API (root; a ``KubeCluster`` with a node)::

    d = ensure_built()                       # the cache directory (builds when missing; CertManagerError)
    install(kc, d)                           # images, helm install, the three Deployments rolled out, webhook up
    kc.apply(ca_issuer("lab-ca", cert_pem, key_pem))   # a CA key pair in a Secret and a ClusterIssuer using it
    logs(kc)                                 # the three components' logs, for a failure report
    renew(kc, namespace, name)               # what `cmctl renew` does: the Certificate's Issuing condition
"""
from __future__ import annotations

import base64
import datetime
import json
import subprocess
import time
from pathlib import Path

from labtools import kubecluster, kubecontroller, ociimage
from labtools.lab import wait_until

REPO = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = REPO / "scripts" / "install-cert-manager.sh"
VERSION = "v1.19.1"
NS = "cert-manager"
COMPONENTS = ("controller", "webhook", "cainjector")
IMAGES = {c: f"localhost/cert-manager-{c}:{VERSION}" for c in COMPONENTS}
DEPLOYMENTS = {"controller": "cert-manager", "webhook": "cert-manager-webhook",
               "cainjector": "cert-manager-cainjector"}


class CertManagerError(RuntimeError):
    pass


def bin_dir() -> Path:
    out = subprocess.run(["bash", str(INSTALL_SCRIPT), "--print-dir"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def built(d: Path) -> bool:
    return (d / "cert-manager").is_file() and (d / "chart" / "Chart.yaml").is_file()


def ensure_built(timeout: float = 60 * 60) -> Path:
    """The cache directory with the program, CRDs and chart; built by scripts/install-cert-manager.sh if missing
    (under an flock, so two test sessions do not build twice)."""
    d = bin_dir()
    if built(d):
        return d
    import fcntl
    import shutil
    if shutil.which("go") is None:
        raise CertManagerError(f"cert-manager is not built in {d} and there is no Go toolchain to build it")
    lock_path = d.parent / ".build-cert-manager.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if built(d):
            return d
        cp = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=timeout)
        if cp.returncode != 0 or not built(d):
            raise CertManagerError(f"scripts/install-cert-manager.sh failed:\n{cp.stderr[-3000:]}")
    return d


def chart_values() -> list[str]:
    """helm --set arguments: the lab's images, CRDs from the chart, no startupapicheck (cmctl is not built)."""
    sets = {"crds.enabled": "true", "startupapicheck.enabled": "false",
            "image.repository": IMAGES["controller"].rpartition(":")[0],
            "webhook.image.repository": IMAGES["webhook"].rpartition(":")[0],
            "cainjector.image.repository": IMAGES["cainjector"].rpartition(":")[0]}
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


def install(kc: kubecluster.KubeCluster, d: Path, timeout: float = 240.0) -> dict[str, float]:
    """Import the three images, ``helm install`` the module's chart, wait for the Deployments and for the
    webhook to admit a ClusterIssuer (its CA bundle injected by the cainjector). Returns timings (s)."""
    t: dict[str, float] = {}
    t0 = time.monotonic()
    binary = (d / "cert-manager").read_bytes()
    for c in COMPONENTS:
        kc.import_image_bytes(ociimage.oci_archive(IMAGES[c], [ociimage.File("cert-manager", binary)],
                                                   ["/cert-manager", c], user="1000"), f"cert-manager-{c}.tar")
    t["import"] = time.monotonic() - t0
    t0 = time.monotonic()
    kubecontroller.helm(kc, "install", "cert-manager", str(d / "chart"), "--namespace", NS, "--create-namespace",
                        *chart_values(), timeout=timeout)
    for c, dep in DEPLOYMENTS.items():
        cp = kc.kubectl("-n", NS, "rollout", "status", f"deployment/{dep}", f"--timeout={int(timeout)}s",
                        check=False, timeout=timeout + 10)
        if cp.returncode != 0:
            raise CertManagerError(f"cert-manager's {c} did not roll out: {cp.stderr.strip()}\n{logs(kc)}")
    t["rollout"] = time.monotonic() - t0
    # what the chart's startupapicheck Job checks: an object of cert-manager's accepted through the webhook
    probe = {"apiVersion": "cert-manager.io/v1", "kind": "Issuer",
             "metadata": {"name": "startup-check", "namespace": NS}, "spec": {"selfSigned": {}}}
    last: list[str] = []

    def admitted() -> bool:
        cp = kc.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False)
        last[:] = [cp.stderr.strip()]
        return cp.returncode == 0
    try:
        wait_until(admitted, timeout, 1.0, "cert-manager's webhook admitting an Issuer")
    except TimeoutError:
        raise CertManagerError(f"the webhook never admitted an Issuer: {last}\n{logs(kc)}") from None
    t["webhook"] = time.monotonic() - t0 - t["rollout"]
    return t


def ca_issuer(name: str, cert_pem: bytes, key_pem: bytes) -> list[dict]:
    """A CA key pair in a Secret of cert-manager's namespace (the chart's cluster resource namespace) and a
    ClusterIssuer signing with it."""
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return [{"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
             "metadata": {"name": f"{name}-key-pair", "namespace": NS},
             "data": {"tls.crt": b64(cert_pem), "tls.key": b64(key_pem)}},
            {"apiVersion": "cert-manager.io/v1", "kind": "ClusterIssuer", "metadata": {"name": name},
             "spec": {"ca": {"secretName": f"{name}-key-pair"}}}]


def condition(obj: dict | None, kind: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def renew(kc: kubecluster.KubeCluster, namespace: str, name: str) -> None:
    """Force a re-issuance as ``cmctl renew`` does: the Certificate's status gets the condition Issuing=True
    (reason ManuallyTriggered), which cert-manager's issuing controllers act on."""
    cert = kc.get("certificate.cert-manager.io", name, namespace)
    if cert is None:
        raise CertManagerError(f"no Certificate {namespace}/{name}")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    conds = [c for c in (cert.get("status") or {}).get("conditions") or [] if c.get("type") != "Issuing"]
    conds.append({"type": "Issuing", "status": "True", "reason": "ManuallyTriggered", "lastTransitionTime": now,
                  "message": "Certificate re-issuance manually triggered", "observedGeneration":
                  cert["metadata"].get("generation", 1)})
    kc.kubectl("-n", namespace, "patch", "certificate.cert-manager.io", name, "--subresource=status",
               "--type=merge", "-p", json.dumps({"status": {"conditions": conds}}))


def logs(kc: kubecluster.KubeCluster, tail: int = 60) -> str:
    out = []
    for c, dep in DEPLOYMENTS.items():
        cp = kc.kubectl("-n", NS, "logs", f"deployment/{dep}", f"--tail={tail}", check=False)
        out.append(f"--- cert-manager {c}\n{cp.stdout}{cp.stderr}")
    pods = kc.kubectl("-n", NS, "get", "pods", "-o", "wide", check=False)
    return "\n".join(out) + f"\n--- pods\n{pods.stdout}{pods.stderr}"
