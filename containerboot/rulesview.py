"""`containerboot rules`: show what the agent wants and what is in the kernel, side by side.

Run it in the agent's network namespace (in a Pod: `kubectl exec <pod> -- containerboot rules`; locally:
`ip netns exec <ns> containerboot rules --socket <path>`). The desired rule set is the one the running agent
last applied, read from the file it keeps next to its LocalAPI socket.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from netfilter.backend import Backend


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="containerboot rules", description=__doc__.splitlines()[0])
    p.add_argument("--socket", default=os.environ.get("TS_SOCKET") or "/tmp/tailscaled.sock",
                   help="the agent's TS_SOCKET (its rules file lives next to it)")
    p.add_argument("--mode", default=os.environ.get("TS_DEBUG_FIREWALL_MODE", ""),
                   help="firewall backend: nftables, iptables or auto (default: as the agent detects)")
    args = p.parse_args(argv)
    from netfilter.model import RuleSet

    backend: Backend
    if _env_bool("TS_TEST_FAKE_NETFILTER", False):
        # The agent's test hook: its rules live in its in-memory firewall, published next to the socket. The
        # real firewall is neither probed nor read.
        from netfilter.fake import read_state, state_path
        backend = read_state(state_path(args.socket), ipv6=_env_bool("TS_TEST_FAKE_NETFILTER_6", True))
    else:
        from netfilter.backend import open_backend
        backend = open_backend(args.mode)
    path = os.path.join(os.path.dirname(args.socket) or ".", "containerboot-rules.json")
    print(f"# backend: {backend.name}")
    try:
        with open(path) as f:
            desired = RuleSet.from_json(f.read())
        print(f"# desired (from {path}):")
        print(backend.render(desired).rstrip() or "(nothing)")
    except FileNotFoundError:
        print(f"# desired: no agent rules file at {path} (is the agent running with this TS_SOCKET?)")
    print("# installed:")
    print(backend.installed().rstrip() or "(nothing)")
    return 0


def _env_bool(name: str, default: bool) -> bool:
    from .settings import parse_go_bool
    try:
        return parse_go_bool(os.environ.get(name) or str(default).lower())
    except ValueError:
        return default


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
