"""The LocalAPI contract on real tailscaled daemons: the same checks the fake tailscaled passes in
tests/test_tailscaled_contract.py (tests/support/tailscaled_contract.py).

Logged out: a daemon with userspace networking in a throw-away network namespace with only loopback, so it
reaches no control or log server. Logged in: the lab's `client` node (headscale), shared with the session's
other end-to-end tests; every check that changes it (serve config, prefs) puts it back.
"""
from __future__ import annotations

import secrets
import subprocess

import pytest

from tests.support.tailscaled_contract import CHECKS, start_real, stop

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def logged_out(lab_bin_dir, tmp_path_factory):
    ns = f"cbts-{secrets.token_hex(4)}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
        workdir = tmp_path_factory.mktemp("real-tailscaled")
        proc, sock = start_real(str(lab_bin_dir / "tailscaled"), str(workdir), ns)
        try:
            yield sock
        finally:
            stop(proc)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.mark.parametrize("check", sorted(CHECKS))
async def test_a_logged_out_tailscaled_keeps_the_contract(logged_out, check):
    await CHECKS[check](logged_out, False)


@pytest.mark.parametrize("check", sorted(CHECKS))
async def test_a_logged_in_tailscaled_keeps_the_contract(lab, check):
    await CHECKS[check](lab.nodes["client"].socket, True)
