"""The agent's firewall at shutdown (containerboot.firewallsetup): rules removed, then the conntrack entries of the
connections they translated, and only for a kernel firewall whose removal worked (the kernel side is in
netns-tests/test_netfilter_kernel.py, test_shutdown_refuses_a_caught_connection_instead_of_blackholing_it)."""
from __future__ import annotations

import asyncio

import pytest

import netfilter.conntrack
from containerboot.firewallsetup import FirewallSetup
from containerboot.settings import load
from netfilter.errors import FirewallError
from netfilter.fake import FakeBackend
from netfilter.model import EgressForward, PortMatch, RuleSet

RULES = RuleSet(egress=(EgressForward("100.99.99.99", "100.64.0.5", (PortMatch("udp", 41641),)),))


class KernelLike(FakeBackend):
    translates_connections = True

    def __init__(self, fail: bool = False) -> None:
        super().__init__(ipv6=True)
        self.fail = fail

    def cleanup(self) -> None:
        if self.fail:
            raise FirewallError("iptables: permission denied")
        super().cleanup()


@pytest.fixture
def flushed(monkeypatch):
    calls: list[RuleSet] = []
    monkeypatch.setattr(netfilter.conntrack, "flush_translated_conntrack", lambda rules: calls.append(rules) or 0)
    return calls


def close(backend, applied):
    fw = FirewallSetup(load({"TS_DEST_IP": "100.64.0.9", "TS_USERSPACE": "false"}))
    fw.backend = backend
    asyncio.run(fw.close(applied))


def test_a_kernel_firewall_flushes_what_its_removed_rules_translated(flushed):
    close(KernelLike(), RULES)
    assert flushed == [RULES]


def test_the_test_hooks_firewall_never_touches_conntrack(flushed):
    close(FakeBackend(ipv6=True), RULES)
    assert flushed == []


def test_nothing_is_flushed_while_the_rules_could_not_be_removed(flushed):
    close(KernelLike(fail=True), RULES)     # the rules still translate: a flushed entry would come back
    assert flushed == []


def test_no_rules_applied_nothing_flushed(flushed):
    close(KernelLike(), None)
    close(KernelLike(), RuleSet())
    assert flushed == []
