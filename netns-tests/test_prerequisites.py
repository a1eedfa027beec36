"""Under CI a missing prerequisite fails the run instead of skipping the tests that need it (needs.py,
tests/support/skipcheck.py): shown by running those tests with the prerequisite taken away, iptables-nft (off
$PATH) and upstream's operator manifests (no module cache, no module proxy), and checking that the run fails
naming what is missing, and that without CI the same run skips and calls the skip unexpected.

Each run stops at the prerequisite, before any namespace or cluster is made: a few seconds each."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from needs import unavailable

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, test: str, ci: bool, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    if ci:
        base["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", test],
                          cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module", autouse=True)
def _root() -> None:
    if os.geteuid() != 0:
        unavailable("these runs use the root-only tests (network namespaces)")


def test_without_iptables_nft_the_kernel_test_fails_under_ci(tmp_path) -> None:
    test = "netns-tests/test_netfilter_kernel.py::test_delta_leaves_the_same_ruleset_as_a_full_apply[iptables-nft]"
    path = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}     # /usr/sbin (iptables-nft) left out
    ci = _run(tmp_path, test, True, path)
    assert ci.returncode == 1, ci.stdout[-3000:]
    assert "CI is set, so these tests must run, but iptables-nft-restore is not installed" in ci.stdout
    local = _run(tmp_path, test, False, path)
    assert local.returncode == 0 and "UNEXPECTED" in local.stdout, local.stdout[-3000:]


def test_without_upstreams_manifests_the_install_guide_fails_under_ci(tmp_path) -> None:
    test = "netns-tests/test_controller_realkube_e2e.py::" \
           "test_install_guide_step_by_step_packaged_chart_upgrade_and_uninstall"
    nothing = {"GOMODCACHE": str(tmp_path / "empty-modcache"), "GOPROXY": "off", "GOFLAGS": "-mod=mod"}
    ci = _run(tmp_path, test, True, nothing)
    assert ci.returncode == 1, ci.stdout[-3000:]
    assert "CI is set, so these tests must run, but upstream's operator manifests cannot be downloaded" in ci.stdout
    local = _run(tmp_path, test, False, nothing)
    assert local.returncode == 0 and "UNEXPECTED" in local.stdout, local.stdout[-3000:]
