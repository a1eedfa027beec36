"""The agent's firewall: detected in the background during the login, warmed up, reported, removed at shutdown.

Detecting the firewall mode probes the kernel (tens of milliseconds of CPU, firewall tools run); rules are
needed only once the node has addresses, so the detection starts in the idle second of the login (once control
has answered), not while tailscaled starts up and sends the login request, which it would slow down on a small
node. The test hook's in-memory firewall (TS_TEST_FAKE_NETFILTER) stands in for a kernel one without any
detection, in either networking mode, as upstream's does.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from netfilter.backend import Backend
from netfilter.model import RuleSet

from .errors import AgentError
from .settings import Settings

log = logging.getLogger("containerboot")


class FirewallSetup:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        #: The configuration has rules (an L3 proxy with a kernel firewall, or the test hook's).
        self.wanted = settings.is_l3_proxy and (not settings.userspace or settings.test_fake_netfilter)
        self.backend: Backend | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> "asyncio.Task[None] | None":
        """Start the detection (once), in the background; the task ends when `backend` is set (its exception
        is an AgentError). None when the configuration has no rules."""
        if self.wanted and self._task is None:
            self._task = asyncio.create_task(self._open())
        return self._task

    async def _open(self) -> None:
        if self.s.test_fake_netfilter:
            # No detection: it runs iptables and probes netlink, which the hook promises never to touch.
            from netfilter.fake import FakeBackend, state_path
            self.backend = FakeBackend(ipv6=self.s.test_fake_netfilter_6, state_file=state_path(self.s.socket))
            log.info("Using the in-memory firewall of TS_TEST_FAKE_NETFILTER (IPv6 %s); the real firewall is "
                     "not touched", "supported" if self.s.test_fake_netfilter_6 else "not supported")
            return
        from netfilter.backend import open_backend
        try:
            self.backend = await asyncio.to_thread(open_backend, self.s.firewall_mode)
        except Exception as e:
            raise AgentError(f"error creating the netfilter runner: {e}") from None
        log.info("Using %s for the agent's firewall rules", self.backend.name)
        # Still the idle second of the login: the first apply, at Running, then costs a warm one's time.
        try:
            await asyncio.to_thread(self.backend.warm_up)
        except Exception as e:   # only a warm-up: the apply reports real failures
            log.debug("firewall warm-up failed: %s", e)

    def status(self, applied: RuleSet | None) -> dict[str, Any] | None:
        """For /status: the backend and the last rule set applied to it (reading the kernel back on every request
        would cost too much)."""
        fw = self.backend
        if fw is None:
            return None
        return {"backend": fw.name, "ipv6": fw.ipv6, "rules": applied.to_dict() if applied is not None else None}

    async def close(self, applied: RuleSet | None = None) -> None:
        """At shutdown: let an unfinished detection end (so the clean-up sees the backend it may have touched),
        then remove the agent's rules, then the conntrack entries of the connections `applied` (the rules last
        in force) translated: tailscaled is gone, so those can only blackhole (netfilter.conntrack)."""
        if self._task is not None and not self._task.done():
            try:
                await self._task
            except Exception:
                pass
        if self.backend is None:
            return
        try:
            await asyncio.to_thread(self.backend.cleanup)
            log.info("Removed the agent's firewall rules")
        except Exception as e:
            log.error("failed to remove the agent's firewall rules: %s", e)
            return      # the rules still translate: a flushed entry would only be created again
        if applied is not None and applied.entries() and self.backend.translates_connections:
            from netfilter.conntrack import flush_translated_conntrack
            await asyncio.to_thread(flush_translated_conntrack, applied)
