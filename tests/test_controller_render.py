"""controller.render: parent + settings → the exact manifests upstream's operator renders for one proxy."""
from __future__ import annotations

import json
from dataclasses import replace

from containerboot.settings import SETTINGS
from controller.config import ControllerConfig
from controller.kinds import connector, ingress, service
from controller.render import CA_DIR, SPEC_HASH, TAILSCALED_ENV, base_name, render

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1",
                       login_server="https://hs.example.com", firewall_mode="nftables")
LABELS = {"tailscale.com/managed": "true", "tailscale.com/parent-resource": "web",
          "tailscale.com/parent-resource-ns": "apps", "tailscale.com/parent-resource-type": "svc"}


def _svc(**spec):
    return {"metadata": {"name": "web", "namespace": "apps", "uid": "1111-2222",
                         "annotations": {"tailscale.com/expose": "true"}},
            "spec": {"type": "ClusterIP", **spec}}


def _strip_hash(obj: dict) -> dict:
    obj = json.loads(json.dumps(obj))
    ann = obj["metadata"].pop("annotations")
    assert len(ann[SPEC_HASH]) == 16
    return obj


def _field(path):
    return {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def test_l3_ingress_dual_stack_statefulset_exact():
    spec = service.decide(_svc(clusterIP="10.96.0.10", clusterIPs=["10.96.0.10", "fd00:10:96::a"]), CFG).spec
    r = render(spec, CFG, ("tskey-auth-k1",))
    name = base_name(spec.parent)
    assert name.startswith("ts-web-") and len(name) == len("ts-web-") + 5
    assert _strip_hash(r.statefulset) == {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": "tailscale", "labels": LABELS},
        "spec": {
            "replicas": 1, "serviceName": name, "selector": {"matchLabels": {"app": "1111-2222"}},
            "template": {
                "metadata": {"deletionGracePeriodSeconds": 10, "labels": {**LABELS, "app": "1111-2222"},
                             "annotations": {"tailscale.com/operator-last-set-cluster-ip":
                                             "10.96.0.10,fd00:10:96::a"}},
                "spec": {
                    "serviceAccountName": name,
                    "initContainers": [{
                        "name": "sysctler", "image": "registry.local/proxy:1", "imagePullPolicy": "Always",
                        "securityContext": {"privileged": True},
                        "command": ["/bin/sh", "-c",
                                    "echo 1 > /proc/sys/net/ipv4/ip_forward && if [ -e "
                                    "/proc/sys/net/ipv6/conf/all/forwarding ]; then echo 1 > "
                                    "/proc/sys/net/ipv6/conf/all/forwarding; fi"]}],
                    "containers": [{
                        "name": "tailscale", "image": "registry.local/proxy:1", "imagePullPolicy": "Always",
                        "env": [
                            {"name": "TS_USERSPACE", "value": "false"},
                            {"name": "POD_IP", **_field("status.podIP")},
                            {"name": "POD_NAME", **_field("metadata.name")},
                            {"name": "POD_UID", **_field("metadata.uid")},
                            {"name": "TS_KUBE_SECRET", "value": "$(POD_NAME)"},
                            {"name": "TS_EXPERIMENTAL_SERVICE_AUTO_ADVERTISEMENT", "value": "false"},
                            {"name": "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR", "value": "/etc/tsconfig/$(POD_NAME)"},
                            {"name": "TS_DEBUG_ACME_FORCE_RENEWAL", "value": "true"},
                            {"name": "TS_DEBUG_FIREWALL_MODE", "value": "nftables"},
                            {"name": "TS_DEST_IP", "value": "10.96.0.10,fd00:10:96::a"},
                            {"name": "TS_INTERNAL_APP", "value": "k8s-operator-ingress-proxy"},
                        ],
                        "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}},
                        "volumeMounts": [{"name": "tailscaledconfig-0", "mountPath": f"/etc/tsconfig/{name}-0",
                                          "readOnly": True}],
                        "securityContext": {"privileged": True}}],
                    "volumes": [{"name": "tailscaledconfig-0", "secret": {"secretName": f"{name}-0"}}],
                }}}}
    assert _strip_hash(r.service) == {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "tailscale", "labels": LABELS},
        "spec": {"clusterIP": "None", "selector": {"app": "1111-2222"}, "ipFamilyPolicy": "PreferDualStack"}}


def test_config_secret_exact_and_authkey_omitted_once_registered():
    spec = service.decide(_svc(clusterIP="10.96.0.10"), CFG).spec
    (sec,) = render(spec, CFG, ("tskey-auth-k1",)).secrets
    assert sec["metadata"] == {"name": base_name(spec.parent) + "-0", "namespace": "tailscale", "labels": LABELS}
    assert json.loads(sec["stringData"]["cap-107.hujson"]) == {
        "Version": "alpha0", "Locked": False, "ServerURL": "https://hs.example.com", "AuthKey": "tskey-auth-k1",
        "Hostname": "apps-web", "acceptDNS": False, "acceptRoutes": False,
        "AppConnector": {"Advertise": False}, "NoStatefulFiltering": True}
    cap95 = json.loads(sec["stringData"]["cap-95.hujson"])
    assert "AppConnector" not in cap95 and cap95["AuthKey"] == "tskey-auth-k1"
    assert set(sec["stringData"]) == {"cap-95.hujson", "cap-107.hujson"}
    (sec2,) = render(spec, CFG, ("",)).secrets
    assert "AuthKey" not in json.loads(sec2["stringData"]["cap-107.hujson"])


def test_default_login_server_is_tailscale():
    spec = service.decide(_svc(clusterIP="10.96.0.10"), ControllerConfig()).spec
    (sec,) = render(spec, ControllerConfig(), ("k",)).secrets
    assert json.loads(sec["stringData"]["cap-107.hujson"])["ServerURL"] == "https://controlplane.tailscale.com"


def test_rendering_is_deterministic_and_hash_follows_content():
    spec = service.decide(_svc(clusterIP="10.96.0.10"), CFG).spec
    a, b = render(spec, CFG, ("k",)), render(spec, CFG, ("k",))
    assert a == b
    spec2 = service.decide(_svc(clusterIP="10.96.0.11"), CFG).spec
    c = render(spec2, CFG, ("k",))
    assert c.statefulset["metadata"]["annotations"][SPEC_HASH] != a.statefulset["metadata"]["annotations"][SPEC_HASH]
    assert c.service["metadata"]["annotations"] == a.service["metadata"]["annotations"]


def test_long_parent_name_fits_statefulset_limit():
    svc = _svc(clusterIP="10.96.0.10")
    svc["metadata"]["name"] = "x" * 63
    spec = service.decide(svc, CFG).spec
    assert len(base_name(spec.parent)) <= 52


def test_l7_ingress_userspace_with_serve_config_mounts():
    backend = {"metadata": {"name": "be", "namespace": "apps"},
               "spec": {"clusterIP": "10.96.0.20", "ports": [{"name": "http", "port": 8080}]}}
    ing = {"metadata": {"name": "site", "namespace": "apps", "uid": "u-ing"},
           "spec": {"ingressClassName": "tailscale", "tls": [{"hosts": ["site"]}],
                    "defaultBackend": {"service": {"name": "be", "port": {"name": "http"}}}}}
    cfg = replace(CFG, ingress_scheme="https")     # upstream's scheme (CFG's server is not Tailscale's)
    spec = ingress.decide(ing, cfg, {"be": backend}).spec
    r = render(spec, cfg, ("k",))
    name = base_name(spec.parent)
    pod = r.statefulset["spec"]["template"]["spec"]
    assert "initContainers" not in pod and "securityContext" not in pod["containers"][0]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["TS_USERSPACE"] == "true"
    assert env["TS_SERVE_CONFIG"] == "/etc/tailscaled/$(POD_NAME)/serve-config"
    assert env["TS_INTERNAL_APP"] == "k8s-operator-ingress-resource"
    assert pod["volumes"][1] == {"name": "serve-config-0", "secret": {
        "secretName": f"{name}-0", "items": [{"key": "serve-config", "path": "serve-config"}]}}
    assert pod["containers"][0]["volumeMounts"][1] == {"name": "serve-config-0",
                                                        "mountPath": f"/etc/tailscaled/{name}-0", "readOnly": True}
    assert json.loads(r.secrets[0]["stringData"]["serve-config"]) == {
        "TCP": {"443": {"HTTPS": True}},
        "Web": {"${TS_CERT_DOMAIN}:443": {"Handlers": {"/": {"Proxy": "http://10.96.0.20:8080/"}}}}}
    assert json.loads(r.secrets[0]["stringData"]["cap-107.hujson"])["Hostname"] == "site"


def test_connector_routes_and_replicas():
    conn = {"metadata": {"name": "office", "uid": "u-c"},
            "spec": {"subnetRouter": {"advertiseRoutes": ["10.40.0.0/16", "192.168.1.0/24", "10.40.0.0/16"]},
                     "replicas": 2, "hostnamePrefix": "office"}}
    spec = connector.decide(conn, CFG).spec
    r = render(spec, CFG, ("k0", "k1"))
    assert [s["metadata"]["name"] for s in r.secrets] == [f"{base_name(spec.parent)}-0", f"{base_name(spec.parent)}-1"]
    confs = [json.loads(s["stringData"]["cap-107.hujson"]) for s in r.secrets]
    assert [c["Hostname"] for c in confs] == ["office-0", "office-1"]
    assert [c["AuthKey"] for c in confs] == ["k0", "k1"]
    assert confs[0]["AdvertiseRoutes"] == ["10.40.0.0/16", "192.168.1.0/24"]
    assert r.secrets[0]["metadata"]["labels"]["tailscale.com/parent-resource-ns"] == ""
    pod = r.statefulset["spec"]["template"]["spec"]
    assert r.statefulset["spec"]["replicas"] == 2
    assert [v["name"] for v in pod["volumes"]] == ["tailscaledconfig-0", "tailscaledconfig-1"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["TS_INTERNAL_APP"] == "k8s-operator-connector-resource"
    assert not {"TS_DEST_IP", "TS_ROUTES", "TS_SERVE_CONFIG"} & set(env)


def test_exit_node_connector_advertises_both_default_routes():
    spec = connector.decide({"metadata": {"name": "exit", "uid": "u"}, "spec": {"exitNode": True}}, CFG).spec
    (sec,) = render(spec, CFG, ("k",)).secrets
    conf = json.loads(sec["stringData"]["cap-107.hujson"])
    assert conf["AdvertiseRoutes"] == ["0.0.0.0/0", "::/0"] and conf["Hostname"] == "exit-connector"


def test_proxy_env_comes_last_so_it_overrides():
    cfg = replace(CFG, proxy_env=(("TS_DEBUG_FIREWALL_MODE", "nftables"), ("TS_DEBUG_USE_DERP_HTTP", "true")))
    spec = service.decide(_svc(clusterIP="10.96.0.10"), cfg).spec
    env = render(spec, cfg, ("k",)).statefulset["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[-2:] == [{"name": "TS_DEBUG_FIREWALL_MODE", "value": "nftables"},
                        {"name": "TS_DEBUG_USE_DERP_HTTP", "value": "true"}]
    assert render(spec, cfg, ("k",)).statefulset != render(service.decide(_svc(clusterIP="10.96.0.10"), CFG).spec,
                                                           CFG, ("k",)).statefulset


def test_proxy_pull_secrets_and_placement_reach_the_pod():
    aff = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64"]}]}]}}}
    cfg = replace(CFG, proxy_image_pull_secrets=("regcred",), proxy_node_selector={"pool": "edge"},
                  proxy_tolerations=[{"key": "edge", "operator": "Exists", "effect": "NoSchedule"}],
                  proxy_affinity=aff)
    spec = service.decide(_svc(clusterIP="10.96.0.10"), cfg).spec
    pod = render(spec, cfg, ("k",)).statefulset["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["nodeSelector"] == {"pool": "edge"}
    assert pod["tolerations"] == [{"key": "edge", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["affinity"] == aff
    plain = render(service.decide(_svc(clusterIP="10.96.0.10"), CFG).spec, CFG, ("k",)).statefulset
    assert not {"imagePullSecrets", "nodeSelector", "tolerations", "affinity"} & set(
        plain["spec"]["template"]["spec"])


def test_every_rendered_env_name_is_known_to_the_agent_or_tailscaled():
    known = {s.name for s in SETTINGS} | set(TAILSCALED_ENV)
    backend = {"metadata": {"name": "be"}, "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80}]}}
    ing = {"metadata": {"name": "i", "namespace": "a", "uid": "u",
                        "annotations": {"tailscale.com/experimental-forward-cluster-traffic-via-ingress": "true"}},
           "spec": {"ingressClassName": "tailscale",
                    "defaultBackend": {"service": {"name": "be", "port": {"number": 80}}}}}
    specs = [service.decide(_svc(clusterIP="10.96.0.10"), CFG).spec,
             service.decide(_svc(type="ExternalName", externalName="db.example.com"), CFG).spec,
             ingress.decide(ing, CFG, {"be": backend}).spec,
             connector.decide({"metadata": {"name": "c", "uid": "u"}, "spec": {"exitNode": True}}, CFG).spec]
    egress = _svc()
    egress["metadata"]["annotations"] = {"tailscale.com/tailnet-ip": "100.64.0.5"}
    specs.append(service.decide(egress, CFG).spec)
    seen = set()
    for spec in specs:
        for e in render(spec, CFG, ("k",)).statefulset["spec"]["template"]["spec"]["containers"][0]["env"]:
            seen.add(e["name"])
    assert seen <= known, seen - known
    assert {"TS_DEST_IP", "TS_EXPERIMENTAL_DEST_DNS_NAME", "TS_TAILNET_TARGET_IP", "TS_SERVE_CONFIG",
            "EXPERIMENTAL_ALLOW_PROXYING_CLUSTER_TRAFFIC_VIA_INGRESS"} <= seen


def test_proxy_ca_configmap_is_mounted_and_trusted_by_every_proxy():
    """PROXY_CA_CONFIGMAP: the ConfigMap as a volume, mounted read-only in the tailscale container, its directory
    added to the system's in SSL_CERT_DIR (tailscaled's and the agent's check read it); nothing without it."""
    from controller import pgrender
    from controller.kinds import proxygroup
    cfg = replace(CFG, proxy_ca_configmap="headscale-ca")
    pg = {"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyGroup",
          "metadata": {"name": "eg", "uid": "u-pg"}, "spec": {"type": "egress", "replicas": 2}}
    pods = [render(service.decide(_svc(clusterIP="10.96.0.10"), cfg).spec, cfg, ("k",)).statefulset,
            render(connector.decide({"metadata": {"name": "c", "uid": "u"}, "spec": {"exitNode": True}}, cfg).spec,
                   cfg, ("k",)).statefulset,
            pgrender.statefulset(proxygroup.decide(pg, cfg), cfg)]
    for sts in pods:
        pod = sts["spec"]["template"]["spec"]
        assert {"name": "control-plane-ca", "configMap": {"name": "headscale-ca"}} in pod["volumes"]
        (c,) = [c for c in pod["containers"] if c["name"] == "tailscale"]
        assert {"name": "control-plane-ca", "mountPath": CA_DIR, "readOnly": True} in c["volumeMounts"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["SSL_CERT_DIR"] == f"/etc/ssl/certs:{CA_DIR}"
    plain = render(service.decide(_svc(clusterIP="10.96.0.10"), CFG).spec, CFG, ("k",)).statefulset
    assert "control-plane-ca" not in json.dumps(plain) and "SSL_CERT_DIR" not in json.dumps(plain)
    # A user's PROXY_ENV still has the last word.
    over = replace(cfg, proxy_env=(("SSL_CERT_DIR", "/mine"),))
    env = render(service.decide(_svc(clusterIP="10.96.0.10"), over).spec, over, ("k",)).statefulset[
        "spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "SSL_CERT_DIR"][-1] == "/mine"
