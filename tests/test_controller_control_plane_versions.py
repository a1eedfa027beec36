"""What a user of an older headscale sees on the objects: the headscale provider (its version known) in whole
reconcile passes against the in-memory API server. A Service on headscale 0.27 without `headscale.user` gets a
false condition and one Warning event naming the version, the minor that has tag-only keys and the setting;
nothing is created. The API server proxy in auth mode on 0.28 gets a Warning event (grants need 0.29) and is
still created."""
from __future__ import annotations

import json

import httpx
import pytest

from controller.config import ControllerConfig
from controller.kubeapi import CONFIGMAPS, EVENTS, SECRETS, SERVICES, STATEFULSETS
from controller.model import APISERVER
from controller.providers import REASON_UNSUPPORTED, ProviderError
from controller.providers.headscale import HeadscaleProvider
from controller.providers.hscompat import Capabilities
from controller.reconcile import Reconciler
from tests.support.fakekube import FakeKube

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1", provider="headscale",
                       login_server="http://hs.test:8080", headscale_url="http://hs.test:8080")


def headscale(version: str, level: tuple[int, int], user: str = "") -> tuple[HeadscaleProvider, list]:
    sent: list = []

    def answer(req: httpx.Request) -> httpx.Response:
        sent.append((req.method, req.url.path, json.loads(req.content) if req.content else None))
        return httpx.Response(200, json={"preAuthKey": {"key": "hskey-auth-minted-SECRET", "reusable": False}})
    return HeadscaleProvider("http://hs.test:8080", api_key="hskey-api-K", user=user,
                             transport=httpx.MockTransport(answer), capabilities=Capabilities(version, level)), sent


def service(kube):
    return kube.put(SERVICES, {"metadata": {"name": "web", "namespace": "apps",
                                            "annotations": {"tailscale.com/expose": "true"}},
                               "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                                        "ipFamilies": ["IPv4"]}})


async def test_service_on_headscale_0_27_without_a_user_says_what_to_set():
    kube = FakeKube([])
    prov, sent = headscale("v0.27.1", (0, 27))
    rec = Reconciler(kube, prov, CFG, now=lambda: "2026-01-01T00:00:00Z")
    service(kube)
    for _ in range(2):
        with pytest.raises(ProviderError):
            await rec.reconcile("svc", "apps", "web")
    assert sent == [] and not kube.of(SECRETS) and not kube.of(STATEFULSETS)
    c = next(c for c in kube.obj(SERVICES, "web", "apps")["status"]["conditions"]
             if c["type"] == "TailscaleProxyReady")
    assert (c["status"], c["reason"]) == ("False", "ProxyFailed")
    assert c["message"].startswith("no auth key: headscale: creating a pre-auth key: headscale v0.27.1 cannot do "
                                   "pre-auth keys without a user (tag-only keys): it needs headscale 0.28 or later")
    assert "set headscale.user (HEADSCALE_USER)" in c["message"]
    (ev,) = kube.of(EVENTS)         # once, however many passes
    assert (ev["type"], ev["reason"]) == ("Warning", REASON_UNSUPPORTED)
    assert "no auth key: " + ev["message"] == c["message"]


async def test_service_on_headscale_0_27_with_a_user_gets_its_proxy():
    kube = FakeKube([])
    prov, sent = headscale("v0.27.1", (0, 27), user="3")
    rec = Reconciler(kube, prov, CFG, now=lambda: "2026-01-01T00:00:00Z")
    service(kube)
    await rec.reconcile("svc", "apps", "web")
    assert [(m, p, b["user"], b["aclTags"]) for m, p, b in sent] == [("POST", "/api/v1/preauthkey", "3", ["tag:k8s"])]
    assert kube.of(STATEFULSETS) and not kube.of(EVENTS)


@pytest.mark.parametrize("level,warned", [((0, 28), True), ((0, 29), False)])
async def test_apiserver_proxy_auth_mode_warns_where_grants_are_missing(level, warned):
    kube = FakeKube([])
    prov, _ = headscale(f"v0.{level[1]}.0", level)
    rec = Reconciler(kube, prov, CFG, now=lambda: "2026-01-01T00:00:00Z")
    kube.put(CONFIGMAPS, {"metadata": {"name": "apiserver-proxy", "namespace": "tailscale",
                                       "labels": {"tailscale.com/apiserver-proxy": "true"}},
                          "data": {"mode": "auth", "hostname": "kube-apiserver", "tags": "tag:k8s"}})
    await rec.reconcile(APISERVER, "tailscale", "apiserver-proxy")
    assert kube.of(STATEFULSETS)        # the proxy runs either way: users are impersonated by name
    events = [e for e in kube.of(EVENTS) if e["reason"] == REASON_UNSUPPORTED]
    if warned:
        (ev,) = events
        assert ev["type"] == "Warning" and "headscale v0.28.0 cannot do grants with app capabilities" in ev["message"]
        assert "needs headscale 0.29 or later" in ev["message"]
    else:
        assert events == []
