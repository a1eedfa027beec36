"""A small Kubernetes API client for the controller's writes (adapter, httpx over aiohttp).

kopf watches; this client reads and writes: get, list by label selector, create, JSON merge patch (the
rendered object is the whole truth for the fields it names, lists included) and delete, for the handful of
resources the controller touches. In a Pod it uses the ServiceAccount's token (re-read when kubelet rotates
it) and CA. Errors are `KubeError` with the HTTP status and the API's reason; messages are redacted.

The requests are httpx's (the shared wire format, `tscommon.kubehttp`, and the tests' mock transports), handed
straight to a transport, without an httpx client, and sent by aiohttp (`AiohttpTransport`), which kopf's watches
already use: httpx's own connection pool (httpcore over anyio's TLS streams) took about half the controller's CPU
when 500 Services came at once, and its client's steps per request a tenth more (docs/benchmarks.md).
Like kopf's watches, it connects to the API server directly: no proxy from the environment (HTTPS_PROXY).
"""
from __future__ import annotations

import asyncio
import os
import ssl
from typing import Any, Callable, Mapping, Protocol

import aiohttp
import httpx

from tscommon import crashpoint
from tscommon.jsontext import response_json
from tscommon.kubeconn import TokenFile, https_url, sa_path, service_host_port, tls_context
from tscommon.kubehttp import api_status, request, retry_after_seconds
from tscommon.redact import redact, register

from .resources import (  # noqa: F401  (re-exported: callers name resources through the client)
    CLUSTERROLEBINDINGS,
    CONFIGMAPS,
    CONNECTORS,
    CRDS,
    DEPLOYMENTS,
    DNSCONFIGS,
    ENDPOINTSLICES,
    EVENTS,
    INGRESSES,
    NAMESPACES,
    PODS,
    PROXYCLASSES,
    PROXYGROUPS,
    RECORDERS,
    ROLEBINDINGS,
    ROLES,
    SECRETS,
    SERVICEACCOUNTS,
    SERVICEMONITORS,
    SERVICES,
    STATEFULSETS,
    Resource,
)


class KubeClient(Protocol):
    """What the passes use of an API client: `Kube` below, and the in-memory fake of the unit tests
    (tests/support/fakekube.py, checked against this by mypy)."""

    async def get(self, res: Resource, name: str, namespace: str = "") -> dict | None: ...

    async def get_own(self, res: Resource, name: str, namespace: str, labels: Mapping[str, str]) -> dict | None:
        """`get` of an object the controller renders with `labels` (a read cache may answer a miss itself:
        controller.watchcache.CachedKube)."""
        ...

    async def list(self, res: Resource, namespace: str = "", selector: str = "") -> list[dict]: ...

    async def create(self, res: Resource, obj: Mapping[str, Any], namespace: str = "") -> dict: ...

    async def patch(self, res: Resource, name: str, patch: Mapping[str, Any], namespace: str = "",
                    subresource: str = "") -> dict: ...

    async def delete(self, res: Resource, name: str, namespace: str = "", *, propagation: str = "") -> bool: ...


class KubeError(Exception):
    """A failed API call. `retry_after`: the seconds the server asked the client to wait (429/503 Retry-After)."""

    def __init__(self, message: str, *, status: int = 0, reason: str = "", retry_after: float | None = None) -> None:
        super().__init__(redact(message))
        self.status, self.reason, self.retry_after = status, reason, retry_after


def path(res: Resource, namespace: str = "", name: str = "", subresource: str = "") -> str:
    p = res.prefix
    if res.namespaced:
        p += f"/namespaces/{namespace}"
    p += f"/{res.plural}"
    if name:
        p += f"/{name}"
    if subresource:
        p += f"/{subresource}"
    return p


#: How the controller's own requests name their client (the API server's audit log, a proxy's record); kopf's two
#: operators add which one they are (`controller.handlers.kopf_login`).
USER_AGENT = "tailscale-controller-py"


#: Sent with every request besides the token and content headers: gzip accepted as httpx's client did (the API
#: server compresses only large answers, lists)
HEADERS = {"User-Agent": USER_AGENT, "Accept-Encoding": "gzip"}

#: how many of its latest requests a client remembers (`Kube.requests`, for tests and request counts)
RECENT_REQUESTS = 1000


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx's requests sent with an aiohttp session (made in the event loop of the first request): the same
    requests and answers, a cheaper connection pool and TLS path. Failures are httpx's (`httpx.ConnectError`,
    `httpx.TimeoutException`, ...), so callers see no difference."""

    def __init__(self, verify: ssl.SSLContext | bool) -> None:
        self._ssl: ssl.SSLContext | bool = verify
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            # no limit of its own (the work queue bounds the passes), no cookies; bodies as sent (httpx decodes)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ssl=self._ssl), cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False, skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding",
                                                          "Content-Type"))
            self._loop = loop
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout") or {}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"), sock_read=t.get("read"))
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw
                   if k.lower() not in (b"host", b"content-length", b"connection")]
        try:
            async with self._client().request(request.method, str(request.url), headers=headers,
                                              data=request.content or None, allow_redirects=False,
                                              timeout=timeout) as r:
                body = await r.read()
                return httpx.Response(r.status, headers=list(r.raw_headers), content=body, request=request)
        except asyncio.TimeoutError as e:
            raise httpx.TimeoutException(f"timed out: {e}", request=request) from None
        except aiohttp.ClientConnectorError as e:
            raise httpx.ConnectError(str(e), request=request) from None
        except aiohttp.ClientError as e:
            raise httpx.NetworkError(f"{type(e).__name__}: {e}", request=request) from None

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


class Kube:
    """The controller's API client. `transport` and explicit credentials are for tests."""

    def __init__(self, url: str, *, token: str = "", token_file: str = "", ca_file: str = "",
                 verify: ssl.SSLContext | bool | None = None, timeout: float = 15.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._token, self.ca_file = token, ca_file
        self._token_file = TokenFile(token_file) if token_file else None
        register(token)
        if verify is None:
            verify = tls_context(ca_file) if ca_file else True
        # The transport is called directly (kubehttp.request), not through an httpx.AsyncClient: with 500 Services
        # at once the client's own steps per request were a tenth of the controller's CPU (docs/benchmarks.md).
        self._base = url.rstrip("/")
        self._transport = transport or AiohttpTransport(verify)
        self._timeout = httpx.Timeout(timeout)
        self.requests: list[tuple[str, str]] = []    # (method, path), the latest: for request counts
        #: the leader election's fence: when set and False, every write is refused before it is sent, so a
        #: replica that lost the Lease cannot write even from a pass that was already running
        self.write_guard: Callable[[], bool] | None = None

    @property
    def url(self) -> str:
        return self._base

    def token(self) -> str:
        """The current bearer token (re-read when its file changes): kopf's login uses the same credentials."""
        return self._token_file.get() if self._token_file else self._token

    @classmethod
    def in_cluster(cls, env: Mapping[str, str] = os.environ) -> "Kube":
        host, port = service_host_port(env)
        url = env.get("CONTROLLER_KUBE_URL", "")
        if not url and not host:
            raise KubeError("KUBERNETES_SERVICE_HOST is not set: the controller runs in a Pod with a "
                            "ServiceAccount (or set CONTROLLER_KUBE_URL)")
        return cls(url or https_url(host, port or "443"),
                   token_file=env.get("CONTROLLER_KUBE_TOKEN_FILE", sa_path("token")),
                   ca_file=env.get("CONTROLLER_KUBE_CA_FILE", sa_path("ca.crt")))

    async def _call(self, method: str, p: str, *, body: Any = None, ctype: str = "application/json",
                    params: Mapping[str, str] | None = None, ok404: bool = False) -> Any:
        if method != "GET" and self.write_guard is not None and not self.write_guard():
            raise KubeError(f"{method} {p}: refused, this replica does not hold the leader Lease")
        self.requests.append((method, p))
        if len(self.requests) > 2 * RECENT_REQUESTS:     # the latest only: a long-running controller keeps no log
            del self.requests[:-RECENT_REQUESTS]
        try:
            r = await self._transport.handle_async_request(request(
                method, self._base + p, token=self.token(), body=body, content_type=ctype, params=params,
                headers=HEADERS, timeout=self._timeout))
            await r.aread()
        except httpx.HTTPError as e:
            raise KubeError(f"{method} {p}: API server unreachable ({type(e).__name__}: {e})") from None
        if r.status_code == 404 and ok404:
            return None
        if r.status_code >= 400:
            st = api_status(r)
            raise KubeError(f"{method} {p}: {r.status_code} {st.message or r.text[:200]}",
                            status=r.status_code, reason=st.reason,
                            retry_after=retry_after_seconds(r.headers.get("Retry-After")))
        try:
            out = response_json(r) if r.content else {}
        except ValueError:
            out = None
        if not isinstance(out, dict):
            # Every answer of the API server is a JSON object; anything else (a proxy's error page, a cut
            # stream) is a failed request, retried like one, not a value to read fields from.
            raise KubeError(f"{method} {p}: {r.status_code} answer is not a JSON object", status=r.status_code,
                            reason="InvalidResponse")
        return out

    async def get(self, res: Resource, name: str, namespace: str = "") -> dict | None:
        return await self._call("GET", path(res, namespace, name), ok404=True)

    async def get_own(self, res: Resource, name: str, namespace: str, labels: Mapping[str, str]) -> dict | None:
        return await self.get(res, name, namespace)

    async def list(self, res: Resource, namespace: str = "", selector: str = "") -> list[dict]:
        out = await self._call("GET", path(res, namespace), params={"labelSelector": selector} if selector else None)
        items = out.get("items") or []
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise KubeError(f"GET {path(res, namespace)}: the list's items are not objects", reason="InvalidResponse")
        return items

    async def create(self, res: Resource, obj: Mapping[str, Any], namespace: str = "") -> dict:
        crashpoint.hit(crashpoint.KUBE_WRITE)
        return await self._call("POST", path(res, namespace), body=obj)

    async def patch(self, res: Resource, name: str, patch: Mapping[str, Any], namespace: str = "",
                    subresource: str = "") -> dict:
        crashpoint.hit(crashpoint.KUBE_WRITE)
        return await self._call("PATCH", path(res, namespace, name, subresource), body=patch,
                                ctype="application/merge-patch+json")

    async def delete(self, res: Resource, name: str, namespace: str = "", *, propagation: str = "") -> bool:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation} if propagation else None
        crashpoint.hit(crashpoint.KUBE_WRITE)
        out = await self._call("DELETE", path(res, namespace, name), body=body, ok404=True)
        return out is not None

    async def served(self, prefix: str) -> frozenset[str] | None:
        """API discovery of one group version (`/apis/<group>/<version>`): the plurals it serves (not their
        subresources), None when the group version is not served at all."""
        out = await self._call("GET", prefix, ok404=True)
        if out is None:
            return None
        return frozenset(r["name"] for r in out.get("resources") or []
                         if isinstance(r, dict) and isinstance(r.get("name"), str) and "/" not in r["name"])

    async def aclose(self) -> None:
        await self._transport.aclose()
