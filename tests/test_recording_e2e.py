"""Sessions recorded end to end on loopback: kubectl's frames through the API server proxy to a stand-in API
server, and the recording to our recorder, stored as a cast file."""
from __future__ import annotations

import asyncio
import json
import logging
import struct
import subprocess
import sys
from pathlib import Path

import h11
import pytest

from containerboot.apiproxy import recclient
from containerboot.apiproxy.identity import CAP_KUBERNETES
from containerboot.apiproxy.server import AUTH, NOAUTH, ApiServerProxy, Upstream
from recorder import v2 as recorder_v2
from recorder.server import Recorder
from recorder.store import FileStore
from tests.support.spdyws import SpdyClient, data, resize, ws_frame
from tests.support.waits import until_async


class ExecApiServer:
    """Answers exec with 101 and plays a container: over SPDY it answers stdin (stream 3) with `out: <line>`
    on stdout (stream 5); over WebSocket it answers channel 0 on channel 1. `requests` counts what came."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while (req := conn.next_event()) is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            assert isinstance(req, h11.Request)
            self.requests.append(req.target)
            while not isinstance(e := conn.next_event(), h11.EndOfMessage):
                if e is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
            ws = req.method == b"GET"
            writer.write(conn.send(h11.InformationalResponse(status_code=101, headers=[
                (b"connection", b"Upgrade"), (b"upgrade", b"websocket" if ws else b"SPDY/3.1")])) or b"")
            buf = bytearray(conn.trailing_data[0])
            writer.write(ws_frame(b"\x01welcome\r\n") if ws else b"")
            while True:
                if ws:
                    while len(buf) >= 6 and len(buf) >= 6 + (buf[1] & 0x7F):
                        n = buf[1] & 0x7F
                        key, payload = buf[2:6], bytes(b ^ buf[2 + (i % 4)] for i, b in enumerate(buf[6:6 + n]))
                        del buf[:6 + n]
                        del key
                        if payload[:1] == b"\x00":
                            writer.write(ws_frame(b"\x01out: " + payload[1:]))
                else:
                    while len(buf) >= 8 and len(buf) >= 8 + int.from_bytes(buf[5:8], "big"):
                        n = int.from_bytes(buf[5:8], "big")
                        frame = bytes(buf[:8 + n])
                        del buf[:8 + n]
                        if not frame[0] & 0x80 and struct.unpack(">I", frame[:4])[0] == 3:
                            writer.write(data(5, b"out: " + frame[8:]))
                await writer.drain()
                chunk = await reader.read(65536)
                if not chunk:
                    return
                buf += chunk
        except (OSError, h11.ProtocolError, AssertionError):
            pass
        finally:
            self.closed.set()
            writer.close()


WHO = {"Node": {"Name": "laptop.tail.example.", "StableID": "nSTABLE", "User": 3, "Tags": []},
       "UserProfile": {"LoginName": "alice@example.com"}}


class Lab:
    def __init__(self, tmp: Path, mode: str = AUTH) -> None:
        self.tmp, self.mode = tmp, mode
        self.api = ExecApiServer()
        self.store = FileStore(str(tmp / "recordings"))
        self.recorder = Recorder(self.store, ui=True)
        self.rules: list[dict] = []

    async def start(self) -> None:
        api_port = await self.api.start()
        self.rec_server = await asyncio.start_server(self.recorder.handle, "127.0.0.1", 0)
        self.rec_addr = f"127.0.0.1:{self.rec_server.sockets[0].getsockname()[1]}"

        async def whois(addr: str) -> dict:
            return {**WHO, "CapMap": {CAP_KUBERNETES: self.rules}}

        self.proxy = ApiServerProxy(mode=self.mode, upstream=Upstream("127.0.0.1", api_port, None, b"api"),
                                    token=lambda: "sa-token", whois=whois)
        self.server = await asyncio.start_server(self.proxy.handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.server.close()
        self.rec_server.close()
        self.api.server.close()

    def casts(self) -> list[list]:
        out = []
        for e in self.store.list():
            p = self.store.path(e.name)
            assert p
            out.append([json.loads(x) for x in Path(p).read_text().splitlines()])
        return out


@pytest.fixture
async def lab(tmp_path):
    lab = Lab(tmp_path)
    await lab.start()
    yield lab
    await lab.stop()


SPDY_EXEC = (b"POST /api/v1/namespaces/team-a/pods/web/exec?command=sh&container=app&stdin=true&stdout=true&tty=true "
             b"HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
             b"X-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n")
WS_EXEC = (b"GET /api/v1/namespaces/team-a/pods/web/exec?command=sh&container=app&stdin=true&stdout=true&tty=true "
           b"HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: v5.channel.k8s.io\r\n\r\n")


async def open_session(port: int, request: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


async def read_until(reader: asyncio.StreamReader, needle: bytes, got: bytes = b"") -> bytes:
    while needle not in got:
        chunk = await asyncio.wait_for(reader.read(65536), 10)
        if not chunk:
            raise EOFError(f"closed before {needle!r}; got {got!r}")
        got += chunk
    return got


async def wait_for(cond, what: str) -> None:
    await until_async(cond, 10, what)


@pytest.mark.parametrize("mode, version", [(AUTH, 2), (NOAUTH, 2), (AUTH, 1)])
async def test_a_spdy_exec_is_recorded_with_its_output_and_resizes(tmp_path, mode, version, monkeypatch, caplog):
    """Version 2 of the protocol (acks) with a recorder that speaks it, else version 1."""
    caplog.set_level(logging.INFO)
    if version == 1:
        monkeypatch.setattr(recorder_v2, "AVAILABLE", False)
    lab = Lab(tmp_path, mode)
    await lab.start()
    try:
        lab.rules = [{"recorderAddrs": [lab.rec_addr], "enforceRecorder": True}]
        reader, writer = await open_session(lab.port, SPDY_EXEC)
        c = SpdyClient()
        writer.write(c.syn_stream(1, "error") + c.syn_stream(3, "stdin") + c.syn_stream(5, "stdout") +
                     c.syn_stream(7, "resize") + data(7, resize(80, 24)))
        writer.write(data(3, b"echo recorded\n"))
        await read_until(reader, b"out: echo recorded\n")
        writer.write(data(7, resize(132, 43)) + data(3, b"exit\n"))
        await read_until(reader, b"out: exit\n")
        writer.close()
        await wait_for(lambda: lab.casts() and lab.recorder.active == 0, "the recording stored")
        (cast,) = lab.casts()
        assert ("started (version 2)" in caplog.text) == (version == 2)
        h = cast[0]
        assert (h["version"], h["width"], h["height"], h["srcNodeUser"], h["srcNode"], h["command"]) == \
            (2, 80, 24, "alice@example.com", "laptop.tail.example", "sh")
        assert h["kubernetes"] == {"PodName": "web", "Namespace": "team-a", "Container": "app", "SessionType": "exec"}
        events = [e[1:] for e in cast[1:]]
        assert events == [["o", "out: echo recorded\n"], ["r", "132x43"], ["o", "out: exit\n"]]
        pytest.importorskip("asciinema")
        (entry,) = lab.store.list()
        out = subprocess.run([sys.executable, "-m", "asciinema", "cat", lab.store.path(entry.name) or ""],
                             capture_output=True, timeout=60)
        assert out.returncode == 0 and out.stdout == b"out: echo recorded\nout: exit\n", out.stderr
    finally:
        await lab.stop()


async def test_a_websocket_exec_is_recorded(lab):
    lab.rules = [{"recorderAddrs": [lab.rec_addr]}]
    reader, writer = await open_session(lab.port, WS_EXEC)
    writer.write(ws_frame(b"\x04" + resize(100, 30), masked=True) + ws_frame(b"\x00whoami\n", masked=True))
    await read_until(reader, b"out: whoami\n")
    writer.close()
    await wait_for(lambda: lab.casts() and lab.recorder.active == 0, "the recording stored")
    (cast,) = lab.casts()
    assert (cast[0]["width"], cast[0]["height"]) == (100, 30)
    assert [e[1:] for e in cast[1:]] == [["o", "welcome\r\n"], ["o", "out: whoami\n"]]


async def test_recorder_gone_mid_session_ends_an_enforced_session_and_keeps_what_was_acknowledged(lab, caplog):
    caplog.set_level(logging.INFO)
    lab.rules = [{"recorderAddrs": [lab.rec_addr], "enforceRecorder": True}]
    reader, writer = await open_session(lab.port, SPDY_EXEC.replace(b"tty=true", b"tty=false"))
    c = SpdyClient()
    writer.write(c.syn_stream(3, "stdin") + c.syn_stream(5, "stdout") + data(3, b"before\n"))
    await read_until(reader, b"out: before\n")
    await wait_for(lambda: "out: before" in json.dumps(lab.casts()), "the output stored")
    # the recorder goes away: its open connections break
    lab.rec_server.close()
    for t in [t for t in asyncio.all_tasks() if "Recorder.handle" in repr(t.get_coro())]:
        t.cancel()
    await wait_for(lambda: "failure mode set to 'fail closed'; closing connection" in caplog.text,
                   "the proxy noticed")
    with pytest.raises((EOFError, ConnectionError)):
        writer.write(data(3, b"after\n"))
        await read_until(reader, b"out: after\n")
    (cast,) = lab.casts()
    assert cast[-1][1:] == ["o", "out: before\n"]


async def test_no_recorder_taking_an_enforced_session_refuses_it_and_a_fail_open_one_runs(lab, caplog):
    lab.rec_server.close()
    await lab.rec_server.wait_closed()
    lab.rules = [{"recorderAddrs": [lab.rec_addr], "enforceRecorder": True}]
    reader, writer = await asyncio.open_connection("127.0.0.1", lab.port)
    writer.write(SPDY_EXEC)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 403")
    body = await asyncio.wait_for(reader.read(), 10)
    msg = json.loads(body)["message"]
    assert msg.startswith(f'error connecting to session recorders: recording: error starting recording on '
                          f'"{lab.rec_addr}"')
    assert "failure mode is 'fail closed'; closing connection." in msg
    assert lab.api.requests == []
    lab.rules = [{"recorderAddrs": [lab.rec_addr]}]
    reader, writer = await open_session(lab.port, SPDY_EXEC)
    writer.close()
    assert len(lab.api.requests) == 1
    assert "failure mode is 'fail open'; continuing session without recording." in caplog.text


async def test_the_recorder_lists_recordings_and_serves_them(lab):
    lab.rules = [{"recorderAddrs": [lab.rec_addr]}]
    reader, writer = await open_session(lab.port, WS_EXEC)
    writer.write(ws_frame(b"\x04" + resize(100, 30), masked=True))
    await read_until(reader, b"welcome")
    writer.close()
    await wait_for(lambda: lab.casts() and lab.recorder.active == 0, "the recording stored")
    import httpx
    async with httpx.AsyncClient(base_url=f"http://{lab.rec_addr}") as c:
        page = (await c.get("/")).text
        (entry,) = lab.store.list()
        assert "alice@example.com" in page and "team-a/web" in page and entry.name in page
        cast = await c.get(f"/recordings/{entry.name}")
        assert cast.headers["content-type"] == "application/x-asciicast"
        assert json.loads(cast.text.splitlines()[0])["srcNodeID"] == "nSTABLE"
        play = await c.get(f"/recordings/{entry.name}/play")
        assert play.status_code == 200 and f'AsciinemaPlayer.create("/recordings/{entry.name}"' in play.text
        js = await c.get("/static/asciinema-player.min.js")
        assert js.headers["content-type"].startswith("text/javascript") and b"AsciinemaPlayer" in js.content
        assert (await c.get("/static/asciinema-player.css")).status_code == 200
        assert (await c.get("/static/README.md")).status_code == 404
        assert (await c.get("/recordings/nope.cast/play")).status_code == 404
        assert (await c.get("/recordings/..%2f..%2fetc%2fpasswd")).status_code == 404
        assert (await c.head("/v2/record")).status_code == 404


async def test_a_recorder_that_stops_acknowledging_ends_an_enforced_session(lab, monkeypatch, caplog):
    """Version 2: no ack frame for the ack window (upstream: 30 s, shortened here) fails the upload."""
    monkeypatch.setattr(recclient, "ACK_WINDOW", 1.0)
    monkeypatch.setattr(recorder_v2, "ACK_INTERVAL", 3600.0)
    real_handle = recorder_v2.V2Connection._handle

    async def deaf(self, events):          # takes the data, and acknowledges nothing after the probe
        for ev in events:
            if type(ev).__name__ == "DataReceived":
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        await real_handle(self, [ev for ev in events if type(ev).__name__ != "DataReceived"])
    monkeypatch.setattr(recorder_v2.V2Connection, "_handle", deaf)
    lab.rules = [{"recorderAddrs": [lab.rec_addr], "enforceRecorder": True}]
    reader, writer = await open_session(lab.port, SPDY_EXEC.replace(b"tty=true", b"tty=false"))
    c = SpdyClient()
    writer.write(c.syn_stream(3, "stdin") + c.syn_stream(5, "stdout"))
    await wait_for(lambda: "did not receive ack frames from the recorder in 1s" in caplog.text, "the ack window")
    with pytest.raises((EOFError, ConnectionError)):
        writer.write(data(3, b"after\n"))
        await read_until(reader, b"out: after\n")
