"""The egress pre-shutdown hook: `GET /internal-egress-services-preshutdown`, a kubelet preStop hook.

Before an egress ProxyGroup Pod goes away, kube-proxy must stop sending new connections to it, or they die
with the Pod. For each egress service that has a health-check endpoint (a ClusterIP Service that load-balances
over the ProxyGroup's Pods, each of whose `/healthz` answers with a `Pod-IPv4`/`Pod-IPv6` header), the hook
asks that endpoint `hep-pings` times per round; while some answer comes from this Pod, the Pod is still routed,
so it waits a second and asks again. When no answer names this Pod, it waits a little longer for connections
already in flight and then returns 200, and kubelet stops the container.

Differences from upstream, on purpose:
* The hook reads the configured directory from the start; upstream reads `./egress-services` until startup
  completes (a data race; spec defect 7).
* An endpoint that cannot be reached counts as drained ("no healthy backends left"), which is what upstream's
  own log line says; upstream counts it as still routed and waits until kubelet gives up (spec defect 6).
* The wait is bounded (`max_wait`), so a hook never outlives any sensible grace period by much.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

import httpx

from tscommon.pgcontract import KEY_EGRESS_SERVICES, KEY_HEP_PINGS, ConfigError, parse_egress_services, parse_hep_pings

log = logging.getLogger("containerboot")


class PreShutdown:
    """Serves the hook for one config directory. `settle`: extra wait once drained (upstream's 10 s)."""

    def __init__(self, cfg_dir: str, pod_ipv4: str = "", pod_ipv6: str = "", *, settle: float = 10.0,
                 interval: float = 1.0, max_wait: float = 300.0, timeout: float = 3.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep):
        self.cfg_dir = cfg_dir
        self.pod_ipv4, self.pod_ipv6 = pod_ipv4, pod_ipv6
        self.settle, self.interval, self.max_wait, self.timeout = settle, interval, max_wait, timeout
        self._transport = transport
        self._sleep = sleep

    def _read(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.cfg_dir, name), encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return None

    async def run(self) -> tuple[int, str]:
        """(HTTP status, body) for one hook call."""
        try:
            cfg = parse_egress_services(await asyncio.to_thread(self._read, KEY_EGRESS_SERVICES))
            pings = parse_hep_pings(await asyncio.to_thread(self._read, KEY_HEP_PINGS))
        except (OSError, ConfigError) as e:
            log.error("egress pre-shutdown: cannot read the egress services config: %s", e)
            return 500, f"error reading egress services config: {e}\n"
        if not cfg.services:
            return 200, "safe to terminate"
        if self.pod_ipv4:
            pod_ip, header = self.pod_ipv4, "Pod-IPv4"
        elif self.pod_ipv6:
            pod_ip, header = self.pod_ipv6, "Pod-IPv6"
        else:
            log.warning("egress pre-shutdown: POD_IPS is not set, cannot tell whether this Pod is still routed")
            return 200, ""
        endpoints = sorted({s.health_check_endpoint for s in cfg.services if s.health_check_endpoint})
        if endpoints and pings > 0:
            log.info("egress pre-shutdown: waiting until %d health check endpoint(s) no longer route to %s",
                     len(endpoints), pod_ip)
            deadline = time.monotonic() + self.max_wait
            async with httpx.AsyncClient(transport=self._transport, timeout=self.timeout) as client:
                await asyncio.gather(*(self._drain(client, url, pings, pod_ip, header, deadline)
                                       for url in endpoints))
        log.info("egress pre-shutdown: waiting %gs for connections in flight", self.settle)
        await self._sleep(self.settle)
        return 200, ""

    async def _drain(self, client: httpx.AsyncClient, url: str, pings: int, pod_ip: str, header: str,
                     deadline: float) -> None:
        while True:
            if not await self._routed(client, url, pings, pod_ip, header):
                log.info("egress pre-shutdown: %s no longer routes to this Pod", url)
                return
            if time.monotonic() >= deadline:
                log.warning("egress pre-shutdown: %s still routes to this Pod after %gs; giving up the wait",
                            url, self.max_wait)
                return
            await self._sleep(self.interval)

    async def _routed(self, client: httpx.AsyncClient, url: str, pings: int, pod_ip: str, header: str) -> bool:
        for _ in range(pings):
            try:
                resp = await client.get(url, headers={"Connection": "close"})
            except httpx.HTTPError as e:
                # No answer is not an answer from this Pod: most likely the Service has no healthy backends left.
                log.info("egress pre-shutdown: %s unreachable (%s), likely because there are no (more) healthy "
                         "backends", url, type(e).__name__)
                continue
            if resp.headers.get(header, "").strip().lower() == pod_ip.lower():
                return True
        return False
