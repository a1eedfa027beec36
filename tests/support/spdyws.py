"""Frames of kubectl's exec streams, made the way its clients make them: SPDY/3.1 (header blocks compressed in
one zlib stream with the SPDY/3 dictionary, each block ended by a sync flush) and WebSocket (client frames
masked, the channel byte first)."""
from __future__ import annotations

import json
import os
import struct
import zlib

from containerboot.apiproxy.streams import SPDY3_DICTIONARY


class SpdyClient:
    """The client side's frames; stream ids are odd, as a client's are."""

    def __init__(self) -> None:
        self._z = zlib.compressobj(zdict=SPDY3_DICTIONARY)

    def _block(self, headers: dict[str, str]) -> bytes:
        raw = struct.pack(">I", len(headers)) + b"".join(
            struct.pack(">I", len(k)) + k.encode() + struct.pack(">I", len(v)) + v.encode() for k, v in headers.items())
        return self._z.compress(raw) + self._z.flush(zlib.Z_SYNC_FLUSH)

    def syn_stream(self, sid: int, streamtype: str) -> bytes:
        payload = struct.pack(">IIH", sid, 0, 0) + self._block({"streamtype": streamtype, "port": ""})
        return control(1, payload)

    def syn_reply(self, sid: int) -> bytes:
        return control(2, struct.pack(">I", sid) + self._block({"status": "200"}))


def control(kind: int, payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">HHB", 0x8003, kind, flags) + len(payload).to_bytes(3, "big") + payload


def data(sid: int, payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">IB", sid, flags) + len(payload).to_bytes(3, "big") + payload


def ping(n: int) -> bytes:
    return control(6, struct.pack(">I", n))


def resize(width: int, height: int) -> bytes:
    return json.dumps({"Width": width, "Height": height}).encode()


def ws_frame(payload: bytes, *, opcode: int = 2, fin: bool = True, masked: bool = False) -> bytes:
    head = bytes([(0x80 if fin else 0) | opcode])
    n = len(payload)
    m = 0x80 if masked else 0
    if n < 126:
        head += bytes([m | n])
    elif n < 1 << 16:
        head += bytes([m | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([m | 127]) + n.to_bytes(8, "big")
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))
