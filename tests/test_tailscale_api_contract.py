"""The controller's Tailscale provider and the fake Tailscale API it is tested with, both held to the published
contract of Tailscale's API v2 (tests/support/tailscale_api_contract.py; written from https://tailscale.com/api
and https://tailscale.com/kb/1215/oauth-clients): every request the provider sends and every answer the fake
gives, over every call the provider makes, success and refusal."""
from __future__ import annotations

import json

import httpx
import pytest

from controller.providers import ProviderError
from controller.providers.tailscale import TailscaleProvider
from tests.support import tailscale_api_contract as contract
from tests.support.fake_tailscale_api import FakeTailscaleAPI


async def test_the_provider_and_the_fake_keep_the_published_contract():
    with FakeTailscaleAPI() as api:
        api.devices |= {"nTAGGED1CNTRL", "nBARE2CNTRL"}
        api.device_tags["nTAGGED1CNTRL"] = ["tag:k8s"]
        api.permitted_tags = {"tag:k8s", "tag:web"}
        rec = contract.RecordingTransport()
        p = TailscaleProvider(api.url, client_id=api.client_id, client_secret=api.client_secret, transport=rec)
        # descriptions as the reconcilers make them: "<kind> <namespace>/<name>", a ProxyGroup's dotted name
        await p.create_auth_key(("tag:k8s",), description="Service apps/web")
        await p.create_auth_key(("tag:k8s", "tag:web"),
                                description="ProxyGroup egress.team-a.example-with-a-rather-long-name")
        with pytest.raises(ProviderError):
            await p.create_auth_key(())                               # refused: an OAuth key needs tags
        assert await p.device_tags("nTAGGED1CNTRL") == ("tag:k8s",)
        assert await p.device_tags("nBARE2CNTRL") == ()
        assert await p.device_tags("nGONE3CNTRL") is None
        await p.set_device_tags("nBARE2CNTRL", ("tag:web",))
        with pytest.raises(ProviderError):
            await p.set_device_tags("nBARE2CNTRL", ("tag:not-permitted",))
        assert await p.delete_device("nTAGGED1CNTRL") is True
        assert await p.delete_device("nTAGGED1CNTRL") is False
        await p.aclose()
        bad = TailscaleProvider(api.url, client_id=api.client_id, client_secret="wrong", transport=rec)
        with pytest.raises(ProviderError):
            await bad.create_auth_key(("tag:k8s",))
        await bad.aclose()

    assert rec.problems() == []
    seen = {(contract.operation(r.method, r.url.path).name, status) for r, status, _ in rec.exchanges}
    assert {name for name, _ in seen} == {op.name for op in contract.OPERATIONS}, "every call checked"
    assert {s for _, s in seen} >= {200, 400, 401, 404}, "successes and refusals both checked"
    keys = [json.loads(r.content) for r, s, _ in rec.exchanges if r.url.path.endswith("/keys") and s == 200]
    assert [k["description"] for k in keys] == ["Service apps-web",
                                                "ProxyGroup egress-team-a-example-with-a-rather-lon"]


def _req(method: str, path: str, body: object = None, *, form: dict | None = None,
         token: str = "tskey-api-x") -> httpx.Request:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if form is not None:
        return httpx.Request(method, "https://api.example" + path, data=form, headers=headers)
    return httpx.Request(method, "https://api.example" + path, headers=headers,
                         json=body if body is not None else None)


GOOD_KEY = {"capabilities": {"devices": {"create": {"reusable": False, "tags": ["tag:k8s"]}}},
            "expirySeconds": 3600, "description": "Service apps-web"}


@pytest.mark.parametrize("req, needle", [
    (_req("POST", "/api/v2/tailnet/-/keys", {**GOOD_KEY, "description": "Service apps/web"}), "description"),
    (_req("POST", "/api/v2/tailnet/-/keys", {**GOOD_KEY, "description": "x" * 51}), "at most 50"),
    (_req("POST", "/api/v2/tailnet/-/keys", {"capabilities": {"devices": {}}}), "capabilities.devices.create"),
    (_req("POST", "/api/v2/tailnet/-/keys", {**GOOD_KEY, "reusable": True}), "reusable: not a field"),
    (_req("POST", "/api/v2/tailnet/-/keys", {**GOOD_KEY, "expirySeconds": True}), "not int"),
    (_req("POST", "/api/v2/tailnet/-/keys", GOOD_KEY, token=""), "no bearer token"),
    (_req("POST", "/api/v2/device/n1/tags", {"tags": ["k8s"]}), "is not a tag"),
    (_req("POST", "/api/v2/device/n1/expire"), "not a call of the published API"),
    (_req("POST", "/api/v2/oauth/token", form={"client_id": "c", "client_secret": "s", "grant_type": "password"},
          token=""), "grant_type"),
    (_req("POST", "/api/v2/oauth/token", {"client_id": "c", "client_secret": "s"}, token=""),
     "not application/x-www-form-urlencoded"),
])
def test_the_checks_catch_a_request_that_breaks_the_contract(req, needle):
    found = contract.request_problems(req)
    assert any(needle in p for p in found), found


KEY_ANSWER = {"id": "k1", "key": "tskey-auth-k1-abc", "created": "2026-01-02T03:04:05Z",
              "expires": "2026-01-02T04:04:05Z", "capabilities": GOOD_KEY["capabilities"]}


@pytest.mark.parametrize("req, status, answer, needle", [
    (_req("POST", "/api/v2/tailnet/-/keys", GOOD_KEY), 200, {k: v for k, v in KEY_ANSWER.items() if k != "key"},
     "key: missing"),
    (_req("POST", "/api/v2/tailnet/-/keys", GOOD_KEY), 200, {**KEY_ANSWER, "expirySeconds": 3600},
     "expirySeconds: not a field"),
    (_req("POST", "/api/v2/tailnet/-/keys", GOOD_KEY), 200, {**KEY_ANSWER, "created": "yesterday"}, "RFC 3339"),
    (_req("GET", "/api/v2/device/n1"), 200, {"id": "n1", "tags": []}, "empty tag list"),
    (_req("GET", "/api/v2/device/n1"), 404, {"error": "gone"}, "message: missing"),
    (_req("GET", "/api/v2/device/n1"), 302, {}, "a status this call does not answer with"),
    (_req("POST", "/api/v2/oauth/token", form={"client_id": "c", "client_secret": "s"}, token=""), 200,
     {"access_token": "t", "token_type": "mac"}, "not Bearer"),
])
def test_the_checks_catch_an_answer_that_breaks_the_contract(req, status, answer, needle):
    found = contract.answer_problems(req, status, json.dumps(answer).encode())
    assert any(needle in p for p in found), found
