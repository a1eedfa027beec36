"""Sending an API request event to a recorder over the tailnet (adapter): upstream's SendEvent
(tailscale.com/sessionrecording) and its use by the proxy (recordRequestAsEvent).

To one recorder: `HEAD /v2/event` over HTTP/1.1 (5 s to connect, 10 s for the answer); a 200 says the recorder
takes events, a 404 that it does not (not an error: the event is skipped for that recorder), anything else is an
error. Then `POST /v2/event` with the event as a JSON body on the same connection, and a 200 is success (30 s
for the answer, where upstream's client waits without limit: a recorder that stalls must not hold the request
forever).

To the caller's recorders: each in turn until one takes the event. When none does, the request is refused
(502) with every recorder's error, unless recording fails open and no recorder said that it does not take
events, in which case the request goes on with a warning: upstream's decision, kept as it is (a recorder
without `/v2/event` is only a warning, also when recording is enforced).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import h11

log = logging.getLogger("containerboot")

DIAL_TIMEOUT = 5.0
PROBE_TIMEOUT = 10.0
POST_TIMEOUT = 30.0
READ_SIZE = 65536


class EventError(Exception):
    """Sending the event to one recorder failed; str(e) in upstream's words."""


class EventsNotSupported(EventError):
    """The recorder answered 404 to `HEAD /v2/event`."""


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__


async def _response(conn: h11.Connection, reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status, body = 0, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(READ_SIZE))
            continue
        if isinstance(event, h11.InformationalResponse):
            continue
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, body
        else:
            raise EOFError("the recorder closed the connection")


async def send_event(addr: str, data: bytes) -> None:
    """Send one event to the recorder at `addr` ("100.64.0.5:80"); EventsNotSupported or EventError."""
    host, port = _host_port(addr)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT)
    except (OSError, asyncio.TimeoutError) as e:
        raise EventError(f"error checking support for `/v2/event` endpoint: dial {addr}: {_describe(e)}") from None
    conn = h11.Connection(h11.CLIENT)
    try:
        try:
            writer.write(conn.send(h11.Request(method="HEAD", target="/v2/event", headers=[("host", addr)])) or b"")
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
            status, body = await asyncio.wait_for(_response(conn, reader), PROBE_TIMEOUT)
        except (OSError, EOFError, asyncio.TimeoutError, h11.ProtocolError) as e:
            raise EventError(f"error checking support for `/v2/event` endpoint: {_describe(e)}") from None
        if status == 404:
            raise EventsNotSupported(f"recorder at address {json.dumps(addr)} does not support \"/v2/event\" "
                                     "endpoint")
        if status != 200:
            raise EventError(f"error checking support for `/v2/event` endpoint: server returned non-OK status: "
                             f"{status}: {body.decode('utf-8', 'replace')}")
        try:
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                raise EOFError("the recorder closed the connection after its answer")
            conn.start_next_cycle()
            writer.write(conn.send(h11.Request(method="POST", target="/v2/event", headers=[
                ("host", addr), ("content-type", "application/json"),
                ("content-length", str(len(data)))])) or b"")
            writer.write(conn.send(h11.Data(data=data)) or b"")
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
            status, body = await asyncio.wait_for(_response(conn, reader), POST_TIMEOUT)
        except (OSError, EOFError, asyncio.TimeoutError, h11.ProtocolError) as e:
            raise EventError(f"error sending request: {_describe(e)}") from None
        if status != 200:
            raise EventError(f"server returned non-OK status: {status}: {body.decode('utf-8', 'replace')}")
    finally:
        writer.transport.abort()


@dataclass(frozen=True)
class EventOutcome:
    """What became of one request's event: `error` set means the request must be refused (a 502)."""

    error: str = ""
    warnings: tuple[str, ...] = ()


async def record_event(addrs: Iterable[str], data: bytes, *, fail_open: bool) -> EventOutcome:
    """Send the event to the first recorder of `addrs` that takes it (upstream's recordRequestAsEvent)."""
    addrs = tuple(addrs)
    if not addrs:
        return EventOutcome(error="no recorder addresses specified")
    errors: list[str] = []
    warnings: list[str] = []
    unsupported = False
    for addr in addrs:
        try:
            await send_event(addr, data)
            return EventOutcome(warnings=tuple(warnings))
        except EventsNotSupported as e:
            warnings.append(str(e))
            unsupported = True
        except EventError as e:
            errors.append(f"error sending event to recorder with address {json.dumps(addr)}: {e}")
    joined = "\n".join(errors)
    if not unsupported and fail_open:
        warnings.append(f"[unexpected] failed to send event to recorders with errors: {joined}; failure mode is "
                        "'fail open'; continuing request without recording.")
        return EventOutcome(warnings=tuple(warnings))
    return EventOutcome(error=joined, warnings=tuple(warnings))
