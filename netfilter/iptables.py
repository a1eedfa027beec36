"""iptables backend: one `iptables-restore --noflush` batch per family, our own `CB-*` chains only.

Why restore batches and not python-iptables (`iptc`): an xtables extension loaded for one family cannot be
loaded for the other in the same process (spec 7.1; DNAT for IPv6 after IPv4 fails with "can't find target"),
and the agent must program both families. `iptables-restore`/`ip6tables-restore` run as short-lived processes,
one per family, each committing its tables (nat, mangle) atomically at COMMIT; a batch is also far faster than
one command per rule. The flavour (legacy x_tables vs iptables-nft) is the one that already holds rules
(`detect.iptables_variant`), else the plain `iptables` on $PATH, which is what tailscaled uses too.

On the iptables-nft flavour (the rules are nf_tables underneath) a change that only adds and removes rules
inside our chains (an egress Service more or less) is a delta: no `iptables-save`, a restore of only the
`-D`/`-I` lines (`netfilter.plan.plan_iptables_delta`), as long as the kernel's ruleset generation is the one
our last apply left (`netfilter.generation`). Otherwise, and always on iptables-legacy (x_tables keeps no
generation), the tables are saved, compared and rewritten.
"""
from __future__ import annotations

import logging
import subprocess

from .detect import which
from .errors import FirewallError
from .generation import RulesetGeneration, advanced_by
from .model import RuleSet
from .plan import (
    IPT_CHAINS,
    IPT_TABLES,
    IptState,
    canonical_iptables,
    filter_iptables_save,
    ipt_chain_rules,
    plan_iptables,
    plan_iptables_delta,
    render_iptables,
)

log = logging.getLogger("containerboot")


class IptablesBackend:
    """`netfilter.backend.Backend` on iptables-restore batches."""

    name = "iptables"
    in_process = False    # every apply runs iptables-save/-restore: always on a worker thread
    translates_connections = True

    def __init__(self, *, ipv6: bool = True, variant: str | None = None) -> None:
        if variant is None:
            from .detect import iptables_variant
            variant = iptables_variant()
        if variant not in ("", "legacy", "nft"):
            raise ValueError(f"iptables variant must be '', 'legacy' or 'nft', not {variant!r}")
        self.variant = variant
        self.ipv6 = ipv6
        # Delta reference (iptables-nft only): the rule set applied last, our chains' rules per family, and the
        # ruleset generation that apply left.
        self._ref: tuple[RuleSet, dict[int, dict[str, tuple[str, ...]]]] | None = None
        self._gen: int | None = None
        self._generation_reader: RulesetGeneration | None = None

    # ---- commands --------------------------------------------------------------------------------------------

    def _bin(self, family: int, tool: str) -> str:
        base = "iptables" if family == 4 else "ip6tables"
        suffix = f"-{self.variant}" if self.variant else ""
        return f"{base}{suffix}{'-' + tool if tool else ''}"

    @property
    def label(self) -> str:
        return self._bin(4, "") if self.variant else "iptables"

    def _families(self) -> tuple[int, ...]:
        return (4, 6) if self.ipv6 else (4,)

    @property
    def families(self) -> tuple[int, ...]:
        """The IP versions this backend can translate: the agent leaves rules of any other family out."""
        return self._families()

    def _exec(self, argv: list[str], stdin: str | None = None) -> str:
        if which(argv[0]) is None:
            raise FirewallError(f"{argv[0]} not found in $PATH; install iptables or set "
                                "TS_DEBUG_FIREWALL_MODE=nftables")
        try:
            p = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise FirewallError(f"{' '.join(argv)} timed out after 60s (xtables lock held?)") from None
        if p.returncode != 0:
            detail = f"; input was:\n{stdin}" if stdin else ""
            raise FirewallError(f"{' '.join(argv)} failed (exit {p.returncode}): {p.stderr.strip()}{detail}")
        return p.stdout

    def _save(self, family: int) -> str:
        """`iptables-save` of the tables we use, concatenated."""
        return "".join(self._exec([self._bin(family, "save"), "-t", t]) for t in IPT_TABLES)

    def _restore(self, family: int, text: str) -> None:
        self._exec([self._bin(family, "restore"), "--noflush", "-w", "5"], stdin=text)

    # ---- Backend ---------------------------------------------------------------------------------------------

    def _header(self, family: int) -> str:
        return f"# IPv{family} ({self._bin(family, '')})"

    def _format(self, family: int, body: str) -> str:
        return f"{self._header(family)}\n{body}" if body else ""

    def _installed_family(self, family: int, save: str | None = None) -> str:
        save = self._save(family) if save is None else save
        tables = filter_iptables_save(save)
        out: list[str] = []
        for t in IPT_TABLES:
            out += canonical_iptables(t, tables.get(t, []))
        return "\n".join(out) + "\n" if out else ""

    def installed(self) -> str:
        parts = []
        for fam in self._families():
            parts.append(self._format(fam, self._installed_family(fam)))
        return "".join(parts)

    def render(self, rules: RuleSet) -> str:
        return "".join(self._format(fam, render_iptables(rules, fam)) for fam in self._families())

    def _generation(self) -> int | None:
        """The nf_tables ruleset generation when our rules are nf_tables (iptables-nft), else None."""
        if self._generation_reader is None:
            nf_tables = self.variant == "nft"
            if not self.variant:
                try:
                    nf_tables = "nf_tables" in self._exec([self._bin(4, ""), "-V"])
                except FirewallError:
                    nf_tables = False
            if not nf_tables:
                return None
            self._generation_reader = RulesetGeneration()
        return self._generation_reader.read()

    def _apply_delta(self, rules: RuleSet) -> bool | None:
        """Apply `rules` as a delta of the last applied rule set; None when that is not possible."""
        if self._ref is None or self._gen is None:
            return None
        gen = self._generation()
        if gen != self._gen:
            return None
        last, chains = self._ref
        if last == rules:
            return False
        new = {fam: ipt_chain_rules(rules, fam) for fam in self._families()}
        texts = {fam: plan_iptables_delta(chains[fam], new[fam]) for fam in self._families()}
        if any(t is None for t in texts.values()):
            return None
        commits = 0
        try:
            for fam, text in texts.items():
                if text:
                    self._restore(fam, text)
                    commits += text.count("\nCOMMIT")
        except FirewallError as e:      # e.g. a rule deleted behind our back: save, compare and rewrite
            log.warning("%s; rewriting the chains instead", e)
            return None
        self._remember(rules, new, gen, commits)
        return commits > 0

    def _remember(self, rules: RuleSet, chains: dict[int, dict[str, tuple[str, ...]]] | None, before: int | None,
                  commits: int) -> None:
        """Keep `rules` as the delta reference if the generation moved by exactly our own commits."""
        after = self._generation() if before is not None else None
        if advanced_by(before, after, commits):
            self._ref = (rules, chains or {fam: ipt_chain_rules(rules, fam) for fam in self._families()})
            self._gen = after
        else:
            self._ref = self._gen = None

    def apply(self, rules: RuleSet) -> bool:
        if not self.ipv6 and rules.family(6).versions():
            raise FirewallError(
                "the rule set has IPv6 rules but ip6tables NAT is not usable in this network namespace (no IPv6, "
                "no ip6tables binary, or no ip6table_nat module); enable IPv6 NAT or drop the IPv6 targets")
        done = self._apply_delta(rules)
        if done is not None:
            return done
        self._ref = self._gen = None
        gen = self._generation()
        changed = False
        commits = 0
        for fam in self._families():
            save = self._save(fam)
            if self._converged(rules, fam, save):
                continue
            text = plan_iptables(rules, fam, save)
            if text:
                self._restore(fam, text)
                commits += text.count("\nCOMMIT")
                changed = True
        if not self.ipv6 and which(self._bin(6, "save")):
            # IPv6 became unusable: best-effort removal of chains a previous run left in ip6tables.
            try:
                text = plan_iptables(RuleSet(), 6, self._save(6))
                if text:
                    self._restore(6, text)
                    commits += text.count("\nCOMMIT")
            except FirewallError as e:
                log.debug("ip6tables cleanup skipped: %s", e)
        self._remember(rules, None, gen, commits)
        return changed

    def _converged(self, rules: RuleSet, fam: int, save: str) -> bool:
        """Kernel already matches: same rules, and every needed jump is the single first rule of its chain."""
        installed = self._installed_family(fam, save)
        if not installed and not rules.family(fam).empty:
            return False    # none of our chains, rules wanted: no need to render them to know
        desired = render_iptables(rules, fam)
        if installed != desired:
            return False
        state = IptState.parse(save)
        return all(state.jumps.get(chain, ()) == (0,) for _, chain, _ in IPT_CHAINS if f":{chain} " in desired)

    def warm_up(self) -> None:
        """Nothing to warm: each apply runs its own iptables-save/-restore processes."""

    def cleanup(self) -> None:
        self._ref = self._gen = None
        errors = []
        for fam in (4, 6):
            if fam == 6 and which(self._bin(6, "save")) is None:
                continue
            try:
                text = plan_iptables(RuleSet(), fam, self._save(fam))
                if text:
                    self._restore(fam, text)
            except FirewallError as e:
                if fam == 4 or self.ipv6:
                    errors.append(str(e))
        if errors:
            raise FirewallError("; ".join(errors))
