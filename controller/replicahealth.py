"""Which ProxyGroup replicas serve, from the controller's own health probes over the Pod network (pure).

Why the controller probes: a replica whose node is lost (its link down, its kubelet gone) stays Ready in the
API until the node lifecycle controller notices no heartbeat for `--node-monitor-grace-period` (default 50 s,
up to 10 s more since the kubelet renews its Lease every 10 s) and marks its Pods not Ready; until then about
one new connection in two goes to it and times out. The controller writes the egress EndpointSlices itself, so
it can drop such a replica as soon as it stops answering the same `/healthz` the kubelet probes, asked from
the controller's Pod over the Pod network (docs/proxygroup.md, "Node loss"). The prober
(`controller.replicaprober`) feeds this module's rule; this module decides.

The rule, per replica (a Pod, at one IP):

* it is **heard** when its `/healthz` answers 200 on any of the prober's connections to it (the prober keeps
  six keep-alive connections per replica, each asking once a second, staggered: on an established connection
  TCP recovers a lost packet in 0.2 s, where a new connection's lost SYN costs 1 s, and one exchange stuck in
  TCP's doubling retransmission timer is not silence on the others);
* a serving replica **leaves** when it has not been heard for `down_after` seconds (3 s), or at once when it
  **refuses**: it answers `/healthz` with anything but 200 (the agent's 503 once its tailscaled has died:
  the node has no tailnet address) or its port refuses the connection (nothing listens: its container has
  exited). A lossy or slow link delays or drops answers but never makes one up, so a refusal is the replica's
  own word, the word the kubelet's readiness probe (one failure is enough, `failureThreshold: 1`) acts on too,
  only seconds sooner; a refusal also restarts the count of a replica that is coming back;
* a replica that left **comes back** once it has been heard for `up_after` seconds (2 s) with no silence of
  `up_silence` seconds (1 s) or more in between (hysteresis: a link that answers now and then stays out);
* a replica starts serving when it is first tracked (the kubelet's readiness already admitted it), and its
  silence counts from then;
* **fail open**: when no candidate of a group is heard, every candidate serves, as if there were no probe
  (the probe's own path, e.g. a NetworkPolicy or the controller's node, is then the likelier fault, and an
  empty EndpointSlice would fail every connection instead of half).

`tests/test_replicahealth.py` shows what the numbers give (TCP's retransmission timers simulated packet by
packet, `tests/support/lossylink.py`): a replica behind a link that drops 30 % of its packets for a minute
is not taken out (no change in 600 simulated minutes; with three connections at twice the rate, 9 minutes in
300 had one), and one whose node is lost leaves 3 s after its last answer.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

__all__ = ["Health", "HealthRule", "heard", "refused", "serving", "tick", "track"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class HealthRule:
    """The rule's timings (seconds); see the module docstring."""

    down_after: float = 3.0
    up_after: float = 2.0
    up_silence: float = 1.0

    def __post_init__(self) -> None:
        for name in ("down_after", "up_after", "up_silence"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HealthRule.{name} must be positive, got {getattr(self, name)!r}")
        if self.up_silence > self.down_after:
            raise ValueError(f"HealthRule.up_silence ({self.up_silence}) must not exceed down_after "
                             f"({self.down_after}): a replica coming back must answer at least as steadily as one "
                             "that stays")


@dataclass(frozen=True)
class Health:
    """One replica's state: whether it serves, when it was last heard (or first tracked) and, while it is
    out, since when it has been answering without a long silence (None: not answering)."""

    serving: bool
    last_heard: float
    answering_since: float | None = None


def track(now: float) -> Health:
    """A replica seen for the first time: serving, its silence counted from now."""
    return Health(True, now)


def heard(rule: HealthRule, h: Health, now: float) -> Health:
    """A 200 answer from the replica at `now`."""
    if h.serving:
        return replace(h, last_heard=max(h.last_heard, now))
    since = h.answering_since
    if since is None or now - h.last_heard >= rule.up_silence:
        since = now
    h = Health(False, max(h.last_heard, now), since)
    return tick(rule, h, now)


def refused(rule: HealthRule, h: Health, now: float) -> Health:
    """The replica refused at `now`: a non-200 answer or a refused connection (see the module docstring). It is
    out, and one coming back starts its count again at its next 200."""
    return Health(False, h.last_heard, None)


def tick(rule: HealthRule, h: Health, now: float) -> Health:
    """Time has passed (the prober calls this every fraction of a second)."""
    if h.serving:
        if now - h.last_heard >= rule.down_after:
            return Health(False, h.last_heard, None)
        return h
    if h.answering_since is not None:
        if now - h.last_heard >= rule.up_silence:
            return replace(h, answering_since=None)
        if now - h.answering_since >= rule.up_after:
            return Health(True, h.last_heard, None)
    return h


def serving(states: Mapping[K, Health], candidates: Iterable[K]) -> frozenset[K]:
    """The candidates that serve: those the rule keeps (an untracked one serves), or all of them when the rule
    keeps none (fail open, see the module docstring)."""
    cands = frozenset(candidates)
    kept = frozenset(k for k in cands if k not in states or states[k].serving)
    return kept if kept else cands
