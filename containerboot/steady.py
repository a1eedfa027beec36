"""The steady state's task set: everything that runs from the end of the login until shutdown.

One task per input (the IPN bus, tailscaled's exit, the serve config, the tailscaled config file, the ProxyGroup
services files, the DNS name) plus the reconcile loop and the reachability checks of the control server and the
state Secret's API server (`probes`). A task that ends with an error, and a condition that
ends the agent (tailscaled left Running, tailscaled exited), resolve one "fatal" future with the reason; the
agent races it against the shutdown signal.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .localapi import WATCH_MASK, LocalAPI, LocalAPIError
from .loginloop import fold_notify
from .publish import NullPublisher
from .reconcile import Reconciler
from .settings import Settings
from .state import NodeState, carries_netmap, notify_backend_state

if TYPE_CHECKING:
    from serveconfig.apply import ServeApplier, ServeLoop

    from . import tailscaled as ts
    from .probes import Probe
    from .reachability import Reachability
    from .status import ServeStatus

log = logging.getLogger("containerboot")

#: ProxyGroup: how long the first reconcile waits for the services files' first read (a local file: normally
#: milliseconds; the bound keeps a stuck mount from holding back the node's own rules).
INPUTS_FIRST_READ_WAIT = 10.0


class SteadyState:
    """The steady state's tasks, and what they report (the serve status and counters, for /status)."""

    def __init__(self, settings: Settings, reconciler: Reconciler, api: LocalAPI, *,
                 publisher: NullPublisher | None = None, tailscaled: "ts.Tailscaled | None" = None,
                 stopping: asyncio.Event | None = None, config_loaded: str | None = None) -> None:
        self.s = settings
        self.reconciler = reconciler
        self.api = api
        self.publisher = publisher if publisher is not None else NullPublisher()
        self.tailscaled = tailscaled
        self.stopping = stopping if stopping is not None else asyncio.Event()
        self.config_loaded = config_loaded     # one-step mode: the config text tailscaled has in force
        self.serve_status: "ServeStatus | None" = None
        self.serve_counters: dict[str, float] = {}
        self.serve_loop: "ServeLoop | None" = None
        self.serve_applier: "ServeApplier | None" = None
        self.tls_watcher: Any = None          # tlsterm.CertWatcher when TS_TLS_CERT_* is set
        self.self_node_known = asyncio.Event()   # the bus has delivered the node's own identity
        self.tasks: list[asyncio.Task] = []
        self.control_probe, self.kube_probe = self._make_probes()

    def _make_probes(self) -> "tuple[Probe, Probe | None]":
        from .probes import Probe, control_check
        from .reachability import public_url
        from .settings import CAPABILITY_VERSION

        control = Probe("control server", control_check(lambda: self.api.prefs(), CAPABILITY_VERSION))
        secret = self.publisher.secret
        if secret is None:
            return control, None
        client = secret.client
        target = public_url(client.url)

        async def check() -> tuple[str, str]:
            error, answered = await client.readyz()
            secret.api_down = bool(error) and not answered
            return target, error

        def on_change(r: "Reachability") -> None:
            if r.reachable and secret.pending:
                self.reconciler.poke()     # the writes that waited for the API server, now

        kube = Probe("Kubernetes API server", check, on_change=on_change)

        def on_write(e: Any) -> None:
            # A write is a check too; a refusal (403, 422...) says the server answers, so it is only recorded.
            if e is None:
                kube.record("", target)
            elif e.status == 0 or e.status >= 500 or e.status == 429:
                kube.record(str(e), target)
            else:
                kube.note_error(str(e))
        secret.on_result = on_write
        return control, kube

    def start(self) -> "asyncio.Future[str]":
        """Start every task this configuration needs; the future resolves with the reason the agent must end."""
        s = self.s
        fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        first_reads = {which: asyncio.Event() for which, path in (("egress", s.egress_proxies_config_path),
                                                                   ("ingress", s.ingress_proxies_config_path))
                       if path}
        self.tasks = [
            asyncio.create_task(self.watch_bus(fatal), name="ipn-bus"),
            asyncio.create_task(self.run_reconciler(list(first_reads.values())), name="reconcile"),
        ]
        if self.tailscaled is not None:
            self.tasks.append(asyncio.create_task(self.watch_tailscaled(fatal), name="tailscaled-exit"))
        self.tasks.append(asyncio.create_task(self.control_probe.run(), name="control-probe"))
        if self.kube_probe is not None:
            self.tasks.append(asyncio.create_task(self.kube_probe.run(), name="kube-probe"))
        if s.serve_config:
            self.tasks.append(asyncio.create_task(self.run_serve(), name="serve-config"))
        if s.tls_cert_secret or s.tls_cert_dir:
            self.tasks.append(asyncio.create_task(self.run_tls(), name="tls"))
        if s.one_step:
            self.tasks.append(asyncio.create_task(self.watch_config_file(), name="tailscaled-config"))
        if s.egress_proxies_config_path:
            log.info("configuring egress proxy using configuration file at %s", s.egress_proxies_config_path)
            self.tasks.append(asyncio.create_task(self.watch_services("egress", first_reads["egress"]),
                                                  name="egress-services"))
        if s.ingress_proxies_config_path:
            log.info("configuring ingress proxy using configuration file at %s", s.ingress_proxies_config_path)
            self.tasks.append(asyncio.create_task(self.watch_services("ingress", first_reads["ingress"]),
                                                  name="ingress-services"))
        if s.dest_dns_name:
            from .dns import Resolver, watch_name
            self.tasks.append(asyncio.create_task(
                watch_name(s.dest_dns_name, Resolver(), self.reconciler.on_dns_answer, log=log), name="dns"))
        for t in self.tasks:
            t.add_done_callback(functools.partial(_propagate, fatal=fatal))
        return fatal

    async def close(self) -> None:
        """Unadvertise the serve config's services while tailscaled still runs, then end every task."""
        if self.serve_applier is not None and self.tailscaled is not None and self.tailscaled.alive():
            try:
                await asyncio.wait_for(self.serve_applier.unadvertise(), 5)
            except Exception as e:
                log.warning("Error ensuring services are not advertised: %s", e)
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            try:
                await t
            except BaseException:
                pass

    # -- the tasks ---------------------------------------------------------------------------------------------
    async def watch_bus(self, fatal: "asyncio.Future[str]") -> None:
        node = NodeState()
        try:
            async for n in self.api.watch_ipn_bus(WATCH_MASK):
                state = notify_backend_state(n)
                if state is not None and state != "Running":
                    # Upstream's design: a proxy that lost its login restarts, and Kubernetes restarts it.
                    _set(fatal, f"tailscaled left running state (now in state {state!r}), exiting")
                    return
                node = await fold_notify(self.api, node, n, with_dns=True)
                if carries_netmap(n) or state is not None:
                    self.reconciler.set_node(node)
                    if self.serve_loop is not None:
                        self.serve_loop.set_cert_domain(node.cert_domain)
                    if node.self_node is not None:
                        self.self_node_known.set()
        except LocalAPIError as e:
            reason = f"failed to read from tailscaled: {e}"
        else:
            reason = "failed to read from tailscaled: the IPN bus stream ended"
        # The stream usually breaks because tailscaled died; then its exit status is the better report.
        if self.tailscaled is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.tailscaled.proc.wait()), 2.0)
                return
            except asyncio.TimeoutError:
                pass
        _set(fatal, reason)

    async def run_reconciler(self, first_reads: list[asyncio.Event]) -> None:
        """Start the reconcile loop once every input file has been read once (bounded), so that the first pass,
        "Startup complete" and the Secret's device keys already account for the ProxyGroup services."""
        if first_reads:
            try:
                async with asyncio.timeout(INPUTS_FIRST_READ_WAIT):
                    for ev in first_reads:
                        await ev.wait()
            except TimeoutError:
                log.warning("the services config files were not read within %gs; starting without them, they "
                            "are applied as soon as they are read", INPUTS_FIRST_READ_WAIT)
        await self.reconciler.run()

    async def watch_tailscaled(self, fatal: "asyncio.Future[str]") -> None:
        assert self.tailscaled is not None
        rc = await self.tailscaled.proc.wait()
        if not self.stopping.is_set():
            _set(fatal, f"tailscaled exited unexpectedly with status {rc}")

    async def run_serve(self) -> None:
        """L7 ingress: keep tailscaled's serve config equal to the file (and the cert domain)."""
        from serveconfig.apply import CertManager, ServeApplier, ServeLoop

        # The cert domain comes with the self node; starting earlier would apply (and publish) "no-https".
        await self.self_node_known.wait()
        certs = CertManager(self.api, on_change=self._poke_serve, counters=self.serve_counters)
        self.serve_applier = ServeApplier(self.api, auto_advertise=self.s.service_auto_advertisement,
                                          cert_manager=certs, counters=self.serve_counters)
        log.info("serve proxy: unsetting previous config")
        self.serve_loop = ServeLoop(self.s.serve_config, self.serve_applier,
                                    cert_domain=self.reconciler.node.cert_domain, on_result=self._on_serve_result)
        try:
            await self.serve_loop.run()
        finally:
            await certs.close()

    async def run_tls(self) -> None:
        """HTTPS with the user's certificate: the TLS listener, once a good certificate is loaded (tlsterm)."""
        from .settings import parse_addr_port
        from .tlsterm import (
            CertSource,
            CertWatcher,
            FileSource,
            KubeSecretSource,
            Terminator,
            localapi_dialer,
            tcp_dialer,
        )
        s = self.s

        def own_ip() -> str:
            ips = self.reconciler.node.tailnet_ips
            ip = next((i for i in ips if i.version == 4), ips[0] if ips else None)
            return str(ip) if ip is not None else ""

        def names() -> tuple[str, ...]:
            me = self.reconciler.node.self_node
            own = (me.name.rstrip("."),) if me is not None and me.name else ()
            return own + tuple(h.strip() for h in s.tls_hosts.split(",") if h.strip())

        source: CertSource
        if s.tls_cert_secret:
            assert self.publisher.secret is not None      # settings: TS_TLS_CERT_SECRET needs the state Secret
            ns, _, name = s.tls_cert_secret.partition("/")
            source = KubeSecretSource(self.publisher.secret.client, ns, name)
        else:
            source = FileSource(s.tls_cert_dir)
        if s.tls_backend:
            bhost, bport = parse_addr_port(s.tls_backend)
            term = Terminator(tcp_dialer(str(bhost), bport))
        else:
            term = Terminator(localapi_dialer(s.socket, own_ip, int(s.tls_upstream_port)))
        watcher = CertWatcher(source, term, names)
        self.tls_watcher = watcher
        host, port = parse_addr_port(s.tls_listen)
        await self.self_node_known.wait()           # the names to check the certificate against
        while not await watcher.refresh():
            await asyncio.sleep(watcher.interval)
        await term.start(str(host), port)
        log.info("tls: listening on %s for the serve config's port 443", s.tls_listen)
        try:
            await watcher.run()
        finally:
            term.close()

    def _poke_serve(self) -> None:
        if self.serve_loop is not None:
            self.serve_loop.poke()

    async def _on_serve_result(self, res: Any) -> None:
        self.serve_status = res.status()
        if res.https_endpoint is not None:
            await self.publisher.https_endpoint(res.https_endpoint)

    async def watch_config_file(self) -> None:
        """One-step mode: when the operator rewrites the tailscaled config, have tailscaled reload it."""
        from tscommon.watch import watch_file

        async for text in watch_file(self.s.tailscaled_config_path, 5.0, label="tailscaled config watch"):
            if text is None or text == self.config_loaded:
                continue
            if not text.strip():
                # A writer that truncates before writing (not kubelet's atomic swap) shows an empty file for
                # a moment; reloading that would only fail. The full text comes with the next event.
                continue
            log.info("tailscaled config watch: ensuring that config is up to date")
            try:
                doc = await self.api.reload_config()
            except LocalAPIError as e:
                log.error("tailscaled config watch: reload failed: %s (the previous config stays in force)", e)
                continue
            if doc.get("Reloaded"):
                self.config_loaded = text
                log.info("tailscaled config watch: config was reloaded")
            else:
                log.error("tailscaled config watch: tailscaled did not reload its config: %s "
                          "(the previous config stays in force)", doc.get("Err") or "no reason given")

    async def watch_services(self, which: str, first_read: asyncio.Event | None = None) -> None:
        """Follow one ProxyGroup services file; a broken file is reported and the last good config stays.

        `first_read` is set once the file's first content (or its absence) has been handed to the reconciler."""
        from tscommon import pgcontract as pgc
        from tscommon.watch import watch_file

        from . import proxyservices as ps

        parse: Any
        if which == "egress":
            path = os.path.join(self.s.egress_proxies_config_path, pgc.KEY_EGRESS_SERVICES)
            parse = ps.parse_egress_services
        else:
            path, parse = self.s.ingress_proxies_config_path, ps.parse_ingress_config
        reported: tuple = ()
        async for text in watch_file(path, 5.0, label=f"{which} services"):
            rec = self.reconciler
            try:
                cfg = parse(text)
            except ps.ConfigError as e:
                log.error("%s services: %s; the last good configuration stays in force", which, e)
                rec.set_services(replace(rec.services, **{f"{which}_error": str(e)}))  # type: ignore[arg-type]
                if first_read is not None:
                    first_read.set()
                continue
            for _name, problem in cfg.problems:
                if problem not in reported:
                    log.error("%s; that service is skipped until its config is fixed", problem)
            reported = tuple(p for _n, p in cfg.problems)
            log.info("%s services: %d configured", which, len(cfg.services))
            rec.set_services(replace(rec.services, **{which: cfg, f"{which}_error": ""}))  # type: ignore[arg-type]
            if first_read is not None:
                first_read.set()


def _set(fut: "asyncio.Future[str]", msg: str) -> None:
    if not fut.done():
        fut.set_result(msg)


def _propagate(task: asyncio.Task, fatal: "asyncio.Future[str]") -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        _set(fatal, f"internal error in {task.get_name()}: {exc!r}")
