"""The API server proxy applying the callers' recording rules, against the fake API server on loopback."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest

from containerboot.apiproxy.identity import CAP_KUBERNETES
from containerboot.apiproxy.server import AUTH, NOAUTH, RecorderUnavailable
from tests.test_apiproxy_server import WHO, Harness

EXEC = (b"POST /api/v1/namespaces/ns/pods/web/exec?command=touch&command=/tmp/marker HTTP/1.1\r\nHost: x\r\n"
        b"Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n")
WS_EXEC = (b"GET /api/v1/namespaces/ns/pods/web/exec?command=sh HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
           b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
           b"Sec-WebSocket-Protocol: v5.channel.k8s.io\r\n\r\n")
RECORDER_PEER = {"Peer": {"k": {"DNSName": "rec.t.", "Tags": ["tag:rec"], "Online": True,
                                "TailscaleIPs": ["127.0.0.1"]}}}


def who_with(*rules) -> dict:
    return {**WHO, "CapMap": {CAP_KUBERNETES: [{"impersonate": {"groups": ["tailnet-readers"]}}, *rules]}}


async def _exchange(port: int, request: bytes) -> tuple[int, bytes]:
    """The status code and what follows the head (a Status body, or the piped bytes after a 101)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    code = int(head.split(b" ", 2)[1])
    if code == 101:
        writer.write(b"hello")
        got = b""
        while b"HELLO" not in got:
            got += await asyncio.wait_for(reader.read(4096), 10)
        body = got
    else:
        length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:"))
        body = await asyncio.wait_for(reader.readexactly(length), 10)
    writer.close()
    return code, body


@pytest.fixture(params=[AUTH, NOAUTH])
async def proxy(request, tmp_path):
    h = Harness(tmp_path, request.param)
    await h.start()
    status: dict = {}

    async def get_status() -> dict:
        return status

    h.proxy._status = get_status
    h.status = status
    h.tried: list[tuple[str, ...]] = []

    async def start_recording(addrs, session, caller, target, *, fail_open):
        h.tried.append(addrs)       # a recorder that does not take the session
        raise RecorderUnavailable(f'recording: error starting recording on "{addrs[0]}": connection refused')

    h.proxy._start_recording = start_recording
    yield h
    await h.stop()


async def test_enforced_recording_without_a_recorder_refuses_exec_before_the_api_server_sees_it(proxy, caplog):
    proxy.whois_answer = who_with({"recorder": ["tag:rec"], "enforceRecorder": True})
    for request in (EXEC, WS_EXEC):
        code, body = await _exchange(proxy.port, request)
        assert code == 403
        doc = json.loads(body)
        assert doc["kind"] == "Status" and doc["code"] == 403
        assert doc["message"].startswith("forbidden: 'kubectl exec' session must be recorded, but no recorders "
                                         "are available.")
        assert "rule 1 of capability 'tailscale.com/cap/kubernetes'" in doc["message"]
    assert proxy.api.connections == 0        # nothing reached the API server, so nothing ran in the container
    # as upstream, every other request of such a caller is refused too while no recorder is there
    code, body = await _exchange(proxy.port, b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == 403 and 'api request "/api/v1/pods" must be recorded' in json.loads(body)["message"]
    assert proxy.api.connections == 0
    assert "refusing 127.0.0.1" in caplog.text


async def test_enforced_recording_with_a_recorder_that_does_not_take_the_session_refuses_it(proxy, caplog):
    proxy.whois_answer = who_with({"recorder": ["tag:rec"]}, {"enforceRecorder": True})
    proxy.status.update(RECORDER_PEER)
    code, body = await _exchange(proxy.port, EXEC)
    assert code == 403
    msg = json.loads(body)["message"]
    assert proxy.tried == [("127.0.0.1:80",)]       # the tag resolved to the peer's address
    assert msg.startswith("error connecting to session recorders: recording: error starting recording on "
                          "\"127.0.0.1:80\": connection refused; ")
    assert "failure mode is 'fail closed'; closing connection. (rules 1, 2 of capability" in msg
    assert proxy.api.connections == 0
    # other requests go through: a recorder is there
    code, body = await _exchange(proxy.port, b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert code == 200


async def test_a_recorder_without_enforcement_fails_open_with_a_log_line(proxy, caplog):
    caplog.set_level(logging.WARNING)
    proxy.whois_answer = who_with({"recorder": ["tag:rec"]})
    # no peer carries the tag: the session goes on unrecorded, and the log says why
    code, body = await _exchange(proxy.port, EXEC.replace(b"/api/v1/namespaces/ns/pods/web/exec", b"/exec"))
    assert code == 101
    code, body = await _exchange(proxy.port, EXEC)
    assert code != 403
    assert "name no recorder that is on the tailnet: not recording (recording is not enforced)" in caplog.text
    # a recorder that does not take it: the same, with upstream's words
    proxy.status.update(RECORDER_PEER)
    caplog.clear()
    await _exchange(proxy.port, EXEC)
    assert "failure mode is 'fail open'; continuing session without recording." in caplog.text


async def test_a_caller_whose_rules_ask_for_no_recording_is_not_affected(proxy):
    proxy.whois_answer = who_with()
    code, _ = await _exchange(proxy.port, b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert code == 200
