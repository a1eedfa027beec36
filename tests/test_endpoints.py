"""containerboot.endpoints over real sockets: probes, readiness transitions, /status, strict /metrics."""
from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import httpx
import pytest

from containerboot.endpoints import EndpointServer, parse_addr_port, render_agent_metrics
from containerboot.status import AgentStatus, ServeStatus, TargetStatus, sample_key
from tests.support.prometheus import parse_prometheus, sample

USERMETRICS = """# TYPE tailscaled_inbound_bytes_total counter
# HELP tailscaled_inbound_bytes_total Counts the number of bytes received from other peers
tailscaled_inbound_bytes_total{path="derp"} 0
tailscaled_inbound_bytes_total{path="direct_ipv4"} 1234
# TYPE tailscaled_health_messages gauge
# HELP tailscaled_health_messages Number of health messages broken down by type.
tailscaled_health_messages{type="warning"} 1
"""


class Holder:
    def __init__(self, st: AgentStatus) -> None:
        self.st = st

    def __call__(self) -> AgentStatus:
        return self.st


def not_ready_status() -> AgentStatus:
    import time
    now = time.time()
    return AgentStatus(backend_state="Starting", started_at=now, loop_heartbeat_at=now,
                       targets=(TargetStatus("db", "tailnet-target-fqdn", (), False, "no such name", now),),
                       serve=ServeStatus(applied=False, last_error="not yet"))


def ready_status() -> AgentStatus:
    import time
    now = time.time()
    return AgentStatus(
        backend_state="Running", tailnet_ips=("100.64.0.1", "fd7a:115c:a1e0::1"), started_at=now - 60,
        loop_heartbeat_at=now, netmap_seen_at=now - 2, last_reconcile_at=now - 1,
        targets=(TargetStatus("db", "tailnet-target-fqdn", ("100.64.0.9",), True, "", now),
                 TargetStatus('we"ird\\name', "dest-ip", ("10.0.0.1",), True, "", now)),
        serve=ServeStatus(applied=True, cert_required=True, cert_ready=True, https_endpoint="n.ts.net"),
        counters={
            "containerboot_reconcile_total": 7,
            "containerboot_reconcile_duration_seconds_sum": 0.25,
            "containerboot_reconcile_duration_seconds_count": 7,
            sample_key("containerboot_dns_resolutions_total", result="ok"): 3,
            sample_key("containerboot_dns_resolutions_total", result="error"): 1,
            sample_key("containerboot_serve_config_applies_total", result="applied"): 2,
            sample_key("containerboot_serve_config_applies_total", result="invalid"): 1,
        })


async def usermetrics_ok() -> str:
    return USERMETRICS


@pytest.fixture
async def server():
    servers: list[EndpointServer] = []

    async def make(status: Holder, *, addr: str = "127.0.0.1:0", healthz_only: bool = False, **kw):
        kw.setdefault("metrics_source", usermetrics_ok)
        kw.setdefault("enable_metrics", True)
        kw.setdefault("enable_health", True)
        srv = EndpointServer(status_provider=status, **kw)
        servers.append(srv)
        bound = await srv.start(addr, healthz_only=healthz_only)
        return srv, f"http://{bound}"

    yield make
    for s in servers:
        await s.close()


# -- tests ----------------------------------------------------------------------------------------------------


async def test_healthz_upstream_semantics(server) -> None:
    holder = Holder(not_ready_status())
    _, url = await server(holder, pod_ipv4="10.1.2.3", pod_ipv6="fd00::3")
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/healthz")
        assert r.status_code == 503
        assert r.text == "node currently has no tailscale IPs\n"
        assert r.headers["content-type"] == "text/plain; charset=utf-8"
        assert "pod-ipv4" not in r.headers
        holder.st = ready_status()
        r = await c.get(url + "/healthz")
        assert r.status_code == 200 and r.text == "ok"
        assert r.headers["Pod-IPv4"] == "10.1.2.3" and r.headers["Pod-IPv6"] == "fd00::3"


async def test_readiness_transitions(server) -> None:
    holder = Holder(not_ready_status())
    _, url = await server(holder)
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/readyz")
        assert r.status_code == 503
        assert "tailscaled backend state is Starting" in r.text
        assert "target db (tailnet-target-fqdn): forwarding rules not installed: no such name" in r.text
        assert "serve config not applied: not yet" in r.text
        holder.st = ready_status()
        r = await c.get(url + "/readyz")
        assert (r.status_code, r.text) == (200, "ok\n")
        # A target loses its rules: not ready again.
        st = holder.st
        holder.st = AgentStatus(**{**st.__dict__, "targets": (TargetStatus("db", "tailnet-target-fqdn"),)})
        r = await c.get(url + "/readyz")
        assert r.status_code == 503 and "target db" in r.text


async def test_livez(server) -> None:
    import time
    holder = Holder(AgentStatus(started_at=time.time(), loop_heartbeat_at=time.time()))
    _, url = await server(holder)
    async with httpx.AsyncClient() as c:
        assert (await c.get(url + "/livez")).status_code == 200
        holder.st = AgentStatus(started_at=time.time() - 100, loop_heartbeat_at=time.time() - 45)
        r = await c.get(url + "/livez")
        assert r.status_code == 503 and "stalled for 45s" in r.text


async def test_status_json(server) -> None:
    holder = Holder(ready_status())
    _, url = await server(holder)
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/status")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["ready"] is True and doc["backend_state"] == "Running"
    assert doc["targets"][0]["resolved"] == ["100.64.0.9"]
    assert doc["serve"]["https_endpoint"] == "n.ts.net"


async def test_metrics_are_valid_exposition(server) -> None:
    holder = Holder(ready_status())
    _, url = await server(holder)
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    fams = parse_prometheus(r.text)
    for name, f in fams.items():
        assert f["type"] is not None and f["help"] is not None, name
    # tailscaled's own metrics come first, untouched.
    assert r.text.startswith(USERMETRICS)
    assert sample(fams, "tailscaled_inbound_bytes_total", path="direct_ipv4") == 1234
    # The agent's.
    assert fams["containerboot_reconcile_total"]["type"] == "counter"
    assert sample(fams, "containerboot_reconcile_total") == 7
    assert fams["containerboot_reconcile_duration_seconds"]["type"] == "summary"
    assert (
        sample(fams, "containerboot_reconcile_duration_seconds", "containerboot_reconcile_duration_seconds_count") == 7
    )
    assert sample(fams, "containerboot_dns_resolutions_total", result="error") == 1
    assert sample(fams, "containerboot_serve_config_applies_total", result="invalid") == 1
    assert sample(fams, "containerboot_rules_installed", target="db", kind="tailnet-target-fqdn") == 1
    assert sample(fams, "containerboot_rules_installed", target='we"ird\\name', kind="dest-ip") == 1
    assert 1 <= sample(fams, "containerboot_netmap_age_seconds") < 10
    assert sample(fams, "containerboot_ready") == 1
    assert sample(fams, "containerboot_tailscaled_metrics_up") == 1


async def test_metrics_with_empty_status_still_has_the_core_families() -> None:
    fams = parse_prometheus(render_agent_metrics(AgentStatus(), 0.0))
    for name in ("containerboot_reconcile_total", "containerboot_reconcile_duration_seconds",
                 "containerboot_dns_resolutions_total", "containerboot_serve_config_applies_total",
                 "containerboot_rules_installed", "containerboot_netmap_age_seconds"):
        assert name in fams and fams[name]["type"], name
    assert sample(fams, "containerboot_reconcile_total") == 0


async def test_metrics_when_tailscaled_is_down(server) -> None:
    async def broken() -> str:
        raise ConnectionRefusedError("no socket")

    _, url = await server(Holder(ready_status()), metrics_source=broken)
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/metrics")
    assert r.status_code == 200
    fams = parse_prometheus(r.text)
    assert sample(fams, "containerboot_tailscaled_metrics_up") == 0
    assert "tailscaled_inbound_bytes_total" not in fams


async def test_scraper_origin_and_referer_do_not_reach_the_localapi(server, tmp_path: Path) -> None:
    """Defect 26: upstream forwards the scraper's headers, so Origin/Referer get a 403 from the LocalAPI."""
    from containerboot.localapi import LocalAPI

    seen: list[dict] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        hdrs = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in head.decode().split("\r\n")[1:] if ln)}
        seen.append(hdrs)
        if "origin" in hdrs or "referer" in hdrs or hdrs.get("host") != "local-tailscaled.sock":
            body, status = b"invalid localapi request\n", 403
        else:
            body, status = USERMETRICS.encode(), 200
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    sock = str(tmp_path / "ts.sock")
    fake = await asyncio.start_unix_server(handle, path=sock)
    api = LocalAPI(sock, timeout=5)
    try:
        _, url = await server(Holder(ready_status()), metrics_source=api.usermetrics)
        async with httpx.AsyncClient() as c:
            r = await c.get(url + "/metrics", headers={"Origin": "https://grafana.example",
                                                        "Referer": "https://grafana.example/d/x"})
        assert r.status_code == 200
        fams = parse_prometheus(r.text)
        assert sample(fams, "containerboot_tailscaled_metrics_up") == 1
        assert "tailscaled_health_messages" in fams
        assert seen and all("origin" not in h and "referer" not in h for h in seen)
    finally:
        await api.aclose()
        fake.close()
        await fake.wait_closed()


async def test_disabled_endpoints_are_404(server) -> None:
    _, url = await server(Holder(ready_status()), enable_metrics=False, enable_health=False)
    async with httpx.AsyncClient() as c:
        assert (await c.get(url + "/metrics")).status_code == 404
        assert (await c.get(url + "/healthz")).status_code == 404
        assert (await c.get(url + "/readyz")).status_code == 200
        assert (await c.get(url + "/livez")).status_code == 200
        assert (await c.get(url + "/status")).status_code == 200
        assert (await c.get(url + "/nope")).status_code == 404


async def test_legacy_healthcheck_listener_serves_only_healthz(server) -> None:
    _, url = await server(Holder(ready_status()), healthz_only=True, enable_health=False)
    async with httpx.AsyncClient() as c:
        assert (await c.get(url + "/healthz")).status_code == 200
        for p in ("/readyz", "/livez", "/status", "/metrics"):
            assert (await c.get(url + p)).status_code == 404, p


async def test_head_and_method_not_allowed(server) -> None:
    _, url = await server(Holder(ready_status()))
    async with httpx.AsyncClient() as c:
        g = await c.get(url + "/readyz")
        h = await c.head(url + "/readyz")
        assert h.status_code == 200 and h.content == b""
        assert h.headers["content-length"] == g.headers["content-length"]
        h = await c.head(url + "/healthz")
        assert h.status_code == 200 and h.content == b"" and h.headers["content-length"] == "2"
        for m in ("POST", "PUT", "DELETE"):
            r = await c.request(m, url + "/metrics", content=b"x")
            assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"


async def test_keep_alive_and_bad_requests(server) -> None:
    srv, url = await server(Holder(ready_status()))
    host, port = url[len("http://"):].rsplit(":", 1)
    r, w = await asyncio.open_connection(host, int(port))
    for _ in range(3):
        w.write(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        await w.drain()
        head = await r.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and b"Connection: keep-alive" in head
        assert await r.readexactly(3) == b"ok\n"
    w.write(b"GET /livez HTTP/1.1\r\nConnection: close\r\n\r\n")
    await w.drain()
    data = await asyncio.wait_for(r.read(), 2)     # server closes
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"ok\n")
    w.close()

    r, w = await asyncio.open_connection(host, int(port))
    w.write(b"garbage\r\n\r\n")
    await w.drain()
    data = await asyncio.wait_for(r.read(), 2)
    assert data.startswith(b"HTTP/1.1 400 ")
    w.close()


async def test_ipv6_loopback(server) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        s = socket.socket(socket.AF_INET6)
        s.bind(("::1", 0))
        s.close()
    except OSError:
        pytest.skip("no ::1")
    srv, url = await server(Holder(ready_status()), addr="[::1]:0")
    assert url.startswith("http://[::1]:")
    async with httpx.AsyncClient() as c:
        assert (await c.get(url + "/healthz")).status_code == 200


async def test_dual_stack_any(server) -> None:
    srv, url = await server(Holder(ready_status()), addr="[::]:0")
    port = int(url.rsplit(":", 1)[1])
    async with httpx.AsyncClient() as c:
        r = await c.get(f"http://127.0.0.1:{port}/healthz")       # IPv4 reaches the [::] listener
        assert r.status_code == 200
        try:
            s = socket.create_connection(("::1", port), timeout=1)
            s.close()
        except OSError:
            return
        r = await c.get(f"http://[::1]:{port}/healthz")
        assert r.status_code == 200


async def test_several_listeners_and_close_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="containerboot")
    srv = EndpointServer(status_provider=Holder(ready_status()), metrics_source=None, enable_metrics=True,
                         enable_health=True)
    a = await srv.start("127.0.0.1:0")
    b = await srv.start("127.0.0.1:0", healthz_only=True)
    assert srv.addresses == [a, b] and a != b
    async with httpx.AsyncClient() as c:
        r = await c.get(f"http://{a}/metrics")
        assert parse_prometheus(r.text)["containerboot_tailscaled_metrics_up"]
        assert (await c.get(f"http://{b}/healthz")).status_code == 200
    await srv.close()
    assert "HTTP server at 127.0.0.1:0 closed" in caplog.text
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as c:
            await c.get(f"http://{a}/livez")


async def test_listen_failure_names_address() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    srv = EndpointServer(status_provider=Holder(AgentStatus()), metrics_source=None, enable_metrics=False,
                         enable_health=False)
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            await srv.start(f"127.0.0.1:{port}")
    finally:
        s.close()
        await srv.close()


async def test_extra_route(server) -> None:
    from containerboot.endpoints import Response

    srv, url = await server(Holder(ready_status()))

    async def hook(method, target, headers):
        return Response(200, b"safe to terminate")

    srv.add_route("/internal-egress-services-preshutdown", hook)
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/internal-egress-services-preshutdown")
    assert r.text == "safe to terminate"


@pytest.mark.parametrize("addr, expected", [
    ("0.0.0.0:9002", ("0.0.0.0", 9002)), ("[::]:9002", ("::", 9002)), ("[fd00::1]:80", ("fd00::1", 80)),
    (":9002", ("", 9002)), ("localhost:1", ("localhost", 1)),
])
def test_parse_addr_port(addr: str, expected: tuple[str, int]) -> None:
    assert parse_addr_port(addr) == expected


@pytest.mark.parametrize("addr", ["9002", "::1:80", "[::1]80", "1.2.3.4:x", "1.2.3.4:70000"])
def test_parse_addr_port_errors(addr: str) -> None:
    with pytest.raises(ValueError, match="invalid listen address"):
        parse_addr_port(addr)


def test_strict_parser_rejects_bad_exposition() -> None:
    bad = [
        "m 1",                                                  # no trailing newline
        "# TYPE m counter\n# TYPE m counter\nm 1\n",            # duplicate TYPE
        "m{a=\"x\"} 1\nn 1\nm{a=\"y\"} 2\n",                    # not contiguous
        "m{a=x} 1\n",                                           # unquoted label
        "m 1\nm 2\n",                                           # duplicate sample
        "1m 1\n",                                               # bad name
        "m one\n",                                              # bad value
        "# TYPE m countr\nm 1\n",                               # bad type
    ]
    for text in bad:
        with pytest.raises(AssertionError):
            parse_prometheus(text)
    assert set(parse_prometheus(USERMETRICS)) == {"tailscaled_inbound_bytes_total", "tailscaled_health_messages"}


def test_bad_or_colliding_counter_keys_cannot_break_the_exposition() -> None:
    st = AgentStatus(counters={"bad key": 1, 'x{a=b}': 2, "containerboot_ready": 5,
                               "containerboot_custom_total": 3, sample_key("containerboot_g", a='q"\n'): 1.5})
    fams = parse_prometheus(render_agent_metrics(st, 0.0))
    assert fams["containerboot_custom_total"]["type"] == "counter"
    assert sample(fams, "containerboot_g", a='q"\n') == 1.5
    assert sample(fams, "containerboot_ready") == 0          # from the status, not the stray counter
