"""The API resources the controller reads and writes (pure): where each lives in the API and whether it is
namespaced. The client (controller/kubeapi.py) and the table of kinds (controller/kindtable.py) both name them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resource:
    prefix: str        # "/api/v1" or "/apis/<group>/<version>"
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        """"v1" or "<group>/<version>", as an object's apiVersion names it."""
        return self.prefix.removeprefix("/apis/").removeprefix("/api/")

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


SERVICES = Resource("/api/v1", "services")
SECRETS = Resource("/api/v1", "secrets")
EVENTS = Resource("/api/v1", "events")
PODS = Resource("/api/v1", "pods")
STATEFULSETS = Resource("/apis/apps/v1", "statefulsets")
INGRESSES = Resource("/apis/networking.k8s.io/v1", "ingresses")
CONNECTORS = Resource("/apis/tailscale.com/v1alpha1", "connectors", namespaced=False)
SERVICEACCOUNTS = Resource("/api/v1", "serviceaccounts")
ROLES = Resource("/apis/rbac.authorization.k8s.io/v1", "roles")
ROLEBINDINGS = Resource("/apis/rbac.authorization.k8s.io/v1", "rolebindings")
NAMESPACES = Resource("/api/v1", "namespaces", namespaced=False)
PROXYGROUPS = Resource("/apis/tailscale.com/v1alpha1", "proxygroups", namespaced=False)
CONFIGMAPS = Resource("/api/v1", "configmaps")
ENDPOINTSLICES = Resource("/apis/discovery.k8s.io/v1", "endpointslices")
PROXYCLASSES = Resource("/apis/tailscale.com/v1alpha1", "proxyclasses", namespaced=False)
CRDS = Resource("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", namespaced=False)
SERVICEMONITORS = Resource("/apis/monitoring.coreos.com/v1", "servicemonitors")
CLUSTERROLEBINDINGS = Resource("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", namespaced=False)
DEPLOYMENTS = Resource("/apis/apps/v1", "deployments")
DNSCONFIGS = Resource("/apis/tailscale.com/v1alpha1", "dnsconfigs", namespaced=False)
RECORDERS = Resource("/apis/tailscale.com/v1alpha1", "recorders", namespaced=False)
