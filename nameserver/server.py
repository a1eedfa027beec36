"""The nameserver's shell: UDP and TCP listeners on one port and the records file watch, on one asyncio loop.

Answers are computed by ``answer.answer`` (pure) against the records in force; a reload swaps in a new
``Records`` value whole, so a query sees either the old or the new records, never a mix.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable

import dns.name

from .answer import answer
from .records import Records, RecordsError, parse_records, zones_of

log = logging.getLogger("nameserver")

__all__ = ["NameServer", "listen", "watch_records", "PORT", "RECORDS_FILE"]

#: Upstream's port (its Service maps 53 to it), so an unprivileged process can listen.
PORT = 1053
#: Where the ``dnsrecords`` ConfigMap is mounted and its key.
RECORDS_FILE = "/config/records.json"
#: How long an idle TCP connection is kept (RFC 7766 suggests seconds, not minutes).
TCP_IDLE_TIMEOUT = 10.0
#: Answers kept per records version (a query's bytes after its ID -> the answer's bytes after the ID).
ANSWER_CACHE_SIZE = 4096


class NameServer:
    """The records in force and the zones they are answered for."""

    def __init__(self, zones: Iterable[str] = (), records: Records | None = None) -> None:
        self._configured = frozenset(dns.name.from_text(z.strip().rstrip(".") + ".").canonicalize()
                                     for z in zones if z.strip())
        self.records = Records()
        self.zones: frozenset[dns.name.Name] = self._configured
        self._answers: dict[tuple[bool, bytes], bytes | None] = {}
        self.set_records(records or Records())

    def set_records(self, records: Records) -> None:
        self.records = records
        self._answers = {}
        # Without a configured domain the zones follow the records (each name's parent): a name of a zone
        # with no record left is then REFUSED rather than NXDOMAIN, which resolvers treat alike.
        self.zones = self._configured or zones_of(records)

    def handle(self, wire: bytes, *, udp: bool) -> bytes | None:
        """The answer to `wire`. An answer is a pure function of the query and the records, and the query's ID
        only comes back in the answer's first two bytes: the same question asked again (a resolver's retry,
        every Pod asking for the same name) is answered from memory until the records change. Parsing and
        rendering with dnspython costs about 100 times the lookup."""
        if len(wire) < 12:
            return answer(wire, self.records, self.zones, udp=udp)
        key = (udp, wire[2:])
        try:
            out = self._answers[key]
        except KeyError:
            out = answer(wire, self.records, self.zones, udp=udp)
            if len(self._answers) >= ANSWER_CACHE_SIZE:
                self._answers.clear()
            self._answers[key] = out
        return None if out is None else wire[:2] + out[2:]


class _UDP(asyncio.DatagramProtocol):
    def __init__(self, ns: NameServer) -> None:
        self.ns = ns
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport   # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple) -> None:   # type: ignore[type-arg]
        out = self.ns.handle(data, udp=True)
        if out is not None and self.transport is not None:
            self.transport.sendto(out, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("UDP error: %s", exc)


async def _tcp_client(ns: NameServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """RFC 1035 4.2.2 framing (a 2-byte length before each message); several queries per connection."""
    try:
        while True:
            try:
                async with asyncio.timeout(TCP_IDLE_TIMEOUT):
                    head = await reader.readexactly(2)
                    body = await reader.readexactly(int.from_bytes(head, "big"))
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                return
            out = ns.handle(body, udp=False)
            if out is None:
                return   # not DNS: nothing sensible follows on this stream
            writer.write(len(out).to_bytes(2, "big") + out)
            await writer.drain()
    finally:
        writer.close()


def _sockets(host: str, port: int) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket on host:port; the empty host is every address of both families when the kernel
    has IPv6 (one dual-stack socket each), else every IPv4 address."""
    if host:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        addrs = [(fam, host)]
    else:
        addrs = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    last: OSError | None = None
    for fam, h in addrs:
        made: list[socket.socket] = []
        try:
            p = port
            # TCP first: with port 0 (tests) the UDP socket then takes the port the kernel gave TCP.
            for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                s = socket.socket(fam, kind)
                made.append(s)
                if fam == socket.AF_INET6 and not host:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                if kind == socket.SOCK_STREAM:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((h, p))
                p = s.getsockname()[1]
                s.setblocking(False)
            return made[1], made[0]
        except OSError as e:
            for s in made:
                s.close()
            last = e
    assert last is not None
    raise last


async def listen(ns: NameServer, host: str = "", port: int = PORT) -> tuple[asyncio.BaseTransport, asyncio.Server]:
    """Start answering on host:port (UDP and TCP); returns the UDP transport and the TCP server."""
    loop = asyncio.get_running_loop()
    udp_sock, tcp_sock = _sockets(host, port)
    transport, _ = await loop.create_datagram_endpoint(lambda: _UDP(ns), sock=udp_sock)
    server = await asyncio.start_server(lambda r, w: _tcp_client(ns, r, w), sock=tcp_sock, backlog=128)
    return transport, server


def load(ns: NameServer, text: str | None) -> bool:
    """Put the records in `text` in force; on a bad file keep the last good ones and say why. True if loaded."""
    try:
        records = parse_records(text)
    except RecordsError as e:
        log.error("%s; keeping the last good records (%d names)", e, len(ns.records.names()))
        return False
    for w in records.warnings:
        log.warning("records file: %s", w)
    ns.set_records(records)
    zones = ", ".join(sorted(z.to_text() for z in ns.zones)) or "none yet"
    log.info("serving %d names (zones: %s)", len(records.names()), zones)
    return True


async def watch_records(ns: NameServer, path: str = RECORDS_FILE, *, poll_interval: float = 5.0,
                        loaded: asyncio.Event | None = None) -> None:
    """Load the records file now and on every change (the kubelet's ``..data`` swap included), forever.

    The watcher yields only when the content differs from the last yield, so a bad file is reported once
    until it changes again."""
    from tscommon.watch import watch_file  # the kubelet-aware watch the agent's serve config uses too

    async for text in watch_file(path, poll_interval, label="nameserver records"):
        load(ns, text)
        if loaded is not None:
            loaded.set()
