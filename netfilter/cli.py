"""`containerboot rules` / `python -m netfilter.cli`: look at (and, for tests, change) the agent's firewall state.

    python -m netfilter.cli installed [--mode nftables|iptables|auto]   what the agent owns in the kernel now
    python -m netfilter.cli show FILE.json [--mode ...]                desired and installed, and whether equal
    python -m netfilter.cli render FILE.json [--mode ...]              desired state from a rule-set JSON file
    python -m netfilter.cli diff FILE.json [--mode ...]                exit 1 if installed != desired
    python -m netfilter.cli apply FILE.json [--mode ...]               apply it (used by the netns tests)
    python -m netfilter.cli cleanup [--mode ...]                       remove everything of ours
    python -m netfilter.cli detect                                     the mode upstream's detection picks

FILE.json is `RuleSet.to_json()` output, which the agent writes on every apply.
"""
from __future__ import annotations

import argparse
import difflib
import sys

from .backend import Backend, open_backend
from .errors import FirewallError
from .model import RuleSet


def _backend(args: argparse.Namespace) -> Backend:
    ipv6 = None if not args.no_ipv6 else False
    if args.mode == "nftables" and (args.variant or ipv6 is not None):
        from .nft import NftBackend
        return NftBackend(ipv6=ipv6 is None)
    if args.mode == "iptables" and (args.variant or ipv6 is not None):
        from .iptables import IptablesBackend
        return IptablesBackend(ipv6=ipv6 is None, variant=None if args.variant == "auto" else
                               ("" if args.variant == "plain" else args.variant))
    return open_backend(args.mode or "")


NOTHING = "(nothing)\n"


def _load(path: str) -> RuleSet:
    with open(path) as f:
        return RuleSet.from_json(f.read())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="containerboot rules", description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("installed", "show", "render", "diff", "apply", "cleanup", "detect"))
    ap.add_argument("file", nargs="?", help="rule-set JSON (render, diff, apply)")
    ap.add_argument("--mode", default="", help="nftables, iptables or auto (default: TS_DEBUG_FIREWALL_MODE)")
    ap.add_argument("--variant", default="", choices=("", "auto", "legacy", "nft", "plain"),
                    help="iptables flavour (default: detect)")
    ap.add_argument("--no-ipv6", action="store_true", help="behave as if IPv6 NAT were unavailable")
    ap.add_argument("--previous", default="", help="apply: the rule-set JSON applied before (conntrack hygiene "
                                                   "for removed translations, as the agent does)")
    args = ap.parse_args(argv)
    try:
        if args.command == "detect":
            import os

            from .detect import detect_firewall_mode
            print(detect_firewall_mode(args.mode or os.environ.get("TS_DEBUG_FIREWALL_MODE", "")))
            return 0
        if args.command in ("show", "render", "diff", "apply") and not args.file:
            ap.error(f"{args.command} needs a rule-set JSON file")
        b = _backend(args)
        if args.command == "installed":
            sys.stdout.write(b.installed())
        elif args.command == "show":
            want, have = b.render(_load(args.file)), b.installed()
            status = "in sync" if want == have else "DIFFERENT (see: diff)"
            sys.stdout.write(f"# backend: {b.name}\n# desired ({args.file}):\n{want or NOTHING}"
                             f"# installed:\n{have or NOTHING}# {status}\n")
        elif args.command == "render":
            sys.stdout.write(b.render(_load(args.file)))
        elif args.command == "diff":
            want, have = b.render(_load(args.file)), b.installed()
            if want == have:
                return 0
            sys.stdout.writelines(difflib.unified_diff(
                have.splitlines(True), want.splitlines(True), "installed", "desired"))
            return 1
        elif args.command == "apply":
            rules = _load(args.file)
            if b.apply(rules) and b.translates_connections:
                from .conntrack import flush_stale_conntrack
                # As the agent does after a change: UDP bindings to targets no longer wanted go.
                flush_stale_conntrack(rules, _load(args.previous) if args.previous else None)
        elif args.command == "cleanup":
            b.cleanup()
    except (FirewallError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
