"""Connectors (`tailscale.com/v1alpha1`, upstream's field names): subnet routers and exit nodes.

A Connector that asks for both is built, as upstream's: one device advertises the subnet routes and the default
routes. That works, measured with tailscaled v1.102.3 (netns-tests/test_connector_e2e.py: a client using the
device as its exit node reaches the subnet and the outside through it, both families); a Normal event says how
to split the two roles when they should scale or fail apart. spec.appConnector and spec.tailnet (upstream's
multi-tailnet) are refused: a false condition and a Warning event.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from ..config import ControllerConfig
from ..model import CONNECTOR, Decision, Invalid, Parent, ProxySpec
from ..resources import CONNECTORS
from ..validation import hostname_problem, route_problem, tag_problems, tailnet_field_problem
from . import meta

APP = "k8s-operator-connector-resource"
GROUP, VERSION, PLURAL = CONNECTORS.group, CONNECTORS.version, CONNECTORS.plural
REASON_BOTH = "SubnetRouterAndExitNode"
BOTH_MESSAGE = ("the Connector's devices are both a subnet router and an exit node (spec.subnetRouter and "
                "spec.exitNode: true): clients that use them as exit node reach the subnet through them too. To "
                "scale or restart the two roles apart, use two Connectors, one with spec.subnetRouter and one "
                "with spec.exitNode: true")


def handled(conn: Mapping[str, Any], cfg: ControllerConfig) -> bool:
    return True


def advertise_routes(routes: tuple[str, ...], exit_node: bool) -> tuple[str, ...]:
    """Deduplicated, sorted by prefix length then family and address; an exit node adds 0.0.0.0/0 and ::/0."""
    nets = {ipaddress.ip_network(r.strip(), strict=False) for r in routes}
    if exit_node:
        nets |= {ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0")}
    return tuple(str(n) for n in sorted(nets, key=lambda n: (n.prefixlen, n.version, int(n.network_address))))


def decide(conn: Mapping[str, Any], cfg: ControllerConfig) -> Decision:
    m, spec = meta(conn), conn.get("spec") or {}
    name = m.get("name", "")
    sr = spec.get("subnetRouter")
    exit_node = spec.get("exitNode") is True
    problems: list[str] = []
    if spec.get("appConnector") is not None:
        problems.append("spec.appConnector is not supported by this controller; use spec.subnetRouter or "
                        "spec.exitNode")
    if spec.get("tailnet"):
        problems.append(tailnet_field_problem("Connector"))
    if sr is None and not exit_node and spec.get("appConnector") is None:
        problems.append("the Connector asks for nothing; set spec.subnetRouter.advertiseRoutes or "
                        "spec.exitNode: true")
    routes: tuple[str, ...] = ()
    if sr is not None:
        routes = tuple(str(r) for r in (sr.get("advertiseRoutes") or []))
        if not routes:
            problems.append("spec.subnetRouter.advertiseRoutes is empty; list at least one CIDR")
        for r in routes:
            if p := route_problem(r):
                problems.append(f"spec.subnetRouter.advertiseRoutes: {p}")
            elif ipaddress.ip_network(r.strip(), strict=False).prefixlen == 0:
                problems.append(f"spec.subnetRouter.advertiseRoutes: {r!r} is a default route; use "
                                "spec.exitNode: true (in its own Connector) for an exit node")
    replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 0:
        problems.append(f"spec.replicas={replicas!r} must be a whole number >= 0")
        replicas = 1
    hostname, prefix = spec.get("hostname") or "", spec.get("hostnamePrefix") or ""
    if hostname and prefix:
        problems.append("spec.hostname and spec.hostnamePrefix are mutually exclusive; keep one")
    if hostname and replicas > 1:
        problems.append("spec.hostname cannot be used with spec.replicas > 1 (the replicas would share one "
                        "name); use spec.hostnamePrefix")
    if hostname and (p := hostname_problem(hostname)):
        problems.append(f"spec.hostname: {p}")
    if prefix and (p := hostname_problem(prefix + "-0")):
        problems.append(f"spec.hostnamePrefix: {p}")
    tags = tuple(spec.get("tags") or ()) or cfg.proxy_tags
    if p := tag_problems(tags):
        problems.append(f"spec.tags: {p}")
    if problems:
        raise Invalid("; ".join(problems))
    adv = advertise_routes(routes, exit_node)
    notices = (("Normal", REASON_BOTH, BOTH_MESSAGE),) if sr is not None and exit_node else ()
    return Decision(ProxySpec(Parent(CONNECTOR, name, "", m.get("uid", "")), hostname or f"{name}-connector",
                              tags, APP, advertise_routes=adv, replicas=replicas, hostname_prefix=prefix,
                              subnet_routes=routes, exit_node=exit_node), notices=notices)
