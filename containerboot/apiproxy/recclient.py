"""Uploading a recording to a recorder over the tailnet (adapter): the protocol of upstream's client
(tailscale.com/sessionrecording, ConnectToRecorder), version 1.

The recorders are tried in order; each gets 5 seconds to connect, all of them 30 seconds in all. To a recorder
the recording is a `POST /record` whose body is the cast, sent as it is made (chunked), with
`Expect: 100-continue`: the recorder answers `100 Continue` when it is ready to store the recording, and the
upload starts only then; a recorder that answers anything else, or closes, is skipped for the next. The final
`200 OK` comes once the body has ended and is stored; any other answer, or the connection breaking, while
the session runs is a failed recording (`error`).

Upstream's client first asks whether the recorder speaks version 2 (`HEAD /v2/record` over HTTP/2 without
TLS, whose response streams acknowledgements); this one speaks version 1 only, which every tsrecorder and
our recorder accept.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable

import h11

log = logging.getLogger("containerboot")

PER_DIAL_TIMEOUT = 5.0
ALL_DIALS_TIMEOUT = 30.0


class RecorderError(Exception):
    """Connecting to or uploading to a recorder failed; str(e) says what happened at which address."""


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class Upload:
    """One recording on its way to one recorder."""

    def __init__(self, addr: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 conn: h11.Connection) -> None:
        self.addr, self._reader, self._writer, self._conn = addr, reader, writer, conn
        self.error: str = ""             # set once the upload has failed
        self.failed = asyncio.Event()
        self._answer = asyncio.ensure_future(self._read_answer())
        self._closed = False

    @classmethod
    async def connect(cls, addrs: Iterable[str], *, host_header: str = "") -> Upload:
        """The first recorder of `addrs` that accepts the recording; RecorderError naming each one tried."""
        errors: list[str] = []
        deadline = time.monotonic() + ALL_DIALS_TIMEOUT
        for addr in addrs:
            left = deadline - time.monotonic()
            if left <= 0:
                errors.append(f"recording: error starting recording on {json.dumps(addr)}: out of time "
                              f"({ALL_DIALS_TIMEOUT:.0f} s for all recorders)")
                continue
            try:
                return await cls._start(addr, min(left, PER_DIAL_TIMEOUT), left, host_header)
            except (OSError, asyncio.TimeoutError, h11.ProtocolError, RecorderError, ValueError) as e:
                errors.append(f"recording: error starting recording on {json.dumps(addr)}: {_describe(e)}")
        if not errors:
            raise RecorderError("no recorders configured")
        raise RecorderError("; ".join(errors))

    @classmethod
    async def _start(cls, addr: str, dial_timeout: float, timeout: float, host_header: str) -> Upload:
        host, port = _host_port(addr)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), dial_timeout)
        conn = h11.Connection(h11.CLIENT)
        try:
            writer.write(conn.send(h11.Request(method="POST", target="/record", headers=[
                ("host", host_header or addr), ("expect", "100-continue"), ("transfer-encoding", "chunked"),
                ("content-type", "application/x-asciicast")])) or b"")
            await writer.drain()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await asyncio.wait_for(reader.read(65536), timeout)
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.InformationalResponse) and event.status_code == 100:
                    return cls(addr, reader, writer, conn)
                if isinstance(event, h11.InformationalResponse):
                    continue
                if isinstance(event, h11.Response):
                    raise RecorderError(f"recording: unexpected status: {event.status_code} "
                                        f"{event.reason.decode('latin-1', 'replace')}")
                raise RecorderError("recording: unexpected EOF")
        except BaseException:
            writer.transport.abort()
            raise

    async def _read_answer(self) -> None:
        """The recorder's final answer: 200 after the body ended; anything before that is a failure."""
        try:
            while True:
                event = self._conn.next_event()
                if event is h11.NEED_DATA:
                    data = await self._reader.read(65536)
                    self._conn.receive_data(data)
                    continue
                if isinstance(event, h11.Response):
                    if event.status_code != 200:
                        self._fail(f"recording: unexpected status: {event.status_code} "
                                   f"{event.reason.decode('latin-1', 'replace')}")
                    elif not self._closed:
                        self._fail("recording: the recorder ended the recording early")
                    return
                if isinstance(event, h11.ConnectionClosed):
                    self._fail("recording: the recorder closed the connection")
                    return
        except (OSError, h11.ProtocolError) as e:
            self._fail(f"recording: {_describe(e)}")

    def _fail(self, message: str) -> None:
        if not self.error:
            self.error = message
            self.failed.set()

    async def write(self, data: bytes) -> None:
        """Send cast bytes; RecorderError once the upload has failed (waits while the recorder is slow)."""
        if self.error:
            raise RecorderError(self.error)
        if not data:
            return
        try:
            self._writer.write(self._conn.send(h11.Data(data=data)) or b"")
            await self._writer.drain()
        except (OSError, h11.ProtocolError) as e:
            self._fail(f"recording: error writing to the recorder: {_describe(e)}")
            raise RecorderError(self.error) from None

    async def finish(self, timeout: float = 30.0) -> None:
        """End the body and wait for the recorder's 200 (the recording stored); RecorderError otherwise."""
        self._closed = True
        try:
            if not self.error:
                self._writer.write(self._conn.send(h11.EndOfMessage()) or b"")
                await self._writer.drain()
                await asyncio.wait_for(asyncio.shield(self._answer), timeout)
        except (OSError, h11.ProtocolError, asyncio.TimeoutError) as e:
            self._fail(f"recording: {_describe(e)}")
        finally:
            self.abort()
        if self.error:
            raise RecorderError(self.error)

    def abort(self) -> None:
        self._closed = True
        if not self._answer.done():
            self._answer.cancel()
        self._writer.transport.abort()


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e) or type(e).__name__
