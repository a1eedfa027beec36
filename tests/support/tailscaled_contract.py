"""The LocalAPI contract the agent relies on, as checks that run unchanged on the fake tailscaled
(tests/support/fake_tailscaled.py) and on a real tailscaled.

Each check talks to a running daemon through the agent's own client (`containerboot.localapi.LocalAPI`) or, for
the wire rules a client cannot break on purpose, a raw HTTP request over the socket. Every check runs on a
daemon that is not logged in (the fake in NeedsLogin; a real tailscaled with no control server reachable) and
on one that is (the fake in Running; the lab's `client` node, logged in to headscale): some answers differ
before the first netmap, and the fake has to differ the same way. The fake's runs are
tests/test_tailscaled_contract.py; the real ones are netns-tests/test_tailscaled_contract.py.
"""
from __future__ import annotations

import asyncio
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


async def check_status_names_the_backend_state_and_capability_version(sock: str, logged_in: bool) -> None:
    api = LocalAPI(sock)
    st = await api.status()
    assert st.get("BackendState") in BACKEND_STATES, st.get("BackendState")
    assert (st.get("BackendState") == "Running") is logged_in, st.get("BackendState")
    assert isinstance(api.capver, int) and api.capver > 0, "every answer carries Tailscale-Cap"


async def check_the_bus_starts_with_the_backend_state(sock: str, logged_in: bool) -> None:
    for mask in (WATCH_MASK, FIRST_WATCH_MASK, LOGIN_WATCH_MASK):
        stream = cast(AsyncGenerator[dict, None], LocalAPI(sock).watch_ipn_bus(mask))
        try:
            first = await asyncio.wait_for(anext(stream), 10)
        finally:
            await stream.aclose()
        state = notify_backend_state(first)
        assert state in BACKEND_STATES, first
        assert (state == "Running") is logged_in, state


async def check_browser_and_foreign_host_requests_are_refused(sock: str, logged_in: bool) -> None:
    """The LocalAPI refuses what a web page could send (a Referer or Origin, another Host)."""
    base = "GET /localapi/v0/status HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n"
    assert raw_status(sock, base.format(host="local-tailscaled.sock", extra="")) == 200
    assert raw_status(sock, base.format(host="local-tailscaled.sock", extra="Origin: http://evil.test\r\n")) == 403
    assert raw_status(sock, base.format(host="local-tailscaled.sock",
                                        extra="Referer: http://evil.test/\r\n")) == 403
    assert raw_status(sock, base.format(host="evil.test", extra="")) == 403


async def check_an_unknown_endpoint_is_404(sock: str, logged_in: bool) -> None:
    assert raw_status(sock, "GET /localapi/v0/no-such-endpoint HTTP/1.1\r\nHost: local-tailscaled.sock\r\n"
                            "Connection: close\r\n\r\n") == 404


async def check_the_serve_config_is_guarded_by_its_etag(sock: str, logged_in: bool) -> None:
    """Readable at any time; written only once the node has a netmap, and only over the ETag last read."""
    api = LocalAPI(sock)
    _cfg, etag = await api.get_serve_config()
    assert etag, "the serve config's answer carries an ETag"
    want = {"TCP": {"8443": {"TCPForward": "127.0.0.1:9000"}}}
    if not logged_in:
        try:
            await api.set_serve_config(want, etag)
        except LocalAPIError as e:
            assert e.status == 500 and "netMap is nil" in str(e), str(e)
        else:
            raise AssertionError("the serve config was written before the node had a netmap")
        return
    await api.set_serve_config(want, etag)
    try:
        got, etag2 = await api.get_serve_config()
        assert got == want and etag2 != etag
        try:
            await api.set_serve_config({}, etag)          # the old ETag: someone else wrote meanwhile
        except LocalAPIError as e:
            assert e.status == 412, str(e)
        else:
            raise AssertionError("a stale ETag was accepted")
    finally:
        _cfg, etag3 = await api.get_serve_config()
        await api.set_serve_config({}, etag3)
    got, _ = await api.get_serve_config()
    assert not got


async def check_prefs_are_edited_by_mask(sock: str, logged_in: bool) -> None:
    api = LocalAPI(sock)
    out = await api.edit_prefs({"AdvertiseServices": ["svc:web"], "AdvertiseServicesSet": True})
    try:
        assert out.get("AdvertiseServices") == ["svc:web"], out
        assert (await api.prefs()).get("AdvertiseServices") == ["svc:web"]
    finally:
        out = await api.edit_prefs({"AdvertiseServices": None, "AdvertiseServicesSet": True})
    assert not out.get("AdvertiseServices")


async def check_usermetrics_are_prometheus_text(sock: str, logged_in: bool) -> None:
    text = await LocalAPI(sock).usermetrics()
    assert "# TYPE " in text, text[:200]


async def check_the_dns_config_comes_with_the_netmap(sock: str, logged_in: bool) -> None:
    """What the agent refreshes after a new netmap (a tailnet FQDN target resolves through its records); before
    the first netmap there is none."""
    api = LocalAPI(sock)
    if logged_in:
        assert isinstance(await api.dns_config(), dict)
        return
    try:
        await api.dns_config()
    except LocalAPIError as e:
        assert e.status == 503, str(e)
    else:
        raise AssertionError("a DNS config before the first netmap")


Check = Callable[[str, bool], Coroutine[Any, Any, None]]
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
        time.sleep(0.05)   # poll: until the LocalAPI answers (deadline asserted above)


def start_fake(workdir: str, *, logged_in: bool) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(workdir, "tailscaled.sock")
    env = {**os.environ, "FAKE_TS_DIR": os.path.join(workdir, "fake"),
           "FAKE_TS_INITIAL": "Running" if logged_in else "NeedsLogin"}
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
