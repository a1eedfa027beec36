"""The ProxyGroup replicas' health rule (controller.replicahealth): a lost replica leaves within seconds, a
slow or lossy link does not make a healthy one flap, and one that answers again comes back.

Answers come from a packet-level model of the prober's connections over the link (tests/support/lossylink.py),
so the rule is judged on what TCP would deliver, not on hand-picked answer times."""
from __future__ import annotations

import random

import pytest

from controller import replicahealth as rh
from controller.replicaprober import CONNECTIONS, INTERVAL
from tests.support.lossylink import Link, heard_times

RULE = rh.HealthRule()
TICK = 0.1


def changes(link: Link, seed: int, *, end: float = 60.0, start: float = 0.0) -> list[tuple[float, bool]]:
    """Verdict changes (time, serving) of one replica probed over `link` from `start` to `end`."""
    answers = heard_times(random.Random(seed), link, start=start, end=end, connections=CONNECTIONS,
                          interval=INTERVAL)
    h, out, i, t = rh.track(start), [], 0, start
    while t < end:
        while i < len(answers) and answers[i] <= t:
            nxt = rh.heard(RULE, h, answers[i])
            if nxt.serving != h.serving:
                out.append((answers[i], nxt.serving))
            h, i = nxt, i + 1
        nxt = rh.tick(RULE, h, t)
        if nxt.serving != h.serving:
            out.append((round(t, 3), nxt.serving))
        h, t = nxt, t + TICK
    return out


def test_a_link_that_drops_30_percent_of_packets_for_a_minute_never_takes_a_replica_out():
    flapped = [seed for seed in range(100) if changes(Link(lambda t: 0.3), seed)]
    assert flapped == []


def test_a_slow_link_is_not_silence():
    assert changes(Link(lambda t: 0.0, rtt=1.5), 0) == []
    assert changes(Link(lambda t: 0.1, rtt=0.8), 1) == []


def test_a_lost_node_takes_its_replica_out_within_seconds_and_it_stays_out():
    for seed in range(20):
        got = changes(Link(lambda t: 1.0 if t >= 10 else 0.0), seed, end=40)
        assert len(got) == 1, got
        when, serving = got[0]
        assert not serving
        assert 10 < when <= 10 + RULE.down_after + TICK


def test_a_replica_back_on_the_network_serves_again_after_answering_steadily():
    got = changes(Link(lambda t: 1.0 if 10 <= t < 20 else 0.0), 3, end=40)
    assert [s for _, s in got] == [False, True]
    back = got[1][0]
    assert 20 + RULE.up_after <= back <= 20 + RULE.up_after + 0.5


def test_a_link_that_answers_now_and_then_keeps_the_replica_out():
    # Half a second of answers every four seconds: never out for long enough to be noticed as away...
    def loss(t: float) -> float:
        return 0.0 if t < 10 or (t % 4) < 0.5 else 1.0
    got = changes(Link(loss), 5, end=60)
    # ...it leaves once, and the short bursts never bring it back (hysteresis).
    assert [s for _, s in got] == [False]


def test_rule_in_isolation():
    h = rh.track(0.0)
    assert rh.tick(RULE, h, 2.9).serving
    h = rh.tick(RULE, h, 3.0)
    assert not h.serving
    h = rh.heard(RULE, h, 3.5)
    assert not h.serving and h.answering_since == 3.5
    h = rh.heard(RULE, h, 4.4)
    h = rh.tick(RULE, h, 5.4)            # a silence of 1 s while coming back starts the count again
    assert h.answering_since is None
    h = rh.heard(RULE, h, 6.0)
    h = rh.heard(RULE, h, 6.9)
    h = rh.heard(RULE, h, 7.8)
    assert not rh.tick(RULE, h, 7.9).serving
    assert rh.heard(RULE, h, 8.0).serving


def test_a_refusal_takes_a_serving_replica_out_at_once_and_restarts_a_return():
    """A non-200 answer or a refused connection is the replica's own word (a link can lose answers, never make one
    up): out at once, not after the silence `down_after` allows."""
    h = rh.heard(RULE, rh.track(0.0), 0.5)
    h = rh.refused(RULE, h, 0.6)
    assert not h.serving
    assert not rh.tick(RULE, h, 0.7).serving
    # coming back: steady answers, one refusal, then the full `up_after` of answers again
    for t in (1.0, 1.5, 2.0, 2.5):
        h = rh.heard(RULE, h, t)
    h = rh.refused(RULE, h, 2.8)
    assert h.answering_since is None
    for t in (3.0, 3.5, 4.0, 4.5):
        h = rh.heard(RULE, h, t)
    assert not h.serving
    assert rh.heard(RULE, h, 5.0).serving


def test_when_no_replica_of_a_group_answers_every_candidate_serves():
    out = rh.Health(False, 0.0)
    states = {"pg-0": out, "pg-1": out}
    assert rh.serving(states, ["pg-0", "pg-1"]) == {"pg-0", "pg-1"}
    states["pg-1"] = rh.track(0.0)
    assert rh.serving(states, ["pg-0", "pg-1"]) == {"pg-1"}
    assert rh.serving(states, ["pg-0", "pg-1", "pg-2"]) == {"pg-1", "pg-2"}   # not tracked yet: serves


@pytest.mark.parametrize("kw", [{"down_after": 0}, {"up_after": -1}, {"up_silence": 5.0}])
def test_a_rule_that_cannot_work_is_refused_with_the_field_named(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        rh.HealthRule(**kw)
