"""The ProxyClass pass (shell around the pure controller/kinds/proxyclass.py): a class's condition and events,
then a pass of every parent that uses it (a changed class rolls its proxies, and only those).

`class_state` is also how the parents' and the ProxyGroups' passes read the class their proxies use: a class
that asks for a ServiceMonitor is valid only where the ServiceMonitor CRD exists (as upstream).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable

from ..kinds import meta
from ..kinds import proxyclass as pcl
from ..kindtable import KINDS, PARENT, class_of, handled
from ..kubeapi import CRDS, PROXYCLASSES, PROXYGROUPS
from ..model import PROXYCLASS, PROXYGROUP
from ..sameness import same
from ..writer import Writer

#: a class waiting for the ServiceMonitor CRD is checked again this often: a safety net, as the CRD's watch
#: queues every class when it is installed (controller.handlers); the check reads the watch cache
CRD_RECHECK = 60.0


async def class_state(w: Writer, name: str) -> tuple[dict | None, pcl.Validation]:
    """A class and its validation (None and an empty validation when it does not exist)."""
    obj = await w.kube.get(PROXYCLASSES, name)
    if obj is None:
        return None, pcl.Validation()
    crd = True
    if pcl.ProxyClass.from_object(obj).service_monitor:
        crd = await w.kube.get(CRDS, pcl.SERVICE_MONITOR_CRD) is not None
    return obj, pcl.validate(obj, service_monitor_crd=crd)


class ProxyClassPass:
    def __init__(self, w: Writer) -> None:
        self.w = w
        #: queues another pass of a key (the work queue's poke)
        self.poke: Callable[[Hashable], None] = lambda key: None

    async def run(self, kind: str, namespace: str, name: str) -> float | None:
        w = self.w
        obj, v = await class_state(w, name)
        if obj is not None:
            status, reason, message = pcl.ready_condition(v)
            cur = obj.get("status") or {}
            conds = w.conditions(obj, pcl.COND_READY, status == "True", reason, message)
            current = {f"{r}:{t}" for r, t in v.warnings}
            if not v.ok:
                current.add(f"{pcl.REASON_INVALID}:{message}")
            w.keep_warnings(obj, current)
            if not v.ok:
                await w.warn(obj, PROXYCLASS, pcl.REASON_INVALID, message)
            for r, t in v.warnings:
                await w.warn(obj, PROXYCLASS, r, t)
            if not same(list(cur.get("conditions") or []), conds):
                await w.patch_status(PROXYCLASS, obj, {"conditions": conds})
        for key in await self.users(name):
            self.poke(key)
        return CRD_RECHECK if v.crd_missing else None

    async def users(self, name: str) -> list[tuple[str, str, str]]:
        """The parents whose proxies use this class (by label, spec.proxyClass, or as the default)."""
        w = self.w
        default = name == w.cfg.default_proxy_class
        sel = "" if default else f"{pcl.LABEL_PROXY_CLASS}={name}"
        found: list[tuple[str, str, str]] = []
        for info in KINDS.values():
            if info.runs != PARENT or not info.queued_by_class:
                continue
            for o in await w.kube.list(info.resource, "", "" if info.class_in_spec else sel):
                if handled(info.key, o, w.cfg) and class_of(info.key, o, w.cfg).name == name:
                    found.append((info.key, info.parent_namespace(o), meta(o).get("name", "")))
        for o in await w.kube.list(PROXYGROUPS):
            if class_of(PROXYGROUP, o, w.cfg).name == name:
                found.append((PROXYGROUP, "", meta(o).get("name", "")))
        return found
