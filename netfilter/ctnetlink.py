"""The conntrack table over ctnetlink, read and pruned with the standard library alone (for netfilter.conntrack).

The clean-ups need two requests: a dump of one family's entries (each with its original and reply tuples and
its status bits) and the deletion of one entry by its original tuple. pyroute2 did both, but loading its
conntrack modules costs about 60 ms of CPU, and the agent's shutdown after tailscaled's death is the moment
that CPU is scarcest: a ProxyGroup replica is usually a BestEffort Pod, the least CPU weight the kubelet gives,
and on a busy node its shutdown measured 2.3 s from the rules' removal to the end of the clean-up, during which
a client's SYN caught by the dead tunnel has no way out but its own timeout (docs/proxygroup.md, "Failover on
two nodes"). The dump and the deletions here cost about a millisecond for a Pod's few dozen entries.

Message layout (linux/netfilter/nfnetlink_conntrack.h): a netlink header, `struct nfgenmsg` (family, version 0,
resource id 0), then attributes (length, type; nested ones hold attributes; each padded to 4 bytes). The pure
part (`parse`, the request builders) is unit-tested against hand-built messages; `Ctnetlink` is the socket.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["CtEntry", "CtTuple", "Ctnetlink", "CtnetlinkError", "delete_request", "dump_request", "parse"]

NETLINK_NETFILTER = 12
_CTNETLINK = 1 << 8                 # NFNL_SUBSYS_CTNETLINK in the message type's high byte
_CT_GET, _CT_DELETE = 1, 2          # IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP = 0x1, 0x4, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLA_TYPE_MASK = 0x3FFF             # without NLA_F_NESTED and NLA_F_NET_BYTEORDER
# attribute types
_CTA_TUPLE_ORIG, _CTA_TUPLE_REPLY, _CTA_STATUS, _CTA_ZONE = 1, 2, 3, 18
_CTA_TUPLE_IP, _CTA_TUPLE_PROTO = 1, 2
_CTA_IP_V4_SRC, _CTA_IP_V4_DST, _CTA_IP_V6_SRC, _CTA_IP_V6_DST = 1, 2, 3, 4
_CTA_PROTO_NUM, _CTA_PROTO_SRC_PORT, _CTA_PROTO_DST_PORT = 1, 2, 3

_HDR = struct.Struct("=IHHII")      # nlmsghdr: length, type, flags, sequence, port id
_NFGEN = struct.Struct("=BBH")      # nfgenmsg: family, version, resource id (big-endian; always 0 here)
_ATTR = struct.Struct("=HH")


class CtnetlinkError(OSError):
    """The kernel refused a request (its errno), or answered something that is not ctnetlink."""


@dataclass(frozen=True)
class CtTuple:
    """One direction of a flow (the attribute names pyroute2's entries use)."""

    proto: int
    saddr: str
    daddr: str
    sport: int
    dport: int


@dataclass(frozen=True)
class CtEntry:
    """One conntrack entry: its tuples and status bits, and the original tuple's attribute as the kernel sent it
    (a deletion names the entry by it) with its zone's, if any."""

    status: int
    tuple_orig: CtTuple
    tuple_reply: CtTuple
    key: bytes


def _attrs(data: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    """(type, payload, the whole attribute as sent) for each attribute in `data`."""
    i = 0
    while i + _ATTR.size <= len(data):
        length, kind = _ATTR.unpack_from(data, i)
        if length < _ATTR.size or i + length > len(data):
            raise CtnetlinkError(0, f"malformed netlink attribute at offset {i}")
        yield kind & _NLA_TYPE_MASK, data[i + _ATTR.size:i + length], data[i:i + length]
        i += (length + 3) & ~3


def _tuple(data: bytes) -> CtTuple:
    addrs: dict[int, str] = {}
    proto = sport = dport = 0
    for kind, payload, _ in _attrs(data):
        if kind == _CTA_TUPLE_IP:
            for k, p, _ in _attrs(payload):
                addrs[k] = str(ipaddress.ip_address(p))
        elif kind == _CTA_TUPLE_PROTO:
            for k, p, _ in _attrs(payload):
                if k == _CTA_PROTO_NUM:
                    proto = p[0]
                elif k == _CTA_PROTO_SRC_PORT:
                    sport = struct.unpack("!H", p[:2])[0]
                elif k == _CTA_PROTO_DST_PORT:
                    dport = struct.unpack("!H", p[:2])[0]
    return CtTuple(proto, addrs.get(_CTA_IP_V4_SRC) or addrs.get(_CTA_IP_V6_SRC, ""),
                   addrs.get(_CTA_IP_V4_DST) or addrs.get(_CTA_IP_V6_DST, ""), sport, dport)


def parse(data: bytes) -> tuple[list[CtEntry], bool]:
    """The entries in one read of a dump, and whether the dump is over. Raises CtnetlinkError on the kernel's
    error answer (an ack, error 0, is neither an entry nor an end)."""
    entries: list[CtEntry] = []
    done = False
    i = 0
    while i + _HDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _HDR.unpack_from(data, i)
        if length < _HDR.size or i + length > len(data):
            raise CtnetlinkError(0, f"malformed netlink message at offset {i}")
        body = data[i + _HDR.size:i + length]
        i += (length + 3) & ~3
        if kind == _NLMSG_DONE:
            done = True
        elif kind == _NLMSG_ERROR:
            err = -struct.unpack_from("=i", body)[0]
            if err:
                raise CtnetlinkError(err, os.strerror(err))
        elif kind >> 8 == _CTNETLINK >> 8:
            orig = reply = None
            key = zone = b""
            status = 0
            for k, payload, whole in _attrs(body[_NFGEN.size:]):
                if k == _CTA_TUPLE_ORIG:
                    orig, key = _tuple(payload), whole
                elif k == _CTA_TUPLE_REPLY:
                    reply = _tuple(payload)
                elif k == _CTA_STATUS:
                    status = struct.unpack("!I", payload[:4])[0]
                elif k == _CTA_ZONE:
                    zone = whole
            if orig is not None and reply is not None:
                entries.append(CtEntry(status, orig, reply, _padded(key) + _padded(zone)))
    return entries, done


def _padded(raw: bytes) -> bytes:
    return raw + b"\0" * (-len(raw) % 4)


def _message(kind: int, flags: int, seq: int, family: int, attrs: bytes = b"") -> bytes:
    body = _NFGEN.pack(family, 0, 0) + attrs
    return _HDR.pack(_HDR.size + len(body), _CTNETLINK | kind, flags, seq, 0) + body


def dump_request(family: int, seq: int = 1) -> bytes:
    """Ask for every entry of `family` (socket.AF_INET or AF_INET6)."""
    return _message(_CT_GET, _NLM_F_REQUEST | _NLM_F_DUMP, seq, family)


def delete_request(family: int, entry: CtEntry, seq: int) -> bytes:
    """Delete `entry` (named by its original tuple and zone), acknowledged."""
    return _message(_CT_DELETE, _NLM_F_REQUEST | _NLM_F_ACK, seq, family, entry.key)


class Ctnetlink:
    """One ctnetlink socket for one family: `dump_entries()`, then `delete(entry)` for each entry to go (the
    calls netfilter.conntrack makes of pyroute2's Conntrack)."""

    def __init__(self, family: int) -> None:
        self.family = family
        self._seq = 0
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self._sock.bind((0, 0))
        except OSError:
            self._sock.close()
            raise

    def close(self) -> None:
        self._sock.close()

    def dump_entries(self) -> list[CtEntry]:
        self._seq += 1
        self._sock.send(dump_request(self.family, self._seq))
        out: list[CtEntry] = []
        while True:
            entries, done = parse(self._sock.recv(1 << 16))
            out.extend(entries)
            if done:
                return out

    def delete(self, entry: CtEntry) -> None:
        """Raises CtnetlinkError (ENOENT: the entry is gone already)."""
        self._seq += 1
        self._sock.send(delete_request(self.family, entry, self._seq))
        parse(self._sock.recv(1 << 12))
