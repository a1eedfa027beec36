"""The API server proxy's HTTP handling against a fake API server over verified TLS, on loopback."""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
from pathlib import Path

import h11
import httpx
import pytest

from containerboot.apiproxy.identity import CAP_KUBERNETES
from containerboot.apiproxy.server import AUTH, NOAUTH, ApiServerProxy, Upstream, status_body
from tests.support.kubeapi import CertFiles, cached_certs, make_certs
from tests.support.waits import until_async

FLOOD_CAP = 256 << 20     # far above what sockets and the proxy hold in flight (about 20 MiB here)


class FakeApiServer:
    """Answers by path: /echo (the request's headers as JSON), /watch (one chunk, a second on `release`),
    /follow (five lines, each after the client took the one before from `steps`), /flood (256 KiB chunks
    as fast as the proxy takes them, up to FLOOD_CAP, counted in `flood_sent`), /exec (101, then echoes
    bytes). Records when a connection closes."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.steps: asyncio.Queue[None] = asyncio.Queue()
        self.flood_sent = 0
        self.closed = asyncio.Event()
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self, ctx: ssl.SSLContext | None, port: int = 0) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", port, ssl=ctx)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:      # a restart ends every open connection too
            w.close()
        await self.server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.add(writer)
        conn = h11.Connection(h11.SERVER)

        async def event():
            while (e := conn.next_event()) is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            return e

        try:
            while True:
                req = await event()
                if not isinstance(req, h11.Request):
                    return
                path = req.target.decode()
                if path.startswith("/early"):
                    # as Go's server when a handler answers without reading a large body: the answer, a
                    # short wait, then the connection closed with the body unread (a reset, on Linux)
                    doc = status_body(403, "Forbidden", 'User "e2e" cannot patch resource "configmaps"')
                    writer.write(conn.send(h11.Response(status_code=403, headers=[
                        (b"content-type", b"application/json"), (b"content-length", str(len(doc)).encode()),
                        (b"connection", b"close")])) + conn.send(h11.Data(data=doc)) + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    await asyncio.sleep(0.5)   # not a wait: Go's pause between its answer and the reset
                    writer.transport.abort()
                    return
                body = b""
                while not isinstance(e := await event(), h11.EndOfMessage):
                    body += e.data
                if path.startswith("/exec"):
                    writer.write(conn.send(h11.InformationalResponse(
                        status_code=101, headers=[(b"connection", b"Upgrade"), (b"upgrade", b"SPDY/3.1")])))
                    data, _ = conn.trailing_data
                    writer.write(b"early:" + data)
                    while chunk := await reader.read(65536):
                        writer.write(chunk.upper())
                        await writer.drain()
                    return
                if path.startswith("/follow") or path.startswith("/flood"):
                    writer.write(conn.send(h11.Response(status_code=200, headers=[
                        (b"content-type", b"text/plain")])))
                    if path.startswith("/follow"):
                        for i in range(5):
                            writer.write(conn.send(h11.Data(data=f"line-{i}\n".encode())))
                            await writer.drain()
                            await self.steps.get()
                    else:
                        chunk = b"x" * 262144
                        while self.flood_sent < FLOOD_CAP:
                            writer.write(conn.send(h11.Data(data=chunk)))
                            await writer.drain()
                            self.flood_sent += len(chunk)
                    writer.write(conn.send(h11.EndOfMessage()))
                    await writer.drain()
                elif path.startswith("/watch"):
                    writer.write(conn.send(h11.Response(status_code=200, headers=[
                        (b"content-type", b"application/json")])))
                    writer.write(conn.send(h11.Data(data=b'{"type":"ADDED"}\n')))
                    await writer.drain()
                    eof = asyncio.ensure_future(reader.read(1))
                    release = asyncio.ensure_future(self.release.wait())
                    await asyncio.wait({eof, release}, return_when=asyncio.FIRST_COMPLETED)
                    if eof.done():       # the proxy closed its connection while the watch was open
                        release.cancel()
                        return
                    eof.cancel()
                    writer.write(conn.send(h11.Data(data=b'{"type":"MODIFIED"}\n')))
                    writer.write(conn.send(h11.EndOfMessage()))
                    await writer.drain()
                else:
                    doc = json.dumps({"headers": [[k.decode(), v.decode()] for k, v in req.headers],
                                      "body": body.decode(), "method": req.method.decode()}).encode()
                    writer.write(conn.send(h11.Response(status_code=200, headers=[
                        (b"content-type", b"application/json"), (b"content-length", str(len(doc)).encode())])))
                    writer.write(conn.send(h11.Data(data=doc)) + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                conn.start_next_cycle()
        except (OSError, h11.ProtocolError):
            pass
        finally:
            self.closed.set()
            self.writers.discard(writer)
            writer.close()


WHO = {"Node": {"Name": "laptop.tail.example.", "Tags": []}, "UserProfile": {"LoginName": "bars"},
       "CapMap": {CAP_KUBERNETES: [{"impersonate": {"groups": ["tailnet-readers"]}}]}}


class Harness:
    def __init__(self, tmp: Path, mode: str) -> None:
        self.tmp, self.mode = tmp, mode
        self.api = FakeApiServer()
        self.token = tmp / "token"
        self.token.write_text("sa-token-1\n")
        self.whois_answer: dict | None = WHO
        self.whois_calls: list[str] = []

    async def start(self) -> None:
        certs = cached_certs(["127.0.0.1"])
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(certs.cert_path, certs.key_path)
        self.server_ctx = server_ctx
        self.api_port = await self.api.start(server_ctx)
        client_ctx = ssl.create_default_context(cafile=certs.ca_path)

        async def whois(addr: str) -> dict | None:
            self.whois_calls.append(addr)
            return self.whois_answer

        self.proxy = ApiServerProxy(mode=self.mode, upstream=Upstream("127.0.0.1", self.api_port, client_ctx,
                                                                      f"127.0.0.1:{self.api_port}".encode()),
                                    token=lambda: self.token.read_text().strip(), whois=whois)
        self.server = await asyncio.start_server(self.proxy.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.server.close()
        await self.api.stop()


@pytest.fixture
async def auth(tmp_path):
    h = Harness(tmp_path, AUTH)
    await h.start()
    yield h
    await h.stop()


@pytest.fixture
async def noauth(tmp_path):
    h = Harness(tmp_path, NOAUTH)
    await h.start()
    yield h
    await h.stop()


def _headers(doc: dict) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in doc["headers"]]


async def test_auth_mode_impersonates_the_caller_with_the_proxys_token(auth):
    async with httpx.AsyncClient(base_url=auth.url) as c:
        r = await c.get("/echo", headers={"Authorization": "Bearer stolen", "Impersonate-User": "admin",
                                          "Impersonate-Group": "system:masters"})
        assert r.status_code == 200
        h = _headers(r.json())
        assert ("authorization", "Bearer sa-token-1") in h
        assert [v for k, v in h if k.startswith("impersonate-")] == ["bars", "tailnet-readers"]
        assert ("host", f"127.0.0.1:{auth.api_port}") in h
        assert auth.whois_calls[0].startswith("127.0.0.1:")
        # The projected token rotates: the next request carries the new one, on the same connection.
        auth.token.write_text("sa-token-2\n")
        r = await c.post("/echo", content=b"x" * 100_000)
        assert ("authorization", "Bearer sa-token-2") in _headers(r.json())
        assert len(r.json()["body"]) == 100_000
    assert auth.api.connections == 1


async def test_noauth_mode_passes_the_clients_credentials(noauth):
    async with httpx.AsyncClient(base_url=noauth.url) as c:
        r = await c.get("/echo", headers={"Authorization": "Bearer client-token"})
    h = _headers(r.json())
    assert ("authorization", "Bearer client-token") in h
    assert not any(k.startswith("impersonate-") for k, _ in h)
    assert noauth.whois_calls       # asked for the caller's recording rules only, as upstream


async def test_unknown_caller_and_malformed_grant_are_refused_with_a_status(auth, caplog):
    auth.whois_answer = None
    async with httpx.AsyncClient(base_url=auth.url) as c:
        r = await c.get("/echo")
        assert r.status_code == 403
        assert r.json()["message"] == "failed to authenticate caller"
        auth.whois_answer = {**WHO, "CapMap": {CAP_KUBERNETES: [{"impersonate": {"groups": "tailnet-readers"}}]}}
        with caplog.at_level(logging.INFO, logger="containerboot"):
            r = await c.get("/echo")
    assert r.status_code == 403
    assert "impersonate.groups is a string" in r.json()["message"]
    assert "rule 0 of capability 'tailscale.com/cap/kubernetes'" in caplog.text
    assert auth.api.connections == 0


async def test_watch_streams_unbuffered_and_a_client_that_leaves_frees_the_upstream(auth):
    reader, writer = await asyncio.open_connection("127.0.0.1", auth.port)
    writer.write(b"GET /watch HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    while b"ADDED" not in got:       # the first event arrives while the API server holds the second
        got += await asyncio.wait_for(reader.read(4096), 10)
    assert not auth.api.closed.is_set()
    writer.close()
    await asyncio.wait_for(auth.api.closed.wait(), 10)


async def test_a_followed_stream_reaches_the_client_line_by_line(auth):
    """As `logs -f`: the API server writes a line only after the client has read the one before, so a proxy
    that held back any part of the body would stall here."""
    async with httpx.AsyncClient(base_url=auth.url) as c:
        async with c.stream("GET", "/follow") as r:
            lines = r.aiter_lines()
            for i in range(5):
                assert await asyncio.wait_for(anext(lines), 10) == f"line-{i}"
                auth.api.steps.put_nowait(None)


async def test_a_client_that_stops_reading_holds_the_api_server_back_and_leaving_frees_it(auth):
    """The proxy reads from the API server only as fast as the client takes the body (it does not soak up a
    large response in memory); a client that then goes away closes the API server connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", auth.port)
    writer.write(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 200")
    last = -1
    for _ in range(120):        # the client reads nothing more: wait for the API server's writes to stall
        await asyncio.sleep(0.25)   # poll: until two samples of what the API server wrote are alike
        if auth.api.flood_sent == last:
            break
        last = auth.api.flood_sent
    # what is in flight is bounded by the sockets' and the proxy's buffers, not by the response's size
    assert 0 < auth.api.flood_sent < FLOOD_CAP // 2, auth.api.flood_sent
    assert not auth.api.closed.is_set()
    writer.close()
    await asyncio.wait_for(auth.api.closed.wait(), 10)
    assert auth.api.flood_sent < FLOOD_CAP
    await until_async(lambda: auth.proxy.connections == 0, what="the proxy's client connection to close")


async def test_a_client_that_leaves_during_its_upload_frees_the_upstream(auth):
    """An aborted `kubectl apply` of a large object: the body is half sent when the client goes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", auth.port)
    writer.write(b"PUT /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n" + b"y" * 300000)
    await writer.drain()
    # the proxy has opened its API server connection and is forwarding the body
    await until_async(lambda: auth.api.connections, what="the proxy's API server connection")
    assert auth.api.connections == 1 and not auth.api.closed.is_set()
    writer.close()
    await asyncio.wait_for(auth.api.closed.wait(), 10)


async def _upload_and_read(port: int, head: bytes, size: int) -> bytes:
    """Send `head` and `size` bytes of body while reading the answer (as Go's client does); the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def upload() -> None:
        writer.write(head)
        try:
            for _ in range(size // 65536):
                writer.write(b"z" * 65536)
                await writer.drain()
        except OSError:
            pass        # the proxy may close once it has answered
    up = asyncio.ensure_future(upload())
    got = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 20):
            got += chunk
    except ConnectionResetError as e:
        raise AssertionError(f"the connection was reset after {got!r}") from e
    finally:
        up.cancel()
        writer.close()
    return got


async def test_an_answer_before_the_request_body_ends_reaches_the_client(auth):
    """A write RBAC refuses: the API server answers 403 without reading the large body and closes. The client,
    still uploading, gets the answer (not a reset), and the proxy's own refusals behave the same."""
    head = b"PATCH /early HTTP/1.1\r\nHost: x\r\nContent-Length: 8388608\r\n\r\n"
    got = await _upload_and_read(auth.port, head, 8388608)
    assert got.startswith(b"HTTP/1.1 403"), got[:300]
    assert b'User \\"e2e\\" cannot patch resource \\"configmaps\\"' in got and b"connection: close" in got.lower()
    auth.whois_answer = None        # the proxy refuses the caller itself, before the body
    got = await _upload_and_read(auth.port, head.replace(b"/early", b"/echo"), 8388608)
    assert got.startswith(b"HTTP/1.1 403") and b"failed to authenticate caller" in got, got[:300]


async def test_watch_delivers_later_events_and_ends(auth):
    async with httpx.AsyncClient(base_url=auth.url) as c:
        async with c.stream("GET", "/watch") as r:
            lines = r.aiter_lines()
            assert "ADDED" in await anext(lines)
            auth.api.release.set()
            assert "MODIFIED" in await anext(lines)


async def test_upgrade_pipes_bytes_both_ways_after_the_101(auth):
    reader, writer = await asyncio.open_connection("127.0.0.1", auth.port)
    writer.write(b"POST /exec?command=sh HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
                 b"X-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\nfirst")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 101")
    assert b"upgrade: SPDY/3.1" in head.lower().replace(b"spdy", b"SPDY")
    got = b""
    while b"FIRST" not in got:
        got += await asyncio.wait_for(reader.read(4096), 10)
    writer.write(b"echo ok")
    while b"ECHO OK" not in got:
        got += await asyncio.wait_for(reader.read(4096), 10)
    assert got.startswith(b"early:")
    writer.close()
    await asyncio.wait_for(auth.api.closed.wait(), 10)


async def test_garbage_gets_a_400_and_is_closed_while_other_clients_carry_on(auth):
    async with httpx.AsyncClient(base_url=auth.url) as c:
        async with c.stream("GET", "/watch") as watch:
            lines = watch.aiter_lines()
            assert "ADDED" in await anext(lines)
            reader, writer = await asyncio.open_connection("127.0.0.1", auth.port)
            writer.write(b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)     # read() to EOF: the proxy closed it
            assert answer.startswith(b"HTTP/1.1 400")
            assert (await c.get("/echo")).status_code == 200
            auth.api.release.set()
            assert "MODIFIED" in await anext(lines)


async def test_api_server_down_fails_cleanly_then_recovers(auth):
    async with httpx.AsyncClient(base_url=auth.url) as c:
        assert (await c.get("/echo")).status_code == 200
        await auth.api.stop()
        r = await c.get("/echo")
        assert r.status_code == 502
        assert "error reaching the API server" in r.json()["message"]
        await auth.api.start(auth.server_ctx, auth.api_port)
        assert (await c.get("/echo")).status_code == 200


async def test_api_server_certificate_is_verified(auth, tmp_path):
    other = ssl.create_default_context()     # the system roots: they do not know the cluster CA
    auth.proxy.upstream = Upstream("127.0.0.1", auth.api_port, other, b"x")
    async with httpx.AsyncClient(base_url=auth.url) as c:
        r = await c.get("/echo")
    assert r.status_code == 502
    assert "CERTIFICATE_VERIFY_FAILED" in r.json()["message"]


def test_entrypoint_settings_name_the_variable_and_the_fix():
    from containerboot.apiproxy.run import ConfigError, settings
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(ConfigError, match=r"TS_APISERVER_PROXY_MODE='true' is not a mode; set it to 'auth'"):
        settings({**env, "TS_APISERVER_PROXY_MODE": "true"})
    with pytest.raises(ConfigError, match="TS_APISERVER_PROXY_PORT='http' is not a port"):
        settings({**env, "TS_APISERVER_PROXY_MODE": "auth", "TS_APISERVER_PROXY_PORT": "http"})
    assert settings({**env, "TS_APISERVER_PROXY_MODE": "noauth"}) == (
        "noauth", "/tmp/tailscaled.sock", "https://10.96.0.1:443", None, False)


async def test_a_burst_on_one_connection_asks_whois_once_and_again_after_the_ttl(auth, monkeypatch):
    from containerboot.apiproxy import server
    async with httpx.AsyncClient(base_url=auth.url) as c:
        for _ in range(3):
            assert (await c.get("/echo")).status_code == 200
        assert len(auth.whois_calls) == 1
        monkeypatch.setattr(server, "WHOIS_TTL", 0.0)
        auth.whois_answer = {**WHO, "CapMap": {}}       # the grant was revoked meanwhile
        r = await c.get("/echo")
    assert len(auth.whois_calls) == 2
    assert [v for k, v in _headers(r.json()) if k.startswith("impersonate-")] == ["bars"]


async def test_self_signed_certificate_serves_tls_with_the_fingerprint_it_reports(tmp_path):
    import hashlib

    from containerboot.apiproxy.run import self_signed
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    fp = self_signed(["kube-apiserver.tailnet.test"], ["127.0.0.1"], ctx)
    srv = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=ctx)
    port = srv.sockets[0].getsockname()[1]
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE   # as insecure-skip-tls-verify
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    srv.close()
    assert fp == ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


class FakeLocalAPI:
    """tailscaled's LocalAPI on a unix socket: Running with 127.0.0.1 as the tailnet address, WhoIs of anyone =
    WHO. Without `cert_domains` no certificate domains (as on headscale); with them (as on Tailscale with HTTPS
    enabled) `cert/<domain>?type=pair` answers `pair` (key PEM then certificate PEM, as tailscaled does)."""

    def __init__(self, path: str, cert_domains: list[str] | None = None, pair: bytes = b"") -> None:
        self.path, self.cert_domains, self.pair = path, cert_domains, pair
        self.cert_requests: list[str] = []

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self.handle, self.path)

    async def handle(self, reader, writer) -> None:
        conn = h11.Connection(h11.SERVER)
        while (e := conn.next_event()) is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
        target = e.target.decode()
        if target.startswith("/localapi/v0/status"):
            name = (self.cert_domains or ["kube-apiserver.tailnet.test"])[0]
            body = json.dumps({"BackendState": "Running", "CertDomains": self.cert_domains,
                               "Self": {"TailscaleIPs": ["127.0.0.1"], "DNSName": f"{name}."}}).encode()
        elif target.startswith("/localapi/v0/cert/"):
            self.cert_requests.append(target)
            body = self.pair
        else:
            body = json.dumps(WHO).encode()
        writer.write(conn.send(h11.Response(status_code=200, headers=[(b"content-length", str(len(body)).encode()),
                                                                     (b"connection", b"close")]))
                     + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        writer.close()


@pytest.mark.parametrize("mode,scheme", [(AUTH, "http"), (NOAUTH, "https")])
async def test_entrypoint_serves_on_the_tailnet_address_http_for_auth_self_signed_https_for_noauth(
        tmp_path, caplog, mode, scheme):
    import socket as _socket

    from containerboot.apiproxy.run import serve
    h = Harness(tmp_path, mode)
    await h.start()
    certs = cached_certs(["127.0.0.1"])
    sa = tmp_path / "root/var/run/secrets/kubernetes.io/serviceaccount"
    sa.mkdir(parents=True)
    (sa / "token").write_text("sa-token-1\n")
    (sa / "ca.crt").write_text(Path(certs.ca_path).read_text())
    lapi = FakeLocalAPI(str(tmp_path / "ts.sock"))
    await lapi.start()
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"TS_APISERVER_PROXY_MODE": mode, "TS_SOCKET": lapi.path, "KUBERNETES_SERVICE_HOST": "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": str(h.api_port), "TS_APISERVER_PROXY_PORT": str(port)}
    with caplog.at_level(logging.INFO, logger="containerboot"):
        task = asyncio.ensure_future(serve(env, str(tmp_path / "root")))
        try:
            await until_async(lambda: "is listening on" in caplog.text or task.done(), what="the proxy to listen")
            assert f"API server proxy in {mode} mode is listening on {scheme}://kube-apiserver.tailnet.test:{port}" \
                in caplog.text, (caplog.text, task.done() and task.exception())
            async with httpx.AsyncClient(base_url=f"{scheme}://127.0.0.1:{port}", verify=False) as c:
                r = await c.get("/echo", headers={"Authorization": "Bearer mine"})
            assert r.status_code == 200
            auth_header = dict(_headers(r.json()))["authorization"]
            assert auth_header == ("Bearer sa-token-1" if mode == AUTH else "Bearer mine")
            assert not task.done(), task.exception()      # still serving, not crashed after the start
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            lapi.server.close()
            await h.stop()


def _renewed(pki: CertFiles, domain: str, out: Path) -> CertFiles:
    """A second certificate for `domain` from the same test CA (what a renewal brings)."""
    import subprocess
    out.mkdir()
    ca_key = str(Path(pki.ca_path).with_name("ca.key"))
    key, csr, crt, ext = (str(out / n) for n in ("server.key", "server.csr", "server.crt", "server.ext"))
    Path(ext).write_text(f"extendedKeyUsage=serverAuth\nsubjectAltName=DNS:{domain}\n")
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", csr,
        "-subj", f"/CN={domain}")
    run("x509", "-req", "-in", csr, "-CA", pki.ca_path, "-CAkey", ca_key, "-CAcreateserial", "-out", crt,
        "-days", "3", "-extfile", ext)
    return CertFiles(pki.ca_path, crt, key)


def _pair(c: CertFiles) -> bytes:
    """tailscaled's `type=pair` answer: the key's PEM, then the certificate's."""
    return Path(c.key_path).read_bytes() + Path(c.cert_path).read_bytes()


def _der_of(c: CertFiles) -> bytes:
    return ssl.PEM_cert_to_DER_cert(Path(c.cert_path).read_text())


async def test_entrypoint_serves_https_with_the_control_planes_certificate_and_picks_up_a_renewed_one(
        tmp_path, caplog, monkeypatch):
    """Tailscale with HTTPS enabled: the status lists certificate domains, so the proxy asks the LocalAPI for
    the first one's certificate pair and serves HTTPS with it; a client that trusts only the issuing CA and
    checks the name connects. When the LocalAPI answers with a renewed certificate, new connections get it."""
    import socket as _socket

    from containerboot.apiproxy import run
    monkeypatch.setattr(run, "_CERT_REFRESH", 0.1)
    domain = "kube-apiserver.tail1234.ts.net"
    first = make_certs(str(tmp_path / "pki"), [domain])
    second = _renewed(first, domain, tmp_path / "pki2")
    h = Harness(tmp_path, AUTH)
    await h.start()
    sa = tmp_path / "root/var/run/secrets/kubernetes.io/serviceaccount"
    sa.mkdir(parents=True)
    (sa / "token").write_text("sa-token-1\n")
    (sa / "ca.crt").write_text(Path(cached_certs(["127.0.0.1"]).ca_path).read_text())
    lapi = FakeLocalAPI(str(tmp_path / "ts.sock"), cert_domains=[domain], pair=_pair(first))
    await lapi.start()
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"TS_APISERVER_PROXY_MODE": AUTH, "TS_SOCKET": lapi.path, "KUBERNETES_SERVICE_HOST": "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": str(h.api_port), "TS_APISERVER_PROXY_PORT": str(port)}
    trusting = ssl.create_default_context(cafile=first.ca_path)    # the test CA only, and the name checked

    async def get(ctx: ssl.SSLContext) -> tuple[httpx.Response, bytes]:
        async with httpx.AsyncClient(verify=ctx) as c:
            async with c.stream("GET", f"https://127.0.0.1:{port}/echo", extensions={"sni_hostname": domain}) as r:
                der = r.extensions["network_stream"].get_extra_info("ssl_object").getpeercert(binary_form=True)
                await r.aread()
        return r, der

    with caplog.at_level(logging.INFO, logger="containerboot"):
        task = asyncio.ensure_future(run.serve(env, str(tmp_path / "root")))
        try:
            await until_async(lambda: "is listening on" in caplog.text or task.done(), what="the proxy to listen")
            assert f"API server proxy in auth mode is listening on https://{domain}:{port}" in caplog.text, \
                (caplog.text, task.done() and task.exception())
            assert lapi.cert_requests[0].startswith(f"/localapi/v0/cert/{domain}?type=pair")
            r, der = await get(trusting)
            assert r.status_code == 200 and dict(_headers(r.json()))["impersonate-user"] == "bars"
            assert der == _der_of(first)
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await get(ssl.create_default_context())      # the system roots do not know the test CA

            lapi.pair = _pair(second)     # tailscaled renewed it
            await until_async(lambda: "serving a renewed certificate" in caplog.text, what="the renewed certificate")
            r, der = await get(trusting)
            assert r.status_code == 200
            assert der == _der_of(second), "a new connection still gets the old certificate"
            assert f"serving a renewed certificate for {domain}" in caplog.text
            assert not task.done(), task.exception()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            lapi.server.close()
            await h.stop()


async def test_entrypoint_without_a_certificate_from_tailscaled_exits_with_the_fix(tmp_path, caplog):
    from containerboot.apiproxy import run
    h = Harness(tmp_path, AUTH)
    await h.start()
    sa = tmp_path / "root/var/run/secrets/kubernetes.io/serviceaccount"
    sa.mkdir(parents=True)
    (sa / "token").write_text("sa-token-1\n")
    (sa / "ca.crt").write_text(Path(cached_certs(["127.0.0.1"]).ca_path).read_text())
    lapi = FakeLocalAPI(str(tmp_path / "ts.sock"), cert_domains=["kube-apiserver.tail1234.ts.net"],
                        pair=b"no certificate here")
    await lapi.start()
    env = {"TS_APISERVER_PROXY_MODE": AUTH, "TS_SOCKET": lapi.path, "KUBERNETES_SERVICE_HOST": "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": str(h.api_port), "TS_APISERVER_PROXY_PORT": "1"}
    try:
        with caplog.at_level(logging.INFO, logger="containerboot"):
            assert await asyncio.wait_for(run.serve(env, str(tmp_path / "root")), 30) == 1
    finally:
        lapi.server.close()
        await h.stop()
    assert "cannot get the certificate of kube-apiserver.tail1234.ts.net from tailscaled" in caplog.text
    assert "TS_APISERVER_PROXY_HTTP=true" in caplog.text
