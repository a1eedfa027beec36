"""Leader election between controller replicas: one `coordination.k8s.io/v1` Lease, as client-go's leaderelection.

Only the holder of Lease `tailscale-controller` in the controller's namespace runs kopf's watches and the work
queue; every other replica is a standby that only reads the Lease (no watch, no write). Why not kopf's
peering: it pauses kopf's watch streams only, not our queue's retries and re-checks, and replicas of one
Deployment have equal priorities, which kopf answers by pausing all of them (see docs/controller.md).

Timing, as client-go's defaults: a candidate takes the Lease over when its record has not changed for
`duration` (15 s) by the candidate's own clock (so clock skew between nodes does not matter); the leader renews
every `retry` (2 s) and stops all work when no renewal succeeded for `renew_deadline` (10 s), which is
before any candidate can take over. Unlike client-go's leader (which exits then), a leader that could not renew
because the API server did not answer keeps its watches and work queue, fenced (no write), and leads again if
the Lease still names it when the server answers (`regain`): an API-server outage then costs no restart and no
re-list of everything; if another replica took the Lease meanwhile, it stops as before. Writes use the Lease's
resourceVersion as a precondition, so two candidates that race for an expired Lease cannot both win.

The Lease is owned by the controller's Deployment (an ownerReference, found from the controller's own Pod:
POD_NAME → its ReplicaSet → its Deployment), so the garbage collector deletes it with the Deployment: `helm
uninstall`, a Flux removal or `kubectl delete -f deploy/` leave nothing behind. The reference is written when
the Lease is created and, on a Lease that lacks it (made by an older version), at the next renewal or
takeover. The chart does not make the Lease itself: an upgrade from a release whose controller made it would
fail with helm's "exists and cannot be imported into the current release" (docs/controller.md). Run outside
a Pod of a Deployment (a laptop run: no POD_NAME), the Lease has no owner, and one log line says so.

`decide`, `lease_spec`, `controller_ref` and `owner_references` are the pure core; `find_owner` and
`LeaderElector` are the shell (reads and writes through `controller.kubeapi.Kube`).
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tscommon.redact import redact

from .kubeapi import PODS, Kube, KubeError, Resource

log = logging.getLogger("controller.leader")

LEASES = Resource("/apis/coordination.k8s.io/v1", "leases")
#: read once, by name, to find the Deployment that owns the controller's Pod (the Lease's owner)
REPLICASETS = Resource("/apis/apps/v1", "replicasets")
LEASE_NAME = "tailscale-controller"


@dataclass(frozen=True)
class Timing:
    duration: float = 15.0         # a holder silent this long (candidate's clock) is gone
    renew_deadline: float = 10.0   # the leader stops when it could not renew for this long (< duration)
    retry: float = 2.0             # how often candidates read and the leader renews


@dataclass(frozen=True)
class Seen:
    """The Lease record a candidate last saw, and when (its own monotonic clock) it last changed."""
    record: tuple[str, str, int]   # holderIdentity, renewTime, leaseTransitions
    at: float


@dataclass(frozen=True)
class Step:
    action: str                    # "create" | "renew" | "take" | "wait"
    seen: Seen | None


def record_of(lease: Mapping[str, Any] | None) -> tuple[str, str, int]:
    spec = (lease or {}).get("spec") or {}
    return (str(spec.get("holderIdentity") or ""), str(spec.get("renewTime") or ""),
            int(spec.get("leaseTransitions") or 0))


def decide(lease: Mapping[str, Any] | None, me: str, seen: Seen | None, now: float, t: Timing) -> Step:
    """What a replica does with the Lease as read now (pure)."""
    if lease is None:
        return Step("create", None)
    rec = record_of(lease)
    if seen is None or seen.record != rec:
        seen = Seen(rec, now)
    holder = rec[0]
    if holder == me:
        return Step("renew", seen)
    if not holder:                  # released by a leader that stopped cleanly
        return Step("take", seen)
    duration = float(((lease.get("spec") or {}).get("leaseDurationSeconds")) or t.duration)
    if now - seen.at >= duration:
        return Step("take", seen)
    return Step("wait", seen)


def micro_now() -> str:
    """A Kubernetes MicroTime (what the API server accepts in a Lease's times)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_spec(lease: Mapping[str, Any] | None, me: str, action: str, now: str, t: Timing) -> dict:
    """The Lease's spec after `action` by `me`."""
    spec = dict((lease or {}).get("spec") or {})
    spec.update({"holderIdentity": me, "leaseDurationSeconds": int(t.duration), "renewTime": now})
    if action in ("create", "take"):
        spec["acquireTime"] = now
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if action == "take" else 0)
    return spec


@dataclass(frozen=True)
class OwnerRef:
    """An ownerReference: the object (in the Lease's namespace) whose deletion deletes the Lease."""
    api_version: str
    kind: str
    name: str
    uid: str

    def as_dict(self) -> dict:
        # neither `controller` nor `blockOwnerDeletion`: the Deployment does not manage the Lease, and
        # blockOwnerDeletion would need update on deployments/finalizers (OwnerReferencesPermissionEnforcement)
        return {"apiVersion": self.api_version, "kind": self.kind, "name": self.name, "uid": self.uid}


@dataclass(frozen=True)
class Owner:
    """What the owner lookup found: the Lease's owner, or None and why (said once in the log)."""
    ref: OwnerRef | None
    why: str = ""


def controller_ref(obj: Mapping[str, Any] | None, api_version: str, kind: str) -> OwnerRef | None:
    """The object's managing owner (`controller: true`) when it is of this kind, else None (pure)."""
    for r in ((obj or {}).get("metadata") or {}).get("ownerReferences") or []:
        if r.get("controller") and r.get("apiVersion") == api_version and r.get("kind") == kind \
                and r.get("name") and r.get("uid"):
            return OwnerRef(api_version, kind, str(r["name"]), str(r["uid"]))
    return None


def owner_references(lease: Mapping[str, Any] | None, owner: OwnerRef | None) -> list[dict] | None:
    """The Lease's ownerReferences once `owner` is among them, or None when nothing is to be written (no owner,
    or the Lease names it already). A reference to an object of the same kind and name but another uid (a
    Deployment deleted and made again while its Lease stayed) is replaced; other owners are kept (pure)."""
    if owner is None:
        return None
    refs = list(((lease or {}).get("metadata") or {}).get("ownerReferences") or [])
    if any(r.get("uid") == owner.uid for r in refs):
        return None
    keep = [r for r in refs if not (r.get("apiVersion") == owner.api_version and r.get("kind") == owner.kind
                                    and r.get("name") == owner.name)]
    return [*keep, owner.as_dict()]


async def find_owner(kube: Kube, namespace: str, pod_name: str) -> Owner:
    """The Deployment that runs this controller: its Pod (POD_NAME), the Pod's ReplicaSet, the ReplicaSet's
    Deployment. A definite answer either way is returned; a failure that may pass (the API server not answering)
    raises KubeError or OSError, and the lookup is tried again at the next write of the Lease."""
    if not pod_name:
        return Owner(None, "POD_NAME is not set (not run in a Pod)")
    try:
        pod = await kube.get(PODS, pod_name, namespace)
        if pod is None:
            return Owner(None, f"its Pod {namespace}/{pod_name} (POD_NAME) does not exist")
        rs_ref = controller_ref(pod, REPLICASETS.api_version, "ReplicaSet")
        if rs_ref is None:
            return Owner(None, f"its Pod {namespace}/{pod_name} is not run by a ReplicaSet of a Deployment")
        rs = await kube.get(REPLICASETS, rs_ref.name, namespace)
        if rs is None:
            return Owner(None, f"the Pod's ReplicaSet {namespace}/{rs_ref.name} does not exist")
        ref = controller_ref(rs, "apps/v1", "Deployment")
        if ref is None:
            return Owner(None, f"the Pod's ReplicaSet {namespace}/{rs_ref.name} is not a Deployment's")
        return Owner(ref)
    except KubeError as e:
        if e.status == 403:
            return Owner(None, f"{redact(str(e))} (the chart's Role tailscale-controller-leader-election grants "
                               "get on pods and replicasets in the controller's namespace; apply the chart's or "
                               "deploy/12-leader-election.yaml's)")
        raise


class LostLeadership(Exception):
    pass


class LeaseUnrenewed(LostLeadership):
    """No renewal succeeded for `renew_deadline`: the API server did not answer. The Lease may still name this
    replica; `regain` finds out once the server answers again."""


class LeaderElector:
    """One replica's side of the election. `kube` must be a client of its own: the controller's client is
    fenced by `is_leader` and would refuse the Lease's writes once leadership is lost."""

    def __init__(self, kube: Kube, namespace: str, identity: str, *, name: str = LEASE_NAME,
                 timing: Timing = Timing(), clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], str] = micro_now, pod_name: str = "") -> None:
        self.kube, self.namespace, self.identity, self.name = kube, namespace, identity, name
        self.t, self.clock, self.wall = timing, clock, wall
        self.pod_name = pod_name
        self._owner: Owner | None = None       # None until the lookup gave a definite answer
        self._seen: Seen | None = None
        self._renewed: float | None = None     # monotonic time of the last successful write as holder
        self._lease: dict | None = None
        self._waiting_for = ""

    def is_leader(self) -> bool:
        """True while the last renewal is recent enough that no other replica can have taken over."""
        return self._renewed is not None and self.clock() - self._renewed < self.t.renew_deadline

    async def owner(self) -> OwnerRef | None:
        """The Lease's owner, looked up before this replica's first write of the Lease (a standby never looks);
        a lookup that failed for a reason that may pass is tried again at the next write."""
        if self._owner is None:
            try:
                self._owner = await find_owner(self.kube, self.namespace, self.pod_name)
            except (KubeError, OSError) as e:
                log.warning("leader election: the Lease's owner (this controller's Deployment) could not be looked "
                            "up yet, retried at the next renewal: %s", redact(str(e) or type(e).__name__))
                return None
            if self._owner.ref is None:
                # a laptop run is expected to have no owner; a Pod without one is a setup to fix
                log.log(logging.WARNING if self.pod_name else logging.INFO,
                        "leader election: Lease %s/%s has no owner: %s; it stays when the controller is removed "
                        "(kubectl -n %s delete lease %s)", self.namespace, self.name, self._owner.why,
                        self.namespace, self.name)
        return self._owner.ref

    async def _try(self) -> bool:
        """One round: read, then create/renew/take when `decide` says so. True when we hold the Lease."""
        lease = await self.kube.get(LEASES, self.name, self.namespace)
        step = decide(lease, self.identity, self._seen, self.clock(), self.t)
        self._seen = step.seen
        if step.action == "wait":
            holder = record_of(lease)[0]
            if holder != self._waiting_for:
                log.info("leader election: standby, Lease %s/%s is held by %s", self.namespace, self.name, holder)
                self._waiting_for = holder
            return False
        owner = await self.owner()
        refs = owner_references(lease, owner)
        now = self.wall()
        spec = lease_spec(lease, self.identity, step.action, now, self.t)
        started = self.clock()
        try:
            if step.action == "create":
                md: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
                if refs is not None:
                    md["ownerReferences"] = refs
                out = await self.kube.create(LEASES, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                                      "metadata": md, "spec": spec}, self.namespace)
            else:
                # the resourceVersion precondition: a Lease changed since our read (another candidate won the
                # race) fails with 409 instead of being overwritten. The owner goes in once, on a Lease that
                # lacks it (one an older version made); a merge patch replaces the list, so it is the whole list.
                md = {"resourceVersion": (lease or {}).get("metadata", {}).get("resourceVersion")}
                if refs is not None:
                    md["ownerReferences"] = refs
                out = await self.kube.patch(LEASES, self.name, {"metadata": md, "spec": spec}, self.namespace)
        except KubeError as e:
            if e.status in (409,):          # lost the race (create: AlreadyExists; patch: Conflict)
                return False
            raise
        self._lease = out
        # the deadline counts from before the write was sent: the write may have taken effect at once
        self._renewed = started
        self._seen = Seen(record_of(out), self.clock())
        if refs is not None and owner is not None:
            log.info("leader election: Lease %s/%s is owned by %s %s/%s from now on (deleted with it)",
                     self.namespace, self.name, owner.kind, self.namespace, owner.name)
        if step.action != "renew":
            log.info("leader election: %s leads (Lease %s/%s %s)", self.identity, self.namespace, self.name,
                     "created" if step.action == "create" else "taken over")
            self._waiting_for = ""
        return True

    async def acquire(self) -> None:
        """Return once this replica holds the Lease. Standby: one GET every `retry` seconds."""
        while True:
            try:
                if await self._try():
                    return
            except KubeError as e:
                log.warning("leader election: %s", redact(str(e)))
            await asyncio.sleep(self.t.retry)

    async def hold(self) -> None:
        """Renew every `retry` seconds; raise LostLeadership when the Lease is someone else's or when no renewal
        succeeded for `renew_deadline` seconds."""
        while True:
            await asyncio.sleep(self.t.retry)
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that arrives as the
                # renewal completes, and a holder cancelled at shutdown would then go on renewing the Lease
                async with asyncio.timeout(max(0.1, self.t.renew_deadline - self.t.retry)):
                    ok = await self._try()
            except (KubeError, TimeoutError) as e:
                ok = None
                log.warning("leader election: renewing the Lease failed: %s", redact(str(e) or type(e).__name__))
            if ok is False:
                self._renewed, self._lease = None, None
                raise LostLeadership(f"Lease {self.namespace}/{self.name} is now held by "
                                     f"{(self._seen.record[0] if self._seen else '') or 'another replica'}")
            if not self.is_leader():
                self._renewed = None
                raise LeaseUnrenewed(f"could not renew Lease {self.namespace}/{self.name} for "
                                     f"{self.t.renew_deadline:.0f}s")

    async def regain(self) -> None:
        """After `LeaseUnrenewed`: return once the Lease is renewed again, which `decide` allows only while it still
        names this replica (nobody took it over meanwhile) or has expired untaken; raise LostLeadership when
        another replica holds it. Fenced meanwhile: `is_leader` is False until the renewal, so nothing is
        written. Failures are logged once per kind (status and reason), not at every attempt."""
        said = ""
        while True:
            try:
                async with asyncio.timeout(max(0.1, self.t.renew_deadline - self.t.retry)):
                    ok = await self._try()
                if ok:
                    return
                raise LostLeadership(f"Lease {self.namespace}/{self.name} is now held by "
                                     f"{(self._seen.record[0] if self._seen else '') or 'another replica'}")
            except (KubeError, TimeoutError) as e:
                kind = f"{getattr(e, 'status', 0)} {getattr(e, 'reason', '') or type(e).__name__}"
                if kind != said:
                    log.warning("leader election: the Lease cannot be renewed yet (retrying every %gs, logged once "
                                "per kind of failure): %s", self.t.retry, redact(str(e) or type(e).__name__))
                    said = kind
            await asyncio.sleep(self.t.retry)

    def fence(self) -> None:
        """Stop leading now: `is_leader` is False from here, so the fenced client refuses every write."""
        self._renewed = None

    async def release(self) -> None:
        """On a clean stop: give the Lease up so a standby takes over at once instead of after `duration`.
        Fences first; the write carries the resourceVersion of our last write, so a Lease someone else took
        meanwhile is left alone (409)."""
        self.fence()
        if self._lease is None:
            return
        md, self._lease = self._lease.get("metadata") or {}, None
        try:
            await self.kube.patch(LEASES, self.name, {"metadata": {"resourceVersion": md.get("resourceVersion")},
                                                      "spec": {"holderIdentity": None, "leaseDurationSeconds": 1}},
                                  self.namespace)
            log.info("leader election: Lease %s/%s released", self.namespace, self.name)
        except KubeError as e:       # someone else holds it already, or the API is gone: it expires anyway
            log.warning("leader election: releasing the Lease failed: %s", redact(str(e)))
