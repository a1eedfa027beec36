"""Flux in the lab: source-controller and helm-controller run against the lab's API server as a Flux install
runs them, and the GitOps manifests (OCIRepository, HelmRelease) that install the chart from a registry.

API (root; the controllers from scripts/install-flux.sh)::

    from labtools import fluxlab
    flux = fluxlab.Flux.start(kc)         # CRDs, flux-system with its ServiceAccounts and RBAC, both controllers
    kc.apply(fluxlab.gitops_manifests(fluxlab.LAB_SOURCE, ...))   # what docs/install-gitops.md shows
    fluxlab.wait_release_ready(kc, "tailscale", "tailscale-controller", version)
    flux.close()
    # release B from release A: A's images tagged B, A's chart as B with a CRD change
    fluxlab.release_next(reg, record_a, "0.1.1", workdir)

How Flux runs here, and why so: both controllers are processes in the cluster's network namespace (the
control-plane host), each seeing the API server as its Pod would: a token of its own ServiceAccount in
``flux-system`` (TokenRequest), the cluster's CA and the namespace at the in-cluster path (a private mount
namespace, pod_view_argv) and KUBERNETES_SERVICE_HOST/PORT, so it takes its in-cluster configuration and the
API server sees exactly the identities and RBAC of a Flux install's Pods: each module's own manager
ClusterRole and leader election Role (config/rbac), and helm-controller bound to cluster-admin as Flux's
``cluster-reconciler`` binding does (it applies whatever the chart holds). The flags are the modules' own
Deployment's (``--watch-all-namespaces``, ``--enable-leader-election``, json logs) with
RUNTIME_NAMESPACE=flux-system. Pods would need an image of each controller built offline, imported and run by
the lab's node, for the same API use; a process needs the binary alone. The one difference: source-controller
serves its artifacts (the chart pulled from the registry) over HTTP to helm-controller, and advertises the
address helm-controller fetches them from: in a Flux install the Service ``source-controller.flux-system.svc``,
here the loopback of the network namespace both processes share (``--storage-addr`` and
``--storage-adv-addr`` 127.0.0.1:9790).
"""
from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from labtools import kubecluster, registry
from labtools.lab import stop_process, wait_until

REPO = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = REPO / "scripts" / "install-flux.sh"
FLUX_NS = "flux-system"
CONTROLLERS = ("source-controller", "helm-controller")
STORAGE = "127.0.0.1:9790"
#: each controller's metrics and health addresses (both processes share one network namespace)
PORTS = {"source-controller": ("127.0.0.1:9791", "127.0.0.1:9792"),
         "helm-controller": ("127.0.0.1:9793", "127.0.0.1:9794")}
CHART_MEDIA_TYPE = "application/vnd.cncf.helm.chart.content.v1.tar+gzip"
RELEASE = "tailscale-controller"


class FluxError(RuntimeError):
    pass


def flux_dir() -> Path:
    """Where scripts/install-flux.sh puts both controllers, their CRDs and RBAC (built or not)."""
    cp = subprocess.run(["bash", str(INSTALL_SCRIPT), "--print-dir"], capture_output=True, text=True, timeout=30)
    return Path(cp.stdout.strip().splitlines()[-1])


def binaries_present(d: Path | None = None) -> bool:
    d = d or flux_dir()
    return all((d / c).is_file() for c in CONTROLLERS) and (d / "crds").is_dir() and (d / "rbac").is_dir()


def ensure_binaries(timeout: float = 3600) -> Path:
    """Both controllers built (scripts/install-flux.sh: minutes cold, nothing when built)."""
    cp = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=timeout)
    if cp.returncode != 0:
        raise FluxError(f"scripts/install-flux.sh failed: {cp.stderr[-1500:]}")
    return Path(cp.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ pure: manifests
def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def rbac_manifests(d: Path) -> list[dict]:
    """flux-system, both ServiceAccounts, each module's manager ClusterRole and leader election Role bound to
    its ServiceAccount, and helm-controller's cluster-admin binding (Flux's ``cluster-reconciler``)."""
    objs: list[dict] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": FLUX_NS}}]
    for c in CONTROLLERS:
        sa = {"kind": "ServiceAccount", "name": c, "namespace": FLUX_NS}
        objs.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": c, "namespace": FLUX_NS}})
        (role,) = _docs(d / "rbac" / f"{c}-role.yaml")
        (le,) = _docs(d / "rbac" / f"{c}-leader-election-role.yaml")
        objs += [
            {**role, "metadata": {"name": f"flux-{c}"}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": f"flux-{c}"}, "subjects": [sa],
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"flux-{c}"}},
            {**le, "metadata": {"name": f"{c}-leader-election", "namespace": FLUX_NS}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": f"{c}-leader-election", "namespace": FLUX_NS}, "subjects": [sa],
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": f"{c}-leader-election"}},
        ]
    objs.append({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                 "metadata": {"name": "cluster-reconciler-flux-system"},
                 "subjects": [{"kind": "ServiceAccount", "name": "helm-controller", "namespace": FLUX_NS}],
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                             "name": "cluster-admin"}})
    return objs


def pod_view_argv(argv: Sequence[str], sa_dir: Path) -> list[str]:
    """argv run as a Pod sees its ServiceAccount: in a private mount namespace with a tmpfs on /run (nothing
    reaches the host's) and ``sa_dir`` (token, ca.crt, namespace) bound at the in-cluster path; with
    KUBERNETES_SERVICE_HOST/PORT in its environment the controller takes its in-cluster configuration, as in
    its Pod (it also finds its namespace there, which leader election needs)."""
    sa = "/run/secrets/kubernetes.io/serviceaccount"
    script = (f"set -e; mount -t tmpfs tmpfs /run; mkdir -p {sa}; mount --bind {shlex.quote(str(sa_dir))} {sa}; "
              f"exec {shlex.join(argv)}")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


def controller_argv(d: Path, name: str, storage_dir: Path) -> list[str]:
    """A controller's command line: its module's Deployment's flags, addresses that do not collide."""
    metrics, health = PORTS[name]
    argv = [str(d / name), "--watch-all-namespaces", "--log-level=info", "--log-encoding=json",
            "--enable-leader-election", f"--metrics-addr={metrics}", f"--health-addr={health}"]
    if name == "source-controller":
        argv += [f"--storage-path={storage_dir}", f"--storage-addr={STORAGE}", f"--storage-adv-addr={STORAGE}"]
    return argv


@dataclass(frozen=True)
class Source:
    """Where the chart is and what the HelmRelease says: the parameters of the GitOps manifests."""
    registry: str                 # host:port of the registry
    path: str                     # the registry path the release was pushed under (REGISTRY=<registry>/<path>)
    version: str                  # the chart's tag (spec.ref.tag)
    headscale_url: str
    magic_dns_suffix: str
    namespace: str = "tailscale"
    extra_values: Mapping[str, Any] = field(default_factory=dict)   # the lab's proxy settings


def gitops_manifests(src: Source) -> list[dict]:
    """The namespace with its Pod Security label, the OCIRepository of the chart (the registry's CA in Secret
    registry-ca, its credentials in the dockerconfigjson Secret regcred) and the HelmRelease (CRD policy, values,
    the headscale API key from Secret headscale-api-key). The Secrets themselves are made by hand (never in Git):
    see docs/install-gitops.md."""
    values: dict[str, Any] = {"provider": "headscale", "headscale": {"url": src.headscale_url},
                              "magicDNSSuffix": src.magic_dns_suffix, "imagePullSecrets": [{"name": "regcred"}]}
    for k, v in src.extra_values.items():
        values[k] = v
    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": src.namespace, "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}},
        {"apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "OCIRepository",
         "metadata": {"name": RELEASE, "namespace": src.namespace},
         "spec": {"interval": "10m", "url": f"oci://{src.registry}/{src.path}/charts/{RELEASE}",
                  "ref": {"tag": src.version},
                  "layerSelector": {"mediaType": CHART_MEDIA_TYPE, "operation": "copy"},
                  "secretRef": {"name": "regcred"}, "certSecretRef": {"name": "registry-ca"}}},
        {"apiVersion": "helm.toolkit.fluxcd.io/v2", "kind": "HelmRelease",
         "metadata": {"name": RELEASE, "namespace": src.namespace},
         "spec": {"interval": "10m", "chartRef": {"kind": "OCIRepository", "name": RELEASE},
                  "install": {"crds": "Create"}, "upgrade": {"crds": "CreateReplace"},
                  "values": values,
                  "valuesFrom": [{"kind": "Secret", "name": "headscale-api-key", "valuesKey": "key",
                                  "targetPath": "credentials.headscaleAPIKey"}]}},
    ]


#: the parameters of docs/install-gitops.md's Flux manifests (tests/test_install_gitops_docs.py compares them)
DOCS_SOURCE = Source(registry="registry.example.com:5000", path="tailscale", version="0.1.0",
                     headscale_url="https://headscale.example.com", magic_dns_suffix="tail.example.com")


def secrets_manifests(namespace: str, reg: registry.LabRegistry, api_key: str) -> list[dict]:
    """The three Secrets the manifests name: regcred (pull and OCIRepository credentials), registry-ca, and the
    headscale API key."""
    def b64(s: str | bytes) -> str:
        return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "regcred", "namespace": namespace},
         "type": "kubernetes.io/dockerconfigjson",
         "data": {".dockerconfigjson": b64(registry.dockerconfigjson(reg.address, reg.username, reg.password))}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "registry-ca", "namespace": namespace},
         "data": {"ca.crt": b64(reg.ca_cert.read_bytes())}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "headscale-api-key", "namespace": namespace},
         "data": {"key": b64(api_key)}},
    ]


def condition(obj: Mapping | None, kind: str = "Ready") -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c
    return {}


# ------------------------------------------------------------------ I/O: the controllers
@dataclass
class Flux:
    """Both controllers running against a lab cluster (see the module docstring)."""
    kc: kubecluster.KubeCluster
    dir: Path
    run_dir: Path
    procs: dict[str, subprocess.Popen]

    @classmethod
    def start(cls, kc: kubecluster.KubeCluster, d: Path | None = None, timeout: float = 120.0) -> "Flux":
        d = d or flux_dir()
        if not binaries_present(d):
            raise FluxError(f"Flux's controllers are not built in {d}: run scripts/install-flux.sh")
        run_dir = kc.run_dir / "flux"
        run_dir.mkdir(parents=True, exist_ok=True)
        kc.kubectl("apply", "--server-side", "--field-manager=flux-install", "-f", str(d / "crds"), timeout=120)
        kc.kubectl("wait", "--for=condition=Established", "-f", str(d / "crds"), "--timeout=60s", timeout=70)
        kc.apply(rbac_manifests(d))
        flux = cls(kc, d, run_dir, {})
        try:
            host, _, port = kc.server.removeprefix("https://").rpartition(":")
            for c in CONTROLLERS:
                sa_dir = run_dir / f"{c}-serviceaccount"
                sa_dir.mkdir(exist_ok=True)
                (sa_dir / "token").write_text(kc.service_account_token(FLUX_NS, c, 6 * 3600))
                (sa_dir / "token").chmod(0o600)
                shutil.copy(kc.ca_cert, sa_dir / "ca.crt")
                (sa_dir / "namespace").write_text(FLUX_NS)
                storage = run_dir / "storage"
                storage.mkdir(exist_ok=True)
                log = open(run_dir / f"{c}.log", "ab")
                flux.procs[c] = kc.popen(
                    pod_view_argv(controller_argv(d, c, storage), sa_dir), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True, cwd=str(run_dir),
                    env={"KUBERNETES_SERVICE_HOST": host.strip("[]"), "KUBERNETES_SERVICE_PORT": port,
                         "RUNTIME_NAMESPACE": FLUX_NS, "TUF_ROOT": str(run_dir / ".sigstore")})
                log.close()
            for c in CONTROLLERS:
                flux.wait_ready(c, timeout)
        except BaseException:
            flux.close()
            raise
        return flux

    def wait_ready(self, name: str, timeout: float) -> None:
        health = PORTS[name][1]

        deadline = time.monotonic() + timeout
        while True:
            if self.procs[name].poll() is not None:
                raise FluxError(f"{name} exited ({self.procs[name].returncode}):\n{self.log(name)[-3000:]}")
            cp = self.kc.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://{health}/readyz"],
                             check=False, timeout=10)
            if cp.stdout.strip() == "200":
                return
            if time.monotonic() > deadline:
                raise FluxError(f"{name} not ready after {timeout}s:\n{self.log(name)[-3000:]}")
            time.sleep(0.5)

    def log(self, name: str) -> str:
        p = self.run_dir / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def diagnostics(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {c} log\n{self.log(c)[-chars:]}" for c in CONTROLLERS)

    def close(self) -> None:
        for p in self.procs.values():
            stop_process(p)
        self.procs.clear()


def wait_release_ready(kc: kubecluster.KubeCluster, namespace: str, name: str, version: str,
                       timeout: float = 300.0) -> dict:
    """The HelmRelease once Ready with ``version`` of the chart installed (its last attempted revision)."""
    def ready() -> dict | None:
        hr = kc.get("helmrelease", name, namespace)
        st = (hr or {}).get("status") or {}
        history = st.get("history") or [{}]
        # the version helm-controller records carries the OCI artifact's digest as build metadata (0.1.0+<digest>)
        if condition(hr).get("status") == "True" and history[0].get("chartVersion", "").split("+")[0] == version \
                and st.get("observedGeneration") == (hr or {}).get("metadata", {}).get("generation"):
            return hr
        return None
    return wait_until(ready, timeout, 1.0, f"HelmRelease {namespace}/{name} Ready with chart {version}")


# ------------------------------------------------------------------ I/O: releases into the lab registry
def version() -> str:
    return (REPO / "VERSION").read_text().strip()


def next_patch(v: str) -> str:
    """The next patch release of x.y.z (a pre-release suffix dropped)."""
    major, minor, patch = v.partition("-")[0].split(".")
    return f"{major}.{minor}.{int(patch) + 1}"


def make_release(reg: registry.LabRegistry, out: Path, platforms: str, path: str = "tailscale",
                 timeout: float = 7000) -> dict:
    """`make release` of the version in VERSION into the lab registry (REGISTRY=<registry>/<path>), as a user
    runs it: its record (scripts/release.sh's JSON). The image archives are built on the host first: the image
    build fetches Python build dependencies from PyPI, which the lab's namespaces cannot reach; the release in
    the namespace then finds them cached (by image ID)."""
    v = version()
    cp = subprocess.run(["bash", str(REPO / "images" / "release.sh"), "--registry", f"registry.invalid/{path}",
                         "--tag", v, "--platforms", platforms, "--offline"], capture_output=True, text=True,
                        timeout=timeout)
    if cp.returncode != 0:
        raise FluxError(f"images/release.sh --offline failed: {cp.stderr[-3000:]}")
    cp = reg.run(["make", "-C", str(REPO), "--no-print-directory", "release", f"REGISTRY={reg.address}/{path}",
                  f"PLATFORMS={platforms}", f"REGISTRY_CERT_DIR={reg.cert_dir}", f"REGISTRY_AUTHFILE={reg.authfile}"],
                 check=False, timeout=timeout, env={**os.environ, "RELEASE_OUT": str(out)})
    if cp.returncode != 0:
        raise FluxError(f"make release failed: {cp.stderr[-3000:]}")
    return json.loads((out / f"release-{v}.json").read_text())


# ------------------------------------------------------------------ I/O: the next release
def release_next(reg: registry.LabRegistry, record: Mapping[str, Any], version: str, work: Path,
                 crd_annotation: tuple[str, str]) -> dict:
    """Release ``version`` from the release ``record`` (scripts/release.sh's JSON) without building: each image's
    index tagged ``version`` in the registry (same digest), and the released chart re-packaged with version =
    appVersion = ``version`` (so its references become <image>:<version>@<same digest>) and the ProxyClass CRD
    carrying ``crd_annotation`` (the CRD change of the upgrade), pushed next to it. Returns the same kind of
    record."""
    from labtools import helmchart
    helm = helmchart.helm_bin()
    if helm is None:
        raise FluxError("helm is not built: run make setup-bin")
    prefix = record["registry"]            # <registry>/<path>
    path = prefix.partition("/")[2]
    images = {}
    for name, ref in record["images"].items():
        digest = ref.partition("@")[2]
        reg.tag(f"{path}/{name}", digest, version)
        images[name] = f"{prefix}/{name}:{version}@{digest}"
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HOME": str(work), "HELM_REGISTRY_CONFIG": str(reg.authfile)}
    pulled = work / "pulled"
    shutil.rmtree(pulled, ignore_errors=True)
    pulled.mkdir()
    reg.run([str(helm), "pull", record["chart"]["ref"], "--version", record["version"], "--ca-file",
             str(reg.ca_cert), "--destination", str(pulled)], env=env, timeout=120)
    (tgz,) = pulled.glob("*.tgz")
    src = work / "src"
    shutil.rmtree(src, ignore_errors=True)
    with tarfile.open(tgz) as t:
        t.extractall(src, filter="data")
    chart = src / "tailscale-controller"
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"], meta["appVersion"] = version, version
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    crd = chart / "templates" / "crds" / "tailscale.com_proxyclasses.yaml"
    text = crd.read_text()
    anchor = "  name: proxyclasses.tailscale.com\n  annotations:\n"
    if anchor not in text:
        raise FluxError(f"{crd.name}: no annotations under its name; the chart's layout changed")
    key, val = crd_annotation
    crd.write_text(text.replace(anchor, f"{anchor}    {key}: {json.dumps(val)}\n", 1))
    out = work / "dist"
    out.mkdir(exist_ok=True)
    subprocess.run([str(helm), "package", str(chart), "--destination", str(out)], check=True, capture_output=True,
                   env=env, timeout=60)
    packaged = out / f"tailscale-controller-{version}.tgz"
    t0 = time.monotonic()
    cp = reg.run([str(helm), "push", str(packaged), f"oci://{prefix}/charts", "--ca-file", str(reg.ca_cert)],
                 env=env, timeout=120)
    digest = next((ln.split()[-1] for ln in (cp.stdout + cp.stderr).splitlines() if ln.startswith("Digest:")), "")
    return {"version": version, "registry": prefix, "images": images,
            "chart": {"ref": record["chart"]["ref"], "version": version, "digest": digest},
            "seconds": {"build": 0, "push": round(time.monotonic() - t0)}}


def proxy_images(kc: kubecluster.KubeCluster, namespace: str, statefulset: str) -> list[str]:
    sts = kc.get("statefulset", statefulset, namespace) or {}
    return [c["image"] for c in sts.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])]


def manifests_yaml(objs: Sequence[Mapping]) -> str:
    return yaml.safe_dump_all([dict(o) for o in objs], sort_keys=False)
