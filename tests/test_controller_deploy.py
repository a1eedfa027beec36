"""deploy/: the manifests parse, the Connector CRD stores router + exit node as upstream's does, RBAC
covers every call the controller makes, and the Deployment sets only settings the controller reads."""
from __future__ import annotations

import inspect
import pathlib

import yaml

from controller import config as cconfig
from controller import kubeapi, leader, proxyrbac
from controller.kinds import service

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "deploy"


def docs():
    out = []
    for f in sorted(DEPLOY.rglob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def by_kind(kind):
    return [d for d in docs() if d["kind"] == kind]


def test_connector_crd_matches_upstream_names_and_stores_both():
    (crd,) = [d for d in by_kind("CustomResourceDefinition") if d["spec"]["names"]["kind"] == "Connector"]
    assert crd["metadata"]["name"] == "connectors.tailscale.com" and crd["spec"]["scope"] == "Cluster"
    (v,) = crd["spec"]["versions"]
    assert v["name"] == "v1alpha1" and v["subresources"] == {"status": {}}
    spec = v["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert {"subnetRouter", "exitNode", "hostname", "tags", "hostnamePrefix", "replicas"} <= set(spec["properties"])
    assert spec["properties"]["subnetRouter"]["properties"]["advertiseRoutes"]["items"]["format"] == "cidr"
    # no rule refuses a Connector that is both, as upstream's CRD: the controller refuses it on the object
    # (tests/test_upstream_crds.py), so that an object written for upstream is never refused by the API server
    assert not [r for r in spec["x-kubernetes-validations"] if "create two Connectors" in r.get("message", "")]


def test_dnsconfig_crd_has_upstreams_names():
    (crd,) = [c for c in by_kind("CustomResourceDefinition") if c["metadata"]["name"] == "dnsconfigs.tailscale.com"]
    assert crd["spec"]["scope"] == "Cluster" and crd["spec"]["names"]["kind"] == "DNSConfig"
    (v,) = crd["spec"]["versions"]
    assert v["name"] == "v1alpha1" and v["subresources"] == {"status": {}}
    ns = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["nameserver"]["properties"]
    assert {"image", "service", "pod", "replicas"} <= set(ns)
    assert set(ns["image"]["properties"]) == {"repo", "tag"} and "clusterIP" in ns["service"]["properties"]
    status = v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert "ip" in status["nameserver"]["properties"]


def test_proxygroup_crd_matches_upstream_names():
    (crd,) = [d for d in by_kind("CustomResourceDefinition") if d["metadata"]["name"] == "proxygroups.tailscale.com"]
    assert crd["spec"]["scope"] == "Cluster" and crd["spec"]["names"]["shortNames"] == ["pg"]
    (v,) = crd["spec"]["versions"]
    assert v["name"] == "v1alpha1" and v["subresources"] == {"status": {}}
    spec = v["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["type"]
    assert {"type", "replicas", "hostnamePrefix", "tags", "proxyClass"} <= set(spec["properties"])
    t = spec["properties"]["type"]
    assert t["enum"] == ["egress", "ingress", "kube-apiserver"]
    assert t["x-kubernetes-validations"] == [{"rule": "self == oldSelf", "message": "ProxyGroup type is immutable"}]
    status = v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status["devices"]["items"]["properties"]) == {"hostname", "tailnetIPs", "staticEndpoints"}


def test_rbac_covers_proxygroups_and_their_egress_objects():
    (cr,) = [d for d in by_kind("ClusterRole") if d["metadata"]["name"] == "tailscale-controller"]
    (role,) = [d for d in by_kind("Role") if d["metadata"]["name"] == "tailscale-controller"]
    for verb in ("get", "list", "watch", "patch"):
        assert _covered(cr["rules"], "tailscale.com", "proxygroups", verb), verb
    assert _covered(cr["rules"], "tailscale.com", "proxygroups/status", "patch")
    for res, grp in ((kubeapi.CONFIGMAPS, ""), (kubeapi.ENDPOINTSLICES, "discovery.k8s.io")):
        for verb in ("get", "list", "create", "patch", "delete"):
            assert _covered(role["rules"], grp, res.plural, verb), (res.plural, verb)
    assert _covered(role["rules"], "", "pods", "watch")


def test_proxyclass_crd_has_upstreams_names_and_fields():
    (crd,) = [d for d in by_kind("CustomResourceDefinition") if d["spec"]["names"]["kind"] == "ProxyClass"]
    assert crd["metadata"]["name"] == "proxyclasses.tailscale.com" and crd["spec"]["scope"] == "Cluster"
    (v,) = crd["spec"]["versions"]
    assert v["name"] == "v1alpha1" and v["subresources"] == {"status": {}}
    spec = v["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert {"statefulSet", "metrics", "tailscale", "useLetsEncryptStagingEnvironment"} <= set(spec)
    sts = spec["statefulSet"]["properties"]
    assert {"labels", "annotations", "pod"} <= set(sts)
    pod = sts["pod"]["properties"]
    assert {"labels", "annotations", "affinity", "nodeName", "nodeSelector", "tolerations",
            "topologySpreadConstraints", "priorityClassName", "imagePullSecrets", "securityContext", "dnsPolicy",
            "dnsConfig", "tailscaleContainer", "tailscaleInitContainer"} <= set(pod)
    for c in ("tailscaleContainer", "tailscaleInitContainer"):
        assert {"env", "image", "imagePullPolicy", "resources", "securityContext", "debug"} <= set(
            pod[c]["properties"]), c
        assert pod[c]["properties"]["debug"]["properties"]["enable"]["type"] == "boolean"
    assert set(spec["metrics"]["properties"]["serviceMonitor"]["properties"]) == {"enable", "labels"}
    assert spec["tailscale"]["properties"]["acceptRoutes"]["type"] == "boolean"


def _covered(rules, group, resource, verb):
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def test_rbac_covers_the_controllers_calls():
    (cr,) = [d for d in by_kind("ClusterRole") if d["metadata"]["name"] == "tailscale-controller"]
    (role,) = [d for d in by_kind("Role") if d["metadata"]["name"] == "tailscale-controller"]
    group = lambda res: res.prefix.split("/")[2] if res.prefix.startswith("/apis/") else ""  # noqa: E731
    for res in (kubeapi.SERVICES, kubeapi.INGRESSES, kubeapi.CONNECTORS):
        for verb in ("get", "list", "watch", "patch"):
            assert _covered(cr["rules"], group(res), res.plural, verb), (res.plural, verb)
        assert _covered(cr["rules"], group(res), res.plural + "/status", "patch")
    for res in (kubeapi.SECRETS, kubeapi.SERVICES, kubeapi.STATEFULSETS):
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            assert _covered(role["rules"], group(res), res.plural, verb), (res.plural, verb)
    assert _covered(cr["rules"], "", "events", "create")
    # the proxies' namespace's Pod Security level (controller/podsecurity.py)
    assert _covered(cr["rules"], "", kubeapi.NAMESPACES.plural, "get")
    # ProxyClasses: read and watched cluster-wide, their status written; the ServiceMonitor CRD looked up;
    # metrics ServiceMonitors in the controller's namespace
    for verb in ("get", "list", "watch"):
        assert _covered(cr["rules"], "tailscale.com", "proxyclasses", verb), verb
    assert _covered(cr["rules"], "tailscale.com", "proxyclasses/status", "patch")
    assert _covered(cr["rules"], "apiextensions.k8s.io", "customresourcedefinitions", "get")
    for verb in ("get", "list", "create", "patch", "delete"):
        assert _covered(role["rules"], "monitoring.coreos.com", "servicemonitors", verb), verb
    assert not _covered(cr["rules"], "", "secrets", "list"), "no cluster-wide Secret access"
    # leader election: the Lease in the controller's namespace, bound to the controller's ServiceAccount
    (le,) = [d for d in by_kind("Role") if d["metadata"]["name"] == "tailscale-controller-leader-election"]
    for verb in ("get", "create", "patch"):
        assert _covered(le["rules"], group(leader.LEASES), leader.LEASES.plural, verb), verb
    # ... and its owner, the Deployment, found from the controller's Pod (POD_NAME from the downward API): one get
    # of the Pod and one of its ReplicaSet, nothing more on either
    for res in (kubeapi.PODS, leader.REPLICASETS):
        (rule,) = [r for r in le["rules"] if res.plural in r["resources"]]
        assert rule["apiGroups"] == [group(res)] and rule["verbs"] == ["get"], rule
    (dep,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "tailscale-controller"]
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in ctr["env"]
    (leb,) = [d for d in by_kind("RoleBinding") if d["roleRef"]["name"] == "tailscale-controller-leader-election"]
    assert leb["subjects"] == [{"kind": "ServiceAccount", "name": "tailscale-controller", "namespace": "tailscale"}]
    for res in (kubeapi.SERVICEACCOUNTS, kubeapi.ROLES, kubeapi.ROLEBINDINGS):
        for verb in ("get", "list", "create", "patch", "delete"):
            assert _covered(role["rules"], group(res), res.plural, verb), (res.plural, verb)
    # DNSConfig: watched cluster-wide with its status; the nameserver's objects in the namespace; EndpointSlices
    for verb in ("get", "list", "watch"):
        assert _covered(cr["rules"], "tailscale.com", "dnsconfigs", verb), verb
        assert _covered(role["rules"], "discovery.k8s.io", "endpointslices", verb), verb
    assert _covered(cr["rules"], "tailscale.com", "dnsconfigs/status", "patch")
    for res in (kubeapi.CONFIGMAPS, kubeapi.DEPLOYMENTS):
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            assert _covered(role["rules"], group(res), res.plural, verb), (res.plural, verb)
    # Recorders: watched cluster-wide, their finalizer and status written; their Pods listed (a scale-down)
    for verb in ("get", "list", "watch", "patch"):
        assert _covered(cr["rules"], "tailscale.com", kubeapi.RECORDERS.plural, verb), verb
    assert _covered(cr["rules"], "tailscale.com", "recorders/status", "patch")
    assert _covered(cr["rules"], "tailscale.com", "recorders/finalizers", "update")
    assert _covered(role["rules"], "", kubeapi.PODS.plural, "list")


def test_no_shared_proxy_identity_and_the_controller_holds_what_it_grants():
    """No Role lets every proxy touch every Secret (upstream's `proxies`); the controller can write each
    proxy's Role without `escalate`/`bind` because it holds every rule it grants in that namespace (the one
    `bind` it holds is for the API server proxy's impersonation ClusterRole, by name)."""
    assert [r["metadata"]["name"] for r in by_kind("Role")] == ["tailscale-controller",
                                                                "tailscale-controller-leader-election"]
    assert [s["metadata"]["name"] for s in by_kind("ServiceAccount")] == ["tailscale-controller"]
    (cr,) = [d for d in by_kind("ClusterRole") if d["metadata"]["name"] == "tailscale-controller"]
    (role,) = [d for d in by_kind("Role") if d["metadata"]["name"] == "tailscale-controller"]
    held = cr["rules"] + role["rules"]
    assert not any({"escalate", "impersonate", "*"} & set(r["verbs"]) for r in held)
    # `bind` on one ClusterRole only: the API server proxy's (auth mode) impersonation role, which the
    # controller binds to that proxy's ServiceAccount without being able to impersonate anyone itself
    binds = [r for r in held if "bind" in r["verbs"]]
    assert binds == [{"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"],
                      "resourceNames": ["tailscale-apiserver-proxy-impersonate"], "verbs": ["bind"]}]
    spec = service.decide({"metadata": {"name": "web", "namespace": "apps", "uid": "u", "annotations": {
        "tailscale.com/expose": "true"}}, "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.1"}},
        cconfig.ControllerConfig(namespace="tailscale", proxy_image="x")).spec
    for rule in proxyrbac.role(spec, cconfig.ControllerConfig(namespace="tailscale", proxy_image="x"))["rules"]:
        for g in rule["apiGroups"]:
            for res in rule["resources"]:
                for verb in rule["verbs"]:
                    assert _covered(role["rules"], g, res, verb), (res, verb)


def test_deployment_env_is_read_by_the_controller():
    (dep,) = by_kind("Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    src = inspect.getsource(cconfig.load)
    for e in c["env"]:
        assert f'"{e["name"]}"' in src, e["name"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "tailscale-controller"
    (ns,) = by_kind("Namespace")
    assert ns["metadata"]["name"] == "tailscale"
    (ic,) = by_kind("IngressClass")
    assert ic["spec"]["controller"] == "tailscale.com/ts-ingress"
