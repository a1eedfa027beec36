"""controller.crdcheck: the controller starts only with the project's CRDs installed (asked by API discovery, never
a list), waits a bounded time for one that is not served yet, names what is missing and how to install it, and
stops when a CRD it serves is removed while it runs."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import httpx
import kopf
import pytest
from kopf._cogs.clients import errors, fetching, watching

from controller import crdcheck
from controller.__main__ import served_crds
from controller.kubeapi import PROXYCLASSES, RECORDERS, Kube, KubeError
from tests.support.crdschema import project_crds
from tests.support.fakekube import FakeKube


class Clock:
    """The wait's time: each sleep advances it (no real waiting), and can change the cluster meanwhile."""

    def __init__(self, on_sleep=None) -> None:
        self.now = 0.0
        self.sleeps = 0
        self.on_sleep = on_sleep

    def __call__(self) -> float:
        return self.now

    async def sleep(self, s: float) -> None:
        self.now += s
        self.sleeps += 1
        if self.on_sleep:
            self.on_sleep(self.sleeps)


def test_the_served_crds_are_the_projects_crds():
    # every CRD the project ships (deploy/crds/) is checked, and nothing else (a built-in kind is always served)
    assert sorted(crdcheck.crd_name(r) for r in served_crds()) == sorted(
        f"{c.plural}.{c.group}" for c in project_crds())


async def test_every_crd_installed_starts_at_once_from_one_discovery_request():
    api, clock = FakeKube(), Clock()
    await crdcheck.wait_installed(served_crds(), api.served, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == 0
    # one GET of the group version: no list of the CRDs
    assert api.calls == [("GET", "", "", "")]


async def test_a_missing_crd_stops_the_start_naming_it_and_the_fix():
    api, clock = FakeKube(), Clock()
    del api.crds[(PROXYCLASSES.prefix, "proxyclasses")]
    with pytest.raises(crdcheck.CRDsMissing) as e:
        await crdcheck.wait_installed(served_crds(), api.served, clock=clock, sleep=clock.sleep)
    msg = str(e.value)
    assert msg.startswith("the CRD proxyclasses.tailscale.com is not installed (not served by the API server "
                          "after 120s)")
    assert "installCRDs=true" in msg and "kubectl apply --server-side -f deploy/crds/" in msg
    # it asked again meanwhile, and gave up at the bound
    assert clock.sleeps == crdcheck.CRD_WAIT / crdcheck.CRD_POLL
    assert clock.now == crdcheck.CRD_WAIT


async def test_no_crd_of_the_group_names_every_one():
    api, clock = FakeKube(), Clock()
    api.crds = {k: c for k, c in api.crds.items() if c.group != crdcheck.GROUP}
    with pytest.raises(crdcheck.CRDsMissing) as e:
        await crdcheck.wait_installed(served_crds(), api.served, clock=clock, sleep=clock.sleep)
    assert "the CRDs connectors.tailscale.com, dnsconfigs.tailscale.com, proxyclasses.tailscale.com, " \
           "proxygroups.tailscale.com, recorders.tailscale.com are not installed" in str(e.value)


async def test_a_crd_served_within_the_wait_starts_the_controller():
    api = FakeKube()
    crd = api.crds.pop((RECORDERS.prefix, "recorders"))

    def install(sleeps: int) -> None:
        if sleeps == 3:          # served after 15 s, well within the wait
            api.crds[(RECORDERS.prefix, "recorders")] = crd
    clock = Clock(install)
    await crdcheck.wait_installed(served_crds(), api.served, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == 3


async def test_an_api_server_not_answering_is_asked_again_and_is_not_a_missing_crd():
    api = FakeKube()
    api.fail_next = [KubeError("GET /apis/tailscale.com/v1alpha1: API server unreachable", status=0)] * 40
    clock = Clock()
    # 200 s of failures (longer than the wait), then the answer: every CRD is there
    await crdcheck.wait_installed(served_crds(), api.served, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == 40


async def test_discovery_reads_the_plurals_of_the_group_version():
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/apis/tailscale.com/v1alpha1":
            return httpx.Response(200, json={"kind": "APIResourceList", "groupVersion": "tailscale.com/v1alpha1",
                                             "resources": [{"name": "proxyclasses", "kind": "ProxyClass"},
                                                           {"name": "proxyclasses/status", "kind": "ProxyClass"}]})
        return httpx.Response(404, json={"kind": "Status", "code": 404, "reason": "NotFound"})
    kube = Kube("http://api", token="t", transport=httpx.MockTransport(answer))
    assert await kube.served("/apis/tailscale.com/v1alpha1") == frozenset({"proxyclasses"})
    assert await kube.served("/apis/example.com/v1") is None
    await kube.aclose()


async def test_a_crd_removed_while_running_stops_the_controller(monkeypatch):
    monkeypatch.setattr(watching, "continuous_watch", watching.continuous_watch)
    monkeypatch.setattr(crdcheck, "_kinds", set())

    async def fetch_objs(**_):
        raise errors.APINotFoundError({"message": "the server could not find the requested resource"},
                                      status=404, headers={})
        yield [], ""            # an async generator, as kopf's

    monkeypatch.setattr(fetching, "fetch_objs", fetch_objs)
    stopped: list[str] = []

    class Stopped(Exception):
        pass

    def stop(message: str) -> None:        # the controller's stop: here it ends the stream at once
        stopped.append(message)
        raise Stopped
    crdcheck.stop_on_removal(served_crds(), stop)
    with pytest.raises(Stopped):
        async for _ in watching.infinite_watch(settings=kopf.OperatorSettings(), namespace=None,
                                               resource=kopf.Resource("tailscale.com", "v1alpha1", "proxyclasses")):
            pass
    assert stopped == ["the CRD proxyclasses.tailscale.com was removed while the controller ran (its watch is "
                       "answered 404); stopping: " + crdcheck.FIX]


async def test_a_404_of_another_kind_is_kopfs_as_before(monkeypatch):
    monkeypatch.setattr(watching, "continuous_watch", watching.continuous_watch)
    monkeypatch.setattr(crdcheck, "_kinds", set())

    async def fetch_objs(**_):
        raise errors.APINotFoundError("gone", status=404, headers={})
        yield [], ""

    monkeypatch.setattr(fetching, "fetch_objs", fetch_objs)
    stopped: list[str] = []
    crdcheck.stop_on_removal(served_crds(), stopped.append)
    with pytest.raises(errors.APINotFoundError):
        async for _ in watching.infinite_watch(settings=kopf.OperatorSettings(), namespace="tailscale",
                                               resource=kopf.Resource("apps", "v1", "statefulsets")):
            pass
    assert stopped == []


async def test_a_429_is_asked_again_after_its_retry_after():
    api, clock = FakeKube(), Clock()
    api.fail_next = [KubeError("GET /apis/tailscale.com/v1alpha1: 429 too many requests", status=429,
                               retry_after=30)]
    await crdcheck.wait_installed(served_crds(), api.served, clock=clock, sleep=clock.sleep)
    assert clock.now == 30
