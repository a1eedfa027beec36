"""`containerboot apiserver-proxy`: the API server proxy next to a running agent (entrypoint, imperative shell).

It runs as a second container of the proxy's Pod (same network namespace, tailscaled's LocalAPI socket on a
shared volume): it waits until tailscaled is Running with tailnet addresses, then serves on those addresses
only: HTTPS on 443 with the control plane's certificate when the tailnet has certificate domains; otherwise
(headscale issues no certificates; WireGuard already encrypts the path) plain HTTP on 80 in auth mode, and
in noauth mode HTTPS on 443 with a self-signed certificate made at start, because kubectl sends a
kubeconfig's credentials over TLS only (client-go drops them for an http:// server). Requests go to the API
server from the Pod's environment (KUBERNETES_SERVICE_HOST/PORT) over TLS verified with the cluster CA.

With TS_APISERVER_PROXY_TLS_SECRET (a `kubernetes.io/tls` Secret of the Pod's namespace, read through the API
server) it serves HTTPS on 443 with that certificate on any control plane, re-read every 20 s: a renewed
certificate reaches new connections, open ones (`logs -f`, `exec`) keep theirs, and a bad one (another name,
expired, a key that does not match) is logged and the last good one stays (containerboot.tlsterm).

Environment: TS_APISERVER_PROXY_MODE (auth | noauth, required), TS_SOCKET (tailscaled's LocalAPI socket),
TS_APISERVER_PROXY_PORT (listening port instead of 80/443), TS_APISERVER_PROXY_HTTP=true (plain HTTP even
where a certificate could be issued), TS_APISERVER_PROXY_TLS_SECRET (the name of your certificate's Secret).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import socket
import ssl
import subprocess
import tempfile
from collections.abc import Mapping
from urllib.parse import urlsplit

from ..kube.client import SA_DIR, KubeError, _Token, api_url_from_env
from ..localapi import LocalAPI, LocalAPIError
from .server import AUTH, NOAUTH, ApiServerProxy, Upstream

log = logging.getLogger("containerboot")
_IP_FREEBIND = 15           # Linux: bind before the address is on tailscale0 (or while IPv6 DAD runs)
#: Seconds between asking tailscaled for the certificate again. tailscaled renews a certificate ahead of its
#: expiry (days ahead for a 90-day certificate) and answers from its cache meanwhile: twice a day is plenty.
_CERT_REFRESH = 12 * 3600


class ConfigError(Exception):
    pass


def settings(env: Mapping[str, str], root: str = "/") -> tuple[str, str, str, int | None, bool]:
    """(mode, socket, API server URL, port override, force HTTP); ConfigError naming the variable."""
    mode = env.get("TS_APISERVER_PROXY_MODE", "").strip()
    if mode not in (AUTH, NOAUTH):
        raise ConfigError(f"TS_APISERVER_PROXY_MODE={mode!r} is not a mode; set it to {AUTH!r} (tailnet "
                          f"identities impersonated) or {NOAUTH!r} (the client's own credentials)")
    port_text = env.get("TS_APISERVER_PROXY_PORT", "").strip()
    if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ConfigError(f"TS_APISERVER_PROXY_PORT={port_text!r} is not a port; set a number from 1 to 65535")
    try:
        url = api_url_from_env({**env, "TS_KUBERNETES_READ_API_SERVER_ADDRESS_FROM_ENV": "true"}, root=root)
    except KubeError as e:
        raise ConfigError(str(e)) from None
    return (mode, env.get("TS_SOCKET", "/tmp/tailscaled.sock"), url, int(port_text) if port_text else None,
            env.get("TS_APISERVER_PROXY_HTTP", "").lower() in ("1", "true"))


def upstream_from(url: str, ca_path: str) -> Upstream:
    parts = urlsplit(url)
    host = parts.hostname or ""
    return Upstream(host, parts.port or 443, ssl.create_default_context(cafile=ca_path),
                    parts.netloc.encode())


async def wait_running(lapi: LocalAPI) -> dict:
    """tailscaled's status once it is Running with tailnet addresses."""
    said = False
    while True:
        try:
            st = await lapi.status()
            if st.get("BackendState") == "Running" and (st.get("Self") or {}).get("TailscaleIPs"):
                return st
        except LocalAPIError as e:
            if not said:
                log.info("api-server-proxy: waiting for tailscaled (%s)", e)
                said = True
        await asyncio.sleep(1)


def _listener(ip: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_IP, _IP_FREEBIND, 1)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((ip, port))
    s.listen(128)
    s.setblocking(False)
    return s


async def _load_cert(lapi: LocalAPI, domain: str, ctx: ssl.SSLContext) -> bytes:
    """Ask tailscaled for `domain`'s certificate pair and load it into ctx (new handshakes use it); returns
    the certificate chain's PEM."""
    cert, key = await lapi.cert_pair(domain)
    with tempfile.TemporaryDirectory() as d:     # ssl loads from files only; gone once loaded
        cp, kp = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        with open(cp, "wb") as f:
            f.write(cert)
        with open(os.open(kp, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(key)
        # checked on a scratch context first: a key that does not match would otherwise leave the live one
        # with the new certificate and the old key, and every later handshake would fail
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cp, kp)
        ctx.load_cert_chain(cp, kp)
    return cert


def self_signed(names: list[str], ips: list[str], ctx: ssl.SSLContext) -> str:
    """Load a new self-signed certificate for `names` and `ips` (openssl CLI, EC P-256, ten years) into ctx;
    returns its SHA-256 fingerprint. The key never leaves a private temporary directory."""
    sans = [f"DNS:{n}" for n in names if n] + [f"IP:{ip}" for ip in ips]
    with tempfile.TemporaryDirectory() as d:
        cp, kp = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "3650", "-subj", f"/CN={(names + ips)[0]}",
                        "-addext", f"subjectAltName={','.join(sans)}", "-keyout", kp, "-out", cp],
                       check=True, capture_output=True, timeout=60)
        ctx.load_cert_chain(cp, kp)
        with open(cp) as f:
            der = ssl.PEM_cert_to_DER_cert(f.read())
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


async def serve(env: Mapping[str, str], root: str = "/") -> int:
    try:
        mode, sock_path, url, port, force_http = settings(env, root)
    except ConfigError as e:
        log.error("invalid configuration: %s", e)
        return 1
    sa = os.path.join(root, SA_DIR)
    token = _Token(os.path.join(sa, "token"))
    try:
        upstream = upstream_from(url, os.path.join(sa, "ca.crt"))
    except (OSError, ssl.SSLError) as e:
        log.error("api-server-proxy: cannot load the cluster CA %s: %s; mount the ServiceAccount's ca.crt",
                  os.path.join(sa, "ca.crt"), e)
        return 1
    lapi = LocalAPI(sock_path)
    proxy = ApiServerProxy(mode=mode, upstream=upstream, token=token.get, whois=lapi.whois, status=lapi.status)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiting = asyncio.ensure_future(wait_running(lapi))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        waiting.cancel()
        return 0
    st = waiting.result()
    ips = [ip for ip in st["Self"]["TailscaleIPs"]]
    domains = [d for d in (st.get("CertDomains") or []) if d]
    dns_name = str((st.get("Self") or {}).get("DNSName") or "").removesuffix(".")
    tls: ssl.SSLContext | None = None
    cert = b""
    own: asyncio.Future = asyncio.ensure_future(asyncio.sleep(0))   # the user's certificate's watcher, if any
    secret = env.get("TS_APISERVER_PROXY_TLS_SECRET", "").strip()
    if secret:
        if force_http:
            log.error("invalid configuration: TS_APISERVER_PROXY_TLS_SECRET=%r and TS_APISERVER_PROXY_HTTP=true "
                      "contradict each other; unset one", secret)
            return 1
        try:
            tls, own = await _own_certificate(env, root, secret, dns_name, stop)
        except ConfigError as e:
            log.error("api-server-proxy: %s", e)
            return 1
        if tls is None:
            return 0                                    # stopped while waiting for a good certificate
    elif not force_http and (domains or mode == NOAUTH):
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.set_alpn_protocols(["http/1.1"])     # SPDY (exec, port-forward) does not survive HTTP/2
        if domains:
            try:
                cert = await _load_cert(lapi, domains[0], tls)
            except (LocalAPIError, OSError, ssl.SSLError) as e:
                log.error("api-server-proxy: cannot get the certificate of %s from tailscaled: %s; HTTPS "
                          "certificates must be enabled for the tailnet (or set TS_APISERVER_PROXY_HTTP=true)",
                          domains[0], e)
                return 1
        else:
            try:
                fp = self_signed([dns_name], ips, tls)
            except (OSError, subprocess.SubprocessError, ssl.SSLError) as e:
                log.error("api-server-proxy: cannot make a self-signed certificate with openssl: %s", e)
                return 1
            log.info("api-server-proxy: no certificate from the control plane; serving HTTPS with a self-signed "
                     "certificate (SHA-256 %s), since kubectl sends credentials over TLS only: set "
                     "insecure-skip-tls-verify: true for this cluster in the kubeconfig (the tailnet already "
                     "authenticates this node)", fp)
    port = port or (443 if tls else 80)
    servers = [await asyncio.start_server(proxy.handle, sock=_listener(ip, port), ssl=tls) for ip in ips]
    scheme = "https" if tls else "http"
    name = domains[0] if domains and not secret else dns_name
    default_port = {"http": 80, "https": 443}[scheme]
    suffix = "" if port == default_port else f":{port}"
    log.info("API server proxy in %s mode is listening on %s (%s)", mode,
             f"{scheme}://{name or ips[0]}{suffix}",
             ", ".join(f"{scheme}://{'[' + ip + ']' if ':' in ip else ip}{suffix}" for ip in ips))
    # the control plane's certificate is renewed by tailscaled: re-read it now and then (a self-signed one lasts)
    refresh = (asyncio.ensure_future(_refresh_cert(lapi, domains[0], tls, cert)) if tls and domains and not secret
               else None)
    await stop.wait()
    if refresh:
        refresh.cancel()
    own.cancel()
    for s in servers:
        s.close()
    return 0


async def _own_certificate(env: Mapping[str, str], root: str, secret: str, dns_name: str, stop: asyncio.Event
                           ) -> "tuple[ssl.SSLContext | None, asyncio.Future]":
    """The listener's context for the user's certificate once a good one is read (None if stopped first), and
    the task that keeps it current."""
    from ..kube.client import KubeClient
    from ..tlsterm import CertWatcher, ContextSwitch, KubeSecretSource
    try:
        client = KubeClient.from_environment(env, root=root)
    except KubeError as e:
        raise ConfigError(f"TS_APISERVER_PROXY_TLS_SECRET={secret!r} needs the Kubernetes API: {e}") from None
    switch = ContextSwitch()
    watcher = CertWatcher(KubeSecretSource(client, client.namespace, secret), switch,
                          lambda: (dns_name,) if dns_name else ())
    while not await watcher.refresh():
        try:
            await asyncio.wait_for(stop.wait(), watcher.interval)
            return None, asyncio.ensure_future(client.aclose())
        except asyncio.TimeoutError:
            continue

    async def keep() -> None:
        try:
            await watcher.run()
        finally:
            await client.aclose()
    return switch.front, asyncio.ensure_future(keep())


async def _refresh_cert(lapi: LocalAPI, domain: str, ctx: ssl.SSLContext, current: bytes) -> None:
    """Every _CERT_REFRESH seconds, ask tailscaled again (it renews the certificate before it expires and
    answers with the cached one until then); a different certificate is loaded for the next handshakes, the
    open connections keep theirs. A failure keeps the loaded certificate and is retried at the next turn."""
    while True:
        await asyncio.sleep(_CERT_REFRESH)
        try:
            cert = await _load_cert(lapi, domain, ctx)
        except (LocalAPIError, OSError, ssl.SSLError) as e:
            log.warning("api-server-proxy: cannot refresh the certificate of %s: %s", domain, e)
            continue
        if cert != current:
            log.info("api-server-proxy: serving a renewed certificate for %s", domain)
            current = cert


def main(env: Mapping[str, str]) -> int:
    return asyncio.run(serve(env, env.get("TS_TEST_ONLY_ROOT") or "/"))
