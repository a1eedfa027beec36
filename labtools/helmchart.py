"""The controller's Helm chart (charts/tailscale-controller) and deploy/, which is rendered from it.

One source of truth: the chart's templates (the CRDs under templates/crds/, as upstream's chart: `helm upgrade`
updates them) are edited; deploy/ (what ``kubectl apply -R -f deploy/``
installs) is ``helm template`` of the chart with its default values plus the one setting the chart requires
(``headscale.url``, the placeholder deploy/ has always carried), written by ``make manifests``
(``python -m labtools.helmchart write``). tests/test_helm_chart.py renders it again and fails when deploy/ is
out of date. deploy/00-namespace.yaml is not rendered: a chart does not create its release's namespace (helm
does, with ``--create-namespace``).

API::

    helm_bin()                     # the pinned helm (scripts/install-helm.sh), or None when not built
    ensure_helm()                  # the same, built first when missing
    template(values, ns)           # the chart rendered with these values (a dict, as a values file): YAML text
    objects(text)                  # the rendered YAML as a list of objects
    manifests()                    # {path under deploy/: text} as `make manifests` writes them
    package(directory)             # `helm package`: directory/tailscale-controller-<version>.tgz
    chart_meta(), project_version()  # Chart.yaml; the file VERSION (images, chart and appVersion agree)
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "tailscale-controller"
DEPLOY = REPO / "deploy"
RELEASE = "tailscale-controller"
#: what deploy/ sets beyond the chart's defaults: the headscale URL and the images' registry are required,
#: deploy/ carries placeholders that a kubectl user replaces (docs/controller.md:
#: `kubectl set env ... HEADSCALE_URL=...`, `kubectl set image ...`)
DEPLOY_REGISTRY = "registry.example.com/tailscale"
DEPLOY_VALUES = {"headscale": {"url": "http://headscale.example:8080"}, "imageRegistry": DEPLOY_REGISTRY}
#: chart file -> deploy/ file
DEPLOY_FILES = {"templates/crds/tailscale.com_connectors.yaml": "crds/tailscale.com_connectors.yaml",
                "templates/crds/tailscale.com_dnsconfigs.yaml": "crds/tailscale.com_dnsconfigs.yaml",
                "templates/crds/tailscale.com_proxygroups.yaml": "crds/tailscale.com_proxygroups.yaml",
                "templates/crds/tailscale.com_proxyclasses.yaml": "crds/tailscale.com_proxyclasses.yaml",
                "templates/crds/tailscale.com_recorders.yaml": "crds/tailscale.com_recorders.yaml",
                "templates/rbac.yaml": "10-rbac.yaml",
                "templates/leader-election.yaml": "12-leader-election.yaml",
                "templates/deployment.yaml": "20-controller.yaml",
                "templates/ingressclass.yaml": "30-ingressclass.yaml"}
HEADER = "# Rendered from charts/tailscale-controller/{src} by `make manifests`: edit the chart, not this file.\n"


class HelmError(Exception):
    """helm failed; str(e) is its stderr."""


def helm_bin() -> Path | None:
    """The pinned helm binary if scripts/install-helm.sh (make setup-bin) built it, else None."""
    d = subprocess.run(["bash", str(REPO / "scripts" / "install-helm.sh"), "--print-dir"], capture_output=True,
                       text=True, check=True).stdout.strip()
    p = Path(d) / "helm"
    return p if p.is_file() else None


def ensure_helm(timeout: float = 1800) -> Path:
    """The pinned helm, built by scripts/install-helm.sh when missing (seconds when it is there); raises
    HelmError with the build's log tail."""
    cp = subprocess.run(["bash", str(REPO / "scripts" / "install-helm.sh")], capture_output=True, text=True,
                        timeout=timeout)
    h = helm_bin()
    if cp.returncode != 0 or h is None:
        raise HelmError(f"scripts/install-helm.sh failed: {cp.stderr[-1500:]}")
    return h


def helm(*args: str, kubeconfig: Path | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run the pinned helm; raises HelmError with its stderr."""
    h = helm_bin()
    if h is None:
        raise HelmError("helm is not built: run make setup-bin (scripts/install-helm.sh)")
    argv = [str(h), *args] + (["--kubeconfig", str(kubeconfig)] if kubeconfig else [])
    with tempfile.TemporaryDirectory() as home:
        # helm's own config/cache/data dirs in a throwaway place: nothing of the user's is read or written
        env = {"PATH": "/usr/bin:/bin", "HELM_CONFIG_HOME": home, "HELM_CACHE_HOME": home, "HELM_DATA_HOME": home}
        cp = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if cp.returncode != 0:
        raise HelmError(cp.stderr.strip())
    return cp


def values_file(values: dict, directory: Path) -> Path:
    """The values as a values file (JSON is YAML) in directory."""
    p = Path(directory) / "values.json"
    p.write_text(json.dumps(values))
    return p


def template(values: dict | None = None, namespace: str = "tailscale", *, crds: bool = True) -> str:
    """``helm template`` of the chart with these values, as the release tailscale-controller in namespace."""
    with tempfile.TemporaryDirectory() as d:
        args = ["template", RELEASE, str(CHART), "--namespace", namespace, "-f", str(values_file(values or {}, d))]
        return helm(*args, *(["--include-crds"] if crds else [])).stdout


def chart_meta() -> dict:
    """Chart.yaml."""
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def project_version() -> str:
    """The file VERSION: the package's version (pyproject.toml reads it), the images' VERSION, the chart's
    version and appVersion."""
    return (REPO / "VERSION").read_text().strip()


def package(directory: Path) -> Path:
    """``helm package`` of the chart into directory: tailscale-controller-<version>.tgz."""
    helm("package", str(CHART), "--destination", str(directory))
    return Path(directory) / f"{RELEASE}-{chart_meta()['version']}.tgz"


def objects(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _by_source(text: str) -> dict[str, list[str]]:
    """Rendered documents grouped by the chart file they came from (helm's ``# Source:`` line), in order."""
    out: dict[str, list[str]] = {}
    prefix = f"# Source: {RELEASE}/"
    for doc in text.split("\n---\n"):
        doc = doc.removeprefix("---\n").strip("\n")
        if not doc:
            continue
        first, _, body = doc.partition("\n")
        if not first.startswith(prefix):
            raise HelmError(f"a rendered document without its source line: {first!r}")
        out.setdefault(first[len(prefix):], []).append(body)
    return out


def manifests() -> dict[str, str]:
    """deploy/'s rendered files: {path relative to deploy/: text}."""
    grouped = _by_source(template(DEPLOY_VALUES))
    unknown = set(grouped) - set(DEPLOY_FILES)
    if unknown:
        raise HelmError(f"chart files with no deploy/ file: {sorted(unknown)}; add them to DEPLOY_FILES")
    return {DEPLOY_FILES[src]: HEADER.format(src=src) + "\n---\n".join(docs) + "\n"
            for src, docs in grouped.items()}


def write(deploy: Path = DEPLOY) -> list[str]:
    """Write deploy/ from the chart; returns the files that changed."""
    changed = []
    for rel, text in manifests().items():
        p = deploy / rel
        if not p.is_file() or p.read_text() != text:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            changed.append(rel)
    return changed


if __name__ == "__main__":
    if sys.argv[1:] != ["write"]:
        sys.exit("usage: python -m labtools.helmchart write")
    try:
        print("\n".join(f"deploy/{c}" for c in write()) or "deploy/ is up to date")
    except HelmError as e:
        sys.exit(str(e))
