"""The reachability of the control server and the Kubernetes API server: the pure state and its log lines, the
check schedule, the checks themselves against loopback servers, and what /status and readiness make of them."""
from __future__ import annotations

import asyncio
import logging
import random

import pytest

from containerboot.probes import Probe, control_check, http_status
from containerboot.reachability import DOWN_EVERY, UP_EVERY, Reachability, next_check_in, public_url
from containerboot.status import AgentStatus
from tests.support.waits import until_async


def test_first_check_up_is_silent_then_one_line_per_change() -> None:
    r0 = Reachability("control server")
    r1 = r0.observe("", 100.0, "http://hs:8080")
    assert (r1.reachable, r1.since, r1.checked_at, r1.target) == (True, 100.0, 100.0, "http://hs:8080")
    assert r0.change_message(r1) is None
    r2 = r1.observe("GET /key: ConnectionRefusedError: refused", 110.0)
    assert (r2.reachable, r2.since, r2.failures) == (False, 110.0, 1)
    assert r1.change_message(r2) == \
        "control server (http://hs:8080) unreachable: GET /key: ConnectionRefusedError: refused"
    r3 = r2.observe("GET /key: no answer within 5s", 115.0)
    assert (r3.since, r3.failures, r3.last_error) == (110.0, 2, "GET /key: no answer within 5s")
    assert r2.change_message(r3) is None                 # still down: no new line
    r4 = r3.observe("", 140.0)
    assert (r4.reachable, r4.since, r4.failures) == (True, 140.0, 0)
    assert r3.change_message(r4) == "control server (http://hs:8080) reachable again after 30s"
    assert (r4.last_error, r4.last_error_at) == ("GET /key: no answer within 5s", 115.0)   # kept for the record


def test_first_check_down_is_said() -> None:
    r = Reachability("Kubernetes API server").observe("GET /readyz: HTTP 500: etcd failed", 5.0, "https://k:6443")
    assert Reachability("Kubernetes API server").change_message(r) == \
        "Kubernetes API server (https://k:6443) unreachable: GET /readyz: HTTP 500: etcd failed"


def test_note_error_leaves_reachability() -> None:
    r = Reachability("k").observe("", 1.0).note_error("not allowed to patch", 2.0)
    assert (r.reachable, r.since, r.last_error, r.last_error_at) == (True, 1.0, "not allowed to patch", 2.0)


def test_checks_are_frequent_while_down_and_jittered() -> None:
    rng = random.Random(1)
    unknown, up = Reachability("x"), Reachability("x").observe("", 0.0)
    down = up.observe("boom", 1.0)
    for r, base in ((unknown, DOWN_EVERY), (down, DOWN_EVERY), (up, UP_EVERY)):
        waits = [next_check_in(r, rng=rng) for _ in range(50)]
        assert all(0.9 * base <= w <= 1.1 * base for w in waits) and len(set(waits)) > 1
    assert DOWN_EVERY < UP_EVERY


@pytest.mark.parametrize("url,want", [
    ("https://user:secret@controlplane.example.com/path?token=abc#x", "https://controlplane.example.com/path"),
    ("http://10.99.0.1:8080", "http://10.99.0.1:8080"),
    ("https://[fd7a::1]:443/", "https://[fd7a::1]:443/"),
    ("", ""), ("not a url", ""), ("http://host:99999", ""),
])
def test_public_url_never_carries_credentials(url: str, want: str) -> None:
    assert public_url(url) == want


def test_probe_logs_each_change_once_and_calls_back(caplog) -> None:
    clock = iter(range(100, 200))
    changes: list[bool | None] = []
    p = Probe("control server", lambda: None, on_change=lambda r: changes.append(r.reachable),  # type: ignore
              clock=lambda: float(next(clock)))
    caplog.set_level(logging.INFO, logger="containerboot")
    for err in ("", "", "refused", "refused", "refused", "", ""):
        p.record(err, "http://hs")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["control server (http://hs) unreachable: refused",
                     "control server (http://hs) reachable again after 3s"]
    assert changes == [True, False, True]


def test_probe_redacts_what_it_records() -> None:
    p = Probe("x", lambda: None)  # type: ignore[arg-type,return-value]
    p.record("GET /key: refused --authkey=tskey-auth-abc123", "http://hs")
    assert "tskey-auth-abc123" not in p.state.last_error and "[REDACTED]" in p.state.last_error


async def _serve(status_line: bytes):
    got: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(status_line + b"\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], got


async def test_control_check_asks_key_at_the_control_url() -> None:
    srv, port, got = await _serve(b"HTTP/1.1 200 OK")
    async with srv:
        async def prefs() -> dict:
            return {"ControlURL": f"http://u:pw@127.0.0.1:{port}"}
        assert await control_check(prefs, 142)() == (f"http://127.0.0.1:{port}", "")
    assert got[0].startswith(b"GET /key?v=142 HTTP/1.1\r\n") and f"Host: 127.0.0.1:{port}".encode() in got[0]
    assert b"pw" not in got[0]


async def test_control_check_failures_name_what_failed() -> None:
    srv, port, _ = await _serve(b"HTTP/1.1 502 Bad Gateway")
    async with srv:
        async def prefs() -> dict:
            return {"ControlURL": f"http://127.0.0.1:{port}"}
        assert await control_check(prefs, 1)() == (f"http://127.0.0.1:{port}", "GET /key: HTTP 502")
    # the server is gone: refused
    target, err = await control_check(prefs, 1)()  # type: ignore[misc]
    assert target == f"http://127.0.0.1:{port}" and err.startswith("GET /key: ConnectionRefusedError")

    async def slow(url: str) -> int:
        raise TimeoutError()
    assert (await control_check(prefs, 1, slow)())[1] == "GET /key: no answer within 5s"  # type: ignore[index]


async def test_control_check_skips_without_a_control_url_or_tailscaled() -> None:
    async def empty() -> dict:
        return {}

    async def broken() -> dict:
        raise OSError("no socket")
    assert await control_check(empty, 1)() is None
    assert await control_check(broken, 1)() is None


async def test_http_status_refuses_a_non_http_answer() -> None:
    srv, port, _ = await _serve(b"SSH-2.0-OpenSSH")
    async with srv:
        with pytest.raises(ValueError, match="not HTTP"):
            await http_status(f"http://127.0.0.1:{port}/key")
    with pytest.raises(ValueError, match="not an http"):
        await http_status("ftp://x/")


async def test_probe_run_checks_until_cancelled() -> None:
    answers = iter([("t", ""), ("t", "down"), None, ("t", "")])
    seen: list[bool | None] = []

    async def check():
        try:
            return next(answers)
        except StopIteration:
            await asyncio.Event().wait()     # the fourth check never answers

    p = Probe("x", check, on_change=lambda r: seen.append(r.reachable), first_after=0)
    import containerboot.probes as probes
    orig = probes.next_check_in
    probes.next_check_in = lambda r: 0.0  # type: ignore[assignment,misc]
    try:
        task = asyncio.create_task(p.run())
        await until_async(lambda: len(seen) >= 3, what="three answers")
        task.cancel()
    finally:
        probes.next_check_in = orig
    assert seen == [True, False, True] and p.state.reachable is True


def _running(**kw) -> AgentStatus:
    return AgentStatus(backend_state="Running", tailnet_ips=("100.64.0.1",), last_reconcile_at=1.0,
                       loop_heartbeat_at=1.0, started_at=0.0, **kw)


def test_status_reports_both_parts_and_readiness_ignores_them() -> None:
    down = Reachability("control server").observe("", 1.0, "http://hs").observe("refused", 2.0)
    kube = Reachability("Kubernetes API server").observe("GET /readyz: no answer within 5s", 2.0, "https://k")
    st = _running(control_plane=down, kubernetes_api=kube, secret_pending_writes=("device_fqdn",))
    assert st.ready(3.0) == (True, [])
    j = st.to_json(3.0)
    assert j["ready"] is True
    assert j["control_plane"] == {"target": "http://hs", "reachable": False, "since": 2.0, "checked_at": 2.0,
                                  "consecutive_failures": 1, "last_error": "refused", "last_error_at": 2.0}
    assert j["kubernetes_api"]["reachable"] is False and j["kubernetes_api"]["pending_writes"] == ["device_fqdn"]
    plain = _running().to_json(3.0)
    assert plain["control_plane"] is None and plain["kubernetes_api"] is None


class _Client:
    """A KubeClient stand-in: counts the writes it was sent; no connection while `down`."""

    def __init__(self) -> None:
        self.down = True
        self.writes = 0
        self.url = "https://k:6443"

    async def patch_secret(self, name, data, *, deadline):
        from containerboot.kube.client import KubeError
        self.writes += 1
        if self.down:
            raise KubeError("patch secrets \"s\": giving up: cannot reach", status=0, reason="Unreachable")

    async def readyz(self) -> tuple[str, bool]:
        return ("GET /readyz: cannot reach https://k:6443", False) if self.down else ("", True)


async def test_secret_writes_wait_while_the_server_does_not_answer_and_land_after() -> None:
    from containerboot.kube.state import SecretState
    client = _Client()
    st = SecretState(client, "s")  # type: ignore[arg-type]
    outcomes: list[object] = []
    st.on_result = outcomes.append
    assert not await st.sync({"device_fqdn": b"a.b"})
    assert (st.pending, st.api_down, client.writes) == (("device_fqdn",), True, 1)
    # known unreachable: no attempt (no retries held against the pass, no log line), the keys stay pending
    assert not await st.sync({"device_fqdn": b"a.b", "device_id": b"n1"})
    assert (st.pending, client.writes) == (("device_fqdn", "device_id"), 1)
    st.api_down = False           # the check found the server back
    client.down = False
    assert await st.sync({"device_fqdn": b"a.b", "device_id": b"n1"})
    assert (st.pending, st.api_down, st.written["device_id"]) == ((), False, b"n1")
    assert [o is None for o in outcomes] == [False, True]


async def test_the_api_servers_return_pokes_the_pending_writes() -> None:
    from containerboot.kube.client import KubeError
    from containerboot.kube.state import SecretState
    from containerboot.publish import SecretPublisher
    from containerboot.settings import load
    from containerboot.steady import SteadyState

    class Rec:
        pokes = 0

        def poke(self, force: bool = False) -> None:
            Rec.pokes += 1
    client = _Client()
    secret = SecretState(client, "s")  # type: ignore[arg-type]
    steady = SteadyState(load({}), Rec(), object(), publisher=SecretPublisher(secret))  # type: ignore[arg-type]
    kube = steady.kube_probe
    assert kube is not None and kube.state.reachable is None and steady.control_probe.state.name == "control server"
    assert not await secret.sync({"device_fqdn": b"a"})              # a write that cannot reach the server
    assert (kube.state.reachable, kube.state.target, secret.api_down) == (False, "https://k:6443", True)
    secret.on_result(KubeError("not allowed to patch", status=403, reason="Forbidden"))   # type: ignore[misc]
    assert kube.state.reachable is False and kube.state.last_error == "not allowed to patch"
    target, err = await kube.check()                                 # still down
    kube.record(err, target)
    assert secret.api_down and Rec.pokes == 0
    client.down = False
    target, err = await kube.check()                                 # the check finds it back
    kube.record(err, target)
    assert Rec.pokes == 1 and not secret.api_down
    assert await secret.sync({"device_fqdn": b"a"}) and kube.state.reachable is True
    assert Rec.pokes == 1                                            # nothing pending any more: no poke


def test_no_kube_check_without_a_state_secret() -> None:
    from containerboot.settings import load
    from containerboot.steady import SteadyState
    assert SteadyState(load({}), object(), object()).kube_probe is None  # type: ignore[arg-type]
