"""The Kubernetes contract on the project's stand-ins: the in-memory fake and the test API server pass the same
checks the real kube-apiserver passes in netns-tests/test_controller_apiserver.py (tests/support/kube_contract.py).
"""
from __future__ import annotations

import pytest

from containerboot.kube.client import KubeClient
from controller.kubeapi import Kube
from tests.support.fakekube import FakeKube
from tests.support.kube_contract import AGENT_CHECKS, CRD_CHECKS, KUBE_CHECKS, install_contract_crd
from tests.support.kubeapi import running
from tests.support.planted_kube import PLANTED, failing_checks


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One test API server for the module (every check names its own objects), allow-all RBAC."""
    yield from running("contract", str(tmp_path_factory.mktemp("kube-contract")))


@pytest.mark.parametrize("check", sorted(KUBE_CHECKS))
async def test_the_in_memory_fake_keeps_the_contract(check):
    await KUBE_CHECKS[check](FakeKube(), "contract")


@pytest.mark.parametrize("check", sorted(KUBE_CHECKS))
async def test_the_test_api_server_keeps_the_contract(server, check):
    kube = Kube(server.url, token=server.token, verify=server.ssl_context())
    try:
        await KUBE_CHECKS[check](kube, server.namespace)
    finally:
        await kube.aclose()


@pytest.mark.parametrize("check", sorted(AGENT_CHECKS))
async def test_the_test_api_server_keeps_the_agent_clients_contract(server, check):
    async with KubeClient.from_environment(server.env(), root=server.root, url=server.url) as client:
        await AGENT_CHECKS[check](client)


@pytest.mark.parametrize("check", sorted(CRD_CHECKS))
async def test_the_in_memory_fake_keeps_the_custom_resource_contract(check):
    kube = FakeKube()
    await install_contract_crd(kube)
    await CRD_CHECKS[check](kube)


@pytest.mark.parametrize("bug", sorted(PLANTED))
async def test_a_planted_status_bug_in_the_fake_fails_the_contract(bug):
    """The checks can fail: the fake with one bug in its status subresource fails the status check (and the real
    server passes the same checks: netns-tests/test_controller_apiserver.py)."""
    assert await failing_checks(FakeKube()) == []
    failed = await failing_checks(PLANTED[bug]())
    assert "status_is_a_subresource" in [f.partition(":")[0] for f in failed], failed
