"""kubectl exec/attach streams, read as they pass through the proxy (pure).

After the API server's 101 the proxy copies bytes both ways untouched; a session being recorded also feeds a
copy of each direction to one of these readers, which turns it into what a recording holds: output (stdout
and stderr) and terminal sizes. They keep no more than one incomplete frame.

- **SPDY/3.1** (kubectl before 1.31, `X-Stream-Protocol-Version: v4.channel.k8s.io` and older): the client
  opens one stream per channel with a SYN_STREAM whose compressed header block carries `streamtype` (stdin,
  stdout, stderr, error, resize); data frames carry the stream id. The header blocks of one direction share
  one zlib stream with the SPDY/3 dictionary, so every client control frame is decompressed in order, even
  those of no interest. Resizes come from the client (JSON `{"Width":..,"Height":..}`), output from the
  server on the client's stdout/stderr stream ids.
- **WebSocket** (kubectl 1.31 and later, `v5.channel.k8s.io`, also v4): binary messages whose first byte
  is the channel (0 stdin, 1 stdout, 2 stderr, 3 error, 4 resize, 255 close); client frames are masked; a
  fragmented message keeps the channel of its first fragment; control frames (ping, pong, close) may come
  between fragments.

A byte sequence that is not the protocol raises StreamError (the session is then handled as a failed
recording: closed when recording is enforced).
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

STDIN, STDOUT, STDERR, ERROR, RESIZE = "stdin", "stdout", "stderr", "error", "resize"
#: WebSocket channel numbers of the Kubernetes remotecommand protocol.
WS_CHANNELS = {0: STDIN, 1: STDOUT, 2: STDERR, 3: ERROR, 4: RESIZE}


def _spdy3_dictionary() -> bytes:
    """The SPDY/3 header compression dictionary (draft-mbelshe-httpbis-spdy-00, 2.6.10.1): length-prefixed
    words, then a run of status lines, dates and media types."""
    words = ("options head post put delete trace accept accept-charset accept-encoding accept-language "
             "accept-ranges age allow authorization cache-control connection content-base content-encoding "
             "content-language content-length content-location content-md5 content-range content-type date etag "
             "expect expires from host if-match if-modified-since if-none-match if-range if-unmodified-since "
             "last-modified location max-forwards pragma proxy-authenticate proxy-authorization range referer "
             "retry-after server te trailer transfer-encoding upgrade user-agent vary via warning "
             "www-authenticate method get status").split() + ["200 OK", "version", "HTTP/1.1", "url", "public",
                                                               "set-cookie", "keep-alive", "origin"]
    tail = ("100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505"
            "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request401 Unauthorized"
            "403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented503 Service Unavailable"
            "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT"
            "chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,"
            "text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.")
    return b"".join(struct.pack(">I", len(w)) + w.encode() for w in words) + tail.encode()


SPDY3_DICTIONARY = _spdy3_dictionary()
SYN_STREAM = 1
#: A frame larger than this is not kubectl's (SPDY's length field allows 16 MiB; data frames are <= 32 KiB).
MAX_FRAME = 16 << 20


class StreamError(Exception):
    """The bytes are not the streaming protocol the session announced."""


@dataclass(frozen=True)
class Output:
    stream: str      # stdout | stderr
    data: bytes


@dataclass(frozen=True)
class Resize:
    width: int
    height: int


Event = Output | Resize


def resize_of(payload: bytes) -> Resize:
    """A terminal size message (Go's TerminalSize: field names matched case-insensitively)."""
    try:
        doc = json.loads(payload)
        fields = {k.lower(): v for k, v in doc.items()}
        w, h = fields.get("width", 0), fields.get("height", 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 16 for v in (w, h)):
            raise ValueError
    except (ValueError, AttributeError) as e:
        raise StreamError(f"a resize message that is not a terminal size: {payload[:100]!r}") from e
    return Resize(w, h)


class SpdySession:
    """Both directions of one SPDY session: `client(data)` and `server(data)` return the events in it."""

    def __init__(self) -> None:
        self._streams: dict[int, str] = {}        # stream id -> streamtype, from the client's SYN_STREAMs
        self._inflate = zlib.decompressobj(zdict=SPDY3_DICTIONARY)
        self._buf = {True: bytearray(), False: bytearray()}

    def client(self, data: bytes) -> list[Event]:
        return self._feed(True, data)

    def server(self, data: bytes) -> list[Event]:
        return self._feed(False, data)

    def _feed(self, from_client: bool, data: bytes) -> list[Event]:
        buf = self._buf[from_client]
        buf += data
        out: list[Event] = []
        while len(buf) >= 8:
            length = int.from_bytes(buf[5:8], "big")
            control = bool(buf[0] & 0x80)
            if control:
                version, kind = struct.unpack(">HH", buf[0:4])
                if version & 0x7FFF == 0 or kind == 0:
                    raise StreamError(f"not a SPDY frame: {bytes(buf[:8]).hex()}")
            elif (struct.unpack(">I", buf[0:4])[0] & 0x7FFFFFFF) not in self._streams:
                # every stream is opened by the client's SYN_STREAM, read before the bytes go on
                raise StreamError(f"not a SPDY frame (data on a stream never opened): {bytes(buf[:8]).hex()}")
            if length > MAX_FRAME:
                raise StreamError(f"a SPDY frame of {length} bytes")
            if len(buf) < 8 + length:
                break
            head = int.from_bytes(buf[0:4], "big")
            payload = bytes(buf[8:8 + length])
            del buf[:8 + length]
            if control:
                if from_client:
                    self._control(kind, payload)
                continue
            stream = self._streams.get(head & 0x7FFFFFFF)
            if not payload:
                continue
            if from_client and stream == RESIZE:
                out.append(resize_of(payload))
            elif not from_client and stream in (STDOUT, STDERR):
                out.append(Output(stream, payload))
        return out

    def _control(self, kind: int, payload: bytes) -> None:
        # every header block of the client's control frames moves the shared zlib stream on
        if kind == SYN_STREAM:
            if len(payload) < 10:
                raise StreamError("a SPDY SYN_STREAM frame too short")
            sid = int.from_bytes(payload[0:4], "big") & 0x7FFFFFFF
            headers = self._headers(payload[10:])
            self._streams[sid] = headers.get("streamtype", "")
        elif kind in (2, 8) and len(payload) > 4:     # SYN_REPLY, HEADERS: a header block after the stream id
            self._headers(payload[4:])

    def _headers(self, block: bytes) -> dict[str, str]:
        try:
            raw = self._inflate.decompress(block)
        except zlib.error as e:
            raise StreamError(f"a SPDY header block that does not decompress: {e}") from e
        headers: dict[str, str] = {}
        try:
            (n,), at = struct.unpack(">I", raw[:4]), 4
            for _ in range(n):
                (ln,) = struct.unpack(">I", raw[at:at + 4])
                name = raw[at + 4:at + 4 + ln].decode("latin-1").lower()
                at += 4 + ln
                (lv,) = struct.unpack(">I", raw[at:at + 4])
                value = raw[at + 4:at + 4 + lv].decode("latin-1")
                at += 4 + lv
                headers[name] = value.split("\0")[0]
        except struct.error as e:
            raise StreamError("a SPDY header block cut short") from e
        return headers


class _WsDirection:
    """Frames of one direction: the channel of the message being received, and an incomplete frame."""

    def __init__(self, masked: bool) -> None:
        self.masked = masked
        self.buf = bytearray()
        self.channel: int | None = None     # of a fragmented binary message in progress
        self.message = bytearray()          # a fragmented resize message so far


class WebSocketSession:
    """Both directions of one WebSocket session (Kubernetes channel protocol v4/v5)."""

    def __init__(self) -> None:
        self._dirs = {True: _WsDirection(masked=True), False: _WsDirection(masked=False)}

    def client(self, data: bytes) -> list[Event]:
        return self._feed(True, data)

    def server(self, data: bytes) -> list[Event]:
        return self._feed(False, data)

    def _feed(self, from_client: bool, data: bytes) -> list[Event]:
        d = self._dirs[from_client]
        d.buf += data
        out: list[Event] = []
        while True:
            frame = _ws_frame(d.buf)
            if frame is None:
                return out
            fin, opcode, payload = frame
            if opcode >= 8:              # close, ping, pong: between fragments too
                continue
            if opcode in (1, 2):
                if d.channel is not None:
                    raise StreamError("a WebSocket message started inside a fragmented one")
                if opcode == 1:
                    # text messages belong to the base64 subprotocols, which kubectl does not use
                    if not fin:
                        d.channel = -1
                    continue
                if not payload:
                    raise StreamError("a WebSocket binary message without a channel byte")
                channel, payload = payload[0], payload[1:]
                d.message.clear()
            elif opcode == 0:
                if d.channel is None:
                    raise StreamError("a WebSocket continuation frame outside a message")
                channel = d.channel
            else:
                raise StreamError(f"a WebSocket frame with the reserved opcode {opcode}")
            d.channel = None if fin else channel
            name = WS_CHANNELS.get(channel)
            if from_client and name == RESIZE:
                d.message += payload
                if fin:
                    out.append(resize_of(bytes(d.message)))
                    d.message.clear()
            elif not from_client and name in (STDOUT, STDERR) and payload:
                out.append(Output(name, payload))


def _ws_frame(buf: bytearray) -> tuple[bool, int, bytes] | None:
    """(FIN, opcode, unmasked payload) of the first whole frame in buf, removed from it; None if incomplete."""
    if len(buf) < 2:
        return None
    fin, opcode = bool(buf[0] & 0x80), buf[0] & 0x0F
    if buf[0] & 0x70:
        raise StreamError("a WebSocket frame with reserved bits set (no extension was negotiated)")
    masked, length, at = bool(buf[1] & 0x80), buf[1] & 0x7F, 2
    if length == 126:
        if len(buf) < 4:
            return None
        length, at = int.from_bytes(buf[2:4], "big"), 4
    elif length == 127:
        if len(buf) < 10:
            return None
        length, at = int.from_bytes(buf[2:10], "big"), 10
    if length > MAX_FRAME:
        raise StreamError(f"a WebSocket frame of {length} bytes")
    key = b""
    if masked:
        if len(buf) < at + 4:
            return None
        key, at = bytes(buf[at:at + 4]), at + 4
    if len(buf) < at + length:
        return None
    payload = bytes(buf[at:at + length])
    del buf[:at + length]
    if key:
        payload = _unmask(payload, key)
    return fin, opcode, payload


def _unmask(payload: bytes, key: bytes) -> bytes:
    n = len(payload)
    mask = int.from_bytes((key * (n // 4 + 1))[:n], "big")
    return (int.from_bytes(payload, "big") ^ mask).to_bytes(n, "big")
