"""The agent's lifecycle: boot, log in, run the steady state, shut down cleanly. This module orchestrates.

The parts it holds together: the host checks and HTTP endpoints (`boot`), the firewall detection
(`firewallsetup`), the state Secret's publishing policy (`publish`: one object, a null one without a Secret),
the login (`login`, a pure state machine, driven by `loginloop`), the steady state's task set (`steady`) and the
auth key reissue (`reissue`). Every phase races against the shutdown signal, so a SIGTERM at any point leads to
the same orderly shutdown: stop tailscaled (SIGTERM, then SIGKILL after the budget), remove the agent's rules,
close the HTTP endpoints. Fatal errors go through the same path and exit 1.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from tscommon.redact import redact, register

from . import boot
from . import tailscaled as ts
from .desired import Desired
from .errors import AgentError
from .firewallsetup import FirewallSetup
from .localapi import FIRST_WATCH_MASK, LOGIN_WATCH_MASK, LocalAPI, LocalAPIError
from .login import LoginConfig
from .loginloop import LoginResult, NeedsReissue, close_watch, fold_notify, run_login
from .publish import NullPublisher
from .reconcile import Reconciler
from .settings import Settings
from .state import NodeState

if TYPE_CHECKING:
    from .endpoints import EndpointServer
    from .status import AgentStatus
    from .steady import SteadyState

__all__ = ["Agent", "AgentError", "SHUTDOWN_BUDGET"]

log = logging.getLogger("containerboot")

#: Time allowed for the whole shutdown; Kubernetes' default grace period is 30 s.
SHUTDOWN_BUDGET = 25.0

T = TypeVar("T")


class _Stopped(Exception):
    """Shutdown was requested while a phase was running."""


class Agent:
    """One run of the agent: `run()` boots, logs in, runs the steady state and shuts down; `status()` is what the
    probes report meanwhile. It is also the login's hooks (`loginloop.LoginHooks`)."""

    def __init__(self, settings: Settings, env: Mapping[str, str], *, early: Any = None):
        self.s = settings
        self._early = early   # __main__.EarlyStart: tailscaled already started, before the imports
        self.env = dict(env)
        self.child_env = ts.child_env(settings, env)
        self.tailscaled: ts.Tailscaled | None = None
        self.api: LocalAPI | None = None
        self.firewall = FirewallSetup(settings)
        self.publisher: NullPublisher = NullPublisher()
        self.reconciler: Reconciler | None = None
        self.steady: SteadyState | None = None
        self.endpoints: EndpointServer | None = None
        self.startup_complete = asyncio.Event()
        self.started_at = time.time()
        self._stop = asyncio.Event()
        self._stop_signal: int | None = None
        self._boot_started = time.monotonic()
        self._boot_state = "NoState"
        self._stopping = False
        self._linked = False
        self._forwarding_ensured = False
        self._config_authkey = ""
        self._config_loaded: str | None = None    # one-step mode: the config text tailscaled has in force
        self._login: LoginResult | None = None
        self._login_watch: tuple = ()              # the login's bus watch, closed after start-up
        self._login_watch_closing: asyncio.Future | None = None
        self._trimmed_at_applies = 0              # rule applies seen at the last malloc_trim
        for secret in (settings.authkey, settings.client_secret, settings.id_token):
            register(secret)

    # -- entry point -----------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        if self._early is not None:
            # Ours from now on: whatever happens next, the shutdown path stops it.
            self.tailscaled = ts.Tailscaled.adopt(self._early.popen, self.s.socket)
            if self._early.pending_signal:
                self._on_signal(self._early.pending_signal)
        self._boot_started = time.monotonic()
        code = 0
        try:
            self._forwarding_ensured = boot.prepare(self.s)
            await self._until_stop(self._kube_setup())
            await self._until_stop(self._start_tailscaled())
            try:
                await self._until_stop(self._run_login())
            except NeedsReissue as e:
                # Outside the boot timeout: the operator may take minutes to issue a key.
                from .reissue import reissue
                assert self.publisher.secret is not None and self.api is not None
                await self._until_stop(reissue(str(e), secret=self.publisher.secret, api=self.api,
                                               config_path=self.s.tailscaled_config_path,
                                               old_key=self._config_authkey))
                raise _Stopped() from None
            await self._steady_state()
        except _Stopped:
            code = 0
        except AgentError as e:
            log.error("%s", redact(str(e)))
            code = 1
        except Exception as e:  # a bug: report it plainly and still shut down in order
            log.exception("unexpected error: %s", redact(repr(e)))
            code = 1
        finally:
            await self.shutdown()
        return code

    def _on_signal(self, signum: int) -> None:
        if self._stop_signal is None:
            log.info("Received %s, shutting down", signal.Signals(signum).name)
            self._stop_signal = signum
        self._stop.set()

    async def _until_stop(self, aw: Awaitable[T]) -> T:
        """Run one phase; abandon it if shutdown is requested meanwhile."""
        if isinstance(aw, asyncio.Future) and aw.done():
            return aw.result()     # finished already: no turn of the loop (start-up waits on this path)
        task = asyncio.ensure_future(aw)
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:
            pass
        raise _Stopped()

    def _boot_deadline(self) -> float:
        return self._boot_started + self.s.boot_timeout

    # -- boot ------------------------------------------------------------------------------------------
    async def _kube_setup(self) -> None:
        """RBAC, the auth key from the Secret, and the reset of the previous run's keys, before tailscaled."""
        from .publish import connect
        if self.s.one_step:
            from .conffile import authkey_from_config
            self._config_authkey = authkey_from_config(self.s.tailscaled_config_path)
            register(self._config_authkey)
        self.publisher, authkey = await connect(self.s, self.env, self._boot_deadline(),
                                                config_authkey=self._config_authkey)
        if authkey:
            from dataclasses import replace
            register(authkey)
            self.s = replace(self.s, authkey=authkey)

    async def _start_tailscaled(self) -> None:
        argv = ts.tailscaled_argv(self.s)
        if self.s.one_step:
            from tscommon.watch import read_text
            # What tailscaled is about to load: the config watcher compares against this, not against its own
            # first read, so that a rewrite landing between here and the watcher's start is not missed.
            self._config_loaded = await asyncio.to_thread(read_text, self.s.tailscaled_config_path)
        try:
            if self.tailscaled is None:   # not started early (see __main__)
                self.tailscaled = await ts.Tailscaled.start(argv, self.child_env, self.s.socket)
        except OSError as e:
            raise AgentError(f"failed to bring up tailscale: starting tailscaled failed: {e}") from None
        try:
            await self.tailscaled.wait_ready(self._boot_deadline())
        except (ts.TailscaledExited, TimeoutError) as e:
            raise AgentError(f"failed to bring up tailscale: {e}") from None
        self.api = LocalAPI(self.s.socket)
        if ts.should_link_socket(self.s):
            self._linked = ts.link_socket(self.s.socket, ts.socket_link_path(self.s.root))
        self.endpoints = await boot.start_endpoints(self.s, self.status, self.api)
        if self.s.forwarding_optimizations:
            try:
                await self.api.set_udp_gro_forwarding()
            except LocalAPIError as e:
                log.warning("[unexpected] error enabling UDP GRO forwarding: %s", e)

    def status(self) -> "AgentStatus":
        """A snapshot of everything the probes, /status and /metrics report."""
        from .status import AgentStatus, ServeStatus

        rec = self.reconciler
        node = rec.node if rec is not None else NodeState(backend_state=self._boot_state)
        serve = self.steady.serve_status if self.steady is not None else None
        if serve is None and self.s.serve_config:
            # Configured but not applied once yet: that is "not ready", not "no serve config".
            serve = ServeStatus(applied=False, last_error="waiting for the first apply")
        done = rec.reconciled_node if rec is not None else None
        serve_counters = self.steady.serve_counters if self.steady is not None else {}
        steady = self.steady
        secret = self.publisher.secret
        # Once tailscaled has exited the node has no tailnet address: /healthz says so (503) at once, as
        # upstream's check fails at once (its process ends with tailscaled), while the shutdown removes the rules
        # (docs/proxygroup.md, "Failover on two nodes": the replica leaves the EndpointSlices meanwhile).
        gone = self.tailscaled is not None and not self.tailscaled.alive()
        return AgentStatus(
            backend_state=node.backend_state or self._boot_state,
            tailnet_ips=() if gone else tuple(str(ip) for ip in node.tailnet_ips),
            targets=rec.target_statuses() if rec is not None else (),
            serve=serve,
            netmap_seen_at=node.netmap_seen_at, health_warnings=node.health_warnings,
            started_at=self.started_at,
            last_reconcile_at=rec.last_reconcile_at if rec is not None else None,
            loop_heartbeat_at=rec.heartbeat if rec is not None else time.time(),
            counters={**(rec.counters() if rec is not None else {}), **serve_counters},
            startup_complete=self.startup_complete.is_set(),
            stopping=self._stopping,
            reconciled_ips=tuple(str(ip) for ip in done.tailnet_ips) if done is not None else None,
            firewall=self.firewall.status(rec.applied.rules if rec is not None else None),
            control_plane=steady.control_probe.state if steady is not None else None,
            kubernetes_api=steady.kube_probe.state if steady is not None and steady.kube_probe else None,
            secret_pending_writes=secret.pending if secret is not None else (),
            tls=(steady.tls_watcher.status() if steady is not None and steady.tls_watcher is not None
                 else {"serial": "", "last_error": "waiting for the first read"}
                 if self.s.tls_cert_secret or self.s.tls_cert_dir else None),
        )

    # -- login -----------------------------------------------------------------------------------------
    async def _run_login(self) -> None:
        """Bring the backend to Running within the boot timeout (the ordering is `login`'s). The watch asks
        tailscaled for as little as the rules need (`LOGIN_WATCH_MASK`): whatever it computes for a watcher
        delays its own switch to Running."""
        assert self.api is not None
        s = self.s
        config = LoginConfig(always_auth=s.always_auth, one_step=s.one_step,
                             reissue=s.one_step and self.publisher.manages_keys,
                             boot_timeout=s.boot_timeout)
        stream = self.api.watch_ipn_bus(FIRST_WATCH_MASK if self._login_needs_tailnet else LOGIN_WATCH_MASK)
        self._login = await run_login(config, stream, self, self._boot_deadline())
        # Logged in: the watch's connection is closed in the background once start-up is complete (closing it
        # takes a few milliseconds of the loop's time).
        self._login_watch = self._login.watch

    # The login's hooks (`loginloop.LoginHooks`).
    async def tailscale_up(self) -> None:
        try:
            await ts.run_cli(ts.tailscale_up_argv(self.s), self.child_env, self._boot_deadline())
        except asyncio.TimeoutError:
            from .login import up_timeout_message
            raise AgentError(up_timeout_message(self.s.boot_timeout)) from None
        except RuntimeError as e:
            raise AgentError(f"failed to auth tailscale: {e}") from None

    def start_firewall(self) -> None:
        self.firewall.start()

    def show_state(self, state: str, node: NodeState) -> None:
        self._boot_state = state
        if self.reconciler is not None:
            self.reconciler.set_node(node)   # /status shows the state; rules changed only by a netmap

    async def fold(self, node: NodeState, notify: dict[str, Any]) -> NodeState:
        return await fold_notify(self.api, node, notify, with_dns=self._login_needs_tailnet)

    async def install_rules(self, node: NodeState) -> None:
        """The node has its addresses: install the rules now, before the login is over (when Running does not
        follow the first netmap within EARLY_RULES_DELAY, and at Running while `tailscale up` exits).

        tailscaled spends the seconds between its first netmap and Running on its network check and the home
        DERP connection; the rules depend only on the addresses, so the data path is ready when Running comes
        and start-up completes right then. Nothing reaches the node's addresses before Running (peers learn
        its endpoints from that same check), and a login that fails afterwards ends in the normal shutdown,
        which removes the rules. "Startup complete" still waits for Running (`_on_converged`)."""
        if not node.tailnet_ips or not self._early_rules_allowed():
            return
        detection = self.firewall.start()
        assert detection is not None
        await asyncio.wait({detection})   # normally done already: it started with the login's answer
        if detection.exception() is not None:
            return          # reported by the steady state, in order
        if self.reconciler is None:
            self.reconciler = self._make_reconciler()
        elif node == self.reconciler.node:
            return
        self.reconciler.set_node(node)
        # Running may come at any moment now: the conntrack clean-up (a dump of tens of milliseconds) waits for
        # the pass that completes start-up and runs right after "Startup complete", as without early rules.
        await self.reconciler.reconcile_once(defer_cleanup=True)

    @property
    def _login_needs_tailnet(self) -> bool:
        """Whether the login's view of the node needs the rest of the tailnet: peers and tailscaled's DNS records
        (a tailnet FQDN target resolves through them). Otherwise the login watches only the node itself, and
        the steady-state watch (its initial status) brings the peers and DNS records after start-up."""
        return bool(self.s.tailnet_target_fqdn)

    def _early_rules_allowed(self) -> bool:
        """Whether the rules may go in before Running. Not with a state Secret (the device ID is written before
        any rule, and upstream writes it only once Running) nor with ProxyGroup services files (their first
        read is awaited before the first pass); those configurations install the rules after Running."""
        s = self.s
        return (self.publisher.secret is None and not s.egress_proxies_config_path
                and not s.ingress_proxies_config_path and self.firewall.wanted)

    def _make_reconciler(self) -> Reconciler:
        rules_file = os.path.join(os.path.dirname(self.s.socket) or ".", "containerboot-rules.json")
        rec = Reconciler(self.s, self.firewall.backend, rules_file=rules_file,
                         ensure_forwarding=None if self.s.userspace else boot.forwarding_ensurer(self.s),
                         on_converged=self._on_converged, before_rules=self._before_rules)
        rec.cleanup_in_child = True   # pyroute2's modules live only as long as the clean-up
        if self._forwarding_ensured:
            rec.applied.forwarding = self.s.forwarding_families    # by `boot.prepare`, before tailscaled started
        return rec

    # -- steady state ----------------------------------------------------------------------------------
    async def _steady_state(self) -> None:
        from .steady import SteadyState

        if self.s.auth_once_mode:    # the only mode with work after the login (a phase costs a turn of the loop)
            await self._until_stop(boot.after_login(self.s, self.child_env, self.publisher,
                                                    ran_up=self._login is not None and self._login.ran_up))
        if (detection := self.firewall.start()) is not None:
            await self._until_stop(detection)     # normally done since the login's answer
        if self.reconciler is None:
            self.reconciler = self._make_reconciler()
        login_node = self._login.node if self._login is not None else NodeState()
        if self._early_rules_allowed() and login_node.tailnet_ips:
            # The login's own view of the node (Running): with the rules already in (`install_rules`), this pass
            # only confirms them and completes start-up, without waiting for the steady-state watch's first
            # notification.
            self.reconciler.set_node(login_node)
            await self._until_stop(self.reconciler.reconcile_once())
        if self._login_watch:
            self._login_watch_closing = asyncio.ensure_future(close_watch(*self._login_watch))
            self._login_watch = ()
        assert self.api is not None
        self.steady = SteadyState(self.s, self.reconciler, self.api, publisher=self.publisher,
                                  tailscaled=self.tailscaled, stopping=self._stop, config_loaded=self._config_loaded)
        fatal = self.steady.start()
        stopper: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({fatal, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if fatal in done:
            raise AgentError(fatal.result())
        raise _Stopped()

    async def _before_rules(self, rec: Reconciler, want: Desired, node: NodeState) -> None:
        """The device ID goes to the Secret before any rule, so the operator can always clean the device up."""
        await self.publisher.device_id(node)

    async def _on_converged(self, rec: Reconciler, want: Desired, node: NodeState) -> None:
        routed = node.self_node is not None and bool(node.tailnet_ips) \
            and (rec.firewall is None or rec.ready_to_serve(want))
        await self.publisher.after_pass(node, routed=routed, services=want.services,
                                        services_in=rec.rules_installed_for(want),
                                        capver=(self.api.capver if self.api is not None else None) or 0)
        if rec.stats.rule_applies != self._trimmed_at_applies and self.startup_complete.is_set():
            # A rule change parsed the kernel's answers (netlink dumps, libnftables' cache): give the freed
            # memory back instead of keeping the peak for the agent's whole life.
            from . import memtrim
            self._trimmed_at_applies = rec.stats.rule_applies
            memtrim.trim()
        if self.startup_complete.is_set() or not routed or node.backend_state != "Running" or self._login is None:
            # Rules installed before the login is over (at the first netmap, or at Running while `tailscale up`
            # exits) do not complete start-up yet.
            return
        if not self.publisher.device_published():
            return
        self.startup_complete.set()
        log.info("Tailnet addresses: %s", ", ".join(map(str, node.tailnet_ips)))
        log.info("Startup complete, waiting for shutdown signal")
        from . import memtrim
        self._trimmed_at_applies = rec.stats.rule_applies
        memtrim.trim()     # the boot's peak (imports, login, first apply) is over

    # -- shutdown --------------------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """The orderly shutdown every run ends with (idempotent enough to be called once more by a test)."""
        self._stopping = True   # /readyz says no from here on: rules and tailscaled are about to go
        if self.steady is not None:
            await self.steady.close()
        if self._login_watch:     # stopped between the login and start-up
            await close_watch(*self._login_watch)
            self._login_watch = ()
        if self._login_watch_closing is not None:
            await self._login_watch_closing
        if self.tailscaled is not None:
            budget_end = time.monotonic() + SHUTDOWN_BUDGET
            if self.tailscaled.alive():
                await self.publisher.settle(budget_end - 5.0)
            await self.tailscaled.stop(max(5.0, budget_end - time.monotonic()))
            log.info("tailscaled exited")
        rec = self.reconciler
        await self.firewall.close(rec.applied.rules if rec is not None else None)
        if self.endpoints is not None:
            await self.endpoints.close()
        if self._linked:
            ts.unlink_socket(self.s.socket, ts.socket_link_path(self.s.root))
        if self.api is not None:
            await self.api.aclose()
        await self.publisher.aclose()
