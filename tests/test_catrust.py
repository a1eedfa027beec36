"""The agent's own HTTPS checks trust what tailscaled trusts: the files of each SSL_CERT_DIR directory outside
the system's store, laid out as a kubelet mounts a ConfigMap (keys as links into a `..<time>` directory behind a
`..data` link). A real TLS server with a certificate from a private CA is refused without the directory and
verified with it."""
from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from containerboot import catrust, probes
from tests.support.kubeapi import make_certs
from tests.support.kubelet import Kubelet


def _configmap_dir(root: Path, pem: str) -> Path:
    """The CA as the kubelet writes a ConfigMap volume (tests/support/kubelet.py)."""
    d = root / "ca"
    Kubelet(d, key="ca.crt").publish(pem)
    return d


def test_extra_ca_files_reads_a_configmap_volume_and_skips_the_system_store(tmp_path: Path) -> None:
    d = _configmap_dir(tmp_path, "x")
    (d / "other.pem").write_text("y")       # a plain file is read as well
    env = {"SSL_CERT_DIR": f"/etc/ssl/certs:{d}:{tmp_path / 'missing'}:"}
    assert catrust.extra_ca_files(env) == [str(d / "ca.crt"), str(d / "other.pem")]
    assert catrust.extra_ca_files({}) == [] and catrust.extra_ca_files({"SSL_CERT_DIR": "/etc/ssl/certs/"}) == []


async def _serve_tls(certfile: str, keyfile: str) -> tuple[asyncio.AbstractServer, int]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=ctx)
    return server, server.sockets[0].getsockname()[1]


def test_the_control_check_verifies_a_private_ca_from_ssl_cert_dir(tmp_path: Path, monkeypatch) -> None:
    certs = make_certs(str(tmp_path / "pki"), ["127.0.0.1"])
    d = _configmap_dir(tmp_path, Path(certs.ca_path).read_text())
    (d / "notes.txt").write_text("not a certificate")     # skipped, as tailscaled skips it

    async def status() -> int:
        server, port = await _serve_tls(certs.cert_path, certs.key_path)
        try:
            return await probes.http_status(f"https://127.0.0.1:{port}/key?v=1")
        finally:
            server.close()

    monkeypatch.setattr(probes, "_TLS", None)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with pytest.raises(ssl.SSLCertVerificationError):
        asyncio.run(status())
    monkeypatch.setattr(probes, "_TLS", None)
    monkeypatch.setenv("SSL_CERT_DIR", f"/etc/ssl/certs:{d}")
    assert asyncio.run(status()) == 200
