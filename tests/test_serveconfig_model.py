"""serveconfig.model: JSON round trips, ${TS_CERT_DOMAIN} substitution, no-https, validation messages."""
from __future__ import annotations

import json

import pytest

from serveconfig.model import (
    NO_HTTPS,
    HTTPHandler,
    ServeConfig,
    ServeConfigError,
    TCPPortHandler,
    cert_domains_needed,
    needs_https,
    parse,
    service_cert_domains,
    service_names,
)

# What the operator renders for an L7 Ingress (spec B.5), with HTTP redirect and Funnel.
OPERATOR_INGRESS = """{"TCP":{"443":{"HTTPS":true},"80":{"HTTP":true}},
 "Web":{"${TS_CERT_DOMAIN}:443":{"Handlers":{"/":{"Proxy":"http://10.0.0.5:8080/"},
                                            "/api":{"Proxy":"https+insecure://10.0.0.6:443/api"}}},
        "${TS_CERT_DOMAIN}:80":{"Handlers":{"/":{"Redirect":"301:https://${HOST}${REQUEST_URI}"}}}},
 "AllowFunnel":{"${TS_CERT_DOMAIN}:443":true,":80":true}}"""

# Upstream-style JSON as tailscaled would return it (Go encoding, omitempty), one of each feature.
FULL = {
    "TCP": {
        "443": {"HTTPS": True},
        "80": {"HTTP": True},
        "5432": {"TCPForward": "10.0.0.7:5432"},
        "8443": {"TCPForward": "127.0.0.1:8443", "TerminateTLS": "db.tailnet.ts.net", "ProxyProtocol": 2},
        "2222": {"TCPForward": "unix:/run/ssh.sock"},
    },
    "Web": {
        "node.tailnet.ts.net:443": {"Handlers": {
            "/": {"Proxy": "http://127.0.0.1:3000"},
            "/static/": {"Path": "/srv/static"},
            "/hello": {"Text": "hello"},
            "/who": {"Proxy": "3030", "AcceptAppCaps": ["example.com/cap/foo"]},
        }},
        "node.tailnet.ts.net:80": {"Handlers": {"/": {"Redirect": "https://${HOST}${REQUEST_URI}"}}},
    },
    "Services": {
        "svc:web": {
            "TCP": {"443": {"HTTPS": True}},
            "Web": {"web.tailnet.ts.net:443": {"Handlers": {"/": {"Proxy": "http://10.0.0.9:80"}}}},
        },
        "svc:db": {"TCP": {"5432": {"TCPForward": "10.0.0.8:5432", "TerminateTLS": "db-svc.tailnet.ts.net"}}},
        "svc:l3": {"Tun": True},
    },
    "AllowFunnel": {"node.tailnet.ts.net:443": True},
    "Foreground": {
        "sess1": {"TCP": {"9000": {"HTTP": True}},
                  "Web": {"node.tailnet.ts.net:9000": {"Handlers": {"/": {"Text": "fg"}}}}},
    },
}


def test_round_trip_full_upstream_json() -> None:
    cfg = ServeConfig.from_json(FULL)
    assert cfg.to_json() == FULL
    # Byte-level too, in the same key order.
    assert json.dumps(cfg.to_json()) == json.dumps(FULL)
    assert ServeConfig.from_json(cfg.to_json()) == cfg
    assert hash(cfg) == hash(ServeConfig.from_json(json.loads(json.dumps(FULL))))


def test_typed_access() -> None:
    cfg = ServeConfig.from_json(FULL)
    assert cfg.tcp[443] == TCPPortHandler(https=True)
    assert cfg.tcp[8443].proxy_protocol == 2
    assert cfg.web["node.tailnet.ts.net:443"].handlers["/who"] == HTTPHandler(
        proxy="3030", accept_app_caps=("example.com/cap/foo",))
    assert cfg.services["svc:l3"].tun is True
    assert cfg.foreground["sess1"].tcp[9000].http is True


def test_unknown_fields_are_kept_at_every_level() -> None:
    raw = {
        "TCP": {"443": {"HTTPS": True, "FutureTCP": {"a": [1, 2, {"b": None}]}}},
        "Web": {"n.ts.net:443": {"Handlers": {"/": {"Proxy": "http://x:1", "FutureHandler": "v"}},
                                 "FutureWeb": 3}},
        "Services": {"svc:a": {"Tun": True, "FutureSvc": False}},
        "FutureTop": {"x": "y"},
    }
    cfg = ServeConfig.from_json(raw)
    assert cfg.to_json() == raw
    assert hash(cfg)  # deep-frozen, so hashable
    # And through the strict parser as well.
    assert parse(json.dumps(raw), "n.ts.net").to_json() == raw


def test_empty_and_null_values_follow_go() -> None:
    assert ServeConfig.from_json(None) == ServeConfig()
    assert ServeConfig.from_json({}).to_json() == {}
    # null fields are zero values; false/empty fields are omitted on output (omitempty).
    cfg = ServeConfig.from_json({"TCP": {"80": {"HTTP": True, "HTTPS": None, "TCPForward": ""}}, "Web": None})
    assert cfg.to_json() == {"TCP": {"80": {"HTTP": True}}}
    # Handlers has no omitempty upstream.
    assert ServeConfig.from_json({"Web": {"a:1": {"Handlers": None}}}).to_json() == {"Web": {"a:1": {"Handlers": {}}}}


def test_case_insensitive_field_names_like_go() -> None:
    cfg = parse('{"tcp":{"443":{"https":true}},"web":{"a.ts.net:443":{"handlers":{"/":{"proxy":"8080"}}}}}', "x")
    assert cfg.to_json() == {"TCP": {"443": {"HTTPS": True}},
                             "Web": {"a.ts.net:443": {"Handlers": {"/": {"Proxy": "8080"}}}}}


def test_operator_ingress_config_substitution() -> None:
    cfg = parse(OPERATOR_INGRESS, "proxy.tailnet.ts.net")
    assert cfg is not None
    j = cfg.to_json()
    assert set(j["Web"]) == {"proxy.tailnet.ts.net:443", "proxy.tailnet.ts.net:80"}
    assert j["AllowFunnel"] == {"proxy.tailnet.ts.net:443": True, ":80": True}
    # ${HOST} and ${REQUEST_URI} are tailscaled's, expanded per request: untouched.
    assert j["Web"]["proxy.tailnet.ts.net:80"]["Handlers"]["/"]["Redirect"] == "301:https://${HOST}${REQUEST_URI}"
    assert "${TS_CERT_DOMAIN}" not in json.dumps(j)
    assert needs_https(cfg)
    assert cert_domains_needed(cfg) == ("proxy.tailnet.ts.net",)


def test_substitution_in_values_too() -> None:
    cfg = parse('{"TCP":{"443":{"TCPForward":"127.0.0.1:443","TerminateTLS":"${TS_CERT_DOMAIN}"}}}', "n.ts.net")
    assert cfg.tcp[443].terminate_tls == "n.ts.net"
    assert cert_domains_needed(cfg) == ("n.ts.net",)


def test_no_https_substitution() -> None:
    cfg = parse(OPERATOR_INGRESS, NO_HTTPS)
    assert "no-https:443" in cfg.web
    assert needs_https(cfg)
    assert cert_domains_needed(cfg) == ()     # the placeholder is never a cert domain
    # An unknown (empty) cert domain is treated as no-https.
    assert parse(OPERATOR_INGRESS, "") == cfg


def test_http_only_config_does_not_need_https() -> None:
    cfg = parse('{"TCP":{"80":{"HTTP":true}},"Web":{"${TS_CERT_DOMAIN}:80":{"Handlers":{"/":{"Text":"hi"}}}}}',
                NO_HTTPS)
    assert not needs_https(cfg)
    assert cert_domains_needed(cfg) == ()


def test_empty_missing_null() -> None:
    assert parse(None, "x") is None
    assert parse("", "x") is None
    assert parse("  \n\t", "x") is None
    assert parse("null", "x") == ServeConfig()
    assert parse("{}", "x") == ServeConfig()
    assert parse(b'\xef\xbb\xbf{}', "x") == ServeConfig()     # UTF-8 BOM


def test_service_names_and_cert_domains() -> None:
    cfg = ServeConfig.from_json(FULL)
    assert service_names(cfg) == ("svc:db", "svc:l3", "svc:web")
    assert service_names(None) == ()
    assert cert_domains_needed(cfg) == (
        "db-svc.tailnet.ts.net", "db.tailnet.ts.net", "node.tailnet.ts.net", "web.tailnet.ts.net")
    assert service_cert_domains(cfg, "svc:web") == ("web.tailnet.ts.net",)
    assert service_cert_domains(cfg, "svc:l3") == ()
    assert needs_https(ServeConfig.from_json({"Services": {"svc:a": {"TCP": {"443": {"HTTPS": True}}}}}))
    assert not needs_https(None)


def _errors(text: str) -> list[str]:
    with pytest.raises(ServeConfigError) as ei:
        parse(text, "n.ts.net")
    return list(ei.value.errors)


def test_validation_names_the_field_path() -> None:
    errs = _errors('{"TCP":{"443":{"HTTPS":true}},"Web":{"foo:443":{"Handlers":{"/":{"Proxy":"http//x"}}}}}')
    assert errs == ['Web["foo:443"].Handlers["/"].Proxy: not a valid URL or port: "http//x"']


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"TCP":{"443":{"HTTPS":"true"}}}', 'TCP["443"].HTTPS: expected true or false, got string "true"'),
        ('{"TCP":{"https":{"HTTPS":true}}}', 'TCP["https"]: TCP port key must be a decimal port number 1-65535'),
        ('{"TCP":{"70000":{"HTTP":true}}}', 'TCP["70000"]: TCP port key must be a decimal port number 1-65535'),
        (
            '{"TCP":{"443":{"HTTPS":true,"TCPForward":"a:1"}}}',
            'TCP["443"]: TCPForward is mutually exclusive with HTTPS and HTTP',
        ),
        ('{"TCP":{"443":{}}}', 'TCP["443"]: one of HTTPS, HTTP or TCPForward must be set'),
        (
            '{"TCP":{"5432":{"TCPForward":"nohost"}}}',
            'TCP["5432"].TCPForward: expected "host:port" or "unix:/path", got "nohost"',
        ),
        (
            '{"TCP":{"5432":{"HTTP":true,"TerminateTLS":"x"}}}',
            'TCP["5432"].TerminateTLS: only valid together with TCPForward',
        ),
        (
            '{"TCP":{"5432":{"TCPForward":"a:1","ProxyProtocol":3}}}',
            'TCP["5432"].ProxyProtocol: PROXY protocol version must be 1 or 2, got 3',
        ),
        (
            '{"TCP":{"5432":{"TCPForward":"a:1","ProxyProtocol":1.5}}}',
            'TCP["5432"].ProxyProtocol: expected an integer, got number 1.5',
        ),
        (
            '{"TCP":{"443":{"HTTPS":true}},"Web":{"n.ts.net":{"Handlers":{"/":{"Text":"x"}}}}}',
            'Web["n.ts.net"]: key must be "<host>:<port>" with a port 1-65535, e.g. "${TS_CERT_DOMAIN}:443"',
        ),
        (
            '{"TCP":{"443":{"HTTPS":true}},"Web":{"n.ts.net:443":{"Handlers":{"api":{"Text":"x"}}}}}',
            'Web["n.ts.net:443"].Handlers["api"]: mount path must start with "/"',
        ),
        (
            '{"TCP":{"443":{"HTTPS":true}},"Web":{"n.ts.net:443":{"Handlers":{"/":{"Text":"x","Proxy":"80"}}}}}',
            'Web["n.ts.net:443"].Handlers["/"]: only one of Path, Proxy, Text or Redirect may be set (got Proxy, Text)',
        ),
        (
            '{"TCP":{"443":{"HTTPS":true}},"Web":{"n.ts.net:443":{"Handlers":{"/":{}}}}}',
            'Web["n.ts.net:443"].Handlers["/"]: one of Path, Proxy, Text or Redirect must be set',
        ),
        (
            '{"TCP":{"443":{"HTTPS":true}},"Web":{"n.ts.net:443":{"Handlers":{"/":{"Path":"srv"}}}}}',
            'Web["n.ts.net:443"].Handlers["/"].Path: must be an absolute path, got "srv"',
        ),
        (
            '{"TCP":{"443":{"HTTPS":true}},"Web":{"n.ts.net:443":{"Handlers":{"/":{"Redirect":"200:/x"}}}}}',
            'Web["n.ts.net:443"].Handlers["/"].Redirect: redirect status code must be 3xx, got 200',
        ),
        (
            '{"TCP":{"443":{"HTTPS":true}},"Web":{"n.ts.net:443":{"Handlers":{}}}}',
            'Web["n.ts.net:443"].Handlers: no handlers: add at least one mount path, e.g. {"/": {"Proxy": "http://..."}}',
        ),
        (
            '{"Web":{"n.ts.net:443":{"Handlers":{"/":{"Text":"x"}}}}}',
            'Web["n.ts.net:443"]: no TCP listener for port 443: add TCP["443"] with HTTPS or HTTP',
        ),
        (
            '{"Services":{"web":{"Tun":true}}}',
            'Services["web"]: Service name must be "svc:<dns-label>", e.g. "svc:my-app"',
        ),
        (
            '{"Services":{"svc:a":{"Tun":true,"TCP":{"22":{"TCPForward":"a:22"}}}}}',
            'Services["svc:a"].Tun: Tun is mutually exclusive with TCP and Web',
        ),
        (
            '{"Services":{"svc:a":{"Web":{"a.ts.net:443":{"Handlers":{"/":{"Proxy":"ftp://x"}}}},'
            '"TCP":{"443":{"HTTPS":true}}}}}',
            'Services["svc:a"].Web["a.ts.net:443"].Handlers["/"].Proxy: not a valid URL or port: "ftp://x"',
        ),
        (
            '{"AllowFunnel":{"n.ts.net:443":"yes"}}',
            'AllowFunnel["n.ts.net:443"]: expected true or false, got string "yes"',
        ),
        (
            '{"Foreground":{"s":{"Foreground":{"t":{}}}}}',
            'Foreground["s"].Foreground: nested Foreground configs are not allowed',
        ),
        ('{"TCP":[]}', "TCP: expected an object, got array"),
        ("[1]", "serve config must be a JSON object, got array"),
    ],
)
def test_validation_messages(text: str, expected: str) -> None:
    assert _errors(text) == [expected]


def test_all_problems_reported_at_once() -> None:
    errs = _errors('{"TCP":{"443":{"HTTPS":1},"80":{"HTTP":"x"}}}')
    assert errs == ['TCP["443"].HTTPS: expected true or false, got number 1',
                    'TCP["80"].HTTP: expected true or false, got string "x"']
    with pytest.raises(ServeConfigError) as ei:
        parse('{"TCP":{"443":{"HTTPS":1},"80":{"HTTP":"x"}}}', "n")
    assert str(ei.value) == "; ".join(errs)


def test_bad_json_names_line_and_column() -> None:
    errs = _errors('{\n  "TCP": {\n    "443": {"HTTPS": true,}\n  }\n}')
    assert len(errs) == 1 and errs[0].startswith("serve config is not valid JSON: line 3 column")


def test_cli_get_config_format_is_explained() -> None:
    errs = _errors('{"version":"0.0.1","services":{"svc:a":{"endpoints":{"tcp:443":"http://localhost:80"}}}}')
    assert "tailscale serve get-config" in errs[0]


def test_proxy_credentials_are_not_echoed() -> None:
    errs = _errors('{"TCP":{"443":{"HTTPS":true}},"Web":{"a:443":{"Handlers":{"/":{"Proxy":"gopher://u:pw@h"}}}}}')
    assert "pw" not in errs[0]


@pytest.mark.parametrize("proxy", [
    "http://10.0.0.5:8080/", "https://example.com", "https+insecure://10.0.0.6:443/api", "8080",
    "localhost:8080", "10.0.0.1:80", "[fd00::1]:8080", "http://[fd00::1]:8080/x", "unix:/run/app.sock",
])
def test_valid_proxy_targets(proxy: str) -> None:
    cfg = parse(json.dumps({"TCP": {"443": {"HTTPS": True}},
                            "Web": {"a.ts.net:443": {"Handlers": {"/": {"Proxy": proxy}}}}}), "x")
    assert cfg.web["a.ts.net:443"].handlers["/"].proxy == proxy


@pytest.mark.parametrize("proxy", ["http//x", "ftp://x", "0", "70000", "unix:relative", "http://", "a b:80",
                                   "host:99999", "host/path"])
def test_invalid_proxy_targets(proxy: str) -> None:
    errs = _errors(json.dumps({"TCP": {"443": {"HTTPS": True}},
                               "Web": {"a.ts.net:443": {"Handlers": {"/": {"Proxy": proxy}}}}}))
    assert errs and errs[0].startswith('Web["a.ts.net:443"].Handlers["/"].Proxy: not a valid URL or port')


def test_lenient_from_json_accepts_what_tailscaled_returns() -> None:
    # tailscaled may hold things the strict parser refuses (e.g. a Web entry without a listener); reading
    # its config back must not fail.
    raw = {"Web": {"a:443": {"Handlers": {"/": {}}}}}
    assert ServeConfig.from_json(raw).to_json() == raw


def test_queries_accept_plain_json_too() -> None:
    assert needs_https(FULL) and service_names(FULL) == ("svc:db", "svc:l3", "svc:web")
    assert cert_domains_needed({"TCP": {"80": {"HTTP": True}}}) == ()
