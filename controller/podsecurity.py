"""Would the proxies' namespace admit this proxy Pod? (pure)

Kubernetes' Pod Security admission refuses a Pod that breaks the level a namespace enforces (label
``pod-security.kubernetes.io/enforce``: privileged, baseline or restricted). A StatefulSet whose Pod is refused
only says so in a FailedCreate event of the StatefulSet controller, so the parent would read "proxy Pod not
ready" for ever. The controller checks its rendered Pod against the namespace's label before it creates
anything and says which label to set.

Only the controls a rendered proxy Pod can break are checked (privileged containers, added capabilities, host
namespaces, ports and paths; for restricted also root, privilege escalation, seccomp and dropped
capabilities). A namespace without the label gets the cluster's default level, which the API server does not
publish: nothing is reported then, as a cluster-wide refusal still shows in the StatefulSet's events.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
#: Violations a message names (restricted finds several per container; the first ones say enough).
SHOWN = 3
LEVELS = ("privileged", "baseline", "restricted")
#: Capabilities the baseline level lets a container add (Kubernetes' Pod Security Standards).
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
#: Volume types the restricted level allows.
RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                "persistentVolumeClaim", "projected", "secret"})


@dataclass(frozen=True)
class Refusal:
    level: str              # the level the namespace enforces
    violations: tuple[str, ...]

    def message(self, namespace: str, userspace: bool) -> str:
        """What the parent's condition and its Warning event say: the level, why, and the label to set."""
        need = "baseline" if userspace and self.level == "restricted" else "privileged"
        why = "; ".join(self.violations[:SHOWN]) + (f"; {len(self.violations) - SHOWN} more"
                                                    if len(self.violations) > SHOWN else "")
        return (f"namespace {namespace} enforces Pod Security level {self.level!r} (label {ENFORCE_LABEL}), "
                f"which refuses this proxy's Pod ({why}): allow it with "
                f"`kubectl label namespace {namespace} {ENFORCE_LABEL}={need} --overwrite`"
                + ("" if userspace else
                   ", or use a namespace for the proxies that allows privileged Pods; only userspace proxies "
                   "(TS_USERSPACE, L7 Ingress proxies) run unprivileged, under the baseline level"))


def enforced_level(namespace: Mapping[str, Any] | None) -> str:
    """The level the namespace enforces ("" when unlabelled or unknown: the cluster's default applies).

    An unrecognised value counts as restricted, as the API server treats it."""
    labels = ((namespace or {}).get("metadata") or {}).get("labels") or {}
    value = str(labels.get(ENFORCE_LABEL, "")).strip()
    if not value:
        return ""
    return value if value in LEVELS else "restricted"


def _containers(pod_spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for c in pod_spec.get(key) or []:
            yield c.get("name", "?"), c


def violations(level: str, pod_spec: Mapping[str, Any]) -> tuple[str, ...]:
    """What in the Pod spec the level refuses (empty: admitted)."""
    if level not in ("baseline", "restricted"):
        return ()
    out: list[str] = []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(flag):
            out.append(f"{flag}=true")
    pod_sc = pod_spec.get("securityContext") or {}
    for v in pod_spec.get("volumes") or []:
        if "hostPath" in v:
            out.append(f"hostPath volume {v.get('name', '?')!r}")
        elif level == "restricted" and not (set(v) - {"name"}) <= RESTRICTED_VOLUMES:
            out.append(f"volume {v.get('name', '?')!r} of a type restricted refuses")
    for name, c in _containers(pod_spec):
        csc = c.get("securityContext") or {}
        if csc.get("privileged"):
            out.append(f"container {name!r} is privileged")
        allowed = {"NET_BIND_SERVICE"} if level == "restricted" else BASELINE_CAPABILITIES
        added = sorted(set((csc.get("capabilities") or {}).get("add") or []) - allowed)
        if added:
            out.append(f"container {name!r} adds capabilities {','.join(added)}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"container {name!r} uses a hostPort")
        if level != "restricted":
            continue
        if csc.get("allowPrivilegeEscalation") is not False:
            out.append(f"container {name!r} does not set allowPrivilegeEscalation=false")
        if not csc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            out.append(f"container {name!r} does not set runAsNonRoot=true")
        seccomp = (csc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"container {name!r} has no seccompProfile RuntimeDefault")
        if "ALL" not in ((csc.get("capabilities") or {}).get("drop") or []):
            out.append(f"container {name!r} does not drop ALL capabilities")
    return tuple(dict.fromkeys(out))


def refusal(namespace: Mapping[str, Any] | None, pod_spec: Mapping[str, Any]) -> Refusal | None:
    """The namespace's refusal of a Pod with this spec, or None when it admits it (or its level is unknown)."""
    level = enforced_level(namespace)
    found = violations(level, pod_spec)
    return Refusal(level, found) if found else None
