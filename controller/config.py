"""The controller's own settings, from its Deployment's environment (pure: parse and validate).

Names follow upstream's operator where it has one (OPERATOR_NAMESPACE, PROXY_IMAGE, PROXY_TAGS,
PROXY_FIREWALL_MODE, OPERATOR_LOGIN_SERVER, OPERATOR_DEFAULT_LOAD_BALANCER, OPERATOR_INGRESS_CLASS_NAME,
OPERATOR_LOGGING);
the control plane provider and the proxy settings under every ProxyClass (image, firewall mode, resources,
env: what a proxy gets where its class says nothing) are ours; PROXY_DEFAULT_CLASS names the class of parents
that name none, as upstream. A bad value is one error naming the variable, the value and the fix; secrets (API keys,
OAuth client secrets) are read from files, never from the environment or a log line.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tscommon import jsontext

from .validation import tag_problems


class ConfigError(Exception):
    """str(e) is the one user-facing message."""


PROVIDERS = ("headscale", "tailscale", "static")
FIREWALL_MODES = ("", "auto", "iptables", "nftables")
INGRESS_SCHEMES = ("auto", "https", "http")
#: OPERATOR_LOGGING, upstream's levels: info; debug (the controller's own debug lines); dev (kopf's too)
LOG_LEVELS = ("info", "debug", "dev")
DEFAULT_RESOURCES = {"requests": {"cpu": "1m", "memory": "1Mi"}}
TAILSCALE_LOGIN_SERVER = "https://controlplane.tailscale.com"
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class ControllerConfig:
    namespace: str = "tailscale"                   # where every proxy object lives
    proxy_image: str = "tailscale/tailscale:latest"
    proxy_tags: tuple[str, ...] = ("tag:k8s",)
    firewall_mode: str = ""                        # -> TS_DEBUG_FIREWALL_MODE
    proxy_resources: dict = field(default_factory=lambda: json.loads(json.dumps(DEFAULT_RESOURCES)),
                                  hash=False)
    image_pull_policy: str = "Always"
    # extra env of the proxy container (ProxyClass' tailscaleContainer.env)
    proxy_env: tuple[tuple[str, str], ...] = ()
    login_server: str = ""                         # written into each proxy's config as ServerURL
    default_load_balancer: bool = False
    ingress_class: str = "tailscale"
    cluster_domain: str = "cluster.local"
    magicdns_suffix: str = ""                      # headscale's base_domain; "" = Tailscale's *.ts.net
    provider: str = "static"
    headscale_url: str = ""                        # API base (defaults to the login server)
    headscale_api_key_file: str = "/etc/headscale-api/key"
    headscale_user: str = ""                       # numeric user ID for pre-auth keys; "" = tags only
    tailscale_api_url: str = "https://api.tailscale.com"
    tailnet: str = "-"
    oauth_client_id_file: str = "/oauth/client_id"
    oauth_client_secret_file: str = "/oauth/client_secret"
    static_key_secret: str = "tailscale-auth"      # Secret in `namespace` with key `authkey`
    ingress_scheme: str = "auto"                   # L7 Ingress: auto | https | http (see ingress_http)
    stub_zone_configmap: str = ""                  # "<ns>/<name>" of CoreDNS's ConfigMap to keep the stub zone in
    # The proxies' Pods (upstream: a ProxyClass's statefulSet.pod): pull Secrets and placement.
    proxy_image_pull_secrets: tuple[str, ...] = ()
    proxy_node_selector: dict = field(default_factory=dict, hash=False)
    proxy_tolerations: list = field(default_factory=list, hash=False)
    proxy_affinity: dict = field(default_factory=dict, hash=False)
    default_proxy_class: str = ""                  # PROXY_DEFAULT_CLASS: the ProxyClass of parents naming none
    # PROXY_CA_CONFIGMAP: a ConfigMap in `namespace` of PEM CA certificates every proxy trusts besides the public
    # ones (a control server with a certificate from a private CA); "" = none
    proxy_ca_configmap: str = ""
    logging: str = "info"                          # OPERATOR_LOGGING: info | debug | dev
    # POD_NAME (the downward API's metadata.name): the controller's own Pod, whose Deployment owns the leader
    # Lease (controller/leader.py); "" = not run in a Pod (the Lease then has no owner)
    pod_name: str = ""

    @property
    def server_url(self) -> str:
        """The proxies' ServerURL: the login server, Tailscale's by default."""
        return self.login_server or TAILSCALE_LOGIN_SERVER

    @property
    def ingress_http(self) -> bool:
        """L7 Ingresses are served over plain HTTP on port 80 instead of HTTPS on 443 (ours, not upstream's).

        `auto` asks for HTTPS only where the control plane can issue the proxies' certificates: Tailscale's.
        headscale never sets the netmap's CertDomains, so tailscaled refuses every certificate there and an
        HTTPS Ingress could never serve; a `static` key on another login server is treated the same way."""
        if self.ingress_scheme != "auto":
            return self.ingress_scheme == "http"
        if self.provider == "headscale":
            return True
        return self.provider == "static" and self.server_url.rstrip("/") != TAILSCALE_LOGIN_SERVER


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    if raw.lower() in ("1", "t", "true"):
        return True
    if raw.lower() in ("0", "f", "false"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use true or false")


def resolv_conf_cluster_domain(text: str) -> str:
    """The cluster domain from a Pod's resolv.conf search list (`svc.<domain>`), as upstream; default cluster.local."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "search":
            for d in parts[1:]:
                if d.startswith("svc."):
                    return d[len("svc."):].rstrip(".")
    return "cluster.local"


def _proxy_env(raw: str) -> tuple[tuple[str, str], ...]:
    """PROXY_ENV: a JSON object of extra env for every proxy container (upstream: a ProxyClass's
    `statefulSet.pod.tailscaleContainer.env`), e.g. tailscaled's knobs a given network needs."""
    if not raw:
        return ()
    try:
        env = jsontext.loads(raw)
    except ValueError as e:
        raise ConfigError(f"PROXY_ENV is not JSON ({e}); use e.g. "
                          '{"TS_DEBUG_USE_DERP_HTTP":"true"}') from None
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and isinstance(v, str) for k, v in env.items()):
        raise ConfigError("PROXY_ENV must be a JSON object of names to string values, e.g. "
                          '{"TS_DEBUG_USE_DERP_HTTP":"true"}')
    return tuple(sorted(env.items()))


def _json(env: Mapping[str, str], name: str, kind: type, example: str) -> Any:
    """A JSON setting of the proxies' Pods (a Kubernetes field, passed through as written)."""
    raw = env.get(name, "").strip()
    if not raw:
        return kind()
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{name} is not JSON ({e}); use e.g. {example}") from None
    if not isinstance(value, kind):
        raise ConfigError(f"{name} must be a JSON {'object' if kind is dict else 'array'}, e.g. {example}")
    return value


def _placement(env: Mapping[str, str]) -> dict:
    """PROXY_NODE_SELECTOR, PROXY_TOLERATIONS, PROXY_AFFINITY and PROXY_IMAGE_PULL_SECRETS: the proxies' Pods'
    nodeSelector, tolerations, affinity and imagePullSecrets (upstream: a ProxyClass's statefulSet.pod)."""
    kw: dict = {}
    sel = _json(env, "PROXY_NODE_SELECTOR", dict, '{"kubernetes.io/arch":"arm64"}')
    if not all(isinstance(v, str) for v in sel.values()):
        raise ConfigError("PROXY_NODE_SELECTOR must map label names to string values, e.g. "
                          '{"kubernetes.io/arch":"arm64"}')
    kw["proxy_node_selector"] = sel
    tol = _json(env, "PROXY_TOLERATIONS", list, '[{"key":"dedicated","operator":"Exists","effect":"NoSchedule"}]')
    if not all(isinstance(t, dict) for t in tol):
        raise ConfigError("PROXY_TOLERATIONS must be a JSON array of tolerations (objects), e.g. "
                          '[{"key":"dedicated","operator":"Exists","effect":"NoSchedule"}]')
    kw["proxy_tolerations"] = tol
    kw["proxy_affinity"] = _json(env, "PROXY_AFFINITY", dict, '{"nodeAffinity":{...}}')
    secrets = tuple(n.strip() for n in env.get("PROXY_IMAGE_PULL_SECRETS", "").split(",") if n.strip())
    bad = [n for n in secrets if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", n)]
    if bad:
        raise ConfigError(f"PROXY_IMAGE_PULL_SECRETS={env['PROXY_IMAGE_PULL_SECRETS']!r}: {bad[0]!r} is not a "
                          "Secret name; use comma-separated names of Secrets in the controller's namespace")
    kw["proxy_image_pull_secrets"] = secrets
    return kw


def load(env: Mapping[str, str], *, resolv_conf: str = "") -> ControllerConfig:
    """Parse the controller's environment; raises ConfigError naming the variable."""
    def get(name: str, default: str = "") -> str:
        return env.get(name, "").strip() or default

    kw: dict = {}
    kw["namespace"] = get("OPERATOR_NAMESPACE", "tailscale")
    kw["proxy_image"] = get("PROXY_IMAGE", ControllerConfig.proxy_image)
    tags = tuple(t.strip() for t in get("PROXY_TAGS", "tag:k8s").split(",") if t.strip())
    bad = tag_problems(tags)
    if bad:
        raise ConfigError(f"PROXY_TAGS={get('PROXY_TAGS')!r}: {bad}")
    kw["proxy_tags"] = tags
    fw = get("PROXY_FIREWALL_MODE")
    if fw not in FIREWALL_MODES:
        raise ConfigError(f"PROXY_FIREWALL_MODE={fw!r} is not a firewall mode; use auto, iptables or nftables")
    kw["firewall_mode"] = fw
    raw_res = get("PROXY_RESOURCES")
    if raw_res:
        try:
            res = jsontext.loads(raw_res)
        except ValueError as e:
            raise ConfigError(f"PROXY_RESOURCES is not JSON ({e}); use e.g. "
                              '{"requests":{"cpu":"10m","memory":"32Mi"}}') from None
        if not isinstance(res, dict) or set(res) - {"requests", "limits"}:
            raise ConfigError("PROXY_RESOURCES must be a JSON object with only 'requests' and 'limits'")
        kw["proxy_resources"] = res
    kw["proxy_env"] = _proxy_env(get("PROXY_ENV"))
    pull = get("PROXY_IMAGE_PULL_POLICY", "Always")
    if pull not in ("Always", "IfNotPresent", "Never"):
        raise ConfigError(f"PROXY_IMAGE_PULL_POLICY={pull!r}; use Always, IfNotPresent or Never")
    kw["image_pull_policy"] = pull
    login = get("OPERATOR_LOGIN_SERVER").rstrip("/")
    if login and not login.startswith(("http://", "https://")):
        raise ConfigError(f"OPERATOR_LOGIN_SERVER={login!r} is not a URL; use e.g. https://headscale.example.com")
    kw["login_server"] = login
    kw["default_load_balancer"] = _bool(env, "OPERATOR_DEFAULT_LOAD_BALANCER", False)
    kw["ingress_class"] = get("OPERATOR_INGRESS_CLASS_NAME", "tailscale")
    kw["cluster_domain"] = get("CLUSTER_DOMAIN") or resolv_conf_cluster_domain(resolv_conf)
    kw["magicdns_suffix"] = get("TS_MAGICDNS_SUFFIX").strip(".")
    provider = get("CONTROL_PLANE", "static")
    if provider not in PROVIDERS:
        raise ConfigError(f"CONTROL_PLANE={provider!r} is not a provider; use headscale, tailscale or static")
    kw["provider"] = provider
    kw["headscale_url"] = get("HEADSCALE_URL", login).rstrip("/")
    if provider == "headscale":
        if not kw["headscale_url"]:
            raise ConfigError("CONTROL_PLANE=headscale needs HEADSCALE_URL or OPERATOR_LOGIN_SERVER "
                              "(the headscale server's URL)")
        if not login:
            kw["login_server"] = kw["headscale_url"]
    kw["headscale_api_key_file"] = get("HEADSCALE_API_KEY_FILE", ControllerConfig.headscale_api_key_file)
    user = get("HEADSCALE_USER")
    # ASCII digits: str.isdigit() is also true for "²" or "٣", which headscale's API does not take as an ID.
    if user and not (user.isascii() and user.isdigit()):
        raise ConfigError(f"HEADSCALE_USER={user!r} must be the numeric user ID (headscale users list)")
    kw["headscale_user"] = user
    kw["tailscale_api_url"] = get("TAILSCALE_API_URL", ControllerConfig.tailscale_api_url).rstrip("/")
    kw["tailnet"] = get("TAILSCALE_TAILNET", "-")
    kw["oauth_client_id_file"] = get("CLIENT_ID_FILE", ControllerConfig.oauth_client_id_file)
    kw["oauth_client_secret_file"] = get("CLIENT_SECRET_FILE", ControllerConfig.oauth_client_secret_file)
    kw["static_key_secret"] = get("AUTH_KEY_SECRET", ControllerConfig.static_key_secret)
    scheme = get("INGRESS_SCHEME", "auto").lower()
    if scheme not in INGRESS_SCHEMES:
        raise ConfigError(f"INGRESS_SCHEME={get('INGRESS_SCHEME')!r} is not a scheme; use auto (HTTPS on Tailscale, "
                          "HTTP on headscale), https or http")
    kw["ingress_scheme"] = scheme
    stub = get("DNS_STUB_ZONE_CONFIGMAP")
    if stub and not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?", stub):
        raise ConfigError(f"DNS_STUB_ZONE_CONFIGMAP={stub!r} is not <namespace>/<name> of a ConfigMap; use e.g. "
                          "kube-system/coredns, or leave it empty to add the stub zone yourself")
    kw["stub_zone_configmap"] = stub
    kw.update(_placement(env))
    default_class = get("PROXY_DEFAULT_CLASS")
    if default_class and not _DNS_SUBDOMAIN.match(default_class):
        raise ConfigError(f"PROXY_DEFAULT_CLASS={default_class!r} is not a ProxyClass name; use a lower-case DNS "
                          "name such as 'prod' (kubectl get proxyclasses)")
    kw["default_proxy_class"] = default_class
    ca = get("PROXY_CA_CONFIGMAP")
    if ca and not (_DNS_SUBDOMAIN.match(ca) and len(ca) <= 253):
        raise ConfigError(f"PROXY_CA_CONFIGMAP={ca!r} is not a ConfigMap name; use the lower-case name of a ConfigMap "
                          f"in {kw['namespace']!r} holding the CA's PEM (e.g. headscale-ca), or leave it empty")
    kw["proxy_ca_configmap"] = ca
    level = get("OPERATOR_LOGGING", "info").lower()
    if level not in LOG_LEVELS:
        raise ConfigError(f"OPERATOR_LOGGING={get('OPERATOR_LOGGING')!r} is not a log level; use info, debug or dev")
    kw["logging"] = level
    pod = get("POD_NAME")
    if pod and not (_DNS_SUBDOMAIN.match(pod) and len(pod) <= 253):
        raise ConfigError(f"POD_NAME={pod!r} is not a Pod name; set it from the downward API (valueFrom: "
                          "fieldRef: fieldPath: metadata.name), or leave it unset outside a Pod")
    kw["pod_name"] = pod
    return ControllerConfig(**kw)
