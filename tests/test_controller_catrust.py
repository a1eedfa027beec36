"""PROXY_CA_CONFIGMAP's ConfigMap checked by the controller: missing, or holding no PEM certificate, the parent
(Service, ProxyGroup) gets a False condition and one Warning event naming the setting, the ConfigMap and the
command that fixes it, and nothing is minted or created; once the ConfigMap is right the next pass makes the
proxy. A proxy that exists already keeps running, with the problem in its condition while it is not ready."""
from __future__ import annotations

import base64
from dataclasses import replace

from controller import render
from controller.config import ControllerConfig
from controller.kubeapi import CONFIGMAPS, EVENTS, PROXYGROUPS, SECRETS, SERVICES, STATEFULSETS
from controller.passes.proxygroup import CA_RECHECK
from controller.reconcile import POD_SECURITY_RECHECK, Reconciler
from tests.support.fakekube import FakeKube, FakeProvider

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1",
                       login_server="https://hs.test", proxy_ca_configmap="headscale-ca")
PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def cm(data: dict | None = None, binary: dict | None = None) -> dict:
    obj: dict = {"metadata": {"name": "headscale-ca", "namespace": "tailscale"}}
    if data is not None:
        obj["data"] = data
    if binary is not None:
        obj["binaryData"] = binary
    return obj


def test_problem_names_the_setting_the_configmap_and_the_fix():
    missing = render.ca_trust_problem(CFG, None)
    assert "ConfigMap tailscale/headscale-ca" in missing and "PROXY_CA_CONFIGMAP" in missing
    assert "proxy.caConfigMap" in missing and "does not exist" in missing
    assert "kubectl -n tailscale create configmap headscale-ca --from-file=ca.crt=CA_FILE" in missing
    empty = render.ca_trust_problem(CFG, cm({"ca.crt": "not a certificate"}))
    assert "holds no PEM certificate (keys: ca.crt)" in empty
    assert "holds no PEM certificate (keys: none)" in render.ca_trust_problem(CFG, cm())
    assert render.ca_trust_problem(CFG, cm({"ca.crt": PEM})) == ""
    # a certificate in binaryData (PEM bytes) is mounted as a file too
    assert render.ca_trust_problem(CFG, cm(binary={"ca.pem": base64.b64encode(PEM.encode()).decode()})) == ""
    assert "keys: ca.der" in render.ca_trust_problem(CFG, cm(binary={"ca.der": base64.b64encode(b"\x30\x82").decode()}))
    # unset: nothing to check
    assert render.ca_trust_problem(replace(CFG, proxy_ca_configmap=""), None) == ""


def service() -> dict:
    return {"metadata": {"name": "web", "namespace": "apps", "uid": "u-web",
                         "annotations": {"tailscale.com/expose": "true"}},
            "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"]}}


def ready_condition(kube: FakeKube) -> dict:
    return next(c for c in kube.obj(SERVICES, "web", "apps")["status"]["conditions"]
                if c["type"] == "TailscaleProxyReady")


async def test_missing_configmap_creates_nothing_and_says_how_to_make_it():
    log: list = []
    kube, prov = FakeKube(log), FakeProvider(log)
    rec = Reconciler(kube, prov, CFG, now=lambda: "2026-01-01T00:00:00Z")
    kube.put(SERVICES, service())
    assert await rec.reconcile("svc", "apps", "web") == POD_SECURITY_RECHECK
    assert prov.keys == [] and kube.of(STATEFULSETS) == [] and kube.of(SECRETS) == []
    c = ready_condition(kube)
    assert c["status"] == "False" and c["reason"] == "ProxyFailed"
    assert "ConfigMap tailscale/headscale-ca" in c["message"] and "does not exist" in c["message"]
    [ev] = kube.of(EVENTS)
    assert (ev["type"], ev["reason"], ev["message"]) == ("Warning", render.REASON_CA_TRUST, c["message"])
    # the next pass sends no second event; the ConfigMap made, the proxy is made and trusts it
    await rec.reconcile("svc", "apps", "web")
    assert len(kube.of(EVENTS)) == 1
    kube.put(CONFIGMAPS, cm({"ca.crt": PEM}))
    await rec.reconcile("svc", "apps", "web")
    [sts] = kube.of(STATEFULSETS)
    assert len(prov.keys) == 1
    volumes = sts["spec"]["template"]["spec"]["volumes"]
    assert {"name": "control-plane-ca", "configMap": {"name": "headscale-ca"}} in volumes
    assert ready_condition(kube)["reason"] == "ProxyPending"


async def test_a_running_proxy_keeps_running_and_its_condition_says_why_it_is_not_ready():
    log: list = []
    kube, prov = FakeKube(log), FakeProvider(log)
    rec = Reconciler(kube, prov, CFG, now=lambda: "2026-01-01T00:00:00Z")
    kube.put(CONFIGMAPS, cm({"ca.crt": PEM}))
    kube.put(SERVICES, service())
    await rec.reconcile("svc", "apps", "web")
    assert len(kube.of(STATEFULSETS)) == 1 and len(prov.keys) == 1
    # the certificate replaced by something else: the proxy stays, a restarted Pod could not log in
    kube.put(CONFIGMAPS, cm({"ca.crt": "oops"}))
    await rec.reconcile("svc", "apps", "web")
    assert len(kube.of(STATEFULSETS)) == 1 and len(prov.keys) == 1
    c = ready_condition(kube)
    assert c["status"] == "False" and "holds no PEM certificate (keys: ca.crt)" in c["message"]
    assert [e["reason"] for e in kube.of(EVENTS)] == [render.REASON_CA_TRUST]


async def test_proxygroup_waits_for_the_configmap():
    log: list = []
    kube, prov = FakeKube(log), FakeProvider(log)
    rec = Reconciler(kube, prov, CFG, now=lambda: "2026-01-01T00:00:00Z")
    kube.put(PROXYGROUPS, {"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyGroup",
                           "metadata": {"name": "pg", "uid": "uid-pg", "generation": 1},
                           "spec": {"type": "egress"}})
    assert await rec.reconcile("proxygroup", "", "pg") == CA_RECHECK
    assert prov.keys == [] and kube.of(STATEFULSETS) == [] and kube.of(SECRETS) == []
    cond = {c["type"]: c for c in kube.obj(PROXYGROUPS, "pg")["status"]["conditions"]}
    ready = cond["ProxyGroupReady"]
    assert ready["status"] == "False" and ready["reason"] == "ProxyGroupCreationFailed"
    assert "ConfigMap tailscale/headscale-ca" in ready["message"]
    assert [e["reason"] for e in kube.of(EVENTS)] == [render.REASON_CA_TRUST]
    kube.put(CONFIGMAPS, cm({"ca.crt": PEM}))
    await rec.reconcile("proxygroup", "", "pg")
    assert len(kube.of(STATEFULSETS)) == 1 and len(prov.keys) == 2
