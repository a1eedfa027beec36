"""A snapshot of what the agent knows and has done, and the probe verdicts derived from it.

Pure module: no I/O, no clock reads (callers pass `now`). The agent builds a new `AgentStatus` after every
reconcile; `containerboot.endpoints` serves it. All timestamps are Unix time in seconds (`time.time()`).

Three different questions, deliberately kept apart (upstream has only the first):

* `healthy()` -- upstream's `/healthz` meaning: the node has at least one tailnet IP.
* `live(now)`  -- the agent's loop is not stuck: its heartbeat is recent. A failing liveness probe restarts
  the container, so it must not depend on anything outside the process (control plane, DNS, tailscaled).
* `ready(now)` -- traffic sent to this Pod will flow: tailscaled is Running, every configured target has its
  forwarding rules installed, the serve config is applied and its certificates exist. Control-plane freshness
  (netmap age) is exposed but never gates readiness: an outage of the coordination server does not stop
  existing tunnels, and failing readiness fleet-wide then would only make things worse. The same holds for
  the control server's and the Kubernetes API server's reachability (`containerboot.reachability`): reported
  (`control_plane`, `kubernetes_api`), never gating.

Counters: `AgentStatus.counters` maps Prometheus sample keys (`name` or `name{label="v",...}`, built with
`sample_key`) to values; the metrics endpoint renders them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from serveconfig.status import ServeStatus

from .reachability import Reachability

__all__ = ["TargetStatus", "ServeStatus", "AgentStatus", "sample_key", "escape_label_value"]


def escape_label_value(v: str) -> str:
    """Escape a Prometheus label value (backslash, double quote, newline)."""
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def sample_key(name: str, **labels: str) -> str:
    """The counters key for one sample: `name{a="x",b="y"}` (labels sorted), or `name` without labels."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


@dataclass(frozen=True)
class TargetStatus:
    """One forwarding target (e.g. TS_DEST_IP, TS_TAILNET_TARGET_FQDN, one egress/ingress service)."""

    name: str
    kind: str                          # e.g. "dest-ip", "dest-dns-name", "tailnet-target-fqdn", "egress-service"
    resolved: tuple[str, ...] = ()     # the backend IPs currently used
    rules_installed: bool = False      # the kernel has the rules for the current `resolved` set
    last_error: str = ""
    updated_at: float = 0.0
    # False for ProxyGroup egress/ingress services: each reports its own readiness to the operator through the
    # state Secret, and one service whose target is gone must not make the Pod unready for all the others.
    gates_readiness: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "resolved": list(self.resolved),
                "rules_installed": self.rules_installed, "last_error": self.last_error,
                "updated_at": _num(self.updated_at), "gates_readiness": self.gates_readiness}


@dataclass(frozen=True)
class AgentStatus:
    """Everything the probes and /status need, as of one moment."""

    backend_state: str = "NoState"
    tailnet_ips: tuple[str, ...] = ()
    targets: tuple[TargetStatus, ...] = ()
    serve: ServeStatus | None = None
    netmap_seen_at: float | None = None       # when the last netmap-bearing notification arrived
    started_at: float = 0.0
    last_reconcile_at: float | None = None
    loop_heartbeat_at: float | None = None
    counters: Mapping[str, float] = field(default_factory=dict)
    startup_complete: bool = False
    stopping: bool = False                    # shutdown has begun: rules and tailscaled are going away
    reconciled_ips: tuple[str, ...] | None = None   # the tailnet IPs the last finished pass made rules for
    # The firewall the agent programs, when it programs one: {"backend", "ipv6", "rules"} (the rule set last
    # applied, RuleSet.to_dict()). With TS_TEST_FAKE_NETFILTER this is the in-memory firewall's whole content.
    firewall: Mapping[str, Any] | None = None
    health_warnings: tuple[tuple[str, str], ...] = ()   # tailscaled's, (code, text): reported, not gating
    control_plane: Reachability | None = None           # reported, not gating (see the module docstring)
    kubernetes_api: Reachability | None = None          # with a state Secret; reported, not gating
    secret_pending_writes: tuple[str, ...] = ()         # the state Secret's keys whose write has not landed yet
    # HTTPS with the user's certificate (tlsterm.CertWatcher.status()): None when not configured. Gates
    # readiness until a first good certificate is served; a bad renewal (the last good one serving) does not.
    tls: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        # Copy and freeze so that the agent mutating its own counters dict later cannot change a snapshot.
        object.__setattr__(self, "counters", MappingProxyType(dict(self.counters)))
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "tailnet_ips", tuple(str(ip) for ip in self.tailnet_ips))
        if self.reconciled_ips is not None:
            object.__setattr__(self, "reconciled_ips", tuple(str(ip) for ip in self.reconciled_ips))

    def netmap_age_s(self, now: float) -> float | None:
        """Seconds since the last netmap; None if none was seen yet."""
        if self.netmap_seen_at is None:
            return None
        return max(0.0, now - self.netmap_seen_at)

    def healthy(self) -> bool:
        """Upstream's /healthz: the node has at least one Tailscale IP."""
        return bool(self.tailnet_ips)

    def live(self, now: float, max_stall: float = 30.0) -> bool:
        """The agent loop has beaten within `max_stall` seconds (counting from start before the first beat)."""
        return self.stall_s(now) <= max_stall

    def stall_s(self, now: float) -> float:
        last = self.loop_heartbeat_at if self.loop_heartbeat_at is not None else self.started_at
        return max(0.0, now - last)

    def ready(self, now: float, max_stall: float = 30.0) -> tuple[bool, list[str]]:
        """(ready, reasons it is not). Reasons are short human-readable lines, one per problem."""
        reasons: list[str] = []
        if self.stopping:
            reasons.append("the agent is shutting down")
        if self.backend_state != "Running":
            reasons.append(f"tailscaled backend state is {self.backend_state}, not Running")
        elif not self.tailnet_ips:
            reasons.append("node has no tailnet IPs yet")
        elif self.last_reconcile_at is None:
            # The node can be Running before the first pass has computed any target: no known target is "not
            # computed yet", never "nothing to wait for".
            reasons.append("the first reconcile has not finished yet")
        elif self.reconciled_ips is not None and set(self.reconciled_ips) != set(self.tailnet_ips) \
                and any(t.gates_readiness for t in self.targets):
            # The bus reported new addresses; the rules still match the old ones until the next pass ends.
            reasons.append("the node's tailnet addresses changed; forwarding rules are being updated")
        if not self.live(now, max_stall):
            reasons.append(f"agent loop stalled for {self.stall_s(now):.0f}s")
        for t in self.targets:
            if t.gates_readiness and not t.rules_installed:
                why = f": {t.last_error}" if t.last_error else ""
                reasons.append(f"target {t.name} ({t.kind}): forwarding rules not installed{why}")
        if self.serve is not None:
            s = self.serve
            if not s.applied:
                why = f": {s.last_error}" if s.last_error else ""
                reasons.append(f"serve config not applied{why}")
            if s.cert_required and not s.cert_ready:
                reasons.append("serve config needs a TLS certificate that has not been issued yet")
        if self.tls is not None and not self.tls.get("serial"):
            why = f": {self.tls['last_error']}" if self.tls.get("last_error") else ""
            reasons.append(f"HTTPS: no good certificate served yet{why}")
        return (not reasons, reasons)

    def to_json(self, now: float) -> dict[str, Any]:
        ok, reasons = self.ready(now)
        return {
            "ready": ok,
            "not_ready_reasons": reasons,
            "healthy": self.healthy(),
            "live": self.live(now),
            "startup_complete": self.startup_complete,
            "stopping": self.stopping,
            "backend_state": self.backend_state,
            "tailnet_ips": list(self.tailnet_ips),
            "netmap_age_s": _num(self.netmap_age_s(now)),
            "started_at": _num(self.started_at),
            "last_reconcile_at": _num(self.last_reconcile_at),
            "loop_heartbeat_at": _num(self.loop_heartbeat_at),
            "targets": [t.to_json() for t in self.targets],
            "serve": self.serve.to_json() if self.serve is not None else None,
            "tls": dict(self.tls) if self.tls is not None else None,
            "counters": {k: _num(v) for k, v in sorted(self.counters.items())},
            "firewall": dict(self.firewall) if self.firewall is not None else None,
            "tailscaled_health": [{"code": c, "text": t} for c, t in self.health_warnings],
            "control_plane": _reach(self.control_plane),
            "kubernetes_api": ({**(_reach(self.kubernetes_api) or {}),
                                "pending_writes": list(self.secret_pending_writes)}
                               if self.kubernetes_api is not None else None),
        }


def _reach(r: Reachability | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {k: _num(v) if isinstance(v, float) else v for k, v in r.to_json().items()}


def _num(v: float | None) -> float | None:
    """JSON has no NaN/inf: map them to null so /status is always strict JSON."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return v
