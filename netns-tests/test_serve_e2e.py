"""L7 ingress and the agent's endpoints, end to end with headscale and real tailscaled.

The serve config on disk decides where the proxy's tailnet HTTP port goes; edits reroute it, a broken file
keeps the last good route; /readyz follows whether traffic can flow; /metrics is valid Prometheus text.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from labtools.lab import wait_until
from tests.support.prometheus import parse_prometheus, sample

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(300)]

LOCAL = "127.0.0.1:9002"


def write_atomically(path: str, doc) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    os.replace(tmp, path)


def serve_doc(host: str, backend: str) -> dict:
    # headscale issues no certificates, so ${TS_CERT_DOMAIN} would be "no-https" (as upstream); plain HTTP is
    # keyed by the node's MagicDNS name.
    return {"TCP": {"80": {"HTTP": True}}, "Web": {f"{host}:80": {"Handlers": {"/": {"Proxy": backend}}}}}


def local_get(lab, path: str) -> tuple[int, str]:
    r = lab.exec("proxy", ["curl", "-s", "-m", "5", "-o", "/dev/stdout", "-w", "\n%{http_code}",
                           f"http://{LOCAL}{path}"], timeout=10)
    body, _, code = r.stdout.rpartition("\n")
    return int(code or 0), body


def test_serve_config_routes_reroutes_and_survives_a_broken_file(lab, lab_backend, start_agent, tmp_path):
    second = lab.start_http_server("backend", "10.98.0.2", 8081, f"second-{lab.prefix}")
    path = str(tmp_path / "serve.json")
    host = "proxy.tailnet.test"
    write_atomically(path, serve_doc(host, "http://10.98.0.2:8080"))
    agent = start_agent({"TS_SERVE_CONFIG": path, "TS_ENABLE_METRICS": "true", "TS_ENABLE_HEALTH_CHECK": "true",
                         "TS_LOCAL_ADDR_PORT": LOCAL})
    agent.wait_for_log("Startup complete, waiting for shutdown signal", timeout=90)
    v4, _ = agent.tailnet_ips()
    url = lab.url(v4, 80, "/l7")
    hdr = ["-H", f"Host: {host}"]

    def get() -> str:
        r = lab.curl("client", url, extra=hdr)
        return r.stdout if r.returncode == 0 else ""

    def wait_body(marker: str, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if marker in get():
                return time.monotonic() - start
            time.sleep(0.1)   # poll: until the body is served or the deadline
        raise AssertionError(f"{marker!r} not served within {timeout}s; last: {get()!r}")

    wait_body(lab_backend.marker, 45)
    write_atomically(path, serve_doc(host, "http://10.98.0.2:8081"))
    took = wait_body(second.marker, 30)
    print(f"rerouted {took:.2f}s after the edit")

    def invalid_applies() -> float:
        code, metrics = local_get(lab, "/metrics")
        assert code == 200, metrics
        try:
            return sample(parse_prometheus(metrics), "containerboot_serve_config_applies_total", result="invalid")
        except KeyError:
            return 0.0   # never counted yet

    def serve_error() -> str:
        code, status = local_get(lab, "/status")
        assert code == 200, status
        return (json.loads(status).get("serve") or {}).get("last_error") or ""

    invalid_before = invalid_applies()
    seen = len(agent.log_text())
    with open(path, "w") as f:
        f.write('{"TCP": {"80": ')  # a half-written, broken file
    # Assert only once the agent has processed the broken file: it logs the parse error, and /status carries
    # it once that round (which re-applies the last good config) has finished.
    wait_until(lambda: "serve proxy: invalid serve config" in agent.log_text()[seen:] or not agent.running(),
               30, 0.1, "the agent to log the invalid serve config")
    assert agent.running(), "a broken serve config file must not stop the agent"
    wait_until(lambda: "invalid serve config" in serve_error(), 30, 0.2, "/status to report the invalid serve config")
    assert second.marker in get(), "the last good route must stay in force"
    assert agent.running()
    assert invalid_applies() > invalid_before
    code, metrics = local_get(lab, "/metrics")
    assert code == 200
    parse_prometheus(metrics)   # valid exposition text
    assert "tailscaled_" in metrics  # tailscaled's own user metrics are served too


def test_readyz_follows_whether_traffic_can_flow(lab, lab_backend, start_agent):
    agent = start_agent({"TS_DEST_IP": lab.backend_ipv4, "TS_ENABLE_HEALTH_CHECK": "true",
                         "TS_LOCAL_ADDR_PORT": LOCAL, "TS_DEBUG_FIREWALL_MODE": "nftables"})
    seen_503_before = False
    deadline = time.monotonic() + 90
    while True:
        code, _ = local_get(lab, "/readyz")
        if code == 200:
            break
        seen_503_before = seen_503_before or code == 503
        assert time.monotonic() < deadline and agent.running(), f"/readyz never said ready (last {code})"
        time.sleep(0.1)   # poll: every 0.1 s, to see a 503 before the first 200
    # At the first 200 the DNAT to the backend must already be in the kernel: the kernel, not the agent's own
    # log, is the reference (a 200 once came before the first reconcile had computed any target).
    rules = lab.exec("proxy", ["nft", "list", "table", "ip", "containerboot"], timeout=10).stdout
    assert f"dnat to {lab.backend_ipv4}" in rules, f"/readyz said ready before the rules were installed:\n{rules}"
    assert seen_503_before, "/readyz never answered 503 while the agent was starting"
    agent.wait_for_log("Startup complete, waiting for shutdown signal", timeout=30)
    code, body = local_get(lab, "/readyz")
    assert code == 200, body
    v4, _ = agent.tailnet_ips()
    lab.wait_curl("client", lab.url(v4, 8080, "/ready"), lab_backend.marker, timeout=45)
    code, body = local_get(lab, "/healthz")
    assert (code, body) == (200, "ok")
