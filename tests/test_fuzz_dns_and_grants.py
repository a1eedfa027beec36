"""Generated input for the parsers the other fuzz files leave out, each asserting what the result means: the
nameserver's records file (what the controller writes is what the nameserver reads back), its answers (the
addresses of the records, NXDOMAIN, or a refusal, never a crash), the API server proxy's grants (groups merged
in order, or an error naming the rule) and DNSConfig (rendered objects that say what the spec said, or an error
naming the field). Every test must reach both its accepted and its refused branch (`reaches`)."""
from __future__ import annotations

import ipaddress
import json
from typing import Any

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from containerboot.apiproxy import identity
from controller.config import ControllerConfig
from controller.kinds import dnsconfig as dc
from nameserver import answer as ns_answer
from nameserver.records import RecordsError, parse_records, zones_of
from tests.support.crdschema import problems, project_crds, prune
from tests.support.fuzz import branch, hostile_text, json_text, json_values, reaches, shaped
from tscommon import dnsrecords

_LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
_NAMES = st.builds(lambda host, case: (f"{host}.tail.example.com" if not case else f"{host.upper()}.TAIL.example.com."),
                   _LABEL, st.booleans())
_V4 = st.ip_addresses(v=4).map(str)
_V6 = st.ip_addresses(v=6).map(str)


# ----------------------------------------------------------------------------------------- the records file

@reaches("accepted")
@given(ip4=st.dictionaries(_NAMES, st.lists(_V4, max_size=3), max_size=4),
       ip6=st.dictionaries(_NAMES, st.lists(_V6, max_size=3), max_size=4))
def test_records_written_by_the_controller_read_back_the_same(ip4: dict[str, list[str]],
                                                                ip6: dict[str, list[str]]) -> None:
    records = parse_records(dnsrecords.render(ip4, ip6))
    branch("accepted")
    assert records.warnings == ()

    def want(m: dict[str, list[str]]) -> dict[dns.name.Name, set[Any]]:
        out: dict[dns.name.Name, set[Any]] = {}
        for k, v in m.items():
            if v:
                out.setdefault(dns.name.from_text(k.rstrip(".").lower() + "."), set()).update(
                    ipaddress.ip_address(a) for a in v)
        return out
    assert {k: set(v) for k, v in records.ip4.items()} == want(ip4)
    assert {k: set(v) for k, v in records.ip6.items()} == want(ip6)
    # and the same records always give the same text
    assert dnsrecords.render(ip4, ip6) == dnsrecords.render(dict(reversed(ip4.items())), ip6)


_RECORDS = {"version": "v1alpha1", "ip4": {"web.tail.example.com": ["100.64.0.7"]},
            "ip6": {"web.tail.example.com": ["fd7a:115c:a1e0::7"]}}


_ENTRY_NAMES = st.one_of(_NAMES, hostile_text(max_size=12), st.sampled_from(["", ".", "a..b", "-x.", "a" * 70]))
_ADDRS = st.lists(st.one_of(_V4, _V6, hostile_text(max_size=10)), max_size=3)
_DOCS = st.fixed_dictionaries({"version": st.sampled_from(["v1alpha1", "v1alpha1", "v1alpha1", "v2", 1]),
                               "ip4": st.dictionaries(_ENTRY_NAMES, _ADDRS, max_size=3),
                               "ip6": st.dictionaries(_ENTRY_NAMES, _ADDRS, max_size=3)})


@reaches("accepted", "refused", "warned")
@given(doc=_DOCS)
def test_a_records_files_entries_are_read_or_skipped_with_a_warning_naming_them(doc: dict[str, Any]) -> None:
    try:
        records = parse_records(json.dumps(doc))
    except RecordsError as e:
        branch("refused")
        assert doc["version"] != "v1alpha1" and "version" in str(e), str(e)
        return
    branch("accepted")
    if records.warnings:
        branch("warned")
        assert all(w.startswith(("ip4", "ip6")) and "skipping it" in w for w in records.warnings), records.warnings
    for family, m in ((4, records.ip4), (6, records.ip6)):
        for name, addrs in m.items():
            assert name.is_absolute() and addrs and all(a.version == family for a in addrs)
    # every address of an entry the file names well is kept (the warnings are for the others)
    for key, m in (("ip4", records.ip4), ("ip6", records.ip6)):
        for raw, addrs in doc[key].items():
            ok = [a for a in addrs if _is_ip(a, int(key[2]))]
            if ok and not any(repr(raw) in w and "not a valid DNS name" in w for w in records.warnings):
                name = dns.name.from_text(raw.strip().rstrip(".") + ".").canonicalize()
                assert {ipaddress.ip_address(a) for a in ok} <= set(m[name]), (raw, ok, m.get(name))


def _is_ip(text: str, family: int) -> bool:
    try:
        return ipaddress.ip_address(text).version == family
    except ValueError:
        return False


@reaches("accepted", "refused")
@given(text=st.one_of(st.none(), json_text(shaped(_RECORDS))))
@example(text=None)
def test_any_records_text_parses_or_is_refused(text: str | None) -> None:
    try:
        parse_records(text)
    except RecordsError as e:
        branch("refused")
        assert str(e).startswith("records file"), str(e)
        return
    branch("accepted")


# --------------------------------------------------------------------------------------------- the answers

_REC = parse_records(dnsrecords.render({"web.tail.example.com": ["100.64.0.7", "100.64.0.8"],
                                        "db.svc.tail.example.com": ["100.64.0.9"]},
                                       {"web.tail.example.com": ["fd7a:115c:a1e0::7"]}))
_ZONES = zones_of(_REC) | {dns.name.from_text("tail.example.com.")}
_QNAMES = st.one_of(st.sampled_from(["web.tail.example.com", "WEB.tail.example.COM", "db.svc.tail.example.com",
                                     "svc.tail.example.com", "tail.example.com", "x.web.tail.example.com"]),
                    st.sampled_from(["example.org", "web.tail.example.org", "com", "ts.net"]),
                    _LABEL.map(lambda h: f"{h}.tail.example.com"), _LABEL.map(lambda h: f"{h}.example.net"))


@reaches("answered", "nodata", "nxdomain", "refused")
@given(qname=_QNAMES, rdtype=st.sampled_from(["A", "AAAA", "TXT", "MX"]), udp=st.booleans())
def test_a_query_gets_the_records_addresses_nxdomain_or_a_refusal(qname: str, rdtype: str, udp: bool) -> None:
    query = dns.message.make_query(qname, rdtype)
    wire = ns_answer.answer(query.to_wire(), _REC, _ZONES, udp=udp)
    assert wire is not None
    resp = dns.message.from_wire(wire)
    assert resp.id == query.id and resp.flags & dns.flags.QR and resp.question == query.question
    name = dns.name.from_text(qname).canonicalize()
    in_zone = any(name.is_subdomain(z) for z in _ZONES)
    if not in_zone:
        branch("refused")
        assert resp.rcode() == dns.rcode.REFUSED
        return
    want = {"A": _REC.ip4, "AAAA": _REC.ip6}.get(rdtype, {}).get(name, ())
    if want:
        branch("answered")
        assert resp.rcode() == dns.rcode.NOERROR and resp.flags & dns.flags.AA
        assert {ipaddress.ip_address(r.address) for rrset in resp.answer for r in rrset} == set(want)
    elif name in _REC.existing or name in _ZONES:
        branch("nodata")
        assert resp.rcode() == dns.rcode.NOERROR and not resp.answer
    else:
        branch("nxdomain")
        assert resp.rcode() == dns.rcode.NXDOMAIN and not resp.answer


@reaches("dropped", "answered")
@given(wire=st.one_of(st.binary(max_size=64),
                      st.builds(lambda q, cut: q.to_wire()[:cut], st.builds(dns.message.make_query, _QNAMES,
                                                                             st.sampled_from(["A", "AAAA"])),
                                st.integers(0, 80))))
def test_any_datagram_is_dropped_or_answered_with_its_own_id(wire: bytes) -> None:
    out = ns_answer.answer(wire, _REC, _ZONES, udp=True)
    if out is None:
        branch("dropped")
        return
    branch("answered")
    resp = dns.message.from_wire(out)
    assert resp.id == int.from_bytes(wire[:2], "big") and resp.flags & dns.flags.QR


# ------------------------------------------------------------------------------------------------- grants

_GROUP = st.one_of(st.sampled_from(["system:masters", "dev", "ops", "a b"]), _LABEL)


@reaches("accepted")
@given(rules=st.lists(st.lists(_GROUP, max_size=3), max_size=4), legacy=st.booleans())
def test_grants_merge_their_groups_in_order_each_once(rules: list[list[str]], legacy: bool) -> None:
    cap = identity.CAP_KUBERNETES_OLD if legacy else identity.CAP_KUBERNETES
    cap_map = {cap: [{"impersonate": {"groups": g}, "enableEvents": False} for g in rules]}
    groups, n = identity.grant_groups(cap_map)
    branch("accepted")
    want: list[str] = []
    for g in rules:
        for x in g:
            if x not in want:
                want.append(x)
    assert (groups, n) == (tuple(want), len(rules))
    # the same rules as a tagged caller's: its groups, or its tags when the rules give none
    imp = identity.impersonation({"Node": {"Name": "proxy.tail.example.com.", "Tags": ["tag:k8s"]},
                                  "CapMap": cap_map})
    assert imp.user == "proxy.tail.example.com" and imp.groups == (tuple(want) or ("tag:k8s",))


_RULE = {"impersonate": {"groups": ["dev"]}, "recorder": ["tag:rec"], "enforceRecorder": False}


@reaches("accepted", "refused")
@given(cap_map=st.one_of(shaped({identity.CAP_KUBERNETES: [_RULE, _RULE]}),
                         st.dictionaries(st.sampled_from([identity.CAP_KUBERNETES, identity.CAP_KUBERNETES_OLD]),
                                         st.one_of(st.lists(shaped(_RULE), max_size=3), json_values(4)),
                                         max_size=2)))
def test_a_grant_is_read_or_refused_naming_the_rule(cap_map: Any) -> None:
    if not isinstance(cap_map, dict):
        cap_map = {identity.CAP_KUBERNETES: cap_map}
    try:
        groups, _ = identity.grant_groups(cap_map)
    except identity.GrantError as e:
        branch("refused")
        assert "capability" in str(e) and ("rule " in str(e) or "want a list of rules" in str(e)), str(e)
        return
    branch("accepted")
    assert len(set(groups)) == len(groups)
    assert all(isinstance(g, str) and g and g == g.strip() and "\n" not in g for g in groups)


# ---------------------------------------------------------------------------------------------- DNSConfig

_DNSCONFIG = {"apiVersion": "tailscale.com/v1alpha1", "kind": "DNSConfig",
              "metadata": {"name": "ts-dns", "uid": "u1"},
              "spec": {"nameserver": {"replicas": 2, "service": {"clusterIP": "10.96.0.53"},
                                      "image": {"repo": "registry.local/ns", "tag": "v1"},
                                      "pod": {"tolerations": [{"key": "a", "operator": "Exists"}]}}}}
_CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1", magicdns_suffix="tail.example")
_DNS_CRD = next(c for c in project_crds() if c.kind == "DNSConfig")
#: what the schema lets through but the controller must refuse, next to what it accepts
_CLUSTER_IPS = st.sampled_from(["", "10.96.0.53", "fd00:10:96::53", " 10.96.0.53 ", "10.96.0.999", "ten", "::g"])
_REPLICAS = st.one_of(st.none(), st.integers(-3, 5))
_IMAGE_PARTS = st.sampled_from(["", "registry.local/ns", "v1.2", "sha256:ab", "bad repo", "-x", "a\nb"])


@st.composite
def _dnsconfigs(draw: st.DrawFn) -> Any:
    if draw(st.booleans()):
        obj = draw(shaped(_DNSCONFIG))
        # metadata is the API server's: an object with the name and uid, whatever the user wrote
        return {**obj, "metadata": _DNSCONFIG["metadata"]} if isinstance(obj, dict) else obj
    ns: dict[str, Any] = {"service": {"clusterIP": draw(_CLUSTER_IPS)},
                          "image": {"repo": draw(_IMAGE_PARTS), "tag": draw(_IMAGE_PARTS)}}
    if (r := draw(_REPLICAS)) is not None:
        ns["replicas"] = r
    return {**_DNSCONFIG, "spec": {"nameserver": ns}}


@reaches("accepted", "refused", "refused by the schema")
@given(obj=_dnsconfigs(), domain=st.sampled_from(["", "tail.example.com"]))
def test_a_dnsconfig_renders_what_it_says_or_is_refused_naming_the_field(obj: Any, domain: str) -> None:
    """What the CRD's schema lets through (as the API server applies it, tests/support/crdschema.py) is either
    rendered into objects that say what the spec said, or refused with the field named."""
    if not isinstance(obj, dict) or problems({k: v for k, v in prune(obj, _DNS_CRD.schema).items()
                                              if k != "metadata"}, _DNS_CRD.schema):
        branch("refused by the schema")
        return
    obj = prune(obj, _DNS_CRD.schema)
    ns = obj["spec"]["nameserver"]
    try:
        out = dc.render(obj, _CFG, domain)
    except dc.DNSConfigInvalid as e:
        branch("refused")
        assert str(e).startswith("spec.nameserver."), str(e)
        return
    branch("accepted")
    json.dumps([out.deployment, out.service, out.service_account])
    replicas = ns.get("replicas")
    assert out.deployment["spec"]["replicas"] == (1 if replicas is None else replicas)
    cip = ((ns.get("service") or {}).get("clusterIP") or "").strip()
    assert out.service["spec"].get("clusterIP", "") == cip
    container = out.deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["env"] == [{"name": "TS_NAMESERVER_DOMAIN", "value": domain}] if domain else "env" not in container


# --------------------------------------------------------------------------------------------- the helper

def test_reaches_fails_a_test_whose_examples_never_reach_a_branch() -> None:
    @reaches("accepted", "refused")
    @given(x=st.integers(0, 10))
    def only_accepts(x: int) -> None:
        branch("accepted")

    with pytest.raises(AssertionError, match=r"no example reached \['refused'\]"):
        only_accepts()

