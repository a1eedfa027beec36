"""The agent's settings: one table of environment variables that drives parsing, validation and the docs.

`load(env)` turns the environment into a frozen `Settings` value, or raises `SettingsError` with one message that
names the variable(s), the offending value (never a secret's value) and the fix. The steps and their order follow
upstream containerboot (`configFromEnv` then `validate`) so that the first error a user sees is the same one, with
these deliberate differences, each also noted in the table and so in the variable reference (docs/agent.md):

* values upstream silently ignores are errors: a Go bool that is not one of ParseBool's words, a `TS_ACCEPT_DNS`
  that is not, a `TS_DEBUG_FIREWALL_MODE` that no backend knows;
* `TS_DEST_IP` / `TS_TAILNET_TARGET_IP` must be IP literals and each `TS_ROUTES` entry a canonical CIDR (upstream
  finds out in kernel mode only, and reports it as an IP-forwarding failure);
* `TS_EXTRA_ARGS` must be flags, each given once;
* `TS_SERVE_CONFIG` with `TS_DEST_IP` is an error (upstream documents them as incompatible but does not check);
* `POD_IPS=""` means unset (upstream exits);
* a `TS_BOOT_TIMEOUT` that is not positive is an error (it could never be met);
* versioned config file names must match exactly and the file found is the file used.

Value errors (a bad bool, IP, CIDR, flag) are raised while reading, before the cross-variable rules, because those
rules depend on the parsed values. Within each phase, the first failure wins.
"""
from __future__ import annotations

import enum
import ipaddress
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from containerboot import conffile
from tscommon.pgcontract import LOCAL_PORT
from tscommon.redact import redact

__all__ = [
    "CAPABILITY_VERSION",
    "IP",
    "Kind",
    "Setting",
    "SETTINGS",
    "Settings",
    "SettingsError",
    "check_flags",
    "cmp_or",
    "load",
    "parse_accept_dns",
    "parse_addr",
    "parse_addr_port",
    "parse_go_bool",
    "parse_go_duration",
    "parse_prefix",
    "reference_markdown",
]

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Prefix = ipaddress.IPv4Network | ipaddress.IPv6Network

# The capability version of the tailscaled we ship with (v1.102.3). It is used only to choose among the operator's
# cap-<N>.hujson files; callers that know the real value (from `tailscale version --json`) pass it to load().
CAPABILITY_VERSION = 142

DEFAULT_KUBE_API_URL = "https://kubernetes.default.svc"


class SettingsError(Exception):
    """Invalid configuration. str(e) is the whole user-facing message; `variables` names what to fix."""

    def __init__(self, message: str, variables: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.variables = variables


# --------------------------------------------------------------------------------------------------------------
# Parsing primitives. Each mirrors the Go function upstream uses, so that what upstream accepts we accept.

GO_TRUE = ("1", "t", "T", "TRUE", "true", "True")
GO_FALSE = ("0", "f", "F", "FALSE", "false", "False")
_GO_BOOL_WORDS = ", ".join(GO_TRUE + GO_FALSE)


def parse_go_bool(text: str) -> bool:
    """Go's strconv.ParseBool: exactly these twelve words, nothing else (not even surrounding spaces)."""
    if text in GO_TRUE:
        return True
    if text in GO_FALSE:
        return False
    raise ValueError(f"invalid boolean {text!r}")


def cmp_or(*values: str) -> str:
    """Go's cmp.Or for strings: the first non-empty value, so an explicitly empty variable means the default."""
    return next((v for v in values if v), "")


# Nanoseconds per unit; Go accepts both the micro sign (U+00B5) and the Greek mu (U+03BC) for microseconds.
_DURATION_UNITS = {"ns": 1, "us": 1_000, "\u00b5s": 1_000, "\u03bcs": 1_000, "ms": 1_000_000,
                   "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}
_DURATION_NUMBER = re.compile(r"([0-9]*)(?:\.([0-9]*))?")
_DURATION_UNIT = re.compile(r"[^0-9.]*")


def parse_go_duration(text: str) -> float:
    """Go's time.ParseDuration, returning seconds. A bare number other than 0 has no unit and is rejected."""
    s, negative = text, False
    if s[:1] in ("+", "-"):
        negative, s = s[0] == "-", s[1:]
    if s == "0":
        return 0.0
    if not s:
        raise ValueError(f"invalid duration {text!r}")
    # Exact arithmetic in integers: the total is `num / scale` nanoseconds, `scale` the largest power of ten a
    # fraction needed so far (fractions.Fraction would do the same but loads the decimal module, about 1 MB).
    num, scale = 0, 1
    while s:
        m = _DURATION_NUMBER.match(s)
        assert m is not None   # the pattern matches the empty string
        whole, frac = m.group(1), m.group(2) or ""
        if not whole and not frac:  # "." or a unit with no number before it
            raise ValueError(f"invalid duration {text!r}")
        s = s[m.end():]
        u = _DURATION_UNIT.match(s)
        assert u is not None   # as above
        unit = u.group(0)
        if not unit:
            raise ValueError(f"missing unit in duration {text!r}")
        if unit not in _DURATION_UNITS:
            raise ValueError(f"unknown unit {unit!r} in duration {text!r}")
        s = s[len(unit):]
        f_scale = 10 ** len(frac)
        value = (int(whole or "0") * f_scale + (int(frac) if frac else 0)) * _DURATION_UNITS[unit]
        if f_scale > scale:
            num, scale = num * (f_scale // scale), f_scale
        num += value * (scale // f_scale)
    nanoseconds = num // scale  # Go truncates sub-nanosecond fractions
    if nanoseconds > 2**63 - (0 if negative else 1):
        raise ValueError(f"invalid duration {text!r}: out of range")
    return (-nanoseconds if negative else nanoseconds) / 1e9


def parse_addr(text: str) -> IP:
    """Go's netip.ParseAddr: a strict IPv4 or IPv6 literal (zone allowed on IPv6), no names, no spaces."""
    if not text or not text.isascii() or any(c.isspace() for c in text):
        raise ValueError(f"{text!r} is not an IP address")
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address") from None


_PORT = re.compile(r"[0-9]+")


def parse_addr_port(text: str) -> tuple[IP, int]:
    """Go's netip.ParseAddrPort: `IPv4:port` or `[IPv6]:port`, literal addresses only."""
    i = text.rfind(":")
    if i < 0:
        raise ValueError(f"{text!r} has no port")
    host, port = text[:i], text[i + 1:]
    if not host:
        raise ValueError(f"{text!r} has no IP address")
    if not port:
        raise ValueError(f"{text!r} has no port")
    bracketed = host.startswith("[")
    if bracketed:
        if len(host) < 2 or not host.endswith("]"):
            raise ValueError(f"{text!r} is missing a ']'")
        host = host[1:-1]
    addr = parse_addr(host)
    if not _PORT.fullmatch(port) or int(port) > 65535:
        raise ValueError(f"{text!r} has an invalid port {port!r}")
    if bracketed and addr.version == 4:
        raise ValueError(f"{text!r}: square brackets are only for IPv6 addresses")
    if not bracketed and addr.version == 6:
        raise ValueError(f"{text!r}: an IPv6 address must be in square brackets, e.g. [{host}]:{port}")
    return addr, int(port)


_PREFIX_BITS = re.compile(r"0|[1-9][0-9]{0,2}")


def parse_prefix(text: str) -> Prefix:
    """A CIDR as `tailscale up --advertise-routes` takes it: `address/bits`, with no bits set past the mask."""
    addr_text, slash, bits_text = text.rpartition("/")
    if not slash:
        raise ValueError(f"{text!r} is not a CIDR (no /bits)")
    if "%" in addr_text:
        raise ValueError(f"{text!r}: a CIDR cannot have an IPv6 zone")
    addr = parse_addr(addr_text)
    limit = 32 if addr.version == 4 else 128
    if not _PREFIX_BITS.fullmatch(bits_text) or int(bits_text) > limit:
        raise ValueError(f"{text!r} has invalid prefix length {bits_text!r} (0 to {limit})")
    network = ipaddress.ip_network(f"{addr}/{bits_text}", strict=False)
    if network.network_address != addr:
        raise ValueError(f"{text!r} has bits set past the prefix length (did you mean {network}?)")
    return network


# Flags of `tailscale up` whose value is a secret: never shown in a message.
_SECRET_FLAGS = frozenset({"authkey", "auth-key", "client-secret", "id-token"})
_FLAG = re.compile(r"--?([^-=][^=]*)(=.*)?", re.DOTALL)


def check_flags(tokens: tuple[str, ...]) -> None:
    """Check that tokens are flags for a Go flag set, each given once. Raises ValueError naming the problem.

    A token that is not a flag is allowed only as the value of the flag just before it (`--hostname foo`);
    `tailscale up` takes no positional arguments, so any other bare word is a mistake. Only flag names are
    quoted in errors, never values, because the values may be secrets.
    """
    seen: set[str] = set()
    previous: str | None = None  # a flag without "=", which may take the next token as its value
    for token in tokens:
        m = _FLAG.fullmatch(token)
        if m is None:
            if previous is None:
                raise ValueError(f"{token!r} is not a flag: flags start with '-' and tailscale up takes no "
                                 "other arguments")
            if previous == "accept-dns" and token in GO_TRUE + GO_FALSE:
                # A Go bool flag never takes the next word as its value: "--accept-dns false" means true.
                raise ValueError(f"'--accept-dns {token}' does not do what it looks like: write "
                                 f"--accept-dns={token}")
            previous = None
            continue
        name = m.group(1)
        if name in seen:
            raise ValueError(f"flag --{name} is given twice: give it once")
        seen.add(name)
        previous = name if m.group(2) is None else None


def _flag_name(token: str) -> str | None:
    m = _FLAG.fullmatch(token)
    return m.group(1) if m else None


def parse_accept_dns(extra_args: str, accept_dns: bool) -> tuple[str, bool]:
    """Pull the first `--accept-dns[=value]` flag out of TS_EXTRA_ARGS (spec 1.4).

    Returns the remaining args and the accept-dns value. If there is no such flag, both come back unchanged.
    Unlike upstream, the flag must be exactly `accept-dns` (one or two dashes; upstream also takes
    `--accept-dns-foo=true` as accept-dns, and misses `-accept-dns`), and a value that is not a Go bool raises
    ValueError instead of being left for `tailscale up` to reject.
    """
    if "accept-dns" not in extra_args:
        return extra_args, accept_dns
    tokens = extra_args.split()
    for i, token in enumerate(tokens):
        if _flag_name(token) != "accept-dns":
            continue
        _, eq, value = token.partition("=")
        if not eq:
            value = "true"  # a bare bool flag means true
        try:
            parsed = parse_go_bool(value)
        except ValueError:
            raise ValueError(f"--accept-dns={value!r} is not a boolean") from None
        return " ".join(tokens[:i] + tokens[i + 1:]), parsed
    return extra_args, accept_dns


# --------------------------------------------------------------------------------------------------------------
# The table.


class Kind(enum.Enum):
    """How a variable's text is read. The value is the type as the reference shows it."""

    STRING = "string"
    PATH = "path"
    BOOL = "bool"
    TRIBOOL = "bool or unset"
    ROUTES = "CIDR list, or unset"
    IP = "IP address"
    DEST_IPS = "IP address, or one IPv4 and one IPv6 address"
    ADDRPORT = "IP:port"
    DURATION = "Go duration"
    IP_LIST = "IP list"
    ARGS = "flags"
    CHOICE = "choice"
    IGNORED = "ignored"


@dataclass(frozen=True)
class Setting:
    """One environment variable.

    `default` is the text the variable falls back to when it is unset or empty (parsed like a user value).
    `field` is the `Settings` field the parsed value goes to, None when a derivation in `load` consumes it.
    `differs` says where we deliberately behave differently from upstream containerboot.
    """

    name: str
    kind: Kind
    help: str
    field: str | None = None
    default: str = ""
    default_doc: str = ""  # the reference's default column, when the default is not a plain value
    secret: bool = False
    deprecated: bool = False
    choices: tuple[str, ...] = ()
    differs: str = ""


_STRICT_BOOL = ("A value other than ParseBool's words (1, t, true, 0, f, false ...) is an error; upstream uses the "
                "default.")

_OURS_TLS = "Ours (upstream has no such variable): HTTPS with a certificate of your own, docs/https.md."

SETTINGS: tuple[Setting, ...] = (
    # Login.
    Setting("TS_AUTHKEY", Kind.STRING, "Auth key for `tailscale up --authkey`. The CLI resolves a `file:<path>` value.",
            "authkey", secret=True),
    Setting("TS_AUTH_KEY", Kind.STRING, "Deprecated alias of TS_AUTHKEY, used only when TS_AUTHKEY is empty.",
            secret=True, deprecated=True),
    Setting("TS_CLIENT_ID", Kind.STRING, "OAuth or workload identity client ID (`--client-id`). May be used alone.",
            "client_id"),
    Setting("TS_CLIENT_SECRET", Kind.STRING, "OAuth client secret (`--client-secret`).", "client_secret", secret=True),
    Setting("TS_ID_TOKEN", Kind.STRING, "Workload identity ID token (`--id-token`); needs TS_CLIENT_ID.", "id_token",
            secret=True),
    Setting("TS_AUDIENCE", Kind.STRING, "Workload identity audience (`--audience`); needs TS_CLIENT_ID.", "audience"),
    Setting("TS_HOSTNAME", Kind.STRING, "Tailscale host name (`--hostname`).", "hostname"),
    Setting("TS_ROUTES", Kind.ROUTES,
            "Subnet routes to advertise, comma separated (`--advertise-routes`). Set but empty withdraws all routes.",
            "routes", default_doc="unset",
            differs="Each entry must be a CIDR with no host bits, checked at start in every mode; upstream checks "
                    "only in kernel mode and reports it as an IP-forwarding failure."),
    # Proxy targets.
    Setting("TS_DEST_IP", Kind.DEST_IPS, "Ingress: forward all tailnet traffic to this IP (kernel networking "
            "only). For a dual-stack Service give both ClusterIPs, comma separated: tailnet IPv4 traffic goes to "
            "the IPv4 address and tailnet IPv6 traffic to the IPv6 address.",
            "dest_ips", differs="Must be IP literals, checked at start; one address of each family may be given "
                                "(upstream takes one address, so a dual-stack Service is reachable over one "
                                "family only)."),
    Setting("TS_EXPERIMENTAL_DEST_DNS_NAME", Kind.STRING,
            "Ingress: like TS_DEST_IP, but to the addresses of this DNS name, re-resolved periodically.",
            "dest_dns_name",
            differs="Enables both IPv4 and IPv6 forwarding at start; upstream enables none until it resolves."),
    Setting("TS_TAILNET_TARGET_IP", Kind.IP, "Egress: forward all non-tailnet traffic to this tailnet IP.",
            "tailnet_target_ip", differs="Must be an IP literal; upstream finds out only when setting up forwarding."),
    Setting("TS_TAILNET_TARGET_FQDN", Kind.STRING,
            "Egress: like TS_TAILNET_TARGET_IP, but to the node, Service or 4via6 name resolved from the netmap.",
            "tailnet_target_fqdn",
            differs="Enables IPv6 forwarding as well as IPv4, because we proxy IPv6 targets; upstream only IPv4."),
    # Process arguments.
    Setting("TS_TAILSCALED_EXTRA_ARGS", Kind.ARGS, "Extra tailscaled flags, separated by spaces.",
            "tailscaled_extra_args"),
    Setting("TS_EXTRA_ARGS", Kind.ARGS,
            "Extra `tailscale up` flags, separated by spaces. An `--accept-dns` flag here is taken out and "
            "overrides TS_ACCEPT_DNS.", "extra_args",
            differs="Re-applied with `tailscale set` on every boot when TS_AUTH_ONCE=true (upstream drops them "
                    "after the first login); flags only `tailscale up` takes are logged as not re-applied. "
                    "Every word must be a flag or a flag's value, and no flag may be given twice; "
                    "`-accept-dns` counts as `--accept-dns`, `--accept-dns-foo=...` does not, and a non-bool "
                    "`--accept-dns=` value is an error."),
    Setting("TS_USERSPACE", Kind.BOOL, "Userspace networking; false uses a kernel TUN device (needs NET_ADMIN).",
            "userspace", default="true", differs=_STRICT_BOOL),
    Setting("TS_STATE_DIR", Kind.PATH, "tailscaled's `--statedir`.", "state_dir"),
    Setting("TS_ACCEPT_DNS", Kind.TRIBOOL, "Use the tailnet's DNS settings (`--accept-dns`). Unset means false.",
            "accept_dns", default_doc="unset",
            differs="A non-empty value other than ParseBool's words is an error; upstream treats it as unset."),
    Setting("TS_KUBE_SECRET", Kind.STRING,
            "Kubernetes Secret holding tailscaled's state. Set to empty in Kubernetes to keep state elsewhere.",
            default_doc="`tailscale` in Kubernetes, empty otherwise"),
    Setting("TS_SOCKS5_SERVER", Kind.STRING, "tailscaled's `--socks5-server` address.", "socks5_server"),
    Setting("TS_OUTBOUND_HTTP_PROXY_LISTEN", Kind.STRING, "tailscaled's `--outbound-http-proxy-listen` address.",
            "outbound_http_proxy_listen"),
    Setting("TS_SOCKET", Kind.PATH, "tailscaled's LocalAPI socket.", "socket", default="/tmp/tailscaled.sock"),
    Setting("TS_AUTH_ONCE", Kind.BOOL,
            "Run `tailscale up` only when a login is needed, and `tailscale set` otherwise.", "auth_once",
            default="false", differs=_STRICT_BOOL),
    Setting("TS_SERVE_CONFIG", Kind.PATH, "Serve config JSON file, watched and applied.", "serve_config",
            differs="An error together with TS_DEST_IP (upstream documents them as incompatible but runs both)."),
    Setting("TS_TLS_CERT_SECRET", Kind.STRING,
            "HTTPS with your own certificate (ours, not upstream's): `<namespace>/<name>` of a `kubernetes.io/tls` "
            "Secret, read through the API server every 20 s and served by the agent's TLS listener "
            "(TS_TLS_LISTEN); the serve config forwards TCP port 443 there. Needs TS_SERVE_CONFIG and "
            "userspace networking.", "tls_cert_secret", differs=_OURS_TLS),
    Setting("TS_TLS_CERT_DIR", Kind.PATH,
            "As TS_TLS_CERT_SECRET, from `tls.crt` and `tls.key` in a directory (a mounted Secret volume).",
            "tls_cert_dir", differs=_OURS_TLS),
    Setting("TS_TLS_LISTEN", Kind.ADDRPORT, "The TLS listener's local address: the serve config's TCPForward "
            "target for port 443.", "tls_listen", default="127.0.0.1:10443", differs=_OURS_TLS),
    Setting("TS_TLS_UPSTREAM_PORT", Kind.STRING, "The serve config's plain-HTTP port that decrypted "
            "connections go to, on the node's own tailnet address (through tailscaled).", "tls_upstream_port",
            default="10080", differs=_OURS_TLS),
    Setting("TS_TLS_BACKEND", Kind.ADDRPORT, "Decrypted connections go straight to this `IP:port` (one plain-HTTP "
            "backend for every path) instead of through tailscaled to TS_TLS_UPSTREAM_PORT: the faster path, "
            "docs/https.md.", "tls_backend", differs=_OURS_TLS),
    Setting("TS_TLS_HOSTS", Kind.STRING, "Host names clients use besides the node's MagicDNS name (comma "
            "separated, e.g. an Ingress's spec.tls[].hosts): the certificate must cover one of them.",
            "tls_hosts", differs=_OURS_TLS),
    Setting("TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR", Kind.PATH,
            "Directory of `cap-<N>.hujson` tailscaled config files; the newest this tailscaled supports is used, "
            "and replaces `tailscale up` (one-step mode).", "versioned_config_dir",
            differs="File names must match `cap-<N>.hujson` (or `tailscaled`) exactly, and the file found is the "
                    "file used; upstream accepts `cap-95.hujson.bak` and turns `cap-095.hujson` into a missing "
                    "`cap-95.hujson`. The file's unknown fields are rejected at the top level and in "
                    "`AppConnector`/`AutoUpdate`; the nested serve config is left to tailscaled."),
    Setting("TS_HEALTHCHECK_ADDR_PORT", Kind.ADDRPORT,
            "Deprecated: a separate listener for `/healthz` only. Use TS_ENABLE_HEALTH_CHECK.",
            "healthcheck_addr_port", deprecated=True),
    Setting("TS_LOCAL_ADDR_PORT", Kind.ADDRPORT,
            "Listener for /metrics, /healthz and the egress pre-shutdown hook. An IPv6 POD_IPS address in it is "
            "bracketed for you.", "local_addr_port", default=f"[::]:{LOCAL_PORT}"),
    Setting("TS_ENABLE_METRICS", Kind.BOOL, "Serve `/metrics` on TS_LOCAL_ADDR_PORT.", "enable_metrics",
            default="false", differs=_STRICT_BOOL),
    Setting("TS_ENABLE_HEALTH_CHECK", Kind.BOOL, "Serve `/healthz` on TS_LOCAL_ADDR_PORT.", "enable_health_check",
            default="false", differs=_STRICT_BOOL),
    Setting("TS_DEBUG_ADDR_PORT", Kind.ADDRPORT, "tailscaled's `--debug` listener, proxied under `/debug/`.",
            "debug_addr_port"),
    Setting("TS_EGRESS_PROXIES_CONFIG_PATH", Kind.PATH,
            "ProxyGroup egress services: directory with the operator's `egress-services` and `hep-pings` files; "
            "watched, status in the Secret key `egress-services`, preStop hook on TS_LOCAL_ADDR_PORT (Kubernetes "
            "with a state Secret only). Rules need kernel networking.",
            "egress_proxies_config_path",
            differs="With TS_USERSPACE=true the agent starts, as upstream does, but installs no rules and records no "
                    "service (there is no tailscale0 to forward through; upstream programs rules that cannot carry "
                    "traffic)."),
    Setting("TS_INGRESS_PROXIES_CONFIG_PATH", Kind.PATH,
            "ProxyGroup ingress services: file mapping Tailscale Service VIPs to ClusterIPs; watched, status in the "
            "Secret key `ingress-config.json` (Kubernetes with a state Secret only). Rules need kernel networking.",
            "ingress_proxies_config_path",
            differs="With TS_USERSPACE=true the agent starts, as upstream does, but installs no rules and records no "
                    "service."),
    Setting("TS_EXPERIMENTAL_ENABLE_FORWARDING_OPTIMIZATIONS", Kind.BOOL,
            "Turn on UDP GRO forwarding at start (kernel networking only).", "forwarding_optimizations",
            default="false", differs=_STRICT_BOOL),
    Setting("EXPERIMENTAL_ALLOW_PROXYING_CLUSTER_TRAFFIC_VIA_INGRESS", Kind.BOOL,
            "L7 ingress: also forward cluster traffic for POD_IP to the tailnet address (needs TS_SERVE_CONFIG, "
            "POD_IP, kernel networking).", "allow_proxying_cluster_traffic_via_ingress", default="false",
            differs=_STRICT_BOOL),
    Setting("TS_EXPERIMENTAL_SERVICE_AUTO_ADVERTISEMENT", Kind.BOOL,
            "Advertise the Tailscale Services found in the serve config.", "service_auto_advertisement",
            default="true", differs=_STRICT_BOOL),
    Setting("TS_EXPERIMENTAL_CERT_SHARE", Kind.BOOL,
            "Share TLS certs between replicas: read-write in the Pod whose POD_NAME ends with `-0`, read-only in "
            "the others (passed to tailscaled as TS_CERT_SHARE_MODE).", default="false", differs=_STRICT_BOOL),
    Setting("TS_BOOT_TIMEOUT", Kind.DURATION, "Deadline for the whole boot phase, e.g. `90s` or `3m`.",
            default="60s", differs="Must be positive; upstream accepts zero or negative values that can never be met."),
    # The Pod, from the downward API.
    Setting("POD_IP", Kind.STRING, "Deprecated: the Pod's IP. Still needed by "
            "EXPERIMENTAL_ALLOW_PROXYING_CLUSTER_TRAFFIC_VIA_INGRESS.", "pod_ip", deprecated=True),
    Setting("POD_IPS", Kind.IP_LIST, "The Pod's IPs, comma separated, at most one per family.", default_doc="unset",
            differs="Empty means unset; upstream exits with an error."),
    Setting("POD_UID", Kind.STRING, "The Pod's UID, written to the state Secret as `pod_uid`.", "pod_uid"),
    Setting("POD_NAME", Kind.STRING, "The Pod's name; decides the cert share mode.", "pod_name"),
    # Kubernetes.
    Setting("KUBERNETES_SERVICE_HOST", Kind.STRING, "Set by Kubernetes; non-empty means we run in Kubernetes."),
    Setting("KUBERNETES_SERVICE_PORT_HTTPS", Kind.STRING,
            "Set by Kubernetes; the API server port when its address is read from the environment."),
    Setting("TS_KUBERNETES_READ_API_SERVER_ADDRESS_FROM_ENV", Kind.BOOL,
            "Reach the API server at KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT_HTTPS instead of "
            "kubernetes.default.svc.", default="false",
            differs="A Go bool (upstream: only the exact text `true`, anything else silently false); an IPv6 "
                    "host is bracketed in the URL (upstream builds a broken URL)."),
    # Tests and debugging.
    Setting("TS_TEST_ONLY_ROOT", Kind.PATH,
            "Tests only: file system root for /dev/net/tun, /proc/sys and the service account files; other than "
            "`/` also reads the API server address from the environment.", "root", default="/"),
    Setting("TS_TEST_FAKE_NETFILTER", Kind.BOOL, "Tests only: use an in-memory firewall. No firewall tool runs "
            "and no netlink call is made; the rules show in `containerboot rules` and `/status`.",
            "test_fake_netfilter",
            default="false", differs=_STRICT_BOOL),
    Setting("TS_TEST_FAKE_NETFILTER_6", Kind.BOOL, "Tests only: whether the in-memory firewall has IPv6.",
            "test_fake_netfilter_6", default="true", differs=_STRICT_BOOL),
    Setting("TS_DEBUG_FIREWALL_MODE", Kind.CHOICE,
            "Firewall backend; empty or `auto` detects (iptables unless only nftables is usable). tailscaled reads "
            "it too.", "firewall_mode", choices=("", "auto", "iptables", "nftables"),
            differs="Any other value is an error; upstream falls back to detection."),
    # Set by the operator, read by neither upstream nor us; listed so nobody wonders.
    Setting("TS_STATE", Kind.IGNORED, "Set by some operator versions; ignored (tailscaled inherits it)."),
    Setting("TS_EGRESS_SERVICES_CONFIG_PATH", Kind.IGNORED,
            "Deprecated name of TS_EGRESS_PROXIES_CONFIG_PATH; ignored, as upstream does.", deprecated=True),
    Setting("PORT", Kind.IGNORED, "Set by the operator; ignored."),
)

_BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}


# --------------------------------------------------------------------------------------------------------------
# Upstream's words.

#: For each invalid configuration that upstream refuses too, upstream's sentence for it, word for word as
#: upstream v1.102.3 writes it (cmd/containerboot/settings.go and main.go of that release). Every message for
#: that condition CONTAINS these words, so that runbooks and log alerts written against upstream's messages
#: still match; ours adds the value, the reason and the fix around them. `{placeholders}` are filled from the
#: configuration (`"{value}"` is Go's %q of a plain value; `{ips}` is Go's %v of a list of strings). Where
#: upstream appends a Go error after a colon (a parse error's own text), the table stops before it: our
#: parser's explanation takes its place.
UPSTREAM_WORDS: Mapping[str, str] = {
    "pod_ips_too_many": "POD_IPs can contain at most 2 IPs, got {count} ({ips})",
    "pod_ips_bad_ip": "error parsing IP address {ip}",
    "config_file_none": 'no tailscaled config file found in "{dir}" for current capability version {capver}',
    "config_dir_unreadable": 'error reading tailscaled config directory "{dir}"',
    "config_file_contents": "error validating tailscaled configfile contents",
    "dest_ip_userspace": "TS_DEST_IP is not supported with TS_USERSPACE",
    "dest_dns_name_userspace": "TS_EXPERIMENTAL_DEST_DNS_NAME is not supported with TS_USERSPACE",
    "dest_dns_name_and_dest_ip": "TS_EXPERIMENTAL_DEST_DNS_NAME and TS_DEST_IP cannot both be set",
    "tailnet_target_ip_userspace": "TS_TAILNET_TARGET_IP is not supported with TS_USERSPACE",
    "tailnet_target_fqdn_userspace": "TS_TAILNET_TARGET_FQDN is not supported with TS_USERSPACE",
    "tailnet_target_ip_and_fqdn": "Both TS_TAILNET_TARGET_IP and TS_TAILNET_FQDN cannot be set",
    "config_dir_combination": "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR cannot be set in combination with TS_HOSTNAME, "
                              "TS_EXTRA_ARGS, TS_AUTHKEY, TS_ROUTES, TS_ACCEPT_DNS, TS_CLIENT_ID, TS_CLIENT_SECRET, "
                              "TS_ID_TOKEN, TS_AUDIENCE.",
    "id_token_without_client_id": "TS_ID_TOKEN is set but TS_CLIENT_ID is not set",
    "audience_without_client_id": "TS_AUDIENCE is set but TS_CLIENT_ID is not set",
    "id_token_and_client_secret": "TS_ID_TOKEN and TS_CLIENT_SECRET cannot both be set",
    "id_token_and_audience": "TS_ID_TOKEN and TS_AUDIENCE cannot both be set",
    "audience_and_client_secret": "TS_AUDIENCE and TS_CLIENT_SECRET cannot both be set",
    "authkey_and_oauth": "TS_AUTHKEY cannot be used with TS_CLIENT_ID, TS_CLIENT_SECRET, TS_ID_TOKEN, or "
                         "TS_AUDIENCE.",
    "allow_proxying_userspace": "EXPERIMENTAL_ALLOW_PROXYING_CLUSTER_TRAFFIC_VIA_INGRESS is not supported in "
                                "userspace mode",
    "allow_proxying_without_serve": "EXPERIMENTAL_ALLOW_PROXYING_CLUSTER_TRAFFIC_VIA_INGRESS is set but this is "
                                    "not a cluster ingress proxy",
    "allow_proxying_without_pod_ip": "EXPERIMENTAL_ALLOW_PROXYING_CLUSTER_TRAFFIC_VIA_INGRESS is set but POD_IP "
                                     "is not set",
    "forwarding_optimizations_userspace": "TS_EXPERIMENTAL_ENABLE_FORWARDING_OPTIMIZATIONS is not supported in "
                                          "userspace mode",
    "healthcheck_addr_port": 'error parsing TS_HEALTHCHECK_ADDR_PORT value "{value}"',
    "local_addr_port": 'error parsing TS_LOCAL_ADDR_PORT value "{value}"',
    "debug_addr_port": 'error parsing TS_DEBUG_ADDR_PORT value "{value}"',
    "healthcheck_and_health_check": "TS_HEALTHCHECK_ADDR_PORT is deprecated and will be removed in 1.82.0, use "
                                    "TS_ENABLE_HEALTH_CHECK and optionally TS_LOCAL_ADDR_PORT",
    "egress_outside_kubernetes": "TS_EGRESS_PROXIES_CONFIG_PATH is only supported for Tailscale running on "
                                 "Kubernetes",
    "ingress_outside_kubernetes": "TS_INGRESS_PROXIES_CONFIG_PATH is only supported for Tailscale running on "
                                  "Kubernetes",
    "boot_timeout": 'error parsing TS_BOOT_TIMEOUT value "{value}"',
}
# Ours (no upstream counterpart): the same sentence shape for our own listeners.
_OWN_WORDS: Mapping[str, str] = {"tls_listen": 'error parsing TS_TLS_LISTEN value "{value}"',
                                 "tls_backend": 'error parsing TS_TLS_BACKEND value "{value}"'}


def _upstream(condition: str, **values: Any) -> str:
    """Upstream's words for `condition`, filled in."""
    return {**UPSTREAM_WORDS, **_OWN_WORDS}[condition].format(**values)


# --------------------------------------------------------------------------------------------------------------
# The parsed result.


@dataclass(frozen=True)
class Settings:
    """Every variable parsed, plus the values derived from them. Secret fields stay out of the repr."""

    authkey: str = field(default="", repr=False)
    client_id: str = ""
    client_secret: str = field(default="", repr=False)
    id_token: str = field(default="", repr=False)
    audience: str = ""
    hostname: str = ""
    routes: str | None = None
    dest_ips: tuple[IP, ...] = ()
    dest_dns_name: str = ""
    tailnet_target_ip: IP | None = None
    tailnet_target_fqdn: str = ""
    tailscaled_extra_args: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()  # without the --accept-dns flag, which is folded into accept_dns
    userspace: bool = True
    state_dir: str = ""
    accept_dns: bool | None = None
    kube_secret: str = ""
    socks5_server: str = ""
    outbound_http_proxy_listen: str = ""
    socket: str = "/tmp/tailscaled.sock"
    auth_once: bool = False
    serve_config: str = ""
    tls_cert_secret: str = ""
    tls_cert_dir: str = ""
    tls_listen: str = "127.0.0.1:10443"
    tls_upstream_port: str = "10080"
    tls_backend: str = ""
    tls_hosts: str = ""
    versioned_config_dir: str = ""
    tailscaled_config_path: str = ""
    healthcheck_addr_port: str = ""
    local_addr_port: str = f"[::]:{LOCAL_PORT}"
    enable_metrics: bool = False
    enable_health_check: bool = False
    debug_addr_port: str = ""
    egress_proxies_config_path: str = ""
    ingress_proxies_config_path: str = ""
    forwarding_optimizations: bool = False
    allow_proxying_cluster_traffic_via_ingress: bool = False
    service_auto_advertisement: bool = True
    cert_share_mode: str = ""  # "", "ro" or "rw"
    boot_timeout: float = 60.0  # seconds
    pod_ip: str = ""
    pod_ipv4: IP | None = None
    pod_ipv6: IP | None = None
    pod_uid: str = ""
    pod_name: str = ""
    in_kubernetes: bool = False
    firewall_mode: str = ""
    root: str = "/"
    kube_api_url: str = DEFAULT_KUBE_API_URL
    test_fake_netfilter: bool = False
    test_fake_netfilter_6: bool = True
    # Things worth logging once at start (deprecations, overrides, the config file chosen). Never secrets.
    notices: tuple[str, ...] = ()

    @property
    def one_step(self) -> bool:
        """tailscaled runs with --config; there is never a `tailscale up` or `set`."""
        return self.tailscaled_config_path != ""

    @property
    def always_auth(self) -> bool:
        """`tailscale up` on every start."""
        return not self.one_step and not self.auth_once

    @property
    def auth_once_mode(self) -> bool:
        """`tailscale up` only when a login is needed, `tailscale set` otherwise."""
        return not self.one_step and self.auth_once

    @property
    def dest_ip(self) -> IP | None:
        """The first TS_DEST_IP address (upstream's single target)."""
        return self.dest_ips[0] if self.dest_ips else None

    @property
    def is_l3_proxy(self) -> bool:
        """Whether the agent installs firewall rules."""
        return bool(self.dest_ip or self.dest_dns_name or self.tailnet_target_ip or self.tailnet_target_fqdn
                    or self.allow_proxying_cluster_traffic_via_ingress or self.egress_proxies_config_path
                    or self.ingress_proxies_config_path)

    @property
    def route_prefixes(self) -> tuple[Prefix, ...]:
        """TS_ROUTES as networks (load() has checked every entry)."""
        return tuple(parse_prefix(r) for r in self.routes.split(",")) if self.routes else ()

    @property
    def forwarding_families(self) -> tuple[bool, bool]:
        """(IPv4, IPv6) forwarding needed at start. Unlike upstream, a tailnet FQDN target needs both families
        (we proxy IPv6 targets too), and so does a DNS-name destination (its addresses are not known yet)."""
        if self.userspace:
            return False, False
        v4 = v6 = False
        for ip in (*self.dest_ips, self.tailnet_target_ip):
            if ip is not None:
                v4, v6 = v4 or ip.version == 4, v6 or ip.version == 6
        if self.tailnet_target_fqdn or self.dest_dns_name:
            v4 = v6 = True
        for prefix in self.route_prefixes:
            v4, v6 = v4 or prefix.version == 4, v6 or prefix.version == 6
        if self.advertises_exit_node:
            v4 = v6 = True  # an exit node forwards everything, in both families
        return v4, v6

    @property
    def advertises_exit_node(self) -> bool:
        """TS_EXTRA_ARGS carries --advertise-exit-node (not =false)."""
        for arg in self.extra_args:
            name, _, value = arg.lstrip("-").partition("=")
            if name == "advertise-exit-node" and value.lower() not in ("false", "0", "f"):
                return True
        return False

    @property
    def local_server_enabled(self) -> bool:
        """Whether anything is served on TS_LOCAL_ADDR_PORT."""
        return self.enable_metrics or self.enable_health_check or self.egress_proxies_config_path != ""

    @property
    def has_kube_secret(self) -> bool:
        """Running in Kubernetes with a state Secret (whether we may patch it is found out at boot)."""
        return self.in_kubernetes and self.kube_secret != ""


# --------------------------------------------------------------------------------------------------------------
# Loading.


def _quote(value: str) -> str:
    return '"' + value + '"'


def _shown(name: str, env: Mapping[str, str]) -> str:
    """How a message shows a variable: its value, or "(set)" for secrets."""
    setting = _BY_NAME.get(name)
    if setting is not None and setting.secret:
        return f"{name} (set)"
    return f"{name}={_quote(env.get(name, ''))}"


def _shown_all(env: Mapping[str, str], *names: str) -> str:
    return ", ".join(_shown(n, env) for n in names)


def _fail(message: str, *names: str) -> SettingsError:
    return SettingsError(message, names)


def _read(setting: Setting, env: Mapping[str, str]) -> Any:
    """A variable's value as its kind reads it. Raises SettingsError for a value upstream would ignore."""
    raw = env.get(setting.name)
    kind, name = setting.kind, setting.name
    if kind in (Kind.STRING, Kind.PATH, Kind.ADDRPORT, Kind.DURATION):
        return cmp_or(raw or "", setting.default)  # address and duration syntax is checked in upstream's order
    if kind == Kind.BOOL:
        text = cmp_or(raw or "", setting.default)
        try:
            return parse_go_bool(text)
        except ValueError:
            raise _fail(f"{name}={_quote(text)} is not a boolean: use one of {_GO_BOOL_WORDS}, or leave it "
                        f"empty for the default ({setting.default})", name) from None
    if kind == Kind.TRIBOOL:
        if not raw:
            return None
        try:
            return parse_go_bool(raw)
        except ValueError:
            raise _fail(f"{name}={_quote(raw)} is not a boolean: use one of {_GO_BOOL_WORDS}, or leave it unset",
                        name) from None
    if kind == Kind.ROUTES:
        if raw is None or raw == "":
            return raw  # unset: leave routes alone; empty: withdraw them all
        for entry in raw.split(","):
            try:
                parse_prefix(entry)
            except ValueError as e:
                raise _fail(f"{name}={_quote(raw)}: entry {e}; give comma-separated CIDRs without spaces, "
                            "e.g. 10.0.0.0/24,fd00::/64, or set it empty to advertise no routes", name) from None
        return raw
    if kind == Kind.IP:
        if not raw:
            return None
        try:
            return parse_addr(raw)
        except ValueError:
            raise _fail(f"{name}={_quote(raw)} is not an IP address: give a literal IPv4 or IPv6 address "
                        "(for a DNS name use TS_EXPERIMENTAL_DEST_DNS_NAME or TS_TAILNET_TARGET_FQDN)",
                        name) from None
    if kind == Kind.DEST_IPS:
        if not raw:
            return ()
        entries = raw.split(",")
        ips = []
        for entry in entries:
            try:
                ips.append(parse_addr(entry))
            except ValueError:
                raise _fail(f"{name}={_quote(raw)}: {_quote(entry)} is not an IP address: give a literal "
                            "IPv4 or IPv6 address, or one of each separated by a comma (for a DNS name use "
                            "TS_EXPERIMENTAL_DEST_DNS_NAME)", name) from None
        if len(ips) > 2 or (len(ips) == 2 and ips[0].version == ips[1].version):
            raise _fail(f"{name}={_quote(raw)}: give one address, or one IPv4 and one IPv6 address (the targets "
                        "of the proxy's tailnet IPv4 and IPv6 addresses)", name)
        return tuple(ips)
    if kind == Kind.ARGS:
        return tuple((raw or "").split())
    if kind == Kind.CHOICE:
        value = raw or ""
        if value not in setting.choices:
            allowed = ", ".join(c for c in setting.choices if c)
            raise _fail(f"{name}={_quote(value)} is not a known value: use one of {allowed}, or leave it empty",
                        name)
        return value
    return raw  # IP_LIST and IGNORED: consumed by a derivation, or by nobody


def _pod_ips(env: Mapping[str, str]) -> tuple[IP | None, IP | None, str]:
    """(IPv4, IPv6, the IPv6 entry as written) from POD_IPS. Empty is unset, unlike upstream."""
    raw = env.get("POD_IPS", "")
    if not raw:
        return None, None, ""
    entries = raw.split(",")
    if len(entries) > 2:
        words = _upstream("pod_ips_too_many", count=len(entries), ips="[" + " ".join(entries) + "]")
        raise _fail(f"{words}: POD_IPS={_quote(raw)} holds one IPv4 and one IPv6 address at most; set it from "
                    "the Pod's status.podIPs", "POD_IPS")
    v4 = v6 = None
    v6_text = ""
    for entry in entries:
        try:
            ip = parse_addr(entry)
        except ValueError:
            raise _fail(f"{_upstream('pod_ips_bad_ip', ip=entry)} (POD_IPS={_quote(raw)}): {_quote(entry)} is not "
                        "an IP address; give IP literals separated by a comma without spaces", "POD_IPS") from None
        if ip.version == 4:
            v4 = ip
        else:  # as upstream, a later entry of the same family wins
            v6, v6_text = ip, entry
    return v4, v6, v6_text


def _config_file(directory: str, capver: int) -> tuple[str, str]:
    """(path, notice) of the versioned config file to use, or ("", "") without a directory."""
    if not directory:
        return "", ""
    try:
        path = conffile.pick_config_file(directory, capver)
    except conffile.ConfigFileError as e:
        condition = "config_file_none" if isinstance(e, conffile.NoConfigFileError) else "config_dir_unreadable"
        words = _upstream(condition, dir=directory, capver=capver)
        raise _fail(f"{words}: TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR={_quote(directory)}: {e}. "
                    f"Mount the operator's config Secret there, with a cap-<N>.hujson for N <= {capver}; ensure "
                    "that the operator is not older than the proxy", "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR") from None
    return path, f"Using tailscaled config file {path!r} to match current capability version {capver}"


def _kube_api_url(env: Mapping[str, str], root: str, from_env: bool) -> str:
    """The API server URL (spec step 5a), with an IPv6 host bracketed (upstream leaves it bare and broken)."""
    if root == "/" and not from_env:
        return DEFAULT_KUBE_API_URL
    host = env.get("KUBERNETES_SERVICE_HOST", "")
    if not host:
        return DEFAULT_KUBE_API_URL
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = env.get("KUBERNETES_SERVICE_PORT_HTTPS", "")
    return f"https://{host}:{port}" if port else f"https://{host}"


def _extra_args(env: Mapping[str, str], tokens: tuple[str, ...], accept_dns: bool | None
                ) -> tuple[tuple[str, ...], bool | None, str]:
    """Check TS_EXTRA_ARGS and fold its --accept-dns into accept_dns (spec 1.4). Returns (args, accept_dns,
    notice)."""
    try:
        check_flags(tokens)
        args, parsed = parse_accept_dns(" ".join(tokens), bool(accept_dns))
    except ValueError as e:
        raise _fail(f"TS_EXTRA_ARGS: {e}", "TS_EXTRA_ARGS") from None
    notice = ""
    if parsed != bool(accept_dns):
        # As upstream, an --accept-dns that agrees with TS_ACCEPT_DNS leaves it as it was (possibly unset).
        notice = (f"TS_EXTRA_ARGS sets --accept-dns={str(parsed).lower()}, overriding TS_ACCEPT_DNS="
                  f"{_quote(env.get('TS_ACCEPT_DNS', ''))}")
        accept_dns = parsed
    return tuple(args.split()), accept_dns, notice


def _secrets(env: Mapping[str, str]) -> list[str]:
    """Secret values that must never appear in a message: secret variables, and secret flags' values."""
    found = [env[s.name] for s in SETTINGS if s.secret and env.get(s.name)]
    tokens = env.get("TS_EXTRA_ARGS", "").split()
    for i, token in enumerate(tokens):
        name, _, value = token.lstrip("-").partition("=")
        if name in _SECRET_FLAGS:
            found.append(value if value else (tokens[i + 1] if i + 1 < len(tokens) else ""))
    return sorted((s for s in found if s), key=len, reverse=True)


def load(env: Mapping[str, str], *, root: str = "/", capver: int = CAPABILITY_VERSION) -> Settings:
    """Parse and validate the environment. `root` is the default of TS_TEST_ONLY_ROOT; `capver` the
    capability version used to choose the versioned config file. Raises SettingsError."""
    try:
        return _load(env, root, capver)
    except SettingsError as e:
        # Messages are built never to hold a secret; this is the belt to those braces.
        message = redact(str(e))
        for secret in _secrets(env):
            message = message.replace(secret, "[REDACTED]")
        raise SettingsError(message, e.variables) from None


def _load(env: Mapping[str, str], default_root: str, capver: int) -> Settings:
    # 1. Read every variable (table order). Values upstream would silently ignore fail here.
    values = {s.name: _read(s, env) for s in SETTINGS}
    fields = {s.field: values[s.name] for s in SETTINGS if s.field is not None}
    notices: list[str] = []

    # 2. Derived values, in upstream's order (spec 1.3).
    config_path, notice = _config_file(values["TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR"], capver)
    notices += [notice] if notice else []
    pod_ipv4, pod_ipv6, pod_ipv6_text = _pod_ips(env)
    cert_share_mode = ""
    if values["TS_EXPERIMENTAL_CERT_SHARE"]:
        cert_share_mode = "rw" if values["POD_NAME"].endswith("-0") else "ro"
    extra_args, accept_dns, notice = _extra_args(env, values["TS_EXTRA_ARGS"], values["TS_ACCEPT_DNS"])
    notices += [notice] if notice else []
    local_addr_port = values["TS_LOCAL_ADDR_PORT"]
    if pod_ipv6 is not None and "[" not in local_addr_port and "]" not in local_addr_port:
        # The operator writes $(POD_IP):9002, which is not an IP:port for an IPv6 Pod.
        for text in dict.fromkeys((pod_ipv6_text, str(pod_ipv6))):
            if text in local_addr_port:
                local_addr_port = local_addr_port.replace(text, f"[{text}]", 1)
                break
    in_kubernetes = values["KUBERNETES_SERVICE_HOST"] != ""
    if in_kubernetes:
        kube_secret = env.get("TS_KUBE_SECRET", "tailscale")  # explicitly empty turns Secret storage off
    else:
        kube_secret = values["TS_KUBE_SECRET"]
    fs_root = cmp_or(env.get("TS_TEST_ONLY_ROOT", ""), default_root)
    authkey = cmp_or(values["TS_AUTHKEY"], values["TS_AUTH_KEY"])
    if not values["TS_AUTHKEY"] and values["TS_AUTH_KEY"]:
        notices.append("TS_AUTH_KEY is deprecated: use TS_AUTHKEY")
    if values["TS_HEALTHCHECK_ADDR_PORT"]:
        notices.append("TS_HEALTHCHECK_ADDR_PORT is deprecated: use TS_ENABLE_HEALTH_CHECK and optionally "
                       "TS_LOCAL_ADDR_PORT")
    try:
        boot_timeout = parse_go_duration(values["TS_BOOT_TIMEOUT"])
    except ValueError:
        boot_timeout = 60.0  # reported in upstream's place, by _validate

    settings = Settings(**{
        **fields,
        "authkey": authkey,
        "tailscaled_config_path": config_path,
        "pod_ipv4": pod_ipv4,
        "pod_ipv6": pod_ipv6,
        "cert_share_mode": cert_share_mode,
        "extra_args": extra_args,
        "accept_dns": accept_dns,
        "local_addr_port": local_addr_port,
        "in_kubernetes": in_kubernetes,
        "kube_secret": kube_secret,
        "root": fs_root,
        "kube_api_url": _kube_api_url(env, fs_root, values["TS_KUBERNETES_READ_API_SERVER_ADDRESS_FROM_ENV"]),
        "boot_timeout": boot_timeout,
        "notices": tuple(notices),
    })
    # 3. Cross-variable rules, in upstream's order (spec 1.5).
    _validate(settings, env)
    return settings


def _userspace(env: Mapping[str, str]) -> str:
    if env.get("TS_USERSPACE"):
        return f"TS_USERSPACE={_quote(env['TS_USERSPACE'])}"
    return "TS_USERSPACE (unset, default true)"


def _check_addr_port(name: str, value: str, condition: str, why: str = "") -> None:
    try:
        parse_addr_port(value)
    except ValueError as e:
        raise _fail(f"{_upstream(condition, value=value)}: {name}={_quote(value)} is not a literal IP:port{why}: {e}. "
                    "Write e.g. \"[::]:9002\" or \"0.0.0.0:9002\" (host names are not accepted)", name) from None


def _validate_tls(s: Settings, env: Mapping[str, str]) -> None:
    if not (s.tls_cert_secret or s.tls_cert_dir):
        return
    src = "TS_TLS_CERT_SECRET" if s.tls_cert_secret else "TS_TLS_CERT_DIR"
    if s.tls_cert_secret and s.tls_cert_dir:
        raise _fail(f"{_shown_all(env, 'TS_TLS_CERT_SECRET', 'TS_TLS_CERT_DIR')}: give the certificate one way; "
                    "unset one", "TS_TLS_CERT_SECRET", "TS_TLS_CERT_DIR")
    if not s.serve_config:
        raise _fail(f"{_shown(src, env)} needs TS_SERVE_CONFIG: the serve config forwards port 443 to the TLS "
                    "listener and serves the decrypted requests", src, "TS_SERVE_CONFIG")
    if not s.userspace:
        raise _fail(f"{_shown(src, env)} needs userspace networking ({_userspace(env)}): decrypted connections "
                    "reach the serve config through tailscaled's netstack; set TS_USERSPACE=true", src,
                    "TS_USERSPACE")
    if s.tls_cert_secret:
        ns, _, name = s.tls_cert_secret.partition("/")
        if not ns or not name or "/" in name:
            raise _fail(f"{_shown(src, env)} is not `<namespace>/<name>`: write e.g. default/site-tls", src)
        if not s.in_kubernetes or not s.kube_secret:
            raise _fail(f"{_shown(src, env)} needs the Kubernetes API and a state Secret (KUBERNETES_SERVICE_HOST "
                        "and TS_KUBE_SECRET): use TS_TLS_CERT_DIR without them", src)
    _check_addr_port("TS_TLS_LISTEN", s.tls_listen, "tls_listen")
    if s.tls_backend:
        _check_addr_port("TS_TLS_BACKEND", s.tls_backend, "tls_backend")
    if not s.tls_upstream_port.isdigit() or not 0 < int(s.tls_upstream_port) < 65536:
        raise _fail(f"{_shown('TS_TLS_UPSTREAM_PORT', env)} is not a port number: give 1-65535 (the serve "
                    "config's plain-HTTP port)", "TS_TLS_UPSTREAM_PORT")


def _validate(s: Settings, env: Mapping[str, str]) -> None:
    """Upstream's rules in upstream's order (spec 1.5), plus ours where they fit. The first failure wins."""
    userspace = _userspace(env)
    kernel_fix = "set TS_USERSPACE=false (kernel networking, which needs NET_ADMIN and /dev/net/tun)"

    # 1. The versioned config file must load.
    if s.tailscaled_config_path:
        try:
            conffile.load(s.tailscaled_config_path)
        except conffile.ConfigFileError as e:
            raise _fail(f"{_upstream('config_file_contents')}: TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR="
                        f"{_quote(s.versioned_config_dir)}: the tailscaled config file is not valid: {e}. Fix the "
                        "file, and ensure that the operator is not older than the proxy",
                        "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR") from None

    # 2-7. Proxy targets need kernel networking, and one target of each kind.
    def needs_kernel(name: str, condition: str) -> SettingsError:
        return _fail(f"{_upstream(condition)} ({_shown(name, env)}, {userspace}): {kernel_fix}", name,
                     "TS_USERSPACE")

    for name, value, cond in (("TS_DEST_IP", s.dest_ip, "dest_ip_userspace"),
                              ("TS_EXPERIMENTAL_DEST_DNS_NAME", s.dest_dns_name, "dest_dns_name_userspace")):
        if value and s.userspace:
            raise needs_kernel(name, cond)
    if s.dest_dns_name and s.dest_ip:
        raise _fail(f"{_upstream('dest_dns_name_and_dest_ip')} "
                    f"({_shown('TS_EXPERIMENTAL_DEST_DNS_NAME', env)}, {_shown('TS_DEST_IP', env)}): unset one",
                    "TS_EXPERIMENTAL_DEST_DNS_NAME", "TS_DEST_IP")
    # Ours: DNAT of all tailnet traffic takes it away from serve, so serve would never see a connection.
    if s.serve_config and s.dest_ip:
        raise _fail(f"{_shown('TS_SERVE_CONFIG', env)} cannot be used with {_shown('TS_DEST_IP', env)}: TS_DEST_IP "
                    "forwards all tailnet traffic, so nothing reaches serve. Unset one of them",
                    "TS_SERVE_CONFIG", "TS_DEST_IP")
    for name, value, cond in (("TS_TAILNET_TARGET_IP", s.tailnet_target_ip, "tailnet_target_ip_userspace"),
                              ("TS_TAILNET_TARGET_FQDN", s.tailnet_target_fqdn, "tailnet_target_fqdn_userspace")):
        if value and s.userspace:
            raise needs_kernel(name, cond)
    if s.tailnet_target_fqdn and s.tailnet_target_ip:
        raise _fail(f"{_upstream('tailnet_target_ip_and_fqdn')}: TS_TAILNET_TARGET_IP and TS_TAILNET_TARGET_FQDN "
                    f"cannot both be set ({_shown('TS_TAILNET_TARGET_IP', env)}, "
                    f"{_shown('TS_TAILNET_TARGET_FQDN', env)}): unset one",
                    "TS_TAILNET_TARGET_IP", "TS_TAILNET_TARGET_FQDN")

    # 8. One-step mode takes login and prefs from the config file, not from variables.
    if s.tailscaled_config_path:
        authkey_var = "TS_AUTHKEY" if env.get("TS_AUTHKEY") else "TS_AUTH_KEY"
        clashes = [
            ("TS_HOSTNAME", bool(s.hostname)),
            ("TS_EXTRA_ARGS", bool(s.extra_args)),
            (authkey_var, bool(s.authkey)),
            ("TS_ROUTES", s.routes is not None),
            ("TS_ACCEPT_DNS", s.accept_dns is not None),
            ("TS_CLIENT_ID", bool(s.client_id)),
            ("TS_CLIENT_SECRET", bool(s.client_secret)),
            ("TS_ID_TOKEN", bool(s.id_token)),
            ("TS_AUDIENCE", bool(s.audience)),
        ]
        names = [name for name, present in clashes if present]
        if names:
            shown = []
            for name in names:
                if name == "TS_EXTRA_ARGS":
                    shown.append(f"TS_EXTRA_ARGS={_quote(redact(' '.join(_mask_args(s.extra_args))))}")
                elif name == "TS_ACCEPT_DNS" and not env.get("TS_ACCEPT_DNS"):
                    shown.append("TS_ACCEPT_DNS (from --accept-dns in TS_EXTRA_ARGS)")
                else:
                    shown.append(_shown(name, env))
            raise _fail(f"{_upstream('config_dir_combination')} Here "
                        f"{_shown('TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR', env)} is combined with "
                        f"{', '.join(shown)}: with a config directory tailscaled takes login and settings from "
                        "the config file. Unset them, or put them in the config file",
                        "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR", *names)

    # 9-14. Login methods: an auth key, or OAuth / workload identity federation, never both.
    wif = "workload identity federation needs TS_CLIENT_ID: set it to the OAuth client's ID"
    if s.id_token and not s.client_id:
        raise _fail(f"{_upstream('id_token_without_client_id')} "
                    f"({_shown_all(env, 'TS_ID_TOKEN', 'TS_CLIENT_ID')}): {wif}", "TS_ID_TOKEN", "TS_CLIENT_ID")
    if s.audience and not s.client_id:
        raise _fail(f"{_upstream('audience_without_client_id')} "
                    f"({_shown_all(env, 'TS_AUDIENCE', 'TS_CLIENT_ID')}): {wif}", "TS_AUDIENCE", "TS_CLIENT_ID")
    for a, b, a_on, b_on, cond in (
            ("TS_ID_TOKEN", "TS_CLIENT_SECRET", s.id_token, s.client_secret, "id_token_and_client_secret"),
            ("TS_ID_TOKEN", "TS_AUDIENCE", s.id_token, s.audience, "id_token_and_audience"),
            ("TS_AUDIENCE", "TS_CLIENT_SECRET", s.audience, s.client_secret, "audience_and_client_secret")):
        if a_on and b_on:
            raise _fail(f"{_upstream(cond)} ({_shown_all(env, a, b)}): they are different login methods; unset "
                        "one", a, b)
    if s.authkey:
        authkey_var = "TS_AUTHKEY" if env.get("TS_AUTHKEY") else "TS_AUTH_KEY"
        others = [n for n, v in (("TS_CLIENT_ID", s.client_id), ("TS_CLIENT_SECRET", s.client_secret),
                                 ("TS_ID_TOKEN", s.id_token), ("TS_AUDIENCE", s.audience)) if v]
        if others:
            values = _shown_all(env, authkey_var, *others)
            raise _fail(f"{_upstream('authkey_and_oauth')} Here {authkey_var} cannot be used with "
                        f"{', '.join(others)} ({values}): log in with either an auth key or OAuth/workload identity "
                        "(TS_CLIENT_ID with TS_CLIENT_SECRET, TS_ID_TOKEN or TS_AUDIENCE); unset the other",
                        authkey_var, *others)

    # 15-18. Features that need kernel networking or an ingress setup.
    allow = "EXPERIMENTAL_ALLOW_PROXYING_CLUSTER_TRAFFIC_VIA_INGRESS"
    if s.allow_proxying_cluster_traffic_via_ingress:
        if s.userspace:
            raise needs_kernel(allow, "allow_proxying_userspace")
        if not s.serve_config:
            raise _fail(f"{_upstream('allow_proxying_without_serve')} ({_shown(allow, env)}): it needs "
                        "TS_SERVE_CONFIG; unset it or set TS_SERVE_CONFIG", allow, "TS_SERVE_CONFIG")
        if not s.pod_ip:
            raise _fail(f"{_upstream('allow_proxying_without_pod_ip')} ({_shown(allow, env)}): set POD_IP "
                        "from the Pod's status.podIP", allow, "POD_IP")
    if s.forwarding_optimizations and s.userspace:
        raise needs_kernel("TS_EXPERIMENTAL_ENABLE_FORWARDING_OPTIMIZATIONS", "forwarding_optimizations_userspace")

    # Ours: HTTPS with the user's certificate, in front of the serve config.
    _validate_tls(s, env)

    # 19-22. Listener addresses. TS_LOCAL_ADDR_PORT is checked only when something listens on it, as upstream
    # does: the operator always sets it, and an unused bad value must not stop a proxy that worked before.
    if s.healthcheck_addr_port:
        _check_addr_port("TS_HEALTHCHECK_ADDR_PORT", s.healthcheck_addr_port, "healthcheck_addr_port")
    if s.local_server_enabled:
        users = [n for n, on in (("TS_ENABLE_METRICS", s.enable_metrics), ("TS_ENABLE_HEALTH_CHECK",
                 s.enable_health_check), ("TS_EGRESS_PROXIES_CONFIG_PATH", bool(s.egress_proxies_config_path)))
                 if on]
        _check_addr_port("TS_LOCAL_ADDR_PORT", s.local_addr_port, "local_addr_port",
                         f" (needed by {', '.join(users)})")
    if s.debug_addr_port:
        _check_addr_port("TS_DEBUG_ADDR_PORT", s.debug_addr_port, "debug_addr_port")
    if s.enable_health_check and s.healthcheck_addr_port:
        raise _fail(f"{_upstream('healthcheck_and_health_check')} ({_shown('TS_HEALTHCHECK_ADDR_PORT', env)} "
                    "cannot be combined with TS_ENABLE_HEALTH_CHECK): unset TS_HEALTHCHECK_ADDR_PORT and, if needed, "
                    "set TS_LOCAL_ADDR_PORT", "TS_HEALTHCHECK_ADDR_PORT", "TS_ENABLE_HEALTH_CHECK")

    # 23-24. The services configs are written by the operator and reported through the state Secret.
    # In userspace mode they start, as upstream does (with no kernel data path the services get no rules; each
    # says so in /status).
    for name, value, cond in (
            ("TS_EGRESS_PROXIES_CONFIG_PATH", s.egress_proxies_config_path, "egress_outside_kubernetes"),
            ("TS_INGRESS_PROXIES_CONFIG_PATH", s.ingress_proxies_config_path, "ingress_outside_kubernetes")):
        if value and not s.has_kube_secret:
            missing = "KUBERNETES_SERVICE_HOST is empty" if not s.in_kubernetes else 'TS_KUBE_SECRET is ""'
            raise _fail(f"{_upstream(cond)} with a state Secret ({_shown(name, env)}), but {missing}: unset {name}, "
                        "or run in Kubernetes with TS_KUBE_SECRET set",
                        name, "KUBERNETES_SERVICE_HOST" if not s.in_kubernetes else "TS_KUBE_SECRET")

    # 25. The boot deadline.
    text = cmp_or(env.get("TS_BOOT_TIMEOUT", ""), _BY_NAME["TS_BOOT_TIMEOUT"].default)
    try:
        seconds = parse_go_duration(text)
    except ValueError as e:
        raise _fail(f"{_upstream('boot_timeout', value=text)}: TS_BOOT_TIMEOUT={_quote(text)} is not a Go duration "
                    f"({e}): write a number with a unit, e.g. 90s, 3m or 1m30s", "TS_BOOT_TIMEOUT") from None
    if seconds <= 0:
        raise _fail(f"TS_BOOT_TIMEOUT={_quote(text)} must be positive: boot could never finish in time; "
                    "use e.g. 90s or 3m", "TS_BOOT_TIMEOUT")


def _mask_args(tokens: tuple[str, ...]) -> list[str]:
    """tokens with the values of secret flags replaced by "(set)"."""
    out: list[str] = []
    hide_next = False
    for token in tokens:
        if hide_next:
            out.append("(set)")
            hide_next = False
            continue
        name, eq, _ = (_flag_name(token) or "").partition("=")
        if name in _SECRET_FLAGS:
            m = _FLAG.fullmatch(token)
            if m and m.group(2):
                token = token.split("=", 1)[0] + "=(set)"
            else:
                hide_next = True
        out.append(token)
    return out


# --------------------------------------------------------------------------------------------------------------
# The variable reference (docs/agent.md).


def _type_text(s: Setting) -> str:
    if s.kind == Kind.CHOICE:
        return "one of " + ", ".join(f"`{c}`" for c in s.choices if c) + ", or empty"
    if s.kind == Kind.IP_LIST:
        return "comma-separated IPs"
    return s.kind.value


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    """The variable reference of docs/agent.md, generated from SETTINGS."""
    lines = [
        "| Variable | Type | Default | Meaning | Differs from upstream |",
        "|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        default = s.default_doc or (f"`{s.default}`" if s.default else "empty")
        meaning = s.help
        if s.secret:
            meaning += " Secret: never logged or shown in errors."
        name = f"`{s.name}`" + (" (deprecated)" if s.deprecated else "")
        lines.append(f"| {name} | {_cell(_type_text(s))} | {_cell(default)} | {_cell(meaning)} | "
                     f"{_cell(s.differs)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m containerboot.settings",
                                     description="The agent's environment variables.")
    parser.add_argument("--markdown", action="store_true", help="print the variable reference (docs/agent.md)")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
