"""The firewall contract on the test hook's in-memory fake: the same checks the kernel backends pass in
`netns-tests/test_firewall_contract.py` (tests/support/firewall_contract.py)."""
from __future__ import annotations

import pytest

from tests.support.firewall_contract import CHECKS, maker


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_the_fake_firewall_keeps_the_contract(check):
    CHECKS[check](maker("fake"))
