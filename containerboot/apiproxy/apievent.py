"""API request events (`enableEvents`): what the API server proxy sends a recorder about one request (pure).

Upstream's proxy (k8s-operator/api-proxy, recordRequestAsEvent) sends, for every request of a caller whose
`tailscale.com/cap/kubernetes` rules set `enableEvents: true` and name a recorder, one JSON document
(tailscale.com/sessionrecording.Event) to the recorder's `/v2/event` before the request is forwarded:

- `type` "kubernetes-api-request", `id` empty (the recorder's to fill), `timestamp` (Unix seconds),
  `userAgent`;
- `request`: `method`, `path` (the request target, query included), `body` (the request body, base64, as Go
  encodes bytes: "" for none) and `queryParameters` (each name to its list of values);
- `kubernetes`: the API server's own reading of the request (k8s.io/apiserver's RequestInfoFactory with the
  prefixes `api` and `apis`): `IsResourceRequest`, `Path`, `Verb` (get, list, watch, create, update, patch,
  delete, deletecollection, or the HTTP method for a non-resource request), `APIPrefix`, `APIGroup`,
  `APIVersion`, `Namespace`, `Resource`, `Subresource`, `Name`, `Parts`, `FieldSelector`, `LabelSelector`
  (upstream's struct has no JSON names for these, so they keep Go's capitalised field names);
- `source`: the caller's `node` (MagicDNS name without the trailing dot) and `nodeID`, and `nodeTags` for a
  tagged device or `nodeUserID` and `nodeUser` (the login name) for a user's;
- `destination`: `node` and `nodeID`, left empty as upstream's proxy leaves them.
"""
from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

EVENT_TYPE = "kubernetes-api-request"
API_PREFIXES = ("api", "apis")
GROUPLESS_PREFIXES = ("api",)
#: Path prefixes that name the verb (k8s.io/apiserver's specialVerbs): /api/v1/watch/..., /api/v1/proxy/...
SPECIAL_VERBS = ("proxy", "watch")
NAMESPACE_SUBRESOURCES = ("status", "finalize")
VERBS_WITH_SELECTORS = ("list", "watch", "deletecollection")
METHOD_VERBS = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete"}


class RequestInfoError(ValueError):
    """The request's path cannot be read as the API server reads it (upstream refuses the request)."""


@dataclass(frozen=True)
class RequestInfo:
    """k8s.io/apiserver's RequestInfo of one request."""

    is_resource_request: bool
    path: str
    verb: str
    api_prefix: str = ""
    api_group: str = ""
    api_version: str = ""
    namespace: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""
    parts: tuple[str, ...] | None = None
    field_selector: str = ""
    label_selector: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"IsResourceRequest": self.is_resource_request, "Path": self.path, "Verb": self.verb,
                "APIPrefix": self.api_prefix, "APIGroup": self.api_group, "APIVersion": self.api_version,
                "Namespace": self.namespace, "Resource": self.resource, "Subresource": self.subresource,
                "Name": self.name, "Parts": None if self.parts is None else list(self.parts),
                "FieldSelector": self.field_selector, "LabelSelector": self.label_selector}


def split_target(target: str) -> tuple[str, str]:
    """The decoded path and the raw query of a request target (origin or absolute form)."""
    if target.lower().startswith(("http://", "https://")):
        u = urlsplit(target)
        return unquote(u.path), u.query
    path, _, query = target.partition("?")
    return unquote(path.partition("#")[0]), query.partition("#")[0]


def query_values(query: str) -> dict[str, list[str]]:
    """Go's url.ParseQuery, as far as a recorder can tell: names to values, `+` a space, blanks kept."""
    return {k: v for k, v in sorted(parse_qs(query, keep_blank_values=True).items())}


def _go_bool(values: list[str]) -> bool:
    """How the API server reads a boolean query parameter: only absent, "0" and "false" are false."""
    return bool(values) and values[0] != "0" and values[0].lower() != "false"


def _split_unescaped(s: str, seps: tuple[str, ...]) -> list[tuple[str, str]]:
    """`s` cut at each separator not escaped by a backslash: (piece before it, the separator) pairs, the last
    with separator ""."""
    out, start, i = [], 0, 0
    while i < len(s):
        if s[i] == "\\":
            i += 2
            continue
        sep = next((x for x in seps if s.startswith(x, i)), "")
        if sep:
            out.append((s[start:i], sep))
            i = start = i + len(sep)
            continue
        i += 1
    out.append((s[start:], ""))
    return out


def _unescape(s: str) -> str | None:
    r"""A field selector's value with `\,`, `\=` and `\\` undone; None for another escape."""
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\":
            if i + 1 >= len(s) or s[i + 1] not in ",=\\":
                return None
            out.append(s[i + 1])
            i += 2
            continue
        out.append(s[i])
        i += 1
    return "".join(out)


def _field_terms(selector: str) -> list[tuple[str, str, str]] | None:
    """A field selector's terms (field, operator, value), as k8s.io/apimachinery's fields.ParseSelector reads
    them; None if it does not parse."""
    terms = []
    for term, _ in _split_unescaped(selector, (",",)):
        if not term:
            continue
        pieces = _split_unescaped(term, ("!=", "==", "="))
        if len(pieces) < 2:
            return None
        field, op = pieces[0]
        value = _unescape(term[len(field) + len(op):])
        if value is None:
            return None
        terms.append((field, op, value))
    return terms


def request_info(method: str, target: str) -> RequestInfo:
    """The API server's reading of a request; RequestInfoError where the API server errs too."""
    path, query = split_target(target)
    info: dict[str, Any] = {"is_resource_request": False, "path": path, "verb": method.lower()}
    parts = [p for p in path.strip("/").split("/")] if path.strip("/") else []
    if len(parts) < 3 or parts[0] not in API_PREFIXES:
        return RequestInfo(**info)
    info["api_prefix"], parts = parts[0], parts[1:]
    if info["api_prefix"] not in GROUPLESS_PREFIXES:
        if len(parts) < 3:
            return RequestInfo(**info)
        info["api_group"], parts = parts[0], parts[1:]
    info["is_resource_request"] = True
    info["api_version"], parts = parts[0], parts[1:]
    via_prefix = False
    if parts[0] in SPECIAL_VERBS:
        if len(parts) < 2:
            raise RequestInfoError(f"unable to determine kind and namespace from url, {target}")
        info["verb"], parts, via_prefix = parts[0], parts[1:], True
    else:
        info["verb"] = METHOD_VERBS.get(method, "")
    if parts[0] == "namespaces":
        if len(parts) > 1:
            info["namespace"] = parts[1]
            if len(parts) > 2 and parts[2] not in NAMESPACE_SUBRESOURCES:
                parts = parts[2:]
    info["parts"] = tuple(parts)
    if len(parts) >= 3 and info["verb"] != "proxy":
        info["subresource"] = parts[2]
    if len(parts) >= 2:
        info["name"] = parts[1]
    if parts:
        info["resource"] = parts[0]
    q = query_values(query)
    if not info.get("name") and info["verb"] == "get":
        info["verb"] = "watch" if _go_bool(q.get("watch", [])) else "list"
        fs = q.get("fieldSelector")
        terms = _field_terms(fs[0]) if fs else None
        for field, op, value in terms or ():
            if field == "metadata.name" and op in ("=", "==") and value not in (".", "..") and \
                    "/" not in value and "%" not in value:
                info["name"] = value
                break
    if not info.get("name") and info["verb"] == "delete":
        info["verb"] = "deletecollection"
    if not via_prefix and info["verb"] in VERBS_WITH_SELECTORS:
        info["field_selector"] = (q.get("fieldSelector") or [""])[0]
        info["label_selector"] = (q.get("labelSelector") or [""])[0]
    return RequestInfo(**info)


def source(who: Mapping[str, Any]) -> dict[str, Any]:
    """The caller as upstream's event names it: tags for a tagged device, else the user."""
    node = who.get("Node") or {}
    out: dict[str, Any] = {"node": str(node.get("Name") or "").removesuffix("."),
                           "nodeID": str(node.get("StableID") or "")}
    tags = [t for t in node.get("Tags") or () if isinstance(t, str)]
    if tags:
        out["nodeTags"] = tags
    else:
        user = who.get("UserProfile") or {}
        uid = int(user.get("ID") or node.get("User") or 0)
        if uid:
            out["nodeUserID"] = uid
        if user.get("LoginName"):
            out["nodeUser"] = str(user["LoginName"])
    return out


def event(*, method: str, target: str, user_agent: str, body: bytes, who: Mapping[str, Any],
          now: float) -> dict[str, Any]:
    """The event upstream's proxy sends for one request; RequestInfoError for a path the API server would
    not read either."""
    info = request_info(method, target)
    _, query = split_target(target)
    return {"type": EVENT_TYPE, "id": "", "timestamp": int(now),
            "userAgent": user_agent,
            "request": {"method": method, "path": target, "body": base64.b64encode(body).decode(),
                        "queryParameters": query_values(query)},
            "kubernetes": info.as_json(), "source": source(who), "destination": {"node": "", "nodeID": ""}}


def encode(doc: Mapping[str, Any]) -> bytes:
    """The event as Go's json.Encoder writes it: one line."""
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"
