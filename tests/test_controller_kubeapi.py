"""controller.kubeapi over HTTPS against the project's test API server (the wire layer of the controller)."""
from __future__ import annotations

import base64
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from controller.kubeapi import CONNECTORS, SECRETS, STATEFULSETS, Kube, KubeError, path
from tests.support.kubeapi import KubeAPIServer


def test_paths():
    assert path(SECRETS, "ns", "s") == "/api/v1/namespaces/ns/secrets/s"
    assert path(STATEFULSETS, "ns") == "/apis/apps/v1/namespaces/ns/statefulsets"
    assert path(CONNECTORS, "", "c", "status") == "/apis/tailscale.com/v1alpha1/connectors/c/status"


async def test_secret_roundtrip_selector_patch_delete():
    with KubeAPIServer(namespace="tailscale") as api:
        kube = Kube(api.url, token=api.token, verify=api.ssl_context())
        b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
        await kube.create(SECRETS, {"metadata": {"name": "ts-a-0", "labels": {"tailscale.com/managed": "true",
                                                                              "tailscale.com/parent-resource-ns": ""}},
                                    "data": {"cap-107.hujson": b64("{}")}}, "tailscale")
        await kube.create(SECRETS, {"metadata": {"name": "other"}, "data": {"x": b64("y")}}, "tailscale")
        got = await kube.list(SECRETS, "tailscale", "tailscale.com/managed=true")
        assert [s["metadata"]["name"] for s in got] == ["ts-a-0"]
        await kube.patch(SECRETS, "ts-a-0", {"data": {"serve-config": b64("{\"TCP\":{}}")}}, "tailscale")
        assert api.secret_data("ts-a-0") == {"cap-107.hujson": b"{}", "serve-config": b'{"TCP":{}}'}
        rec = [r for r in api.requests if r.method == "PATCH"][-1]
        assert rec.content_type == "application/merge-patch+json"
        assert await kube.get(SECRETS, "missing", "tailscale") is None
        assert await kube.delete(SECRETS, "ts-a-0", "tailscale") is True
        assert await kube.delete(SECRETS, "ts-a-0", "tailscale") is False
        with pytest.raises(KubeError) as e:
            await kube.create(SECRETS, {"metadata": {"name": "other"}}, "tailscale")
        assert e.value.status == 409 and e.value.reason == "AlreadyExists"
        await kube.aclose()
        bad = Kube(api.url, token="wrong-TOKENVALUE", verify=api.ssl_context())
        with pytest.raises(KubeError) as e:
            await bad.get(SECRETS, "other", "tailscale")
        assert e.value.status == 401 and "TOKENVALUE" not in str(e.value)
        await bad.aclose()
