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
    try:
        ipaddress.ip_address(value.strip())
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
