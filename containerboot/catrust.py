"""Extra certificate authorities for the agent's own HTTPS checks, from the same variable tailscaled reads.

A control server whose certificate comes from a private CA (a self-hosted headscale, often) is trusted by
tailscaled when the CA's directory is in `SSL_CERT_DIR` (Go reads every file of each directory in that
colon-separated list). OpenSSL, behind Python's `ssl`, reads the same variable but finds a certificate in a
directory only under its subject-hash name (`c_rehash`), which a mounted ConfigMap does not have. So the
agent's own check of the control server (`containerboot.probes`) loads each file of those directories itself,
and says the same thing about the server as tailscaled does. `SSL_CERT_FILE` needs nothing: both read it.
"""
from __future__ import annotations

import os
import ssl
from collections.abc import Mapping

# Directories that hold the system's hashed store already (OpenSSL finds those certificates on its own, and
# reading every file of /etc/ssl/certs would cost ~100 ms for nothing).
_SYSTEM_DIRS = frozenset({"/etc/ssl/certs", "/usr/lib/ssl/certs", "/etc/pki/tls/certs"})


def extra_ca_files(env: Mapping[str, str]) -> list[str]:
    """The regular files (symlinks followed) of each `SSL_CERT_DIR` directory outside the system's store, in a
    stable order. Names starting with "." are skipped: a ConfigMap volume keeps its versions in `..<time>`
    directories behind a `..data` link, and shows each key as a link into it."""
    out: list[str] = []
    for d in (env.get("SSL_CERT_DIR") or "").split(":"):
        d = d.rstrip("/") or d
        if not d or os.path.realpath(d) in _SYSTEM_DIRS or d in _SYSTEM_DIRS:
            continue
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        out += [os.path.join(d, n) for n in names if not n.startswith(".") and os.path.isfile(os.path.join(d, n))]
    return out


def client_context(env: Mapping[str, str] = os.environ) -> ssl.SSLContext:
    """The default verifying context, plus the CAs of `extra_ca_files`. A file that is not a certificate is
    skipped (tailscaled skips it too); the check then fails as tailscaled's would, naming the server."""
    ctx = ssl.create_default_context()
    for path in extra_ca_files(env):
        try:
            ctx.load_verify_locations(cafile=path)
        except (OSError, ssl.SSLError, ValueError):
            continue
    return ctx
