"""The kinds the controller acts on, as one table (pure): what each is in the API, and which pass runs it.

A row is the kind's facts (controller/kindfacts.py: its API resource, apiVersion and Kubernetes kind, which
events name the object with, its condition type and reasons, the `ts_proxy_type` label of its metrics, whether
its key carries a namespace) extended with what the shell needs: the pass that runs its queue keys, how to tell
that it is ours (`handled`), how to decide what it asks for (`decide`), which status fields its proxies'
state gives it, and the few facts that make it different (whether its proxies use certificates, whether the
default ProxyClass applies without a label). The passes (controller/passes/) read
the row; none of them switches on a kind's name. Adding a kind is adding a row (docs/controller-internals.md).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from . import status as st
from .config import ControllerConfig
from .kindfacts import FACTS, KindFacts
from .kinds import apiserverproxy, connector, egress, ingress, service
from .kinds import proxyclass as pcl
from .model import APISERVER, CONNECTOR, DNSCONFIG, INGRESS, PROXYCLASS, PROXYGROUP, SVC, Decision, ProxySpec
from .model import RECORDER as RECORDER_KIND
from .sameness import same

#: the passes a queue key can go to (KindInfo.runs)
PARENT, GROUP, CLASS, DNS = "parent", "group", "class", "dns"
#: the Recorders' pass (controller/passes/recorder.py)
RECORDER = "recorder"


@dataclass(frozen=True)
class DecideInputs:
    """What a `decide` may need beyond the object: an Ingress's backend Services (name -> object), its
    proxy's MagicDNS name (read back from replica 0's state Secret) and why the user's TLS Secret cannot be
    served ("" when it can, or when none is named: `KindInfo.tls_secret`)."""

    services: Mapping[str, Mapping[str, Any]]
    fqdn: str = ""
    tls_problem: str = ""


@dataclass(frozen=True, kw_only=True)
class KindInfo(KindFacts):
    """A row of controller/kindfacts.py (what the kind is) with what the shell does with it."""

    runs: str                       # the pass for its keys: PARENT, GROUP, CLASS or DNS
    handled: Callable[[Mapping[str, Any], ControllerConfig], bool] | None = None
    decide: Callable[[Mapping[str, Any], ControllerConfig, DecideInputs], Decision] | None = None
    #: the backend Services `decide` needs (DecideInputs; with them the proxy's MagicDNS name under INGRESS_HTTP)
    backends: Callable[[Mapping[str, Any]], Iterable[str]] | None = None
    #: the status fields its proxies' state gives it, as a patch of what differs from `status` now
    status_fields: Callable[[Mapping[str, Any], ProxySpec | None, Sequence[st.DeviceInfo]],
                            dict[str, Any]] | None = None
    #: PROXY_DEFAULT_CLASS applies without the class label (spec.proxyClass instead: proxyclass.select)
    class_in_spec: bool = False
    #: its proxies serve HTTPS with the control plane's certificates (the ACME staging directory)
    uses_certs: bool = False
    #: the proxy's URL is announced on the object (an annotation and a Normal event: the API server proxy)
    announces_url: bool = False
    #: its proxy has a ClusterRoleBinding of its own (the API server proxy's impersonation)
    cluster_binding: bool = False
    #: a ProxyClass's pass queues the objects of this kind that use it (the API server proxy's ConfigMap is
    #: not: its pass reads the class again at its next event or re-check)
    queued_by_class: bool = True
    #: an object of this kind that a ProxyGroup serves instead of a proxy of its own (egress Services)
    on_group: Callable[[Mapping[str, Any]], bool] | None = None
    #: status fields cleared, with its condition, from an object that stays but is no longer ours
    released_status: Mapping[str, Any] | None = None
    #: the user's `kubernetes.io/tls` Secret its proxy serves (in the object's namespace) and the extra names a
    #: client may use, ("", ()) when none: checked before `decide` (DecideInputs.tls_problem, docs/https.md)
    tls_secret: Callable[[Mapping[str, Any]], tuple[str, tuple[str, ...]]] | None = None
    #: where the user names that Secret, for the messages
    tls_field: str = "spec.tls[].secretName"
    #: its proxies run in another namespace than the object and its Secret: a Role and RoleBinding of their
    #: own there let the proxy read it (proxyrbac.tls_secret_access), and the Secret, not watched, is checked
    #: again every TLS_RECHECK
    tls_role: bool = False

    @property
    def dns_records(self) -> bool:
        """Its objects' names can change the DNSConfig's records (an egress name, an Ingress's MagicDNS name)."""
        return bool(self.dns_name)

    def parent_namespace(self, obj: Mapping[str, Any]) -> str:
        return ((obj.get("metadata") or {}).get("namespace") or "") if self.namespaced else ""


def _load_balancer(want: Mapping[str, Any], cur: Mapping[str, Any]) -> dict[str, Any]:
    if same((cur.get("loadBalancer") or {}).get("ingress"), want.get("ingress")):
        return {}
    return {"loadBalancer": {"ingress": want.get("ingress")}}


def _service_status(obj: Mapping[str, Any], spec: ProxySpec | None,
                    devices: Sequence[st.DeviceInfo]) -> dict[str, Any]:
    if not service.is_load_balancer(obj) or service.is_egress(obj):
        return {}
    return _load_balancer(st.service_load_balancer(devices, st.service_families(obj)), obj.get("status") or {})


def _ingress_status(obj: Mapping[str, Any], spec: ProxySpec | None,
                    devices: Sequence[st.DeviceInfo]) -> dict[str, Any]:
    return {} if spec is None else _load_balancer(st.ingress_load_balancer(devices, spec), obj.get("status") or {})


def _connector_status(obj: Mapping[str, Any], spec: ProxySpec | None,
                      devices: Sequence[st.DeviceInfo]) -> dict[str, Any]:
    cur, body = obj.get("status") or {}, st.connector_status(spec, devices)
    return {k: body.get(k) for k in ("subnetRoutes", "isExitNode", "isAppConnector", "devices", "hostname",
                                     "tailnetIPs") if not same(cur.get(k), body.get(k))}


def _service_handled(obj: Mapping[str, Any], cfg: ControllerConfig) -> bool:
    return egress.handled(obj) or service.handled(obj, cfg)


def _row(key: str, runs: str, **shell: Any) -> KindInfo:
    facts = FACTS[key]
    return KindInfo(**{f.name: getattr(facts, f.name) for f in fields(facts)}, runs=runs, **shell)


KINDS: dict[str, KindInfo] = {k.key: k for k in (
    _row(SVC, PARENT, handled=_service_handled, decide=lambda o, c, _: service.decide(o, c),
         status_fields=_service_status, on_group=egress.handled, released_status={"loadBalancer": {"ingress": None}}),
    _row(INGRESS, PARENT, handled=ingress.handled,
         decide=lambda o, c, i: ingress.decide(o, c, i.services, i.fqdn, i.tls_problem),
         backends=ingress.backend_services, status_fields=_ingress_status, uses_certs=True,
         tls_secret=ingress.tls_entry, tls_role=True),
    _row(CONNECTOR, PARENT, handled=connector.handled, decide=lambda o, c, _: connector.decide(o, c),
         status_fields=_connector_status, class_in_spec=True),
    _row(APISERVER, PARENT, handled=apiserverproxy.handled,
         decide=lambda o, c, i: apiserverproxy.decide(o, c, i.tls_problem), announces_url=True,
         cluster_binding=True, queued_by_class=False, tls_secret=apiserverproxy.tls_entry,
         tls_field="apiServerProxy.tls.secretName"),
    _row(PROXYGROUP, GROUP, handled=lambda o, c: True, class_in_spec=True),
    _row(PROXYCLASS, CLASS),
    _row(DNSCONFIG, DNS),
    _row(RECORDER_KIND, RECORDER, handled=lambda o, c: True),
)}
#: the kinds whose objects own proxies (the children's LABEL_PARENT_TYPE values)
PARENT_KINDS = tuple(k.key for k in KINDS.values() if k.proxy_type)


def handled(kind: str, obj: Mapping[str, Any], cfg: ControllerConfig) -> bool:
    """The controller runs a proxy (or a ProxyGroup's egress) for this object."""
    h = KINDS[kind].handled
    return h is not None and h(obj, cfg)


def class_of(kind: str, obj: Mapping[str, Any], cfg: ControllerConfig) -> pcl.Selection:
    """The ProxyClass an object's proxies use (its label, or spec.proxyClass, else PROXY_DEFAULT_CLASS)."""
    return pcl.select(KINDS[kind].class_in_spec, obj, cfg.default_proxy_class)


def proxy_target(kind: str, spec: ProxySpec, cfg: ControllerConfig) -> pcl.Target:
    """Upstream's exclusions: no metrics or debug endpoints on egress proxies and forwarding L7 Ingress proxies
    (their cluster traffic is all forwarded); the ACME staging directory only where certificates are used."""
    to_tailnet = any(k in ("TS_TAILNET_TARGET_IP", "TS_TAILNET_TARGET_FQDN") for k, _ in spec.target_env)
    return pcl.Target(endpoints=not to_tailnet and not spec.forward_cluster_traffic,
                      acme=KINDS[kind].uses_certs and not spec.ingress_http)
