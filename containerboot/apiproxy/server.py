"""The API server proxy's HTTP handling: h11 on the client side and on the API server side (adapter).

One client connection gets at most one API server connection at a time, opened when its first request is
forwarded and reused while both sides keep the connection alive (kubectl's own keep-alive is mirrored).
Bodies stream in both directions an event at a time, each chunk written and drained before the next is read,
so watches and `logs -f` arrive as the API server sends them. While a response streams, the client side is
watched: a client that goes away closes the API server connection at once (a watch does not linger). A
request body is sent while the response head is awaited, so an answer that comes before the body has gone
(RBAC's 403 to a large apply) is passed on; that client connection then ends, after the rest of its body has
been read and dropped (a close with unread data would reset the answer away).

Upgrades (exec, attach, port-forward: SPDY/3.1 or WebSocket) are forwarded as an ordinary request; when the
API server answers 101 the 101 goes to the client and from then on bytes are copied both ways until either
side closes, as Go's ReverseProxy does after a protocol switch.

Refusals are Kubernetes Status objects (kubectl prints their message); a client that does not speak HTTP gets
a 400 when h11 can still frame one, and its connection is closed; nothing else is affected. Why h11 rather
than aiohttp: a proxy must pass a 101 and the bytes after it through untouched and must not buffer bodies;
with h11 both are the natural shape (events in, events out, `trailing_data` after a switch), while aiohttp's
server and client would each have to be bypassed for upgrades. h11 is already the agent's HTTP framing.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11

from tscommon.redact import redact

from . import apievent
from .eventclient import EventOutcome, record_event
from .identity import (
    GrantError,
    Impersonation,
    NoIdentity,
    forwarded_request_headers,
    forwarded_response_headers,
    impersonation,
    is_upgrade,
)
from .recclient import RecorderError
from .record import Recording, start_recording
from .recording import (
    Plan,
    RecorderPolicy,
    Session,
    connect_failed,
    plan,
    recorder_addrs,
    recorder_policy,
    session_of,
)

log = logging.getLogger("containerboot")

READ_SIZE = 262144
#: The API server side's stream buffer: asyncio stops reading a socket at twice this, and its 64 KiB default
#: cut a list of thousands of objects into many small reads and writes.
UPSTREAM_BUFFER = 1 << 20
AUTH, NOAUTH = "auth", "noauth"
#: How long a connection's caller, once identified, stands for its next requests (seconds). A LocalAPI WhoIs
#: per request is a round trip to tailscaled on every `kubectl get`; kubectl sends its requests in bursts on
#: one kept-alive connection, so the burst asks once, and a changed grant still counts within this time.
WHOIS_TTL = 1.0
_GONE = (OSError, EOFError, asyncio.IncompleteReadError, h11.ProtocolError)


@dataclass(frozen=True)
class Upstream:
    """Where the API server is: host and port to dial, TLS context (verifying the cluster CA) and Host."""

    host: str
    port: int
    ssl: ssl.SSLContext | None
    host_header: bytes


@dataclass(frozen=True)
class Caller:
    """Who is calling: the WhoIs answer, the impersonation (auth mode) and what its rules say of recording."""

    who: dict
    imp: Impersonation | None
    policy: RecorderPolicy


class RecorderUnavailable(Exception):
    """No recorder took the session; str(e) says why for each recorder tried."""


async def _start_recording(addrs: tuple[str, ...], session: Session, caller: Caller, target: bytes, *,
                           fail_open: bool) -> Recording:
    try:
        return await start_recording(addrs, session, caller, target, fail_open=fail_open)
    except RecorderError as e:
        raise RecorderUnavailable(str(e)) from None


class Refused(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


class _ClientGone(Exception):
    pass


class _UpstreamWriteFailed(Exception):
    """Sending the request body to the API server failed (it may have answered and closed already)."""


def status_body(status: int, reason: str, message: str) -> bytes:
    """A Kubernetes Status object: what kubectl expects in an error response."""
    return json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": message, "reason": reason, "code": status}).encode()


class _Side:
    """One end of the proxy: a stream pair and its h11 state machine."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, role: Any) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(role)

    async def next_event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await self.reader.read(READ_SIZE))

    async def send(self, *events: Any) -> None:
        for event in events:
            data = self.conn.send(event)
            if data:
                self.writer.write(data)
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        """Close at once, dropping what is unsent: a TLS close waits (up to 30 s) for the peer's close_notify,
        and a peer blocked writing a body the proxy no longer reads never sends it."""
        self.writer.transport.abort()


def _peer_addr(peer: Any) -> str:
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ApiServerProxy:
    """Serves one client connection at a time per `handle` call; shared state is read-only or atomic."""

    def __init__(self, *, mode: str, upstream: Upstream, token: Callable[[], str],
                 whois: Callable[[str], Awaitable[dict | None]],
                 status: Callable[[], Awaitable[dict]] | None = None,
                 start_recording: Callable[..., Awaitable[Any]] = _start_recording,
                 record_event: Callable[..., Awaitable[EventOutcome]] = record_event) -> None:
        if mode not in (AUTH, NOAUTH):
            raise ValueError(f"mode {mode!r}: want {AUTH!r} or {NOAUTH!r}")
        self.mode, self.upstream, self._token, self._whois = mode, upstream, token, whois
        self._status, self._start_recording, self._record_event = status, start_recording, record_event
        self._identified: dict[str, tuple[float, Caller]] = {}   # open connection's peer -> caller
        self._peers: tuple[float, dict] | None = None            # tailscaled's status, for recorder tags
        self._finishing: set[asyncio.Future[None]] = set()   # recordings being closed after their session
        self.connections = 0    # open client connections (for tests and the status line)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = _Side(reader, writer, h11.SERVER)
        peer = _peer_addr(writer.get_extra_info("peername") or ("?", 0))
        upstream: _Side | None = None
        self.connections += 1
        try:
            while True:
                try:
                    event = await client.next_event()
                except h11.RemoteProtocolError as e:
                    await self._garbage(client, peer, e)
                    return
                if not isinstance(event, h11.Request):
                    return       # ConnectionClosed: the client is done
                upstream = await self._exchange(client, event, peer, upstream)
                if upstream is None and client.conn.our_state is h11.SWITCHED_PROTOCOL:
                    return
                if client.conn.their_state is h11.SEND_BODY and client.conn.our_state in (h11.DONE, h11.MUST_CLOSE):
                    await _linger(client)      # answered before the request body ended
                    return
                if client.conn.our_state is not h11.DONE or client.conn.their_state is not h11.DONE:
                    return
                client.conn.start_next_cycle()
        except _ClientGone:
            client.abort()
        except _GONE:
            pass
        finally:
            self.connections -= 1
            self._identified.pop(peer, None)
            client.close()
            if upstream is not None:
                upstream.abort()

    async def _garbage(self, client: _Side, peer: str, e: h11.RemoteProtocolError) -> None:
        log.info("api-server-proxy: closing the connection from %s: not HTTP/1.1 (%s)", peer, e)
        if client.conn.our_state is h11.SEND_RESPONSE or client.conn.our_state is h11.IDLE:
            body = status_body(400, "BadRequest", f"bad request: {e}")
            try:
                await client.send(h11.Response(status_code=400, headers=[
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")]), h11.Data(data=body), h11.EndOfMessage())
            except (h11.LocalProtocolError, *_GONE):
                pass

    async def _refuse(self, client: _Side, r: Refused) -> None:
        body = status_body(r.status, r.reason, r.message)
        await client.send(h11.Response(status_code=r.status, headers=[
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]), h11.Data(data=body), h11.EndOfMessage())

    async def identify(self, peer: str) -> Caller:
        """The caller (its impersonation in auth mode, its recording rules in both modes); Refused (403) when
        it has no identity or a malformed grant."""
        now = time.monotonic()
        known = self._identified.get(peer)
        if known is not None and now - known[0] < WHOIS_TTL:
            return known[1]
        try:
            who = await self._whois(peer)
        except Exception as e:   # any LocalAPI failure means: no identity
            log.warning("api-server-proxy: failed to authenticate caller %s: WhoIs failed: %s", peer, e)
            raise Refused(403, "Forbidden", "failed to authenticate caller") from None
        if not who:
            log.warning("api-server-proxy: failed to authenticate caller %s: not a tailnet node known to this "
                        "proxy", peer)
            raise Refused(403, "Forbidden", "failed to authenticate caller")
        try:
            caller = Caller(who, impersonation(who) if self.mode == AUTH else None, recorder_policy(who.get("CapMap")))
            self._identified[peer] = (now, caller)
            return caller
        except NoIdentity as e:
            log.warning("api-server-proxy: failed to authenticate caller %s: %s", peer, e)
            raise Refused(403, "Forbidden", "failed to authenticate caller") from None
        except GrantError as e:
            name = str((who.get("UserProfile") or {}).get("LoginName") or (who.get("Node") or {}).get("Name"))
            log.error("api-server-proxy: refusing %s (%s): malformed capability grant: %s", peer, name, e)
            raise Refused(403, "Forbidden", f"forbidden: the tailnet policy grants this caller a malformed "
                                            f"capability: {e}; fix the grant in the tailnet policy") from None

    async def _recorders(self, policy: RecorderPolicy) -> tuple[str, ...]:
        """The recorder addresses of the caller's rules, the `recorder` tags resolved with tailscaled's
        status (asked at most once per WHOIS_TTL). A status that cannot be read resolves no tag."""
        if not policy.tags or self._status is None:
            return recorder_addrs(policy, None)
        now = time.monotonic()
        if self._peers is None or now - self._peers[0] >= WHOIS_TTL:
            try:
                self._peers = (now, await self._status())
            except Exception as e:
                log.warning("api-server-proxy: cannot read tailscaled's status to find the recorders %s: %s",
                            ", ".join(policy.tags), e)
                return recorder_addrs(policy, None)
        return recorder_addrs(policy, self._peers[1])

    async def _recording(self, req: h11.Request, caller: Caller, peer: str, client: _Side) -> tuple[Any, bytes | None]:
        """Apply the recording rules before anything is sent to the API server: (None, body) to forward the
        request unrecorded, (a started recording, body) to forward it recorded; Refused (403) when it must be
        recorded and cannot be, (502) when its API event must be and cannot be. `body` is the request body when
        it was read whole for the event, else None (it streams)."""
        policy = caller.policy
        if not policy.asks:
            return None, None
        session = session_of(req.method, req.target)
        p = plan(policy, await self._recorders(policy), session, target=req.target,
                 upgrade=is_upgrade(req.headers))
        body = None
        if p.events:
            body = await self._read_body(client)
            await self._event(req, caller, peer, body, p)
        if p.action == "refuse":
            log.error("api-server-proxy: refusing %s: %s", peer, p.message)
            raise Refused(403, "Forbidden", p.message)
        if p.action == "pass":
            if p.message:
                log.warning("api-server-proxy: %s: %s", peer, p.message)
            return None, body
        assert session is not None
        try:
            return await self._start_recording(p.addrs, session, caller, req.target, fail_open=p.fail_open), body
        except RecorderUnavailable as e:
            msg = connect_failed(session, str(e), p.fail_open, policy)
            if p.fail_open:
                log.warning("api-server-proxy: %s: %s", peer, msg)
                return None, body
            log.error("api-server-proxy: refusing %s: %s", peer, msg)
            raise Refused(403, "Forbidden", msg) from None

    async def _read_body(self, client: _Side) -> bytes:
        """The whole request body (an event carries it, and is sent before the request is forwarded)."""
        if client.conn.they_are_waiting_for_100_continue:
            await client.send(h11.InformationalResponse(status_code=100, headers=[]))
        body = bytearray()
        while True:
            event = await client.next_event()
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:
                raise _ClientGone()

    async def _event(self, req: h11.Request, caller: Caller, peer: str, body: bytes, p: Plan) -> None:
        """Send the request's API event to the recorders (enableEvents); Refused (502) when upstream refuses."""
        ua = next((v for k, v in req.headers if k == b"user-agent"), b"")
        try:
            doc = apievent.event(method=req.method.decode("latin-1"), target=req.target.decode("latin-1"),
                                 user_agent=ua.decode("latin-1"), body=body, who=caller.who, now=time.time())
        except apievent.RequestInfoError as e:
            outcome = EventOutcome(error=f"error parsing request {req.method.decode('latin-1')} "
                                         f"{apievent.split_target(req.target.decode('latin-1'))[0]}: {e}")
        else:
            outcome = await self._record_event(p.addrs, apievent.encode(doc), fail_open=p.fail_open)
        for w in outcome.warnings:
            log.warning("api-server-proxy: %s: %s", peer, w)
        if outcome.error:
            msg = f"error recording Kubernetes API request: {outcome.error}"
            log.error("api-server-proxy: refusing %s: %s (%s, enableEvents: true)", peer, msg, caller.policy.which())
            raise Refused(502, "ServiceUnavailable", msg)

    async def _connect(self) -> _Side:
        up = self.upstream
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                up.host, up.port, ssl=up.ssl, server_hostname=up.host if up.ssl else None,
                limit=UPSTREAM_BUFFER), 30)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            log.warning("api-server-proxy: cannot reach the API server at %s:%s: %s", up.host, up.port, e)
            raise Refused(502, "ServiceUnavailable",
                          f"error reaching the API server at {up.host}:{up.port}: {e}") from None
        return _Side(reader, writer, h11.CLIENT)

    async def _exchange(self, client: _Side, req: h11.Request, peer: str, upstream: _Side | None) -> _Side | None:
        """Forward one request and its response; the API server connection to keep, or None."""
        try:
            caller = await self.identify(peer)
            who = caller.imp
            recording, body = await self._recording(req, caller, peer, client)
            headers = forwarded_request_headers(req.headers, host=self.upstream.host_header, who=who,
                                                token=self._token() if who is not None else "")
        except Refused as r:
            await self._refuse(client, r)
            return upstream
        except (_ClientGone, *_GONE):   # the client left while its body was read (for an event)
            raise
        except Exception as e:   # the token file: reported to the caller without detail
            log.error("api-server-proxy: %s", redact(str(e)))
            await self._refuse(client, Refused(500, "InternalError", "the proxy cannot read its own credentials"))
            return upstream
        if recording is None:
            return await self._forward(client, req, headers, upstream, None, body)
        try:
            kept = await self._forward(client, req, headers, upstream, recording, body)
        except BaseException:
            recording.abort()
            raise
        # The rest of the cast and the recorder's confirmation, without holding the client's connection open
        # meanwhile (a session refused by the API server leaves a cast with its header).
        task = asyncio.ensure_future(recording.finish())
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)
        return kept

    async def _forward(self, client: _Side, req: h11.Request, headers: list[tuple[bytes, bytes]],
                       upstream: _Side | None, recording: Recording | None, body: bytes | None = None) -> _Side | None:
        if client.conn.they_are_waiting_for_100_continue:
            await client.send(h11.InformationalResponse(status_code=100, headers=[]))
        bodyless = not any(k in (b"content-length", b"transfer-encoding") for k, _ in headers) or \
            (b"content-length", b"0") in headers
        request = h11.Request(method=req.method, target=req.target, headers=headers)
        fresh = upstream is None or upstream.conn.our_state is not h11.IDLE
        try:
            if fresh:
                if upstream is not None:
                    upstream.abort()
                upstream = await self._connect()
            assert upstream is not None
            try:
                first = await self._send_request(client, upstream, request, body)
            except _GONE:
                if fresh or not bodyless:
                    raise
                # A kept-alive connection the API server had already closed: once more on a new one.
                upstream.abort()
                upstream = await self._connect()
                first = await self._send_request(client, upstream, request, body)
        except Refused as r:
            await self._refuse(client, r)
            return None
        except _GONE as e:
            if upstream is not None:
                upstream.abort()
            if client.conn.our_state is h11.SEND_RESPONSE:
                await self._refuse(client, Refused(502, "ServiceUnavailable",
                                                   f"error talking to the API server: {e!r}"))
            return None
        except BaseException:       # the client went away mid-upload (or the task is cancelled)
            if upstream is not None:
                upstream.abort()
            raise
        try:
            if isinstance(first, h11.InformationalResponse):     # 101: the protocol switched
                await client.send(h11.InformationalResponse(
                    status_code=101, reason=first.reason,
                    headers=forwarded_response_headers(first.headers, upgrade=True)))
                await _pipe(client, upstream, recording)
                upstream.abort()
                return None
            headers = forwarded_response_headers(first.headers)
            if client.conn.their_state is h11.SEND_BODY:     # an answer before the request body ended
                headers.append((b"connection", b"close"))
            await client.send(h11.Response(status_code=first.status_code, reason=first.reason, headers=headers))
            await self._stream_body(client, upstream)
        except BaseException:       # whatever ends the exchange early, this API server connection goes now
            upstream.abort()
            raise
        if upstream.conn.our_state is h11.DONE and upstream.conn.their_state is h11.DONE:
            upstream.conn.start_next_cycle()
            return upstream
        upstream.abort()
        return None

    async def _send_request(self, client: _Side, upstream: _Side, request: h11.Request,
                            whole: bytes | None = None) -> Any:
        """Send the request head and body; the response head (a Response, or a 101 InformationalResponse).

        The head is read while the body is still being sent, as Go's transport does: the API server answers
        a refused write (RBAC's 403) without reading a large body and then closes, so the answer can come
        before the body has gone, and writing on would only fail. The rest of the body is then not sent."""
        await upstream.send(request)
        if whole is not None:        # read whole already (for its API event)
            await upstream.send(*((h11.Data(data=whole),) if whole else ()), h11.EndOfMessage())
            return await self._response_head(upstream)
        # What of the body is already here (all of it for a GET, an upgrade or a small write) goes at once.
        while (event := client.conn.next_event()) is not h11.NEED_DATA:
            if isinstance(event, h11.Data):
                await upstream.send(h11.Data(data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                await upstream.send(h11.EndOfMessage())
                return await self._response_head(upstream)
            else:
                raise _ClientGone()
        body = asyncio.ensure_future(self._send_body(client, upstream))
        head = asyncio.ensure_future(self._response_head(upstream))
        try:
            done, _ = await asyncio.wait({body, head}, return_when=asyncio.FIRST_COMPLETED)
            if head in done:
                return head.result()
            try:
                body.result()
            except _UpstreamWriteFailed as e:
                # the API server may have answered and closed: its answer, if it sent one, is still to read
                try:
                    return await asyncio.wait_for(asyncio.shield(head), 5)
                except (asyncio.TimeoutError, *_GONE):
                    raise e.__cause__ or EOFError("the API server closed the connection") from None
            return await head
        finally:
            for t in (body, head):
                if not t.done():
                    t.cancel()
            await asyncio.gather(body, head, return_exceptions=True)

    async def _send_body(self, client: _Side, upstream: _Side) -> None:
        while True:
            event = await client.next_event()
            if isinstance(event, h11.Data):
                out: Any = h11.Data(data=event.data)
            elif isinstance(event, h11.EndOfMessage):
                out = h11.EndOfMessage()
            else:
                raise _ClientGone()
            try:
                await upstream.send(out)
            except _GONE as e:
                raise _UpstreamWriteFailed() from e
            if isinstance(out, h11.EndOfMessage):
                return

    async def _response_head(self, upstream: _Side) -> Any:
        while True:
            event = await upstream.next_event()
            if isinstance(event, h11.Response):
                return event
            if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                return event
            if isinstance(event, h11.ConnectionClosed):
                raise EOFError("the API server closed the connection")

    async def _stream_body(self, client: _Side, upstream: _Side) -> None:
        """Copy the response body chunk by chunk; stop (and close upstream) as soon as the client goes."""
        # What already arrived with the head (a small response: all of it) goes out without the two tasks.
        while (event := upstream.conn.next_event()) is not h11.NEED_DATA:
            if isinstance(event, h11.Data):
                client.writer.write(client.conn.send(h11.Data(data=event.data)) or b"")
            elif isinstance(event, h11.EndOfMessage):
                client.writer.write(client.conn.send(h11.EndOfMessage()) or b"")
                await client.writer.drain()
                return
            else:
                raise EOFError("the API server closed the connection mid-response")
        await client.writer.drain()
        pump = asyncio.ensure_future(self._pump(client, upstream))
        watch = asyncio.ensure_future(client.reader.read(READ_SIZE))
        try:
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch in done and not watch.exception():
                data = watch.result()
                if not data:          # EOF: the client went away mid-response
                    raise _ClientGone()
                client.conn.receive_data(data)     # a pipelined request: h11 keeps it for later
            await pump
        finally:
            for t in (pump, watch):
                if not t.done():
                    t.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)

    async def _pump(self, client: _Side, upstream: _Side) -> None:
        while True:
            event = await upstream.next_event()
            if isinstance(event, h11.Data):
                await client.send(h11.Data(data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                await client.send(h11.EndOfMessage())
                return
            else:       # the API server closed mid-body: the client's connection must end too
                raise EOFError("the API server closed the connection mid-response")


#: After answering a request whose body had not ended: how long and how much of the rest to read and drop
#: before closing. Closing a socket with unread data sends a reset, which can destroy the answer before the
#: client has read it; the client stops sending once it sees the answer, and `Connection: close`.
LINGER_SECONDS = 5.0
LINGER_BYTES = 64 << 20


async def _linger(client: _Side) -> None:
    transport = client.writer.transport
    try:
        await client.writer.drain()
        if transport.can_write_eof():
            transport.write_eof()        # the answer is complete: the client may see the end at once
        dropped, deadline = 0, time.monotonic() + LINGER_SECONDS
        while dropped < LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
            chunk = await asyncio.wait_for(client.reader.read(READ_SIZE), left)
            if not chunk:
                return
            dropped += len(chunk)
    except (asyncio.TimeoutError, *_GONE):
        pass


async def _pipe(client: _Side, upstream: _Side, recording: Recording | None = None) -> None:
    """After a 101: bytes both ways (what h11 already read first) until either side closes. A recorded session
    hands each chunk to the recording (and waits for the recorder) before passing it on, so that what the
    other side received has been recorded; when an enforced recording breaks, the session ends."""
    async def copy(src: _Side, dst: _Side, feed: Callable[[bytes], None] | None) -> None:
        data, _closed = src.conn.trailing_data
        chunk = bytes(data)
        while True:
            if chunk:
                if feed is not None and recording is not None:
                    feed(chunk)
                    await recording.send()
                dst.writer.write(chunk)
                await dst.writer.drain()
            chunk = await src.reader.read(READ_SIZE)
            if not chunk:
                return

    tasks: list[asyncio.Future[Any]] = [
        asyncio.ensure_future(copy(client, upstream, recording.client if recording else None)),
        asyncio.ensure_future(copy(upstream, client, recording.server if recording else None))]
    if recording is not None and not recording.fail_open:
        tasks.append(asyncio.ensure_future(recording.upload.failed.wait()))   # the recorder went away
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if recording is not None and len(tasks) == 3 and tasks[2] in done and not recording.stopped:
            recording.abort()
            log.error("api-server-proxy: connection to the session recorder errored: %s; failure mode set to "
                      "'fail closed'; closing connection", recording.upload.error)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
