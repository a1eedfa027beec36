"""Manifests for the real cluster's scenarios (pure: arguments in, dicts out; applied with KubeCluster.apply).

* ``echo_backend``: a Deployment of ``lab-echo`` (answers with a marker, the peer and the Pod's name) and its
  ClusterIP Service: the backend the proxy exposes, reached through kube-proxy.
* ``proxy_rbac``: the proxy's ServiceAccount, a Role on its state Secret and a RoleBinding, as upstream's
  operator renders them (``get``, ``update``, ``patch`` on the named Secret; ``verbs`` narrows it, e.g. a
  Role without ``patch``).
* ``proxy_config_secret``: the operator's config Secret: one ``cap-<N>.hujson`` tailscaled config (one-step
  mode), mounted into the Pod, rewritten to change the proxy's config.
* ``proxy_statefulset``: the agent as a one-replica StatefulSet Pod, privileged with /dev/net/tun as upstream's
  operator runs proxies, state in the Secret named after the Pod (``TS_KUBE_SECRET=$(POD_NAME)``).

There is no cluster DNS (CoreDNS) in the lab: the Pods find ``kubernetes.default.svc`` through
``hostAliases`` (an /etc/hosts entry for the ``kubernetes`` Service's ClusterIP) and the tailnet's control
server by IP.
"""
from __future__ import annotations

import base64
import json
from typing import Mapping, Sequence

CAP_VERSION = 95          # cap-95.hujson: a capability version every tailscaled since 1.60 understands


def echo_backend(namespace: str, name: str, marker: str, image: str, *, port: int = 8080,
                 replicas: int = 1) -> list[dict]:
    labels = {"app": name}
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
         "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels},
                               "spec": {"terminationGracePeriodSeconds": 1,
                                        "containers": [{"name": "echo", "image": image, "imagePullPolicy": "Never",
                                                        "env": [{"name": "MARKER", "value": marker},
                                                                {"name": "PORT", "value": str(port)}],
                                                        "ports": [{"containerPort": port}],
                                                        "readinessProbe": {"tcpSocket": {"port": port},
                                                                           "periodSeconds": 1}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
         "spec": {"type": "ClusterIP", "selector": labels, "ports": [{"port": port, "targetPort": port}]}},
    ]


def namespace(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def proxy_rbac(namespace: str, name: str, secret: str, *,
               verbs: Sequence[str] = ("get", "update", "patch")) -> list[dict]:
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": name, "namespace": namespace},
         "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [secret], "verbs": list(verbs)},
                   {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch", "get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": name, "namespace": namespace},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}},
    ]


def secret(namespace: str, name: str, data: Mapping[str, str | bytes] | None = None) -> dict:
    enc = {k: base64.b64encode(v if isinstance(v, bytes) else v.encode()).decode() for k, v in (data or {}).items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
            "type": "Opaque", "data": enc}


def tailscaled_config(*, authkey: str, hostname: str, server_url: str,
                      advertise_routes: Sequence[str] = ()) -> str:
    """A tailscaled ``alpha0`` config file as the operator renders one (JSON is valid HuJSON)."""
    doc = {"Version": "alpha0", "Locked": False, "AuthKey": authkey, "Hostname": hostname, "ServerURL": server_url,
           "AcceptDNS": False, "AcceptRoutes": False, "AdvertiseRoutes": list(advertise_routes) or None}
    return json.dumps({k: v for k, v in doc.items() if v is not None}, indent=1)


def proxy_config_secret(namespace: str, name: str, config_text: str) -> dict:
    return secret(namespace, name, {f"cap-{CAP_VERSION}.hujson": config_text})


def proxy_statefulset(namespace: str, name: str, image: str, *, service_account: str, dest_ip: str,
                      api_ip: str, env: Mapping[str, str] | None = None, config_secret: str | None = None,
                      privileged: bool = True) -> dict:
    """The agent's StatefulSet (one replica: Pod ``<name>-0``, state Secret ``<name>-0``)."""
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    e: list[dict] = [
        {"name": "POD_NAME", **field("metadata.name")}, {"name": "POD_UID", **field("metadata.uid")},
        {"name": "POD_IP", **field("status.podIP")}, {"name": "POD_IPS", **field("status.podIPs")},
        {"name": "TS_KUBE_SECRET", "value": "$(POD_NAME)"}, {"name": "TS_USERSPACE", "value": "false"},
        {"name": "TS_DEST_IP", "value": dest_ip},
    ]
    mounts, volumes = [], []
    if config_secret:
        e.append({"name": "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR", "value": "/etc/tsconfig"})
        mounts.append({"name": "tsconfig", "mountPath": "/etc/tsconfig", "readOnly": True})
        volumes.append({"name": "tsconfig", "secret": {"secretName": config_secret}})
    e += [{"name": k, "value": v} for k, v in (env or {}).items()]
    sc = {"privileged": True} if privileged else {"capabilities": {"add": ["NET_ADMIN"]}}
    if not privileged:
        mounts.append({"name": "tun", "mountPath": "/dev/net/tun"})
        volumes.append({"name": "tun", "hostPath": {"path": "/dev/net/tun", "type": "CharDevice"}})
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": 1, "serviceName": name, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {
                     "serviceAccountName": service_account, "terminationGracePeriodSeconds": 30,
                     "hostAliases": [{"ip": api_ip, "hostnames": ["kubernetes.default.svc",
                                                                  "kubernetes.default.svc.cluster.local"]}],
                     "containers": [{"name": "tailscale", "image": image, "imagePullPolicy": "Never",
                                     "env": e, "securityContext": sc, "volumeMounts": mounts}],
                     "volumes": volumes}}},
    }
