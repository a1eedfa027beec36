"""records.json -> Records (pure).

The file is the one upstream's operator writes into the ``dnsrecords`` ConfigMap::

    {"version": "v1alpha1", "ip4": {"web.tailnet.example": ["10.1.0.7"]}, "ip6": {"web.tailnet.example": [...]}}

A file that is not JSON, has another version, or has maps of the wrong shape is an error (the server then
keeps its last good records). Inside a well-shaped file, one bad name or address is skipped with a warning,
as upstream does: one broken entry must not take every other name down.
"""
from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import dns.exception
import dns.name

from tscommon.dnsrecords import VERSION
from tscommon.dnsrecords import render as render_records

__all__ = ["VERSION", "Records", "RecordsError", "parse_records", "render_records", "zones_of"]


class RecordsError(ValueError):
    """The records file cannot be used at all (its text is never part of the message: it is not ours)."""


@dataclass(frozen=True)
class Records:
    """Absolute, lower-case names -> addresses. Empty records answer every name with NXDOMAIN."""
    ip4: Mapping[dns.name.Name, tuple[ipaddress.IPv4Address, ...]] = field(default_factory=dict)
    ip6: Mapping[dns.name.Name, tuple[ipaddress.IPv6Address, ...]] = field(default_factory=dict)
    #: Entries skipped because their name or address is invalid (one line each, for the log).
    warnings: tuple[str, ...] = ()
    #: Every name that exists: the record names and their ancestors (an ancestor with no address of its own
    #: answers NODATA, not NXDOMAIN). Derived once here rather than on each query.
    existing: frozenset[dns.name.Name] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        out: set[dns.name.Name] = set()
        for n in self.names():
            while n != dns.name.root and n not in out:
                out.add(n)
                n = n.parent()
        object.__setattr__(self, "existing", frozenset(out))

    def names(self) -> frozenset[dns.name.Name]:
        return frozenset(self.ip4) | frozenset(self.ip6)


def _name(text: str) -> dns.name.Name:
    n = dns.name.from_text(text.strip().rstrip(".") + ".")
    if n == dns.name.root:
        raise dns.exception.SyntaxError("empty name")
    return n.canonicalize()


def _map(doc: Mapping[str, object], key: str) -> Mapping[str, list[str]]:
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RecordsError(f"records file: {key!r} must be a map of name to a list of addresses, "
                           f"not {type(value).__name__}")
    for name, addrs in value.items():
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise RecordsError(f"records file: {key}[{name!r}] must be a list of address strings")
    return value


def parse_records(text: str | None) -> Records:
    """The records in a records.json text. None (no file) or blank text: no records, like upstream."""
    if text is None or not text.strip():
        return Records()
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise RecordsError(f"records file is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise RecordsError(f"records file must be a JSON object, not {type(doc).__name__}")
    version = doc.get("version")
    if version != VERSION:
        raise RecordsError(f"records file has version {version!r}; the supported version is {VERSION!r}")
    warnings: list[str] = []
    ip4: dict[dns.name.Name, tuple[ipaddress.IPv4Address, ...]] = {}
    ip6: dict[dns.name.Name, tuple[ipaddress.IPv6Address, ...]] = {}
    for key, family, out in (("ip4", 4, ip4), ("ip6", 6, ip6)):
        for raw_name, addrs in _map(doc, key).items():
            try:
                name = _name(raw_name)
            except dns.exception.DNSException as e:
                warnings.append(f"{key}: {raw_name!r} is not a valid DNS name ({e}); skipping it")
                continue
            good = []
            for a in addrs:
                try:
                    ip = ipaddress.ip_address(a)
                except ValueError:
                    warnings.append(f"{key}[{raw_name!r}]: {a!r} is not an IP address; skipping it")
                    continue
                if ip.version != family:
                    warnings.append(f"{key}[{raw_name!r}]: {a!r} is not an IPv{family} address; skipping it")
                    continue
                if ip not in good:
                    good.append(ip)
            if good:
                out[name] = tuple(out.get(name, ())) + tuple(good)   # type: ignore[assignment]
    return Records(ip4=ip4, ip6=ip6, warnings=tuple(warnings))


def zones_of(records: Records) -> frozenset[dns.name.Name]:
    """The zones a records set implies when none is configured: each name's parent (a device's MagicDNS name is
    ``<host>.<tailnet domain>``)."""
    return frozenset(n.parent() for n in records.names() if len(n) > 2)
