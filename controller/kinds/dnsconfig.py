"""DNSConfig: the cluster's nameserver for MagicDNS names and its records (pure: objects in, objects out).

Upstream's resource (``tailscale.com/v1alpha1``, kind ``DNSConfig``, cluster-scoped, one per cluster) and
upstream's rendering: a Deployment ``nameserver`` (port 1053 UDP and TCP), its ServiceAccount, a Service
``nameserver`` (port 53 to 1053, at ``spec.nameserver.service.clusterIP`` when set) and the ConfigMap
``dnsrecords`` whose ``records.json`` the nameserver serves (the ``nameserver`` package). Every object is owned
by the DNSConfig, so the garbage collector removes them with it.

The records (as upstream's dnsrecords reconciler, computed whole on each pass rather than edited one by one):

- each egress Service with ``tailscale.com/tailnet-fqdn``: that name -> its proxy Pods' IPs;
- each tailnet Ingress: its MagicDNS name (``status.loadBalancer.ingress[0].hostname``) -> its proxy Pods' IPs
  (reachable when the Ingress has ``tailscale.com/experimental-forward-cluster-traffic-via-ingress``, which makes
  the proxy serve on its Pod IP too);

the Pod IPs being the ready endpoints of the proxy's headless Service, IPv4 and IPv6; an egress Service on a
ProxyGroup gets its ClusterIP Service's addresses instead (as upstream). A proxy whose parent is gone, or whose
Pods are not ready, has no record.

The stub zone (``with_stub_zone``): beyond upstream, the controller can keep a marked block in CoreDNS's
Corefile that forwards the tailnet's domain to the nameserver, touching nothing else in the file.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tscommon.dnsrecords import CONFIGMAP as RECORDS_CONFIGMAP
from tscommon.dnsrecords import KEY as RECORDS_KEY
from tscommon.dnsrecords import render as render_records

from ..config import TAILSCALE_LOGIN_SERVER, ControllerConfig
from ..kindfacts import DNS_NAME_ANNOTATION, DNS_NAME_STATUS, FACTS
from ..model import (
    ANN_TAILNET_FQDN,
    DNSCONFIG,
    LABEL_MANAGED,
    LABEL_PARENT_NAME,
    LABEL_PARENT_NS,
    LABEL_PARENT_TYPE,
    LABEL_SVC_TYPE,
)
from ..model import COND_NAMESERVER_READY as COND_NAMESERVER_READY
from ..render import hashed
from ..validation import upstream_nameserver_problem
from . import labels, meta

_FACTS = FACTS[DNSCONFIG]
GROUP, VERSION, PLURAL, KIND = _FACTS.api_names
REASON_CREATED = _FACTS.ready_reason
REASON_FAILED = _FACTS.failed_reason
REASON_MULTIPLE = "MultipleDNSConfigsPresent"
MESSAGE_MULTIPLE = ("Multiple DNSConfig resources found in cluster. Please ensure no more than one is present.")

NAME = "nameserver"                 # the Deployment, Service and ServiceAccount
PORT = 1053
APP_LABEL = {"app": NAME}
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
#: The queue key of the single pass that keeps the nameserver and its records.
QUEUE_KEY = (DNSCONFIG, "", "")

STUB_BEGIN = "# BEGIN tailscale-controller stub zone (managed by the controller; edits here are overwritten)"
STUB_END = "# END tailscale-controller stub zone"


class DNSConfigInvalid(ValueError):
    """The DNSConfig asks for something that cannot be built; the message names the field, value and fix."""


@dataclass(frozen=True)
class Choice:
    """Which DNSConfig is in force (the oldest) and which are refused for being extra."""
    active: Mapping[str, Any] | None
    extra: tuple[Mapping[str, Any], ...] = ()


def choose(dnsconfigs: Iterable[Mapping[str, Any]]) -> Choice:
    """The oldest DNSConfig (creation time, then name) is the one in force; a second one changes nothing that
    works already and is refused with a condition."""
    live = sorted((d for d in dnsconfigs if not meta(d).get("deletionTimestamp")),
                  key=lambda d: (meta(d).get("creationTimestamp") or "", meta(d).get("name") or ""))
    if not live:
        return Choice(None)
    return Choice(live[0], tuple(live[1:]))


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((obj.get("spec") or {}).get("nameserver") or {})


def validate(obj: Mapping[str, Any]) -> None:
    """Raise DNSConfigInvalid for a spec the API server's schema let through but that cannot work."""
    ns = _spec(obj)
    ip = ((ns.get("service") or {}).get("clusterIP") or "").strip()
    if ip:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise DNSConfigInvalid(
                f"spec.nameserver.service.clusterIP {ip!r} is not an IP address; set an unused address of the "
                "cluster's Service range (e.g. 10.96.0.53) or leave it out to get one allocated") from None
    replicas = ns.get("replicas")
    if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0):
        raise DNSConfigInvalid(f"spec.nameserver.replicas {replicas!r} must be a whole number, 0 or more")
    image = ns.get("image") or {}
    for key in ("repo", "tag"):
        v = image.get(key) or ""
        if v and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*", v):
            raise DNSConfigInvalid(f"spec.nameserver.image.{key} {v!r} is not an image {key}")


def image_problem(obj: Mapping[str, Any], cfg: ControllerConfig, domain: str) -> str:
    """"" or why the image the DNSConfig names cannot answer for the tailnet's domain (upstream's nameserver
    answers only under ts.net: with headscale's base_domain it would answer nothing)."""
    on_tailscale = cfg.server_url.rstrip("/") == TAILSCALE_LOGIN_SERVER
    return upstream_nameserver_problem(str((_spec(obj).get("image") or {}).get("repo") or ""), domain, on_tailscale)


def image(obj: Mapping[str, Any], cfg: ControllerConfig) -> tuple[str, bool]:
    """(image, is the proxy image): the nameserver is an entrypoint of the proxy image unless the DNSConfig
    names another image (which then must run its nameserver as its entrypoint, like upstream's)."""
    img = _spec(obj).get("image") or {}
    repo, tag = (img.get("repo") or "").strip(), (img.get("tag") or "").strip()
    if not repo:
        if not tag:
            return cfg.proxy_image, True
        base = cfg.proxy_image.split("@", 1)[0]
        if ":" in base.rsplit("/", 1)[-1]:
            base = base.rsplit(":", 1)[0]
        return f"{base}:{tag}", True
    return f"{repo}:{tag or 'latest'}", False


def _labels() -> dict[str, str]:
    return {LABEL_MANAGED: "true", LABEL_PARENT_TYPE: "nameserver", **APP_LABEL}


def _owner(obj: Mapping[str, Any]) -> list[dict]:
    m = meta(obj)
    return [{"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": m.get("name", ""), "uid": m.get("uid", ""),
             "controller": True, "blockOwnerDeletion": True}]


def _metadata(name: str, obj: Mapping[str, Any], cfg: ControllerConfig) -> dict:
    return {"name": name, "namespace": cfg.namespace, "labels": _labels(), "ownerReferences": _owner(obj)}


@dataclass(frozen=True)
class Nameserver:
    service_account: dict
    deployment: dict
    service: dict


def render(obj: Mapping[str, Any], cfg: ControllerConfig, domain: str) -> Nameserver:
    """The nameserver's objects for the DNSConfig in force (validated first). `domain`: the tailnet's domain,
    "" to let the nameserver take it from its record names."""
    validate(obj)
    ns = _spec(obj)
    img, ours = image(obj, cfg)
    pod = ns.get("pod") or {}
    container: dict[str, Any] = {
        "name": NAME, "image": img, "imagePullPolicy": cfg.image_pull_policy,
        "ports": [{"name": "dns", "containerPort": PORT, "protocol": "UDP"},
                  {"name": "dns-tcp", "containerPort": PORT, "protocol": "TCP"}],
        "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}],
        "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
        # No privileges: an unprivileged port, nothing written.
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if ours:
        container["command"] = ["/usr/local/bin/k8s-nameserver"]
    if domain:
        container["env"] = [{"name": "TS_NAMESERVER_DOMAIN", "value": domain}]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": NAME, "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": RECORDS_CONFIGMAP}}],
    }
    for k in ("tolerations", "affinity", "nodeSelector"):
        if pod.get(k):
            pod_spec[k] = pod[k]
    replicas = ns.get("replicas")
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(NAME, obj, cfg),
        "spec": {"replicas": 1 if replicas is None else replicas, "revisionHistoryLimit": 3,
                 "selector": {"matchLabels": dict(APP_LABEL)},
                 "template": {"metadata": {"labels": _labels()}, "spec": pod_spec}},
    }
    svc_spec: dict[str, Any] = {"type": "ClusterIP", "selector": dict(APP_LABEL),
                                "ports": [{"name": "dns", "port": 53, "targetPort": PORT, "protocol": "UDP"},
                                          {"name": "dns-tcp", "port": 53, "targetPort": PORT, "protocol": "TCP"}]}
    cip = ((ns.get("service") or {}).get("clusterIP") or "").strip()
    if cip:
        svc_spec["clusterIP"] = cip
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(NAME, obj, cfg), "spec": svc_spec}
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(NAME, obj, cfg),
          "automountServiceAccountToken": False}
    return Nameserver(hashed(sa), hashed(deployment), hashed(service))


def records_configmap(obj: Mapping[str, Any], cfg: ControllerConfig, text: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(RECORDS_CONFIGMAP, obj, cfg),
            "data": {RECORDS_KEY: text}}


# ---- records -------------------------------------------------------------------------------------------------

def _ready(ep: Mapping[str, Any]) -> bool:
    """An endpoint takes new traffic unless it says otherwise (EndpointSlice conditions: nil means yes)."""
    c = ep.get("conditions") or {}
    return c.get("ready") is not False and c.get("serving") is not False and c.get("terminating") is not True


def proxy_ips(slices: Iterable[Mapping[str, Any]], service: str) -> list[str]:
    out: list[str] = []
    for s in slices:
        if labels(s).get(LABEL_SERVICE_NAME) != service:
            continue
        for ep in s.get("endpoints") or []:
            if _ready(ep):
                out += [a for a in ep.get("addresses") or [] if a not in out]
    return out


def record_name(headless: Mapping[str, Any], parents: Mapping[tuple[str, str, str], Mapping[str, Any]]) -> str:
    """The MagicDNS name a proxy's headless Service carries a record for, or ""."""
    lb = labels(headless)
    kind = lb.get(LABEL_PARENT_TYPE)
    parent = parents.get((kind or "", lb.get(LABEL_PARENT_NS, ""), lb.get(LABEL_PARENT_NAME, "")))
    if parent is None or meta(parent).get("deletionTimestamp"):
        return ""
    facts = FACTS.get(kind or "")
    where = facts.dns_name if facts else ""
    if where == DNS_NAME_ANNOTATION:
        return (meta(parent).get("annotations") or {}).get(ANN_TAILNET_FQDN, "").strip().rstrip(".").lower()
    if where == DNS_NAME_STATUS:
        ing = ((parent.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        return (ing[0].get("hostname") or "").strip().rstrip(".").lower() if ing else ""
    return ""


def _addresses(svc: Mapping[str, Any], slices: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where a proxy's Service sends cluster traffic: a single proxy's headless Service -> its ready Pods; a
    ProxyGroup egress Service (label ``tailscale.com/svc-type: egress``) -> its ClusterIPs, as upstream."""
    spec = svc.get("spec") or {}
    if spec.get("clusterIP") == "None":
        return proxy_ips(slices, meta(svc).get("name", ""))
    if labels(svc).get(LABEL_SVC_TYPE) == "egress":
        return [ip for ip in spec.get("clusterIPs") or [spec.get("clusterIP")] if ip and ip != "None"]
    return []


def records(services: Sequence[Mapping[str, Any]], parents: Mapping[tuple[str, str, str], Mapping[str, Any]],
            slices: Sequence[Mapping[str, Any]]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(ip4, ip6) for every proxy with a MagicDNS name and somewhere to send it (`services`: the controller's
    Services in its namespace)."""
    ip4: dict[str, list[str]] = {}
    ip6: dict[str, list[str]] = {}
    for h in sorted(services, key=lambda o: meta(o).get("name", "")):
        if meta(h).get("deletionTimestamp"):
            continue
        name = record_name(h, parents)
        if not name:
            continue
        for ip in _addresses(h, slices):
            fam = ip4 if ipaddress.ip_address(ip).version == 4 else ip6
            if ip not in fam.setdefault(name, []):
                fam[name].append(ip)
    return ({k: sorted(v) for k, v in ip4.items() if v}, {k: sorted(v) for k, v in ip6.items() if v})


def records_text(headless: Sequence[Mapping[str, Any]], parents: Mapping[tuple[str, str, str], Mapping[str, Any]],
                 slices: Sequence[Mapping[str, Any]]) -> str:
    return render_records(*records(headless, parents, slices))


def parent_keys(headless: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """The parents to read for these headless Services: those whose kind's proxies have a MagicDNS name for the
    records (egress Services and Ingresses: kindfacts.KindFacts.dns_name)."""
    out = []
    for h in headless:
        lb = labels(h)
        key = (lb.get(LABEL_PARENT_TYPE, ""), lb.get(LABEL_PARENT_NS, ""), lb.get(LABEL_PARENT_NAME, ""))
        if key[0] in FACTS and FACTS[key[0]].dns_name and key not in out:
            out.append(key)
    return out


def domain(cfg: ControllerConfig, names: Iterable[str]) -> str:
    """The tailnet's domain: TS_MAGICDNS_SUFFIX when set, else the one domain the record names share ("" when
    there is none yet, or several)."""
    if cfg.magicdns_suffix:
        return cfg.magicdns_suffix.strip(".").lower()
    parents = {n.split(".", 1)[1] for n in names if n.count(".") >= 2}
    return parents.pop() if len(parents) == 1 else ""


# ---- the stub zone -------------------------------------------------------------------------------------------

def stub_zone_block(zone: str, nameserver: str, port: int = 53) -> str:
    """The Corefile server block (on CoreDNS's `port`) that forwards the tailnet's domain to the nameserver
    (no cache: the records change as proxy Pods move)."""
    return (f"{STUB_BEGIN}\n{zone}:{port} {{\n    errors\n    forward . {nameserver}\n}}\n{STUB_END}\n")


_BLOCK = re.compile(rf"\n?{re.escape(STUB_BEGIN)}\n.*?{re.escape(STUB_END)}\n?", re.S)


def with_stub_zone(corefile: str, zone: str, nameserver_ip: str, *, port: int = 53) -> str:
    """`corefile` with the controller's own block replaced (or added, or removed when `zone` or the address is
    empty); everything outside the markers is kept byte for byte."""
    rest = _BLOCK.sub("\n", corefile) if STUB_BEGIN in corefile else corefile
    if STUB_BEGIN in corefile and not rest.strip("\n"):
        rest = ""
    if not (zone and nameserver_ip):
        return rest
    if rest and not rest.endswith("\n"):
        rest += "\n"
    return rest + stub_zone_block(zone, nameserver_ip, port)
