"""The user's certificate is checked as a client would: names, validity, the key's match, readable PEM."""
from __future__ import annotations

import time

import pytest

from tests.support.testca import TestCA
from tscommon import tlscert, tlsload
from tscommon.tlscert import CertProblem


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> TestCA:
    return TestCA(str(tmp_path_factory.mktemp("ca")))


def test_a_good_certificate_gives_its_serial_and_names(ca):
    leaf = ca.issue("proxy.tail.example", "app.example.com")
    info = tlscert.check(leaf.cert_pem, leaf.key_pem, ("proxy.tail.example.",), time.time())
    assert info.serial == leaf.serial
    assert info.dns_names == ("proxy.tail.example", "app.example.com")
    tlsload.key_matches(leaf.cert_pem, leaf.key_pem)


def test_names_are_matched_like_clients_do(ca):
    wild = ca.issue("*.example.com")
    now = time.time()
    assert tlscert.check(wild.cert_pem, wild.key_pem, ("APP.example.com",), now)
    for name in ("example.com", "a.b.example.com"):
        with pytest.raises(CertProblem, match=r"covers none of the served names .* \(it names \*\.example\.com\)"):
            tlscert.check(wild.cert_pem, wild.key_pem, (name,), now)


def test_a_certificate_for_another_name_is_refused_naming_both(ca):
    other = ca.issue("other.example.org")
    with pytest.raises(CertProblem) as e:
        tlscert.check(other.cert_pem, other.key_pem, ("proxy.tail.example", "app.example.com"), time.time())
    assert "proxy.tail.example, app.example.com" in str(e.value) and "other.example.org" in str(e.value)


def test_the_common_name_counts_only_without_dns_names(ca):
    cn_only = ca.issue(cn="proxy.tail.example")
    assert tlscert.check(cn_only.cert_pem, cn_only.key_pem, ("proxy.tail.example",), time.time())
    with_san = ca.issue("other.example.org", cn="proxy.tail.example")
    with pytest.raises(CertProblem, match="covers none"):
        tlscert.check(with_san.cert_pem, with_san.key_pem, ("proxy.tail.example",), time.time())


def test_expired_and_not_yet_valid_certificates_are_refused(ca):
    old = ca.issue("proxy.tail.example", not_before="20200101000000Z", not_after="20200201000000Z")
    with pytest.raises(CertProblem, match="expired at 2020-02-01T00:00:00Z"):
        tlscert.check(old.cert_pem, old.key_pem, ("proxy.tail.example",), time.time())
    future = ca.issue("proxy.tail.example", not_before="20991231000000Z", not_after="21000101000000Z")
    with pytest.raises(CertProblem, match="not valid yet"):
        tlscert.check(future.cert_pem, future.key_pem, ("proxy.tail.example",), time.time())


def test_a_key_of_another_certificate_is_refused(ca):
    a, b = ca.issue("proxy.tail.example"), ca.issue("proxy.tail.example")
    tlscert.check(a.cert_pem, b.key_pem, ("proxy.tail.example",), time.time())   # names and dates are fine
    with pytest.raises(CertProblem, match="tls.key does not match the certificate"):
        tlsload.key_matches(a.cert_pem, b.key_pem)


@pytest.mark.parametrize("crt,key,msg", [
    (b"", b"", "tls.crt holds no PEM certificate"),
    (b"-----BEGIN CERTIFICATE-----\n@@@\n-----END CERTIFICATE-----\n", b"", "not valid base64"),
    (b"-----BEGIN CERTIFICATE-----\nMAMCAQE=\n-----END CERTIFICATE-----\n", b"-----BEGIN PRIVATE KEY-----\n"
     b"AA==\n-----END PRIVATE KEY-----\n", "does not hold an X.509 certificate"),
])
def test_unreadable_pem_is_refused_with_the_field(crt, key, msg):
    with pytest.raises(CertProblem, match=msg):
        tlscert.check(crt, key, ("x",), time.time())


def test_a_missing_key_is_named(ca):
    leaf = ca.issue("proxy.tail.example")
    with pytest.raises(CertProblem, match="tls.key holds no PEM private key"):
        tlscert.check(leaf.cert_pem, b"", ("proxy.tail.example",), time.time())


def test_the_key_never_appears_in_a_problem(ca):
    a, b = ca.issue("x.example"), ca.issue("x.example")
    with pytest.raises(CertProblem) as e:
        tlsload.key_matches(a.cert_pem, b.key_pem)
    body = b"".join(tlscert.pem_blocks(b.key_pem, ("PRIVATE KEY",)))
    assert body.hex()[:16] not in str(e.value) and b"PRIVATE" not in str(e.value).encode()
