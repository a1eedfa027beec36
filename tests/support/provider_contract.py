"""What a control-plane provider promises the controller (`controller.providers.Provider`), as checks that run
unchanged on the fake of the unit tests (`tests.support.fakekube.FakeProvider`, tests/test_provider_contract.py)
and on the real headscale provider against the lab's headscale with a real node logged in
(netns-tests/test_controller_headscale.py). Only what the controller can observe through the interface: the
key it mints, the tags it reads, what a deletion answers, and which errors are final.

`run(provider, case)` runs every check in order (the last ones delete the device) and returns a name -> ""
(kept) or the problem map, so that a run in another process (the lab's network namespace) can report it.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from controller.providers import ProviderError


@dataclass(frozen=True)
class Case:
    device: str                 # the ID of a live device ...
    tags: tuple[str, ...]       # ... and its tags
    unknown: str                # a well-formed ID of no device
    not_an_id: str              # text that cannot be a device ID (a damaged state Secret)
    refused_tag: str            # a tag the control plane's policy does not permit


async def check_a_minted_key_is_a_non_empty_string(p: Any, c: Case) -> None:
    key = await p.create_auth_key(c.tags, description="contract")
    assert isinstance(key, str) and key.strip() == key and len(key) > 8, "a key must be a non-empty string"


async def check_tags_are_read_sorted_and_an_unknown_device_has_none(p: Any, c: Case) -> None:
    assert await p.device_tags(c.device) == tuple(sorted(c.tags))
    assert await p.device_tags(c.unknown) is None


async def check_a_refused_tag_is_a_final_error_and_changes_nothing(p: Any, c: Case) -> None:
    try:
        await p.set_device_tags(c.device, (*c.tags, c.refused_tag))
    except ProviderError as e:
        assert not e.transient, f"a policy refusal is final, not retried: {e}"
        assert "invalid or not permitted" in str(e) and c.device in str(e), str(e)
    else:
        raise AssertionError(f"{c.refused_tag} was accepted")
    assert await p.device_tags(c.device) == tuple(sorted(c.tags))


async def check_what_is_not_an_id_deletes_nothing(p: Any, c: Case) -> None:
    assert await p.delete_device(c.not_an_id) is False
    assert await p.device_tags(c.device) is not None


async def check_a_deletion_says_whether_there_was_a_device(p: Any, c: Case) -> None:
    assert await p.delete_device(c.unknown) is False
    assert await p.delete_device(c.device) is True
    assert await p.device_tags(c.device) is None
    assert await p.delete_device(c.device) is False, "deleting a device already gone is not an error"


ProviderCheck = Callable[[Any, Case], Awaitable[None]]
#: in the order they run: the device is deleted last
CHECKS: dict[str, ProviderCheck] = {
    "key": check_a_minted_key_is_a_non_empty_string,
    "tags": check_tags_are_read_sorted_and_an_unknown_device_has_none,
    "refused-tag": check_a_refused_tag_is_a_final_error_and_changes_nothing,
    "not-an-id": check_what_is_not_an_id_deletes_nothing,
    "delete": check_a_deletion_says_whether_there_was_a_device,
}


async def run(p: Any, c: Case) -> dict[str, str]:
    out = {}
    for name, check in CHECKS.items():
        try:
            await check(p, c)
            out[name] = ""
        except (AssertionError, ProviderError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out
