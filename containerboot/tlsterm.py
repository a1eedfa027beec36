"""HTTPS with the user's own certificate: a TLS terminator in front of tailscaled's plain-HTTP serve.

tailscaled serves HTTPS only with certificates its control plane issued (headscale issues none), so the
certificate of a `kubernetes.io/tls` Secret is served here. The path of one connection:

    tailnet client ──WireGuard──► tailscaled, serve config TCP 443: TCPForward 127.0.0.1:<TS_TLS_LISTEN port>
        ──► this terminator (asyncio + ssl, the Secret's certificate) ──decrypted bytes──►
        either the one backend (TS_TLS_BACKEND: every path goes to it), or tailscaled's LocalAPI `dial` to the
        node's own tailnet address, port <TS_TLS_UPSTREAM_PORT>, tailscaled's plain-HTTP serve (the Ingress's
        paths and backends, exactly as without TLS)

The terminator parses no HTTP: it copies bytes, so every HTTP feature of the backend or of tailscaled's serve
(paths, WebSockets, streaming) works unchanged; the Tailscale identity headers are the exception (through
tailscaled they name the proxy itself). The choice and its figures are in docs/https.md (bench/https.py).

Renewal: `CertWatcher` reads the source every `interval` seconds; a pair that differs is checked
(`tscommon.tlscert`: PEM, validity, names, the key's match) and, when good, becomes the context that new
handshakes use (an SNI callback picks the current context per handshake); established connections keep the
session they negotiated. A bad pair is logged once per version and the last good one stays in use.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from tscommon import tlscert, tlsload
from tscommon.tlscert import CertInfo, CertProblem

log = logging.getLogger("containerboot.tls")

CHUNK = 256 * 1024
#: Seconds between reads of the certificate's source: a renewal reaches new connections within this (plus the
#: source's own delay: none for a Secret read through the API server).
RELOAD_INTERVAL = 20.0
Dialer = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class CertSource(Protocol):
    """Where the pair comes from; `describe` names it in logs (never its content)."""

    def describe(self) -> str: ...

    async def load(self) -> tuple[bytes, bytes]: ...


@dataclass(frozen=True)
class FileSource:
    """`tls.crt` and `tls.key` in a directory (a mounted Secret volume, or files the operator writes)."""

    directory: str

    def describe(self) -> str:
        return f"directory {self.directory}"

    async def load(self) -> tuple[bytes, bytes]:
        def read() -> tuple[bytes, bytes]:
            with open(f"{self.directory}/tls.crt", "rb") as c, open(f"{self.directory}/tls.key", "rb") as k:
                return c.read(), k.read()
        return await asyncio.to_thread(read)


class KubeSecretSource:
    """A `kubernetes.io/tls` Secret read through the API server (it may live in another namespace than the
    Pod, where a volume cannot reach). The proxy's Role allows `get` on exactly this Secret."""

    def __init__(self, kube: "KubeGetter", namespace: str, name: str):
        self.kube, self.namespace, self.name = kube, namespace, name

    def describe(self) -> str:
        return f"Secret {self.namespace}/{self.name}"

    async def load(self) -> tuple[bytes, bytes]:
        import base64

        from .kube.client import KubeError
        try:
            doc = await self.kube.get_secret_in(self.namespace, self.name)
        except KubeError as e:
            raise CertProblem(str(e)) from None
        if doc is None:
            raise CertProblem(f"Secret {self.namespace}/{self.name} not found")
        if doc.get("type") not in ("kubernetes.io/tls", None):
            raise CertProblem(f"Secret {self.namespace}/{self.name} is of type {doc.get('type')!r}, not "
                              "kubernetes.io/tls")
        data = doc.get("data") or {}
        try:
            return base64.b64decode(data.get("tls.crt", "")), base64.b64decode(data.get("tls.key", ""))
        except ValueError:
            raise CertProblem(f"Secret {self.namespace}/{self.name}: tls.crt or tls.key is not base64") from None


class KubeGetter(Protocol):
    async def get_secret_in(self, namespace: str, name: str) -> dict | None: ...


def tcp_dialer(host: str, port: int) -> Dialer:
    async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port, limit=CHUNK)
    return dial


def localapi_dialer(socket_path: str, host: Callable[[], str], port: int) -> Dialer:
    """A connection through tailscaled (its LocalAPI `dial`, the `ts-dial` upgrade): it reaches the node's own
    tailnet address inside tailscaled's netstack, where the serve config's plain-HTTP port listens."""
    async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        h = host()
        if not h:
            raise ConnectionError("the node has no tailnet address yet")
        r, w = await asyncio.open_unix_connection(socket_path, limit=CHUNK)
        w.write((f"POST /localapi/v0/dial HTTP/1.1\r\nHost: local-tailscaled.sock\r\nConnection: upgrade\r\n"
                 f"Upgrade: ts-dial\r\nDial-Host: {h}\r\nDial-Port: {port}\r\nDial-Network: tcp\r\n"
                 "Content-Length: 0\r\n\r\n").encode())
        head = await r.readuntil(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status + b" ":
            w.close()
            raise ConnectionError(f"tailscaled refused the dial to {h}:{port}: {status.decode(errors='replace')}")
        return r, w
    return dial


async def _pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while data := await r.read(CHUNK):
            w.write(data)
            await w.drain()
        if w.can_write_eof():
            w.write_eof()
    except (ConnectionError, ssl.SSLError, OSError):
        pass


class ContextSwitch:
    """The SSLContext a listener hands every new handshake: the current certificate's. The listener is made with
    `front` (the first good context); its SNI callback, which OpenSSL calls for every ClientHello, with or
    without a server name, moves the handshake to `current`. Open connections keep the session they have."""

    def __init__(self) -> None:
        self.front: ssl.SSLContext | None = None
        self.current: ssl.SSLContext | None = None
        self.info: CertInfo | None = None

    def use(self, ctx: ssl.SSLContext, info: CertInfo) -> None:
        """New handshakes use `ctx` from now on; open connections keep theirs."""
        if self.front is None:
            self.front = ctx
            ctx.sni_callback = self._pick
        self.current, self.info = ctx, info

    def _pick(self, sslobj: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        if self.current is not None and sslobj.context is not self.current:
            sslobj.context = self.current


class Terminator(ContextSwitch):
    """The TLS listener: the current certificate for new handshakes, bytes copied to `dial`'s connection."""

    def __init__(self, dial: Dialer):
        super().__init__()
        self.dial = dial
        self.counters = {"connections": 0, "dial_errors": 0}
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        if self.front is None:
            raise RuntimeError("no certificate loaded yet")
        self._server = await asyncio.start_server(self._handle, host, port, ssl=self.front, limit=CHUNK,
                                                  ssl_handshake_timeout=15)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.counters["connections"] += 1
        try:
            ur, uw = await self.dial()
        except (OSError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            self.counters["dial_errors"] += 1
            log.warning("tls: cannot reach the serve port: %s", e)
            cw.close()
            return
        # The connection lasts as long as the server side sends: when it ends (an HTTP `Connection: close`
        # answer, or its reply to the client's half-close), the client gets a TLS close at once; TLS has no
        # half-close to pass the end on with and leave the client's direction open.
        up = asyncio.ensure_future(_pump(cr, uw))
        try:
            await _pump(ur, cw)
        finally:
            up.cancel()
            for w in (uw, cw):
                w.close()


class CertWatcher:
    """Keeps the terminator's certificate equal to the source's last good pair."""

    def __init__(self, source: CertSource, term: ContextSwitch, names: Callable[[], tuple[str, ...]], *,
                 interval: float | None = None, now: Callable[[], float] = time.time,
                 on_change: Callable[[str], None] | None = None):
        self.source, self.term, self.names, self.now = source, term, names, now
        self.interval = RELOAD_INTERVAL if interval is None else interval
        self.on_change = on_change
        self.last_error = ""
        self._seen: tuple[bytes, bytes] | None = None
        self._names: tuple[str, ...] = ()

    async def refresh(self) -> bool:
        """One read: True when the terminator now serves a new certificate."""
        try:
            pair = await self.source.load()
        except (OSError, CertProblem, ValueError) as e:
            self._problem(f"cannot read {self.source.describe()}: {e}")
            return False
        names = self.names()
        if pair == self._seen and names == self._names:
            return False
        self._seen, self._names = pair, names
        try:
            info = tlscert.check(pair[0], pair[1], names, self.now())
            ctx = await asyncio.to_thread(tlsload.server_context, *pair)
        except CertProblem as e:
            self._problem(f"{self.source.describe()}: {e}; "
                          + ("still serving the last good certificate" if self.term.info else "not serving HTTPS"))
            return False
        self.term.use(ctx, info)
        self.last_error = ""
        log.info("tls: serving the certificate of %s (serial %s, valid until %s)", self.source.describe(),
                 info.serial, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(info.not_after)))
        if self.on_change:
            self.on_change(info.serial)
        return True

    def status(self) -> dict:
        """For /status: what is served and the last problem (never the key)."""
        info = self.term.info
        return {"source": self.source.describe(), "serial": info.serial if info else "",
                "not_after": info.not_after if info else None, "names": list(info.names()) if info else [],
                "last_error": self.last_error, **getattr(self.term, "counters", {})}

    def _problem(self, msg: str) -> None:
        if msg != self.last_error:
            log.warning("tls: %s", msg)
        self.last_error = msg

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)
