"""One level-triggered pass for one parent of single proxies: decide, mint keys, apply what differs, report.

A parent is a Service, an Ingress, a Connector or the API server proxy's ConfigMap (`kindtable.KINDS`, rows
run by this pass); its row says how to decide and what status it gets. Every pass starts from what is in the
API server now, so a pass after a crash, a missed event or a restart converges the same way. A pass that finds
everything as rendered sends no write at all (`writer.Writer`). Nothing is half-created: an auth key is minted
before the first object is written, and a parent whose key cannot be minted gets a status that says so and
nothing else. A Service that names a ProxyGroup goes to the egress pass instead (controller/passes/egress.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from tscommon import secretcontract as sc

from .. import adoption, podsecurity, proxyrbac, render, tlssecret
from .. import status as st
from ..config import TAILSCALE_LOGIN_SERVER
from ..kinds import apiserverproxy, ingress, meta, service
from ..kinds import proxyclass as pcl
from ..kindtable import KINDS, DecideInputs, class_of, handled, proxy_target
from ..kubeapi import CLUSTERROLEBINDINGS, NAMESPACES, ROLEBINDINGS, ROLES, SECRETS, SERVICES, STATEFULSETS, KubeError
from ..model import FINALIZER, Decision, Invalid, Parent, Pending, ProxySpec
from ..providers import REASON_UNSUPPORTED, ProviderError, limitations
from ..sameness import same
from ..writer import RBAC_RESOURCES, Writer, decode, ref
from .egress import EgressPass
from .proxyclass import class_state

log = logging.getLogger("controller")

#: Safety-net re-checks of a parent whose proxy is not ready yet and of a ready one: the watches on the proxies'
#: Secrets and StatefulSets bring changes at once, and a re-check reads the watch cache (controller/watchcache.py),
#: not the API server.
PENDING_RECHECK = 60.0
READY_RECHECK = 600.0
#: an object serving the user's own certificate from another namespace: its Secret checked again (docs/https.md)
TLS_RECHECK = 60.0
#: a parent whose proxy's StatefulSet is still going (foreground deletion)
CLEANUP_RECHECK = 2.0
#: The Warning event's reason when the proxies' namespace refuses the proxy's Pod (controller/podsecurity.py).
REASON_POD_SECURITY = "PodSecurityRefused"
#: A parent waiting for the namespace's label (or the CA's ConfigMap) is re-checked this often (neither is
#: watched: both are read once for all passes every `__main__.NAMESPACE_POLL`).
POD_SECURITY_RECHECK = 10.0


@dataclasses.dataclass(frozen=True)
class Blocked:
    """Why the proxy cannot run as rendered, checked before anything is minted."""

    misplaced: str = ""     # the class named where upstream does not read it (an annotation)
    refused: str = ""       # why the proxies' namespace would refuse the proxy's Pod
    ca_problem: str = ""    # why PROXY_CA_CONFIGMAP cannot give it the control server's CA


class ParentPass:
    def __init__(self, w: Writer, egress: EgressPass) -> None:
        self.w, self.egress = w, egress

    async def run(self, kind: str, namespace: str, name: str) -> float | None:
        w, info = self.w, KINDS[kind]
        obj = await w.kube.get(info.resource, name, namespace)
        if obj is None:
            return None
        m = meta(obj)
        if m.get("deletionTimestamp") or not handled(kind, obj, w.cfg):
            if FINALIZER in (m.get("finalizers") or []):
                if info.on_group is not None:
                    await self.egress.cleanup_service(obj)
                    obj = dict(await self.egress.clear_conditions(obj))
                if not await self.cleanup(kind, obj):
                    return CLEANUP_RECHECK
                await self.release(kind, obj)
            return None
        if info.on_group is not None and info.on_group(obj):
            return await self.egress.run_service(obj)
        if info.on_group is not None and self.egress.has_conditions(obj):
            # It named a ProxyGroup until now and asks for a proxy of its own instead.
            await self.egress.cleanup_service(obj)
            obj = dict(await self.egress.clear_conditions(obj))
        try:
            decision = await self.decide(kind, obj)
        except Invalid as e:
            await w.warn(obj, kind, info.invalid_reason, e.message)
            await self.write_status(kind, obj, None, [], st.Readiness(False, "", e.message), invalid=True)
            return None
        except Pending as e:
            await self.write_status(kind, obj, None, [], st.Readiness(False, "ProxyPending", str(e)))
            return PENDING_RECHECK
        sel = class_of(kind, obj, w.cfg)
        if sel.misplaced:
            decision = dataclasses.replace(decision, notices=decision.notices + (
                ("Warning", pcl.REASON_ANNOTATION, pcl.annotation_message(info.kind, sel.misplaced)),))
        if limits := limitations(w.provider, kind, decision.spec.apiserver_proxy_mode == "auth"):
            decision = dataclasses.replace(decision, notices=decision.notices + tuple(
                ("Warning", REASON_UNSUPPORTED, m) for m in limits))
        pc: pcl.ProxyClass | None = None
        spec = decision.spec
        waiting = ""                  # why the class cannot be used (missing, or not valid)
        crd_missing = False
        if sel.name:
            pc_obj, v = await class_state(w, sel.name)
            if pc_obj is None or not v.ok:
                running = await w.kube.get(STATEFULSETS, render.base_name(spec.parent), w.cfg.namespace)
                waiting = pcl.not_ready_message(sel.name, pc_obj, running=running is not None, validation=v)
                crd_missing = pc_obj is not None and v.crd_missing
                decision = dataclasses.replace(decision, notices=decision.notices + (
                    ("Warning", pcl.REASON_NOT_READY, waiting),))
            else:
                pc = pcl.ProxyClass.from_object(pc_obj)
                if pc.tags and spec.tags == w.cfg.proxy_tags:
                    # the class's TS_EXTRA_ARGS --advertise-tags: under the parent's own tags, over PROXY_TAGS
                    spec = dataclasses.replace(spec, tags=pc.tags)
        refused = "" if waiting else await self.pod_security(kind, spec, pc)
        ca_problem = "" if waiting else await w.ca_trust_problem()
        current = {f"InvalidBackend:{x}" for x in decision.warnings} | {f"{r}:{t}" for _, r, t in decision.notices}
        current |= {f"{REASON_POD_SECURITY}:{refused}"} if refused else set()
        current |= {f"{render.REASON_CA_TRUST}:{ca_problem}"} if ca_problem else set()
        w.keep_warnings(obj, current)
        for x in decision.warnings:
            await w.warn(obj, kind, "InvalidBackend", x)
        for etype, reason, message in decision.notices:
            await w.warn(obj, kind, reason, message, etype=etype)
        if waiting:
            # Nothing is created or changed until the class is there and valid; a running proxy keeps running as
            # it was. The class's watch brings the next pass (a missing ServiceMonitor CRD has none: re-checked).
            await self.write_status(kind, obj, None, [], st.Readiness(False, pcl.REASON_NOT_READY, waiting),
                                    condition_only=True)
            return PENDING_RECHECK if crd_missing else None
        await w.add_finalizer(kind, obj)
        return await self.provision(kind, obj, spec, pc, Blocked(sel.misplaced, refused, ca_problem))

    async def decide(self, kind: str, obj: Mapping[str, Any]) -> Decision:
        w, info = self.w, KINDS[kind]
        assert info.decide is not None, f"{kind} is not a parent of single proxies"
        m = meta(obj)
        ns = info.parent_namespace(obj)
        services = {}
        for n in info.backends(obj) if info.backends is not None else ():
            svc = await w.kube.get(SERVICES, n, ns)
            if svc is not None:
                services[n] = svc
        tls_secret, tls_hosts = info.tls_secret(obj) if info.tls_secret is not None else ("", ())
        fqdn = ""
        if (info.backends is not None and w.cfg.ingress_http) or tls_secret:
            # The plain-HTTP serve config and the user's certificate name the proxy's MagicDNS name, which only
            # the proxy knows: read it back from replica 0's state Secret (its write brings another pass).
            p = Parent(kind, m.get("name", ""), ns, m.get("uid", ""))
            data = decode(await w.kube.get(SECRETS, render.secret_name(p, 0), w.cfg.namespace)) or {}
            fqdn = sc.parse_device_fqdn(data.get(sc.KEY_DEVICE_FQDN)) if data.get(sc.KEY_DEVICE_ID) else ""
        problem = ""
        if tls_secret:   # the user's certificate, checked as far as the controller can see (docs/https.md)
            problem = tlssecret.tls_problem(await w.kube.get(SECRETS, tls_secret, ns), ns, tls_secret,
                                            ingress.tls_names(fqdn, tls_hosts), time.time(), info.tls_field)
        return info.decide(obj, w.cfg, DecideInputs(services, fqdn, problem))

    # ---- provisioning

    async def provision(self, kind: str, obj: Mapping[str, Any], spec: ProxySpec, pc: pcl.ProxyClass | None,
                        blocked: Blocked) -> float | None:
        """Mint, render, apply, report."""
        w, cfg, info, p = self.w, self.w.cfg, KINDS[kind], spec.parent
        refused, ca_problem = blocked.refused, blocked.ca_problem
        base = render.base_name(p)
        listed = await w.kube.list(SECRETS, cfg.namespace, render.child_selector(p))
        existing = {s["metadata"]["name"]: s for s in listed if adoption.is_ours(s["metadata"]["name"], base)}
        # Children with the parent's labels and another name are upstream's operator's (controller/adoption.py)
        theirs = [s for s in listed if not adoption.is_ours(s["metadata"]["name"], base)]
        for i in range(spec.replicas):
            # A Secret of the expected name without our labels (made by hand, or its labels lost) holds the
            # proxy's state: adopt it (the apply below restores the labels) rather than fail on create.
            n = render.secret_name(p, i)
            if n not in existing and (found := await w.kube.get(SECRETS, n, cfg.namespace)) is not None:
                existing[n] = found
        datas = [decode(existing.get(render.secret_name(p, i))) for i in range(spec.replicas)]
        # A Pod the namespace's Pod Security level refuses would leave the parent "not ready" for ever: say so
        # before anything is minted or created (a proxy that exists already keeps running; its state is
        # reported below).
        if refused and not existing:
            await w.warn(obj, kind, REASON_POD_SECURITY, refused)
            await self.write_status(kind, obj, spec, [], st.Readiness(False, info.failed_reason, refused))
            return POD_SECURITY_RECHECK
        if ca_problem:
            await w.warn(obj, kind, render.REASON_CA_TRUST, ca_problem)
            if not existing:        # the same for a CA the proxy could not be given: nothing minted or created
                await self.write_status(kind, obj, spec, [], st.Readiness(False, info.failed_reason, ca_problem))
                return POD_SECURITY_RECHECK
        plan = adoption.Plan()
        if theirs or not existing:
            plan = await self.upstream_plan(spec, theirs, datas)
        if plan.wait:
            for n in plan.stop:
                log.info("%s %s: stopping upstream's proxy %s before taking it over", kind, ref(p), n)
                await w.kube.delete(STATEFULSETS, n, cfg.namespace, propagation="Foreground")
            await self.write_status(kind, obj, spec, [], st.Readiness(
                False, "ProxyPending", "waiting for the Pods of upstream's operator's proxy to stop before this "
                "controller's proxy starts"))
            return CLEANUP_RECHECK
        for i, copied in plan.copies.items():
            if datas[i] is None:         # the Secret of ours is created with the device's state in it, below
                datas[i] = dict(copied)
        try:
            keys = await w.auth_keys(datas, spec.tags, f"{kind} {p.namespace}/{p.name}",
                                     f"{kind} {p.namespace}/{p.name}".strip(), logged_in=plan.copies)
        except ProviderError as e:
            msg = f"no auth key: {e}" if "no auth key" not in str(e) else str(e)
            if e.reason:        # the control plane's version cannot do it: said once as an event too
                await w.warn(obj, kind, e.reason, str(e))
            await self.write_status(kind, obj, spec, [], st.Readiness(False, info.failed_reason, msg))
            raise
        target = proxy_target(kind, spec, cfg)
        rendered = render.render(spec, cfg, tuple(keys), pc, target)
        await w.apply(SERVICES, rendered.service)
        for i, s in enumerate(rendered.secrets):
            await w.apply_secret(s, existing.get(s["metadata"]["name"]), state=plan.copies.get(i))
        await self.upstream_leftovers(kind, obj, plan, theirs)
        # Before the StatefulSet: a Pod never starts without the permissions its agent checks at boot (and a
        # scale-up's new Secret is in the Role before its Pod exists).
        for res, desired in zip(RBAC_RESOURCES, proxyrbac.objects(spec, cfg), strict=True):
            await w.apply(res, desired)
        if info.cluster_binding:
            await self.apply_impersonation(spec)
        if info.tls_role:
            await self.apply_tls_access(spec)
        sts = await w.apply(STATEFULSETS, rendered.statefulset)
        await w.metrics(kind, spec, rendered.statefulset, pc if pc is not None and target.endpoints else None)
        # Replicas scaled away: their devices and Secrets go too (as upstream).
        wanted = {s["metadata"]["name"] for s in rendered.secrets}
        await w.retire_secrets(s for n, s in sorted(existing.items()) if n not in wanted)
        if spec.egress_rewrite:
            patch = service.egress_rewrite_patch(obj, render.base_name(p), cfg)
            if patch is not None:
                # The answer carries the new generation, which the condition's observedGeneration must match.
                obj = await w.kube.patch(SERVICES, p.name, patch, p.namespace)
        tags_error = await w.sync_tags(kind, p, spec.tags, datas)
        devices = [st.device_info(render.secret_name(p, i), datas[i]) for i in range(spec.replicas)]
        ready_replicas = int(((sts or {}).get("status") or {}).get("readyReplicas") or 0)
        if refused and ready_replicas < spec.replicas:
            await w.warn(obj, kind, REASON_POD_SECURITY, refused)
        r = st.readiness(kind, devices, replicas=spec.replicas, ready_replicas=ready_replicas,
                         failure=str(tags_error or "") or
                         ((refused or ca_problem) if ready_replicas < spec.replicas else ""))
        if blocked.misplaced:
            r = st.Readiness(r.ok, r.reason, f"{r.message}; {pcl.annotation_message(info.kind, blocked.misplaced)}")
        await self.write_status(kind, obj, spec, devices, r)
        if tags_error is not None:
            raise tags_error                # retried with backoff; the condition says what failed
        if spec.tls_secret and info.tls_role:
            return TLS_RECHECK              # the user's Secret is not watched: re-checked this often
        return READY_RECHECK if r.ok else PENDING_RECHECK

    async def upstream_plan(self, spec: ProxySpec, theirs: list[dict],
                            datas: list[dict[str, bytes] | None]) -> adoption.Plan:
        """What to do about the proxy upstream's operator made for this parent (controller/adoption.py). Its
        StatefulSets and headless Services are looked for only when a Secret of upstream's is there or this
        controller has none yet: a steady pass sends no extra request."""
        w, cfg, p = self.w, self.w.cfg, spec.parent
        sel, base = render.child_selector(p), render.base_name(p)
        stss = await w.kube.list(STATEFULSETS, cfg.namespace, sel)
        svcs = await w.kube.list(SERVICES, cfg.namespace, sel)
        found = adoption.Found(
            tuple((o["metadata"]["name"], bool(o["metadata"].get("deletionTimestamp"))) for o in stss),
            tuple((o["metadata"]["name"], decode(o) or {}) for o in theirs),
            tuple(o["metadata"]["name"] for o in svcs))
        return adoption.plan(found, base=base, hostnames=[spec.replica_hostname(i) for i in range(spec.replicas)],
                             server_url=cfg.server_url, default_server=TAILSCALE_LOGIN_SERVER,
                             ours=dict(enumerate(datas)))

    async def upstream_leftovers(self, kind: str, obj: Mapping[str, Any], plan: adoption.Plan,
                                 theirs: list[dict]) -> None:
        """Upstream's Secrets and headless Service once this controller's Secrets are written: the events, then
        each Secret deleted keeping its device (adopted, or another control plane's), or retired with it."""
        w, ns = self.w, self.w.cfg.namespace
        for etype, reason, message in plan.events:
            await w.warn(obj, kind, reason, message, etype=etype)
        for n in (*plan.drop_secrets, *plan.forget_secrets):
            await w.kube.delete(SECRETS, n, ns)
        await w.retire_secrets(s for s in theirs if s["metadata"]["name"] in plan.retire_secrets)
        for n in plan.delete_services:
            await w.kube.delete(SERVICES, n, ns)

    async def apply_impersonation(self, spec: ProxySpec) -> None:
        """The API server proxy's ClusterRoleBinding to `impersonate`: there in auth mode, gone otherwise."""
        w = self.w
        want = proxyrbac.impersonation_binding(spec, w.cfg, apiserverproxy.IMPERSONATE_CLUSTER_ROLE)
        keep = want["metadata"]["name"] if want else None
        for o in await w.kube.list(CLUSTERROLEBINDINGS, "", render.child_selector(spec.parent)):
            if o["metadata"]["name"] != keep:
                await w.kube.delete(CLUSTERROLEBINDINGS, o["metadata"]["name"])
        if want is not None:
            await w.apply(CLUSTERROLEBINDINGS, want)

    async def apply_tls_access(self, spec: ProxySpec) -> None:
        """The proxy's read access to the TLS Secret in its parent's namespace: there while the parent names one,
        gone otherwise (controller/proxyrbac.py). In the controller's own namespace the proxy's Role has it."""
        w = self.w
        if spec.parent.namespace == w.cfg.namespace:
            return
        want = proxyrbac.tls_secret_access(spec, w.cfg)
        ns, sel = spec.parent.namespace, render.child_selector(spec.parent)
        for res, desired in zip((ROLEBINDINGS, ROLES), reversed(want) if want else (None, None), strict=True):
            for o in await w.kube.list(res, ns, sel):
                if desired is None or o["metadata"]["name"] != desired["metadata"]["name"]:
                    await w.kube.delete(res, o["metadata"]["name"], ns)
        for res, desired in zip((ROLES, ROLEBINDINGS), want or (), strict=False):
            await w.apply(res, desired)

    async def pod_security(self, kind: str, spec: ProxySpec, pc: pcl.ProxyClass | None) -> str:
        """Why the proxies' namespace would refuse this proxy's Pod, as rendered with its ProxyClass ("" when it
        admits it, or when its level cannot be read: a controller without `get` on namespaces goes on as
        before)."""
        cfg = self.w.cfg
        try:
            ns = await self.w.kube.get(NAMESPACES, cfg.namespace)
        except KubeError as e:
            if e.status not in (401, 403):
                raise
            log.debug("namespace %s not readable (%s): Pod Security level not checked", cfg.namespace, e)
            return ""
        sts = render.classed_statefulset(spec, cfg, pc, proxy_target(kind, spec, cfg))
        refusal = podsecurity.refusal(ns, sts["spec"]["template"]["spec"])
        return refusal.message(cfg.namespace, spec.userspace) if refusal else ""

    # ---- cleanup

    async def cleanup(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """The parent's proxy goes (`Writer.remove_proxy`). True when done."""
        return await self.w.remove_proxy(kind, obj)

    async def release(self, kind: str, obj: Mapping[str, Any]) -> None:
        """The object is no longer ours: a status we gave one that stays goes, then our finalizer."""
        w, info, m = self.w, KINDS[kind], meta(obj)
        ctype = info.condition_type
        conds = (obj.get("status") or {}).get("conditions") or []
        if info.released_status is not None and any(c.get("type") == ctype for c in conds) and \
                not m.get("deletionTimestamp"):
            rest = [c for c in conds if c.get("type") != ctype]
            obj = await w.patch_status(kind, obj, {"conditions": rest or None, **info.released_status}) or obj
        await w.remove_finalizer(kind, obj)

    # ---- status

    async def write_status(self, kind: str, obj: Mapping[str, Any], spec: ProxySpec | None,
                           devices: list[st.DeviceInfo], r: st.Readiness, *, invalid: bool = False,
                           condition_only: bool = False) -> None:
        w, info, cur = self.w, KINDS[kind], obj.get("status") or {}
        if invalid:
            r = st.readiness(kind, devices, replicas=1, ready_replicas=0, invalid=r.message)
        elif r.reason == "ProxyPending":
            r = st.Readiness(False, info.pending_reason, r.message)
        want: dict[str, Any] = {}
        if info.condition_type:
            conds = w.conditions(obj, info.condition_type, r.ok, r.reason, r.message)
            if not same(list(cur.get("conditions") or []), conds):
                want["conditions"] = conds
        if not condition_only:
            if info.status_fields is not None:
                want.update(info.status_fields(obj, spec, devices))
            if info.announces_url and spec is not None:
                await self.announce_url(kind, obj, spec, devices)
        await w.patch_status(kind, obj, want)

    async def announce_url(self, kind: str, obj: Mapping[str, Any], spec: ProxySpec,
                           devices: list[st.DeviceInfo]) -> None:
        """The API server proxy's status: its URL in an annotation on the ConfigMap, a Normal event and a log
        line when it becomes known or changes (ConfigMaps have no status)."""
        w, m = self.w, meta(obj)
        dev = devices[0] if devices else None
        # HTTPS where the control plane issues certificates, and in noauth mode anyway (a self-signed one: kubectl
        # sends credentials over TLS only); plain HTTP in auth mode without certificates
        # or the user's own certificate (docs/https.md)
        https = not w.cfg.ingress_http or spec.apiserver_proxy_mode == "noauth" or bool(spec.tls_secret)
        # the device's name, not the Pod's readiness: a restart (a mode change) keeps the same device and URL
        url = apiserverproxy.url(dev.hostname, dev.ips, https) if dev and dev.device_id and dev.hostname else ""
        if (m.get("annotations") or {}).get(apiserverproxy.ANN_URL, "") == url:
            return
        await w.kube.patch(KINDS[kind].resource, m["name"], {"metadata": {"annotations": {
            apiserverproxy.ANN_URL: url or None}}}, m.get("namespace", ""))
        if url:      # once per new URL: the annotation is the record that it was announced
            await w.warn(obj, kind, "APIServerProxyReady",
                         f"the API server proxy ({spec.apiserver_proxy_mode} mode) is at {url}; point kubectl "
                         f"at it: kubectl config set-cluster tailnet --server={url}", etype="Normal")
