"""The egress pre-shutdown hook (kubelet preStop): waits until health checks stop reaching this Pod."""
from __future__ import annotations

import json

import httpx
import pytest

from containerboot.egressdrain import PreShutdown

POD = "10.1.2.3"


def write(d, services=None, pings=None):
    if services is not None:
        (d / "egress-services").write_text(json.dumps(services))
    if pings is not None:
        (d / "hep-pings").write_text(str(pings))


def service(hep="http://hc.tailscale.svc:9002/healthz"):
    return {"tailnetTarget": {"ip": "100.64.0.9", "fqdn": ""},
            "ports": [{"protocol": "TCP", "matchPort": 10001, "targetPort": 80}], "healthCheckEndpoint": hep}


class Clock:
    def __init__(self):
        self.slept: list[float] = []

    async def sleep(self, s: float) -> None:
        self.slept.append(s)


def hook(d, handler, clock, **kw):
    return PreShutdown(str(d), POD, "", transport=httpx.MockTransport(handler), sleep=clock.sleep, **kw)


async def test_no_config_is_safe_to_terminate_at_once(tmp_path):
    clock = Clock()
    assert await hook(tmp_path, lambda r: httpx.Response(500), clock).run() == (200, "safe to terminate")
    assert clock.slept == []


async def test_waits_while_the_health_check_still_lands_on_this_pod(tmp_path):
    write(tmp_path, {"default-a": service()}, pings=3)
    answers = iter([POD, "10.9.9.9", "10.9.9.8", POD, POD, POD] + ["10.9.9.9"] * 3)
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.headers.get("connection"))
        return httpx.Response(200, headers={"Pod-IPv4": next(answers)}, text="ok")

    clock = Clock()
    assert await hook(tmp_path, handler, clock, settle=10.0).run() == (200, "")
    # round 1: our IP on the first ping -> routed; round 2: 10.9.9.9, 10.9.9.8, ours -> routed;
    # round 3: ours at once -> routed; round 4: ours -> routed; round 5: three foreign answers -> drained
    assert len(seen) == 1 + 3 + 1 + 1 + 3
    assert all(c == "close" for c in seen)
    assert clock.slept == [1.0, 1.0, 1.0, 1.0, 10.0]


async def test_an_unreachable_endpoint_counts_as_drained(tmp_path):
    write(tmp_path, {"default-a": service()}, pings=2)

    def handler(req):
        raise httpx.ConnectError("connection refused", request=req)

    clock = Clock()
    assert await hook(tmp_path, handler, clock, settle=10.0).run() == (200, "")
    assert clock.slept == [10.0]


async def test_zero_pings_or_no_endpoint_only_settles(tmp_path):
    calls = []
    clock = Clock()
    write(tmp_path, {"default-a": service(), "default-b": service(hep="")}, pings=0)
    assert await hook(tmp_path, lambda r: calls.append(r) or httpx.Response(200), clock).run() == (200, "")
    assert calls == [] and clock.slept == [10.0]


async def test_the_wait_is_bounded(tmp_path):
    write(tmp_path, {"default-a": service()}, pings=1)
    clock = Clock()
    h = hook(tmp_path, lambda r: httpx.Response(200, headers={"Pod-IPv4": POD}), clock, max_wait=0.0)
    assert await h.run() == (200, "")


@pytest.mark.parametrize("files", [{"services": "{broken"}, {"pings": "many"}])
async def test_unreadable_config_is_a_500(tmp_path, files):
    (tmp_path / "egress-services").write_text(files.get("services", json.dumps({"default-a": service()})))
    (tmp_path / "hep-pings").write_text(files.get("pings", "1"))
    status, body = await hook(tmp_path, lambda r: httpx.Response(200), Clock()).run()
    assert status == 500 and "egress services config" in body


async def test_ipv6_only_pod_uses_the_ipv6_header(tmp_path):
    write(tmp_path, {"default-a": service()}, pings=1)
    answers = iter(["fd00::3", "fd00::9"])
    clock = Clock()
    h = PreShutdown(str(tmp_path), "", "FD00::3",
                    transport=httpx.MockTransport(lambda r: httpx.Response(200, headers={"Pod-IPv6": next(answers)})),
                    sleep=clock.sleep)
    assert await h.run() == (200, "")
    assert clock.slept == [1.0, 10.0]
