"""The provider contract (tests/support/provider_contract.py) on the unit tests' fake control plane; the real
headscale provider runs the same checks against the lab's headscale (netns-tests/test_controller_headscale.py)."""
from __future__ import annotations

from tests.support import provider_contract as pc
from tests.support.fakekube import FakeProvider


async def test_the_fake_provider_keeps_the_contract() -> None:
    p = FakeProvider()
    p.tags["17"] = ("tag:k8s", "tag:ctl")
    p.refused_tags.add("tag:nobody")
    case = pc.Case(device="17", tags=("tag:k8s", "tag:ctl"), unknown="999999", not_an_id="../x",
                   refused_tag="tag:nobody")
    assert await pc.run(p, case) == {name: "" for name in pc.CHECKS}


async def test_a_fake_that_deletes_twice_breaks_the_contract() -> None:
    """The contract can fail: a fake whose deletion always says a device was there is caught."""
    class Always(FakeProvider):
        async def delete_device(self, device_id: str) -> bool:
            await super().delete_device(device_id)
            return True
    p = Always()
    p.tags["17"] = ("tag:k8s",)
    p.refused_tags.add("tag:nobody")
    got = await pc.run(p, pc.Case("17", ("tag:k8s",), "999999", "../x", "tag:nobody"))
    assert got["delete"] and got["not-an-id"] and not got["tags"], got
