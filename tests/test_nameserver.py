"""The nameserver: records.json parsing, the answers (with dnspython as the client, over real UDP and TCP on
loopback), and reloading on the kubelet's ``..data`` swap."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import socket

import dns.asyncquery
import dns.asyncresolver
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.resolver
import pytest

from nameserver.__main__ import parse_args
from nameserver.answer import answer
from nameserver.records import Records, RecordsError, parse_records, render_records
from nameserver.server import NameServer, listen, watch_records
from tests.support.kubelet import Kubelet
from tests.support.waits import until_async

ZONE = "tail.example"   # a headscale-style tailnet domain: not ts.net


def doc(ip4=None, ip6=None, version="v1alpha1") -> str:
    return json.dumps({"version": version, "ip4": ip4 or {}, "ip6": ip6 or {}})


RECORDS = parse_records(doc(
    ip4={"web.tail.example": ["10.1.0.7", "10.1.0.8"], "v4only.tail.example.": ["10.1.0.9"],
         "many.tail.example": [f"10.2.{i // 250}.{i % 250 + 1}" for i in range(120)]},
    ip6={"web.tail.example": ["fd7a:115c:a1e0::7"], "v6only.tail.example": ["fd7a:115c:a1e0::9"]}))
ZONES = [dns.name.from_text(ZONE)]


def ask(name: str, rdtype: str = "A", *, udp: bool = True, records: Records = RECORDS, **kw) -> dns.message.Message:
    q = dns.message.make_query(name, rdtype, **kw)
    out = answer(q.to_wire(), records, ZONES, udp=udp)
    assert out is not None
    return dns.message.from_wire(out)


def addrs(m: dns.message.Message) -> list[str]:
    return sorted(rd.to_text() for rrset in m.answer for rd in rrset)


# --- records.json ------------------------------------------------------------------------------------------

def test_records_parse_names_case_and_trailing_dot():
    r = parse_records(doc(ip4={"Web.Tail.Example.": ["10.0.0.1"]}))
    assert [n.to_text() for n in r.ip4] == ["web.tail.example."]


@pytest.mark.parametrize("text, says", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (doc(version="v2"), "version 'v2'"),
    (json.dumps({"version": "v1alpha1", "ip4": ["10.0.0.1"]}), "'ip4' must be a map"),
    (json.dumps({"version": "v1alpha1", "ip4": {"a.tail.example": "10.0.0.1"}}), "ip4['a.tail.example']"),
])
def test_records_bad_file_is_an_error_naming_the_problem(text, says):
    with pytest.raises(RecordsError, match=re.escape(says)):
        parse_records(text)


def test_records_bad_entries_are_skipped_with_a_warning():
    r = parse_records(doc(ip4={"a.tail.example": ["10.0.0.1", "nope", "fd00::1"], "b.tail.example": ["x"]},
                          ip6={"a.tail.example": ["10.0.0.2"]}))
    assert [str(a) for a in r.ip4[dns.name.from_text("a.tail.example")]] == ["10.0.0.1"]
    assert dns.name.from_text("b.tail.example") not in r.ip4 and not r.ip6
    assert len(r.warnings) == 4 and any("'nope' is not an IP address" in w for w in r.warnings)


def test_records_missing_or_empty_file_means_no_records():
    assert parse_records(None).names() == frozenset()
    assert parse_records("  \n").names() == frozenset()


def test_render_records_round_trips_and_is_deterministic():
    text = render_records({"b.tail.example.": ["10.0.0.2", "10.0.0.1"], "a.tail.example": ["10.0.0.3"]}, {})
    assert text == render_records({"a.tail.example": ["10.0.0.3"], "b.tail.example": ["10.0.0.1", "10.0.0.2"]}, {})
    assert json.loads(text) == {"version": "v1alpha1", "ip4": {"a.tail.example": ["10.0.0.3"],
                                                               "b.tail.example": ["10.0.0.1", "10.0.0.2"]},
                                "ip6": {}}
    assert parse_records(text).names() == {dns.name.from_text("a.tail.example"), dns.name.from_text("b.tail.example")}


# --- answers (pure) ----------------------------------------------------------------------------------------

def test_a_and_aaaa_answers_are_authoritative_with_ttl_zero():
    m = ask("web.tail.example", "A")
    assert m.rcode() == dns.rcode.NOERROR and m.flags & dns.flags.AA and not m.flags & dns.flags.RA
    assert addrs(m) == ["10.1.0.7", "10.1.0.8"] and m.answer[0].ttl == 0
    assert addrs(ask("WEB.tail.EXAMPLE.", "AAAA")) == ["fd7a:115c:a1e0::7"]


def test_existing_name_without_that_family_is_nodata_not_nxdomain():
    for name, rdtype in (("v4only.tail.example", "AAAA"), ("v6only.tail.example", "A"), ("web.tail.example", "TXT"),
                         ("tail.example", "A")):
        m = ask(name, rdtype)
        assert (m.rcode(), m.answer) == (dns.rcode.NOERROR, []), (name, rdtype)


def test_missing_name_in_the_zone_is_nxdomain():
    for name in ("nothere.tail.example", "sub.web.tail.example"):
        m = ask(name)
        assert m.rcode() == dns.rcode.NXDOMAIN and m.flags & dns.flags.AA


def test_names_outside_the_zone_are_refused():
    for name in ("example.com", "web.tail.example.com", "ts.net", "kubernetes.default.svc.cluster.local"):
        assert ask(name).rcode() == dns.rcode.REFUSED


def test_udp_answer_too_big_is_truncated_and_tcp_carries_it_whole():
    m = ask("many.tail.example")
    assert m.flags & dns.flags.TC and m.answer == []
    m = ask("many.tail.example", use_edns=0, payload=4096)   # EDNS: still above the 1232-byte UDP ceiling
    assert m.flags & dns.flags.TC
    m = ask("many.tail.example", udp=False)
    assert not m.flags & dns.flags.TC and len(addrs(m)) == 120
    assert not ask("web.tail.example").flags & dns.flags.TC


def test_garbage_and_responses_get_no_answer():
    assert answer(b"\x00\x01garbage", RECORDS, ZONES, udp=True) is None
    assert answer(b"", RECORDS, ZONES, udp=True) is None
    resp = dns.message.make_response(dns.message.make_query("web.tail.example", "A"))
    assert answer(resp.to_wire(), RECORDS, ZONES, udp=True) is None


def test_query_without_a_question_is_formerr():
    q = dns.message.make_query("web.tail.example", "A")
    q.question = []
    out = answer(q.to_wire(), RECORDS, ZONES, udp=True)
    assert out is not None and dns.message.from_wire(out).rcode() == dns.rcode.FORMERR


def test_zones_follow_the_record_names_when_none_is_configured():
    ns = NameServer()
    ns.set_records(RECORDS)
    assert ns.zones == {dns.name.from_text(ZONE)}
    q = dns.message.make_query("nothere.tail.example", "A").to_wire()
    assert dns.message.from_wire(ns.handle(q, udp=True)).rcode() == dns.rcode.NXDOMAIN
    assert NameServer(["other.example"], RECORDS).zones == {dns.name.from_text("other.example")}


def test_command_line_and_environment(monkeypatch):
    monkeypatch.setenv("TS_NAMESERVER_DOMAIN", "a.example,b.example")
    a = parse_args([])
    assert a.domain == ["a.example", "b.example"] and a.listen == ("", 1053) and a.records == "/config/records.json"
    assert parse_args(["--domain", "c.example", "--listen", "127.0.0.1:5353"]).listen == ("127.0.0.1", 5353)
    with pytest.raises(SystemExit):
        parse_args(["--listen", "nope"])


# --- the server on loopback --------------------------------------------------------------------------------

@pytest.fixture
async def server():
    ns = NameServer([ZONE], RECORDS)
    transport, srv = await listen(ns, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    yield ns, port
    transport.close()
    srv.close()
    await srv.wait_closed()


def resolver(port: int) -> dns.asyncresolver.Resolver:
    r = dns.asyncresolver.Resolver(configure=False)
    r.nameservers = ["127.0.0.1"]
    r.port = port
    r.lifetime = 5
    return r


async def test_udp_and_tcp_queries(server):
    _, port = server
    q = dns.message.make_query("web.tail.example", "A")
    assert addrs(await dns.asyncquery.udp(q, "127.0.0.1", port=port, timeout=5)) == ["10.1.0.7", "10.1.0.8"]
    assert addrs(await dns.asyncquery.tcp(q, "127.0.0.1", port=port, timeout=5)) == ["10.1.0.7", "10.1.0.8"]


async def test_resolver_gets_a_truncated_answer_whole_over_tcp(server):
    _, port = server
    ans = await resolver(port).resolve("many.tail.example", "A")
    assert len(ans.rrset) == 120


async def test_resolver_sees_nxdomain_and_refused(server):
    _, port = server
    with pytest.raises(dns.resolver.NXDOMAIN):
        await resolver(port).resolve("nothere.tail.example", "A")
    with pytest.raises(dns.resolver.NoNameservers):   # REFUSED from the only server
        await resolver(port).resolve("example.com", "A")


async def test_garbage_datagram_is_dropped_and_the_server_keeps_answering(server):
    _, port = server
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setblocking(False)
    s.connect(("127.0.0.1", port))
    try:
        await loop.sock_sendall(s, b"\xff" * 40)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await loop.sock_recv(s, 4096)
    finally:
        s.close()
    r, w = await asyncio.open_connection("127.0.0.1", port)   # garbage over TCP: that connection is closed
    w.write(b"\x00\x05hello")
    assert await asyncio.wait_for(r.read(), 5) == b""
    w.close()
    q = dns.message.make_query("web.tail.example", "A")
    assert addrs(await dns.asyncquery.udp(q, "127.0.0.1", port=port, timeout=5)) == ["10.1.0.7", "10.1.0.8"]


async def until(pred, timeout: float = 5.0) -> None:
    await until_async(pred, timeout)


async def test_reload_on_kubelet_swap_and_bad_file_keeps_last_good_records(tmp_path, caplog):
    kubelet = Kubelet(tmp_path / "config", key="records.json")
    kubelet.publish(doc(ip4={"a.tail.example": ["10.0.0.1"]}))
    ns = NameServer([ZONE])
    transport, srv = await listen(ns, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    watch = asyncio.create_task(watch_records(ns, kubelet.path, poll_interval=0.1))
    res = resolver(port)
    try:
        await until(lambda: bool(ns.records.names()))
        assert [a.to_text() for a in await res.resolve("a.tail.example", "A")] == ["10.0.0.1"]

        kubelet.publish(doc(ip4={"b.tail.example": ["10.0.0.2"]}))
        await until(lambda: dns.name.from_text("b.tail.example") in ns.records.ip4)
        assert [a.to_text() for a in await res.resolve("b.tail.example", "A")] == ["10.0.0.2"]
        with pytest.raises(dns.resolver.NXDOMAIN):
            await res.resolve("a.tail.example", "A")

        caplog.set_level(logging.INFO, logger="nameserver")
        caplog.clear()
        kubelet.publish("{broken")
        await until(lambda: any("not valid JSON" in r.message for r in caplog.records))
        kubelet.publish(doc(version="v0"))
        await until(lambda: any("version 'v0'" in r.message for r in caplog.records))
        assert [a.to_text() for a in await res.resolve("b.tail.example", "A")] == ["10.0.0.2"]
        # the same bad file published again, then a good one: once the good one is loaded the watch has seen
        # the rewrite too, and the same bad file was not reported again
        kubelet.publish(doc(version="v0"))
        kubelet.publish(doc(ip4={"c.tail.example": ["10.0.0.3"]}))
        await until(lambda: dns.name.from_text("c.tail.example") in ns.records.ip4)
        errors = [r.message for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 2 and "keeping the last good records (1 names)" in errors[0], errors
    finally:
        watch.cancel()
        transport.close()
        srv.close()


def test_repeated_question_keeps_its_own_id_and_follows_new_records():
    ns = NameServer([ZONE], RECORDS)
    q1 = dns.message.make_query("web.tail.example", "A")
    q2 = dns.message.make_query("web.tail.example", "A")
    q2.id = (q1.id + 1) % 65536
    a1 = dns.message.from_wire(ns.handle(q1.to_wire(), udp=True))
    a2 = dns.message.from_wire(ns.handle(q2.to_wire(), udp=True))
    assert (a1.id, a2.id) == (q1.id, q2.id) and addrs(a1) == addrs(a2) == ["10.1.0.7", "10.1.0.8"]
    ns.set_records(parse_records(doc(ip4={"web.tail.example": ["10.9.9.9"]})))
    assert addrs(dns.message.from_wire(ns.handle(q1.to_wire(), udp=True))) == ["10.9.9.9"]
    assert ns.handle(b"\x00\x01" + b"\xff" * 20, udp=True) is None
