"""A user's TLS certificate (a `kubernetes.io/tls` Secret's `tls.crt` and `tls.key`), checked before it is served.

Pure: PEM text in, a `CertInfo` or a `CertProblem` out. Both sides use it: the controller checks the Secret it
can read (type, keys, names, expiry) and reports a problem as a false condition and a Warning event naming the
Secret; the agent checks again what it is about to load (the controller may not have seen this version yet)
and keeps serving its last good certificate when the new one fails.

The checks, each with its own message (never the key's bytes):
- `tls.crt` holds at least one PEM certificate, `tls.key` one PEM private key;
- the leaf (first) certificate is valid now (`notBefore` <= now < `notAfter`);
- the leaf covers at least one of the names clients use (the proxy's MagicDNS name, or `spec.tls[].hosts`):
  a DNS subjectAltName equal to the name or a one-label wildcard (`*.example.com` covers `a.example.com`, not
  `example.com` nor `a.b.example.com`), compared without case and trailing dot; the subject's CN only when the
  certificate has no DNS names (RFC 6125), as clients do;
- the key matches the leaf: checked by the caller with the TLS library (`tscommon.tlsload.key_matches`), since
  comparing keys needs the key's mathematics, which the ssl module does while loading the pair.

The leaf is read with a small DER reader (X.509's TBSCertificate: serial, validity, subject CN, SANs); the
proxy image carries no X.509 library and the ssl module decodes certificates only from files.
"""
from __future__ import annotations

import base64
import binascii
import calendar
import datetime
import re
from dataclasses import dataclass

__all__ = ["CertProblem", "CertInfo", "check", "parse_leaf", "covers", "pem_blocks"]

_PEM = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\s*(.*?)\s*-----END \1-----", re.S)
_SAN_OID = bytes.fromhex("551d11")          # 2.5.29.17 subjectAltName
_CN_OID = bytes.fromhex("550403")           # 2.5.4.3 commonName


class CertProblem(ValueError):
    """Why a certificate cannot be served, in words for an event (names the problem, never the key)."""


@dataclass(frozen=True)
class CertInfo:
    serial: str                    # hex, upper case, as `openssl x509 -serial` prints it
    not_before: float              # seconds since the epoch
    not_after: float
    dns_names: tuple[str, ...]
    common_name: str

    def names(self) -> tuple[str, ...]:
        return self.dns_names or ((self.common_name,) if self.common_name else ())


def pem_blocks(text: bytes, kinds: tuple[str, ...]) -> list[bytes]:
    """DER bytes of each PEM block whose label is one of `kinds`, in order."""
    out = []
    for label, body in _PEM.findall(text):
        if label.decode() in kinds:
            try:
                out.append(base64.b64decode(b"".join(body.split()), validate=True))
            except binascii.Error:
                raise CertProblem(f"a {label.decode()} PEM block is not valid base64") from None
    return out


def _tlv(data: bytes, i: int) -> tuple[int, int, int]:
    """(tag, start of value, end of value) of the DER element at i."""
    if i + 2 > len(data):
        raise CertProblem("the certificate's DER encoding is truncated")
    tag, n = data[i], data[i + 1]
    i += 2
    if n & 0x80:
        k = n & 0x7F
        if k == 0 or k > 4 or i + k > len(data):
            raise CertProblem("the certificate's DER encoding has a bad length")
        n = int.from_bytes(data[i:i + k], "big")
        i += k
    if i + n > len(data):
        raise CertProblem("the certificate's DER encoding is truncated")
    return tag, i, i + n


def _children(data: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    out = []
    while start < end:
        t = _tlv(data, start)
        out.append(t)
        start = t[2]
    return out


def _time(data: bytes, tag: int, s: int, e: int) -> float:
    text = data[s:e].decode("ascii", "replace")
    m = re.fullmatch(r"(\d{2}|\d{4})(\d{2})(\d{2})(\d{2})(\d{2})(\d{2})Z", text)
    if not m or tag not in (0x17, 0x18):
        raise CertProblem(f"the certificate has a validity time it cannot be read: {text!r}")
    year = int(m.group(1))
    if tag == 0x17:                         # UTCTime: two digits, 1950-2049 (RFC 5280)
        year += 1900 if year >= 50 else 2000
    return float(calendar.timegm((year, *map(int, m.groups()[1:]))))


def _common_name(data: bytes, s: int, e: int) -> str:
    for _, rs, re_ in _children(data, s, e):                  # RDNs (SETs)
        for _, as_, ae in _children(data, rs, re_):           # AttributeTypeAndValue (SEQUENCE)
            parts = _children(data, as_, ae)
            if len(parts) == 2 and data[parts[0][1]:parts[0][2]] == _CN_OID:
                return data[parts[1][1]:parts[1][2]].decode("utf-8", "replace")
    return ""


def _dns_names(data: bytes, s: int, e: int) -> tuple[str, ...]:
    names: list[str] = []
    for _, es, ee in _children(data, s, e):                   # Extension SEQUENCEs
        parts = _children(data, es, ee)
        if not parts or data[parts[0][1]:parts[0][2]] != _SAN_OID:
            continue
        _, vs, ve = parts[-1]                                 # OCTET STRING holding GeneralNames
        _, gs, ge = _tlv(data, vs)
        for tag, ns, ne in _children(data, gs, ge):
            if tag == 0x82:                                   # [2] dNSName
                names.append(data[ns:ne].decode("ascii", "replace"))
    return tuple(names)


def parse_leaf(der: bytes) -> CertInfo:
    """Serial, validity, CN and DNS SANs of one DER certificate; CertProblem when it cannot be read."""
    _, cs, ce = _tlv(der, 0)
    tbs_tag, ts, te = _tlv(der, cs)
    if tbs_tag != 0x30:
        raise CertProblem("tls.crt does not hold an X.509 certificate")
    fields = _children(der, ts, te)
    if fields and fields[0][0] == 0xA0:                       # [0] version
        fields = fields[1:]
    if len(fields) < 6:
        raise CertProblem("tls.crt does not hold an X.509 certificate")
    serial = der[fields[0][1]:fields[0][2]].lstrip(b"\x00") or b"\x00"
    validity = _children(der, fields[3][1], fields[3][2])
    if len(validity) != 2:
        raise CertProblem("the certificate's validity cannot be read")
    not_before = _time(der, *validity[0])
    not_after = _time(der, *validity[1])
    cn = _common_name(der, fields[4][1], fields[4][2])
    dns: tuple[str, ...] = ()
    for tag, s, _e in fields[6:]:
        if tag == 0xA3:                                       # [3] extensions
            _, xs, xe = _tlv(der, s)
            dns = _dns_names(der, xs, xe)
    return CertInfo(serial.hex().upper(), not_before, not_after, dns, cn)


def _norm(name: str) -> str:
    return name.strip().rstrip(".").lower()


def covers(cert_name: str, name: str) -> bool:
    """Whether one certificate name (maybe `*.` wildcard) covers the host name a client uses."""
    c, n = _norm(cert_name), _norm(name)
    if not c or not n:
        return False
    if c.startswith("*."):
        head, _, rest = n.partition(".")
        return bool(head) and rest == c[2:]
    return c == n


def check(cert_pem: bytes, key_pem: bytes, names: tuple[str, ...], now: float) -> CertInfo:
    """The leaf's facts if it may be served for `names` at `now`; else CertProblem saying what is wrong.

    `names` empty: the served names are not known yet (the proxy has no MagicDNS name and the Ingress names no
    hosts), so only the names check is left out. The key's match is `tlsload.key_matches`'s."""
    certs = pem_blocks(cert_pem, ("CERTIFICATE",))
    if not certs:
        raise CertProblem("tls.crt holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    if not pem_blocks(key_pem, ("PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY")):
        raise CertProblem("tls.key holds no PEM private key (-----BEGIN PRIVATE KEY-----)")
    info = parse_leaf(certs[0])
    if now < info.not_before:
        raise CertProblem(f"the certificate is not valid yet (notBefore {_iso(info.not_before)})")
    if now >= info.not_after:
        raise CertProblem(f"the certificate expired at {_iso(info.not_after)}")
    if names and not any(covers(c, n) for c in info.names() for n in names):
        have = ", ".join(info.names()) or "none"
        raise CertProblem(f"the certificate covers none of the served names {', '.join(names)} "
                          f"(it names {have})")
    return info


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
