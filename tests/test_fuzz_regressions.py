"""The bugs the generated-input tests found, each pinned by the smallest input that showed it.

docs/reliability.md lists them; the property tests in tests/test_fuzz_*.py keep looking for more.
"""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from containerboot import conffile, proxyservices
from containerboot.kube import secretstate
from containerboot.kube.client import KubeClient, KubeError
from controller import config as controller_config
from controller.kubeapi import SERVICES, Kube
from controller.kubeapi import KubeError as ControllerKubeError
from controller.providers import ProviderError
from controller.providers.headscale import HeadscaleProvider
from controller.providers.tailscale import TailscaleProvider
from controller.status import config_authkey
from serveconfig import model as serve
from tscommon import secretcontract as sc

DEEP = "[" * 5000


def test_deeply_nested_json_is_a_parse_error_not_a_crash() -> None:
    # Python's decoder raised RecursionError, which no parser caught: the agent crashed on a 5 kB file.
    with pytest.raises(conffile.ConfigFileError, match="cap-107.hujson: not valid HuJSON/JSON: .*nested too deeply"):
        conffile.parse(DEEP, "cap-107.hujson")
    with pytest.raises(serve.ServeConfigError, match="not valid JSON"):
        serve.parse(DEEP, "")
    with pytest.raises(proxyservices.ConfigError, match="egress-services is not valid JSON"):
        proxyservices.parse_egress_services(DEEP)
    with pytest.raises(proxyservices.ConfigError, match="ingress config is not valid JSON"):
        proxyservices.parse_ingress_config(DEEP)
    assert sc.parse_device_ips(DEEP.encode()) == ()
    assert config_authkey({sc.config_key(max(sc.CONFIG_CAPVERS)): DEEP.encode()}) == ""
    with pytest.raises(controller_config.ConfigError, match="PROXY_ENV is not JSON"):
        controller_config.load({"PROXY_ENV": DEEP})
    # A ProxyGroup's egress-services document and a replica's status: broken means empty, as documented.
    from controller.kinds import egress
    assert egress.parse_entries(DEEP) == {} and egress.parse_status(DEEP.encode()) is None
    assert egress.entry_ports({"ports": 7}) == {}


def test_reissue_clear_deletes_only_a_profile_key() -> None:
    # A _current-profile naming another key made the reissue clean-up delete that key (here the new auth key).
    patch = secretstate.reissue_clear_patch({sc.KEY_CURRENT_PROFILE: b"authkey", sc.KEY_AUTHKEY: b"tskey-new"})
    assert sc.KEY_AUTHKEY not in patch
    patch = secretstate.reissue_clear_patch({sc.KEY_CURRENT_PROFILE: b"profile-1a2b"})
    assert patch["profile-1a2b"] is None


def _agent_client(tmp_path: Path, body: bytes) -> KubeClient:
    (tmp_path / "token").write_text("t")
    return KubeClient(url="https://api", namespace="ns", token_path=str(tmp_path / "token"), ca_path="",
                      transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body)))


@pytest.mark.parametrize("body", [
    b'{"data": [null]}', b'{"metadata": [1]}', b'{"data": {"k": 7}}', b'{"metadata": {"labels": {"a": 1}}}',
    b'{"data": {"k": "not base64!"}}', DEEP.encode()])
async def test_agent_refuses_a_malformed_secret_by_name(tmp_path: Path, body: bytes) -> None:
    # A Secret with the wrong shapes raised AttributeError/TypeError in the agent's client.
    client = _agent_client(tmp_path, body)
    try:
        with pytest.raises(KubeError, match='secrets "state"'):
            await client.get_secret("state")
    finally:
        await client.aclose()


@pytest.mark.parametrize("status,body", [(200, b"0"), (200, b":"), (200, b'{"items": [1]}'), (404, b"0"),
                                         (500, b"[]"), (200, DEEP.encode())])
async def test_controller_client_refuses_an_answer_that_is_not_an_object(status: int, body: bytes) -> None:
    # A list, a number or a cut body from the API server (or a proxy in front of it) raised AttributeError or
    # JSONDecodeError out of the controller's client instead of a KubeError its passes retry.
    kube = Kube("http://api", token="t",
                transport=httpx.MockTransport(lambda request: httpx.Response(status, content=body)))
    try:
        with pytest.raises(ControllerKubeError, match="/services"):
            await kube.list(SERVICES, "ns")
    finally:
        await kube.aclose()


@pytest.mark.parametrize("device_id", ["../../tailnet/-/keys/k1", "1?x=y", "٣", "n1/tags"])
async def test_providers_send_nothing_for_a_device_id_that_is_not_an_id(device_id: str) -> None:
    # device_id comes from a Secret the proxy can write; it went into the control plane API's path as written,
    # so a damaged or hostile value could address another endpoint with the controller's credentials.
    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/api/v2/oauth/token":
            sent.append(request.url.path)
        return httpx.Response(200, json={"access_token": "tok", "tags": [], "node": {"tags": []}})

    for provider in (HeadscaleProvider("http://hs", api_key="k", transport=httpx.MockTransport(answer)),
                     TailscaleProvider("http://ts", client_id="i", client_secret="s",
                                       transport=httpx.MockTransport(answer))):
        assert await provider.delete_device(device_id) is False
        with pytest.raises(ProviderError, match="is not a"):
            await provider.device_tags(device_id)
        await provider.aclose()
    assert sent == []


@pytest.mark.parametrize("user", ["²", "٣", "1²"])
def test_headscale_user_must_be_ascii_digits(user: str) -> None:
    # str.isdigit() accepted other scripts' digits; the value then failed as a headscale user ID at run time.
    with pytest.raises(controller_config.ConfigError, match="HEADSCALE_USER"):
        controller_config.load({"HEADSCALE_USER": user})
