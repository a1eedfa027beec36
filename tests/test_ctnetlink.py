"""The conntrack table's netlink messages (netfilter.ctnetlink): a dump read into entries, a deletion naming an
entry as the kernel named it, the kernel's errors raised. Messages are built here by hand from the layout in
linux/netfilter/nfnetlink_conntrack.h; netns-tests/test_netfilter_kernel.py runs the same code against the
kernel (the shutdown's clean-up of a caught connection)."""
from __future__ import annotations

import ipaddress
import socket
import struct

import pytest

from netfilter import ctnetlink as ctn

NESTED = 0x8000


def attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def tuple_attr(kind: int, proto: int, src: str, dst: str, sport: int, dport: int) -> bytes:
    v6 = ":" in src
    ip = attr(3 if v6 else 1, ipaddress.ip_address(src).packed) + attr(4 if v6 else 2, ipaddress.ip_address(dst).packed)
    pr = attr(1, bytes([proto])) + attr(2, struct.pack("!H", sport)) + attr(3, struct.pack("!H", dport))
    return attr(kind | NESTED, attr(1 | NESTED, ip) + attr(2 | NESTED, pr))


def message(kind: int, body: bytes, flags: int = 2) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, flags, 1, 0) + body


def entry_msg(family: int, orig: bytes, reply: bytes, status: int, zone: bytes = b"") -> bytes:
    return message((1 << 8) | 0, struct.pack("=BBH", family, 0, 0) + orig + reply
                   + attr(3, struct.pack("!I", status)) + attr(7, struct.pack("!I", 120)) + zone)


DONE = message(3, struct.pack("=i", 0))


def test_a_dump_becomes_entries_with_both_tuples_and_the_status():
    orig = tuple_attr(1, 6, "10.244.0.9", "10.244.0.5", 40000, 18100)
    reply = tuple_attr(2, 6, "100.64.0.7", "100.64.0.2", 18100, 40000)
    v6o = tuple_attr(1, 17, "fd00::9", "fd00::5", 5353, 53)
    v6r = tuple_attr(2, 17, "fd7a:115c:a1e0::7", "fd00::9", 53, 5353)
    zone = attr(18, struct.pack("!H", 4))
    entries, done = ctn.parse(entry_msg(socket.AF_INET, orig, reply, 0x1A8)
                              + entry_msg(socket.AF_INET6, v6o, v6r, 8, zone))
    assert not done
    a, b = entries
    assert a.tuple_orig == ctn.CtTuple(6, "10.244.0.9", "10.244.0.5", 40000, 18100)
    assert (a.tuple_reply.saddr, a.tuple_reply.sport) == ("100.64.0.7", 18100)
    assert a.status == 0x1A8 and a.status & (1 << 5)          # IPS_DST_NAT
    assert a.key == orig                                       # named as the kernel named it
    assert b.tuple_orig.daddr == "fd00::5" and b.tuple_reply.saddr == "fd7a:115c:a1e0::7"
    assert b.key == v6o + zone      # each attribute padded
    assert ctn.parse(DONE) == ([], True)


def test_a_deletion_names_the_entry_by_its_original_tuple_and_asks_for_an_ack():
    orig = tuple_attr(1, 6, "10.244.0.9", "10.244.0.5", 40000, 18100)
    (e,), _ = ctn.parse(entry_msg(socket.AF_INET, orig, tuple_attr(2, 6, "100.64.0.7", "10.244.0.9", 1, 2), 32))
    req = ctn.delete_request(socket.AF_INET, e, 7)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", req)
    assert length == len(req) and kind == (1 << 8) | 2 and flags == 0x5 and seq == 7
    assert req[16:20] == struct.pack("=BBH", socket.AF_INET, 0, 0) and req[20:] == orig
    length, kind, flags, _, _ = struct.unpack_from("=IHHII", ctn.dump_request(socket.AF_INET6))
    assert kind == (1 << 8) | 1 and flags == 0x301


def test_the_kernels_error_is_raised_and_its_ack_is_not_an_error():
    assert ctn.parse(message(2, struct.pack("=i", 0) + b"\0" * 16)) == ([], False)
    with pytest.raises(ctn.CtnetlinkError) as e:
        ctn.parse(message(2, struct.pack("=i", -2) + b"\0" * 16))
    assert e.value.errno == 2


def test_a_truncated_message_is_an_error_not_a_silent_end():
    with pytest.raises(ctn.CtnetlinkError, match="malformed"):
        ctn.parse(entry_msg(socket.AF_INET, tuple_attr(1, 6, "10.0.0.1", "10.0.0.2", 1, 2),
                            tuple_attr(2, 6, "10.0.0.2", "10.0.0.1", 2, 1), 32)[:-6])
