"""controller.kinds and controller.validation: which parents get a proxy, what it targets, what is refused."""
from __future__ import annotations

import json

import pytest

from controller import config as cconfig
from controller.config import ControllerConfig
from controller.kinds import connector, egress, ingress, service
from controller.model import Invalid, Pending

CFG = ControllerConfig()


def svc(ann=None, **spec):
    return {"metadata": {"name": "web", "namespace": "apps", "uid": "u1", "annotations": ann or {}},
            "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", **spec}}


def env(decision):
    return dict(decision.spec.target_env)


# ---- Service selection


@pytest.mark.parametrize("obj,cfg,want", [
    (svc({"tailscale.com/expose": "true"}), CFG, True),
    (svc({"tailscale.com/expose": "True"}), CFG, False),                # opt.Bool: only "true"
    (svc(type="LoadBalancer", loadBalancerClass="tailscale"), CFG, True),
    (svc(type="LoadBalancer", loadBalancerClass="other"), CFG, False),
    (svc(type="LoadBalancer"), CFG, False),
    (svc(type="LoadBalancer"), ControllerConfig(default_load_balancer=True), True),
    (svc({"tailscale.com/tailnet-ip": "100.64.0.5"}), CFG, True),
    (svc({"tailscale.com/tailnet-fqdn": "db.tail1.ts.net"}), CFG, True),
    # handled, to be refused by decide with its reason (a ProxyGroup serves only egress Services here)
    (svc({"tailscale.com/expose": "true", "tailscale.com/proxy-group": "pg"}), CFG, True),
    (svc({"tailscale.com/tailnet-ip": "100.64.0.5", "tailscale.com/proxy-group": "pg"}), CFG, False),
    (svc(), CFG, False),
])
def test_service_selection(obj, cfg, want):
    assert service.handled(obj, cfg) is want


def test_l3_ingress_single_and_dual_stack():
    assert env(service.decide(svc({"tailscale.com/expose": "true"}), CFG)) == {"TS_DEST_IP": "10.96.0.10"}
    d = service.decide(svc({"tailscale.com/expose": "true"}, clusterIPs=["10.96.0.10", "fd00::a"]), CFG)
    assert env(d) == {"TS_DEST_IP": "10.96.0.10,fd00::a"}
    assert d.spec.hostname == "apps-web" and d.spec.tags == ("tag:k8s",) and not d.spec.userspace


def test_hostname_and_tags_annotations():
    d = service.decide(svc({"tailscale.com/expose": "true", "tailscale.com/hostname": "db",
                            "tailscale.com/tags": "tag:a, tag:b-2"}), CFG)
    assert d.spec.hostname == "db" and d.spec.tags == ("tag:a", "tag:b-2")


def test_externalname_goes_to_dest_dns_name():
    d = service.decide(svc({"tailscale.com/expose": "true"}, type="ExternalName", externalName="db.example.com",
                           clusterIP=None), CFG)
    assert env(d) == {"TS_EXPERIMENTAL_DEST_DNS_NAME": "db.example.com"}


def test_no_cluster_ip_yet_is_pending():
    with pytest.raises(Pending):
        service.decide(svc({"tailscale.com/expose": "true"}, clusterIP=""), CFG)


def test_egress_ip_and_fqdn():
    d = service.decide(svc({"tailscale.com/tailnet-ip": "100.64.0.5"}), CFG)
    assert env(d) == {"TS_TAILNET_TARGET_IP": "100.64.0.5"} and d.spec.egress_rewrite
    assert d.spec.app == "k8s-operator-egress-proxy"
    d = service.decide(svc({"tailscale.com/tailnet-fqdn": "db.tail1.ts.net"}), CFG)
    assert env(d) == {"TS_TAILNET_TARGET_FQDN": "db.tail1.ts.net."}
    d = service.decide(svc({"tailscale.com/ts-tailnet-target-ip": "fd7a:115c:a1e0::5"}), CFG)
    assert env(d) == {"TS_TAILNET_TARGET_IP": "fd7a:115c:a1e0::5"}


def test_headscale_magicdns_suffix():
    cfg = ControllerConfig(magicdns_suffix="tail.example.com")
    d = service.decide(svc({"tailscale.com/tailnet-fqdn": "db.tail.example.com"}), cfg)
    assert env(d) == {"TS_TAILNET_TARGET_FQDN": "db.tail.example.com."}
    with pytest.raises(Invalid, match="use <host>.tail.example.com"):
        service.decide(svc({"tailscale.com/tailnet-fqdn": "db.tail1.ts.net"}), cfg)


def test_egress_rewrite_patch_and_noop():
    s = svc({"tailscale.com/tailnet-ip": "100.64.0.5"}, selector={"app": "x"})
    p = service.egress_rewrite_patch(s, "ts-web-abcde", CFG)
    assert p == {"spec": {"type": "ExternalName", "externalName": "ts-web-abcde.tailscale.svc.cluster.local",
                          "selector": None}}
    done = {**s, "spec": {"type": "ExternalName", "externalName": "ts-web-abcde.tailscale.svc.cluster.local"}}
    assert service.egress_rewrite_patch(done, "ts-web-abcde", CFG) is None


@pytest.mark.parametrize("ann,extra,needle", [
    ({"tailscale.com/tailnet-ip": "100.64.0.5", "tailscale.com/tailnet-fqdn": "db.t.ts.net"}, {},
     "both tailscale.com/tailnet-ip and tailscale.com/tailnet-fqdn"),
    ({"tailscale.com/tailnet-ip": "100.64.0.999"}, {}, "'100.64.0.999' is not an IP address"),
    # Python's parser takes any IPv6 zone; the proxy's agent (as Go's netip) refuses a non-ASCII one
    ({"tailscale.com/tailnet-ip": "::%\x80"}, {}, "'::%\\x80' is not an IP address"),
    ({"tailscale.com/tailnet-fqdn": "db.example.com"}, {}, "'db.example.com' is not a MagicDNS name"),
    ({"tailscale.com/expose": "true", "tailscale.com/hostname": "My_Host"}, {}, "'My_Host' is not a valid DNS label"),
    ({"tailscale.com/expose": "true", "tailscale.com/hostname": "-x"}, {}, "'-x' is not a valid DNS label"),
    ({"tailscale.com/expose": "true", "tailscale.com/tags": "k8s,tag:9x"}, {}, "invalid tag(s) 'k8s', 'tag:9x'"),
    ({"tailscale.com/expose": "true"}, {"clusterIP": "None"}, "headless Services are not supported"),
])
def test_invalid_service_annotations(ann, extra, needle):
    with pytest.raises(Invalid) as e:
        service.decide(svc(ann, **extra), CFG)
    assert needle in str(e.value)


@pytest.mark.parametrize("ann", [
    {"tailscale.com/tailnet-ip": "100.64.0.999", "tailscale.com/tailnet-fqdn": "db.example.com"},
    {"tailscale.com/tailnet-ip": "100.64.0.999"},
    {"tailscale.com/tailnet-fqdn": "db.example.com"},
])
def test_a_bad_tailnet_target_is_refused_alike_with_and_without_a_proxygroup(ann):
    """The same annotations get the same refusal, every problem named, whichever proxy would serve them."""
    with pytest.raises(Invalid) as alone:
        service.decide(svc(ann), CFG)
    grouped_svc = svc({**ann, "tailscale.com/proxy-group": "pg"}, type="ExternalName", externalName="x",
                      ports=[{"port": 5432}])
    with pytest.raises(Invalid) as grouped:
        egress.decide(grouped_svc, CFG, {"spec": {"type": "egress"}})
    assert str(alone.value) == str(grouped.value)
    for key, value in ann.items():
        assert f"annotation {key}: {value!r}" in str(alone.value)
    both = "both tailscale.com/tailnet-ip and tailscale.com/tailnet-fqdn are set"
    assert (both in str(alone.value)) == (len(ann) > 1)


# ---- Ingress

BACKEND = {
    "metadata": {"name": "be"},
    "spec": {"clusterIP": "10.96.0.20", "ports": [{"name": "http", "port": 8080}, {"name": "https", "port": 8443}]},
}


def ing(spec, ann=None):
    return {"metadata": {"name": "site", "namespace": "apps", "uid": "ui", "annotations": ann or {}},
            "spec": {"ingressClassName": "tailscale", **spec}}


def test_ingress_selection():
    assert ingress.handled(ing({}), CFG)
    assert not ingress.handled({"spec": {"ingressClassName": "nginx"}}, CFG)
    assert ingress.handled(ing({}, {"tailscale.com/proxy-group": "pg"}), CFG)    # refused by decide


def test_ingress_serve_config_paths_schemes_redirect_funnel():
    i = ing({"tls": [{"hosts": ["site.tail1.ts.net"]}],
             "rules": [{"host": "site.tail1.ts.net", "http": {"paths": [
                 {"path": "/", "pathType": "Prefix", "backend": {"service": {"name": "be", "port": {"name": "http"}}}},
                 {"path": "/secure", "pathType": "Exact",
                  "backend": {"service": {"name": "be", "port": {"name": "https"}}}},
                 {"path": "/gone", "backend": {"service": {"name": "missing", "port": {"number": 80}}}}]}},
                       {"host": "other.example.com", "http": {"paths": [
                           {"path": "/", "backend": {"service": {"name": "be", "port": {"number": 80}}}}]}}]},
            {"tailscale.com/funnel": "true", "tailscale.com/http-redirect": "true"})
    d = ingress.decide(i, CFG, {"be": BACKEND})
    assert d.spec.hostname == "site" and not d.spec.ingress_http
    assert d.spec.serve_config == {
        "TCP": {"443": {"HTTPS": True}, "80": {"HTTP": True}},
        "Web": {"${TS_CERT_DOMAIN}:443": {"Handlers": {"/": {"Proxy": "http://10.96.0.20:8080/"},
                                                        "/secure": {"Proxy": "https+insecure://10.96.0.20:8443/secure"}}},
                "${TS_CERT_DOMAIN}:80": {"Handlers": {"/": {"Redirect": "301:https://${HOST}${REQUEST_URI}"},
                                                       "/secure": {"Redirect": "301:https://${HOST}${REQUEST_URI}"}}}},
        "AllowFunnel": {"${TS_CERT_DOMAIN}:443": True, "${TS_CERT_DOMAIN}:80": True}}
    text = "\n".join(d.warnings)
    assert "pathType Exact is served as a prefix" in text
    assert "backend Service 'missing' not found" in text
    assert "host 'other.example.com' is not the TLS host" in text
    assert ingress.backend_services(i) == ("be", "missing")


HS = ControllerConfig(provider="headscale", login_server="http://hs:8080", magicdns_suffix="tail.example")


def test_ingress_http_scheme_serves_port_80_under_the_magicdns_name():
    """headscale (no certificates): plain HTTP on 80 under the proxy's MagicDNS name, the same paths and
    backends as the HTTPS config; Funnel and the redirect are ignored with a Warning."""
    i = ing(
        {
            "tls": [{"hosts": ["site"]}],
            "defaultBackend": {"service": {"name": "be", "port": {"number": 80}}},
            "rules": [
                {
                    "host": "site",
                    "http": {
                        "paths": [
                            {
                                "path": "/api",
                                "pathType": "Prefix",
                                "backend": {"service": {"name": "be", "port": {"name": "http"}}},
                            },
                            {
                                "path": "/secure",
                                "pathType": "Prefix",
                                "backend": {"service": {"name": "be", "port": {"name": "https"}}},
                            },
                        ]
                    },
                },
                {
                    "host": "other.example.com",
                    "http": {"paths": [{"path": "/", "backend": {"service": {"name": "be", "port": {"number": 80}}}}]},
                },
            ],
        },
        {"tailscale.com/funnel": "true", "tailscale.com/http-redirect": "true"},
    )
    handlers = {"/": {"Proxy": "http://10.96.0.20:80/"}, "/api": {"Proxy": "http://10.96.0.20:8080/api"},
                "/secure": {"Proxy": "https+insecure://10.96.0.20:8443/secure"}}
    # The device's own name (here different from the asked one) wins over the predicted one.
    d = ingress.decide(i, HS, {"be": BACKEND}, "site-2.tail.example.")
    assert (d.spec.hostname, d.spec.ingress_http, d.spec.ingress_http_name) == ("site", True, "site-2.tail.example")
    assert d.spec.serve_config == {"TCP": {"80": {"HTTP": True}},
                                   "Web": {"site-2.tail.example:80": {"Handlers": handlers}}}
    assert "host 'other.example.com' is not the TLS host" in "\n".join(d.warnings)
    assert [(t, r) for t, r, _ in d.notices] == [
        ("Normal", "HTTPOnly"),
        ("Warning", "HTTPOnly"),
        ("Warning", "HTTPOnly"),
    ]
    assert (
        "the control plane issues no TLS certificates (INGRESS_SCHEME=auto, CONTROL_PLANE=headscale)" in d.notices[0][2]
    )
    assert "annotation tailscale.com/funnel ignored" in d.notices[1][2]
    assert "annotation tailscale.com/http-redirect ignored" in d.notices[2][2]
    assert "AllowFunnel" not in d.spec.serve_config
    # Not registered yet: the name predicted from TS_MAGICDNS_SUFFIX; without a suffix, nothing served yet.
    d = ingress.decide(i, HS, {"be": BACKEND})
    assert (
        list(d.spec.serve_config["Web"]) == ["site.tail.example:80"] and d.spec.ingress_http_name == "site.tail.example"
    )
    d = ingress.decide(i, ControllerConfig(provider="headscale", login_server="http://hs:8080"), {"be": BACKEND})
    assert (d.spec.serve_config, d.spec.ingress_http_name) == ({}, "")
    # Upstream's HTTPS config is unchanged for Tailscale, and what a static key on Tailscale's server gets.
    for cfg in (ControllerConfig(provider="tailscale"), CFG, ControllerConfig(provider="headscale",
                                                                              ingress_scheme="https")):
        d = ingress.decide(i, cfg, {"be": BACKEND}, "site-2.tail.example")
        assert (d.spec.ingress_http, d.notices) == (False, ())
        assert d.spec.serve_config["TCP"] == {"443": {"HTTPS": True}, "80": {"HTTP": True}}
        assert d.spec.serve_config["Web"]["${TS_CERT_DOMAIN}:443"] == {"Handlers": handlers}


@pytest.mark.parametrize("env,http", [
    ({}, False),                                                            # static key, Tailscale's server
    ({"CONTROL_PLANE": "tailscale"}, False),
    ({"CONTROL_PLANE": "headscale", "HEADSCALE_URL": "http://hs:8080"}, True),
    ({"OPERATOR_LOGIN_SERVER": "https://hs.example.com"}, True),            # static key, another server
    ({"OPERATOR_LOGIN_SERVER": "https://controlplane.tailscale.com/"}, False),
    ({"CONTROL_PLANE": "headscale", "HEADSCALE_URL": "http://hs:8080", "INGRESS_SCHEME": "HTTPS"}, False),
    ({"CONTROL_PLANE": "tailscale", "INGRESS_SCHEME": "http"}, True),
])
def test_ingress_scheme_auto_follows_the_control_plane(env, http):
    assert cconfig.load(env).ingress_http is http


def test_ingress_default_hostname_and_no_valid_backend():
    i = ing({"defaultBackend": {"service": {"name": "be", "port": {"number": 80}}}})
    assert ingress.decide(i, CFG, {"be": BACKEND}).spec.hostname == "apps-site-ingress"
    with pytest.raises(Invalid, match="no valid backends: spec.defaultBackend skipped: backend Service 'be' not found"):
        ingress.decide(i, CFG, {})


def test_ingress_ipv6_backend_is_bracketed():
    b6 = {"metadata": {"name": "be"}, "spec": {"clusterIP": "fd00::20", "ports": [{"port": 80}]}}
    d = ingress.decide(ing({"defaultBackend": {"service": {"name": "be", "port": {"number": 80}}}}), CFG, {"be": b6})
    assert d.spec.serve_config["Web"]["${TS_CERT_DOMAIN}:443"]["Handlers"]["/"]["Proxy"] == "http://[fd00::20]:80/"


# ---- Connector


def conn(spec):
    return {"metadata": {"name": "office", "uid": "uc"}, "spec": spec}


def test_connector_subnet_router_and_exit_node():
    d = connector.decide(conn({"subnetRouter": {"advertiseRoutes": ["fd00::/64", "10.0.0.0/8", "10.1.0.0/16"]},
                               "tags": ["tag:router"]}), CFG)
    assert d.spec.advertise_routes == ("10.0.0.0/8", "10.1.0.0/16", "fd00::/64")
    assert d.spec.hostname == "office-connector" and d.spec.tags == ("tag:router",)
    d = connector.decide(conn({"exitNode": True, "hostname": "gw"}), CFG)
    assert d.spec.advertise_routes == ("0.0.0.0/0", "::/0") and d.spec.hostname == "gw" and d.spec.exit_node


def test_connector_that_is_both_advertises_both_with_a_note_on_splitting():
    d = connector.decide(conn({"subnetRouter": {"advertiseRoutes": ["10.0.0.0/8"]}, "exitNode": True}), CFG)
    assert d.spec.advertise_routes == ("0.0.0.0/0", "::/0", "10.0.0.0/8")
    assert d.spec.subnet_routes == ("10.0.0.0/8",) and d.spec.exit_node
    ((etype, reason, message),) = d.notices
    assert (etype, reason) == ("Normal", "SubnetRouterAndExitNode") and "use two Connectors" in message
    assert connector.decide(conn({"exitNode": True}), CFG).notices == ()


@pytest.mark.parametrize("spec,needle", [
    ({}, "the Connector asks for nothing"),
    ({"subnetRouter": {"advertiseRoutes": []}}, "advertiseRoutes is empty"),
    ({"subnetRouter": {"advertiseRoutes": ["10.0.0.1/8"]}}, "has host bits set; use 10.0.0.0/8"),
    ({"subnetRouter": {"advertiseRoutes": ["nonsense"]}}, "'nonsense' is not a CIDR prefix"),
    ({"subnetRouter": {"advertiseRoutes": ["0.0.0.0/0"]}}, "is a default route; use spec.exitNode"),
    ({"exitNode": True, "hostname": "a", "hostnamePrefix": "b"}, "mutually exclusive"),
    ({"exitNode": True, "hostname": "a", "replicas": 2}, "cannot be used with spec.replicas > 1"),
    ({"exitNode": True, "hostname": "Bad_Name"}, "spec.hostname: 'Bad_Name' is not a valid DNS label"),
    ({"exitNode": True, "tags": ["k8s"]}, "spec.tags: invalid tag(s) 'k8s'"),
    ({"appConnector": {}}, "spec.appConnector is not supported"),
])
def test_connector_validation(spec, needle):
    with pytest.raises(Invalid) as e:
        connector.decide(conn(spec), CFG)
    assert needle in str(e.value)


# ---- controller settings


def test_config_defaults_and_headscale():
    c = cconfig.load({})
    assert (c.namespace, c.proxy_tags, c.provider, c.server_url) == (
        "tailscale", ("tag:k8s",), "static", "https://controlplane.tailscale.com")
    c = cconfig.load({"CONTROL_PLANE": "headscale", "HEADSCALE_URL": "http://10.99.0.1:8080/"})
    assert c.login_server == "http://10.99.0.1:8080" and c.headscale_url == "http://10.99.0.1:8080"
    assert (
        cconfig.load({}, resolv_conf="search ns.svc.corp.local svc.corp.local corp.local\n").cluster_domain
        == "corp.local"
    )
    c = cconfig.load({"PROXY_RESOURCES": json.dumps({"requests": {"cpu": "5m"}})})
    assert c.proxy_resources == {"requests": {"cpu": "5m"}}
    c = cconfig.load({"PROXY_ENV": json.dumps({"TS_DEBUG_USE_DERP_HTTP": "true", "A": "1"})})
    assert c.proxy_env == (("A", "1"), ("TS_DEBUG_USE_DERP_HTTP", "true"))
    c = cconfig.load({"PROXY_NODE_SELECTOR": '{"kubernetes.io/arch": "arm64"}', "PROXY_IMAGE_PULL_SECRETS": "a, b",
                      "PROXY_TOLERATIONS": '[{"key": "k", "operator": "Exists"}]', "PROXY_AFFINITY": "{}"})
    assert (c.proxy_node_selector, c.proxy_image_pull_secrets, c.proxy_tolerations, c.proxy_affinity) == (
        {"kubernetes.io/arch": "arm64"}, ("a", "b"), [{"key": "k", "operator": "Exists"}], {})


@pytest.mark.parametrize("env,needle", [
    ({"CONTROL_PLANE": "saas"}, "CONTROL_PLANE='saas' is not a provider"),
    ({"CONTROL_PLANE": "headscale"}, "needs HEADSCALE_URL or OPERATOR_LOGIN_SERVER"),
    ({"PROXY_TAGS": "k8s"}, "PROXY_TAGS='k8s': invalid tag(s) 'k8s'"),
    ({"PROXY_FIREWALL_MODE": "pf"}, "PROXY_FIREWALL_MODE='pf'"),
    ({"PROXY_RESOURCES": "{"}, "PROXY_RESOURCES is not JSON"),
    ({"PROXY_ENV": "[1]"}, "PROXY_ENV must be a JSON object of names to string values"),
    ({"PROXY_ENV": '{"A": 1}'}, "PROXY_ENV must be a JSON object"),
    ({"PROXY_ENV": "A=1"}, "PROXY_ENV is not JSON"),
    ({"OPERATOR_LOGIN_SERVER": "hs.example.com"}, "is not a URL"),
    ({"HEADSCALE_USER": "alice"}, "must be the numeric user ID"),
    ({"OPERATOR_DEFAULT_LOAD_BALANCER": "yes"}, "is not a boolean"),
    ({"INGRESS_SCHEME": "tls"}, "INGRESS_SCHEME='tls' is not a scheme; use auto"),
    ({"PROXY_NODE_SELECTOR": "arch=arm64"}, "PROXY_NODE_SELECTOR is not JSON"),
    ({"PROXY_NODE_SELECTOR": '{"a": 1}'}, "PROXY_NODE_SELECTOR must map label names to string values"),
    ({"PROXY_TOLERATIONS": "{}"}, "PROXY_TOLERATIONS must be a JSON array"),
    ({"PROXY_AFFINITY": "[]"}, "PROXY_AFFINITY must be a JSON object"),
    ({"PROXY_IMAGE_PULL_SECRETS": "regcred,Bad_Name"}, "'Bad_Name' is not a Secret name"),
    ({"PROXY_CA_CONFIGMAP": "tailscale/headscale-ca"}, "PROXY_CA_CONFIGMAP='tailscale/headscale-ca' is not a "
                                                       "ConfigMap name; use the lower-case name of a ConfigMap in "
                                                       "'tailscale'"),
])
def test_config_errors_name_the_variable(env, needle):
    with pytest.raises(cconfig.ConfigError) as e:
        cconfig.load(env)
    assert needle in str(e.value)
