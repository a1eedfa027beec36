"""A ProxyGroup → its Kubernetes objects (pure, deterministic).

Upstream's names and shapes, so stock upstream proxy images run these Pods: a StatefulSet `<pg>` of N Pods;
per replica a config Secret `<pg>-<i>-config` (the tailscaled config file, mounted at
`/etc/tsconfig/<pg>-<i>`, the Pod picking its own through `$(POD_NAME)`) and a state Secret `<pg>-<i>` (the
agent's `TS_KUBE_SECRET`); the ConfigMap `<pg>-egress-config` with `egress-services` (written per egress
Service by the egress Service's pass) and `hep-pings`, mounted at `/etc/proxies`; a pre-stop hook on the agent's
pre-shutdown endpoint with a grace period long enough for it to drain. The ConfigMap's document, the port and
the paths are the ProxyGroup contract's (tscommon/pgcontract.py), shared with the agent.

As for single proxies (controller/proxyrbac.py), the group runs as its own ServiceAccount `<pg>` whose Role
names only its replicas' state Secrets; the config Secrets, which carry the auth keys, reach the Pods only as
volumes.

A ProxyClass applies to the group as to any proxy, through controller/kinds/proxyclass.py's merge (`statefulset(...,
pc)`, `config_secret(..., pc)`); as upstream, a class that sets `TS_LOCAL_ADDR_PORT` moves the replicas' health
check away from where the pre-stop hook asks, so the group then has no hook (and the default grace period).
"""
from __future__ import annotations

from typing import Any

from tscommon import pgcontract as pgc
from tscommon.secretcontract import CONFIG_CAPVERS, config_key

from . import proxyrbac
from .config import ControllerConfig
from .kinds import proxyclass as pcl
from .kinds.proxygroup import GroupSpec
from .render import SYSCTL_SCRIPT, ca_trust, child_labels, dumps, hashed, rehash, tailscaled_config

#: the hook waits up to 300 s for the Pod to leave every EndpointSlice, then 10 s for connections in flight
GRACE_SECONDS = 360


def state_secret_name(pg: str, i: int) -> str:
    return f"{pg}-{i}"


def config_secret_name(pg: str, i: int) -> str:
    return f"{pg}-{i}-config"


def configmap_name(pg: str) -> str:
    return f"{pg}-egress-config"


def replica_index(pg: str, name: str) -> int | None:
    """i for `<pg>-<i>` (a Pod's or a state Secret's name), else None."""
    head, _, tail = name.rpartition("-")
    return int(tail) if head == pg and tail.isdigit() else None


def labels(g: GroupSpec) -> dict[str, str]:
    return child_labels(g.parent)


def selector(g: GroupSpec) -> str:
    return ",".join(f"{k}={v}" for k, v in labels(g).items())


def config_secret(g: GroupSpec, cfg: ControllerConfig, i: int, authkey: str,
                  pc: pcl.ProxyClass | None = None) -> dict:
    spec = g.proxy_spec()
    return pcl.apply_to_config_secret({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": config_secret_name(g.name, i), "namespace": cfg.namespace, "labels": labels(g)},
        "stringData": {config_key(c): dumps(tailscaled_config(spec, cfg, i, authkey, c)) for c in CONFIG_CAPVERS}},
        pc)


def state_secret(g: GroupSpec, cfg: ControllerConfig, i: int) -> dict:
    """Empty: made by the controller so that the Role can name it and the agent (which may not create) fills it."""
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": state_secret_name(g.name, i), "namespace": cfg.namespace, "labels": labels(g)},
            "stringData": {}}


def hep_pings(g: GroupSpec) -> str:
    return pgc.render_hep_pings(g.replicas)


def configmap(g: GroupSpec, cfg: ControllerConfig) -> dict:
    """The ConfigMap as first created; afterwards the group's pass owns `hep-pings` only."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": configmap_name(g.name), "namespace": cfg.namespace, "labels": labels(g)},
            "data": {pgc.KEY_EGRESS_SERVICES: pgc.render_egress_services({}), pgc.KEY_HEP_PINGS: hep_pings(g)}}


def rbac(g: GroupSpec, cfg: ControllerConfig, secrets: list[str]) -> tuple[dict, dict, dict]:
    """ServiceAccount, Role, RoleBinding `<pg>`; `secrets`: the state Secrets the replicas may use (the wanted
    replicas' and those of replicas still shutting down after a scale-down)."""
    return proxyrbac.identity(g.name, cfg.namespace, labels(g), sorted(secrets))


def _env(g: GroupSpec, cfg: ControllerConfig) -> list[dict]:
    def field(path: str) -> dict:
        return {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}
    env: list[dict] = [
        {"name": "TS_USERSPACE", "value": "false"},
        {"name": "POD_IP", **field("status.podIP")},
        {"name": "POD_IPS", **field("status.podIPs")},
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_UID", **field("metadata.uid")},
        {"name": "TS_KUBE_SECRET", "value": "$(POD_NAME)"},
        {"name": "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR", "value": "/etc/tsconfig/$(POD_NAME)"},
        {"name": "TS_EGRESS_PROXIES_CONFIG_PATH", "value": pgc.CONFIG_DIR},
        {"name": "TS_LOCAL_ADDR_PORT", "value": f"$(POD_IP):{pgc.LOCAL_PORT}"},
        {"name": "TS_ENABLE_HEALTH_CHECK", "value": "true"},
    ]
    if cfg.firewall_mode:
        env.append({"name": "TS_DEBUG_FIREWALL_MODE", "value": cfg.firewall_mode})
    env.append({"name": "TS_INTERNAL_APP", "value": g.proxy_spec().app})
    trust = ca_trust(cfg)
    if trust:
        env.append(trust[2])
    # The default class's extra env last: as in upstream, the user's value wins over a rendered one.
    env += [{"name": k, "value": v} for k, v in cfg.proxy_env]
    return env


def statefulset(g: GroupSpec, cfg: ControllerConfig, pc: pcl.ProxyClass | None = None) -> dict:
    """The group's StatefulSet, with its class (if any) merged in as into every other proxy's."""
    volumes: list[dict] = []
    mounts: list[dict] = []
    for i in range(g.replicas):
        sname = config_secret_name(g.name, i)
        volumes.append({"name": f"tailscaledconfig-{i}", "secret": {"secretName": sname}})
        mounts.append({"name": f"tailscaledconfig-{i}", "mountPath": f"/etc/tsconfig/{state_secret_name(g.name, i)}",
                       "readOnly": True})
    volumes.append({"name": "egress-config", "configMap": {"name": configmap_name(g.name)}})
    mounts.append({"name": "egress-config", "mountPath": pgc.CONFIG_DIR, "readOnly": True})
    trust = ca_trust(cfg)
    if trust:
        volumes.append(trust[0])
        mounts.append(trust[1])
    container: dict[str, Any] = {
        "name": "tailscale", "image": cfg.proxy_image, "imagePullPolicy": cfg.image_pull_policy,
        "env": _env(g, cfg), "resources": cfg.proxy_resources, "volumeMounts": mounts,
        "securityContext": {"privileged": True},
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": g.name,
        "initContainers": [{"name": "sysctler", "image": cfg.proxy_image, "imagePullPolicy": cfg.image_pull_policy,
                            "securityContext": {"privileged": True}, "command": ["/bin/sh", "-c", SYSCTL_SCRIPT]}],
        "containers": [container],
        "volumes": volumes,
    }
    if not pcl.sets_local_addr_port(pc):
        # The agent answers once this replica no longer receives traffic through any egress Service (it is out
        # of the EndpointSlices), so connections through the group move to the other replicas first. The hook
        # asks the health check on its default address: a class that moves it gets no hook (as upstream).
        container["lifecycle"] = {"preStop": {"httpGet": {"path": pgc.PRESHUTDOWN_PATH, "port": pgc.LOCAL_PORT}}}
        pod_spec["terminationGracePeriodSeconds"] = GRACE_SECONDS
        # Ready only while tailscaled is up with its tailnet addresses (the agent's /healthz, on the same
        # address): a replica whose tailscaled died, or that is still logging in after a restart, leaves the
        # EndpointSlices (they list Ready replicas only) instead of taking every other new connection nowhere.
        container["readinessProbe"] = {"httpGet": {"path": pgc.HEALTHZ_PATH, "port": pgc.LOCAL_PORT},
                                       "periodSeconds": 1, "failureThreshold": 1, "timeoutSeconds": 1}
    sts = hashed({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": g.name, "namespace": cfg.namespace, "labels": labels(g)},
        "spec": {"replicas": g.replicas, "selector": {"matchLabels": labels(g)},
                 # Replicas start and stop in parallel: one that cannot log in must not hold up the others.
                 "podManagementPolicy": "Parallel",
                 "template": {"metadata": {"labels": labels(g)}, "spec": pod_spec}},
    })
    # A group serves no single egress target: the metrics and debug endpoints apply (as upstream).
    return rehash(pcl.apply_to_statefulset(sts, pc, pcl.Target(endpoints=True))) if pc is not None else sts
