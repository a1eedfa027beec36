"""Recorder: a recorder on the tailnet for the API server proxy's session recordings (pure: objects in, objects
out). The controller's pass for it is controller/passes/recorder.py.

Upstream's resource (`tailscale.com/v1alpha1`, kind `Recorder`, cluster-scoped) and upstream's object names,
in the controller's namespace: a StatefulSet `<rec>`, per replica a state Secret `<rec>-<i>` and a config
Secret `<rec>-<i>-config` (the tailscaled config file with the auth key, as a ProxyGroup's replicas have;
upstream's tsrecorder reads a Secret `<rec>-auth-<i>` instead, since it embeds tailscaled), and a
ServiceAccount, Role and RoleBinding `<rec>` (or the ServiceAccount named in
`spec.statefulSet.pod.serviceAccount.name`). The Role names only the replicas' state Secrets
(controller/proxyrbac.py).

Each Pod runs two containers of the proxy image: `tailscale` (the agent and tailscaled, as in every proxy Pod;
its device is `<rec>-<i>` with the Recorder's tags, default the controller's proxy tags) and `recorder`
(`tsrecorder`: the recorder package), which shares the Pod's network namespace and tailscaled's LocalAPI
socket and listens on the device's tailnet addresses, port 80. Recordings go to `/data/recordings` on the
volume `data` (an emptyDir, as upstream's default); with `enableUI` the recorder also lists them there.

With `spec.storage.s3` the recorder writes to the bucket (`TSRECORDER_DST=s3://<endpoint>`,
`TSRECORDER_BUCKET`) with the credentials Secret's keys as its environment (`envFrom`, as upstream).

What this controller cannot do is refused with a message naming the field and the fix (RecorderInvalid):
`spec.storage.s3` without endpoint, bucket or credentials Secret (this recorder reads no other credentials
source), `spec.tailnet` (this controller serves one tailnet), more than one replica without S3 (upstream's
rule). `spec.statefulSet` overrides apply as
upstream: labels and annotations on the StatefulSet and the Pod, the Pod's affinity, nodeSelector,
tolerations, imagePullSecrets, securityContext and ServiceAccount, and the `recorder` container's env, image,
imagePullPolicy, resources and securityContext.

Status (`status()`): `devices` (hostname, tailnetIPs, and with the UI its URL `http://<MagicDNS name>`) from the
replicas' state Secrets, and the condition RecorderReady (RecorderCreated once every replica is on the tailnet,
RecorderCreating before, RecorderInvalid for a refused spec).
"""
from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tscommon.secretcontract import (
    CONFIG_CAPVERS,
    KEY_DEVICE_FQDN,
    KEY_DEVICE_IPS,
    config_key,
    parse_device_fqdn,
    parse_device_ips,
)

from .. import proxyrbac
from ..config import ControllerConfig
from ..kindfacts import FACTS
from ..model import COND_RECORDER_READY, RECORDER
from ..render import SPEC_HASH, dumps, hashed, rehash
from . import proxyclass as pcl

_FACTS = FACTS[RECORDER]
GROUP, VERSION, PLURAL, KIND = _FACTS.api_names
#: the work-queue kind of a Recorder (not a parent of proxies: its pass is controller/passes/recorder.py)
QUEUE_KIND = RECORDER
COND_READY = COND_RECORDER_READY
REASON_CREATED = _FACTS.ready_reason
REASON_CREATING = _FACTS.pending_reason
REASON_INVALID = _FACTS.invalid_reason
REASON_FAILED = _FACTS.failed_reason
APP = "k8s-operator-recorder"
LABEL_RECORDER = "tailscale.com/recorder"
SOCKET_DIR = "/var/run/tailscale"
SOCKET = SOCKET_DIR + "/tailscaled.sock"
DATA_DIR = "/data"
RECORDINGS_DIR = DATA_DIR + "/recordings"
_TAG = re.compile(r"^tag:[a-zA-Z][a-zA-Z0-9-]*$")

__all__ = ["RecorderInvalid", "RecorderSpec", "decide", "render", "status", "Rendered", "SPEC_HASH"]


class RecorderInvalid(ValueError):
    """The Recorder asks for something this controller cannot build; the message names the field and the fix."""


@dataclass(frozen=True)
class RecorderSpec:
    name: str
    uid: str
    replicas: int
    tags: tuple[str, ...]
    enable_ui: bool
    service_account: str
    sts_labels: Mapping[str, str] = field(default_factory=dict)
    sts_annotations: Mapping[str, str] = field(default_factory=dict)
    pod: Mapping[str, Any] = field(default_factory=dict)          # spec.statefulSet.pod, checked
    generation: int = 0
    s3_endpoint: str = ""
    s3_bucket: str = ""
    s3_secret: str = ""                                           # Secret with AWS_ACCESS_KEY_ID, ...


def _get(obj: Mapping[str, Any] | None, *path: str) -> Any:
    for p in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(p)
    return obj


def _strmap(v: Any, where: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, Mapping) or not all(isinstance(x, str) for x in v.values()):
        raise RecorderInvalid(f"{where}: want a map of strings")
    return dict(v)


def decide(obj: Mapping[str, Any], cfg: ControllerConfig) -> RecorderSpec:
    """The Recorder as this controller builds it; RecorderInvalid naming every problem and its fix."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    problems: list[str] = []
    replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        problems.append(f"spec.replicas={replicas!r}: want a whole number, 0 or more")
        replicas = 1
    s3 = _get(spec, "storage", "s3")
    if s3 is not None:
        if not isinstance(s3, Mapping) or not s3.get("endpoint") or not s3.get("bucket"):
            problems.append("spec.storage.s3: want endpoint and bucket (e.g. endpoint: s3.us-east-1.amazonaws.com, "
                            "bucket: recordings)")
            s3 = None
        elif not _get(s3, "credentials", "secret", "name"):
            problems.append("spec.storage.s3.credentials.secret.name is empty: this recorder takes S3 credentials "
                            "from a Secret in the controller's namespace (keys AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY)")
            s3 = None
    elif replicas > 1:
        problems.append("must use S3 storage when using multiple replicas to ensure recordings are accessible "
                        f"(spec.replicas={replicas}); use spec.replicas: 1")
    if spec.get("tailnet"):
        problems.append(f"spec.tailnet={spec['tailnet']!r}: this controller serves the one tailnet it is "
                        "configured for; remove spec.tailnet")
    tags = spec.get("tags")
    if tags is None or tags == []:
        tags = list(cfg.proxy_tags)
    if not isinstance(tags, list) or not all(isinstance(t, str) and _TAG.match(t) for t in tags):
        problems.append(f"spec.tags={tags!r}: want tags like tag:k8s-recorder (tag:, a letter, then letters, "
                        "digits or dashes)")
        tags = list(cfg.proxy_tags)
    ui = spec.get("enableUI", False)
    if not isinstance(ui, bool):
        problems.append(f"spec.enableUI={ui!r}: want true or false")
        ui = False
    sts = spec.get("statefulSet") or {}
    pod = sts.get("pod") or {}
    try:
        sts_labels = _strmap(sts.get("labels"), "spec.statefulSet.labels")
        sts_annotations = _strmap(sts.get("annotations"), "spec.statefulSet.annotations")
        _strmap(pod.get("labels"), "spec.statefulSet.pod.labels")
        _strmap(pod.get("annotations"), "spec.statefulSet.pod.annotations")
        _strmap(pod.get("nodeSelector"), "spec.statefulSet.pod.nodeSelector")
        _strmap(_get(pod, "serviceAccount", "annotations"), "spec.statefulSet.pod.serviceAccount.annotations")
        # the CRD stores what upstream's stores (label values, toleration operator ""): checked here, as for a class
        pcl.check_labels("spec.statefulSet.labels", sts.get("labels"), problems)
        pcl.check_labels("spec.statefulSet.pod.labels", pod.get("labels"), problems)
    except RecorderInvalid as e:
        problems.append(str(e))
        sts_labels, sts_annotations = {}, {}
    pcl.check_tolerations("spec.statefulSet.pod.tolerations", pod.get("tolerations"), problems)
    env = _get(pod, "container", "env") or []
    if not isinstance(env, list) or not all(isinstance(e, Mapping) and isinstance(e.get("name"), str) for e in env):
        problems.append("spec.statefulSet.pod.container.env: want a list of {name, value}")
    name = str(meta.get("name") or "")
    sa = str(_get(pod, "serviceAccount", "name") or name)
    if problems:
        raise RecorderInvalid("; ".join(problems))
    return RecorderSpec(name=name, uid=str(meta.get("uid") or ""), replicas=replicas, tags=tuple(tags),
                        enable_ui=ui, service_account=sa, sts_labels=sts_labels, sts_annotations=sts_annotations,
                        pod=pod, generation=int(meta.get("generation") or 0),
                        s3_endpoint=str(s3["endpoint"]) if s3 else "", s3_bucket=str(s3["bucket"]) if s3 else "",
                        s3_secret=str(_get(s3, "credentials", "secret", "name") or "") if s3 else "")


def labels(r: RecorderSpec) -> dict[str, str]:
    """On every object of the Recorder: the controller's and upstream's recorder label."""
    return {"tailscale.com/managed": "true", LABEL_RECORDER: r.name}


def selector(name: str) -> str:
    """The label selector of a Recorder's objects (by the Recorder's name: also when its spec is refused)."""
    return f"tailscale.com/managed=true,{LABEL_RECORDER}={name}"


def replica_index(r: RecorderSpec, secret: str) -> int | None:
    """The replica a state or config Secret of the Recorder belongs to (None: not one of its replicas')."""
    n = secret.removesuffix("-config").removeprefix(f"{r.name}-")
    return int(n) if secret.startswith(f"{r.name}-") and n.isdigit() else None


def credentials_problem(r: RecorderSpec, cfg: ControllerConfig, secret: Mapping[str, Any] | None) -> str:
    """Why the S3 credentials Secret cannot be used ("" when it can, or when there is no S3 storage)."""
    if not r.s3_secret or secret is not None:
        return ""
    return (f"spec.storage.s3.credentials.secret.name={r.s3_secret!r}: no Secret {r.s3_secret!r} in namespace "
            f"{cfg.namespace!r}; create it there with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "name the Secret that has them")


def state_secret_name(r: RecorderSpec, i: int) -> str:
    return f"{r.name}-{i}"


def config_secret_name(r: RecorderSpec, i: int) -> str:
    return f"{r.name}-{i}-config"


def _owner(r: RecorderSpec) -> list[dict]:
    return [{"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": r.name, "uid": r.uid, "controller": True,
             "blockOwnerDeletion": True}]


def _meta(r: RecorderSpec, cfg: ControllerConfig, name: str) -> dict:
    return {"name": name, "namespace": cfg.namespace, "labels": labels(r), "ownerReferences": _owner(r)}


def tailscaled_config(r: RecorderSpec, cfg: ControllerConfig, i: int, authkey: str, capver: int) -> dict:
    """Replica i's tailscaled config (as a ProxyGroup replica's): its host name and, until it has logged in,
    its auth key."""
    conf: dict[str, Any] = {"Version": "alpha0", "Locked": False, "ServerURL": cfg.server_url,
                            "Hostname": f"{r.name}-{i}", "acceptDNS": False, "acceptRoutes": False,
                            "NoStatefulFiltering": True}
    if authkey:
        conf["AuthKey"] = authkey
    if capver >= 107:
        conf["AppConnector"] = {"Advertise": False}
    return conf


def config_secret(r: RecorderSpec, cfg: ControllerConfig, i: int, authkey: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(r, cfg, config_secret_name(r, i)),
            "stringData": {config_key(c): dumps(tailscaled_config(r, cfg, i, authkey, c)) for c in CONFIG_CAPVERS}}


def state_secret(r: RecorderSpec, cfg: ControllerConfig, i: int) -> dict:
    """Empty: the controller makes it so that the Role can name it; the agent fills it."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(r, cfg, state_secret_name(r, i)),
            "stringData": {}}


def rbac(r: RecorderSpec, cfg: ControllerConfig, retiring: Sequence[int] = ()) -> tuple[dict | None, dict, dict]:
    """ServiceAccount (None when spec.statefulSet.pod.serviceAccount names one to use), Role and RoleBinding
    `<rec>`; the Role allows the replicas' state Secrets only (and, while their Pods shut down, those of the
    replicas scaled away: `retiring`)."""
    sa, role, binding = proxyrbac.identity(r.name, cfg.namespace, labels(r),
                                           [state_secret_name(r, i) for i in [*range(r.replicas), *retiring]])
    for o in (sa, role, binding):
        o["metadata"]["ownerReferences"] = _owner(r)
    sa_ann = _get(r.pod, "serviceAccount", "annotations") or {}
    if sa_ann:
        sa["metadata"]["annotations"] = {**sa["metadata"].get("annotations", {}), **sa_ann}
    binding["subjects"] = [{"kind": "ServiceAccount", "name": r.service_account, "namespace": cfg.namespace}]
    return (rehash(sa) if r.service_account == r.name else None), rehash(role), rehash(binding)


def statefulset(r: RecorderSpec, cfg: ControllerConfig) -> dict:
    pod_over = r.pod
    volumes: list[dict] = [{"name": "tailscaled-socket", "emptyDir": {}}, {"name": "data", "emptyDir": {}}]
    sock = {"name": "tailscaled-socket", "mountPath": SOCKET_DIR}
    mounts: list[dict] = [sock]
    for i in range(r.replicas):
        volumes.append({"name": f"tailscaledconfig-{i}", "secret": {"secretName": config_secret_name(r, i)}})
        mounts.append({"name": f"tailscaledconfig-{i}", "mountPath": f"/etc/tsconfig/{state_secret_name(r, i)}",
                       "readOnly": True})

    def fieldref(path: str) -> dict:
        return {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}
    tailscale = {
        "name": "tailscale", "image": cfg.proxy_image, "imagePullPolicy": cfg.image_pull_policy,
        "env": [{"name": "POD_NAME", **fieldref("metadata.name")}, {"name": "POD_UID", **fieldref("metadata.uid")},
                {"name": "TS_USERSPACE", "value": "false"},
                {"name": "TS_KUBE_SECRET", "value": "$(POD_NAME)"},
                {"name": "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR", "value": "/etc/tsconfig/$(POD_NAME)"},
                {"name": "TS_SOCKET", "value": SOCKET},
                {"name": "TS_INTERNAL_APP", "value": APP}],
        "resources": cfg.proxy_resources, "volumeMounts": mounts,
        # a kernel TUN device: the recorder listens on the tailnet addresses tailscaled puts on tailscale0
        "securityContext": {"privileged": True}}
    c_over = _get(pod_over, "container") or {}
    if r.s3_bucket:
        env = [{"name": "TSRECORDER_DST", "value": f"s3://{r.s3_endpoint}"},
               {"name": "TSRECORDER_BUCKET", "value": r.s3_bucket}]
    else:
        env = [{"name": "TSRECORDER_DST", "value": RECORDINGS_DIR}]
    env.append({"name": "TS_SOCKET", "value": SOCKET})
    if r.enable_ui:
        env.append({"name": "TSRECORDER_UI", "value": "true"})
    # the user's env last, as upstream: its value wins over a rendered one of the same name
    env = [e for e in env if e["name"] not in {x["name"] for x in c_over.get("env") or ()}] + \
        [dict(e) for e in c_over.get("env") or ()]
    recorder: dict[str, Any] = {
        "name": "recorder", "image": c_over.get("image") or cfg.proxy_image,
        "imagePullPolicy": c_over.get("imagePullPolicy") or cfg.image_pull_policy,
        "command": ["tsrecorder"], "env": env,
        "volumeMounts": [sock, {"name": "data", "mountPath": DATA_DIR}],
        # port 80 on the tailnet addresses needs this one capability, nothing else
        "securityContext": c_over.get("securityContext") or {
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}}
    if c_over.get("resources"):
        recorder["resources"] = dict(c_over["resources"])
    if r.s3_secret:
        # each key of the Secret an environment variable, as upstream (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)
        recorder["envFrom"] = [{"secretRef": {"name": r.s3_secret}}]
    pod_spec: dict[str, Any] = {"serviceAccountName": r.service_account, "containers": [tailscale, recorder],
                                "volumes": volumes}
    for k in ("affinity", "nodeSelector", "tolerations", "imagePullSecrets", "securityContext"):
        if pod_over.get(k):
            pod_spec[k] = pod_over[k]
    if "imagePullSecrets" not in pod_spec and cfg.proxy_image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in cfg.proxy_image_pull_secrets]
    pod_labels = {**(pod_over.get("labels") or {}), **labels(r)}
    template_meta: dict[str, Any] = {"labels": pod_labels}
    if pod_over.get("annotations"):
        template_meta["annotations"] = dict(pod_over["annotations"])
    meta = _meta(r, cfg, r.name)
    meta["labels"] = {**r.sts_labels, **labels(r)}
    if r.sts_annotations:
        meta["annotations"] = dict(r.sts_annotations)
    return hashed({
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta,
        "spec": {"replicas": r.replicas, "serviceName": r.name, "selector": {"matchLabels": labels(r)},
                 "podManagementPolicy": "Parallel",
                 "template": {"metadata": template_meta, "spec": pod_spec}}})


@dataclass(frozen=True)
class Rendered:
    """In the order they are applied: the Secrets, then the identity, then the StatefulSet."""

    secrets: tuple[dict, ...]
    service_account: dict | None
    role: dict
    role_binding: dict
    statefulset: dict

    def objects(self) -> list[dict]:
        return [*self.secrets, *([self.service_account] if self.service_account else []), self.role,
                self.role_binding, self.statefulset]


def render(r: RecorderSpec, cfg: ControllerConfig, authkeys: Sequence[str], retiring: Sequence[int] = ()) -> Rendered:
    """Every object of the Recorder; `authkeys[i]` is replica i's (empty once it has logged in); `retiring`: the
    replicas scaled away whose Pods still run (their state Secrets stay in the Role)."""
    if len(authkeys) != r.replicas:
        raise ValueError(f"{len(authkeys)} auth keys for {r.replicas} replicas")
    secrets: list[dict] = []
    for i in range(r.replicas):
        secrets += [state_secret(r, cfg, i), config_secret(r, cfg, i, authkeys[i])]
    sa, role, binding = rbac(r, cfg, retiring)
    return Rendered(tuple(secrets), sa, role, binding, statefulset(r, cfg))


def _b64(data: Mapping[str, Any], key: str) -> bytes | None:
    v = data.get(key)
    return base64.b64decode(v) if isinstance(v, str) else None


def devices(r: RecorderSpec, state_secrets: Mapping[str, Mapping[str, Any]]) -> list[dict]:
    """The replicas on the tailnet, from their state Secrets (by name): hostname, tailnetIPs and, with the UI,
    its URL."""
    out = []
    for i in range(r.replicas):
        s = state_secrets.get(state_secret_name(r, i))
        if not s:
            continue
        data = s.get("data") or {}
        fqdn = parse_device_fqdn(_b64(data, KEY_DEVICE_FQDN))
        ips = list(parse_device_ips(_b64(data, KEY_DEVICE_IPS)))
        if not fqdn and not ips:
            continue
        d: dict[str, Any] = {"hostname": fqdn.split(".")[0] if fqdn else f"{r.name}-{i}", "tailnetIPs": ips}
        if r.enable_ui and fqdn:
            d["url"] = f"http://{fqdn.rstrip('.')}"
        out.append(d)
    return out


def status(r: RecorderSpec | None, state_secrets: Mapping[str, Mapping[str, Any]], *, invalid: str = "",
           now: str, previous: Mapping[str, Any] | None = None, generation: int = 0) -> dict:
    """The Recorder's status: its devices and the RecorderReady condition (its lastTransitionTime kept while
    the status stays the same)."""
    if invalid or r is None:
        devs: list[dict] = []
        st, reason, msg = "False", REASON_INVALID, invalid
    else:
        devs = devices(r, state_secrets)
        if len(devs) >= r.replicas:
            st, reason, msg = "True", REASON_CREATED, REASON_CREATED
        else:
            st, reason, msg = "False", REASON_CREATING, (f"{len(devs)}/{r.replicas} replicas are on the tailnet")
        generation = r.generation
    old = next((c for c in (previous or {}).get("conditions") or () if c.get("type") == COND_READY), None)
    when = old["lastTransitionTime"] if old and old.get("status") == st and old.get("lastTransitionTime") else now
    cond = {"type": COND_READY, "status": st, "reason": reason, "message": msg, "lastTransitionTime": when,
            "observedGeneration": generation}
    return {"conditions": [cond], "devices": devs}
