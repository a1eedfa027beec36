"""containerboot.status: readiness, health and liveness verdicts, JSON."""
from __future__ import annotations

import json

from containerboot.status import AgentStatus, ServeStatus, TargetStatus, sample_key

NOW = 1_800_000_000.0


def running(**kw) -> AgentStatus:
    base = dict(backend_state="Running", tailnet_ips=("100.64.0.1", "fd7a:115c:a1e0::1"), started_at=NOW - 100,
                loop_heartbeat_at=NOW - 1, netmap_seen_at=NOW - 5, last_reconcile_at=NOW - 2)
    base.update(kw)
    return AgentStatus(**base)


def test_ready_when_everything_is_in_place() -> None:
    st = running(targets=(TargetStatus("dest", "dest-ip", ("10.0.0.1",), True, "", NOW),),
                 serve=ServeStatus(applied=True, cert_required=True, cert_ready=True))
    assert st.ready(NOW) == (True, [])
    assert st.healthy() and st.live(NOW)


def test_not_ready_reasons() -> None:
    st = AgentStatus(backend_state="Starting", started_at=NOW)
    ok, reasons = st.ready(NOW)
    assert not ok and reasons == ["tailscaled backend state is Starting, not Running"]
    assert not st.healthy()

    st = running(targets=(TargetStatus("db", "tailnet-target-fqdn", (), False, "cannot resolve db", NOW),
                          TargetStatus("web", "dest-ip", ("10.0.0.2",), True)))
    assert st.ready(NOW) == (False, ["target db (tailnet-target-fqdn): forwarding rules not installed: "
                                     "cannot resolve db"])

    st = running(serve=ServeStatus(applied=False, last_error="no-https"))
    assert st.ready(NOW) == (False, ["serve config not applied: no-https"])
    st = running(serve=ServeStatus(applied=True, cert_required=True, cert_ready=False))
    assert st.ready(NOW)[1] == ["serve config needs a TLS certificate that has not been issued yet"]
    st = running(serve=ServeStatus(applied=True, cert_required=False, cert_ready=False))
    assert st.ready(NOW) == (True, [])


def test_not_ready_before_the_first_reconcile_even_without_targets() -> None:
    # The bus can report Running with IPs before the reconciler has computed any target: an empty target list
    # then means "not known yet", and /readyz must not say 200 (the CI failure of session 2).
    st = running(last_reconcile_at=None)
    assert st.ready(NOW) == (False, ["the first reconcile has not finished yet"])
    assert running().ready(NOW) == (True, [])


def test_not_ready_while_shutting_down() -> None:
    st = running(stopping=True)
    assert st.ready(NOW) == (False, ["the agent is shutting down"])
    assert st.to_json(NOW)["stopping"] is True


def test_not_ready_while_the_rules_still_match_old_tailnet_addresses() -> None:
    dest = TargetStatus("dest", "dest-ip", ("10.0.0.1",), True, "", NOW)
    st = running(targets=(dest,), reconciled_ips=("100.64.0.9",))
    assert st.ready(NOW) == (False, ["the node's tailnet addresses changed; forwarding rules are being updated"])
    # Same addresses in another order: nothing to wait for.
    assert running(targets=(dest,), reconciled_ips=("fd7a:115c:a1e0::1", "100.64.0.1")).ready(NOW) == (True, [])
    # No target has rules that depend on the addresses: a change does not matter.
    assert running(reconciled_ips=("100.64.0.9",)).ready(NOW) == (True, [])


def test_netmap_age_does_not_gate_readiness() -> None:
    st = running(netmap_seen_at=NOW - 3600)
    assert st.ready(NOW)[0]
    assert st.netmap_age_s(NOW) == 3600
    assert AgentStatus().netmap_age_s(NOW) is None


def test_liveness() -> None:
    st = running(loop_heartbeat_at=NOW - 31)
    assert not st.live(NOW) and st.live(NOW, max_stall=60)
    assert st.ready(NOW) == (False, ["agent loop stalled for 31s"])
    # Before the first heartbeat, the start time counts.
    assert AgentStatus(started_at=NOW - 10).live(NOW)
    assert not AgentStatus(started_at=NOW - 100).live(NOW)


def test_healthy_is_upstream_meaning() -> None:
    # Healthy = has a tailnet IP, whatever else is going on.
    assert AgentStatus(backend_state="Starting", tailnet_ips=("100.64.0.1",)).healthy()


def test_counters_snapshot_is_immutable_copy() -> None:
    counters = {"containerboot_reconcile_total": 1.0}
    st = running(counters=counters)
    counters["containerboot_reconcile_total"] = 5
    assert st.counters["containerboot_reconcile_total"] == 1.0


def test_to_json_is_strict_json() -> None:
    st = running(targets=(TargetStatus("t", "dest-ip", ("10.0.0.1",), True, "", NOW),),
                 serve=ServeStatus(applied=True, https_endpoint="n.ts.net"),
                 counters={sample_key("containerboot_dns_resolutions_total", result="ok"): 3,
                           "nan_value": float("nan")})
    j = st.to_json(NOW)
    text = json.dumps(j, allow_nan=False)
    back = json.loads(text)
    assert back["ready"] is True and back["healthy"] is True and back["netmap_age_s"] == 5
    assert back["targets"][0] == {"name": "t", "kind": "dest-ip", "resolved": ["10.0.0.1"], "rules_installed": True,
                                  "last_error": "", "updated_at": NOW, "gates_readiness": True}
    assert back["serve"]["https_endpoint"] == "n.ts.net"
    assert back["counters"]['containerboot_dns_resolutions_total{result="ok"}'] == 3
    assert back["counters"]["nan_value"] is None


def test_sample_key() -> None:
    assert sample_key("m") == "m"
    assert sample_key("m", b="2", a='x"y\\') == 'm{a="x\\"y\\\\",b="2"}'


def test_tailscaled_health_is_reported_without_gating_readiness() -> None:
    st = running(health_warnings=(("not-in-map-poll", "Unable to connect to the coordination server"),))
    j = st.to_json(NOW)
    assert j["tailscaled_health"] == [{"code": "not-in-map-poll",
                                      "text": "Unable to connect to the coordination server"}]
    # A control plane outage leaves the data path working: the proxy stays ready (in its Service's endpoints).
    assert j["ready"] is True
