"""The controller's headscale provider against a real headscale (the lab's), with a real proxy logging in.

The provider runs where a controller Pod would: on the island (in the `client` namespace, which reaches
headscale at 10.99.0.1:8080), with an API key made by headscale's CLI. It mints a single-use tagged pre-auth
key over the REST API; our agent logs in with it; the node carries the tags, the key is used up, and the
`device_id` the agent would write (the node's StableID) is what the provider reads the node's tags and
deletes the node by. Re-tagging: the lab's headscale starts with no policy, and headscale v0.29 then refuses
every tag set through its API (a tag must be in the policy's `tagOwners`, unlike a pre-auth key's tags): the
provider's error says so, and the node keeps its tags. With a policy whose `tagOwners` define the tags (set at
run time with `headscale policy set`, the lab's headscale keeping its policy in its database), the
controller's tag pass re-tags the device: headscale's node and the proxy's own status show the new tags, a
second pass (a restarted controller) reads them and writes nothing, and a tag the policy does not define is
still refused.
"""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

from labtools.lab import HEADSCALE_VERSION, wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(240),
              # tag-only keys, `tags` and refused re-tags are 0.28's; older minors: labtools/hsmatrix.py (make compat)
              pytest.mark.skipif(HEADSCALE_VERSION in ("v0.26.1", "v0.27.1"),
                                 reason="asserts headscale 0.28+ behaviour; make compat covers older ones")]

REPO = str(pathlib.Path(__file__).resolve().parents[1])
SCRIPT = r"""
import asyncio, json, os, sys
from controller.providers.headscale import HeadscaleProvider
from controller.providers import ProviderError
import httpx
from controller.model import Parent
from controller.writer import Writer
req = json.loads(sys.stdin.read())
sent = []
class Counting(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request):
        if request.url.path.startswith("/api/"):     # not the version read once at start
            sent.append(f"{request.method} {request.url.path}")
        return await super().handle_async_request(request)
async def main():
    p = HeadscaleProvider(req["url"], api_key=os.environ["HS_API_KEY"], transport=Counting())
    try:
        if req["op"] == "sync":      # the controller's tag pass, as a freshly started controller runs it
            w = Writer(None, p, None)
            err = await w.sync_tags("svc", Parent("svc", "web", "apps", "u1"), tuple(req["tags"]),
                                       [{"device_id": req["id"].encode()}])
            return {"error": None if err is None else str(err), "sent": sent}
        if req["op"] == "contract":
            from tests.support import provider_contract as pc
            return {"contract": await pc.run(p, pc.Case(**req["case"]))}
        if req["op"] == "create":
            return {"key": await p.create_auth_key(tuple(req["tags"]))}
        if req["op"] == "tags":
            tags = await p.device_tags(req["id"])
            return {"tags": None if tags is None else list(tags)}
        if req["op"] == "settags":
            await p.set_device_tags(req["id"], tuple(req["tags"]))
            return {"set": True}
        return {"deleted": await p.delete_device(req["id"])}
    except ProviderError as e:
        return {"error": str(e)}
    finally:
        await p.aclose()
print(json.dumps(asyncio.run(main())))
"""


def provider(lab, api_key: str, **req) -> dict:
    cp = lab.exec("client", [sys.executable, "-c", SCRIPT], timeout=30,
                  input=json.dumps({"url": lab.login_server, **req}),
                  env={"PYTHONPATH": REPO, "HS_API_KEY": api_key})
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout.strip().splitlines()[-1])


@pytest.fixture
def api_key(lab) -> str:
    out = lab.hs("apikeys", "create", "--expiration", "1h")
    return out if isinstance(out, str) else str(out.get("key") or out)


def test_tagged_single_use_key_login_and_device_deletion(lab, start_agent, api_key):
    got = provider(lab, api_key, op="create", tags=["tag:k8s", "tag:ctl"])
    assert "key" in got, got
    key = got["key"]
    keys = [k for k in lab.hs("preauthkeys", "list") or [] if k.get("key", "").endswith(key[-6:])
            or k.get("key") == key]
    agent = start_agent({"TS_AUTHKEY": key, "TS_HOSTNAME": "ctl-proxy"})
    st = agent.wait_running(90)
    stable_id = st["Self"]["ID"]
    node = wait_until(lambda: lab.hs_node("ctl-proxy"), 30, 0.5, "node in headscale")
    assert str(node["id"]) == stable_id, (node["id"], stable_id)   # device_id is the node ID: deletable by it
    tags = set(node.get("tags") or node.get("forced_tags") or node.get("valid_tags") or [])
    assert {"tag:k8s", "tag:ctl"} <= tags, node
    used = [k for k in lab.hs("preauthkeys", "list") or [] if not k.get("reusable")]
    assert any(k.get("used") for k in used), used or keys
    # the node's tags as the controller reads them (sorted), the same as headscale's CLI shows
    assert provider(lab, api_key, op="tags", id=stable_id) == {"tags": sorted(tags)}
    refused = provider(lab, api_key, op="settags", id=stable_id, tags=["tag:k8s", "tag:web"])
    assert refused["error"].startswith(f"headscale: setting the tags of node {stable_id}: headscale's policy refuses "
                                      "tag:k8s, tag:web"), refused
    assert "tagOwners" in refused["error"], refused
    assert "invalid or not permitted" in refused["error"], refused
    assert set(lab.hs_node("ctl-proxy").get("tags") or []) == tags
    # not a headscale node ID (a damaged state Secret): it names no device, so nothing is deleted and the
    # node is still there; the pass is not blocked by it
    assert provider(lab, api_key, op="delete", id="abc") == {"deleted": False}
    assert lab.hs_node("ctl-proxy") is not None
    assert provider(lab, api_key, op="delete", id=stable_id) == {"deleted": True}
    assert lab.hs_node("ctl-proxy") is None
    assert provider(lab, api_key, op="delete", id=stable_id) == {"deleted": False}   # already gone: fine
    assert provider(lab, api_key, op="tags", id=stable_id) == {"tags": None}          # gone: nothing to re-tag


def test_the_headscale_provider_keeps_the_provider_contract(lab, start_agent, api_key):
    """The checks the unit tests' fake provider passes (tests/support/provider_contract.py), on the real
    provider and headscale, with a real node logged in with a key the provider minted."""
    from tests.support.provider_contract import CHECKS
    tags = ["tag:ctl", "tag:k8s"]
    got = provider(lab, api_key, op="create", tags=tags)
    assert "key" in got, got
    agent = start_agent({"TS_AUTHKEY": got["key"], "TS_HOSTNAME": "contract-proxy"})
    device = agent.wait_running(90)["Self"]["ID"]
    wait_until(lambda: lab.hs_node("contract-proxy"), 30, 0.5, "node in headscale")
    case = {"device": device, "tags": tags, "unknown": "999999", "not_an_id": "abc", "refused_tag": "tag:nobody"}
    assert provider(lab, api_key, op="contract", case=case) == {"contract": {name: "" for name in CHECKS}}
    assert lab.hs_node("contract-proxy") is None


def test_bad_api_key_is_an_error_without_the_key(lab):
    got = provider(lab, "hskey-api-notreal-SECRETVALUE", op="create", tags=["tag:k8s"])
    assert "error" in got and "HTTP 401" in got["error"], got
    assert "SECRETVALUE" not in got["error"]


#: What a headscale user needs for re-tagging: every tag the controller may set is in `tagOwners` (owned by a
#: user here; a group or another tag would do), and an ACL that keeps the tailnet as open as no policy was.
POLICY = {
    "tagOwners": {"tag:k8s": ["e2e@"], "tag:ctl": ["tag:k8s"], "tag:web": ["tag:k8s"]},
    "acls": [{"action": "accept", "src": ["*"], "dst": ["*:*"]}],
}


def test_retag_with_a_tag_owners_policy(lab, start_agent, api_key):
    key = provider(lab, api_key, op="create", tags=["tag:k8s", "tag:ctl"])["key"]
    agent = start_agent({"TS_AUTHKEY": key, "TS_HOSTNAME": "ctl-retag"})
    stable_id = agent.wait_running(90)["Self"]["ID"]
    node = wait_until(lambda: lab.hs_node("ctl-retag"), 30, 0.5, "node in headscale")
    assert set(node.get("tags") or []) == {"tag:k8s", "tag:ctl"}, node
    # no policy (as the lab starts): refused, as before
    got = provider(lab, api_key, op="sync", id=stable_id, tags=["tag:k8s", "tag:web"])
    assert "invalid or not permitted" in (got["error"] or ""), got
    with lab.hs_policy(POLICY):
        got = provider(lab, api_key, op="sync", id=stable_id, tags=["tag:web", "tag:k8s"])
        assert got == {"error": None, "sent": [f"GET /api/v1/node/{stable_id}",
                                               f"POST /api/v1/node/{stable_id}/tags"]}, got
        assert set(lab.hs_node("ctl-retag").get("tags") or []) == {"tag:k8s", "tag:web"}
        # the proxy itself is told: its own status carries the new tags, no restart, no new key
        wait_until(lambda: set(agent.status()["Self"].get("Tags") or []) == {"tag:k8s", "tag:web"}, 30, 0.5,
                   "the proxy's own tags")
        # equal as sets (order and duplicates do not count): read only, nothing written
        got = provider(lab, api_key, op="sync", id=stable_id, tags=["tag:k8s", "tag:web", "tag:k8s"])
        assert got == {"error": None, "sent": [f"GET /api/v1/node/{stable_id}"]}, got
        # a tag no tagOwners defines is still refused, with headscale's answer, and changes nothing
        got = provider(lab, api_key, op="sync", id=stable_id, tags=["tag:k8s", "tag:nope"])
        assert got["error"].startswith(f"device tags not applied (tag:k8s,tag:nope on device {stable_id}): "
                                       f"headscale: setting the tags of node {stable_id}: headscale's policy "
                                       "refuses tag:nope ("), got
        assert "tag:nope" in got["error"] and "invalid or not permitted" in got["error"], got
        assert set(lab.hs_node("ctl-retag").get("tags") or []) == {"tag:k8s", "tag:web"}
        assert agent.running()
    # the policy is gone again: the lab is as other tests expect it
    got = provider(lab, api_key, op="sync", id=stable_id, tags=["tag:k8s", "tag:ctl"])
    assert "invalid or not permitted" in (got["error"] or ""), got
