"""Boot steps that do not depend on the login: the host checks before any process starts, and the HTTP
endpoints (health, metrics, /status, the egress pre-shutdown hook) once tailscaled answers."""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from . import tailscaled as ts
from .errors import AgentError
from .settings import Settings

if TYPE_CHECKING:
    from .endpoints import EndpointServer
    from .localapi import LocalAPI
    from .publish import NullPublisher
    from .status import AgentStatus

log = logging.getLogger("containerboot")


def prepare(s: Settings) -> bool:
    """Everything that may fail on the host before any process is started. Returns whether IP forwarding was
    ensured (the reconciler's first pass need not do it again)."""
    for notice in s.notices:
        log.info("%s", notice)
    for warning in ts.routing_warnings(s):
        log.warning("[warning] %s", warning)
    if s.userspace:
        return False
    from .privileges import missing_net_admin, tun_hint
    if (problem := missing_net_admin(s.root)):
        raise AgentError(problem)
    try:
        ts.ensure_tun(s.root)
    except OSError as e:
        raise AgentError(tun_hint(e)) from None
    if not any(s.forwarding_families):
        return False
    from netfilter.sysctl import ForwardingError, ensure_forwarding
    try:
        ensure_forwarding(*s.forwarding_families, root=s.root)
    except ForwardingError as e:
        raise AgentError(str(e)) from None
    return True


async def start_endpoints(s: Settings, status: Callable[[], "AgentStatus"],
                          api: "LocalAPI | None") -> "EndpointServer | None":
    """The HTTP endpoints the configuration asks for (None when none); AgentError when a port cannot be bound."""
    if not (s.local_server_enabled or s.healthcheck_addr_port):
        return None
    from .endpoints import EndpointServer

    server = EndpointServer(
        status_provider=status, metrics_source=api.usermetrics if api else None,
        enable_metrics=s.enable_metrics, enable_health=s.enable_health_check,
        pod_ipv4=s.pod_ipv4, pod_ipv6=s.pod_ipv6)   # type: ignore[arg-type]
    if s.egress_proxies_config_path:
        from tscommon.pgcontract import PRESHUTDOWN_PATH

        from .egressdrain import PreShutdown
        from .endpoints import Response

        hook = PreShutdown(s.egress_proxies_config_path, str(s.pod_ipv4 or ""), str(s.pod_ipv6 or ""))

        async def preshutdown(method: str, target: str, headers: Any) -> Response:
            if method not in ("GET", "HEAD"):
                return Response(405, b"method not allowed\n", headers=(("Allow", "GET, HEAD"),))
            code, body = await hook.run()
            return Response(code, body.encode())

        server.add_route(PRESHUTDOWN_PATH, preshutdown)
    try:
        if s.local_server_enabled:
            await server.start(s.local_addr_port)
            if s.egress_proxies_config_path:
                from tscommon.pgcontract import PRESHUTDOWN_PATH
                log.info("Running egress preshutdown hook at %s%s", s.local_addr_port, PRESHUTDOWN_PATH)
        if s.healthcheck_addr_port:
            await server.start(s.healthcheck_addr_port, healthz_only=True)
    except (OSError, ValueError) as e:
        raise AgentError(f"failed to start the HTTP endpoints: {e}; check TS_LOCAL_ADDR_PORT / "
                         "TS_HEALTHCHECK_ADDR_PORT (is the port in use?)") from None
    return server


def forwarding_ensurer(s: Settings) -> Callable[[bool, bool], None]:
    """What the reconciler calls when the rules need IP forwarding (a worker thread: it writes sysctls)."""
    def ensure(v4: bool, v6: bool) -> None:
        from netfilter.sysctl import ensure_forwarding
        ensure_forwarding(v4, v6, root=s.root)
    return ensure


async def after_login(s: Settings, child_env: Mapping[str, str], publisher: "NullPublisher", *, ran_up: bool) -> None:
    """TS_AUTH_ONCE: `tailscale set` for the flags a logged-in node still takes, then the key's removal from the
    Secret (it has done its job)."""
    argv, skipped = ts.tailscale_set_argv(s)
    if skipped and not ran_up:
        log.info("TS_EXTRA_ARGS flags %s apply only to the first `tailscale up` and were not re-applied",
                 " ".join(skipped))
    try:
        await ts.run_cli(argv, child_env, None)
    except RuntimeError as e:
        raise AgentError(f"failed to auth tailscale: tailscale set failed: {e}") from None
    from .kube.state import KubeSetupError
    try:
        await publisher.delete_authkey()
    except KubeSetupError as e:
        raise AgentError(str(e)) from None
