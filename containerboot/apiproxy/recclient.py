"""Uploading a recording to a recorder over the tailnet (adapter): the protocol of upstream's client
(tailscale.com/sessionrecording, ConnectToRecorder), version 1.

The recorders are tried in order; each gets 5 seconds to connect, all of them 30 seconds in all. To a recorder
the recording is a `POST /record` whose body is the cast, sent as it is made (chunked), with
`Expect: 100-continue`: the recorder answers `100 Continue` when it is ready to store the recording, and the
upload starts only then; a recorder that answers anything else, or closes, is skipped for the next. The final
`200 OK` comes once the body has ended and is stored; any other answer, or the connection breaking, while
the session runs is a failed recording (`error`).

As upstream's client, it first asks whether the recorder speaks version 2 (`HEAD /v2/record` over HTTP/2
without TLS, prior knowledge; UploadV2): if so the recording goes as the body of `POST /v2/record`, whose
response streams `{"ack": <bytes>}` frames; no frame for 30 s, an `{"error": ...}` frame or a broken
connection fails the upload. A recorder that does not answer the probe with a 200 over HTTP/2 gets version 1.
Version 2 needs the `h2` package (in the image); without it, version 1 only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

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
    async def connect(cls, addrs: Iterable[str], *, host_header: str = "") -> Upload | UploadV2:
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
                if H2:
                    try:
                        return await UploadV2.start(addr, min(left, PER_DIAL_TIMEOUT), left)
                    except NoV2:
                        left = deadline - time.monotonic()
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


# ---- version 2: /v2/record over HTTP/2 without TLS, with acknowledgements ------------------------------------

#: Upstream's limits: the HEAD probe's time, and how long an upload may go without an ack frame.
PROBE_TIMEOUT = 10.0
ACK_WINDOW = 30.0

try:
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions
    H2 = True
except ImportError:     # version 1 only
    H2 = False


class NoV2(Exception):
    """The recorder does not speak version 2: upstream's client then uses version 1."""


class UploadV2:
    """One recording on its way to one recorder over `/v2/record`: the response streams `{"ack": n}` frames;
    no frame for ACK_WINDOW seconds, an `{"error": ...}` frame or a broken connection fails the upload."""

    def __init__(self, addr: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Any) -> None:
        self.addr, self._reader, self._writer, self._conn = addr, reader, writer, conn
        self.error = ""
        self.failed = asyncio.Event()
        self.acked = 0
        self.sent = 0
        self._sid = 0
        self._buf = b""
        self._status: dict[int, str] = {}
        self._ended: dict[int, asyncio.Event] = {}
        self._window = asyncio.Event()
        self._last_ack = time.monotonic()
        self._closed = False
        self._tasks: list[asyncio.Future[Any]] = []

    @classmethod
    async def start(cls, addr: str, dial_timeout: float, timeout: float) -> UploadV2:
        """Probe (`HEAD /v2/record`), then `POST /v2/record`; NoV2 when the recorder does not speak HTTP/2
        or answers the probe with anything but 200; RecorderError when the POST is refused."""
        host, port = _host_port(addr)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), dial_timeout)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        up = cls(addr, reader, writer, conn)
        up._tasks.append(asyncio.ensure_future(up._read()))
        try:
            probe = await up._request("HEAD", end_stream=True)
            await asyncio.wait_for(up._head(probe), min(PROBE_TIMEOUT, timeout))
            if up._status.get(probe) != "200":
                raise NoV2(f"probe answered {up._status.get(probe)}")
            up._sid = await up._request("POST", end_stream=False)
            await asyncio.wait_for(up._head(up._sid), timeout)
            if up._status.get(up._sid) != "200":
                raise RecorderError(f"recording: unexpected status: {up._status.get(up._sid)}")
        except (NoV2, RecorderError):
            up.abort()
            raise
        except (OSError, asyncio.TimeoutError, h2.exceptions.ProtocolError, EOFError) as e:
            up.abort()
            raise NoV2(_describe(e)) from None
        up._last_ack = time.monotonic()
        up._tasks.append(asyncio.ensure_future(up._watch_acks()))
        return up

    async def _request(self, method: str, *, end_stream: bool) -> int:
        sid = self._conn.get_next_available_stream_id()
        self._ended[sid] = asyncio.Event()
        self._conn.send_headers(sid, [(":method", method), (":path", "/v2/record"), (":scheme", "http"),
                                      (":authority", self.addr)], end_stream=end_stream)
        await self._flush()
        return sid

    async def _head(self, sid: int) -> None:
        while sid not in self._status:
            if self.failed.is_set():
                raise EOFError(self.error)
            self._window.clear()
            await self._window.wait()       # set on every read, and on failure

    async def _flush(self) -> None:
        data = self._conn.data_to_send()
        if data:
            self._writer.write(data)
            await self._writer.drain()

    async def _read(self) -> None:
        try:
            while True:
                data = await self._reader.read(65536)
                if not data:
                    raise EOFError("the recorder closed the connection")
                for ev in self._conn.receive_data(data):
                    self._event(ev)
                self._window.set()           # wakes writers and whoever waits for a response
                await self._flush()
        except (OSError, EOFError, h2.exceptions.ProtocolError) as e:
            if not (self._closed and self._ended.get(self._sid, asyncio.Event()).is_set()):
                self._fail(f"recording: {_describe(e)}")
            self._window.set()

    def _event(self, ev: Any) -> None:
        if isinstance(ev, h2.events.ResponseReceived):
            self._status[ev.stream_id] = next((str(v) for k, v in ev.headers or () if str(k) == ":status"), "")
        elif isinstance(ev, h2.events.DataReceived):
            self._conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            if ev.stream_id != self._sid:
                return
            self._buf += ev.data
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                try:
                    frame = json.loads(line)
                except ValueError:
                    self._fail(f"recording: unexpected error receiving acks: {line[:100]!r}")
                    return
                if frame.get("error"):
                    self._fail(f"recording: received error from the recorder: {json.dumps(frame['error'])}")
                    return
                self.acked = int(frame.get("ack") or self.acked)
                self._last_ack = time.monotonic()
        elif isinstance(ev, h2.events.StreamEnded):
            if ev.stream_id in self._ended:
                self._ended[ev.stream_id].set()
            if ev.stream_id == self._sid and not self._closed:
                self._fail("recording: the recorder ended the recording early")
        elif isinstance(ev, h2.events.StreamReset) and ev.stream_id == self._sid:
            self._fail("recording: the recorder reset the upload")
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self._fail("recording: the recorder closed the connection")

    async def _watch_acks(self) -> None:
        while not self.failed.is_set():
            left = self._last_ack + ACK_WINDOW - time.monotonic()
            if left <= 0:
                self._fail(f"did not receive ack frames from the recorder in {ACK_WINDOW:.0f}s")
                self._writer.transport.abort()
                return
            await asyncio.sleep(min(left, 1.0))

    def _fail(self, message: str) -> None:
        if not self.error:
            self.error = message
            self.failed.set()
            self._window.set()

    async def write(self, data: bytes) -> None:
        """Send cast bytes as HTTP/2 flow control allows (waiting while the recorder has not taken them)."""
        view = memoryview(data)
        while view:
            if self.error:
                raise RecorderError(self.error)
            try:
                room = min(self._conn.local_flow_control_window(self._sid), self._conn.max_outbound_frame_size)
                if room <= 0:
                    self._window.clear()
                    await self._window.wait()
                    continue
                self._conn.send_data(self._sid, bytes(view[:room]))
                await self._flush()
            except (OSError, h2.exceptions.ProtocolError) as e:
                self._fail(f"recording: error writing to the recorder: {_describe(e)}")
                raise RecorderError(self.error) from None
            self.sent += min(room, len(view))
            view = view[room:]
        if self.error:
            raise RecorderError(self.error)

    async def finish(self, timeout: float = 30.0) -> None:
        """End the upload and wait for the recorder to end its response (every byte acknowledged)."""
        self._closed = True
        try:
            if not self.error:
                self._conn.end_stream(self._sid)
                await self._flush()
                await asyncio.wait_for(self._ended[self._sid].wait(), timeout)
                if self.acked < self.sent and not self.error:
                    self._fail(f"recording: the recorder acknowledged {self.acked} of {self.sent} bytes")
        except (OSError, h2.exceptions.ProtocolError, asyncio.TimeoutError) as e:
            self._fail(f"recording: {_describe(e)}")
        finally:
            self.abort()
        if self.error:
            raise RecorderError(self.error)

    def abort(self) -> None:
        self._closed = True
        for t in self._tasks:
            if not t.done():
                t.cancel()
        self._writer.transport.abort()
