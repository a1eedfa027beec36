"""Pure planner: a `RuleSet` in, the one transaction that makes the kernel match it out.

Nothing here touches the kernel; the backends feed the output to libnftables or `iptables-restore`. Because the
plan is a function of the desired state (and, for iptables, of the current dump; for a delta, of the rule set
applied last), applying the same rule set any number of times converges to the same kernel state, and a
changed target replaces every old rule.

nftables layout (chosen: one `ip` and one `ip6` table, both named `containerboot`, replaced in ONE batch):

    table ip|ip6 containerboot
      chain prerouting   type nat hook prerouting priority dstnat - 10    (ours runs before other dstnat chains)
      chain postrouting  type nat hook postrouting priority srcnat - 10
      chain forward      type filter hook forward priority mangle          (MSS clamping)

  Per-family tables rather than one `inet` table: NAT in `inet` tables needs kernel 5.2+, and with separate
  tables a host without IPv6 simply never gets the `ip6` table. Both tables still go into one netlink
  transaction, so the two families change together. The batch is `add table` (no-op if present), `delete table`
  (drops every chain, rule and set of ours), `add table` + contents; the kernel commits the batch atomically, so no
  packet ever sees a half-built table.

  Per-packet cost does not grow with the number of services: every many-entry match is ONE rule with a map
  (hash lookup): `dnat to ip daddr map {...}` for VIPs/DNATs, `dnat ip to meta l4proto . th dport map @portmap`
  for egress port maps, `snat to ip daddr map @snatmap` for SNAT (more than one pair). Load balancing uses
  `numgen random mod N map {...}`.

  The egress port maps and SNAT pairs live in the NAMED maps `portmap` and `snatmap`, so that one egress
  Service more or less (a ProxyGroup replica's everyday change) is a transaction of a few elements
  (`plan_nft_delta`) instead of a rebuilt table: with a thousand Services, rebuilding costs a few hundred ms,
  the elements well under a millisecond. libnftables 1.0.6 cannot declare a named map with concatenated data
  from JSON, so a batch with named maps is an `nft -f` script (`plan_nft_script`); the others stay JSON.

iptables layout: our own chains, jumped to from the built-ins (one jump each, kept first in the built-in chain):

    nat    CB-PREROUTING  <- PREROUTING       DNAT rules
    nat    CB-POSTROUTING <- POSTROUTING      SNAT rules
    mangle CB-FORWARD     <- FORWARD          MSS clamping

  The restore input declares (and thereby flushes) only those chains; nothing else in the table is touched. A
  chain exists only while it has rules; an unneeded one is unhooked and deleted in the same COMMIT.

Deliberate fixes over upstream (see the spec's section 6): [E1] egress matches `iifname` (oifname is empty at
prerouting), [E2] IPv6 `--to-destination [addr]:port`, [E3] nftables load-balances, [E5]/[E7] no duplicates ever,
[E6] SNAT matches /32 resp. /128, [E16] exact interface names (no prefix match), [E17] both backends clamp on
`SYN` with `RST` clear, [E18] egress catch-all never captures exempt ports (tailscaled's UDP port, the agent's
health port).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable

from .model import IP, Dnat, RuleSet

TABLE = "containerboot"
PORT_MAP = "portmap"     # the named map of egress port maps: (proto, port) -> (target, target port)
SNAT_MAP = "snatmap"     # the named map of SNAT pairs: destination -> new source ("snat" is a keyword)
NFT_FAMILY = {4: "ip", 6: "ip6"}
PRIO_DSTNAT = -110   # dstnat - 10
PRIO_SRCNAT = 90     # srcnat - 10
PRIO_MANGLE = -150   # mangle

# iptables: (table, our chain, built-in chain that jumps to it)
IPT_CHAINS = (
    ("nat", "CB-PREROUTING", "PREROUTING"),
    ("nat", "CB-POSTROUTING", "POSTROUTING"),
    ("mangle", "CB-FORWARD", "FORWARD"),
)
IPT_TABLES = ("nat", "mangle")
IPT_OUR_CHAINS = tuple(c for _, c, _ in IPT_CHAINS)


# ===================================================================================== shared desired-state view

@dataclass(frozen=True)
class _Plan:
    """The family-specific, backend-neutral shape of what is wanted; both backends render from this."""

    version: int
    tun: str
    lb_dnats: tuple[Dnat, ...]                         # original_dst -> several targets (load-balanced)
    addr_dnats: tuple[tuple[IP, IP, str], ...]         # (original_dst, target, service or "") single target
    port_maps: tuple[tuple[str, int, IP, int, str], ...]   # (proto, match_port, target, target_port, service)
    egress_targets: tuple[IP, ...]                     # catch-all targets (load-balanced if > 1)
    exempt: tuple[tuple[str, int], ...]                # (proto, port) never captured by the catch-all
    snat: tuple[tuple[IP, IP], ...]                    # (destination, new source)
    clamp: bool

    @property
    def has_prerouting(self) -> bool:
        return bool(self.lb_dnats or self.addr_dnats or self.port_maps or self.egress_targets)


_DIGIT_RUNS = re.compile(r"(\d+)").split


def _natural_key(text: str) -> tuple:
    """Sort key that orders embedded numbers numerically ("10.0.0.9" < "10.0.0.10"). Splitting on one capturing
    group puts the digit runs at the odd places; sorting a 10,000-element map calls this for every element."""
    return tuple((0, int(t), "") if i & 1 else (1, 0, t) for i, t in enumerate(_DIGIT_RUNS(text)))


def _ip_key(ip: IP) -> tuple[int, int]:
    return (ip.version, int(ip))


def _family_plan(rules: RuleSet, version: int) -> _Plan:
    return rules.memo(("plan", version), lambda: _build_family_plan(rules, version))


def _build_family_plan(rules: RuleSet, version: int) -> _Plan:
    r = rules.family(version)
    lb = tuple(sorted((d for d in r.dnats if len(d.targets) > 1), key=lambda d: _ip_key(d.original_dst)))
    single = [(d.original_dst, d.targets[0], "") for d in r.dnats if len(d.targets) == 1]
    single += [(s.vip, s.cluster_ip, s.service) for s in r.service_dnats]
    single.sort(key=lambda x: _ip_key(x[0]))
    pm: dict[tuple[str, int], tuple[str, int, IP, int, str]] = {}
    for p in r.port_maps:
        pm.setdefault((p.protocol, p.match_port), (p.protocol, p.match_port, p.target, p.target_port, p.service))
    port_maps = tuple(pm[k] for k in sorted(pm))
    targets: dict[IP, None] = {}
    exempt: set[tuple[str, int]] = set()
    for e in r.egress:
        targets.setdefault(e.target, None)
        exempt.update((x.protocol, x.port) for x in e.exempt)
    snat = tuple(sorted(r.snat_pairs(), key=lambda x: _ip_key(x[0])))
    plan = _Plan(
        version=version, tun=r.tun, lb_dnats=lb, addr_dnats=tuple(single), port_maps=port_maps,
        egress_targets=tuple(targets), exempt=tuple(sorted(exempt)), snat=snat, clamp=False)
    # Clamping only matters where this family forwards something.
    clamp = rules.clamp_mss and (plan.has_prerouting or bool(snat))
    return replace(plan, clamp=clamp)


# ============================================================================================== nftables (JSON)

def _payload_daddr(version: int) -> dict:
    return {"payload": {"protocol": NFT_FAMILY[version], "field": "daddr"}}


_L4_DPORT = {"concat": [{"meta": {"key": "l4proto"}}, {"payload": {"protocol": "th", "field": "dport"}}]}


def _numgen_map(targets: tuple[IP, ...]) -> dict:
    return {"map": {"key": {"numgen": {"mode": "random", "mod": len(targets), "offset": 0}},
                    "data": {"set": [[i, str(t)] for i, t in enumerate(targets)]}}}


_ADDR_TYPE = {4: "ipv4_addr", 6: "ipv6_addr"}


def _named_maps(p: _Plan) -> list[tuple[str, str, frozenset[tuple[str, str]]]]:
    """(name, type, {(key, data)}) of the named maps a family's table holds: the egress port map, and the SNAT
    map when there is more than one pair. Named, so that one Service more or less is an element added or
    removed (`plan_nft_delta`); only the text form declares them (libnftables 1.0.6 JSON cannot declare
    concatenated map data)."""
    addr = _ADDR_TYPE[p.version]
    out = []
    if p.port_maps:
        out.append((PORT_MAP, f"inet_proto . inet_service : {addr} . inet_service",
                    frozenset((f"{pr} . {mp}", f"{t} . {tp}") for pr, mp, t, tp, _ in p.port_maps)))
    if len(p.snat) > 1:
        out.append((SNAT_MAP, f"{addr} : {addr}", frozenset((str(d), str(s)) for d, s in p.snat)))
    return out


def _nft_family_cmds(p: _Plan) -> tuple[list[dict], list[str]]:
    """(JSON commands that build this family's table, the `nft list table` text it will show)."""
    fam = NFT_FAMILY[p.version]
    tun = p.tun
    cmds: list[dict] = []
    text: list[str] = [f"table {fam} {TABLE} {{"]
    chains: list[tuple[str, str, str, int, str, list[tuple[list[dict], str]]]] = []

    pre: list[tuple[list[dict], str]] = []
    for d in p.lb_dnats:
        pre.append((
            [{"match": {"op": "==", "left": _payload_daddr(p.version), "right": str(d.original_dst)}},
             {"dnat": {"addr": _numgen_map(d.targets)}}],
            f"{fam} daddr {d.original_dst} dnat to numgen random mod {len(d.targets)} map "
            f"{{ {', '.join(f'{i} : {t}' for i, t in enumerate(d.targets))} }}"))
    if len(p.addr_dnats) == 1:
        dst, target, _ = p.addr_dnats[0]
        pre.append((
            [{"match": {"op": "==", "left": _payload_daddr(p.version), "right": str(dst)}},
             {"dnat": {"addr": str(target)}}],
            f"{fam} daddr {dst} dnat to {target}"))
    elif p.addr_dnats:
        pre.append((
            [{"dnat": {"addr": {"map": {"key": _payload_daddr(p.version),
                                        "data": {"set": [[str(d), str(t)] for d, t, _ in p.addr_dnats]}}}}}],
            f"dnat to {fam} daddr map {{ {', '.join(f'{d} : {t}' for d, t, _ in p.addr_dnats)} }}"))
    not_tun = {"match": {"op": "!=", "left": {"meta": {"key": "iifname"}}, "right": tun}}
    if p.port_maps:
        # A named map, so that one Service more or less is one element added or removed (`plan_nft_delta`);
        # only the text form can declare it (libnftables 1.0.6 JSON cannot declare concatenated map data).
        pre.append(([not_tun, {"dnat": {"family": fam, "addr": {"map": {"key": _L4_DPORT, "data": f"@{PORT_MAP}"}}}}],
                    f'iifname != "{tun}" dnat {fam} to meta l4proto . th dport map @{PORT_MAP}'))
    if p.egress_targets:
        expr: list[dict] = [not_tun]
        txt = f'iifname != "{tun}" '
        if p.exempt:
            expr.append({"match": {"op": "!=", "left": _L4_DPORT,
                                   "right": {"set": [{"concat": [proto, port]} for proto, port in p.exempt]}}})
            txt += ("meta l4proto . th dport != { "
                    + ", ".join(f"{proto} . {port}" for proto, port in p.exempt) + " } ")
        if len(p.egress_targets) == 1:
            expr.append({"dnat": {"addr": str(p.egress_targets[0])}})
            txt += f"dnat to {p.egress_targets[0]}"
        else:
            expr.append({"dnat": {"addr": _numgen_map(p.egress_targets)}})
            txt += (f"dnat to numgen random mod {len(p.egress_targets)} map "
                    f"{{ {', '.join(f'{i} : {t}' for i, t in enumerate(p.egress_targets))} }}")
        pre.append((expr, txt))
    if pre:
        chains.append(("prerouting", "nat", "prerouting", PRIO_DSTNAT, "dstnat - 10", pre))

    post: list[tuple[list[dict], str]] = []
    if len(p.snat) == 1:
        dst, src = p.snat[0]
        post.append(([{"match": {"op": "==", "left": _payload_daddr(p.version), "right": str(dst)}},
                      {"snat": {"addr": str(src)}}],
                     f"{fam} daddr {dst} snat to {src}"))
    elif p.snat:
        post.append(([{"snat": {"addr": {"map": {"key": _payload_daddr(p.version), "data": f"@{SNAT_MAP}"}}}}],
                     f"snat to {fam} daddr map @{SNAT_MAP}"))
    if post:
        chains.append(("postrouting", "nat", "postrouting", PRIO_SRCNAT, "srcnat - 10", post))

    if p.clamp:
        fwd: list[tuple[list[dict], str]] = []
        for key in ("oifname", "iifname"):
            fwd.append((
                [{"match": {"op": "==", "left": {"meta": {"key": key}}, "right": tun}},
                 # SYN set and RST clear, like iptables' `--tcp-flags SYN,RST SYN` [E17].
                 {"match": {"op": "==", "left": {"&": [{"payload": {"protocol": "tcp", "field": "flags"}},
                                                       {"|": ["syn", "rst"]}]}, "right": "syn"}},
                 {"mangle": {"key": {"tcp option": {"name": "maxseg", "field": "size"}},
                             "value": {"rt": {"key": "mtu"}}}}],
                f'{key} "{tun}" tcp flags syn / syn,rst tcp option maxseg size set rt mtu'))
        chains.append(("forward", "filter", "forward", PRIO_MANGLE, "mangle", fwd))

    cmds.append({"add": {"table": {"family": fam, "name": TABLE}}})
    for name, typ, elems in _named_maps(p):
        listed = ", ".join(f"{k} : {d}" for k, d in sorted(elems, key=lambda e: _natural_key(e[0])))
        text += [f"\tmap {name} {{", f"\t\ttype {typ}", "\t\telements = { " + listed + " }", "\t}", ""]
    for i, (name, ctype, hook, prio, prio_text, rules) in enumerate(chains):
        cmds.append({"add": {"chain": {"family": fam, "table": TABLE, "name": name, "type": ctype,
                                       "hook": hook, "prio": prio, "policy": "accept"}}})
        if i:
            text.append("")
        text.append(f"\tchain {name} {{")
        text.append(f"\t\ttype {ctype} hook {hook} priority {prio_text}; policy accept;")
        for expr, line in rules:
            cmds.append({"add": {"rule": {"family": fam, "table": TABLE, "chain": name, "expr": expr}}})
            text.append(f"\t\t{line}")
        text.append("\t}")
    text.append("}")
    return cmds, text


def plan_nft(rules: RuleSet, families: Iterable[int] = (4, 6)) -> dict:
    """The libnftables JSON batch that atomically replaces our tables for `families`.

    For each family: `add table` (creates it if missing, so the following delete cannot fail), `delete table`
    (removes all of our old chains and rules), then, if the family has rules, the table is built again. The
    whole list is one netlink transaction. A family without rules ends up without a table.
    Rule sets with egress port maps need the text form (`plan_nft_script`): ValueError here.
    """
    cmds: list[dict] = []
    for v in families:
        fam = NFT_FAMILY[v]
        cmds.append({"add": {"table": {"family": fam, "name": TABLE}}})
        cmds.append({"delete": {"table": {"family": fam, "name": TABLE}}})
        p = _family_plan(rules, v)
        if _named_maps(p):
            raise ValueError("egress port maps and SNAT maps need the named map of the text batch: use plan_nft_script")
        if p.has_prerouting or p.snat:
            cmds.extend(_nft_family_cmds(p)[0])
    return {"nftables": cmds}


def plan_nft_script(rules: RuleSet, families: Iterable[int] = (4, 6)) -> str:
    """The same replacement as `plan_nft`, as an `nft -f` script (one transaction): each family's table is
    created if missing, deleted, and written again as `render_nft` shows it (a family without rules ends up
    without a table). The form every rule set can take, named port map included."""
    out: list[str] = []
    for v in families:
        fam = NFT_FAMILY[v]
        out += [f"add table {fam} {TABLE}", f"delete table {fam} {TABLE}"]
        p = _family_plan(rules, v)
        if p.has_prerouting or p.snat:
            out += _nft_family_cmds(p)[1]
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class NftState:
    """What one `apply` leaves in our tables, split into the part a delta keeps (`shape`: every chain and
    rule, and which named maps exist) and the named maps' elements: ((family, map name), {(key, data)}).
    Computed from a rule set, never listed from the kernel."""

    shape: tuple[tuple[int, _Plan, tuple[str, ...], tuple[tuple[str, str], ...], bool], ...]
    elements: tuple[tuple[tuple[int, str], frozenset[tuple[str, str]]], ...]


def nft_state(rules: RuleSet, families: Iterable[int] = (4, 6)) -> NftState:
    """The `NftState` of `rules`: what `render_nft` shows, split for `plan_nft_delta`. Computed without building
    the port maps' `_Plan` (a few ms per thousand Services): only the part without port maps is planned, and
    the maps' elements are formatted as `_named_maps` does."""
    rest = replace(rules, port_maps=()) if rules.port_maps else rules
    by_version: dict[int, list] = {4: [], 6: []}
    for m in rules.port_maps:
        by_version[m.target.version].append(m)
    shape, elements = [], []
    for v in families:
        p = _family_plan(rest, v)
        first: dict[tuple[str, int], object] = {}
        for m in by_version[v]:
            first.setdefault((m.protocol, m.match_port), m)     # the first of a (protocol, port), as _family_plan
        snat = {str(d): str(s) for d, s in p.snat}
        pm = set()
        src_ip, src_text = None, ""
        for m in by_version[v]:
            target = str(m.target)
            if first[(m.protocol, m.match_port)] is m:
                pm.add((f"{m.protocol} . {m.match_port}", f"{target} . {m.target_port}"))
            if m.snat_source is not src_ip:     # usually one source for all: format it once
                src_ip, src_text = m.snat_source, str(m.snat_source)
            snat.setdefault(target, src_text)
        names = ((PORT_MAP,) if pm else ()) + ((SNAT_MAP,) if len(snat) > 1 else ())
        single = tuple(snat.items()) if len(snat) == 1 else ()
        clamp = rules.clamp_mss and (p.has_prerouting or bool(pm) or bool(snat))
        shape.append((v, replace(p, snat=(), clamp=False), names, single, clamp))
        if pm:
            elements.append(((v, PORT_MAP), frozenset(pm)))
        if len(snat) > 1:
            elements.append(((v, SNAT_MAP), frozenset(snat.items())))
    return NftState(tuple(shape), tuple(elements))


def plan_nft_delta(old: NftState, new: NftState) -> str | None:
    """The `nft -f` script (one transaction) that turns the tables `old` describes into `new` by adding and
    removing named map elements only; "" when they are equal, None when a chain, rule or map differs (the
    caller replaces the tables: `plan_nft_script`). An element whose data changed is deleted and added again
    in the same transaction."""
    if old.shape != new.shape:
        return None
    out: list[str] = []
    for ((v, name), before), (_, after) in zip(old.elements, new.elements, strict=True):
        where = f"{NFT_FAMILY[v]} {TABLE} {name}"
        after_data = dict(after)
        gone = sorted({k for k, d in before if after_data.get(k) != d}, key=_natural_key)
        added = sorted(after - before, key=lambda e: _natural_key(e[0]))
        if gone:
            out.append(f"delete element {where} {{ " + ", ".join(gone) + " }")
        if added:
            out.append(f"add element {where} {{ " + ", ".join(f"{k} : {d}" for k, d in added) + " }")
    return "\n".join(out) + "\n" if out else ""

_BRACES = re.compile(r"\{ ([^{}]*) \}")


def normalize_nft_text(text: str) -> str:
    """Canonical form of `nft list table` output: elements inside `{ ... }` sorted.

    The kernel lists hash-set elements in hash order, which differs from insertion order; sorting makes
    `installed()` and `render()` comparable byte for byte.
    """
    def sort_elems(m: re.Match) -> str:
        elems = m.group(1).split(", ")
        return "{ " + ", ".join(sorted(elems, key=_natural_key)) + " }"
    out = []
    lines: list[str] = []
    for line in text.splitlines():
        # nft prints a named set's elements over several lines; one line per list makes them sortable.
        if lines and "elements = {" in lines[-1] and not lines[-1].rstrip().endswith("}"):
            lines[-1] = lines[-1].rstrip() + " " + line.strip()
        else:
            lines.append(line)
    for line in lines:
        if line.strip().startswith("type ") or "{" not in line:
            out.append(line.rstrip())
        else:
            out.append(_BRACES.sub(sort_elems, line.rstrip()))
    return "\n".join(out).strip("\n") + ("\n" if text.strip() else "")


def render_nft(rules: RuleSet, families: Iterable[int] = (4, 6)) -> str:
    """What `nft list table <fam> containerboot` will print after applying `rules` (normalised)."""
    parts = []
    for v in families:
        p = _family_plan(rules, v)
        if p.has_prerouting or p.snat:
            parts.append("\n".join(_nft_family_cmds(p)[1]) + "\n")
    return normalize_nft_text("".join(parts))


# ============================================================================================ iptables-restore

def _host(ip: IP) -> str:
    return f"{ip}/{ip.max_prefixlen}"


def _ipt_target(ip: IP, port: int | None = None) -> str:
    if port is None:
        return str(ip)
    # IPv6 needs brackets when a port follows, or ip6tables reads the port as part of the address [E2].
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _comment(text: str) -> str:
    # Comments identify service rules in `iptables-save`; keep them short (the kernel limit is 255 bytes and
    # [E25] shows long comments are a liability) and free of characters that would need escaping.
    text = re.sub(r"[^A-Za-z0-9_.:/@ -]", "_", text)[:200]
    return f'-m comment --comment "{text}"'


def _lb_lines(chain: str, match: str, targets: tuple[IP, ...]) -> list[str]:
    """Even split of new flows: rule k (from the end) takes every k-th packet that reaches it."""
    lines = []
    for i in range(len(targets), 1, -1):
        lines.append(f"-A {chain} {match}-m statistic --mode nth --every {i} --packet 0 "
                     f"-j DNAT --to-destination {targets[i - 1]}")
    lines.append(f"-A {chain} {match}-j DNAT --to-destination {targets[0]}")
    return lines


def _ipt_chain_rules(p: _Plan) -> dict[str, list[str]]:
    """Rule lines (`iptables-save` canonical form) per chain of ours."""
    tun = p.tun
    pre: list[str] = []
    for d in p.lb_dnats:
        pre += _lb_lines("CB-PREROUTING", f"-d {_host(d.original_dst)} ", d.targets)
    for dst, target, service in p.addr_dnats:
        c = f"{_comment('svc ' + service)} " if service else ""
        pre.append(f"-A CB-PREROUTING -d {_host(dst)} {c}-j DNAT --to-destination {target}")
    for proto, mport, target, tport, service in p.port_maps:
        pre.append(f"-A CB-PREROUTING ! -i {tun} -p {proto} -m {proto} --dport {mport} "
                   f"{_comment(f'svc {service} {proto}/{mport}')} "
                   f"-j DNAT --to-destination {_ipt_target(target, tport)}")
    if p.egress_targets:
        # Exempt ports return to the built-in chain before the catch-all; they come after every specific rule,
        # so they only ever exempt from the catch-all.
        for proto, port in p.exempt:
            pre.append(f"-A CB-PREROUTING ! -i {tun} -p {proto} -m {proto} --dport {port} -j RETURN")
        pre += _lb_lines("CB-PREROUTING", f"! -i {tun} ", p.egress_targets)
    post = [f"-A CB-POSTROUTING -d {_host(dst)} -j SNAT --to-source {src}" for dst, src in p.snat]
    fwd = []
    if p.clamp:
        fwd = [f"-A CB-FORWARD {flag} {tun} -p tcp -m tcp --tcp-flags SYN,RST SYN -j TCPMSS --clamp-mss-to-pmtu"
               for flag in ("-o", "-i")]
    return {"CB-PREROUTING": pre, "CB-POSTROUTING": post, "CB-FORWARD": fwd}


@dataclass(frozen=True)
class IptState:
    """What `iptables-save` says about our chains and the jumps to them, per table."""

    chains: frozenset[str]                      # our chains that exist
    jumps: dict[str, tuple[int, ...]]           # our chain -> positions (0-based) of `-j` jumps in its built-in

    @classmethod
    def parse(cls, save_text: str) -> "IptState":
        chains: set[str] = set()
        jumps: dict[str, list[int]] = {}
        pos: dict[str, int] = {}
        for line in save_text.splitlines():
            if line.startswith(":"):
                name = line[1:].split(" ", 1)[0]
                if name in IPT_OUR_CHAINS:
                    chains.add(name)
            elif line.startswith("-A "):
                parts = line.split()
                chain = parts[1]
                idx = pos.get(chain, 0)
                pos[chain] = idx + 1
                if len(parts) == 4 and parts[2] == "-j" and parts[3] in IPT_OUR_CHAINS:
                    jumps.setdefault(parts[3], []).append(idx)
        return cls(frozenset(chains), {k: tuple(v) for k, v in jumps.items()})


def plan_iptables(rules: RuleSet, family: int, existing: str = "") -> str:
    """`iptables-restore --noflush` input (for `iptables` if family 4, `ip6tables` if 6).

    `existing` is the current `iptables-save` output for the nat and mangle tables of that family (empty = none
    of ours exists); it is needed because restore cannot express "add this jump unless present". Per table the
    input declares our needed chains (declaring flushes them), keeps exactly one jump from the built-in chain at
    position 1, fills the chains, and unhooks/deletes chains of ours that are no longer needed. Other chains
    are never mentioned. Returns "" when nothing needs doing for this family.
    """
    if family not in (4, 6):
        raise ValueError(f"family must be 4 or 6, not {family!r}")
    p = _family_plan(rules, family)
    wanted = _ipt_chain_rules(p)
    state = IptState.parse(existing)
    out: list[str] = []
    for table in IPT_TABLES:
        body: list[str] = []
        decl: list[str] = []
        for t, chain, builtin in IPT_CHAINS:
            if t != table:
                continue
            lines = wanted[chain]
            jumps = state.jumps.get(chain, ())
            if lines:
                decl.append(f":{chain} - [0:0]")
                if jumps != (0,):
                    body += [f"-D {builtin} -j {chain}"] * len(jumps)
                    body.append(f"-I {builtin} 1 -j {chain}")
                body += lines
            elif chain in state.chains or jumps:
                # Not needed any more: unhook, flush (by declaring) and delete.
                decl.append(f":{chain} - [0:0]")
                body += [f"-D {builtin} -j {chain}"] * len(jumps)
                body.append(f"-X {chain}")
        if decl:
            out += [f"*{table}", *decl, *body, "COMMIT"]
    return "\n".join(out) + "\n" if out else ""


def ipt_chain_rules(rules: RuleSet, family: int) -> dict[str, tuple[str, ...]]:
    """The rule lines each chain of ours holds for `rules` (what `plan_iptables` writes), for `plan_iptables_delta`."""
    return {chain: tuple(lines) for chain, lines in _ipt_chain_rules(_family_plan(rules, family)).items()}


def plan_iptables_delta(old: dict[str, tuple[str, ...]], new: dict[str, tuple[str, ...]]) -> str | None:
    """`iptables-restore --noflush` input that turns our chains' rules from `old` into `new` (`ipt_chain_rules`)
    by deleting and inserting single rules, each table in one COMMIT; "" when they are equal.

    None when that cannot be done rule by rule: a chain appears or goes away (its jump changes too), or the
    rules both hold are not in the same order. Positions are those of `old`: the caller must know that the
    kernel holds exactly `old` (`netfilter.generation`). After the deletions, inserting each new rule at its
    final position, lowest first, leaves exactly `new`.
    """
    out: list[str] = []
    for table in IPT_TABLES:
        body: list[str] = []
        for t, chain, _ in IPT_CHAINS:
            a, b = old.get(chain, ()), new.get(chain, ())
            if t != table or a == b:
                continue
            if not a or not b:
                return None
            aset, bset = set(a), set(b)
            if len(aset) != len(a) or len(bset) != len(b):
                return None     # never planned ([E5]/[E7]); the sets below would miscount
            if [ln for ln in a if ln in bset] != [ln for ln in b if ln in aset]:
                return None
            prefix = f"-A {chain} "
            # Deleted by position, last first so that the earlier positions still hold: iptables-nft finds a
            # rule by number without comparing every rule's text (a third of the time with 1,000 rules).
            body += [f"-D {chain} {i + 1}" for i in reversed(range(len(a))) if a[i] not in bset]
            body += [f"-I {chain} {i + 1} {ln[len(prefix):]}" for i, ln in enumerate(b) if ln not in aset]
        if body:
            out += [f"*{table}", *body, "COMMIT"]
    return "\n".join(out) + "\n" if out else ""


def plan_iptables_cleanup(family: int, existing: str = "") -> str:
    """Restore input that removes every chain and jump of ours for `family`."""
    return plan_iptables(RuleSet(), family, existing)


_BUILTIN_ORDER = ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING")


def _chain_rank(chain: str) -> tuple[int, str]:
    return (_BUILTIN_ORDER.index(chain), "") if chain in _BUILTIN_ORDER else (len(_BUILTIN_ORDER), chain)


def canonical_iptables(table: str, lines: Iterable[str]) -> list[str]:
    """Order our lines as iptables-save does (built-in chains first, then ours by name), rule order kept."""
    decl = sorted({ln for ln in lines if ln.startswith(":")})
    rules = [ln for ln in lines if ln.startswith("-A ")]
    rules = sorted(rules, key=lambda ln: _chain_rank(ln.split()[1]))   # stable: keeps order within a chain
    if not decl and not rules:
        return []
    return [f"*{table}", *decl, *rules]


def filter_iptables_save(save_text: str) -> dict[str, list[str]]:
    """From `iptables-save` output, keep only our chains, their rules and the jumps to them, per table."""
    tables: dict[str, list[str]] = {}
    table = ""
    for line in save_text.splitlines():
        if line.startswith("*"):
            table = line[1:].strip()
            continue
        if line.startswith(":"):
            name = line[1:].split(" ", 1)[0]
            if name in IPT_OUR_CHAINS:
                tables.setdefault(table, []).append(f":{name} - [0:0]")   # counters are not state
        elif line.startswith("-A "):
            parts = line.split()
            if parts[1] in IPT_OUR_CHAINS or (len(parts) == 4 and parts[2] == "-j" and parts[3] in IPT_OUR_CHAINS):
                tables.setdefault(table, []).append(line.rstrip())
    return tables


def render_iptables(rules: RuleSet, family: int) -> str:
    """What `installed()` will show for this family after applying `rules` (tables nat, mangle)."""
    p = _family_plan(rules, family)
    wanted = _ipt_chain_rules(p)
    out: list[str] = []
    for table in IPT_TABLES:
        lines: list[str] = []
        for t, chain, builtin in IPT_CHAINS:
            if t == table and wanted[chain]:
                lines += [f":{chain} - [0:0]", f"-A {builtin} -j {chain}", *wanted[chain]]
        out += canonical_iptables(table, lines)
    return "\n".join(out) + "\n" if out else ""


# ======================================================================================= conntrack hygiene

class NatOracle:
    """Decides whether an existing NAT binding contradicts the current rule set (pure).

    Conntrack keeps a flow's DNAT binding until the flow times out, so after a target change a UDP client that
    keeps its source port (DNS resolvers, QUIC, WireGuard) would keep reaching the old target indefinitely.
    The backend asks this oracle about every DNATed UDP entry and deletes the stale ones; the next packet then
    goes through the current rules. A binding is stale only if the *current* rules would capture the flow
    (same precedence as the chains) and send it somewhere else; flows no current rule matches are left alone,
    since they may be another component's.
    """

    def __init__(self, rules: RuleSet, version: int) -> None:
        p = _family_plan(rules, version)
        self._lb = {d.original_dst: frozenset(d.targets) for d in p.lb_dnats}
        self._addr = {dst: target for dst, target, _ in p.addr_dnats}
        self._ports = {(proto, mport): (target, tport) for proto, mport, target, tport, _ in p.port_maps}
        self._egress = frozenset(p.egress_targets)
        self._exempt = frozenset(p.exempt)

    def covers(self, proto: str, orig_dst: IP, dport: int) -> bool:
        """Whether these rules would translate a new flow to orig_dst:dport at all."""
        return (orig_dst in self._lb or orig_dst in self._addr or (proto, dport) in self._ports
                or (bool(self._egress) and (proto, dport) not in self._exempt))

    def is_stale(self, proto: str, orig_dst: IP, dport: int, reply_src: IP, reply_sport: int) -> bool:
        if orig_dst in self._lb:
            return reply_src not in self._lb[orig_dst] or reply_sport != dport
        if orig_dst in self._addr:
            return reply_src != self._addr[orig_dst] or reply_sport != dport
        if (proto, dport) in self._ports:
            return (reply_src, reply_sport) != self._ports[(proto, dport)]
        if self._egress and (proto, dport) not in self._exempt:
            return reply_src not in self._egress or reply_sport != dport
        return False
