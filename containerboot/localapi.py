"""Client for tailscaled's LocalAPI over its unix socket (asyncio streams, HTTP/1.1 framing by h11).

The LocalAPI refuses requests whose Host is not `local-tailscaled.sock` or that carry a Referer or Origin
header (a browser-CSRF guard), so every request here is built with exactly that Host and neither header.
The IPN bus (`watch-ipn-bus`) is a never-ending response of newline-delimited JSON Notify objects; it is
exposed as an async iterator that ends when the stream ends.

Why not httpx (which the Kubernetes client uses): on a unix socket to one local daemon, a connection per call
costs microseconds, and httpx with its dependencies costs the agent about 5 MB of resident memory (a seventh
of its budget) that a configuration without Kubernetes never needs; h11, the HTTP/1.1 state machine httpx
itself builds on, does the framing (chunked streams included) in 0.5 MB.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import h11

from tscommon.redact import redact

HOST = "local-tailscaled.sock"
BASE = f"http://{HOST}/localapi/v0"

# IPN bus mask bits (see the spec's table; only the ones the agent uses are named).
NOTIFY_INITIAL_STATE = 2
NOTIFY_INITIAL_PREFS = 4
NOTIFY_INITIAL_NETMAP = 8
NOTIFY_NO_PRIVATE_KEYS = 16
NOTIFY_INITIAL_HEALTH_STATE = 128
NOTIFY_PEER_CHANGES = 4096
NOTIFY_NO_NETMAP = 8192
NOTIFY_INITIAL_STATUS = 16384

#: The agent's standing watch: initial status (self, peers, DNS extra records) plus incremental peer
#: changes, without the full netmap on every change. Same as upstream's base mask.
WATCH_MASK = NOTIFY_INITIAL_STATUS | NOTIFY_PEER_CHANGES | NOTIFY_NO_NETMAP
#: The first watch also asks for prefs and health, to see a failed login at once.
FIRST_WATCH_MASK = WATCH_MASK | NOTIFY_INITIAL_PREFS | NOTIFY_INITIAL_HEALTH_STATE
#: The login's watch when the rules depend on the node's own addresses only: without peer changes. tailscaled
#: still sends the self node (SelfChange) with each new netmap, but computes no peer list for this watcher.
#: Measured in the lab: a watcher of peer changes during the login delays tailscaled's own switch to Running
#: by 1-2 ms (upstream's containerboot watches nothing while `tailscale up` runs).
LOGIN_WATCH_MASK = FIRST_WATCH_MASK & ~NOTIFY_PEER_CHANGES

#: The capability version this client speaks (sent as Tailscale-Cap, as the Go client does).
CLIENT_CAPVER = 142


class LocalAPIError(Exception):
    """A LocalAPI call failed; `status` is the HTTP status (0 for a transport error)."""

    def __init__(self, message: str, status: int = 0, retry_after: float | None = None):
        super().__init__(redact(message))
        self.status = status
        self.retry_after = retry_after  # seconds, from a 429's Retry-After header


@dataclass
class Response:
    status_code: int
    headers: dict[str, str] = field(default_factory=dict)   # names lower-cased
    content: bytes = b""

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class _Exchange:
    """One request on its own connection to the socket; the response arrives as h11 events."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.conn = h11.Connection(h11.CLIENT)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def start(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> Response:
        """Send the request; return the response head (content still to read)."""
        self.reader, self.writer = await asyncio.open_unix_connection(self.socket_path)
        if body or method in ("POST", "PUT", "PATCH"):
            headers = [*headers, ("Content-Length", str(len(body)))]
        out = self.conn.send(h11.Request(method=method, target=target, headers=headers))
        if body:
            out += self.conn.send(h11.Data(data=body))
        out += self.conn.send(h11.EndOfMessage())
        self.writer.write(out)
        await self.writer.drain()
        event = await self._next()
        if not isinstance(event, h11.Response):
            raise h11.RemoteProtocolError(f"expected a response, got {type(event).__name__}")
        return Response(event.status_code, {k.decode().lower(): v.decode("latin-1") for k, v in event.headers})

    async def _next(self):
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            assert self.reader is not None
            self.conn.receive_data(await self.reader.read(65536))

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; ends at the end of the message (or when the server closes)."""
        while True:
            event = await self._next()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass


_TRANSPORT_ERRORS = (OSError, EOFError, h11.ProtocolError, asyncio.IncompleteReadError)


def _error_text(resp: Response) -> str:
    body = resp.text
    try:
        doc = json.loads(body)
        if isinstance(doc, dict):
            body = doc.get("Error") or doc.get("error") or body
    except ValueError:
        pass
    return f"{resp.status_code}: {str(body).strip()}"


class LocalAPI:
    """A thin async client of one tailscaled's LocalAPI."""

    def __init__(self, socket_path: str, *, timeout: float = 30.0):
        self.socket_path = socket_path
        self.capver: int | None = None
        self._timeout = timeout
        self._headers = [("Host", HOST), ("Tailscale-Cap", str(CLIENT_CAPVER))]

    async def aclose(self) -> None:
        pass     # every call has its own connection, closed when the call ends

    def _note_capver(self, resp: Response) -> None:
        cap = resp.headers.get("tailscale-cap")
        if cap and cap.isdigit():
            self.capver = int(cap)

    async def _call(self, method: str, path: str, *, expect: int = 200, json_body: Any = None,
                    headers: dict[str, str] | None = None, content: bytes | None = None,
                    timeout: float | None = None) -> Response:
        body = content or b""
        extra = list((headers or {}).items())
        if json_body is not None:
            body = json.dumps(json_body).encode()
            extra.append(("Content-Type", "application/json"))
        ex = _Exchange(self.socket_path)
        try:
            async with asyncio.timeout(timeout if timeout is not None else self._timeout):
                resp = await ex.start(method, f"/localapi/v0/{path}", [*self._headers, *extra], body)
                resp.content = b"".join([c async for c in ex.chunks()])
        except TimeoutError:
            raise LocalAPIError(f"LocalAPI {method} {path}: timed out") from None
        except _TRANSPORT_ERRORS as e:
            raise LocalAPIError(f"LocalAPI {method} {path}: {e!r}") from None
        finally:
            await ex.close()
        self._note_capver(resp)
        if resp.status_code != expect:
            ra = resp.headers.get("retry-after", "")
            raise LocalAPIError(f"LocalAPI {method} {path}: {_error_text(resp)}", resp.status_code,
                                float(ra) if ra.replace(".", "", 1).isdigit() else None)
        return resp

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = await self._call(method, path, **kw)
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError as e:
            raise LocalAPIError(f"LocalAPI {method} {path}: bad JSON: {e}") from None

    async def status(self) -> dict:
        return await self._json("GET", "status")

    async def prefs(self) -> dict:
        return await self._json("GET", "prefs")

    async def edit_prefs(self, masked: dict) -> dict:
        return await self._json("PATCH", "prefs", json_body=masked)

    async def get_serve_config(self) -> tuple[dict | None, str]:
        resp = await self._call("GET", "serve-config")
        doc = resp.json() if resp.content else None
        return (doc or None), resp.headers.get("etag", "")

    async def set_serve_config(self, config: dict, etag: str = "") -> None:
        headers = {"If-Match": etag} if etag else {}
        await self._call("POST", "serve-config", content=json.dumps(config).encode(),
                         headers={**headers, "Content-Type": "application/json"})

    async def dns_config(self) -> dict:
        return await self._json("GET", "dns-config") or {}

    async def cert_pair(self, domain: str) -> tuple[bytes, bytes]:
        # Issuing a certificate (ACME) can take minutes; the default timeout is for quick calls.
        resp = await self._call("GET", f"cert/{domain}?type=pair&min_validity=0s", timeout=300.0)
        return _split_pem_pair(resp.content)

    async def whois(self, addr: str) -> dict | None:
        """The node and user behind a tailnet address ("ip:port" or "[ipv6]:port"); None when unknown."""
        from urllib.parse import quote
        try:
            return await self._json("GET", f"whois?addr={quote(addr, safe='')}")
        except LocalAPIError as e:
            if e.status == 404:
                return None
            raise

    async def usermetrics(self) -> str:
        resp = await self._call("GET", "usermetrics")
        return resp.text

    async def disconnect_control(self) -> None:
        await self._call("POST", "disconnect-control")

    async def reload_config(self) -> dict:
        return await self._json("POST", "reload-config") or {}

    async def set_udp_gro_forwarding(self) -> None:
        doc = await self._json("GET", "set-udp-gro-forwarding") or {}
        if doc.get("Warning"):
            raise LocalAPIError(f"set-udp-gro-forwarding: {doc['Warning']}")

    async def watch_ipn_bus(self, mask: int) -> AsyncIterator[dict]:
        """Yield Notify objects until the stream ends (EOF) or the caller stops iterating.

        Uses its own connection with no read timeout: the bus is quiet for long stretches.
        """
        ex = _Exchange(self.socket_path)
        try:
            try:
                async with asyncio.timeout(10.0):     # connecting and the response head only: the bus is quiet
                    resp = await ex.start("GET", f"/localapi/v0/watch-ipn-bus?mask={mask}", self._headers, b"")
            except TimeoutError:
                raise LocalAPIError("watch-ipn-bus: timed out waiting for the response") from None
            self._note_capver(resp)
            if resp.status_code != 200:
                resp.content = b"".join([c async for c in ex.chunks()])
                raise LocalAPIError(f"watch-ipn-bus: {_error_text(resp)}", resp.status_code)
            pending = b""
            async for chunk in ex.chunks():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        notify = json.loads(line)
                    except ValueError as e:
                        raise LocalAPIError(f"watch-ipn-bus: bad JSON line: {e}") from None
                    if isinstance(notify, dict):
                        yield notify
        except _TRANSPORT_ERRORS as e:
            raise LocalAPIError(f"watch-ipn-bus: {e!r}") from None
        finally:
            await ex.close()


def _split_pem_pair(pem: bytes) -> tuple[bytes, bytes]:
    """Split tailscaled's `type=pair` answer (key block(s) first, then the certificate chain)."""
    marker = b"-----BEGIN CERTIFICATE-----"
    i = pem.find(marker)
    if i < 0:
        raise LocalAPIError("cert pair: no certificate in the answer")
    return pem[i:], pem[:i]
