"""Releases (scripts/release.sh, `make release`): one version, written once, and what a release refuses.

The version is the file VERSION: the package's (pyproject.toml reads it), the chart's version and appVersion,
and each CHANGELOG.md release has an entry. A release of a version the files do not say, or without its
CHANGELOG entry, stops before building anything, naming the fix. The chart pins images by tag and digest when
the digest is set, and refuses a digest that is not one. The pushing release itself runs against the lab's
registry in netns-tests/test_release_registry.py.
"""
from __future__ import annotations

import importlib.metadata
import re
import subprocess
from pathlib import Path

import pytest

from labtools import helmchart

REPO = Path(__file__).resolve().parent.parent
VERSION = (REPO / "VERSION").read_text().strip()


def test_version_is_written_once_and_everything_reads_it():
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    assert helmchart.project_version() == VERSION
    meta = helmchart.chart_meta()
    assert meta["version"] == meta["appVersion"] == VERSION
    assert importlib.metadata.version("containerboot-py") == VERSION
    assert 'version = "' not in (REPO / "pyproject.toml").read_text().split("[project]")[1].split("\n[")[0]


def test_changelog_has_an_entry_for_the_version():
    assert re.search(rf"^## {re.escape(VERSION)}$", (REPO / "CHANGELOG.md").read_text(), re.M)


def _release(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "release.sh"), *args], capture_output=True, text=True,
                          timeout=60)


def test_release_of_another_version_says_to_bump_first():
    cp = _release("--registry", "registry.example.com/tailscale", "--version", "9.9.9")
    assert cp.returncode == 2
    assert f"the file VERSION says {VERSION}" in cp.stderr and "CHANGELOG.md" in cp.stderr


def test_release_needs_a_registry():
    cp = _release()
    assert cp.returncode == 2 and "--registry is required" in cp.stderr


def test_release_without_changelog_entry_refused(tmp_path):
    # a copy of the files the checks read, with the version bumped but no CHANGELOG entry
    for rel in ("scripts/release.sh", "charts/tailscale-controller/Chart.yaml", "CHANGELOG.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        text = (REPO / rel).read_text()
        if rel.endswith("Chart.yaml"):
            text = re.sub(r"^version: .*$", "version: 0.0.99", text, flags=re.M)
            text = re.sub(r"^appVersion: .*$", 'appVersion: "0.0.99"', text, flags=re.M)
        (tmp_path / rel).write_text(text)
    (tmp_path / "VERSION").write_text("0.0.99\n")
    cp = subprocess.run(["bash", str(tmp_path / "scripts" / "release.sh"), "--registry", "r.example/x"],
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "CHANGELOG.md has no '## 0.0.99' entry" in cp.stderr


@pytest.fixture
def helm_built():
    if helmchart.helm_bin() is None:
        pytest.skip("helm is not built: run make setup-bin (scripts/install-helm.sh)")


DIGEST = "sha256:" + "ab" * 32


def _images(values: dict) -> tuple[str, str]:
    objs = helmchart.objects(helmchart.template({"imageRegistry": "reg.example:5000/ts",
                                                 "headscale": {"url": "https://hs.example"}, **values}, "tailscale"))
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    return c["image"], env["PROXY_IMAGE"]


def test_chart_pins_images_by_tag_and_digest(helm_built):
    ctl, proxy = _images({"image": {"digest": DIGEST}, "proxy": {"image": {"digest": DIGEST.replace("ab", "cd")}}})
    assert ctl == f"reg.example:5000/ts/containerboot-py-controller:{VERSION}@{DIGEST}"
    assert proxy == f"reg.example:5000/ts/containerboot-py:{VERSION}@{DIGEST.replace('ab', 'cd')}"
    # without a digest, the tag alone (the chart in the repository)
    assert _images({}) == (f"reg.example:5000/ts/containerboot-py-controller:{VERSION}",
                           f"reg.example:5000/ts/containerboot-py:{VERSION}")


@pytest.mark.parametrize("key,values", [
    ("image.digest", {"image": {"digest": "sha256:xyz"}}),
    ("proxy.image.digest", {"proxy": {"image": {"digest": "ab" * 32}}}),
])
def test_chart_refuses_a_digest_that_is_not_one(helm_built, key, values):
    with pytest.raises(helmchart.HelmError) as e:
        _images(values)
    assert f"{key}=" in str(e.value) and "sha256:<64 hex digits>" in str(e.value)
