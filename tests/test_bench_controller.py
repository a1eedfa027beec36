"""bench.controller's reading of the API server's audit log: the idle window's worst minute and watch lengths."""
from __future__ import annotations

from bench.controller import watch_lengths, worst_minute


def _ev(verb: str, resource: str, start: str, end: str) -> dict:
    return {"verb": verb, "objectRef": {"resource": resource},
            "requestReceivedTimestamp": f"2026-01-01T00:{start}Z", "stageTimestamp": f"2026-01-01T00:{end}Z"}


def test_the_worst_minute_is_the_most_requests_completed_in_any_60_s():
    ev = [_ev("get", "services", "00:59.0", t) for t in ("01:00.5", "01:30.0", "01:59.9", "03:00.0", "03:10.0")]
    assert worst_minute(ev) == 3                        # 01:00.5 .. 01:59.9
    # exactly 60 s apart are two minutes, not one
    assert worst_minute([_ev("get", "pods", "00:00.0", t) for t in ("01:00.0", "02:00.0")]) == 1
    assert worst_minute([]) == 0


def test_watch_lengths_are_per_kind_and_leave_other_verbs_out():
    ev = [_ev("watch", "pods", "00:00.0", "30:00.4"), _ev("watch", "pods", "10:00.0", "59:59.6"),
          _ev("watch", "services", "00:00.0", "01:10.0"), _ev("get", "pods", "00:00.0", "00:00.1")]
    assert watch_lengths(ev) == {"pods": [1800, 3000], "services": [70]}
