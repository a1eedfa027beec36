"""What each kind the controller acts on is, as plain facts (pure): the lowest part of the table of kinds.

A row names the kind's queue key, its API resource (the apiVersion follows from it), its Kubernetes kind, its
condition type and reasons, the `ts_proxy_type` label of its proxies' metrics, whether its key carries a
namespace, and the few facts that make its proxies or its records different. It imports nothing of ours but the
model and the resources, so the pure modules that render or report for a kind (render.py, status.py,
kinds/dnsconfig.py) read a row here instead of switching on the kind's name, and the kind modules take their own
API names from it. controller/kindtable.py extends each row with what the shell needs (the pass that runs it,
`handled`, `decide`, ...); adding a kind starts with a row here (docs/controller-internals.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import (
    APISERVER,
    COND_CONNECTOR_READY,
    COND_NAMESERVER_READY,
    COND_PG_READY,
    COND_PROXY_READY,
    COND_PROXYCLASS_READY,
    COND_RECORDER_READY,
    CONNECTOR,
    DNSCONFIG,
    INGRESS,
    PROXYCLASS,
    PROXYGROUP,
    RECORDER,
    SVC,
)
from .resources import (
    CONFIGMAPS,
    CONNECTORS,
    DNSCONFIGS,
    INGRESSES,
    PROXYCLASSES,
    PROXYGROUPS,
    RECORDERS,
    SERVICES,
    Resource,
)

#: where a proxy's MagicDNS name for the DNSConfig's records is read (KindFacts.dns_name)
DNS_NAME_ANNOTATION = "annotation"      # the object's tailscale.com/tailnet-fqdn (an egress Service)
DNS_NAME_STATUS = "status"              # status.loadBalancer.ingress[0].hostname (an Ingress)


@dataclass(frozen=True)
class KindFacts:
    key: str                        # the queue key's kind, and the children's LABEL_PARENT_TYPE
    resource: Resource
    kind: str                       # the Kubernetes kind
    condition_type: str | None = None
    proxy_type: str = ""            # the `ts_proxy_type` label of its proxies' metrics (upstream's values)
    namespaced: bool = True         # the parent's key (and its children's labels) carry its namespace
    invalid_reason: str = "ProxyInvalid"
    failed_reason: str = "ProxyFailed"
    pending_reason: str = "ProxyPending"
    ready_reason: str = "ProxyCreated"
    #: its proxies advertise the spec's subnet routes (and the exit node's) in their tailscaled config
    advertises_routes: bool = False
    #: where its proxy's MagicDNS name for the DNSConfig's records is (DNS_NAME_*), "" for none
    dns_name: str = ""
    #: in auth mode its proxy authorizes callers by the control plane's grants (the API server proxy)
    grants_in_auth_mode: bool = False

    @property
    def api_version(self) -> str:
        return self.resource.api_version

    @property
    def api_names(self) -> tuple[str, str, str, str]:
        """(group, version, plural, kind): what a watch and an ownerReference name the kind by."""
        return self.resource.group, self.resource.version, self.resource.plural, self.kind


FACTS: dict[str, KindFacts] = {k.key: k for k in (
    KindFacts(SVC, SERVICES, "Service", COND_PROXY_READY, "ingress_service", dns_name=DNS_NAME_ANNOTATION),
    KindFacts(INGRESS, INGRESSES, "Ingress", None, "ingress_resource", dns_name=DNS_NAME_STATUS),
    KindFacts(CONNECTOR, CONNECTORS, "Connector", COND_CONNECTOR_READY, "connector", namespaced=False,
              invalid_reason="ConnectorInvalid", failed_reason="ConnectorCreationFailed",
              pending_reason="ConnectorCreating", ready_reason="ConnectorCreated", advertises_routes=True),
    KindFacts(APISERVER, CONFIGMAPS, "ConfigMap", None, "apiserver_proxy", grants_in_auth_mode=True),
    KindFacts(PROXYGROUP, PROXYGROUPS, "ProxyGroup", COND_PG_READY, "proxygroup", namespaced=False),
    KindFacts(PROXYCLASS, PROXYCLASSES, "ProxyClass", COND_PROXYCLASS_READY, namespaced=False,
              invalid_reason="ProxyClassInvalid", ready_reason="ProxyClassValid"),
    KindFacts(DNSCONFIG, DNSCONFIGS, "DNSConfig", COND_NAMESERVER_READY, namespaced=False,
              failed_reason="NameserverCreationFailed", ready_reason="NameserverCreated"),
    KindFacts(RECORDER, RECORDERS, "Recorder", COND_RECORDER_READY, namespaced=False, invalid_reason="RecorderInvalid",
              failed_reason="RecorderCreationFailed", pending_reason="RecorderCreating",
              ready_reason="RecorderCreated"),
)}
