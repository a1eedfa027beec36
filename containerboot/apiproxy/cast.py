"""A kubectl exec/attach session as an asciinema v2 cast (pure): upstream's header, then one JSON line per
event (https://docs.asciinema.org/manual/asciicast/v2/).

The header is upstream's CastHeader (sessionrecording/header.go) with its Kubernetes part: `version` 2,
`width` and `height` (the terminal's, 0 without one), `timestamp` (Unix seconds), `command` (the exec's
`command` parameters joined by spaces), `srcNode` (the caller's MagicDNS name without the dot),
`srcNodeID`, `srcNodeTags` (a tagged caller) or `srcNodeUserID` and `srcNodeUser` (the login name, which is
also the Kubernetes user in auth mode), the SSH-only fields empty, and
`kubernetes: {PodName, Namespace, Container, SessionType}`.

Events are `[seconds since the start, "o", text]` for stdout and stderr and `[seconds, "r", "WxH"]` for a
terminal resize after the first. As upstream, a session with a terminal (`tty=true`) writes its header only
once the client has sent the terminal's size, so that the cast can be played at that size; output before it
is held (at most HOLD_LIMIT bytes, after which the header goes without a size). Output is decoded as UTF-8
per stream, a character split across two frames kept whole; invalid bytes become U+FFFD.
"""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .streams import Event, Output, Resize

HOLD_LIMIT = 1 << 20


@dataclass(frozen=True)
class SessionInfo:
    """Who opened which session: from the request and the caller's WhoIs answer."""

    session_type: str       # exec | attach
    namespace: str
    pod: str
    container: str
    command: str
    tty: bool
    src_node: str
    src_node_id: str
    src_node_tags: tuple[str, ...]
    src_node_user: str
    src_node_user_id: int


def session_info(who: dict, session_type: str, namespace: str, pod: str, target: bytes) -> SessionInfo:
    q = parse_qs(urlsplit(target.decode("latin-1")).query, keep_blank_values=True)
    node = who.get("Node") or {}
    tags = tuple(t for t in node.get("Tags") or () if isinstance(t, str))
    user = who.get("UserProfile") or {}
    return SessionInfo(
        session_type=session_type, namespace=namespace, pod=pod, container="".join(q.get("container", [])),
        command=" ".join(q.get("command", [])), tty="".join(q.get("tty", [])) == "true",
        src_node=str(node.get("Name") or "").removesuffix("."), src_node_id=str(node.get("StableID") or ""),
        src_node_tags=tags, src_node_user="" if tags else str(user.get("LoginName") or ""),
        src_node_user_id=0 if tags else int(node.get("User") or 0))


def header(info: SessionInfo, *, timestamp: int, width: int = 0, height: int = 0) -> dict[str, Any]:
    h: dict[str, Any] = {"version": 2, "width": width, "height": height, "timestamp": timestamp}
    if info.command:
        h["command"] = info.command
    h["srcNode"] = info.src_node
    h["srcNodeID"] = info.src_node_id
    if info.src_node_tags:
        h["srcNodeTags"] = list(info.src_node_tags)
    if info.src_node_user_id:
        h["srcNodeUserID"] = info.src_node_user_id
    if info.src_node_user:
        h["srcNodeUser"] = info.src_node_user
    h.update({"env": None, "sshUser": "", "localUser": "", "connectionID": "",
              "kubernetes": {"PodName": info.pod, "Namespace": info.namespace, "Container": info.container,
                             "SessionType": info.session_type}})
    return h


def line(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


class Cast:
    """Events in, cast lines out: `events(now, events)` returns the bytes to send, `end(now)` the rest."""

    def __init__(self, info: SessionInfo, *, start: float, timestamp: int) -> None:
        self.info, self.start, self.timestamp = info, start, timestamp
        self._size: tuple[int, int] | None = None
        self._header_sent = False
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}

    def begin(self) -> bytes:
        """The header at once for a session without a terminal; nothing yet for one with."""
        return b"" if self.info.tty else self._header()

    def _header(self) -> bytes:
        self._header_sent = True
        w, h = self._size or (0, 0)
        return line(header(self.info, timestamp=self.timestamp, width=w, height=h))

    def events(self, now: float, events: list[Event]) -> bytes:
        out: list[bytes] = []
        t = round(now - self.start, 6)
        for e in events:
            if isinstance(e, Resize):
                first = self._size is None
                self._size = (e.width, e.height)
                if not self.info.tty:
                    continue      # as upstream: sizes are read only for a session with a terminal
                if not self._header_sent:
                    out.append(self._header())
                    out += self._held
                    self._held, self._held_bytes = [], 0
                elif not first:
                    out.append(line([t, "r", f"{e.width}x{e.height}"]))
            elif isinstance(e, Output):
                text = self._decoders[e.stream].decode(e.data)
                if not text:
                    continue
                ev = line([t, "o", text])
                if self._header_sent:
                    out.append(ev)
                else:
                    self._held.append(ev)
                    self._held_bytes += len(ev)
                    if self._held_bytes > HOLD_LIMIT:
                        out.append(self._header())
                        out += self._held
                        self._held, self._held_bytes = [], 0
        return b"".join(out)

    def end(self, now: float) -> bytes:
        """What is still held or undecoded when the session ends."""
        out = [] if self._header_sent else [self._header()]
        out += self._held
        self._held = []
        t = round(now - self.start, 6)
        for d in self._decoders.values():
            rest = d.decode(b"", final=True)
            if rest:
                out.append(line([t, "o", rest]))
        return b"".join(out)
