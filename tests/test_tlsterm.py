"""The terminator serves the user's certificate, switches to a renewed one for new connections only, and keeps
the last good one when the source turns bad."""
from __future__ import annotations

import asyncio
import ssl

import pytest

from containerboot.tlsterm import CertWatcher, Terminator, tcp_dialer
from tests.support.testca import TestCA

NAME = "proxy.tail.example"


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> TestCA:
    return TestCA(str(tmp_path_factory.mktemp("ca")))


class MemSource:
    def __init__(self, pair: tuple[bytes, bytes]):
        self.pair = pair

    def describe(self) -> str:
        return "Secret default/site-tls"

    async def load(self) -> tuple[bytes, bytes]:
        return self.pair


async def echo_server() -> tuple[asyncio.Server, int]:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def connect(port: int, ca_path: str, sni: str | None = NAME):
    ctx = ssl.create_default_context(cafile=ca_path)
    if sni is None:
        ctx.check_hostname = False
    r, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=sni)
    cert = w.get_extra_info("ssl_object").getpeercert()
    return r, w, cert["serialNumber"]


async def roundtrip(r, w, data: bytes) -> bytes:
    w.write(data)
    await w.drain()
    return await r.readexactly(len(data))


async def test_renewal_reaches_new_connections_and_spares_open_ones(ca, caplog):
    first, second = ca.issue(NAME), ca.issue(NAME)
    srv, port = await echo_server()
    term = Terminator(tcp_dialer("127.0.0.1", port))
    src = MemSource((first.cert_pem, first.key_pem))
    watch = CertWatcher(src, term, lambda: (NAME,))
    assert await watch.refresh()
    await term.start("127.0.0.1", 0)
    tport = term._server.sockets[0].getsockname()[1]
    r1, w1, serial1 = await connect(tport, ca.ca_path)
    assert serial1 == first.serial
    assert await roundtrip(r1, w1, b"hello") == b"hello"

    src.pair = (second.cert_pem, second.key_pem)
    assert await watch.refresh()
    r2, w2, serial2 = await connect(tport, ca.ca_path)
    assert serial2 == second.serial
    _, w3, serial3 = await connect(tport, ca.ca_path, sni=None)   # curl to an IP sends no SNI
    assert serial3 == second.serial
    assert await roundtrip(r1, w1, b"x" * 300_000) == b"x" * 300_000, "the connection opened before renewal"
    assert await roundtrip(r2, w2, b"after") == b"after"

    wrong = ca.issue("other.example.org")
    src.pair = (wrong.cert_pem, wrong.key_pem)
    assert not await watch.refresh()
    assert "covers none of the served names proxy.tail.example" in watch.last_error
    assert "still serving the last good certificate" in watch.last_error
    _, w4, serial4 = await connect(tport, ca.ca_path)
    assert serial4 == second.serial
    mismatched = (first.cert_pem, second.key_pem)
    src.pair = mismatched
    assert not await watch.refresh()
    assert "tls.key does not match" in watch.last_error
    assert "BEGIN" not in caplog.text
    for w in (w1, w2, w3, w4):
        w.close()
    term.close()
    srv.close()


async def test_a_bad_first_certificate_serves_nothing(ca):
    wrong = ca.issue("other.example.org")
    term = Terminator(tcp_dialer("127.0.0.1", 9))
    watch = CertWatcher(MemSource((wrong.cert_pem, wrong.key_pem)), term, lambda: (NAME,))
    assert not await watch.refresh()
    assert term.current is None and "not serving HTTPS" in watch.last_error


def test_readiness_waits_for_a_first_good_certificate_only():
    import time as _time

    from containerboot.status import AgentStatus
    now = _time.time()
    waiting = AgentStatus(tls={"serial": "", "last_error": "Secret apps/site-tls not found"})
    assert "HTTPS: no good certificate served yet: Secret apps/site-tls not found" in waiting.ready(now)[1]
    serving = AgentStatus(tls={"serial": "1A", "last_error": "the certificate expired at 2020-02-01T00:00:00Z"})
    assert not [r for r in serving.ready(now)[1] if r.startswith("HTTPS")]
    assert serving.to_json(now)["tls"]["serial"] == "1A"


async def test_the_server_side_ending_closes_the_client_at_once(ca):
    """An HTTP/1.0-style answer ends with the connection: the client must see the end at once."""
    async def answer_and_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nbody without a length")
        await w.drain()
        w.close()
    srv = await asyncio.start_server(answer_and_close, "127.0.0.1", 0)
    term = Terminator(tcp_dialer("127.0.0.1", srv.sockets[0].getsockname()[1]))
    leaf = ca.issue(NAME)
    assert await CertWatcher(MemSource((leaf.cert_pem, leaf.key_pem)), term, lambda: (NAME,)).refresh()
    await term.start("127.0.0.1", 0)
    r, w, _ = await connect(term._server.sockets[0].getsockname()[1], ca.ca_path)
    w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await w.drain()
    assert (await asyncio.wait_for(r.read(), 10)).endswith(b"body without a length")
    w.close()
    term.close()
    srv.close()
