"""The part of Tailscale's public API v2 the controller's Tailscale provider uses, as a small schema of our own,
and the checks that hold the provider's requests and the fake's answers (tests/support/fake_tailscale_api.py)
to it. No live API is reachable from the tests, so the published contract stands in for the real thing.

Written from the published API reference, https://tailscale.com/api (the OpenAPI description of
https://api.tailscale.com/api/v2: "Create auth key", "Get a device", "Delete a device", "Set device tags", the
Key, KeyCapabilities and Device objects, the error object), and for the token endpoint from
https://tailscale.com/kb/1215/oauth-clients with RFC 6749 sections 4.4 and 5.1 (client credentials grant,
token answer). What the reference leaves open is said where it is assumed (a 404 for an unknown device on
DELETE: the reference lists 400, 500 and 501 only; upstream's operator treats 404 as "already gone").

A schema is a plain value: a Python type (str, bool, int, list, dict) for a leaf; `Obj` for a JSON object with
its fields (required or not; a field not named is a contract break); `ListOf` for an array. Every check names
the place, so a failure says which field of which call broke the contract.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import httpx

Check = Callable[[Any], str]         # "" when the value is acceptable, else why not


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class Obj:
    required: Mapping[str, Any] = field(default_factory=dict)
    optional: Mapping[str, Any] = field(default_factory=dict)
    #: a check on the value itself, after its fields (e.g. a constraint across fields)
    check: Check | None = None


@dataclass(frozen=True)
class Checked:
    """A leaf of type `kind` with a further check on its value."""
    kind: type
    check: Check


def problems(schema: Any, value: Any, where: str = "$") -> list[str]:
    """Every way `value` breaks `schema`, each naming its place; [] when it keeps it."""
    if isinstance(schema, Obj):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not an object"]
        out = [f"{where}.{k}: missing" for k in schema.required if k not in value]
        for k, v in value.items():
            sub = schema.required.get(k, schema.optional.get(k))
            if sub is None:
                out.append(f"{where}.{k}: not a field of this object in the published API")
            else:
                out += problems(sub, v, f"{where}.{k}")
        if schema.check and not out and (why := schema.check(value)):
            out.append(f"{where}: {why}")
        return out
    if isinstance(schema, ListOf):
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__}, not an array"]
        return [p for i, v in enumerate(value) for p in problems(schema.item, v, f"{where}[{i}]")]
    if isinstance(schema, Checked):
        out = problems(schema.kind, value, where)
        return out or ([f"{where}: {why}"] if (why := schema.check(value)) else [])
    # bool is an int in Python, and JSON keeps them apart
    if not isinstance(value, schema) or (schema is int and isinstance(value, bool)):
        return [f"{where}: {type(value).__name__} {value!r}, not {schema.__name__}"]
    return []


def _tag(t: str) -> str:
    return "" if re.fullmatch(r"tag:[A-Za-z][A-Za-z0-9-]*", t) else \
        f"{t!r} is not a tag (tag:<a letter, then letters, digits, hyphens>)"


def _description(d: str) -> str:
    # the reference: at most 50 characters, alphanumerics with hyphens and spaces
    return "" if re.fullmatch(r"[A-Za-z0-9 -]{0,50}", d) else \
        f"{d!r}: a key's description is at most 50 letters, digits, hyphens and spaces"


def _rfc3339(s: str) -> str:
    ok = re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", s)
    return "" if ok else f"{s!r} is not an RFC 3339 date-time"


def _positive(n: int) -> str:
    return "" if n > 0 else f"{n} is not a positive number of seconds"


TAGS = ListOf(Checked(str, _tag))

#: KeyCapabilities as a key-creating call sends it and the Key object carries it back
CAPABILITIES = Obj(required={"devices": Obj(required={"create": Obj(optional={
    "reusable": bool, "ephemeral": bool, "preauthorized": bool, "tags": TAGS})})})

KEY_REQUEST = Obj(required={"capabilities": CAPABILITIES},
                  optional={"expirySeconds": Checked(int, _positive), "description": Checked(str, _description)})

#: the Key object answered to a create; `key` (the secret) is in this answer only
KEY_ANSWER = Obj(required={"id": str, "key": Checked(str, lambda k: "" if k.startswith("tskey-auth-") else
                                                     "an auth key starts with tskey-auth-"),
                           "created": Checked(str, _rfc3339), "expires": Checked(str, _rfc3339),
                           "capabilities": CAPABILITIES},
                 optional={"description": str, "revoked": Checked(str, _rfc3339), "invalid": bool})

#: the Device object (every field optional in the reference; those a fake may answer with)
DEVICE = Obj(optional={"id": str, "nodeId": str, "name": str, "hostname": str, "user": str,
                       "addresses": ListOf(str), "tags": TAGS, "authorized": bool, "os": str,
                       "clientVersion": str, "created": str, "lastSeen": str, "expires": str,
                       "keyExpiryDisabled": bool, "isExternal": bool, "updateAvailable": bool},
             check=lambda d: "" if d.get("tags") != [] else "an empty tag list is omitted, not sent")

SET_TAGS_REQUEST = Obj(required={"tags": TAGS})

#: the client credentials grant's form (RFC 6749 4.4.2, credentials in the body as Tailscale's guide shows)
TOKEN_FORM = Obj(required={"client_id": str, "client_secret": str},
                 optional={"grant_type": Checked(str, lambda g: "" if g == "client_credentials" else
                                                 f"grant_type {g!r} is not client_credentials"),
                           "scope": str})

#: the token answer (RFC 6749 5.1); Tailscale's tokens last an hour
TOKEN_ANSWER = Obj(required={"access_token": str, "token_type": Checked(str, lambda t: "" if t.lower() == "bearer"
                                                                        else f"token_type {t!r} is not Bearer")},
                   optional={"expires_in": Checked(int, _positive), "scope": str})

#: what every refusal answers: an object whose `message` says why
ERROR = Obj(required={"message": str})

NOTHING = None      # an answer whose body the reference leaves open: the provider must not read it


@dataclass(frozen=True)
class Operation:
    name: str
    method: str
    path: str            # a regular expression on the path
    body: str            # "json", "form" or "" (no body)
    request: Any
    answer: Any
    #: statuses the reference (or the assumption in the module docstring) gives this call
    statuses: frozenset[int]
    authorised: bool = True


DEVICE_ID = r"[A-Za-z0-9]+"

OPERATIONS = (
    Operation("OAuth token", "POST", r"/api/v2/oauth/token", "form", TOKEN_FORM, TOKEN_ANSWER,
              frozenset({200, 400, 401}), authorised=False),
    Operation("create auth key", "POST", r"/api/v2/tailnet/[^/]+/keys", "json", KEY_REQUEST, KEY_ANSWER,
              frozenset({200, 400, 401, 403, 404, 500})),
    Operation("get a device", "GET", rf"/api/v2/device/{DEVICE_ID}", "", None, DEVICE,
              frozenset({200, 400, 401, 403, 404, 500})),
    Operation("delete a device", "DELETE", rf"/api/v2/device/{DEVICE_ID}", "", None, NOTHING,
              frozenset({200, 400, 401, 403, 404, 500, 501})),
    Operation("set device tags", "POST", rf"/api/v2/device/{DEVICE_ID}/tags", "json", SET_TAGS_REQUEST, NOTHING,
              frozenset({200, 400, 401, 403, 404, 500})),
)


def operation(method: str, path: str) -> Operation | None:
    return next((op for op in OPERATIONS if op.method == method and re.fullmatch(op.path, path)), None)


def request_problems(req: httpx.Request) -> list[str]:
    """Every way a request the provider sent breaks the published contract."""
    op = operation(req.method, req.url.path)
    if op is None:
        return [f"{req.method} {req.url.path}: not a call of the published API the provider is meant to use"]
    where = f"{op.name} request"
    out: list[str] = []
    auth = req.headers.get("Authorization", "")
    if op.authorised and not re.fullmatch(r"Bearer \S+", auth):
        out.append(f"{where}: no bearer token in the Authorization header")
    if not op.authorised and auth:
        out.append(f"{where}: sends an Authorization header the token endpoint does not take")
    ctype = req.headers.get("Content-Type", "").split(";")[0].strip()
    if op.body == "json":
        if ctype != "application/json":
            out.append(f"{where}: Content-Type {ctype!r}, not application/json")
        try:
            body = json.loads(req.content)
        except ValueError:
            return out + [f"{where}: the body is not JSON"]
        out += problems(op.request, body, where)
    elif op.body == "form":
        if ctype != "application/x-www-form-urlencoded":
            out.append(f"{where}: Content-Type {ctype!r}, not application/x-www-form-urlencoded")
        form = parse_qs(req.content.decode(), keep_blank_values=True)
        if any(len(v) != 1 for v in form.values()):
            out.append(f"{where}: a form field is sent more than once")
        out += problems(op.request, {k: v[0] for k, v in form.items()}, where)
    elif req.content:
        out.append(f"{where}: sends a body the call does not take")
    return out


def answer_problems(req: httpx.Request, status: int, body: bytes) -> list[str]:
    """Every way an answer to `req` breaks the published contract."""
    op = operation(req.method, req.url.path)
    if op is None:
        return []      # the request's own problem, reported by request_problems
    where = f"{op.name} answer {status}"
    if status not in op.statuses:
        return [f"{where}: a status this call does not answer with"]
    if 200 <= status < 300 and op.answer is NOTHING:
        return []
    try:
        doc = json.loads(body)
    except ValueError:
        return [f"{where}: the body is not JSON"]
    return problems(op.answer if 200 <= status < 300 else ERROR, doc, where)


class RecordingTransport(httpx.AsyncBaseTransport):
    """Passes every request on to `inner` and keeps (request, status, body) of each exchange."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.exchanges: list[tuple[httpx.Request, int, bytes]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await self.inner.handle_async_request(request)
        body = await resp.aread()
        self.exchanges.append((request, resp.status_code, body))
        return httpx.Response(resp.status_code, headers=resp.headers, content=body, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def problems(self) -> list[str]:
        return [p for req, status, body in self.exchanges
                for p in request_problems(req) + answer_problems(req, status, body)]
