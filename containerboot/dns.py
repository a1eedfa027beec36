"""Resolution of TS_EXPERIMENTAL_DEST_DNS_NAME with record TTLs, and the re-resolution schedule.

Upstream re-resolves every 10 minutes whatever the records say; here the next lookup happens when the
answer's TTL runs out (bounded to [5 s, 10 min]), and after a failure with upstream's backoff (1 s, 2 s, 4 s,
... up to 10 min). The stdlib resolver does not expose TTLs, so this module speaks plain DNS over UDP (TCP
on truncation) to the nameservers of /etc/resolv.conf: A and AAAA, following CNAMEs, honouring `search` and
`ndots` for relative names. The wire format code is pure and unit-tested; the socket code is small.
"""
from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import struct
from dataclasses import dataclass

from .state import IP

MIN_TTL = 5.0
MAX_TTL = 600.0
MAX_BACKOFF = 600.0
QTYPE_A, QTYPE_AAAA, QTYPE_CNAME = 1, 28, 5


class DNSError(Exception):
    """A lookup failed (timeout, SERVFAIL, no addresses, ...)."""


@dataclass(frozen=True)
class Answer:
    addresses: tuple[IP, ...]
    ttl: float  # seconds until the answer should be refreshed


def next_delay(*, ok: bool, ttl: float = MAX_TTL, failures: int = 0) -> float:
    """When to resolve again: at the TTL after a success, with exponential backoff after failures."""
    if ok:
        return min(MAX_TTL, max(MIN_TTL, ttl))
    return min(MAX_BACKOFF, float(2 ** min(failures, 20)))


# ---- wire format (pure) ---------------------------------------------------------------------------------
def encode_query(name: str, qtype: int, qid: int) -> bytes:
    header = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)  # RD=1
    qname = b"".join(bytes([len(label)]) + label.encode("idna") for label in name.rstrip(".").split(".") if label)
    return header + qname + b"\x00" + struct.pack("!HH", qtype, 1)


def _read_name(msg: bytes, off: int) -> tuple[str, int]:
    labels: list[str] = []
    jumped, end, hops = False, off, 0
    while True:
        if off >= len(msg):
            raise DNSError("malformed DNS answer (name past the end)")
        n = msg[off]
        if n & 0xC0 == 0xC0:
            if hops > 32:
                raise DNSError("malformed DNS answer (pointer loop)")
            ptr = ((n & 0x3F) << 8) | msg[off + 1]
            if not jumped:
                end = off + 2
            off, jumped, hops = ptr, True, hops + 1
            continue
        off += 1
        if n == 0:
            break
        labels.append(msg[off:off + n].decode("ascii", "replace"))
        off += n
    return ".".join(labels).lower() + ".", (end if jumped else off)


@dataclass(frozen=True)
class Parsed:
    rcode: int
    truncated: bool
    records: tuple[tuple[str, int, int, bytes | str], ...]  # (name, type, ttl, rdata or target name)


def decode_response(msg: bytes, qid: int) -> Parsed:
    if len(msg) < 12:
        raise DNSError("short DNS answer")
    rid, flags, qd, an, _ns, _ar = struct.unpack("!HHHHHH", msg[:12])
    if rid != qid:
        raise DNSError("DNS answer for another query")
    off = 12
    for _ in range(qd):
        _, off = _read_name(msg, off)
        off += 4
    records = []
    for _ in range(an):
        name, off = _read_name(msg, off)
        rtype, _cls, ttl, rdlen = struct.unpack("!HHIH", msg[off:off + 10])
        off += 10
        rdata = msg[off:off + rdlen]
        if rtype == QTYPE_CNAME:
            target, _ = _read_name(msg, off)
            records.append((name, rtype, ttl, target))
        else:
            records.append((name, rtype, ttl, rdata))
        off += rdlen
    return Parsed(rcode=flags & 0xF, truncated=bool(flags & 0x0200), records=tuple(records))


def addresses_from(parsed: Parsed, qname: str, qtype: int) -> tuple[list[IP], float | None]:
    """Follow CNAMEs from qname and collect addresses of qtype; return them with the smallest TTL seen."""
    name = qname.lower() if qname.endswith(".") else qname.lower() + "."
    ttls: list[int] = []
    for _ in range(16):
        cname = next((r for r in parsed.records if r[0] == name and r[1] == QTYPE_CNAME), None)
        if cname is None:
            break
        ttls.append(cname[2])
        name = str(cname[3])
    out: list[IP] = []
    for rname, rtype, ttl, rdata in parsed.records:
        if rname == name and rtype == qtype and isinstance(rdata, bytes):
            if qtype == QTYPE_A and len(rdata) == 4:
                out.append(ipaddress.IPv4Address(rdata))
            elif qtype == QTYPE_AAAA and len(rdata) == 16:
                out.append(ipaddress.IPv6Address(rdata))
            else:
                continue
            ttls.append(ttl)
    return out, (float(min(ttls)) if out else None)


@dataclass(frozen=True)
class ResolvConf:
    nameservers: tuple[str, ...] = ("127.0.0.1",)
    search: tuple[str, ...] = ()
    ndots: int = 1
    timeout: float = 2.0
    attempts: int = 2


def parse_resolv_conf(text: str) -> ResolvConf:
    ns: list[str] = []
    search: list[str] = []
    ndots, timeout, attempts = 1, 2.0, 2
    for line in text.splitlines():
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if parts[0] == "nameserver" and len(parts) > 1:
            ns.append(parts[1])
        elif parts[0] in ("search", "domain"):
            search = parts[1:]
        elif parts[0] == "options":
            for opt in parts[1:]:
                key, _, val = opt.partition(":")
                if key == "ndots" and val.isdigit():
                    ndots = int(val)
                elif key == "timeout" and val.isdigit():
                    timeout = float(val)
                elif key == "attempts" and val.isdigit():
                    attempts = int(val)
    return ResolvConf(tuple(ns) or ("127.0.0.1",), tuple(search), ndots, timeout, attempts)


def candidate_names(name: str, conf: ResolvConf) -> list[str]:
    if name.endswith("."):
        return [name]
    as_is = [name + "."]
    searched = [f"{name}.{d.strip('.')}." for d in conf.search]
    return as_is + searched if name.count(".") >= conf.ndots else searched + as_is


# ---- network (adapter) ----------------------------------------------------------------------------------
class _UDP(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr) -> None:
        if not self.answer.done():
            self.answer.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.answer.done():
            self.answer.set_exception(exc)


async def _exchange(server: str, query: bytes, timeout: float, port: int = 53) -> bytes:
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in server else socket.AF_INET
    transport, proto = await loop.create_datagram_endpoint(_UDP, remote_addr=(server, port), family=family)
    try:
        transport.sendto(query)
        return await asyncio.wait_for(proto.answer, timeout)
    finally:
        transport.close()


async def _exchange_tcp(server: str, query: bytes, timeout: float, port: int = 53) -> bytes:
    async with asyncio.timeout(timeout):
        r, w = await asyncio.open_connection(server, port)
        try:
            w.write(struct.pack("!H", len(query)) + query)
            await w.drain()
            n = struct.unpack("!H", await r.readexactly(2))[0]
            return await r.readexactly(n)
        finally:
            w.close()


class Resolver:
    def __init__(self, resolv_conf: str = "/etc/resolv.conf", *, port: int = 53):
        self.resolv_conf = resolv_conf
        self.port = port

    def _conf(self) -> ResolvConf:
        try:
            with open(self.resolv_conf) as f:
                return parse_resolv_conf(f.read())
        except OSError:
            return ResolvConf()

    async def _query(self, conf: ResolvConf, name: str, qtype: int) -> tuple[int, list[IP], float | None]:
        last: Exception | None = None
        for _ in range(max(1, conf.attempts)):
            for server in conf.nameservers:
                qid = random.randrange(1, 0xFFFF)
                q = encode_query(name, qtype, qid)
                try:
                    parsed = decode_response(await _exchange(server, q, conf.timeout, self.port), qid)
                    if parsed.truncated:
                        parsed = decode_response(await _exchange_tcp(server, q, conf.timeout, self.port), qid)
                except (OSError, asyncio.TimeoutError, DNSError) as e:
                    last = e
                    continue
                if parsed.rcode not in (0, 3):  # SERVFAIL, REFUSED, ...: try the next server
                    last = DNSError(f"rcode {parsed.rcode} from {server}")
                    continue
                addrs, ttl = addresses_from(parsed, name, qtype)
                return parsed.rcode, addrs, ttl
        raise DNSError(f"no answer for {name.rstrip('.')}: {last!r}")

    async def resolve(self, name: str) -> Answer:
        """A and AAAA records of name (v4 first); raises DNSError when neither family has an address."""
        conf = self._conf()
        for candidate in candidate_names(name, conf):
            (_, v4, t4), (_, v6, t6) = await asyncio.gather(
                self._query(conf, candidate, QTYPE_A), self._query(conf, candidate, QTYPE_AAAA))
            if v4 or v6:
                ttls = [t for t in (t4, t6) if t is not None]
                return Answer(tuple(sorted(set(v4), key=str)) + tuple(sorted(set(v6), key=str)), min(ttls))
        raise DNSError(f"no IPv4 or IPv6 addresses found for host: {name}")




async def watch_name(name: str, resolver: "Resolver", on_answer, *, sleep=asyncio.sleep, log=None) -> None:
    """Resolve `name` forever: at the answer's TTL after a success, with backoff after failures.

    `on_answer(addresses, error)` is called after every attempt: with the addresses on success, and with
    `None` and the error text on failure, so that the caller keeps the last good addresses (a transient DNS
    failure must not tear down working rules).
    """
    failures = 0
    while True:
        try:
            answer = await resolver.resolve(name)
        except DNSError as e:
            delay = next_delay(ok=False, failures=failures)
            failures += 1
            if log is not None:
                log.warning("[unexpected] error resolving DNS name %s: %s (retrying in %gs)", name, e, delay)
            on_answer(None, str(e))
        else:
            failures = 0
            delay = next_delay(ok=True, ttl=answer.ttl)
            on_answer(answer.addresses, "")
        await sleep(delay)
