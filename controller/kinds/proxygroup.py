"""ProxyGroups (`tailscale.com/v1alpha1`, upstream's field names): N proxies, each its own tailnet device.

Type `egress` is built: the replicas serve every egress Service that names the group
(`tailscale.com/proxy-group`). Types `ingress` and `kube-apiserver` serve through the control plane's Tailscale
Services (virtual IPs) with its TLS certificates; they are refused with a condition that says why: headscale
has neither, and with Tailscale this controller does not build them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..config import ControllerConfig
from ..model import PROXYGROUP, Invalid, Parent, ProxySpec
from ..resources import PROXYGROUPS
from ..validation import hostname_problem, tag_problems, tailnet_field_problem
from . import meta

GROUP, VERSION, PLURAL = PROXYGROUPS.group, PROXYGROUPS.version, PROXYGROUPS.plural
APP_EGRESS = "k8s-operator-proxygroup-egress"
TYPE_EGRESS = "egress"
TYPES = (TYPE_EGRESS, "ingress", "kube-apiserver")
DEFAULT_REPLICAS = 2


@dataclass(frozen=True)
class GroupSpec:
    """What one ProxyGroup asks for, validated."""

    name: str
    uid: str
    type: str
    replicas: int
    hostname_prefix: str        # replica i is <prefix>-<i>; the group's name when unset (as upstream)
    tags: tuple[str, ...]
    proxy_class: str = ""
    tags_given: bool = False     # spec.tags set: a class's --advertise-tags does not replace them

    @property
    def parent(self) -> Parent:
        return Parent(PROXYGROUP, self.name, "", self.uid)

    def proxy_spec(self) -> ProxySpec:
        """The ProxySpec whose replica config the single-proxy renderer already knows how to write."""
        return ProxySpec(self.parent, self.name, self.tags, APP_EGRESS, replicas=self.replicas,
                         hostname_prefix=self.hostname_prefix)


def unsupported_type_message(pg_type: str, provider: str) -> str:
    why = ("a ProxyGroup of type {t} serves through the control plane's Tailscale Services (virtual IPs) with "
           "its TLS certificates").format(t=pg_type)
    if provider == "headscale":
        return (f"spec.type={pg_type!r} is not supported: {why}, and headscale provides neither; use type egress, "
                "or one proxy per Ingress or Service")
    return (f"spec.type={pg_type!r} is not supported by this controller yet: {why}; use type egress, or one "
            "proxy per Ingress or Service")


def decide(pg: Mapping[str, Any], cfg: ControllerConfig, provider: str = "") -> GroupSpec:
    """The group's spec, or Invalid naming every problem (the field, the value and the fix)."""
    m, spec = meta(pg), pg.get("spec") or {}
    name = m.get("name", "")
    pg_type = spec.get("type") or ""
    if pg_type not in TYPES:
        raise Invalid(f"spec.type={pg_type!r} is not a ProxyGroup type; use egress")
    if pg_type != TYPE_EGRESS:
        raise Invalid(unsupported_type_message(pg_type, provider))
    problems: list[str] = []
    if spec.get("tailnet"):
        problems.append(tailnet_field_problem("ProxyGroup"))
    replicas = spec.get("replicas", DEFAULT_REPLICAS)
    if replicas is None:
        replicas = DEFAULT_REPLICAS
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        problems.append(f"spec.replicas={replicas!r} must be a whole number >= 0")
        replicas = DEFAULT_REPLICAS
    prefix = spec.get("hostnamePrefix") or name
    if p := hostname_problem(f"{prefix}-{max(replicas - 1, 0)}"):
        field = "spec.hostnamePrefix" if spec.get("hostnamePrefix") else "metadata.name (the default hostnamePrefix)"
        problems.append(f"{field}: {p}")
    tags = tuple(spec.get("tags") or ()) or cfg.proxy_tags
    if p := tag_problems(tags):
        problems.append(f"spec.tags: {p}")
    if problems:
        raise Invalid("; ".join(problems))
    return GroupSpec(name, m.get("uid", ""), pg_type, replicas, prefix, tags, str(spec.get("proxyClass") or ""),
                     tags_given=bool(spec.get("tags")))
