"""The failover scenario's pure part: reading the client Pod's log into the figures a case reports
(labtools.pgfailover; the scenario itself runs in netns-tests/test_pg_failover_twonode.py)."""
from __future__ import annotations

import json

import pytest

from labtools import pgfailover as fo

LOG = """\
100.0 new ok 100.64.0.2
100.1 held 100.64.0.2 4000 ok
100.1 held 100.64.0.3 4001 ok
100.2 new ok 100.64.0.3
100.4 new fail ConnectionRefusedError
100.6 new fail TimeoutError
102.6 new ok 100.64.0.2
102.7 held 100.64.0.3 4001 fail TimeoutError
102.7 held 100.64.0.2 4000 ok
103.0 new ok 100.64.0.3
103.1 held 100.64.0.2 4000 ok
garbage line
"""


def test_log_lines_become_attempts_and_held_pings():
    new, held = fo.parse_log(LOG)
    assert [(a.t, a.ok, a.peer) for a in new][:3] == [(100.0, True, "100.64.0.2"), (100.2, True, "100.64.0.3"),
                                                      (100.4, False, "")]
    assert len(new) == 6 and len(held) == 5
    assert held[2] == fo.Held(102.7, "100.64.0.3", 4001, False)


def test_gap_spans_from_the_last_success_before_to_the_first_after():
    new, _ = fo.parse_log(LOG)
    assert abs(fo.longest_gap(new, 100.3, 102.6) - 2.4) < 1e-9     # 100.2 -> 102.6
    assert fo.longest_gap([], 1, 2) == float("inf")                # nothing succeeded: no bound


def test_judge_names_the_survivors_held_connection_and_whether_it_broke():
    r = fo.judge("kill", "ha-1", "100.64.0.3", "100.64.0.2", 100.3, 103.0, 103.1, LOG, {"back": 2.7})
    assert (r.new_ok, r.new_fail, r.new_ok_survivor) == (2, 2, 1)
    assert r.held_port == 4000 and r.held_ok_after and not r.held_failed
    # seen from the other side, the held connection through the victim broke
    r2 = fo.judge("kill", "ha-0", "100.64.0.2", "100.64.0.3", 100.3, 103.0, 103.1, LOG)
    assert r2.held_port == 4001 and r2.held_failed and not r2.held_ok_after


def test_a_victim_that_never_comes_back_counts_every_survivor_success_of_the_case():
    # a lost node's replica is out until the case ends: it left the slice at 102.0, the survivor answered after
    log = LOG + "103.05 new ok 100.64.0.2\n"
    assert fo.judge("lose", "ha-1", "100.64.0.3", "100.64.0.2", 100.3, 102.0, 103.1, log).new_ok_survivor == 0
    r = fo.judge("lose", "ha-1", "100.64.0.3", "100.64.0.2", 100.3, 102.0, 103.1, log, survivor_until=103.1)
    assert r.new_ok_survivor == 2


def test_a_failure_says_whether_it_waited_for_the_clients_timeout():
    new, _ = fo.parse_log(LOG + "103.2 new fail TimeoutError 2.001\n103.4 new fail ConnectionRefusedError 1.02\n")
    assert [a.error for a in new if not a.ok] == ["ConnectionRefusedError", "TimeoutError", "TimeoutError",
                                                   "ConnectionRefusedError"]
    r = fo.judge("kill", "ha-1", "100.64.0.3", "100.64.0.2", 100.3, 103.0, 103.5,
                 LOG + "103.2 new fail TimeoutError 2.001\n")
    assert (r.new_fail, r.new_timed_out) == (3, 2)


def test_the_steps_of_a_replicas_exit_are_read_from_the_logs_timestamps():
    start = 1795847560.0     # 2026-11-28T06:32:40Z
    agent = ("2026-11-28T06:32:39.900000000Z boot: 2026/11/28 06:32:39 Removed the agent's firewall rules\n"
             "2026-11-28T06:32:40.212000000Z boot: 2026/11/28 06:32:40 tailscaled exited unexpectedly with status -9\n"
             "2026-11-28T06:32:40.250000000Z boot: 2026/11/28 06:32:40 Removed the agent's firewall rules\n"
             "2026-11-28T06:32:40.408000000Z boot: 2026/11/28 06:32:40 removed 24 conntrack entries of connections "
             "the removed rules had translated\n"
             "2026-11-28T06:32:40.409000000Z boot: 2026/11/28 06:32:40 HTTP server at 10.244.0.5:9002 closed\n")
    ctl = ("2026-11-28T06:32:40.500000000Z 2026-11-28 06:32:40,499 controller WARNING ProxyGroup ha: replica ha-10 "
           "(10.244.0.9) refused its health check; it leaves the egress EndpointSlices until it answers again\n"
           "2026-11-28T06:32:40.600000000Z 2026-11-28 06:32:40,599 controller WARNING ProxyGroup ha: replica ha-1 "
           "(10.244.0.5) refused its health check; it leaves the egress EndpointSlices until it answers again\n")
    got = {k: round(v, 3) for k, v in fo.death_steps(agent, ctl, "ha-1", start).items()}
    assert got == {"agent_noticed": 0.212, "rules_removed": 0.25, "conntrack_flushed": 0.408,
                   "health_closed": 0.409, "probe_out": 0.6}


def _slice(*eps: tuple[str, bool | None]) -> dict:
    return {"endpoints": [{"addresses": [ip], **({} if r is None else {"conditions": {"ready": r}})}
                          for ip, r in eps]}


def test_a_replica_is_in_a_slice_when_listed_and_not_marked_not_ready():
    assert fo.in_slice(_slice(("10.0.0.5", None)), "10.0.0.5")
    assert fo.in_slice(_slice(("10.0.0.5", True)), "10.0.0.5")
    assert not fo.in_slice(_slice(("10.0.0.5", False)), "10.0.0.5")
    assert not fo.in_slice(_slice(("10.0.0.6", None)), "10.0.0.5")
    assert not fo.in_slice({}, "10.0.0.5")


def test_a_watchs_output_is_read_object_by_object_and_a_partial_last_one_left_out():
    a, b = _slice(("10.0.0.5", None)), _slice(("10.0.0.6", None))
    text = json.dumps(a, indent=4) + "\n" + json.dumps(b, indent=4) + "\n" + json.dumps(a)[:10]
    assert fo.watched_slices(text) == [a, b]
    assert fo.watched_slices("") == []


def test_membership_changes_count_each_leave_and_return():
    assert fo.membership_changes([True, True, True]) == (0, 0)
    assert fo.membership_changes([True, False, True, True, False]) == (3, 2)
    assert fo.membership_changes([False, True]) == (1, 0)
    assert fo.membership_changes([]) == (0, 0)


def test_the_lossy_table_drops_the_share_asked_on_the_device_and_its_counters_are_read():
    rules = fo.lossy_ruleset("eth0", 30)
    assert 'hook ingress device "eth0"' in rules and "numgen random mod 100 < 30" in rules and "drop" in rules
    listing = ("table netdev lossylab {\n\tchain ingress {\n\t\ttype filter hook ingress device \"eth0\" priority "
               "-500; policy accept;\n\t\tcounter packets 701 bytes 20575 numgen random mod 100 < 30 counter "
               "packets 213 bytes 6223 drop\n\t}\n}\n")
    assert fo.lossy_counts(listing) == (701, 213)
    with pytest.raises(ValueError, match="percent=130"):
        fo.lossy_ruleset("eth0", 130)
    with pytest.raises(ValueError, match="no two counters"):
        fo.lossy_counts("table netdev lossylab {}")
