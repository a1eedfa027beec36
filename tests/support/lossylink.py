"""A packet-level model of the controller's health probes over a lossy or slow link (for the health rule's tests).

Each of the prober's keep-alive connections to a replica asks `/healthz` in turn: a request, then the answer,
each one TCP segment that the link drops with probability `loss` (independently), retransmitted on TCP's
timer (RTO 0.2 s plus the round trip, doubled after each loss, as Linux does on an established connection).
The next request goes `interval` seconds after the previous one was sent, or when its answer comes if later.
An exchange that gets no answer for `stale` seconds is given up and the connection made again (SYN and
SYN-ACK, retried after 1, 2, 4 ... s, Linux's initial RTO). `heard_times` returns when answers arrived.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

RTO_MIN = 0.2
SYN_RTO = 1.0


@dataclass(frozen=True)
class Link:
    """`loss(t)`: the probability a packet sent at t is dropped; `rtt`: the round trip (seconds)."""

    loss: Callable[[float], float]
    rtt: float = 0.001


def _deliver(rng: random.Random, link: Link, t: float, rto: float, deadline: float) -> float | None:
    """When a segment first sent at t arrives (retransmitted on the doubling timer), or None by `deadline`."""
    while t < deadline:
        if rng.random() >= link.loss(t):
            return t + link.rtt / 2
        t += rto
        rto = min(rto * 2, 60.0)
    return None


def heard_times(rng: random.Random, link: Link, *, start: float, end: float, connections: int = 3,
                interval: float = 0.5, stale: float = 10.0) -> list[float]:
    out: list[float] = []
    rto = RTO_MIN + link.rtt
    for c in range(connections):
        t = start + c * interval / connections     # the prober staggers its connections
        connected = False
        while t < end:
            if not connected:
                done = None
                attempt, wait = t, SYN_RTO
                while attempt < t + stale and done is None:
                    syn = _deliver(rng, link, attempt, 1e9, attempt + 1e-9)
                    if syn is not None:
                        done = _deliver(rng, link, syn, 1e9, syn + 1e-9)
                    if done is None:
                        attempt, wait = attempt + wait, wait * 2
                if done is None:
                    t += stale
                    continue
                t, connected = done, True
            sent = t
            req = _deliver(rng, link, sent, rto, sent + stale)
            ans = _deliver(rng, link, req, rto, sent + stale) if req is not None else None
            if ans is None:
                connected = False
                t = sent + stale
                continue
            if ans < end:
                out.append(ans)
            t = max(ans, sent + interval)
    return sorted(out)
