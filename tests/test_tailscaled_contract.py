"""The LocalAPI contract on the fake tailscaled, logged out and logged in: the same checks a real tailscaled
passes in netns-tests/test_tailscaled_contract.py (tests/support/tailscaled_contract.py)."""
from __future__ import annotations

import pytest

from tests.support.tailscaled_contract import CHECKS, start_fake, stop


@pytest.fixture(scope="module", params=(False, True), ids=("logged-out", "logged-in"))
def fake(request, tmp_path_factory):
    proc, sock = start_fake(str(tmp_path_factory.mktemp("fake-tailscaled")), logged_in=request.param)
    yield sock, request.param
    stop(proc)


@pytest.mark.parametrize("check", sorted(CHECKS))
async def test_the_fake_tailscaled_keeps_the_contract(fake, check):
    await CHECKS[check](*fake)
