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
