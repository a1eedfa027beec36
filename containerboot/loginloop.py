"""The thin async loop that drives the login's state machine (`containerboot.login`).

It owns the I/O only: one IPN bus watch for the whole login, `tailscale up` beside it, the early-rules timer and
the boot deadline. Each wake-up is turned into events in a fixed order (the timer, then the CLI's exit, then a
notification) and the machine's actions are carried out in the order given. The watch is not closed here when
the login succeeds: closing takes a few milliseconds of the loop's time, so the agent does it in the background
once start-up is complete (`LoginResult.watch`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from . import login
from .errors import AgentError
from .localapi import LocalAPIError
from .state import NodeState, apply_notify, with_dns_config

log = logging.getLogger("containerboot")


class NeedsReissue(Exception):
    """One-step mode: the config file's auth key was rejected; ask the operator for a new one."""


class LoginHooks(Protocol):
    """What the agent does for the login's actions."""

    async def tailscale_up(self) -> None:
        """Run `tailscale up`; raise AgentError with the reason when it fails or times out."""

    def start_firewall(self) -> None:
        """Start the firewall detection in the background (idempotent)."""

    async def install_rules(self, node: NodeState) -> None:
        """Install the rules for the node before the login is over (a no-op when not allowed)."""

    def show_state(self, state: str, node: NodeState) -> None:
        """The backend state changed (for /status)."""

    async def fold(self, node: NodeState, notify: dict[str, Any]) -> NodeState:
        """The notification folded into the node state."""


@dataclass(frozen=True)
class LoginResult:
    node: NodeState                    # the node as the login's watch last saw it (Running)
    ran_up: bool                       # `tailscale up` ran and exited successfully
    watch: tuple                       # (stream, pending read, CLI task): close with `close_watch`


async def fold_notify(api: Any, node: NodeState, n: dict[str, Any], *, with_dns: bool) -> NodeState:
    """One bus notification folded into the node state, and tailscaled's DNS config after a new netmap when the
    caller needs the tailnet's records (`with_dns`)."""
    node = apply_notify(node, n, time.time())
    if n.get("SelfChange") and with_dns:
        try:
            node = with_dns_config(node, await api.dns_config())
        except LocalAPIError as e:
            log.info("error refreshing DNS config from tailscaled: %s", e)
    return node


async def run_login(config: login.LoginConfig, stream: AsyncIterator[dict[str, Any]], hooks: LoginHooks,
                    deadline: float) -> LoginResult:
    """Drive the login to Running before `deadline` (time.monotonic()). Raises AgentError or NeedsReissue;
    on any exit other than success the watch and the CLI are closed."""
    st, first = login.start(config)
    up: asyncio.Future | None = None
    nxt: asyncio.Future | None = None
    timer: asyncio.Future | None = None
    beside: asyncio.Future | None = None      # rules installed at Running while `tailscale up` exits
    done: login.Done | None = None

    async def carry_out(actions: tuple[login.Action, ...]) -> None:
        nonlocal up, timer, beside, done
        for a in actions:
            if isinstance(a, login.StartUp):
                up = asyncio.ensure_future(hooks.tailscale_up())
            elif isinstance(a, login.StartFirewall):
                hooks.start_firewall()
            elif isinstance(a, login.ArmTimer):
                timer = asyncio.ensure_future(asyncio.sleep(a.delay))
            elif isinstance(a, login.InstallRules):
                if a.wait:
                    await hooks.install_rules(a.node)
                else:
                    beside = asyncio.ensure_future(hooks.install_rules(a.node))
            elif isinstance(a, login.ShowState):
                hooks.show_state(a.state, a.node)
            elif isinstance(a, login.Log):
                log.info("%s", a.message)
            elif isinstance(a, login.Fail):
                raise AgentError(a.message)
            elif isinstance(a, login.Reissue):
                raise NeedsReissue(a.message)
            elif isinstance(a, login.Done):
                done = a

    def feed(ev: login.Event) -> tuple[login.Action, ...]:
        nonlocal st
        st, actions = login.step(st, ev)
        return actions

    try:
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await carry_out(first)
                while done is None:
                    if nxt is None and st.wants_read:
                        nxt = asyncio.ensure_future(anext(stream))
                    waits: set[asyncio.Future] = set() if nxt is None else {nxt}
                    if up is not None and not up.done():
                        waits.add(up)
                    if timer is not None:
                        waits.add(timer)
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if timer is not None and timer.done():
                        timer = None
                        await carry_out(feed(login.TimerFired()))
                    if up is not None and up.done() and st.up == login.UP_RUNNING:
                        try:
                            up.result()
                            error = ""
                        except AgentError as e:
                            error = str(e)
                        await carry_out(feed(login.UpExited(error)))
                        if done is not None:
                            break
                    if nxt is None or not nxt.done():
                        continue
                    try:
                        n = nxt.result()
                    except StopAsyncIteration:
                        n = None
                    nxt = None
                    if n is None:
                        await carry_out(feed(login.StreamEnded()))
                        continue
                    node = await hooks.fold(st.node, n)
                    await carry_out(feed(login.Notified(n, node)))
                if beside is not None:
                    await beside
        except TimeoutError:
            raise AgentError(login.timeout_message(st)) from None
        except LocalAPIError as e:
            raise AgentError(f"failed to watch tailscaled for updates: {e}") from None
    except BaseException:
        await close_watch(stream, nxt, up, timer, beside)
        raise
    if timer is not None:
        timer.cancel()
    assert done is not None
    return LoginResult(node=done.node, ran_up=st.ran_up, watch=(stream, nxt, up))


async def close_watch(stream: Any, *pending: asyncio.Future | None) -> None:
    """End a bus watch and what ran beside it: cancel the pending read and a running `tailscale up` (run_cli
    kills it), then close the stream's connection. Never raises."""
    for fut in pending:
        if fut is not None and not fut.done():
            fut.cancel()
            try:
                await fut
            except BaseException:
                pass
    try:
        await stream.aclose()
    except BaseException:
        pass
