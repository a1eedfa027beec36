"""DNS resolution with TTLs (dnspython underneath): the re-resolution schedule, and real lookups against a
small authoritative server on loopback (CNAME chains, search domains, truncation, TTLs)."""
from __future__ import annotations

import asyncio
import ipaddress
import struct

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from containerboot.dns import Answer, DNSError, Resolver, next_delay, watch_name

ip = ipaddress.ip_address


def test_schedule_ttl_bounds_and_backoff():
    assert next_delay(ok=True, ttl=1) == 5
    assert next_delay(ok=True, ttl=42) == 42
    assert next_delay(ok=True, ttl=86400) == 600
    assert [next_delay(ok=False, failures=n) for n in range(12)] == [
        1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60]
    assert next_delay(ok=False, failures=10**6) == 60


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


# ---- a small authoritative server on loopback (UDP and TCP on one port), built with dnspython's message code

ZONE = {
    # (name, type): (ttl, [values])
    ("backend.test.", "A"): (42, ["10.98.0.3", "10.98.0.2"]),
    ("backend.test.", "AAAA"): (7, ["fd98::2"]),
    ("web.a.svc.", "CNAME"): (30, ["real.test."]),
    ("real.test.", "A"): (60, ["10.98.0.9"]),
    ("v4only.test.", "A"): (300, ["10.98.0.4"]),
    ("big.test.", "A"): (90, [f"10.98.1.{i}" for i in range(1, 40)]),
}


def answer_for(wire: bytes, *, udp: bool) -> bytes:
    q = dns.message.from_wire(wire)
    r = dns.message.make_response(q)
    qname, qtype = q.question[0].name.to_text(), dns.rdatatype.to_text(q.question[0].rdtype)
    name, found = qname, False
    for _ in range(8):   # follow CNAMEs inside the zone, as an authoritative server does
        if (name, "CNAME") in ZONE:
            ttl, (target,) = ZONE[(name, "CNAME")]
            r.answer.append(dns.rrset.from_text(name, ttl, "IN", "CNAME", target))
            name, found = target, True
            continue
        if (name, qtype) in ZONE:
            ttl, values = ZONE[(name, qtype)]
            r.answer.append(dns.rrset.from_text(name, ttl, "IN", qtype, *values))
            found = True
        elif any(n == name for n, _ in ZONE):
            found = True    # the name exists: NOERROR, no data
        break
    if not found:
        r.set_rcode(dns.rcode.NXDOMAIN)
    if udp and qname == "big.test.":
        r.answer = []
        r.flags |= dns.flags.TC    # too big for UDP: the client must retry over TCP
    return r.to_wire()


class _Udp(asyncio.DatagramProtocol):
    def connection_made(self, transport):
        self.t = transport

    def datagram_received(self, data, addr):
        self.t.sendto(answer_for(data, udp=True), addr)


async def _tcp(reader, writer):
    try:
        n = struct.unpack("!H", await reader.readexactly(2))[0]
        out = answer_for(await reader.readexactly(n), udp=False)
        writer.write(struct.pack("!H", len(out)) + out)
        await writer.drain()
    finally:
        writer.close()


@pytest.fixture
async def dns_server(tmp_path):
    """(port, resolv.conf writer) of a server answering ZONE on 127.0.0.1, UDP and TCP."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(_Udp, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    tcp = await asyncio.start_server(_tcp, "127.0.0.1", port)

    def conf(extra: str = "") -> str:
        p = tmp_path / "resolv.conf"
        p.write_text(f"nameserver 127.0.0.1\noptions timeout:1\n{extra}")
        return str(p)
    try:
        yield port, conf
    finally:
        transport.close()
        tcp.close()


async def test_resolver_against_a_local_server(dns_server):
    port, conf = dns_server
    ans = await Resolver(conf(), port=port).resolve("backend.test")
    assert ans.addresses == (ip("10.98.0.2"), ip("10.98.0.3"), ip("fd98::2"))
    assert ans.ttl == 7      # the smallest TTL of both families
    ans = await Resolver(conf(), port=port).resolve("v4only.test")
    assert ans.addresses == (ip("10.98.0.4"),) and ans.ttl == 300
    with pytest.raises(DNSError, match="no IPv4 or IPv6 addresses found for host: missing.test"):
        await Resolver(conf(), port=port).resolve("missing.test")


async def test_search_domains_and_the_cname_chains_smallest_ttl(dns_server):
    port, conf = dns_server
    ans = await Resolver(conf("search a.svc b.local\n"), port=port).resolve("web")
    assert ans.addresses == (ip("10.98.0.9"),)
    assert ans.ttl == 30     # the CNAME's TTL is smaller than the address record's


async def test_a_truncated_answer_is_fetched_over_tcp(dns_server):
    port, conf = dns_server
    ans = await Resolver(conf(), port=port).resolve("big.test")
    assert len(ans.addresses) == 39 and ans.ttl == 90


async def test_an_unreachable_server_is_an_error_not_a_hang(tmp_path):
    p = tmp_path / "resolv.conf"
    p.write_text("nameserver 127.0.0.1\noptions timeout:1\n")
    with pytest.raises(DNSError, match="no answer for backend.test"):
        async with asyncio.timeout(30):
            await Resolver(str(p), port=9).resolve("backend.test")    # discard port: nobody answers
