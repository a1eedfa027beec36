"""docs/install-gitops.md's Flux manifests are the ones the lab's Flux test applies (netns-tests/
test_flux_realkube.py and the GitOps demo use labtools.fluxlab.gitops_manifests): the YAML in the docs'
"Flux" section, parsed, equals that function's output for the docs' example registry and headscale."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from labtools import fluxlab

DOC = Path(__file__).resolve().parent.parent / "docs" / "install-gitops.md"


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/install-gitops.md has no '## {title}' section"
    return m.group(1)


def _yaml_blocks(section: str) -> list[dict]:
    docs: list[dict] = []
    for block in re.findall(r"^```yaml\n(.*?)^```", section, re.M | re.S):
        docs += [d for d in yaml.safe_load_all(block) if d]
    return docs


def test_the_docs_flux_manifests_are_the_tested_ones():
    documented = _yaml_blocks(_section(DOC.read_text(), "Flux"))
    assert documented == fluxlab.gitops_manifests(fluxlab.DOCS_SOURCE)


def test_a_changed_manifest_is_noticed():
    # the comparison sees a difference in a nested value (what a stale docs block would have)
    tested = fluxlab.gitops_manifests(fluxlab.DOCS_SOURCE)
    stale = fluxlab.gitops_manifests(fluxlab.Source(**{**fluxlab.DOCS_SOURCE.__dict__, "version": "0.0.9"}))
    assert stale != tested
    assert [o["kind"] for o in tested] == ["Namespace", "OCIRepository", "HelmRelease"]


def test_the_argo_cd_application_is_said_to_be_untested():
    argo = _section(DOC.read_text(), "Argo CD")
    assert "not run" in argo
