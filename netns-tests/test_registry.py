"""The lab's registry (labtools/registry.py) as its clients see it: the CNCF registry v3.0.0 with TLS from the
lab's private CA and htpasswd basic auth, in a network namespace of its own (root).

With the password, podman pushes an image and pulls it back (same digest) and helm pushes the chart as an OCI
artifact and pulls it back; without it, or with a wrong one, the registry answers 401 and both clients fail
with the registry's "unauthorized"; a client that does not trust the lab's CA fails the TLS check.
"""
from __future__ import annotations

import json
import os
import shutil
import tarfile

import pytest
from needs import unavailable

from labtools import helmchart, ociimage, registry

ACCEPT = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    if os.geteuid() != 0:
        unavailable("the registry test runs it in a network namespace (root)")
    if not registry.binary_path().exists():
        unavailable("the registry is not built: run scripts/setup.sh --binaries=registry (scripts/install-registry.sh)")
    if not shutil.which("htpasswd"):
        unavailable("htpasswd is missing: run scripts/setup.sh --binaries=registry (Debian's apache2-utils)")
    r = registry.LabRegistry.start(tmp_path_factory.mktemp("registry"), netns=f"cbreg{os.getpid()}", new_netns=True)
    try:
        yield r
    finally:
        r.close()


def test_api_needs_the_password(reg):
    assert reg.status(auth=False) == 401
    assert reg.status(auth=True) == 200
    wrong = registry.LabRegistry(reg.files, reg.host, reg.port, reg.netns, reg.proc, reg.password + "x")
    assert wrong.status(auth=True) == 401


def test_untrusted_ca_fails_tls(reg):
    cp = reg.run(["curl", "-sS", "-o", "/dev/null", f"https://{reg.address}/v2/"], check=False, timeout=30)
    assert cp.returncode != 0 and "certificate" in cp.stderr.lower()


def _podman(reg: registry.LabRegistry, *args: str, check: bool = True):
    return reg.run(["podman", *args], check=check, timeout=300)


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman is missing (scripts/setup.sh --image)")
def test_podman_push_and_pull_with_password_refused_without(reg, tmp_path):
    name = f"localhost/cbpy-registry-test:{os.getpid()}"
    archive = tmp_path / "img.tar"
    archive.write_bytes(ociimage.oci_archive(name, [ociimage.File("hello", b"#!/bin/sh\necho hi\n")], ["/hello"]))
    ref = f"{reg.address}/lab/hello:1"
    creds = ["--cert-dir", str(reg.cert_dir), "--authfile", str(reg.authfile)]
    noauth = tmp_path / "empty-auth.json"
    noauth.write_text("{}")
    _podman(reg, "pull", "-q", f"oci-archive:{archive}")
    try:
        refused = _podman(reg, "push", "--cert-dir", str(reg.cert_dir), "--authfile", str(noauth), name,
                          f"docker://{ref}", check=False)
        assert refused.returncode != 0 and "authentication required" in refused.stderr.lower() + refused.stdout.lower()
        digest_file = tmp_path / "digest"
        _podman(reg, "push", *creds, "--digestfile", str(digest_file), name, f"docker://{ref}")
        pushed = digest_file.read_text().strip()
        assert pushed.startswith("sha256:")
        # the manifest is served by that digest, to the owner of the password only
        _, served = reg.fetch_json(f"/v2/lab/hello/manifests/{pushed}", ACCEPT)
        assert served == pushed
        assert reg.status(f"/v2/lab/hello/manifests/{pushed}", auth=False) == 401
        _podman(reg, "rmi", "-f", name)
        refused = _podman(reg, "pull", "--cert-dir", str(reg.cert_dir), "--authfile", str(noauth), ref, check=False)
        assert refused.returncode != 0
        _podman(reg, "pull", "-q", *creds, ref)
        got = json.loads(_podman(reg, "image", "inspect", ref).stdout)[0]
        assert got["Digest"] == pushed
    finally:
        for r in (name, ref):
            _podman(reg, "rmi", "-f", r, check=False)


def test_helm_chart_as_oci_artifact_with_password_refused_without(reg, tmp_path):
    helm = helmchart.helm_bin()
    if helm is None:
        unavailable("helm is not built: run make setup-bin (scripts/install-helm.sh)")
    out = tmp_path / "dist"
    reg.run([str(helm), "package", str(helmchart.CHART), "--destination", str(out)], timeout=120)
    (tgz,) = out.glob("*.tgz")
    meta = helmchart.chart_meta()
    anon = {**os.environ, "HELM_REGISTRY_CONFIG": str(tmp_path / "anon.json"), "HOME": str(tmp_path)}
    cfg = {**os.environ, "HELM_REGISTRY_CONFIG": str(tmp_path / "registry.json"), "HOME": str(tmp_path)}
    refused = reg.run([str(helm), "push", str(tgz), f"oci://{reg.address}/charts", "--ca-file", str(reg.ca_cert)],
                      check=False, env=anon, timeout=120)
    # helm asks for no password it has not got: the registry's challenge ends the push
    assert refused.returncode != 0 and "basic credential not found" in refused.stderr.lower()
    reg.run([str(helm), "registry", "login", reg.address, "--username", reg.username, "--password-stdin",
             "--ca-file", str(reg.ca_cert)], input=reg.password, env=cfg, timeout=60)
    reg.run([str(helm), "push", str(tgz), f"oci://{reg.address}/charts", "--ca-file", str(reg.ca_cert)],
            env=cfg, timeout=120)
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    refused = reg.run([str(helm), "pull", f"oci://{reg.address}/charts/{meta['name']}", "--version", meta["version"],
                       "--ca-file", str(reg.ca_cert), "--destination", str(pulled)], check=False, env=anon, timeout=120)
    assert refused.returncode != 0
    reg.run([str(helm), "pull", f"oci://{reg.address}/charts/{meta['name']}", "--version", meta["version"],
             "--ca-file", str(reg.ca_cert), "--destination", str(pulled)], env=cfg, timeout=120)
    (got,) = pulled.glob("*.tgz")
    with tarfile.open(got) as t:
        chart = t.extractfile(f"{meta['name']}/Chart.yaml")
        assert chart is not None and f"version: {meta['version']}" in chart.read().decode()
