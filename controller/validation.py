"""Checks of what users write in annotations and specs (pure). Each returns "" or one problem sentence.

The rules are upstream's (the operator's validateService, isMagicDNSName, tailcfg.CheckTag, the Connector
CRD's patterns), with one addition: with headscale the MagicDNS suffix is the server's `base_domain`, so the
FQDN check takes it from TS_MAGICDNS_SUFFIX instead of assuming `ts.net`.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

_TS_NET_RE = re.compile(r"^[a-zA-Z0-9-]+\.[a-zA-Z0-9-]+\.ts\.net\.?$")
_LABEL_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_DNS_LABEL_CHARS = re.compile(r"^[a-zA-Z0-9-]+$")
_TAG_RE = re.compile(r"^tag:[a-zA-Z][a-zA-Z0-9-]*$")


def ip_problem(value: str) -> str:
    """An IP literal as the proxy's agent reads TS_TAILNET_TARGET_IP (Go's netip.ParseAddr): Python's parser
    alone would also take a non-ASCII IPv6 zone, which the agent then refuses."""
    v = value.strip()
    try:
        if not v.isascii() or any(c.isspace() for c in v):
            raise ValueError(v)
        ipaddress.ip_address(v)
    except ValueError:
        return f"{value!r} is not an IP address; use one IPv4 or IPv6 address such as 100.64.0.7"
    return ""


def magicdns_problem(value: str, suffix: str = "") -> str:
    """A MagicDNS name: <host>.<tailnet>.ts.net, or <host>.<suffix> for headscale's base_domain."""
    v = value.strip()
    if suffix:
        host = v.rstrip(".")
        sfx = "." + suffix.strip(".").lower()
        if host.lower().endswith(sfx) and host[: -len(sfx)] and \
                all(_DNS_LABEL_CHARS.match(p) for p in host[: -len(sfx)].split(".")):
            return ""
        return f"{value!r} is not a MagicDNS name; use <host>{sfx} (the tailnet's MagicDNS suffix)"
    if _TS_NET_RE.match(v):
        return ""
    return f"{value!r} is not a MagicDNS name; use <host>.<tailnet>.ts.net"


def hostname_problem(value: str) -> str:
    """A DNS label: lowercase letters, digits and '-', 1 to 63 characters, no '-' at either end."""
    if _LABEL_RE.match(value):
        return ""
    return (f"{value!r} is not a valid DNS label; use 1-63 lowercase letters, digits or '-', "
            "starting and ending with a letter or digit")


def tag_problems(tags: Iterable[str]) -> str:
    # Not a string at all: a CRD installed without its schema lets anything through.
    bad = [t for t in tags if not isinstance(t, str) or not _TAG_RE.match(t)]
    if not bad:
        return ""
    return (f"invalid tag(s) {', '.join(repr(t) for t in bad)}; a tag is 'tag:' followed by a letter and "
            "then letters, digits or '-', e.g. tag:k8s")


def route_problem(value: str) -> str:
    """A route: a prefix without host bits (10.0.0.0/24, fd00::/64)."""
    try:
        net = ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        return f"route {value!r} is not a CIDR prefix; use e.g. 10.40.0.0/16"
    if str(net) != value.strip() and ipaddress.ip_interface(value.strip()).ip != net.network_address:
        return f"route {value!r} has host bits set; use {net}"
    return ""


def parse_tags(raw: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in raw.split(",") if t.strip())


# ---- upstream's fields and annotations this controller does not carry out --------------------------------------
# Each is refused where it is written (a false condition and a Warning event: kinds/ raise model.Invalid with
# these messages), never accepted and ignored: what is not supported, why, and what to do instead.

def tailnet_field_problem(kind: str) -> str:
    """spec.tailnet of a Connector or a ProxyGroup: upstream's multi-tailnet (a Tailnet object's credentials)."""
    return (f"spec.tailnet is not supported: it names one of upstream's Tailnet objects (another tailnet's "
            f"credentials), and this controller serves the one tailnet of its own control plane settings; "
            f"recreate the {kind} without spec.tailnet (the field is immutable) to join the controller's tailnet, "
            "or run a second controller for the other tailnet")


def proxy_group_ingress_problem(what: str, provider: str) -> str:
    """`tailscale.com/proxy-group` on an Ingress or an exposed (ingress) Service: a ProxyGroup of type ingress."""
    why = ("a ProxyGroup serves Ingresses and exposed Services through the control plane's Tailscale Services "
           "(virtual IPs) with its TLS certificates")
    why += (", and headscale provides neither" if provider == "headscale"
            else ", which this controller does not build yet")
    return (f"annotation tailscale.com/proxy-group on {what} is not supported: {why}; remove the annotation to "
            "get a proxy of its own (the ProxyGroup serves only egress Services: tailscale.com/tailnet-ip or "
            "tailscale.com/tailnet-fqdn)")


HTTP_ENDPOINT = "tailscale.com/http-endpoint"


def http_endpoint_notice(ingress_http: bool) -> str:
    """`tailscale.com/http-endpoint` on an Ingress of its own proxy: upstream reads it only on ProxyGroup
    Ingresses, so it has no effect here (a Warning event, the Ingress is served)."""
    how = ("this Ingress is served over plain HTTP on port 80 already" if ingress_http else
           "this Ingress is served over HTTPS on port 443 (use tailscale.com/http-redirect for port 80)")
    return (f"annotation {HTTP_ENDPOINT} has no effect: it applies to Ingresses on a ProxyGroup (as upstream), "
            f"which this controller does not build; {how}; remove the annotation")


def static_endpoints_problem() -> str:
    """A ProxyClass's spec.staticEndpoints (upstream: NodePort Services as ProxyGroup replicas' endpoints)."""
    return ("spec.staticEndpoints is not supported by this controller yet: the NodePort Services that would "
            "give ProxyGroup replicas fixed WireGuard endpoints are not built; remove spec.staticEndpoints (the "
            "proxies reach their peers through NAT traversal and DERP, as other devices do)")


#: upstream's nameserver image: it answers only under ts.net
UPSTREAM_NAMESERVER = re.compile(r"(^|/)tailscale/k8s-nameserver$")


def upstream_nameserver_problem(repo: str, domain: str, on_tailscale: bool) -> str:
    """A DNSConfig naming upstream's nameserver image where the tailnet's domain is not under ts.net: `domain`
    when known, else whether the control plane is Tailscale's (whose MagicDNS names are under ts.net)."""
    if not UPSTREAM_NAMESERVER.search(repo.strip()):
        return ""
    if domain and domain.rstrip(".").endswith(".ts.net"):
        return ""
    if not domain and on_tailscale:
        return ""
    where = f"the tailnet's domain {domain!r}" if domain else "this control plane's MagicDNS domain"
    return (f"spec.nameserver.image.repo={repo!r} is upstream's nameserver, which answers only names under "
            f"ts.net, so it would not answer for {where}; remove spec.nameserver.image to run this project's "
            "nameserver (the proxy image), which answers for the tailnet's own domain")
