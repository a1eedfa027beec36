"""Services: L3 ingress (expose annotation or the `tailscale` LoadBalancer class) and L3 egress (tailnet-ip /
tailnet-fqdn annotations), as upstream's operator selects and validates them.

Beyond upstream: a dual-stack Service's two ClusterIPs both go into TS_DEST_IP (the agent DNATs each family to
its own address; upstream passes only the first, so the proxy's IPv6 tailnet address led nowhere).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import ControllerConfig
from ..model import (
    ANN_EXPOSE,
    ANN_HOSTNAME,
    ANN_LAST_CLUSTER_IP,
    ANN_LAST_DNS_NAME,
    ANN_LAST_TAILNET_FQDN,
    ANN_LAST_TAILNET_IP,
    ANN_PROXY_GROUP,
    ANN_TAGS,
    SVC,
    Decision,
    Invalid,
    Parent,
    Pending,
    ProxySpec,
)
from ..validation import hostname_problem, parse_tags, proxy_group_ingress_problem, tag_problems
from . import annotations_of, meta, tailnet

APP_INGRESS = "k8s-operator-ingress-proxy"
APP_EGRESS = "k8s-operator-egress-proxy"


def is_egress(svc: Mapping[str, Any]) -> bool:
    return tailnet.is_egress(annotations_of(svc))


def handled(svc: Mapping[str, Any], cfg: ControllerConfig) -> bool:
    """Whether the Service asks for a proxy from this controller. An exposed Service naming a ProxyGroup asks
    for one too (refused by `decide`, saying why); an egress Service naming one is `kinds.egress`'s."""
    ann = annotations_of(svc)
    if ann.get(ANN_PROXY_GROUP) and is_egress(svc):
        return False
    if is_egress(svc) or ann.get(ANN_EXPOSE) == "true":     # opt.Bool: only the exact "true" counts
        return True
    spec = svc.get("spec") or {}
    if spec.get("type") == "LoadBalancer":
        cls = spec.get("loadBalancerClass")
        return cls == "tailscale" or (cls is None and cfg.default_load_balancer)
    return False


def is_load_balancer(svc: Mapping[str, Any]) -> bool:
    spec = svc.get("spec") or {}
    return spec.get("type") == "LoadBalancer" and spec.get("loadBalancerClass") in ("tailscale", None)


def decide(svc: Mapping[str, Any], cfg: ControllerConfig) -> Decision:
    m, ann, spec = meta(svc), annotations_of(svc), svc.get("spec") or {}
    ns, name = m.get("namespace", ""), m.get("name", "")
    parent = Parent(SVC, name, ns, m.get("uid", ""))
    tip, tfqdn = tailnet.target_of(ann)
    problems = tailnet.target_problems(tip, tfqdn, cfg.magicdns_suffix)
    hostname = ann.get(ANN_HOSTNAME, "").strip()
    if hostname and (p := hostname_problem(hostname)):
        problems.append(f"annotation {ANN_HOSTNAME}: {p}")
    tags = parse_tags(ann[ANN_TAGS]) if ann.get(ANN_TAGS, "").strip() else cfg.proxy_tags
    if p := tag_problems(tags):
        problems.append(f"annotation {ANN_TAGS}: {p}")
    egress = bool(tip or tfqdn)
    if not egress and ann.get(ANN_PROXY_GROUP, "").strip():
        problems.append(proxy_group_ingress_problem("an exposed Service", cfg.provider))
    if not egress and spec.get("clusterIP") == "None":
        problems.append("headless Services are not supported: the proxy forwards to the Service's ClusterIP; "
                        "remove clusterIP: None or expose a Service that has a ClusterIP")
    if problems:
        raise Invalid("; ".join(problems))
    hostname = hostname or f"{ns}-{name}"
    if egress:
        if tip:
            env, pod_ann = (("TS_TAILNET_TARGET_IP", tip),), ((ANN_LAST_TAILNET_IP, tip),)
        else:
            fq = tfqdn if tfqdn.endswith(".") else tfqdn + "."
            env, pod_ann = (("TS_TAILNET_TARGET_FQDN", fq),), ((ANN_LAST_TAILNET_FQDN, fq),)
        return Decision(ProxySpec(parent, hostname, tags, APP_EGRESS, env, pod_ann, egress_rewrite=True))
    if spec.get("type") == "ExternalName":
        dns = (spec.get("externalName") or "").strip()
        if not dns:
            raise Invalid("spec.externalName is empty; set the DNS name the proxy should forward to")
        return Decision(ProxySpec(parent, hostname, tags, APP_INGRESS, (("TS_EXPERIMENTAL_DEST_DNS_NAME", dns),),
                                  ((ANN_LAST_DNS_NAME, dns),)))
    ips = [ip for ip in (spec.get("clusterIPs") or []) if ip and ip != "None"]
    if not ips and spec.get("clusterIP") not in (None, "", "None"):
        ips = [spec["clusterIP"]]
    if not ips:
        raise Pending("the Service has no ClusterIP yet")
    dest = ",".join(ips[:2])
    return Decision(ProxySpec(parent, hostname, tags, APP_INGRESS, (("TS_DEST_IP", dest),),
                              ((ANN_LAST_CLUSTER_IP, dest),)))


def egress_rewrite_patch(svc: Mapping[str, Any], headless_name: str, cfg: ControllerConfig) -> dict | None:
    """The merge patch that points the user's egress Service at the proxy's headless Service, or None when it
    already does (so a second pass writes nothing)."""
    spec = svc.get("spec") or {}
    target = f"{headless_name}.{cfg.namespace}.svc.{cfg.cluster_domain}"
    if spec.get("type") == "ExternalName" and spec.get("externalName") == target and not spec.get("selector"):
        return None
    return {"spec": {"type": "ExternalName", "externalName": target, "selector": None}}
