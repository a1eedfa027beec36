"""In-cluster Kubernetes API client for the agent's state Secret (adapter).

Only what the agent needs: read, create and patch one Secret, and ask SelfSubjectAccessReviews. Compared with
upstream's client it adds what a Pod entrypoint needs to be robust: a clear error for every missing
ServiceAccount file, IPv6-safe URLs built from the environment, the bearer token re-read whenever the projected
file changes and after a 401, per-request timeouts, and retries with exponential backoff and jitter on 5xx, 429
(honouring Retry-After) and connection errors, all bounded by a caller-supplied deadline. A 409 Conflict on a
write that carries no resourceVersion precondition (the agent's patches and creates) is retried the same way:
such a write does not depend on the version it would conflict with, so re-sending it is the "re-read and
re-apply" the API server asks for (the server applies a patch to its latest version); upstream's client gives
up on it and the container restarts. A 409 on a write with a precondition, and a 409 ``AlreadyExists`` on
create, are final: the caller must decide. A 403 becomes a message naming the verb, the object and the RBAC
rule to add.

Deadlines are absolute ``time.monotonic()`` values (the asyncio loop's clock on Linux). Secrets never reach a
log line or an exception message: tokens are registered with ``redact`` and every message goes through it.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import os
import random
import ssl
import time
import types
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import httpx

from tscommon import crashpoint
from tscommon.jsontext import response_json
from tscommon.kubeconn import SA_DIR, TokenFile, https_url, service_host_port, tls_context
from tscommon.kubehttp import api_status, retry_after_seconds, send
from tscommon.redact import redact, register

log = logging.getLogger("containerboot")

DEFAULT_URL = "https://kubernetes.default.svc"
FIELD_MANAGER = "tailscale-container"
SSAR_PATH = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
_CREDENTIAL_KEYS = ("authkey", "reissue_authkey")
_LAST_ATTEMPT = 0.2     # seconds kept for a final attempt before a deadline

_SA_FILE_HELP = {
    "token": "the ServiceAccount token (set automountServiceAccountToken: true on the Pod or its ServiceAccount)",
    "ca.crt": "the cluster CA bundle (mounted with the ServiceAccount token)",
    "namespace": "the Pod namespace (mounted with the ServiceAccount token)",
}


class KubeError(Exception):
    """A failed Kubernetes API call or client setup. str(e) is the user-facing message, already redacted.

    status: HTTP status (0 when there was no HTTP answer: configuration, connection or deadline).
    reason: the Status ``reason`` (NotFound, Forbidden, Conflict, AlreadyExists, Invalid, ...), or one of
    ``Config``, ``Unreachable``, ``Timeout`` for client-side failures.
    """

    def __init__(self, message: str, *, status: int = 0, reason: str = "", verb: str = "",
                 resource: str = "", name: str = "") -> None:
        super().__init__(redact(message))
        self.status = status
        self.reason = reason
        self.verb = verb
        self.resource = resource
        self.name = name


@dataclass(frozen=True)
class Secret:
    name: str
    resource_version: str
    data: Mapping[str, bytes] = field(default_factory=lambda: types.MappingProxyType({}))
    labels: Mapping[str, str] = field(default_factory=lambda: types.MappingProxyType({}))


def rbac_hint(verb: str, resource: str, name: str = "") -> str:
    """The Role rule that would allow verb on resource[/name], as a one-line YAML hint."""
    group = "authorization.k8s.io" if resource == "selfsubjectaccessreviews" else ""
    rule = f'kind: Role rules: - apiGroups: ["{group}"] resources: ["{resource}"] verbs: ["{verb}"]'
    # RBAC cannot restrict create (or list) by name: the request has no name when it is authorised.
    if name and verb not in ("create", "list", "watch"):
        rule += f' resourceNames: ["{name}"]'
    return rule


def api_url_from_env(env: Mapping[str, str], *, root: str = "/") -> str:
    """The API server URL: kubernetes.default.svc, or the service env vars (IPv6 hosts bracketed)."""
    if root.rstrip("/") == "" and env.get("TS_KUBERNETES_READ_API_SERVER_ADDRESS_FROM_ENV") != "true":
        return DEFAULT_URL
    host, port = service_host_port(env)
    if not host:
        raise KubeError("KUBERNETES_SERVICE_HOST is empty, but the API server address must come from the "
                        "environment (TS_KUBERNETES_READ_API_SERVER_ADDRESS_FROM_ENV=true or a test root); "
                        "set KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT_HTTPS", reason="Config")
    return https_url(host, port)


class _Token(TokenFile):
    """The shared token file, with the agent's messages for a missing or empty one."""

    def get(self, *, force: bool = False) -> str:
        try:
            value = super().get(force=force)
        except OSError as e:
            raise KubeError(f"cannot read the ServiceAccount token {self.path}: {e.strerror or e}; mount "
                            f"{_SA_FILE_HELP['token']}", reason="Config") from None
        if not value:
            raise KubeError(f"the ServiceAccount token file {self.path} is empty", reason="Config")
        return value


class KubeClient:
    """Async client for one namespace. Create with from_environment(); close with aclose()."""

    def __init__(self, *, url: str, namespace: str, token_path: str, ca_path: str,
                 timeout: float = 10.0, retry_budget: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.namespace = namespace
        self.timeout = timeout
        self.retry_budget = retry_budget
        self._token = _Token(token_path)
        try:
            ctx = tls_context(ca_path)
        except (ssl.SSLError, OSError) as e:
            raise KubeError(f"the cluster CA bundle {ca_path} is not a valid PEM certificate file: {e}",
                            reason="Config") from None
        self._http = httpx.AsyncClient(verify=ctx, transport=transport, timeout=timeout,
                                       headers={"Accept": "application/json",
                                                "User-Agent": "containerboot-py"})

    @classmethod
    def from_environment(cls, env: Mapping[str, str], *, root: str = "/", url: str | None = None,
                         timeout: float = 10.0, retry_budget: float = 30.0) -> "KubeClient":
        """Build a client from <root>/var/run/secrets/kubernetes.io/serviceaccount and the environment."""
        sa = os.path.join(root, SA_DIR)
        for name in ("token", "ca.crt", "namespace"):
            p = os.path.join(sa, name)
            if not os.path.isfile(p):
                raise KubeError(
                    f"Kubernetes ServiceAccount file {p} is missing: mount {_SA_FILE_HELP[name]}, or set "
                    f"TS_KUBE_SECRET=\"\" to run without a Kubernetes state Secret", reason="Config")
        try:
            with open(os.path.join(sa, "namespace"), encoding="utf-8") as f:
                namespace = f.read().strip()
        except OSError as e:
            raise KubeError(f"cannot read {os.path.join(sa, 'namespace')}: {e.strerror}", reason="Config") from None
        if not namespace:
            raise KubeError(f"the namespace file {os.path.join(sa, 'namespace')} is empty", reason="Config")
        return cls(url=url or api_url_from_env(env, root=root), namespace=namespace,
                   token_path=os.path.join(sa, "token"), ca_path=os.path.join(sa, "ca.crt"),
                   timeout=timeout, retry_budget=retry_budget)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "KubeClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- Secrets

    def _secret_url(self, name: str = "") -> str:
        base = f"{self.url}/api/v1/namespaces/{self.namespace}/secrets"
        return f"{base}/{name}" if name else base

    async def get_secret(self, name: str, *, deadline: float | None = None) -> Secret | None:
        """The Secret, or None if it does not exist."""
        try:
            obj = await self._request("GET", self._secret_url(name), verb="get", name=name, deadline=deadline)
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        return _secret_from_json(name, obj)

    async def get_secret_in(self, namespace: str, name: str) -> dict | None:
        """A Secret of any namespace as the API returns it (the user's TLS Secret), or None if it does not exist."""
        url = f"{self.url}/api/v1/namespaces/{namespace}/secrets/{name}"
        try:
            obj = await self._request("GET", url, verb="get", name=f"{namespace}/{name}")
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        return obj if isinstance(obj, dict) else None

    async def patch_secret(self, name: str, data: Mapping[str, bytes | None], *,
                           deadline: float | None = None) -> None:
        """Strategic-merge-patch data into the Secret; a None value deletes the key."""
        body = {"data": {k: (None if v is None else base64.b64encode(v).decode()) for k, v in sorted(data.items())}}
        await self._request("PATCH", self._secret_url(name), verb="patch", name=name, deadline=deadline,
                            params={"fieldManager": FIELD_MANAGER}, json_body=body,
                            content_type="application/strategic-merge-patch+json", retry_conflict=True)

    async def json_patch_secret(self, name: str, ops: Sequence[Mapping[str, Any]], *,
                                deadline: float | None = None) -> None:
        """Apply an RFC 6902 patch to the Secret (values under /data/<key> must already be base64)."""
        ops = [dict(op) for op in ops]
        # Without a resourceVersion in the patch a 409 is transient; with one, the caller asked for a precondition.
        precondition = any(str(op.get("path", "")).startswith("/metadata/resourceVersion") for op in ops)
        await self._request("PATCH", self._secret_url(name), verb="patch", name=name, deadline=deadline,
                            json_body=ops, content_type="application/json-patch+json",
                            retry_conflict=not precondition)

    async def create_secret(self, name: str, data: Mapping[str, bytes | None], *,
                            deadline: float | None = None) -> None:
        """Create the Secret with data (None values are skipped). KubeError(409, AlreadyExists) if it exists."""
        body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": self.namespace},
                "type": "Opaque",
                "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items()) if v is not None}}
        await self._request("POST", self._secret_url(), verb="create", name=name, deadline=deadline,
                            json_body=body, params={"fieldManager": FIELD_MANAGER}, retry_conflict=True)

    async def can_i(self, verb: str, resource: str, name: str = "", *, deadline: float | None = None) -> bool:
        """SelfSubjectAccessReview for verb on resource (optionally one named object) in our namespace."""
        attrs = {"namespace": self.namespace, "verb": verb, "resource": resource}
        if name:
            attrs["name"] = name
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attrs}}
        obj = await self._request("POST", self.url + SSAR_PATH, verb="create",
                                  resource="selfsubjectaccessreviews", deadline=deadline, json_body=body)
        return bool(((obj or {}).get("status") or {}).get("allowed"))

    async def readyz(self, timeout: float = 5.0) -> tuple[str, bool]:
        """One `GET /readyz`, no retry and no log line (the reachability check): ("", True) when the API server is
        ready, else (what went wrong, whether the server answered at all)."""
        try:
            resp = await self._http.get(self.url + "/readyz", timeout=timeout,
                                        headers={"Authorization": "Bearer " + self._token.get()})
        except httpx.TimeoutException:
            return f"GET /readyz: no answer within {timeout:g}s", False
        except httpx.TransportError as e:
            return redact(f"GET /readyz: cannot reach {self.url}: {type(e).__name__}: {e}"), False
        except KubeError as e:   # the token file: a configuration problem, said as it is
            return str(e), True
        if resp.status_code == 200:
            return "", True
        return redact(f"GET /readyz: HTTP {resp.status_code}: {resp.text[:200].strip()}"), True

    # ---- transport

    async def _request(self, method: str, url: str, *, verb: str, name: str = "", resource: str = "secrets",
                       deadline: float | None = None, params: Mapping[str, str] | None = None,
                       json_body: Any = None, content_type: str = "application/json",
                       retry_conflict: bool = False) -> Any:
        """One API call with auth, retries and a deadline. Returns the decoded JSON body of a 200/201.

        retry_conflict: the write carries no resourceVersion precondition, so a 409 Conflict (not AlreadyExists)
        is transient and is retried like a 5xx."""
        if deadline is None:
            deadline = time.monotonic() + self.retry_budget
        if method in ("POST", "PATCH", "PUT", "DELETE") and resource == "secrets":
            crashpoint.hit(crashpoint.SECRET_WRITE)
        what = f'{resource} "{name}"' if name else resource
        attempt = 0
        reauthed = False
        started = time.monotonic()
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KubeError(f"{verb} {what}: deadline exceeded before the request could be sent "
                                f"to {self.url}", reason="Timeout", verb=verb, resource=resource, name=name)
            retry_after: float | None = None
            try:
                resp = await send(self._http, method, url, token=self._token.get(), body=json_body,
                                  content_type=content_type, params=params,
                                  timeout=httpx.Timeout(min(self.timeout, remaining)))
            except httpx.TransportError as e:
                problem = f"cannot reach the Kubernetes API server at {self.url}: {type(e).__name__}: {e}"
                status = 0
            else:
                status = resp.status_code
                if status in (200, 201):
                    try:
                        return response_json(resp) if resp.content else None
                    except ValueError:
                        raise KubeError(f"{verb} {what}: the API server sent a body that is not JSON",
                                        status=status, reason="InvalidResponse", verb=verb, resource=resource,
                                        name=name) from None
                st = api_status(resp)
                reason = st.reason
                message = st.message or resp.reason_phrase
                if status == 401 and not reauthed:
                    # The projected token may have been rotated under us: re-read it and retry once.
                    reauthed = True
                    self._token.get(force=True)
                    continue
                if status == 401:
                    raise KubeError(f"{verb} {what}: the API server rejected the ServiceAccount token "
                                    f"(401 Unauthorized: {message}); check that the token at "
                                    f"{self._token.path} is current and belongs to this cluster",
                                    status=401, reason=reason or "Unauthorized", verb=verb, resource=resource,
                                    name=name)
                if status == 403:
                    raise KubeError(f"not allowed to {verb} {what} in namespace \"{self.namespace}\" "
                                    f"(403 Forbidden: {message}); grant the Pod's ServiceAccount this "
                                    f"permission, e.g. {rbac_hint(verb, resource, name)}",
                                    status=403, reason=reason or "Forbidden", verb=verb, resource=resource,
                                    name=name)
                conflict = status == 409 and retry_conflict and reason != "AlreadyExists"
                if not (status >= 500 or status == 429 or conflict):
                    raise KubeError(f"{verb} {what}: {status} {reason or resp.reason_phrase}: {message}",
                                    status=status, reason=reason, verb=verb, resource=resource, name=name)
                problem = f"the API server answered {status} {reason or resp.reason_phrase}: {message}"
                retry_after = retry_after_seconds(resp.headers.get("Retry-After"))
            delay = min(0.2 * 2 ** (attempt - 1), 5.0) * random.uniform(0.5, 1.5)
            remaining = deadline - time.monotonic()
            if retry_after is not None:
                delay = max(delay, retry_after)
            elif delay > remaining - _LAST_ATTEMPT and remaining > 2 * _LAST_ATTEMPT:
                # Use the budget fully: one last attempt just before the deadline rather than giving up early.
                delay = remaining - _LAST_ATTEMPT
            if delay > remaining - _LAST_ATTEMPT:
                raise KubeError(f"{verb} {what}: giving up after {attempt} attempt(s) in "
                                f"{time.monotonic() - started:.1f}s: {problem}",
                                status=status, reason="Unreachable" if status == 0 else "Timeout",
                                verb=verb, resource=resource, name=name)
            log.info("%s", redact(f"kube: {verb} {what}: {problem}; retrying in {delay:.1f}s"))
            await asyncio.sleep(delay)


def _secret_from_json(name: str, obj: Any) -> Secret:
    def invalid(what: str) -> KubeError:
        return KubeError(f'secrets "{name}": the API server sent a Secret whose {what}', reason="InvalidResponse",
                         verb="get", resource="secrets", name=name)

    obj = obj if isinstance(obj, dict) else {}
    meta, raw_data = obj.get("metadata") or {}, obj.get("data") or {}
    if not isinstance(meta, dict):
        raise invalid("metadata is not an object")
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise invalid("metadata.labels is not an object of strings")
    if not isinstance(raw_data, dict):
        raise invalid("data is not an object")
    data: dict[str, bytes] = {}
    for k, v in raw_data.items():
        try:
            if not isinstance(v, str | None):
                raise ValueError(k)
            data[k] = base64.b64decode(v or "", validate=True)
        except ValueError:
            raise invalid(f"value of key {k!r} is not valid base64") from None
    # Credentials read from the Secret must be masked wherever they might show up later (headscale's hex
    # pre-auth keys have no recognisable prefix, so the pattern-based redaction alone would miss them).
    for k in _CREDENTIAL_KEYS:
        if data.get(k):
            register(data[k].decode(errors="replace").strip())
    return Secret(name=str(meta.get("name") or name), resource_version=str(meta.get("resourceVersion") or ""),
                  data=types.MappingProxyType(data), labels=types.MappingProxyType(dict(labels)))
