"""The Kubernetes contract on the project's stand-ins: the in-memory fake and the test API server pass the same
checks the real kube-apiserver passes in netns-tests/test_controller_apiserver.py (tests/support/kube_contract.py).
"""
from __future__ import annotations

import pytest

from containerboot.kube.client import KubeClient
from controller.kubeapi import Kube
from tests.support.fakekube import FakeKube
from tests.support.kube_contract import AGENT_CHECKS, KUBE_CHECKS


@pytest.mark.parametrize("check", sorted(KUBE_CHECKS))
async def test_the_in_memory_fake_keeps_the_contract(check):
    await KUBE_CHECKS[check](FakeKube(), "contract")


@pytest.mark.parametrize("check", sorted(KUBE_CHECKS))
async def test_the_test_api_server_keeps_the_contract(kube_api, check):
    kube = Kube(kube_api.url, token=kube_api.token, verify=kube_api.ssl_context())
    try:
        await KUBE_CHECKS[check](kube, kube_api.namespace)
    finally:
        await kube.aclose()


@pytest.mark.parametrize("check", sorted(AGENT_CHECKS))
async def test_the_test_api_server_keeps_the_agent_clients_contract(kube_api, check):
    async with KubeClient.from_environment(kube_api.env(), root=kube_api.root, url=kube_api.url) as client:
        await AGENT_CHECKS[check](client)
