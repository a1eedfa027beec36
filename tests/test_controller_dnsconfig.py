"""DNSConfig: the nameserver's objects, its records (egress names and Ingress MagicDNS names -> proxy Pod IPs),
the singleton rule, bad input, and the stub zone in CoreDNS's ConfigMap, against the in-memory API server."""
from __future__ import annotations

import dataclasses
import json
import types

import pytest

from controller.config import ConfigError, ControllerConfig, load
from controller.kinds import dnsconfig as dc
from controller.kinds.dnsconfig import QUEUE_KEY
from controller.kubeapi import (
    CONFIGMAPS,
    DEPLOYMENTS,
    DNSCONFIGS,
    ENDPOINTSLICES,
    EVENTS,
    INGRESSES,
    SERVICEACCOUNTS,
    SERVICES,
    KubeError,
)
from controller.model import Parent
from controller.reconcile import Reconciler
from controller.render import base_name
from nameserver.records import parse_records
from tests.support.fakekube import FakeKube, FakeProvider

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1",
                       login_server="http://hs.test:8080", magicdns_suffix="tail.example")
COREFILE = ".:53 {\n    errors\n    kubernetes cluster.local in-addr.arpa ip6.arpa\n    cache 30\n}\n"


@pytest.fixture
def env():
    kube = FakeKube()
    clock = iter(f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z" for i in range(3600))
    now = lambda: next(clock)   # noqa: E731
    rec = Reconciler(kube, FakeProvider(), CFG, now=now)
    return kube, rec, dns_pass(rec)


def dns_pass(rec):
    """The DNSConfig key's pass, as the work queue runs it."""
    return types.SimpleNamespace(reconcile=lambda: rec.reconcile(*QUEUE_KEY))


def dnsconfig(kube, name="ts-dns", created="2026-01-01T00:00:00Z", **nameserver):
    return kube.put(DNSCONFIGS, {"apiVersion": "tailscale.com/v1alpha1", "kind": "DNSConfig",
                                 "metadata": {"name": name, "creationTimestamp": created},
                                 "spec": {"nameserver": nameserver}})


def slice_for(kube, service: str, addrs: list[tuple[str, bool]], family="IPv4", n=0):
    kube.put(ENDPOINTSLICES, {"metadata": {"name": f"{service}-{family.lower()}{n}", "namespace": "tailscale",
                                           "labels": {dc.LABEL_SERVICE_NAME: service}},
                              "addressType": family,
                              "endpoints": [{"addresses": [a], "conditions": {"ready": r}} for a, r in addrs]})


async def egress(kube, rec, name="db", fqdn="db.tail.example"):
    svc = kube.put(SERVICES, {"metadata": {"name": name, "namespace": "apps",
                                           "annotations": {"tailscale.com/tailnet-fqdn": fqdn}},
                              "spec": {"type": "ClusterIP", "clusterIP": "10.96.5.5", "selector": {"a": "b"}}})
    await rec.reconcile("svc", "apps", name)
    return base_name(Parent("svc", name, "apps", svc["metadata"]["uid"]))


def ingress_proxy(kube, name="web", hostname="web.tail.example"):
    """A tailnet Ingress with its status, and its proxy's headless Service as the controller names it."""
    ing = kube.put(INGRESSES, {"metadata": {"name": name, "namespace": "apps"},
                               "spec": {"ingressClassName": "tailscale"},
                               "status": {"loadBalancer": {"ingress": [{"hostname": hostname}]}}})
    p = Parent("ingress", name, "apps", ing["metadata"]["uid"])
    kube.put(SERVICES, {"metadata": {"name": base_name(p), "namespace": "tailscale", "labels": {
        "tailscale.com/managed": "true", "tailscale.com/parent-resource": name,
        "tailscale.com/parent-resource-ns": "apps", "tailscale.com/parent-resource-type": "ingress"}},
        "spec": {"clusterIP": "None"}})
    return base_name(p)


def records(kube) -> dict:
    return json.loads(kube.obj(CONFIGMAPS, "dnsrecords", "tailscale")["data"]["records.json"])


def allocate_cluster_ip(kube, ip="10.96.0.53"):
    kube.obj(SERVICES, "nameserver", "tailscale")["spec"].setdefault("clusterIP", ip)


def cond(obj):
    return next(c for c in obj["status"]["conditions"] if c["type"] == "NameserverReady")


async def test_nameserver_objects_records_and_status(env):
    kube, rec, dns = env
    dnsconfig(kube)
    hl = await egress(kube, rec)
    slice_for(kube, hl, [("10.244.0.7", True), ("10.244.0.8", False)])
    slice_for(kube, hl, [("fd00:10:244::7", True)], family="IPv6")
    ing = ingress_proxy(kube)
    slice_for(kube, ing, [("10.244.0.9", True)])
    await dns.reconcile()
    assert records(kube) == {"version": "v1alpha1",
                             "ip4": {"db.tail.example": ["10.244.0.7"], "web.tail.example": ["10.244.0.9"]},
                             "ip6": {"db.tail.example": ["fd00:10:244::7"]}}
    assert parse_records(json.dumps(records(kube))).names()     # what the nameserver reads
    dep = kube.obj(DEPLOYMENTS, "nameserver", "tailscale")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "registry.local/proxy:1" and c["command"] == ["/usr/local/bin/k8s-nameserver"]
    assert {"name": "TS_NAMESERVER_DOMAIN", "value": "tail.example"} in c["env"]
    assert {(p["containerPort"], p["protocol"]) for p in c["ports"]} == {(1053, "UDP"), (1053, "TCP")}
    assert dep["spec"]["template"]["spec"]["volumes"] == [{"name": "config", "configMap": {"name": "dnsrecords"}}]
    svc = kube.obj(SERVICES, "nameserver", "tailscale")
    assert {(p["port"], p["targetPort"], p["protocol"]) for p in svc["spec"]["ports"]} == {(53, 1053, "UDP"),
                                                                                           (53, 1053, "TCP")}
    for o in (dep, svc, kube.obj(SERVICEACCOUNTS, "nameserver", "tailscale"),
              kube.obj(CONFIGMAPS, "dnsrecords", "tailscale")):
        assert o["metadata"]["ownerReferences"][0]["kind"] == "DNSConfig"   # gone with the DNSConfig
    assert "status" not in kube.obj(DNSCONFIGS, "ts-dns")                    # no address yet: not ready
    allocate_cluster_ip(kube)
    await dns.reconcile()
    obj = kube.obj(DNSCONFIGS, "ts-dns")
    assert obj["status"]["nameserver"] == {"ip": "10.96.0.53"}
    assert (cond(obj)["status"], cond(obj)["reason"]) == ("True", "NameserverCreated")
    kube.calls.clear()
    await dns.reconcile()
    assert kube.writes() == []                                                # a pass with no change writes nothing


async def test_records_follow_pods_and_go_with_their_parents(env):
    kube, rec, dns = env
    dnsconfig(kube)
    hl = await egress(kube, rec)
    await dns.reconcile()
    assert records(kube)["ip4"] == {}                      # no ready Pod yet: no record
    slice_for(kube, hl, [("10.244.0.7", True)])
    await dns.reconcile()
    assert records(kube)["ip4"] == {"db.tail.example": ["10.244.0.7"]}
    slice_for(kube, hl, [("10.244.0.12", True)])           # the Pod moved
    await dns.reconcile()
    assert records(kube)["ip4"] == {"db.tail.example": ["10.244.0.12"]}
    kube.objects[("services", "apps", "db")]["metadata"]["annotations"] = {"tailscale.com/tailnet-fqdn":
                                                                             "db2.tail.example"}
    await dns.reconcile()
    assert records(kube)["ip4"] == {"db2.tail.example": ["10.244.0.12"]}
    await kube.delete(SERVICES, "db", "apps")              # the parent goes: its record goes at once
    await dns.reconcile()
    assert records(kube)["ip4"] == {}


async def test_second_dnsconfig_is_refused_and_changes_nothing(env):
    kube, rec, dns = env
    dnsconfig(kube, "first", "2026-01-01T00:00:00Z")
    await dns.reconcile()
    allocate_cluster_ip(kube)
    await dns.reconcile()
    dnsconfig(kube, "second", "2026-01-02T00:00:00Z", service={"clusterIP": "10.96.0.99"})
    kube.calls.clear()
    await dns.reconcile()
    second = kube.obj(DNSCONFIGS, "second")
    assert (cond(second)["status"], cond(second)["reason"]) == ("False", "MultipleDNSConfigsPresent")
    assert cond(kube.obj(DNSCONFIGS, "first"))["status"] == "True"
    assert kube.obj(SERVICES, "nameserver", "tailscale")["spec"]["clusterIP"] == "10.96.0.53"
    ev = [e for e in kube.of(EVENTS) if e["involvedObject"]["name"] == "second"]
    assert len(ev) == 1 and ev[0]["type"] == "Warning" and ev[0]["reason"] == "MultipleDNSConfigsPresent"
    await dns.reconcile()
    assert len([e for e in kube.of(EVENTS) if e["involvedObject"]["name"] == "second"]) == 1   # once


async def test_invalid_cluster_ip_condition_names_it_and_nothing_is_created(env):
    kube, rec, dns = env
    dnsconfig(kube, service={"clusterIP": "10.96.0.300"})
    await dns.reconcile()
    c = cond(kube.obj(DNSCONFIGS, "ts-dns"))
    assert c["status"] == "False" and "spec.nameserver.service.clusterIP '10.96.0.300'" in c["message"]
    assert kube.of(DEPLOYMENTS) == [] and kube.of(CONFIGMAPS) == [] and kube.of(SERVICES) == []
    assert [e["reason"] for e in kube.of(EVENTS)] == ["NameserverCreationFailed"]


async def test_changed_cluster_ip_moves_the_service(env):
    kube, rec, dns = env
    dnsconfig(kube, service={"clusterIP": "10.96.0.53"})
    await dns.reconcile()
    kube.objects[("dnsconfigs", "", "ts-dns")]["spec"]["nameserver"]["service"]["clusterIP"] = "10.96.0.54"
    await dns.reconcile()
    assert kube.obj(SERVICES, "nameserver", "tailscale")["spec"]["clusterIP"] == "10.96.0.54"
    assert kube.obj(DNSCONFIGS, "ts-dns")["status"]["nameserver"] == {"ip": "10.96.0.54"}


async def test_placement_replicas_and_image(env):
    kube, rec, dns = env
    dnsconfig(kube, replicas=2, image={"repo": "registry.example/nameserver", "tag": "v1.80"},
              pod={"nodeSelector": {"kubernetes.io/os": "linux"}, "tolerations": [{"operator": "Exists"}]})
    await dns.reconcile()
    dep = kube.obj(DEPLOYMENTS, "nameserver", "tailscale")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 2 and pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"] == [{"operator": "Exists"}]
    c = pod["containers"][0]
    assert c["image"] == "registry.example/nameserver:v1.80" and "command" not in c   # its own entrypoint
    assert dc.image({"spec": {"nameserver": {"image": {"tag": "2"}}}}, CFG) == ("registry.local/proxy:2", True)


async def test_no_crd_no_work(env):
    kube, rec, dns = env
    kube.fail_next.append(KubeError("404", status=404, reason="NotFound"))
    assert await dns.reconcile() is None


async def test_stub_zone_only_its_own_block_added_and_removed(env):
    kube, rec, _ = env
    cfg = dataclasses.replace(CFG, stub_zone_configmap="kube-system/coredns")
    dns = dns_pass(Reconciler(kube, FakeProvider(), cfg, now=lambda: "2026-01-01T00:00:00Z"))
    kube.put(CONFIGMAPS, {"metadata": {"name": "coredns", "namespace": "kube-system"},
                          "data": {"Corefile": COREFILE, "other": "x"}})
    dnsconfig(kube)
    await dns.reconcile()
    allocate_cluster_ip(kube)
    await dns.reconcile()
    core = kube.obj(CONFIGMAPS, "coredns", "kube-system")["data"]
    assert core["Corefile"].startswith(COREFILE) and core["other"] == "x"
    assert "tail.example:53 {\n    errors\n    forward . 10.96.0.53\n}" in core["Corefile"]
    kube.calls.clear()
    await dns.reconcile()
    assert kube.writes() == []
    await kube.delete(DNSCONFIGS, "ts-dns")
    await dns.reconcile()
    assert kube.obj(CONFIGMAPS, "coredns", "kube-system")["data"]["Corefile"] == COREFILE


def test_with_stub_zone_round_trips_and_keeps_the_rest_byte_for_byte():
    added = dc.with_stub_zone(COREFILE, "tail.example", "10.96.0.53")
    assert dc.with_stub_zone(added, "tail.example", "10.96.0.53") == added
    moved = dc.with_stub_zone(added, "tail.example", "10.96.0.54")
    assert moved.count(dc.STUB_BEGIN) == 1 and "10.96.0.54" in moved and "10.96.0.53" not in moved
    assert dc.with_stub_zone(moved, "", "") == COREFILE
    middle = added + "example.org:53 {\n    whoami\n}\n"
    assert dc.with_stub_zone(middle, "", "") == COREFILE + "example.org:53 {\n    whoami\n}\n"
    assert dc.with_stub_zone("", "tail.example", "10.0.0.1").startswith(dc.STUB_BEGIN)
    assert dc.with_stub_zone(COREFILE.rstrip("\n"), "", "") == COREFILE.rstrip("\n")


def test_domain_from_the_setting_or_the_names():
    assert dc.domain(CFG, []) == "tail.example"
    bare = dataclasses.replace(CFG, magicdns_suffix="")
    assert dc.domain(bare, ["db.tail.example", "web.tail.example"]) == "tail.example"
    assert dc.domain(bare, ["db.a.example", "web.b.example"]) == ""
    assert dc.domain(bare, []) == ""


def test_stub_zone_setting_is_validated():
    assert load({"DNS_STUB_ZONE_CONFIGMAP": "kube-system/coredns"}).stub_zone_configmap == "kube-system/coredns"
    with pytest.raises(ConfigError, match="DNS_STUB_ZONE_CONFIGMAP='coredns'"):
        load({"DNS_STUB_ZONE_CONFIGMAP": "coredns"})


async def test_proxygroup_egress_service_resolves_to_its_clusterip_service(env):
    kube, rec, dns = env
    dnsconfig(kube)
    kube.put(SERVICES, {"metadata": {"name": "pg-db", "namespace": "apps",
                                     "annotations": {"tailscale.com/tailnet-fqdn": "pgdb.tail.example",
                                                     "tailscale.com/proxy-group": "egress"}},
                        "spec": {"type": "ExternalName", "externalName": "ts-pg-db-x.tailscale.svc.cluster.local"}})
    kube.put(SERVICES, {"metadata": {"name": "ts-pg-db-x", "namespace": "tailscale", "labels": {
        "tailscale.com/managed": "true", "tailscale.com/parent-resource": "pg-db",
        "tailscale.com/parent-resource-ns": "apps", "tailscale.com/parent-resource-type": "svc",
        "tailscale.com/proxy-group": "egress", "tailscale.com/svc-type": "egress"}},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.7.7", "clusterIPs": ["10.96.7.7"]}})
    await dns.reconcile()
    assert records(kube)["ip4"] == {"pgdb.tail.example": ["10.96.7.7"]}
    # a Service of the controller's that is neither a proxy's headless Service nor a group's egress one: no record
    kube.objects[("services", "tailscale", "ts-pg-db-x")]["metadata"]["labels"]["tailscale.com/svc-type"] = "other"
    await dns.reconcile()
    assert records(kube)["ip4"] == {}


async def test_upstreams_nameserver_image_off_ts_net_is_refused(env):
    """Upstream's nameserver answers only under ts.net: with this tailnet's domain (tail.example) it would answer
    nothing, so the DNSConfig is refused, saying so, and nothing is created."""
    kube, rec, dns = env
    dnsconfig(kube, image={"repo": "tailscale/k8s-nameserver", "tag": "v1.102.3"})
    await dns.reconcile()
    c = cond(kube.obj(DNSCONFIGS, "ts-dns"))
    assert (c["status"], c["reason"]) == ("False", "NameserverCreationFailed")
    assert "is upstream's nameserver, which answers only names under ts.net" in c["message"]
    assert "'tail.example'" in c["message"] and "remove spec.nameserver.image" in c["message"]
    assert kube.of(DEPLOYMENTS) == []
    assert [e["type"] for e in kube.of(EVENTS)] == ["Warning"]
