"""The LocalAPI contract the agent relies on, as checks that run unchanged on the fake tailscaled
(tests/support/fake_tailscaled.py) and on a real tailscaled.

Each check talks to a running daemon through the agent's own client (`containerboot.localapi.LocalAPI`) or, for
the wire rules a client cannot break on purpose, a raw HTTP request over the socket. The daemon is not logged
in (the fake starts in NeedsLogin; a real tailscaled without control stays there), so the checks are about
the wire: headers, status codes, the bus's first notification, the serve config's ETag, prefs editing and
the metrics endpoint. The fake's run is tests/test_tailscaled_contract.py; the real one's is
netns-tests/test_tailscaled_contract.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, cast

from containerboot.localapi import FIRST_WATCH_MASK, LOGIN_WATCH_MASK, WATCH_MASK, LocalAPI, LocalAPIError
from containerboot.state import BACKEND_STATES, notify_backend_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def raw_status(sock: str, request: str) -> int:
    """The status code tailscaled answers a raw HTTP/1.1 request with."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(sock)
        s.sendall(request.encode())
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ", 2)[1])


async def check_status_names_the_backend_state_and_capability_version(sock: str) -> None:
    api = LocalAPI(sock)
    st = await api.status()
    assert st.get("BackendState") in BACKEND_STATES, st.get("BackendState")
    assert isinstance(api.capver, int) and api.capver > 0, "every answer carries Tailscale-Cap"


async def check_the_bus_starts_with_the_backend_state(sock: str) -> None:
    for mask in (WATCH_MASK, FIRST_WATCH_MASK, LOGIN_WATCH_MASK):
        stream = cast(AsyncGenerator[dict, None], LocalAPI(sock).watch_ipn_bus(mask))
        try:
            first = await asyncio.wait_for(anext(stream), 10)
        finally:
            await stream.aclose()
        assert notify_backend_state(first) in BACKEND_STATES, first


async def check_browser_and_foreign_host_requests_are_refused(sock: str) -> None:
    """The LocalAPI refuses what a web page could send (a Referer or Origin, another Host)."""
    base = "GET /localapi/v0/status HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n"
    assert raw_status(sock, base.format(host="local-tailscaled.sock", extra="")) == 200
    assert raw_status(sock, base.format(host="local-tailscaled.sock", extra="Origin: http://evil.test\r\n")) == 403
    assert raw_status(sock, base.format(host="local-tailscaled.sock",
                                        extra="Referer: http://evil.test/\r\n")) == 403
    assert raw_status(sock, base.format(host="evil.test", extra="")) == 403


async def check_an_unknown_endpoint_is_404(sock: str) -> None:
    assert raw_status(sock, "GET /localapi/v0/no-such-endpoint HTTP/1.1\r\nHost: local-tailscaled.sock\r\n"
                            "Connection: close\r\n\r\n") == 404


async def check_the_serve_config_is_guarded_by_its_etag(sock: str) -> None:
    api = LocalAPI(sock)
    _cfg, etag = await api.get_serve_config()
    assert etag, "the serve config's answer carries an ETag"
    want = {"TCP": {"8443": {"TCPForward": "127.0.0.1:9000"}}}
    await api.set_serve_config(want, etag)
    got, etag2 = await api.get_serve_config()
    assert got == want and etag2 != etag
    try:
        await api.set_serve_config({}, etag)          # the old ETag: someone else wrote meanwhile
    except LocalAPIError as e:
        assert e.status == 412, str(e)
    else:
        raise AssertionError("a stale ETag was accepted")
    await api.set_serve_config({}, etag2)
    got, _ = await api.get_serve_config()
    assert not got


async def check_prefs_are_edited_by_mask(sock: str) -> None:
    api = LocalAPI(sock)
    out = await api.edit_prefs({"AdvertiseServices": ["svc:web"], "AdvertiseServicesSet": True})
    assert out.get("AdvertiseServices") == ["svc:web"], out
    assert (await api.prefs()).get("AdvertiseServices") == ["svc:web"]
    out = await api.edit_prefs({"AdvertiseServices": None, "AdvertiseServicesSet": True})
    assert not out.get("AdvertiseServices")


async def check_usermetrics_are_prometheus_text(sock: str) -> None:
    text = await LocalAPI(sock).usermetrics()
    assert "# TYPE " in text, text[:200]


async def check_the_dns_config_names_cert_domains_and_records(sock: str) -> None:
    """What the agent refreshes after a new netmap (a tailnet FQDN target resolves through the records)."""
    doc = await LocalAPI(sock).dns_config()
    assert isinstance(doc, dict)


Check = Callable[[str], Coroutine[Any, Any, None]]
CHECKS: dict[str, Check] = {n.removeprefix("check_"): f for n, f in sorted(globals().items())
                            if n.startswith("check_")}


def wait_ready(sock: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until the LocalAPI answers (the socket file exists before tailscaled serves on it)."""
    end = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the daemon exited with status {proc.returncode}"
        if os.path.exists(sock):
            try:
                if raw_status(sock, "GET /localapi/v0/status HTTP/1.1\r\nHost: local-tailscaled.sock\r\n"
                                    "Connection: close\r\n\r\n") == 200:
                    return
            except OSError:
                pass
        assert time.monotonic() < end, "the LocalAPI did not answer"
        time.sleep(0.05)


def start_fake(workdir: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(workdir, "tailscaled.sock")
    env = {**os.environ, "FAKE_TS_DIR": os.path.join(workdir, "fake")}
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests/support/fake_tailscaled.py"),
                             f"--socket={sock}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(sock, proc)
    return proc, sock


def start_real(tailscaled: str, workdir: str, netns: str) -> tuple[subprocess.Popen, str]:
    """A real tailscaled with userspace networking in the network namespace `netns` (loopback only: no control
    server or log server is reachable, and it stays logged out)."""
    sock = os.path.join(workdir, "tailscaled.sock")
    env = {**os.environ, "TS_LOGS_DIR": os.path.join(workdir, "logs")}
    log = open(os.path.join(workdir, "tailscaled.log"), "wb")
    proc = subprocess.Popen(["ip", "netns", "exec", netns, tailscaled, "--tun=userspace-networking",
                             f"--socket={sock}", f"--statedir={os.path.join(workdir, 'state')}",
                             "--no-logs-no-support", "--port=0"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_ready(sock, proc)
    return proc, sock


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_all(sock: str) -> dict[str, str]:
    """Every check against one daemon: "" when it held, else the failure."""
    import traceback
    out = {}
    for name, fn in CHECKS.items():
        try:
            asyncio.run(fn(sock))
            out[name] = ""
        except Exception:     # a failed check is a result; the others still run
            out[name] = traceback.format_exc(limit=3)
    return out


if __name__ == "__main__":
    print(json.dumps(run_all(sys.argv[1])))
