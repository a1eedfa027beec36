"""The controller's Helm chart (charts/tailscale-controller), rendered with the pinned helm (no cluster).

deploy/ is rendered from the chart (``make manifests``) and must be up to date; ``helm lint --strict`` passes;
the chart's values map onto the controller's own settings: the rendered env, fed to controller.config.load,
gives the configuration a user asked for (headscale, Tailscale and static providers); credentials from values
land only in their Secret; RBAC equals deploy/'s in any namespace; bad values stop before anything is installed
with the value and the fix. Without helm (``make setup-bin`` builds it) these tests skip with that reason, and
fail under CI, as netns-tests/needs.py does.
"""
from __future__ import annotations

import base64
import os
import pathlib
import subprocess

import pytest
import yaml

from controller import config as cconfig
from labtools import helmchart

DEPLOY = helmchart.DEPLOY
LAB_KEY = "hskey-0123456789abcdef-not-a-real-key"


@pytest.fixture(scope="module", autouse=True)
def helm_built():
    if helmchart.helm_bin() is None:
        reason = "helm is not built: run make setup-bin (scripts/install-helm.sh)"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set, so these tests must run, but {reason}")
        pytest.skip(reason)


REGISTRY = "registry.example.com/tailscale"
#: the chart's version, its appVersion (the images' tag) and the project's version go together
VERSION = helmchart.chart_meta()["appVersion"]


def render(values: dict, namespace: str = "tailscale") -> list[dict]:
    return helmchart.objects(helmchart.template({"imageRegistry": REGISTRY, **values}, namespace))


def one(objs, kind, name=None):
    (o,) = [d for d in objs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return o


def container(objs) -> dict:
    (c,) = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def env_of(objs) -> dict[str, str]:
    """The controller container's env as the Pod sees it (fieldRef metadata.namespace resolved), but POD_NAME:
    the Pod's own name, unknown before it runs (test_controller_deploy.py checks its fieldRef)."""
    out = {}
    dep = one(objs, "Deployment")
    for e in container(objs)["env"]:
        if e["name"] == "POD_NAME":
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, e
            continue
        if "valueFrom" in e:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}, e
            out[e["name"]] = dep["metadata"]["namespace"]
        else:
            out[e["name"]] = e["value"]
    return out


def deploy_objects() -> list[dict]:
    return [d for f in sorted(DEPLOY.rglob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def test_deploy_is_rendered_from_the_chart_and_up_to_date():
    want = helmchart.manifests()
    for rel, text in want.items():
        assert (DEPLOY / rel).read_text() == text, f"deploy/{rel} is out of date: run make manifests"
    extra = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*.yaml")} - set(want) - {"00-namespace.yaml"}
    assert not extra, f"deploy/ files not rendered from the chart: {sorted(extra)}"
    # and as objects: the chart with deploy's one setting is exactly what kubectl apply -R -f deploy/ creates
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    rendered = sorted(render(helmchart.DEPLOY_VALUES), key=key)
    assert rendered == sorted([d for d in deploy_objects() if d["kind"] != "Namespace"], key=key)


@pytest.mark.parametrize("values", [
    helmchart.DEPLOY_VALUES,
    {"provider": "tailscale", "proxy": {"tags": ["tag:k8s", "tag:web"], "firewallMode": "nftables"}},
    {"provider": "static", "credentials": {"authKey": "tskey-x"}, "ingressClass": {"create": False}},
], ids=["headscale", "tailscale", "static"])
def test_helm_lint_strict_passes(values, tmp_path):
    f = helmchart.values_file({"imageRegistry": REGISTRY, **values}, tmp_path)
    out = helmchart.helm("lint", "--strict", str(helmchart.CHART), "-f", str(f)).stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in out, out


def test_headscale_install_env_secret_refs_and_the_config_it_gives():
    values = {"provider": "headscale", "headscale": {"url": "https://hs.example.com/", "user": "3"},
              "magicDNSSuffix": "tail.example.com",
              "imageRegistry": "reg.example/",
              "proxy": {"image": {"repository": "proxy", "tag": "v1", "pullPolicy": "Always"},
                        "tags": ["tag:k8s", "tag:prod"], "firewallMode": "iptables",
                        "resources": {"requests": {"cpu": "5m"}}, "env": {"TS_DEBUG_USE_DERP_HTTP": "true"}},
              "image": {"repository": "controller", "tag": "v2", "pullPolicy": "Always"}}
    objs = render(values, "ts-system")
    c = container(objs)
    assert (c["image"], c["imagePullPolicy"]) == ("reg.example/controller:v2", "Always")
    assert env_of(objs) == {
        "OPERATOR_NAMESPACE": "ts-system", "CONTROL_PLANE": "headscale", "HEADSCALE_URL": "https://hs.example.com/",
        "TS_MAGICDNS_SUFFIX": "tail.example.com", "INGRESS_SCHEME": "auto", "PROXY_IMAGE": "reg.example/proxy:v1",
        "PROXY_IMAGE_PULL_POLICY": "Always", "PROXY_TAGS": "tag:k8s,tag:prod", "PROXY_FIREWALL_MODE": "iptables",
        "HEADSCALE_API_KEY_FILE": "/etc/headscale-api/key", "CLIENT_ID_FILE": "/oauth/client_id",
        "CLIENT_SECRET_FILE": "/oauth/client_secret", "HEADSCALE_USER": "3",
        "PROXY_RESOURCES": '{"requests":{"cpu":"5m"}}', "PROXY_ENV": '{"TS_DEBUG_USE_DERP_HTTP":"true"}'}
    cfg = cconfig.load(env_of(objs))
    assert (cfg.provider, cfg.headscale_url, cfg.server_url) == ("headscale", "https://hs.example.com",
                                                                 "https://hs.example.com")
    assert (cfg.namespace, cfg.proxy_image, cfg.proxy_tags, cfg.firewall_mode, cfg.image_pull_policy) == (
        "ts-system", "reg.example/proxy:v1", ("tag:k8s", "tag:prod"), "iptables", "Always")
    assert cfg.proxy_env == (("TS_DEBUG_USE_DERP_HTTP", "true"),) and cfg.proxy_resources == {
        "requests": {"cpu": "5m"}} and cfg.headscale_user == "3" and cfg.magicdns_suffix == "tail.example.com"
    assert cfg.ingress_http     # headscale issues no certificates: L7 Ingresses over HTTP (ingressScheme auto)
    # the API key comes from the user's Secret, mounted where HEADSCALE_API_KEY_FILE points; no Secret rendered
    vols = {v["name"]: v for v in one(objs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert vols["headscale-api"]["secret"] == {"secretName": "headscale-api", "optional": True}
    assert mounts["headscale-api"] == "/etc/headscale-api"
    assert cfg.headscale_api_key_file.startswith("/etc/headscale-api/")
    assert not [o for o in objs if o["kind"] == "Secret"]


def test_tailscale_install_env_and_oauth_secret():
    objs = render({"provider": "tailscale", "tailscale": {"oauthSecret": "my-oauth", "tailnet": "example.com"}})
    env = env_of(objs)
    assert env == {"OPERATOR_NAMESPACE": "tailscale", "CONTROL_PLANE": "tailscale", "TS_MAGICDNS_SUFFIX": "",
                   "INGRESS_SCHEME": "auto",
                   "PROXY_IMAGE": f"{REGISTRY}/containerboot-py:{VERSION}", "PROXY_IMAGE_PULL_POLICY": "IfNotPresent",
                   "PROXY_TAGS": "tag:k8s", "PROXY_FIREWALL_MODE": "",
                   "HEADSCALE_API_KEY_FILE": "/etc/headscale-api/key",
                   "CLIENT_ID_FILE": "/oauth/client_id", "CLIENT_SECRET_FILE": "/oauth/client_secret",
                   "TAILSCALE_TAILNET": "example.com"}
    cfg = cconfig.load(env)
    assert (cfg.provider, cfg.server_url, cfg.tailnet) == ("tailscale", cconfig.TAILSCALE_LOGIN_SERVER, "example.com")
    vols = {v["name"]: v for v in one(objs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert vols["oauth"]["secret"] == {"secretName": "my-oauth", "optional": True}
    assert {m["name"]: m["mountPath"] for m in container(objs)["volumeMounts"]}["oauth"] == "/oauth"


def test_static_provider_and_the_other_settings():
    objs = render({"provider": "static", "static": {"authKeySecret": "my-key"}, "loginServer": "https://cp.example",
                   "defaultLoadBalancer": True, "clusterDomain": "corp.local",
                   "ingressClass": {"name": "tailnet"}, "replicas": 1})
    cfg = cconfig.load(env_of(objs))
    assert (cfg.provider, cfg.static_key_secret, cfg.login_server, cfg.default_load_balancer, cfg.cluster_domain,
            cfg.ingress_class) == ("static", "my-key", "https://cp.example", True, "corp.local", "tailnet")
    assert one(objs, "IngressClass")["metadata"]["name"] == "tailnet"
    assert not [o for o in render({"provider": "static", "ingressClass": {"create": False}})
                if o["kind"] == "IngressClass"]


def test_credentials_from_values_go_into_their_secret_only():
    objs = render({**helmchart.DEPLOY_VALUES, "credentials": {"headscaleAPIKey": LAB_KEY}})
    sec = one(objs, "Secret")
    assert (sec["metadata"]["name"], sec["metadata"]["namespace"]) == ("headscale-api", "tailscale")
    assert base64.b64decode(sec["data"]["key"]).decode() == LAB_KEY
    others = yaml.safe_dump_all([o for o in objs if o["kind"] != "Secret"])
    assert LAB_KEY not in others and base64.b64encode(LAB_KEY.encode()).decode() not in others
    # a changed credential restarts the controller (it reads the file at start)
    ann = one(objs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert set(ann) == {"checksum/credentials"}
    objs = render({"provider": "tailscale", "credentials": {"oauthClientID": "cid", "oauthClientSecret": "csec"}})
    sec = one(objs, "Secret")
    assert sec["metadata"]["name"] == "operator-oauth" and {k: base64.b64decode(v).decode() for k, v in
                                                            sec["data"].items()} == {"client_id": "cid",
                                                                                     "client_secret": "csec"}
    sec = one(render({"provider": "static", "credentials": {"authKey": "tskey-auth-x"}}), "Secret")
    assert sec["metadata"]["name"] == "tailscale-auth" and base64.b64decode(sec["data"]["authkey"]) == b"tskey-auth-x"


def test_rbac_in_another_namespace_equals_deploys():
    objs = render(helmchart.DEPLOY_VALUES, "ts-other")
    deployed = deploy_objects()
    for kind in ("ClusterRole", "Role"):
        for o in [d for d in deployed if d["kind"] == kind]:
            assert one(objs, kind, o["metadata"]["name"])["rules"] == o["rules"], (kind, o["metadata"]["name"])
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        for o in [d for d in objs if d["kind"] == kind]:
            assert [s["namespace"] for s in o["subjects"]] == ["ts-other"], o
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] in ("Role", "ServiceAccount", "Deployment")} \
        == {"ts-other"}


@pytest.mark.parametrize("values,message", [
    ({"headscale": {"url": "https://hs.example.com"}},
     "imageRegistry is empty: set it to the registry you pushed both images to (make images REGISTRY="),
    ({"imageRegistry": REGISTRY, "provider": "headscale"},
     "provider headscale needs headscale.url, the headscale server's URL: --set headscale.url="),
    ({"imageRegistry": REGISTRY, "provider": "tailnet"},
     'provider="tailnet" is not a provider; use headscale, tailscale or static'),
    ({"imageRegistry": REGISTRY, "provider": "tailscale", "proxy": {"firewallMode": "ipfw"}},
     'proxy.firewallMode="ipfw" is not a firewall mode; use auto, iptables or nftables'),
    ({"imageRegistry": REGISTRY, "provider": "tailscale", "ingressScheme": "ftp"},
     'ingressScheme="ftp" is not a scheme; use auto, https or http'),
    ({"imageRegistry": REGISTRY, "provider": "tailscale", "credentials": {"oauthClientSecret": "only-the-secret"}},
     "credentials.oauthClientID and credentials.oauthClientSecret go together"),
    ({"imageRegistry": REGISTRY, "provider": "tailscale", "dns": {"stubZoneConfigMap": "coredns"}},
     'dns.stubZoneConfigMap="coredns" is not <namespace>/<name> of a ConfigMap; use e.g. kube-system/coredns'),
    ({"imageRegistry": REGISTRY, "provider": "tailscale", "apiServerProxy": {"mode": "true"}},
     'apiServerProxy.mode="true" is not a mode; use off, auth or noauth'),
])
def test_bad_values_stop_with_the_value_and_the_fix(values, message):
    with pytest.raises(helmchart.HelmError) as e:
        helmchart.template(values)
    assert message in str(e.value)
    assert "only-the-secret" not in str(e.value)


def test_apiserver_proxy_mode_renders_its_configmap_and_in_auth_mode_only_impersonation():
    from controller.kinds import apiserverproxy
    from controller.kinds import meta as _meta
    base = {"provider": "tailscale"}
    for off in ({}, {"apiServerProxy": {"mode": "off"}}, {"apiServerProxy": {"mode": False}}):
        assert not [o for o in render({**base, **off}) if o["kind"] == "ConfigMap"]
    objs = render({**base, "apiServerProxy": {"mode": "auth", "tags": ["tag:k8s-api"]}})
    cm = one(objs, "ConfigMap", "apiserver-proxy")
    assert cm["data"] == {"mode": "auth", "hostname": "kube-apiserver", "tags": "tag:k8s-api"}
    cfg = cconfig.ControllerConfig(namespace="tailscale")
    assert apiserverproxy.handled(cm, cfg) and _meta(cm)["namespace"] == "tailscale"
    assert apiserverproxy.decide(cm, cfg).spec.apiserver_proxy_mode == "auth"
    role = one(objs, "ClusterRole", apiserverproxy.IMPERSONATE_CLUSTER_ROLE)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["users", "groups"], "verbs": ["impersonate"]}]
    noauth = render({**base, "apiServerProxy": {"mode": "noauth"}})
    assert one(noauth, "ConfigMap")["data"]["mode"] == "noauth"
    assert not [o for o in noauth if o["metadata"]["name"] == apiserverproxy.IMPERSONATE_CLUSTER_ROLE]


def test_helm_is_the_pinned_version():
    out = subprocess.run([str(helmchart.helm_bin()), "version", "--short"], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "v3.19.0"
    assert pathlib.Path(helmchart.helm_bin()).parent.name == "helm-v3.19.0"


def test_stub_zone_setting_grants_that_one_configmap_only():
    objs = render({**helmchart.DEPLOY_VALUES, "dns": {"stubZoneConfigMap": "kube-system/coredns"}})
    assert env_of(objs)["DNS_STUB_ZONE_CONFIGMAP"] == "kube-system/coredns"
    role = one(objs, "Role", "tailscale-controller-stub-zone")
    assert role["metadata"]["namespace"] == "kube-system"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["coredns"],
                              "verbs": ["get", "patch"]}]
    rb = one(objs, "RoleBinding", "tailscale-controller-stub-zone")
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "tailscale-controller", "namespace": "tailscale"}]
    # off by default: no access to kube-system at all
    assert "DNS_STUB_ZONE_CONFIGMAP" not in env_of(render(helmchart.DEPLOY_VALUES))
    assert [o for o in render(helmchart.DEPLOY_VALUES) if o["metadata"].get("namespace") == "kube-system"] == []


def test_images_default_to_the_registry_and_the_charts_version():
    objs = render({"headscale": {"url": "https://hs.example.com"}})
    assert container(objs)["image"] == f"{REGISTRY}/containerboot-py-controller:{VERSION}"
    assert env_of(objs)["PROXY_IMAGE"] == f"{REGISTRY}/containerboot-py:{VERSION}"
    assert "localhost" not in yaml.safe_dump_all(objs)
    meta = helmchart.chart_meta()
    assert meta["version"] == meta["appVersion"] == helmchart.project_version()


def test_pull_secrets_placement_extra_env_volumes_and_seccomp():
    aff = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["edge"]}]}}]}}
    values = {"headscale": {"url": "https://hs.example.com"}, "imagePullSecrets": [{"name": "regcred"}],
              "proxy": {"nodeSelector": {"kubernetes.io/arch": "arm64"},
                        "tolerations": [{"key": "edge", "operator": "Exists", "effect": "NoSchedule"}],
                        "affinity": aff},
              "extraEnv": [{"name": "SSL_CERT_FILE", "value": "/etc/headscale-ca/ca.crt"}],
              "extraVolumes": [{"name": "headscale-ca", "configMap": {"name": "headscale-ca"}}],
              "extraVolumeMounts": [{"name": "headscale-ca", "mountPath": "/etc/headscale-ca", "readOnly": True}]}
    objs = render(values)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert {"name": "headscale-ca", "configMap": {"name": "headscale-ca"}} in pod["volumes"]
    c = container(objs)
    assert {"name": "headscale-ca", "mountPath": "/etc/headscale-ca", "readOnly": True} in c["volumeMounts"]
    env = env_of(objs)
    assert env["SSL_CERT_FILE"] == "/etc/headscale-ca/ca.crt"
    cfg = cconfig.load(env)
    assert cfg.proxy_image_pull_secrets == ("regcred",)
    assert cfg.proxy_node_selector == {"kubernetes.io/arch": "arm64"} and cfg.proxy_affinity == aff
    assert cfg.proxy_tolerations == [{"key": "edge", "operator": "Exists", "effect": "NoSchedule"}]
    # without them, none of these settings is rendered
    env = env_of(render({"headscale": {"url": "https://hs.example.com"}}))
    assert not {"PROXY_IMAGE_PULL_SECRETS", "PROXY_NODE_SELECTOR", "PROXY_TOLERATIONS", "PROXY_AFFINITY"} & set(env)


def test_packaged_chart_renders_like_the_directory(tmp_path):
    tgz = helmchart.package(tmp_path)
    assert tgz.name == f"tailscale-controller-{VERSION}.tgz"
    values = {"imageRegistry": REGISTRY, "headscale": {"url": "https://hs.example.com"}}
    from_tgz = helmchart.helm("template", helmchart.RELEASE, str(tgz), "--namespace", "tailscale", "-f",
                              str(helmchart.values_file(values, tmp_path)), "--include-crds").stdout
    assert helmchart.objects(from_tgz) == helmchart.objects(helmchart.template(values))


def test_default_proxy_class_value_sets_the_controllers_default():
    objs = render({"provider": "tailscale", "proxy": {"defaultProxyClass": "prod"}})
    assert env_of(objs)["PROXY_DEFAULT_CLASS"] == "prod"
    assert cconfig.load(env_of(objs)).default_proxy_class == "prod"
    assert "PROXY_DEFAULT_CLASS" not in env_of(render({"provider": "tailscale"}))
    (crd,) = [o for o in objs if o["kind"] == "CustomResourceDefinition" and
              o["metadata"]["name"] == "proxyclasses.tailscale.com"]
    assert crd["spec"]["scope"] == "Cluster"


def test_proxy_ca_configmap_value_reaches_the_controller():
    objs = render({"provider": "tailscale", "proxy": {"caConfigMap": "headscale-ca"}})
    assert env_of(objs)["PROXY_CA_CONFIGMAP"] == "headscale-ca"
    assert cconfig.load(env_of(objs)).proxy_ca_configmap == "headscale-ca"
    assert "PROXY_CA_CONFIGMAP" not in env_of(render({"provider": "tailscale"}))
