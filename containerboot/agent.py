"""The agent's lifecycle: boot, log in, run the steady-state loop, shut down cleanly.

This is the imperative shell around the pure modules. Every phase races against the shutdown signal, so a
SIGTERM at any point leads to the same orderly shutdown: stop tailscaled (SIGTERM, then SIGKILL after the
budget), remove the agent's rules, close the HTTP endpoints. Fatal errors go through the same path and exit 1.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, TypeVar

from . import tailscaled as ts
from .desired import Desired
from .localapi import FIRST_WATCH_MASK, LOGIN_WATCH_MASK, WATCH_MASK, LocalAPI, LocalAPIError
from .reconcile import Reconciler
from tscommon.redact import redact, register
from .settings import Settings
from .state import NodeState, apply_notify, carries_netmap, notify_backend_state, with_dns_config

if TYPE_CHECKING:
    from .status import AgentStatus

log = logging.getLogger("containerboot")

#: Time allowed for the whole shutdown; Kubernetes' default grace period is 30 s.
SHUTDOWN_BUDGET = 25.0

#: ProxyGroup: how long the first reconcile waits for the services files' first read (a local file: normally
#: milliseconds; the bound keeps a stuck mount from holding back the node's own rules).
INPUTS_FIRST_READ_WAIT = 10.0

#: Rules before Running: how long after the first netmap the agent waits for Running before installing them
#: (a quick Running comes 10-40 ms after the netmap; a slow network check takes seconds).
EARLY_RULES_DELAY = 0.1

#: Auth key reissue: how often the config file is re-read when no change event arrives (upstream's 5 s ticker).
REISSUE_POLL_INTERVAL = 5.0

T = TypeVar("T")


class AgentError(Exception):
    """A fatal error: logged once and the agent exits 1 after an orderly shutdown."""


class _Stopped(Exception):
    """Shutdown was requested while a phase was running."""


class _NeedsReissue(Exception):
    """One-step mode: the config file's auth key was rejected; ask the operator for a new one."""


class Agent:
    def __init__(self, settings: Settings, env: Mapping[str, str], *, early=None):
        self.s = settings
        self._early = early   # __main__.EarlyStart: tailscaled already started, before the imports
        self.env = dict(env)
        self.child_env = ts.child_env(settings, env)
        self.tailscaled: ts.Tailscaled | None = None
        self.api: LocalAPI | None = None
        self.firewall = None
        self.reconciler: Reconciler | None = None
        self.startup_complete = asyncio.Event()
        self._stop = asyncio.Event()
        self._stop_signal: int | None = None
        self._tasks: list[asyncio.Task] = []
        self._firewall_task: asyncio.Task | None = None
        self._firewall_wanted = False   # the configuration has rules; detection starts at `_start_firewall`
        self._linked = False
        self._did_up = False
        self._logged_in = False     # the login is over (Running, `tailscale up` exited): start-up may complete
        self._forwarding_ensured = False
        self._login_watch: tuple = ()  # the login's bus watch and what ran beside it, closed after start-up
        self.endpoints = None
        self.started_at = time.time()
        self._boot_state = "NoState"
        self.serve_status = None
        self.serve_loop = None
        self.serve_applier = None
        self._serve_counters: dict[str, float] = {}
        self.secret = None  # kubestate.SecretState when TS_KUBE_SECRET is set
        self.kube_store = False  # the agent manages the Secret's keys (patch allowed, in Kubernetes)
        self.config_authkey = ""
        self._config_loaded: str | None = None   # one-step mode: the config text tailscaled has in force
        self._stopping = False
        self._self_node_known = asyncio.Event()   # the bus has delivered the node's own identity
        self._login_node = NodeState()            # the node as the login's bus watch last saw it
        self._login_watch_closing: asyncio.Future | None = None
        self._trimmed_at_applies = 0              # rule applies seen at the last malloc_trim
        for secret in (settings.authkey, settings.client_secret, settings.id_token):
            register(secret)

    # -- helpers ---------------------------------------------------------------------------------------
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
            await self._prepare()
            await self._until_stop(self._kube_setup())
            await self._until_stop(self._start_tailscaled())
            try:
                await self._until_stop(self._login())
            except _NeedsReissue as e:
                # Outside the boot timeout: the operator may take minutes to issue a key.
                await self._until_stop(self._reissue(str(e)))
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
            await self._shutdown()
        return code

    # -- boot ------------------------------------------------------------------------------------------
    async def _prepare(self) -> None:
        """Everything that may fail on the host before any process is started."""
        s = self.s
        for notice in s.notices:
            log.info("%s", notice)
        for warning in ts.routing_warnings(s):
            log.warning("[warning] %s", warning)
        if not s.userspace:
            from .privileges import missing_net_admin, tun_hint
            if (problem := missing_net_admin(s.root)):
                raise AgentError(problem)
            try:
                ts.ensure_tun(s.root)
            except OSError as e:
                raise AgentError(tun_hint(e)) from None
            if any(s.forwarding_families):
                from netfilter.sysctl import ForwardingError, ensure_forwarding
                try:
                    ensure_forwarding(*s.forwarding_families, root=s.root)
                except ForwardingError as e:
                    raise AgentError(str(e)) from None
                self._forwarding_ensured = True     # the reconciler's first pass need not do it again
        if s.is_l3_proxy and (not s.userspace or s.test_fake_netfilter):
            # Detecting the firewall mode probes the kernel (tens of milliseconds of CPU, firewall tools run);
            # rules are needed only once the node has addresses, so it runs in the idle second of the login
            # (`_start_firewall`), not while tailscaled starts up and sends the login request, which it would
            # slow down on a small node. The test hook's in-memory firewall stands in for a kernel one in
            # either networking mode, as upstream's does.
            self._firewall_wanted = True

    async def _kube_setup(self) -> None:
        """RBAC, the auth key from the Secret, and the reset of the previous run's keys, before tailscaled."""
        s = self.s
        if s.one_step:
            from .conffile import authkey_from_config
            self.config_authkey = authkey_from_config(s.tailscaled_config_path)
            register(self.config_authkey)
        if not s.kube_secret:
            return
        from dataclasses import replace

        from .kube.client import KubeClient, KubeError
        from .kube.state import KubeSetupError, SecretState
        try:
            client = KubeClient.from_environment(self.env, root=s.root, url=s.kube_api_url)
        except KubeError as e:
            raise AgentError(f"error initializing kube client: {e}") from None
        self.secret = SecretState(client, s.kube_secret)
        try:
            setup = await self.secret.setup(s, self._boot_deadline(), config_authkey=self.config_authkey)
        except KubeSetupError as e:
            raise AgentError(str(e)) from None
        self.kube_store = setup.has_state_store
        if setup.authkey_from_secret:
            register(setup.authkey_from_secret)
            self.s = replace(self.s, authkey=setup.authkey_from_secret)

    def _start_firewall(self) -> None:
        """Start the firewall detection (once), in the background."""
        if self._firewall_wanted and self._firewall_task is None:
            self._firewall_task = asyncio.create_task(self._open_firewall())

    async def _open_firewall(self) -> None:
        if self.s.test_fake_netfilter:
            # No detection: it runs iptables and probes netlink, which the hook promises never to touch.
            from netfilter.fake import FakeBackend, state_path
            self.firewall = FakeBackend(ipv6=self.s.test_fake_netfilter_6, state_file=state_path(self.s.socket))
            log.info("Using the in-memory firewall of TS_TEST_FAKE_NETFILTER (IPv6 %s); the real firewall is "
                     "not touched", "supported" if self.s.test_fake_netfilter_6 else "not supported")
            return
        from netfilter.backend import open_backend
        try:
            self.firewall = await asyncio.to_thread(open_backend, self.s.firewall_mode)
        except Exception as e:
            raise AgentError(f"error creating the netfilter runner: {e}") from None
        log.info("Using %s for the agent's firewall rules", self.firewall.name)
        if (warm_up := getattr(self.firewall, "warm_up", None)) is not None:
            # Still the idle second of the login: the first apply, at Running, then costs a warm one's time.
            try:
                await asyncio.to_thread(warm_up)
            except Exception as e:   # noqa: BLE001 -- only a warm-up: the apply reports real failures
                log.debug("firewall warm-up failed: %s", e)

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
        await self._start_endpoints()
        if self.s.forwarding_optimizations:
            try:
                await self.api.set_udp_gro_forwarding()
            except LocalAPIError as e:
                log.warning("[unexpected] error enabling UDP GRO forwarding: %s", e)

    async def _start_endpoints(self) -> None:
        s = self.s
        if not (s.local_server_enabled or s.healthcheck_addr_port):
            return
        from .endpoints import EndpointServer

        api = self.api
        self.endpoints = EndpointServer(
            status_provider=self.status, metrics_source=api.usermetrics if api else None,
            enable_metrics=s.enable_metrics, enable_health=s.enable_health_check,
            pod_ipv4=s.pod_ipv4, pod_ipv6=s.pod_ipv6)
        if s.egress_proxies_config_path:
            from .egressdrain import PreShutdown
            from .endpoints import Response
            from .proxyservices import PRESHUTDOWN_PATH

            hook = PreShutdown(s.egress_proxies_config_path, str(s.pod_ipv4 or ""), str(s.pod_ipv6 or ""))

            async def preshutdown(method: str, target: str, headers) -> Response:
                if method not in ("GET", "HEAD"):
                    return Response(405, b"method not allowed\n", headers=(("Allow", "GET, HEAD"),))
                status, body = await hook.run()
                return Response(status, body.encode())

            self.endpoints.add_route(PRESHUTDOWN_PATH, preshutdown)
        try:
            if s.local_server_enabled:
                await self.endpoints.start(s.local_addr_port)
                if s.egress_proxies_config_path:
                    from .proxyservices import PRESHUTDOWN_PATH
                    log.info("Running egress preshutdown hook at %s%s", s.local_addr_port, PRESHUTDOWN_PATH)
            if s.healthcheck_addr_port:
                await self.endpoints.start(s.healthcheck_addr_port, healthz_only=True)
        except (OSError, ValueError) as e:
            raise AgentError(f"failed to start the HTTP endpoints: {e}; check TS_LOCAL_ADDR_PORT / "
                             "TS_HEALTHCHECK_ADDR_PORT (is the port in use?)") from None

    def status(self) -> "AgentStatus":
        """A snapshot of everything the probes, /status and /metrics report."""
        from .status import AgentStatus, ServeStatus

        rec = self.reconciler
        node = rec.node if rec is not None else NodeState(backend_state=self._boot_state)
        serve = self.serve_status
        if serve is None and self.s.serve_config:
            # Configured but not applied once yet: that is "not ready", not "no serve config".
            serve = ServeStatus(applied=False, last_error="waiting for the first apply")
        done = rec.reconciled_node if rec is not None else None
        return AgentStatus(
            backend_state=node.backend_state or self._boot_state,
            tailnet_ips=tuple(str(ip) for ip in node.tailnet_ips),
            targets=rec.target_statuses() if rec is not None else (),
            serve=serve,
            netmap_seen_at=node.netmap_seen_at,
            started_at=self.started_at,
            last_reconcile_at=rec.last_reconcile_at if rec is not None else None,
            loop_heartbeat_at=rec.heartbeat if rec is not None else time.time(),
            counters={**(rec.counters() if rec is not None else {}), **self._serve_counters},
            startup_complete=self.startup_complete.is_set(),
            stopping=self._stopping,
            reconciled_ips=tuple(str(ip) for ip in done.tailnet_ips) if done is not None else None,
            firewall=self._firewall_status(),
        )

    def _firewall_status(self) -> dict | None:
        fw = self.firewall
        if fw is None:
            return None
        # The in-memory firewall of the test hook holds its rules itself; a kernel one is described by the last
        # rule set applied to it (reading the kernel back on every /status request would cost too much).
        rules = getattr(fw, "rules", None)
        if rules is None and self.reconciler is not None:
            rules = self.reconciler.applied.rules
        return {"backend": fw.name, "ipv6": bool(getattr(fw, "ipv6", False)),
                "rules": rules.to_dict() if rules is not None else None}

    async def _tailscale_up(self) -> None:
        try:
            await ts.run_cli(ts.tailscale_up_argv(self.s), self.child_env, self._boot_deadline())
        except asyncio.TimeoutError:
            raise AgentError(f"tailscale up did not finish within TS_BOOT_TIMEOUT ({self.s.boot_timeout:g}s); "
                             "check the auth key and that the control server is reachable") from None
        except RuntimeError as e:
            raise AgentError(f"failed to auth tailscale: {e}") from None

    async def _login(self) -> None:
        """Bring the backend to Running within the boot timeout.

        One IPN bus watch for the whole login, and `tailscale up` (when needed) runs beside it rather than
        before it: the agent sees the node's addresses as soon as tailscaled has its first netmap, seconds
        before Running (tailscaled first waits for its network check and home DERP connection), and installs
        the data path's rules then (see `_early_rules`), or, when Running follows at once, at Running while
        `tailscale up` exits. Start-up still completes only once the backend is Running and `tailscale up` has
        exited successfully, as upstream's does. The watch asks tailscaled for as little as the rules need
        (`LOGIN_WATCH_MASK`): whatever it computes for a watcher delays its own switch to Running."""
        s = self.s
        assert self.api is not None
        up: asyncio.Task | None = None
        if s.always_auth:
            up = asyncio.ensure_future(self._tailscale_up())
        did_up = self._did_up = s.always_auth
        last_state = ""
        node = NodeState()
        remaining = self._boot_deadline() - time.monotonic()
        stream = self.api.watch_ipn_bus(FIRST_WATCH_MASK if self._login_needs_tailnet else LOGIN_WATCH_MASK)
        nxt: asyncio.Future | None = None
        early_wanted = False     # a netmap came: the rules go in if Running is not there soon
        early_timer: asyncio.Future | None = None
        running_rules: asyncio.Future | None = None   # rules installed at Running while `tailscale up` exits
        try:
            try:
                async with asyncio.timeout(max(0.0, remaining)):
                    while True:
                        # Between Starting and Running tailscaled configures its router, DNS and DERP connection,
                        # usually within 10-15 ms; every notification read then costs this process CPU that
                        # tailscaled's switch to Running needs (measured: reading them delayed Running by 1.5-3 ms
                        # on 2 cores). `tailscale up` exits as soon as it sees Running, so while it runs, and for at
                        # most EARLY_RULES_DELAY, the notifications wait in the socket and are read after.
                        quiet = last_state == "Starting" and early_timer is not None and up is not None \
                            and not up.done()
                        if nxt is None and not quiet:
                            nxt = asyncio.ensure_future(anext(stream))
                        waits = set() if nxt is None else {nxt}
                        if up is not None and not up.done():
                            waits.add(up)
                        if early_timer is not None:
                            waits.add(early_timer)
                        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                        if early_timer is not None and early_timer.done():
                            early_timer = None
                            if early_wanted and last_state != "Running":
                                await self._early_rules(node)   # the login's latest view of the node
                            early_wanted = False
                        if up is not None and up.done():
                            up.result()     # a failed `tailscale up` ends the boot at once (AgentError)
                            self._did_up = True
                            if last_state == "Running":
                                break
                        if nxt is None or not nxt.done():
                            continue
                        try:
                            n = nxt.result()
                        except StopAsyncIteration:
                            raise AgentError("failed to read from tailscaled: the IPN bus stream ended") from None
                        nxt = None
                        health = n.get("Health")
                        if s.one_step and self.kube_store and isinstance(health, dict) \
                                and "login-state" in (health.get("Warnings") or {}):
                            raise _NeedsReissue("Auth key failed to authenticate (may be expired or single-use), "
                                                "disconnecting from control and requesting new key from operator")
                        state = notify_backend_state(n)
                        early = state != "Running" and carries_netmap(n) \
                            and (n.get("SelfChange") or (state or node.backend_state) == "Starting")
                        node = await self._fold_notify(node, n)
                        logged_in = (state or node.backend_state) in ("Starting", "Running") or bool(node.tailnet_ips)
                        if n.get("LoginFinished") is not None or logged_in:
                            # Control has answered the login (headscale then takes about a second for the first
                            # netmap), or the node was logged in already: nothing left for the detection to delay.
                            self._start_firewall()
                        if early:
                            # A netmap from control: the node has its addresses. Its rules go in if Running does
                            # not follow within EARLY_RULES_DELAY (tailscaled's network check, seconds when
                            # slow); when it does, the rules would only compete with tailscaled's own switch to
                            # Running (its router and DNS configuration), which they were measured to slow down
                            # by 10-25 ms, and go in at Running instead.
                            early_wanted = True
                            if early_timer is None:
                                early_timer = asyncio.ensure_future(asyncio.sleep(EARLY_RULES_DELAY))
                        if state is None:
                            continue
                        last_state = self._boot_state = state
                        if self.reconciler is not None:
                            self.reconciler.set_node(node)   # /status shows the state; rules changed only by a netmap
                        if state == "Running":
                            if up is None or up.done():
                                if up is not None:
                                    up.result()
                                break
                            # `tailscale up` exits as soon as it sees Running too, a few milliseconds from now
                            # (a process exit): the rules go in meanwhile, start-up completes once it has exited.
                            if running_rules is None:
                                running_rules = asyncio.ensure_future(self._early_rules(node))
                            continue
                        if state == "NeedsLogin":
                            if s.one_step and self.kube_store:
                                raise _NeedsReissue("Auth key missing or invalid (NeedsLogin state), "
                                                    "disconnecting from control and requesting new key from "
                                                    "operator")
                            if s.one_step:
                                raise AgentError(
                                    "invalid state: tailscaled daemon started with a config file, but tailscale "
                                    "is not logged in: ensure you pass a valid auth key in the config file")
                            if not did_up:
                                did_up = True
                                up = asyncio.ensure_future(self._tailscale_up())
                        elif state == "NeedsMachineAuth":
                            log.info("machine authorization required, please visit the admin panel")
                        else:
                            log.info("tailscaled in state %r, waiting", state)
                    if running_rules is not None:
                        await running_rules
            except TimeoutError:
                if up is not None and not up.done():
                    raise AgentError(f"tailscale up did not finish within TS_BOOT_TIMEOUT ({s.boot_timeout:g}s); "
                                     "check the auth key and that the control server is reachable") from None
                raise AgentError(f"tailscaled did not reach the Running state within TS_BOOT_TIMEOUT "
                                 f"({s.boot_timeout:g}s); last state {last_state or 'unknown'!r}") from None
            except LocalAPIError as e:
                raise AgentError(f"failed to watch tailscaled for updates: {e}") from None
        except BaseException:
            await _close_watch(stream, nxt, up, early_timer, running_rules)
            raise
        if early_timer is not None:
            early_timer.cancel()
        # Logged in: the watch's connection is closed in the background once start-up is complete (closing it
        # takes a few milliseconds of the loop's time).
        self._login_watch = (stream, nxt, up)
        self._login_node = node
        self._logged_in = True

    async def _fold_notify(self, node: NodeState, n: dict) -> NodeState:
        """One bus notification folded into the node state (and tailscaled's DNS config after a new netmap)."""
        node = apply_notify(node, n, time.time())
        if n.get("SelfChange") and (self._logged_in or self._login_needs_tailnet):
            assert self.api is not None
            try:
                node = with_dns_config(node, await self.api.dns_config())
            except LocalAPIError as e:
                log.info("error refreshing DNS config from tailscaled: %s", e)
        return node

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
        return (self.secret is None and not s.egress_proxies_config_path and not s.ingress_proxies_config_path
                and self._firewall_wanted)

    def _make_reconciler(self) -> Reconciler:
        rules_file = os.path.join(os.path.dirname(self.s.socket) or ".", "containerboot-rules.json")
        rec = Reconciler(self.s, self.firewall, rules_file=rules_file,
                         ensure_forwarding=None if self.s.userspace else self._ensure_forwarding,
                         on_converged=self._on_converged, before_rules=self._before_rules)
        if self._forwarding_ensured:
            rec.applied.forwarding = self.s.forwarding_families    # by `_prepare`, before tailscaled started
        return rec

    async def _early_rules(self, node: NodeState) -> None:
        """The node has its addresses: install the rules now, before the login is over. Called when Running does
        not follow the first netmap within EARLY_RULES_DELAY, and at Running while `tailscale up` exits.

        tailscaled spends the seconds between its first netmap and Running on its network check and the home
        DERP connection; the rules depend only on the addresses, so the data path is ready when Running comes
        and start-up completes right then. Nothing reaches the node's addresses before Running (peers learn
        its endpoints from that same check), and a login that fails afterwards ends in the normal shutdown,
        which removes the rules. "Startup complete" still waits for Running (`_on_converged`)."""
        if not node.tailnet_ips or not self._early_rules_allowed():
            return
        self._start_firewall()
        assert self._firewall_task is not None
        await asyncio.wait({self._firewall_task})   # normally done already: it started with the login's answer
        if self._firewall_task.exception() is not None:
            return          # reported by the steady state, in order
        if self.reconciler is None:
            self.reconciler = self._make_reconciler()
        elif node == self.reconciler.node:
            return
        self.reconciler.set_node(node)
        # Running may come at any moment now: the conntrack clean-up (a dump of tens of milliseconds) waits for
        # the pass that completes start-up and runs right after "Startup complete", as without early rules.
        await self.reconciler.reconcile_once(defer_cleanup=True)

    async def _reissue(self, reason: str) -> None:
        """Ask the operator for a new auth key and wait for it; the agent then exits 0 to restart with it."""
        from .conffile import authkey_from_config
        from .kube.setup import reissue_flow

        assert self.secret is not None and self.api is not None
        log.info("%s", reason)
        # The operator writes the new key into the mounted Secret: kubelet swaps the directory's `..data` link.
        # A watch on the directory notices within milliseconds; the poll stays as the fallback.
        from tscommon.watch import DirWatch

        directory = os.path.dirname(os.path.abspath(self.s.tailscaled_config_path))
        changed: asyncio.Event | None = asyncio.Event()
        watch: DirWatch | None = DirWatch(directory, asyncio.get_running_loop(), changed)
        try:
            await asyncio.to_thread(watch.start)
            log.info("Config directory %s (kubelet's ..data swap included): auth key reissue: watching for "
                     "config changes via fsnotify", directory)
        except Exception as e:   # noqa: BLE001 -- no inotify instance left, watchdog unusable, ...
            await asyncio.to_thread(watch.stop)
            watch = changed = None
            log.warning("auth key reissue: cannot watch %s for config changes (%s), using polling every %gs",
                        directory, e, REISSUE_POLL_INTERVAL)
        try:
            await reissue_flow(self.secret.client, self.secret.name, self.config_authkey,
                               lambda: authkey_from_config(self.s.tailscaled_config_path),
                               disconnect=self.api.disconnect_control, changed=changed,
                               poll_interval=REISSUE_POLL_INTERVAL)
        except TimeoutError as e:
            raise AgentError(f"failed to get a reissued authkey: {e}") from None
        except Exception as e:
            raise AgentError(f"failed to get a reissued authkey: {e}") from None
        finally:
            if watch is not None:
                await asyncio.to_thread(watch.stop)
        log.info("Successfully received new auth key, restarting to apply configuration")

    async def _watch_config_file(self) -> None:
        """One-step mode: when the operator rewrites the tailscaled config, have tailscaled reload it."""
        from tscommon.watch import watch_file

        assert self.api is not None
        async for text in watch_file(self.s.tailscaled_config_path, 5.0, label="tailscaled config watch"):
            if text is None or text == self._config_loaded:
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
                self._config_loaded = text
                log.info("tailscaled config watch: config was reloaded")
            else:
                log.error("tailscaled config watch: tailscaled did not reload its config: %s "
                          "(the previous config stays in force)", doc.get("Err") or "no reason given")

    async def _watch_services(self, which: str, first_read: asyncio.Event | None = None) -> None:
        """Follow one ProxyGroup services file; a broken file is reported and the last good config stays.

        `first_read` is set once the file's first content (or its absence) has been handed to the reconciler."""
        from dataclasses import replace

        from tscommon.watch import watch_file

        from . import proxyservices as ps

        assert self.reconciler is not None
        if which == "egress":
            path, parse = os.path.join(self.s.egress_proxies_config_path, ps.EGRESS_FILE), ps.parse_egress_services
        else:
            path, parse = self.s.ingress_proxies_config_path, ps.parse_ingress_config
        reported: tuple = ()
        async for text in watch_file(path, 5.0, label=f"{which} services"):
            rec = self.reconciler
            try:
                cfg = parse(text)
            except ps.ConfigError as e:
                log.error("%s services: %s; the last good configuration stays in force", which, e)
                rec.set_services(replace(rec.services, **{f"{which}_error": str(e)}))
                if first_read is not None:
                    first_read.set()
                continue
            for _name, problem in cfg.problems:
                if problem not in reported:
                    log.error("%s; that service is skipped until its config is fixed", problem)
            reported = tuple(p for _n, p in cfg.problems)
            log.info("%s services: %d configured", which, len(cfg.services))
            rec.set_services(replace(rec.services, **{which: cfg, f"{which}_error": ""}))
            if first_read is not None:
                first_read.set()

    async def _run_reconciler(self, first_reads: list[asyncio.Event]) -> None:
        """Start the reconcile loop once every input file has been read once (bounded), so that the first pass,
        "Startup complete" and the Secret's device keys already account for the ProxyGroup services."""
        assert self.reconciler is not None
        if first_reads:
            try:
                async with asyncio.timeout(INPUTS_FIRST_READ_WAIT):
                    for ev in first_reads:
                        await ev.wait()
            except TimeoutError:
                log.warning("the services config files were not read within %gs; starting without them, they "
                            "are applied as soon as they are read", INPUTS_FIRST_READ_WAIT)
        await self.reconciler.run()

    async def _after_login(self) -> None:
        if self.s.auth_once_mode:
            argv, skipped = ts.tailscale_set_argv(self.s)
            if skipped and not self._did_up:
                log.info("TS_EXTRA_ARGS flags %s apply only to the first `tailscale up` and were not re-applied",
                         " ".join(skipped))
            try:
                await ts.run_cli(argv, self.child_env, None)
            except RuntimeError as e:
                raise AgentError(f"failed to auth tailscale: tailscale set failed: {e}") from None
        if self.s.auth_once_mode and self.kube_store and self.secret is not None:
            from .kube.state import KubeSetupError
            try:
                await self.secret.delete_authkey(time.monotonic() + 30)
            except KubeSetupError as e:
                raise AgentError(str(e)) from None

    # -- steady state ----------------------------------------------------------------------------------
    async def _steady_state(self) -> None:
        if self.s.auth_once_mode:    # the only mode with work after the login (a phase costs a turn of the loop)
            await self._until_stop(self._after_login())
        self._start_firewall()
        if self._firewall_task is not None:
            await self._until_stop(self._firewall_task)     # normally done since the login's answer
        if self.reconciler is None:
            self.reconciler = self._make_reconciler()
        if self._early_rules_allowed() and self._login_node.tailnet_ips:
            # The login's own view of the node (Running): with the rules already in (`_early_rules`), this pass
            # only confirms them and completes start-up, without waiting for the steady-state watch's first
            # notification.
            self.reconciler.set_node(self._login_node)
            await self._until_stop(self.reconciler.reconcile_once())
        if self._login_watch:
            self._login_watch_closing = asyncio.ensure_future(_close_watch(*self._login_watch))
            self._login_watch = ()
        fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        first_reads = {which: asyncio.Event() for which, path in (("egress", self.s.egress_proxies_config_path),
                                                                   ("ingress", self.s.ingress_proxies_config_path))
                       if path}
        self._tasks = [
            asyncio.create_task(self._watch_bus(fatal), name="ipn-bus"),
            asyncio.create_task(self._run_reconciler(list(first_reads.values())), name="reconcile"),
            asyncio.create_task(self._watch_tailscaled(fatal), name="tailscaled-exit"),
        ]
        if self.s.serve_config:
            self._tasks.append(asyncio.create_task(self._start_serve(), name="serve-config"))
        if self.s.one_step:
            self._tasks.append(asyncio.create_task(self._watch_config_file(), name="tailscaled-config"))
        if self.s.egress_proxies_config_path:
            log.info("configuring egress proxy using configuration file at %s", self.s.egress_proxies_config_path)
            self._tasks.append(asyncio.create_task(self._watch_services("egress", first_reads["egress"]),
                                                   name="egress-services"))
        if self.s.ingress_proxies_config_path:
            log.info("configuring ingress proxy using configuration file at %s", self.s.ingress_proxies_config_path)
            self._tasks.append(asyncio.create_task(self._watch_services("ingress", first_reads["ingress"]),
                                                   name="ingress-services"))
        if self.s.dest_dns_name:
            from .dns import Resolver, watch_name
            self._tasks.append(asyncio.create_task(
                watch_name(self.s.dest_dns_name, Resolver(), self.reconciler.on_dns_answer, log=log),
                name="dns"))
        for t in self._tasks:
            t.add_done_callback(lambda t, f=fatal: _propagate(t, f))
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({fatal, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if fatal in done:
            raise AgentError(fatal.result())
        raise _Stopped()

    def _ensure_forwarding(self, v4: bool, v6: bool) -> None:
        from netfilter.sysctl import ensure_forwarding
        ensure_forwarding(v4, v6, root=self.s.root)

    async def _watch_bus(self, fatal: asyncio.Future) -> None:
        assert self.api is not None and self.reconciler is not None
        node = NodeState()
        try:
            async for n in self.api.watch_ipn_bus(WATCH_MASK):
                state = notify_backend_state(n)
                if state is not None and state != "Running":
                    # Upstream's design: a proxy that lost its login restarts, and Kubernetes restarts it.
                    _set(fatal, f"tailscaled left running state (now in state {state!r}), exiting")
                    return
                node = await self._fold_notify(node, n)
                if carries_netmap(n) or state is not None:
                    self.reconciler.set_node(node)
                    if self.serve_loop is not None:
                        self.serve_loop.set_cert_domain(node.cert_domain)
                    if node.self_node is not None:
                        self._self_node_known.set()
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

    async def _start_serve(self) -> None:
        """L7 ingress: keep tailscaled's serve config equal to the file (and the cert domain)."""
        from serveconfig.apply import CertManager, ServeApplier, ServeLoop

        assert self.api is not None and self.reconciler is not None
        # The cert domain comes with the self node; starting earlier would apply (and publish) "no-https".
        await self._self_node_known.wait()
        certs = CertManager(self.api, on_change=lambda: self.serve_loop and self.serve_loop.poke(),
                            counters=self._serve_counters)
        self.serve_applier = ServeApplier(self.api, auto_advertise=self.s.service_auto_advertisement,
                                          cert_manager=certs, counters=self._serve_counters)
        log.info("serve proxy: unsetting previous config")
        self.serve_loop = ServeLoop(self.s.serve_config, self.serve_applier,
                                    cert_domain=self.reconciler.node.cert_domain, on_result=self._on_serve_result)
        try:
            await self.serve_loop.run()
        finally:
            await certs.close()

    async def _on_serve_result(self, res) -> None:
        self.serve_status = res.status()
        if self.kube_store and self.secret is not None and res.https_endpoint is not None:
            from .kube import secretstate as ss
            await self.secret.sync(ss.https_endpoint_patch(res.https_endpoint))

    async def _watch_tailscaled(self, fatal: asyncio.Future) -> None:
        assert self.tailscaled is not None
        rc = await self.tailscaled.proc.wait()
        if not self._stop.is_set():
            _set(fatal, f"tailscaled exited unexpectedly with status {rc}")

    async def _before_rules(self, rec: Reconciler, want: Desired, node: NodeState) -> None:
        """The device ID goes to the Secret before any rule, so the operator can always clean the device up."""
        me = node.self_node
        if self.kube_store and self.secret is not None and me is not None and me.stable_id:
            from .kube import secretstate as ss
            # A login that got this far worked: the reissue rate limit starts over.
            await self.secret.sync({**ss.device_id_patch(me), **ss.reissue_reset_patch()})

    async def _on_converged(self, rec: Reconciler, want: Desired, node: NodeState) -> None:
        me = node.self_node
        routed = me is not None and bool(node.tailnet_ips) and (self.firewall is None or rec.ready_to_serve(want))
        if self.kube_store and self.secret is not None and routed:
            from .kube import secretstate as ss
            # FQDN and IPs only once traffic can flow: the operator reads them as "this proxy works".
            want_keys = {**ss.device_endpoints_patch(me.name, me.ips)}
            if self.api is not None and self.api.capver:
                want_keys[ss.KEY_CAPVER] = str(self.api.capver).encode()
            await self.secret.sync(want_keys)
        svc = want.services
        if self.kube_store and self.secret is not None and svc is not None and rec.rules_installed_for(want):
            from .kube import secretstate as ss
            # Per-service records only once their rules are in: the operator routes a service to this Pod
            # when the record matches what it asked for.
            status = {}
            if svc.egress_status is not None:
                status[ss.KEY_EGRESS_SERVICES] = svc.egress_status
            if svc.ingress_status is not None:
                status[ss.KEY_INGRESS_CONFIG] = svc.ingress_status
            await self.secret.sync(status)
        if rec.stats.rule_applies != self._trimmed_at_applies and self.startup_complete.is_set():
            # A rule change parsed the kernel's answers (netlink dumps, libnftables' cache): give the freed
            # memory back instead of keeping the peak for the agent's whole life.
            from . import memtrim
            self._trimmed_at_applies = rec.stats.rule_applies
            memtrim.trim()
        if self.startup_complete.is_set() or not routed or node.backend_state != "Running" or not self._logged_in:
            # Rules installed before the login is over (`_early_rules`: at the first netmap, or at Running while
            # `tailscale up` exits) do not complete start-up yet.
            return
        if self.kube_store and self.secret is not None and not self.secret.has_written("device_id", "device_fqdn"):
            return
        self.startup_complete.set()
        ips = ", ".join(map(str, node.tailnet_ips))
        log.info("Tailnet addresses: %s", ips)
        log.info("Startup complete, waiting for shutdown signal")
        from . import memtrim
        self._trimmed_at_applies = rec.stats.rule_applies
        memtrim.trim()     # the boot's peak (imports, login, first apply) is over

    # -- shutdown --------------------------------------------------------------------------------------
    async def _shutdown(self) -> None:
        self._stopping = True   # /readyz says no from here on: rules and tailscaled are about to go
        if self._firewall_task is not None and not self._firewall_task.done():
            try:  # let an unfinished detection end, so that cleanup sees the backend it may have touched
                await self._firewall_task
            except Exception:
                pass
        if self.serve_applier is not None and self.tailscaled is not None and self.tailscaled.alive():
            try:
                await asyncio.wait_for(self.serve_applier.unadvertise(), 5)
            except Exception as e:
                log.warning("Error ensuring services are not advertised: %s", e)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except BaseException:
                pass
        if self._login_watch:     # stopped between the login and start-up
            await _close_watch(*self._login_watch)
            self._login_watch = ()
        if self._login_watch_closing is not None:
            await self._login_watch_closing
        if self.tailscaled is not None:
            budget_end = time.monotonic() + SHUTDOWN_BUDGET
            if self.kube_store and self.secret is not None and self.tailscaled.alive():
                await self.secret.wait_consistent(budget_end - 5.0)
            await self.tailscaled.stop(max(5.0, budget_end - time.monotonic()))
            log.info("tailscaled exited")
        if self.firewall is not None:
            try:
                await asyncio.to_thread(self.firewall.cleanup)
                log.info("Removed the agent's firewall rules")
            except Exception as e:
                log.error("failed to remove the agent's firewall rules: %s", e)
        if self.endpoints is not None:
            await self.endpoints.close()
        if self._linked:
            ts.unlink_socket(self.s.socket, ts.socket_link_path(self.s.root))
        if self.api is not None:
            await self.api.aclose()
        if self.secret is not None:
            await self.secret.client.aclose()


async def _close_watch(stream, *pending: asyncio.Future | None) -> None:
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


def _set(fut: asyncio.Future, msg: str) -> None:
    if not fut.done():
        fut.set_result(msg)


def _propagate(task: asyncio.Task, fatal: asyncio.Future) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        _set(fatal, f"internal error in {task.get_name()}: {exc!r}")

