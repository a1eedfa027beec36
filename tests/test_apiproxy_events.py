"""API request events (`enableEvents`): the event's shape (the API server's reading of the request, the caller),
and end to end on loopback: requests through the API server proxy to a stand-in API server, each event stored by
our recorder before the request is forwarded; a recorder that is down, that does not take events, or that
fails, with and without enforceRecorder."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path

import h11
import pytest

from containerboot.apiproxy import apievent
from containerboot.apiproxy.identity import CAP_KUBERNETES
from containerboot.apiproxy.server import AUTH, ApiServerProxy, Upstream
from recorder.server import Recorder
from recorder.store import FileStore
from tests.test_recording_e2e import SPDY_EXEC, ExecApiServer, open_session

USER = {"Node": {"Name": "laptop.tail.example.", "StableID": "nSTABLE", "User": 3, "Tags": []},
        "UserProfile": {"ID": 3, "LoginName": "alice@example.com"}}
TAGGED = {"Node": {"Name": "ci.tail.example.", "StableID": "nCI", "User": 9, "Tags": ["tag:ci"]},
          "UserProfile": {"ID": 9, "LoginName": "tagged-devices"}}


@pytest.mark.parametrize("method,target,want", [
    # the cases k8s.io/apiserver's own tests cover, read as the API server reads them
    ("GET", "/api/v1/namespaces/team-a/pods", dict(Verb="list", Namespace="team-a", Resource="pods", Name="",
                                                    Parts=["pods"])),
    ("GET", "/api/v1/namespaces/team-a/pods/web", dict(Verb="get", Resource="pods", Name="web", Parts=["pods", "web"])),
    ("GET", "/api/v1/pods?watch=true&labelSelector=app%3Dweb&resourceVersion=5",
     dict(Verb="watch", Namespace="", Resource="pods", LabelSelector="app=web")),
    ("GET", "/api/v1/pods?watch=", dict(Verb="watch")),        # an empty boolean parameter is true
    ("GET", "/api/v1/pods?watch=0", dict(Verb="list")),
    ("GET", "/api/v1/watch/namespaces/team-a/pods", dict(Verb="watch", Namespace="team-a", Resource="pods",
                                                         FieldSelector="")),
    ("GET", "/api/v1/namespaces/team-a/pods?fieldSelector=metadata.name%3Dweb,status.phase%21%3DFailed",
     dict(Verb="list", Name="web", FieldSelector="metadata.name=web,status.phase!=Failed")),
    ("GET", "/api/v1/namespaces/team-a/pods?fieldSelector=metadata.name%21%3Dweb", dict(Verb="list", Name="")),
    ("POST", "/apis/apps/v1/namespaces/team-a/deployments", dict(Verb="create", APIPrefix="apis", APIGroup="apps",
                                                                 APIVersion="v1", Resource="deployments")),
    ("PATCH", "/apis/apps/v1/namespaces/team-a/deployments/web/scale",
     dict(Verb="patch", Name="web", Subresource="scale", Parts=["deployments", "web", "scale"])),
    ("DELETE", "/api/v1/namespaces/team-a/pods", dict(Verb="deletecollection")),
    ("DELETE", "/api/v1/namespaces/team-a/pods/web", dict(Verb="delete", Name="web")),
    ("PUT", "/api/v1/namespaces/team-a/finalize", dict(Verb="update", Resource="namespaces", Name="team-a",
                                                       Subresource="finalize")),
    ("GET", "/api/v1/namespaces/team-a", dict(Verb="get", Resource="namespaces", Name="team-a")),
    ("GET", "/api/v1/nodes/n1/proxy/metrics/x", dict(Verb="get", Resource="nodes", Name="n1", Subresource="proxy")),
    ("GET", "/api/v1/proxy/nodes/n1/metrics", dict(Verb="proxy", Resource="nodes", Name="n1", Subresource="")),
    ("POST", "/api/v1/namespaces/team-a/pods/web/exec?command=sh&container=app",
     dict(Verb="create", Resource="pods", Name="web", Subresource="exec")),
    ("GET", "/version", dict(IsResourceRequest=False, Verb="get", Path="/version", Parts=None, Resource="")),
    ("GET", "/apis/apps", dict(IsResourceRequest=False, Verb="get", APIPrefix="")),
    ("GET", "/apis/apps/v1", dict(IsResourceRequest=False, APIPrefix="apis", APIGroup="")),
    ("GET", "/api/v1/namespaces/a%2Fb/pods", dict(Namespace="a", Resource="b", Path="/api/v1/namespaces/a/b/pods")),
])
def test_the_event_reads_the_request_as_the_api_server_does(method, target, want):
    got = apievent.request_info(method, target).as_json()
    assert set(got) == {"IsResourceRequest", "Path", "Verb", "APIPrefix", "APIGroup", "APIVersion", "Namespace",
                        "Resource", "Subresource", "Name", "Parts", "FieldSelector", "LabelSelector"}
    want = {"IsResourceRequest": True, "Path": target.partition("?")[0], **want}
    assert {k: got[k] for k in want} == want


def test_a_path_the_api_server_cannot_read_is_an_error():
    with pytest.raises(apievent.RequestInfoError, match="unable to determine kind and namespace"):
        apievent.request_info("GET", "/api/v1/watch")


def test_the_event_names_the_user_or_the_tags_and_carries_the_body():
    e = apievent.event(method="POST", target="/api/v1/namespaces/a/configmaps?dryRun=All&fieldManager=kubectl",
                       user_agent="kubectl/v1.34.1", body=b'{"kind":"ConfigMap"}', who=USER, now=1795823730.7)
    assert e["type"] == "kubernetes-api-request" and e["id"] == "" and e["timestamp"] == 1795823730
    assert e["userAgent"] == "kubectl/v1.34.1"
    assert e["request"] == {"method": "POST", "path": "/api/v1/namespaces/a/configmaps?dryRun=All&fieldManager=kubectl",
                            "body": base64.b64encode(b'{"kind":"ConfigMap"}').decode(),
                            "queryParameters": {"dryRun": ["All"], "fieldManager": ["kubectl"]}}
    assert e["source"] == {"node": "laptop.tail.example", "nodeID": "nSTABLE", "nodeUserID": 3,
                           "nodeUser": "alice@example.com"}
    assert e["destination"] == {"node": "", "nodeID": ""}
    t = apievent.event(method="GET", target="/version", user_agent="", body=b"", who=TAGGED, now=0)
    assert t["source"] == {"node": "ci.tail.example", "nodeID": "nCI", "nodeTags": ["tag:ci"]}
    assert t["request"]["body"] == "" and t["request"]["queryParameters"] == {}
    line = apievent.encode(t)
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and json.loads(line) == t


class JsonApiServer:
    """Answers every request with a small JSON object; keeps (method, target, body) of each."""

    def __init__(self) -> None:
        self.requests: list[tuple[bytes, bytes, bytes]] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                body = b""
                while not isinstance(req := conn.next_event(), h11.Request):
                    if req is h11.NEED_DATA:
                        conn.receive_data(await reader.read(65536))
                    elif isinstance(req, h11.ConnectionClosed):
                        return
                while not isinstance(e := conn.next_event(), h11.EndOfMessage):
                    if e is h11.NEED_DATA:
                        conn.receive_data(await reader.read(65536))
                    elif isinstance(e, h11.Data):
                        body += e.data
                self.requests.append((req.method, req.target, body))
                out = b'{"kind":"PodList","items":[]}'
                writer.write(conn.send(h11.Response(status_code=200, headers=[
                    (b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())])) or b"")
                writer.write(conn.send(h11.Data(data=out)) or b"")
                writer.write(conn.send(h11.EndOfMessage()) or b"")
                await writer.drain()
                conn.start_next_cycle()
        except (OSError, h11.ProtocolError):
            pass
        finally:
            writer.close()


class Lab:
    def __init__(self, tmp: Path) -> None:
        self.api = JsonApiServer()
        self.exec_api = ExecApiServer()
        self.store = FileStore(str(tmp / "recordings"))
        self.recorder = Recorder(self.store, ui=True)
        self.rules: list[dict] = []
        self.who = USER

    async def start(self, api: JsonApiServer | ExecApiServer | None = None) -> None:
        api_port = await (api or self.api).start()
        self.rec_server = await asyncio.start_server(self.recorder.handle, "127.0.0.1", 0)
        self.rec_addr = f"127.0.0.1:{self.rec_server.sockets[0].getsockname()[1]}"

        async def whois(addr: str) -> dict:
            return {**self.who, "CapMap": {CAP_KUBERNETES: self.rules}}

        self.proxy = ApiServerProxy(mode=AUTH, upstream=Upstream("127.0.0.1", api_port, None, b"api"),
                                    token=lambda: "sa-token", whois=whois)
        self.server = await asyncio.start_server(self.proxy.handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for s in (self.server, self.rec_server, self.api.server if hasattr(self.api, "server") else None):
            if s is not None:
                s.close()

    def events(self) -> list[dict]:
        return [json.loads(d) for _, d in self.store.list_events()]

    async def request(self, method: str, target: str, body: bytes = b"", *,
                      expect: bool = False) -> tuple[int, dict]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = (f"{method} {target} HTTP/1.1\r\nHost: x\r\nUser-Agent: kubectl/v1.34.1 (linux/amd64)\r\n"
                f"Content-Length: {len(body)}\r\n" + ("Expect: 100-continue\r\n" if expect else "") + "\r\n")
        writer.write(head.encode())
        if expect:
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 100")
        writer.write(body)
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method=method, target=target, headers=[("host", "x"),
                                                                      ("content-length", str(len(body)))]))
        if body:
            conn.send(h11.Data(data=body))
        conn.send(h11.EndOfMessage())
        status, out = 0, b""
        while True:
            e = conn.next_event()
            if e is h11.NEED_DATA:
                conn.receive_data(await asyncio.wait_for(reader.read(65536), 60))
            elif isinstance(e, h11.Response):
                status = e.status_code
            elif isinstance(e, h11.Data):
                out += e.data
            elif isinstance(e, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        writer.close()
        return status, json.loads(out)


@pytest.fixture
async def lab(tmp_path):
    lab = Lab(tmp_path)
    await lab.start()
    yield lab
    await lab.stop()


async def test_a_kubectl_get_is_stored_as_an_event_before_it_reaches_the_api_server(lab):
    lab.rules = [{"recorderAddrs": [lab.rec_addr], "enableEvents": True, "enforceRecorder": True}]
    status, body = await lab.request("GET", "/api/v1/namespaces/team-a/pods?limit=500")
    assert status == 200 and body["kind"] == "PodList"
    [e] = lab.events()
    assert e["type"] == "kubernetes-api-request" and e["id"].startswith("events/") and e["id"].endswith(".json")
    assert e["kubernetes"]["Verb"] == "list" and e["kubernetes"]["Namespace"] == "team-a"
    assert e["kubernetes"]["Resource"] == "pods"
    assert e["request"]["method"] == "GET" and e["request"]["path"] == "/api/v1/namespaces/team-a/pods?limit=500"
    assert e["request"]["queryParameters"] == {"limit": ["500"]}
    assert e["source"]["nodeUser"] == "alice@example.com" and e["userAgent"] == "kubectl/v1.34.1 (linux/amd64)"
    assert lab.api.requests == [(b"GET", b"/api/v1/namespaces/team-a/pods?limit=500", b"")]
    # the list page of the recorder shows it
    page = lab.recorder.events_page().decode()
    assert "alice@example.com" in page and "team-a/pods" in page and "list" in page


async def test_a_write_carries_its_body_in_the_event_and_still_reaches_the_api_server_whole(lab):
    lab.rules = [{"recorderAddrs": [lab.rec_addr], "enableEvents": True}]
    body = json.dumps({"kind": "ConfigMap", "data": {"k": "v" * 200_000}}).encode()
    for expect in (False, True):
        status, _ = await lab.request("POST", "/api/v1/namespaces/team-a/configmaps", body, expect=expect)
        assert status == 200
    assert [r[2] for r in lab.api.requests] == [body, body]
    events = lab.events()
    assert len(events) == 2
    for e in events:
        assert base64.b64decode(e["request"]["body"]) == body and e["kubernetes"]["Verb"] == "create"


async def test_without_enable_events_nothing_is_sent(lab):
    lab.rules = [{"recorderAddrs": [lab.rec_addr]}]
    status, _ = await lab.request("GET", "/api/v1/pods")
    assert status == 200 and lab.events() == []


async def _dead_addr() -> str:
    s = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = s.sockets[0].getsockname()[1]
    s.close()
    await s.wait_closed()
    return f"127.0.0.1:{port}"


async def test_recorder_down_with_enforcement_refuses_the_request_before_the_api_server(lab, caplog):
    dead = await _dead_addr()
    lab.rules = [{"recorderAddrs": [dead], "enableEvents": True, "enforceRecorder": True}]
    with caplog.at_level(logging.ERROR, logger="containerboot"):
        status, body = await lab.request("GET", "/api/v1/pods")
    assert status == 502 and lab.api.requests == []
    assert body["message"].startswith("error recording Kubernetes API request: error sending event to recorder "
                                      f"with address \"{dead}\": error checking support for `/v2/event` endpoint")
    assert "enableEvents: true" in caplog.text


async def test_recorder_down_without_enforcement_logs_and_forwards(lab, caplog):
    dead = await _dead_addr()
    lab.rules = [{"recorderAddrs": [dead], "enableEvents": True}]
    with caplog.at_level(logging.WARNING, logger="containerboot"):
        status, _ = await lab.request("GET", "/api/v1/pods")
    assert status == 200 and len(lab.api.requests) == 1
    assert "[unexpected] failed to send event to recorders with errors" in caplog.text
    assert "failure mode is 'fail open'; continuing request without recording." in caplog.text


async def test_the_next_recorder_takes_the_event_when_the_first_is_down(lab):
    lab.rules = [{"recorderAddrs": [await _dead_addr(), lab.rec_addr], "enableEvents": True, "enforceRecorder": True}]
    status, _ = await lab.request("GET", "/api/v1/pods")
    assert status == 200 and len(lab.events()) == 1


async def _recorder_answering(head_status: int, post_status: int = 200) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                while not isinstance(req := conn.next_event(), h11.Request):
                    if req is h11.NEED_DATA:
                        conn.receive_data(await reader.read(65536))
                    elif isinstance(req, h11.ConnectionClosed):
                        return
                while not isinstance(e := conn.next_event(), h11.EndOfMessage):
                    if e is h11.NEED_DATA:
                        conn.receive_data(await reader.read(65536))
                code = head_status if req.method == b"HEAD" else post_status
                msg = b"" if req.method == b"HEAD" else b"bucket unavailable"
                writer.write(conn.send(h11.Response(status_code=code, headers=[
                    (b"content-length", str(len(msg)).encode())])) or b"")
                writer.write(conn.send(h11.Data(data=msg)) or b"" if msg else b"")
                writer.write(conn.send(h11.EndOfMessage()) or b"")
                await writer.drain()
                conn.start_next_cycle()
        except (OSError, h11.ProtocolError):
            pass
        finally:
            writer.close()

    s = await asyncio.start_server(handle, "127.0.0.1", 0)
    return s, f"127.0.0.1:{s.sockets[0].getsockname()[1]}"


async def test_a_recorder_without_events_is_a_warning_even_when_enforced_as_upstream(lab, caplog):
    s, addr = await _recorder_answering(404)
    lab.rules = [{"recorderAddrs": [addr], "enableEvents": True, "enforceRecorder": True}]
    with caplog.at_level(logging.WARNING, logger="containerboot"):
        status, _ = await lab.request("GET", "/api/v1/pods")
    s.close()
    assert status == 200 and len(lab.api.requests) == 1
    assert f'recorder at address "{addr}" does not support "/v2/event" endpoint' in caplog.text


async def test_a_recorder_that_fails_to_store_refuses_an_enforced_request(lab):
    s, addr = await _recorder_answering(200, 500)
    lab.rules = [{"recorderAddrs": [addr], "enableEvents": True, "enforceRecorder": True}]
    status, body = await lab.request("GET", "/api/v1/pods")
    s.close()
    assert status == 502 and lab.api.requests == []
    assert body["message"].endswith("server returned non-OK status: 500: bucket unavailable")


async def test_an_exec_with_events_sends_its_event_then_is_recorded(tmp_path):
    lab = Lab(tmp_path)
    await lab.start(lab.exec_api)
    try:
        lab.rules = [{"recorderAddrs": [lab.rec_addr], "enableEvents": True, "enforceRecorder": True}]
        reader, writer = await open_session(lab.port, SPDY_EXEC)
        writer.close()
        [e] = lab.events()
        assert e["kubernetes"]["Subresource"] == "exec" and e["kubernetes"]["Name"] == "web"
        assert e["request"]["queryParameters"]["command"] == ["sh"]
        for _ in range(100):
            if lab.store.list():
                break
            await asyncio.sleep(0.05)   # poll: until the cast is stored (5 s at most)
        assert len(lab.store.list()) == 1
    finally:
        lab.server.close()
        lab.rec_server.close()
        lab.exec_api.server.close()


async def test_a_client_that_leaves_mid_body_sends_no_event_and_reaches_nothing(lab, caplog):
    lab.rules = [{"recorderAddrs": [lab.rec_addr], "enableEvents": True, "enforceRecorder": True}]
    caplog.set_level(logging.INFO, logger="containerboot")
    reader, writer = await asyncio.open_connection("127.0.0.1", lab.port)
    writer.write(b"POST /api/v1/namespaces/a/configmaps HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"kind\"")
    await writer.drain()
    writer.close()
    for _ in range(100):
        if lab.proxy.connections == 0:
            break
        await asyncio.sleep(0.02)   # poll: until the proxy has closed the connection (2 s at most)
    assert lab.proxy.connections == 0
    assert lab.events() == [] and lab.api.requests == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []   # not a proxy fault
    status, _ = await lab.request("GET", "/api/v1/pods")      # the proxy serves the next caller
    assert status == 200 and len(lab.events()) == 1
