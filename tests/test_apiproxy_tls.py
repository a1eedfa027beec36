"""The API server proxy with your own certificate (TS_APISERVER_PROXY_TLS_SECRET): served on any control plane,
verified by a client that trusts only your CA, renewed for new connections while an open one carries on, and
kept when the Secret turns bad."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import ssl
from pathlib import Path

import h11
import httpx
import pytest

from containerboot import tlsterm
from containerboot.apiproxy.server import AUTH
from tests.support.kubeapi import cached_certs
from tests.support.testca import TestCA
from tests.support.waits import until_async
from tests.test_apiproxy_server import FakeLocalAPI

NAME = "kube-apiserver.tailnet.test"      # FakeLocalAPI's MagicDNS name without certificate domains


class SecretApi:
    """An API server over TLS: GET of the Secret `kube-api-tls` in `tailscale` (mutable), and /echo."""

    def __init__(self) -> None:
        self.secret: dict | None = None
        self.reads = 0

    async def start(self) -> int:
        certs = cached_certs(["127.0.0.1"])
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(certs.cert_path, certs.key_path)
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0, ssl=ctx)
        return self.server.sockets[0].getsockname()[1]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                while (e := conn.next_event()) is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                if not isinstance(e, h11.Request):
                    return
                while not isinstance(conn.next_event(), h11.EndOfMessage):
                    pass
                path = e.target.decode()
                status, body = 200, b'{"ok": true}'
                if path == "/api/v1/namespaces/tailscale/secrets/kube-api-tls":
                    self.reads += 1
                    status, body = (200, json.dumps(self.secret).encode()) if self.secret else (404, b"{}")
                writer.write(conn.send(h11.Response(status_code=status, headers=[
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]))
                    + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                await writer.drain()
                conn.start_next_cycle()
        except (ConnectionError, h11.RemoteProtocolError):
            pass
        finally:
            writer.close()


def as_secret(leaf) -> dict:
    return {"type": "kubernetes.io/tls", "data": {"tls.crt": base64.b64encode(leaf.cert_pem).decode(),
                                                  "tls.key": base64.b64encode(leaf.key_pem).decode()}}


async def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    await until_async(cond, timeout, what, interval=0.05)


async def test_own_certificate_verified_renewed_and_kept(tmp_path, caplog, monkeypatch):
    from containerboot.apiproxy import run
    monkeypatch.setattr(tlsterm, "RELOAD_INTERVAL", 0.1)
    ca = TestCA(str(tmp_path / "ca"))
    first, second, wrong = ca.issue(NAME), ca.issue(NAME), ca.issue("other.example.org")
    api = SecretApi()
    api_port = await api.start()
    sa = tmp_path / "root/var/run/secrets/kubernetes.io/serviceaccount"
    sa.mkdir(parents=True)
    (sa / "token").write_text("sa-token-1\n")
    (sa / "namespace").write_text("tailscale\n")
    (sa / "ca.crt").write_text(Path(cached_certs(["127.0.0.1"]).ca_path).read_text())
    lapi = FakeLocalAPI(str(tmp_path / "ts.sock"))
    await lapi.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"TS_APISERVER_PROXY_MODE": AUTH, "TS_SOCKET": lapi.path, "KUBERNETES_SERVICE_HOST": "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": str(api_port), "TS_APISERVER_PROXY_PORT": str(port),
           "TS_APISERVER_PROXY_TLS_SECRET": "kube-api-tls"}
    trusting = ssl.create_default_context(cafile=ca.ca_path)   # the user's CA only; the name is checked

    def serial_of(r: httpx.Response) -> str:
        return r.extensions["network_stream"].get_extra_info("ssl_object").getpeercert()["serialNumber"]

    async def fresh_serial() -> str:
        async with httpx.AsyncClient(verify=trusting) as c:
            async with c.stream("GET", f"https://127.0.0.1:{port}/echo", extensions={"sni_hostname": NAME}) as r:
                await r.aread()
                assert r.status_code == 200
                return serial_of(r)

    with caplog.at_level(logging.INFO, logger="containerboot"):
        task = asyncio.ensure_future(run.serve(env, str(tmp_path / "root")))
        try:
            await wait_for(lambda: "not found" in caplog.text, "the missing Secret to be reported")
            assert "is listening on" not in caplog.text        # nothing served before a good certificate
            api.secret = as_secret(first)
            await wait_for(lambda: "is listening on" in caplog.text or task.done(), "the listener")
            assert f"API server proxy in auth mode is listening on https://{NAME}:{port}" in caplog.text
            assert await fresh_serial() == first.serial
            held = httpx.AsyncClient(verify=trusting)
            async with held.stream("GET", f"https://127.0.0.1:{port}/echo",
                                   extensions={"sni_hostname": NAME}) as r:
                await r.aread()
                assert serial_of(r) == first.serial

            api.secret = as_secret(second)
            await wait_for(lambda: f"serial {second.serial}" in caplog.text, "the renewal")
            assert await fresh_serial() == second.serial
            async with held.stream("GET", f"https://127.0.0.1:{port}/echo",
                                   extensions={"sni_hostname": NAME}) as r:
                await r.aread()
                assert r.status_code == 200 and serial_of(r) == first.serial, "the held connection was replaced"
            await held.aclose()

            api.secret = as_secret(wrong)
            await wait_for(lambda: "covers none of the served names" in caplog.text, "the wrong certificate")
            assert "still serving the last good certificate" in caplog.text
            assert await fresh_serial() == second.serial
            assert "PRIVATE KEY" not in caplog.text
            assert not task.done(), task.exception()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            lapi.server.close()
            api.server.close()


async def test_own_certificate_and_forced_http_contradict(tmp_path, caplog):
    from containerboot.apiproxy import run
    lapi = FakeLocalAPI(str(tmp_path / "ts.sock"))
    await lapi.start()
    sa = tmp_path / "root/var/run/secrets/kubernetes.io/serviceaccount"
    sa.mkdir(parents=True)
    (sa / "token").write_text("t\n")
    (sa / "ca.crt").write_text(Path(cached_certs(["127.0.0.1"]).ca_path).read_text())
    env = {"TS_APISERVER_PROXY_MODE": AUTH, "TS_SOCKET": lapi.path, "KUBERNETES_SERVICE_HOST": "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": "1", "TS_APISERVER_PROXY_TLS_SECRET": "x", "TS_APISERVER_PROXY_HTTP": "true"}
    try:
        assert await asyncio.wait_for(run.serve(env, str(tmp_path / "root")), 30) == 1
    finally:
        lapi.server.close()
    assert "contradict each other" in caplog.text


@pytest.fixture(autouse=True)
def _quiet_httpx(caplog):
    caplog.set_level(logging.WARNING, logger="httpx")
