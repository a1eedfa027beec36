"""A user's certificate and key loaded into the TLS library (I/O: the ssl module reads a pair only from files).

`server_context` is the listener's context for a checked pair (containerboot.tlsterm); `key_matches` is the
one check `tscommon.tlscert` cannot make by reading the certificate: that the key belongs to it.
"""
from __future__ import annotations

import os
import ssl
import tempfile

from .tlscert import CertProblem


def server_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A server SSLContext holding the pair; CertProblem when the key does not match the certificate.

    The ssl module loads a pair only from files: they are written to a private temporary directory and
    removed at once (the key never outlives the call on disk)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    with tempfile.TemporaryDirectory(prefix="tlscert-") as d:
        crt, key = os.path.join(d, "tls.crt"), os.path.join(d, "tls.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem)
        with open(crt, "wb") as f:
            f.write(cert_pem)
        try:
            ctx.load_cert_chain(crt, key)
        except ssl.SSLError as e:
            if "KEY_VALUES_MISMATCH" in str(e) or "key values mismatch" in str(e):
                raise CertProblem("tls.key does not match the certificate in tls.crt") from None
            raise CertProblem(f"tls.crt and tls.key cannot be loaded together ({e.reason or 'SSL error'})") from None
    return ctx


def key_matches(cert_pem: bytes, key_pem: bytes) -> None:
    """CertProblem when the key does not belong to the leaf certificate."""
    server_context(cert_pem, key_pem)
