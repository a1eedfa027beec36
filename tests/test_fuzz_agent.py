"""Generated hostile input against every parser of the agent: the TS_* environment, tailscaled's config file, the
serve config, the egress and ingress services files, the state Secret as read back, and the API server's answers.

The properties, for every input: it is accepted, or refused with the parser's own error whose message names the
variable, field or file at fault (never another exception, never a hang); what is accepted renders and parses
back to the same value; no secret value appears in a refusal. `tests/support/fuzz.py` holds the profiles (a
bounded, deterministic run here; `make fuzz` for the long one) and the strategies.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from containerboot import conffile, proxyservices
from containerboot.kube import secretstate
from containerboot.kube.client import KubeClient, KubeError
from containerboot.settings import SETTINGS, Kind, Settings, SettingsError, load
from serveconfig import model as serve
from tests.support.fuzz import TOKENS, branch, deep_nesting, env_text, hostile_text, json_text, reaches, shaped
from tscommon import secretcontract as sc

# The strategies are built from nested one_of()s; their repr is large, and hypothesis warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

# --------------------------------------------------------------------------------------------- the environment

_SECRET_NAMES = tuple(s.name for s in SETTINGS if s.secret)
_PLAIN = tuple(s for s in SETTINGS if not s.secret and s.name not in ("TS_TEST_ONLY_ROOT",
                                                                      "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR"))
_GOOD = {
    Kind.BOOL: ("true", "false", "1", "0"), Kind.TRIBOOL: ("true", "false"),
    Kind.ROUTES: ("10.0.0.0/8", "10.0.0.0/8,fd00::/64", "0.0.0.0/0,::/0"),
    Kind.IP: ("100.64.0.7", "fd7a:115c:a1e0::7"), Kind.DEST_IPS: ("10.96.0.10", "10.96.0.10,fd00::10"),
    Kind.ADDRPORT: ("[::]:9002", "0.0.0.0:9002", "127.0.0.1:1"), Kind.DURATION: ("60s", "1m30s", "10ms"),
    Kind.IP_LIST: ("10.1.0.5", "10.1.0.5,fd00::5"), Kind.ARGS: ("--reset", "--accept-routes --netfilter-mode=off"),
}
# A secret value is recognisable wherever it ends up: no other variable's value is built from this alphabet.
_SECRETS = st.text("QXZqxz", min_size=12, max_size=24).map(lambda s: "tskey-auth-" + s)


@st.composite
def environments(draw: st.DrawFn) -> dict[str, str]:
    env: dict[str, str] = {}
    for s in draw(st.lists(st.sampled_from(_PLAIN), max_size=12, unique=True)):
        good = _GOOD.get(s.kind, s.choices or ("web", "/tmp/x"))
        env[s.name] = draw(st.one_of(st.sampled_from(good), env_text(),
                                     st.lists(st.sampled_from(good + TOKENS), max_size=3).map(",".join)))
    for name in draw(st.lists(st.sampled_from(_SECRET_NAMES), max_size=2, unique=True)):
        env[name] = draw(_SECRETS)
    if draw(st.booleans()):  # a secret flag on tailscale up's command line
        env["TS_EXTRA_ARGS"] = (env.get("TS_EXTRA_ARGS", "") + " --authkey=" + draw(_SECRETS)).strip()
    return env


def _secret_values(env: dict[str, str]) -> list[str]:
    out = [env[n] for n in _SECRET_NAMES if n in env]
    out += [t.split("=", 1)[1] for t in env.get("TS_EXTRA_ARGS", "").split() if t.startswith("--authkey=")]
    return [v for v in out if v]


@reaches("accepted", "refused")
@given(env=environments())
def test_settings_accept_or_name_the_variable(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> None:
    root = str(tmp_path_factory.getbasetemp())
    try:
        s = load(env, root=root)
    except SettingsError as e:
        branch("refused")
        message = str(e)
        assert e.variables, f"no variable named for {message!r}"
        assert any(v in message for v in e.variables), message
        for secret in _secret_values(env):
            assert secret not in message
        return
    branch("accepted")
    assert isinstance(s, Settings)
    # Accepted: loading the same environment again gives the same settings (no hidden state, no I/O surprises).
    assert load(env, root=root) == s


# ------------------------------------------------------------------------------------ tailscaled's config file

_CONF = {"version": "alpha0", "authKey": "tskey-auth-QXZ", "hostname": "web", "acceptDNS": False,
         "advertiseRoutes": ["10.0.0.0/8"], "AppConnector": {"Advertise": True}, "relayServerPort": 40000,
         "serveConfigTemp": {"TCP": {}}}


def _hujson(text: str) -> st.SearchStrategy[str]:
    return st.sampled_from([text, "// c\n" + text, text.replace(",", ",\n/* c */"), text.replace("}", ",}", 1)])


@reaches("accepted", "refused")
@given(text=st.one_of(json_text(shaped(_CONF)).flatmap(_hujson), hostile_text(max_size=80)))
@example(text="[" * 5000)
@example(text='{"version":"alpha0","authKey":"' + "\\" * 3)
def test_conffile_accept_or_refuse(text: str) -> None:
    try:
        cf = conffile.parse(text, "/etc/ts/cap-107.hujson")
    except conffile.ConfigFileError as e:
        branch("refused")
        assert "/etc/ts/cap-107.hujson" in str(e)
        assert "tskey-auth-QXZ" not in str(e)
        return
    branch("accepted")
    assert cf.version == "alpha0"
    # Accepted: its fields written as plain JSON parse back to the same fields.
    again = conffile.parse(json.dumps(dict(cf.fields)), "again")
    assert again.fields == cf.fields


@pytest.mark.parametrize("text", deep_nesting(), ids=["array", "object", "unclosed"])
def test_conffile_refuses_deep_nesting(text: str) -> None:
    with pytest.raises(conffile.ConfigFileError, match="cap-107.hujson"):
        conffile.parse(text, "/etc/ts/cap-107.hujson")


# ------------------------------------------------------------------------------------------------ serve config

_SERVE = {
    "TCP": {"443": {"HTTPS": True}, "80": {"HTTP": True}, "5432": {"TCPForward": "10.0.0.1:5432",
                                                                  "TerminateTLS": "x.example.com"}},
    "Web": {"${TS_CERT_DOMAIN}:443": {"Handlers": {"/": {"Proxy": "http://user:pw@10.0.0.1:8080"},
                                                   "/s": {"Text": "hi"}, "/p": {"Path": "/srv"}}}},
    "AllowFunnel": {"${TS_CERT_DOMAIN}:443": True},
    "Services": {"svc:web": {"TCP": {"443": {"HTTPS": True}},
                             "Web": {"web.example.com:443": {"Handlers": {"/": {"Proxy": "8080"}}}}}},
    "Foreground": {"s1": {"TCP": {}}},
}


@reaches("accepted", "refused")
@given(text=json_text(shaped(_SERVE)), domain=st.sampled_from(["", "node.example.ts.net", "a"]))
@example(text="[" * 5000, domain="")
def test_serve_config_accept_or_refuse(text: str, domain: str) -> None:
    try:
        cfg = serve.parse(text, domain)
    except serve.ServeConfigError as e:
        branch("refused")
        message = str(e)
        assert message.strip()
        assert ":pw@" not in message, "the proxy target's password is shown"
        return
    if cfg is None:
        return
    branch("accepted")
    # Accepted: the JSON tailscaled gets parses back to the same config.
    assert serve.parse(json.dumps(cfg.to_json()), domain) == cfg


# ------------------------------------------------------------------------------------ egress and ingress files

_EGRESS = {"svc-a": {"tailnetTarget": {"ip": "100.64.0.7"}, "healthCheckEndpoint": "http://x",
                     "ports": [{"protocol": "TCP", "matchPort": 8080, "targetPort": 80}]},
           "svc-b": {"tailnetTarget": {"fqdn": "db.tail.example."},
                     "ports": [{"protocol": "UDP", "matchPort": 53, "targetPort": 53}]}}
_INGRESS = {"svc:web": {"IPv4Mapping": {"TailscaleServiceIP": "100.100.1.1", "ClusterIP": "10.96.0.5"},
                        "IPv6Mapping": {"TailscaleServiceIP": "fd7a:115c:a1e0::1", "ClusterIP": "fd00::5"}}}


def _egress_doc(cfg: proxyservices.EgressConfig) -> dict[str, Any]:
    return {s.name: {"tailnetTarget": s.target_json(), "healthCheckEndpoint": s.health_check_endpoint,
                     "ports": [p.to_json() for p in s.ports]} for s in cfg.services}


@given(text=st.one_of(st.none(), json_text(shaped(_EGRESS))))
@example(text="[" * 5000)
def test_egress_services_accept_or_refuse(text: str | None) -> None:
    try:
        cfg = proxyservices.parse_egress_services(text)
    except proxyservices.ConfigError as e:
        assert "egress-services" in str(e)
        return
    event(f"{len(cfg.services)} accepted, {len(cfg.problems)} refused")
    for _name, problem in cfg.problems:
        assert problem.startswith("egress-services: service "), problem
    # Accepted services, written back in the file's format, parse to the same services and no problems.
    again = proxyservices.parse_egress_services(json.dumps(_egress_doc(cfg)))
    assert again.services == cfg.services and not again.problems


@given(text=st.one_of(st.none(), json_text(shaped(_INGRESS))))
@example(text="[" * 5000)
def test_ingress_config_accept_or_refuse(text: str | None) -> None:
    try:
        cfg = proxyservices.parse_ingress_config(text)
    except proxyservices.ConfigError as e:
        assert "ingress config" in str(e)
        return
    event(f"{len(cfg.services)} accepted, {len(cfg.problems)} refused")
    for _name, problem in cfg.problems:
        assert problem.startswith("ingress config: service "), problem
    again = proxyservices.parse_ingress_config(json.dumps({s.name: s.to_json() for s in cfg.services}))
    assert again.services == cfg.services and not again.problems


@given(text=st.one_of(st.none(), hostile_text()))
def test_hep_pings_accept_or_refuse(text: str | None) -> None:
    try:
        n = proxyservices.parse_hep_pings(text)
    except proxyservices.ConfigError as e:
        assert "hep-pings" in str(e)
        return
    assert n >= 0


# ------------------------------------------------------------------------------ the state Secret, read back

_KEYS = (sc.KEY_DEVICE_IPS, sc.KEY_DEVICE_FQDN, sc.KEY_HTTPS_ENDPOINT, sc.KEY_REISSUE_ATTEMPTS,
         sc.KEY_REISSUE_REQUESTED_AT, sc.KEY_REISSUE_AUTHKEY, sc.KEY_AUTHKEY, sc.KEY_CURRENT_PROFILE,
         sc.KEY_PROFILES, sc.KEY_MACHINE_KEY, sc.KEY_CAPVER, sc.KEY_POD_UID, "profile-1a2b", "other")
_VALUES = st.one_of(st.binary(max_size=40), hostile_text().map(lambda t: t.encode("utf-8", "surrogatepass")),
                    st.sampled_from([b'["100.64.0.7","fd7a::7"]', b"2026-01-01T00:00:00Z", b"3", b"-3",
                                     b"99999999999999999999999", b"profile-1a2b", b"authkey", b"null", b"[1,{}]"]))
_DATA = st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=8)


@given(data=_DATA, now=st.floats(0, 4e9))
@example(data={sc.KEY_CURRENT_PROFILE: b"authkey", sc.KEY_AUTHKEY: b"k"}, now=0)
def test_secret_read_back_never_fails(data: dict[str, bytes], now: float) -> None:
    sc.parse_device_ips(data.get(sc.KEY_DEVICE_IPS))
    sc.parse_device_fqdn(data.get(sc.KEY_DEVICE_FQDN))
    sc.parse_https_endpoint(data.get(sc.KEY_HTTPS_ENDPOINT))
    secretstate.is_consistent(data)
    assert secretstate.reissue_attempts(data) >= 0
    assert 0 <= secretstate.reissue_delay(data, now) <= secretstate.REISSUE_MAX_DELAY
    secretstate.authkey_from_secret(data)
    secretstate.reissue_needs_clear(data, "tskey-auth-new")
    patch = secretstate.reissue_clear_patch(data)
    # Clearing a reissue removes the login state and the request, never what the user or the operator wrote.
    removed = {k for k, v in patch.items() if v is None}
    assert not removed & {sc.KEY_AUTHKEY, sc.KEY_CAPVER, sc.KEY_POD_UID, "other"}, removed
    secretstate.boot_reset_patch(data, capver=107, pod_uid="uid", config_authkey="")


@given(ips=st.lists(st.ip_addresses(), max_size=4), junk=st.lists(hostile_text(max_size=10), max_size=2))
def test_device_ips_round_trip(ips: list[Any], junk: list[str]) -> None:
    assert sc.parse_device_ips(sc.format_device_ips(ips)) == tuple(str(ip) for ip in ips)
    # Entries that are not addresses (a damaged Secret) are skipped, the rest still read.
    raw = json.dumps([str(ip) for ip in ips] + junk).encode()
    assert set(sc.parse_device_ips(raw)) >= {str(ip) for ip in ips}


# -------------------------------------------------------------------------------- the API server's answers

_SECRET_OBJ = {"kind": "Secret", "metadata": {"name": "s", "resourceVersion": "7", "labels": {"a": "b"}},
               "data": {"authkey": base64.b64encode(b"tskey-auth-QXZ").decode(), "k": "aGk="}}


def _client(tmp: Path, body: bytes, status: int) -> KubeClient:
    token = tmp / "token"
    token.write_text("t0ken")
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body,
                                                                   headers={"Retry-After": "0"}))
    c = KubeClient(url="https://api", namespace="ns", token_path=str(token), ca_path="", retry_budget=0.05,
                   transport=transport)
    return c


@given(body=st.one_of(json_text(shaped(_SECRET_OBJ)).map(lambda t: t.encode("utf-8", "surrogatepass")),
                      st.binary(max_size=60)),
       status=st.sampled_from([200, 200, 201, 400, 404, 409, 422, 500]))
@example(body=b"[" * 5000, status=200)
async def test_kube_client_decodes_or_names_the_secret(body: bytes, status: int,
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    c = _client(tmp_path_factory.getbasetemp(), body, status)
    try:
        secret = await c.get_secret("s")
    except KubeError as e:
        assert 'secrets "s"' in str(e)
        assert "tskey-auth-QXZ" not in str(e)
        return
    finally:
        await c.aclose()
    if secret is not None:
        assert all(isinstance(v, bytes) for v in secret.data.values())
