"""nftables backend: libnftables batches through python-nftables (`nftables.Nftables().json_cmd` / `cmd`).

The agent owns the tables `ip containerboot` and `ip6 containerboot` and nothing else. An apply is one
transaction, in one of two forms:

- a delta (`netfilter.plan.plan_nft_delta`): when only named map elements differ from the rule set this object
  applied last (an egress Service added, removed or moved: its port map and SNAT elements) and the kernel's
  ruleset generation is still the one that apply produced (nobody, here or in another process, has committed
  anything to nftables in this network namespace since), only those elements are added and deleted;
- otherwise the kernel's tables are listed and compared with the desired ones, and, when they differ, one
  batch (`plan_nft` / `plan_nft_script`) deletes and rebuilds both tables.

When nothing differs, nothing is sent at all, so repeated applies do not even reset counters. The generation
(`NFT_MSG_GETGEN`, one netlink round trip) is what makes the delta safe: a foreign or stale change anywhere
bumps it, and the next apply then compares and repairs the whole tables.

libnftables runs in-process: the batches are of a small fixed set of shapes, all exercised by the netns tests
(libnftables 1.0.6 can crash the process on some malformed JSON; we never generate free-form input).

Each operation (an apply, the warm-up, a listing, the clean-up) runs on a libnftables context of its own, freed
when the operation ends. A context keeps its ruleset cache until its next command: hash tables of 8192 buckets
per table and object kind, zero-filled on allocation, so about 3.7 MB resident in a proxy Pod for as long as
the agent lives (docs/benchmarks.md, "Resident memory"). A new context costs about 0.4 ms; the code and the
library's own tables, which make a process's first batch slow, stay loaded, so the warm-up still pays.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import threading
from collections.abc import Callable
from ipaddress import ip_address
from typing import Any

from .errors import FirewallError
from .generation import RulesetGeneration, advanced_by
from .model import Dnat, EgressForward, PortMatch, RuleSet
from .plan import (
    NFT_FAMILY,
    TABLE,
    NftState,
    nft_state,
    normalize_nft_text,
    plan_nft,
    plan_nft_delta,
    plan_nft_script,
    render_nft,
)

log = logging.getLogger("containerboot")


def _warm_up_rules(families: tuple[int, ...]) -> RuleSet:
    """The shapes of a warm-up batch (`NftBackend.warm_up`): one of each translation the agent installs most,
    on documentation addresses (RFC 5737, RFC 3849). Checked only, never committed."""
    addr = {4: ("192.0.2.1", "192.0.2.2", "198.51.100.1", "192.0.2.3"),
            6: ("2001:db8::1", "2001:db8::2", "2001:db8:1::1", "2001:db8::3")}
    ips = {v: tuple(map(ip_address, addr[v])) for v in families}
    return RuleSet(dnats=tuple(Dnat(ips[v][0], (ips[v][1],)) for v in families),
                   egress=tuple(EgressForward(ips[v][2], ips[v][3], (PortMatch("udp", 41641),)) for v in families),
                   clamp_mss=True)


def _dry_run_switch(nft) -> "Callable[[bool], None] | None":
    """libnftables' check mode (`nft --check`: the batch is parsed, evaluated and validated, never committed)
    for this context, or None where neither the binding nor the library offers it."""
    setter = getattr(nft, "set_dry_run", None)      # newer python-nftables bindings
    if setter is not None:
        return setter
    ctx = getattr(nft, "_Nftables__ctx", None)     # pip-nftables 1.0.2: the context is private, the C call exists
    if ctx is None:
        return None
    try:
        lib = ctypes.CDLL("libnftables.so.1")
        fn = lib.nft_ctx_set_dry_run
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_bool]
    fn.restype = None
    return lambda on: fn(ctx, on)


class NftBackend:
    """`netfilter.backend.Backend` on nftables."""

    name = "nftables"
    in_process = True     # libnftables in this process: a small apply may run on the event loop's thread
    translates_connections = True

    def __init__(self, *, ipv6: bool = True) -> None:
        self._ctx: Any = None               # the context of the operation in progress (see the docstring)
        self._depth = 0                     # operations in progress on this thread (nested: warm-up, listing)
        # One operation at a time, possibly from worker threads; re-entrant: an operation's steps take it too.
        self._lock = threading.RLock()
        self._applied = False               # an apply has written our tables through this object
        self.ipv6 = ipv6
        self._absent_at_warm_up = False     # `warm_up` found none of our tables (the first apply must write)
        # The reference for deltas: what the kernel holds after our last apply, and the ruleset generation
        # it left (None: unknown, so the next apply lists and compares).
        self._ref: tuple[tuple[RuleSet, tuple[int, ...]], NftState] | None = None
        self._gen: int | None = None
        self._generation = RulesetGeneration().read

    @property
    def _nft(self):
        """The current operation's libnftables context, created on first use (callers hold `_lock`)."""
        if self._ctx is None:
            import nftables
            self._ctx = nftables.Nftables()
            self._ctx.set_json_output(False)
            self._ctx.set_handle_output(False)
        return self._ctx

    def _operation(self) -> "contextlib.AbstractContextManager[None]":
        """Hold the lock for a whole operation and free its context (and libnftables' cache) at its end."""
        @contextlib.contextmanager
        def op():
            with self._lock:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                    if self._depth == 0:        # nested in another operation: that one frees it
                        self._ctx = None        # python-nftables frees the context when the object goes
        return op()

    @property
    def families(self) -> tuple[int, ...]:
        return (4, 6) if self.ipv6 else (4,)

    def _check_families(self, rules: RuleSet) -> None:
        if not self.ipv6 and rules.family(6).versions():
            raise FirewallError(
                "the rule set has IPv6 rules but IPv6 is not usable in this network namespace (see the log for "
                "the probe result); enable IPv6 in the Pod/cluster or drop the IPv6 targets")

    def _run(self, batch: dict | str, what: str) -> None:
        with self._lock:
            rc, _out, err = self._nft.json_cmd(batch) if isinstance(batch, dict) else self._nft.cmd(batch)
        if rc != 0:
            shown = json.dumps(batch) if isinstance(batch, dict) else batch
            raise FirewallError(f"nftables: {what} failed: {err.strip() or f'libnftables returned {rc}'}; "
                                f"batch was: {shown[:2000]}")

    def _full_batch(self, rules: RuleSet, families: tuple[int, ...]) -> dict | str:
        if rules.port_maps:     # named maps: only the text form declares them (no JSON batch built in vain)
            return plan_nft_script(rules, families)
        try:
            return plan_nft(rules, families)
        except ValueError:      # the SNAT map (several pairs): the same
            return plan_nft_script(rules, families)

    def _remember(self, rules: RuleSet, families: tuple[int, ...], state: NftState | None, before: int | None,
                  commits: int) -> None:
        """Keep `rules` as the delta reference if the generation moved from `before` by exactly our own
        `commits` (0: nothing was written); anything else means someone else committed in between."""
        after = self._generation()
        ok = advanced_by(before, after, commits)
        self._gen = after if ok else None
        self._ref = ((rules, families), state or nft_state(rules, families)) if ok else None

    def _list_table(self, fam: str) -> str:
        with self._lock:
            rc, out, err = self._nft.cmd(f"list table {fam} {TABLE}")
        if rc != 0:
            if "No such file or directory" in err or "does not exist" in err:
                return ""
            raise FirewallError(f"nftables: listing table {fam} {TABLE} failed: {err.strip()}")
        return out

    def installed(self) -> str:
        """`nft list table` of our tables (elements sorted), "" when none exist."""
        with self._operation():
            parts = [self._list_table(NFT_FAMILY[v]) for v in (4, 6)]
        return normalize_nft_text("".join(p if p.endswith("\n") or not p else p + "\n" for p in parts))

    def render(self, rules: RuleSet) -> str:
        return render_nft(rules, self.families)

    def apply(self, rules: RuleSet) -> bool:
        with self._operation():
            return self._apply(rules)

    def _apply(self, rules: RuleSet) -> bool:
        self._check_families(rules)
        families = self.families
        if self._ref is not None and self._gen is not None:
            gen = self._generation()
            if gen == self._gen:
                if self._ref[0] == (rules, families):
                    return False        # the kernel holds what we last applied, and that is wanted
                state = nft_state(rules, families)
                delta = plan_nft_delta(self._ref[1], state)
                if delta == "":
                    self._ref = ((rules, families), state)
                    return False
                if delta is not None:
                    try:
                        self._run(delta, "updating the containerboot maps")
                    except FirewallError as e:      # never expected; the full path below repairs whatever it is
                        log.warning("%s; replacing the tables instead", e)
                    else:
                        self._remember(rules, families, state, gen, 1)
                        return True
                    self._ref = self._gen = None
        gen = self._generation()
        if not self._applied and self._absent_at_warm_up:
            # The first apply after `warm_up` found none of our tables: it has to write whatever the kernel
            # holds now (nobody else writes our tables), so the two dumps that could only find the rules equal
            # are skipped (0.4-0.8 ms at Running, on the path to "Startup complete").
            if not rules.entries():
                return False    # no tables, and none wanted
            desired = None
        else:
            current = self.installed()
            # No tables and rules wanted: they cannot be equal, and rendering 10,000 maps costs ~0.2 s.
            desired = None if current == "" and rules.entries() else self.render(rules)
            if current == desired:
                self._remember(rules, families, None, gen, 0)
                return False
            if 6 not in families and f"table {NFT_FAMILY[6]} {TABLE} " in current:
                families = (4, 6)     # IPv6 became unusable: still remove our stale ip6 table
        self._run(self._full_batch(rules, families), "replacing the containerboot tables")
        self._applied = True
        self._remember(rules, self.families, None, gen, 1)
        if not log.isEnabledFor(logging.DEBUG):
            return True     # listing big maps costs ~0.2 ms per element; only worth it when someone looks
        if desired is None:
            desired = self.render(rules)
        after_text = self.installed()
        if after_text != desired:
            # Not fatal: the kernel accepted the batch, the text differs only if our renderer lags nft's
            # printer. Keep it visible for `containerboot rules`.
            log.debug("nftables: installed rules differ from the rendered desired rules:\n%s\n---\n%s",
                      after_text, desired)
        return True

    def warm_up(self) -> None:
        """Make the first real apply fast: run one batch of the same shapes in check mode (never committed).

        A process's first libnftables batch costs 2.5-3.5 ms of CPU, the next ones 0.4-0.9 ms (measured in the
        lab at tailscaled's switch to Running: code and tables loaded on first use). The agent calls this in
        the idle second of the login, so that the apply at Running is a warm one. Best effort: without check
        mode nothing is run, and a failure only leaves the first apply cold."""
        with self._operation():
            self._warm_up()

    def _warm_up(self) -> None:
        self._absent_at_warm_up = self.installed() == ""     # and the listing's code is warm too
        dry = _dry_run_switch(self._nft)
        if dry is None:
            return
        with self._lock:
            dry(True)
            try:
                rc, _out, err = self._nft.json_cmd(plan_nft(_warm_up_rules(self.families), self.families))
            finally:
                dry(False)
        if rc != 0:
            log.debug("nftables: the warm-up batch was refused (the first apply stays cold): %s", err.strip())

    def cleanup(self) -> None:
        with self._operation():
            self._cleanup()

    def _cleanup(self) -> None:
        self._absent_at_warm_up = False     # from now on an apply compares with what the kernel holds
        self._ref = self._gen = None
        # Both families regardless of current IPv6 state, so nothing of ours survives a changed probe.
        try:
            self._run(plan_nft(RuleSet(), (4, 6)), "removing the containerboot tables")
        except FirewallError:
            self._run(plan_nft(RuleSet(), (4,)), "removing the containerboot table")
