"""The agent's HTTP endpoints: probes, status and Prometheus metrics.

An asyncio HTTP/1.1 server (plain streams; the agent is one asyncio loop) that can listen on several
addresses. Routes on the local server (`TS_LOCAL_ADDR_PORT`):

* `/healthz` (iff TS_ENABLE_HEALTH_CHECK) -- upstream meaning: 200 `ok` with `Pod-IPv4`/`Pod-IPv6` headers
  when the node has tailnet IPs, else 503 `node currently has no tailscale IPs`.
* `/livez`, `/readyz`, `/status` (always) -- see `containerboot.status` for what they mean.
* `/metrics` (iff TS_ENABLE_METRICS) -- tailscaled's usermetrics followed by the agent's own metrics.
  Upstream proxies the scraper's request headers to the LocalAPI, so a scraper sending `Origin` or `Referer`
  gets a 403; here the usermetrics are fetched by the agent's own LocalAPI client, never with the scraper's
  headers. If tailscaled cannot be reached the agent's metrics are still served
  (`containerboot_tailscaled_metrics_up 0`) instead of a 500.

The deprecated `TS_HEALTHCHECK_ADDR_PORT` listener serves only `/healthz` (`start(addr, healthz_only=True)`).
GET and HEAD are served; other methods get 405. Listen addresses are `host:port` with IPv6 hosts in
brackets; `[::]` (or an empty host) binds dual-stack, falling back to `0.0.0.0` where IPv6 is unavailable.
"""
from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import logging
import math
import re
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from containerboot.status import AgentStatus, escape_label_value
from tscommon.redact import redact

__all__ = ["EndpointServer", "render_agent_metrics", "parse_addr_port", "Response"]

log = logging.getLogger("containerboot")

_MAX_HEADER_BYTES = 16 * 1024
_MAX_BODY_BYTES = 64 * 1024
_READ_TIMEOUT = 10.0        # a client must send its request within this (slowloris guard)
_IDLE_TIMEOUT = 30.0        # keep-alive connections idle longer than this are closed
_METRICS_TIMEOUT = 10.0

_TEXT = "text/plain; charset=utf-8"
_PROM = "text/plain; version=0.0.4; charset=utf-8"

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable", 505: "HTTP Version Not Supported"}


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = _TEXT
    headers: tuple[tuple[str, str], ...] = ()


# An extra route handler (e.g. the egress pre-shutdown hook): (method, path+query, headers) -> Response.
Handler = Callable[[str, str, Mapping[str, str]], Awaitable[Response]]


# ------------------------------------------------------------------------------------------------------
# Metrics rendering.

# family -> (type, help). Counters keys in AgentStatus whose family is listed here get this metadata.
_FAMILIES: dict[str, tuple[str, str]] = {
    "containerboot_reconcile_total": ("counter", "Reconcile passes run by the agent."),
    "containerboot_reconcile_errors_total": ("counter", "Reconcile passes that ended with an error."),
    "containerboot_reconcile_duration_seconds": ("summary", "Time spent in reconcile passes."),
    "containerboot_dns_resolutions_total": ("counter", "DNS resolutions of backend names, by result."),
    "containerboot_serve_config_applies_total": (
        "counter", "Serve config convergence attempts, by result (applied, unchanged, invalid, skipped, error)."),
    "containerboot_cert_requests_total": ("counter", "TLS certificate requests to tailscaled, by result."),
    "containerboot_firewall_applies_total": ("counter", "Firewall rule set applications, by result."),
}
# Families rendered from the status fields rather than from counters.
_FIXED = frozenset({
    "containerboot_rules_installed", "containerboot_netmap_age_seconds", "containerboot_ready",
    "containerboot_backend_running", "containerboot_serve_config_applied", "containerboot_serve_cert_ready",
    "containerboot_last_reconcile_timestamp_seconds", "containerboot_start_time_seconds",
    "containerboot_tailscaled_metrics_up"})
_SAMPLE_KEY_RE = re.compile(
    r'[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\["\\n])*"'
    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\["\\n])*")*\})?')
_ALWAYS = ("containerboot_reconcile_total", "containerboot_reconcile_duration_seconds",
           "containerboot_dns_resolutions_total", "containerboot_serve_config_applies_total")


def _fmt(v: float) -> str:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _family_of(key: str) -> str:
    name = key.split("{", 1)[0]
    for suffix in ("_sum", "_count", "_bucket"):
        base = name[: -len(suffix)] if name.endswith(suffix) else None
        if base and _FAMILIES.get(base, ("",))[0] in ("summary", "histogram"):
            return base
    return name


def render_agent_metrics(st: AgentStatus, now: float) -> str:
    """The agent's own metrics in Prometheus text exposition format 0.0.4, every family with HELP and TYPE."""
    fams: dict[str, list[tuple[str, float]]] = {}
    for key, value in st.counters.items():
        family_name = _family_of(key)
        # A malformed key or one that collides with a family rendered below would break the whole scrape.
        if not _SAMPLE_KEY_RE.fullmatch(key) or family_name in _FIXED:
            log.debug("metrics: skipping counter %r", key)
            continue
        fams.setdefault(family_name, []).append((key, value))
    for name in _ALWAYS:
        fams.setdefault(name, [])
    if not fams["containerboot_reconcile_total"]:
        fams["containerboot_reconcile_total"].append(("containerboot_reconcile_total", 0))
    dur = fams["containerboot_reconcile_duration_seconds"]
    if not any(k.startswith("containerboot_reconcile_duration_seconds_count") for k, _ in dur):
        dur.extend([("containerboot_reconcile_duration_seconds_sum", 0.0),
                    ("containerboot_reconcile_duration_seconds_count", 0)])

    lines: list[str] = []

    def family(name: str, typ: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {typ}")
        for k, v in sorted(samples):
            lines.append(f"{k} {_fmt(v)}")

    for name in sorted(fams):
        default = ("counter" if name.endswith("_total") else "gauge", f"Agent value {name}.")
        typ, help_ = _FAMILIES.get(name, default)
        family(name, typ, help_, fams[name])

    family("containerboot_rules_installed", "gauge",
           "1 if the forwarding rules for a target are installed, else 0.",
           [(f'containerboot_rules_installed{{kind="{escape_label_value(t.kind)}",'
             f'target="{escape_label_value(t.name)}"}}', 1 if t.rules_installed else 0) for t in st.targets])
    age = st.netmap_age_s(now)
    family("containerboot_netmap_age_seconds", "gauge",
           "Seconds since tailscaled last delivered a network map (control-plane freshness).",
           [] if age is None else [("containerboot_netmap_age_seconds", age)])
    ready, _ = st.ready(now)
    family("containerboot_ready", "gauge", "1 if the agent reports ready (see /readyz).",
           [("containerboot_ready", 1 if ready else 0)])
    family("containerboot_backend_running", "gauge", "1 if tailscaled's backend state is Running.",
           [("containerboot_backend_running", 1 if st.backend_state == "Running" else 0)])
    if st.serve is not None:
        family("containerboot_serve_config_applied", "gauge", "1 if the serve config is in force.",
               [("containerboot_serve_config_applied", 1 if st.serve.applied else 0)])
        family("containerboot_serve_cert_ready", "gauge",
               "1 if every TLS certificate the serve config needs exists (1 when none is needed).",
               [("containerboot_serve_cert_ready", 1 if (st.serve.cert_ready or not st.serve.cert_required) else 0)])
    if st.last_reconcile_at is not None:
        family("containerboot_last_reconcile_timestamp_seconds", "gauge",
               "Unix time of the last completed reconcile.",
               [("containerboot_last_reconcile_timestamp_seconds", st.last_reconcile_at)])
    family("containerboot_start_time_seconds", "gauge", "Unix time the agent started.",
           [("containerboot_start_time_seconds", st.started_at)])
    return "\n".join(lines) + "\n"


def _clean_usermetrics(text: str) -> str:
    # Drop an OpenMetrics "# EOF" terminator (it would end the document early) and ensure a final newline.
    lines = [ln for ln in text.splitlines() if ln.strip() != "# EOF"]
    out = "\n".join(lines)
    return out + "\n" if out else ""


# ------------------------------------------------------------------------------------------------------
# Listening.


def parse_addr_port(addr_port: str) -> tuple[str, int]:
    """Split `host:port` / `[v6]:port` / `:port`. Raises ValueError with a message naming the value."""
    s = addr_port.strip()
    if s.startswith("["):
        end = s.find("]")
        if end < 0 or s[end + 1:end + 2] != ":":
            raise ValueError(f"invalid listen address {addr_port!r}: expected [IPv6]:port")
        host, port = s[1:end], s[end + 2:]
    else:
        host, sep, port = s.rpartition(":")
        if not sep:
            raise ValueError(f"invalid listen address {addr_port!r}: expected host:port")
        if ":" in host:
            raise ValueError(f"invalid listen address {addr_port!r}: put IPv6 addresses in brackets, "
                             f"e.g. [{host}]:{port}")
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"invalid listen address {addr_port!r}: bad port {port!r}")
    return host, int(port)


def _listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket. `[::]`/empty host: dual-stack (IPV6_V6ONLY=0), falling back to IPv4."""
    if host in ("", "::"):
        try:
            s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError as e:
            if e.errno not in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT):
                raise
            return _listen_socket("0.0.0.0", port)
        try:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("::", port))
        except OSError as e:
            s.close()
            if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):   # IPv6 disabled in the Pod
                log.info("IPv6 is not available; listening on 0.0.0.0:%d instead of [::]:%d", port, port)
                return _listen_socket("0.0.0.0", port)
            raise
    else:
        try:
            ip = ipaddress.ip_address(host)
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            sockaddr: tuple = (host, port)
        except ValueError:   # a name: resolve it (first result)
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, _, _, _, sockaddr = info[0]
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(sockaddr)
        except OSError:
            s.close()
            raise
    s.listen(128)
    s.setblocking(False)
    return s


def _format_sockname(sock: socket.socket) -> str:
    name = sock.getsockname()
    if sock.family == socket.AF_INET6:
        return f"[{name[0]}]:{name[1]}"
    return f"{name[0]}:{name[1]}"


class _Listener:
    def __init__(self, addr: str, bound: str, server: asyncio.Server, healthz_only: bool):
        self.addr = addr
        self.bound = bound
        self.server = server
        self.healthz_only = healthz_only


class EndpointServer:
    """Serves the probe, status and metrics endpoints on one or more addresses."""

    def __init__(self, *, status_provider: Callable[[], AgentStatus],
                 metrics_source: Callable[[], Awaitable[str]] | None,
                 enable_metrics: bool, enable_health: bool,
                 pod_ipv4: str | ipaddress.IPv4Address | None = None,
                 pod_ipv6: str | ipaddress.IPv6Address | None = None,
                 max_stall: float = 30.0,
                 clock: Callable[[], float] = time.time):
        self._status = status_provider
        self._metrics_source = metrics_source
        self._enable_metrics = enable_metrics
        self._enable_health = enable_health
        self._pod_ipv4 = str(pod_ipv4) if pod_ipv4 else ""
        self._pod_ipv6 = str(pod_ipv6) if pod_ipv6 else ""
        self._max_stall = max_stall
        self._clock = clock
        self._listeners: list[_Listener] = []
        self._routes: dict[str, Handler] = {}
        self._conns: set[asyncio.Task] = set()

    # -- lifecycle ---------------------------------------------------------------------------------------

    def add_route(self, path: str, handler: Handler) -> None:
        """Serve an extra exact path on the local listeners (e.g. the egress pre-shutdown hook)."""
        self._routes[path] = handler

    async def start(self, addr_port: str, *, healthz_only: bool = False) -> str:
        """Listen on `addr_port` and return the bound address (`host:port`, useful with port 0).

        `healthz_only` makes this the deprecated TS_HEALTHCHECK_ADDR_PORT listener. Raises OSError /
        ValueError with the address in the message; the caller decides whether that is fatal."""
        host, port = parse_addr_port(addr_port)
        try:
            sock = _listen_socket(host, port)
        except OSError as e:
            raise OSError(e.errno, f"cannot listen on {addr_port}: {e.strerror or e}") from e
        server = await asyncio.start_server(
            lambda r, w: self._on_connection(r, w, healthz_only), sock=sock, limit=_MAX_HEADER_BYTES)
        bound = _format_sockname(sock)
        self._listeners.append(_Listener(addr_port, bound, server, healthz_only))
        # Upstream's log lines for the two endpoints it has (harnesses grep for them), then ours.
        if healthz_only or self._enable_health:
            log.info("Running healthcheck endpoint at %s/healthz", addr_port)
        if not healthz_only:
            if self._enable_metrics:
                log.info("Running metrics endpoint at %s/metrics", addr_port)
            log.info("Running HTTP endpoints at %s (%s)", addr_port, ", ".join(self._paths()))
        return bound

    @property
    def addresses(self) -> list[str]:
        """The bound addresses, in start order."""
        return [ln.bound for ln in self._listeners]

    async def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        for ln in listeners:
            ln.server.close()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        for ln in listeners:
            try:
                await asyncio.wait_for(ln.server.wait_closed(), 5)
            except (asyncio.TimeoutError, Exception):   # closing is best effort
                pass
            log.info("HTTP server at %s closed", ln.addr)

    def _paths(self) -> list[str]:
        p = ["/livez", "/readyz", "/status"]
        if self._enable_health:
            p.insert(0, "/healthz")
        if self._enable_metrics:
            p.append("/metrics")
        return p + sorted(self._routes)

    # -- connection handling -----------------------------------------------------------------------------

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             healthz_only: bool) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            first = True
            while True:
                keep_alive = await self._one_request(reader, writer, healthz_only,
                                                     _READ_TIMEOUT if first else _IDLE_TIMEOUT)
                first = False
                if not keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.CancelledError):
            pass
        except Exception:   # one bad connection must never take the server down
            log.exception("HTTP endpoint: unexpected error")
        finally:
            self._conns.discard(task)
            try:
                writer.close()
            except Exception:
                pass

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           healthz_only: bool, timeout: float) -> bool:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except asyncio.IncompleteReadError as e:
            if e.partial.strip():
                await self._write(writer, "GET", Response(400, b"bad request\n"), False)
            return False
        except asyncio.LimitOverrunError:
            await self._write(writer, "GET", Response(431, b"request headers too large\n"), False)
            return False
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ")
            if not version.startswith("HTTP/1."):
                await self._write(writer, method, Response(505, b"HTTP version not supported\n"), False)
                return False
            headers: dict[str, str] = {}
            for ln in lines[1:]:
                if not ln:
                    continue
                k, _, v = ln.partition(":")
                if not _ or not k or k != k.strip():
                    raise ValueError("bad header line")
                headers[k.lower()] = v.strip()
            length = int(headers.get("content-length", "0") or "0")
            if length < 0:
                raise ValueError("negative content-length")
        except ValueError:
            await self._write(writer, "GET", Response(400, b"bad request\n"), False)
            return False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            # No endpoint takes a body; refuse rather than mis-frame the connection.
            await self._write(writer, method, Response(400, b"request bodies are not supported\n"), False)
            return False
        if length > _MAX_BODY_BYTES:
            await self._write(writer, method, Response(413, b"request body too large\n"), False)
            return False
        if length:
            await asyncio.wait_for(reader.readexactly(length), timeout)
        conn = headers.get("connection", "").lower()
        keep_alive = (version == "HTTP/1.1" and conn != "close") or (version == "HTTP/1.0" and conn == "keep-alive")
        resp = await self._dispatch(method, target, headers, healthz_only)
        await self._write(writer, method, resp, keep_alive)
        return keep_alive

    async def _write(self, writer: asyncio.StreamWriter, method: str, resp: Response, keep_alive: bool) -> None:
        reason = _REASONS.get(resp.status, "Unknown")
        hdrs = [("Content-Type", resp.content_type), ("Content-Length", str(len(resp.body))),
                ("Cache-Control", "no-store"), *resp.headers,
                ("Connection", "keep-alive" if keep_alive else "close")]
        out = f"HTTP/1.1 {resp.status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs) + "\r\n"
        writer.write(out.encode("latin-1") + (b"" if method == "HEAD" else resp.body))
        await writer.drain()

    # -- routing -----------------------------------------------------------------------------------------

    async def _dispatch(self, method: str, target: str, headers: Mapping[str, str], healthz_only: bool) -> Response:
        path = target.split("?", 1)[0]
        if path.startswith("http://") or path.startswith("https://"):   # absolute-form request target
            path = "/" + path.split("://", 1)[1].partition("/")[2]
        if healthz_only:
            handler = self._healthz if path == "/healthz" else None
        else:
            handler = {
                "/healthz": self._healthz if self._enable_health else None,
                "/livez": self._livez,
                "/readyz": self._readyz,
                "/status": self._status_json,
                "/metrics": self._metrics if self._enable_metrics else None,
            }.get(path)
            if handler is None and path in self._routes:
                return await self._routes[path](method, target, headers)
        if handler is None:
            return Response(404, b"404 page not found\n")
        if method not in ("GET", "HEAD"):
            return Response(405, b"method not allowed\n", headers=(("Allow", "GET, HEAD"),))
        try:
            return await handler()
        except Exception as e:   # report, don't drop the connection
            log.warning("HTTP endpoint %s failed: %s", path, redact(str(e)))
            return Response(500, f"internal error: {redact(str(e))}\n".encode())

    async def _healthz(self) -> Response:
        st = self._status()
        if not st.healthy():
            return Response(503, b"node currently has no tailscale IPs\n")
        hdrs = []
        if self._pod_ipv4:
            hdrs.append(("Pod-IPv4", self._pod_ipv4))
        if self._pod_ipv6:
            hdrs.append(("Pod-IPv6", self._pod_ipv6))
        return Response(200, b"ok", headers=tuple(hdrs))

    async def _livez(self) -> Response:
        st = self._status()
        now = self._clock()
        if st.live(now, self._max_stall):
            return Response(200, b"ok\n")
        return Response(503, f"agent loop stalled for {st.stall_s(now):.0f}s\n".encode())

    async def _readyz(self) -> Response:
        ok, reasons = self._status().ready(self._clock(), self._max_stall)
        if ok:
            return Response(200, b"ok\n")
        return Response(503, ("not ready:\n" + "".join(f"- {r}\n" for r in reasons)).encode())

    async def _status_json(self) -> Response:
        body = json.dumps(self._status().to_json(self._clock()), indent=2, sort_keys=False, allow_nan=False)
        return Response(200, (body + "\n").encode(), content_type="application/json")

    async def _metrics(self) -> Response:
        st = self._status()
        parts: list[str] = []
        up = 0
        if self._metrics_source is not None:
            try:
                # The agent's own LocalAPI client makes this request: the scraper's headers (Origin, Referer,
                # ...) never reach tailscaled, so a browser-like scraper cannot trigger its 403.
                text = await asyncio.wait_for(self._metrics_source(), _METRICS_TIMEOUT)
                parts.append(_clean_usermetrics(text))
                up = 1
            except Exception as e:
                log.warning("metrics: cannot get tailscaled's metrics: %s", redact(str(e)))
        parts.append(render_agent_metrics(st, self._clock()))
        parts.append("# HELP containerboot_tailscaled_metrics_up 1 if tailscaled's metrics were included.\n"
                     "# TYPE containerboot_tailscaled_metrics_up gauge\n"
                     f"containerboot_tailscaled_metrics_up {up}\n")
        return Response(200, "".join(parts).encode(), content_type=_PROM)
