"""The LocalAPI client against the fake tailscaled's unix-socket server."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from containerboot.localapi import FIRST_WATCH_MASK, LocalAPI, LocalAPIError

HERE = os.path.dirname(__file__)


def _accepts(sock: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(sock)
        except OSError:
            return False
    return True


@pytest.fixture
def fake(tmp_path, request):
    """The fake tailscaled, logged out unless the test asks for another initial state (indirect parameter)."""
    sock = str(tmp_path / "ts.sock")
    env = dict(os.environ, FAKE_TS_DIR=str(tmp_path), FAKE_TS_INITIAL=getattr(request, "param", "NeedsLogin"))
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "support", "fake_tailscaled.py"),
                             f"--socket={sock}"], env=env)
    try:
        # Ready when the socket accepts connections (it exists a moment before the server listens on it).
        # A bare connect sends no request, so it leaves no line in requests.log.
        end = time.monotonic() + 20
        while not _accepts(sock):
            assert proc.poll() is None, f"the fake tailscaled exited with status {proc.returncode}"
            assert time.monotonic() < end, "the fake tailscaled's socket never accepted connections"
            time.sleep(0.05)   # poll: until the socket accepts (deadline asserted above)
        yield sock, tmp_path
    finally:
        proc.terminate()
        proc.wait(10)


def requests(tmp_path):
    with open(tmp_path / "requests.log") as f:
        return [json.loads(line) for line in f]


async def test_requests_carry_local_host_and_no_referer_or_origin(fake):
    sock, tmp = fake
    api = LocalAPI(sock)
    st = await api.status()
    assert st["BackendState"] == "NeedsLogin"
    assert api.capver == 142
    await api.aclose()
    (req,) = requests(tmp)
    assert req["host"] == "local-tailscaled.sock"
    assert req["referer"] is None and req["origin"] is None
    assert req["cap"] == "142"


async def test_watch_ipn_bus_streams_notifies(fake):
    sock, _ = fake
    api = LocalAPI(sock)
    seen = []
    watching = asyncio.Event()

    async def login_once_watching():
        # Log in only after the watch has delivered its first notification: from then on the fake streams
        # every state change to it, so the login below is observed, however slow the machine.
        await watching.wait()
        r, w = await asyncio.open_unix_connection(sock)
        w.write(b"POST /localapi/v0/fake/login HTTP/1.1\r\nHost: local-tailscaled.sock\r\nContent-Length: 0\r\n\r\n")
        await w.drain()
        assert (await r.readline()).startswith(b"HTTP/1.1 200")
        w.close()
        await w.wait_closed()

    task = asyncio.create_task(login_once_watching())
    try:
        async with asyncio.timeout(20):
            async for n in api.watch_ipn_bus(FIRST_WATCH_MASK):
                seen.append(n)
                watching.set()
                if n.get("State") == 6:     # Running, after the new netmap (SelfChange), as tailscaled sends them
                    break
            await task
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert seen[0]["InitialStatus"]["BackendState"] == "NeedsLogin"
    assert {"State": 6} in seen
    (change,) = [n["SelfChange"] for n in seen if "SelfChange" in n]
    assert change["Addresses"][0] == "100.64.0.5/32"
    await api.aclose()


@pytest.mark.parametrize("fake", ["Running"], indirect=True)    # tailscaled writes a serve config only with a netmap
async def test_serve_config_etag_and_conflict(fake):
    sock, _ = fake
    api = LocalAPI(sock)
    cfg, etag = await api.get_serve_config()
    assert cfg is None and etag
    await api.set_serve_config({"TCP": {"80": {"HTTP": True}}}, etag)
    cfg, etag2 = await api.get_serve_config()
    assert cfg == {"TCP": {"80": {"HTTP": True}}} and etag2 != etag
    with pytest.raises(LocalAPIError) as e:
        await api.set_serve_config({}, etag)  # stale ETag
    assert e.value.status == 412
    await api.aclose()


async def test_errors_name_the_call_and_status(fake):
    sock, _ = fake
    api = LocalAPI(sock)
    with pytest.raises(LocalAPIError) as e:
        await api.set_udp_gro_forwarding()  # the fake does not implement it, like a tailscaled built without
    assert e.value.status == 404 and "set-udp-gro-forwarding" in str(e.value)
    await api.aclose()


async def test_missing_socket_is_a_transport_error(tmp_path):
    api = LocalAPI(str(tmp_path / "nope.sock"))
    with pytest.raises(LocalAPIError) as e:
        await api.status()
    assert e.value.status == 0
    await api.aclose()
