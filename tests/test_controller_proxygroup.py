"""ProxyGroups and their egress Services: the kind's validation, rendering, port allocation, EndpointSlice
membership, and whole passes against the in-memory API server (what appears, what a second pass sends, scale
down, deletion, invalid input, removal)."""
from __future__ import annotations

import asyncio
import base64
import json

import pytest

from containerboot.proxyservices import parse_egress_services, parse_hep_pings
from controller import pgrender
from controller.config import ControllerConfig
from controller.kinds import egress, proxygroup
from controller.kinds.egress import Port, Replica
from controller.kubeapi import (
    CONFIGMAPS,
    ENDPOINTSLICES,
    EVENTS,
    PODS,
    PROXYGROUPS,
    ROLES,
    SECRETS,
    SERVICES,
    STATEFULSETS,
)
from controller.model import Invalid
from controller.reconcile import Reconciler
from tests.support.fakekube import FakeKube, FakeProvider

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1",
                       login_server="http://hs.test:8080")
NS = "tailscale"


def pg_obj(name="pg", **spec):
    return {"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyGroup",
            "metadata": {"name": name, "uid": f"uid-{name}", "generation": 1},
            "spec": {"type": "egress", **spec}}


# ---- the kind


def test_decide_defaults_are_upstreams():
    g = proxygroup.decide(pg_obj(), CFG)
    assert (g.replicas, g.hostname_prefix, g.tags, g.type) == (2, "pg", ("tag:k8s",), "egress")
    g = proxygroup.decide(pg_obj(replicas=3, hostnamePrefix="egr", tags=["tag:a"]), CFG)
    assert (g.replicas, g.hostname_prefix, g.tags) == (3, "egr", ("tag:a",))


@pytest.mark.parametrize("pg_type", ["ingress", "kube-apiserver"])
def test_ingress_and_apiserver_types_are_refused_saying_why(pg_type):
    with pytest.raises(Invalid) as hs:
        proxygroup.decide(pg_obj(type=pg_type), CFG, "headscale")
    assert "headscale provides neither" in hs.value.message and f"spec.type={pg_type!r}" in hs.value.message
    assert "Tailscale Services" in hs.value.message and "use type egress" in hs.value.message
    with pytest.raises(Invalid) as ts:
        proxygroup.decide(pg_obj(type=pg_type), CFG, "tailscale")
    assert "not supported by this controller yet" in ts.value.message


def test_invalid_fields_are_named():
    with pytest.raises(Invalid) as e:
        proxygroup.decide(pg_obj(replicas=-1, tags=["k8s"], hostnamePrefix="Bad_"), CFG)
    assert "spec.replicas=-1" in e.value.message and "spec.tags" in e.value.message
    assert "spec.hostnamePrefix" in e.value.message


# ---- rendering


def test_statefulset_env_mounts_hook_and_grace():
    g = proxygroup.decide(pg_obj(replicas=2), CFG)
    sts = pgrender.statefulset(g, CFG)
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["TS_KUBE_SECRET"] == "$(POD_NAME)"
    assert env["TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR"] == "/etc/tsconfig/$(POD_NAME)"
    assert env["TS_EGRESS_PROXIES_CONFIG_PATH"] == "/etc/proxies"
    assert env["TS_INTERNAL_APP"] == "k8s-operator-proxygroup-egress"
    assert env["TS_ENABLE_HEALTH_CHECK"] == "true" and env["TS_LOCAL_ADDR_PORT"] == "$(POD_IP):9002"
    assert env["POD_IPS"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIPs"}}
    assert c["lifecycle"]["preStop"]["httpGet"] == {"path": "/internal-egress-services-preshutdown", "port": 9002}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 9002}
    assert pod["terminationGracePeriodSeconds"] >= 310       # the hook's 300 s wait and 10 s settle fit
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"/etc/tsconfig/pg-0", "/etc/tsconfig/pg-1", "/etc/proxies"}
    secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"pg-0-config", "pg-1-config"}
    assert pod["serviceAccountName"] == "pg" and sts["spec"]["replicas"] == 2


def test_role_names_only_state_secrets_and_config_is_upstream_shape():
    g = proxygroup.decide(pg_obj(replicas=2), CFG)
    sa, role, rb = pgrender.rbac(g, CFG, ["pg-0", "pg-1"])
    (secret_rule,) = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    assert secret_rule["resourceNames"] == ["pg-0", "pg-1"] and "list" not in secret_rule["verbs"]
    conf = json.loads(pgrender.config_secret(g, CFG, 1, "tskey-x")["stringData"]["cap-107.hujson"])
    assert conf["Hostname"] == "pg-1" and conf["AuthKey"] == "tskey-x"
    cm = pgrender.configmap(g, CFG)
    assert cm["metadata"]["name"] == "pg-egress-config" and parse_hep_pings(cm["data"]["hep-pings"]) == 6


# ---- allocation and membership


def test_allocation_is_lowest_free_stable_and_avoids_reserved_and_others():
    a, b = Port("a", "TCP", 80), Port("b", "UDP", 53)
    first = egress.allocate([a, b], {}, used=set())
    assert first == {("TCP", 80): 3000, ("UDP", 53): 3001}
    # stable: the same answer with its own current mapping, whatever else is free now
    assert egress.allocate([a, b], first, used={3002}) == first
    # a port taken by another Service (e.g. an edit by hand) is moved; the other stays
    assert egress.allocate([a, b], first, used={3000}) == {("TCP", 80): 3002, ("UDP", 53): 3001}
    used = set(range(egress.PORT_MIN, 9001)) | set(range(9003, egress.PORT_MAX))
    with pytest.raises(Invalid, match="no free port left"):
        egress.allocate([a], {}, used=used)
    assert egress.allocate([a], {}, used=set(range(egress.PORT_MIN, 9001)))[("TCP", 80)] == 9003


WANT = {"tailnetTarget": {"ip": "100.64.0.5"}, "ports": [{"protocol": "TCP", "matchPort": 3000, "targetPort": 80}]}


def status(v4="10.0.0.1", v6="", services=None):
    return {"podIPv4": v4, "podIPv6": v6, "services": services if services is not None else {
        "apps-db": {"tailnetTarget": {"ip": "100.64.0.5", "fqdn": ""}, "tailnetTargetIPs": ["100.64.0.5"],
                    "ports": [{"protocol": "TCP", "matchPort": 3000, "targetPort": 80}]}}}


def test_membership_only_replicas_reporting_the_rules_from_their_current_pod():
    ok = Replica("pg-0", ("10.0.0.1", "fd00::1"), status(v6="fd00::1"))
    stale_pod = Replica("pg-1", ("10.0.0.9",), status(v4="10.0.0.2"))           # a previous Pod's report
    other_ports = Replica("pg-2", ("10.0.0.3",), status(v4="10.0.0.3", services={"apps-db": {
        "tailnetTarget": {"ip": "100.64.0.5"}, "ports": [{"protocol": "TCP", "matchPort": 3001, "targetPort": 80}]}}))
    not_yet = Replica("pg-3", ("10.0.0.4",), status(v4="10.0.0.4", services={}))
    terminating = Replica("pg-4", (), status(v4="10.0.0.5"))
    rs = [ok, stale_pod, other_ports, not_yet, terminating]
    assert egress.addresses(rs, "apps-db", WANT, "IPv4") == ["10.0.0.1"]
    assert egress.addresses(rs, "apps-db", WANT, "IPv6") == ["fd00::1"]
    assert egress.addresses(rs, "apps-db", None, "IPv4") == []
    # protocol spelling and key order do not matter; the target does
    lower = Replica("pg-0", ("10.0.0.1",), status(services={"apps-db": {
        "tailnetTarget": {"fqdn": "", "ip": "100.64.0.5"},
        "ports": [{"protocol": "tcp", "matchPort": 3000, "targetPort": 80}]}}))
    assert egress.addresses([lower], "apps-db", WANT, "IPv4") == ["10.0.0.1"]
    moved = {**WANT, "tailnetTarget": {"ip": "100.64.0.6"}}
    assert egress.addresses([lower], "apps-db", moved, "IPv4") == []


# ---- whole passes


@pytest.fixture
def env():
    kube, prov = FakeKube(), FakeProvider()
    clock = iter(f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z" for i in range(3600))
    return kube, prov, Reconciler(kube, prov, CFG, now=lambda: next(clock))


def secret_data(kube, name):
    return {k: base64.b64decode(v) for k, v in (kube.obj(SECRETS, name, NS).get("data") or {}).items()}


def agent_reports(kube, name, **data: bytes):
    s = kube.obj(SECRETS, name, NS)
    s["data"] = {**(s.get("data") or {}), **{k.replace("_", "-") if k == "egress_services" else k:
                                             base64.b64encode(v).decode() for k, v in data.items()}}


def run_pod(kube, name, v4, v6="", ready=True):
    ips = [{"ip": v4}] + ([{"ip": v6}] if v6 else [])
    kube.put(PODS, {"metadata": {"name": name, "namespace": NS, "labels": pgrender.labels(
        proxygroup.decide(pg_obj(), CFG))}, "status": {"phase": "Running", "podIP": v4, "podIPs": ips,
                                                       "conditions": [{"type": "Ready",
                                                                       "status": str(ready)}]}})


def register(kube, prov, i, dev):
    agent_reports(kube, f"pg-{i}", device_id=dev.encode(), device_fqdn=f"pg-{i}.tail.example.".encode(),
                  device_ips=json.dumps([f"100.64.0.{10 + i}"]).encode())
    prov.tags[dev] = ("tag:k8s",)


async def test_group_pass_renders_everything_once_and_keeps_keys(env):
    kube, prov, rec = env
    kube.put(PROXYGROUPS, pg_obj())
    await rec.reconcile("proxygroup", "", "pg")
    assert len(prov.keys) == 2
    assert kube.obj(PROXYGROUPS, "pg")["metadata"]["finalizers"] == ["tailscale.com/finalizer"]
    for n in ("pg-0", "pg-1", "pg-0-config", "pg-1-config"):
        assert kube.obj(SECRETS, n, NS) is not None
    assert json.loads(secret_data(kube, "pg-1-config")["cap-107.hujson"])["AuthKey"] == prov.keys[1][0]
    assert kube.obj(STATEFULSETS, "pg", NS)["spec"]["replicas"] == 2
    cm = kube.obj(CONFIGMAPS, "pg-egress-config", NS)
    assert cm["data"] == {"egress-services": "{}", "hep-pings": "6"}
    assert kube.obj(ROLES, "pg", NS)["rules"][0]["resourceNames"] == ["pg-0", "pg-1"]
    cond = {c["type"]: c for c in kube.obj(PROXYGROUPS, "pg")["status"]["conditions"]}
    assert cond["ProxyGroupReady"]["status"] == "False" and cond["ProxyGroupReady"]["reason"] == "ProxyGroupCreating"
    # a second pass: no key, no write
    before = len(kube.writes())
    await rec.reconcile("proxygroup", "", "pg")
    assert len(prov.keys) == 2 and kube.writes()[before:] == []
    # the replicas register: devices in the status, ready; still no new key
    register(kube, prov, 0, "11")
    register(kube, prov, 1, "12")
    kube.objects[("statefulsets", NS, "pg")]["status"] = {"readyReplicas": 2}
    await rec.reconcile("proxygroup", "", "pg")
    st = kube.obj(PROXYGROUPS, "pg")["status"]
    assert st["devices"] == [{"hostname": "pg-0.tail.example", "tailnetIPs": ["100.64.0.10"]},
                             {"hostname": "pg-1.tail.example", "tailnetIPs": ["100.64.0.11"]}]
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["ProxyGroupReady"]["status"] == "True" and cond["ProxyGroupAvailable"]["status"] == "True"
    assert len(prov.keys) == 2


async def test_scale_up_mints_only_for_the_new_replica_and_scale_down_waits_for_the_pod(env):
    kube, prov, rec = env
    kube.put(PROXYGROUPS, pg_obj())
    await rec.reconcile("proxygroup", "", "pg")
    register(kube, prov, 0, "11")
    register(kube, prov, 1, "12")
    kube.objects[("proxygroups", "", "pg")]["spec"]["replicas"] = 3
    await rec.reconcile("proxygroup", "", "pg")
    assert len(prov.keys) == 3 and kube.obj(SECRETS, "pg-2-config", NS) is not None
    assert kube.obj(ROLES, "pg", NS)["rules"][0]["resourceNames"] == ["pg-0", "pg-1", "pg-2"]
    register(kube, prov, 2, "13")
    run_pod(kube, "pg-2", "10.0.0.3")
    kube.objects[("proxygroups", "", "pg")]["spec"]["replicas"] = 1
    assert await rec.reconcile("proxygroup", "", "pg") == 2.0
    # pg-2's Pod is still shutting down: its Secret stays (and in the Role); pg-1's Pod is gone
    assert kube.obj(SECRETS, "pg-2", NS) is not None and kube.obj(SECRETS, "pg-1", NS) is None
    assert kube.obj(SECRETS, "pg-1-config", NS) is None and prov.deleted == ["12"]
    assert kube.obj(ROLES, "pg", NS)["rules"][0]["resourceNames"] == ["pg-0", "pg-2"]
    del kube.objects[("pods", NS, "pg-2")]
    await rec.reconcile("proxygroup", "", "pg")
    assert prov.deleted == ["12", "13"] and kube.obj(SECRETS, "pg-2", NS) is None
    assert kube.obj(ROLES, "pg", NS)["rules"][0]["resourceNames"] == ["pg-0"]
    assert kube.obj(CONFIGMAPS, "pg-egress-config", NS)["data"]["hep-pings"] == "3"
    assert len(prov.keys) == 3


async def test_deleting_the_group_deletes_everything_with_devices(env):
    kube, prov, rec = env
    kube.put(PROXYGROUPS, pg_obj())
    await rec.reconcile("proxygroup", "", "pg")
    register(kube, prov, 0, "11")
    kube.objects[("proxygroups", "", "pg")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert await rec.reconcile("proxygroup", "", "pg") == 2.0        # the StatefulSet goes first
    kube.finish_deletions()
    assert await rec.reconcile("proxygroup", "", "pg") is None
    assert prov.deleted == ["11"] and kube.obj(PROXYGROUPS, "pg") is None
    left = [k for k in kube.objects if k[1] == NS]
    assert left == []


async def test_invalid_type_gets_a_condition_and_an_event_and_nothing_else(env):
    kube, prov, rec = env
    kube.put(PROXYGROUPS, pg_obj(type="ingress"))
    await rec.reconcile("proxygroup", "", "pg")
    cond = {c["type"]: c for c in kube.obj(PROXYGROUPS, "pg")["status"]["conditions"]}["ProxyGroupReady"]
    assert cond["status"] == "False" and cond["reason"] == "ProxyGroupInvalid"
    assert "not supported" in cond["message"]
    assert [e["reason"] for e in kube.of(EVENTS)] == ["ProxyGroupInvalid"]
    assert prov.keys == [] and not [k for k in kube.objects if k[1] == NS]


def egress_svc(kube, name="db", ns="apps", ann=None, ports=None, **spec):
    a = {"tailscale.com/proxy-group": "pg", "tailscale.com/tailnet-ip": "100.64.0.5"} if ann is None else ann
    return kube.put(SERVICES, {"metadata": {"name": name, "namespace": ns, "annotations": a},
                               "spec": {"type": "ExternalName", "externalName": "placeholder",
                                        "ports": ports if ports is not None else [{"port": 80, "protocol": "TCP"}],
                                        **spec}})


async def ready_group(kube, prov, rec):
    kube.put(PROXYGROUPS, pg_obj())
    await rec.reconcile("proxygroup", "", "pg")
    for i in range(2):
        register(kube, prov, i, str(11 + i))
        run_pod(kube, f"pg-{i}", f"10.0.0.{i + 1}", f"fd00::{i + 1}")


def egress_objects(kube, name="db"):
    from controller.model import Parent
    from controller.render import base_name
    svc = kube.obj(SERVICES, name, "apps")
    cip = base_name(Parent("svc", name, "apps", svc["metadata"]["uid"]))
    return cip, kube.obj(SERVICES, cip, NS), kube.obj(ENDPOINTSLICES, f"{cip}-ipv4", NS)


async def test_egress_service_on_a_group_end_to_end_with_membership(env):
    kube, prov, rec = env
    await ready_group(kube, prov, rec)
    egress_svc(kube, ports=[{"name": "http", "port": 80, "protocol": "TCP"}, {"port": 53, "protocol": "UDP"}])
    assert await rec.reconcile("svc", "apps", "db") is None
    cip, svc, eps = egress_objects(kube)
    assert [(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [(80, 3000), (53, 3001), (9002, 9002)]
    assert svc["metadata"]["labels"]["tailscale.com/proxy-group"] == "pg"
    # the ConfigMap entry is what the agent reads (its own parser accepts it)
    cm = kube.obj(CONFIGMAPS, "pg-egress-config", NS)
    parsed = parse_egress_services(cm["data"]["egress-services"])
    assert parsed.problems == () and [s.name for s in parsed.services] == ["apps-db"]
    (s,) = parsed.services
    assert s.target_ip == "100.64.0.5" and [(p.match_port, p.target_port) for p in s.ports] == [(3000, 80), (3001, 53)]
    assert s.health_check_endpoint == f"http://{cip}.tailscale.svc.cluster.local:9002/healthz"
    # no replica reports it yet: an empty slice that kube-proxy follows
    assert eps["endpoints"] == [] and eps["metadata"]["labels"]["kubernetes.io/service-name"] == cip
    assert {p["port"] for p in eps["ports"]} == {3000, 3001, 9002}
    user = kube.obj(SERVICES, "db", "apps")
    assert user["spec"]["externalName"] == f"{cip}.tailscale.svc.cluster.local"
    conds = {c["type"]: c for c in user["status"]["conditions"]}
    assert conds["TailscaleEgressSvcValid"]["status"] == "True"
    assert conds["TailscaleEgressSvcConfigured"]["reason"] == "ConfiguredFor:ProxyGroup:pg"
    # replica 0 applies the rules; its state Secret says so: the group's pass lists it, and only it
    entry = json.loads(cm["data"]["egress-services"])["apps-db"]
    report = {"podIPv4": "10.0.0.1", "podIPv6": "fd00::1", "services": {"apps-db": {
        "tailnetTarget": {"ip": "100.64.0.5", "fqdn": ""}, "ports": entry["ports"], "tailnetTargetIPs": []}}}
    agent_reports(kube, "pg-0", **{"egress-services": json.dumps(report).encode()})
    await rec.reconcile("proxygroup", "", "pg")
    _, _, eps = egress_objects(kube)
    assert [e["addresses"] for e in eps["endpoints"]] == [["10.0.0.1"]]
    # the group's pass queues the user's Service, whose TailscaleEgressSvcReady follows (upstream's condition)
    assert conds["TailscaleEgressSvcReady"]["status"] == "False"
    await rec.reconcile("svc", "apps", "db")
    ready = {c["type"]: c for c in kube.obj(SERVICES, "db", "apps")["status"]["conditions"]}["TailscaleEgressSvcReady"]
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "True", "PartiallyReadyToRouteTraffic", "1 out of 2 replicas are ready to route traffic")
    # a second pass of either writes nothing
    before = len(kube.writes())
    await rec.reconcile("proxygroup", "", "pg")
    await rec.reconcile("svc", "apps", "db")
    assert kube.writes()[before:] == []
    # the replica's Pod is not Ready (its tailscaled died, its node is lost): it leaves the slice, and comes
    # back once Ready again (its rules are still reported)
    run_pod(kube, "pg-0", "10.0.0.1", "fd00::1", ready=False)
    await rec.reconcile("proxygroup", "", "pg")
    assert egress_objects(kube)[2]["endpoints"] == []
    run_pod(kube, "pg-0", "10.0.0.1", "fd00::1")
    await rec.reconcile("proxygroup", "", "pg")
    assert [e["addresses"] for e in egress_objects(kube)[2]["endpoints"]] == [["10.0.0.1"]]
    # the replica's Pod terminates: it leaves the slice at once (its pre-stop drain waits for that)
    kube.objects[("pods", NS, "pg-0")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await rec.reconcile("proxygroup", "", "pg")
    assert egress_objects(kube)[2]["endpoints"] == []


async def test_two_services_get_distinct_ports_and_removal_removes_only_its_own(env):
    kube, prov, rec = env
    await ready_group(kube, prov, rec)
    egress_svc(kube, "a")
    egress_svc(kube, "b", ann={"tailscale.com/proxy-group": "pg", "tailscale.com/tailnet-fqdn": "web.ts.net."},
               ports=[{"port": 80, "protocol": "TCP"}])
    b_fqdn = "web.tail.ts.net"
    kube.objects[("services", "apps", "b")]["metadata"]["annotations"]["tailscale.com/tailnet-fqdn"] = b_fqdn
    await rec.reconcile("svc", "apps", "a")
    await rec.reconcile("svc", "apps", "b")
    entries = json.loads(kube.obj(CONFIGMAPS, "pg-egress-config", NS)["data"]["egress-services"])
    assert entries["apps-a"]["ports"][0]["matchPort"] == 3000 and entries["apps-b"]["ports"][0]["matchPort"] == 3001
    assert entries["apps-b"]["tailnetTarget"] == {"fqdn": b_fqdn}
    a_cip, a_svc, _ = egress_objects(kube, "a")
    # the annotations go: a's entry, ClusterIP Service and slices go, the finalizer too; b is untouched
    kube.objects[("services", "apps", "a")]["metadata"]["annotations"] = {}
    b_before = egress_objects(kube, "b")
    await rec.reconcile("svc", "apps", "a")
    entries = json.loads(kube.obj(CONFIGMAPS, "pg-egress-config", NS)["data"]["egress-services"])
    assert list(entries) == ["apps-b"]
    assert kube.obj(SERVICES, a_cip, NS) is None and kube.obj(ENDPOINTSLICES, f"{a_cip}-ipv4", NS) is None
    a = kube.obj(SERVICES, "a", "apps")
    assert not a["metadata"].get("finalizers") and not (a.get("status") or {}).get("conditions")
    assert egress_objects(kube, "b") == b_before
    # b is deleted: its objects go and the finalizer is released
    kube.objects[("services", "apps", "b")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await rec.reconcile("svc", "apps", "b")
    assert json.loads(kube.obj(CONFIGMAPS, "pg-egress-config", NS)["data"]["egress-services"]) == {}
    assert kube.obj(SERVICES, "b", "apps") is None
    assert [o for o in kube.of(SERVICES) if o["metadata"]["namespace"] == NS] == []
    assert kube.of(ENDPOINTSLICES) == []


async def test_a_group_pass_between_a_deleted_services_cleanup_steps_does_not_bring_its_slices_back(env):
    """The group's pass (brought by the replicas' reports, which follow the ConfigMap the cleanup just changed)
    runs while a deleted egress Service's cleanup is between deleting its EndpointSlices and its ClusterIP
    Service: it must not write the slices again, for nothing would remove them after the finalizer is gone."""
    kube, prov, rec = env
    await ready_group(kube, prov, rec)
    egress_svc(kube, "a")
    egress_svc(kube, "b")
    await rec.reconcile("svc", "apps", "a")
    await rec.reconcile("svc", "apps", "b")
    b_cip, _, _ = egress_objects(kube, "b")
    kube.objects[("services", "apps", "b")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    delete, group_pass = kube.delete, []

    async def delete_then_the_group_pass_runs(res, name, namespace="", **kw):
        out = await delete(res, name, namespace, **kw)
        if res == ENDPOINTSLICES and name.startswith(b_cip) and not group_pass:
            group_pass.append(asyncio.ensure_future(rec.reconcile("proxygroup", "", "pg")))
            # every step the group pass can take now (none while it waits for the cleanup): no time passes
            for _ in range(50):
                await asyncio.sleep(0)   # not a wait: one turn of the loop, one step of the group pass
        return out
    kube.delete = delete_then_the_group_pass_runs
    await rec.reconcile("svc", "apps", "b")
    await group_pass[0]
    assert kube.obj(SERVICES, "b", "apps") is None
    assert [o["metadata"]["name"] for o in kube.of(ENDPOINTSLICES)] == [f"{egress_objects(kube, 'a')[0]}-ipv4"]


@pytest.mark.parametrize("ann,ports,stype,group,fragment", [
    ({"tailscale.com/tailnet-ip": "100.64.0.5"}, [], "ExternalName", "pg", "spec.ports is empty"),
    ({"tailscale.com/tailnet-ip": "100.64.0.5", "tailscale.com/tailnet-fqdn": "a.b.ts.net"}, None, "ExternalName",
     "pg", "both tailscale.com/tailnet-ip and tailscale.com/tailnet-fqdn"),
    ({"tailscale.com/tailnet-ip": "100.64.0.5"}, None, "ExternalName", "nope", "ProxyGroup 'nope' does not exist"),
    ({"tailscale.com/tailnet-ip": "100.64.0.5"}, None, "ExternalName", "ing", "is of type 'ingress'"),
    ({"tailscale.com/tailnet-ip": "100.64.0.5"}, None, "ClusterIP", "pg", "must be of type ExternalName"),
])
async def test_invalid_egress_service_condition_event_nothing_made(env, ann, ports, stype, group, fragment):
    kube, prov, rec = env
    await ready_group(kube, prov, rec)
    kube.put(PROXYGROUPS, pg_obj("ing", type="ingress"))
    egress_svc(kube, ann={"tailscale.com/proxy-group": group, **ann}, ports=ports, type=stype)
    before = {k for k in kube.objects if k[1] == NS}
    assert await rec.reconcile("svc", "apps", "db") is None
    cond = {c["type"]: c for c in kube.obj(SERVICES, "db", "apps")["status"]["conditions"]}
    valid = cond["TailscaleEgressSvcValid"]
    assert valid["status"] == "False" and fragment in valid["message"]
    assert "TailscaleEgressSvcConfigured" not in cond
    (ev,) = [e for e in kube.of(EVENTS) if e["involvedObject"]["name"] == "db"]
    assert ev["type"] == "Warning" and fragment in ev["message"]
    assert {k for k in kube.objects if k[1] == NS} == before
    assert json.loads(kube.obj(CONFIGMAPS, "pg-egress-config", NS)["data"]["egress-services"]) == {}
    assert kube.obj(SERVICES, "db", "apps")["spec"]["externalName"] == "placeholder"


# ---- a ProxyClass on a group

def pclass(name="prod", spec=None):
    return {"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyClass",
            "metadata": {"name": name, "uid": f"pc-{name}", "generation": 1}, "spec": spec or {}}


PG_CLASS = {"statefulSet": {"labels": {"team": "net"}, "pod": {
    "labels": {"tier": "edge", "tailscale.com/parent-resource": "hijack"},
    "nodeSelector": {"pool": "edge"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ts", "effect": "NoSchedule"}],
    "tailscaleContainer": {"env": [{"name": "TS_DEBUG_X", "value": "1"}],
                           "resources": {"requests": {"cpu": "5m"}}}}},
    "metrics": {"enable": True}}


def test_a_class_on_a_group_is_the_same_merge_exactly_and_keeps_the_selector_labels():
    from controller.kinds import proxyclass as pcl
    from controller.render import SPEC_HASH
    g = proxygroup.decide(pg_obj(replicas=2), CFG)
    base = pgrender.statefulset(g, CFG)
    got = pgrender.statefulset(g, CFG, pcl.ProxyClass.from_object(pclass(spec=PG_CLASS)))
    want = json.loads(json.dumps(base))
    ours = pgrender.labels(g)
    want["metadata"]["labels"] = {"team": "net", **ours}
    want["spec"]["template"]["metadata"]["labels"] = {"tier": "edge", **ours}     # the hijack lost
    pod = want["spec"]["template"]["spec"]
    pod["nodeSelector"] = {"pool": "edge"}
    pod["tolerations"] = [{"key": "dedicated", "operator": "Equal", "value": "ts", "effect": "NoSchedule"}]
    (c,) = pod["containers"]
    c["resources"] = {"requests": {"cpu": "5m"}}
    # upstream's order: the endpoints (a group has no single egress target, so they apply), then the class's env
    c["env"] += [{"name": "TS_DEBUG_ADDR_PORT", "value": "$(POD_IP):9001"},
                 {"name": "TS_TAILSCALED_EXTRA_ARGS", "value": "--debug=$(TS_DEBUG_ADDR_PORT)"},
                 {"name": "TS_LOCAL_ADDR_PORT", "value": "$(POD_IP):9002"},
                 {"name": "TS_ENABLE_METRICS", "value": "true"},
                 {"name": "TS_DEBUG_X", "value": "1"}]
    c["ports"] = [{"name": "debug", "protocol": "TCP", "containerPort": 9001},
                  {"name": "metrics", "protocol": "TCP", "containerPort": 9002}]
    for o in (got, want):
        o["metadata"]["annotations"].pop(SPEC_HASH)
    assert got == want
    assert got["spec"]["selector"]["matchLabels"] == ours
    # the class changes the rendering's hash: the StatefulSet is patched and its Pods roll
    assert pgrender.statefulset(g, CFG, pcl.ProxyClass.from_object(pclass(spec=PG_CLASS)))["metadata"][
        "annotations"][SPEC_HASH] != base["metadata"]["annotations"][SPEC_HASH]


def test_a_class_setting_ts_local_addr_port_removes_the_pre_stop_hook_its_grace_and_the_probe_only():
    from controller.kinds import proxyclass as pcl
    from controller.render import SPEC_HASH
    g = proxygroup.decide(pg_obj(replicas=2), CFG)
    spec = {"statefulSet": {"pod": {"tailscaleContainer": {"env": [
        {"name": "TS_LOCAL_ADDR_PORT", "value": "[::]:9999"}]}}}}
    got = pgrender.statefulset(g, CFG, pcl.ProxyClass.from_object(pclass(spec=spec)))
    want = pgrender.statefulset(g, CFG)
    pod = want["spec"]["template"]["spec"]
    del pod["terminationGracePeriodSeconds"]
    del pod["containers"][0]["lifecycle"]
    del pod["containers"][0]["readinessProbe"]      # it asks the same address
    pod["containers"][0]["env"].append({"name": "TS_LOCAL_ADDR_PORT", "value": "[::]:9999"})
    for o in (got, want):
        o["metadata"]["annotations"].pop(SPEC_HASH)
    assert got == want
    # metrics.enable alone keeps the hook: its TS_LOCAL_ADDR_PORT is the hook's address
    kept = pgrender.statefulset(g, CFG, pcl.ProxyClass.from_object(pclass(spec={"metrics": {"enable": True}})))
    assert kept["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["httpGet"]["port"] == 9002
    assert kept["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] == 9002


@pytest.fixture
def cenv():
    from dataclasses import replace
    kube, prov = FakeKube(), FakeProvider()
    rec = Reconciler(kube, prov, replace(CFG, proxy_tags=("tag:k8s",)), now=lambda: "2026-01-01T00:00:00Z")
    poked: list = []
    rec.poke = poked.append
    return kube, prov, rec, poked


def ready_cond(kube, name="pg"):
    return {c["type"]: c for c in kube.obj(PROXYGROUPS, name)["status"]["conditions"]}["ProxyGroupReady"]


async def test_a_group_naming_a_missing_class_waits_then_converges_when_it_appears(cenv):
    from controller.kubeapi import PROXYCLASSES
    kube, prov, rec, poked = cenv
    kube.put(PROXYGROUPS, pg_obj(proxyClass="prod"))
    assert await rec.reconcile("proxygroup", "", "pg") is None
    c = ready_cond(kube)
    assert (c["status"], c["reason"]) == ("False", "ProxyClassNotReady")
    assert c["message"].startswith("ProxyClass 'prod' does not exist; ")
    assert [(e["type"], e["reason"]) for e in kube.of(EVENTS)] == [("Warning", "ProxyClassNotReady")]
    assert prov.keys == [] and not [k for k in kube.objects if k[1] == NS]
    await rec.reconcile("proxygroup", "", "pg")
    assert len(kube.of(EVENTS)) == 1, "warned once"
    kube.put(PROXYCLASSES, pclass(spec={"statefulSet": {"pod": {"nodeSelector": {"pool": "edge"}}},
                                        "tailscale": {"acceptRoutes": True}}))
    await rec.reconcile("proxyclass", "", "prod")
    assert poked == [("proxygroup", "", "pg")]
    await rec.reconcile("proxygroup", "", "pg")
    sts = kube.obj(STATEFULSETS, "pg", NS)
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "edge"}
    assert json.loads(secret_data(kube, "pg-1-config")["cap-107.hujson"])["acceptRoutes"] is True
    assert ready_cond(kube)["reason"] == "ProxyGroupCreating"


async def test_an_invalid_or_deleted_class_changes_no_running_group_and_says_so(cenv):
    from controller.kubeapi import PROXYCLASSES
    kube, prov, rec, poked = cenv
    kube.put(PROXYCLASSES, pclass(spec={"statefulSet": {"pod": {"labels": {"v": "1"}}}}))
    kube.put(PROXYGROUPS, pg_obj(proxyClass="prod"))
    await rec.reconcile("proxygroup", "", "pg")
    before = json.loads(json.dumps(kube.obj(STATEFULSETS, "pg", NS)))
    kube.obj(PROXYCLASSES, "prod")["spec"] = {"statefulSet": {"pod": {
        "labels": {"v": "2"}, "tolerations": [{"key": "a", "operator": "Maybe"}]}}}
    await rec.reconcile("proxygroup", "", "pg")
    assert kube.obj(STATEFULSETS, "pg", NS) == before
    c = ready_cond(kube)
    assert c["reason"] == "ProxyClassNotReady" and "'Maybe'" in c["message"] and "keeps running" in c["message"]
    del kube.objects[("proxyclasses", "", "prod")]
    await rec.reconcile("proxygroup", "", "pg")
    assert kube.obj(STATEFULSETS, "pg", NS) == before
    assert "'prod' does not exist (deleted?)" in ready_cond(kube)["message"]
    assert [e["reason"] for e in kube.of(EVENTS)] == ["ProxyClassNotReady"] * 2


async def test_a_class_change_rolls_the_groups_using_it_only(cenv):
    from controller.kubeapi import PROXYCLASSES
    kube, prov, rec, poked = cenv
    kube.put(PROXYCLASSES, pclass(spec={"statefulSet": {"pod": {"labels": {"v": "1"}}}}))
    kube.put(PROXYGROUPS, pg_obj("pg", proxyClass="prod"))
    kube.put(PROXYGROUPS, pg_obj("other"))
    kube.put(PROXYGROUPS, pg_obj("third", proxyClass="dev"))
    kube.put(PROXYCLASSES, pclass("dev"))
    for n in ("pg", "other", "third"):
        await rec.reconcile("proxygroup", "", n)
    others = [json.loads(json.dumps(kube.obj(STATEFULSETS, n, NS))) for n in ("other", "third")]
    assert kube.obj(STATEFULSETS, "pg", NS)["spec"]["template"]["metadata"]["labels"]["v"] == "1"
    n_writes = len(kube.writes())
    await rec.reconcile("proxygroup", "", "pg")
    assert kube.writes()[n_writes:] == [], "nothing changed, nothing written"
    kube.obj(PROXYCLASSES, "prod")["spec"] = {"statefulSet": {"pod": {"labels": {"v": "2"}}}}
    await rec.reconcile("proxyclass", "", "prod")
    assert poked == [("proxygroup", "", "pg")]
    for n in ("pg", "other", "third"):
        await rec.reconcile("proxygroup", "", n)
    assert kube.obj(STATEFULSETS, "pg", NS)["spec"]["template"]["metadata"]["labels"]["v"] == "2"
    assert [kube.obj(STATEFULSETS, n, NS) for n in ("other", "third")] == others


async def test_the_default_class_applies_to_groups_unless_they_name_one_tags_metrics_and_cleanup(cenv):
    from dataclasses import replace

    from controller.kubeapi import PROXYCLASSES
    kube, prov, rec, poked = cenv
    rec.cfg = replace(rec.cfg, default_proxy_class="base")
    kube.put(PROXYCLASSES, pclass("base", {"metrics": {"enable": True}, "statefulSet": {"pod": {
        "tailscaleContainer": {"env": [{"name": "TS_EXTRA_ARGS", "value": "--advertise-tags=tag:pg"}]}}}}))
    kube.put(PROXYCLASSES, pclass("own", {"statefulSet": {"pod": {"labels": {"own": "yes"}}}}))
    kube.put(PROXYGROUPS, pg_obj("pg"))
    kube.put(PROXYGROUPS, pg_obj("named", proxyClass="own"))
    kube.put(PROXYGROUPS, pg_obj("tagged", tags=["tag:mine"]))
    await rec.reconcile("proxyclass", "", "base")
    assert poked == [("proxygroup", "", "pg"), ("proxygroup", "", "tagged")]
    for n in ("pg", "named", "tagged"):
        await rec.reconcile("proxygroup", "", n)
    # the class's --advertise-tags: over PROXY_TAGS, under the group's spec.tags
    assert [k[1] for k in prov.keys] == [("tag:pg",)] * 2 + [("tag:k8s",)] * 2 + [("tag:mine",)] * 2
    env = {e["name"] for e in kube.obj(STATEFULSETS, "pg", NS)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "TS_ENABLE_METRICS" in env and "TS_EXTRA_ARGS" not in env
    assert kube.obj(STATEFULSETS, "named", NS)["spec"]["template"]["metadata"]["labels"]["own"] == "yes"
    msvc = kube.obj(SERVICES, "pg-metrics", NS)
    assert msvc["metadata"]["labels"]["ts_proxy_type"] == "proxygroup"
    assert msvc["metadata"]["labels"]["ts_prom_job"] == "ts_proxygroup_pg"
    assert msvc["spec"]["selector"] == pgrender.labels(proxygroup.decide(pg_obj("pg"), CFG))
    assert msvc["spec"]["ports"] == [{"name": "metrics", "protocol": "TCP", "port": 9002, "targetPort": 9002}]
    assert kube.obj(SERVICES, "named-metrics", NS) is None
    # deleting the group removes its metrics Service with the rest
    kube.objects[("proxygroups", "", "pg")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await rec.reconcile("proxygroup", "", "pg")
    kube.finish_deletions()
    assert await rec.reconcile("proxygroup", "", "pg") is None
    assert [k for k in kube.objects if k[1] == NS and k[2].startswith("pg")] == []


async def test_ts_local_addr_port_in_the_class_is_a_warning_on_the_group(cenv):
    from controller.kubeapi import PROXYCLASSES
    kube, prov, rec, poked = cenv
    kube.put(PROXYCLASSES, pclass(spec={"statefulSet": {"pod": {"tailscaleContainer": {"env": [
        {"name": "TS_LOCAL_ADDR_PORT", "value": "[::]:9999"}]}}}}))
    kube.put(PROXYGROUPS, pg_obj(proxyClass="prod"))
    await rec.reconcile("proxygroup", "", "pg")
    await rec.reconcile("proxygroup", "", "pg")
    (ev,) = kube.of(EVENTS)
    assert (ev["type"], ev["reason"], ev["involvedObject"]["kind"]) == ("Warning", "CustomTSLocalAddrPort",
                                                                        "ProxyGroup")
    assert "no pre-stop hook" in ev["message"] and "TS_LOCAL_ADDR_PORT" in ev["message"]
    assert "lifecycle" not in kube.obj(STATEFULSETS, "pg", NS)["spec"]["template"]["spec"]["containers"][0]
