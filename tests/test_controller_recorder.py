"""The Recorder: its CRD against upstream's, the decision, the rendered objects, the status and one pass."""
from __future__ import annotations

import base64
import json
import pathlib
import subprocess

import pytest
import yaml

from controller.config import ControllerConfig
from controller.recorder import (RecorderInvalid, RecorderPass, decide, render, status)
from controller.render import SPEC_HASH

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


class FakeWriter:
    def __init__(self, secrets: dict | None = None) -> None:
        self.secrets: dict[str, dict] = dict(secrets or {})
        self.applied: list[dict] = []
        self.deleted: list[str] = []
        self.minted = 0
        self.statuses: list[dict] = []
        self.events: list[tuple] = []

    async def get_secret(self, name):
        return self.secrets.get(name)

    async def apply(self, obj):
        self.applied.append(obj)
        if obj["kind"] == "Secret":
            self.secrets[obj["metadata"]["name"]] = {"data": {k: base64.b64encode(v.encode()).decode()
                                                              for k, v in obj["stringData"].items()}}

    async def delete_secret(self, name):
        self.deleted.append(name)
        self.secrets.pop(name, None)

    async def mint_authkey(self, tags):
        self.minted += 1
        return f"tskey-{self.minted}"

    async def patch_status(self, obj, st):
        self.statuses.append(st)

    async def event(self, obj, kind, reason, message):
        self.events.append((kind, reason, message))


async def test_a_pass_mints_a_key_once_keeps_it_until_login_and_never_overwrites_the_agents_state():
    w = FakeWriter()
    p = RecorderPass(w, CFG, now=lambda: "t")
    await p.reconcile(EXAMPLE)
    assert w.minted == 1 and w.statuses[-1]["conditions"][0]["reason"] == "RecorderCreating"
    await p.reconcile(EXAMPLE)                 # not logged in yet: the same key, no new one
    assert w.minted == 1
    conf = [o for o in w.applied if o["metadata"]["name"] == "recorder-0-config"][-1]
    assert json.loads(conf["stringData"]["cap-95.hujson"])["AuthKey"] == "tskey-1"
    w.secrets["recorder-0"] = state("recorder-0.tailnet.example.", ["100.64.0.9"])
    w.applied.clear()
    await p.reconcile(EXAMPLE)
    assert "recorder-0" not in [o["metadata"]["name"] for o in w.applied]      # the agent's, left alone
    conf = [o for o in w.applied if o["metadata"]["name"] == "recorder-0-config"][-1]
    assert "AuthKey" not in json.loads(conf["stringData"]["cap-95.hujson"])
    assert w.statuses[-1]["conditions"][0]["reason"] == "RecorderCreated"


async def test_a_pass_removes_scaled_down_replicas_secrets_and_reports_an_invalid_spec():
    w = FakeWriter({"recorder-1": state("r1.", ["100.64.0.10"]), "recorder-1-config": {"data": {}}})
    await RecorderPass(w, CFG, now=lambda: "t").reconcile(EXAMPLE)
    assert w.deleted == ["recorder-1", "recorder-1-config"]
    w = FakeWriter()
    await RecorderPass(w, CFG, now=lambda: "t").reconcile({**EXAMPLE, "spec": {"replicas": 3}})
    assert w.applied == [] and w.events[0][:2] == ("Warning", "RecorderInvalid")
    assert w.statuses[0]["conditions"][0]["reason"] == "RecorderInvalid"
    assert "multiple replicas" in w.statuses[0]["conditions"][0]["message"]
