"""The API server proxy's pure core: grants → impersonation, and the headers sent to the API server."""
from __future__ import annotations

import pytest

from containerboot.apiproxy.identity import (
    CAP_KUBERNETES,
    CAP_KUBERNETES_OLD,
    GrantError,
    Impersonation,
    NoIdentity,
    forwarded_request_headers,
    forwarded_response_headers,
    grant_groups,
    impersonation,
    is_upgrade,
)


def whois(login="alice@example.com", *, tags=(), name="laptop.tail.example.", caps=None):
    return {"Node": {"Name": name, "Tags": list(tags)}, "UserProfile": {"LoginName": login},
            "CapMap": caps or {}}


def test_user_node_is_impersonated_by_login_name_with_its_granted_groups():
    caps = {CAP_KUBERNETES: [{"impersonate": {"groups": ["tailnet-readers"]}}]}
    assert impersonation(whois("bars", caps=caps)) == Impersonation("bars", ("tailnet-readers",))


def test_several_grants_merge_each_group_once_in_order():
    caps = {CAP_KUBERNETES: [{"impersonate": {"groups": ["a", "b"]}}, {"recorder": ["tag:rec"]},
                             {"impersonate": {"groups": ["b", "c"]}}, None, {"impersonate": None}]}
    assert impersonation(whois(caps=caps)).groups == ("a", "b", "c")


def test_no_grant_means_the_user_alone():
    assert impersonation(whois()) == Impersonation("alice@example.com", ())


def test_tagged_node_is_its_name_without_the_dot_with_tags_as_groups_when_no_rule_gives_any():
    who = whois(tags=["tag:ci", "tag:k8s"], name="runner.tail.example.")
    assert impersonation(who) == Impersonation("runner.tail.example", ("tag:ci", "tag:k8s"))
    who["CapMap"] = {CAP_KUBERNETES: [{"impersonate": {"groups": ["deployers"]}}]}
    assert impersonation(who) == Impersonation("runner.tail.example", ("deployers",))


def test_legacy_capability_name_only_when_the_current_one_has_no_rules():
    old = {CAP_KUBERNETES_OLD: [{"impersonate": {"groups": ["old"]}}]}
    assert impersonation(whois(caps=old)).groups == ("old",)
    both = {**old, CAP_KUBERNETES: [{"impersonate": {"groups": ["new"]}}]}
    assert impersonation(whois(caps=both)).groups == ("new",)


def test_field_names_match_case_insensitively_and_unknown_fields_are_ignored_as_in_go():
    caps = {CAP_KUBERNETES: [{"Impersonate": {"Groups": ["x"]}, "somethingNew": 1}]}
    assert grant_groups(caps) == (("x",), 1)


@pytest.mark.parametrize("rule, words", [
    ("tailnet-readers", "rule 0 of capability 'tailscale.com/cap/kubernetes' is a string"),
    ({"impersonate": ["tailnet-readers"]}, "impersonate is a list"),
    ({"impersonate": {"groups": "tailnet-readers"}}, "impersonate.groups is a string, want a list of strings"),
    ({"impersonate": {"groups": ["ok", 3]}}, "with an item that is not a string"),
    ({"impersonate": {"groups": ["bad\r\nX-Injected: 1"]}}, "cannot be sent in a header"),
    ({"enforceRecorder": "yes"}, "enforceRecorder is a string, want true or false"),
])
def test_malformed_rule_is_an_error_naming_the_rule(rule, words):
    caps = {CAP_KUBERNETES: [{"impersonate": {"groups": ["fine"]}}, rule]}
    with pytest.raises(GrantError) as e:
        impersonation(whois(caps=caps))
    assert words.replace("rule 0", "rule 1") in str(e.value)
    assert "rule 1 of capability 'tailscale.com/cap/kubernetes'" in str(e.value)


def test_node_without_a_login_name_has_no_identity():
    with pytest.raises(NoIdentity):
        impersonation(whois(login=""))


def _h(**kw):
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in kw.items()]


def test_auth_mode_strips_client_credentials_and_adds_the_proxys_own():
    client = [(b"Host", b"100.64.0.5"), (b"Authorization", b"Bearer client"), (b"Impersonate-User", b"admin"),
              (b"Impersonate-Group", b"system:masters"), (b"Impersonate-Uid", b"0"),
              (b"Impersonate-Extra-Scopes", b"all"), (b"Accept", b"application/json"),
              (b"Connection", b"keep-alive, X-Private"), (b"X-Private", b"hop"), (b"X-Forwarded-For", b"1.2.3.4")]
    out = forwarded_request_headers(client, host=b"10.96.0.1:443",
                                    who=Impersonation("bars", ("tailnet-readers", "devs")), token="sa-token")
    assert out == [(b"host", b"10.96.0.1:443"), (b"accept", b"application/json"),
                   (b"authorization", b"Bearer sa-token"), (b"impersonate-user", b"bars"),
                   (b"impersonate-group", b"tailnet-readers"), (b"impersonate-group", b"devs")]


def test_noauth_mode_passes_the_clients_credentials_through():
    client = [(b"Host", b"proxy"), (b"Authorization", b"Bearer client"), (b"Impersonate-User", b"x"),
              (b"Content-Length", b"12")]
    out = forwarded_request_headers(client, host=b"api:6443", who=None, token="unused")
    assert out == [(b"host", b"api:6443"), (b"authorization", b"Bearer client"), (b"impersonate-user", b"x"),
                   (b"content-length", b"12")]


def test_upgrade_request_keeps_its_upgrade_and_chunked_body_stays_chunked():
    client = [(b"Connection", b"Upgrade"), (b"Upgrade", b"SPDY/3.1"), (b"X-Stream-Protocol-Version", b"v4")]
    assert is_upgrade(client) == b"SPDY/3.1"
    out = forwarded_request_headers(client, host=b"api", who=None, token="")
    assert out[-2:] == [(b"connection", b"Upgrade"), (b"upgrade", b"SPDY/3.1")]
    assert is_upgrade([(b"Upgrade", b"websocket")]) == b""     # without Connection: upgrade it is no upgrade
    out = forwarded_request_headers([(b"Transfer-Encoding", b"chunked")], host=b"api", who=None, token="")
    assert out == [(b"host", b"api"), (b"transfer-encoding", b"chunked")]


def test_response_headers_drop_hop_by_hop_except_on_a_switch():
    resp = [(b"Content-Type", b"application/json"), (b"Transfer-Encoding", b"chunked"),
            (b"Connection", b"keep-alive")]
    assert forwarded_response_headers(resp) == [(b"content-type", b"application/json")]
    switch = [(b"Connection", b"Upgrade"), (b"Upgrade", b"SPDY/3.1")]
    assert forwarded_response_headers(switch, upgrade=True) == [(b"connection", b"Upgrade"),
                                                                 (b"upgrade", b"SPDY/3.1")]
