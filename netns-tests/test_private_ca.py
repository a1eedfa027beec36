"""A control server with a certificate from a private CA: the lab's headscale behind a TLS front
(`labtools/tlsfront.py`, a certificate for its address signed by a CA made here), and our agent with a real
tailscaled pointed at it over HTTPS. With the CA's directory laid out as a kubelet mounts a ConfigMap and named
in SSL_CERT_DIR (what the controller renders for PROXY_CA_CONFIGMAP), the node logs in and the agent's own
check of the control server says it answers; without it, tailscaled refuses the certificate and never logs in.
"""
from __future__ import annotations

import json

import pytest

from labtools import tlsfront
from labtools.lab import HS_PORT, HS_V4, wait_until
from tests.support.kubeapi import make_certs
from tests.support.kubelet import Kubelet

pytestmark = [pytest.mark.netns, pytest.mark.e2e]

TLS_PORT = 8443
STATUS_PORT = 9097


@pytest.fixture(scope="module")
def tls_front(lab):
    d = lab.run_dir / "private-ca"
    d.mkdir(parents=True, exist_ok=True)
    certs = make_certs(str(d / "pki"), [HS_V4])
    p = tlsfront.start(lab, "hs", f"{HS_V4}:{TLS_PORT}", f"{HS_V4}:{HS_PORT}", certs.cert_path, certs.key_path,
                       d / "tlsfront.log")
    ca_dir = d / "control-plane-ca"        # as the kubelet mounts a ConfigMap: the key a link into `..data`
    Kubelet(ca_dir, key="ca.crt").publish(certs.ca_pem.decode())
    yield certs, ca_dir
    p.terminate()
    p.wait(10)


def _status(lab) -> dict:
    cp = lab.curl("proxy", f"http://127.0.0.1:{STATUS_PORT}/status", 3)
    return json.loads(cp.stdout) if cp.returncode == 0 else {}


def test_a_private_ca_in_ssl_cert_dir_is_trusted_by_tailscaled_and_the_agent(lab, start_agent, tls_front) -> None:
    _, ca_dir = tls_front
    agent = start_agent({"TS_EXTRA_ARGS": f"--login-server=https://{HS_V4}:{TLS_PORT}",
                         "SSL_CERT_DIR": f"/etc/ssl/certs:{ca_dir}",
                         "TS_LOCAL_ADDR_PORT": f"127.0.0.1:{STATUS_PORT}", "TS_ENABLE_HEALTH_CHECK": "true"})
    agent.wait_running(90)
    agent.wait_for_log("Startup complete", 60)
    assert agent.tailnet_ips()[0], "no tailnet address after logging in over HTTPS"

    def control_checked() -> bool:
        return _status(lab).get("control_plane", {}).get("reachable") is not None
    wait_until(control_checked, 40, 0.5, "the agent's first check of the control server")
    cp = _status(lab)["control_plane"]
    assert cp["reachable"] is True and cp["target"].startswith(f"https://{HS_V4}:{TLS_PORT}"), cp


def test_without_the_ca_the_certificate_is_refused(lab, start_agent, tls_front) -> None:
    agent = start_agent({"TS_EXTRA_ARGS": f"--login-server=https://{HS_V4}:{TLS_PORT}"})
    # tailscaled says why in its log (part of the agent's): the certificate's authority is unknown.
    agent.wait_for_log("x509: certificate signed by unknown authority", 60)
    assert not agent.tailnet_ips()[0]
