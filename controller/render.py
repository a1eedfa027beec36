"""ProxySpec → the Kubernetes objects of one proxy (pure, deterministic).

What upstream's operator renders for a single proxy (its `proxy.yaml` / `userspace-proxy.yaml` skeletons and
`reconcileSTS`): a headless Service, one config+state Secret per replica named like its Pod, and a StatefulSet
whose Pods mount every replica's Secret and pick their own through `$(POD_NAME)`. Same labels, env, mounts and
Secret keys, so stock upstream proxy images run these Pods too. Env names are the agent's settings table's
(a test checks every rendered name against it), plus two that tailscaled itself reads.

Differences, on purpose: object names are derived from the parent's UID (`ts-<parent>-<5 chars>`) instead of
the API server's random `generateName` suffix, so rendering is a pure function and a retried create cannot
leave a second orphan set; each proxy runs as its own ServiceAccount named like its StatefulSet, allowed only
its own Secrets (controller/proxyrbac.py), not upstream's shared `proxies` one; each rendered object carries a
hash of itself (`SPEC_HASH`) so that a pass that changes nothing writes nothing, whatever defaults the API server added.

The proxy's ProxyClass is merged in here too (`render(..., pc, target)`, controller/kinds/proxyclass.py's merge), so
what a pass applies is the whole rendering.
"""
from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tscommon.secretcontract import CONFIG_CAPVERS, KEY_SERVE_CONFIG, config_key

from .config import ControllerConfig
from .kindfacts import FACTS
from .kinds import proxyclass as pcl
from .model import LABEL_MANAGED, LABEL_PARENT_NAME, LABEL_PARENT_NS, LABEL_PARENT_TYPE, Parent, ProxySpec

SPEC_HASH = "tailscale.com/controller-spec-hash"
SYSCTL_SCRIPT = ("echo 1 > /proc/sys/net/ipv4/ip_forward && if [ -e /proc/sys/net/ipv6/conf/all/forwarding ]; "
                 "then echo 1 > /proc/sys/net/ipv6/conf/all/forwarding; fi")
#: Env read by tailscaled itself (envknobs), not by the agent's settings table.
TAILSCALED_ENV = ("TS_INTERNAL_APP", "TS_DEBUG_ACME_FORCE_RENEWAL", "TS_DEBUG_ACME_DIRECTORY_URL", "SSL_CERT_DIR")
_NAME_MAX = 52   # a StatefulSet's Pods get a controller-revision-hash label of name + 11 chars, max 63
#: The API server proxy's container talks to tailscaled over this socket, on a volume both containers mount.
APISERVER_SOCKET_DIR = "/var/run/tailscale"
APISERVER_SOCKET = APISERVER_SOCKET_DIR + "/tailscaled.sock"


def child_labels(parent: Parent) -> dict[str, str]:
    return {LABEL_MANAGED: "true", LABEL_PARENT_NAME: parent.name, LABEL_PARENT_NS: parent.namespace,
            LABEL_PARENT_TYPE: parent.kind}


def child_selector(parent: Parent) -> str:
    """The label selector that finds a parent's children."""
    return ",".join(f"{k}={v}" for k, v in child_labels(parent).items())


def base_name(parent: Parent) -> str:
    """ts-<parent name>-<5 chars of the UID's hash>: the headless Service's and the StatefulSet's name."""
    digest = base64.b32encode(hashlib.sha256(parent.uid.encode()).digest()).decode().lower()[:5]
    stem = parent.name[: _NAME_MAX - len("ts--") - 5].rstrip("-.")
    return f"ts-{stem}-{digest}"


def secret_name(parent: Parent, i: int) -> str:
    return f"{base_name(parent)}-{i}"


def tailscaled_config(spec: ProxySpec, cfg: ControllerConfig, i: int, authkey: str, capver: int) -> dict:
    """The `cap-<N>.hujson` content (ipn.ConfigVAlpha as upstream's operator fills it)."""
    conf: dict[str, Any] = {"Version": "alpha0", "Locked": False, "ServerURL": cfg.server_url,
                            "Hostname": spec.replica_hostname(i), "acceptDNS": False, "acceptRoutes": False,
                            "NoStatefulFiltering": True}
    if authkey:
        conf["AuthKey"] = authkey
    if FACTS[spec.parent.kind].advertises_routes:
        conf["AdvertiseRoutes"] = list(spec.advertise_routes)
    if capver >= 107:
        conf["AppConnector"] = {"Advertise": False}
    return conf


def dumps(obj: Any) -> str:
    """Deterministic JSON: sorted keys, no spaces, so an unchanged config is byte-identical."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def secret_string_data(spec: ProxySpec, cfg: ControllerConfig, i: int, authkey: str) -> dict[str, str]:
    """The keys the controller owns in replica i's Secret (tailscaled's and the agent's are left alone)."""
    out = {config_key(c): dumps(tailscaled_config(spec, cfg, i, authkey, c)) for c in CONFIG_CAPVERS}
    if spec.serve_config is not None:
        out[KEY_SERVE_CONFIG] = dumps(spec.serve_config)
    return out


def rehash(obj: dict) -> dict:
    """The object's SPEC_HASH again, after a later step (a ProxyClass) changed it."""
    (obj["metadata"].get("annotations") or {}).pop(SPEC_HASH, None)
    return hashed(obj)


def hashed(obj: dict) -> dict:
    """The object with SPEC_HASH, the hash of its rendering: a pass writes it only when the hash differs."""
    h = hashlib.sha256(dumps(obj).encode()).hexdigest()[:16]
    obj["metadata"].setdefault("annotations", {})[SPEC_HASH] = h
    return obj


def headless_service(spec: ProxySpec, cfg: ControllerConfig) -> dict:
    p = spec.parent
    return hashed({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": base_name(p), "namespace": cfg.namespace, "labels": child_labels(p)},
        "spec": {"clusterIP": "None", "selector": {"app": p.uid}, "ipFamilyPolicy": "PreferDualStack"},
    })


def secret(spec: ProxySpec, cfg: ControllerConfig, i: int, authkey: str) -> dict:
    p = spec.parent
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": secret_name(p, i), "namespace": cfg.namespace, "labels": child_labels(p)},
            "stringData": secret_string_data(spec, cfg, i, authkey)}


#: Where a proxy container finds PROXY_CA_CONFIGMAP's certificates.
CA_DIR = "/etc/containerboot/ca"


#: The Warning event's reason when PROXY_CA_CONFIGMAP's ConfigMap is missing or holds no certificate.
REASON_CA_TRUST = "ControlPlaneCAMissing"


def ca_trust_problem(cfg: ControllerConfig, configmap: Mapping[str, Any] | None) -> str:
    """Why PROXY_CA_CONFIGMAP's ConfigMap (read from the proxies' namespace: `configmap`, None when it does not
    exist) cannot give the proxies their control server's CA, or "" when it can (or the setting is unset).
    Without the ConfigMap the kubelet cannot mount the volume and every proxy Pod waits in ContainerCreating;
    without a certificate in it tailscaled trusts no more than the public CAs and cannot log in."""
    name, ns = cfg.proxy_ca_configmap, cfg.namespace
    if not name:
        return ""
    where = f"ConfigMap {ns}/{name} (PROXY_CA_CONFIGMAP, the chart's proxy.caConfigMap)"
    if configmap is None:
        return (f"{where} does not exist, so the proxies' Pods cannot start: create it with the control server's "
                f"CA certificate (kubectl -n {ns} create configmap {name} --from-file=ca.crt=CA_FILE) or unset "
                "the setting")
    data = {k: v for k, v in (configmap.get("data") or {}).items() if isinstance(v, str)}
    for k, v in (configmap.get("binaryData") or {}).items():
        try:
            data[k] = base64.b64decode(v).decode("ascii", errors="replace") if isinstance(v, str) else ""
        except ValueError:
            data[k] = ""
    # tailscaled (Go's x509) and the agent read PEM files only
    if not any("-----BEGIN CERTIFICATE-----" in v for v in data.values()):
        keys = ", ".join(sorted(data)) or "none"
        return (f"{where} holds no PEM certificate (keys: {keys}): put the control server's CA certificate in "
                f"it (kubectl -n {ns} create configmap {name} --from-file=ca.crt=CA_FILE --dry-run=client -o yaml "
                "| kubectl apply -f -)")
    return ""


def ca_trust(cfg: ControllerConfig) -> tuple[dict, dict, dict] | None:
    """(volume, mount, env entry) that make a proxy container trust PROXY_CA_CONFIGMAP's CAs besides the system's:
    tailscaled (Go) reads every file of each directory in SSL_CERT_DIR, and the agent's own check of the control
    server does the same (containerboot/catrust.py). None without the setting."""
    if not cfg.proxy_ca_configmap:
        return None
    return ({"name": "control-plane-ca", "configMap": {"name": cfg.proxy_ca_configmap}},
            {"name": "control-plane-ca", "mountPath": CA_DIR, "readOnly": True},
            {"name": "SSL_CERT_DIR", "value": f"/etc/ssl/certs:{CA_DIR}"})


def _env(spec: ProxySpec, cfg: ControllerConfig) -> list[dict]:
    def field(path: str) -> dict:
        return {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}
    env: list[dict] = [
        {"name": "TS_USERSPACE", "value": "true" if spec.userspace else "false"},
        {"name": "POD_IP", **field("status.podIP")},
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_UID", **field("metadata.uid")},
        {"name": "TS_KUBE_SECRET", "value": "$(POD_NAME)"},
        {"name": "TS_EXPERIMENTAL_SERVICE_AUTO_ADVERTISEMENT", "value": "false"},
        {"name": "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR", "value": "/etc/tsconfig/$(POD_NAME)"},
        {"name": "TS_DEBUG_ACME_FORCE_RENEWAL", "value": "true"},
    ]
    if spec.forward_cluster_traffic:
        env.append({"name": "EXPERIMENTAL_ALLOW_PROXYING_CLUSTER_TRAFFIC_VIA_INGRESS", "value": "true"})
    if cfg.firewall_mode:
        env.append({"name": "TS_DEBUG_FIREWALL_MODE", "value": cfg.firewall_mode})
    if spec.apiserver_proxy_mode:
        env.append({"name": "TS_SOCKET", "value": APISERVER_SOCKET})
    env += [{"name": k, "value": v} for k, v in spec.target_env]
    env.append({"name": "TS_INTERNAL_APP", "value": spec.app})
    trust = ca_trust(cfg)
    if trust:
        env.append(trust[2])
    # The default ProxyClass's extra env last: as in upstream, the user's value wins over a rendered one.
    env += [{"name": k, "value": v} for k, v in cfg.proxy_env]
    return env


def statefulset(spec: ProxySpec, cfg: ControllerConfig) -> dict:
    p = spec.parent
    name = base_name(p)
    volumes: list[dict] = []
    mounts: list[dict] = []
    for i in range(spec.replicas):
        sname = secret_name(p, i)
        volumes.append({"name": f"tailscaledconfig-{i}", "secret": {"secretName": sname}})
        mounts.append({"name": f"tailscaledconfig-{i}", "mountPath": f"/etc/tsconfig/{sname}", "readOnly": True})
        if spec.serve_config is not None:
            volumes.append({"name": f"serve-config-{i}", "secret": {
                "secretName": sname, "items": [{"key": KEY_SERVE_CONFIG, "path": KEY_SERVE_CONFIG}]}})
            mounts.append({"name": f"serve-config-{i}", "mountPath": f"/etc/tailscaled/{sname}", "readOnly": True})
    trust = ca_trust(cfg)
    if trust:
        volumes.append(trust[0])
        mounts.append(trust[1])
    container: dict[str, Any] = {"name": "tailscale", "image": cfg.proxy_image,
                                 "imagePullPolicy": cfg.image_pull_policy, "env": _env(spec, cfg),
                                 "resources": cfg.proxy_resources, "volumeMounts": mounts}
    # The proxy's own ServiceAccount (controller/proxyrbac.py): it may touch only its replicas' Secrets.
    pod_spec: dict[str, Any] = {"serviceAccountName": name}
    if not spec.userspace:
        container["securityContext"] = {"privileged": True}
        # Same image, same pull policy: with PROXY_IMAGE_PULL_POLICY=Never/IfNotPresent and a `:latest` tag, a
        # defaulted (Always) init container could not start where the proxy image is only preloaded.
        pod_spec["initContainers"] = [{"name": "sysctler", "image": cfg.proxy_image,
                                       "imagePullPolicy": cfg.image_pull_policy,
                                       "securityContext": {"privileged": True},
                                       "command": ["/bin/sh", "-c", SYSCTL_SCRIPT]}]
    pod_spec["containers"] = [container]
    if spec.apiserver_proxy_mode:
        # The API server proxy: a second process of the same image, in the Pod's network namespace (it serves
        # on the tailnet addresses tailscaled puts on tailscale0) and with tailscaled's socket (WhoIs).
        volumes.append({"name": "tailscaled-socket", "emptyDir": {}})
        sock = {"name": "tailscaled-socket", "mountPath": APISERVER_SOCKET_DIR}
        mounts.append(sock)
        pod_spec["containers"].append({
            "name": "apiserver-proxy", "image": cfg.proxy_image, "imagePullPolicy": cfg.image_pull_policy,
            "args": ["apiserver-proxy"],
            "env": [{"name": "TS_APISERVER_PROXY_MODE", "value": spec.apiserver_proxy_mode},
                    {"name": "TS_SOCKET", "value": APISERVER_SOCKET}]
            + ([{"name": "TS_APISERVER_PROXY_TLS_SECRET", "value": spec.tls_secret}] if spec.tls_secret else []),
            "resources": cfg.proxy_resources, "volumeMounts": [sock],
            # Binding the tailnet ports (80/443) needs this one capability, nothing else.
            "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}})
    pod_spec["volumes"] = volumes
    if cfg.proxy_image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in cfg.proxy_image_pull_secrets]
    if cfg.proxy_node_selector:
        pod_spec["nodeSelector"] = dict(cfg.proxy_node_selector)
    if cfg.proxy_tolerations:
        pod_spec["tolerations"] = list(cfg.proxy_tolerations)
    if cfg.proxy_affinity:
        pod_spec["affinity"] = dict(cfg.proxy_affinity)
    template_meta: dict[str, Any] = {"deletionGracePeriodSeconds": 10,
                                     "labels": {**child_labels(p), "app": p.uid}}
    if spec.pod_annotations:
        template_meta["annotations"] = dict(spec.pod_annotations)
    return hashed({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": cfg.namespace, "labels": child_labels(p)},
        "spec": {"replicas": spec.replicas, "serviceName": name, "selector": {"matchLabels": {"app": p.uid}},
                 "template": {"metadata": template_meta, "spec": pod_spec}},
    })


@dataclass(frozen=True)
class Rendered:
    service: dict
    secrets: tuple[dict, ...]
    statefulset: dict


def classed_statefulset(spec: ProxySpec, cfg: ControllerConfig, pc: pcl.ProxyClass | None,
                        target: pcl.Target) -> dict:
    """The proxy's StatefulSet with its ProxyClass (if any) merged in (`target`: kindtable.proxy_target)."""
    sts = statefulset(spec, cfg)
    return rehash(pcl.apply_to_statefulset(sts, pc, target)) if pc is not None else sts


def render(spec: ProxySpec, cfg: ControllerConfig, authkeys: tuple[str, ...], pc: pcl.ProxyClass | None = None,
           target: pcl.Target = pcl.Target()) -> Rendered:
    """Every object of the proxy, with its ProxyClass merged in; authkeys[i] is replica i's key to put in its
    config ("" = none)."""
    return Rendered(headless_service(spec, cfg),
                    tuple(pcl.apply_to_config_secret(secret(spec, cfg, i, authkeys[i] if i < len(authkeys) else ""),
                                                     pc) for i in range(spec.replicas)),
                    classed_statefulset(spec, cfg, pc, target))
