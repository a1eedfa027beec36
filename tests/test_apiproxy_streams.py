"""kubectl's exec streams read as they pass (SPDY and WebSocket), and the cast made of them (pure)."""
from __future__ import annotations

import json

import pytest

from containerboot.apiproxy.cast import Cast, header, session_info
from containerboot.apiproxy.streams import Output, Resize, SpdySession, StreamError, WebSocketSession, _spdy3_dictionary
from tests.support.spdyws import SpdyClient, data, ping, resize, ws_frame


def feed_bytewise(parse, stream: bytes) -> list:
    """Events of a byte stream fed one byte at a time: no frame boundary is assumed."""
    out = []
    for i in range(len(stream)):
        out += parse(stream[i:i + 1])
    return out


def test_the_spdy3_dictionary_is_the_specs():
    d = _spdy3_dictionary()
    assert len(d) == 1423 and d.startswith(b"\x00\x00\x00\x07options") and d.endswith(b",*,enq=0.")


def spdy_session_bytes() -> tuple[bytes, bytes]:
    c = SpdyClient()
    client = (c.syn_stream(1, "error") + c.syn_stream(3, "stdin") + c.syn_stream(5, "stdout") +
              c.syn_stream(7, "stderr") + c.syn_stream(9, "resize") + data(9, resize(80, 24)) + ping(1) +
              data(3, b"ls\n") + data(9, resize(100, 30)) + c.syn_reply(11))
    server = (data(5, b"file-a\n") + ping(2) + data(7, "caf\u00e9 err\n".encode()) + data(3, b"not output") +
              data(1, b"exit status"))
    return client, server


@pytest.mark.parametrize("bytewise", [False, True])
def test_spdy_streams_are_told_apart_by_their_syn_stream_types(bytewise):
    client, server = spdy_session_bytes()
    s = SpdySession()
    got_c = feed_bytewise(s.client, client) if bytewise else s.client(client)
    got_s = feed_bytewise(s.server, server) if bytewise else s.server(server)
    assert got_c == [Resize(80, 24), Resize(100, 30)]
    assert got_s == [Output("stdout", b"file-a\n"), Output("stderr", "caf\u00e9 err\n".encode())]


def test_bytes_that_are_not_spdy_are_an_error():
    with pytest.raises(StreamError, match="not a SPDY frame"):
        SpdySession().client(b"GET / HTTP/1.1\r\n\r\n" * 2)
    with pytest.raises(StreamError, match="does not decompress"):
        SpdySession().client(b"\x80\x03\x00\x01\x00\x00\x00\x0e" + b"\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00garb")


def ws_session_bytes() -> tuple[bytes, bytes]:
    client = (ws_frame(b"\x04" + resize(80, 24), masked=True) + ws_frame(b"\x00ls\n", masked=True) +
              ws_frame(b"", opcode=9, masked=True) +
              # a resize message in two fragments with a ping between them
              ws_frame(b'\x04{"Width":120,', fin=False, masked=True) + ws_frame(b"", opcode=10, masked=True) +
              ws_frame(b'"Height":40}', opcode=0, masked=True))
    big = b"x" * 70000
    server = (ws_frame(b"\x01file-a\n") + ws_frame(b"\x02oops", fin=False) + ws_frame(b"!\n", opcode=0) +
              ws_frame(b"\x03{\"status\":\"Success\"}") + ws_frame(b"\x01" + big) + ws_frame(b"\x03\xe8", opcode=8))
    return client, server


@pytest.mark.parametrize("bytewise", [False, True])
def test_websocket_channels_fragments_and_control_frames(bytewise):
    client, server = ws_session_bytes()
    s = WebSocketSession()
    got_c = feed_bytewise(s.client, client) if bytewise else s.client(client)
    got_s = feed_bytewise(s.server, server) if bytewise else s.server(server)
    assert got_c == [Resize(80, 24), Resize(120, 40)]
    assert got_s == [Output("stdout", b"file-a\n"), Output("stderr", b"oops"), Output("stderr", b"!\n"),
                     Output("stdout", b"x" * 70000)]


def test_websocket_errors():
    with pytest.raises(StreamError, match="continuation frame outside a message"):
        WebSocketSession().server(ws_frame(b"x", opcode=0))
    with pytest.raises(StreamError, match="not a terminal size"):
        WebSocketSession().client(ws_frame(b"\x04{\"Width\": \"wide\"}", masked=True))


WHO_USER = {"Node": {"Name": "laptop.tail.example.", "StableID": "nXYZ", "User": 7, "Tags": []},
            "UserProfile": {"LoginName": "alice@example.com"}}
WHO_TAGGED = {"Node": {"Name": "ci.tail.example.", "StableID": "nCI", "User": 9, "Tags": ["tag:ci"]},
              "UserProfile": {"LoginName": "tagged-devices"}}
TARGET = b"/api/v1/namespaces/team-a/pods/web/exec?command=sh&command=-c&command=ls&container=app&stdin=true&tty=true"


def test_the_header_has_upstreams_fields_for_a_user_and_for_a_tagged_node():
    info = session_info(WHO_USER, "exec", "team-a", "web", TARGET)
    assert header(info, timestamp=1700000000, width=80, height=24) == {
        "version": 2, "width": 80, "height": 24, "timestamp": 1700000000, "command": "sh -c ls",
        "srcNode": "laptop.tail.example", "srcNodeID": "nXYZ", "srcNodeUserID": 7, "srcNodeUser": "alice@example.com",
        "env": None, "sshUser": "", "localUser": "", "connectionID": "",
        "kubernetes": {"PodName": "web", "Namespace": "team-a", "Container": "app", "SessionType": "exec"}}
    h = header(session_info(WHO_TAGGED, "attach", "ns", "p", b"/x?container="), timestamp=1)
    assert h["srcNodeTags"] == ["tag:ci"] and "srcNodeUser" not in h and "srcNodeUserID" not in h
    assert "command" not in h and h["kubernetes"]["SessionType"] == "attach"


def lines(b: bytes) -> list:
    return [json.loads(x) for x in b.decode().splitlines()]


def test_a_terminal_session_holds_output_until_the_first_size_then_records_resizes():
    cast = Cast(session_info(WHO_USER, "exec", "team-a", "web", TARGET), start=100.0, timestamp=1700000000)
    assert cast.begin() == b""
    assert cast.events(100.5, [Output("stdout", b"$ ")]) == b""
    out = lines(cast.events(101.0, [Resize(80, 24), Output("stdout", "caf\u00e9"[:3].encode() + b"\xc3")]))
    assert out[0]["width"] == 80 and out[0]["height"] == 24
    assert out[1:] == [[0.5, "o", "$ "], [1.0, "o", "caf"]]
    out = lines(cast.events(102.25, [Output("stdout", b"\xa9\n"), Resize(100, 30)]))
    assert out == [[2.25, "o", "\u00e9\n"], [2.25, "r", "100x30"]]
    assert lines(cast.end(103.0)) == []


def test_a_session_without_a_terminal_starts_with_its_header_and_ignores_sizes():
    info = session_info(WHO_USER, "exec", "team-a", "web", TARGET.replace(b"tty=true", b"tty=false"))
    cast = Cast(info, start=0.0, timestamp=5)
    first = lines(cast.begin())
    assert first[0]["width"] == 0 and first[0]["timestamp"] == 5
    assert lines(cast.events(1.0, [Resize(80, 24), Output("stderr", b"\xff")])) == [[1.0, "o", "\ufffd"]]


def test_a_terminal_session_that_never_sends_a_size_still_gets_its_header_at_the_end():
    cast = Cast(session_info(WHO_USER, "exec", "team-a", "web", TARGET), start=0.0, timestamp=5)
    cast.events(1.0, [Output("stdout", b"hi")])
    out = lines(cast.end(2.0))
    assert out[0]["version"] == 2 and out[1] == [1.0, "o", "hi"]


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0), max_size=12), st.lists(st.integers(min_value=0), max_size=12))
def test_any_split_of_a_session_reads_the_same(cuts_c, cuts_s):
    for make, (client, server) in ((SpdySession, spdy_session_bytes()), (WebSocketSession, ws_session_bytes())):
        whole = make()
        want = (whole.client(client), whole.server(server))
        s = make()
        got_c = [e for part in _split(client, cuts_c) for e in s.client(part)]
        got_s = [e for part in _split(server, cuts_s) for e in s.server(part)]
        # output may come in more pieces than frames; what was written, per stream and in order, is the same
        assert got_c == want[0]
        joined = lambda evs: [(e.stream, e.data) for e in evs]   # noqa: E731
        assert joined(got_s) == joined(want[1])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_garbage_is_a_stream_error_or_nothing_never_a_crash(data, ws):
    s = WebSocketSession() if ws else SpdySession()
    for feed in (s.client, s.server):
        try:
            feed(data)
        except StreamError:
            pass
