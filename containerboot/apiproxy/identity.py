"""Who is calling, and as whom the request goes to the API server (pure).

Upstream's rules (k8s-operator/api-proxy): the caller is the WhoIs answer for the connection's tailnet
address. `Impersonate-User` is the caller's login name, or, for a tagged node, the node's MagicDNS name
without the trailing dot. `Impersonate-Group` is every group of every `impersonate` rule of the caller's
`tailscale.com/cap/kubernetes` capability (several grants merge; each group once, in order of appearance);
the legacy name `https://tailscale.com/cap/kubernetes` is read only when the current one has no rules; a
tagged node with no group from its rules is impersonated with its tags as groups.

A rule is decoded the way Go's encoding/json decodes upstream's KubernetesCapRule: unknown fields are
ignored, field names match case-insensitively (exact match preferred), `null` is the zero value, and a value
of the wrong JSON type is an error. Upstream logs that error and forwards the request without impersonation
headers; here the caller is refused (a deliberate difference: a typo in the policy must not turn into the
proxy's own, broader, identity).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

CAP_KUBERNETES = "tailscale.com/cap/kubernetes"
CAP_KUBERNETES_OLD = "https://" + CAP_KUBERNETES

#: Request headers the client may not choose in auth mode (besides every Impersonate-Extra-*).
_AUTH_HEADERS = (b"authorization", b"impersonate-user", b"impersonate-group", b"impersonate-uid")
_IMPERSONATE_EXTRA = b"impersonate-extra-"
#: Hop-by-hop headers (RFC 9110 7.6.1) a proxy never forwards, plus the X-Forwarded-* set a Go ReverseProxy
#: with a Rewrite hook drops. Framing (Content-Length, Transfer-Encoding) is h11's to write.
_HOP_BY_HOP = frozenset((b"connection", b"proxy-connection", b"keep-alive", b"proxy-authenticate",
                         b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade", b"expect",
                         b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto", b"forwarded"))

#: Fields of a KubernetesCapRule and the JSON shape each must have (the rest are ignored, as in Go).
_RULE_FIELDS = {"impersonate": "object", "recorder": "strings", "recorderAddrs": "strings",
                "enforceRecorder": "bool", "enableEvents": "bool", "enableSessionRecordings": "bool"}


class GrantError(Exception):
    """A capability rule that does not decode; str(e) names the capability, the rule and the problem."""


class NoIdentity(Exception):
    """The caller is not a known tailnet node (WhoIs has no answer) or has no usable name."""


@dataclass(frozen=True)
class Impersonation:
    user: str
    groups: tuple[str, ...]


def _go_fields(obj: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """Go's field lookup for each known name: the exact key if present, else a case-insensitive match.
    Names absent from `obj` are absent from the answer."""
    out: dict[str, Any] = {}
    for name in names:
        if name in obj:
            out[name] = obj[name]
            continue
        for k, v in obj.items():
            if k.lower() == name.lower():
                out[name] = v
    return out


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(s, str) for s in value)


def _check_rule(rule: Any, where: str) -> tuple[str, ...]:
    """The groups of one rule; GrantError when it has the wrong shape."""
    if rule is None:
        return ()
    if not isinstance(rule, dict):
        raise GrantError(f"{where} is {_type_name(rule)}, want an object like "
                         '{"impersonate": {"groups": ["..."]}}')
    fields = _go_fields(rule, _RULE_FIELDS)
    for name, value in fields.items():
        shape = _RULE_FIELDS[name]
        if value is None:
            continue
        if shape == "object" and not isinstance(value, dict):
            raise GrantError(f"{where}: {name} is {_type_name(value)}, want an object like "
                             '{"groups": ["..."]}')
        if shape == "bool" and not isinstance(value, bool):
            raise GrantError(f"{where}: {name} is {_type_name(value)}, want true or false")
        if shape == "strings" and not _strings(value):
            raise GrantError(f"{where}: {name} is {_type_name(value)}"
                             f"{' with an item that is not a string' if isinstance(value, list) else ''}, "
                             "want a list of strings")
    groups = _go_fields(fields.get("impersonate") or {}, ("groups",)).get("groups")
    if groups is None:
        return ()
    if not _strings(groups):
        raise GrantError(f"{where}: impersonate.groups is {_type_name(groups)}"
                         f"{' with an item that is not a string' if isinstance(groups, list) else ''}, "
                         "want a list of strings")
    for g in groups:
        if not _header_safe(g):
            raise GrantError(f"{where}: impersonate.groups has {g!r}, which cannot be sent in a header "
                             "(empty, or with control characters)")
    return tuple(groups)


def _header_safe(value: str) -> bool:
    return bool(value) and value == value.strip() and all(c == "\t" or (" " <= c != "\x7f") for c in value)


def grant_groups(cap_map: Mapping[str, Any] | None) -> tuple[tuple[str, ...], int]:
    """(groups merged from every rule in order, number of rules read); GrantError on a malformed rule."""
    cap_map = cap_map or {}
    name = CAP_KUBERNETES
    rules = cap_map.get(name)
    if not rules:
        name, rules = CAP_KUBERNETES_OLD, cap_map.get(CAP_KUBERNETES_OLD)
    if rules is None:
        return (), 0
    if not isinstance(rules, list):
        raise GrantError(f"capability {name!r} is {_type_name(rules)}, want a list of rules")
    out: list[str] = []
    for i, rule in enumerate(rules):
        for g in _check_rule(rule, f"rule {i} of capability {name!r}"):
            if g not in out:
                out.append(g)
    return tuple(out), len(rules)


def impersonation(whois: Mapping[str, Any]) -> Impersonation:
    """The Kubernetes identity of a WhoIs answer (`Node`, `UserProfile`, `CapMap`), by upstream's rules."""
    node = whois.get("Node") or {}
    groups, _ = grant_groups(whois.get("CapMap"))
    tags = tuple(t for t in (node.get("Tags") or ()) if isinstance(t, str))
    if not tags:
        user = str((whois.get("UserProfile") or {}).get("LoginName") or "")
        if not _header_safe(user):
            raise NoIdentity(f"the caller's node {node.get('Name', '')!r} has no usable login name")
        return Impersonation(user, groups)
    user = str(node.get("Name") or "").removesuffix(".")
    if not _header_safe(user):
        raise NoIdentity("the caller's tagged node has no usable name")
    return Impersonation(user, groups or tuple(t for t in tags if _header_safe(t)))


Headers = list[tuple[bytes, bytes]]


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    return {t.strip().lower() for k, v in headers if k.lower() == b"connection" for t in v.split(b",")}


def is_upgrade(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The Upgrade protocol (e.g. b"SPDY/3.1", b"websocket") when the request asks for one, else b""."""
    headers = list(headers)
    if b"upgrade" not in _connection_tokens(headers):
        return b""
    return next((v for k, v in headers if k.lower() == b"upgrade"), b"")


def forwarded_request_headers(headers: Iterable[tuple[bytes, bytes]], *, host: bytes,
                              who: Impersonation | None, token: str) -> Headers:
    """The headers sent upstream: hop-by-hop ones dropped (an upgrade kept), Host set to the API server's;
    with `who` (auth mode) the client's Authorization and Impersonate-* removed, the proxy's token and the
    caller's impersonation added. Without `who` (noauth mode) the client's credentials pass through."""
    headers = list(headers)
    upgrade = is_upgrade(headers)
    drop = _HOP_BY_HOP | _connection_tokens(headers) | {b"host"}
    out: Headers = [(b"host", host)]
    for k, v in headers:
        k = k.lower()
        if k in drop or k == b"content-length":
            continue
        if who is not None and (k in _AUTH_HEADERS or k.startswith(_IMPERSONATE_EXTRA)):
            continue
        out.append((k, v))
    out += [(k.lower(), v) for k, v in headers if k.lower() == b"content-length"][:1]
    if any(k.lower() == b"transfer-encoding" for k, _ in headers):
        out.append((b"transfer-encoding", b"chunked"))
    if upgrade:
        out += [(b"connection", b"Upgrade"), (b"upgrade", upgrade)]
    if who is not None:
        out.append((b"authorization", b"Bearer " + token.encode()))
        out.append((b"impersonate-user", who.user.encode()))
        out += [(b"impersonate-group", g.encode()) for g in who.groups]
    return out


def forwarded_response_headers(headers: Iterable[tuple[bytes, bytes]], *, upgrade: bool = False) -> Headers:
    """The API server's response headers as sent to the client: hop-by-hop ones dropped (kept on a 101, whose
    Connection/Upgrade are the switch itself); Content-Length kept, chunking left to h11."""
    headers = list(headers)
    if upgrade:
        return [(k.lower(), v) for k, v in headers]
    drop = _HOP_BY_HOP | _connection_tokens(headers)
    return [(k.lower(), v) for k, v in headers if k.lower() not in drop]
