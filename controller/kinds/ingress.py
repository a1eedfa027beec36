"""L7 Ingresses with `ingressClassName: tailscale`: a serve config in the proxy's Secret (upstream's rules for
hosts, paths, backends, Funnel and the HTTP redirect).

Two schemes (`ControllerConfig.ingress_http`). HTTPS, upstream's: port 443 under `${TS_CERT_DOMAIN}`, which
the proxy replaces with its certificate domain. HTTP, ours, for control planes that issue no certificates
(headscale): port 80, plain HTTP inside the tailnet (WireGuard encrypts it), under the proxy's literal MagicDNS
name. The literal name is what makes it work with any proxy image: tailscaled matches a plain-HTTP request to
a Web key by its Host header (port dropped, the tailnet's MagicDNS suffix appended when missing, so `site` and
`site.tail.example` both hit `site.tail.example:80`; a bare tailnet IP matches nothing and gets tailscaled's
404), while `${TS_CERT_DOMAIN}` without a certificate domain becomes `no-https`, a name no request carries.
The name is the device's `device_fqdn` from its state Secret once the proxy has written it (level-triggered:
a pass after that write), before that `<hostname>.<TS_MAGICDNS_SUFFIX>` when the suffix is configured, else
nothing is served yet (an empty config).

HTTPS with the user's certificate (ours, docs/https.md): a `spec.tls[]` entry with a `secretName` makes the
proxy's agent serve that `kubernetes.io/tls` Secret (in the Ingress's namespace) on port 443 under either
scheme. tailscaled cannot serve a certificate its control plane did not issue, so the serve config forwards
TCP 443 to the agent's TLS listener (`TLS_LISTEN`), and the agent sends the decrypted connections to the same
handlers on a plain-HTTP port of the proxy's own tailnet address (`TLS_INNER_PORT`), keyed by the MagicDNS name
and by each `spec.tls[].hosts` name (as tailscaled sees a name outside the tailnet: with the tailnet's suffix
appended). `tailscale.com/http-redirect` answers port 80 with a redirect to https. The certificate is checked
by the controller (`controller.tlssecret`) and again by the agent, which keeps the last good one.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import ControllerConfig
from ..model import (
    ANN_FORWARD_CLUSTER_TRAFFIC,
    ANN_FUNNEL,
    ANN_HTTP_REDIRECT,
    ANN_PROXY_GROUP,
    ANN_TAGS,
    INGRESS,
    Decision,
    Invalid,
    Parent,
    ProxySpec,
)
from ..validation import (
    HTTP_ENDPOINT,
    hostname_problem,
    http_endpoint_notice,
    parse_tags,
    proxy_group_ingress_problem,
    tag_problems,
)
from . import annotations_of, meta

APP = "k8s-operator-ingress-resource"
CERT_443 = "${TS_CERT_DOMAIN}:443"
CERT_80 = "${TS_CERT_DOMAIN}:80"


def handled(ing: Mapping[str, Any], cfg: ControllerConfig) -> bool:
    spec = ing.get("spec") or {}
    # one naming a ProxyGroup too: `decide` refuses it, saying why
    return spec.get("ingressClassName") == cfg.ingress_class


def backend_services(ing: Mapping[str, Any]) -> tuple[str, ...]:
    """Names of the Services (in the Ingress's namespace) the Ingress routes to: what `decide` needs looked up."""
    spec = ing.get("spec") or {}
    names = []
    for b in [spec.get("defaultBackend")] + [p.get("backend") for r in spec.get("rules") or []
                                             for p in ((r.get("http") or {}).get("paths") or [])]:
        if b and (b.get("service") or {}).get("name"):
            names.append(b["service"]["name"])
    return tuple(sorted(set(names)))


TLS_LISTEN = "127.0.0.1:10443"
TLS_INNER_PORT = 10080
REASON_TLS = "TLSCertificateInvalid"


def tls_entry(ing: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """(secretName, hosts) of the first spec.tls[] entry that names a Secret; ("", ()) when none does."""
    for t in (ing.get("spec") or {}).get("tls") or []:
        if isinstance(t, Mapping) and t.get("secretName"):
            return str(t["secretName"]), tuple(str(h) for h in t.get("hosts") or [] if h)
    return "", ()


def tls_names(fqdn: str, hosts: tuple[str, ...]) -> tuple[str, ...]:
    """The names a client may use: the proxy's MagicDNS name (when known) and the entry's hosts."""
    return tuple(dict.fromkeys(([fqdn.rstrip(".")] if fqdn else []) + list(hosts)))


def _inner_key(host: str, suffix: str) -> str:
    """The Web key tailscaled matches a plain-HTTP request for `host` against (it appends the tailnet's suffix
    to a Host outside it)."""
    h = host.rstrip(".")
    if suffix and not h.endswith("." + suffix):
        h = f"{h}.{suffix}"
    return f"{h}:{TLS_INNER_PORT}"


def direct_backend(handlers: Mapping[str, Any]) -> str:
    """`IP:port` when every path goes to one plain-HTTP backend unchanged (one handler, `/`, to `http://...:N/`):
    the agent then sends decrypted connections straight to it (measured faster than through tailscaled's
    serve, docs/https.md); "" otherwise."""
    if list(handlers) != ["/"]:
        return ""
    url = str((handlers["/"] or {}).get("Proxy") or "")
    if not url.startswith("http://") or not url.endswith("/") or url.count("/") != 3:
        return ""
    return url[len("http://"):-1]


def tls_serve_config(name: str, hosts: tuple[str, ...], handlers: Mapping[str, Any], redirect: bool) -> dict:
    """Port 443 to the agent's TLS listener, the handlers on the inner plain-HTTP port for the MagicDNS name and
    each host (not needed when the agent goes straight to the one backend), and port 80's redirect when asked;
    {} while the MagicDNS name is unknown."""
    if not name:
        return {}
    suffix = name.partition(".")[2]
    keys = list(dict.fromkeys([_inner_key(name, suffix)] + [_inner_key(h, suffix) for h in hosts]))
    cfg: dict = {"TCP": {"443": {"TCPForward": TLS_LISTEN}}, "Web": {}}
    if not direct_backend(handlers):
        cfg["TCP"][str(TLS_INNER_PORT)] = {"HTTP": True}
        cfg["Web"] = {k: {"Handlers": dict(handlers)} for k in keys}
    if redirect:
        cfg["TCP"]["80"] = {"HTTP": True}
        for k in keys:
            cfg["Web"][k.rsplit(":", 1)[0] + ":80"] = {
                "Handlers": {m: {"Redirect": "301:https://${HOST}${REQUEST_URI}"} for m in handlers}}
    if not cfg["Web"]:
        del cfg["Web"]
    return cfg


def _tls_host(spec: Mapping[str, Any]) -> str:
    tls = spec.get("tls") or []
    hosts = (tls[0].get("hosts") or []) if tls else []
    return hosts[0] if hosts else ""


def _proxy_url(backend: Mapping[str, Any], path: str, services: Mapping[str, Mapping[str, Any]]) -> str:
    """http[s+insecure]://<clusterIP>:<port><path> for one backend; raises ValueError with the reason."""
    ref = backend.get("service") or {}
    name = ref.get("name", "")
    svc = services.get(name)
    if svc is None:
        raise ValueError(f"backend Service {name!r} not found")
    sspec = svc.get("spec") or {}
    ip = sspec.get("clusterIP") or ""
    if ip in ("", "None"):
        raise ValueError(f"backend Service {name!r} has no ClusterIP (headless or ExternalName)")
    port = ref.get("port") or {}
    number, pname = port.get("number"), port.get("name", "")
    if not number:
        match = [p for p in sspec.get("ports") or [] if p.get("name") == pname and pname]
        if not match:
            raise ValueError(f"backend Service {name!r} has no port named {pname!r}")
        number = match[0].get("port")
    scheme = "https+insecure" if number == 443 or pname == "https" else "http"
    host = f"[{ip}]" if ":" in ip else ip
    return f"{scheme}://{host}:{number}{path}"


def serve_config(ing: Mapping[str, Any], services: Mapping[str, Mapping[str, Any]], *, http_name: str | None = None,
                 tls_name: str | None = None) -> tuple[dict, tuple[str, ...]]:
    """The ServeConfig for the Ingress and warnings about what was skipped; Invalid if nothing is left.

    http_name None: upstream's HTTPS config. A string: the plain-HTTP config on port 80 for that MagicDNS name
    ("" = not known yet: an empty config)."""
    ann = annotations_of(ing)
    handlers, warnings = handlers_of(ing, services)
    if tls_name is not None:
        return (tls_serve_config(tls_name, tls_entry(ing)[1], handlers, ann.get(ANN_HTTP_REDIRECT) == "true"),
                tuple(warnings))
    if http_name is not None:
        return http_serve_config(http_name, handlers), tuple(warnings)
    cfg: dict = {"TCP": {"443": {"HTTPS": True}}, "Web": {CERT_443: {"Handlers": handlers}}}
    funnel = ann.get(ANN_FUNNEL) == "true"
    if funnel:
        cfg["AllowFunnel"] = {CERT_443: True}
    if ann.get(ANN_HTTP_REDIRECT) == "true":
        cfg["TCP"]["80"] = {"HTTP": True}
        cfg["Web"][CERT_80] = {"Handlers": {m: {"Redirect": "301:https://${HOST}${REQUEST_URI}"}
                                            for m in handlers}}
        if funnel:
            cfg["AllowFunnel"][CERT_80] = True
    return cfg, tuple(warnings)


def handlers_of(ing: Mapping[str, Any], services: Mapping[str, Mapping[str, Any]]
                ) -> tuple[dict[str, dict], list[str]]:
    """The serve handlers by path and warnings about what was skipped; Invalid if nothing is left."""
    spec = ing.get("spec") or {}
    tls_host = _tls_host(spec)
    warnings: list[str] = []
    handlers: dict[str, dict] = {}
    if spec.get("defaultBackend"):
        try:
            handlers["/"] = {"Proxy": _proxy_url(spec["defaultBackend"], "/", services)}
        except ValueError as e:
            warnings.append(f"spec.defaultBackend skipped: {e}")
    for i, rule in enumerate(spec.get("rules") or []):
        host = rule.get("host") or ""
        if host and host != tls_host:
            warnings.append(f"spec.rules[{i}] skipped: host {host!r} is not the TLS host {tls_host!r} "
                            "(one proxy serves one host)")
            continue
        for j, p in enumerate((rule.get("http") or {}).get("paths") or []):
            path = p.get("path") or ""
            if not path:
                warnings.append(f"spec.rules[{i}].http.paths[{j}] has no path; served at /")
                path = "/"
            if p.get("pathType") == "Exact":
                warnings.append(f"spec.rules[{i}].http.paths[{j}]: pathType Exact is served as a prefix")
            try:
                handlers[path] = {"Proxy": _proxy_url(p.get("backend") or {}, path, services)}
            except ValueError as e:
                warnings.append(f"spec.rules[{i}].http.paths[{j}] skipped: {e}")
    if not handlers:
        raise Invalid("no valid backends: " + ("; ".join(warnings) if warnings else
                      "the Ingress has neither spec.defaultBackend nor rules with paths") +
                      "; point the Ingress at a Service with a ClusterIP in the same namespace")
    return handlers, warnings


def http_serve_config(name: str, handlers: Mapping[str, Any]) -> dict:
    """Plain HTTP on port 80 for requests to `name` (the proxy's MagicDNS name); {} while it is unknown."""
    if not name:
        return {}
    return {"TCP": {"80": {"HTTP": True}}, "Web": {f"{name}:80": {"Handlers": dict(handlers)}}}


HTTP_ONLY = "HTTPOnly"


def http_name(hostname: str, cfg: ControllerConfig, device_fqdn: str) -> str:
    """The MagicDNS name the HTTP config answers to: the device's own, else the predicted one, else ""."""
    if device_fqdn:
        return device_fqdn.rstrip(".")
    return f"{hostname}.{cfg.magicdns_suffix}" if cfg.magicdns_suffix else ""


def decide(ing: Mapping[str, Any], cfg: ControllerConfig, services: Mapping[str, Mapping[str, Any]],
           device_fqdn: str = "", tls_secret_problem: str = "") -> Decision:
    """device_fqdn: the proxy's MagicDNS name from its state Secret ("" when none yet), for the HTTP scheme and
    the user's certificate. tls_secret_problem: `controller.tlssecret.tls_problem`'s answer for the Ingress's
    TLS Secret."""
    m, ann, spec = meta(ing), annotations_of(ing), ing.get("spec") or {}
    ns, name = m.get("namespace", ""), m.get("name", "")
    problems = []
    tls_host = _tls_host(spec)
    hostname = tls_host.split(".")[0] if tls_host else f"{ns}-{name}-ingress"
    if tls_host and (p := hostname_problem(hostname)):
        problems.append(f"spec.tls[0].hosts[0]: the first label {p}")
    tags = parse_tags(ann[ANN_TAGS]) if ann.get(ANN_TAGS, "").strip() else cfg.proxy_tags
    if p := tag_problems(tags):
        problems.append(f"annotation {ANN_TAGS}: {p}")
    if ann.get(ANN_PROXY_GROUP, "").strip():
        problems.append(proxy_group_ingress_problem("an Ingress", cfg.provider))
    if problems:
        raise Invalid("; ".join(problems))
    notices: list[tuple[str, str, str]] = []
    if ann.get(HTTP_ENDPOINT, "").strip():
        notices.append(("Warning", "HTTPEndpointIgnored", http_endpoint_notice(cfg.ingress_http)))
    secret, tls_hosts = tls_entry(ing)
    forward = ann.get(ANN_FORWARD_CLUSTER_TRAFFIC) == "true"
    if secret and forward:
        raise Invalid(f"spec.tls[].secretName {secret!r} cannot be served with annotation "
                      f"{ANN_FORWARD_CLUSTER_TRAFFIC}: the proxy then runs kernel networking, where its TLS listener "
                      "cannot reach the serve config; remove one of them")
    name_http = http_name(hostname, cfg, device_fqdn) if (cfg.ingress_http or secret) else None
    if secret:
        assert name_http is not None
        sc, warnings = serve_config(ing, services, tls_name=name_http)
        others = [str(t.get("secretName")) for t in spec.get("tls") or []
                  if isinstance(t, Mapping) and t.get("secretName") and t.get("secretName") != secret]
        if others:
            warnings += (f"spec.tls[]: only Secret {secret!r} is served (one proxy serves one certificate); "
                         f"{', '.join(others)} skipped",)
        if ann.get(ANN_FUNNEL) == "true":
            notices.append(("Warning", REASON_TLS, f"annotation {ANN_FUNNEL} ignored: Funnel needs the control "
                            "plane's certificate, and this Ingress serves its own (spec.tls[].secretName)"))
        if tls_secret_problem:
            notices.append(("Warning", REASON_TLS, tls_secret_problem + "; the proxy keeps serving the last good "
                            "certificate, if it had one"))
    else:
        sc, warnings = serve_config(ing, services, http_name=name_http)
    if cfg.ingress_http and not secret:
        notices.append(("Normal", HTTP_ONLY, "served over plain HTTP on port 80 inside the tailnet (WireGuard "
                        "encrypts it), not HTTPS: the control plane issues no TLS certificates "
                        f"(INGRESS_SCHEME={cfg.ingress_scheme}, CONTROL_PLANE={cfg.provider}); use "
                        "http://<the status hostname>/"))
        for a in (ANN_FUNNEL, ANN_HTTP_REDIRECT):
            if ann.get(a) == "true":
                notices.append(("Warning", HTTP_ONLY, f"annotation {a} ignored: the Ingress is served over plain "
                                "HTTP (no TLS certificates from this control plane), and it needs HTTPS"))
    env: tuple[tuple[str, str], ...] = (("TS_SERVE_CONFIG", "/etc/tailscaled/$(POD_NAME)/serve-config"),)
    if secret:
        env += (("TS_TLS_CERT_SECRET", f"{ns}/{secret}"), ("TS_TLS_LISTEN", TLS_LISTEN),
                ("TS_TLS_UPSTREAM_PORT", str(TLS_INNER_PORT)))
        if tls_hosts:
            env += (("TS_TLS_HOSTS", ",".join(tls_hosts)),)
        if backend := direct_backend(handlers_of(ing, services)[0]):
            env += (("TS_TLS_BACKEND", backend),)
    return Decision(ProxySpec(Parent(INGRESS, name, ns, m.get("uid", "")), hostname, tags, APP, env,
                              userspace=not forward, serve_config=sc, forward_cluster_traffic=forward,
                              ingress_http=cfg.ingress_http and not secret, ingress_http_name=name_http or "",
                              tls_secret=secret),
                    tuple(warnings), tuple(notices))
