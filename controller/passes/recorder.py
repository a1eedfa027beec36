"""The Recorder pass (shell around the pure `kinds.recorder`): a Recorder object in, its recorder on the tailnet.

One pass keeps everything of one Recorder: the finalizer, per replica an auth key (minted once, kept in the
config Secret until the replica has logged in, a new one when its agent asks), the state and config Secrets,
the ServiceAccount/Role/RoleBinding, the StatefulSet, the devices' tags, and the status (its devices and the
RecorderReady condition). A refused spec, or an S3 credentials Secret that is not there, gets the condition
False and a Warning event naming the field and the fix, and nothing is made or changed. Replicas scaled away
lose their device and Secrets once their Pod is gone; a deleted Recorder keeps its finalizer until its
StatefulSet's Pods are gone and every replica's device is deleted from the control plane, as a proxy's.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ..kinds import meta
from ..kinds import recorder as rec
from ..kubeapi import PODS, SECRETS, STATEFULSETS
from ..model import Parent
from ..providers import ProviderError
from ..sameness import same
from ..writer import RBAC_RESOURCES, Writer, decode

log = logging.getLogger("controller")

KIND = rec.QUEUE_KIND
#: a Recorder whose S3 credentials Secret is missing: that Secret is the user's (not watched), so read again
PENDING_RECHECK = 60.0
READY_RECHECK = 600.0
#: a replica scaled away whose Pod is still shutting down, or a deletion waiting for the Pods
RETIRING_RECHECK = 2.0


class RecorderPass:
    def __init__(self, w: Writer) -> None:
        self.w = w

    async def run(self, kind: str, namespace: str, name: str) -> float | None:
        w, kube, cfg = self.w, self.w.kube, self.w.cfg
        if (opened := await w.open(KIND, name, "", self.cleanup)).obj is None:
            return RETIRING_RECHECK if opened.waiting else None
        obj = opened.obj
        try:
            r = rec.decide(obj, cfg)
        except rec.RecorderInvalid as e:
            await self.refuse(obj, str(e))
            return None
        ns = cfg.namespace
        if r.s3_secret:
            problem = rec.credentials_problem(r, cfg, await kube.get(SECRETS, r.s3_secret, ns))
            if problem:
                await self.refuse(obj, problem)
                return PENDING_RECHECK
        w.keep_warnings(obj, ())
        await w.add_finalizer(KIND, obj)
        secrets = {s["metadata"]["name"]: s for s in await kube.list(SECRETS, ns, rec.selector(r.name))}
        states = [decode(secrets.get(rec.state_secret_name(r, i))) for i in range(r.replicas)]
        datas = []
        for i in range(r.replicas):
            conf = decode(secrets.get(rec.config_secret_name(r, i)))
            datas.append(None if conf is None and states[i] is None else {**(conf or {}), **(states[i] or {})})
        try:
            keys = await w.auth_keys(datas, r.tags, f"Recorder {r.name}", f"Recorder {r.name}")
        except ProviderError as e:
            await self.status(obj, r, secrets, (False, rec.REASON_FAILED, f"no auth key: {e}"))
            raise
        pods = {p["metadata"]["name"] for p in await kube.list(PODS, ns, rec.selector(r.name))}
        retired = sorted({j for n in secrets if (j := rec.replica_index(r, n)) is not None and j >= r.replicas})
        running = [i for i in retired if rec.state_secret_name(r, i) in pods]
        out = rec.render(r, cfg, keys, running)
        for s in out.secrets:
            await w.apply_secret(s, secrets.get(s["metadata"]["name"]))
        identity = (out.service_account, out.role, out.role_binding)
        for res, desired in zip(RBAC_RESOURCES, identity, strict=True):
            if desired is not None:        # None: spec.statefulSet.pod.serviceAccount names the user's own
                await w.apply(res, desired)
        await w.apply(STATEFULSETS, out.statefulset)
        for i in retired:
            if i in running:
                continue
            names = (rec.state_secret_name(r, i), rec.config_secret_name(r, i))
            await w.retire_secrets(secrets[n] for n in names if n in secrets)
            log.info("Recorder %s: replica %d removed (device and Secrets)", r.name, i)
        tags_error = await w.sync_tags(KIND, Parent(KIND, r.name, "", r.uid), r.tags, states)
        ready = await self.status(obj, r, secrets, failure=str(tags_error or ""))
        if tags_error is not None:
            raise tags_error
        if running:
            return RETIRING_RECHECK
        return READY_RECHECK if ready else None

    async def refuse(self, obj: Mapping[str, Any], message: str) -> None:
        """A spec this controller cannot build: RecorderReady False and a Warning event, once; nothing else
        changes (a running recorder keeps running as it was)."""
        w = self.w
        w.keep_warnings(obj, {f"{rec.REASON_INVALID}:{message}"})
        await w.warn(obj, KIND, rec.REASON_INVALID, message)
        conds = w.conditions(obj, rec.COND_READY, False, rec.REASON_INVALID, message)
        if not same(list((obj.get("status") or {}).get("conditions") or []), conds):
            await w.patch_status(KIND, obj, {"conditions": conds})

    async def status(self, obj: Mapping[str, Any], r: rec.RecorderSpec, secrets: Mapping[str, Mapping[str, Any]],
                     ready: tuple[bool, str, str] | None = None, *, failure: str = "") -> bool:
        """The devices (hostname, tailnet IPs, the UI's URL) from the state Secrets and RecorderReady: True once
        every replica is on the tailnet. Only what differs is written."""
        w, cur = self.w, obj.get("status") or {}
        devs = rec.devices(r, secrets)
        if ready is None:
            if failure:
                ready = (False, rec.REASON_FAILED, failure)
            elif len(devs) >= r.replicas:
                ready = (True, rec.REASON_CREATED, rec.REASON_CREATED)
            else:
                ready = (False, rec.REASON_CREATING, f"{len(devs)}/{r.replicas} replicas are on the tailnet")
        conds = w.conditions(obj, rec.COND_READY, *ready)
        want: dict[str, Any] = {}
        if not same(list(cur.get("conditions") or []), conds):
            want["conditions"] = conds
        if not same(cur.get("devices") or [], devs):
            want["devices"] = devs or None
        await w.patch_status(KIND, obj, want)
        return ready[0]

    async def cleanup(self, obj: Mapping[str, Any]) -> bool:
        """StatefulSet (foreground: the Pods go first), then each replica's device and the Secrets, then the
        RoleBinding, Role and ServiceAccount. True when done."""
        m = meta(obj)
        name = m.get("name", "")
        done = await self.w.remove_children(Parent(KIND, name, "", m.get("uid", "")), rec.selector(name),
                                            tuple(reversed(RBAC_RESOURCES)))
        if done:
            log.info("Recorder %s removed (devices deleted)", name)
        return done

