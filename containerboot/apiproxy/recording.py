"""Whether a request through the API server proxy must be recorded, and what happens when it cannot be (pure).

Upstream's rules (k8s-operator/api-proxy, determineRecorderConfig and sessionForProto), read from the
caller's `tailscale.com/cap/kubernetes` rules (the current capability name only; the legacy one carries
impersonation alone):

- the recorders are every rule's `recorderAddrs` (filled in by Tailscale's control plane from the `recorder`
  tags). Here a rule's `recorder` tags are also resolved to the tailnet addresses (port 80) of the peers that
  carry them, since headscale passes the rule on as written, without `recorderAddrs`;
- recording fails open unless some rule sets `enforceRecorder: true` (the default is false);
- with no recorder and no enforcement nothing is recorded; with enforcement and no recorder every request
  is refused (exec and attach with "'kubectl exec' session must be recorded, but no recorders are
  available.", any other request with "api request ... must be recorded ..."); with recorders, exec and
  attach (`/api/v1/namespaces/<ns>/pods/<pod>/exec|attach`, SPDY over POST, WebSocket over GET) are
  recorded, and a session whose Upgrade does not match its method is refused when recording is enforced,
  or passed on unrecorded with a warning when it is not;
- with recorders and `enableEvents: true` in some rule, every request's API event (apievent.py) is sent to them
  before anything else is done with it (eventclient.py).

Refusals here name the rule that asked for recording, after upstream's message.
"""
from __future__ import annotations

import ipaddress
import json
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from .identity import CAP_KUBERNETES, GrantError, _go_fields, _strings, _type_name

#: tsrecorder's port on its tailnet addresses (the address control writes into `recorderAddrs`).
RECORDER_PORT = 80
SPDY, WEBSOCKET = "SPDY", "WebSocket"
#: The Upgrade header each streaming protocol must carry (upstream's upgradeHeaderForProto).
UPGRADE_FOR = {SPDY: "SPDY/3.1", WEBSOCKET: "websocket"}


@dataclass(frozen=True)
class RecorderPolicy:
    """What the caller's rules say about recording. `rules` are the indices of the rules that name a
    recorder or enforce recording (for messages)."""

    tags: tuple[str, ...] = ()
    addrs: tuple[str, ...] = ()
    enforce: bool = False
    events: bool = False
    rules: tuple[int, ...] = ()

    @property
    def asks(self) -> bool:
        """A rule names a recorder or enforces recording."""
        return bool(self.tags or self.addrs or self.enforce)

    def which(self) -> str:
        """The rules that ask for recording, for a message."""
        names = ", ".join(str(i) for i in self.rules)
        what = [f"recorder {list(self.tags)}" if self.tags else "",
                f"recorderAddrs {list(self.addrs)}" if self.addrs else "",
                "enforceRecorder: true" if self.enforce else ""]
        return (f"rule{'s' if len(self.rules) > 1 else ''} {names} of capability {CAP_KUBERNETES!r} "
                f"({', '.join(w for w in what if w)})")


def _addr_port(value: str) -> str:
    """A netip.AddrPort in Go's text form ("100.64.0.5:80", "[fd7a::5]:80"), normalised; ValueError if not."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(value)
    if host.startswith("[") and host.endswith("]"):
        ip = ipaddress.ip_address(host[1:-1])
        if ip.version != 6:
            raise ValueError(value)
        return f"[{ip}]:{int(port)}"
    ip = ipaddress.ip_address(host)
    if ip.version != 4:
        raise ValueError(value)
    return f"{ip}:{int(port)}"


def recorder_policy(cap_map: Mapping[str, Any] | None) -> RecorderPolicy:
    """The recording rules of a WhoIs CapMap; GrantError (naming the rule) on a value of the wrong shape."""
    rules = (cap_map or {}).get(CAP_KUBERNETES)
    if not rules or not isinstance(rules, list):
        return RecorderPolicy()     # a non-list is reported by impersonation's check of the same rules
    tags: list[str] = []
    addrs: list[str] = []
    enforce = events = False
    asking: list[int] = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict):
            continue
        where = f"rule {i} of capability {CAP_KUBERNETES!r}"
        f = _go_fields(rule, ("recorder", "recorderAddrs", "enforceRecorder", "enableEvents"))
        for name in ("recorder", "recorderAddrs"):
            v = f.get(name)
            if v is not None and not _strings(v):
                raise GrantError(f"{where}: {name} is {_type_name(v)}, want a list of strings")
        for name in ("enforceRecorder", "enableEvents"):
            v = f.get(name)
            if v is not None and not isinstance(v, bool):
                raise GrantError(f"{where}: {name} is {_type_name(v)}, want true or false")
        for t in f.get("recorder") or ():
            if not t.startswith("tag:") or len(t) == 4:
                raise GrantError(f"{where}: recorder has {t!r}, want a tag such as \"tag:k8s-recorder\"")
            if t not in tags:
                tags.append(t)
        for a in f.get("recorderAddrs") or ():
            try:
                a = _addr_port(a)
            except ValueError:
                raise GrantError(f"{where}: recorderAddrs has {a!r}, want an address and port such as "
                                 "\"100.64.0.5:80\"") from None
            if a not in addrs:
                addrs.append(a)
        if f.get("recorder") or f.get("recorderAddrs") or f.get("enforceRecorder"):
            asking.append(i)
        enforce = enforce or bool(f.get("enforceRecorder"))
        events = events or bool(f.get("enableEvents"))
    return RecorderPolicy(tuple(tags), tuple(addrs), enforce, events, tuple(asking))


def recorder_addrs(policy: RecorderPolicy, status: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The recorders to try, in order: the rules' `recorderAddrs`, then the tailnet addresses (IPv4 first,
    port 80) of the peers carrying one of the rules' `recorder` tags, online peers first (tailscaled's
    status `Peer` map)."""
    out = list(policy.addrs)
    if policy.tags and status:
        peers = [p for p in (status.get("Peer") or {}).values()
                 if isinstance(p, dict) and set(p.get("Tags") or ()) & set(policy.tags)]
        peers.sort(key=lambda p: (not p.get("Online"), str(p.get("DNSName") or "")))
        for p in peers:
            ips = sorted((str(ip) for ip in p.get("TailscaleIPs") or ()), key=lambda ip: ":" in ip)
            for ip in ips:
                a = f"[{ip}]:{RECORDER_PORT}" if ":" in ip else f"{ip}:{RECORDER_PORT}"
                if a not in out:
                    out.append(a)
    return tuple(out)


@dataclass(frozen=True)
class Session:
    """An exec or attach request: what upstream's mux routes to its session handlers."""

    type: str          # "exec" | "attach"
    protocol: str      # SPDY (POST) | WebSocket (GET)
    namespace: str
    pod: str


def session_of(method: bytes, target: bytes) -> Session | None:
    """The session an exec/attach request opens, else None. The path is compared percent-decoded, with
    repeated slashes and dot segments resolved, so that no spelling the API server would route to exec or
    attach escapes the check."""
    if method not in (b"GET", b"POST"):
        return None
    raw = target.decode("latin-1")
    # an absolute-form target names the path after its authority; any other is the path (and query) itself
    path = urlsplit(raw).path if raw.lower().startswith(("http://", "https://")) else raw.partition("?")[0]
    path = unquote(path.partition("#")[0])
    path = posixpath.normpath("/" + path.lstrip("/")) if path else "/"
    parts = path.strip("/").split("/")
    if len(parts) != 7 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods" or \
            parts[6] not in ("exec", "attach"):
        return None
    return Session(parts[6], SPDY if method == b"POST" else WEBSOCKET, parts[3], parts[5])


@dataclass(frozen=True)
class Plan:
    """What to do with one request: `action` is "pass", "refuse" or "record"; `message` is the refusal (a
    403) or, for "pass", a warning to log (empty: nothing to say); `addrs` the recorders to try."""

    action: str
    message: str = ""
    addrs: tuple[str, ...] = ()
    fail_open: bool = True
    events: bool = False    # send the request's API event to `addrs` first (enableEvents)


PASS = Plan("pass")


def _q(s: str) -> str:
    """Go's %q for the messages upstream formats with it."""
    return json.dumps(s)


def plan(policy: RecorderPolicy, addrs: Iterable[str], session: Session | None, *, target: bytes,
         upgrade: bytes) -> Plan:
    """Upstream's decision for one request, given the recorders resolved for the caller's rules."""
    addrs = tuple(addrs)
    if not policy.asks:
        return PASS
    if not addrs and not policy.enforce:
        return Plan("pass", f"{policy.which()} name no recorder that is on the tailnet: not recording "
                            "(recording is not enforced)") if session else PASS
    if not addrs:
        what = f"'kubectl {session.type}' session" if session else f"api request {_q(target.decode('latin-1'))}"
        return Plan("refuse", f"forbidden: {what} must be recorded, but no recorders are available. "
                              f"({policy.which()}; no peer carries {', '.join(policy.tags) or 'a recorder tag'})")
    # from here on there are recorders: with enableEvents the request's event goes to them first (whatever
    # then becomes of the request, as upstream)
    events, fail_open = policy.events, not policy.enforce
    if session is None:
        return Plan("pass", addrs=addrs, fail_open=fail_open, events=True) if events else PASS
    want = UPGRADE_FOR[session.protocol]
    if upgrade.decode("latin-1") != want:
        msg = (f"[unexpected] unable to verify that streaming protocol is {session.protocol}, wants Upgrade "
               f"header {_q(want)}, got: {_q(upgrade.decode('latin-1'))}")
        if policy.enforce:
            return Plan("refuse", f"{msg}; failure mode is 'fail closed'; closing connection. ({policy.which()})",
                        addrs=addrs, fail_open=False, events=events)
        return Plan("pass", f"{msg}; failure mode is 'fail open'; continuing session without recording.",
                    addrs=addrs, events=events)
    return Plan("record", addrs=addrs, fail_open=fail_open, events=events)


def connect_failed(session: Session, error: str, fail_open: bool, policy: RecorderPolicy) -> str:
    """Upstream's message when no recorder took the session (a log line when failing open, else the 403)."""
    msg = f"error connecting to session recorders: {error}"
    if fail_open:
        return f"{msg}; failure mode is 'fail open'; continuing session without recording."
    return f"{msg}; failure mode is 'fail closed'; closing connection. ({policy.which()})"
