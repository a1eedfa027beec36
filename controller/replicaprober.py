"""The controller's health probes of ProxyGroup replicas over the Pod network (thin I/O around
`controller.replicahealth`, which decides).

The group's pass tells the prober which replicas are candidates (`track`: Running, Ready, not terminating, with
the readiness probe the controller gives them, whose `/healthz` it asks too) and asks which of them serve
(`serving`). The prober keeps `CONNECTIONS` keep-alive HTTP/1.1 connections to each replica's health endpoint,
each asking `/healthz` every `INTERVAL` seconds, staggered; a 200 answer on any of them is the replica heard.
Every `TICK` seconds it applies the rule, and when a group's serving set changes it calls `on_change(group)`
(the controller queues a pass of the group, which writes the EndpointSlices). Only the leader runs it.

An exchange without an answer for `STALE` seconds, or a connection that fails, is made again after
`INTERVAL`; an answer that is not HTTP/1.1 is not heard. A refusal, an HTTP answer other than 200 or a connection
refused by the replica's address (ECONNREFUSED: a reset or an ICMP port unreachable, nothing listens there), is
given to the rule as it comes, which takes the replica out at once; any other failure (a timeout, no route to
the host, a connection closed by the server) is only the absence of an answer. Six requests a second per replica: the
agent's endpoint server and this client each spend under 60 µs of CPU on one (measured together on one
keep-alive connection), about 1 s of CPU an hour per replica on either side.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from . import replicahealth as rh

__all__ = ["CONNECTIONS", "INTERVAL", "ReplicaProber", "Target", "target_of"]

log = logging.getLogger("controller")

CONNECTIONS = 6
INTERVAL = 1.0
TICK = 0.25
STALE = 10.0
_MAX_HEADER = 16 * 1024


@dataclass(frozen=True)
class Target:
    """One replica's health endpoint: its Pod (by name and IP, so a new Pod of the same name is a new target)."""

    pod: str
    ip: str
    port: int
    path: str = "/healthz"


def target_of(pod: dict) -> Target | None:
    """The health endpoint the kubelet probes for this Pod's first container (its readinessProbe's httpGet on
    the Pod's IP), or None when it has none (a class that moved the agent's local address): not probed."""
    containers = (pod.get("spec") or {}).get("containers") or []
    ips = [a["ip"] for a in ((pod.get("status") or {}).get("podIPs") or []) if a.get("ip")]
    if not containers or not ips:
        return None
    get = ((containers[0].get("readinessProbe") or {}).get("httpGet") or {})
    port = get.get("port")
    if not isinstance(port, int) or get.get("host") or (get.get("scheme") or "HTTP") != "HTTP":
        return None
    return Target(pod["metadata"]["name"], ips[0], port, str(get.get("path") or "/healthz"))


Opener = Callable[[str, int], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class ReplicaProber:
    def __init__(self, on_change: Callable[[str], None], *, rule: rh.HealthRule = rh.HealthRule(),
                 clock: Callable[[], float] = time.monotonic, connections: int = CONNECTIONS,
                 interval: float = INTERVAL, tick: float = TICK, stale: float = STALE,
                 open_connection: Opener | None = None) -> None:
        self.on_change, self.rule, self.clock = on_change, rule, clock
        self.connections, self.interval, self.tick_every, self.stale = connections, interval, tick, stale
        self._open: Opener = open_connection or (lambda host, port: asyncio.open_connection(host, port))
        self._groups: dict[str, frozenset[Target]] = {}
        self._states: dict[Target, rh.Health] = {}
        self._tasks: dict[Target, list[asyncio.Task]] = {}
        self._serving: dict[str, frozenset[Target]] = {}
        #: the clock's reading when the rule was last applied to every target (None before the first tick):
        #: a verdict that has not come by a tick after its deadline will not come (the tests wait on it)
        self.last_tick_at: float | None = None

    # ---- what the group's pass calls

    def track(self, group: str, targets: Iterable[Target]) -> None:
        """The group's candidates now: new ones are probed (serving until the rule says otherwise), the rest
        forgotten."""
        now = self.clock()
        new = frozenset(targets)
        old = self._groups.get(group, frozenset())
        if new:
            self._groups[group] = new
        else:
            self._groups.pop(group, None)
        still = set().union(*self._groups.values()) if self._groups else set()
        for t in old - new:
            if t not in still:
                self._forget(t)
        for t in new - old:
            if t not in self._states:
                self._states[t] = rh.track(now)
                self._tasks[t] = [asyncio.ensure_future(self._ask(t, i * self.interval / self.connections))
                                  for i in range(self.connections)]
        self._serving[group] = rh.serving(self._states, new)

    def serving(self, candidates: Iterable[Target]) -> frozenset[Target]:
        """Which of one group's candidates serve (the rule's verdicts; one not tracked serves)."""
        return rh.serving(self._states, candidates)

    # ---- the loop

    async def run(self) -> None:
        """Apply the rule every `TICK` seconds until cancelled (then every connection is closed)."""
        try:
            while True:
                await asyncio.sleep(self.tick_every)
                now = self.clock()
                for t, h in list(self._states.items()):
                    self._states[t] = rh.tick(self.rule, h, now)
                self._report()
                self.last_tick_at = now
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        for t in list(self._tasks):
            self._forget(t)
        self._groups.clear()

    def _forget(self, t: Target) -> None:
        for task in self._tasks.pop(t, []):
            task.cancel()
        self._states.pop(t, None)

    def _report(self) -> None:
        for group, targets in list(self._groups.items()):
            now = rh.serving(self._states, targets)
            before = self._serving.get(group)
            if now != before:
                self._serving[group] = now
                if before is not None:
                    for t in sorted(before - now, key=lambda t: t.pod):
                        h = self._states.get(t)
                        why = (f"has not answered its health check for {self.rule.down_after:.0f}s"
                               if h is None or self.clock() - h.last_heard >= self.rule.down_after
                               else "refused its health check")
                        log.warning("ProxyGroup %s: replica %s (%s) %s; it leaves the egress EndpointSlices until "
                                    "it answers again", group, t.pod, t.ip, why)
                    for t in sorted(now - before, key=lambda t: t.pod):
                        log.info("ProxyGroup %s: replica %s (%s) answers its health check again", group, t.pod, t.ip)
                self.on_change(group)

    def _heard(self, t: Target, ok: bool = True) -> None:
        """An answer from the replica: 200 (`ok`) or a refusal."""
        h = self._states.get(t)
        if h is None:
            return
        nxt = (rh.heard if ok else rh.refused)(self.rule, h, self.clock())
        self._states[t] = nxt
        if nxt.serving != h.serving:
            self._report()

    async def _ask(self, t: Target, offset: float) -> None:
        """One connection's loop: ask, wait for the answer, ask again `interval` after the last question."""
        await asyncio.sleep(offset)
        request = (f"GET {t.path} HTTP/1.1\r\nHost: {_host(t)}\r\nUser-Agent: tailscale-controller\r\n"
                   "Accept: */*\r\n\r\n").encode()
        while True:
            writer = None
            try:
                reader, writer = await asyncio.wait_for(self._open(t.ip, t.port), self.stale)
                while True:
                    asked = self.clock()
                    writer.write(request)
                    status, keep = await asyncio.wait_for(_answer(reader), self.stale)
                    self._heard(t, status == 200)
                    if not keep:
                        break
                    await asyncio.sleep(max(0.0, asked + self.interval - self.clock()))
            except ConnectionRefusedError:
                self._heard(t, False)
            except (OSError, EOFError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                    asyncio.LimitOverrunError):
                pass
            finally:
                if writer is not None:
                    writer.close()
            await asyncio.sleep(self.interval)


def _host(t: Target) -> str:
    return f"[{t.ip}]:{t.port}" if ":" in t.ip else f"{t.ip}:{t.port}"


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Read one HTTP/1.1 response: (status, whether the connection stays open). Raises ValueError on anything
    else."""
    head = await reader.readuntil(b"\r\n\r\n")
    if len(head) > _MAX_HEADER:
        raise ValueError("response header too large")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or parts[0] != "HTTP/1.1" or not parts[1].isdigit():
        raise ValueError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    length = int(headers.get("content-length", "-1"))
    if length < 0:
        return int(parts[1]), False    # no length: the body runs to the end of the connection
    await reader.readexactly(length)
    return int(parts[1]), headers.get("connection", "").lower() != "close"
