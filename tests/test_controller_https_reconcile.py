"""A pass over an Ingress naming a TLS Secret, against the in-memory API server: the proxy's read access in the
Ingress's namespace, the Warning for a certificate clients would refuse, the status, and the cleanup."""
from __future__ import annotations

import base64
import json

import pytest

from containerboot.kube import secretstate as agent_ss
from controller.config import ControllerConfig
from controller.kubeapi import EVENTS, INGRESSES, ROLEBINDINGS, ROLES, SECRETS, SERVICES, STATEFULSETS
from controller.model import Parent
from controller.reconcile import TLS_RECHECK, Reconciler
from controller.render import base_name
from tests.support.fakekube import FakeKube, FakeProvider, agent_writes, secret_data
from tests.support.testca import TestCA

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1",
                       login_server="http://hs.test:8080")
FQDN = "site.tail.test"


@pytest.fixture
def env():
    log: list = []
    kube, prov = FakeKube(log), FakeProvider(log)
    clock = iter(f"2026-01-01T00:00:{i:02d}Z" for i in range(60))
    return kube, prov, Reconciler(kube, prov, CFG, now=lambda: next(clock))


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> TestCA:
    return TestCA(str(tmp_path_factory.mktemp("ca")))


def put_tls(kube, leaf):
    kube.objects.pop(("secrets", "apps", "site-tls"), None)
    kube.put(SECRETS, {"metadata": {"name": "site-tls", "namespace": "apps"}, "type": "kubernetes.io/tls",
                       "data": {"tls.crt": base64.b64encode(leaf.cert_pem).decode(),
                                "tls.key": base64.b64encode(leaf.key_pem).decode()}})


async def test_ingress_with_its_own_certificate(env, ca):
    kube, prov, rec = env
    kube.put(SERVICES, {"metadata": {"name": "be", "namespace": "apps"},
                        "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80}]}})
    ing = kube.put(INGRESSES, {"metadata": {"name": "site", "namespace": "apps"},
                               "spec": {"ingressClassName": "tailscale", "tls": [{"secretName": "site-tls"}],
                                        "defaultBackend": {"service": {"name": "be", "port": {"number": 80}}}}})
    name = base_name(Parent("ingress", "site", "apps", ing["metadata"]["uid"]))
    assert await rec.reconcile("ingress", "apps", "site") == TLS_RECHECK
    events = [(e["type"], e["reason"], e["message"]) for e in kube.of(EVENTS)]
    assert any(r == "TLSCertificateInvalid" and "Secret apps/site-tls (spec.tls[].secretName) not found" in m
               for _, r, m in events), events
    assert not any(r == "HTTPOnly" for _, r, _ in events)
    role, binding = kube.obj(ROLES, name, "apps"), kube.obj(ROLEBINDINGS, name, "apps")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["site-tls"],
                              "verbs": ["get"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "tailscale"}]
    env_of = {e["name"]: e.get("value") for e in
              kube.obj(STATEFULSETS, name, "tailscale")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env_of["TS_TLS_CERT_SECRET"] == "apps/site-tls"

    # The proxy registers; its certificate names another host: the Warning names the Secret and the problem.
    agent_writes(kube, f"{name}-0", {
        **agent_ss.boot_reset_patch(None, capver=142, pod_uid="p", config_authkey=""),
        **agent_ss.device_id_patch("5"), **agent_ss.device_endpoints_patch(FQDN, ["100.64.0.5"]),
        **agent_ss.https_endpoint_patch("no-https")})
    put_tls(kube, ca.issue("other.example.org"))
    await rec.reconcile("ingress", "apps", "site")
    msgs = [e["message"] for e in kube.of(EVENTS) if e["reason"] == "TLSCertificateInvalid"]
    assert any(m.startswith("Secret apps/site-tls: the certificate covers none of the served names site.tail.test")
               for m in msgs), msgs
    sc = json.loads(secret_data(kube, f"{name}-0")["serve-config"])
    assert sc == {"TCP": {"443": {"TCPForward": "127.0.0.1:10443"}}}     # one backend: the agent goes straight
    assert env_of["TS_TLS_BACKEND"] == "10.96.0.20:80"
    assert kube.obj(INGRESSES, "site", "apps")["status"]["loadBalancer"] == {
        "ingress": [{"hostname": FQDN, "ports": [{"port": 443, "protocol": "TCP"}]}]}

    # A good certificate: no new Warning
    put_tls(kube, ca.issue(FQDN))
    n = len([e for e in kube.of(EVENTS) if e["reason"] == "TLSCertificateInvalid"])
    await rec.reconcile("ingress", "apps", "site")
    assert len([e for e in kube.of(EVENTS) if e["reason"] == "TLSCertificateInvalid"]) == n

    # The Ingress stops naming a Secret: the read access goes
    obj = kube.obj(INGRESSES, "site", "apps")
    obj["spec"].pop("tls")
    await rec.reconcile("ingress", "apps", "site")
    assert kube.obj(ROLES, name, "apps") is None and kube.obj(ROLEBINDINGS, name, "apps") is None

    # ... and comes back; deleting the Ingress removes it too
    kube.obj(INGRESSES, "site", "apps")["spec"]["tls"] = [{"secretName": "site-tls"}]
    await rec.reconcile("ingress", "apps", "site")
    assert kube.obj(ROLES, name, "apps") is not None
    kube.obj(INGRESSES, "site", "apps")["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    for _ in range(3):
        await rec.reconcile("ingress", "apps", "site")
        kube.objects.pop(("statefulsets", "tailscale", name), None)     # the kubelet's part of a foreground delete
    assert kube.obj(ROLES, name, "apps") is None and kube.obj(ROLEBINDINGS, name, "apps") is None


async def test_apiserver_proxy_certificate_problem_is_a_warning_on_its_configmap(env, ca):
    from controller.kubeapi import CONFIGMAPS
    from controller.model import APISERVER
    kube, prov, rec = env
    kube.put(CONFIGMAPS, {"metadata": {"name": "apiserver-proxy", "namespace": "tailscale",
                                       "labels": {"tailscale.com/apiserver-proxy": "true"}},
                          "data": {"mode": "auth", "tlsSecret": "kube-api-tls"}})
    await rec.reconcile(APISERVER, "tailscale", "apiserver-proxy")
    warn = [e for e in kube.of(EVENTS) if e["reason"] == "TLSCertificateInvalid"]
    assert [e["message"].split(":")[0] for e in warn] == [
        "Secret tailscale/kube-api-tls (apiServerProxy.tls.secretName) not found"]
    assert warn[0]["involvedObject"]["kind"] == "ConfigMap"
    leaf = ca.issue("kube-apiserver.tail.test")
    kube.put(SECRETS, {"metadata": {"name": "kube-api-tls", "namespace": "tailscale"}, "type": "kubernetes.io/tls",
                       "data": {"tls.crt": base64.b64encode(leaf.cert_pem).decode(),
                                "tls.key": base64.b64encode(leaf.key_pem).decode()}})
    await rec.reconcile(APISERVER, "tailscale", "apiserver-proxy")
    assert len([e for e in kube.of(EVENTS) if e["reason"] == "TLSCertificateInvalid"]) == len(warn)


async def test_ingress_in_the_controllers_namespace_reads_its_secret_through_the_proxys_own_role(env):
    # There the proxy's Role has the name a second Role would have: the Secret is added to it instead, and the
    # proxy's own access is never taken away.
    kube, prov, rec = env
    kube.put(SERVICES, {"metadata": {"name": "be", "namespace": "tailscale"},
                        "spec": {"clusterIP": "10.96.0.21", "ports": [{"port": 80}]}})
    ing = kube.put(INGRESSES, {"metadata": {"name": "site", "namespace": "tailscale"},
                               "spec": {"ingressClassName": "tailscale", "tls": [{"secretName": "site-tls"}],
                                        "defaultBackend": {"service": {"name": "be", "port": {"number": 80}}}}})
    name = base_name(Parent("ingress", "site", "tailscale", ing["metadata"]["uid"]))
    for _ in range(2):
        await rec.reconcile("ingress", "tailscale", "site")
        rules = kube.obj(ROLES, name, "tailscale")["rules"]
        assert {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["site-tls"], "verbs": ["get"]} in rules
        assert any(f"{name}-0" in (r.get("resourceNames") or []) for r in rules), rules
    kube.obj(INGRESSES, "site", "tailscale")["spec"].pop("tls")
    await rec.reconcile("ingress", "tailscale", "site")
    rules = kube.obj(ROLES, name, "tailscale")["rules"]
    assert all("site-tls" not in (r.get("resourceNames") or []) for r in rules)
    assert any(f"{name}-0" in (r.get("resourceNames") or []) for r in rules), rules
    assert kube.obj(ROLEBINDINGS, name, "tailscale") is not None
