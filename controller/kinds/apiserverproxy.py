"""The API server proxy's parent: a ConfigMap the chart renders when `apiServerProxy.mode` is not `off`.

The ConfigMap lives in the controller's namespace, carries the label `tailscale.com/apiserver-proxy: "true"`
and says what to run in `data`: `mode` (auth | noauth), `hostname` (the device's name, default
`kube-apiserver`), `tags` (comma-separated; default the controller's proxy tags) and `tlsSecret` (ours: a
`kubernetes.io/tls` Secret of the same namespace whose certificate the proxy serves, docs/https.md; the
proxy's Role then allows `get` on it). Deleting it (helm does
when the mode becomes `off`) removes the proxy and its device, as for any parent: it carries the finalizer.
Upstream runs this proxy inside the operator (tsnet) instead; a proxy Pod of its own has its own auth key,
device, tags and ServiceAccount like every other proxy here.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..config import ControllerConfig
from ..model import APISERVER, Decision, Invalid, Parent, ProxySpec
from ..validation import hostname_problem, tag_problems
from . import labels, meta
from .ingress import REASON_TLS

APP = "k8s-operator-apiserver-proxy"
LABEL = "tailscale.com/apiserver-proxy"
MODES = ("auth", "noauth")
DEFAULT_HOSTNAME = "kube-apiserver"
#: The chart's ClusterRole allowing `impersonate` on users and groups (auth mode binds the proxy to it).
IMPERSONATE_CLUSTER_ROLE = "tailscale-apiserver-proxy-impersonate"
#: Annotation on the ConfigMap where the controller writes the proxy's tailnet URL once it is known.
ANN_URL = "tailscale.com/apiserver-proxy-url"
_SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def handled(cm: Mapping[str, Any], cfg: ControllerConfig) -> bool:
    return labels(cm).get(LABEL) == "true" and meta(cm).get("namespace") == cfg.namespace


def tls_entry(cm: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """(data.tlsSecret, no extra names) when it is a Secret's name, else ("", ()) (`decide` says why)."""
    name = str((cm.get("data") or {}).get("tlsSecret", "")).strip()
    return (name, ()) if _SECRET_NAME.fullmatch(name) else ("", ())


def decide(cm: Mapping[str, Any], cfg: ControllerConfig, tls_secret_problem: str = "") -> Decision:
    """tls_secret_problem: `controller.tlssecret.tls_problem`'s answer for data.tlsSecret, a Warning on the
    ConfigMap."""
    m, data = meta(cm), cm.get("data") or {}
    problems: list[str] = []
    mode = str(data.get("mode", "")).strip()
    if mode not in MODES:
        problems.append(f"data.mode={mode!r} is not a mode; use auth (tailnet identities impersonated) or "
                        "noauth (the client's own credentials), or delete the ConfigMap (chart: "
                        "apiServerProxy.mode: off)")
    hostname = str(data.get("hostname", "")).strip() or DEFAULT_HOSTNAME
    if p := hostname_problem(hostname):
        problems.append(f"data.hostname: {p}")
    tags = tuple(t.strip() for t in str(data.get("tags", "")).split(",") if t.strip()) or cfg.proxy_tags
    if p := tag_problems(tags):
        problems.append(f"data.tags: {p}")
    tls_secret = str(data.get("tlsSecret", "")).strip()
    if tls_secret and not _SECRET_NAME.fullmatch(tls_secret):
        problems.append(f"data.tlsSecret={tls_secret!r} is not a Secret name (lower-case letters, digits, '-' and "
                        "'.'; chart: apiServerProxy.tls.secretName)")
    if problems:
        raise Invalid("; ".join(problems))
    parent = Parent(APISERVER, m.get("name", ""), m.get("namespace", ""), m.get("uid", ""))
    return Decision(ProxySpec(parent=parent, hostname=hostname, tags=tags, app=APP, apiserver_proxy_mode=mode,
                              tls_secret=tls_secret),
                    notices=(("Warning", REASON_TLS, tls_secret_problem),) if tls_secret_problem else ())


def url(fqdn: str, ips: tuple[str, ...] | list[str], https: bool) -> str:
    """The URL kubectl uses: the MagicDNS name (or the first address) over HTTPS or plain HTTP."""
    host = fqdn.rstrip(".") or (f"[{ips[0]}]" if ips and ":" in ips[0] else (ips[0] if ips else ""))
    return f"{'https' if https else 'http'}://{host}" if host else ""
