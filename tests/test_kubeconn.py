"""tscommon.kubeconn: the in-cluster connection the agent's and the controller's clients share."""
from __future__ import annotations

import os

from controller.kubeapi import Kube
from tscommon.kubeconn import TokenFile, https_url, service_host_port
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
