"""Conntrack hygiene: after a rule change, UDP bindings that point at targets the rules no longer want are deleted;
after the rules are removed (the agent's shutdown), every connection they translated is.

A backend's `apply` only changes rules and says whether the kernel changed; whoever applies (the agent's
reconciler, `netfilter.cli`) decides when this clean-up runs, because it is a dump of the whole conntrack table
(tens of milliseconds on a busy node) and the agent keeps it off the path to "Startup complete".
`PendingCleanup` is the value such a caller carries between an apply and the clean-up.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .model import RuleSet

log = logging.getLogger("containerboot")


@dataclass(frozen=True)
class PendingCleanup:
    """A clean-up owed after one or more applies: `rules` is in force, bindings may date from `previous`."""

    rules: RuleSet
    previous: RuleSet | None

    def after(self, rules: RuleSet) -> "PendingCleanup":
        """Another apply before the clean-up ran: bindings may still come from the older rule set."""
        return PendingCleanup(rules, self.previous)

    def run(self) -> int:
        return flush_stale_conntrack(self.rules, self.previous)

    def run_in_child(self) -> int:
        """`run()` in a forked child that exits when done; returns its count (-1 when the child failed).

        The clean-up loads pyroute2's netlink and conntrack modules (about 2.5 MB of a long-running agent's
        resident memory, for a dump that runs once after start-up and after rule changes that remove a
        translation); in a child they go away with it. The child only dumps and deletes entries and logs,
        then leaves with `os._exit` (no clean-up of the parent's objects, sockets or files); CPython
        re-initialises the import and logging locks after a fork. Where fork is not available, in-process."""
        import os
        if not hasattr(os, "fork"):
            return self.run()
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            return self.run()
        if pid == 0:   # the child
            code = 1
            try:
                import signal
                os.close(r)
                signal.set_wakeup_fd(-1)   # a signal to the child must not wake the parent's event loop
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_DFL)
                os.write(w, str(self.run()).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        try:
            out = b""
            while chunk := os.read(r, 64):
                out += chunk
        finally:
            os.close(r)
            os.waitpid(pid, 0)
        return int(out) if out.strip().isdigit() else -1


IPS_DST_NAT = 1 << 5      # conntrack status bit: the flow's destination was translated


def _only_additions(previous: RuleSet, rules: RuleSet) -> bool:
    """True when `rules` keeps every translation of `previous` unchanged (it may add new ones)."""
    return all(set(getattr(previous, f)) <= set(getattr(rules, f))
               for f in ("dnats", "egress", "port_maps", "service_dnats"))


def flush_stale_conntrack(rules: RuleSet, previous: RuleSet | None = None) -> int:
    """Delete UDP conntrack entries whose DNAT binding contradicts `rules`; returns how many. Best effort.

    Only UDP: a TCP connection to a target that is no longer wanted keeps working while that target lives and
    ends on its own (the same policy kube-proxy follows), whereas a UDP "flow" from a fixed source port never
    ends and would stick to the old target forever. A binding is stale when the current rules send its flow
    elsewhere, or when `previous` (the rules this binding came from) covered it and the current rules do not
    (a removed service). When the change only adds translations no binding can be stale, so the conntrack
    table (whose dump costs time in proportion to its size) is not read at all. Errors (no
    nf_conntrack_netlink, no CAP_NET_ADMIN) are logged, never raised: the rules themselves are already correct.
    """
    import ipaddress
    import socket

    from .plan import NatOracle

    if previous is not None and _only_additions(previous, rules):
        return 0

    def stale_in(version: int) -> "Callable[[Any], bool]":
        oracle = NatOracle(rules, version)
        old = NatOracle(previous, version) if previous is not None else None

        def stale(e: Any) -> bool:
            o, r = e.tuple_orig, e.tuple_reply
            if o.proto != socket.IPPROTO_UDP:
                return False
            dst = ipaddress.ip_address(o.daddr)
            gone = old is not None and old.covers("udp", dst, o.dport) and not oracle.covers("udp", dst, o.dport)
            return gone or oracle.is_stale("udp", dst, o.dport, ipaddress.ip_address(r.saddr), r.sport)
        return stale

    removed = _delete_translated(stale_in)
    if removed:
        log.info("removed %d UDP conntrack entries that pointed at targets no longer wanted", removed)
    return removed


def flush_translated_conntrack(rules: RuleSet) -> int:
    """Delete every conntrack entry (TCP, UDP) whose destination `rules` translated; returns how many. Best effort.

    For the agent's shutdown, after its rules are removed: tailscaled is gone or going, so a flow that the rules
    sent to a tailnet target can only be dropped from now on, and its conntrack entry would keep translating its
    packets into nowhere until it times out. A client whose SYN was caught (a ProxyGroup replica whose tailscaled
    died: a new connection sent to it just then) would wait for its own timeout; with the entry gone its
    retransmission meets no translation and is refused at once, so it can try again (another replica). Entries
    of flows the rules did not translate are kept. Errors are logged, never raised."""
    import ipaddress
    import socket

    from .plan import NatOracle

    protos = {socket.IPPROTO_TCP: "tcp", socket.IPPROTO_UDP: "udp"}

    def translated_in(version: int) -> "Callable[[Any], bool]":
        oracle = NatOracle(rules, version)

        def translated(e: Any) -> bool:
            o = e.tuple_orig
            proto = protos.get(o.proto)
            return proto is not None and oracle.covers(proto, ipaddress.ip_address(o.daddr), o.dport)
        return translated

    # The standard library's netlink, not pyroute2: this runs as a ProxyGroup replica whose tailscaled died
    # leaves, when its CPU is scarcest, and loading pyroute2 is most of the work (netfilter.ctnetlink).
    from .ctnetlink import Ctnetlink
    removed = _delete_translated(translated_in, lambda family: Ctnetlink(family))
    if removed:
        log.info("removed %d conntrack entries of connections the removed rules had translated", removed)
    return removed


def _delete_translated(matcher: "Callable[[int], Callable[[Any], bool]]",
                       table: "Callable[[int], Any] | None" = None) -> int:
    """Delete, in both families, the DNAT-translated conntrack entries that `matcher(version)` selects; returns
    how many. `table(family)` opens the conntrack table (`dump_entries()`, `delete(entry)`, `close()`): pyroute2's
    Conntrack unless given. Errors (no nf_conntrack_netlink, no CAP_NET_ADMIN, an entry already gone) are
    logged, never raised."""
    import socket

    removed = 0
    for version, family in ((4, socket.AF_INET), (6, socket.AF_INET6)):
        select = matcher(version)
        try:
            ct = table(family) if table is not None else conntrack_class()(nfgen_family=family)
        except Exception as err:
            log.debug("conntrack unavailable (IPv%d): %s", version, err)
            continue
        try:
            # Read the whole dump before deleting: pyroute2 cannot interleave requests with a running dump.
            for e in list(ct.dump_entries()):
                if not (e.status or 0) & IPS_DST_NAT or not select(e):
                    continue
                try:
                    ct.delete(e)
                    removed += 1
                except Exception as err:   # already gone
                    log.debug("conntrack delete %s: %s", e, err)
        except Exception as err:
            log.info("could not clean up conntrack entries (IPv%d): %s", version, err)
        finally:
            ct.close()
    return removed


def conntrack_class():
    """pyroute2's Conntrack, without the rest of pyroute2.

    `import pyroute2` runs a package __init__ that imports every part of the library (IPDB, NDB, IPVS, iw,
    ethtool, ...): about 10 MB of resident memory for the agent's whole life. The conntrack module needs none
    of it, so the package is registered without running its __init__ (its submodules import each other by
    full name, never through the package's namespace). The first use of a name from the package itself
    (`from pyroute2 import IPRoute`, anywhere later) runs the real __init__ then, so nothing else changes.
    """
    import sys
    if "pyroute2" not in sys.modules:
        import importlib
        import importlib.util
        spec = importlib.util.find_spec("pyroute2")
        if spec is None or spec.loader is None:
            raise ImportError("pyroute2 is not installed")
        pkg = importlib.util.module_from_spec(spec)
        loader = spec.loader   # bound here: mypy does not carry the None check above into the closure
        loaded: list[bool] = []

        def complete(name: str):   # PEP 562: called only for names the bare package lacks
            if not loaded and importlib.util.find_spec(f"pyroute2.{name}") is not None:
                return importlib.import_module(f"pyroute2.{name}")   # a submodule: `from pyroute2 import config`
            if not loaded:
                loaded.append(True)
                del pkg.__getattr__
                loader.exec_module(pkg)
            return pkg.__dict__[name] if name in pkg.__dict__ else getattr(pkg, name)

        pkg.__dict__["__getattr__"] = complete   # PEP 562 looks it up in the module's namespace
        sys.modules["pyroute2"] = pkg
    from pyroute2.conntrack import Conntrack
    return Conntrack
