"""The login's state machine fed with notification sequences, as tailscaled and the `tailscale up` CLI produce
them: what the agent does, and in which order (the boot figures depend on it)."""
from __future__ import annotations

from typing import Any

import pytest

from containerboot import login
from containerboot.login import (
    ArmTimer,
    Done,
    Fail,
    InstallRules,
    Log,
    LoginConfig,
    Notified,
    Reissue,
    ShowState,
    StartFirewall,
    StartUp,
    StreamEnded,
    TimedOut,
    TimerFired,
    UpExited,
)
from containerboot.state import apply_notify

STATE = {"NoState": 0, "NeedsLogin": 2, "NeedsMachineAuth": 3, "Stopped": 4, "Starting": 5, "Running": 6}
SELF = {"ID": 1, "StableID": "nStable1", "Name": "proxy.tailnet.test.", "Addresses": ["100.64.0.5/32"]}


def state(name: str) -> dict[str, Any]:
    return {"State": STATE[name]}


def netmap(**extra: Any) -> dict[str, Any]:
    return {"SelfChange": SELF, **extra}


class Login:
    """Feeds events the way the agent's loop does (folding each notification first) and keeps the actions."""

    def __init__(self, **config: Any) -> None:
        self.st, first = login.start(LoginConfig(boot_timeout=120, **config))
        self.actions: list[Any] = list(first)

    def feed(self, ev: Any) -> tuple[Any, ...]:
        self.st, acts = login.step(self.st, ev)
        self.actions += acts
        return acts

    def notify(self, n: dict[str, Any]) -> tuple[Any, ...]:
        return self.feed(Notified(n, apply_notify(self.st.node, n, 1.0)))

    def kinds(self, acts: tuple[Any, ...] | None = None) -> list[str]:
        return [type(a).__name__ for a in (self.actions if acts is None else acts)]


def test_a_fresh_login_runs_up_at_needslogin_and_ends_at_running_after_up_exits():
    m = Login()
    assert m.actions == []                     # TS_AUTH_ONCE: `tailscale up` only when the backend asks for it
    assert m.kinds(m.notify(state("NeedsLogin"))) == ["ShowState", "StartUp"]
    assert m.st.up == login.UP_RUNNING
    assert m.kinds(m.notify({"LoginFinished": {}})) == ["StartFirewall"]      # control answered: detect now
    acts = m.notify({**state("Starting")})
    assert m.kinds(acts) == ["StartFirewall", "ShowState", "Log"]
    acts = m.notify(netmap())                   # the node's addresses: rules if Running does not follow soon
    assert m.kinds(acts) == ["StartFirewall", "ArmTimer"] and acts[1] == ArmTimer(login.EARLY_RULES_DELAY)
    assert not m.st.wants_read, "between Starting and up's exit, with the timer running, the bus is not read"
    # up exits as it sees Running; the loop then reads Running from the socket
    assert m.feed(UpExited()) == ()
    assert m.st.wants_read
    acts = m.notify(state("Running"))
    assert m.kinds(acts) == ["StartFirewall", "ShowState", "Done"]
    assert isinstance(acts[-1], Done) and acts[-1].node.tailnet_ips and m.st.ran_up
    assert m.feed(TimerFired()) == () and m.feed(StreamEnded()) == (), "the login is over"


def test_running_before_up_exits_installs_the_rules_beside_the_cli_and_ends_at_its_exit():
    m = Login(always_auth=True)
    assert m.kinds() == ["StartUp"]              # TS_AUTH_ONCE unset: `tailscale up` at once, beside the watch
    m.notify(state("Starting"))
    m.notify(netmap())
    m.feed(TimerFired())                         # Running is slow: the rules go in with the login's view
    assert isinstance(m.actions[-1], InstallRules) and m.actions[-1].wait
    acts = m.notify(state("Running"))
    assert m.kinds(acts) == ["StartFirewall", "ShowState", "InstallRules"]
    assert isinstance(acts[-1], InstallRules) and not acts[-1].wait    # beside up's exit, awaited at the end
    assert m.notify(state("Running")) == (StartFirewall(), ShowState("Running", m.st.node)), "asked for once"
    acts = m.feed(UpExited())
    assert m.kinds(acts) == ["Done"] and m.st.ran_up


def test_a_quick_running_puts_the_rules_in_at_running_not_at_the_timer():
    m = Login(always_auth=True)
    m.notify(state("Starting"))
    m.notify(netmap())
    m.feed(UpExited())
    done = m.notify(state("Running"))
    assert m.kinds(done)[-1] == "Done"
    assert not [a for a in m.actions if isinstance(a, InstallRules)]


def test_the_timer_after_running_installs_nothing():
    m = Login(always_auth=True)
    m.notify(state("Starting"))
    m.notify(netmap())
    m.notify(state("Running"))                  # up still running: rules beside its exit
    assert m.feed(TimerFired()) == ()


def test_a_node_logged_in_already_starts_the_firewall_at_its_first_notification():
    m = Login()
    acts = m.notify({"InitialStatus": {"BackendState": "Running", "Self": {"ID": "n1", "NodeID": 1, "TailscaleIPs":
                                                                         ["100.64.0.5"]}}})
    assert m.kinds(acts) == ["StartFirewall", "ShowState", "Done"] and not m.st.ran_up


def test_a_rejected_key_in_one_step_mode_with_a_secret_asks_the_operator_for_a_new_one():
    m = Login(one_step=True, reissue=True)
    acts = m.notify({"Health": {"Warnings": {"login-state": {"Text": "auth key expired"}}}})
    assert acts == (Reissue(login.NEEDS_REISSUE_HEALTH),)
    m = Login(one_step=True, reissue=True)
    acts = m.notify(state("NeedsLogin"))
    assert acts[-1] == Reissue(login.NEEDS_REISSUE_STATE) and StartUp() not in acts


def test_a_rejected_key_in_one_step_mode_without_a_secret_fails_with_upstreams_words():
    m = Login(one_step=True)
    m.notify({"Health": {"Warnings": {"login-state": {}}}})     # nobody to ask: wait for the state
    acts = m.notify(state("NeedsLogin"))
    assert acts[-1] == Fail(login.ONE_STEP_NOT_LOGGED_IN)
    assert "ensure you pass a valid auth key in the config file" in login.ONE_STEP_NOT_LOGGED_IN


def test_a_failing_tailscale_up_ends_the_login_with_its_reason():
    m = Login(always_auth=True)
    m.notify(state("NeedsLogin"))
    assert m.feed(UpExited("failed to auth tailscale: invalid key")) == (
        Fail("failed to auth tailscale: invalid key"),)
    assert m.st.finished


@pytest.mark.parametrize("up_running", (True, False))
def test_the_boot_timeout_names_what_was_still_missing(up_running):
    m = Login(always_auth=up_running)
    m.notify(state("NeedsMachineAuth"))
    assert m.actions[-1] == Log("machine authorization required, please visit the admin panel")
    (fail,) = m.feed(TimedOut())
    assert isinstance(fail, Fail)
    if up_running:
        assert fail.message.startswith("tailscale up did not finish within TS_BOOT_TIMEOUT (120s)")
    else:
        assert fail.message == ("tailscaled did not reach the Running state within TS_BOOT_TIMEOUT (120s); "
                                "last state 'NeedsMachineAuth'")


def test_the_stream_ending_fails_the_login():
    m = Login()
    assert m.feed(StreamEnded()) == (Fail(login.STREAM_ENDED),)


def test_the_netmap_of_a_notification_that_also_says_running_is_not_an_early_one():
    m = Login(always_auth=True)
    m.notify(state("Starting"))
    acts = m.notify({**netmap(), **state("Running")})
    assert "ArmTimer" not in m.kinds(acts) and m.kinds(acts)[-1] == "InstallRules"

