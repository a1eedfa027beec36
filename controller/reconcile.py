"""One level-triggered pass for one parent: decide, mint keys, apply what differs, report (the shell's core).

Every pass starts from what is in the API server now, so a pass after a crash, a missed event or a restart
converges the same way. A pass that finds everything as rendered sends no write at all: objects carry the
hash of their rendering, Secrets are compared key by key, statuses field by field, and Warning events are
sent once per distinct problem. Nothing is half-created: an auth key is minted before the first object is
written, and a parent whose key cannot be minted gets a status that says so and nothing else.
"""
from __future__ import annotations

import base64
import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from tscommon import secretcontract as sc
from tscommon.redact import redact

from . import podsecurity, proxyclass as pcl, proxyrbac, render, status as st
from .config import ControllerConfig
from .kinds import apiserverproxy, connector, egress, ingress, meta, service
from .kubeapi import (CLUSTERROLEBINDINGS, CONFIGMAPS, CONNECTORS, CRDS, EVENTS, INGRESSES, NAMESPACES, PROXYCLASSES,
                      PROXYGROUPS, ROLEBINDINGS, ROLES, SECRETS, SERVICEACCOUNTS, SERVICEMONITORS, SERVICES,
                      STATEFULSETS, Kube, KubeError, Resource)
from .model import (APISERVER, CONNECTOR, FINALIZER, INGRESS, LABEL_PROXY_GROUP, PROXYCLASS, PROXYGROUP, SVC, Decision,
                    Invalid, Parent, Pending, ProxySpec)
from .pgreconcile import GroupReconciler
from .sameness import same
from .providers import Provider, ProviderError

log = logging.getLogger("controller")

RESOURCES: dict[str, Resource] = {SVC: SERVICES, INGRESS: INGRESSES, CONNECTOR: CONNECTORS, PROXYGROUP: PROXYGROUPS,
                                  APISERVER: CONFIGMAPS}
#: A proxy's own identity (controller/proxyrbac.py), in creation order.
RBAC_RESOURCES = (SERVICEACCOUNTS, ROLES, ROLEBINDINGS)
#: Safety-net re-checks of a parent whose proxy is not ready yet and of a ready one: the watches on the proxies'
#: Secrets and StatefulSets bring changes at once, so polling 500 parents must not cost much.
PENDING_RECHECK = 60.0
READY_RECHECK = 600.0
TLS_RECHECK = 60.0          # an Ingress serving its own certificate: its Secret checked again (docs/https.md)
#: A device's tags, once seen equal to the wanted ones, are read again after this long (a re-tag by hand in
#: the admin console is undone then); a change of the wanted tags is acted on at the next pass.
TAGS_RECHECK = 3600.0
#: The Warning event's reason when the proxies' namespace refuses the proxy's Pod (controller/podsecurity.py).
REASON_POD_SECURITY = "PodSecurityRefused"
#: A parent waiting for the namespace's label (or the CA's ConfigMap) is re-checked this often (neither is
#: watched; one GET).
POD_SECURITY_RECHECK = 10.0


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _decode(secret: Mapping[str, Any] | None) -> dict[str, bytes] | None:
    if secret is None:
        return None
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


def handled(kind: str, obj: Mapping[str, Any], cfg: ControllerConfig) -> bool:
    if kind == PROXYGROUP:
        return True
    if kind == SVC and egress.handled(obj):
        return True
    return {SVC: service.handled, INGRESS: ingress.handled, CONNECTOR: connector.handled,
            APISERVER: apiserverproxy.handled}[kind](obj, cfg)


class Reconciler:
    def __init__(self, kube: Kube, provider: Provider, cfg: ControllerConfig, *,
                 now: Callable[[], str] = _now, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.provider, self.cfg, self.now, self.clock = kube, provider, cfg, now, clock
        self._warned: dict[str, set[str]] = {}     # parent UID -> problems already sent as Warning events
        self._tags_ok: dict[str, tuple[tuple[str, ...], float]] = {}   # device -> (tags seen equal, when)
        self.groups = GroupReconciler(self)     # ProxyGroups and the egress Services on them
        #: queues another pass of a key (the work queue's poke); a ProxyClass's pass wakes the parents using it
        self.poke: Callable[[Hashable], None] = lambda key: None

    # ---- entry point

    async def reconcile(self, kind: str, namespace: str, name: str) -> float | None:
        """One pass; returns seconds until the next check (None: wait for an event). Raises on API or control
        plane errors (the caller retries with backoff)."""
        if kind == PROXYGROUP:
            return await self.groups.reconcile_group(name)
        if kind == PROXYCLASS:
            return await self.reconcile_class(name)
        obj = await self.kube.get(RESOURCES[kind], name, namespace)
        if obj is None:
            return None
        m = meta(obj)
        if m.get("deletionTimestamp") or not handled(kind, obj, self.cfg):
            if FINALIZER in (m.get("finalizers") or []):
                if kind == SVC:
                    await self.groups.cleanup_service(obj)
                    obj = dict(await self.groups.clear_conditions(obj))
                if not await self.cleanup(kind, obj):
                    return 2.0
                await self._remove_finalizer(kind, obj)
            return None
        if kind == SVC and egress.handled(obj):
            return await self.groups.reconcile_service(obj)
        if kind == SVC and self.groups.has_conditions(obj):
            # It named a ProxyGroup until now and asks for a proxy of its own instead.
            await self.groups.cleanup_service(obj)
            obj = dict(await self.groups.clear_conditions(obj))
        try:
            decision = await self._decide(kind, obj)
        except Invalid as e:
            await self._report_invalid(kind, obj, e.message)
            return None
        except Pending as e:
            await self._write_status(kind, obj, None, [], st.Readiness(False, "ProxyPending", str(e)))
            return PENDING_RECHECK
        sel = pcl.select(kind == CONNECTOR, obj, self.cfg.default_proxy_class)
        if sel.misplaced:
            decision = dataclasses.replace(decision, notices=decision.notices + (
                ("Warning", pcl.REASON_ANNOTATION, pcl.annotation_message(_k8s_kind(kind), sel.misplaced)),))
        pc: pcl.ProxyClass | None = None
        spec = decision.spec
        waiting = ""                  # why the class cannot be used (missing, or not valid)
        crd_missing = False
        if sel.name:
            pc_obj, v = await self._class_state(sel.name)
            if pc_obj is None or not v.ok:
                running = await self.kube.get(STATEFULSETS, render.base_name(spec.parent), self.cfg.namespace)
                waiting = pcl.not_ready_message(sel.name, pc_obj, running=running is not None, validation=v)
                crd_missing = pc_obj is not None and v.crd_missing
                decision = dataclasses.replace(decision, notices=decision.notices + (
                    ("Warning", pcl.REASON_NOT_READY, waiting),))
            else:
                pc = pcl.ProxyClass.from_object(pc_obj)
                if pc.tags and spec.tags == self.cfg.proxy_tags:
                    # the class's TS_EXTRA_ARGS --advertise-tags: under the parent's own tags, over PROXY_TAGS
                    spec = dataclasses.replace(spec, tags=pc.tags)
        refused = "" if waiting else await self._pod_security(kind, spec, pc)
        ca_problem = "" if waiting else await self.ca_trust_problem()
        # Only what this pass still reports stays remembered: a problem that goes and comes back is sent again.
        current = {f"InvalidBackend:{w}" for w in decision.warnings} | {f"{r}:{t}" for _, r, t in decision.notices}
        current |= {f"{REASON_POD_SECURITY}:{refused}"} if refused else set()
        current |= {f"{render.REASON_CA_TRUST}:{ca_problem}"} if ca_problem else set()
        if (seen := self._warned.get(m.get("uid", ""))) is not None:
            seen &= current
        for w in decision.warnings:
            await self._warn(obj, kind, "InvalidBackend", w)
        for etype, reason, message in decision.notices:
            await self._warn(obj, kind, reason, message, etype=etype)
        if waiting:
            # Nothing is created or changed until the class is there and valid; a running proxy keeps running as
            # it was. The class's watch brings the next pass (a missing ServiceMonitor CRD has none: re-checked).
            await self._write_status(kind, obj, None, [], st.Readiness(False, pcl.REASON_NOT_READY, waiting),
                                     condition_only=True)
            return PENDING_RECHECK if crd_missing else None
        await self._ensure_finalizer(kind, obj)
        return await self._provision(kind, obj, spec, pc, sel.misplaced, refused, ca_problem)

    async def _class_state(self, name: str) -> tuple[dict | None, pcl.Validation]:
        """A class and its validation; a class asking for a ServiceMonitor is valid only where the
        ServiceMonitor CRD exists (as upstream)."""
        obj = await self.kube.get(PROXYCLASSES, name)
        if obj is None:
            return None, pcl.Validation()
        crd = True
        if pcl.ProxyClass.from_object(obj).service_monitor:
            crd = await self.kube.get(CRDS, pcl.SERVICE_MONITOR_CRD) is not None
        return obj, pcl.validate(obj, service_monitor_crd=crd)

    async def reconcile_class(self, name: str) -> float | None:
        """A ProxyClass's pass: its ProxyClassReady condition, Warning events for what is wrong or doubtful, then
        every parent using it is queued (a changed class rolls its proxies, and only those)."""
        obj, v = await self._class_state(name)
        if obj is not None:
            status, reason, message = pcl.ready_condition(v)
            m, cur = meta(obj), obj.get("status") or {}
            cond = st.condition(pcl.COND_READY, status == "True", reason, message, generation=m.get("generation"),
                                previous=cur.get("conditions"), now=self.now())
            conds = st.with_condition(cur.get("conditions"), cond)
            current = {f"{r}:{t}" for r, t in v.warnings}
            if not v.ok:
                current.add(f"{pcl.REASON_INVALID}:{message}")
            if (seen := self._warned.get(m.get("uid", ""))) is not None:
                seen &= current
            if not v.ok:
                await self._warn(obj, PROXYCLASS, pcl.REASON_INVALID, message)
            for r, t in v.warnings:
                await self._warn(obj, PROXYCLASS, r, t)
            if not same(list(cur.get("conditions") or []), conds):
                await self.kube.patch(PROXYCLASSES, name, {"status": {"conditions": conds}}, subresource="status")
        for key in await self.class_users(name):
            self.poke(key)
        return PENDING_RECHECK if v.crd_missing else None

    async def class_users(self, name: str) -> list[tuple[str, str, str]]:
        """The parents whose proxies use this class (by label, spec.proxyClass, or as the default)."""
        default = name == self.cfg.default_proxy_class
        sel = "" if default else f"{pcl.LABEL_PROXY_CLASS}={name}"
        found: list[tuple[str, str, str]] = []
        for kind, res, s in ((SVC, SERVICES, sel), (INGRESS, INGRESSES, sel), (CONNECTOR, CONNECTORS, "")):
            for o in await self.kube.list(res, "", s):
                m = meta(o)
                if (handled(kind, o, self.cfg) and
                        pcl.select(kind == CONNECTOR, o, self.cfg.default_proxy_class).name == name):
                    found.append((kind, m.get("namespace", "") if kind != CONNECTOR else "", m.get("name", "")))
        for o in await self.kube.list(PROXYGROUPS):
            # spec.proxyClass, else the default: as a Connector (upstream's ProxyGroup reconciler)
            if pcl.select(True, o, self.cfg.default_proxy_class).name == name:
                found.append((PROXYGROUP, "", meta(o).get("name", "")))
        return found

    async def _decide(self, kind: str, obj: Mapping[str, Any]) -> Decision:
        if kind == SVC:
            return service.decide(obj, self.cfg)
        if kind == CONNECTOR:
            return connector.decide(obj, self.cfg)
        if kind == APISERVER:
            d = apiserverproxy.decide(obj, self.cfg)
            if d.spec.tls_secret:   # its own certificate, checked as an Ingress's (docs/https.md)
                ns = self.cfg.namespace
                problem = ingress.tls_problem(
                    await self.kube.get(SECRETS, d.spec.tls_secret, ns), ns, d.spec.tls_secret,
                    ingress.tls_names(await self._device_fqdn(d.spec.parent), ()), time.time(),
                    "apiServerProxy.tls.secretName")
                if problem:
                    d = dataclasses.replace(d, notices=d.notices + (("Warning", ingress.REASON_TLS, problem),))
            return d
        ns = meta(obj).get("namespace", "")
        services = {}
        for n in ingress.backend_services(obj):
            svc = await self.kube.get(SERVICES, n, ns)
            if svc is not None:
                services[n] = svc
        fqdn = ""
        tls_secret, tls_hosts = ingress.tls_entry(obj)
        if self.cfg.ingress_http or tls_secret:
            # The plain-HTTP serve config names the proxy's MagicDNS name, which only the proxy knows: read it
            # back from replica 0's state Secret (its write brings another pass).
            m = meta(obj)
            fqdn = await self._device_fqdn(Parent(INGRESS, m.get("name", ""), ns, m.get("uid", "")))
        problem = ""
        if tls_secret:   # the user's certificate, checked as far as the controller can see (docs/https.md)
            problem = ingress.tls_problem(await self.kube.get(SECRETS, tls_secret, ns), ns, tls_secret,
                                          ingress.tls_names(fqdn, tls_hosts), time.time())
        return ingress.decide(obj, self.cfg, services, fqdn, problem)

    async def _device_fqdn(self, p: Parent) -> str:
        """The MagicDNS name replica 0's proxy wrote into its state Secret, "" before it registered."""
        data = _decode(await self.kube.get(SECRETS, render.secret_name(p, 0), self.cfg.namespace))
        return sc.parse_device_fqdn((data or {}).get(sc.KEY_DEVICE_FQDN)) if (data or {}).get(
            sc.KEY_DEVICE_ID) else ""

    # ---- provisioning

    async def _provision(self, kind: str, obj: Mapping[str, Any], spec: ProxySpec, pc: pcl.ProxyClass | None = None,
                         misplaced: str = "", refused: str = "", ca_problem: str = "") -> float | None:
        """Mint, render, apply, report. `refused`: why the proxies' namespace would refuse the proxy's Pod;
        `ca_problem`: why PROXY_CA_CONFIGMAP cannot give it the control server's CA."""
        cfg, p = self.cfg, spec.parent
        existing = {s["metadata"]["name"]: s for s in
                    await self.kube.list(SECRETS, cfg.namespace, render.child_selector(p))}
        for i in range(spec.replicas):
            # A Secret of the expected name without our labels (made by hand, or its labels lost) holds the
            # proxy's state: adopt it (the apply below restores the labels) rather than fail on create.
            n = render.secret_name(p, i)
            if n not in existing and (found := await self.kube.get(SECRETS, n, cfg.namespace)) is not None:
                existing[n] = found
        datas = [_decode(existing.get(render.secret_name(p, i))) for i in range(spec.replicas)]
        # A Pod the namespace's Pod Security level refuses would leave the parent "not ready" for ever: say so
        # before anything is minted or created (a proxy that exists already keeps running; its state is
        # reported below).
        if refused and not existing:
            await self._warn(obj, kind, REASON_POD_SECURITY, refused)
            await self._write_status(kind, obj, spec, [], st.Readiness(False, _failed(kind), refused))
            return POD_SECURITY_RECHECK
        if ca_problem:
            await self._warn(obj, kind, render.REASON_CA_TRUST, ca_problem)
            if not existing:        # the same for a CA the proxy could not be given: nothing minted or created
                await self._write_status(kind, obj, spec, [], st.Readiness(False, _failed(kind), ca_problem))
                return POD_SECURITY_RECHECK
        keys: list[str] = []
        try:
            for i, data in enumerate(datas):
                action = st.authkey_action(data)
                if action in ("new", "reissue"):
                    if action == "reissue":
                        old = (data or {}).get("device_id", b"").decode(errors="replace").strip()
                        if old:
                            await self.provider.delete_device(old)
                        log.info("%s %s/%s replica %d asked for a new auth key; issuing one", kind,
                                 p.namespace, p.name, i)
                    keys.append(await self.provider.create_auth_key(
                        spec.tags, description=f"{kind} {p.namespace}/{p.name}".strip()))
                else:
                    keys.append(st.config_authkey(data) if action == "keep" else "")
        except ProviderError as e:
            msg = f"no auth key: {e}" if "no auth key" not in str(e) else str(e)
            await self._write_status(kind, obj, spec, [], st.Readiness(False, _failed(kind), msg))
            raise
        rendered = render.render(spec, cfg, tuple(keys))
        target = proxy_target(kind, spec, cfg)
        rendered = render.Rendered(
            rendered.service, tuple(pcl.apply_to_config_secret(s, pc) for s in rendered.secrets),
            render.rehash(pcl.apply_to_statefulset(rendered.statefulset, pc, target)) if pc else rendered.statefulset)
        await self._apply(SERVICES, rendered.service)
        for s in rendered.secrets:
            await self._apply_secret(s, existing.get(s["metadata"]["name"]))
        # Before the StatefulSet: a Pod never starts without the permissions its agent checks at boot (and a
        # scale-up's new Secret is in the Role before its Pod exists).
        for res, desired in zip(RBAC_RESOURCES, proxyrbac.objects(spec, cfg)):
            await self._apply(res, desired)
        if kind == APISERVER:
            await self._apply_impersonation(spec)
        if kind == INGRESS:
            await self._apply_tls_access(spec)
        sts = await self._apply(STATEFULSETS, rendered.statefulset)
        await self._metrics(kind, spec, rendered.statefulset, pc if pc is not None and target.endpoints else None)
        # Replicas scaled away: their devices and Secrets go too (as upstream).
        wanted = {s["metadata"]["name"] for s in rendered.secrets}
        for n, s in sorted(existing.items()):
            if n not in wanted:
                await self._delete_device_of(_decode(s))
                await self.kube.delete(SECRETS, n, cfg.namespace)
        if spec.egress_rewrite:
            patch = service.egress_rewrite_patch(obj, render.base_name(p), cfg)
            if patch is not None:
                # The answer carries the new generation, which the condition's observedGeneration must match.
                obj = await self.kube.patch(SERVICES, p.name, patch, p.namespace)
        tags_error = await self._sync_tags(kind, p, spec.tags, datas)
        devices = [st.device_info(render.secret_name(p, i), datas[i]) for i in range(spec.replicas)]
        ready_replicas = int(((sts or {}).get("status") or {}).get("readyReplicas") or 0)
        if refused and ready_replicas < spec.replicas:
            await self._warn(obj, kind, REASON_POD_SECURITY, refused)
        blocked = refused or ca_problem
        r = st.readiness(kind, devices, replicas=spec.replicas, ready_replicas=ready_replicas,
                         failure=str(tags_error or "") or (blocked if ready_replicas < spec.replicas else ""))
        if misplaced:
            r = st.Readiness(r.ok, r.reason, f"{r.message}; {pcl.annotation_message(_k8s_kind(kind), misplaced)}")
        await self._write_status(kind, obj, spec, devices, r)
        if tags_error is not None:
            raise tags_error                # retried with backoff; the condition says what failed
        if spec.tls_secret and kind == INGRESS:
            return TLS_RECHECK          # the user's Secret is not watched: re-checked this often
        return READY_RECHECK if r.ok else PENDING_RECHECK

    async def ca_trust_problem(self) -> str:
        """Why PROXY_CA_CONFIGMAP's ConfigMap cannot give the proxies the control server's CA ("" when it can, when
        the setting is unset, and when the ConfigMap cannot be read: a controller without `get` on ConfigMaps goes
        on, and the kubelet's event names a missing one)."""
        if not self.cfg.proxy_ca_configmap:
            return ""
        try:
            cm = await self.kube.get(CONFIGMAPS, self.cfg.proxy_ca_configmap, self.cfg.namespace)
        except KubeError as e:
            if e.status not in (401, 403):
                raise
            log.debug("ConfigMap %s not readable (%s): not checked", self.cfg.proxy_ca_configmap, e)
            return ""
        return render.ca_trust_problem(self.cfg, cm)

    async def _pod_security(self, kind: str, spec: ProxySpec, pc: pcl.ProxyClass | None) -> str:
        """Why the proxies' namespace would refuse this proxy's Pod, as rendered with its ProxyClass ("" when it
        admits it, or when its level cannot be read: a controller without `get` on namespaces goes on as
        before)."""
        try:
            ns = await self.kube.get(NAMESPACES, self.cfg.namespace)
        except KubeError as e:
            if e.status not in (401, 403):
                raise
            log.debug("namespace %s not readable (%s): Pod Security level not checked", self.cfg.namespace, e)
            return ""
        sts = render.statefulset(spec, self.cfg)
        if pc is not None:
            sts = pcl.apply_to_statefulset(sts, pc, proxy_target(kind, spec, self.cfg))
        refusal = podsecurity.refusal(ns, sts["spec"]["template"]["spec"])
        return refusal.message(self.cfg.namespace, spec.userspace) if refusal else ""

    async def _metrics(self, kind: str, spec: ProxySpec, sts: Mapping[str, Any], pc: pcl.ProxyClass | None) -> None:
        """The metrics Service (and a ServiceMonitor) of a class with metrics.enable; removed when no longer
        asked for."""
        p = spec.parent
        name = f"{sts['metadata']['name']}-metrics"
        if pc is not None and pc.metrics:
            svc = render.rehash(pcl.metrics_service(sts, _proxy_type(kind, spec), p.name, p.namespace))
            await self._apply(SERVICES, svc)
            if pc.service_monitor:
                await self._apply(SERVICEMONITORS, render.rehash(pcl.service_monitor(svc, pc)))
                return
        elif await self.kube.get(SERVICES, name, self.cfg.namespace) is not None:
            await self.kube.delete(SERVICES, name, self.cfg.namespace)
        else:
            return
        await self._delete_service_monitors(p)

    async def _delete_service_monitors(self, p: Parent) -> None:
        try:
            for o in await self.kube.list(SERVICEMONITORS, self.cfg.namespace, render.child_selector(p)):
                await self.kube.delete(SERVICEMONITORS, o["metadata"]["name"], self.cfg.namespace)
        except KubeError as e:
            if e.status != 404:          # no ServiceMonitor CRD: there is nothing to delete
                raise

    async def _sync_tags(self, kind: str, p: Parent, tags: tuple[str, ...],
                         datas: list[dict[str, bytes] | None]) -> ProviderError | None:
        """Registered devices get the tags the parent now wants (`tailscale.com/tags`, `spec.tags` or
        PROXY_TAGS): upstream applies tags to newly minted keys only, so a changed annotation left existing
        devices with their old tags. Read, compare as sets, write only when they differ."""
        want = tuple(sorted(set(tags)))
        for data in datas:
            dev = (data or {}).get("device_id", b"").decode(errors="replace").strip()
            if not dev or st.authkey_action(data) == "reissue":
                continue
            ok = self._tags_ok.get(dev)
            if ok is not None and ok[0] == want and self.clock() - ok[1] < TAGS_RECHECK:
                continue
            try:
                have = await self.provider.device_tags(dev)
                if have is None:             # gone, or a provider that cannot tell
                    continue
                if have != want:
                    await self.provider.set_device_tags(dev, want)
                    log.info("%s %s: device %s re-tagged from %s to %s", kind, _ref(p), dev, ",".join(have) or "-",
                             ",".join(want))
            except ProviderError as e:
                self._tags_ok.pop(dev, None)
                return ProviderError(f"device tags not applied ({','.join(want)} on device {dev}): {e}",
                                     transient=e.transient)
            self._tags_ok[dev] = (want, self.clock())
        return None

    async def _apply(self, res: Resource, desired: dict) -> dict | None:
        """Create, or merge-patch when the rendering's hash differs; nothing when it is equal."""
        md = desired["metadata"]
        ns = md.get("namespace", "")
        cur = await self.kube.get(res, md["name"], ns)
        if cur is None:
            return await self.kube.create(res, desired, ns)
        want = md["annotations"][render.SPEC_HASH]
        if (cur["metadata"].get("annotations") or {}).get(render.SPEC_HASH) == want:
            return cur
        return await self.kube.patch(res, md["name"], desired, ns)

    async def _apply_impersonation(self, spec: ProxySpec) -> None:
        """The API server proxy's ClusterRoleBinding to `impersonate`: there in auth mode, gone otherwise."""
        want = proxyrbac.impersonation_binding(spec, self.cfg, apiserverproxy.IMPERSONATE_CLUSTER_ROLE)
        keep = want["metadata"]["name"] if want else None
        for o in await self.kube.list(CLUSTERROLEBINDINGS, "", render.child_selector(spec.parent)):
            if o["metadata"]["name"] != keep:
                await self.kube.delete(CLUSTERROLEBINDINGS, o["metadata"]["name"])
        if want is not None:
            await self._apply(CLUSTERROLEBINDINGS, want)

    async def _apply_tls_access(self, spec: ProxySpec) -> None:
        """The Ingress proxy's read access to its TLS Secret, in the Ingress's namespace: there while the Ingress
        names one, gone otherwise (controller/proxyrbac.py)."""
        want = proxyrbac.tls_secret_access(spec, self.cfg)
        ns, sel = spec.parent.namespace, render.child_selector(spec.parent)
        for res, desired in zip((ROLEBINDINGS, ROLES), reversed(want) if want else (None, None)):
            for o in await self.kube.list(res, ns, sel):
                if desired is None or o["metadata"]["name"] != desired["metadata"]["name"]:
                    await self.kube.delete(res, o["metadata"]["name"], ns)
        for res, desired in zip((ROLES, ROLEBINDINGS), want or ()):
            await self._apply(res, desired)

    async def _apply_secret(self, desired: dict, cur: Mapping[str, Any] | None) -> None:
        md = desired["metadata"]
        data = {k: base64.b64encode(v.encode()).decode() for k, v in desired["stringData"].items()}
        if cur is None:
            body = {k: v for k, v in desired.items() if k != "stringData"}
            await self.kube.create(SECRETS, {**body, "data": data}, md["namespace"])
            return
        have = cur.get("data") or {}
        changed = {k: v for k, v in data.items() if have.get(k) != v}
        labels_ok = all((cur["metadata"].get("labels") or {}).get(k) == v for k, v in md["labels"].items())
        if changed or not labels_ok:
            await self.kube.patch(SECRETS, md["name"], {"metadata": {"labels": md["labels"]}, "data": changed},
                                  md["namespace"])

    async def _delete_device_of(self, data: Mapping[str, bytes] | None) -> None:
        dev = (data or {}).get("device_id", b"").decode(errors="replace").strip()
        if dev:
            await self.provider.delete_device(dev)
            self._tags_ok.pop(dev, None)

    # ---- cleanup

    async def cleanup(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """StatefulSet (foreground), then each device, the Secrets, the headless Service, the proxy's
        ServiceAccount, Role and RoleBinding (its Pods are gone by then). True when done."""
        m = meta(obj)
        p = Parent(kind, m.get("name", ""), m.get("namespace", "") if kind != CONNECTOR else "", m.get("uid", ""))
        sel, ns = render.child_selector(p), self.cfg.namespace
        stss = await self.kube.list(STATEFULSETS, ns, sel)
        if stss:
            for s in stss:
                if not s["metadata"].get("deletionTimestamp"):
                    await self.kube.delete(STATEFULSETS, s["metadata"]["name"], ns, propagation="Foreground")
            return False
        for s in await self.kube.list(SECRETS, ns, sel):
            await self._delete_device_of(_decode(s))
            await self.kube.delete(SECRETS, s["metadata"]["name"], ns)
        for s in await self.kube.list(SERVICES, ns, sel):
            if (s["metadata"].get("labels") or {}).get(LABEL_PROXY_GROUP):
                continue        # a ProxyGroup egress Service's (GroupReconciler.cleanup_service)
            await self.kube.delete(SERVICES, s["metadata"]["name"], ns)
        for res in reversed(RBAC_RESOURCES):
            for o in await self.kube.list(res, ns, sel):
                await self.kube.delete(res, o["metadata"]["name"], ns)
        if kind == APISERVER:
            for o in await self.kube.list(CLUSTERROLEBINDINGS, "", sel):
                await self.kube.delete(CLUSTERROLEBINDINGS, o["metadata"]["name"])
        if kind == INGRESS and p.namespace != ns:     # the TLS Secret's Role and RoleBinding
            for res in (ROLEBINDINGS, ROLES):
                for o in await self.kube.list(res, p.namespace, sel):
                    await self.kube.delete(res, o["metadata"]["name"], p.namespace)
        if await self.kube.get(CRDS, pcl.SERVICE_MONITOR_CRD) is not None:
            await self._delete_service_monitors(p)
        log.info("%s %s: proxy removed", kind, _ref(p))
        return True

    async def _ensure_finalizer(self, kind: str, obj: Mapping[str, Any]) -> None:
        m = meta(obj)
        fins = list(m.get("finalizers") or [])
        if FINALIZER not in fins:
            await self.kube.patch(RESOURCES[kind], m["name"], {"metadata": {
                "finalizers": fins + [FINALIZER], "resourceVersion": m.get("resourceVersion")}},
                m.get("namespace", ""))

    async def _remove_finalizer(self, kind: str, obj: Mapping[str, Any]) -> None:
        m = meta(obj)
        ctype = st.condition_type(kind)
        conds = (obj.get("status") or {}).get("conditions") or []
        if kind == SVC and any(c.get("type") == ctype for c in conds) and not m.get("deletionTimestamp"):
            rest = [c for c in conds if c.get("type") != ctype]
            obj = await self.kube.patch(SERVICES, m["name"], {"status": {"conditions": rest or None,
                                                                         "loadBalancer": {"ingress": None}}},
                                        m.get("namespace", ""), subresource="status")
            m = meta(obj)
        fins = [f for f in m.get("finalizers") or [] if f != FINALIZER]
        await self.kube.patch(RESOURCES[kind], m["name"], {"metadata": {
            "finalizers": fins or None, "resourceVersion": m.get("resourceVersion")}}, m.get("namespace", ""))
        self._warned.pop(m.get("uid", ""), None)

    # ---- status and events

    async def _report_invalid(self, kind: str, obj: Mapping[str, Any], message: str) -> None:
        await self._warn(obj, kind, "ConnectorInvalid" if kind == CONNECTOR else "ProxyInvalid", message)
        await self._write_status(kind, obj, None, [], st.Readiness(False, "", message), invalid=True)

    async def _write_status(self, kind: str, obj: Mapping[str, Any], spec: ProxySpec | None,
                            devices: list[st.DeviceInfo], r: st.Readiness, *, invalid: bool = False,
                            condition_only: bool = False) -> None:
        m, cur = meta(obj), obj.get("status") or {}
        if invalid:
            r = st.readiness(kind, devices, replicas=1, ready_replicas=0, invalid=r.message)
        elif kind == CONNECTOR and r.reason == "ProxyPending":
            r = st.Readiness(False, "ConnectorCreating", r.message)
        want: dict[str, Any] = {}
        ctype = st.condition_type(kind)
        if ctype:
            cond = st.condition(ctype, r.ok, r.reason, r.message, generation=m.get("generation"),
                                previous=cur.get("conditions"), now=self.now())
            conds = st.with_condition(cur.get("conditions"), cond)
            if not same(list(cur.get("conditions") or []), conds):
                want["conditions"] = conds
        if condition_only:
            pass
        elif kind == SVC and service.is_load_balancer(obj) and not service.is_egress(obj):
            lb = st.service_load_balancer(devices, st.service_families(obj))
            if not same((cur.get("loadBalancer") or {}).get("ingress"), lb.get("ingress")):
                want["loadBalancer"] = {"ingress": lb.get("ingress")}
        elif kind == INGRESS and spec is not None:
            lb = st.ingress_load_balancer(devices, spec)
            if not same((cur.get("loadBalancer") or {}).get("ingress"), lb.get("ingress")):
                want["loadBalancer"] = {"ingress": lb.get("ingress")}
        elif kind == APISERVER and spec is not None:
            await self._apiserver_status(obj, spec, devices)
        elif kind == CONNECTOR:
            body = st.connector_status(spec, devices)
            for k in ("subnetRoutes", "isExitNode", "isAppConnector", "devices", "hostname", "tailnetIPs"):
                if not same(cur.get(k), body.get(k)):
                    want[k] = body.get(k)
        if want:
            await self.kube.patch(RESOURCES[kind], m["name"], {"status": want}, m.get("namespace", ""),
                                  subresource="status")

    async def _apiserver_status(self, obj: Mapping[str, Any], spec: ProxySpec,
                                devices: list[st.DeviceInfo]) -> None:
        """The API server proxy's status: its URL in an annotation on the ConfigMap, a Normal event and a log
        line when it becomes known or changes (ConfigMaps have no status)."""
        m = meta(obj)
        dev = devices[0] if devices else None
        # HTTPS where the control plane issues certificates, and in noauth mode anyway (a self-signed one: kubectl
        # sends credentials over TLS only); plain HTTP in auth mode without certificates
        https = not self.cfg.ingress_http or spec.apiserver_proxy_mode == "noauth" or bool(spec.tls_secret)
        # the device's name, not the Pod's readiness: a restart (a mode change) keeps the same device and URL
        url = apiserverproxy.url(dev.hostname, dev.ips, https) if dev and dev.device_id and dev.hostname else ""
        if (m.get("annotations") or {}).get(apiserverproxy.ANN_URL, "") == url:
            return
        await self.kube.patch(CONFIGMAPS, m["name"], {"metadata": {"annotations": {
            apiserverproxy.ANN_URL: url or None}}}, m.get("namespace", ""))
        if url:      # once per new URL: the annotation is the record that it was announced
            await self._warn(obj, APISERVER, "APIServerProxyReady",
                             f"the API server proxy ({spec.apiserver_proxy_mode} mode) is at {url}; point kubectl "
                             f"at it: kubectl config set-cluster tailnet --server={url}", etype="Normal")

    async def _warn(self, obj: Mapping[str, Any], kind: str, reason: str, message: str, *,
                    etype: str = "Warning") -> None:
        """A Warning (or `etype`) event, once per distinct problem of a parent (a pass every few seconds must not
        flood)."""
        m = meta(obj)
        uid = m.get("uid", "")
        key = f"{reason}:{message}"
        if key in self._warned.get(uid, set()):
            return
        self._warned.setdefault(uid, set()).add(key)
        ns = m.get("namespace") or "default"
        now = self.now()
        api = {SVC: "v1", INGRESS: "networking.k8s.io/v1", CONNECTOR: "tailscale.com/v1alpha1",
               PROXYGROUP: "tailscale.com/v1alpha1", PROXYCLASS: "tailscale.com/v1alpha1", APISERVER: "v1"}[kind]
        k8s_kind = _k8s_kind(kind)
        ev = {"apiVersion": "v1", "kind": "Event",
              "metadata": {"generateName": f"{m.get('name', 'x')}.", "namespace": ns},
              "involvedObject": {"apiVersion": api, "kind": k8s_kind, "name": m.get("name", ""),
                                 "namespace": m.get("namespace", ""), "uid": uid},
              "reason": reason, "message": redact(message), "type": etype,
              "source": {"component": "tailscale-controller"}, "reportingComponent": "tailscale-controller",
              "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        log.log(logging.WARNING if etype == "Warning" else logging.INFO, "%s %s/%s: %s", k8s_kind,
                m.get("namespace", ""), m.get("name", ""), redact(message))
        try:
            await self.kube.create(EVENTS, ev, ns)
        except KubeError as e:
            log.warning("could not record an event: %s", e)


def _k8s_kind(kind: str) -> str:
    return {SVC: "Service", INGRESS: "Ingress", CONNECTOR: "Connector", PROXYGROUP: "ProxyGroup",
            PROXYCLASS: pcl.KIND, APISERVER: "ConfigMap"}[kind]


def _proxy_type(kind: str, spec: ProxySpec) -> str:
    """The `ts_proxy_type` label of a proxy's metrics (upstream's values)."""
    return {SVC: "ingress_service", INGRESS: "ingress_resource", CONNECTOR: "connector",
            PROXYGROUP: "proxygroup", APISERVER: "apiserver_proxy"}[kind]


def proxy_target(kind: str, spec: ProxySpec, cfg: ControllerConfig) -> pcl.Target:
    """Upstream's exclusions: no metrics or debug endpoints on egress proxies and forwarding L7 Ingress proxies
    (their cluster traffic is all forwarded); the ACME staging directory only where certificates are used."""
    egress = any(k in ("TS_TAILNET_TARGET_IP", "TS_TAILNET_TARGET_FQDN") for k, _ in spec.target_env)
    return pcl.Target(endpoints=not egress and not spec.forward_cluster_traffic,
                      acme=kind == INGRESS and not spec.ingress_http)


def _failed(kind: str) -> str:
    return "ConnectorCreationFailed" if kind == CONNECTOR else "ProxyFailed"


def _ref(p: Parent) -> str:
    return f"{p.namespace}/{p.name}" if p.namespace else p.name
