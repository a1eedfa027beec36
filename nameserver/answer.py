"""A query's wire bytes -> the answer's wire bytes (pure: no sockets, no clock, no state).

The server is authoritative for its zones (the tailnet's domain, whatever it is) and answers from the
records only:

- A / AAAA for a name with addresses of that family: the addresses, TTL 0 (records change as proxy Pods move,
  and upstream's nameserver does not let resolvers cache them either).
- A name in a zone with no address of the asked family (or any other type for a known name): NOERROR with
  no answer (NODATA), so a resolver asking for both families keeps the one that exists.
- A name in a zone that has no records at all: NXDOMAIN.
- A name outside every zone: REFUSED (the server is not a recursive resolver).
- Over UDP an answer larger than the client's buffer (512 bytes, or its EDNS payload size) is sent empty with
  TC set, and the client retries over TCP, which carries it whole.
- Bytes that are not a DNS query: no answer at all (None); a query with no or several questions: FORMERR; an
  opcode other than QUERY: NOTIMP.
"""
from __future__ import annotations

from collections.abc import Iterable

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from .records import Records

__all__ = ["answer", "TTL", "UDP_MIN_PAYLOAD", "TCP_MAX"]

TTL = 0
UDP_MIN_PAYLOAD = 512
TCP_MAX = 65535
#: The largest UDP answer sent even to a client advertising more (RFC 9715's advice against fragmentation).
UDP_MAX_PAYLOAD = 1232


def _zone_of(name: dns.name.Name, zones: Iterable[dns.name.Name]) -> dns.name.Name | None:
    best: dns.name.Name | None = None
    for z in zones:
        if name.is_subdomain(z) and (best is None or len(z) > len(best)):
            best = z
    return best


def _reply(query: dns.message.Message, rcode: dns.rcode.Rcode, *, authoritative: bool) -> dns.message.Message:
    resp = dns.message.make_response(query, recursion_available=False, our_payload=UDP_MAX_PAYLOAD)
    resp.set_rcode(rcode)
    if authoritative:
        resp.flags |= dns.flags.AA
    return resp


def _wire(resp: dns.message.Message, query: dns.message.Message, udp: bool) -> bytes:
    if not udp:
        return resp.to_wire(max_size=TCP_MAX)
    size = UDP_MIN_PAYLOAD
    if query.edns >= 0:
        size = max(UDP_MIN_PAYLOAD, min(query.payload, UDP_MAX_PAYLOAD))
    try:
        return resp.to_wire(max_size=size)
    except dns.exception.TooBig:
        # Send the question alone with TC: a partial address list would look complete to the client.
        resp.answer.clear()
        resp.authority.clear()
        resp.flags |= dns.flags.TC
        return resp.to_wire(max_size=size)


def answer(wire: bytes, records: Records, zones: Iterable[dns.name.Name], *, udp: bool) -> bytes | None:
    """The answer to one query, or None when `wire` is not a DNS query (the caller drops it)."""
    try:
        query = dns.message.from_wire(wire, ignore_trailing=False)
    except dns.exception.DNSException:
        return None
    except Exception:   # dnspython can raise ValueError or IndexError on some garbage, not only DNSException
        return None
    if query.flags & dns.flags.QR:
        return None   # a response, not a query: answering responses invites loops
    if query.opcode() != dns.opcode.QUERY:
        return _wire(_reply(query, dns.rcode.NOTIMP, authoritative=False), query, udp)
    if len(query.question) != 1:
        return _wire(_reply(query, dns.rcode.FORMERR, authoritative=False), query, udp)
    q = query.question[0]
    qname = q.name.canonicalize()
    zone = _zone_of(qname, zones)
    if zone is None or q.rdclass != dns.rdataclass.IN:
        return _wire(_reply(query, dns.rcode.REFUSED, authoritative=False), query, udp)
    v4 = records.ip4.get(qname, ())
    v6 = records.ip6.get(qname, ())
    exists = qname == zone or qname in records.existing
    if not exists:
        return _wire(_reply(query, dns.rcode.NXDOMAIN, authoritative=True), query, udp)
    resp = _reply(query, dns.rcode.NOERROR, authoritative=True)
    addrs: tuple[object, ...] = ()
    if q.rdtype == dns.rdatatype.A:
        addrs = v4
    elif q.rdtype == dns.rdatatype.AAAA:
        addrs = v6
    if addrs:
        # Owner name as asked (case preserved, as resolvers compare it case-insensitively anyway).
        resp.answer.append(dns.rrset.from_text_list(q.name, TTL, dns.rdataclass.IN, q.rdtype,
                                                    [str(a) for a in addrs]))
    return _wire(resp, query, udp)
