"""The lab's fault-injecting proxy for an API server (labtools.faultproxy) against a small upstream on loopback:
it forwards what it does not break, its faults are what the API server's would be on the wire, watch streams
are cut mid-stream, and its record tells a 429 ignored from one respected. Its use against a real API server
is netns-tests/test_controller_hostile_apiserver.py."""
from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import h11
import httpx
import pytest

from labtools.faultproxy import Decision, FaultProxy, Faults, Record, early_after_429, object_path

NONE = Faults(error_rate=0, lost_answer_rate=0, throttle_rate=0, slow_rate=0, watch_cut_rate=0)


async def _upstream(writes: list[str]) -> tuple[asyncio.AbstractServer, str]:
    """GET answers an object; a write is recorded; ?watch=true streams 50 events, 20 ms apart."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                req = None
                while True:
                    ev = conn.next_event()
                    if ev is h11.NEED_DATA:
                        conn.receive_data(await reader.read(65536))
                    elif isinstance(ev, h11.Request):
                        req = ev
                    elif isinstance(ev, h11.EndOfMessage) or isinstance(ev, h11.ConnectionClosed):
                        break
                if req is None:
                    return
                if b"watch=true" in req.target:
                    writer.write(conn.send(h11.Response(status_code=200, headers=[(b"x-up", b"1")])))
                    for i in range(50):
                        line = json.dumps({"type": "ADDED", "object": {"metadata": {"name": f"o{i}"}}}) + "\n"
                        writer.write(conn.send(h11.Data(data=line.encode())))
                        await writer.drain()
                        await asyncio.sleep(0.02)   # not a wait: paces the watch stream
                    writer.write(conn.send(h11.EndOfMessage()))
                else:
                    if req.method != b"GET":
                        writes.append(req.method.decode())
                    body = json.dumps({"kind": "Secret", "metadata": {"name": "a"}}).encode()
                    writer.write(conn.send(h11.Response(status_code=200, headers=[
                        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())])))
                    writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                await writer.drain()
                conn.start_next_cycle()
        except (OSError, h11.ProtocolError):
            pass
        finally:
            writer.close()
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


async def _with_proxy(faults: Faults, body) -> tuple[list[Record], list[str]]:
    writes: list[str] = []
    up, up_url = await _upstream(writes)
    proxy = FaultProxy(upstream=up_url, upstream_ca=None, faults=faults)
    url = await proxy.start()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            await body(c)
    finally:
        await proxy.aclose()
        up.close()
    return proxy.records(), writes


async def test_forwards_what_it_does_not_break() -> None:
    async def body(c: httpx.AsyncClient) -> None:
        r = await c.get("/api/v1/namespaces/ns/secrets/a")
        assert r.status_code == 200 and r.json()["metadata"]["name"] == "a"
        r = await c.patch("/api/v1/namespaces/ns/secrets/a", json={"data": {}})
        assert r.status_code == 200
        lines = []
        async with c.stream("GET", "/api/v1/namespaces/ns/secrets?watch=true") as s:
            assert s.headers["x-up"] == "1"
            async for ln in s.aiter_lines():
                lines.append(ln)
        assert len(lines) == 50
    records, writes = await _with_proxy(NONE, body)
    assert writes == ["PATCH"]
    assert [(r.method, r.status, r.fault) for r in records] == [("GET", 200, ""), ("PATCH", 200, ""), ("GET", 200, "")]
    assert records[2].watch and records[2].events == 50


async def test_errors_and_throttles_are_the_api_servers_statuses() -> None:
    got = []

    async def body(c: httpx.AsyncClient) -> None:
        for _ in range(40):
            r = await c.post("/api/v1/namespaces/ns/secrets", json={"metadata": {"name": "b"}})
            got.append((r.status_code, r.json().get("reason"), r.headers.get("retry-after")))
    records, writes = await _with_proxy(Faults(seed=3, error_rate=0.3, lost_answer_rate=0.3, throttle_rate=0.3,
                                               slow_rate=0, watch_cut_rate=0), body)
    kinds = Counter(r.fault for r in records)
    assert set(kinds) == {"500", "500-after-write", "429", ""}, kinds
    # a lost answer: the write was done upstream, the client got a 500
    assert len(writes) == kinds["500-after-write"] + kinds[""]
    for (status, reason, retry_after), r in zip(got, records, strict=True):
        assert status == r.status
        if r.fault in ("500", "500-after-write"):
            assert (status, reason) == (500, "InternalError")
        if r.fault == "429":
            assert (status, reason) == (429, "TooManyRequests") and retry_after in ("1", "2")
            assert r.retry_after == int(retry_after) and r.body_name == "b"


async def test_a_watch_stream_is_cut_mid_stream() -> None:
    async def body(c: httpx.AsyncClient) -> None:
        lines = []
        with pytest.raises(httpx.HTTPError):       # the chunked body never ends: a broken stream, not an end
            async with c.stream("GET", "/api/v1/namespaces/ns/secrets?watch=true") as s:
                async for ln in s.aiter_lines():
                    lines.append(ln)
        assert 3 <= len(lines) < 50
        r = await c.get("/api/v1/namespaces/ns/secrets/a")     # the proxy serves on
        assert r.status_code == 200
    faults = Faults(error_rate=0, lost_answer_rate=0, throttle_rate=0, slow_rate=0, watch_cut_rate=1,
                    watch_cut_events=(3, 3), watch_cut_seconds=(30, 30))
    records, _ = await _with_proxy(faults, body)
    assert records[0].fault == "watch-cut" and 3 <= records[0].events < 50


def test_decisions_follow_the_seed_and_the_rates() -> None:
    f = Faults(seed=1, error_rate=0.04, throttle_rate=0.04, lost_answer_rate=0.02)
    a = [f.decide(random.Random(5), "PATCH", False) for _ in range(1)]
    rng1, rng2 = random.Random(5), random.Random(5)
    seq1 = [f.decide(rng1, m, w) for m, w in [("GET", False), ("PATCH", False), ("GET", True)] * 300]
    seq2 = [f.decide(rng2, m, w) for m, w in [("GET", False), ("PATCH", False), ("GET", True)] * 300]
    assert seq1 == seq2 and a[0] == seq1[1]
    kinds = Counter(d.fault for d in seq1)
    assert 15 <= kinds["500"] <= 60 and 15 <= kinds["429"] <= 60 and kinds["500-after-write"] > 0
    # a read never gets a lost answer; every watch not failed outright is cut (watch_cut_rate 1)
    assert all(d.fault != "500-after-write" for d in seq1[0::3])
    assert all(d.fault in ("watch-cut", "500", "429") for d in seq1[2::3])
    assert Decision("").fault == ""


def _rec(t: float, path: str, fault: str = "", retry_after: int = 0, query: str = "", agent: str = "x") -> Record:
    return Record(t=t, method="GET", path=path, query=query, user_agent=agent, status=429 if fault else 200,
                  fault=fault, retry_after=retry_after)


def test_early_after_429_is_per_object_and_counts_the_status_subresource() -> None:
    svc = "/api/v1/namespaces/ns/services/a"
    records = [_rec(0.0, svc, "429", 2), _rec(1.0, "/api/v1/namespaces/ns/services/b"), _rec(2.5, svc),
               _rec(3.0, svc + "/status", "429", 1), _rec(3.5, svc), _rec(10.0, "/api/v1/services", query="watch=true"),
               _rec(10.2, "/api/v1/services")]
    early = early_after_429(records)
    assert [(r.t, round(s, 2)) for r, s in early] == [(3.5, 0.5)]
    assert early_after_429(records, exempt=[svc]) == []
    # a list by label selector is about its selection
    coll = "/api/v1/namespaces/t/secrets"
    lists = [_rec(0.0, coll, "429", 2, query="labelSelector=p%3Da"), _rec(0.5, coll, query="labelSelector=p%3Db"),
             _rec(1.0, coll, query="labelSelector=p%3Da")]
    assert [r.t for r, _ in early_after_429(lists)] == [1.0]
    # a 429 holds back the client it answered, not another client (User-Agent) asking for the same thing
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    two = [_rec(0.0, crds, "429", 2, query="watch=true", agent="a"), _rec(1.0, crds, query="watch=true", agent="b"),
           _rec(1.5, crds, query="watch=true", agent="a")]
    assert [(r.t, r.user_agent) for r, _ in early_after_429(two)] == [(1.5, "a")]
    assert object_path(svc + "/status") == svc
    sts = "/apis/apps/v1/namespaces/t/statefulsets/x"
    assert object_path(sts + "/status") == sts
    assert object_path("/apis/tailscale.com/v1alpha1/connectors/c") == "/apis/tailscale.com/v1alpha1/connectors/c"
    assert object_path("/api/v1/namespaces/t/secrets") == "/api/v1/namespaces/t/secrets"
