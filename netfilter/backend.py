"""The backend interface the agent programs the firewall through, and the factory that picks one.

A backend owns its own objects only (nftables tables `ip/ip6 containerboot`, or iptables chains `CB-*` jumped to
from the built-ins) and applies a whole `RuleSet` at a time. The agent calls these synchronous methods through
`asyncio.to_thread`.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping, Protocol, runtime_checkable

from .model import RuleSet

log = logging.getLogger("containerboot")


class FirewallError(Exception):
    """A firewall operation failed; str(e) says what was attempted, what the kernel/tool said, and a fix."""


@runtime_checkable
class Backend(Protocol):
    name: str                                    # "nftables" | "iptables"

    def apply(self, rules: RuleSet) -> None:     # whole desired set, one transaction per family; idempotent
        ...

    def installed(self) -> str:                  # human-readable dump of what the agent owns in the kernel now
        ...

    def render(self, rules: RuleSet) -> str:     # human-readable desired state, same format as installed()
        ...

    def cleanup(self) -> None:                   # remove everything the agent added
        ...


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
    removed = 0
    for version, family in ((4, socket.AF_INET), (6, socket.AF_INET6)):
        oracle = NatOracle(rules, version)
        old = NatOracle(previous, version) if previous is not None else None
        try:
            ct = _conntrack_class()(nfgen_family=family)
        except Exception as e:
            log.debug("conntrack unavailable (IPv%d): %s", version, e)
            continue
        try:
            # Read the whole dump before deleting: pyroute2 cannot interleave requests with a running dump.
            for e in list(ct.dump_entries()):
                if not (e.status or 0) & IPS_DST_NAT or e.tuple_orig.proto != socket.IPPROTO_UDP:
                    continue
                o, r = e.tuple_orig, e.tuple_reply
                dst = ipaddress.ip_address(o.daddr)
                gone = old is not None and old.covers("udp", dst, o.dport) and not oracle.covers("udp", dst, o.dport)
                if gone or oracle.is_stale("udp", dst, o.dport, ipaddress.ip_address(r.saddr), r.sport):
                    try:
                        ct.delete(e)
                        removed += 1
                    except Exception as err:   # already gone
                        log.debug("conntrack delete %s: %s", e, err)
        except Exception as err:
            log.info("could not clean up conntrack entries (IPv%d): %s", version, err)
        finally:
            ct.close()
    if removed:
        log.info("removed %d UDP conntrack entries that pointed at targets no longer wanted", removed)
    return removed


def conntrack_after_apply(backend, rules: RuleSet, previous: RuleSet | None) -> None:
    """What a backend's apply() does about conntrack once its rules are in: clean up now, or, when the caller
    set `backend.defer_conntrack`, leave it for `flush_pending_conntrack` (the agent first reports the rules
    as installed, so the clean-up, a conntrack dump, is off the path to "Startup complete")."""
    if not getattr(backend, "defer_conntrack", False):
        flush_stale_conntrack(rules, previous)
        return
    pending = getattr(backend, "pending_conntrack", None)
    # Two applies before one flush: bindings may still come from the older rule set.
    backend.pending_conntrack = (rules, pending[1] if pending is not None else previous)


def flush_pending_conntrack(backend) -> int:
    pending = getattr(backend, "pending_conntrack", None)
    if pending is None:
        return 0
    backend.pending_conntrack = None
    return flush_stale_conntrack(*pending)


def _conntrack_class():
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
        loaded = []

        def complete(name: str):   # PEP 562: called only for names the bare package lacks
            if not loaded and importlib.util.find_spec(f"pyroute2.{name}") is not None:
                return importlib.import_module(f"pyroute2.{name}")   # a submodule: `from pyroute2 import config`
            if not loaded:
                loaded.append(True)
                del pkg.__getattr__
                spec.loader.exec_module(pkg)
            return pkg.__dict__[name] if name in pkg.__dict__ else getattr(pkg, name)

        pkg.__getattr__ = complete
        sys.modules["pyroute2"] = pkg
    from pyroute2.conntrack import Conntrack
    return Conntrack


def open_backend(mode: str = "", *, env: Mapping[str, str] | None = None) -> Backend:
    """Backend for `TS_DEBUG_FIREWALL_MODE` semantics: "", "auto", "iptables", "nftables".

    An empty `mode` falls back to `TS_DEBUG_FIREWALL_MODE` from `env` (default: the process environment), then to
    upstream's detection (spec 1.2): iptables when an iptables binary exists, else nftables; "auto" picks the
    one that already holds rules (spec 1.3). Any other value means iptables, exactly like upstream.
    """
    from . import detect

    env = os.environ if env is None else env
    if not mode:
        mode = env.get("TS_DEBUG_FIREWALL_MODE", "")
    chosen = detect.detect_firewall_mode(mode)
    v6 = detect.ipv6_nat_available(chosen)
    log.info("firewall mode %s (requested %r), IPv6 NAT %s", chosen, mode, "available" if v6 else "unavailable")
    if chosen == "nftables":
        from .nft import NftBackend
        return NftBackend(ipv6=v6)
    from .iptables import IptablesBackend
    return IptablesBackend(ipv6=v6)
