"""An Ingress naming a TLS Secret: the serve config hands port 443 to the agent's TLS listener, the proxy may
read exactly that Secret, and a certificate the clients would refuse is reported naming the Secret."""
from __future__ import annotations

import base64
import time

import pytest

from controller.config import ControllerConfig
from controller.kinds import ingress
from controller.model import Invalid
from controller.proxyrbac import tls_secret_access
from controller.render import base_name, render
from controller.status import DeviceInfo, ingress_load_balancer
from controller.tlssecret import tls_problem
from tests.support.testca import TestCA

BACKEND = {"metadata": {"name": "be"}, "spec": {"clusterIP": "10.96.0.20", "ports": [{"name": "http", "port": 80}]}}
HS = ControllerConfig(provider="headscale", login_server="http://hs:8080", magicdns_suffix="tail.example")
TS = ControllerConfig(provider="tailscale")
FQDN = "site.tail.example"


def ing(tls, ann=None, paths=("/",)):
    return {"metadata": {"name": "site", "namespace": "apps", "uid": "ui", "annotations": ann or {}},
            "spec": {"ingressClassName": "tailscale", "tls": tls, "rules": [{"http": {"paths": [
                {"path": p, "pathType": "Prefix", "backend": {"service": {"name": "be", "port": {"number": 80}}}}
                for p in paths]}}]}}


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> TestCA:
    return TestCA(str(tmp_path_factory.mktemp("ca")))


def tls_secret(leaf, key=None, type_="kubernetes.io/tls"):
    return {"type": type_, "data": {"tls.crt": base64.b64encode(leaf.cert_pem).decode(),
                                    "tls.key": base64.b64encode(key if key is not None else leaf.key_pem).decode()}}


@pytest.mark.parametrize("cfg", [HS, TS], ids=["headscale", "tailscale"])
def test_the_secret_wins_on_either_control_plane(cfg):
    """Several paths: the agent hands the decrypted stream back to tailscaled's serve on the inner port."""
    d = ingress.decide(ing([{"hosts": ["site"], "secretName": "site-tls"}], paths=("/", "/api")), cfg,
                       {"be": BACKEND}, FQDN + ".")
    h = {"/": {"Proxy": "http://10.96.0.20:80/"}, "/api": {"Proxy": "http://10.96.0.20:80/api"}}
    assert d.spec.serve_config == {"TCP": {"443": {"TCPForward": "127.0.0.1:10443"}, "10080": {"HTTP": True}},
                                   "Web": {f"{FQDN}:10080": {"Handlers": h}}}   # "site" is that name too
    env = dict(d.spec.target_env)
    assert env["TS_TLS_CERT_SECRET"] == "apps/site-tls" and env["TS_TLS_HOSTS"] == "site"
    assert env["TS_TLS_LISTEN"] == "127.0.0.1:10443" and env["TS_TLS_UPSTREAM_PORT"] == "10080"
    assert "TS_TLS_BACKEND" not in env
    assert d.spec.tls_secret == "site-tls" and not d.spec.ingress_http
    assert not [n for n in d.notices if n[1] == "HTTPOnly"]
    sts = render(d.spec, cfg, ("key",)).statefulset
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "TS_TLS_CERT_SECRET", "value": "apps/site-tls"} in c["env"]


def test_one_backend_for_every_path_is_reached_straight():
    d = ingress.decide(ing([{"secretName": "site-tls"}]), HS, {"be": BACKEND}, FQDN)
    assert d.spec.serve_config == {"TCP": {"443": {"TCPForward": "127.0.0.1:10443"}}}   # no plain-HTTP port
    assert dict(d.spec.target_env)["TS_TLS_BACKEND"] == "10.96.0.20:80"
    v6 = {"metadata": {"name": "be"}, "spec": {"clusterIP": "fd00::20", "ports": [{"port": 80}]}}
    assert dict(ingress.decide(ing([{"secretName": "x"}]), HS, {"be": v6}, FQDN).spec.target_env)[
        "TS_TLS_BACKEND"] == "[fd00::20]:80"
    for handlers in ({"/": {"Proxy": "https+insecure://10.0.0.1:443/"}}, {"/": {"Proxy": "http://10.0.0.1:80/x"}},
                     {"/a": {"Proxy": "http://10.0.0.1:80/a"}}, {"/": {"Proxy": "http://10.0.0.1:80/"}, "/b": {}}):
        assert ingress.direct_backend(handlers) == ""


def test_without_a_secret_tailscale_keeps_upstreams_certificate():
    d = ingress.decide(ing([{"hosts": ["site"]}]), TS, {"be": BACKEND})
    assert d.spec.serve_config["TCP"] == {"443": {"HTTPS": True}}
    assert not any(k.startswith("TS_TLS_") for k, _ in d.spec.target_env)
    assert tls_secret_access(d.spec, TS) is None


def test_own_domain_and_redirect():
    i = ing([{"hosts": ["app.example.com"], "secretName": "app-tls"}], {"tailscale.com/http-redirect": "true"},
            paths=("/", "/api"))
    d = ingress.decide(i, HS, {"be": BACKEND}, "app.tail.example.")
    sc = d.spec.serve_config
    assert sc["TCP"]["80"] == {"HTTP": True}
    assert set(sc["Web"]) == {"app.tail.example:10080", "app.example.com.tail.example:10080",
                              "app.tail.example:80", "app.example.com.tail.example:80"}
    assert sc["Web"]["app.tail.example:80"]["Handlers"]["/"] == {"Redirect": "301:https://${HOST}${REQUEST_URI}"}
    lb = ingress_load_balancer([DeviceInfo("s-0", "id", "app.tail.example", (), serve_applied=True)], d.spec)
    assert lb == {"ingress": [{"hostname": "app.tail.example", "ports": [{"port": 443, "protocol": "TCP"},
                                                                         {"port": 80, "protocol": "TCP"}]}]}


def test_before_the_name_is_known_nothing_is_served():
    d = ingress.decide(ing([{"secretName": "x"}]), TS, {"be": BACKEND})
    assert d.spec.serve_config == {}


def test_forwarding_cluster_traffic_with_a_secret_is_refused():
    with pytest.raises(Invalid, match="cannot be served with annotation"):
        ingress.decide(ing([{"secretName": "x"}], {"tailscale.com/experimental-forward-cluster-traffic-via-ingress":
                                                   "true"}), HS, {"be": BACKEND}, FQDN)


def test_second_secret_and_funnel_are_reported_not_dropped():
    i = ing([{"secretName": "a"}, {"secretName": "b", "hosts": ["b.example.com"]}], {"tailscale.com/funnel": "true"})
    d = ingress.decide(i, TS, {"be": BACKEND}, FQDN)
    assert any("only Secret 'a' is served" in w and "b skipped" in w for w in d.warnings)
    assert any(n[1] == ingress.REASON_TLS and "tailscale.com/funnel ignored" in n[2] for n in d.notices)
    assert "AllowFunnel" not in d.spec.serve_config


def test_the_proxy_may_read_exactly_its_secret():
    d = ingress.decide(ing([{"secretName": "site-tls"}]), HS, {"be": BACKEND}, FQDN)
    role, binding = tls_secret_access(d.spec, HS)
    name = base_name(d.spec.parent)
    assert role["metadata"]["namespace"] == "apps" and binding["metadata"]["namespace"] == "apps"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["site-tls"],
                              "verbs": ["get"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": HS.namespace}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"] == name


def test_problems_name_the_secret(ca):
    good, other = ca.issue(FQDN), ca.issue("other.example.org")
    names = ingress.tls_names(FQDN + ".", ())
    now = time.time()
    assert tls_problem(tls_secret(good), "apps", "site-tls", names, now) == ""
    cases = {
        "not found": None,
        "of type 'Opaque'": tls_secret(good, type_="Opaque"),
        "covers none of the served names site.tail.example": tls_secret(other),
        "tls.key does not match": tls_secret(good, key=other.key_pem),
        "holds no PEM certificate": {"type": "kubernetes.io/tls", "data": {}},
    }
    for fragment, secret in cases.items():
        msg = tls_problem(secret, "apps", "site-tls", names, now)
        assert msg.startswith("Secret apps/site-tls") and fragment in msg, msg
        assert "PRIVATE" not in msg
    expired = ca.issue(FQDN, not_before="20200101000000Z", not_after="20200201000000Z")
    assert "expired" in tls_problem(tls_secret(expired), "apps", "site-tls", names, now)


def test_a_problem_becomes_a_warning_event():
    d = ingress.decide(ing([{"secretName": "site-tls"}]), HS, {"be": BACKEND}, FQDN,
                       "Secret apps/site-tls: the certificate expired at 2020-02-01T00:00:00Z")
    assert ("Warning", "TLSCertificateInvalid", "Secret apps/site-tls: the certificate expired at "
            "2020-02-01T00:00:00Z; the proxy keeps serving the last good certificate, if it had one") in d.notices


# ---- the API server proxy's own certificate

def apiserver_cm(data):
    return {"metadata": {"name": "apiserver-proxy", "namespace": "tailscale", "uid": "u1",
                         "labels": {"tailscale.com/apiserver-proxy": "true"}}, "data": data}


def test_apiserver_proxy_serves_and_may_read_its_secret():
    from controller.kinds import apiserverproxy
    from controller.proxyrbac import role
    d = apiserverproxy.decide(apiserver_cm({"mode": "auth", "tlsSecret": "kube-api-tls"}), HS)
    sts = render(d.spec, HS, ("key",)).statefulset
    c = {x["name"]: x for x in sts["spec"]["template"]["spec"]["containers"]}["apiserver-proxy"]
    assert {"name": "TS_APISERVER_PROXY_TLS_SECRET", "value": "kube-api-tls"} in c["env"]
    rules = role(d.spec, HS)["rules"]
    assert {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["kube-api-tls"], "verbs": ["get"]} in rules
    assert tls_secret_access(d.spec, HS) is None      # same namespace: no second Role
    plain = apiserverproxy.decide(apiserver_cm({"mode": "auth"}), HS)
    assert all("kube-api-tls" not in (r.get("resourceNames") or []) for r in role(plain.spec, HS)["rules"])


def test_apiserver_proxy_secret_name_is_checked():
    from controller.kinds import apiserverproxy
    with pytest.raises(Invalid, match="data.tlsSecret='Bad_Name' is not a Secret name"):
        apiserverproxy.decide(apiserver_cm({"mode": "noauth", "tlsSecret": "Bad_Name"}), HS)


def test_the_chart_passes_the_api_server_proxys_secret_and_lets_the_controller_grant_it():
    import os

    from labtools import helmchart
    if helmchart.helm_bin() is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set, so this test must run, but helm is not built (make setup-bin)")
        pytest.skip("helm is not built: run make setup-bin (scripts/install-helm.sh)")
    from controller.kinds import apiserverproxy

    def render_(values):
        return helmchart.objects(helmchart.template({"imageRegistry": "registry.example.com/t", **values},
                                                    "tailscale"))
    objs = render_({"provider": "tailscale", "apiServerProxy": {"mode": "auth", "tls": {"secretName": "kube-tls"}}})
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "apiserver-proxy"]
    assert cm["data"]["tlsSecret"] == "kube-tls"
    assert apiserverproxy.decide(cm, ControllerConfig(namespace="tailscale")).spec.tls_secret == "kube-tls"
    plain = render_({"provider": "tailscale", "apiServerProxy": {"mode": "auth"}})
    (cm,) = [o for o in plain if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "apiserver-proxy"]
    assert "tlsSecret" not in cm["data"]
    (cr,) = [o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "tailscale-controller"]
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]} in cr["rules"]
    assert not any("secrets" in r["resources"] and {"list", "watch"} & set(r["verbs"]) for r in cr["rules"])
