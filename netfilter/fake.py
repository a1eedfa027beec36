"""The in-memory firewall of the test hook `TS_TEST_FAKE_NETFILTER=true` (upstream's fake netfilter runner).

A harness built like upstream's (fake `tailscaled`, `tailscale`, `iptables` on PATH, a temporary file system
root) runs the agent as an L3 proxy on a developer's machine or in CI. With the hook set, nothing may reach the
real firewall: this backend runs no program, imports neither libnftables nor pyroute2, sends no netlink
message and deletes no conntrack entry. It keeps the last applied rule set in memory and mirrors it, as
`RuleSet` JSON, to a state file next to the agent's socket, so that `containerboot rules` (another process)
can show it as "installed". `TS_TEST_FAKE_NETFILTER_6=false` makes it a firewall without IPv6 NAT, as
upstream's fake does: rules of that family are left out and the affected target reports why.
"""
from __future__ import annotations

import os

from .errors import FirewallError
from .model import RuleSet
from .plan import render_iptables

#: The state file's name, in the directory of the agent's TS_SOCKET.
STATE_FILE = "containerboot-fake-netfilter.json"


def state_path(socket: str) -> str:
    return os.path.join(os.path.dirname(socket) or ".", STATE_FILE)


class FakeBackend:
    """A `netfilter.backend.Backend` that only remembers. Rendered like the iptables backend (upstream's fake
    is an iptables runner), headed by the IP families it supports."""

    name = "fake (TS_TEST_FAKE_NETFILTER)"
    in_process = True
    translates_connections = False    # no kernel: there is no conntrack table to clean up

    def __init__(self, *, ipv6: bool = True, state_file: str | None = None) -> None:
        self.ipv6 = ipv6
        self.state_file = state_file
        self.rules = RuleSet()
        self.applies = 0

    @property
    def families(self) -> tuple[int, ...]:
        return (4, 6) if self.ipv6 else (4,)

    def apply(self, rules: RuleSet) -> bool:
        if not self.ipv6 and rules.family(6).versions():
            raise FirewallError("the rule set has IPv6 rules but the fake firewall has no IPv6 "
                                "(TS_TEST_FAKE_NETFILTER_6=false)")
        if self.render(rules) == self.installed():
            return False        # as a kernel backend: the same rules write nothing
        self.rules = rules
        self.applies += 1
        self._publish()
        return True

    def render(self, rules: RuleSet) -> str:
        return "".join(f"# IPv{v} (fake)\n{body}" for v in self.families
                       if (body := render_iptables(rules, v)))

    def installed(self) -> str:
        return self.render(self.rules)

    def warm_up(self) -> None:
        """Nothing to warm in memory."""

    def cleanup(self) -> None:
        self.rules = RuleSet()
        self._publish()

    def _publish(self) -> None:
        if not self.state_file:
            return
        tmp = f"{self.state_file}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(self.rules.to_json())
            os.replace(tmp, self.state_file)
        except OSError:
            pass    # the file is a debugging view; the rules themselves live in memory


def read_state(path: str, *, ipv6: bool = True) -> FakeBackend:
    """The fake firewall a running agent published (empty when it has not applied anything yet)."""
    fb = FakeBackend(ipv6=ipv6)
    try:
        with open(path) as f:
            fb.rules = RuleSet.from_json(f.read())
    except FileNotFoundError:
        pass
    return fb
