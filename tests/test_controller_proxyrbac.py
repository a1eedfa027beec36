"""controller.proxyrbac: each proxy's own ServiceAccount, Role and RoleBinding, exact, and what they allow.

The Role is checked the way the API server's RBAC authorizer reads it (a rule matches when its group,
resource, verb and, if it names any, resourceName match): every call the agents make on their state Secret is
allowed, the SelfSubjectAccessReviews they ask at boot get the answers they need, and nothing else in the
namespace is reachable (the control plane's credentials, another proxy's Secrets, list/watch/create/delete).
"""
from __future__ import annotations

import json

from controller.config import ControllerConfig
from controller.kinds import connector, service
from controller.proxyrbac import objects, role, role_binding, service_account
from controller.render import SPEC_HASH, base_name, render

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1",
                       login_server="https://hs.example.com")
LABELS = {"tailscale.com/managed": "true", "tailscale.com/parent-resource": "web",
          "tailscale.com/parent-resource-ns": "apps", "tailscale.com/parent-resource-type": "svc"}


def _spec():
    return service.decide({"metadata": {"name": "web", "namespace": "apps", "uid": "1111-2222",
                                        "annotations": {"tailscale.com/expose": "true"}},
                           "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10"}}, CFG).spec


def _connector(replicas):
    return connector.decide({"metadata": {"name": "office", "uid": "u-c"},
                             "spec": {"exitNode": True, "replicas": replicas}}, CFG).spec


def _strip_hash(obj: dict) -> dict:
    obj = json.loads(json.dumps(obj))
    ann = obj["metadata"].pop("annotations")
    assert len(ann[SPEC_HASH]) == 16
    return obj


def allows(role_obj: dict, verb: str, resource: str, name: str = "", group: str = "") -> bool:
    """RBAC's rule matching for one request (no wildcards are rendered, so none are handled)."""
    for r in role_obj["rules"]:
        if group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]:
            names = r.get("resourceNames")
            if not names or name in names:
                return True
    return False


def test_service_account_role_and_binding_exact():
    spec = _spec()
    name = base_name(spec.parent)
    sa, ro, rb = objects(spec, CFG)
    meta = {"name": name, "namespace": "tailscale", "labels": LABELS}
    assert _strip_hash(sa) == {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    assert _strip_hash(ro) == {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [f"{name}-0"],
                   "verbs": ["get", "update", "patch"]},
                  {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "get", "patch"]}]}
    assert _strip_hash(rb) == {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "tailscale"}]}


def test_the_statefulset_runs_as_the_proxys_own_service_account():
    spec = _spec()
    pod = render(spec, CFG, ("k",)).statefulset["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == service_account(spec, CFG)["metadata"]["name"] == base_name(spec.parent)
    assert role_binding(spec, CFG)["subjects"][0]["name"] == pod["serviceAccountName"]


def test_role_names_every_replicas_secret_and_follows_scaling():
    two, three = role(_connector(2), CFG), role(_connector(3), CFG)
    name = base_name(_connector(2).parent)
    secrets = [s["metadata"]["name"] for s in render(_connector(3), CFG, ("a", "b", "c")).secrets]
    assert three["rules"][0]["resourceNames"] == secrets == [f"{name}-0", f"{name}-1", f"{name}-2"]
    assert two["rules"][0]["resourceNames"] == secrets[:2]
    assert two["metadata"]["annotations"][SPEC_HASH] != three["metadata"]["annotations"][SPEC_HASH]
    assert objects(_connector(2), CFG) == objects(_connector(2), CFG), "deterministic"


def test_role_allows_the_agents_calls_on_its_own_secret_only():
    spec = _spec()
    ro = role(spec, CFG)
    own = f"{base_name(spec.parent)}-0"
    # Boot-time SelfSubjectAccessReviews (ours and upstream's): get and update are required, patch is used.
    for verb in ("get", "update", "patch"):
        assert allows(ro, verb, "secrets", own), verb
    # create is not granted: the controller creates the Secret before the StatefulSet.
    assert not allows(ro, "create", "secrets", own)
    # tailscaled's kube store: events on its Pod, after an unnamed review for get, create and patch.
    for verb in ("get", "create", "patch"):
        assert allows(ro, verb, "events"), verb
    # What a compromised proxy must not reach.
    for other in ("headscale-api", "operator-oauth", "tailscale-auth", "ts-db-abcde-0", f"{own}x"):
        for verb in ("get", "update", "patch", "delete"):
            assert not allows(ro, verb, "secrets", other), (verb, other)
    for verb in ("list", "watch", "delete", "deletecollection"):
        assert not allows(ro, verb, "secrets", own) and not allows(ro, verb, "secrets"), verb
    for verb in ("list", "watch", "delete"):
        assert not allows(ro, verb, "events"), verb
    assert all(r["apiGroups"] == [""] and set(r["resources"]) <= {"secrets", "events"} for r in ro["rules"])
