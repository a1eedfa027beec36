"""A release installed from the lab's registry into the lab's real Kubernetes, pulled as a user's cluster pulls
it (root).

One cluster with a node; the lab's registry (labtools/registry.py: TLS from a private CA, htpasswd auth) runs
on the node's island address; `make release` pushes the version in VERSION to it (both images as multi-arch
indexes, the chart as an OCI artifact; the images are the project's own build, cached by image ID). The node's
containerd trusts the registry's CA through certs.d/<registry>/hosts.toml in its own config dir (no skip-verify,
no archive import: the node has none of the release's images before the install). Then, as a user would:

1. the namespace with its Pod Security label, an image pull Secret (kubernetes.io/dockerconfigjson) for the
   registry, and `helm install oci://<registry>/tailscale/charts/tailscale-controller --version <VERSION>` with
   ``imagePullSecrets``: the controller Pod runs <registry>/containerboot-py-controller:<VERSION>@<index digest>,
   pulled by the node (its imageID is that repository's digest);
2. a Service exposed: its proxy Pod pulls the proxy image the same way (the controller passes the pull Secret
   on), logs in to headscale, and the lab's tailnet client reaches the backend through it;
3. a Pod naming the same image without the pull Secret, pull policy Always, fails to pull (the registry asks
   for credentials): the images are not public;
4. the arm64 entry of each index (the nodes are amd64): its platform and digest, its manifest and config
   served by the registry say arm64;
5. removal: the Service and `helm uninstall` leave no proxy, and no node in headscale.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest
from needs import unavailable

from labtools import helmchart, kubecluster, kubecontroller, kubemanifests, registry
from labtools import lab as labmod
from labtools.lab import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(7200)]

REPO = Path(__file__).resolve().parent.parent
VERSION = (REPO / "VERSION").read_text().strip()
PLATFORMS = os.environ.get("CB_RELEASE_PLATFORMS", "linux/amd64,linux/arm64")
NS = "tailscale"
INDEX = "application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"


@pytest.fixture(scope="module")
def cluster(lab, k8s_bin_dir):
    if helmchart.helm_bin() is None:
        unavailable("helm is not built: run make setup-bin")
    if not registry.binary_path().exists():
        unavailable("the registry is not built: run scripts/setup.sh --binaries=registry")
    kc = kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin_dir)
    reg = None
    try:
        assert kc.netns is not None
        reg = registry.LabRegistry.start(kc.cfg.run_dir, host=kc.node_ip(kc.nodes[0]), port=5000, netns=kc.netns)
        kc.trust_registry(reg.address, reg.ca_cert.read_bytes())
        yield kc, reg
    except BaseException:
        print(kc.diagnostics())
        raise
    finally:
        if reg is not None:
            reg.close()
        kc.close()


@pytest.fixture(scope="module")
def release(cluster, tmp_path_factory):
    """`make release` into the lab registry: the release record (references, digests)."""
    kc, reg = cluster
    out = tmp_path_factory.mktemp("dist")
    build_archives()
    cp = reg.run(["make", "-C", str(REPO), "--no-print-directory", "release", f"REGISTRY={reg.address}/tailscale",
                  f"PLATFORMS={PLATFORMS}", f"REGISTRY_CERT_DIR={reg.cert_dir}",
                  f"REGISTRY_AUTHFILE={reg.authfile}"], check=False, timeout=7000,
                 env={**os.environ, "RELEASE_OUT": str(out)})
    assert cp.returncode == 0, cp.stderr[-4000:]
    return json.loads((out / f"release-{VERSION}.json").read_text())


def build_archives() -> None:
    """The release's image archives, built on the host first: image builds fetch Python build dependencies
    from PyPI, which the lab's namespaces cannot reach; the release in the namespace then finds them cached."""
    cp = subprocess.run(["bash", str(REPO / "images" / "release.sh"), "--registry", "registry.invalid/tailscale",
                         "--tag", VERSION, "--platforms", PLATFORMS, "--offline"], capture_output=True, text=True,
                        timeout=7000)
    assert cp.returncode == 0, cp.stderr[-4000:]


def _pull_secret(reg: registry.LabRegistry, namespace: str) -> dict:
    data = registry.dockerconfigjson(reg.address, reg.username, reg.password)
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "regcred", "namespace": namespace},
            "type": "kubernetes.io/dockerconfigjson",
            "data": {".dockerconfigjson": base64.b64encode(data.encode()).decode()}}


def _api_key(lab) -> str:
    key = lab.hs("apikeys", "create", "--expiration", "2h")
    return key if isinstance(key, str) else str((key or {}).get("key") or key)


def test_install_from_the_registry_pull_expose_and_remove(lab, cluster, release):
    kc, reg = cluster
    refs = release["images"]
    # nothing of the release is on the node before the install: what runs below was pulled
    assert not [i for i in kc.images() if reg.address in i], kc.images()
    kc.apply([{"apiVersion": "v1", "kind": "Namespace",
               "metadata": {"name": NS, "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}},
              _pull_secret(reg, NS)])
    values = {"provider": "headscale", "headscale": {"url": labmod.LOGIN_SERVER}, "magicDNSSuffix": "tailnet.test",
              "imagePullSecrets": [{"name": "regcred"}], "credentials": {"headscaleAPIKey": _api_key(lab)},
              "proxy": {"firewallMode": lab.firewall_mode, "env": kubecontroller.LAB_PROXY_ENV}}
    kubecontroller.helm(kc, "install", helmchart.RELEASE, f"oci://{reg.address}/tailscale/charts/tailscale-controller",
                        "--version", VERSION, "--namespace", NS, "--ca-file", str(reg.ca_cert),
                        "--registry-config", str(reg.authfile), "-f", "-", input=json.dumps(values), timeout=300)
    kc.kubectl("-n", NS, "rollout", "status", "deployment/tailscale-controller", "--timeout=300s", timeout=310)
    pod = kubecontroller.controller_pod(kc)
    assert pod is not None
    assert pod["spec"]["containers"][0]["image"] == refs["containerboot-py-controller"]
    ctl_digest = refs["containerboot-py-controller"].partition("@")[2]
    (status,) = pod["status"]["containerStatuses"]
    assert status["imageID"].endswith(f"/tailscale/containerboot-py-controller@{ctl_digest}"), status
    pulled = kc.images()
    assert any(i.startswith(f"{reg.address}/tailscale/containerboot-py-controller") for i in pulled), pulled

    # a Service exposed: the proxy Pod pulls the proxy image with the same Secret and carries traffic
    marker = f"release-ok-{lab.prefix}"
    kc.apply([kubemanifests.namespace("apps"),
              *kubemanifests.echo_backend("apps", "echo", marker, kubecluster.ECHO_IMAGE)])
    kc.kubectl("-n", "apps", "rollout", "status", "deployment/echo", "--timeout=90s", timeout=100)
    lab.delete_node("apps-web")
    kc.apply({"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": "web", "namespace": "apps", "annotations": {"tailscale.com/expose": "true"}},
              "spec": {"type": "LoadBalancer", "selector": {"app": "echo"},
                       "ports": [{"port": 8080, "targetPort": 8080}]}})
    svc = kubecontroller.wait_service_ip(kc, "apps", "web", 300)
    ip = kubecontroller.lb_ips(svc)[0]
    made = kubecontroller.children(kc, "apps", "web")
    proxy = kc.get("pod", made["pods"][0], NS)
    assert proxy["spec"]["containers"][0]["image"] == refs["containerboot-py"]
    assert {"name": "regcred"} in proxy["spec"]["imagePullSecrets"]
    lab.wait_peer("client", "apps-web", 60)
    body = lab.wait_curl("client", lab.url(ip, 8080, "/through-release"), marker, timeout=60)
    print(f"curl client -> {ip}:8080 through the released proxy image: {body.splitlines()[0]}")

    # without the Secret, the registry refuses the pull (pull policy Always: the node's copy is not enough)
    kc.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "nocreds", "namespace": "apps"},
              "spec": {"containers": [{"name": "c", "image": refs["containerboot-py"], "imagePullPolicy": "Always",
                                       "command": ["true"]}], "restartPolicy": "Never"}})

    def pull_failed():
        p = kc.get("pod", "nocreds", "apps") or {}
        for s in (p.get("status") or {}).get("containerStatuses") or []:
            w = (s.get("state") or {}).get("waiting") or {}
            if w.get("reason") in ("ErrImagePull", "ImagePullBackOff"):
                return w
        return None
    waiting = wait_until(pull_failed, 120, 0.5, "the pull without credentials refused")
    assert "401" in waiting.get("message", "") or "unauthorized" in waiting.get("message", "").lower(), waiting

    # the arm64 entries of both indexes, though the node is amd64 (CB_RELEASE_PLATFORMS without arm64: skipped)
    for name, ref in refs.items() if "linux/arm64" in PLATFORMS else ():
        digest = ref.partition("@")[2]
        index, served = reg.fetch_json(f"/v2/tailscale/{name}/manifests/{VERSION}", INDEX)
        assert served == digest
        (arm,) = [m for m in index["manifests"] if m["platform"] == {"architecture": "arm64", "os": "linux"}]
        man, got = reg.fetch_json(f"/v2/tailscale/{name}/manifests/{arm['digest']}", MANIFEST)
        assert got == arm["digest"]
        cfg, _ = reg.fetch_json(f"/v2/tailscale/{name}/blobs/{man['config']['digest']}")
        assert (cfg["os"], cfg["architecture"]) == ("linux", "arm64")
        print(f"{name}: linux/arm64 {arm['digest']}")

    # removal
    kc.kubectl("-n", "apps", "delete", "pod", "nocreds", "--wait=false")
    kc.kubectl("-n", "apps", "delete", "service", "web", "--wait=false")
    wait_until(lambda: kc.get("service", "web", "apps") is None, 120, 0.5, "the Service gone")
    kubecontroller.helm(kc, "uninstall", helmchart.RELEASE, "--namespace", NS, "--wait", timeout=180)
    wait_until(lambda: kubecontroller.controller_pod(kc) is None, 120, 0.5, "the controller Pod gone")
    assert kubecontroller.children(kc, "apps", "web") == kubecontroller.NO_CHILDREN
    assert [n for n in lab.hs_nodes() if "apps-web" in (n.get("name"), n.get("given_name"))] == []
