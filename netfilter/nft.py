"""nftables backend: libnftables JSON batches through python-nftables (`nftables.Nftables().json_cmd`).

The agent owns the tables `ip containerboot` and `ip6 containerboot` and nothing else. `apply` sends one batch
(see `netfilter.plan.plan_nft`) that deletes and rebuilds both tables; the kernel commits it atomically. When
the kernel already holds exactly the desired rules, nothing is sent at all, so repeated applies do not even
reset counters.

libnftables runs in-process: the batches are of a small fixed set of shapes, all exercised by the netns tests
(libnftables 1.0.6 can crash the process on some malformed JSON; we never generate free-form input).
"""
from __future__ import annotations

import json
import logging
import threading

from .backend import FirewallError, conntrack_after_apply
from .model import RuleSet
from .plan import NFT_FAMILY, TABLE, normalize_nft_text, plan_nft, render_nft

log = logging.getLogger("containerboot")


class NftBackend:
    name = "nftables"

    def __init__(self, *, ipv6: bool = True) -> None:
        import nftables
        self._nft = nftables.Nftables()
        self._nft.set_json_output(False)
        self._nft.set_handle_output(False)
        self._lock = threading.Lock()       # one libnftables context, possibly called from worker threads
        self.previous: RuleSet | None = None  # the last rule set applied (conntrack hygiene)
        self.ipv6 = ipv6

    @property
    def families(self) -> tuple[int, ...]:
        return (4, 6) if self.ipv6 else (4,)

    def _check_families(self, rules: RuleSet) -> None:
        if not self.ipv6 and rules.family(6).versions():
            raise FirewallError(
                "the rule set has IPv6 rules but IPv6 is not usable in this network namespace (see the log for "
                "the probe result); enable IPv6 in the Pod/cluster or drop the IPv6 targets")

    def _run(self, batch: dict, what: str) -> None:
        with self._lock:
            rc, _out, err = self._nft.json_cmd(batch)
        if rc != 0:
            raise FirewallError(f"nftables: {what} failed: {err.strip() or f'libnftables returned {rc}'}; "
                                f"batch was: {json.dumps(batch)[:2000]}")

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
        parts = [self._list_table(NFT_FAMILY[v]) for v in (4, 6)]
        return normalize_nft_text("".join(p if p.endswith("\n") or not p else p + "\n" for p in parts))

    def render(self, rules: RuleSet) -> str:
        return render_nft(rules, self.families)

    def apply(self, rules: RuleSet) -> None:
        self._check_families(rules)
        desired = self.render(rules)
        current = self.installed()
        if current == desired:
            return
        families = self.families
        if 6 not in families and f"table {NFT_FAMILY[6]} {TABLE} " in current:
            families = (4, 6)     # IPv6 became unusable: still remove our stale ip6 table
        self._run(plan_nft(rules, families), "replacing the containerboot tables")
        conntrack_after_apply(self, rules, self.previous)
        self.previous = rules
        if not log.isEnabledFor(logging.DEBUG):
            return      # listing big maps costs ~0.2 ms per element; only worth it when someone looks
        after = self.installed()
        if after != desired:
            # Not fatal: the kernel accepted the batch, the text differs only if our renderer lags nft's
            # printer. Keep it visible for `containerboot rules`.
            log.debug("nftables: installed rules differ from the rendered desired rules:\n%s\n---\n%s",
                      after, desired)

    def cleanup(self) -> None:
        # Both families regardless of current IPv6 state, so nothing of ours survives a changed probe.
        try:
            self._run(plan_nft(RuleSet(), (4, 6)), "removing the containerboot tables")
        except FirewallError:
            self._run(plan_nft(RuleSet(), (4,)), "removing the containerboot table")
