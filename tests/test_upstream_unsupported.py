"""Upstream's fields and annotations this controller does not carry out are refused where they are written,
never accepted and ignored: the object's condition goes false and a Warning event says what is not supported,
why, and what to do instead (controller/validation.py's messages, applied by controller/kinds/, ProxyClass and
DNSConfig validation). OPERATOR_LOGGING, upstream's log level setting, is read and applied.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest

from controller import __main__ as cmain
from controller import config as cconfig
from controller.config import ControllerConfig
from controller.kinds import connector, egress, ingress, proxygroup, service
from controller.kinds import dnsconfig as dc
from controller.kinds import proxyclass as pcl
from controller.kubeapi import EVENTS, INGRESSES, SECRETS, SERVICES, STATEFULSETS
from controller.model import Invalid
from controller.reconcile import Reconciler
from tests.support.fakekube import FakeKube, FakeProvider

HS = ControllerConfig(provider="headscale", headscale_url="http://hs.test", login_server="http://hs.test",
                      magicdns_suffix="tail.example")
TS = ControllerConfig(provider="tailscale")


def svc(ann, **spec):
    return {"metadata": {"name": "web", "namespace": "apps", "uid": "u1", "annotations": ann},
            "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"], **spec}}


def ing(ann):
    return {"metadata": {"name": "site", "namespace": "apps", "uid": "u2", "annotations": ann},
            "spec": {"ingressClassName": "tailscale",
                     "defaultBackend": {"service": {"name": "be", "port": {"number": 80}}}}}


BACKENDS = {"be": {"spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80}]}}}


@pytest.mark.parametrize("cfg,why", [(HS, "headscale provides neither"),
                                     (TS, "which this controller does not build yet")])
def test_proxy_group_on_an_exposed_service_is_refused_with_the_reason_for_the_provider(cfg, why):
    obj = svc({"tailscale.com/expose": "true", "tailscale.com/proxy-group": "ingress-pg"})
    assert service.handled(obj, cfg) and not egress.handled(obj)
    with pytest.raises(Invalid) as e:
        service.decide(obj, cfg)
    msg = str(e.value)
    assert "annotation tailscale.com/proxy-group on an exposed Service is not supported" in msg
    assert why in msg and "remove the annotation to get a proxy of its own" in msg
    # a LoadBalancer of class tailscale naming a group: the same
    lb = svc({"tailscale.com/proxy-group": "ingress-pg"}, type="LoadBalancer", loadBalancerClass="tailscale")
    assert service.handled(lb, cfg)
    with pytest.raises(Invalid, match="tailscale.com/proxy-group on an exposed Service"):
        service.decide(lb, cfg)


def test_proxy_group_on_an_egress_service_stays_the_groups():
    obj = svc({"tailscale.com/tailnet-ip": "100.64.0.5", "tailscale.com/proxy-group": "pg"}, type="ExternalName")
    assert egress.handled(obj) and not service.handled(obj, HS)


@pytest.mark.parametrize("cfg,why", [(HS, "headscale provides neither"), (TS, "does not build yet")])
def test_proxy_group_on_an_ingress_is_refused(cfg, why):
    obj = ing({"tailscale.com/proxy-group": "ingress-pg"})
    assert ingress.handled(obj, cfg)
    with pytest.raises(Invalid) as e:
        ingress.decide(obj, cfg, BACKENDS)
    assert "annotation tailscale.com/proxy-group on an Ingress is not supported" in str(e.value) and why in str(e.value)


@pytest.mark.parametrize("cfg,how", [(HS, "served over plain HTTP on port 80 already"),
                                     (dataclasses.replace(TS, ingress_scheme="https"), "tailscale.com/http-redirect")])
def test_http_endpoint_on_an_ingress_of_its_own_is_served_with_a_warning(cfg, how):
    d = ingress.decide(ing({"tailscale.com/http-endpoint": "enabled"}), cfg, BACKENDS)
    (warn,) = [n for n in d.notices if n[1] == "HTTPEndpointIgnored"]
    assert warn[0] == "Warning" and "tailscale.com/http-endpoint has no effect" in warn[2] and how in warn[2]
    assert not [n for n in ingress.decide(ing({}), cfg, BACKENDS).notices if n[1] == "HTTPEndpointIgnored"]


def test_connector_tailnet_is_refused_and_without_it_the_connector_is_built():
    spec = {"subnetRouter": {"advertiseRoutes": ["10.40.0.0/16"]}}
    with pytest.raises(Invalid) as e:
        connector.decide({"metadata": {"name": "c"}, "spec": {**spec, "tailnet": "other"}}, HS)
    assert "spec.tailnet is not supported" in str(e.value) and "recreate the Connector without spec.tailnet" in \
        str(e.value)
    assert connector.decide({"metadata": {"name": "c"}, "spec": spec}, HS).spec.subnet_routes == ("10.40.0.0/16",)


def test_proxygroup_tailnet_is_refused():
    pg = {"metadata": {"name": "pg"}, "spec": {"type": "egress", "tailnet": "other"}}
    with pytest.raises(Invalid, match="spec.tailnet is not supported.*recreate the ProxyGroup"):
        proxygroup.decide(pg, HS, "headscale")
    pg["spec"].pop("tailnet")
    assert proxygroup.decide(pg, HS, "headscale").type == "egress"


def test_proxyclass_static_endpoints_make_the_class_not_ready():
    pc = {"metadata": {"name": "c"},
          "spec": {"staticEndpoints": {"nodePort": {"ports": ["30000-30010"]}}}}
    v = pcl.validate(pc)
    assert not v.ok
    assert "spec.staticEndpoints is not supported by this controller yet" in pcl.invalid_message(v)
    pc["spec"].pop("staticEndpoints")
    assert pcl.validate(pc).ok


@pytest.mark.parametrize("repo,cfg,domain,refused", [
    ("tailscale/k8s-nameserver", HS, "tail.example", True),
    ("ghcr.io/tailscale/k8s-nameserver", HS, "", True),          # headscale: never ts.net
    ("tailscale/k8s-nameserver", ControllerConfig(login_server="https://cp.example"), "", True),
    ("tailscale/k8s-nameserver", TS, "tailnet-1234.ts.net", False),
    ("tailscale/k8s-nameserver", TS, "", False),                 # Tailscale: ts.net, as upstream
    ("registry.example/containerboot-py", HS, "tail.example", False),
])
def test_dnsconfig_naming_upstreams_nameserver_where_it_cannot_answer(repo, cfg, domain, refused):
    obj = {"metadata": {"name": "dns"}, "spec": {"nameserver": {"image": {"repo": repo, "tag": "v1.102.3"}}}}
    problem = dc.image_problem(obj, cfg, domain)
    assert bool(problem) is refused
    if refused:
        assert "answers only names under ts.net" in problem and "remove spec.nameserver.image" in problem


# ---- through the reconciler: the condition and the Warning event a user sees

@pytest.fixture
def rec_env():
    log: list = []
    kube, prov = FakeKube(log), FakeProvider(log)
    kube.put(SERVICES, {"metadata": {"name": "be", "namespace": "apps"},
                        "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80}]}})
    return kube, prov, Reconciler(kube, prov, HS, now=lambda: "2026-01-01T00:00:00Z")


async def test_an_exposed_service_naming_a_proxy_group_gets_a_false_condition_and_a_warning(rec_env):
    kube, prov, rec = rec_env
    kube.put(SERVICES, svc({"tailscale.com/expose": "true", "tailscale.com/proxy-group": "ingress-pg"}))
    assert await rec.reconcile("svc", "apps", "web") is None
    (c,) = kube.obj(SERVICES, "web", "apps")["status"]["conditions"]
    assert (c["type"], c["status"], c["reason"]) == ("TailscaleProxyReady", "False", "ProxyInvalid")
    assert "tailscale.com/proxy-group on an exposed Service is not supported" in c["message"]
    (ev,) = kube.of(EVENTS)
    assert (ev["type"], ev["reason"]) == ("Warning", "ProxyInvalid") and ev["message"] == c["message"]
    assert not kube.of(STATEFULSETS) and not kube.of(SECRETS) and prov.keys == []


async def test_an_ingress_naming_a_proxy_group_gets_a_warning(rec_env):
    """An Ingress's status has no conditions in Kubernetes: the Warning event is what says it."""
    kube, prov, rec = rec_env
    kube.put(INGRESSES, ing({"tailscale.com/proxy-group": "ingress-pg"}))
    assert await rec.reconcile("ingress", "apps", "site") is None
    (ev,) = kube.of(EVENTS)
    assert (ev["type"], ev["reason"]) == ("Warning", "ProxyInvalid")
    assert "tailscale.com/proxy-group on an Ingress is not supported" in ev["message"]
    assert not kube.of(STATEFULSETS) and not kube.of(SECRETS) and prov.keys == []


# ---- OPERATOR_LOGGING

@pytest.mark.parametrize("raw,level", [("", "info"), ("info", "info"), ("debug", "debug"), ("DEV", "dev")])
def test_operator_logging_levels(raw, level):
    assert cconfig.load({"OPERATOR_LOGGING": raw}).logging == level


def test_operator_logging_bad_value_names_the_variable():
    with pytest.raises(cconfig.ConfigError, match="OPERATOR_LOGGING='verbose' is not a log level; use info, debug "
                                                  "or dev"):
        cconfig.load({"OPERATOR_LOGGING": "verbose"})


@pytest.fixture
def restore_levels():
    names = ("", "controller", "kopf", "kopf.objects", "httpx", "httpcore")
    saved = {n: logging.getLogger(n).level for n in names}
    yield
    for n, lvl in saved.items():
        logging.getLogger(n).setLevel(lvl)


def test_log_levels_debug_and_dev(restore_levels):
    logging.getLogger("controller").setLevel(logging.INFO)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    cmain.apply_log_level("info")
    assert not logging.getLogger("controller.queue").isEnabledFor(logging.DEBUG)
    cmain.apply_log_level("debug")
    assert logging.getLogger("controller.queue").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("kopf.objects").isEnabledFor(logging.INFO)
    cmain.apply_log_level("dev")
    assert logging.getLogger("kopf.objects").isEnabledFor(logging.DEBUG)
    # the HTTP client's request lines stay out at every level
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    assert not logging.getLogger("httpcore").isEnabledFor(logging.INFO)


# ---- TailscaleEgressSvcReady (upstream's condition on egress Services of a ProxyGroup)

def _pg(replicas=None, available=True):
    spec = {"type": "egress"} if replicas is None else {"type": "egress", "replicas": replicas}
    return {"spec": spec, "status": {"conditions": [
        {"type": "ProxyGroupAvailable", "status": "True" if available else "False"}]}}


WANT = {"tailnetTarget": {"ip": "100.64.0.5"}, "ports": [{"protocol": "TCP", "matchPort": 3000, "targetPort": 80}]}


def _replica(i, serving=True, ips=("10.0.0.{}", "fd00::{}")):
    ips = tuple(ip.format(i + 1) for ip in ips)
    status = {"podIPv4": ips[0], "services": {"apps-db": {"tailnetTarget": {"ip": "100.64.0.5"},
                                                          "ports": WANT["ports"]}} if serving else {}}
    return egress.Replica(f"pg-{i}", ips, status)


@pytest.mark.parametrize("pg,replicas,fams,want", [
    (None, [], ["IPv4"], (False, "ClusterResourcesNotReady", "ClusterResourcesNotReady")),
    (_pg(available=False), [_replica(0)], ["IPv4"], (False, "ClusterResourcesNotReady", "ClusterResourcesNotReady")),
    (_pg(0), [], ["IPv4"], (False, "NoProxiesConfigured", "NoProxiesConfigured")),
    (_pg(), [_replica(0, False), _replica(1, False)], ["IPv4"],
     (False, "NotReadyToRouteTraffic", "0 out of 2 replicas are ready to route traffic")),
    (_pg(), [_replica(0), _replica(1, False)], ["IPv4"],
     (True, "PartiallyReadyToRouteTraffic", "1 out of 2 replicas are ready to route traffic")),
    (_pg(3), [_replica(0), _replica(1), _replica(2)], ["IPv4", "IPv6"],
     (True, "ReadyToRouteTraffic", "3 out of 3 replicas are ready to route traffic")),
    # a replica without an address of a family the Service's slices list routes none of that family
    (_pg(1), [_replica(0, ips=("10.0.0.{}",))], ["IPv4", "IPv6"],
     (False, "NotReadyToRouteTraffic", "0 out of 1 replicas are ready to route traffic")),
])
def test_egress_service_ready_condition(pg, replicas, fams, want):
    assert egress.ready_condition(pg, replicas, "apps-db", WANT, fams) == want
