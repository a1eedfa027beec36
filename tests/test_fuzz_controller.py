"""Generated hostile input against the controller's parsers: its environment, the annotations and specs of
Services, Ingresses and Connectors, the replicas' state Secrets, and the API server's answers.

Objects keep the shapes the API server enforces (annotations are strings, a Service's clusterIPs a list) and
take hostile values everywhere a user can write one. Properties: `decide` returns a Decision or refuses with
`Invalid`/`Pending` naming the annotation or field (never another exception); what it accepts renders, and the
proxy it renders starts: the agent's own parsers accept the rendered environment, config files and serve config.
Profiles and strategies: tests/support/fuzz.py.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from containerboot import conffile
from containerboot.settings import SettingsError, load
from controller import config as controller_config
from controller import render
from controller import status as cstatus
from controller.config import ControllerConfig
from controller.kinds import connector, ingress, service
from controller.kubeapi import SERVICES, Kube, KubeError
from controller.model import (
    ANN_EXPOSE,
    ANN_FORWARD_CLUSTER_TRAFFIC,
    ANN_HOSTNAME,
    ANN_TAGS,
    ANN_TAILNET_FQDN,
    ANN_TAILNET_IP,
    Decision,
    Invalid,
    Pending,
    ProxySpec,
)
from controller.providers import ProviderError
from controller.providers.headscale import HeadscaleProvider
from controller.providers.hscompat import Capabilities
from controller.providers.tailscale import TailscaleProvider
from serveconfig import model as serve
from tests.support.fuzz import branch, env_text, hostile_text, json_text, reaches, shaped
from tscommon import secretcontract as sc

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

_CFGS = (ControllerConfig(), ControllerConfig(magicdns_suffix="tail.example.com", provider="headscale",
                                              headscale_url="http://hs", login_server="http://hs"))
_VALUES = st.one_of(hostile_text(), st.sampled_from(
    ("true", "100.64.0.7", "fd7a:115c:a1e0::7", "db.tail.example.com", "db.tail1.ts.net", "web", "tag:a,tag:b",
     " 100.64.0.7 ", "tag:k8s, ", "1.2.3.4,5.6.7.8", "Web", "-web", "a" * 63, "a" * 64)))
_DNS_LABEL = st.from_regex(r"[a-z]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
_IPS = st.one_of(st.ip_addresses().map(str), st.sampled_from(("None", "", "10.96.0.10", "fd00::10")))
_counter = itertools.count()


# What a user means to write for each annotation or field, so that most examples get past the first check.
_GOOD = {ANN_EXPOSE: ("true",), ANN_HOSTNAME: ("web", "a" * 63, "x-1"), ANN_TAGS: ("tag:a,tag:b", "tag:k8s"),
         ANN_TAILNET_IP: ("100.64.0.7", "fd7a:115c:a1e0::7", " 100.64.0.7 "),
         ANN_TAILNET_FQDN: ("db.tail.example.com", "db.tail1.ts.net", "db.tail.example.com."),
         ANN_FORWARD_CLUSTER_TRAFFIC: ("true",), "tailscale.com/funnel": ("true",),
         "hostname": ("web", "x-1"), "hostnamePrefix": ("web", "x"), "routes": ("10.0.0.0/24", "fd00::/64")}


def _value(key: str) -> st.SearchStrategy[str]:
    good = st.sampled_from(_GOOD.get(key, ("x",)))
    return st.one_of(good, good, good, _VALUES)


def _annotations(keys: tuple[str, ...]) -> st.SearchStrategy[dict[str, str]]:
    return st.fixed_dictionaries({}, optional={k: _value(k) for k in keys})


@st.composite
def services(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": draw(st.sampled_from(["ClusterIP", "LoadBalancer", "ExternalName", "NodePort"]))}
    if draw(st.integers(0, 3)):
        # The API server's shape: "None", or one address per family, the primary family first.
        v4, v6 = draw(st.ip_addresses(v=4).map(str)), draw(st.ip_addresses(v=6).map(str))
        spec["clusterIPs"] = draw(st.sampled_from([[v4], [v6], [v4, v6], [v6, v4], ["None"], []]))
    if draw(st.booleans()):
        spec["clusterIP"] = draw(_IPS)
    if spec["type"] == "ExternalName":
        spec["externalName"] = draw(_VALUES)
    if spec["type"] == "LoadBalancer":
        spec["loadBalancerClass"] = draw(st.sampled_from([None, "tailscale", "other"]))
    # One way of asking for a proxy (or all of them, which must be refused), then the optional annotations.
    asks = draw(st.sampled_from(((ANN_EXPOSE,), (ANN_TAILNET_IP,), (ANN_TAILNET_FQDN,), (),
                                 (ANN_EXPOSE, ANN_TAILNET_IP, ANN_TAILNET_FQDN))))
    ann = draw(_annotations((ANN_HOSTNAME, ANN_TAGS)))
    ann.update({k: draw(_value(k)) for k in asks})
    return {"apiVersion": "v1", "kind": "Service", "spec": spec,
            "metadata": {"name": draw(_DNS_LABEL), "namespace": draw(_DNS_LABEL), "uid": "u1", "annotations": ann}}


_ROUTES = st.one_of(_VALUES, st.sampled_from(("10.0.0.0/24", "10.0.0.1/24", "0.0.0.0/0", "::/0", "fd00::/64",
                                              "10.0.0.1", "10.0.0.0/33", " 10.0.0.0/8", "fe80::/64%eth0")))


@st.composite
def connectors(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    asks = draw(st.sampled_from(["subnetRouter", "subnetRouter", "exitNode", "both", "nothing"]))
    if asks in ("exitNode", "both"):
        spec["exitNode"] = True
    if asks in ("subnetRouter", "both"):
        spec["subnetRouter"] = {"advertiseRoutes": draw(st.lists(st.one_of(_value("routes"), _value("routes"), _ROUTES),
                                                                 min_size=1, max_size=4))}
    for key, value in (("replicas", st.integers(0, 3)), ("hostname", _value("hostname")),
                       ("hostnamePrefix", _value("hostnamePrefix")),
                       ("tags", st.lists(_value(ANN_TAGS).map(lambda t: t.split(",")[0]), max_size=3)),
                       ("appConnector", st.just({}))):
        if draw(st.integers(0, 4)) == 0:
            spec[key] = draw(value)
    return {"apiVersion": "tailscale.com/v1alpha1", "kind": "Connector", "spec": spec,
            "metadata": {"name": draw(_DNS_LABEL), "uid": "u2"}}


# The API server requires an absolute path (or none).
_PATHS = st.one_of(st.sampled_from(("/", "/a", "/a/", "", "//", "/a b", "/${TS_CERT_DOMAIN}")),
                   hostile_text().map(lambda t: "/" + t))


@st.composite
def ingresses(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    def backend() -> dict[str, Any]:
        port = draw(st.one_of(st.builds(lambda n: {"number": n}, st.integers(1, 65535)),
                              st.builds(lambda n: {"name": n}, st.sampled_from(["http", "https", "", "x"]))))
        return {"service": {"name": draw(st.sampled_from(["a", "b", "missing"])), "port": port}}

    rules = [{"host": draw(_VALUES), "http": {"paths": [{"path": draw(_PATHS), "pathType": "Prefix",
                                                         "backend": backend()}
                                                        for _ in range(draw(st.integers(0, 3)))]}}
             for _ in range(draw(st.integers(0, 2)))]
    spec: dict[str, Any] = {"ingressClassName": "tailscale", "rules": rules}
    if draw(st.booleans()):
        spec["defaultBackend"] = backend()
    if draw(st.booleans()):
        spec["tls"] = [{"hosts": draw(st.lists(_VALUES, max_size=2))}]
    svcs = {n: {"spec": {"clusterIP": draw(_IPS), "ports": [{"name": "http", "port": draw(st.integers(1, 65535))},
                                                              {"name": "https", "port": 443}]}}
            for n in ("a", "b")}
    ann = draw(_annotations((ANN_TAGS, ANN_FORWARD_CLUSTER_TRAFFIC, "tailscale.com/funnel")))
    return ({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "spec": spec,
             "metadata": {"name": draw(_DNS_LABEL), "namespace": draw(_DNS_LABEL), "uid": "u3",
                          "annotations": ann}}, svcs)


def _refused(e: Invalid | Pending, *fields: str) -> None:
    branch("refused")
    message = str(e)
    assert message.strip()
    assert any(f in message for f in fields), message


def _proxy_starts(spec: ProxySpec, cfg: ControllerConfig, base: Path) -> None:
    """The rendered proxy, as its agent would read it: env, the Secret's config files, the serve config."""
    branch("accepted")
    rendered = render.render(spec, cfg, ("tskey-auth-QXZ",) * spec.replicas)
    json.dumps(rendered.statefulset)  # the manifests are JSON
    for _i, secret in enumerate(rendered.secrets):
        confdir = base / f"conf{next(_counter)}"
        confdir.mkdir()
        data = secret["stringData"]
        for key, text in data.items():
            (confdir / key).write_text(text)
            if key.startswith("cap-"):
                conffile.parse(text, key)
        pod = secret["metadata"]["name"]
        env = {"POD_IP": "10.1.2.3", "POD_NAME": pod, "POD_UID": "uid", "KUBERNETES_SERVICE_HOST": "10.0.0.1",
               "KUBERNETES_SERVICE_PORT_HTTPS": "443"}
        container = rendered.statefulset["spec"]["template"]["spec"]["containers"][0]
        for e in container["env"]:
            if "value" in e:
                env[e["name"]] = e["value"].replace("$(POD_NAME)", pod)
        env["TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR"] = str(confdir)
        try:
            load(env, root=str(base))
        except SettingsError as e:
            raise AssertionError(f"the rendered proxy refuses its environment: {e}") from None
        if sc.KEY_SERVE_CONFIG in data:
            serve.parse(data[sc.KEY_SERVE_CONFIG], "node.example.ts.net")
            serve.parse(data[sc.KEY_SERVE_CONFIG], "")


@reaches("accepted", "refused")
@given(svc=services(), cfg=st.sampled_from(_CFGS))
def test_service_decide_accepts_or_names_the_annotation(svc: dict[str, Any], cfg: ControllerConfig,
                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    if not service.handled(svc, cfg):
        return
    try:
        decision = service.decide(svc, cfg)
    except (Invalid, Pending) as e:
        _refused(e, "annotation tailscale.com/", "spec.", "Service", "ClusterIP")
        return
    assert isinstance(decision, Decision)
    _proxy_starts(decision.spec, cfg, tmp_path_factory.getbasetemp())


@reaches("accepted", "refused")
@given(conn=connectors(), cfg=st.sampled_from(_CFGS))
@example(conn={"metadata": {"name": "c"}, "spec": {"subnetRouter": {"advertiseRoutes": ["fe80::/64%eth0"]}}},
         cfg=_CFGS[0])
def test_connector_decide_accepts_or_names_the_field(conn: dict[str, Any], cfg: ControllerConfig,
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    try:
        decision = connector.decide(conn, cfg)
    except Invalid as e:
        _refused(e, "spec.", "Connector")
        return
    _proxy_starts(decision.spec, cfg, tmp_path_factory.getbasetemp())


@reaches("accepted", "refused")
@given(case=ingresses(), cfg=st.sampled_from(_CFGS), fqdn=st.sampled_from(["", "web.tail.example.com."]))
def test_ingress_decide_accepts_or_names_the_field(case: tuple[dict[str, Any], dict[str, Any]],
                                                   cfg: ControllerConfig, fqdn: str,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    ing, svcs = case
    assert set(ingress.backend_services(ing)) <= {"a", "b", "missing"}
    try:
        decision = ingress.decide(ing, cfg, svcs, fqdn)
    except Invalid as e:
        _refused(e, "spec.", "annotation tailscale.com/")
        return
    _proxy_starts(decision.spec, cfg, tmp_path_factory.getbasetemp())


# --------------------------------------------------------------------------------------- the controller's env

_CONTROLLER_VARS = ("OPERATOR_NAMESPACE", "PROXY_IMAGE", "PROXY_TAGS", "PROXY_FIREWALL_MODE", "PROXY_RESOURCES",
                    "PROXY_ENV", "PROXY_IMAGE_PULL_POLICY", "OPERATOR_LOGIN_SERVER", "OPERATOR_DEFAULT_LOAD_BALANCER",
                    "CLUSTER_DOMAIN", "TS_MAGICDNS_SUFFIX", "CONTROL_PLANE", "HEADSCALE_URL", "HEADSCALE_USER",
                    "INGRESS_SCHEME", "PROXY_CA_CONFIGMAP")


@example(env={"HEADSCALE_USER": "²"})
@given(env=st.dictionaries(st.sampled_from(_CONTROLLER_VARS),
                           st.one_of(env_text(), json_text(shaped({"requests": {"cpu": "10m"}, "A": "b"})),
                                     st.sampled_from(("headscale", "http://hs", "12", "²", "nftables", "Never"))),
                           max_size=6))
def test_controller_config_accepts_or_names_the_variable(env: dict[str, str]) -> None:
    try:
        cfg = controller_config.load(env)
    except controller_config.ConfigError as e:
        assert any(v in str(e) for v in _CONTROLLER_VARS), str(e)
        return
    if cfg.headscale_user:
        assert int(cfg.headscale_user) >= 0  # what headscale's API gets


# ------------------------------------------------------------------------------ the replicas' state Secrets

_SECRET_VALUES = st.one_of(st.binary(max_size=30), st.sampled_from(
    [b"107", b"\xff", b"99999999999999999999", b'{"AuthKey":"k"}', b"[", b"n1CNTRL", b"1", b"../x", b"\xd9\xa3"]))
_SECRET_KEYS = (sc.KEY_DEVICE_ID, sc.KEY_DEVICE_FQDN, sc.KEY_DEVICE_IPS, sc.KEY_CAPVER, sc.KEY_POD_UID,
                sc.KEY_HTTPS_ENDPOINT, sc.KEY_REISSUE_AUTHKEY, sc.config_key(max(sc.CONFIG_CAPVERS)))


@given(data=st.one_of(st.none(), st.dictionaries(st.sampled_from(_SECRET_KEYS), _SECRET_VALUES, max_size=8)),
       pod_uid=st.sampled_from([None, "uid", ""]))
def test_replica_secret_read_back_never_fails(data: dict[str, bytes] | None, pod_uid: str | None) -> None:
    info = cstatus.device_info("s-0", data, pod_uid)
    assert cstatus.authkey_action(data) in ("new", "reissue", "keep", "omit")
    cstatus.config_authkey(data)
    assert all(isinstance(ip, str) for ip in info.ips)


@given(device_id=st.one_of(hostile_text(), st.sampled_from(["1", "²", "٣", "../x", "n1CNTRL", "1/../2", "1?x=y"])))
async def test_providers_refuse_a_device_id_that_is_not_an_id(device_id: str) -> None:
    """device_id comes from a Secret the proxy writes: it must not steer the control plane API elsewhere."""
    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/api/v2/oauth/token":
            sent.append(request.url.raw_path.decode())
        return httpx.Response(200, json={"node": {"tags": []}, "tags": [], "access_token": "tok"})

    providers: list[HeadscaleProvider | TailscaleProvider] = [
        HeadscaleProvider("http://hs", api_key="k", transport=httpx.MockTransport(answer),
                          capabilities=Capabilities("v0.29.2", (0, 29))),
        TailscaleProvider("http://ts", client_id="i", client_secret="s", transport=httpx.MockTransport(answer))]
    for p in providers:
        sent.clear()
        await p.delete_device(device_id)
        try:
            await p.device_tags(device_id)
        except ProviderError as e:
            assert not e.transient and "is not a" in str(e)
        for path in sent:
            last = path.rsplit("/", 1)[-1]
            assert last == device_id and device_id.isascii() and device_id.isalnum(), path
        await p.aclose()


# -------------------------------------------------------------------------------- the API server's answers

_OBJ = {"metadata": {"name": "x", "annotations": {"a": "b"}}, "spec": {"clusterIP": "10.0.0.1"},
        "items": [{"metadata": {"name": "y"}}]}


@given(body=st.one_of(json_text(shaped(_OBJ)).map(lambda t: t.encode("utf-8", "surrogatepass")),
                      st.binary(max_size=40), st.just(b"[" * 5000)),
       status=st.sampled_from([200, 200, 201, 404, 409, 429, 500]))
async def test_controller_client_decodes_or_raises_kube_error(body: bytes, status: int) -> None:
    kube = Kube("http://api", token="t", transport=httpx.MockTransport(
        lambda request: httpx.Response(status, content=body)))
    try:
        for call in (lambda: kube.get(SERVICES, "x", "ns"), lambda: kube.list(SERVICES, "ns")):
            try:
                out = await call()
            except KubeError as e:
                assert "/services" in str(e)
                continue
            assert out is None or isinstance(out, (dict, list))
    finally:
        await kube.aclose()


# ------------------------------------------------------------------ ProxyGroups, their egress Services, ProxyClass

@st.composite
def proxygroups(draw: st.DrawFn) -> dict[str, Any]:
    """The CRD's shapes (type, replicas, hostnamePrefix, tags, proxyClass) with hostile values."""
    spec: dict[str, Any] = {"type": draw(st.sampled_from(["egress", "egress", "ingress", "kube-apiserver", "x"]))}
    for key, value in (("replicas", st.one_of(st.none(), st.integers(0, 4), st.integers(-3, -1))),
                       ("hostnamePrefix", _value("hostnamePrefix")),
                       ("tags", st.lists(_value(ANN_TAGS).map(lambda t: t.split(",")[0]), max_size=3)),
                       ("proxyClass", _VALUES)):
        if draw(st.booleans()):
            spec[key] = draw(value)
    return {"metadata": {"name": draw(_DNS_LABEL), "uid": "u4"}, "spec": spec}


@reaches("accepted", "refused")
@given(pg=proxygroups(), cfg=st.sampled_from(_CFGS))
def test_proxygroup_decide_accepts_or_names_the_field(pg: dict[str, Any], cfg: ControllerConfig) -> None:
    from controller.kinds import proxygroup
    try:
        g = proxygroup.decide(pg, cfg, cfg.provider)
    except Invalid as e:
        _refused(e, "spec.", "metadata.name", "ProxyGroup")
        return
    branch("accepted")
    assert g.replicas >= 0


_ENTRY = {"svc-a": {"tailnetTarget": {"ip": "100.64.0.7"},
                    "ports": [{"protocol": "TCP", "matchPort": 10000, "targetPort": 80}]}}


@given(text=st.one_of(st.none(), json_text(shaped(_ENTRY)), st.just("[" * 5000)))
def test_group_egress_entries_read_back_never_fail(text: str | None) -> None:
    from controller.kinds import egress
    entries = egress.parse_entries(text)
    for _name, entry in entries.items():
        ports = egress.entry_ports(entry)
        assert all(isinstance(mp, int) for mp in ports.values())
    egress.used_ports(entries, but="x")
    egress.parse_status(text.encode("utf-8", "surrogatepass") if text is not None else None)


_PC_SPEC = {"statefulSet": {"labels": {"team": "net"}, "annotations": {"a": "b"},
                            "pod": {"labels": {"env": "prod"}, "nodeSelector": {"os": "linux"},
                                    "tolerations": [{"key": "k", "operator": "Equal", "value": "v",
                                                     "effect": "NoSchedule"}],
                                    "dnsPolicy": "ClusterFirst", "imagePullSecrets": [{"name": "r"}],
                                    "tailscaleContainer": {"env": [{"name": "TS_DEBUG_X", "value": "1"}],
                                                           "image": "img:1", "resources": {"requests": {"cpu": "1m"}},
                                                           "debug": {"enable": True}},
                                    "tailscaleInitContainer": {"image": "busybox"}}},
            "metrics": {"enable": True, "serviceMonitor": {"enable": False, "labels": {"r": "p"}}},
            "tailscale": {"acceptRoutes": True}, "useLetsEncryptStagingEnvironment": False}


@reaches("accepted", "refused")
@given(spec=shaped(_PC_SPEC), svc=services())
def test_proxyclass_validates_then_applies_without_failing(spec: Any, svc: dict[str, Any]) -> None:
    from controller.kinds import proxyclass as pcl
    obj = {"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyClass", "metadata": {"name": "c"}, "spec": spec}
    v = pcl.validate(obj)
    for problem in v.problems:
        assert problem.startswith("spec"), problem
    if not v.ok:
        branch("refused")
        return
    branch("accepted")
    try:
        decision = service.decide(svc, _CFGS[0])
    except (Invalid, Pending):
        return
    rendered = render.render(decision.spec, _CFGS[0], ("tskey-auth-QXZ",))
    pc = pcl.ProxyClass.from_object(obj)
    sts = pcl.apply_to_statefulset(rendered.statefulset, pc, pcl.Target(endpoints=True, acme=False))
    json.dumps(sts)
    for secret in rendered.secrets:
        pcl.apply_to_config_secret(secret, pc)
