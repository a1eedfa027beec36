"""What the controller decides for one parent object: the proxy to run (pure data).

Labels, annotations and the finalizer are upstream's (tailscale k8s-operator), so objects written by either
controller are recognised by the other and stock upstream proxy images run the rendered Pods.
"""
from __future__ import annotations

from dataclasses import dataclass

FINALIZER = "tailscale.com/finalizer"

# Labels on every child object (headless Service, Secrets, StatefulSet, Pods).
LABEL_MANAGED = "tailscale.com/managed"
LABEL_PARENT_NAME = "tailscale.com/parent-resource"
LABEL_PARENT_NS = "tailscale.com/parent-resource-ns"
LABEL_PARENT_TYPE = "tailscale.com/parent-resource-type"

# User-facing annotations.
ANN_EXPOSE = "tailscale.com/expose"
ANN_HOSTNAME = "tailscale.com/hostname"
ANN_TAGS = "tailscale.com/tags"
ANN_TAILNET_IP = "tailscale.com/tailnet-ip"
ANN_TAILNET_IP_OLD = "tailscale.com/ts-tailnet-target-ip"
ANN_TAILNET_FQDN = "tailscale.com/tailnet-fqdn"
ANN_PROXY_GROUP = "tailscale.com/proxy-group"
ANN_FUNNEL = "tailscale.com/funnel"
ANN_HTTP_REDIRECT = "tailscale.com/http-redirect"
ANN_FORWARD_CLUSTER_TRAFFIC = "tailscale.com/experimental-forward-cluster-traffic-via-ingress"

# Pod template annotations that force a restart when a target changes (as upstream).
ANN_LAST_CLUSTER_IP = "tailscale.com/operator-last-set-cluster-ip"
ANN_LAST_DNS_NAME = "tailscale.com/operator-last-set-cluster-dns-name"
ANN_LAST_TAILNET_IP = "tailscale.com/operator-last-set-ts-tailnet-target-ip"
ANN_LAST_TAILNET_FQDN = "tailscale.com/operator-last-set-ts-tailnet-target-fqdn"

# Parent types as written in LABEL_PARENT_TYPE.
SVC, INGRESS, CONNECTOR, PROXYGROUP = "svc", "ingress", "connector", "proxygroup"

# Labels on a ProxyGroup egress Service's ClusterIP Service and EndpointSlices (upstream's).
LABEL_PROXY_GROUP = "tailscale.com/proxy-group"
LABEL_SVC_TYPE = "tailscale.com/svc-type"
#: The work-queue kind of a ProxyClass (not a parent: it has no proxy of its own).
PROXYCLASS = "proxyclass"
#: The API server proxy's parent: the chart's ConfigMap in the controller's namespace (kinds/apiserverproxy.py).
APISERVER = "apiserverproxy"
#: The work-queue kinds of a DNSConfig (one key for every event that can change its records) and of a Recorder.
DNSCONFIG, RECORDER = "dnsconfig", "recorder"

# Conditions and reasons (upstream's names).
COND_PROXY_READY = "TailscaleProxyReady"
COND_CONNECTOR_READY = "ConnectorReady"
COND_PG_READY = "ProxyGroupReady"
COND_PG_AVAILABLE = "ProxyGroupAvailable"
COND_PROXYCLASS_READY = "ProxyClassReady"
COND_NAMESERVER_READY = "NameserverReady"
COND_RECORDER_READY = "RecorderReady"
COND_EGRESS_VALID = "TailscaleEgressSvcValid"
COND_EGRESS_CONFIGURED = "TailscaleEgressSvcConfigured"


class Invalid(Exception):
    """The parent asks for something that cannot be built. str(e) names the field, the value and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Pending(Exception):
    """The parent is valid but something it needs is not there yet (e.g. a ClusterIP); retried later."""


@dataclass(frozen=True)
class Decision:
    """A kind module's answer: the proxy to run, and warnings about parts that were skipped."""

    spec: "ProxySpec"
    warnings: tuple[str, ...] = ()
    notices: tuple[tuple[str, str, str], ...] = ()  # (event type, reason, message): events, once per parent


@dataclass(frozen=True)
class Parent:
    """The object a proxy is made for."""

    kind: str          # SVC | INGRESS | CONNECTOR | PROXYGROUP | APISERVER
    name: str
    namespace: str     # "" for a Connector or a ProxyGroup (cluster-scoped)
    uid: str


@dataclass(frozen=True)
class ProxySpec:
    """Everything the renderer needs for one parent: deterministic, no I/O behind it."""

    parent: Parent
    hostname: str                                   # tailnet host name (one replica), or the prefix base
    tags: tuple[str, ...]                           # tags for the auth key
    app: str                                        # TS_INTERNAL_APP
    target_env: tuple[tuple[str, str], ...] = ()    # TS_DEST_IP / TS_EXPERIMENTAL_DEST_DNS_NAME / ...
    pod_annotations: tuple[tuple[str, str], ...] = ()
    userspace: bool = False                         # L7 Ingress without forwarding: no privileges
    serve_config: dict | None = None                # L7 Ingress: the ServeConfig JSON
    advertise_routes: tuple[str, ...] = ()          # Connector: subnet routes (+ 0.0.0.0/0, ::/0 for exit node)
    forward_cluster_traffic: bool = False           # L7 Ingress annotation
    replicas: int = 1
    hostname_prefix: str = ""                       # Connector: replica i is <prefix>-<i>
    egress_rewrite: bool = False                    # L3 egress: the user's Service becomes an ExternalName
    subnet_routes: tuple[str, ...] = ()             # Connector: the spec's routes, for its status
    exit_node: bool = False                         # Connector: spec.exitNode, for its status
    ingress_http: bool = False                      # L7 Ingress served over plain HTTP on port 80 (ours)
    ingress_http_name: str = ""                     # ... the MagicDNS name its serve config answers to
    apiserver_proxy_mode: str = ""                  # API server proxy: auth | noauth (a second container)
    tls_secret: str = ""                            # L7 Ingress: spec.tls[].secretName served by the agent (ours)

    def replica_hostname(self, i: int) -> str:
        return f"{self.hostname_prefix}-{i}" if self.hostname_prefix else self.hostname
