"""Our recorder's protocol handling on loopback: what it acknowledges is on storage (version 1: the final 200;
version 2: each ack), a connection cut mid-recording keeps what arrived, names cannot leave the directory."""
from __future__ import annotations

import asyncio
import json
import os

import h2.config
import h2.connection
import h2.events
import pytest

from recorder.__main__ import ConfigError, settings
from recorder.server import Recorder
from recorder.store import FileStore, entry
from tests.support.waits import until_async


@pytest.fixture
async def rec(tmp_path):
    store = FileStore(str(tmp_path / "rec"))
    r = Recorder(store, ui=True)
    server = await asyncio.start_server(r.handle, "127.0.0.1", 0)
    r.port = server.sockets[0].getsockname()[1]
    r.store = store
    yield r
    server.close()


def files(store: FileStore) -> list[bytes]:
    return [open(os.path.join(store.directory, e.name), "rb").read() for e in store.list()]


async def wait_for(cond, what: str):
    await until_async(cond, 10, what)


async def test_v1_continue_then_each_chunk_stored_and_200_only_after_the_end(rec):
    reader, writer = await asyncio.open_connection("127.0.0.1", rec.port)
    writer.write(b"POST /record HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 100")
    line = b'{"version":2,"width":0,"height":0,"timestamp":1}\n'
    writer.write(b"%x\r\n%s\r\n" % (len(line), line))
    await wait_for(lambda: files(rec.store) == [line], "the first chunk on storage")
    assert rec.active == 1
    writer.write(b"0\r\n\r\n")
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
    # the file is closed (in a thread) after the answer is sent: the count drops then
    await wait_for(lambda: rec.active == 0, "the recording closed")


async def test_v1_a_connection_cut_mid_recording_keeps_what_arrived(rec):
    reader, writer = await asyncio.open_connection("127.0.0.1", rec.port)
    writer.write(b"POST /record HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"6\r\n[1,2]\n\r\n")
    await wait_for(lambda: files(rec.store) == [b"[1,2]\n"], "the chunk on storage")
    writer.transport.abort()
    await wait_for(lambda: rec.active == 0, "the recording closed")
    assert files(rec.store) == [b"[1,2]\n"]


class H2Client:
    """Upstream's client's side of version 2, as the tests need it."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.frames: list[dict] = []
        self.status: dict[int, str] = {}
        self.ended: set[int] = set()
        self._buf = b""

    async def send(self) -> None:
        self.writer.write(self.conn.data_to_send())
        await self.writer.drain()

    async def pump(self, until) -> None:
        while not until():
            data = await asyncio.wait_for(self.reader.read(65536), 10)
            assert data, "the recorder closed the connection"
            for ev in self.conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    self.status[ev.stream_id] = dict(ev.headers)[":status"]
                elif isinstance(ev, h2.events.DataReceived):
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    self._buf += ev.data
                    while b"\n" in self._buf:
                        line, self._buf = self._buf.split(b"\n", 1)
                        self.frames.append(json.loads(line))
                elif isinstance(ev, h2.events.StreamEnded):
                    self.ended.add(ev.stream_id)
            await self.send()


async def test_v2_probe_and_acks_count_only_what_is_on_storage(rec):
    reader, writer = await asyncio.open_connection("127.0.0.1", rec.port)
    c = H2Client(reader, writer)
    c.conn.send_headers(1, [(":method", "HEAD"), (":path", "/v2/record"), (":scheme", "http"),
                            (":authority", "r")], end_stream=True)
    c.conn.send_headers(3, [(":method", "HEAD"), (":path", "/v2/event"), (":scheme", "http"),
                            (":authority", "r")], end_stream=True)
    await c.send()
    await c.pump(lambda: 1 in c.status and 3 in c.status)
    assert (c.status[1], c.status[3]) == ("200", "404")
    c.conn.send_headers(5, [(":method", "POST"), (":path", "/v2/record"), (":scheme", "http"), (":authority", "r")])
    first = b'{"version":2,"width":80,"height":24,"timestamp":1}\n'
    c.conn.send_data(5, first)
    await c.send()
    await c.pump(lambda: {"ack": len(first)} in c.frames)
    assert files(rec.store) == [first]              # what was acknowledged is in the file (fsync'd first)
    second = b'[0.5,"o","hi"]\n'
    c.conn.send_data(5, second, end_stream=True)
    await c.send()
    await c.pump(lambda: 5 in c.ended)
    assert c.status[5] == "200" and c.frames[-1] == {"ack": len(first) + len(second)}
    assert files(rec.store) == [first + second] and rec.active == 0


def test_names_outside_the_store_are_not_recordings(tmp_path):
    store = FileStore(str(tmp_path))
    (tmp_path / "secret.txt").write_text("x")
    assert store.path("../secret.txt") is None and store.path("secret.txt") is None
    assert store.path("20261128T001647Z-82dc4897.cast") is None       # a valid name, but no such file
    assert store.list() == []


def test_a_listing_reads_the_header_and_survives_a_bad_one():
    e = entry("n.cast", b'{"version":2,"timestamp":5,"srcNodeTags":["tag:ci"],"srcNode":"ci.t",'
                        b'"kubernetes":{"PodName":"web"}}\n', 10)
    assert (e.user, e.node, e.timestamp, e.kubernetes["PodName"]) == ("tag:ci", "ci.t", 5, "web")
    assert entry("n.cast", b"garbage", 3).user == ""


@pytest.mark.parametrize("env, words", [
    ({"TSRECORDER_DST": "s3://s3.example", "TSRECORDER_LISTEN": ":1"}, "TSRECORDER_BUCKET is empty"),
    ({"TSRECORDER_DST": "s3://s3.example", "TSRECORDER_BUCKET": "b", "TSRECORDER_LISTEN": ":1"},
     "AWS_ACCESS_KEY_ID is empty: S3 storage needs credentials"),
    ({"TSRECORDER_DST": "rel/dir", "TSRECORDER_LISTEN": ":1"}, "want an absolute directory such as /data/recordings, or s3://<endpoint>"),
    ({"TSRECORDER_UI": "maybe", "TSRECORDER_LISTEN": ":1"}, "TSRECORDER_UI='maybe': want true or false"),
    ({"TSRECORDER_LISTEN": "80"}, "TSRECORDER_LISTEN='80': want HOST:PORT"),
    ({}, "set TS_SOCKET"),
])
def test_settings_name_the_variable_and_the_fix(env, words):
    with pytest.raises(ConfigError) as e:
        settings(env)
    assert words in str(e.value)


async def _http(port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
    body = await reader.readexactly(length) if length and not raw.startswith(b"HEAD") else b""
    writer.close()
    return int(head.split()[1]), body


def _post(doc: bytes) -> bytes:
    return b"POST /v2/event HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: " + \
        str(len(doc)).encode() + b"\r\n\r\n" + doc


async def test_events_are_taken_stored_whole_with_their_id_and_listed(rec):
    assert await _http(rec.port, b"HEAD /v2/event HTTP/1.1\r\nHost: r\r\n\r\n") == (200, b"")
    doc = {"type": "kubernetes-api-request", "id": "", "timestamp": 1795823730, "userAgent": "kubectl/v1.34.1",
           "request": {"method": "GET", "path": "/api/v1/namespaces/team-a/pods", "body": "", "queryParameters": {}},
           "kubernetes": {"Verb": "list", "Namespace": "team-a", "Resource": "pods", "Name": ""},
           "source": {"node": "laptop.tail.example", "nodeID": "nS", "nodeUser": "alice@example.com"}}
    assert (await _http(rec.port, _post(json.dumps(doc).encode())))[0] == 200
    [(name, data)] = rec.store.list_events()
    assert json.loads(data) == {**doc, "id": f"events/{name}"}
    assert os.listdir(os.path.join(rec.store.directory, "events")) == [name]     # no temporary file left
    assert rec.store.list() == []                                               # not a recording
    status, page = await _http(rec.port, b"GET /events HTTP/1.1\r\nHost: r\r\n\r\n")
    assert status == 200
    for cell in (b"2026-11-27 23:55:30 UTC", b"alice@example.com", b"laptop.tail.example", b"<td>list</td>",
                 b"team-a/pods", b"kubectl/v1.34.1", f'href="/events/{name}"'.encode()):
        assert cell in page
    assert await _http(rec.port, f"GET /events/{name} HTTP/1.1\r\nHost: r\r\n\r\n".encode()) == (200, data)
    assert (await _http(rec.port, b"GET /events/..%2Fx.json HTTP/1.1\r\nHost: r\r\n\r\n"))[0] == 404


async def test_an_event_that_is_not_a_json_object_or_too_large_is_refused(rec, monkeypatch):
    status, body = await _http(rec.port, _post(b"[1,2]"))
    assert status == 400 and b"not a JSON object" in body
    status, body = await _http(rec.port, _post(b"{not json"))
    assert status == 400
    from recorder import server
    monkeypatch.setattr(server, "MAX_EVENT", 100)
    status, body = await _http(rec.port, _post(json.dumps({"x": "y" * 200}).encode()))
    assert status == 413 and body == b"event larger than 100 bytes\n"
    assert rec.store.list_events() == []
