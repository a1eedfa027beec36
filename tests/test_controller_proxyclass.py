"""controller.kinds.proxyclass and its place in a pass: a class + a rendering → the objects a user finds, exactly; bad
classes refused with the field and the value; selection by label, spec.proxyClass and the default; a parent
waiting for its class; a class change rolling only its users; the two user mistakes reported."""
from __future__ import annotations

import base64
import dataclasses
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from controller import render
from controller.config import ControllerConfig
from controller.kinds import proxyclass as pcl
from controller.kubeapi import CONNECTORS, CRDS, EVENTS, PROXYCLASSES, SECRETS, SERVICEMONITORS, SERVICES, STATEFULSETS
from controller.model import SVC, Parent, ProxySpec
from controller.reconcile import Reconciler, proxy_target
from tests.support.fakekube import FakeKube, FakeProvider

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1",
                       login_server="http://hs.test:8080")
PARENT = Parent(SVC, "web", "apps", "uid-1")
SPEC = ProxySpec(parent=PARENT, hostname="apps-web", tags=("tag:k8s",), app="k8s-operator-ingress-proxy",
                 target_env=(("TS_DEST_IP", "10.96.0.10"),))

FULL = {
    "statefulSet": {
        "labels": {"team": "net", "tailscale.com/managed": "no"},
        "annotations": {"owner": "net@example.com"},
        "pod": {
            "labels": {"env": "prod", "app": "hijack"},
            "annotations": {"scrape": "yes"},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
            "nodeName": "node-1",
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ts", "effect": "NoSchedule"}],
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
            "priorityClassName": "high",
            "imagePullSecrets": [{"name": "regcred"}],
            "securityContext": {"runAsNonRoot": False},
            "dnsPolicy": "None",
            "dnsConfig": {"nameservers": ["10.0.0.10"]},
            "tailscaleContainer": {
                "env": [{"name": "TS_DEBUG_FIREWALL_MODE", "value": "nftables"},
                        {"name": "TS_EXTRA_ARGS", "value": "--advertise-tags=tag:prod,tag:web"}],
                "image": "registry.local/proxy:2", "imagePullPolicy": "IfNotPresent",
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
                "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}},
                "debug": {"enable": True}},
            "tailscaleInitContainer": {"image": "busybox:1.36", "resources": {"requests": {"cpu": "1m"}}},
        },
    },
    "metrics": {"enable": True, "serviceMonitor": {"enable": True, "labels": {"release": "prom"}}},
    "tailscale": {"acceptRoutes": True},
    "useLetsEncryptStagingEnvironment": True,
}


def klass(name="prod", spec=None, generation=1):
    return {"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyClass",
            "metadata": {"name": name, "uid": f"pc-{name}", "generation": generation}, "spec": spec or {}}


def env_of(c):
    return [(e["name"], e.get("value", e.get("valueFrom"))) for e in c["env"]]


# ---- the merge, exact

def test_every_field_lands_where_upstream_puts_it_and_the_controllers_own_labels_win():
    pc = pcl.ProxyClass.from_object(klass(spec=FULL))
    base = render.statefulset(SPEC, CFG)
    out = pcl.apply_to_statefulset(base, pc, pcl.Target(endpoints=True, acme=True))
    assert base == render.statefulset(SPEC, CFG), "the input is not changed"
    md = out["metadata"]
    assert md["labels"] == {**render.child_labels(PARENT), "team": "net"}
    assert md["annotations"]["owner"] == "net@example.com"
    tm = out["spec"]["template"]["metadata"]
    assert tm["labels"] == {**render.child_labels(PARENT), "app": "uid-1", "env": "prod"}
    assert tm["annotations"] == {"scrape": "yes"}
    ps = out["spec"]["template"]["spec"]
    for f in ("affinity", "nodeName", "nodeSelector", "tolerations", "topologySpreadConstraints",
              "priorityClassName", "imagePullSecrets", "securityContext", "dnsPolicy", "dnsConfig"):
        assert ps[f] == FULL["statefulSet"]["pod"][f], f
    (main,) = ps["containers"]
    assert main["image"] == "registry.local/proxy:2" and main["imagePullPolicy"] == "IfNotPresent"
    assert main["resources"] == {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}}
    assert main["securityContext"] == {"capabilities": {"add": ["NET_ADMIN"]}}
    rendered_env = env_of(render.statefulset(SPEC, CFG)["spec"]["template"]["spec"]["containers"][0])
    assert env_of(main) == rendered_env + [
        ("TS_DEBUG_ADDR_PORT", "$(POD_IP):9001"), ("TS_TAILSCALED_EXTRA_ARGS", "--debug=$(TS_DEBUG_ADDR_PORT)"),
        ("TS_LOCAL_ADDR_PORT", "$(POD_IP):9002"), ("TS_ENABLE_METRICS", "true"),
        ("TS_DEBUG_ACME_DIRECTORY_URL", pcl.LETS_ENCRYPT_STAGING),
        ("TS_DEBUG_FIREWALL_MODE", "nftables")], "class env last (the user wins); TS_EXTRA_ARGS carried over"
    assert main["ports"] == [{"name": "debug", "protocol": "TCP", "containerPort": 9001},
                             {"name": "metrics", "protocol": "TCP", "containerPort": 9002}]
    (init,) = ps["initContainers"]
    assert init["image"] == "busybox:1.36" and init["resources"] == {"requests": {"cpu": "1m"}}
    assert init["securityContext"] == {"privileged": True}
    assert pc.tags == ("tag:prod", "tag:web") and pc.accept_routes


def test_no_class_or_an_empty_one_changes_nothing_and_excluded_proxies_get_no_endpoints():
    base = render.statefulset(SPEC, CFG)
    assert pcl.apply_to_statefulset(base, None, pcl.Target()) == base
    assert pcl.apply_to_statefulset(base, pcl.ProxyClass.from_object(klass()), pcl.Target()) == base
    pc = pcl.ProxyClass.from_object(klass(spec={"metrics": {"enable": True}, "useLetsEncryptStagingEnvironment": True}))
    out = pcl.apply_to_statefulset(base, pc, pcl.Target(endpoints=False, acme=False))
    assert out == base
    egress = dataclasses.replace(SPEC, target_env=(("TS_TAILNET_TARGET_FQDN", "db.tail.net"),))
    assert proxy_target(SVC, egress, CFG) == pcl.Target(endpoints=False, acme=False)
    assert proxy_target(SVC, SPEC, CFG).endpoints


def test_debug_defaults_to_metrics_and_can_be_turned_off():
    assert pcl.ProxyClass.from_object(klass(spec={"metrics": {"enable": True}})).debug
    off = {"metrics": {"enable": True}, "statefulSet": {"pod": {"tailscaleContainer": {"debug": {"enable": False}}}}}
    assert not pcl.ProxyClass.from_object(klass(spec=off)).debug


def test_accept_routes_lands_in_every_config_file():
    pc = pcl.ProxyClass.from_object(klass(spec={"tailscale": {"acceptRoutes": True}}))
    s = render.secret(SPEC, CFG, 0, "key")
    out = pcl.apply_to_config_secret(s, pc)
    for k, v in out["stringData"].items():
        if k.startswith("cap-"):
            assert json.loads(v)["acceptRoutes"] is True
    assert pcl.apply_to_config_secret(s, None) == s


def test_metrics_service_and_service_monitor():
    pc = pcl.ProxyClass.from_object(klass(spec=FULL))
    sts = render.statefulset(SPEC, CFG)
    svc = pcl.metrics_service(sts, "ingress_service", "web", "apps")
    assert svc["metadata"]["name"] == f"{render.base_name(PARENT)}-metrics"
    assert svc["spec"]["selector"] == {"app": "uid-1"}
    assert svc["spec"]["ports"] == [{"name": "metrics", "protocol": "TCP", "port": 9002, "targetPort": 9002}]
    assert svc["metadata"]["labels"]["ts_prom_job"] == "ts_ingress_service_apps_web"
    sm = pcl.service_monitor(svc, pc)
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"] == svc["metadata"]["labels"]
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics"}]


# ---- selection

def test_selection_label_spec_default_and_the_misplaced_annotation():
    svc = {"metadata": {"labels": {pcl.LABEL_PROXY_CLASS: "prod"}}}
    assert pcl.select(False, svc, "dflt") == pcl.Selection("prod")
    assert pcl.select(False, {"metadata": {}}, "dflt") == pcl.Selection("dflt")
    assert pcl.select(True, {"spec": {"proxyClass": "edge"}}, "dflt") == pcl.Selection("edge")
    wrong = {"metadata": {"annotations": {pcl.LABEL_PROXY_CLASS: "prod"}}}
    assert pcl.select(False, wrong, "") == pcl.Selection("", misplaced="prod")
    assert "use a label" in pcl.annotation_message("Service", "prod")


# ---- validation

@pytest.mark.parametrize("spec, field, value", [
    ({"statefulSet": {"pod": {"tolerations": [{"key": "a", "operator": "Maybe"}]}}},
     "spec.statefulSet.pod.tolerations[0].operator", "'Maybe'"),
    ({"statefulSet": {"pod": {"tolerations": [{"key": "a", "operator": "Exists", "value": "x"}]}}},
     "spec.statefulSet.pod.tolerations[0].value", "'x'"),
    ({"statefulSet": {"pod": {"nodeSelector": ["linux"]}}}, "spec.statefulSet.pod.nodeSelector", '["linux"]'),
    ({"statefulSet": {"pod": {"tailscaleContainer": {"resources": {"limits": {"memory": "lots"}}}}}},
     "spec.statefulSet.pod.tailscaleContainer.resources.limits.memory", '"lots"'),
    ({"statefulSet": {"pod": {"tailscaleContainer": {"env": [{"name": "TS_KUBE_SECRET", "value": "x"}]}}}},
     "spec.statefulSet.pod.tailscaleContainer.env[0].name", "TS_KUBE_SECRET"),
    ({"statefulSet": {"pod": {"tailscaleContainer": {"env": [{"name": "TS_EXTRA_ARGS", "value": "--ssh"}]}}}},
     "spec.statefulSet.pod.tailscaleContainer.env[0].value", "'--ssh'"),
    ({"statefulSet": {"pod": {"tailscaleInitContainer": {"debug": {"enable": True}}}}},
     "spec.statefulSet.pod.tailscaleInitContainer.debug.enable", "init container"),
    ({"statefulSet": {"labels": {"a": "not valid!"}}}, "spec.statefulSet.labels[a]", "'not valid!'"),
    ({"statefulSet": {"pod": {"tailscaleContainer": {"image": "UPPER CASE"}}}},
     "spec.statefulSet.pod.tailscaleContainer.image", "'UPPER CASE'"),
    ({"metrics": {"enable": False, "serviceMonitor": {"enable": True}}}, "spec.metrics.serviceMonitor.enable",
     "spec.metrics.enable: true"),
    ({"tailscale": {"acceptRoutes": "yes"}}, "spec.tailscale.acceptRoutes", '"yes"'),
])
def test_an_invalid_class_names_the_field_and_the_value(spec, field, value):
    v = pcl.validate(klass(spec=spec))
    assert not v.ok
    (problem,) = v.problems
    assert problem.startswith(field) and value in problem, problem
    status, reason, message = pcl.ready_condition(v)
    assert (status, reason) == ("False", "ProxyClassInvalid") and message.startswith("ProxyClass is not valid: ")


def test_the_full_class_is_valid_with_upstreams_warning_for_custom_ts_env():
    v = pcl.validate(klass(spec=FULL))
    assert v.ok, v.problems
    assert v.warnings == (("CustomTSEnvVar", "ProxyClass overrides the default value for TS_DEBUG_FIREWALL_MODE env "
                           "var for tailscale container. Running with custom values for Tailscale env vars is not "
                           "recommended and might break in the future."),)
    assert pcl.ready_condition(v) == ("True", "ProxyClassValid", "ProxyClassValid")


def test_ts_env_on_the_init_container_is_a_warning_naming_the_variable_and_its_container():
    spec = {"statefulSet": {"pod": {"tailscaleInitContainer": {"env": [
        {"name": "TS_EXTRA_ARGS", "value": "--advertise-tags=tag:x"}]}}}}
    v = pcl.validate(klass(spec=spec))
    assert v.ok
    ((reason, msg),) = v.warnings
    assert reason == "EnvOnInitContainer" and "TS_EXTRA_ARGS" in msg and "tailscaleContainer.env" in msg


def test_service_monitor_without_its_crd_is_not_ready():
    v = pcl.validate(klass(spec=FULL), service_monitor_crd=False)
    assert v.crd_missing and "servicemonitors.monitoring.coreos.com" in v.problems[0]


# ---- in a pass

def labelled_svc(kube, name="web", cls="prod", *, annotation=False):
    md = {"name": name, "namespace": "apps", "uid": f"uid-{name}",
          "annotations": {"tailscale.com/expose": "true"}}
    if annotation:
        md["annotations"][pcl.LABEL_PROXY_CLASS] = cls
    elif cls:
        md["labels"] = {pcl.LABEL_PROXY_CLASS: cls}
    return kube.put(SERVICES, {"metadata": md, "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10",
                                                        "clusterIPs": ["10.96.0.10"], "ipFamilies": ["IPv4"]}})


@pytest.fixture
def env():
    log: list = []
    kube, prov = FakeKube(log), FakeProvider(log)
    rec = Reconciler(kube, prov, CFG, now=lambda: "2026-01-01T00:00:00Z")
    poked: list = []
    rec.poke = poked.append
    return kube, prov, rec, poked


def cond(obj, ctype):
    (c,) = [c for c in obj["status"]["conditions"] if c["type"] == ctype]
    return c


def sts_of(kube, name="web"):
    return kube.obj(STATEFULSETS, render.base_name(Parent(SVC, name, "apps", f"uid-{name}")), "tailscale")


def warnings(kube, reason):
    return [e["message"] for e in kube.of(EVENTS) if e["reason"] == reason]


async def test_a_missing_class_waits_then_converges_when_it_appears(env):
    kube, prov, rec, poked = env
    labelled_svc(kube)
    assert await rec.reconcile("svc", "apps", "web") is None
    c = cond(kube.obj(SERVICES, "web", "apps"), "TailscaleProxyReady")
    assert (c["status"], c["reason"]) == ("False", "ProxyClassNotReady") and "'prod' does not exist" in c["message"]
    assert sts_of(kube) is None and not kube.of(SECRETS) and prov.keys == []
    kube.put(PROXYCLASSES, klass(spec={"statefulSet": {"pod": {"nodeSelector": {"pool": "edge"}}}}))
    await rec.reconcile("proxyclass", "", "prod")
    assert cond(kube.obj(PROXYCLASSES, "prod"), "ProxyClassReady")["status"] == "True"
    assert poked == [("svc", "apps", "web")]
    await rec.reconcile("svc", "apps", "web")
    assert sts_of(kube)["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "edge"}


async def test_a_class_change_rolls_its_users_only_and_an_unchanged_pass_writes_nothing(env):
    kube, prov, rec, poked = env
    kube.put(PROXYCLASSES, klass(spec={"statefulSet": {"pod": {"labels": {"v": "1"}}}}))
    labelled_svc(kube, "web")
    labelled_svc(kube, "other", cls="")
    for n in ("web", "other"):
        await rec.reconcile("svc", "apps", n)
    other_before = sts_of(kube, "other")
    assert sts_of(kube)["spec"]["template"]["metadata"]["labels"]["v"] == "1"
    n = len(kube.writes())
    await rec.reconcile("svc", "apps", "web")
    assert len(kube.writes()) == n, "nothing changed, nothing written"
    kube.obj(PROXYCLASSES, "prod")["spec"] = {"statefulSet": {"pod": {"labels": {"v": "2"}}}}
    await rec.reconcile("proxyclass", "", "prod")
    assert poked == [("svc", "apps", "web")]
    await rec.reconcile("svc", "apps", "web")
    await rec.reconcile("svc", "apps", "other")
    assert sts_of(kube)["spec"]["template"]["metadata"]["labels"]["v"] == "2"
    assert sts_of(kube, "other") == other_before


async def test_an_invalid_class_changes_no_proxy_and_says_why(env):
    kube, prov, rec, poked = env
    kube.put(PROXYCLASSES, klass(spec={"statefulSet": {"pod": {"labels": {"v": "1"}}}}))
    labelled_svc(kube)
    await rec.reconcile("svc", "apps", "web")
    before = sts_of(kube)
    kube.obj(PROXYCLASSES, "prod")["spec"] = {"statefulSet": {"pod": {
        "labels": {"v": "2"}, "tolerations": [{"key": "a", "operator": "Maybe"}]}}}
    await rec.reconcile("proxyclass", "", "prod")
    c = cond(kube.obj(PROXYCLASSES, "prod"), "ProxyClassReady")
    assert (c["status"], c["reason"]) == ("False", "ProxyClassInvalid") and "'Maybe'" in c["message"]
    assert any("tolerations[0].operator" in m for m in warnings(kube, "ProxyClassInvalid"))
    await rec.reconcile("svc", "apps", "web")
    assert sts_of(kube) == before
    c = cond(kube.obj(SERVICES, "web", "apps"), "TailscaleProxyReady")
    assert c["reason"] == "ProxyClassNotReady" and "keeps running" in c["message"]


async def test_a_deleted_class_keeps_the_proxy_and_the_condition_says_so(env):
    kube, prov, rec, poked = env
    kube.put(PROXYCLASSES, klass())
    labelled_svc(kube)
    await rec.reconcile("svc", "apps", "web")
    before = sts_of(kube)
    del kube.objects[("proxyclasses", "", "prod")]
    await rec.reconcile("proxyclass", "", "prod")
    assert poked == [("svc", "apps", "web")]
    await rec.reconcile("svc", "apps", "web")
    assert sts_of(kube) == before
    c = cond(kube.obj(SERVICES, "web", "apps"), "TailscaleProxyReady")
    assert c["reason"] == "ProxyClassNotReady" and "does not exist (deleted?)" in c["message"]


async def test_the_annotation_instead_of_the_label_is_not_applied_and_says_use_a_label(env):
    kube, prov, rec, poked = env
    kube.put(PROXYCLASSES, klass(spec={"statefulSet": {"pod": {"labels": {"v": "1"}}}}))
    labelled_svc(kube, annotation=True)
    await rec.reconcile("svc", "apps", "web")
    assert "v" not in sts_of(kube)["spec"]["template"]["metadata"]["labels"]
    (msg,) = warnings(kube, "ProxyClassAnnotation")
    assert "use a label" in msg and "'prod'" in msg
    assert "use a label" in cond(kube.obj(SERVICES, "web", "apps"), "TailscaleProxyReady")["message"]


async def test_default_class_tags_metrics_and_service_monitor_with_its_crd(env):
    kube, prov, rec, poked = env
    rec.cfg = dataclasses.replace(CFG, default_proxy_class="prod")
    kube.put(PROXYCLASSES, klass(spec=FULL))
    labelled_svc(kube, cls="")
    await rec.reconcile("svc", "apps", "web")
    c = cond(kube.obj(SERVICES, "web", "apps"), "TailscaleProxyReady")
    assert c["reason"] == "ProxyClassNotReady" and "CRD was not found" in c["message"]
    kube.put(CRDS, {"metadata": {"name": "servicemonitors.monitoring.coreos.com"}})
    await rec.reconcile("svc", "apps", "web")
    assert prov.keys and prov.keys[-1][1] == ("tag:prod", "tag:web"), "TS_EXTRA_ARGS --advertise-tags → key's tags"
    env_names = [e["name"] for e in sts_of(kube)["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert "TS_EXTRA_ARGS" not in env_names and "TS_ENABLE_METRICS" in env_names
    name = render.base_name(Parent(SVC, "web", "apps", "uid-web")) + "-metrics"
    assert kube.obj(SERVICES, name, "tailscale") is not None
    assert kube.obj(SERVICEMONITORS, name, "tailscale") is not None
    data = kube.obj(SECRETS, render.base_name(Parent(SVC, "web", "apps", "uid-web")) + "-0", "tailscale")["data"]
    assert json.loads(base64.b64decode(data["cap-107.hujson"]))["acceptRoutes"] is True
    # metrics turned off: the metrics Service and the ServiceMonitor go
    kube.obj(PROXYCLASSES, "prod")["spec"] = {}
    await rec.reconcile("svc", "apps", "web")
    assert kube.obj(SERVICES, name, "tailscale") is None and kube.obj(SERVICEMONITORS, name, "tailscale") is None


async def test_a_connector_names_its_class_in_spec(env):
    kube, prov, rec, poked = env
    kube.put(PROXYCLASSES, klass(spec={"statefulSet": {"pod": {"labels": {"v": "1"}}}}))
    kube.put(CONNECTORS, {"metadata": {"name": "lan", "uid": "uid-lan", "generation": 1},
                          "spec": {"subnetRouter": {"advertiseRoutes": ["10.0.0.0/24"]}, "proxyClass": "prod"}})
    await rec.reconcile("proxyclass", "", "prod")
    assert poked == [("connector", "", "lan")]
    await rec.reconcile("connector", "", "lan")
    (sts,) = kube.of(STATEFULSETS)
    assert sts["spec"]["template"]["metadata"]["labels"]["v"] == "1"


# ---- the agent's side: every env a class sets on the proxy container works

def kubelet_env(env: list[dict], fields: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: fieldRefs resolved, $(VAR) expanded from the entries
    before it, a later duplicate replacing an earlier one."""
    import re
    out: dict[str, str] = {}
    for e in env:
        if "valueFrom" in e:
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e.get("value", ""))
    return out


def test_the_class_env_on_a_rendered_proxy_boots_the_agent_with_metrics_debug_and_acme(tmp_path):
    from containerboot.settings import SETTINGS, load
    from containerboot.tailscaled import child_env, tailscaled_argv
    spec = {**FULL, "statefulSet": {"pod": {"tailscaleContainer": {
        "env": [{"name": "TS_EXTRA_ARGS", "value": "--advertise-tags=tag:prod"}], "debug": {"enable": True}}}}}
    pc = pcl.ProxyClass.from_object(klass(spec=spec))
    sts = render.rehash(pcl.apply_to_statefulset(render.statefulset(SPEC, CFG), pc, pcl.Target(True, True)))
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    names = {e["name"] for e in c["env"]}
    assert names <= {s.name for s in SETTINGS} | set(render.TAILSCALED_ENV) | {"POD_IP", "POD_NAME", "POD_UID"}
    env = kubelet_env(c["env"], {"status.podIP": "10.1.2.3", "metadata.name": "ts-web-0", "metadata.uid": "u"})
    (tmp_path / "cap-107.hujson").write_text(render.dumps(render.tailscaled_config(SPEC, CFG, 0, "", 107)))
    env["TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR"] = str(tmp_path)
    env["TS_KUBE_SECRET"] = ""       # no API server here; the state Secret is not what this checks
    s = load(env)
    assert s.enable_metrics and s.local_addr_port == "10.1.2.3:9002"
    assert s.debug_addr_port == "10.1.2.3:9001"
    argv = tailscaled_argv(s)
    assert [a for a in argv if a.startswith("--debug")] == ["--debug=10.1.2.3:9001"]
    assert child_env(s, env)["TS_DEBUG_ACME_DIRECTORY_URL"] == pcl.LETS_ENCRYPT_STAGING
    assert not s.extra_args, "TS_EXTRA_ARGS is carried over by the controller, never passed on"


async def test_a_waiting_parent_is_warned_once_however_many_passes(env):
    kube, prov, rec, poked = env
    labelled_svc(kube)
    for _ in range(3):
        await rec.reconcile("svc", "apps", "web")
    assert len(warnings(kube, "ProxyClassNotReady")) == 1


async def test_an_ingress_takes_its_class_from_its_label(env):
    from controller.kubeapi import INGRESSES
    kube, prov, rec, poked = env
    rec.cfg = dataclasses.replace(CFG, ingress_scheme="https")
    kube.put(PROXYCLASSES, klass(spec={"statefulSet": {"pod": {"labels": {"v": "1"}}},
                                       "useLetsEncryptStagingEnvironment": True}))
    kube.put(SERVICES, {"metadata": {"name": "be", "namespace": "apps"},
                        "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80}]}})
    kube.put(INGRESSES, {"metadata": {"name": "ing", "namespace": "apps", "uid": "uid-ing",
                                      "labels": {pcl.LABEL_PROXY_CLASS: "prod"}},
                         "spec": {"ingressClassName": "tailscale",
                                  "defaultBackend": {"service": {"name": "be", "port": {"number": 80}}}}})
    await rec.reconcile("proxyclass", "", "prod")
    assert poked == [("ingress", "apps", "ing")]
    await rec.reconcile("ingress", "apps", "ing")
    (sts,) = kube.of(STATEFULSETS)
    assert sts["spec"]["template"]["metadata"]["labels"]["v"] == "1"
    env_ = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env_["TS_DEBUG_ACME_DIRECTORY_URL"] == pcl.LETS_ENCRYPT_STAGING


def test_proxy_default_class_is_a_setting_with_a_clear_error():
    from controller.config import ConfigError, load
    assert load({"PROXY_DEFAULT_CLASS": "prod"}).default_proxy_class == "prod"
    assert load({}).default_proxy_class == ""
    with pytest.raises(ConfigError, match="PROXY_DEFAULT_CLASS='Prod_1' is not a ProxyClass name"):
        load({"PROXY_DEFAULT_CLASS": "Prod_1"})
