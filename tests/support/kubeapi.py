"""A test Kubernetes API server that honours the real wire contract, for the agent and for a real tailscaled.

It is not a mock of our own client: it speaks HTTPS with its own CA, demands a bearer token, stores namespaced
objects (Secrets with validation, Events and ConfigMaps generically) with a cluster-wide ``resourceVersion``,
and answers GET/list, POST, PUT, DELETE and PATCH in the three content types the real apiserver accepts
for Secrets (JSON patch with the apiserver's lenient ``replace``, merge patch, strategic merge patch).
Authorisation comes from per-test RBAC-like rules, which also answer SelfSubjectAccessReviews, so a 403 and
an SSAR always agree, exactly as in a cluster. Faults (status codes with their reason, e.g. the 409 Conflict
an admission webhook can give; Retry-After, dropped connections, latency) can be injected for the next N
matching requests; every request is logged for assertions.

In-process use::

    with KubeAPIServer(namespace="ns", rules=[(["get", "patch"], "secrets", ["ts-state"])]) as api:
        api.write_sa_root(tmp_path)            # <tmp>/var/run/secrets/kubernetes.io/serviceaccount/*
        env = api.env()                        # KUBERNETES_SERVICE_HOST/PORT_HTTPS (+ read-from-env flag)
        ...
        api.secret_data("ts-state")            # -> {"key": b"value"} or None
        api.requests                           # [RequestRecord(method, path, content_type, verb, ...)]

Out of process (netns tests, a real ``tailscaled --state=kube:<name>``)::

    python -m tests.support.kubeapi --listen 127.0.0.1:6443 --dir /tmp/sa [--namespace ns] [--token T]

writes ``ca.crt``, ``token`` and ``namespace`` into ``--dir`` (usable as a ServiceAccount dir), prints one JSON
line with ``url`` and ``env``, serves until SIGTERM/SIGINT and then dumps objects and the request log to
``<dir>/state.json``. Test-only endpoints under ``/_test/`` (no auth) inspect and steer a running server.

Differences from a real apiserver are listed in ``FIDELITY`` below.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import copy
import datetime
import http.server
import ipaddress
import json
import os
import re
import secrets as _secrets
import signal
import socket
import socketserver
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

FIDELITY = """\
Faithful: HTTPS with a CA-signed serving cert (SANs 127.0.0.1, ::1, localhost, kubernetes.default.svc and
friends, plus the listen host); 401 Status for a missing or wrong bearer token; Status objects with
kind/apiVersion/status/message/reason/details/code; NotFound, AlreadyExists, Conflict (resourceVersion
preconditions on PUT and on patches that carry metadata.resourceVersion), Forbidden with the real message
shape, 415 for apply patches; Secret validation (key charset, base64 data, stringData folded into data, 1 MiB
limit, empty data omitted from responses so a JSON-patch add on /data/<k> fails until /data exists);
system metadata (uid, creationTimestamp, namespace, name) cannot be changed by writes; a no-op write does not
bump resourceVersion; JSON patch follows evanphx/json-patch v4 as used by kube-apiserver: replace of an absent
object key succeeds, remove of an absent key fails (422), parents must exist, a missing value means null;
create is authorised with an empty name (so a resourceNames-restricted rule never allows create, while an SSAR
naming the object does, as in real RBAC); SSAR returns 201.
Not faithful: no admission, no managedFields/server-side apply, no watch, no field selectors, no namespace
objects (every namespace exists), rules apply only to the server's own namespace, label selectors support
k=v, k==v, k!=v, k and !k only; strategic merge patch is a merge patch plus $patch replace/delete on maps
(enough for Secrets, whose only lists are in metadata).
"""

SA_SUBDIR = os.path.join("var", "run", "secrets", "kubernetes.io", "serviceaccount")
SSAR_PATH = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
SECRET_KEY_RE = re.compile(r"^[-._a-zA-Z0-9]+$")
MAX_SECRET_BYTES = 1024 * 1024
# Resources the server stores; kinds for their objects and lists.
KINDS = {"secrets": "Secret", "events": "Event", "configmaps": "ConfigMap", "leases": "Lease"}
#: resources outside the core group: their URL prefix and apiVersion (the controller's leader election Lease)
GROUPS = {"leases": "coordination.k8s.io/v1"}
DEFAULT_SANS = ("127.0.0.1", "::1", "localhost", "kubernetes", "kubernetes.default",
                "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")

Rule = tuple[Any, Any, Any]   # (verbs, resources, names): each a str, "*" or an iterable; names () = any


# --------------------------------------------------------------------------------------------------------
# certificates


@dataclass(frozen=True)
class CertFiles:
    ca_path: str
    cert_path: str
    key_path: str

    @property
    def ca_pem(self) -> bytes:
        with open(self.ca_path, "rb") as f:
            return f.read()


_CERT_CACHE: dict[tuple[str, ...], CertFiles] = {}
_CERT_CACHE_LOCK = threading.Lock()


def cached_certs(hosts: Iterable[str]) -> CertFiles:
    """make_certs once per process for a set of hosts (a CA per test costs ~50 ms of openssl)."""
    key = tuple(sorted(set(h.strip("[]") for h in hosts)))
    with _CERT_CACHE_LOCK:
        if key not in _CERT_CACHE:
            import atexit
            import shutil
            d = tempfile.mkdtemp(prefix="kubeapi-pki-")
            atexit.register(shutil.rmtree, d, True)
            _CERT_CACHE[key] = make_certs(d, key)
        return _CERT_CACHE[key]


def make_certs(directory: str, hosts: Iterable[str] = DEFAULT_SANS) -> CertFiles:
    """Create a fresh CA and a serving certificate for hosts (IPs and DNS names) with the openssl CLI."""
    os.makedirs(directory, exist_ok=True)
    ca_key, ca_crt = os.path.join(directory, "ca.key"), os.path.join(directory, "ca.crt")
    key, csr, crt = (os.path.join(directory, n) for n in ("server.key", "server.csr", "server.crt"))
    ext = os.path.join(directory, "server.ext")
    sans = []
    for h in dict.fromkeys(hosts):
        h = h.strip("[]")
        try:
            ipaddress.ip_address(h)
            sans.append(f"IP:{h}")
        except ValueError:
            sans.append(f"DNS:{h}")
    with open(ext, "w") as f:
        f.write("basicConstraints=critical,CA:FALSE\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=serverAuth\n"
                "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
                f"subjectAltName={','.join(sans)}\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", *ec, "-keyout", ca_key, "-out", ca_crt, "-days", "3", "-subj", "/CN=test-kubeapi-ca",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=kube-apiserver")
    run("x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial", "-out", crt,
        "-days", "3", "-extfile", ext)
    return CertFiles(ca_crt, crt, key)


# --------------------------------------------------------------------------------------------------------
# records, faults, errors


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    query: Mapping[str, tuple[str, ...]]
    content_type: str
    verb: str          # get, list, create, update, patch, delete, or "" for non-resource paths
    resource: str
    name: str
    namespace: str
    status: int        # 0 when the connection was dropped on purpose
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


@dataclass
class Fault:
    kind: str                       # "status" | "drop"
    count: int = 1
    status: int = 500
    retry_after: str | None = None
    method: str | None = None       # only requests with this method
    path: str | None = None         # only requests whose path contains this
    delay: float = 0.0              # seconds to sleep before failing
    reason: str | None = None       # the Status reason; default InternalError (5xx), Conflict (409), TooManyRequests
    message: str | None = None      # the Status message; default "injected fault: HTTP <status>"

    def matches(self, method: str, path: str) -> bool:
        return (self.count > 0 and (self.method is None or self.method.upper() == method)
                and (self.path is None or self.path in path))


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = dict(details or {})
        self.headers = dict(headers or {})

    def status(self) -> dict:
        st: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            st["details"] = self.details
        return st


def _not_found(resource: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})


class PatchError(Exception):
    pass


# --------------------------------------------------------------------------------------------------------
# JSON pointer / JSON patch (evanphx/json-patch v4 semantics, as kube-apiserver applies them)


def _ptr(path: Any) -> list[str]:
    if not isinstance(path, str):
        raise PatchError(f"invalid path: {path!r}")
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}: must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list, key: str, *, allow_end: bool) -> int:
    if key == "-" and allow_end:
        return len(container)
    if not re.fullmatch(r"0|[1-9][0-9]*", key):
        raise PatchError(f"invalid array index {key!r}")
    i = int(key)
    if i > len(container) or (i == len(container) and not allow_end):
        raise PatchError(f"array index {i} out of bounds")
    return i


def _parent(doc: Any, parts: list[str], path: str) -> Any:
    cur = doc
    for p in parts[:-1]:
        if isinstance(cur, dict) and p in cur and cur[p] is not None:
            cur = cur[p]
        elif isinstance(cur, list):
            cur = cur[_index(cur, p, allow_end=False)]
        else:
            raise PatchError(f"doc is missing path: {path}")
    if not isinstance(cur, (dict, list)):
        raise PatchError(f"doc is missing path: {path}")
    return cur


def _get(doc: Any, path: str) -> Any:
    parts = _ptr(path)
    if not parts:
        return doc
    con, key = _parent(doc, parts, path), parts[-1]
    if isinstance(con, dict):
        if key not in con:
            raise PatchError(f"doc is missing path: {path}")
        return con[key]
    return con[_index(con, key, allow_end=False)]


def _json_equal(a: Any, b: Any) -> bool:
    # Python's == treats True == 1 and 1 == 1.0 loosely; JSON equality should not.
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def apply_json_patch(doc: Any, ops: Any) -> Any:
    """Apply an RFC 6902 patch with kube-apiserver's (evanphx v4) leniencies; raises PatchError."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a JSON array of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict):
            raise PatchError("each JSON patch operation must be an object")
        kind = op.get("op")
        path = op.get("path")
        value = copy.deepcopy(op.get("value"))   # v4: an absent value is null
        if kind in ("add", "replace"):
            parts = _ptr(path)
            if not parts:
                doc = value
                continue
            con, key = _parent(doc, parts, path), parts[-1]
            if isinstance(con, dict):
                con[key] = value                  # replace of an absent key is accepted, like v4
            elif kind == "add":
                con.insert(_index(con, key, allow_end=True), value)
            else:
                con[_index(con, key, allow_end=False)] = value
        elif kind == "remove":
            _remove(doc, path)
        elif kind in ("move", "copy"):
            src = op.get("from")
            val = _get(doc, src)
            if kind == "move":
                if isinstance(path, str) and isinstance(src, str) and path.startswith(src + "/"):
                    raise PatchError("cannot move a value into one of its children")
                _remove(doc, src)
            else:
                val = copy.deepcopy(val)
            doc = apply_json_patch(doc, [{"op": "add", "path": path, "value": val}])
        elif kind == "test":
            if not _json_equal(_get(doc, path), value):
                raise PatchError(f"testing value {path} failed: test failed")
        else:
            raise PatchError(f"Unexpected kind: {kind}")
    return doc


def _remove(doc: Any, path: str) -> None:
    parts = _ptr(path)
    if not parts:
        raise PatchError("cannot remove the document root")
    con, key = _parent(doc, parts, path), parts[-1]
    if isinstance(con, dict):
        if key not in con:
            raise PatchError(f"remove operation does not apply: doc is missing path: {path}")
        del con[key]
    else:
        del con[_index(con, key, allow_end=False)]


_DELETE = object()


def merge_patch(target: Any, patch: Any, *, strategic: bool = False) -> Any:
    """RFC 7386 merge patch; with strategic=True, also honour $patch: replace|delete on maps."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch") if strategic else None
    if directive == "delete":
        return _DELETE
    if strategic:
        patch = {k: v for k, v in patch.items() if not k.startswith("$")}
    if directive == "replace":
        return {k: merge_patch(None, v, strategic=strategic) for k, v in patch.items() if v is not None}
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
            continue
        merged = merge_patch(out.get(k), v, strategic=strategic)
        if merged is _DELETE:
            out.pop(k, None)
        else:
            out[k] = merged
    return out


# --------------------------------------------------------------------------------------------------------
# label selectors and RBAC


def _selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "==" in term or "=" in term:
            k, v = term.split("==", 1) if "==" in term else term.split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _as_set(v: Any) -> frozenset[str]:
    if isinstance(v, str):
        return frozenset([v])
    return frozenset(v or ())


def rules_allow(rules: Sequence[Rule] | None, verb: str, resource: str, name: str) -> bool:
    """RBAC semantics: a rule with resourceNames never matches a request without a name (create, list)."""
    if rules is None:
        return True
    for verbs, resources, names in rules:
        verbs, resources, names = _as_set(verbs), _as_set(resources), _as_set(names)
        if not (verbs & {verb, "*"}) or not (resources & {resource, "*"}):
            continue
        if not names or name in names:
            if names and not name:
                continue
            return True
    return False


# --------------------------------------------------------------------------------------------------------
# the server


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeAPIServer:
    """The test API server. Thread-safe; start()/stop() or use as a context manager."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, namespace: str = "default",
                 token: str | None = None, rules: Sequence[Rule] | None = None,
                 service_account: str = "tailscale", extra_sans: Iterable[str] = (),
                 workdir: str | None = None, fresh_ca: bool = False) -> None:
        self.host = host.strip("[]")
        self._port = port
        self.namespace = namespace
        self.token = token if token is not None else "test-sa-token-" + _secrets.token_hex(12)
        self.tokens: set[str] = {self.token}
        self.rules: list[Rule] | None = list(rules) if rules is not None else None
        self.service_account = service_account
        self.latency = 0.0
        self.requests: list[RequestRecord] = []
        self.faults: list[Fault] = []
        self._objects: dict[tuple[str, str, str], dict] = {}
        self._rv = 1000
        self._lock = threading.RLock()
        self._owned_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kubeapi-")
        self._sans = (*DEFAULT_SANS, self.host, *extra_sans)
        self.certs: CertFiles | None = None
        self.fresh_ca = fresh_ca        # False: share one CA per process and SAN set (faster tests)
        self._httpd: _TLSServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._sa_dirs: list[str] = []
        self.root: str | None = None     # set by the kube_api fixture: a root holding the SA files

    # ---- lifecycle

    def start(self) -> "KubeAPIServer":
        if self.fresh_ca:
            self.certs = make_certs(os.path.join(self.workdir, "pki"), self._sans)
        else:
            self.certs = cached_certs(self._sans)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.certs.cert_path, self.certs.key_path)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._httpd = _TLSServer((self.host, self._port), _Handler, self, ctx, family)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="kubeapi", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            with self._lock:
                conns = list(self._conns)
            for c in conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._httpd = None
        if self._owned_workdir:
            import shutil
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "KubeAPIServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- addresses and credentials

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"

    @property
    def ca_pem(self) -> bytes:
        assert self.certs is not None
        return self.certs.ca_pem

    def ssl_context(self) -> ssl.SSLContext:
        """A client context that trusts only this server's CA."""
        return ssl.create_default_context(cafile=self.certs.ca_path if self.certs else None)

    def env(self, *, read_from_env: bool = True) -> dict[str, str]:
        """Variables that point an in-cluster client (ours, or tailscaled's kubestore) at this server."""
        e = {"KUBERNETES_SERVICE_HOST": self.host, "KUBERNETES_SERVICE_PORT_HTTPS": str(self.port),
             "KUBERNETES_SERVICE_PORT": str(self.port)}
        if read_from_env:
            e["TS_KUBERNETES_READ_API_SERVER_ADDRESS_FROM_ENV"] = "true"
        return e

    def write_sa_dir(self, directory: str | os.PathLike) -> str:
        """Write ca.crt, token and namespace (no trailing newline, like kubelet) into directory."""
        d = os.fspath(directory)
        os.makedirs(d, exist_ok=True)
        for name, content in (("ca.crt", self.ca_pem), ("token", self.token.encode()),
                              ("namespace", self.namespace.encode())):
            with open(os.path.join(d, name), "wb") as f:
                f.write(content)
        if d not in self._sa_dirs:
            self._sa_dirs.append(d)
        return d

    def write_sa_root(self, root: str | os.PathLike) -> str:
        """Write the ServiceAccount files under <root>/var/run/secrets/kubernetes.io/serviceaccount."""
        return self.write_sa_dir(os.path.join(os.fspath(root), SA_SUBDIR))

    def rotate_token(self, new: str | None = None, *, keep_old: bool = False) -> str:
        """Accept a new token (and rewrite it into every SA dir written so far), like a projected token."""
        new = new or "test-sa-token-" + _secrets.token_hex(12)
        with self._lock:
            self.tokens = (self.tokens | {new}) if keep_old else {new}
            self.token = new
        for d in self._sa_dirs:
            tmp = os.path.join(d, ".token.tmp")
            with open(tmp, "w") as f:
                f.write(new)
            os.replace(tmp, os.path.join(d, "token"))
        return new

    # ---- steering

    def set_rules(self, rules: Sequence[Rule] | None) -> None:
        with self._lock:
            self.rules = list(rules) if rules is not None else None

    def fail(self, status: int = 500, count: int = 1, *, retry_after: str | int | None = None,
             method: str | None = None, path: str | None = None, delay: float = 0.0,
             reason: str | None = None, message: str | None = None) -> Fault:
        """Answer the next count matching requests with status (before authentication); the request is not
        applied. A 409 says Conflict, as a real API server's (or an admission webhook's) would."""
        f = Fault("status", count, status, None if retry_after is None else str(retry_after), method, path, delay,
                  reason, message)
        with self._lock:
            self.faults.append(f)
        return f

    def drop(self, count: int = 1, *, method: str | None = None, path: str | None = None,
             delay: float = 0.0) -> Fault:
        """Close the connection without a response for the next count matching requests."""
        f = Fault("drop", count, 0, None, method, path, delay)
        with self._lock:
            self.faults.append(f)
        return f

    def clear_requests(self) -> None:
        with self._lock:
            self.requests.clear()

    def requests_for(self, *, verb: str | None = None, resource: str | None = None,
                     name: str | None = None, method: str | None = None) -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.requests if (verb is None or r.verb == verb)
                    and (resource is None or r.resource == resource) and (name is None or r.name == name)
                    and (method is None or r.method == method)]

    # ---- direct store access for tests

    def put_secret(self, name: str, data: Mapping[str, bytes | str] | None = None, *,
                   namespace: str | None = None, labels: Mapping[str, str] | None = None) -> dict:
        """Create or overwrite a Secret directly (no auth, no log), as an operator or kubectl would."""
        ns = namespace or self.namespace
        obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret",
                               "metadata": {"name": name, "namespace": ns}, "type": "Opaque"}
        if labels:
            obj["metadata"]["labels"] = dict(labels)
        if data:
            obj["data"] = {k: base64.b64encode(v.encode() if isinstance(v, str) else v).decode()
                           for k, v in data.items()}
        with self._lock:
            old = self._objects.get((ns, "secrets", name))
            obj = self._normalize("secrets", obj, name, ns)
            return self._store("secrets", ns, name, obj, old)

    def secret(self, name: str, *, namespace: str | None = None) -> dict | None:
        with self._lock:
            o = self._objects.get((namespace or self.namespace, "secrets", name))
            return copy.deepcopy(o)

    def secret_data(self, name: str, *, namespace: str | None = None) -> dict[str, bytes] | None:
        o = self.secret(name, namespace=namespace)
        if o is None:
            return None
        return {k: base64.b64decode(v) for k, v in (o.get("data") or {}).items()}

    def delete_secret(self, name: str, *, namespace: str | None = None) -> None:
        with self._lock:
            self._objects.pop((namespace or self.namespace, "secrets", name), None)

    def objects(self) -> list[dict]:
        with self._lock:
            return [copy.deepcopy(o) for o in self._objects.values()]

    # ---- request handling (called from handler threads)

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.matches(method, path):
                    f.count -= 1
                    return Fault(f.kind, 1, f.status, f.retry_after, f.method, f.path, f.delay, f.reason, f.message)
        return None

    def _record(self, rec: RequestRecord) -> None:
        with self._lock:
            self.requests.append(rec)

    def _authorize(self, verb: str, resource: str, name: str, ns: str) -> None:
        with self._lock:
            rules = self.rules
        if rules is None or (ns == self.namespace and rules_allow(rules, verb, resource, name)):
            return
        user = f"system:serviceaccount:{self.namespace}:{self.service_account}"
        what = f'{resource} "{name}"' if name else resource
        raise ApiError(403, "Forbidden",
                       f'{what} is forbidden: User "{user}" cannot {verb} resource "{resource}" '
                       f'in API group "" in the namespace "{ns}"',
                       {"name": name, "kind": resource} if name else {"kind": resource})

    def handle(self, method: str, raw_path: str, headers: Mapping[str, str], body: bytes
               ) -> tuple[int, Any, dict[str, str]]:
        """Route one request; returns (status, JSON body, extra headers). Raises ApiError."""
        u = urlsplit(raw_path)
        path = unquote(u.path)
        query = parse_qs(u.query, keep_blank_values=True)
        if path.startswith("/_test/"):
            return self._admin(method, path, body)
        auth = headers.get("authorization", "")
        with self._lock:
            tokens = set(self.tokens)
        if not auth.startswith("Bearer ") or auth[len("Bearer "):] not in tokens:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        if path == SSAR_PATH:
            if method != "POST":
                raise ApiError(
                    405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
                )
            return self._ssar(body)
        if path in ("/version", "/version/"):
            return 200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0-kubeapi-test"}, {}
        if path in ("/readyz", "/livez"):
            return 200, "ok", {}
        m = re.fullmatch(r"/(?:api/v1|apis/([^/]+/[^/]+))/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?/?", path)
        if not m or m.group(3) not in KINDS or GROUPS.get(m.group(3)) != m.group(1):
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        ns, resource, name = m.group(2), m.group(3), m.group(4) or ""
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if name:
            verb = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)
        else:
            verb = {"GET": "list", "POST": "create"}.get(method)
        if verb is None:
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        self._authorize(verb, resource, name, ns)
        with self._lock:
            return getattr(self, "_" + verb)(resource, ns, name, body, ctype, query)

    # ---- verbs (called with the lock held)

    def _get(self, resource, ns, name, body, ctype, query):
        o = self._objects.get((ns, resource, name))
        if o is None:
            raise _not_found(resource, name)
        return 200, copy.deepcopy(o), {}

    def _list(self, resource, ns, name, body, ctype, query):
        sel = (query.get("labelSelector") or [""])[0]
        items = []
        for (ons, ores, _), o in sorted(self._objects.items()):
            if ons == ns and ores == resource and _selector_matches(sel, o["metadata"].get("labels") or {}):
                item = copy.deepcopy(o)
                item.pop("kind", None)
                item.pop("apiVersion", None)
                items.append(item)
        return 200, {"kind": KINDS[resource] + "List", "apiVersion": GROUPS.get(resource, "v1"),
                     "metadata": {"resourceVersion": str(self._rv)}, "items": items}, {}

    def _create(self, resource, ns, name, body, ctype, query):
        obj = _decode_body(body, KINDS[resource])
        if not isinstance(obj, dict):
            raise ApiError(400, "BadRequest", "the body of the request was not a JSON object")
        meta = obj.setdefault("metadata", {}) or {}
        obj["metadata"] = meta
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + _secrets.token_hex(3)[:5]
        oname = meta.get("name") or ""
        if not oname:
            raise ApiError(
                422,
                "Invalid",
                f'{KINDS[resource]} "" is invalid: metadata.name: Required value: name or generateName is required',
                {"kind": KINDS[resource]},
            )
        if meta.get("namespace") and meta["namespace"] != ns:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        if (ns, resource, oname) in self._objects:
            raise ApiError(
                409, "AlreadyExists", f'{resource} "{oname}" already exists', {"name": oname, "kind": resource}
            )
        meta.pop("resourceVersion", None)
        obj = self._normalize(resource, obj, oname, ns)
        return 201, self._store(resource, ns, oname, obj, None), {}

    def _update(self, resource, ns, name, body, ctype, query):
        obj = _decode_body(body, KINDS[resource])
        if not isinstance(obj, dict):
            raise ApiError(400, "BadRequest", "the body of the request was not a JSON object")
        old = self._objects.get((ns, resource, name))
        if old is None:
            raise _not_found(resource, name)
        return 200, self._write_over(resource, ns, name, old, obj), {}

    def _patch(self, resource, ns, name, body, ctype, query):
        if ctype == "application/apply-patch+yaml":
            raise ApiError(415, "UnsupportedMediaType", "apply patches are not supported by this test server")
        if ctype not in ("application/json-patch+json", "application/merge-patch+json",
                         "application/strategic-merge-patch+json"):
            raise ApiError(415, "UnsupportedMediaType",
                           'the body of the request was in an unknown format - accepted media types include: '
                           'application/json-patch+json, application/merge-patch+json, '
                           'application/apply-patch+yaml, application/strategic-merge-patch+json')
        old = self._objects.get((ns, resource, name))
        if old is None:
            raise _not_found(resource, name)
        try:
            patch = json.loads(body or b"null")
        except ValueError as e:
            raise ApiError(400, "BadRequest", f"error decoding patch: {e}") from e
        try:
            if ctype == "application/json-patch+json":
                if not isinstance(patch, list):
                    raise ApiError(
                        400, "BadRequest", "json: cannot unmarshal object into Go value of type jsonpatch.Patch"
                    )
                new = apply_json_patch(old, patch)
            else:
                if not isinstance(patch, dict):
                    raise ApiError(400, "BadRequest", "the patch is not a JSON object")
                new = merge_patch(old, patch, strategic=ctype.startswith("application/strategic"))
        except PatchError as e:
            raise ApiError(422, "Invalid", str(e), {}) from e
        if not isinstance(new, dict):
            raise ApiError(422, "Invalid", "the patched object is not a JSON object", {})
        return 200, self._write_over(resource, ns, name, old, new), {}

    def _delete(self, resource, ns, name, body, ctype, query):
        old = self._objects.get((ns, resource, name))
        if old is None:
            raise _not_found(resource, name)
        if old["metadata"].get("finalizers"):
            # As the real API server: the object stays, marked, until the last finalizer is removed.
            if old["metadata"].get("deletionTimestamp"):
                return 200, copy.deepcopy(old), {}
            marked = copy.deepcopy(old)
            marked["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            return 200, self._store(resource, ns, name, marked, old), {}
        del self._objects[(ns, resource, name)]
        self._rv += 1
        return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                     "details": {"name": name, "kind": resource, "uid": old["metadata"]["uid"]}}, {}

    def _write_over(self, resource, ns, name, old, new) -> dict:
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            meta = new["metadata"] = {}
        if meta.get("name", name) != name:
            raise ApiError(400, "BadRequest",
                           f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
        if meta.get("namespace", ns) != ns:
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        rv = meta.get("resourceVersion") or ""
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict",
                           f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
                           f'please apply your changes to the latest version and try again',
                           {"name": name, "kind": resource})
        if resource == "secrets" and new.get("type", "Opaque") != old.get("type", "Opaque"):
            raise ApiError(
                422,
                "Invalid",
                f'Secret "{name}" is invalid: type: Invalid value: "{new.get("type")}": field is immutable',
                {"name": name, "kind": "Secret"},
            )
        # System fields are owned by the server; writes cannot change them (Go clients even send a zero
        # creationTimestamp in every strategic merge patch).
        for k in ("uid", "creationTimestamp"):
            meta[k] = old["metadata"][k]
        if old["metadata"].get("deletionTimestamp"):
            meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
        else:
            meta.pop("deletionTimestamp", None)
        meta["name"], meta["namespace"] = name, ns
        new = self._normalize(resource, new, name, ns)
        cmp_old = {k: v for k, v in old.items()}
        cmp_old["metadata"] = {k: v for k, v in old["metadata"].items() if k != "resourceVersion"}
        cmp_new = {k: v for k, v in new.items()}
        cmp_new["metadata"] = {k: v for k, v in new["metadata"].items() if k != "resourceVersion"}
        if cmp_old == cmp_new:
            return copy.deepcopy(old)            # a no-op write keeps the resourceVersion, like etcd3 storage
        stored = self._store(resource, ns, name, new, old)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            del self._objects[(ns, resource, name)]     # the last finalizer is gone: the deletion completes
            self._rv += 1
        return stored

    def _store(self, resource, ns, name, obj, old) -> dict:
        self._rv += 1
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self._rv)
        if old is not None:
            meta["uid"], meta["creationTimestamp"] = old["metadata"]["uid"], old["metadata"]["creationTimestamp"]
        else:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            if not meta.get("uid"):
                meta["uid"] = str(uuid.uuid4())
            if not meta.get("creationTimestamp") or meta["creationTimestamp"].startswith("0001-"):
                meta["creationTimestamp"] = _now()
        self._objects[(ns, resource, name)] = obj
        return copy.deepcopy(obj)

    def _normalize(self, resource: str, obj: dict, name: str, ns: str) -> dict:
        obj = {"kind": KINDS[resource], "apiVersion": GROUPS.get(resource, "v1"),
               **{k: copy.deepcopy(v) for k, v in obj.items() if k not in ("kind", "apiVersion")}}
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        meta = {k: v for k, v in meta.items() if v is not None}
        meta["name"], meta["namespace"] = name, ns
        meta.pop("managedFields", None)
        obj["metadata"] = meta
        if resource != "secrets":
            return obj
        data = obj.get("data") or {}
        if not isinstance(data, dict):
            raise ApiError(
                400, "BadRequest", 'Secret in version "v1" cannot be handled as a Secret: data must be an object'
            )
        out: dict[str, str] = {}
        total = 0
        for k, v in data.items():
            if v is None:        # a JSON null decodes into an empty []byte on the server
                v = ""
            if not isinstance(v, str):
                raise ApiError(
                    400,
                    "BadRequest",
                    f'Secret in version "v1" cannot be handled as a Secret: '
                    f"json: cannot unmarshal {type(v).__name__} into Go struct field Secret.data of type []uint8",
                )
            try:
                raw = base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(
                    400,
                    "BadRequest",
                    f'Secret in version "v1" cannot be handled as a Secret: illegal base64 data in data[{k}]',
                ) from None
            out[k] = base64.b64encode(raw).decode()
            total += len(raw)
        for k, v in (obj.pop("stringData", None) or {}).items():
            out[k] = base64.b64encode(str(v).encode()).decode()
            total += len(str(v).encode())
        for k in out:
            if not SECRET_KEY_RE.match(k) or len(k) > 253:
                raise ApiError(
                    422,
                    "Invalid",
                    f'Secret "{name}" is invalid: data[{k}]: Invalid value: "{k}": a valid config key must '
                    f"consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  "
                    f"or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')",
                    {"name": name, "kind": "Secret"},
                )
        if total > MAX_SECRET_BYTES:
            raise ApiError(
                422,
                "Invalid",
                f'Secret "{name}" is invalid: data: Too long: must have at most {MAX_SECRET_BYTES} bytes',
                {"name": name, "kind": "Secret"},
            )
        if out:
            obj["data"] = out
        else:
            obj.pop("data", None)      # the real server omits empty data, which is why kubestore adds /data
        obj.setdefault("type", "Opaque")
        return obj

    def _ssar(self, body: bytes):
        try:
            review = json.loads(body)
            attrs = review["spec"]["resourceAttributes"]
        except (ValueError, KeyError, TypeError):
            raise ApiError(400, "BadRequest", "SelfSubjectAccessReview must have spec.resourceAttributes") from None
        verb, resource = attrs.get("verb", ""), attrs.get("resource", "")
        name, ns = attrs.get("name", "") or "", attrs.get("namespace", "") or ""
        with self._lock:
            rules = self.rules
        allowed = rules is None or (ns == self.namespace and rules_allow(rules, verb, resource, name))
        status: dict[str, Any] = {"allowed": allowed}
        if allowed and rules is not None:
            status["reason"] = f'RBAC: allowed by RoleBinding "{self.service_account}/{ns}"'
        review = {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                  "metadata": {"creationTimestamp": None}, "spec": review.get("spec"), "status": status}
        return 201, review, {}

    # ---- /_test/ endpoints (no auth): inspect and steer a server running in another process

    def _admin(self, method: str, path: str, body: bytes):
        arg = json.loads(body) if body else None
        if path == "/_test/objects" and method == "GET":
            return 200, self.objects(), {}
        if path == "/_test/requests" and method == "GET":
            with self._lock:
                return 200, [_record_json(r) for r in self.requests], {}
        if path == "/_test/rules" and method == "PUT":
            self.set_rules(arg)
            return 200, {"rules": arg}, {}
        if path == "/_test/faults" and method == "POST":
            f = Fault(**arg)
            with self._lock:
                self.faults.append(f)
            return 200, asdict(f), {}
        if path == "/_test/token" and method == "POST":
            return 200, {"token_rotated": bool(self.rotate_token((arg or {}).get("token")))}, {}
        m = re.fullmatch(r"/_test/secrets/([^/]+)", path)
        if m and method == "PUT":
            self.put_secret(m.group(1), {k: v for k, v in (arg or {}).items()})
            return 200, self.secret(m.group(1)), {}
        raise ApiError(404, "NotFound", "unknown test endpoint", {})


def _decode_body(body: bytes, kind: str) -> Any:
    try:
        return json.loads(body or b"null")
    except ValueError as e:
        raise ApiError(400, "BadRequest", f'{kind} in version "v1" cannot be handled as a {kind}: {e}') from e


def _record_json(r: RequestRecord) -> dict:
    d = asdict(r)
    d["body"] = r.body.decode(errors="replace")
    return d


class _TLSServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, addr, handler, api: KubeAPIServer, ctx: ssl.SSLContext, family: int) -> None:
        self.address_family = family
        self.api = api
        self.ssl_ctx = ctx
        super().__init__(addr, handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        socketserver.TCPServer.server_bind(self)    # skip HTTPServer's reverse DNS lookup
        self.server_name, self.server_port = "kubeapi", self.server_address[1]

    def finish_request(self, request, client_address) -> None:
        # The TLS handshake happens here, in the connection's own thread, so a slow client cannot stall accept().
        request.settimeout(10)
        try:
            tls = self.ssl_ctx.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        with self.api._lock:
            self.api._conns.add(tls)
        try:
            self.RequestHandlerClass(tls, client_address, self)
        except (OSError, ssl.SSLError):
            pass
        finally:
            with self.api._lock:
                self.api._conns.discard(tls)
            try:
                tls.close()
            except OSError:
                pass

    def handle_error(self, request, client_address) -> None:
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30
    server: _TLSServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _serve(self) -> None:
        api = self.server.api
        body = self._read_body()
        method = self.command
        u = urlsplit(self.path)
        path = unquote(u.path)
        headers = {k.lower(): v for k, v in self.headers.items()}
        ctype = headers.get("content-type", "")
        verb, resource, name, ns = _classify(method, path)
        query = {k: tuple(v) for k, v in parse_qs(u.query, keep_blank_values=True).items()}
        rec = lambda status: api._record(RequestRecord(method, path, query, ctype, verb, resource, name, ns,  # noqa: E731
                                                       status, body))
        if api.latency:
            time.sleep(api.latency)   # not a wait: the latency the test asked the server for
        fault = None if path.startswith("/_test/") else api._take_fault(method, path)
        if fault is not None:
            if fault.delay:
                time.sleep(fault.delay)   # not a wait: the injected fault's delay
            if fault.kind == "drop":
                rec(0)
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            default_reason = ("InternalError" if fault.status >= 500 else "Conflict" if fault.status == 409
                              else "TooManyRequests")
            err = ApiError(fault.status, fault.reason or default_reason,
                           fault.message or f"injected fault: HTTP {fault.status}", {},
                           {"Retry-After": fault.retry_after} if fault.retry_after else None)
            rec(err.code)
            return self._send(err.code, err.status(), err.headers)
        try:
            status, obj, extra = api.handle(method, self.path, headers, body)
        except ApiError as e:
            status, obj, extra = e.code, e.status(), e.headers
        except Exception as e:  # a bug in the test server must look like a server error, not hang the client
            status, obj, extra = 500, ApiError(500, "InternalError", f"test server bug: {e!r}").status(), {}
        if not path.startswith("/_test/"):
            rec(status)
        self._send(status, obj, extra)

    def _send(self, status: int, obj: Any, extra: Mapping[str, str]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        for k, v in extra.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve


def _classify(method: str, path: str) -> tuple[str, str, str, str]:
    if path == SSAR_PATH:
        return "create", "selfsubjectaccessreviews", "", ""
    m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?/?", path)
    if not m:
        return "", "", "", ""
    ns, resource, name = m.group(1), m.group(2), m.group(3) or ""
    if name:
        verb = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, "")
    else:
        verb = {"GET": "list", "POST": "create"}.get(method, "")
    return verb, resource, name, ns


# --------------------------------------------------------------------------------------------------------
# running a real in-cluster client (tailscaled --state=kube:..., upstream containerboot) against the server


def pod_mount_namespace_argv(argv: Sequence[str], sa_dir: str) -> list[str]:
    """argv wrapped so that it runs in a private mount namespace (needs root) that looks like a Pod's:
    tmpfs on /run and /var/lib (nothing leaks onto the host, e.g. tailscaled's log state in /var/lib/tailscale),
    and sa_dir bind-mounted at /var/run/secrets/kubernetes.io/serviceaccount, the absolute path that tailscaled's
    kube client reads (a bind mount, so rotate_token() reaches the process). Pair it with KubeAPIServer.env() for
    the API address."""
    import shlex
    sa = "/run/secrets/kubernetes.io/serviceaccount"
    script = (f"set -e; mount -t tmpfs tmpfs /run; mount -t tmpfs tmpfs /var/lib; mkdir -p {sa}; "
              f"mount --bind {shlex.quote(os.path.abspath(sa_dir))} {sa}; "
              f"exec {' '.join(shlex.quote(a) for a in argv)}")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


def running(namespace: str, tmp: str) -> Iterator[KubeAPIServer]:
    """A started server (allow-all until set_rules) with its ServiceAccount files written under
    ``<tmp>/root`` (``server.root``), the layout ``KubeClient.from_environment`` and ``TS_TEST_ONLY_ROOT``
    expect; stopped after. A generator, for a fixture to yield from."""
    api = KubeAPIServer(namespace=namespace, workdir=os.path.join(tmp, "kubeapi"))
    api.start()
    try:
        api.root = os.path.join(tmp, "root")
        api.write_sa_root(api.root)
        yield api
    finally:
        api.stop()


# --------------------------------------------------------------------------------------------------------
# pytest fixture: `from tests.support.kubeapi import kube_api` in a test module registers it.

try:
    import pytest as _pytest
except ImportError:  # the CLI does not need pytest
    _pytest = None

if _pytest is not None:
    @_pytest.fixture
    def kube_api(tmp_path):
        """A started server (namespace "tailscale", allow-all until set_rules) with its ServiceAccount files
        written under ``kube_api.root`` (``<tmp>/root``), the layout ``KubeClient.from_environment`` and
        ``TS_TEST_ONLY_ROOT`` expect."""
        yield from running("tailscale", str(tmp_path))


# --------------------------------------------------------------------------------------------------------
# CLI


def _parse_listen(s: str) -> tuple[str, int]:
    if s.startswith("["):
        host, _, port = s[1:].partition("]:")
    else:
        host, _, port = s.rpartition(":")
    return host, int(port or 0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.kubeapi", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT or [V6]:PORT (port 0 = pick one)")
    p.add_argument("--dir", required=True, help="directory to write ca.crt, token, namespace and state.json into")
    p.add_argument("--namespace", default="default")
    p.add_argument("--token", default=None)
    p.add_argument("--san", action="append", default=[], help="extra certificate SAN (IP or DNS name)")
    p.add_argument(
        "--rules", default=None, help='JSON list of [verbs, resources, names], e.g. [[["get"],"secrets",[]]]'
    )
    p.add_argument("--secret", action="append", default=[], help="pre-create an empty Secret with this name")
    a = p.parse_args(argv)
    host, port = _parse_listen(a.listen)
    rules = json.loads(a.rules) if a.rules else None
    api = KubeAPIServer(host=host, port=port, namespace=a.namespace, token=a.token, rules=rules,
                        extra_sans=a.san, workdir=os.path.join(a.dir, ".kubeapi"), fresh_ca=True)
    api.start()
    api.write_sa_dir(a.dir)
    for name in a.secret:
        api.put_secret(name)
    with open(os.path.join(a.dir, "url"), "w") as f:
        f.write(api.url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"url": api.url, "port": api.port, "dir": a.dir, "env": api.env()}), flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        with open(os.path.join(a.dir, "state.json"), "w") as f:
            with api._lock:
                json.dump({"objects": api.objects(), "requests": [_record_json(r) for r in api.requests]}, f, indent=1)
        api.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
