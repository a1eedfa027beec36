"""The headscale provider against each headscale minor it speaks (0.26 to 0.29), replaying the REST answers
recorded from the real servers in the lab (`make compat` → tests/data/headscale/<version>/, by
labtools/hsmatrix.py): the version detected, keys minted or refused by name, the node's tags read where that
version keeps them, re-tagging, route approval, deletion, and every error a user can meet as a message naming
its fix. Each call is the one the controller makes (labtools.hsmatrix.run_op); the replay checks that the
provider sends the requests the server answered, in order."""
from __future__ import annotations

import asyncio
import json
import pathlib
import sys
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from controller.providers import REASON_UNSUPPORTED, limitations
from controller.providers.headscale import HeadscaleProvider
from controller.providers.hscompat import Capabilities, api_level, detect, explain
from labtools.hsmatrix import KEY_PLACEHOLDER, SUBNET, run_op
from labtools.lab import HEADSCALE_VERSIONS

DATA = pathlib.Path(__file__).resolve().parent / "data" / "headscale"
#: The versions of the matrix whose answers are recorded (`make compat` records them all).
VERSIONS = tuple(v for v in HEADSCALE_VERSIONS if (DATA / v).is_dir())


class Replay(httpx.AsyncBaseTransport):
    """Serves the recorded exchanges in order; a request the server did not get fails the test."""

    def __init__(self, exchanges: list[dict]) -> None:
        self.left = list(exchanges)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert self.left, f"unrecorded request {request.method} {request.url.path}"
        ex = self.left.pop(0)
        assert (request.method, request.url.path) == (ex["method"], ex["path"])
        if ex["request"] is not None:
            sent = json.loads(request.content)
            sent.pop("expiration", None)
            want = {k: v for k, v in ex["request"].items() if k != "expiration"}
            assert sent == want
        body = ex["response"]
        content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        return httpx.Response(ex["status"], content=content, request=request)


def scenario(version: str, name: str) -> list[dict]:
    path = DATA / version / f"{name}.json"
    assert path.exists(), f"no recording {path}: run `make compat` (root) to record it"
    return json.loads(path.read_text())


def replay(version: str, name: str) -> list[Any]:
    """Each recorded call made again by the provider against the recorded answers; their results now."""
    async def go() -> list[Any]:
        outs = []
        for rec in scenario(version, name):
            t = Replay(rec["exchanges"])
            outs.append(await run_op(rec["op"], "http://10.99.0.1:8080", "hskey-api-REPLAY", t))
            assert not t.left, f"{name}: recorded requests not sent: {[(e['method'], e['path']) for e in t.left]}"
        return outs
    return asyncio.run(go())


def old(version: str) -> bool:
    return version in ("v0.26.1", "v0.27.1")


def test_the_pinned_and_the_oldest_versions_are_recorded():
    assert {"v0.26.1", "v0.29.2"} <= set(VERSIONS), f"recorded: {VERSIONS}; run `make compat` (root)"


@pytest.mark.parametrize("version", VERSIONS)
def test_version_detected_from_its_api(version):
    (got,) = replay(version, "detect")
    assert got["level"] == [0, int(version.split(".")[1])]
    if old(version):
        assert "unavailable: pre-auth keys without a user (tag-only keys) (needs 0.28)" in got["summary"]
    if version != "v0.29.2":
        assert "grants with app capabilities" in got["summary"] and "(needs 0.29)" in got["summary"]
    else:
        assert "every feature the controller uses is available" in got["summary"]


@pytest.mark.parametrize("version", VERSIONS)
def test_keys_with_and_without_a_user(version):
    tag_only, for_user = replay(version, "keys")
    assert for_user == {"key": KEY_PLACEHOLDER}
    if old(version):
        # refused before asking: the message names the version, the minor that has it and the setting
        assert tag_only["reason"] == REASON_UNSUPPORTED
        msg = tag_only["error"]
        # the lab's builds have no release stamp (`dev`): named by the minor their API is
        assert f"headscale {version[1:5]} cannot do pre-auth keys without a user" in msg
        assert "needs headscale 0.28 or later" in msg and "headscale.user (HEADSCALE_USER)" in msg
        assert "headscale users list" in msg and "HTTP" not in msg
    else:
        assert tag_only == {"key": KEY_PLACEHOLDER}


@pytest.mark.parametrize("version", VERSIONS)
def test_headscales_own_answer_to_a_key_without_user(version):
    """Where the version could not be detected, headscale's own refusal (0.26, 0.27: HTTP 500 `user not found`)
    still becomes the message naming the setting."""
    (got,) = replay(version, "key_tag_only_undetected")
    if old(version):
        assert "HTTP 500" not in got["error"] and "user not found" not in got["error"]
        assert "needs headscale 0.28 or later" in got["error"] and "headscale.user (HEADSCALE_USER)" in got["error"]
    else:
        assert got == {"key": KEY_PLACEHOLDER}


@pytest.mark.parametrize("version", VERSIONS)
def test_errors_name_their_fix_and_no_secret(version):
    unknown_user, bad_key, expired_key = replay(version, "errors")
    assert unknown_user["error"].startswith("headscale: creating a pre-auth key: headscale has no user with ID 9999 "
                                            "(headscale.user (HEADSCALE_USER))")
    assert "headscale users list" in unknown_user["error"]
    for got in (bad_key, expired_key):
        msg = got["error"]
        assert "headscale refused the controller's API key" in msg and "Unauthorized" in msg
        assert "headscale apikeys create --expiration 8760h" in msg and "HEADSCALE_API_KEY_FILE" in msg
        assert "BBBBBBBB" not in msg and "RECORDED" not in msg
    for got in (unknown_user, bad_key, expired_key):
        assert "HTTP 500" not in got["error"]


@pytest.mark.parametrize("version", VERSIONS)
def test_node_tags_read_where_the_version_keeps_them(version):
    (got,) = replay(version, "node")
    assert got == {"tags": ["tag:k8s"]}      # forcedTags on 0.26/0.27, tags from 0.28
    node = scenario(version, "node")[0]["exchanges"][-1]["response"]["node"]
    assert ("tags" in node) is not old(version)


@pytest.mark.parametrize("version", VERSIONS)
def test_retag(version):
    no_policy, policy, with_policy, outside, back, reset = replay(version, "retag")
    assert policy["status"] == 200 and reset["status"] == 200
    assert with_policy == {"set": True} and back == {"set": True}
    if old(version):
        # 0.26 and 0.27 force any tag through the API, policy or not
        assert no_policy == {"set": True} and outside == {"set": True}
    else:
        for got, tags in ((no_policy, "tag:k8s, tag:web"), (outside, "tag:nope (")):     # the one refused
            assert f"headscale's policy refuses {tags}" in got["error"] and "tagOwners" in got["error"]
            assert "headscale policy set -f policy.hujson" in got["error"]


@pytest.mark.parametrize("version", VERSIONS)
def test_subnet_and_exit_routes_approved(version):
    (got,) = replay(version, "routes")
    assert got == {"approved": sorted(["0.0.0.0/0", "::/0", SUBNET])}


@pytest.mark.parametrize("version", VERSIONS)
def test_device_deletion_and_already_gone(version):
    assert replay(version, "delete") == [{"deleted": True}, {"deleted": False}, {"tags": None}]


@pytest.mark.parametrize("version", VERSIONS)
def test_policy_examples_of_the_docs_accepted_by_their_version(version):
    from labtools.hsmatrix import doc_policies, minor
    mine = [text for _, minors, text in doc_policies() if minor(version) in minors]
    recorded = {r["op"]["policy"]: r["result"] for r in scenario(version, "policies")}
    assert mine and all(text in recorded for text in mine), "the docs changed since the last `make compat`"
    assert all(recorded[text]["status"] == 200 for text in mine), [recorded[t] for t in mine]


def test_the_newest_minimal_policy_is_refused_by_0_26():
    from labtools.hsmatrix import doc_policies
    newest = next(t for n, m, t in doc_policies() if n == "minimal" and "0.29" in m)
    got = {r["op"]["policy"]: r["result"] for r in scenario("v0.26.1", "policies")}[newest]
    assert got["status"] != 200 and "autogroup:member" in got["message"]


# ---- the pure parts, on the recorded documents


@pytest.mark.parametrize("version", VERSIONS)
def test_api_level_from_the_recorded_openapi_document(version):
    ex = [e for e in scenario(version, "detect")[0]["exchanges"] if e["path"].startswith("/swagger/")]
    assert api_level(ex[0]["response"]) == (0, int(version.split(".")[1]))


def test_release_names_the_version_api_decides_the_features():
    swagger = [e for e in scenario("v0.26.1", "detect")[0]["exchanges"] if e["path"].startswith("/swagger/")][0]
    caps = detect({"version": "v0.26.1", "commit": "x"}, swagger["response"])
    assert (caps.version, caps.level, caps.tags_field) == ("v0.26.1", (0, 26), "forcedTags")
    assert detect({"version": "dev"}, swagger["response"]).version == "0.26"
    assert detect({"version": "v0.30.0"}, None).level == (0, 30)
    undetected = detect(None, None)
    assert not undetected.detected and undetected.level == (0, 29)


def test_older_than_0_26_refused_by_name():
    caps = detect(None, {"paths": {"/api/v1/node": {}, "/api/v1/routes": {}},
                         "definitions": {"v1Node": {"properties": {"forcedTags": {}}}}})
    assert caps.level == (0, 25) and not caps.supported
    p = HeadscaleProvider("http://hs", api_key="k", capabilities=caps)
    with pytest.raises(Exception) as e:
        asyncio.run(p.create_auth_key(("tag:k8s",)))
    assert "older than 0.26, the oldest the controller speaks" in str(e.value)
    assert "upgrade headscale one minor at a time" in str(e.value)
    assert limitations(p, "Service") == (str(e.value),)


def test_limitations_for_the_api_server_proxy_in_auth_mode():
    from controller.model import APISERVER, SVC
    p = HeadscaleProvider("http://hs", api_key="k", capabilities=Capabilities("v0.28.0", (0, 28)))
    (msg,) = limitations(p, APISERVER, True)
    assert msg.startswith("headscale: headscale v0.28.0 cannot do grants with app capabilities")
    assert "needs headscale 0.29 or later" in msg
    assert limitations(p, APISERVER, False) == () and limitations(p, SVC, True) == ()
    p.capabilities = Capabilities("v0.29.2", (0, 29))
    assert limitations(p, APISERVER, True) == ()
    assert limitations(object(), APISERVER, True) == ()


def test_unknown_errors_keep_headscales_words_without_the_envelope():
    msg, transient = explain("reading node 3", 500, '{"code": 2, "message": "database is locked"}',
                             Capabilities("v0.29.2", (0, 29)))
    assert msg == "headscale: reading node 3: headscale answered HTTP 500: database is locked" and transient
    msg, transient = explain("reading node 3", 404, "404 page not found", Capabilities("v0.29.2", (0, 29)))
    assert "does not serve headscale's API under /api/v1" in msg and "HEADSCALE_URL" in msg and not transient


# ---- `make compat --check`: a run against the docs' table (bench/results/compat.json)


def test_a_cell_verdict_drops_what_changes_between_runs_and_keeps_what_a_user_reads():
    from labtools.hsmatrix import verdict
    assert verdict("works (100.64.0.2, fd7a:115c:a1e0::2)") == verdict("works (100.64.0.7, fd7a:115c:a1e0::7)")
    assert verdict("works (10 passed in 98.34s (0:01:38))") == ("works",)
    assert verdict("accepted; auto-approved 10.98.0.0/24 for node 3") == ("accepted", "auto-approved")
    assert verdict("accepted; auto-approval failed: timeout") != verdict("accepted; auto-approved 10.98.0.0/24")
    assert verdict("refused: headscale 0.26 cannot do grants ...") == ("refused",)
    assert verdict("works") != verdict("refused: headscale 0.26 cannot do grants")
    assert verdict("0.26 (API 0.26)") != verdict("0.27 (API 0.27)")
    # the controller's start-up line: what it says is unavailable, not the version it names
    assert verdict("headscale 0.26: unavailable: grants (needs 0.29)") == verdict("headscale v0.27.1: unavailable: x")
    assert verdict("headscale 0.29: every feature the controller uses is available") != verdict(
        "headscale 0.29: unavailable: grants (needs 0.29)")


def test_the_docs_table_agrees_with_each_versions_last_recorded_run():
    from labtools.hsmatrix import differences
    rows = {v: json.loads((DATA / v / "table.json").read_text()) for v in VERSIONS}
    assert differences(rows) == []


def test_a_run_that_differs_from_the_docs_table_is_named_by_version_and_feature():
    from bench.results import Table
    from labtools.hsmatrix import differences
    docs = Table.of(["feature", "headscale v0.26.1"], [["deletion", "works"], ["tag-only key", "refused: x"]])
    assert differences({"v0.26.1": {"deletion": "works", "tag-only key": "refused: y"}}, docs) == []
    got = differences({"v0.26.1": {"deletion": "failed: timeout", "new step": "works"},
                       "v0.30.0": {"deletion": "works"}}, docs)
    assert got == ["v0.26.1 deletion: 'failed: timeout', the docs say 'works'",
                   "v0.26.1 new step: not a row of the docs' table",
                   "v0.30.0: not in the docs' table (its columns: headscale v0.26.1)"]


@pytest.mark.parametrize("caps", [Capabilities("0.26", (0, 26)), Capabilities("v0.29.2", (0, 29)),
                                  Capabilities("dev", (0, 27)), Capabilities("0.29 (assumed)", (0, 29), detected=False),
                                  Capabilities("v0.25.1", (0, 25))])
def test_the_compat_story_finds_the_controllers_start_up_line(caps):
    """labtools.hsstory reads the start-up line from the controller's log by this pattern: every shape of it."""
    from labtools.hsstory import STARTUP_LINE
    for user_set in (False, True):
        line = caps.summary(user_set=user_set)
        m = STARTUP_LINE.search(f"2026-11-28 03:00:00 WARNING controller.providers.headscale: {line}")
        assert m and m.group(0) == line, line
