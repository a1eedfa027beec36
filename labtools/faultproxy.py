"""A fault-injecting HTTP(S) proxy for a real Kubernetes API server: what a client meets from a hostile one.

It sits between a client (the controller, kopf's watches included) and a real kube-apiserver and, at random
with a seed, answers a request itself or changes its answer:

* ``500``: an ``InternalError`` Status (``etcdserver: request timed out``) instead of forwarding the request;
* ``500-after-write``: a write is forwarded and done, but its answer is replaced by that 500 (the answer lost
  after the commit: the client cannot know whether the write happened);
* ``429``: a ``TooManyRequests`` Status with ``Retry-After`` (whole seconds, as the API server's priority and
  fairness sends it);
* ``slow``: the request waits before it is forwarded;
* ``watch-cut``: a watch stream is dropped mid-stream (the connection is aborted, no end of the chunked body)
  after a number of events or seconds, whichever comes first.

409s are not made here: a real API server's admission webhook gives them (labtools.conflictwebhook), so the
conflict carries the API server's own wording and the write is really refused.

Every request is recorded (``Record``: method, path, query, the proxy's monotonic clock when it arrived, the
status the client got, the fault): ``early_after_429`` finds any request for an object sooner than a 429 for it
allowed (per client), ``faults_by_kind`` counts what was injected. The decision (``Faults.decide``) is pure given the
random generator; the shell is asyncio with h11 on the client side and httpx to the API server.

    proxy = FaultProxy(upstream="https://127.0.0.1:6443", upstream_ca="ca.crt", faults=Faults(seed=7),
                       cert=("proxy.crt", "proxy.key"))      # cert: serve HTTPS (signed by the cluster CA)
    url = proxy.start_in_thread()      # https://127.0.0.1:<port>; proxy.records(); proxy.stop()
"""
from __future__ import annotations

import asyncio
import json
import random
import ssl
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

import h11
import httpx

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: hop-by-hop and framing headers: h11 and httpx frame each side themselves
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer",
                  b"upgrade", b"host", b"content-length", b"accept-encoding"})


@dataclass(frozen=True)
class Faults:
    """How hostile: per request, the chance of each fault; a watch's cut window."""
    seed: int = 1
    error_rate: float = 0.01          # 500 before forwarding
    lost_answer_rate: float = 0.02    # writes: forwarded, then a 500 instead of the answer
    throttle_rate: float = 0.01       # 429 + Retry-After
    retry_after: tuple[int, ...] = (1, 2)
    slow_rate: float = 0.05
    slow_seconds: tuple[float, float] = (0.3, 1.5)
    watch_cut_rate: float = 1.0       # the share of watch streams that are cut
    watch_cut_events: tuple[int, int] = (1, 40)
    watch_cut_seconds: tuple[float, float] = (1.0, 8.0)

    def decide(self, rng: random.Random, method: str, watch: bool) -> "Decision":
        """What to do with one request (pure given rng)."""
        r = rng.random()
        if r < self.error_rate:
            return Decision("500")
        r -= self.error_rate
        if r < self.throttle_rate:
            return Decision("429", retry_after=rng.choice(self.retry_after))
        r -= self.throttle_rate
        if method in WRITES and r < self.lost_answer_rate:
            return Decision("500-after-write")
        r = rng.random()
        slow = rng.uniform(*self.slow_seconds) if r < self.slow_rate else 0.0
        if watch and rng.random() < self.watch_cut_rate:
            return Decision("watch-cut", slow=slow, cut_events=rng.randint(*self.watch_cut_events),
                            cut_seconds=rng.uniform(*self.watch_cut_seconds))
        return Decision("slow" if slow else "", slow=slow)


@dataclass(frozen=True)
class Decision:
    fault: str                       # "" | "500" | "500-after-write" | "429" | "slow" | "watch-cut"
    retry_after: int = 0
    slow: float = 0.0
    cut_events: int = 0
    cut_seconds: float = 0.0


@dataclass(frozen=True)
class Record:
    """One request as the proxy saw it. ``t``: the proxy's monotonic clock when the request had arrived."""
    t: float
    method: str
    path: str
    query: str
    user_agent: str
    status: int                      # what the client got (0: the connection was cut before a status)
    fault: str = ""
    retry_after: int = 0
    slow: float = 0.0
    body_name: str = ""              # a create's metadata.name, an Event's involvedObject.name
    events: int = 0                  # a watch: events passed on

    @property
    def watch(self) -> bool:
        return is_watch(self.query)

    @property
    def write(self) -> bool:
        return self.method in WRITES

    @property
    def object_path(self) -> str:
        """The object the request is about: the path without a ``/status`` (or other) subresource."""
        return object_path(self.path)


def is_watch(query: str) -> bool:
    return urllib.parse.parse_qs(query).get("watch", [""])[0] in ("true", "1")


def object_path(path: str) -> str:
    parts = path.rstrip("/").split("/")
    # /api/v1/namespaces/NS/PLURAL/NAME/SUB or /apis/G/V/namespaces/NS/PLURAL/NAME/SUB (and cluster-scoped)
    base = 3 if parts[1:2] == ["api"] else 4      # the index after the version
    if parts[base:base + 1] == ["namespaces"] and len(parts) > base + 2:
        base += 2
    return "/".join(parts[:base + 2])


def request_key(r: Record) -> str:
    """What a 429 is about: the object (its subresources included; a create's is named in its body); for a
    collection, the selection (a list by label selector is about that selection, not every object of the kind);
    a watch apart from a read."""
    if r.method == "POST" and r.body_name:
        return f"{r.object_path}/{r.body_name}"
    q = urllib.parse.parse_qs(r.query)
    sel = "&".join(f"{k}={q[k][0]}" for k in ("labelSelector", "fieldSelector") if k in q)
    return f"{r.object_path}?{sel}{'&watch' if r.watch else ''}"


def early_after_429(records: Iterable[Record], exempt: Iterable[str] = ()) -> list[tuple[Record, float]]:
    """Each request for an object that came sooner than a 429 for that object allowed, and how much sooner.
    A 429 holds back the client it answered: clients are told apart by their User-Agent (one process may run
    several, each with its own connections and retries). ``exempt``: object paths read on behalf of many
    parents at once (a shared Secret), where a 429 holds back the parent whose request it answered, not the
    others."""
    skip = set(exempt)
    not_before: dict[str, float] = {}
    early = []
    for r in sorted(records, key=lambda r: r.t):
        if r.object_path in skip:
            continue
        key = f"{r.user_agent} {request_key(r)}"
        if r.t < not_before.get(key, 0.0):
            early.append((r, not_before[key] - r.t))
        if r.fault == "429":
            not_before[key] = max(not_before.get(key, 0.0), r.t + r.retry_after)
    return early


def faults_by_kind(records: Iterable[Record]) -> Counter[str]:
    return Counter(r.fault for r in records if r.fault)


def _status(code: int, reason: str, message: str) -> bytes:
    return json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": message, "reason": reason, "code": code}).encode()


def _body_name(body: bytes) -> str:
    if not body.startswith(b"{"):
        return ""
    try:
        obj = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(obj, dict):
        return ""
    inv = obj.get("involvedObject")
    if isinstance(inv, dict) and inv.get("name"):
        return str(inv["name"])
    md = obj.get("metadata")
    return str(md.get("name") or "") if isinstance(md, dict) else ""


class _Cut(Exception):
    """The watch stream is to be dropped now."""


class FaultProxy:
    def __init__(self, *, upstream: str, upstream_ca: str | None, faults: Faults,
                 cert: tuple[str, str] | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream, self.upstream_ca, self.faults = upstream.rstrip("/"), upstream_ca, faults
        self.cert, self.host, self.port = cert, host, port
        self.rng = random.Random(faults.seed)
        self.enabled = True              # False: forward everything as it is (no fault)
        self._records: list[Record] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._client: httpx.AsyncClient | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    # ------------------------------------------------------------------ the record
    def records(self) -> list[Record]:
        with self._lock:
            return list(self._records)

    def _record(self, r: Record) -> None:
        with self._lock:
            self._records.append(r)

    # ------------------------------------------------------------------ life
    async def start(self) -> str:
        verify: ssl.SSLContext | bool = (ssl.create_default_context(cafile=self.upstream_ca) if self.upstream_ca
                                         else False)
        self._client = httpx.AsyncClient(
            verify=verify, timeout=httpx.Timeout(30.0, read=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        ctx = None
        if self.cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*self.cert)
        self._server = await asyncio.start_server(self._handle, self.host, self.port, ssl=ctx, limit=1 << 20)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"{'https' if ctx else 'http'}://{self.host}:{self.port}"

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._conns):
            w.transport.abort()
        if self._client is not None:
            await self._client.aclose()

    def start_in_thread(self) -> str:
        """Run the proxy in a thread of its own with its own event loop; returns its URL."""
        started: list[Any] = []
        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                started.append(loop.run_until_complete(self.start()))
            except BaseException as e:      # handed to the caller
                started.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.aclose())
            loop.close()
        self._thread = threading.Thread(target=main, name="faultproxy", daemon=True)
        self._thread.start()
        ready.wait(30)
        if not started or isinstance(started[0], BaseException):
            raise RuntimeError(f"fault proxy did not start: {started[0] if started else 'timeout'}")
        return str(started[0])

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    # ------------------------------------------------------------------ one client connection
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                req, body = await self._read_request(conn, reader)
                if req is None:
                    break
                if not await self._exchange(conn, writer, req, body):
                    break
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    break
                conn.start_next_cycle()
        except (OSError, EOFError, h11.ProtocolError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.discard(writer)
            writer.transport.abort()

    @staticmethod
    async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader) -> tuple[h11.Request | None, bytes]:
        req: h11.Request | None = None
        body = bytearray()
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                data = await reader.read(1 << 16)
                conn.receive_data(data)
                continue
            if isinstance(ev, h11.Request):
                req = ev
            elif isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                return req, bytes(body)
            elif isinstance(ev, h11.ConnectionClosed):
                return None, b""

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, conn: h11.Connection, *events: Any) -> None:
        for ev in events:
            data = conn.send(ev)
            if data:
                writer.write(data)
        await writer.drain()

    async def _exchange(self, conn: h11.Connection, writer: asyncio.StreamWriter, req: h11.Request,
                        body: bytes) -> bool:
        t = time.monotonic()
        method = req.method.decode()
        target = req.target.decode()
        path, _, query = target.partition("?")
        ua = next((v.decode() for k, v in req.headers if k == b"user-agent"), "")
        watch = is_watch(query)
        d = self.faults.decide(self.rng, method, watch) if self.enabled else Decision("")
        rec = dict(t=t, method=method, path=path, query=query, user_agent=ua, fault=d.fault, slow=d.slow,
                   body_name=_body_name(body) if method == "POST" else "")
        if d.fault == "500":
            await self._answer(conn, writer, 500, _status(500, "InternalError", "etcdserver: request timed out"))
            self._record(Record(status=500, **rec))  # type: ignore[arg-type]
            return True
        if d.fault == "429":
            await self._answer(conn, writer, 429, _status(
                429, "TooManyRequests", "the server has received too many requests and has asked us to try again "
                "later"), [(b"retry-after", str(d.retry_after).encode())])
            self._record(Record(status=429, retry_after=d.retry_after, **rec))  # type: ignore[arg-type]
            return True
        if d.slow:
            await asyncio.sleep(d.slow)
        assert self._client is not None
        headers = [(k, v) for k, v in req.headers if k.lower() not in _HOP]
        headers.append((b"accept-encoding", b"identity"))
        up = self._client.build_request(method, self.upstream + target, headers=headers,
                                        content=body if body or method in WRITES else None)
        try:
            resp = await self._client.send(up, stream=True)
        except httpx.HTTPError as e:
            await self._answer(conn, writer, 502, _status(502, "BadGateway", f"fault proxy: upstream: {e!r}"))
            self._record(Record(status=502, **rec))  # type: ignore[arg-type]
            return True
        try:
            out_headers = [(k.encode(), v.encode()) for k, v in resp.headers.multi_items()
                           if k.lower().encode() not in _HOP]
            if d.fault == "500-after-write":
                await resp.aread()
                await self._answer(conn, writer, 500, _status(500, "InternalError", "etcdserver: request timed out"))
                self._record(Record(status=500, **rec))  # type: ignore[arg-type]
                return True
            if not watch:
                content = await resp.aread()
                await self._send(writer, conn, h11.Response(status_code=resp.status_code, headers=[
                    *out_headers, (b"content-length", str(len(content)).encode())]), h11.Data(data=content),
                    h11.EndOfMessage())
                self._record(Record(status=resp.status_code, **rec))  # type: ignore[arg-type]
                return True
            # a watch: chunked to the client, as the API server sends it; cut when the decision says so
            await self._send(writer, conn, h11.Response(status_code=resp.status_code, headers=out_headers))
            events = 0
            deadline = t + d.cut_seconds if d.fault == "watch-cut" else None
            chunks = resp.aiter_raw()
            try:
                while True:
                    timeout = None if deadline is None else deadline - time.monotonic()
                    if timeout is not None and timeout <= 0:
                        raise _Cut
                    try:
                        chunk = await asyncio.wait_for(chunks.__anext__(), timeout)
                    except asyncio.TimeoutError:
                        raise _Cut from None
                    except StopAsyncIteration:
                        break
                    events += chunk.count(b"\n")
                    await self._send(writer, conn, h11.Data(data=chunk))
                    if deadline is not None and events >= d.cut_events:
                        raise _Cut
            except _Cut:
                self._record(Record(status=resp.status_code, events=events, **rec))  # type: ignore[arg-type]
                writer.transport.abort()
                return False
            except httpx.HTTPError:
                # the API server ended the stream badly: pass that on as a cut too, but not as our fault
                self._record(Record(status=resp.status_code, events=events,
                                    **{**rec, "fault": "upstream-cut"}))  # type: ignore[arg-type]
                writer.transport.abort()
                return False
            await self._send(writer, conn, h11.EndOfMessage())
            self._record(Record(status=resp.status_code, events=events,
                                **{**rec, "fault": d.fault if d.fault != "watch-cut" else ""}))  # type: ignore[arg-type]
            return True
        finally:
            await resp.aclose()

    async def _answer(self, conn: h11.Connection, writer: asyncio.StreamWriter, code: int, body: bytes,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
        await self._send(writer, conn, h11.Response(status_code=code, headers=[
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]),
            h11.Data(data=body), h11.EndOfMessage())

