"""HTTPS with the user's own certificate on headscale, end to end: real headscale, real tailscaled, our agent.

A tailnet client curls https://<the proxy's MagicDNS name> verifying against a test CA and sees the
certificate's serial; a renewed certificate reaches new connections while a connection opened before it goes
on working; a certificate for another name is refused and the last good one keeps serving; port 80 redirects.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from labtools.lab import wait_until
from tests.support.testca import TestCA

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(300)]

FQDN = "proxy.tailnet.test"

# Run on the client node: a keep-alive connection opened now, a marker file, then new connections until the
# serial differs, then one more request on the first connection.
HELD = r'''
import http.client, json, socket, ssl, sys, time
ip, name, ca, marker, old = sys.argv[1:6]
ctx = ssl.create_default_context(cafile=ca)
def conn():
    c = http.client.HTTPConnection(ip, 443, timeout=10)
    c.sock = ctx.wrap_socket(socket.create_connection((ip, 443), 10), server_hostname=name)
    return c
def get(c):
    c.request("GET", "/held", headers={"Host": name})
    r = c.getresponse()
    return r.status, r.read().decode()
held = conn()
first = held.sock.getpeercert()["serialNumber"]
out = {"held_serial": first, "first": get(held)}
open(marker, "w").write("ready")
deadline, new = time.monotonic() + 90, first
while time.monotonic() < deadline:
    c = conn()
    new = c.sock.getpeercert()["serialNumber"]
    c.close()
    if new != old:
        break
    time.sleep(0.5)   # poll: until a new connection gets the new certificate
out["new_serial"] = new
out["after"] = get(held)
print(json.dumps(out))
'''


def write_pair(d: str, leaf) -> None:
    for fname, data in (("tls.crt", leaf.cert_pem), ("tls.key", leaf.key_pem)):
        tmp = os.path.join(d, fname + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(d, fname))


def curl_https(lab, ip: str, ca: str, path: str = "/") -> tuple[int, str, str]:
    """(exit code, body, serial of the certificate) of a verified HTTPS GET of https://FQDN from the client."""
    r = lab.exec("client", ["curl", "-sS", "--noproxy", "*", "-m", "10", "--cacert", ca, "--resolve",
                            f"{FQDN}:443:{ip}", "-w", "\n%{certs}", f"https://{FQDN}{path}"], timeout=15)
    serial = ""
    for line in r.stdout.splitlines():
        if line.startswith("Serial Number:"):
            serial = line.split(":", 1)[1].strip().replace(":", "").upper().lstrip("0")
            break
    return r.returncode, r.stdout if r.returncode == 0 else r.stderr, serial


def test_own_certificate_served_renewed_and_kept_when_bad(lab, lab_backend, start_agent, tmp_path):
    ca = TestCA(str(tmp_path / "ca"))
    certs = tmp_path / "tls"
    certs.mkdir()
    first = ca.issue(FQDN)
    write_pair(str(certs), first)
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({
        "TCP": {"443": {"TCPForward": "127.0.0.1:10443"}, "10080": {"HTTP": True}, "80": {"HTTP": True}},
        "Web": {f"{FQDN}:10080": {"Handlers": {"/": {"Proxy": "http://10.98.0.2:8080"}}},
                f"{FQDN}:80": {"Handlers": {"/": {"Redirect": "301:https://${HOST}${REQUEST_URI}"}}}}}))
    agent = start_agent({"TS_USERSPACE": "true", "TS_SERVE_CONFIG": str(serve), "TS_TLS_CERT_DIR": str(certs)})
    agent.wait_for_log("tls: listening on 127.0.0.1:10443", timeout=90)
    v4, _ = agent.tailnet_ips()

    def served() -> tuple[int, str, str]:
        return curl_https(lab, v4, ca.ca_path, "/hello")
    wait_until(lambda: served()[0] == 0, 45, 0.3, "HTTPS through the proxy")
    code, body, serial = served()
    assert code == 0 and lab_backend.marker in body and "path=/hello" in body, body
    assert serial == first.serial.lstrip("0")
    # Without the CA the client refuses the certificate (it is really the test CA's, verified)
    r = lab.exec("client", ["curl", "-sS", "-m", "10", "--resolve", f"{FQDN}:443:{v4}", f"https://{FQDN}/"],
                 timeout=15)
    assert r.returncode == 60, r.stderr
    # Port 80 redirects to https
    r = lab.exec("client", ["curl", "-sS", "-m", "10", "-o", "/dev/null", "-w", "%{http_code} %{redirect_url}",
                            "-H", f"Host: {FQDN}", f"http://{v4}/x?y=1"], timeout=15)
    assert r.stdout == f"301 https://{FQDN}/x?y=1", r.stdout

    # Renewal while a connection is held open
    second = ca.issue(FQDN)
    marker = tmp_path / "held-ready"
    result: dict = {}

    def held() -> None:
        cp = lab.exec("client", [sys.executable, "-c", HELD, v4, FQDN, ca.ca_path, str(marker),
                                 first.serial], timeout=150)
        result["cp"] = cp
    t = threading.Thread(target=held)
    t.start()
    wait_until(lambda: marker.exists(), 30, 0.1, "the held connection")
    renewed_at = time.monotonic()
    write_pair(str(certs), second)
    t.join(160)
    cp = result["cp"]
    assert cp.returncode == 0, cp.stderr[-2000:]
    out = json.loads(cp.stdout)
    took = time.monotonic() - renewed_at
    assert out["held_serial"] == first.serial and out["first"][0] == 200
    assert out["new_serial"] == second.serial, "the renewed certificate never reached a new connection"
    assert out["after"][0] == 200 and lab_backend.marker in out["after"][1], "the held connection was cut"
    print(f"renewed certificate served {took:.1f}s after the Secret changed")
    assert served()[2] == second.serial.lstrip("0")

    # A certificate for another name: refused, the last good one keeps serving
    seen = len(agent.log_text())
    write_pair(str(certs), ca.issue("other.example.org"))
    wait_until(lambda: "covers none of the served names" in agent.log_text()[seen:], 60, 0.5,
               "the agent to refuse the certificate for another name")
    assert "still serving the last good certificate" in agent.log_text()[seen:]
    code, body, serial = served()
    assert code == 0 and serial == second.serial.lstrip("0")
    assert "BEGIN" not in agent.log_text()


def test_one_backend_is_reached_straight_with_the_certificate(lab, lab_backend, start_agent, tmp_path):
    """TS_TLS_BACKEND (an Ingress whose every path goes to one Service): no plain-HTTP port on the tailnet."""
    ca = TestCA(str(tmp_path / "ca"))
    certs = tmp_path / "tls"
    certs.mkdir()
    leaf = ca.issue(FQDN)
    write_pair(str(certs), leaf)
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"TCP": {"443": {"TCPForward": "127.0.0.1:10443"}}}))
    agent = start_agent({"TS_USERSPACE": "true", "TS_SERVE_CONFIG": str(serve), "TS_TLS_CERT_DIR": str(certs),
                         "TS_TLS_BACKEND": "10.98.0.2:8080"})
    agent.wait_for_log("tls: listening on 127.0.0.1:10443", timeout=90)
    v4, _ = agent.tailnet_ips()
    wait_until(lambda: curl_https(lab, v4, ca.ca_path, "/straight")[0] == 0, 45, 0.3, "HTTPS through the proxy")
    code, body, serial = curl_https(lab, v4, ca.ca_path, "/straight")
    assert code == 0 and lab_backend.marker in body and "path=/straight" in body, body
    assert serial == leaf.serial.lstrip("0")
    r = lab.exec("client", ["curl", "-sS", "-m", "5", f"http://{v4}:10080/"], timeout=10)
    assert r.returncode != 0, "a plain-HTTP port is open on the tailnet"
