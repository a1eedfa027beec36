"""L3 ingress to a DNS name (`TS_EXPERIMENTAL_DEST_DNS_NAME`) end to end, for both firewall backends.

A dnsmasq in the backend namespace answers A and AAAA records for `web.backend.test` from a hosts file, with a
short TTL; the proxy namespace's resolv.conf points at it. The client reaches the backends through the proxy's
tailnet addresses (both families); new connections spread over the two backends; when the records change, the
ingress follows within the TTL plus slack (re-resolution at the TTL, not upstream's fixed 10 minutes); when the
name stops resolving, the last good backends keep working.
"""
from __future__ import annotations

import labextras as lx
import pytest

from labtools.lab import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(300)]

MODES = ("nftables", "iptables")
NAME = "web.backend.test"
TTL = 5
PORT = 8080
B_V4, B_V6 = "10.98.0.3", "fd98::3"          # the second backend, next to the lab's 10.98.0.2 / fd98::2
DNS_V4, DNS_V6 = "10.98.0.53", "fd98::53"    # dnsmasq, in the backend namespace
# How long a records change may take to show: one TTL until the agent asks again, plus generous slack for
# reconcile, rule swap and a slow machine. Only an upper bound; nothing asserts on how fast it was.
FOLLOW_TIMEOUT = TTL + 40


@pytest.fixture(scope="module")
def dns_lab(lab, lab_backend):
    """Second backend server, dnsmasq, and the proxy namespace resolving through it (restored afterwards)."""
    added = []
    for cidr in (f"{B_V4}/24", f"{B_V6}/64", f"{DNS_V4}/24", f"{DNS_V6}/64"):
        lx.add_address(lab, "backend", "eth0", cidr)
        added.append(cidr)
    srv_b = lab.start_http_server("backend", (B_V4, B_V6), PORT, f"backend-b-{lab.prefix}")
    dns = lx.start_dnsmasq(lab, "backend", (DNS_V4, DNS_V6), {NAME: both_backends(lab)}, ttl=TTL,
                          local_domains=("backend.test",))
    old = lx.set_resolv_conf(lab, "proxy", f"nameserver {DNS_V4}\nnameserver {DNS_V6}\n"
                                           "options timeout:1 attempts:2\n")
    try:
        yield lab_backend, srv_b, dns
    finally:
        lx.set_resolv_conf(lab, "proxy", old)
        dns.stop()
        srv_b.proc.terminate()
        srv_b.proc.wait(10)
        for cidr in added:
            lx.del_address(lab, "backend", "eth0", cidr)


def both_backends(lab) -> list[str]:
    return [a for a in (lab.backend_ipv4, B_V4, lab.backend_ipv6, B_V6) if a]


def spread(lab, url: str, markers: tuple[str, ...], n: int) -> dict[str, int]:
    return lx.markers_seen(lab, "client", url, markers, n, timeout=4)


def wait_only(lab, url: str, want: str, markers: tuple[str, ...], what: str, streak: int = 8) -> None:
    """Bounded wait until ``streak`` new connections in a row all land on the backend with marker ``want``."""
    last: list[dict] = [{}]

    def pred() -> bool:
        seen = spread(lab, url, markers, streak)
        last[0] = seen
        return seen == {want: streak}
    try:
        wait_until(pred, FOLLOW_TIMEOUT, 0.5, what)
    except TimeoutError as e:
        raise AssertionError(f"{e}; last {streak} answers: {last[0]}") from None


@pytest.mark.parametrize("mode", MODES)
def test_dns_name_ingress_spreads_and_follows_records(lab, dns_lab, start_agent, mode):
    srv_a, srv_b, dns = dns_lab
    markers = (srv_a.marker, srv_b.marker)
    dns.set_records({NAME: both_backends(lab)})
    assert sorted(dns.query(NAME, "A")) == sorted([lab.backend_ipv4, B_V4]), dns.log_text()[-2000:]

    agent = start_agent({"TS_EXPERIMENTAL_DEST_DNS_NAME": NAME, "TS_DEBUG_FIREWALL_MODE": mode})
    agent.wait_for_log("Startup complete, waiting for shutdown signal", timeout=90)
    proxy_v4, proxy_v6 = agent.tailnet_ips()
    urls = {4: lab.url(proxy_v4, PORT, "/?dns4")}
    if proxy_v6 and lab.backend_ipv6:
        urls[6] = lab.url(proxy_v6, PORT, "/?dns6")

    # Both families work, and new connections are spread over both backends.
    for version, url in urls.items():
        lab.wait_curl("client", url, "backend-", timeout=45)
        seen: dict[str, int] = {}
        wait_until(lambda seen=seen, url=url: (
                       seen.update({k: seen.get(k, 0) + v for k, v in spread(lab, url, markers, 10).items()})
                       or all(seen.get(m) for m in markers)), 40, 0.1,
                   f"IPv{version} connections reaching both backends")
        assert "<fail>" not in seen and "<other>" not in seen, seen

    # The records change to the second backend only: the ingress follows, without a restart.
    dns.set_records({NAME: [a for a in (B_V4, B_V6 if lab.backend_ipv6 else None) if a]})
    for version, url in urls.items():
        wait_only(lab, url, srv_b.marker, markers, f"IPv{version} ingress follows the records to backend B")
    # ... and back to the first one only.
    dns.set_records({NAME: [a for a in (lab.backend_ipv4, lab.backend_ipv6) if a]})
    for version, url in urls.items():
        wait_only(lab, url, srv_a.marker, markers, f"IPv{version} ingress follows the records to backend A")
    assert "Backend address change detected" in agent.log_text()

    # The record is deleted (NXDOMAIN): the agent says so, keeps the last good backends, and keeps running.
    mark = len(agent.log_text())
    dns.set_records({})
    assert dns.query(NAME, "A") == []
    wait_until(lambda: "error resolving DNS name" in agent.log_text()[mark:], FOLLOW_TIMEOUT, 0.5,
               "the agent noticing the name no longer resolves")
    for version, url in urls.items():
        assert spread(lab, url, markers, 4) == {srv_a.marker: 4}, f"IPv{version}: last good backends dropped"
    assert agent.running()

    # The backends see the client's traffic on their own addresses (the DNAT target), on both families.
    locals_a = {r["local"] for r in lab.http_peer_log(srv_a) if r["path"].startswith("/?dns")}
    locals_b = {r["local"] for r in lab.http_peer_log(srv_b) if r["path"].startswith("/?dns")}
    assert lab.backend_ipv4 in locals_a and B_V4 in locals_b
    if 6 in urls:
        assert lab.backend_ipv6 in locals_a and B_V6 in locals_b
