"""The API server proxy on a real tailnet without Kubernetes: `containerboot apiserver-proxy` next to our agent
(kernel mode) in the lab's proxy namespace, in front of labtools.fakeapiserver over TLS checked with its CA,
and the lab's real headscale with a policy granting the client's user `tailscale.com/cap/kubernetes`.

From the client node (curl over the tailnet): the proxy listens on the node's tailnet address; the request
reaches the API server with the proxy's own token, `Impersonate-User: e2e` (the headscale user's login name)
and `Impersonate-Group: tailnet-readers` from the grant, the client's own Authorization and Impersonate-*
headers gone. With a malformed grant (`"groups": "tailnet-readers"`) the caller is refused with a 403 Status
naming the rule, and the proxy's log names the rule and the caller.
"""
from __future__ import annotations

import json
import tempfile

import pytest

from labtools import apiproxylab as ap
from labtools.lab import wait_until
from tests.support.kubeapi import make_certs

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(300)]

BAD = {"grants": [
    {"src": ["*"], "dst": ["*"], "ip": ["*"]},
    {"src": ["e2e@"], "dst": ["e2e@"], "app": {ap.CAP_KUBERNETES: [{"impersonate": {"groups": "tailnet-readers"}}]}}]}


def _start(lab, start_agent, mode: str, port: int):
    agent = start_agent({"TS_HOSTNAME": "apiproxy-lab", "TS_USERSPACE": "false"})
    agent.wait_running(90)
    certs = make_certs(tempfile.mkdtemp(prefix="apiproxy-pki-", dir=str(lab.run_dir)), ["127.0.0.1"])
    return ap.LocalProxy(lab, agent, ca=certs.ca_path, cert=certs.cert_path, key=certs.key_path, objects=10,
                         mode=mode, port=port), agent


@pytest.fixture
def proxy(lab, start_agent):
    p, agent = _start(lab, start_agent, "auth", 80)
    try:
        p.wait_listening()
        yield p, agent.tailnet_ips()[0]
    finally:
        p.stop()


def _curl(lab, ip: str, path: str = "/api/v1/namespaces/apps/pods") -> tuple[int, dict]:
    cp = lab.curl("client", f"http://{ip}{path}", 10, extra=[
        "-H", "Authorization: Bearer client-secret", "-H", "Impersonate-User: admin",
        "-H", "Impersonate-Group: system:masters", "-w", "\\n%{http_code}"])
    body, _, code = cp.stdout.rpartition("\n")
    return int(code or 0), json.loads(body) if body.strip().startswith("{") else {"raw": body, "err": cp.stderr}


def test_impersonation_from_the_policy_over_the_tailnet(lab, proxy):
    p, ip = proxy
    assert "is listening on http://" in p.wait_listening() and f"http://{ip}" in p.wait_listening()
    with lab.hs_policy(ap.policy("e2e", dst="e2e@")):
        seen: list = []

        def granted() -> dict | None:
            code, doc = _curl(lab, ip)
            seen[:] = [code, doc]
            heads = [(k.lower(), v) for k, v in doc.get("headers", [])]
            return doc if code == 200 and ("impersonate-group", "tailnet-readers") in heads else None
        try:
            doc = wait_until(granted, 60, 1, "the grant reaching the proxy's netmap")
        except TimeoutError:
            raise AssertionError(f"last answer: {seen}\n{p.log_text()[-2000:]}") from None
        heads = [(k.lower(), v) for k, v in doc["headers"]]
        assert ("authorization", "Bearer lab-proxy-token") in heads
        assert [v for k, v in heads if k.startswith("impersonate-")] == ["e2e", "tailnet-readers"]
    with lab.hs_policy(BAD):
        def refused() -> dict | None:
            code, doc = _curl(lab, ip)
            return doc if code == 403 else None
        doc = wait_until(refused, 60, 1, "the malformed grant refused")
        assert doc["reason"] == "Forbidden"
        assert "rule 0 of capability 'tailscale.com/cap/kubernetes': impersonate.groups is a string" in doc["message"]
        log = p.log_text()
        assert "malformed capability grant" in log and "rule 0 of capability" in log and "(e2e)" in log
    assert "lab-proxy-token" not in p.log_text() and "client-secret" not in p.log_text()


def test_noauth_serves_https_with_a_self_signed_certificate_and_passes_the_clients_token(lab, start_agent):
    """kubectl sends credentials over TLS only, so noauth without a control-plane certificate is HTTPS."""
    p, agent = _start(lab, start_agent, "noauth", 443)
    try:
        line = p.wait_listening()
        ip = agent.tailnet_ips()[0]
        assert f"https://{ip}" in line and "self-signed certificate (SHA-256" in p.log_text()
        cp = wait_until(lambda: (c := lab.curl("client", f"https://{ip}/api/v1/pods/x", 10, extra=[
            "-k", "-H", "Authorization: Bearer client-token"])).returncode == 0 and c, 60, 1, "an HTTPS answer")
        heads = [(k.lower(), v) for k, v in json.loads(cp.stdout)["headers"]]
        assert ("authorization", "Bearer client-token") in heads
        assert not [k for k, _ in heads if k.startswith("impersonate-")]
    finally:
        p.stop()

