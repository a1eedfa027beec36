"""DNS resolution with TTLs: wire format, resolv.conf, the re-resolution schedule, and a real local server."""
from __future__ import annotations

import asyncio
import ipaddress
import struct

import pytest

from containerboot import dns
from containerboot.dns import (Answer, DNSError, Resolver, candidate_names, decode_response, encode_query,
                               next_delay, parse_resolv_conf, watch_name)

ip = ipaddress.ip_address


def _name(n: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode() for p in n.rstrip(".").split(".")) + b"\0"


def build_response(qid: int, qname: str, qtype: int, answers: list[tuple[str, int, int, bytes]],
                   rcode: int = 0) -> bytes:
    """A DNS response; answers are (name, type, ttl, rdata); CNAME rdata is an encoded name."""
    msg = struct.pack("!HHHHHH", qid, 0x8180 | rcode, 1, len(answers), 0, 0) + _name(qname) + struct.pack("!HH", qtype, 1)
    for name, rtype, ttl, rdata in answers:
        msg += _name(name) + struct.pack("!HHIH", rtype, 1, ttl, len(rdata)) + rdata
    return msg


def test_query_encoding_and_response_decoding_with_cname_chain():
    q = encode_query("backend.example", dns.QTYPE_A, 0x1234)
    assert q[:2] == b"\x12\x34" and _name("backend.example") in q
    resp = build_response(0x1234, "backend.example.", 1, [
        ("backend.example.", dns.QTYPE_CNAME, 300, _name("real.example.")),
        ("real.example.", dns.QTYPE_A, 30, bytes([10, 0, 0, 1])),
        ("real.example.", dns.QTYPE_A, 60, bytes([10, 0, 0, 2])),
    ])
    parsed = decode_response(resp, 0x1234)
    addrs, ttl = dns.addresses_from(parsed, "backend.example", dns.QTYPE_A)
    assert addrs == [ip("10.0.0.1"), ip("10.0.0.2")] and ttl == 30
    with pytest.raises(DNSError):
        decode_response(resp, 0x9999)


def test_resolv_conf_and_search_order():
    conf = parse_resolv_conf("# c\nnameserver 10.0.0.53\nnameserver fd00::53\nsearch a.svc b.local\n"
                             "options ndots:5 timeout:1 attempts:3\n")
    assert conf.nameservers == ("10.0.0.53", "fd00::53") and conf.ndots == 5
    assert conf.timeout == 1 and conf.attempts == 3
    assert candidate_names("db", conf) == ["db.a.svc.", "db.b.local.", "db."]
    assert candidate_names("db.example.com.", conf) == ["db.example.com."]
    conf1 = parse_resolv_conf("search x\noptions ndots:1")
    assert candidate_names("db.example", conf1) == ["db.example.", "db.example.x."]


def test_schedule_ttl_bounds_and_backoff():
    assert next_delay(ok=True, ttl=1) == 5
    assert next_delay(ok=True, ttl=42) == 42
    assert next_delay(ok=True, ttl=86400) == 600
    assert [next_delay(ok=False, failures=n) for n in range(12)] == [
        1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 600, 600]


class FakeResolver:
    def __init__(self, script):
        self.script = list(script)

    async def resolve(self, name):
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


async def test_watch_name_follows_ttl_and_keeps_last_good_on_failure():
    answers, delays = [], []
    script = [Answer((ip("10.0.0.1"),), 30), DNSError("timeout"), DNSError("timeout"),
              Answer((ip("10.0.0.2"),), 1), Answer((ip("10.0.0.2"),), 900)]

    class Done(Exception):
        pass

    async def fake_sleep(d):
        delays.append(d)
        if len(delays) == len(script):
            raise Done

    with pytest.raises(Done):
        await watch_name("x", FakeResolver(script), lambda a, e: answers.append((a, e)), sleep=fake_sleep)
    assert delays == [30, 1, 2, 5, 600]
    assert answers[0] == ((ip("10.0.0.1"),), "") and answers[1] == (None, "timeout")


class _Server(asyncio.DatagramProtocol):
    """A tiny authoritative server on loopback: A and AAAA for backend.test., NXDOMAIN otherwise."""

    def connection_made(self, transport):
        self.t = transport

    def datagram_received(self, data, addr):
        qid = struct.unpack("!H", data[:2])[0]
        qname, off = dns._read_name(data, 12)
        qtype = struct.unpack("!H", data[off:off + 2])[0]
        if qname == "backend.test." and qtype == dns.QTYPE_A:
            ans = [(qname, 1, 42, bytes([10, 98, 0, 2])), (qname, 1, 50, bytes([10, 98, 0, 3]))]
        elif qname == "backend.test." and qtype == dns.QTYPE_AAAA:
            ans = [(qname, 28, 7, ip("fd98::2").packed)]
        else:
            self.t.sendto(build_response(qid, qname, qtype, [], rcode=3), addr)
            return
        self.t.sendto(build_response(qid, qname, qtype, ans), addr)


async def test_resolver_against_a_local_server(tmp_path):
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(_Server, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    try:
        ans = await Resolver(str(conf), port=port).resolve("backend.test")
        assert ans.addresses == (ip("10.98.0.2"), ip("10.98.0.3"), ip("fd98::2"))
        assert ans.ttl == 7
        with pytest.raises(DNSError, match="no IPv4 or IPv6 addresses"):
            await Resolver(str(conf), port=port).resolve("missing.test")
    finally:
        transport.close()

