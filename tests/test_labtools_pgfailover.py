"""The failover scenario's pure part: reading the client Pod's log into the figures a case reports
(labtools.pgfailover; the scenario itself runs in netns-tests/test_pg_failover_twonode.py)."""
from __future__ import annotations

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
