"""The state Secret contract between the agent and the controller: key names and value formats.

One module below both, so the two sides cannot drift: the agent (``containerboot.kube.secretstate``) writes
these keys in these formats, the controller (``controller.status``) reads them back. Pure, no I/O.
"""
from __future__ import annotations

import ipaddress
import json
from typing import Any, Iterable

from tscommon import jsontext

# Keys written by the agent.
KEY_CAPVER = "tailscale_capver"
KEY_POD_UID = "pod_uid"
KEY_HTTPS_ENDPOINT = "https_endpoint"
KEY_EGRESS_SERVICES = "egress-services"
KEY_INGRESS_CONFIG = "ingress-config.json"
KEY_DEVICE_ID = "device_id"
KEY_DEVICE_FQDN = "device_fqdn"
KEY_DEVICE_IPS = "device_ips"
KEY_REISSUE_AUTHKEY = "reissue_authkey"
# Ours (the operator ignores them): when the agent last asked for a new key, and how many times in a row it has
# asked without a successful login since. They rate-limit the requests across restarts.
KEY_REISSUE_REQUESTED_AT = "reissue_requested_at"
KEY_REISSUE_ATTEMPTS = "reissue_attempts"
# Written by the user or the operator, read (and in AuthOnce mode deleted) by the agent.
KEY_AUTHKEY = "authkey"
# Written by tailscaled's kube state store.
KEY_MACHINE_KEY = "_machinekey"
KEY_PROFILES = "_profiles"
KEY_CURRENT_PROFILE = "_current-profile"
PROFILE_PREFIX = "profile-"

NO_HTTPS = "no-https"


def _bare_ip(a: Any) -> str:
    if isinstance(a, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        return str(a)
    if isinstance(a, (ipaddress.IPv4Network, ipaddress.IPv6Network)):
        return str(a.network_address)
    if isinstance(a, (ipaddress.IPv4Interface, ipaddress.IPv6Interface)):
        return str(a.ip)
    return str(ipaddress.ip_interface(str(a)).ip)


def format_device_ips(ips: Iterable[Any] | None) -> bytes:
    """JSON array of addresses without prefix length, in the given order; null when there are none (as upstream)."""
    out = [_bare_ip(a) for a in (ips or ())]
    return json.dumps(out if out else None, separators=(",", ":")).encode()


def format_device_fqdn(fqdn: str) -> bytes:
    """The MagicDNS name with exactly one trailing dot ("" stays "")."""
    fqdn = fqdn.strip()
    if fqdn and not fqdn.endswith("."):
        fqdn += "."
    return fqdn.encode()


# Keys the controller writes into the same Secret (the proxy's config; upstream's names).
KEY_SERVE_CONFIG = "serve-config"
#: tailscaled config files (`cap-<N>.hujson`): the agent runs the highest N not above its capability version.
CONFIG_CAPVERS = (95, 107)


def config_key(capver: int) -> str:
    return f"cap-{capver}.hujson"


def parse_device_ips(raw: bytes | None) -> tuple[str, ...]:
    """device_ips back to addresses; () for absent, null or malformed (the proxy has not finished yet)."""
    try:
        v = jsontext.loads(raw) if raw else None
    except ValueError:
        return ()
    if not isinstance(v, list):
        return ()
    out = []
    for a in v:
        try:
            out.append(str(ipaddress.ip_address(str(a))))
        except ValueError:
            continue
    return tuple(out)


def parse_device_fqdn(raw: bytes | None) -> str:
    """device_fqdn without its trailing dot ("" when absent)."""
    return (raw or b"").decode(errors="replace").strip().rstrip(".")


def parse_https_endpoint(raw: bytes | None) -> str:
    """https_endpoint as a host name: trailing dot trimmed, "no-https" and absent → ""."""
    v = (raw or b"").decode(errors="replace").strip().rstrip(".")
    return "" if v == NO_HTTPS else v
