"""The in-cluster connection both Kubernetes clients set up: the agent's (`containerboot.kube.client`) and the
controller's (`controller.kubeapi`). Each keeps its own calls, retries and errors; what they share is how a
Pod reaches its API server: the ServiceAccount directory, the API server's address from the Service
environment (an IPv6 host bracketed), the cluster CA as a TLS context, and the bearer token, re-read whenever
kubelet rotates the projected file and registered for redaction before it can reach any message.
"""
from __future__ import annotations

import os
import ssl
from collections.abc import Mapping

from tscommon.redact import register

#: Where kubelet mounts the ServiceAccount's token, CA bundle and namespace, relative to the file system root.
SA_DIR = "var/run/secrets/kubernetes.io/serviceaccount"


def sa_path(name: str, root: str = "/") -> str:
    """A ServiceAccount file (`token`, `ca.crt`, `namespace`) under `root`."""
    return os.path.join(root, SA_DIR, name)


def service_host_port(env: Mapping[str, str]) -> tuple[str, str]:
    """The API server's host and port from the Service environment Kubernetes sets in every container
    (KUBERNETES_SERVICE_HOST, KUBERNETES_SERVICE_PORT_HTTPS, else KUBERNETES_SERVICE_PORT); either may be ""."""
    host = env.get("KUBERNETES_SERVICE_HOST", "").strip()
    port = env.get("KUBERNETES_SERVICE_PORT_HTTPS", "").strip() or env.get("KUBERNETES_SERVICE_PORT", "").strip()
    return host, port


def https_url(host: str, port: str = "") -> str:
    """`https://host[:port]`, with an IPv6 literal host bracketed (a bare one would make the port ambiguous)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"https://{host}:{port}" if port else f"https://{host}"


def tls_context(ca_file: str) -> ssl.SSLContext:
    """A client TLS context that trusts the cluster CA bundle only. Raises ssl.SSLError or OSError."""
    return ssl.create_default_context(cafile=ca_file)


class TokenFile:
    """The bearer token file, re-read whenever it changes on disk (kubelet rotates projected tokens) or when
    asked to (`force`, after a 401). Every value read is registered for redaction first."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._value = ""

    def get(self, *, force: bool = False) -> str:
        """The current token, "" when the file is empty. Raises OSError when it cannot be read."""
        st = os.stat(self.path)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if force or stamp != self._stamp:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                value = f.read().strip()
            register(value)
            self._value, self._stamp = value, stamp
        return self._value
