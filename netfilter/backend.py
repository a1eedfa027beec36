"""The firewall contract the agent programs through, and the factory that picks a backend.

A backend owns its own objects only (nftables tables `ip/ip6 containerboot`, or iptables chains `CB-*` jumped to
from the built-ins) and applies a whole `RuleSet` at a time. Three implementations keep the contract:
`nft.NftBackend`, `iptables.IptablesBackend` and the in-memory `fake.FakeBackend` of the test hook; one contract
test (`tests/test_firewall_contract.py` on the fake, `netns-tests/test_firewall_contract.py` on real kernels)
runs the same checks on each. Callers use nothing outside the protocol.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping, Protocol, runtime_checkable

from .errors import FirewallError
from .model import RuleSet

__all__ = ["Backend", "FirewallError", "open_backend"]

log = logging.getLogger("containerboot")


@runtime_checkable
class Backend(Protocol):
    """What every firewall backend promises. The methods are synchronous; the agent calls them through
    `asyncio.to_thread`, except a small `apply` of an `in_process` backend (see `containerboot.reconcile`).

    Attributes:
        name: shown in logs and /status ("nftables", "iptables", the fake's name).
        in_process: `apply` runs no program (libnftables, memory), so a small one may run on the caller's thread.
        ipv6: whether IPv6 NAT works here; without it `families` is (4,) and IPv6 rules are refused.
        families: the IP versions whose rules `apply` accepts; the agent leaves rules of other versions out.
        translates_connections: its rules translate the kernel's connections, so a rule change may leave
            UDP conntrack bindings pointing at old targets (`netfilter.conntrack`); False for the fake.

    Methods:
        apply(rules): make the owned objects equal `rules`, atomically per family, and return whether anything
            changed (False: the kernel already held exactly these rules; nothing was written). Idempotent.
            A rule set with IPv6 rules on a backend without IPv6 raises FirewallError and changes nothing.
            Conntrack is not touched: the caller decides when to clean up (`netfilter.conntrack`).
        installed(): a canonical text of what the backend owns now ("" when nothing); after apply(rules) it
            equals render(rules).
        render(rules): the same text for a desired rule set, without touching anything.
        cleanup(): remove everything the backend owns (installed() is "" afterwards); safe to repeat.
        warm_up(): optional speed-up before the first apply (load code, read state); changes nothing the kernel
            holds and never raises for lack of support (a no-op where there is nothing to warm).
    Failures raise `FirewallError` with what was attempted, what the kernel or tool said, and a fix.
    """

    name: str
    in_process: bool
    ipv6: bool
    translates_connections: bool

    @property
    def families(self) -> tuple[int, ...]:
        ...

    def apply(self, rules: RuleSet) -> bool:
        ...

    def installed(self) -> str:
        ...

    def render(self, rules: RuleSet) -> str:
        ...

    def cleanup(self) -> None:
        ...

    def warm_up(self) -> None:
        ...


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
