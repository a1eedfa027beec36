"""One proxy's own identity: its ServiceAccount, Role and RoleBinding (pure, deterministic).

Upstream's operator runs every proxy as one shared ServiceAccount whose Role allows every verb on every
Secret of the operator's namespace. A proxy Pod that is compromised can then read the control plane's
credentials kept there (the headscale API key, the OAuth client) and every other proxy's auth key and node
state (and so impersonate it), or delete them. Here, on purpose, each proxy runs as its own ServiceAccount,
named like its StatefulSet, whose Role names exactly its replicas' state Secrets.

What the Role allows is what the agents (ours and upstream containerboot v1.102.3, with tailscaled's
`kube:` state store in the same Pod) do, and nothing more:
- Secrets, only `resourceNames` = the replicas' state Secrets: get (read state, the boot-time reset, the
  shutdown consistency wait), update (tailscaled's store rewrites the whole Secret when it cannot patch) and
  patch (the agents' merge/JSON patches). Both agents ask SelfSubjectAccessReviews for get and update (fatal
  if denied) and for patch and create (optional). `create` is left out: RBAC cannot limit a create to a name,
  and the controller creates each Secret before the StatefulSet, so the agents never need to. No list or
  watch (only upstream's shared-certificate ProxyGroup replicas list Secrets; this controller renders none),
  no delete.
- Events, get/create/patch: tailscaled's store records "state loaded/updated" events on its Pod when a
  SelfSubjectAccessReview without a name says it may do all three (else it logs that it cannot and goes on).
  An Event carries no credential; RBAC cannot limit a create to a name either. Same rule as upstream's.
- The API server proxy with `apiServerProxy.tls.secretName` (ours): `get` on that Secret, in the same Role.
- An L7 Ingress with `spec.tls[].secretName` (ours, docs/https.md): a second Role and RoleBinding, in the
  Ingress's namespace, named like the proxy, that allow `get` on exactly that Secret (the agent reads it every
  20 s; no list, no watch, no write). They go when the Ingress stops naming a Secret or goes away. An Ingress
  in the controller's own namespace gets that `get` in the proxy's Role instead (a second Role there would
  have its name).
Creating SelfSubjectAccessReviews needs no grant (every authenticated user has it).

The objects carry the proxy's child labels (the controller's child lookup and cleanup find them by these)
and the rendering hash (`render.SPEC_HASH`), so an unchanged proxy costs reads only.
"""
from __future__ import annotations

from typing import Any

from .config import ControllerConfig
from .model import ProxySpec
from .render import base_name, child_labels, hashed, secret_name

RBAC_API = "rbac.authorization.k8s.io/v1"
SECRET_VERBS = ("get", "update", "patch")
EVENT_VERBS = ("create", "get", "patch")
TLS_SECRET_VERBS = ("get",)


def identity(name: str, namespace: str, labels: dict[str, str], secrets: list[str],
             read_only: tuple[str, ...] = ()) -> tuple[dict, dict, dict]:
    """ServiceAccount, Role and RoleBinding named `name`, the Role limited to the Secrets `secrets` (and `get`
    on the Secrets `read_only`): the order they are created in (the binding names both). A proxy and a
    ProxyGroup share this shape."""
    def meta() -> dict[str, Any]:
        return {"name": name, "namespace": namespace, "labels": dict(labels)}
    sa = hashed({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta()})
    role = hashed({
        "apiVersion": RBAC_API, "kind": "Role", "metadata": meta(),
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": list(secrets),
                   "verbs": list(SECRET_VERBS)},
                  {"apiGroups": [""], "resources": ["events"], "verbs": list(EVENT_VERBS)}]
        + ([{"apiGroups": [""], "resources": ["secrets"], "resourceNames": list(read_only),
             "verbs": list(TLS_SECRET_VERBS)}] if read_only else []),
    })
    binding = hashed({
        "apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": meta(),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    })
    return sa, role, binding


def impersonation_binding(spec: ProxySpec, cfg: ControllerConfig, cluster_role: str) -> dict | None:
    """Auth mode of the API server proxy: its ServiceAccount bound to the chart's ClusterRole that allows
    `impersonate` on users and groups and nothing else (the API server then authorizes each request as the
    impersonated caller). None in every other case."""
    if spec.apiserver_proxy_mode != "auth":
        return None
    name = base_name(spec.parent)
    return hashed({
        "apiVersion": RBAC_API, "kind": "ClusterRoleBinding",
        "metadata": {"name": f"{cfg.namespace}-{name}-impersonate", "labels": child_labels(spec.parent)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": cfg.namespace}],
    })


def _own_namespace(spec: ProxySpec, cfg: ControllerConfig) -> bool:
    return bool(spec.apiserver_proxy_mode) or spec.parent.namespace == cfg.namespace


def tls_secret_access(spec: ProxySpec, cfg: ControllerConfig) -> tuple[dict, dict] | None:
    """Role and RoleBinding in the Ingress's namespace: the proxy may read its one TLS Secret. None without one,
    and when that namespace is the proxy's own (the API server proxy's, or an Ingress in the controller's
    namespace): `objects`' Role covers it there, under the same name."""
    if not spec.tls_secret or _own_namespace(spec, cfg):
        return None
    name, ns = base_name(spec.parent), spec.parent.namespace

    def meta() -> dict[str, Any]:
        return {"name": name, "namespace": ns, "labels": child_labels(spec.parent)}
    role = hashed({
        "apiVersion": RBAC_API, "kind": "Role", "metadata": meta(),
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [spec.tls_secret],
                   "verbs": list(TLS_SECRET_VERBS)}],
    })
    binding = hashed({
        "apiVersion": RBAC_API, "kind": "RoleBinding", "metadata": meta(),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": cfg.namespace}],
    })
    return role, binding


def objects(spec: ProxySpec, cfg: ControllerConfig) -> tuple[dict, dict, dict]:
    """ServiceAccount, Role, RoleBinding of one proxy: the order they are created in (the binding names both)."""
    # A certificate in the proxy's own namespace (the API server proxy's; an Ingress of the controller's
    # namespace): its Role reads it by name (a second Role there would have this one's name).
    own_tls = (spec.tls_secret,) if spec.tls_secret and _own_namespace(spec, cfg) else ()
    return identity(base_name(spec.parent), cfg.namespace, child_labels(spec.parent),
                    [secret_name(spec.parent, i) for i in range(spec.replicas)], own_tls)


def service_account(spec: ProxySpec, cfg: ControllerConfig) -> dict:
    return objects(spec, cfg)[0]


def role(spec: ProxySpec, cfg: ControllerConfig) -> dict:
    return objects(spec, cfg)[1]


def role_binding(spec: ProxySpec, cfg: ControllerConfig) -> dict:
    return objects(spec, cfg)[2]
