"""The Recorder: its CRD against upstream's, the decision, the rendered objects, the status, and whole passes
against the in-memory API server (create, a second pass, scale-down, deletion, bad input)."""
from __future__ import annotations

import base64
import json
import pathlib
import subprocess

import pytest
import yaml

from controller.config import ControllerConfig
from controller.handlers import child_key
from controller.kinds.recorder import RecorderInvalid, decide, render, status
from controller.kubeapi import EVENTS, PODS, RECORDERS, ROLES, SECRETS, STATEFULSETS
from controller.reconcile import Reconciler
from controller.render import SPEC_HASH
from tests.support.fakekube import FakeKube, FakeProvider, agent_writes, secret_data

REPO = pathlib.Path(__file__).resolve().parents[1]
CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.example/proxy:1", proxy_tags=("tag:k8s",))
EXAMPLE = {"apiVersion": "tailscale.com/v1alpha1", "kind": "Recorder",
           "metadata": {"name": "recorder", "uid": "u-1", "generation": 2}, "spec": {"enableUI": True}}


def upstream_crd() -> dict | None:
    try:
        mod = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    p = pathlib.Path(mod) / "tailscale.com@v1.102.3/cmd/k8s-operator/deploy/crds/tailscale.com_recorders.yaml"
    return yaml.safe_load(p.read_text()) if p.exists() else None


def fields(schema: dict, path: str = "") -> set[str]:
    """Every property path of a schema, down to where ours keeps an embedded type as given."""
    out = set()
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return out
    for k, v in (schema.get("properties") or {}).items():
        out.add(path + k)
        out |= fields(v, path + k + ".")
    if "items" in schema:
        out |= fields(schema["items"], path + "[].")
    return out


def ours() -> dict:
    return yaml.safe_load((REPO / "deploy/crds/tailscale.com_recorders.yaml").read_text())


def test_the_crd_has_upstreams_names_and_every_field_of_upstreams_schema():
    crd = ours()
    assert crd["metadata"]["name"] == "recorders.tailscale.com" and crd["spec"]["scope"] == "Cluster"
    assert crd["spec"]["names"]["shortNames"] == ["rec"]
    (v,) = crd["spec"]["versions"]
    mine = fields(v["schema"]["openAPIV3Schema"])
    up = upstream_crd()
    if up is None:
        pytest.skip("upstream's module is not in the Go module cache")
    (uv,) = up["spec"]["versions"]
    theirs = fields(uv["schema"]["openAPIV3Schema"])
    embedded = ("spec.statefulSet.pod.affinity.", "spec.statefulSet.pod.securityContext.",
                "spec.statefulSet.pod.container.securityContext.",
                "spec.statefulSet.pod.container.resources.claims.[].",
                "spec.statefulSet.pod.container.env.[].valueFrom")
    assert {f for f in theirs if not f.startswith(embedded)} - mine == set()
    assert mine - theirs == set()
    assert [r["rule"] for r in v["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]] == \
        [r["rule"] for r in uv["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]]


def test_toleration_operator_empty_is_equal_as_in_kubernetes():
    obj = {**EXAMPLE, "spec": {"statefulSet": {"pod": {"tolerations": [
        {"key": "dedicated", "operator": "", "value": "rec", "effect": ""}]}}}}
    assert decide(obj, CFG).name == "recorder"


def test_upstreams_example_renders_a_recorder_pod_beside_the_agent():
    r = decide(EXAMPLE, CFG)
    assert (r.replicas, r.tags, r.enable_ui, r.service_account) == (1, ("tag:k8s",), True, "recorder")
    out = render(r, CFG, ["tskey-auth-1"])
    names = [(o["kind"], o["metadata"]["name"]) for o in out.objects()]
    assert names == [("Secret", "recorder-0"), ("Secret", "recorder-0-config"), ("ServiceAccount", "recorder"),
                     ("Role", "recorder"), ("RoleBinding", "recorder"), ("StatefulSet", "recorder")]
    conf = json.loads(out.secrets[1]["stringData"]["cap-95.hujson"])
    assert conf["AuthKey"] == "tskey-auth-1" and conf["Hostname"] == "recorder-0"
    (secret_rule, _events) = out.role["rules"]
    assert secret_rule["resourceNames"] == ["recorder-0"]        # the state Secret only, never the auth key's
    pod = out.statefulset["spec"]["template"]["spec"]
    ts, rec = pod["containers"]
    assert rec["command"] == ["tsrecorder"] and rec["image"] == "registry.example/proxy:1"
    env = {e["name"]: e.get("value") for e in rec["env"]}
    assert env == {"TSRECORDER_DST": "/data/recordings", "TS_SOCKET": "/var/run/tailscale/tailscaled.sock",
                   "TSRECORDER_UI": "true"}
    assert rec["securityContext"] == {"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}
    assert {e["name"]: e.get("value") for e in ts["env"]}["TS_SOCKET"] == "/var/run/tailscale/tailscaled.sock"
    for o in out.objects():
        assert o["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        assert o["metadata"]["namespace"] == "tailscale"
    assert SPEC_HASH in out.statefulset["metadata"]["annotations"]


def test_statefulset_overrides_apply_as_upstream():
    obj = {**EXAMPLE, "spec": {"tags": ["tag:k8s-recorder"], "statefulSet": {
        "labels": {"team": "sec"}, "annotations": {"a": "b"},
        "pod": {"labels": {"p": "q"}, "annotations": {"c": "d"}, "nodeSelector": {"disk": "ssd"},
                "tolerations": [{"key": "k", "operator": "Exists"}],
                "serviceAccount": {"name": "rec-sa", "annotations": {"eks.amazonaws.com/role-arn": "arn"}},
                "container": {"image": "other/recorder:2", "env": [{"name": "TSRECORDER_UI", "value": "false"},
                                                                   {"name": "EXTRA", "value": "1"}],
                              "resources": {"limits": {"memory": "64Mi"}}}}}}}
    r = decide(obj, CFG)
    assert r.tags == ("tag:k8s-recorder",)
    out = render(r, CFG, [""])
    sts = out.statefulset
    assert sts["metadata"]["labels"]["team"] == "sec" and sts["metadata"]["annotations"]["a"] == "b"
    tpl = sts["spec"]["template"]
    assert tpl["metadata"]["labels"]["p"] == "q" and tpl["metadata"]["annotations"] == {"c": "d"}
    pod = tpl["spec"]
    assert pod["nodeSelector"] == {"disk": "ssd"} and pod["serviceAccountName"] == "rec-sa"
    rec = pod["containers"][1]
    assert rec["image"] == "other/recorder:2" and rec["resources"] == {"limits": {"memory": "64Mi"}}
    env = [(e["name"], e.get("value")) for e in rec["env"]]
    assert ("TSRECORDER_UI", "false") in env and ("EXTRA", "1") in env and env.count(("TSRECORDER_UI", "true")) == 0
    assert out.service_account is None                            # the named ServiceAccount is the user's
    assert out.role_binding["subjects"][0]["name"] == "rec-sa"
    assert "AuthKey" not in json.loads(out.secrets[1]["stringData"]["cap-95.hujson"])


@pytest.mark.parametrize("spec, words", [
    ({"storage": {"s3": {"bucket": "b"}}}, "spec.storage.s3: want endpoint and bucket"),
    ({"storage": {"s3": {"bucket": "b", "endpoint": "s3.example"}}, "replicas": 2},
     "spec.storage.s3.credentials.secret.name is empty"),
    ({"replicas": 2}, "must use S3 storage when using multiple replicas"),
    ({"tailnet": "other"}, "spec.tailnet='other'"),
    ({"tags": ["k8s"]}, "spec.tags=['k8s']: want tags like tag:k8s-recorder"),
    ({"enableUI": "yes"}, "spec.enableUI='yes': want true or false"),
    # stored by the CRD (upstream's accepts them), refused here before any StatefulSet is written
    ({"statefulSet": {"labels": {"team": "a b"}}}, "spec.statefulSet.labels[team]: value 'a b' is not a valid label"),
    ({"statefulSet": {"pod": {"labels": {"x": "-x"}}}}, "spec.statefulSet.pod.labels[x]: value '-x'"),
    ({"statefulSet": {"pod": {"tolerations": [{"key": "k", "operator": "In"}]}}},
     "spec.statefulSet.pod.tolerations[0].operator: 'In' is not an operator; use Exists or Equal"),
])
def test_what_cannot_be_built_is_refused_naming_the_field(spec, words):
    with pytest.raises(RecorderInvalid) as e:
        decide({**EXAMPLE, "spec": spec}, CFG)
    assert words in str(e.value)


def test_s3_storage_goes_to_the_bucket_with_the_secrets_keys_as_environment():
    obj = {**EXAMPLE, "spec": {"replicas": 2, "storage": {"s3": {
        "endpoint": "s3.us-east-1.amazonaws.com", "bucket": "recordings",
        "credentials": {"secret": {"name": "s3-creds"}}}}}}
    out = render(decide(obj, CFG), CFG, ["k1", "k2"])
    rec = out.statefulset["spec"]["template"]["spec"]["containers"][1]
    env = {e["name"]: e.get("value") for e in rec["env"]}
    assert env["TSRECORDER_DST"] == "s3://s3.us-east-1.amazonaws.com" and env["TSRECORDER_BUCKET"] == "recordings"
    assert rec["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert out.statefulset["spec"]["replicas"] == 2 and out.role["rules"][0]["resourceNames"] == ["recorder-0",
                                                                                                 "recorder-1"]


def state(fqdn: str, ips: list[str], device_id: str = "n1") -> dict:
    enc = lambda s: base64.b64encode(s.encode()).decode()   # noqa: E731
    return {"data": {"device_fqdn": enc(fqdn), "device_ips": enc(json.dumps(ips)), "device_id": enc(device_id)}}


def test_status_lists_devices_with_the_ui_url_and_keeps_the_transition_time():
    r = decide(EXAMPLE, CFG)
    st = status(r, {}, now="t1")
    assert st["devices"] == [] and st["conditions"][0]["reason"] == "RecorderCreating"
    st2 = status(r, {"recorder-0": state("recorder-0.tailnet.example.", ["100.64.0.9", "fd7a::9"])}, now="t2",
                 previous=st)
    assert st2["devices"] == [{"hostname": "recorder-0", "tailnetIPs": ["100.64.0.9", "fd7a::9"],
                               "url": "http://recorder-0.tailnet.example"}]
    assert st2["conditions"][0] == {"type": "RecorderReady", "status": "True", "reason": "RecorderCreated",
                                         "message": "RecorderCreated", "lastTransitionTime": "t2",
                                         "observedGeneration": 2}
    assert status(r, {"recorder-0": state("r.", ["100.64.0.9"])}, now="t3", previous=st2)[
        "conditions"][0]["lastTransitionTime"] == "t2"


# ---- whole passes against the in-memory API server


NS = "tailscale"


@pytest.fixture
def env():
    kube, prov = FakeKube(), FakeProvider()
    clock = iter(f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z" for i in range(3600))
    return kube, prov, Reconciler(kube, prov, CFG, now=lambda: next(clock))


def recorder_obj(**spec) -> dict:
    return {"apiVersion": "tailscale.com/v1alpha1", "kind": "Recorder",
            "metadata": {"name": "recorder", "generation": 1}, "spec": {"enableUI": True, **spec}}


def register(kube, prov, i: int, dev: str) -> None:
    """Replica i's agent logs in and writes its device into its state Secret."""
    agent_writes(kube, f"recorder-{i}", {"device_id": dev.encode(),
                                         "device_fqdn": f"recorder-{i}.tail.example.".encode(),
                                         "device_ips": json.dumps([f"100.64.0.{10 + i}"]).encode()})
    prov.tags[dev] = ("tag:k8s",)


def ready(kube) -> dict:
    (cond,) = [c for c in kube.obj(RECORDERS, "recorder")["status"]["conditions"] if c["type"] == "RecorderReady"]
    return cond


async def test_a_recorder_object_gets_its_recorder_a_key_once_and_its_devices_in_the_status(env):
    kube, prov, rec = env
    kube.put(RECORDERS, recorder_obj())
    await rec.reconcile("recorder", "", "recorder")
    assert kube.obj(RECORDERS, "recorder")["metadata"]["finalizers"] == ["tailscale.com/finalizer"]
    assert [(k[0], k[2]) for k in kube.objects if k[1] == NS] == [
        ("secrets", "recorder-0"), ("secrets", "recorder-0-config"), ("serviceaccounts", "recorder"),
        ("roles", "recorder"), ("rolebindings", "recorder"), ("statefulsets", "recorder")]
    (key, tags), = prov.keys
    assert tags == ("tag:k8s",)
    assert json.loads(secret_data(kube, "recorder-0-config")["cap-95.hujson"])["AuthKey"] == key
    containers = kube.obj(STATEFULSETS, "recorder", NS)["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["tailscale", "recorder"]
    assert ready(kube)["status"] == "False" and ready(kube)["reason"] == "RecorderCreating"
    # a second pass before the replica has logged in: the same key, no write at all
    before = len(kube.writes())
    await rec.reconcile("recorder", "", "recorder")
    assert len(prov.keys) == 1 and kube.writes()[before:] == []
    # the replica logs in: the key leaves its config, the status lists its device with the UI's URL
    register(kube, prov, 0, "21")
    await rec.reconcile("recorder", "", "recorder")
    assert "AuthKey" not in json.loads(secret_data(kube, "recorder-0-config")["cap-95.hujson"])
    assert secret_data(kube, "recorder-0")["device_id"] == b"21"          # the agent's state, left alone
    st = kube.obj(RECORDERS, "recorder")["status"]
    assert st["devices"] == [{"hostname": "recorder-0", "tailnetIPs": ["100.64.0.10"],
                              "url": "http://recorder-0.tail.example"}]
    assert ready(kube)["status"] == "True" and ready(kube)["reason"] == "RecorderCreated"
    assert len(prov.keys) == 1 and kube.of(EVENTS) == []


S3 = {"storage": {"s3": {"endpoint": "s3.example", "bucket": "recordings",
                         "credentials": {"secret": {"name": "s3-creds"}}}}}


async def test_scaling_2_to_1_deletes_the_device_and_secrets_once_the_pod_is_gone(env):
    kube, prov, rec = env
    kube.put(SECRETS, {"metadata": {"name": "s3-creds", "namespace": NS}, "data": {}})
    kube.put(RECORDERS, recorder_obj(replicas=2, **S3))
    await rec.reconcile("recorder", "", "recorder")
    register(kube, prov, 0, "21")
    register(kube, prov, 1, "22")
    await rec.reconcile("recorder", "", "recorder")
    assert [d["hostname"] for d in kube.obj(RECORDERS, "recorder")["status"]["devices"]] == ["recorder-0",
                                                                                           "recorder-1"]
    kube.put(PODS, {"metadata": {"name": "recorder-1", "namespace": NS,
                                 "labels": {"tailscale.com/managed": "true", "tailscale.com/recorder": "recorder"}}})
    kube.objects[("recorders", "", "recorder")]["spec"]["replicas"] = 1
    assert await rec.reconcile("recorder", "", "recorder") == 2.0       # its Pod is still shutting down
    assert kube.obj(STATEFULSETS, "recorder", NS)["spec"]["replicas"] == 1
    assert kube.obj(SECRETS, "recorder-1", NS) is not None and prov.deleted == []
    assert kube.obj(ROLES, "recorder", NS)["rules"][0]["resourceNames"] == ["recorder-0", "recorder-1"]
    del kube.objects[("pods", NS, "recorder-1")]
    await rec.reconcile("recorder", "", "recorder")
    assert prov.deleted == ["22"]
    assert kube.obj(SECRETS, "recorder-1", NS) is None and kube.obj(SECRETS, "recorder-1-config", NS) is None
    assert kube.obj(ROLES, "recorder", NS)["rules"][0]["resourceNames"] == ["recorder-0"]
    assert [d["hostname"] for d in kube.obj(RECORDERS, "recorder")["status"]["devices"]] == ["recorder-0"]
    assert len(prov.keys) == 2


async def test_deleting_a_recorder_deletes_its_devices_objects_and_then_the_finalizer(env):
    kube, prov, rec = env
    kube.put(RECORDERS, recorder_obj())
    await rec.reconcile("recorder", "", "recorder")
    register(kube, prov, 0, "21")
    await rec.reconcile("recorder", "", "recorder")
    await kube.delete(RECORDERS, "recorder")
    assert await rec.reconcile("recorder", "", "recorder") == 2.0      # the StatefulSet's Pods go first
    assert prov.deleted == [] and kube.obj(RECORDERS, "recorder") is not None
    kube.finish_deletions()
    assert await rec.reconcile("recorder", "", "recorder") is None
    assert prov.deleted == ["21"] and kube.obj(RECORDERS, "recorder") is None
    assert [k for k in kube.objects if k[1] == NS] == []


@pytest.mark.parametrize("spec, words", [
    (S3, "spec.storage.s3.credentials.secret.name='s3-creds': no Secret 's3-creds' in namespace 'tailscale'; "
         "create it there with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
    ({"tailnet": "other"}, "spec.tailnet='other'"),
])
async def test_bad_input_gets_a_false_condition_and_one_warning_event_and_nothing_made(env, spec, words):
    kube, prov, rec = env
    kube.put(RECORDERS, recorder_obj(**spec))
    await rec.reconcile("recorder", "", "recorder")
    await rec.reconcile("recorder", "", "recorder")
    cond = ready(kube)
    assert cond["status"] == "False" and cond["reason"] == "RecorderInvalid" and words in cond["message"]
    (ev,) = kube.of(EVENTS)
    assert (ev["type"], ev["reason"]) == ("Warning", "RecorderInvalid") and words in ev["message"]
    assert ev["involvedObject"]["kind"] == "Recorder" and ev["involvedObject"]["apiVersion"] == "tailscale.com/v1alpha1"
    assert prov.keys == [] and [k for k in kube.objects if k[1] == NS] == []


async def test_the_missing_credentials_secret_once_created_lets_the_recorder_start(env):
    kube, prov, rec = env
    kube.put(RECORDERS, recorder_obj(**S3))
    assert await rec.reconcile("recorder", "", "recorder") == 60.0      # the user's Secret is not watched
    kube.put(SECRETS, {"metadata": {"name": "s3-creds", "namespace": NS}, "data": {}})
    await rec.reconcile("recorder", "", "recorder")
    assert ready(kube)["reason"] == "RecorderCreating" and len(prov.keys) == 1
    env_from = kube.obj(STATEFULSETS, "recorder", NS)["spec"]["template"]["spec"]["containers"][1]["envFrom"]
    assert env_from == [{"secretRef": {"name": "s3-creds"}}]


def test_a_recorders_children_lead_back_to_it():
    labels = {"tailscale.com/managed": "true", "tailscale.com/recorder": "recorder"}
    assert child_key({"metadata": {"labels": labels}}) == ("recorder", "", "recorder")
