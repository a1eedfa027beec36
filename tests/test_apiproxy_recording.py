"""Recording rules of the API server proxy (pure): the caller's rules, recorders from tags, sessions, plans."""
from __future__ import annotations

import pytest

from containerboot.apiproxy.identity import CAP_KUBERNETES, GrantError
from containerboot.apiproxy.recording import (
    SPDY,
    WEBSOCKET,
    RecorderPolicy,
    Session,
    plan,
    recorder_addrs,
    recorder_policy,
    session_of,
)


def caps(*rules):
    return {CAP_KUBERNETES: list(rules)}


def test_rules_merge_recorders_enforcement_and_events_and_remember_which_rules_asked():
    p = recorder_policy(caps({"impersonate": {"groups": ["a"]}}, {"recorder": ["tag:rec"]},
                             {"recorderAddrs": ["100.64.0.9:80", "[fd7a:115c:a1e0::9]:80"], "enforceRecorder": True},
                             {"enableEvents": True, "recorder": ["tag:rec", "tag:rec2"]}))
    assert p == RecorderPolicy(("tag:rec", "tag:rec2"), ("100.64.0.9:80", "[fd7a:115c:a1e0::9]:80"), True, True,
                               (1, 2, 3))
    assert "rules 1, 2, 3 of capability 'tailscale.com/cap/kubernetes'" in p.which()


def test_recording_fails_open_by_default_and_the_legacy_name_carries_no_recording():
    assert recorder_policy(caps({"recorder": ["tag:rec"]})).enforce is False
    assert not recorder_policy({"https://" + CAP_KUBERNETES: [{"enforceRecorder": True}]}).asks
    assert not recorder_policy(caps({"impersonate": {"groups": ["a"]}})).asks
    # Go's decoding: field names case-insensitively, false and null are the zero value
    assert recorder_policy(caps({"EnforceRecorder": True})).enforce
    assert not recorder_policy(caps({"enforceRecorder": False, "recorder": None})).asks


@pytest.mark.parametrize("rule, words", [
    ({"recorder": "tag:rec"}, "rule 0 of capability 'tailscale.com/cap/kubernetes': recorder is a string"),
    ({"recorder": ["rec"]}, "recorder has 'rec', want a tag"),
    ({"recorderAddrs": ["100.64.0.9"]}, "recorderAddrs has '100.64.0.9', want an address and port"),
    ({"recorderAddrs": ["fd7a::9:80"]}, "recorderAddrs has 'fd7a::9:80'"),
    ({"enableEvents": "yes"}, "enableEvents is a string, want true or false"),
])
def test_a_malformed_recording_rule_is_an_error_naming_the_rule(rule, words):
    with pytest.raises(GrantError) as e:
        recorder_policy(caps(rule))
    assert words in str(e.value)


def test_recorder_tags_resolve_to_peers_online_first_ipv4_first_after_the_rules_addresses():
    status = {"Peer": {
        "k1": {"DNSName": "rec-0.t.", "Tags": ["tag:rec"], "Online": False, "TailscaleIPs": ["100.64.0.1"]},
        "k2": {"DNSName": "rec-1.t.", "Tags": ["tag:rec", "tag:x"], "Online": True,
               "TailscaleIPs": ["fd7a:115c:a1e0::2", "100.64.0.2"]},
        "k3": {"DNSName": "other.t.", "Tags": ["tag:other"], "Online": True, "TailscaleIPs": ["100.64.0.3"]},
        "k4": {"DNSName": "user.t.", "Online": True, "TailscaleIPs": ["100.64.0.4"]}}}
    p = RecorderPolicy(tags=("tag:rec",), addrs=("100.64.0.9:80",), rules=(0,))
    assert recorder_addrs(p, status) == ("100.64.0.9:80", "100.64.0.2:80", "[fd7a:115c:a1e0::2]:80", "100.64.0.1:80")
    assert recorder_addrs(RecorderPolicy(tags=("tag:none",)), status) == ()


@pytest.mark.parametrize("method, target, want", [
    (b"POST", b"/api/v1/namespaces/ns/pods/web/exec?command=sh&tty=true", Session("exec", SPDY, "ns", "web")),
    (b"GET", b"/api/v1/namespaces/ns/pods/web/attach?stdin=true", Session("attach", WEBSOCKET, "ns", "web")),
    (b"POST", b"//api/v1/namespaces/ns/pods/web/./exec", Session("exec", SPDY, "ns", "web")),
    (b"POST", b"/api/v1/namespaces/ns/pods/web/%65xec", Session("exec", SPDY, "ns", "web")),
    (b"POST", b"/api/v1/namespaces/ns/pods/x/../web/exec/", Session("exec", SPDY, "ns", "web")),
    (b"POST", b"/api/v1/namespaces/ns/pods/web/portforward", None),
    (b"GET", b"/api/v1/namespaces/ns/pods/web/log", None),
    (b"PUT", b"/api/v1/namespaces/ns/pods/web/exec", None),
    (b"GET", b"/api/v1/namespaces/ns/pods", None),
])
def test_sessions_are_exec_and_attach_however_the_path_is_spelled(method, target, want):
    assert session_of(method, target) == want


ENFORCED = RecorderPolicy(tags=("tag:rec",), enforce=True, rules=(1,))
OPEN = RecorderPolicy(tags=("tag:rec",), rules=(0,))
EXEC = Session("exec", SPDY, "ns", "web")
T = b"/api/v1/namespaces/ns/pods/web/exec?command=sh"


def test_enforced_without_a_recorder_refuses_sessions_and_other_requests_with_upstreams_message():
    p = plan(ENFORCED, (), EXEC, target=T, upgrade=b"SPDY/3.1")
    assert p.action == "refuse"
    assert p.message.startswith("forbidden: 'kubectl exec' session must be recorded, but no recorders are "
                                "available.")
    assert "rule 1 of capability 'tailscale.com/cap/kubernetes' (recorder ['tag:rec'], enforceRecorder: true)" \
        in p.message and "no peer carries tag:rec" in p.message
    p = plan(ENFORCED, (), None, target=b"/api/v1/pods", upgrade=b"")
    assert p.action == "refuse"
    assert p.message.startswith('forbidden: api request "/api/v1/pods" must be recorded, but no recorders')


def test_not_enforced_without_a_recorder_passes_with_a_warning_for_sessions():
    p = plan(OPEN, (), EXEC, target=T, upgrade=b"SPDY/3.1")
    assert (p.action, "name no recorder that is on the tailnet" in p.message) == ("pass", True)
    assert plan(OPEN, (), None, target=b"/api/v1/pods", upgrade=b"") == plan(RecorderPolicy(), (), EXEC, target=T,
                                                                            upgrade=b"SPDY/3.1")


def test_with_recorders_sessions_are_recorded_other_requests_pass():
    p = plan(ENFORCED, ("100.64.0.2:80",), EXEC, target=T, upgrade=b"SPDY/3.1")
    assert (p.action, p.addrs, p.fail_open) == ("record", ("100.64.0.2:80",), False)
    assert plan(OPEN, ("100.64.0.2:80",), EXEC, target=T, upgrade=b"SPDY/3.1").fail_open is True
    assert plan(ENFORCED, ("100.64.0.2:80",), None, target=b"/api/v1/pods", upgrade=b"").action == "pass"


def test_a_session_whose_upgrade_does_not_match_its_method_is_refused_only_when_enforced():
    ws_as_post = Session("exec", SPDY, "ns", "web")
    p = plan(ENFORCED, ("100.64.0.2:80",), ws_as_post, target=T, upgrade=b"websocket")
    assert p.action == "refuse"
    assert p.message.startswith('[unexpected] unable to verify that streaming protocol is SPDY, wants Upgrade '
                                'header "SPDY/3.1", got: "websocket"; failure mode is \'fail closed\'')
    p = plan(OPEN, ("100.64.0.2:80",), ws_as_post, target=T, upgrade=b"")
    assert p.action == "pass" and "failure mode is 'fail open'; continuing session without recording." in p.message
