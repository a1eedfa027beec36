"""The serve config (tailscaled's `ipn.ServeConfig`) as typed, immutable data.

Pure module: no I/O. `parse` turns the text of a `TS_SERVE_CONFIG` file into a validated `ServeConfig`;
`ServeConfig.to_json()` gives the JSON body for `POST /localapi/v0/serve-config`.

JSON field names are tailscaled's (Go field names verbatim). Decoding follows Go's `encoding/json` where it
matters for compatibility with files that work upstream:

* field names match exactly first, then case-insensitively (Go does this, so `"https": true` works there);
* a JSON `null` for a field means "zero value";
* TCP port map keys are decimal strings (`"443"`);
* fields this model does not know are KEPT and written back by `to_json()`, so a newer tailscaled's fields
  survive a round trip through an older agent (Go would drop them; tailscaled drops what it doesn't know).

Unlike upstream, which decodes anything that is JSON and lets tailscaled or the first request fail, `parse`
validates the whole document and reports every problem with the field path that holds it, for example
`Web["foo:443"].Handlers["/"].Proxy: not a valid URL or port: "http//x"`.

`${TS_CERT_DOMAIN}` is replaced in the raw text before JSON decoding, exactly as upstream does, so it works in
keys and values. The cert domain is the node's first MagicDNS cert domain or the sentinel `no-https`
(`NO_HTTPS`) when the tailnet has HTTPS disabled.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

from tscommon import jsontext
from tscommon.redact import redact

__all__ = [
    "NO_HTTPS", "CERT_DOMAIN_TOKEN", "ServeConfigError", "FrozenDict", "TCPPortHandler", "HTTPHandler",
    "WebServerConfig", "ServiceConfig", "ServeConfig", "parse", "needs_https", "service_names",
    "cert_domains_needed",
]

NO_HTTPS = "no-https"
CERT_DOMAIN_TOKEN = "${TS_CERT_DOMAIN}"

K = TypeVar("K")
V = TypeVar("V")


class ServeConfigError(ValueError):
    """An invalid serve config. `errors` holds one message per problem, each starting with its field path."""

    def __init__(self, errors: Iterable[str]):
        self.errors: tuple[str, ...] = tuple(errors)
        super().__init__("; ".join(self.errors) if self.errors else "invalid serve config")


class FrozenDict(Mapping[K, V]):
    """An immutable, hashable, insertion-ordered mapping (so the config dataclasses can be frozen and hashed)."""

    __slots__ = ("_d", "_h")

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()):
        self._d: dict[K, V] = dict(items)
        self._h: int | None = None

    def __getitem__(self, key: K) -> V:
        return self._d[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        if self._h is None:
            self._h = hash(frozenset(self._d.items()))
        return self._h

    def __repr__(self) -> str:
        return f"FrozenDict({self._d!r})"


# ---------------------------------------------------------------------------------------------------------
# Generic JSON helpers: freezing unknown values, and the decoding context that collects errors with paths.


def _freeze(v: Any) -> Any:
    """Deep-freeze an arbitrary JSON value so it can live in a frozen dataclass."""
    if isinstance(v, dict):
        return FrozenDict((k, _freeze(x)) for k, x in v.items())
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, FrozenDict):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


def _q(key: str) -> str:
    """A map key as it appears in a field path: JSON-quoted, like `Web["foo:443"]`."""
    return json.dumps(key, ensure_ascii=False)


def _describe(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean " + ("true" if v else "false")
    if isinstance(v, (int, float)):
        return f"number {v!r}"
    if isinstance(v, str):
        s = v if len(v) <= 60 else v[:57] + "..."
        return "string " + _q(s)
    if isinstance(v, list):
        return "array"
    return "object"


class _Ctx:
    """Collects decoding/validation errors; `strict` False makes decoding lenient (for tailscaled's own JSON)."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.errors: list[str] = []

    def err(self, path: str, msg: str) -> None:
        self.errors.append(f"{path}: {msg}" if path else msg)


def _split_fields(obj: dict, known: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Match JSON keys to Go field names: exact first, then case-insensitive. Returns (known, unknown)."""
    lower = {k.lower(): k for k in known}
    got: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for k, v in obj.items():
        if k in known:
            got[k] = v
        elif k.lower() in lower:
            got[lower[k.lower()]] = v
        else:
            extra[k] = v
    return got, extra


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _bool(ctx: _Ctx, path: str, v: Any) -> bool:
    if v is None:
        return False
    if not isinstance(v, bool):
        ctx.err(path, f"expected true or false, got {_describe(v)}")
        return False
    return v


def _str(ctx: _Ctx, path: str, v: Any) -> str:
    if v is None:
        return ""
    if not isinstance(v, str):
        ctx.err(path, f"expected a string, got {_describe(v)}")
        return ""
    return v


def _int(ctx: _Ctx, path: str, v: Any) -> int:
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int):
        ctx.err(path, f"expected an integer, got {_describe(v)}")
        return 0
    return v


def _obj(ctx: _Ctx, path: str, v: Any) -> dict | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        ctx.err(path, f"expected an object, got {_describe(v)}")
        return None
    return v


def _map(ctx: _Ctx, path: str, v: Any, key: Callable[[_Ctx, str, str], Any],
         val: Callable[[_Ctx, str, Any], Any]) -> FrozenDict:
    """Decode a JSON object into a FrozenDict with typed keys and values; bad entries are reported and skipped."""
    o = _obj(ctx, path, v)
    if not o:
        return FrozenDict()
    out = {}
    for k, x in o.items():
        p = f"{path}[{_q(k)}]"
        kk = key(ctx, p, k)
        if kk is None:
            continue
        out[kk] = val(ctx, p, x)
    return FrozenDict(out)


def _port_key(ctx: _Ctx, path: str, k: str) -> int | None:
    # Go decodes map[uint16] keys with strconv.ParseUint(k, 10, 16): digits only.
    if not re.fullmatch(r"[0-9]+", k) or int(k) > 65535:
        ctx.err(path, "TCP port key must be a decimal port number 1-65535")
        return None
    if int(k) == 0:
        ctx.err(path, "port 0 is not a valid port")
        return None
    return int(k)


def _valid_port(s: str) -> bool:
    return bool(re.fullmatch(r"[0-9]{1,5}", s)) and 1 <= int(s) <= 65535


def _split_hostport(s: str) -> tuple[str, str] | None:
    """Split "host:port" / "[v6]:port". None if it is not of that shape."""
    if s.startswith("["):
        end = s.find("]")
        if end < 0 or s[end + 1:end + 2] != ":":
            return None
        return s[1:end], s[end + 2:]
    host, sep, port = s.rpartition(":")
    if not sep or ":" in host:
        return None
    return host, port


def _hostport_key(ctx: _Ctx, path: str, k: str) -> str | None:
    hp = _split_hostport(k)
    if hp is None or not hp[0] or not _valid_port(hp[1]):
        # No implicit :443 upstream: a Web key without a port never matches a request.
        ctx.err(path, 'key must be "<host>:<port>" with a port 1-65535, e.g. "${TS_CERT_DOMAIN}:443"')
        # Keep it anyway in lenient mode so tailscaled's own JSON always round-trips.
        return None if ctx.strict else k
    return k


def _funnel_key(ctx: _Ctx, path: str, k: str) -> str | None:
    # The operator writes ":80" (empty host) for Funnel with HTTP redirect, so only the port is required.
    hp = _split_hostport(k)
    if ctx.strict and (hp is None or not _valid_port(hp[1])):
        ctx.err(path, 'key must be "<host>:<port>" with a port 1-65535, e.g. "${TS_CERT_DOMAIN}:443"')
        return None
    return k


def _any_key(ctx: _Ctx, path: str, k: str) -> str:
    return k


# ---------------------------------------------------------------------------------------------------------
# The model.


@dataclass(frozen=True)
class TCPPortHandler:
    """How tailscaled handles one TCP port on the node's (or a Service's) Tailscale IPs."""

    https: bool = False            # HTTPS: terminate TLS, serve via the matching Web entry
    http: bool = False             # HTTP: plain HTTP via the matching Web entry
    tcp_forward: str = ""          # TCPForward: "host:port" or "unix:/path" to forward raw TCP to
    terminate_tls: str = ""        # TerminateTLS: with TCPForward, terminate TLS for this SNI name
    proxy_protocol: int = 0        # ProxyProtocol: PROXY protocol version (TCPForward only)
    extra: FrozenDict = field(default_factory=FrozenDict)

    _FIELDS = ("HTTPS", "HTTP", "TCPForward", "TerminateTLS", "ProxyProtocol")

    @classmethod
    def from_json(cls, obj: Any, *, strict: bool = False) -> "TCPPortHandler":
        return _decode(lambda ctx: cls._decode(ctx, "", obj), strict)

    @classmethod
    def _decode(cls, ctx: _Ctx, path: str, obj: Any) -> "TCPPortHandler":
        n_errors = len(ctx.errors)
        o = _obj(ctx, path, obj) or {}
        f, extra = _split_fields(o, cls._FIELDS)
        h = cls(
            https=_bool(ctx, _join(path, "HTTPS"), f.get("HTTPS")),
            http=_bool(ctx, _join(path, "HTTP"), f.get("HTTP")),
            tcp_forward=_str(ctx, _join(path, "TCPForward"), f.get("TCPForward")),
            terminate_tls=_str(ctx, _join(path, "TerminateTLS"), f.get("TerminateTLS")),
            proxy_protocol=_int(ctx, _join(path, "ProxyProtocol"), f.get("ProxyProtocol")),
            extra=_freeze(extra),
        )
        if ctx.strict and len(ctx.errors) == n_errors:   # no follow-on errors after a type error
            h._validate(ctx, path)
        return h

    def _validate(self, ctx: _Ctx, path: str) -> None:
        if self.https and self.http:
            ctx.err(path, "HTTPS and HTTP are mutually exclusive")
        if self.tcp_forward and (self.https or self.http):
            ctx.err(path, "TCPForward is mutually exclusive with HTTPS and HTTP")
        if not (self.https or self.http or self.tcp_forward):
            ctx.err(path, "one of HTTPS, HTTP or TCPForward must be set")
        if self.tcp_forward and not _valid_tcp_target(self.tcp_forward):
            ctx.err(_join(path, "TCPForward"),
                    f'expected "host:port" or "unix:/path", got {_q(redact(self.tcp_forward))}')
        if self.terminate_tls and not self.tcp_forward:
            ctx.err(_join(path, "TerminateTLS"), "only valid together with TCPForward")
        if self.proxy_protocol not in (0, 1, 2):
            ctx.err(_join(path, "ProxyProtocol"), f"PROXY protocol version must be 1 or 2, got {self.proxy_protocol}")
        elif self.proxy_protocol and not self.tcp_forward:
            ctx.err(_join(path, "ProxyProtocol"), "only valid together with TCPForward")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.https:
            out["HTTPS"] = True
        if self.http:
            out["HTTP"] = True
        if self.tcp_forward:
            out["TCPForward"] = self.tcp_forward
        if self.terminate_tls:
            out["TerminateTLS"] = self.terminate_tls
        if self.proxy_protocol:
            out["ProxyProtocol"] = self.proxy_protocol
        out.update(_thaw(self.extra))
        return out


@dataclass(frozen=True)
class HTTPHandler:
    """What to do for one mount path of a Web server: exactly one of Path, Proxy, Text, Redirect."""

    path: str = ""                          # Path: absolute file or directory to serve
    proxy: str = ""                         # Proxy: backend URL, host:port, port or unix:/path
    text: str = ""                          # Text: static text
    accept_app_caps: tuple[str, ...] = ()   # AcceptAppCaps: peer capabilities forwarded to the backend
    redirect: str = ""                      # Redirect: "[<3xx code>:]<target>"
    extra: FrozenDict = field(default_factory=FrozenDict)

    _FIELDS = ("Path", "Proxy", "Text", "AcceptAppCaps", "Redirect")

    @classmethod
    def from_json(cls, obj: Any, *, strict: bool = False) -> "HTTPHandler":
        return _decode(lambda ctx: cls._decode(ctx, "", obj), strict)

    @classmethod
    def _decode(cls, ctx: _Ctx, path: str, obj: Any) -> "HTTPHandler":
        n_errors = len(ctx.errors)
        o = _obj(ctx, path, obj) or {}
        f, extra = _split_fields(o, cls._FIELDS)
        caps_raw = f.get("AcceptAppCaps")
        caps: list[str] = []
        if caps_raw is not None:
            if not isinstance(caps_raw, list):
                ctx.err(_join(path, "AcceptAppCaps"), f"expected an array of strings, got {_describe(caps_raw)}")
            else:
                for i, c in enumerate(caps_raw):
                    caps.append(_str(ctx, f"{_join(path, 'AcceptAppCaps')}[{i}]", c))
        h = cls(
            path=_str(ctx, _join(path, "Path"), f.get("Path")),
            proxy=_str(ctx, _join(path, "Proxy"), f.get("Proxy")),
            text=_str(ctx, _join(path, "Text"), f.get("Text")),
            accept_app_caps=tuple(caps),
            redirect=_str(ctx, _join(path, "Redirect"), f.get("Redirect")),
            extra=_freeze(extra),
        )
        if ctx.strict and len(ctx.errors) == n_errors:   # no follow-on errors after a type error
            h._validate(ctx, path)
        return h

    def _validate(self, ctx: _Ctx, path: str) -> None:
        kinds = [n for n, v in (("Path", self.path), ("Proxy", self.proxy), ("Text", self.text),
                                ("Redirect", self.redirect)) if v]
        if not kinds:
            ctx.err(path, "one of Path, Proxy, Text or Redirect must be set")
        elif len(kinds) > 1:
            ctx.err(path, f"only one of Path, Proxy, Text or Redirect may be set (got {', '.join(kinds)})")
        if self.path and not self.path.startswith("/"):
            ctx.err(_join(path, "Path"), f"must be an absolute path, got {_q(self.path)}")
        if self.proxy and not _valid_proxy(self.proxy):
            ctx.err(_join(path, "Proxy"), f"not a valid URL or port: {_q(_mask_userinfo(self.proxy))}")
        if self.redirect:
            m = re.match(r"([0-9]+):", self.redirect)
            if m and not 300 <= int(m.group(1)) <= 399:
                ctx.err(_join(path, "Redirect"), f"redirect status code must be 3xx, got {m.group(1)}")
            target = self.redirect[m.end():] if m else self.redirect
            if not target:
                ctx.err(_join(path, "Redirect"), "redirect target is empty")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.path:
            out["Path"] = self.path
        if self.proxy:
            out["Proxy"] = self.proxy
        if self.text:
            out["Text"] = self.text
        if self.accept_app_caps:
            out["AcceptAppCaps"] = list(self.accept_app_caps)
        if self.redirect:
            out["Redirect"] = self.redirect
        out.update(_thaw(self.extra))
        return out


@dataclass(frozen=True)
class WebServerConfig:
    """One HTTP(S) virtual host: mount path -> handler."""

    handlers: FrozenDict = field(default_factory=FrozenDict)   # FrozenDict[str, HTTPHandler]
    extra: FrozenDict = field(default_factory=FrozenDict)

    _FIELDS = ("Handlers",)

    @classmethod
    def from_json(cls, obj: Any, *, strict: bool = False) -> "WebServerConfig":
        return _decode(lambda ctx: cls._decode(ctx, "", obj), strict)

    @classmethod
    def _decode(cls, ctx: _Ctx, path: str, obj: Any) -> "WebServerConfig":
        o = _obj(ctx, path, obj) or {}
        f, extra = _split_fields(o, cls._FIELDS)
        hp = _join(path, "Handlers")
        handlers = _map(ctx, hp, f.get("Handlers"), _mount_key, HTTPHandler._decode)
        if ctx.strict and not f.get("Handlers"):   # judged on the raw value: no follow-on error for bad keys
            ctx.err(hp, "no handlers: add at least one mount path, e.g. {\"/\": {\"Proxy\": \"http://...\"}}")
        return cls(handlers=handlers, extra=_freeze(extra))

    def to_json(self) -> dict[str, Any]:
        # Handlers has no omitempty upstream: always present.
        out: dict[str, Any] = {"Handlers": {k: h.to_json() for k, h in self.handlers.items()}}
        out.update(_thaw(self.extra))
        return out


def _mount_key(ctx: _Ctx, path: str, k: str) -> str | None:
    if ctx.strict and not k.startswith("/"):
        ctx.err(path, 'mount path must start with "/"')
        return None
    return k


def _decode_tcp(ctx: _Ctx, path: str, v: Any) -> FrozenDict:
    return _map(ctx, path, v, _port_key, TCPPortHandler._decode)


def _decode_web(ctx: _Ctx, path: str, v: Any) -> FrozenDict:
    return _map(ctx, path, v, _hostport_key, WebServerConfig._decode)


def _tcp_json(tcp: Mapping[int, TCPPortHandler]) -> dict[str, Any]:
    return {str(p): h.to_json() for p, h in tcp.items()}


def _web_json(web: Mapping[str, WebServerConfig]) -> dict[str, Any]:
    return {k: w.to_json() for k, w in web.items()}


def _validate_scope(ctx: _Ctx, path: str, tcp: Mapping[int, TCPPortHandler],
                    web: Mapping[str, WebServerConfig]) -> None:
    """Cross-field checks within one scope (top level or one Service): Web hosts need a listener."""
    for key in web:
        hp = _split_hostport(key)
        if hp is None or not _valid_port(hp[1]):
            continue
        h = tcp.get(int(hp[1]))
        if h is None or not (h.http or h.https):
            ctx.err(f"{_join(path, 'Web')}[{_q(key)}]",
                    f"no TCP listener for port {hp[1]}: add {_join(path, 'TCP')}[\"{hp[1]}\"] with HTTPS or HTTP")


@dataclass(frozen=True)
class ServiceConfig:
    """Serve config of one Tailscale Service (`svc:<name>`)."""

    tcp: FrozenDict = field(default_factory=FrozenDict)   # FrozenDict[int, TCPPortHandler]
    web: FrozenDict = field(default_factory=FrozenDict)   # FrozenDict[str, WebServerConfig]
    tun: bool = False                                     # Tun: L3 forwarding of all ports
    extra: FrozenDict = field(default_factory=FrozenDict)

    _FIELDS = ("TCP", "Web", "Tun")

    @classmethod
    def from_json(cls, obj: Any, *, strict: bool = False) -> "ServiceConfig":
        return _decode(lambda ctx: cls._decode(ctx, "", obj), strict)

    @classmethod
    def _decode(cls, ctx: _Ctx, path: str, obj: Any) -> "ServiceConfig":
        o = _obj(ctx, path, obj) or {}
        f, extra = _split_fields(o, cls._FIELDS)
        s = cls(
            tcp=_decode_tcp(ctx, _join(path, "TCP"), f.get("TCP")),
            web=_decode_web(ctx, _join(path, "Web"), f.get("Web")),
            tun=_bool(ctx, _join(path, "Tun"), f.get("Tun")),
            extra=_freeze(extra),
        )
        if ctx.strict:
            if s.tun and (s.tcp or s.web):
                ctx.err(_join(path, "Tun"), "Tun is mutually exclusive with TCP and Web")
            _validate_scope(ctx, path, s.tcp, s.web)
        return s

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tcp:
            out["TCP"] = _tcp_json(self.tcp)
        if self.web:
            out["Web"] = _web_json(self.web)
        if self.tun:
            out["Tun"] = True
        out.update(_thaw(self.extra))
        return out


_SVC_RE = re.compile(r"svc:[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _service_key(ctx: _Ctx, path: str, k: str) -> str | None:
    if ctx.strict and not _SVC_RE.fullmatch(k):
        ctx.err(path, 'Service name must be "svc:<dns-label>", e.g. "svc:my-app"')
        return None
    return k


@dataclass(frozen=True)
class ServeConfig:
    """tailscaled's serve config. The empty config (`ServeConfig()`, JSON `{}`) serves nothing."""

    tcp: FrozenDict = field(default_factory=FrozenDict)           # TCP: FrozenDict[int, TCPPortHandler]
    web: FrozenDict = field(default_factory=FrozenDict)           # Web: FrozenDict[str, WebServerConfig]
    services: FrozenDict = field(default_factory=FrozenDict)      # Services: FrozenDict[str, ServiceConfig]
    allow_funnel: FrozenDict = field(default_factory=FrozenDict)  # AllowFunnel: FrozenDict[str, bool]
    foreground: FrozenDict = field(default_factory=FrozenDict)    # Foreground: FrozenDict[str, ServeConfig]
    extra: FrozenDict = field(default_factory=FrozenDict)

    _FIELDS = ("TCP", "Web", "Services", "AllowFunnel", "Foreground")

    @classmethod
    def from_json(cls, obj: Any, *, strict: bool = False) -> "ServeConfig":
        """Decode JSON (a dict, or None for `null`). Lenient by default (for tailscaled's own JSON);
        `strict=True` also validates and raises ServeConfigError listing every problem."""
        return _decode(lambda ctx: cls._decode(ctx, "", obj, nested=False), strict)

    @classmethod
    def _decode(cls, ctx: _Ctx, path: str, obj: Any, *, nested: bool) -> "ServeConfig":
        o = _obj(ctx, path, obj) or {}
        f, extra = _split_fields(o, cls._FIELDS)
        if nested and f.get("Foreground"):
            ctx.err(_join(path, "Foreground"), "nested Foreground configs are not allowed")
        sc = cls(
            tcp=_decode_tcp(ctx, _join(path, "TCP"), f.get("TCP")),
            web=_decode_web(ctx, _join(path, "Web"), f.get("Web")),
            services=_map(ctx, _join(path, "Services"), f.get("Services"), _service_key, ServiceConfig._decode),
            allow_funnel=_map(ctx, _join(path, "AllowFunnel"), f.get("AllowFunnel"), _funnel_key, _bool),
            foreground=FrozenDict() if nested else _map(
                ctx, _join(path, "Foreground"), f.get("Foreground"), _any_key,
                lambda c, p, v: cls._decode(c, p, v, nested=True)),
            extra=_freeze(extra),
        )
        if ctx.strict:
            _validate_scope(ctx, path, sc.tcp, sc.web)
        return sc

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tcp:
            out["TCP"] = _tcp_json(self.tcp)
        if self.web:
            out["Web"] = _web_json(self.web)
        if self.services:
            out["Services"] = {k: s.to_json() for k, s in self.services.items()}
        if self.allow_funnel:
            out["AllowFunnel"] = dict(self.allow_funnel)
        if self.foreground:
            out["Foreground"] = {k: c.to_json() for k, c in self.foreground.items()}
        out.update(_thaw(self.extra))
        return out

    def is_empty(self) -> bool:
        return not (self.tcp or self.web or self.services or self.allow_funnel or self.foreground or self.extra)

    def scopes(self) -> Iterator[tuple[str, Mapping[int, TCPPortHandler], Mapping[str, WebServerConfig]]]:
        """(name, TCP, Web) for the node itself ("") and for every Service."""
        yield "", self.tcp, self.web
        for name, svc in self.services.items():
            yield name, svc.tcp, svc.web


def _decode(fn: Callable[[_Ctx], Any], strict: bool) -> Any:
    ctx = _Ctx(strict)
    out = fn(ctx)
    if ctx.errors:
        # Type errors are reported even in lenient mode: there is no sensible value to keep.
        raise ServeConfigError(ctx.errors)
    return out


# ---------------------------------------------------------------------------------------------------------
# Target syntax checks (mirroring what tailscaled accepts for Proxy and TCPForward).


def _mask_userinfo(s: str) -> str:
    return redact(re.sub(r"(://)[^/@]*@", r"\1[REDACTED]@", s))


def _valid_host(h: str) -> bool:
    return bool(h) and not any(c.isspace() or c in "/?#@" for c in h)


def _valid_tcp_target(s: str) -> bool:
    if s.startswith("unix:"):
        return s[len("unix:"):].startswith("/")
    hp = _split_hostport(s)
    return hp is not None and _valid_host(hp[0]) and _valid_port(hp[1])


def _valid_proxy(s: str) -> bool:
    """Accept what tailscaled's proxy argument expansion accepts: http(s)://, https+insecure://, host:port,
    a bare port (-> http://127.0.0.1:<port>) or unix:/path."""
    if s.startswith("unix:"):
        return s[len("unix:"):].startswith("/")
    if re.fullmatch(r"[0-9]+", s):
        return _valid_port(s)
    if "://" in s:
        scheme = s.split("://", 1)[0]
        if scheme not in ("http", "https", "https+insecure"):
            return False
        url = "http" + s[len(scheme):]
    else:
        if "/" in s or "?" in s or "#" in s:     # "host:port" form has no path
            return False
        url = "http://" + s
    try:
        u = urlsplit(url)
        port = u.port    # raises ValueError for a bad port
    except ValueError:
        return False
    if not u.hostname or not _valid_host(u.hostname.strip("[]")):
        return False
    return port is None or 1 <= port <= 65535


# ---------------------------------------------------------------------------------------------------------
# Parsing a file and queries on a config.


def _looks_like_cli_format(obj: dict) -> bool:
    # `tailscale serve get-config` prints {"version": ..., "services": {"svc:x": {"endpoints": ...}}}.
    # Upstream silently decodes that as a config without handlers; say what is wrong instead.
    return "version" in obj and ("services" in obj or "endpoints" in obj) and not any(
        k in obj for k in ("TCP", "Web", "Services"))


def parse(text: str | bytes | None, cert_domain: str) -> ServeConfig | None:
    """Parse and validate the text of a serve config file.

    Returns None for a missing (None) or empty (only whitespace) file, which means "no config, change nothing"
    as upstream. `${TS_CERT_DOMAIN}` is replaced by `cert_domain` first; an empty `cert_domain` (not known
    yet) counts as `no-https`. JSON `null` decodes to the empty config, as in Go. Raises ServeConfigError.
    """
    if text is None:
        return None
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ServeConfigError([f"serve config is not valid UTF-8 at byte {e.start}"]) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        return None
    text = text.replace(CERT_DOMAIN_TOKEN, cert_domain or NO_HTTPS)
    try:
        obj = jsontext.loads(text)
    except json.JSONDecodeError as e:
        raise ServeConfigError([f"serve config is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}"]) \
            from None
    if obj is None:
        return ServeConfig()
    if not isinstance(obj, dict):
        raise ServeConfigError([f"serve config must be a JSON object, got {_describe(obj)}"])
    if _looks_like_cli_format(obj):
        raise ServeConfigError([
            'this looks like the "tailscale serve get-config" format (version/services/endpoints); '
            "TS_SERVE_CONFIG needs tailscaled's ServeConfig format (TCP/Web/Services)"])
    return ServeConfig.from_json(obj, strict=True)


def _coerce(cfg: ServeConfig | Mapping[str, Any] | None) -> ServeConfig | None:
    """Accept tailscaled JSON (a dict) wherever a ServeConfig is expected."""
    if cfg is None or isinstance(cfg, ServeConfig):
        return cfg
    return ServeConfig.from_json(dict(cfg))


def _https_ports(tcp: Mapping[int, TCPPortHandler]) -> set[int]:
    return {p for p, h in tcp.items() if h.https}


def needs_https(cfg: ServeConfig | Mapping[str, Any] | None) -> bool:
    """True if the config needs TLS certificates: an HTTPS port or a TerminateTLS handler, at the top level
    or in any Service (upstream's gate inspects top-level HTTPS only)."""
    cfg = _coerce(cfg)
    if cfg is None:
        return False
    return any(h.https or h.terminate_tls for _, tcp, _ in cfg.scopes() for h in tcp.values())


def service_names(cfg: ServeConfig | Mapping[str, Any] | None) -> tuple[str, ...]:
    """The Tailscale Services the config serves (the keys of `Services`), sorted."""
    cfg = _coerce(cfg)
    return tuple(sorted(cfg.services)) if cfg is not None else ()


def cert_domains_needed(cfg: ServeConfig | Mapping[str, Any] | None) -> tuple[str, ...]:
    """The domains that need a certificate: hosts of Web entries on HTTPS ports and TerminateTLS names,
    top level and Services. The `no-https` placeholder is never a domain. Sorted, unique."""
    cfg = _coerce(cfg)
    if cfg is None:
        return ()
    out: set[str] = set()
    for _, tcp, web in cfg.scopes():
        https = _https_ports(tcp)
        for key in web:
            hp = _split_hostport(key)
            if hp and _valid_port(hp[1]) and int(hp[1]) in https:
                out.add(hp[0])
        out.update(h.terminate_tls for h in tcp.values() if h.terminate_tls)
    out.discard(NO_HTTPS)
    out.discard("")
    return tuple(sorted(d.rstrip(".") for d in out))


def service_cert_domains(cfg: ServeConfig | None, service: str) -> tuple[str, ...]:
    """The domains one Service needs certificates for (used to hold back advertisement until they exist)."""
    if cfg is None or service not in cfg.services:
        return ()
    return cert_domains_needed(ServeConfig(services=FrozenDict({service: cfg.services[service]})))
