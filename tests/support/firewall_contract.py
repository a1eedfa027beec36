"""The firewall contract (`netfilter.backend.Backend`) as checks that run unchanged on every implementation.

`tests/test_firewall_contract.py` runs them on the test hook's in-memory fake; `netns-tests/test_firewall_contract.py`
runs them on nftables and both iptables flavours in a throw-away network namespace, through this module's
command line (`python -m tests.support.firewall_contract BACKEND` prints one JSON object: check name -> "" when
it held, else what failed). A fake that passes the same checks as the kernel backends cannot hide a difference
the agent relies on.
"""
from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from ipaddress import ip_address

from netfilter.backend import Backend
from netfilter.errors import FirewallError
from netfilter.model import Dnat, EgressForward, PortMatch, RuleSet, ServiceDnat, ServicePortMap

Make = Callable[[bool], Backend]      # ipv6 -> a backend on a kernel (or memory) holding none of our rules

ip = ip_address
V4 = RuleSet(dnats=(Dnat(ip("100.64.0.5"), (ip("10.0.0.1"), ip("10.0.0.2"))),),
             egress=(EgressForward(ip("100.99.99.99"), ip("100.64.0.5"), (PortMatch("udp", 41641),)),),
             port_maps=(ServicePortMap("default-db", "TCP", 10001, 5432, ip("100.99.99.98"), ip("100.64.0.5")),),
             service_dnats=(ServiceDnat("svc:web", ip("100.100.1.1"), ip("10.96.0.10")),),
             clamp_mss=True)
BOTH = RuleSet(dnats=V4.dnats + (Dnat(ip("fd7a:115c:a1e0::5"), (ip("fd00::1"),)),), egress=V4.egress,
               port_maps=V4.port_maps, service_dnats=V4.service_dnats, clamp_mss=True)
MOVED = RuleSet(dnats=(Dnat(ip("100.64.0.5"), (ip("10.0.0.3"),)),))


def check_members(make: Make) -> None:
    """Every member the agent uses is there, with the declared types."""
    for ipv6 in (True, False):
        b = make(ipv6)
        assert isinstance(b, Backend), type(b)
        assert isinstance(b.name, str) and b.name
        assert isinstance(b.in_process, bool) and isinstance(b.translates_connections, bool)
        assert b.ipv6 is ipv6
        assert tuple(b.families) == ((4, 6) if ipv6 else (4,)), b.families


def check_apply_is_idempotent_and_shows_as_rendered(make: Make) -> None:
    b = make(True)
    b.cleanup()
    assert b.installed() == ""
    assert b.apply(BOTH) is True
    first = b.installed()
    assert first and first == b.render(BOTH), (first, b.render(BOTH))
    assert b.apply(BOTH) is False, "the same rules again must write nothing"
    assert b.installed() == first
    b.cleanup()


def check_a_change_replaces_the_rules(make: Make) -> None:
    b = make(True)
    b.cleanup()
    b.apply(BOTH)
    assert b.apply(MOVED) is True
    assert b.installed() == b.render(MOVED)
    assert "10.0.0.1" not in b.installed()
    assert b.apply(RuleSet()) is True and b.installed() == ""
    b.cleanup()


def check_render_touches_nothing(make: Make) -> None:
    b = make(True)
    b.cleanup()
    assert b.render(BOTH) and b.installed() == ""
    assert b.render(RuleSet()) == ""


def check_cleanup_removes_everything_and_may_repeat(make: Make) -> None:
    b = make(True)
    b.cleanup()
    b.apply(BOTH)
    b.cleanup()
    assert b.installed() == ""
    b.cleanup()
    assert b.installed() == ""
    assert b.apply(V4) is True, "after a clean-up the rules must be written again"
    b.cleanup()


def check_without_ipv6_rules_of_that_family_are_refused(make: Make) -> None:
    b = make(False)
    b.cleanup()
    try:
        b.apply(BOTH)
    except FirewallError as e:
        assert "IPv6" in str(e), str(e)
    else:
        raise AssertionError("apply of IPv6 rules without IPv6 did not raise FirewallError")
    assert b.installed() == "", "a refused apply must change nothing"
    assert b.apply(V4) is True and b.installed() == b.render(V4)
    b.cleanup()


def check_warm_up_changes_nothing(make: Make) -> None:
    b = make(True)
    b.cleanup()
    b.warm_up()
    assert b.installed() == ""
    assert b.apply(RuleSet()) is False, "no rules wanted, none there: nothing to write"
    assert b.apply(V4) is True and b.installed() == b.render(V4)
    b.cleanup()
    again = make(True)
    again.apply(V4)
    again.warm_up()
    assert again.installed() == again.render(V4)
    again.cleanup()


CHECKS: dict[str, Callable[[Make], None]] = {
    name.removeprefix("check_"): fn for name, fn in sorted(globals().items()) if name.startswith("check_")}


def run_all(make: Make) -> dict[str, str]:
    """Every check, each after the previous one's clean-up: "" when it held, else the failure."""
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(make)
            results[name] = ""
        except Exception:   # a failed check is a result, and the other checks still run
            results[name] = traceback.format_exc(limit=3)
            try:
                make(True).cleanup()
            except Exception:   # the next check starts with its own clean-up anyway
                pass
    return results


def maker(backend: str) -> Make:
    if backend == "fake":
        from netfilter.fake import FakeBackend
        return lambda ipv6: FakeBackend(ipv6=ipv6)
    if backend == "nftables":
        from netfilter.nft import NftBackend
        return lambda ipv6: NftBackend(ipv6=ipv6)
    if backend in ("iptables-legacy", "iptables-nft"):
        from netfilter.iptables import IptablesBackend
        variant = backend.split("-", 1)[1]
        return lambda ipv6: IptablesBackend(ipv6=ipv6, variant=variant)
    raise SystemExit(f"unknown backend {backend!r}: fake, nftables, iptables-legacy or iptables-nft")


if __name__ == "__main__":
    print(json.dumps(run_all(maker(sys.argv[1]))))
