"""The controller's passes behind one entry point: a queue key in, seconds until the next check out.

`Reconciler` builds the one `writer.Writer` (the verbs every pass shares, with the one warned-once memory) and
the passes (controller/passes/), and sends each key to the pass its kind's row names (`kindtable.KINDS`): the
parents of single proxies, the ProxyGroups, the ProxyClasses, the DNSConfig and the Recorders. Every pass is
level-triggered: it starts from what is in the API server now, so a pass after a crash, a missed event or a
restart converges the same way, and a pass that finds everything as rendered sends no write at all.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Hashable

from .config import ControllerConfig
from .kindtable import CLASS, DNS, GROUP, KINDS, PARENT, RECORDER
from .kindtable import handled as handled
from .kindtable import proxy_target as proxy_target
from .kubeapi import KubeClient
from .passes.dnsconfig import DNSConfigPass
from .passes.egress import EgressPass
from .passes.parents import PENDING_RECHECK as PENDING_RECHECK
from .passes.parents import POD_SECURITY_RECHECK as POD_SECURITY_RECHECK
from .passes.parents import READY_RECHECK as READY_RECHECK
from .passes.parents import REASON_POD_SECURITY as REASON_POD_SECURITY
from .passes.parents import TLS_RECHECK as TLS_RECHECK
from .passes.parents import ParentPass
from .passes.proxyclass import ProxyClassPass
from .passes.proxygroup import ProxyGroupPass
from .passes.recorder import RecorderPass
from .providers import Provider
from .replicaprober import ReplicaProber
from .writer import Writer, now_utc


class Reconciler:
    def __init__(self, kube: KubeClient, provider: Provider, cfg: ControllerConfig, *,
                 now: Callable[[], str] = now_utc, clock: Callable[[], float] = time.monotonic,
                 prober: ReplicaProber | None = None) -> None:
        self.writer = Writer(kube, provider, cfg, now=now, clock=clock)
        # the leader's health probes of the ProxyGroup replicas, shared by the groups' and the egress pass
        self.groups = ProxyGroupPass(self.writer, prober)
        self.egress = EgressPass(self.writer, prober)
        self.groups.lock = self.egress.lock     # a group's slices and its egress Services' removal, one at a time
        self.parents = ParentPass(self.writer, self.egress)
        self.classes = ProxyClassPass(self.writer)
        self.dns = DNSConfigPass(self.writer)
        self.recorders = RecorderPass(self.writer)
        self.passes: dict[str, Callable[[str, str, str], Awaitable[float | None]]] = {
            PARENT: self.parents.run, GROUP: self.groups.run, CLASS: self.classes.run, DNS: self.dns.run,
            RECORDER: self.recorders.run}

    @property
    def kube(self) -> KubeClient:
        return self.writer.kube

    @property
    def cfg(self) -> ControllerConfig:
        return self.writer.cfg

    @cfg.setter
    def cfg(self, cfg: ControllerConfig) -> None:
        self.writer.cfg = cfg

    @property
    def poke(self) -> Callable[[Hashable], None]:
        """Queues another pass of a key (the work queue's poke): a ProxyClass's pass wakes the parents using it,
        a ProxyGroup's pass the user Services it serves."""
        return self.classes.poke

    @poke.setter
    def poke(self, poke: Callable[[Hashable], None]) -> None:
        self.classes.poke = poke
        self.groups.poke = poke

    async def reconcile(self, kind: str, namespace: str, name: str) -> float | None:
        """One pass; returns seconds until the next check (None: wait for an event). Raises on API or control
        plane errors (the caller retries with backoff)."""
        return await self.passes[KINDS[kind].runs](kind, namespace, name)
