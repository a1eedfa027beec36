"""Version 2 of the recording protocol (adapter): `/v2/record` over HTTP/2 without TLS, with acknowledgements.

Upstream's client (tailscale.com/sessionrecording, connectV2) asks `HEAD /v2/record` on an HTTP/2 connection
(prior knowledge) and, on a 200, sends the recording as the body of `POST /v2/record` while reading the
response: a stream of JSON frames `{"ack": <bytes received so far>}`, and at most one `{"error": "..."}` as
the last frame. It closes the upload when no frame came for 30 seconds, so the recorder sends one every
ACK_INTERVAL even when nothing new arrived.

Here an ack counts only bytes that are on storage: each batch that arrives is appended and fsync'd before it
is acknowledged, and HTTP/2 flow control is given back only then, so a client cannot run far ahead of what is
stored. `/v2/event` answers 404 here: API request events come over HTTP/1.1, as upstream's client sends them
(recorder/server.py).

Needs the `h2` package (`pip install containerboot-py[recorder]`); without it the recorder speaks version 1
only, which upstream's client falls back to.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from .store import Store, Writer

log = logging.getLogger("recorder")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
ACK_INTERVAL = 10.0
WINDOW = 4 << 20

try:
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions
    import h2.settings
    AVAILABLE = True
except ImportError:        # the recorder then speaks version 1 only
    AVAILABLE = False


@dataclass
class _Upload:
    out: Writer
    acked: int = 0
    unacked_flow: int = 0


class V2Connection:
    """One HTTP/2 connection from a recording client."""

    def __init__(self, store: Store, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 peer: str, recorder: Any) -> None:
        self.store, self.reader, self.writer, self.peer, self.recorder = store, reader, writer, peer, recorder
        self.conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=False,
                                                                                header_encoding="utf-8"))
        self.uploads: dict[int, _Upload] = {}

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.writer.write(data)

    async def serve(self, first: bytes) -> None:
        self.conn.initiate_connection()
        # A window of WINDOW per upload (and for the connection): the client sends on while what came before
        # is being made durable, and is held back once that much is waiting (the window comes back only when
        # what it carried is on storage). HTTP/2's default, 64 KiB, would allow one fsync's worth at a time.
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        self.conn.increment_flow_control_window(WINDOW)
        self._flush()
        ticker = asyncio.ensure_future(self._tick())
        try:
            data = first
            while True:
                if data:
                    try:
                        events = self.conn.receive_data(data)
                    except h2.exceptions.ProtocolError as e:
                        log.info("HTTP/2 connection from %s: %s", self.peer, e)
                        self._flush()
                        return
                    await self._handle(events)
                    self._flush()
                    await self.writer.drain()
                data = await self.reader.read(65536)
                if not data:
                    return
        finally:
            ticker.cancel()
            for sid, up in list(self.uploads.items()):
                await self._end(sid, up, complete=False)

    async def _handle(self, events: list[Any]) -> None:
        arrived: dict[int, list[bytes]] = {}
        ended: list[int] = []
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                await self._request(ev.stream_id, {str(k): str(v) for k, v in ev.headers or ()})
            elif isinstance(ev, h2.events.DataReceived):
                up = self.uploads.get(ev.stream_id)
                if up is None:
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    continue
                arrived.setdefault(ev.stream_id, []).append(ev.data)
                up.unacked_flow += ev.flow_controlled_length
            elif isinstance(ev, h2.events.StreamEnded):
                ended.append(ev.stream_id)
            elif isinstance(ev, h2.events.StreamReset):
                up = self.uploads.pop(ev.stream_id, None)
                if up is not None:
                    await self._end(ev.stream_id, up, complete=False)
        for sid, chunks in arrived.items():
            up = self.uploads[sid]
            try:
                await asyncio.to_thread(_append, up.out, b"".join(chunks))
            except OSError as e:
                self._frame(sid, {"error": f"cannot store the recording: {e}"}, end=True)
                self.uploads.pop(sid, None)
                await self._end(sid, up, complete=False)
                continue
            up.acked = up.out.size
            self.conn.acknowledge_received_data(up.unacked_flow, sid)     # only once it is on storage
            up.unacked_flow = 0
            self._frame(sid, {"ack": up.acked})
        for sid in ended:
            up = self.uploads.pop(sid, None)
            if up is not None:
                await self._end(sid, up, complete=True)

    async def _request(self, sid: int, headers: dict[str, str]) -> None:
        method, path = headers.get(":method", ""), headers.get(":path", "").partition("?")[0]
        if path == "/v2/record" and method == "HEAD":
            self.conn.send_headers(sid, [(":status", "200")], end_stream=True)
        elif path == "/v2/record" and method == "POST":
            try:
                out = await asyncio.to_thread(self.store.create)
            except OSError as e:
                log.error("cannot store a recording from %s: %s", self.peer, e)
                self.conn.send_headers(sid, [(":status", "500")], end_stream=True)
                return
            self.uploads[sid] = _Upload(out)
            self.recorder.active += 1
            log.info("recording %s from %s: started (version 2)", out.name, self.peer)
            self.conn.send_headers(sid, [(":status", "200"), ("content-type", "application/json")])
        elif method == "HEAD":
            self.conn.send_headers(sid, [(":status", "404")], end_stream=True)
        else:
            self.conn.send_headers(sid, [(":status", "404"), ("content-type", "text/plain")])
            self.conn.send_data(sid, b"not found\n", end_stream=True)

    def _frame(self, sid: int, doc: dict, end: bool = False) -> None:
        try:
            self.conn.send_data(sid, json.dumps(doc).encode() + b"\n", end_stream=end)
        except h2.exceptions.ProtocolError:
            pass      # the stream is gone (the client reset it)

    async def _end(self, sid: int, up: _Upload, *, complete: bool) -> None:
        try:
            await asyncio.to_thread(lambda: up.out.sync(final=True))
        except OSError:
            pass
        await asyncio.to_thread(up.out.close)
        self.recorder.active -= 1
        if complete:
            self._frame(sid, {"ack": up.out.size}, end=True)
            self._flush()
            log.info("recording %s from %s: stored (%d bytes)", up.out.name, self.peer, up.out.size)
        else:
            log.warning("recording %s from %s: the connection ended before the recording did; %d bytes kept",
                        up.out.name, self.peer, up.out.size)

    async def _tick(self) -> None:
        """An ack now and then for every open upload, so that an idle session's client knows all is well."""
        while True:
            await asyncio.sleep(ACK_INTERVAL)
            for sid, up in self.uploads.items():
                self._frame(sid, {"ack": up.acked})
            self._flush()


def _append(out: Writer, data: bytes) -> None:
    out.write(data)
    out.sync()
