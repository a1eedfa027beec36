"""Releases pushed to the lab's registry (TLS from its private CA, htpasswd auth; on the host's loopback),
read back as a cluster and Flux would read them.

1. `make release` (scripts/release.sh) of the version in VERSION: each image is an index with one entry per
   platform (linux/amd64 and linux/arm64, or CB_RELEASE_PLATFORMS), each entry's manifest served by its digest
   and its config saying that architecture; the chart pulled back from oci://<registry>/charts has version =
   appVersion = VERSION, imageRegistry the registry, and the index digests the registry serves as its
   image digests; `helm template` of it names <registry>/<image>:<version>@<digest>.
2. `make images` (the user's path, podman manifest lists) with LOCAL_BASES=1 (this machine's bases instead of
   Docker Hub's, which the lab cannot reach): the indexes it pushes have the same platforms.

The images are the project's own (images/release.sh --offline archives, cached by image ID: a second run with
unchanged sources builds nothing; the first run builds arm64 under qemu, several minutes).
"""
from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml
from needs import unavailable

from labtools import helmchart, registry

pytestmark = [pytest.mark.netns, pytest.mark.timeout(7200)]

REPO = Path(__file__).resolve().parent.parent
VERSION = (REPO / "VERSION").read_text().strip()
PLATFORMS = os.environ.get("CB_RELEASE_PLATFORMS", "linux/amd64,linux/arm64")
NAMES = ("containerboot-py", "containerboot-py-controller")
INDEX = "application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    if os.geteuid() != 0:
        unavailable("the release tests install the image build's packages and use podman's storage (root)")
    if not registry.binary_path().exists():
        unavailable("the registry is not built: run scripts/setup.sh --binaries=registry")
    if helmchart.helm_bin() is None:
        unavailable("helm is not built: run make setup-bin")
    cp = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--image", "--multiarch"], capture_output=True,
                        text=True, timeout=1800)
    if cp.returncode != 0:
        unavailable(f"the image build's packages cannot be installed: {cp.stderr[-800:]}")
    # on the host's loopback (a free port): the image builds reach PyPI from the host only
    r = registry.LabRegistry.start(tmp_path_factory.mktemp("registry"))
    try:
        yield r
    finally:
        r.close()


def check_index(reg: registry.LabRegistry, repo: str, tag: str, digest: str = "") -> dict[str, str]:
    """The index at repo:tag (its digest equal to ``digest`` when given): platform -> manifest digest, each
    manifest's config saying its platform."""
    index, got = reg.fetch_json(f"/v2/{repo}/manifests/{tag}", INDEX)
    if digest:
        assert got == digest, (repo, got, digest)
    entries = {f"{m['platform']['os']}/{m['platform']['architecture']}": m["digest"] for m in index["manifests"]}
    assert sorted(entries) == sorted(PLATFORMS.split(",")), index
    for plat, d in entries.items():
        man, served = reg.fetch_json(f"/v2/{repo}/manifests/{d}", MANIFEST)
        assert served == d
        cfg, _ = reg.fetch_json(f"/v2/{repo}/blobs/{man['config']['digest']}")
        assert f"{cfg['os']}/{cfg['architecture']}" == plat, (repo, plat, cfg.get("architecture"))
    return entries


def test_make_release_pushes_indexes_and_a_pinned_oci_chart(reg, tmp_path):
    out = tmp_path / "dist"
    cp = reg.run(["make", "-C", str(REPO), "--no-print-directory", "release", f"VERSION={VERSION}",
                  f"REGISTRY={reg.address}/tailscale", f"PLATFORMS={PLATFORMS}",
                  f"REGISTRY_CERT_DIR={reg.cert_dir}", f"REGISTRY_AUTHFILE={reg.authfile}"],
                 check=False, timeout=7000, env={**os.environ, "RELEASE_OUT": str(out)})
    print(cp.stderr[-3000:])
    assert cp.returncode == 0, cp.stderr[-4000:]
    rec = json.loads(Path(cp.stdout.strip().splitlines()[-1]).read_text())
    print(f"release {VERSION}: build {rec['seconds']['build']}s, push {rec['seconds']['push']}s")
    digests = {}
    for n in NAMES:
        ref, _, digest = rec["images"][n].partition("@")
        assert ref == f"{reg.address}/tailscale/{n}:{VERSION}"
        check_index(reg, f"tailscale/{n}", VERSION, digest)
        digests[n] = digest
    # the chart, pulled as Flux's source-controller or `helm install oci://` would
    env = {**os.environ, "HOME": str(tmp_path), "HELM_REGISTRY_CONFIG": str(reg.authfile)}
    helm = str(helmchart.helm_bin())
    (tmp_path / "pulled").mkdir()
    reg.run([helm, "pull", f"oci://{reg.address}/tailscale/charts/tailscale-controller", "--version", VERSION,
             "--ca-file", str(reg.ca_cert), "--destination", str(tmp_path / "pulled")], env=env, timeout=120)
    tgz = tmp_path / "pulled" / f"tailscale-controller-{VERSION}.tgz"
    with tarfile.open(tgz) as t:
        meta = yaml.safe_load(t.extractfile("tailscale-controller/Chart.yaml").read())  # type: ignore[union-attr]
        values = yaml.safe_load(t.extractfile("tailscale-controller/values.yaml").read())  # type: ignore[union-attr]
    assert meta["version"] == meta["appVersion"] == VERSION
    assert values["imageRegistry"] == f"{reg.address}/tailscale"
    assert values["image"]["digest"] == digests["containerboot-py-controller"]
    assert values["proxy"]["image"]["digest"] == digests["containerboot-py"]
    rendered = reg.run([helm, "template", "t", str(tgz), "--set", "headscale.url=https://hs.example"], env=env).stdout
    for n in NAMES:
        assert f'"{reg.address}/tailscale/{n}:{VERSION}@{digests[n]}"' in rendered


def test_make_images_user_path_pushes_indexes(reg):
    tag = f"{VERSION}-userpath"
    cp = reg.run(["make", "-C", str(REPO), "--no-print-directory", "images", f"REGISTRY={reg.address}/user",
                  f"TAG={tag}", f"PLATFORMS={PLATFORMS}", "TOOL=podman", "LOCAL_BASES=1",
                  f"REGISTRY_CERT_DIR={reg.cert_dir}", f"REGISTRY_AUTHFILE={reg.authfile}"],
                 check=False, timeout=7000)
    assert cp.returncode == 0, cp.stderr[-4000:]
    for n in NAMES:
        check_index(reg, f"user/{n}", tag)
