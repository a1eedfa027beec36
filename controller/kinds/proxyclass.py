"""ProxyClass (`tailscale.com/v1alpha1`, cluster-scoped): which class a parent uses, whether a class is valid, and
the class merged into a proxy's rendered objects (pure: objects in, objects out).

The merge is generic over what `render` (or any other renderer) made: a StatefulSet whose main container is
named `tailscale` and whose init container is `sysctler`, and config Secrets with `cap-<N>.hujson` keys, so
every kind of proxy (Service, Ingress, Connector, a group of replicas) gets it the same way::

    sel = select(is_connector_like, parent_obj, cfg.default_proxy_class)     # which class, and mistakes
    v = validate(class_obj)                                                  # ProxyClassReady, problems
    sts = apply_to_statefulset(sts, ProxyClass.from_object(class_obj), Target(endpoints=..., acme=...))
    secret = apply_to_config_secret(secret, pc)                             # per config Secret
    metrics_service(sts, ...), service_monitor(svc, pc)                     # when pc.metrics / .service_monitor

It follows upstream's `applyProxyClassToStatefulSet`: labels and annotations merged with the controller's own winning
(its selector labels are never replaced), Pod scheduling fields replaced, the class's env appended after the
rendered env (a later duplicate wins in Kubernetes, so the user wins), image, pull policy, resources and
security context replaced where the class gives them; `metrics.enable` → the proxy's metrics endpoint on
`$(POD_IP):9002`, `debug.enable` (default: `metrics.enable`, as upstream) → tailscaled's debug endpoint on
`$(POD_IP):9001`, both skipped for egress proxies and forwarding L7 Ingress proxies as upstream skips them;
`tailscale.acceptRoutes` → `acceptRoutes` in the proxy's config file; `useLetsEncryptStagingEnvironment` → the
staging ACME directory for proxies that get certificates.

Ours, on purpose (docs/proxyclass.md, "Deliberate differences"): a class is refused (ProxyClassReady False,
nothing applied) for what upstream accepts and then fails at run time or in the API server (bad tolerations,
quantities that do not parse, env the controller owns, wrong types); `TS_EXTRA_ARGS` in the proxy container's
env is translated instead of passed on (the proxy is configured through its config file, and the agent, like
upstream's, refuses to start with both): `--advertise-tags` becomes the proxy's tags, `--accept-routes` its
config's `acceptRoutes`; and a class's resources replace the fallback only where the class sets them.
"""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tscommon.secretcontract import CONFIG_CAPVERS, config_key

from ..kindfacts import FACTS
from ..model import COND_PROXYCLASS_READY, PROXYCLASS
from ..validation import static_endpoints_problem

_FACTS = FACTS[PROXYCLASS]
GROUP, VERSION, PLURAL, KIND = _FACTS.api_names
LABEL_PROXY_CLASS = "tailscale.com/proxy-class"
COND_READY = COND_PROXYCLASS_READY
REASON_VALID, REASON_INVALID = _FACTS.ready_reason, _FACTS.invalid_reason
REASON_CUSTOM_TS_ENV = "CustomTSEnvVar"
REASON_INIT_ENV = "EnvOnInitContainer"
REASON_NOT_READY = "ProxyClassNotReady"
REASON_ANNOTATION = "ProxyClassAnnotation"
REASON_LOCAL_ADDR_PORT = "CustomTSLocalAddrPort"
MAIN_CONTAINER, INIT_CONTAINER = "tailscale", "sysctler"
METRICS_PORT, DEBUG_PORT = 9002, 9001
LETS_ENCRYPT_STAGING = "https://acme-staging-v02.api.letsencrypt.org/directory"
SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"

#: Env the controller sets per proxy, or that would stop the agent (it is configured through its config file):
#: a class that sets one would break every proxy using it, so such a class is refused.
RESERVED_ENV = {
    "POD_IP": "the Pod's IP, set by the controller",
    "POD_NAME": "the Pod's name, which picks its state Secret and config",
    "POD_UID": "the Pod's UID, reported in its state Secret",
    "TS_KUBE_SECRET": "the proxy's state Secret, one per replica",
    "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR": "the proxy's config directory, written by the controller",
    "TS_AUTHKEY": "the auth key, minted by the controller into the config file",
    "TS_AUTH_KEY": "the auth key, minted by the controller into the config file",
    "TS_HOSTNAME": "the host name, from the parent (tailscale.com/hostname or spec.hostname)",
    "TS_ROUTES": "the routes, from the Connector's spec.subnetRouter",
    "TS_ACCEPT_DNS": "acceptDNS in the config file; the agent refuses it with a config file",
    "TS_DEST_IP": "the proxy's target, from its parent",
    "TS_EXPERIMENTAL_DEST_DNS_NAME": "the proxy's target, from its parent",
    "TS_TAILNET_TARGET_IP": "the proxy's target, from its parent",
    "TS_TAILNET_TARGET_FQDN": "the proxy's target, from its parent",
    "TS_SERVE_CONFIG": "the Ingress's serve config, from the Ingress",
}
#: TS_EXTRA_ARGS flags the controller carries over into the proxy's configuration.
_TAG_FLAGS = ("--advertise-tags", "-advertise-tags")
_ACCEPT_ROUTES_FLAGS = ("--accept-routes", "-accept-routes")

_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?(\d+(\.\d*)?|\.\d+))?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_IMAGE = re.compile(r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._/-][a-z0-9]+)*)*"
                    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$")
_TAG = re.compile(r"^tag:[a-zA-Z][a-zA-Z0-9-]*$")


@dataclass(frozen=True)
class ProxyClass:
    """A class as read from the API server: its name and spec (JSON as given), and what it means for a proxy."""

    name: str
    spec: Mapping[str, Any] = field(default_factory=dict, hash=False)
    generation: int = 0

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> "ProxyClass":
        m = obj.get("metadata") or {}
        spec = obj.get("spec")
        return cls(str(m.get("name", "")), spec if isinstance(spec, Mapping) else {}, int(m.get("generation") or 0))

    def _get(self, *path: str) -> Any:
        cur: Any = self.spec
        for p in path:
            if not isinstance(cur, Mapping):
                return None
            cur = cur.get(p)
        return cur

    @property
    def metrics(self) -> bool:
        return self._get("metrics", "enable") is True

    @property
    def debug(self) -> bool:
        """tailscaled's debug endpoint: `debug.enable`, defaulting to `metrics.enable` when unset (upstream)."""
        dbg = self._get("statefulSet", "pod", "tailscaleContainer", "debug")
        if not isinstance(dbg, Mapping) or "enable" not in dbg:
            return self.metrics
        return dbg.get("enable") is True

    @property
    def service_monitor(self) -> bool:
        return self.metrics and self._get("metrics", "serviceMonitor", "enable") is True

    @property
    def service_monitor_labels(self) -> dict[str, str]:
        return _str_map(self._get("metrics", "serviceMonitor", "labels"))

    @property
    def accept_routes(self) -> bool:
        if self._get("tailscale", "acceptRoutes") is True:
            return True
        return bool(_extra_args(self.container_env(MAIN_CONTAINER)).get("accept_routes"))

    @property
    def tags(self) -> tuple[str, ...]:
        """Tags from `--advertise-tags` in the proxy container's TS_EXTRA_ARGS (empty: none given)."""
        return tuple(_extra_args(self.container_env(MAIN_CONTAINER)).get("tags") or ())

    @property
    def lets_encrypt_staging(self) -> bool:
        return self._get("useLetsEncryptStagingEnvironment") is True

    def container(self, which: str) -> Mapping[str, Any]:
        key = "tailscaleContainer" if which == MAIN_CONTAINER else "tailscaleInitContainer"
        c = self._get("statefulSet", "pod", key)
        return c if isinstance(c, Mapping) else {}

    def container_env(self, which: str) -> list[tuple[str, str]]:
        env = self.container(which).get("env")
        return [(str(e.get("name", "")), str(e.get("value") or "")) for e in env or [] if isinstance(e, Mapping)]


def sets_local_addr_port(pc: ProxyClass | None) -> bool:
    """The class sets TS_LOCAL_ADDR_PORT on the proxy container (upstream's test: the name, whatever the value):
    an egress ProxyGroup's pre-stop hook then cannot reach the health check, and the group has none."""
    return pc is not None and any(k == "TS_LOCAL_ADDR_PORT" for k, _ in pc.container_env(MAIN_CONTAINER))


def local_addr_port_message(name: str) -> str:
    return (f"ProxyClass {name!r} sets TS_LOCAL_ADDR_PORT on the proxy container, which moves the replicas' health "
            "check away from <Pod IP>:9002 where the pre-stop hook asks it: the ProxyGroup's replicas get no pre-stop "
            "hook, so a replica that stops cuts the connections it carries instead of draining first. Remove "
            "TS_LOCAL_ADDR_PORT from spec.statefulSet.pod.tailscaleContainer.env (metrics.enable serves /metrics on "
            "<Pod IP>:9002 without it)")


def _str_map(v: Any) -> dict[str, str]:
    return {str(k): str(x) for k, x in v.items()} if isinstance(v, Mapping) else {}


def _extra_args(env: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """TS_EXTRA_ARGS of an env list: {"tags": [...], "accept_routes": bool, "other": [flags not carried over]}."""
    out: dict[str, Any] = {"tags": [], "accept_routes": False, "other": []}
    raw = ""
    for k, v in env:
        if k == "TS_EXTRA_ARGS":
            raw = v                          # the last one wins, as in a Pod's env
    words = raw.split()
    i = 0
    while i < len(words):
        w = words[i]
        name, eq, value = w.partition("=")
        if name in _TAG_FLAGS:
            if not eq and i + 1 < len(words):
                i += 1
                value = words[i]
            out["tags"] = [t.strip() for t in value.split(",") if t.strip()]
        elif name in _ACCEPT_ROUTES_FLAGS:
            out["accept_routes"] = not eq or value.lower() in ("1", "t", "true")
        else:
            out["other"].append(w)
        i += 1
    return out


# ---- selection

@dataclass(frozen=True)
class Selection:
    """The class a parent uses ("" = none) and a mistake worth a Warning (the annotation instead of the label)."""

    name: str
    misplaced: str = ""          # the class named by the annotation `tailscale.com/proxy-class`, not applied


def select(kind_is_connector: bool, obj: Mapping[str, Any], default: str) -> Selection:
    """Upstream's choice: the label on a Service or Ingress, `spec.proxyClass` on a Connector (or a group), else
    the cluster default. The same key as an annotation is a mistake: not applied (as upstream), but reported."""
    m = obj.get("metadata") or {}
    if kind_is_connector:
        name = str((obj.get("spec") or {}).get("proxyClass") or "")
        return Selection(name or default)
    name = str((m.get("labels") or {}).get(LABEL_PROXY_CLASS) or "")
    misplaced = "" if name else str((m.get("annotations") or {}).get(LABEL_PROXY_CLASS) or "")
    return Selection(name or default, misplaced)


def annotation_message(kind: str, misplaced: str) -> str:
    return (f"the {kind} names ProxyClass {misplaced!r} in the annotation {LABEL_PROXY_CLASS}, which is not read; "
            f"use a label: metadata.labels: {{{LABEL_PROXY_CLASS}: {misplaced}}} (the annotation is ignored)")


# ---- validation

@dataclass(frozen=True)
class Validation:
    problems: tuple[str, ...] = ()           # any → ProxyClassReady False, the class is not applied
    warnings: tuple[tuple[str, str], ...] = ()   # (reason, message): Warning events on the class
    crd_missing: bool = False                # a ServiceMonitor is asked for where its CRD is not installed

    @property
    def ok(self) -> bool:
        return not self.problems


def _label_key_problem(k: str) -> str:
    prefix, slash, name = k.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return "its prefix must be a lower-case DNS subdomain"
    if not name or len(name) > 63 or not _NAME_PART.match(name):
        return ("its name must be 63 characters or less, begin and end with a letter or digit, and contain only "
                "letters, digits, '-', '_' and '.'")
    return ""


def check_labels(path: str, v: Any, problems: list[str], *, values: bool = True) -> None:
    if v is None:
        return
    if not isinstance(v, Mapping):
        problems.append(f"{path}: {_show(v)} is not a map of names to strings")
        return
    for k, x in v.items():
        if p := _label_key_problem(str(k)):
            problems.append(f"{path}: key {str(k)!r} is invalid: {p}")
        if not isinstance(x, str):
            problems.append(f"{path}[{k}]: {_show(x)} is not a string")
        elif values and (len(x) > 63 or not _LABEL_VALUE.match(x)):
            problems.append(f"{path}[{k}]: value {x!r} is not a valid label value (63 characters or less, "
                            "letters, digits, '-', '_' and '.', beginning and ending with a letter or digit)")


def _show(v: Any) -> str:
    s = json.dumps(v, sort_keys=True)
    return s if len(s) <= 80 else s[:77] + "..."


def _type(path: str, v: Any, want: type | tuple[type, ...], what: str, problems: list[str]) -> bool:
    """Whether `v` is given and of the wanted type; a value of another type is a problem (None: not given)."""
    if v is None:
        return False
    if not isinstance(v, want):
        problems.append(f"{path}: {_show(v)} is not {what}")
        return False
    return True


def check_tolerations(path: str, v: Any, problems: list[str]) -> None:
    if not _type(path, v, list, "a list of tolerations", problems):
        return
    for i, t in enumerate(v):
        p = f"{path}[{i}]"
        if not isinstance(t, Mapping):
            problems.append(f"{p}: {_show(t)} is not a toleration (an object with key, operator, value, effect)")
            continue
        op = t.get("operator", "Equal") or "Equal"
        if op not in ("Exists", "Equal"):
            problems.append(f"{p}.operator: {op!r} is not an operator; use Exists or Equal")
        eff = t.get("effect", "") or ""
        if eff not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            problems.append(f"{p}.effect: {eff!r} is not an effect; use NoSchedule, PreferNoSchedule or NoExecute")
        if op == "Exists" and t.get("value"):
            problems.append(f"{p}.value: {t.get('value')!r} must be empty with operator Exists")
        if not t.get("key") and op != "Exists":
            problems.append(f"{p}.operator: an empty key needs operator Exists")
        if t.get("key") and (pr := _label_key_problem(str(t.get("key")))):
            problems.append(f"{p}.key: {str(t.get('key'))!r} is invalid: {pr}")
        if t.get("tolerationSeconds") is not None and eff != "NoExecute":
            problems.append(f"{p}.tolerationSeconds: only with effect NoExecute")


def _check_resources(path: str, v: Any, problems: list[str]) -> None:
    if not _type(path, v, Mapping, "an object with requests and limits", problems):
        return
    for k, q in v.items():
        if k == "claims":
            continue
        if k not in ("requests", "limits"):
            problems.append(f"{path}.{k}: unknown field; use requests and limits")
            continue
        if not _type(f"{path}.{k}", q, Mapping, "a map of resource names to quantities", problems):
            continue
        for r, amount in q.items():
            if isinstance(amount, bool) or not isinstance(amount, (int, str)) or not _QUANTITY.match(str(amount)):
                problems.append(f"{path}.{k}.{r}: {_show(amount)} is not a quantity; use e.g. 100m (CPU) or "
                                "64Mi (memory)")


def _check_container(path: str, which: str, c: Any, problems: list[str], warnings: list[tuple[str, str]]) -> None:
    if not _type(path, c, Mapping, "an object", problems):
        return
    env: Any = c.get("env")
    if _type(f"{path}.env", env, list, "a list of {name, value}", problems):
        for i, e in enumerate(env):
            p = f"{path}.env[{i}]"
            if not isinstance(e, Mapping) or not isinstance(e.get("name"), str):
                problems.append(f"{p}: {_show(e)} is not an env entry {{name, value}}")
                continue
            name = e["name"]
            if not _ENV_NAME.match(name):
                problems.append(f"{p}.name: {name!r} is not an env name (letters, digits, '-', '_', '.'; not "
                                "starting with a digit)")
            if e.get("value") is not None and not isinstance(e.get("value"), str):
                problems.append(f"{p}.value: {_show(e.get('value'))} is not a string; quote it")
            if which == MAIN_CONTAINER:
                if name in RESERVED_ENV:
                    problems.append(f"{p}.name: {name} is set by the controller ({RESERVED_ENV[name]}); remove it "
                                    "from the ProxyClass")
                elif name == "TS_EXTRA_ARGS":
                    other = _extra_args([(name, str(e.get("value") or ""))])["other"]
                    if other:
                        problems.append(
                            f"{p}.value: TS_EXTRA_ARGS flags {' '.join(other)!r} cannot be passed to a proxy the "
                            "controller configures through its config file (the proxy would refuse to start); only "
                            "--advertise-tags and --accept-routes are carried over (as the proxy's tags and "
                            "spec.tailscale.acceptRoutes)")
                    for t in _extra_args([(name, str(e.get("value") or ""))])["tags"]:
                        if not _TAG.match(t):
                            problems.append(f"{p}.value: --advertise-tags {t!r} is not a tag; use e.g. tag:k8s")
                elif name.startswith("TS_") or name.upper() in ("EXPERIMENTAL_TS_CONFIGFILE_PATH",
                                                                "EXPERIMENTAL_ALLOW_PROXYING_CLUSTER_TRAFFIC_VIA_INGRESS"):
                    warnings.append((REASON_CUSTOM_TS_ENV, (
                        f"ProxyClass overrides the default value for {name} env var for tailscale container. Running "
                        "with custom values for Tailscale env vars is not recommended and might break in the future.")))
            elif name.startswith("TS_") or name.startswith("EXPERIMENTAL_"):
                warnings.append((REASON_INIT_ENV, (
                    f"{name} is set on spec.statefulSet.pod.tailscaleInitContainer (the sysctler init container, "
                    f"which does not read it); it belongs to the proxy container: move it to "
                    f"spec.statefulSet.pod.tailscaleContainer.env")))
    image: Any = c.get("image")
    if _type(f"{path}.image", image, str, "a string", problems) and image and not _IMAGE.match(image):
        problems.append(f"{path}.image: {image!r} is not an image reference; use e.g. tailscale/tailscale:v1.80.0")
    pull: Any = c.get("imagePullPolicy")
    if _type(f"{path}.imagePullPolicy", pull, str, "a string", problems) and pull not in (
            "", "Always", "Never", "IfNotPresent"):
        problems.append(f"{path}.imagePullPolicy: {pull!r} is not a pull policy; use Always, Never or IfNotPresent")
    if c.get("resources") is not None:
        _check_resources(f"{path}.resources", c.get("resources"), problems)
    _type(f"{path}.securityContext", c.get("securityContext"), Mapping, "an object (a SecurityContext)", problems)
    dbg: Any = c.get("debug")
    if _type(f"{path}.debug", dbg, Mapping, "an object", problems):
        _type(f"{path}.debug.enable", dbg.get("enable"), bool, "true or false", problems)
        if which == INIT_CONTAINER and dbg.get("enable") is True:
            problems.append(f"{path}.debug.enable: debug settings cannot be enabled on the init container")


def validate(obj: Mapping[str, Any], *, service_monitor_crd: bool = True) -> Validation:
    """Everything the controller checks of a class (the CRD's schema checks some of it again): problems name the
    field, the value and the fix. `service_monitor_crd`: whether the ServiceMonitor CRD is installed (a class
    asking for a ServiceMonitor without it is not ready, as upstream)."""
    problems: list[str] = []
    warnings: list[tuple[str, str]] = []
    crd_missing = False
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return Validation((f"spec: {_show(spec)} is not an object",))
    sts: Any = spec.get("statefulSet")
    if _type("spec.statefulSet", sts, Mapping, "an object", problems):
        check_labels("spec.statefulSet.labels", sts.get("labels"), problems)
        check_labels("spec.statefulSet.annotations", sts.get("annotations"), problems, values=False)
        pod: Any = sts.get("pod")
        if _type("spec.statefulSet.pod", pod, Mapping, "an object", problems):
            pp = "spec.statefulSet.pod"
            check_labels(f"{pp}.labels", pod.get("labels"), problems)
            check_labels(f"{pp}.annotations", pod.get("annotations"), problems, values=False)
            check_labels(f"{pp}.nodeSelector", pod.get("nodeSelector"), problems)
            for f in ("affinity", "securityContext", "dnsConfig"):
                _type(f"{pp}.{f}", pod.get(f), Mapping, "an object", problems)
            for f in ("nodeName", "priorityClassName"):
                _type(f"{pp}.{f}", pod.get(f), str, "a string", problems)
            if pod.get("tolerations") is not None:
                check_tolerations(f"{pp}.tolerations", pod.get("tolerations"), problems)
            if _type(f"{pp}.topologySpreadConstraints", pod.get("topologySpreadConstraints"), list, "a list",
                     problems):
                for i, t in enumerate(pod["topologySpreadConstraints"]):
                    _type(f"{pp}.topologySpreadConstraints[{i}]", t, Mapping, "an object", problems)
            if _type(f"{pp}.imagePullSecrets", pod.get("imagePullSecrets"), list, "a list of {name}", problems):
                for i, s in enumerate(pod["imagePullSecrets"]):
                    if not isinstance(s, Mapping) or not isinstance(s.get("name"), str):
                        problems.append(f"{pp}.imagePullSecrets[{i}]: {_show(s)} is not {{name: <Secret>}}")
            dp = pod.get("dnsPolicy")
            if _type(f"{pp}.dnsPolicy", dp, str, "a string", problems) and dp not in (
                    "ClusterFirstWithHostNet", "ClusterFirst", "Default", "None"):
                problems.append(f"{pp}.dnsPolicy: {dp!r} is not a DNS policy; use ClusterFirst, "
                                "ClusterFirstWithHostNet, Default or None")
            if dp == "None" and not pod.get("dnsConfig"):
                problems.append(f"{pp}.dnsConfig: required with dnsPolicy None (the Pod would have no resolver)")
            if pod.get("tailscaleContainer") is not None:
                _check_container(f"{pp}.tailscaleContainer", MAIN_CONTAINER, pod["tailscaleContainer"], problems,
                                 warnings)
            if pod.get("tailscaleInitContainer") is not None:
                _check_container(f"{pp}.tailscaleInitContainer", INIT_CONTAINER, pod["tailscaleInitContainer"],
                                 problems, warnings)
    metrics: Any = spec.get("metrics")
    if _type("spec.metrics", metrics, Mapping, "an object", problems):
        _type("spec.metrics.enable", metrics.get("enable"), bool, "true or false", problems)
        sm: Any = metrics.get("serviceMonitor")
        if _type("spec.metrics.serviceMonitor", sm, Mapping, "an object", problems):
            _type("spec.metrics.serviceMonitor.enable", sm.get("enable"), bool, "true or false", problems)
            check_labels("spec.metrics.serviceMonitor.labels", sm.get("labels"), problems)
            if sm.get("enable") is True and metrics.get("enable") is not True:
                problems.append("spec.metrics.serviceMonitor.enable: a ServiceMonitor needs metrics; set "
                                "spec.metrics.enable: true")
            elif sm.get("enable") is True and not service_monitor_crd:
                crd_missing = True
                problems.append(f"spec.metrics.serviceMonitor.enable: ProxyClass defines that a ServiceMonitor "
                                f"custom resource should be created, but \"{SERVICE_MONITOR_CRD}\" CRD was not "
                                "found; install the Prometheus Operator's CRDs, or set "
                                "spec.metrics.serviceMonitor.enable: false")
    ts: Any = spec.get("tailscale")
    if _type("spec.tailscale", ts, Mapping, "an object", problems):
        _type("spec.tailscale.acceptRoutes", ts.get("acceptRoutes"), bool, "true or false", problems)
    _type("spec.useLetsEncryptStagingEnvironment", spec.get("useLetsEncryptStagingEnvironment"), bool,
          "true or false", problems)
    if spec.get("staticEndpoints") is not None:
        problems.append(static_endpoints_problem())
    return Validation(tuple(problems), tuple(dict.fromkeys(warnings)), crd_missing)


def invalid_message(v: Validation) -> str:
    """Upstream's message shape ("ProxyClass is not valid: ..."), every problem listed."""
    return "ProxyClass is not valid: " + "; ".join(v.problems)


def not_ready_message(name: str, obj: Mapping[str, Any] | None, *, running: bool,
                      validation: Validation | None = None) -> str:
    """A parent's condition while its class is missing or invalid."""
    if obj is None:
        if running:
            return (f"ProxyClass {name!r} does not exist (deleted?); the proxy keeps running as last configured. "
                    f"Create the ProxyClass again, or name another one")
        return (f"ProxyClass {name!r} does not exist; the proxy is created once it does (kubectl get proxyclasses), "
                f"or name another one")
    v = validation if validation is not None else validate(obj)
    keep = "; the proxy keeps running as last configured" if running else "; no proxy until it is fixed"
    return f"ProxyClass {name!r} is not ready ({invalid_message(v)}){keep}"


# ---- the merge

@dataclass(frozen=True)
class Target:
    """What the merge must know about the proxy beyond its objects (upstream's exclusions)."""

    endpoints: bool = True       # metrics/debug endpoints allowed (not egress, not forwarding L7 Ingress)
    acme: bool = False           # the proxy gets TLS certificates (L7 Ingress): the staging directory applies


def _merge_meta(ours: Mapping[str, str] | None, theirs: Mapping[str, str]) -> dict[str, str]:
    """The class's keys plus ours; ours win, so the controller's selector labels never change."""
    return {**dict(theirs), **dict(ours or {})}


def _env_list(pairs: Sequence[tuple[str, str]]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in pairs]


def _overlay_container(c: dict, pc: ProxyClass, which: str) -> None:
    over = pc.container(which)
    if isinstance(over.get("securityContext"), Mapping):
        c["securityContext"] = copy.deepcopy(dict(over["securityContext"]))
    if isinstance(over.get("resources"), Mapping):
        c["resources"] = copy.deepcopy(dict(over["resources"]))
    env = pc.container_env(which)
    if which == MAIN_CONTAINER:
        # Carried over into the config and the tags instead (the agent refuses TS_EXTRA_ARGS with a config file).
        env = [(k, v) for k, v in env if k != "TS_EXTRA_ARGS"]
    if env:
        c["env"] = list(c.get("env") or []) + _env_list(env)
    if over.get("image"):
        c["image"] = over["image"]
    if over.get("imagePullPolicy"):
        c["imagePullPolicy"] = over["imagePullPolicy"]


def apply_to_statefulset(sts: Mapping[str, Any], pc: ProxyClass | None, target: Target) -> dict:
    """The StatefulSet with the class applied (a new object; the input is not changed)."""
    out = copy.deepcopy(dict(sts))
    if pc is None:
        return out
    tmpl = out["spec"]["template"]
    pod_spec = tmpl["spec"]
    main = next((c for c in pod_spec.get("containers") or [] if c.get("name") == MAIN_CONTAINER), None)
    if main is not None:
        extra: list[tuple[str, str]] = []
        ports: list[dict] = []
        if target.endpoints and pc.debug:
            extra += [("TS_DEBUG_ADDR_PORT", f"$(POD_IP):{DEBUG_PORT}"),
                      ("TS_TAILSCALED_EXTRA_ARGS", "--debug=$(TS_DEBUG_ADDR_PORT)")]
            ports.append({"name": "debug", "protocol": "TCP", "containerPort": DEBUG_PORT})
        if target.endpoints and pc.metrics:
            extra += [("TS_LOCAL_ADDR_PORT", f"$(POD_IP):{METRICS_PORT}"), ("TS_ENABLE_METRICS", "true")]
            ports.append({"name": "metrics", "protocol": "TCP", "containerPort": METRICS_PORT})
        if target.acme and pc.lets_encrypt_staging:
            extra.append(("TS_DEBUG_ACME_DIRECTORY_URL", LETS_ENCRYPT_STAGING))
        if extra:
            main["env"] = list(main.get("env") or []) + _env_list(extra)
        if ports:
            main["ports"] = list(main.get("ports") or []) + ports
    sset = pc.spec.get("statefulSet")
    if not isinstance(sset, Mapping):
        return out
    md = out.setdefault("metadata", {})
    if sset.get("labels"):
        md["labels"] = _merge_meta(md.get("labels"), _str_map(sset["labels"]))
    if sset.get("annotations"):
        md["annotations"] = _merge_meta(md.get("annotations"), _str_map(sset["annotations"]))
    pod = sset.get("pod")
    if not isinstance(pod, Mapping):
        return out
    tm = tmpl.setdefault("metadata", {})
    if pod.get("labels"):
        tm["labels"] = _merge_meta(tm.get("labels"), _str_map(pod["labels"]))
    if pod.get("annotations"):
        tm["annotations"] = _merge_meta(tm.get("annotations"), _str_map(pod["annotations"]))
    for f in ("securityContext", "imagePullSecrets", "nodeName", "nodeSelector", "affinity", "tolerations",
              "priorityClassName", "topologySpreadConstraints", "dnsPolicy", "dnsConfig"):
        if pod.get(f) not in (None, "", {}, []):
            pod_spec[f] = copy.deepcopy(pod[f])
    for c in pod_spec.get("containers") or []:
        if c.get("name") == MAIN_CONTAINER:
            _overlay_container(c, pc, MAIN_CONTAINER)
    for c in pod_spec.get("initContainers") or []:
        if c.get("name") == INIT_CONTAINER:
            _overlay_container(c, pc, INIT_CONTAINER)
    return out


def apply_to_config_secret(secret: Mapping[str, Any], pc: ProxyClass | None) -> dict:
    """A config Secret (stringData with `cap-<N>.hujson` keys) with the class's `acceptRoutes` applied."""
    out = copy.deepcopy(dict(secret))
    if pc is None or not pc.accept_routes:
        return out
    data = out.get("stringData") or {}
    for c in CONFIG_CAPVERS:
        k = config_key(c)
        if k in data:
            conf = json.loads(data[k])
            conf["acceptRoutes"] = True
            data[k] = json.dumps(conf, sort_keys=True, separators=(",", ":"))
    return out


# ---- metrics Service and ServiceMonitor

def metrics_service(sts: Mapping[str, Any], proxy_type: str, parent_name: str, parent_ns: str) -> dict:
    """`<statefulset>-metrics`: the proxy's metrics port behind a ClusterIP Service (upstream's name and port)."""
    md = sts["metadata"]
    labels = _metrics_labels(md.get("labels") or {}, proxy_type, parent_name, parent_ns)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"{md['name']}-metrics", "namespace": md["namespace"], "labels": labels},
            "spec": {"selector": dict(sts["spec"]["selector"]["matchLabels"]),
                     "ports": [{"name": "metrics", "protocol": "TCP", "port": METRICS_PORT,
                                "targetPort": METRICS_PORT}]}}


def _metrics_labels(child: Mapping[str, str], proxy_type: str, parent_name: str, parent_ns: str) -> dict[str, str]:
    out = dict(child)
    out["ts_proxy_type"] = proxy_type
    out["ts_proxy_parent_name"] = parent_name
    if parent_ns:
        out["ts_proxy_parent_namespace"] = parent_ns
    out["ts_prom_job"] = f"ts_{proxy_type}_{parent_ns + '_' if parent_ns else ''}{parent_name}"[:63].rstrip("-_.")
    return out


def service_monitor(svc: Mapping[str, Any], pc: ProxyClass) -> dict:
    """A `monitoring.coreos.com/v1` ServiceMonitor selecting the metrics Service (only made when its CRD exists)."""
    md = svc["metadata"]
    labels = md.get("labels") or {}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": md["name"], "namespace": md["namespace"],
                         "labels": {**pc.service_monitor_labels, **{k: v for k, v in labels.items()
                                                                      if k.startswith("tailscale.com/")}}},
            "spec": {"selector": {"matchLabels": dict(labels)},
                     "namespaceSelector": {"matchNames": [md["namespace"]]},
                     "jobLabel": "ts_prom_job",
                     "targetLabels": ["ts_proxy_type", "ts_proxy_parent_name", "ts_proxy_parent_namespace"],
                     "endpoints": [{"port": "metrics", "path": "/metrics"}]}}


def ready_condition(v: Validation) -> tuple[str, str, str]:
    """(status, reason, message) of the class's ProxyClassReady, upstream's reasons and valid message."""
    if v.ok:
        return ("True", REASON_VALID, REASON_VALID)
    return ("False", REASON_INVALID, invalid_message(v))
