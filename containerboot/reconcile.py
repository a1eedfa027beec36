"""The steady-state loop: events in, desired state out, adapters converge the world to it.

Events (IPN bus notifications, DNS answers, file changes, timer ticks) only update the agent's state value
and mark it dirty; one reconcile task then computes the whole desired state and converges every part. The
bus reader never waits for a reconcile, so tailscaled never drops the agent as a slow consumer, and bursts of
notifications coalesce into one reconcile.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from netfilter.backend import Backend
from netfilter.conntrack import PendingCleanup
from netfilter.model import RuleSet
from tscommon import crashpoint

from . import desired as desired_mod
from .desired import Desired, DNSAnswer
from .proxyservices import ServicesInput
from .settings import Settings
from .state import NodeState
from .status import TargetStatus

log = logging.getLogger("containerboot")

#: How often the whole desired state is re-applied even without events, to repair drift (someone flushing
#: our table) and to retry failures. Applying an unchanged rule set is cheap and changes nothing.
RESYNC_INTERVAL = 30.0

#: How often an idle loop proves it is alive. Well below the liveness limit (30 s), so that a late timer at a
#: resync boundary cannot make /livez fail; a pass that hangs stops the beat and does fail it.
HEARTBEAT_INTERVAL = 5.0

#: Rule sets up to this many entries are applied on the event loop's own thread when the backend works in
#: process (libnftables, the in-memory fake): such an apply takes about a millisecond, less than handing it to
#: a worker thread and back while tailscaled and the `tailscale up` CLI compete for the CPU at Running
#: (measured: 1.3 ms alone, 3-4 ms through the thread). Bigger sets, and backends that run a firewall tool,
#: go to a worker thread so that the loop (health, metrics, the IPN bus) keeps answering.
INLINE_APPLY_MAX_ENTRIES = 64


@dataclass(frozen=True)
class PartResult:
    ok: bool
    error: str = ""


@dataclass
class ReconcileStats:
    reconciles: int = 0
    failures: int = 0
    last_duration: float = 0.0
    total_duration: float = 0.0
    rule_applies: int = 0
    dns_resolutions: int = 0
    dns_failures: int = 0


@dataclass
class Applied:
    """What the agent last applied successfully (to skip no-op work and to order Secret writes)."""

    rules: RuleSet | None = None
    forwarding: tuple[bool, bool] = (False, False)
    rules_error: str = ""


class Reconciler:
    """Holds the agent's state value and converges the data path to it."""

    def __init__(self, settings: Settings, firewall: Backend | None, *, rules_file: str | None = None,
                 ensure_forwarding: Callable[[bool, bool], None] | None = None,
                 on_converged: Callable[["Reconciler", Desired, NodeState], Awaitable[None]] | None = None,
                 before_rules: Callable[["Reconciler", Desired, NodeState], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.time):
        self.settings = settings
        self.firewall = firewall
        self.rules_file = rules_file
        self.ensure_forwarding = ensure_forwarding
        self.on_converged = on_converged
        self.before_rules = before_rules
        self.clock = clock
        self.node = NodeState()
        self.dns = DNSAnswer()
        self.services = ServicesInput()
        self.desired: Desired | None = None
        self.reconciled_node: NodeState | None = None   # the node snapshot of the last finished pass
        self._in_pass = False
        self.applied = Applied()
        self.stats = ReconcileStats()
        self.heartbeat = clock()
        #: the beat's completed ticks, a stuck pass's included: proof that the beat had its turn (tests wait on it)
        self.beats = 0
        self.last_reconcile_at: float | None = None
        self._dirty = asyncio.Event()
        self._force = False
        self._rules_file_pending = False
        #: The UDP conntrack clean-up owed for rule changes since the last one ran (see `_reconcile_once`).
        self.pending_cleanup: PendingCleanup | None = None
        #: the agent runs the conntrack clean-up in a forked child (netfilter.conntrack.PendingCleanup.run_in_child)
        self.cleanup_in_child = False

    # -- events ----------------------------------------------------------------------------------------
    def set_node(self, node: NodeState) -> None:
        if node != self.node:
            self.node = node
            self._dirty.set()

    def set_dns(self, answer: DNSAnswer) -> None:
        if answer != self.dns:
            self.dns = answer
            self._dirty.set()

    def set_services(self, services: ServicesInput) -> None:
        """The egress/ingress services files changed (or became unreadable: then only the error changes)."""
        if services != self.services:
            self.services = services
            self._dirty.set()

    def on_dns_answer(self, addresses, error: str) -> None:
        """A DNS attempt finished: new addresses, or an error that keeps the last good ones."""
        if addresses is None:
            self.stats.dns_failures += 1
            self.set_dns(DNSAnswer(self.dns.addresses, error))
        else:
            self.stats.dns_resolutions += 1
            if tuple(addresses) != self.dns.addresses:
                log.info("Backend address change detected, installing proxy rules for backends %s",
                         [str(a) for a in addresses])
            self.set_dns(DNSAnswer(tuple(addresses), ""))

    @property
    def pending(self) -> bool:
        """An input changed since the last pass started: the loop runs another one."""
        return self._dirty.is_set()

    def poke(self, force: bool = False) -> None:
        """Ask for a reconcile; `force` re-applies even parts that look unchanged (drift repair)."""
        self._force = self._force or force
        self._dirty.set()

    # -- the loop --------------------------------------------------------------------------------------
    async def run(self) -> None:
        ticker = asyncio.create_task(self._tick())
        beat = asyncio.create_task(self._beat())
        try:
            while True:
                await self._dirty.wait()
                self._dirty.clear()
                force, self._force = self._force, False
                await self.reconcile_once(force=force)
        finally:
            ticker.cancel()
            beat.cancel()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(RESYNC_INTERVAL)
            self.poke(force=True)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            if not self._in_pass:   # a pass beats when it starts and ends; one stuck in between must show
                self.heartbeat = self.clock()
            self.beats += 1

    async def reconcile_once(self, *, force: bool = False, defer_cleanup: bool = False) -> Desired:
        """One pass. The reconciler decides when the UDP conntrack clean-up of a rule change runs: at the end of the
        pass, after the Secret and start-up bookkeeping. `defer_cleanup` leaves it to the next pass (the pass
        before Running: the clean-up, a conntrack dump of tens of milliseconds, must not hold up the login's
        handling of Running; the pass that completes start-up does it, right after "Startup complete")."""
        self._in_pass = True
        try:
            return await self._reconcile_once(force, defer_cleanup)
        finally:
            self._in_pass = False

    async def _reconcile_once(self, force: bool, defer_cleanup: bool = False) -> Desired:
        start = time.monotonic()
        self.heartbeat = self.clock()
        # One snapshot for the whole pass: events arriving meanwhile mark the state dirty for the next pass.
        node = self.node
        families = self.firewall.families if self.firewall is not None else (4, 6)
        want = desired_mod.compute(self.settings, node, self.dns, services=self.services, families=families)
        self._log_target_changes(want)
        self.desired = want
        if self.before_rules is not None:
            await self.before_rules(self, want, node)
        ok = await self._converge_rules(want, force)
        self.stats.reconciles += 1
        if not ok:
            self.stats.failures += 1
        if self.on_converged is not None:
            await self.on_converged(self, want, node)
        if self._rules_file_pending and self.applied.rules is not None:
            # After the start-up bookkeeping: only `containerboot rules` reads the file.
            self._rules_file_pending = False
            self._write_rules_file(self.applied.rules)
        if self.pending_cleanup is not None and not defer_cleanup:
            cleanup, self.pending_cleanup = self.pending_cleanup, None
            try:   # after the Secret and start-up bookkeeping: a conntrack dump takes tens of milliseconds
                await asyncio.to_thread(cleanup.run_in_child if self.cleanup_in_child else cleanup.run)
            except Exception as e:   # best effort, like the clean-up itself
                log.info("conntrack clean-up failed: %s", e)
        self.stats.last_duration = time.monotonic() - start
        self.stats.total_duration += self.stats.last_duration
        self.reconciled_node = node
        self.last_reconcile_at = self.heartbeat = self.clock()
        return want

    async def _converge_rules(self, want: Desired, force: bool) -> bool:
        if self.firewall is None:
            return True
        try:
            if self.ensure_forwarding is not None and want.forwarding != self.applied.forwarding \
                    and any(want.forwarding):
                await asyncio.to_thread(self.ensure_forwarding, *want.forwarding)
                self.applied.forwarding = want.forwarding
            if force or want.rules != self.applied.rules:
                if want.rules != self.applied.rules:
                    log.info("Applying rules: %s", describe(want.rules))
                crashpoint.hit(crashpoint.RULES_APPLY)
                if self.firewall.in_process and want.rules.entries() <= INLINE_APPLY_MAX_ENTRIES:
                    changed = self.firewall.apply(want.rules)
                else:
                    changed = await asyncio.to_thread(self.firewall.apply, want.rules)
                if changed and self.firewall.translates_connections:
                    # UDP bindings may point at targets the new rules no longer want; cleaned up at the end of
                    # the pass, after the Secret and start-up bookkeeping. Two applies before one clean-up: the
                    # bindings may still come from the older rule set.
                    self.pending_cleanup = (self.pending_cleanup.after(want.rules) if self.pending_cleanup
                                            else PendingCleanup(want.rules, self.applied.rules))
                self.stats.rule_applies += 1
                self.applied.rules = want.rules
                self._rules_file_pending = True
            self.applied.rules_error = ""
            return True
        except Exception as e:  # an adapter failure must not stop the loop: report it and retry on the next tick
            msg = f"failed to apply firewall rules: {e}"
            if msg != self.applied.rules_error:
                log.error("%s (will retry)", msg)
            self.applied.rules_error = msg
            return False

    def _log_target_changes(self, want: Desired) -> None:
        """Say when a target stops or starts resolving (the error also stays visible in /status)."""
        before = {t.name: t for t in self.desired.targets} if self.desired else {}
        for t in want.targets:
            prev = before.get(t.name)
            if t.error and (prev is None or prev.error != t.error):
                log.warning("%s %s: %s; no forwarding rules for it until that changes", t.name, t.value, t.error)
            elif not t.error and prev is not None and prev.error and t.resolved:
                log.info("%s %s resolved again to %s", t.name, t.value, ", ".join(map(str, t.resolved)))

    def ready_to_serve(self, want: Desired) -> bool:
        """Rules are in for every target that can have them; a target still pending (no answer and no error
        yet, like a DNS name before its first lookup) holds start-up back."""
        return self.rules_installed_for(want) and all(t.has_rules or t.error for t in want.targets)

    def rules_installed_for(self, want: Desired) -> bool:
        return self.applied.rules == want.rules and not self.applied.rules_error

    def target_statuses(self) -> tuple[TargetStatus, ...]:
        """Per-target status for /status, /readyz and /metrics."""
        want = self.desired
        if want is None:
            return ()
        installed = self.rules_installed_for(want)
        return tuple(TargetStatus(name=t.name, kind=t.kind, resolved=tuple(str(ip) for ip in t.resolved),
                                  rules_installed=installed and t.has_rules,
                                  last_error=t.error or self.applied.rules_error,
                                  updated_at=self.last_reconcile_at or 0.0,
                                  gates_readiness=t.gates_readiness) for t in want.targets)

    def counters(self) -> dict[str, float]:
        st = self.stats
        return {
            "containerboot_reconcile_total": st.reconciles,
            "containerboot_reconcile_errors_total": st.failures,
            "containerboot_reconcile_duration_seconds_sum": st.total_duration,
            "containerboot_reconcile_duration_seconds_count": st.reconciles,
            'containerboot_dns_resolutions_total{result="ok"}': st.dns_resolutions,
            'containerboot_dns_resolutions_total{result="error"}': st.dns_failures,
            'containerboot_firewall_applies_total{result="ok"}': st.rule_applies,
        }

    def _write_rules_file(self, rules: RuleSet) -> None:
        """Publish the desired rule set for `containerboot rules` (debugging view)."""
        if not self.rules_file:
            return
        tmp = f"{self.rules_file}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(rules.to_json())
            os.replace(tmp, self.rules_file)
        except OSError as e:
            log.debug("could not write %s: %s", self.rules_file, e)


def describe(rules: RuleSet) -> str:
    parts = [f"DNAT {d.original_dst} -> {', '.join(map(str, d.targets))}" for d in rules.dnats]
    parts += [f"egress -> {e.target} (SNAT {e.snat_source})" for e in rules.egress]
    if rules.port_maps:
        parts.append(f"{len(rules.port_maps)} egress service port maps")
    if rules.service_dnats:
        parts.append(f"{len(rules.service_dnats)} ingress service VIP mappings")
    return "; ".join(parts) or "none"

