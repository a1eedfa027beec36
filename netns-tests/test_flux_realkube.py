"""Flux installs, upgrades and removes the controller from the lab's registry, in the lab's real Kubernetes (root).

One cluster with a node; the lab's registry (TLS from a private CA, htpasswd auth) on the node's island address,
the node's containerd trusting its CA (as in test_release_realkube.py); Flux's source-controller and
helm-controller running against the API server with their own ServiceAccounts and RBAC in flux-system, Flux's
CRDs from the same modules (labtools/fluxlab.py). Releases:

* A: `make release` of the version in VERSION (amd64, or CB_RELEASE_PLATFORMS), as a user runs it;
* B: the next patch version without a build: A's indexes tagged B in the registry (same digests), A's chart
  re-packaged as B (version = appVersion = B, so the images become <image>:B@<same digest>) with a change to the
  ProxyClass CRD (an annotation), pushed next to A (fluxlab.release_next).

As a user would, with the manifests of docs/install-gitops.md (fluxlab.gitops_manifests, which the docs' test
compares with the docs):

1. install: the namespace with its Pod Security label, the Secrets (registry credentials, its CA, the headscale
   API key), the OCIRepository on the registry at tag A and the HelmRelease (install.crds/upgrade.crds,
   valuesFrom the API key Secret): Ready with chart A, the controller Pod running A's pinned image pulled from
   the registry; a Service exposed and reached from the tailnet (curl);
2. upgrade: the OCIRepository's tag bumped to B and applied again (the commit a user makes): the HelmRelease
   Ready with chart B, the ProxyClass CRD carries B's annotation, the proxy's StatefulSet names B's image, and
   the proxy rolled exactly once (one generation more, two Pod UIDs seen by a watch over the whole upgrade,
   the same headscale node); the Service is reached again;
3. removal: the Service's expose annotation removed (docs/install-headscale.md, "Uninstall"), then the
   HelmRelease deleted: no object of the release left in the cluster (the CRDs stay, by their keep policy), the
   controller's leader election Lease included (the controller made it with its Deployment as owner, so the
   garbage collector deletes it with the Deployment), no proxy, no node left in headscale.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from needs import unavailable

from labtools import fluxlab, helmchart, kubecluster, kubecontroller, kubemanifests, registry
from labtools import lab as labmod
from labtools.lab import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.ecosystem, pytest.mark.timeout(7200)]

PLATFORMS = os.environ.get("CB_RELEASE_PLATFORMS", "linux/amd64,linux/arm64")
NS = kubecontroller.NS
APPS = "gitops"
ANNOTATION = "tailscale.com/chart-release"
PROXY_SELECTOR = f"tailscale.com/parent-resource=web,tailscale.com/parent-resource-ns={APPS}"


@pytest.fixture(scope="module")
def cluster(lab, k8s_bin_dir):
    if helmchart.helm_bin() is None:
        unavailable("helm is not built: run make setup-bin")
    if not registry.binary_path().exists():
        unavailable("the registry is not built: run scripts/setup.sh --binaries=registry")
    if not fluxlab.binaries_present():
        unavailable("Flux's controllers are not built: run scripts/setup.sh --binaries=flux")
    kc = kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin_dir)
    reg = flux = None
    try:
        assert kc.netns is not None
        reg = registry.LabRegistry.start(kc.cfg.run_dir, host=kc.node_ip(kc.nodes[0]), port=5000, netns=kc.netns)
        kc.trust_registry(reg.address, reg.ca_cert.read_bytes())
        flux = fluxlab.Flux.start(kc)
        yield kc, reg, flux
    except BaseException:
        print(kc.diagnostics())
        if flux is not None:
            print(flux.diagnostics())
        raise
    finally:
        if flux is not None:
            flux.close()
        if reg is not None:
            reg.close()
        kc.close()


@pytest.fixture(scope="module")
def releases(cluster, tmp_path_factory):
    """Release A (`make release`) and B (A's images, the chart bumped with a CRD change)."""
    _, reg, _ = cluster
    a = fluxlab.make_release(reg, tmp_path_factory.mktemp("dist"), PLATFORMS)
    b_version = fluxlab.next_patch(a["version"])
    b = fluxlab.release_next(reg, a, b_version, tmp_path_factory.mktemp("next"), (ANNOTATION, b_version))
    return a, b


def _api_key(lab) -> str:
    key = lab.hs("apikeys", "create", "--expiration", "2h")
    return key if isinstance(key, str) else str((key or {}).get("key") or key)


def _source(lab, reg: registry.LabRegistry, version: str) -> fluxlab.Source:
    return fluxlab.Source(registry=reg.address, path="tailscale", version=version,
                          headscale_url=labmod.LOGIN_SERVER, magic_dns_suffix="tailnet.test",
                          extra_values={"proxy": {"firewallMode": lab.firewall_mode,
                                                  "env": kubecontroller.LAB_PROXY_ENV}})


def _apply(kc, src: fluxlab.Source) -> None:
    """What a user's GitOps commit holds: the namespace, the OCIRepository and the HelmRelease."""
    kc.apply(fluxlab.gitops_manifests(src))


def _watch_uids(path) -> set[str]:
    """The UIDs of the proxy Pods in a `kubectl get -w -o json` stream."""
    text, dec, i, uids = path.read_text(), json.JSONDecoder(), 0, set()
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return uids
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return uids   # a last object half written
        o = obj.get("object", obj)
        uids.add(o["metadata"]["uid"])


def _hs_node(lab, name: str) -> list[dict]:
    return [n for n in lab.hs_nodes() if name in (n.get("name"), n.get("given_name"))]


def _lease_owners(kc) -> list[tuple[str, str, str]]:
    """The owners (kind, name, uid) of the controller's leader election Lease."""
    md = (kc.get("lease", "tailscale-controller", NS) or {}).get("metadata") or {}
    return [(r["kind"], r["name"], r["uid"]) for r in md.get("ownerReferences") or []]


def _left_in_namespace(kc) -> dict[str, list[str]]:
    """Every object of the namespace other than what the user made by hand (the three Secrets) and what
    Kubernetes makes in every namespace."""
    own = {"secrets": {"regcred", "registry-ca", "headscale-api-key"}, "serviceaccounts": {"default"},
           "configmaps": {"kube-root-ca.crt"}}
    left = {}
    for kind in ("deployments", "statefulsets", "pods", "services", "secrets", "configmaps", "serviceaccounts",
                 "roles", "rolebindings", "leases", "helmreleases", "ocirepositories"):
        cp = kc.kubectl("-n", NS, "get", kind, "-o", "json")
        names = [i["metadata"]["name"] for i in json.loads(cp.stdout).get("items") or []
                 if i["metadata"]["name"] not in own.get(kind, set())]
        if names:
            left[kind] = names
    return left


def test_flux_installs_upgrades_and_removes_from_the_registry(lab, cluster, releases, tmp_path):
    kc, reg, flux = cluster
    a, b = releases
    nodes_before = {n["id"] for n in lab.hs_nodes()}
    lab.delete_node(f"{APPS}-web")

    # 1. install: namespace, Secrets (by hand, never in Git), OCIRepository at A, HelmRelease
    src_a = _source(lab, reg, a["version"])
    ns_obj = fluxlab.gitops_manifests(src_a)[0]
    api_key = _api_key(lab)
    kc.apply([ns_obj, *fluxlab.secrets_manifests(NS, reg, api_key)])
    _apply(kc, src_a)
    hr = fluxlab.wait_release_ready(kc, NS, fluxlab.RELEASE, a["version"], timeout=600)
    print(f"HelmRelease Ready: {fluxlab.condition(hr)['message']}")
    repo = kc.get("ocirepository", fluxlab.RELEASE, NS)
    assert fluxlab.condition(repo).get("status") == "True", repo
    kc.kubectl("-n", NS, "rollout", "status", "deployment/tailscale-controller", "--timeout=300s", timeout=310)
    pod = kubecontroller.controller_pod(kc)
    assert pod is not None and pod["spec"]["containers"][0]["image"] == a["images"]["containerboot-py-controller"]
    assert pod["status"]["containerStatuses"][0]["imageID"].endswith(
        a["images"]["containerboot-py-controller"].partition("@")[2])
    crd = kc.get("crd", "proxyclasses.tailscale.com")
    assert ANNOTATION not in (crd or {})["metadata"].get("annotations", {})
    # the API key came from the values Secret into the chart's credentials Secret
    assert kubecontroller.secret_data(kc, NS, "headscale-api") == {"key": api_key.encode()}
    # the leader Lease the controller made is owned by its Deployment (the removal below deletes it with it)
    deploy_uid = kc.get("deployment", "tailscale-controller", NS)["metadata"]["uid"]  # type: ignore[index]
    wait_until(lambda: _lease_owners(kc) == [("Deployment", "tailscale-controller", deploy_uid)], 60, 0.5,
               "the controller's Lease owned by its Deployment")

    marker = f"gitops-ok-{lab.prefix}"
    kc.apply([kubemanifests.namespace(APPS),
              *kubemanifests.echo_backend(APPS, "echo", marker, kubecluster.ECHO_IMAGE)])
    kc.kubectl("-n", APPS, "rollout", "status", "deployment/echo", "--timeout=90s", timeout=100)
    kc.apply({"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": "web", "namespace": APPS, "annotations": {"tailscale.com/expose": "true"}},
              "spec": {"type": "LoadBalancer", "selector": {"app": "echo"},
                       "ports": [{"port": 8080, "targetPort": 8080}]}})
    ip = kubecontroller.lb_ips(kubecontroller.wait_service_ip(kc, APPS, "web", 300))[0]
    (sts,) = kubecontroller.children(kc, APPS, "web")["statefulsets"]
    assert fluxlab.proxy_images(kc, NS, sts) == [a["images"]["containerboot-py"]]
    lab.wait_peer("client", f"{APPS}-web", 60)
    body = lab.wait_curl("client", lab.url(ip, 8080, "/through-flux-a"), marker, timeout=60)
    print(f"curl client -> {ip}:8080 with release {a['version']}: {body.splitlines()[0]}")
    (node_a,) = _hs_node(lab, f"{APPS}-web")
    gen_a = kc.get("statefulset", sts, NS)["metadata"]["generation"]  # type: ignore[index]

    # 2. upgrade: the tag bumped to B in the manifests, applied again; a watch counts the proxy's Pods
    watch_out = tmp_path / "proxy-pods.json"
    with open(watch_out, "wb") as f:
        watcher = kc.popen([str(kc.cfg.bin_dir / "kubectl"), f"--kubeconfig={kc.kubeconfig}", "-n", NS, "get", "pods",
                            "-l", PROXY_SELECTOR, "-w", "-o", "json", "--output-watch-events"],
                           stdout=f, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: _watch_uids(watch_out), 30, 0.2, "the watch's first Pod")
        _apply(kc, _source(lab, reg, b["version"]))
        hr = fluxlab.wait_release_ready(kc, NS, fluxlab.RELEASE, b["version"], timeout=600)
        print(f"HelmRelease Ready: {fluxlab.condition(hr)['message']}")
        wait_until(lambda: fluxlab.proxy_images(kc, NS, sts) == [b["images"]["containerboot-py"]], 300, 0.5,
                   "the proxy's StatefulSet naming release B's image")
        kc.kubectl("-n", NS, "rollout", "status", f"statefulset/{sts}", "--timeout=300s", timeout=310)
        body = lab.wait_curl("client", lab.url(ip, 8080, "/through-flux-b"), marker, timeout=120)
        print(f"curl client -> {ip}:8080 with release {b['version']}: {body.splitlines()[0]}")
    finally:
        labmod.stop_process(watcher)
    pod = kubecontroller.controller_pod(kc)
    assert pod is not None and pod["spec"]["containers"][0]["image"] == b["images"]["containerboot-py-controller"]
    crd = kc.get("crd", "proxyclasses.tailscale.com")
    assert (crd or {})["metadata"]["annotations"].get(ANNOTATION) == b["version"]
    proxy = kc.get("statefulset", sts, NS)
    assert proxy["metadata"]["generation"] == gen_a + 1, proxy["metadata"]  # type: ignore[index]
    uids = _watch_uids(watch_out)
    assert len(uids) == 2, f"the proxy's Pods seen over the upgrade: {sorted(uids)} (one roll: old and new)"
    print(f"proxy {sts}: generation {gen_a} -> {gen_a + 1}, Pods seen over the upgrade: {len(uids)}")
    (node_b,) = _hs_node(lab, f"{APPS}-web")
    assert node_b["id"] == node_a["id"]    # its state is in its Secret: the same device after the roll

    # 3. removal: stop exposing, then delete the HelmRelease (and the OCIRepository)
    kc.kubectl("-n", APPS, "annotate", "service", "web", "tailscale.com/expose-")
    wait_until(lambda: kubecontroller.children(kc, APPS, "web") == kubecontroller.NO_CHILDREN, 180, 0.5,
               "the proxy removed")
    kc.kubectl("-n", NS, "delete", "helmrelease", fluxlab.RELEASE, "--timeout=300s", timeout=310)
    kc.kubectl("-n", NS, "delete", "ocirepository", fluxlab.RELEASE, "--timeout=120s", timeout=130)
    # nothing of the release in the namespace: the controller's leader election Lease goes with its owner, the
    # Deployment (the garbage collector, once the controller's Pod is gone)
    try:
        wait_until(lambda: _left_in_namespace(kc) == {}, 180, 0.5, "no object of the release in the namespace")
    except TimeoutError:
        raise AssertionError(f"left in {NS} after the removal: {_left_in_namespace(kc)}") from None
    cluster_scoped = json.loads(kc.kubectl("get", "clusterroles,clusterrolebindings,ingressclasses", "-o",
                                           "json").stdout)["items"]
    assert [o["metadata"]["name"] for o in cluster_scoped
            if "tailscale" in o["metadata"]["name"] and "flux" not in o["metadata"]["name"]] == []
    # the CRDs stay (helm.sh/resource-policy: keep), as docs/install-gitops.md says
    assert kc.get("crd", "proxyclasses.tailscale.com") is not None
    assert _hs_node(lab, f"{APPS}-web") == []
    assert {n["id"] for n in lab.hs_nodes()} <= nodes_before
