"""tscommon.kubeconn and tscommon.kubehttp: the in-cluster connection and the HTTP exchange the agent's and the
controller's Kubernetes clients share."""
from __future__ import annotations

import asyncio
import email.utils
import json
import os

import httpx
import pytest

from containerboot.kube.client import KubeClient
from containerboot.kube.client import KubeError as AgentKubeError
from controller.kubeapi import SECRETS, Kube, KubeError
from tscommon.kubeconn import TokenFile, https_url, service_host_port
from tscommon.kubehttp import retry_after_seconds
from tscommon.redact import redact


def test_api_server_url_from_the_service_environment():
    env = {"KUBERNETES_SERVICE_HOST": "fd00:96::1", "KUBERNETES_SERVICE_PORT": "6443"}
    assert https_url(*service_host_port(env)) == "https://[fd00:96::1]:6443"
    env["KUBERNETES_SERVICE_PORT_HTTPS"] = "443"
    assert https_url(*service_host_port(env)) == "https://[fd00:96::1]:443"
    assert https_url("10.96.0.1") == "https://10.96.0.1"
    ctl_env = {"KUBERNETES_SERVICE_HOST": "fd00:96::1", "KUBERNETES_SERVICE_PORT": "6443",
               "CONTROLLER_KUBE_TOKEN_FILE": "/t", "CONTROLLER_KUBE_CA_FILE": ""}
    assert Kube.in_cluster(ctl_env).url == "https://[fd00:96::1]:6443"


def test_a_rotated_token_is_read_again_and_never_shown(tmp_path):
    p = tmp_path / "token"
    p.write_text("first-token-value\n")
    tf = TokenFile(str(p))
    assert tf.get() == "first-token-value"
    p.write_text("second-token-value-longer\n")      # kubelet swaps the projected file
    os.utime(p, ns=(1, 1))
    assert tf.get() == "second-token-value-longer"
    assert redact("Bearer second-token-value-longer") == "Bearer [REDACTED]"
    kube = Kube("https://127.0.0.1:1", token_file=str(p))
    assert kube.token() == "second-token-value-longer"


@pytest.mark.parametrize("body, reason, shown", [
    (json.dumps({"kind": "Status", "reason": "Invalid", "message": "data[x]: not base64"}), "Invalid",
     "data[x]: not base64"),
    ("<html><body>bad gateway page</body></html>", "", "<html><body>bad gateway page"),
])
def test_both_clients_read_a_failed_answer_alike(tmp_path, body, reason, shown):
    """A refused call shows the API server's reason and message, or the start of a page that is no Status
    object; both clients send the token and a JSON body the same way."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(422, content=body.encode())

    token = tmp_path / "token"
    token.write_text("shared-wire-token-value\n")
    agent = KubeClient(url="https://api", namespace="ns", token_path=str(token), ca_path="",
                       transport=httpx.MockTransport(answer))
    ctl = Kube("https://api", token_file=str(token), transport=httpx.MockTransport(answer))

    async def both() -> tuple[AgentKubeError, KubeError]:
        with pytest.raises(AgentKubeError) as a:
            await agent.patch_secret("s", {"k": b"v"})
        with pytest.raises(KubeError) as c:
            await ctl.patch(SECRETS, "s", {"data": {"k": "dg=="}}, namespace="ns")
        await agent.aclose()
        await ctl.aclose()
        return a.value, c.value

    a, c = asyncio.run(both())
    assert (a.status, a.reason, c.status, c.reason) == (422, reason, 422, reason)
    assert shown in str(a) and shown in str(c)
    for req in seen:
        assert req.headers["Authorization"] == "Bearer shared-wire-token-value"
        assert req.headers["Accept"] == "application/json"
        assert json.loads(req.content)["data"]
    assert [r.headers["Content-Type"] for r in seen] == ["application/strategic-merge-patch+json",
                                                         "application/merge-patch+json"]


def test_retry_after_in_seconds_or_as_a_date():
    assert retry_after_seconds("7") == 7.0
    assert retry_after_seconds("-3") == 0.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    when = email.utils.formatdate(1_000_030, usegmt=True)
    assert retry_after_seconds(when, now=lambda: 1_000_000.0) == 30.0
    assert retry_after_seconds(when, now=lambda: 1_000_100.0) == 0.0


def test_the_controllers_requests_name_it_and_keep_the_servers_path_and_the_selector():
    """The controller's client hands its requests to the transport itself (no httpx client): the API server still
    sees its User-Agent (the audit log tells its requests from kopf's by it), the label selector as a query,
    and a server URL's own path kept in front of the API path."""
    from controller.kubeapi import USER_AGENT
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"items": [{"metadata": {"name": "a"}}]})

    ctl = Kube("https://api:6443/prefix/", token="t", transport=httpx.MockTransport(answer))

    async def go() -> list[dict]:
        try:
            return await ctl.list(SECRETS, "ns", "tailscale.com/managed=true,app in (a,b)")
        finally:
            await ctl.aclose()

    assert asyncio.run(go()) == [{"metadata": {"name": "a"}}]
    (req,) = seen
    assert (req.method, req.url.host, req.url.port, req.url.path) == ("GET", "api", 6443,
                                                                      "/prefix/api/v1/namespaces/ns/secrets")
    assert req.url.params["labelSelector"] == "tailscale.com/managed=true,app in (a,b)"
    assert req.headers["User-Agent"] == USER_AGENT
    assert "Content-Type" not in req.headers and not req.content
