"""The state Secret's publishing policy (containerboot/publish.py): what each publisher writes, and when start-up
may be reported. The agent-level ordering (device ID before any rule, endpoints once routed) is covered by
tests/test_agent_kube.py; here each publisher alone, against the test API server."""
from __future__ import annotations

from containerboot.kube.client import KubeClient
from containerboot.kube.state import SecretState
from containerboot.proxyservices import ServicesDesired
from containerboot.publish import NullPublisher, SecretPublisher, UnwritableSecret
from containerboot.state import NodeState, apply_notify

SECRET = "proxy-0"


def running_node() -> NodeState:
    init = {"BackendState": "Running", "Self": {"ID": "nStable1", "NodeID": 1, "DNSName": "proxy.tailnet.test.",
                                                 "TailscaleIPs": ["100.64.0.5", "fd7a:115c:a1e0::5"]}}
    return apply_notify(NodeState(), {"InitialStatus": init}, 1.0)


async def test_without_a_secret_nothing_is_written_and_nothing_waits():
    p = NullPublisher()
    node = running_node()
    await p.device_id(node)
    await p.after_pass(node, routed=True, services=None, services_in=True, capver=142)
    await p.https_endpoint("proxy.tailnet.test")
    await p.delete_authkey()
    await p.settle(0.0)
    assert p.device_published() and p.secret is None and not p.manages_keys
    await p.aclose()


async def test_a_secret_the_pod_may_not_patch_is_left_alone(kube_api):
    kube_api.put_secret(SECRET, {"keep": b"1"})
    async with KubeClient.from_environment(kube_api.env(), root=kube_api.root, url=kube_api.url) as kc:
        p = UnwritableSecret(SecretState(kc, SECRET))
        node = running_node()
        await p.device_id(node)
        await p.after_pass(node, routed=True, services=None, services_in=True, capver=142)
        assert p.device_published() and not p.manages_keys
    assert kube_api.secret_data(SECRET) == {"keep": b"1"}
    assert kube_api.requests_for(verb="patch") == []


async def test_the_device_keys_follow_the_policy_and_gate_start_up(kube_api):
    kube_api.put_secret(SECRET, {})
    async with KubeClient.from_environment(kube_api.env(), root=kube_api.root, url=kube_api.url) as kc:
        p = SecretPublisher(SecretState(kc, SECRET))
        node = running_node()
        await p.device_id(node)
        assert kube_api.secret_data(SECRET)["device_id"] == b"nStable1"
        assert not p.device_published(), "start-up waits for the FQDN too"
        services = ServicesDesired(egress_status=b'{"svc":{}}')
        await p.after_pass(node, routed=False, services=services, services_in=False, capver=142)
        data = kube_api.secret_data(SECRET)
        assert "device_fqdn" not in data and "egress-services" not in data, "nothing before traffic can flow"
        await p.after_pass(node, routed=True, services=services, services_in=True, capver=142)
        data = kube_api.secret_data(SECRET)
        assert data["device_fqdn"] == b"proxy.tailnet.test." and data["tailscale_capver"] == b"142"
        assert data["egress-services"] == b'{"svc":{}}'
        assert p.device_published() and p.manages_keys
