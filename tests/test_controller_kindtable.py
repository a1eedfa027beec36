"""controller.kindtable: each row agrees with itself and with the watches, so a kind added by a row alone is
whole (events name the object the API server knows, every parent kind has a pass, its children's events bring
a pass of it)."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from controller.handlers import child_key
from controller.kindfacts import DNS_NAME_ANNOTATION, DNS_NAME_STATUS, FACTS
from controller.kindtable import KINDS, PARENT, PARENT_KINDS
from controller.reconcile import Reconciler
from labtools import helmchart
from tests.support.fakekube import FakeKube, FakeProvider
from tests.test_controller_reconcile import CFG


def test_every_custom_kind_is_the_crd_the_chart_installs() -> None:
    """The facts name each custom resource as its CRD does (events and ownerReferences carry them), and the
    table of the shell is the facts' rows, one for one."""
    crds = {}
    for f in sorted((helmchart.DEPLOY / "crds").glob("*.yaml")):
        crd = next(d for d in yaml.safe_load_all(f.read_text()) if d)
        crds[crd["spec"]["names"]["plural"]] = crd
    custom = [f for f in FACTS.values() if f.resource.group == "tailscale.com"]
    assert {f.resource.plural for f in custom} == set(crds)
    for f in custom:
        crd = crds[f.resource.plural]
        served = [v["name"] for v in crd["spec"]["versions"] if v.get("served")]
        assert (crd["spec"]["group"], crd["spec"]["names"]["kind"], crd["spec"]["scope"] == "Namespaced") == \
            (f.resource.group, f.kind, f.namespaced), f.key
        assert f.resource.version in served and f.api_version == f"tailscale.com/{f.resource.version}", f.key
    assert set(KINDS) == set(FACTS)
    for key, info in KINDS.items():
        assert all(getattr(info, fl.name) == getattr(FACTS[key], fl.name) for fl in dataclasses.fields(FACTS[key]))


def test_pure_modules_read_the_kind_from_its_facts() -> None:
    """What a kind's row says is what the renderer, the readiness and the records do with it."""
    from controller import render
    from controller import status as st
    from controller.kinds import dnsconfig as dc
    from controller.model import Parent, ProxySpec

    for key, f in FACTS.items():
        spec = ProxySpec(Parent(key, "p", "", "u"), "h", (), "app", advertise_routes=("10.0.0.0/8",))
        conf = render.tailscaled_config(spec, CFG, 0, "", 106)
        assert ("AdvertiseRoutes" in conf) == f.advertises_routes, key
        r = st.readiness(key, [], replicas=1, ready_replicas=0, invalid="bad")
        assert r.reason == f.invalid_reason
        headless = {"metadata": {"labels": {"tailscale.com/parent-resource-type": key,
                                            "tailscale.com/parent-resource": "p",
                                            "tailscale.com/parent-resource-ns": "ns"}}}
        parent = {"metadata": {"annotations": {"tailscale.com/tailnet-fqdn": "db.tail.ts.net"}},
                  "status": {"loadBalancer": {"ingress": [{"hostname": "web.tail.ts.net"}]}}}
        name = dc.record_name(headless, {(key, "ns", "p"): parent})
        assert name == {DNS_NAME_ANNOTATION: "db.tail.ts.net", DNS_NAME_STATUS: "web.tail.ts.net", "": ""}[f.dns_name]
        assert bool(dc.parent_keys([headless])) == bool(f.dns_name), key


def test_every_parent_kind_is_decided_reported_and_dispatched() -> None:
    rec = Reconciler(FakeKube(), FakeProvider(), CFG)
    for info in KINDS.values():
        assert info.runs in rec.passes, info.key
        if info.runs == PARENT:
            assert info.decide is not None and info.handled is not None and info.proxy_type, info.key
    assert set(PARENT_KINDS) >= {k for k, i in KINDS.items() if i.runs == PARENT}


def test_every_parent_kinds_children_lead_back_to_it() -> None:
    for kind in PARENT_KINDS:
        labels = {"tailscale.com/managed": "true", "tailscale.com/parent-resource-type": kind,
                  "tailscale.com/parent-resource": "x", "tailscale.com/parent-resource-ns": "ns"}
        assert child_key({"metadata": {"labels": labels}}) == (kind, "ns", "x")
