"""This chart's CRDs accept whatever upstream's (tailscale.com v1.102.3, from the Go module cache) accept, so an
object written for upstream's operator is stored whole, neither refused by the API server nor pruned: each
schema is compared with upstream's node by node (labtools.upstreamchart.schema_gaps) and upstream's own
examples are checked against ours. What the controller then does not build, it refuses on the object
(tests/test_upstream_unsupported.py). Without the module (and no way to download it) these tests skip, and fail
under CI.
"""
from __future__ import annotations

import os

import pytest
import yaml

from controller.config import ControllerConfig
from controller.kinds import connector
from controller.kinds import proxyclass as pcl
from labtools import helmchart, upstreamchart

#: our rule text -> upstream's, for CEL rules that say the same with other words (checked by reading)
EQUIVALENT_RULES = {
    # "no appConnector together with a subnet router or an exit node": !A || (!S && !E) == !((S || E) && A)
    "!has(self.appConnector) || (!has(self.subnetRouter) && (!has(self.exitNode) || self.exitNode == false))":
        "!((has(self.subnetRouter) || (has(self.exitNode) && self.exitNode == true)) && has(self.appConnector))",
}
#: upstream's kinds this chart does not install (docs/install-tailscale.md says what happens to their objects)
NOT_SHIPPED = {"tailnets.tailscale.com", "peerrelays.tailscale.com",
               "proxygrouppolicies.tailscale.com"}


@pytest.fixture(scope="module")
def upstream():
    if upstreamchart.module_dir() is None:
        reason = f"{upstreamchart.MODULE} is not in the Go module cache and could not be downloaded"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set, so these tests must run, but {reason}")
        pytest.skip(reason)
    return upstreamchart.crds()


def ours() -> dict[str, dict]:
    out = {}
    for f in sorted((helmchart.DEPLOY / "crds").glob("*.yaml")):
        obj = next(d for d in yaml.safe_load_all(f.read_text()) if d)
        out[obj["metadata"]["name"]] = obj
    return out


def _gaps(up, mine):
    gaps = upstreamchart.crd_gaps(up, mine)
    return [g for g in gaps if not any(f"rule {o!r} is not upstream's" in g for o in EQUIVALENT_RULES)]


def test_every_crd_accepts_what_upstreams_accepts(upstream):
    mine = ours()
    assert set(upstream) - set(mine) == NOT_SHIPPED
    for name, crd in mine.items():
        assert _gaps(upstream[name], crd) == [], name
    # the equivalences above name rules that exist on both sides (a stale entry would hide a real gap)
    conn_up = upstream["connectors.tailscale.com"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    conn = mine["connectors.tailscale.com"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    for o, u in EQUIVALENT_RULES.items():
        assert o in upstreamchart._rules(conn["spec"]) and u in upstreamchart._rules(conn_up["spec"])


def test_upstreams_examples_are_accepted_whole(upstream):
    mine = {c["spec"]["names"]["kind"]: c for c in ours().values()}
    checked = set()
    for ex in upstreamchart.examples():
        if ex["kind"] not in mine:
            assert f"{ex['kind'].lower()}s.tailscale.com" in NOT_SHIPPED, ex["kind"]
            continue
        schema = mine[ex["kind"]]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert upstreamchart.object_problems(ex, schema) == [], (ex["kind"], ex["metadata"]["name"])
        checked.add(ex["kind"])
    assert checked == {"Connector", "DNSConfig", "ProxyClass", "ProxyGroup", "Recorder"}


def test_the_comparison_finds_a_narrower_schema():
    up = {"type": "object", "properties": {"op": {"type": "string"}, "tailnet": {"type": "string"},
                                           "n": {"type": "integer", "minimum": 0}}}
    mine = {"type": "object", "properties": {"op": {"type": "string", "enum": ["Exists", "Equal"]},
                                             "n": {"type": "integer", "minimum": 1}}}
    gaps = upstreamchart.schema_gaps(up, mine)
    assert ".op: enum ['Exists', 'Equal'] refuses upstream's any value" in gaps
    assert ".tailnet: not declared (pruned on write)" in gaps
    assert ".n: minimum 1, upstream 0" in gaps
    assert sorted(upstreamchart.object_problems({"tailnet": "x", "op": ""}, mine)) == [
        ".op: '' is not one of ['Exists', 'Equal']", ".tailnet: not declared (pruned on write)"]


def test_objects_upstream_accepts_that_the_controller_refuses_or_takes():
    pc_schema = ours()["proxyclasses.tailscale.com"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pc = {"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyClass", "metadata": {"name": "p"},
          "spec": {"statefulSet": {"pod": {"tolerations": [
              {"key": "dedicated", "operator": "", "value": "edge", "effect": "NoSchedule"}]}}}}
    assert upstreamchart.object_problems(pc, pc_schema) == []
    assert pcl.validate(pc).ok           # operator "" is Equal, as in Kubernetes
    cn_schema = ours()["connectors.tailscale.com"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    both = {"apiVersion": "tailscale.com/v1alpha1", "kind": "Connector", "metadata": {"name": "c"},
            "spec": {"subnetRouter": {"advertiseRoutes": ["10.40.0.0/16"]}, "exitNode": True}}
    assert upstreamchart.object_problems(both, cn_schema) == []
    rules = upstreamchart._rules(cn_schema["properties"]["spec"])
    assert not [r for r in rules if "exitNode == true)" in r and r.startswith("!(has(self.subnetRouter)")]
    assert connector.decide(both, ControllerConfig()).spec.exit_node     # built (measured: both roles work)
    pg_schema = ours()["proxygroups.tailscale.com"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pg = {"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyGroup", "metadata": {"name": "pg"},
          "spec": {"type": "egress", "tailnet": "other"}}
    assert upstreamchart.object_problems(pg, pg_schema) == []
