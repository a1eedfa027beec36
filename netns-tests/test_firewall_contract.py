"""The firewall contract on real kernels: nftables and both iptables flavours pass the same checks as the test
hook's in-memory fake (tests/support/firewall_contract.py; the fake's run is tests/test_firewall_contract.py).

One throw-away network namespace per backend; the checks run in one process inside it and report per check.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from tests.support.firewall_contract import CHECKS

pytestmark = pytest.mark.netns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=("nftables", "iptables-legacy", "iptables-nft"))
def results(request, netns_available) -> dict[str, str]:
    name = f"cbfc-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
        p = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-m", "tests.support.firewall_contract",
                            request.param], capture_output=True, text=True, timeout=300, cwd=REPO)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_the_kernel_backend_keeps_the_contract(results, check):
    assert results.get(check) == "", results.get(check, "the check did not run")
