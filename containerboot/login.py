"""The login as a pure state machine: bus notifications, the `tailscale up` CLI's exit and timers in, actions out.

`step(state, event)` returns the next state and the actions to take, in order; it does no I/O and reads no
clock. The agent's thin async loop (`containerboot.agent`) reads the IPN bus, runs the CLI and the timers, turns
what happens into events, and carries out the actions. So the ordering the boot figures depend on is written
down here once and unit-tested with notification sequences (tests/test_login.py):

- `tailscale up` runs beside the bus watch, not before it: at once with TS_AUTH_ONCE unset (`always_auth`),
  else when the backend says NeedsLogin.
- The firewall detection starts once control has answered (LoginFinished) or the node is logged in already:
  it then runs in the login's idle second instead of slowing down tailscaled's start.
- A netmap from control gives the node its addresses: the rules go in if Running does not follow within
  `EARLY_RULES_DELAY` (tailscaled's network check, seconds when slow). When Running comes while `tailscale up`
  is still running, the rules go in at once, beside the CLI's exit (`InstallRules(wait=False)`).
- Between Starting and `tailscale up`'s exit, while that timer runs, the bus is not read (`wants_read`): every
  notification read then costs this process CPU that tailscaled's switch to Running needs, and the CLI's exit
  is itself the signal that Running came.
- The login is over (`Done`) once the backend is Running and `tailscale up` (if it ran) has exited, as
  upstream's containerboot waits for the CLI.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Union

from .state import NodeState, carries_netmap, notify_backend_state

#: Rules before Running: how long after the first netmap the agent waits for Running before installing them
#: (a quick Running comes 10-40 ms after the netmap; a slow network check takes seconds).
EARLY_RULES_DELAY = 0.1

#: The CLI's states.
UP_NOT_RUN, UP_RUNNING, UP_DONE = "not run", "running", "done"


@dataclass(frozen=True)
class LoginConfig:
    """What of the agent's configuration the login's decisions depend on."""

    always_auth: bool = False      # run `tailscale up` at once (TS_AUTH_ONCE unset), not only at NeedsLogin
    one_step: bool = False         # tailscaled runs with a config file (TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR)
    reissue: bool = False          # one-step mode with a state Secret: a rejected key is reissued by the operator
    boot_timeout: float = 0.0      # TS_BOOT_TIMEOUT, for the timeout's message


# -- events --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Notified:
    """A bus notification, and the node state with it folded in (the loop folds: it may ask tailscaled)."""

    notify: Mapping[str, Any]
    node: NodeState


@dataclass(frozen=True)
class StreamEnded:
    """The bus stream ended."""


@dataclass(frozen=True)
class UpExited:
    """`tailscale up` exited; `error` is the failure's message ("" on success)."""

    error: str = ""


@dataclass(frozen=True)
class TimerFired:
    """`EARLY_RULES_DELAY` after the first netmap."""


@dataclass(frozen=True)
class TimedOut:
    """TS_BOOT_TIMEOUT passed."""


Event = Union[Notified, StreamEnded, UpExited, TimerFired, TimedOut]


# -- actions -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StartUp:
    """Run `tailscale up` beside the watch."""


@dataclass(frozen=True)
class StartFirewall:
    """Start the firewall detection in the background (a no-op once started, or when there are no rules)."""


@dataclass(frozen=True)
class ArmTimer:
    delay: float = EARLY_RULES_DELAY


@dataclass(frozen=True)
class InstallRules:
    """Install the rules for `node` before the login is over. `wait`: before the next event (the timer's case);
    else beside it (at Running while `tailscale up` exits), awaited before the login ends."""

    node: NodeState
    wait: bool


@dataclass(frozen=True)
class ShowState:
    """The backend state changed: /status shows it (the rules change only with a netmap)."""

    state: str
    node: NodeState


@dataclass(frozen=True)
class Log:
    message: str


@dataclass(frozen=True)
class Fail:
    """The boot failed: the agent logs the message and exits 1 after an orderly shutdown."""

    message: str


@dataclass(frozen=True)
class Reissue:
    """One-step mode with a state Secret: the auth key was rejected; ask the operator for a new one."""

    message: str


@dataclass(frozen=True)
class Done:
    """Logged in: Running, and `tailscale up` (if it ran) has exited successfully."""

    node: NodeState


Action = Union[StartUp, StartFirewall, ArmTimer, InstallRules, ShowState, Log, Fail, Reissue, Done]

TERMINAL = (Fail, Reissue, Done)


# -- state ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoginState:
    config: LoginConfig
    up: str = UP_NOT_RUN              # the `tailscale up` CLI: UP_NOT_RUN, UP_RUNNING, UP_DONE
    last_state: str = ""              # the last backend state a notification carried
    node: NodeState = field(default_factory=NodeState)
    timer_armed: bool = False
    early_wanted: bool = False        # a netmap came: the rules go in if Running is not there when the timer fires
    rules_at_running: bool = False    # InstallRules(wait=False) was asked for
    finished: bool = False            # a terminal action was returned: no further events

    @property
    def wants_read(self) -> bool:
        """Whether the loop should read the next notification now. Not between Starting and `tailscale up`'s
        exit while the early-rules timer runs: the notifications wait in the socket and are read after."""
        quiet = self.last_state == "Starting" and self.timer_armed and self.up == UP_RUNNING
        return not quiet and not self.finished

    @property
    def ran_up(self) -> bool:
        """`tailscale up` ran and exited successfully during this login."""
        return self.up == UP_DONE


def start(config: LoginConfig) -> tuple[LoginState, tuple[Action, ...]]:
    """The first state, and what to do before the first notification."""
    if config.always_auth:
        return LoginState(config, up=UP_RUNNING), (StartUp(),)
    return LoginState(config), ()


NEEDS_REISSUE_HEALTH = ("Auth key failed to authenticate (may be expired or single-use), disconnecting from "
                        "control and requesting new key from operator")
NEEDS_REISSUE_STATE = ("Auth key missing or invalid (NeedsLogin state), disconnecting from control and requesting "
                       "new key from operator")
ONE_STEP_NOT_LOGGED_IN = ("invalid state: tailscaled daemon started with a config file, but tailscale is not "
                          "logged in: ensure you pass a valid auth key in the config file")
STREAM_ENDED = "failed to read from tailscaled: the IPN bus stream ended"


def up_timeout_message(boot_timeout: float) -> str:
    return (f"tailscale up did not finish within TS_BOOT_TIMEOUT ({boot_timeout:g}s); check the auth key and that "
            "the control server is reachable")


def timeout_message(st: LoginState) -> str:
    """Why TS_BOOT_TIMEOUT passed: the CLI still running, or the backend not Running."""
    if st.up == UP_RUNNING:
        return up_timeout_message(st.config.boot_timeout)
    return (f"tailscaled did not reach the Running state within TS_BOOT_TIMEOUT ({st.config.boot_timeout:g}s); "
            f"last state {st.last_state or 'unknown'!r}")


def step(st: LoginState, ev: Event) -> tuple[LoginState, tuple[Action, ...]]:
    """The next state and the actions to take, in order. After a terminal action (Fail, Reissue, Done) the login
    is over and further events change nothing."""
    if st.finished:
        return st, ()
    if isinstance(ev, Notified):
        return _notified(st, ev)
    if isinstance(ev, UpExited):
        if ev.error:
            return _end(st, Fail(ev.error))
        st = replace(st, up=UP_DONE)
        if st.last_state == "Running":
            return _end(st, Done(st.node))
        return st, ()
    if isinstance(ev, TimerFired):
        acts: tuple[Action, ...] = ()
        if st.early_wanted and st.last_state != "Running":
            acts = (InstallRules(st.node, wait=True),)     # the login's latest view of the node
        return replace(st, timer_armed=False, early_wanted=False), acts
    if isinstance(ev, StreamEnded):
        return _end(st, Fail(STREAM_ENDED))
    if isinstance(ev, TimedOut):
        return _end(st, Fail(timeout_message(st)))
    raise TypeError(f"not a login event: {ev!r}")


def _end(st: LoginState, action: Action) -> tuple[LoginState, tuple[Action, ...]]:
    return replace(st, finished=True), (action,)


def _notified(st: LoginState, ev: Notified) -> tuple[LoginState, tuple[Action, ...]]:
    cfg, n, node = st.config, ev.notify, ev.node
    health = n.get("Health")
    if cfg.reissue and isinstance(health, Mapping) and "login-state" in (health.get("Warnings") or {}):
        return _end(st, Reissue(NEEDS_REISSUE_HEALTH))
    acts: list[Action] = []
    changes: dict[str, Any] = {"node": node}     # one new state per event (this runs at Running, on the boot path)
    state = notify_backend_state(n)
    # A netmap from control before Running: the node has its addresses (the state before this notification
    # decides whether it is the login's netmap, as a notification may carry both).
    early = state != "Running" and carries_netmap(n) \
        and bool(n.get("SelfChange") or (state or st.node.backend_state) == "Starting")
    logged_in = (state or node.backend_state) in ("Starting", "Running") or bool(node.tailnet_ips)
    if n.get("LoginFinished") is not None or logged_in:
        # Control has answered the login (headscale then takes about a second for the first netmap), or the
        # node was logged in already: nothing left for the detection to delay.
        acts.append(StartFirewall())
    if early:
        # Its rules go in if Running does not follow within EARLY_RULES_DELAY; when it does, the rules would only
        # compete with tailscaled's own switch to Running (measured: 10-25 ms slower), and go in at Running.
        changes["early_wanted"] = True
        if not st.timer_armed:
            changes["timer_armed"] = True
            acts.append(ArmTimer())
    if state is None:
        return replace(st, **changes), tuple(acts)
    changes["last_state"] = state
    acts.append(ShowState(state, node))
    end: Action | None = None
    if state == "Running":
        if st.up != UP_RUNNING:
            end = Done(node)
        elif not st.rules_at_running:
            # `tailscale up` exits as soon as it sees Running too, a few milliseconds from now (a process exit):
            # the rules go in meanwhile, and the login ends once it has exited.
            changes["rules_at_running"] = True
            acts.append(InstallRules(node, wait=False))
    elif state == "NeedsLogin":
        if cfg.reissue:
            end = Reissue(NEEDS_REISSUE_STATE)
        elif cfg.one_step:
            end = Fail(ONE_STEP_NOT_LOGGED_IN)
        elif st.up == UP_NOT_RUN:
            changes["up"] = UP_RUNNING
            acts.append(StartUp())
    elif state == "NeedsMachineAuth":
        acts.append(Log("machine authorization required, please visit the admin panel"))
    else:
        acts.append(Log(f"tailscaled in state {state!r}, waiting"))
    if end is not None:
        changes["finished"] = True
        acts.append(end)
    return replace(st, **changes), tuple(acts)
