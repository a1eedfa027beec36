"""controller.leader: two replicas and one Lease on the project's test API server (HTTPS, resourceVersion
preconditions): one leads, the standby only reads, a dead leader's Lease is taken over within a bound, a clean
stop hands over at once, a leader that cannot renew stops, and a fenced client sends nothing. The Lease's owner:
the controller's Deployment, found from its Pod (on the fake API), written on a new Lease and on one an older
version made; none on a laptop run, said once."""
from __future__ import annotations

import asyncio
import copy
import logging
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from controller.kubeapi import DEPLOYMENTS, PODS, SECRETS, Kube, KubeError
from controller.leader import (
    LEASES,
    REPLICASETS,
    LeaderElector,
    LostLeadership,
    Owner,
    OwnerRef,
    Seen,
    Timing,
    controller_ref,
    decide,
    find_owner,
    lease_spec,
    owner_references,
    record_of,
)
from tests.support.fakekube import FakeKube
from tests.support.kubeapi import KubeAPIServer
from tests.support.waits import until_async

T = Timing(duration=2.0, renew_deadline=1.2, retry=0.1)
NS = "tailscale"


def lease(holder: str, renew: str = "t1", transitions: int = 0, duration: int = 15) -> dict:
    return {"metadata": {"resourceVersion": "7"}, "spec": {"holderIdentity": holder, "renewTime": renew,
                                                         "leaseTransitions": transitions,
                                                         "leaseDurationSeconds": duration}}


def test_decide():
    t = Timing()
    assert decide(None, "a", None, 0.0, t).action == "create"
    assert decide(lease("a"), "a", None, 0.0, t).action == "renew"
    assert decide(lease(""), "a", None, 0.0, t).action == "take"             # released
    s = decide(lease("b"), "a", None, 100.0, t)
    assert s.action == "wait" and s.seen == Seen(("b", "t1", 0), 100.0)
    # the same record for less than the Lease's duration, by our own clock: wait; for longer: take over
    assert decide(lease("b"), "a", s.seen, 114.9, t).action == "wait"
    assert decide(lease("b"), "a", s.seen, 115.0, t).action == "take"
    # a renewal seen (renewTime changed) restarts the count, whatever the holder's clock says
    s2 = decide(lease("b", renew="t2"), "a", s.seen, 114.0, t)
    assert s2.action == "wait" and s2.seen.at == 114.0
    assert decide(lease("b", renew="t2"), "a", s2.seen, 128.0, t).action == "wait"
    # the Lease's own duration counts (a holder that asked for 30 s gets 30 s)
    assert decide(lease("b", duration=30), "a", s.seen, 120.0, t).action == "wait"


@pytest.fixture
def api():
    with KubeAPIServer(namespace=NS) as server:
        yield server


def client(api) -> Kube:
    return Kube(api.url, token=api.token, verify=api.ssl_context())


def held_by(api) -> str:
    return next((o["spec"].get("holderIdentity") or "") for o in api.objects() if o["kind"] == "Lease")


async def test_one_leads_the_standby_only_reads_and_takes_over_a_dead_leader_in_bounded_time(api):
    a, b = LeaderElector(client(api), NS, "a", timing=T), LeaderElector(client(api), NS, "b", timing=T)
    await asyncio.wait_for(a.acquire(), 2)
    holding = asyncio.create_task(a.hold())
    standby = asyncio.create_task(b.acquire())
    loop = asyncio.get_running_loop()
    t_start = loop.time()

    def renewals() -> int:
        return [m for m, _ in a.kube.requests].count("PATCH")
    # wait for the events themselves: the leader renewing, over more than one Lease duration
    await until_async(lambda: renewals() >= 5 and loop.time() - t_start >= 1.5 * T.duration, 60,
                      "five renewals over more than one Lease duration")
    assert not standby.done() and a.is_leader() and not b.is_leader() and held_by(api) == "a"
    assert {m for m, _ in b.kube.requests} == {"GET"} and len(b.kube.requests) >= 2
    # the leader dies without a word (its process killed): no more renewals, no release
    holding.cancel()
    t0 = asyncio.get_running_loop().time()
    await asyncio.wait_for(standby, 60)
    took = asyncio.get_running_loop().time() - t0
    assert b.is_leader() and held_by(api) == "b"
    # not before the Lease's duration without a renewal (a lower bound: load can only delay the takeover);
    # that it comes right after is decide()'s, tested above on a clock of its own
    assert took >= T.duration - 2 * T.retry, took
    lease_obj = next(o for o in api.objects() if o["kind"] == "Lease")
    assert lease_obj["apiVersion"] == "coordination.k8s.io/v1" and lease_obj["spec"]["leaseTransitions"] == 1
    # the old leader, were it only frozen, finds out at its next renewal and stops
    with pytest.raises(LostLeadership, match="held by b"):
        await asyncio.wait_for(a.hold(), 3)
    assert not a.is_leader()
    for e in (a, b):
        await e.kube.aclose()


async def test_a_clean_stop_releases_the_lease_and_the_standby_takes_over_at_once(api):
    # a Lease of an hour: a takeover at all can only come from the release
    a, b = LeaderElector(client(api), NS, "a", timing=Timing(3600, 10, 0.1)), \
        LeaderElector(client(api), NS, "b", timing=Timing(3600, 10, 0.1))
    await a.acquire()
    standby = asyncio.create_task(b.acquire())
    await until_async(lambda: b.kube.requests, what="the standby to see the Lease held")
    await a.release()
    assert not a.is_leader()
    await asyncio.wait_for(standby, 60)
    assert held_by(api) == "b"
    for e in (a, b):
        await e.kube.aclose()


async def test_two_candidates_racing_for_an_expired_lease_only_one_wins(api):
    es = [LeaderElector(client(api), NS, n, timing=T) for n in ("a", "b", "c")]
    await es[0].acquire()
    # b and c both saw the Lease unchanged for longer than its duration; both try at the same moment
    current = record_of(await es[1].kube.get(LEASES, "tailscale-controller", NS))
    for e in es[1:]:
        e._seen = Seen(current, e.clock() - 100.0)
    won = await asyncio.gather(es[1]._try(), es[2]._try())
    assert sorted(won) == [False, True]
    assert held_by(api) in ("b", "c") and [e.is_leader() for e in es[1:]].count(True) == 1
    for e in es:
        await e.kube.aclose()


async def test_a_leader_that_cannot_renew_stops_within_the_renew_deadline(api):
    a = LeaderElector(client(api), NS, "a", timing=T)
    await a.acquire()
    api.fail(503, count=1000, path="/leases/")
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(LostLeadership, match="could not renew"):
        await asyncio.wait_for(a.hold(), 60)
    # it kept trying for the renew deadline (a lower bound: load can only lengthen it) and then stopped
    assert asyncio.get_running_loop().time() - t0 >= T.renew_deadline - 2 * T.retry
    assert not a.is_leader()
    await a.kube.aclose()


async def test_the_fenced_controller_client_sends_no_write_without_the_lease(api):
    a = LeaderElector(client(api), NS, "a", timing=T)
    kube = client(api)
    kube.write_guard = a.is_leader
    with pytest.raises(KubeError, match="does not hold the leader Lease"):
        await kube.create(SECRETS, {"metadata": {"name": "x"}}, NS)
    assert kube.requests == [] and api.secret("x") is None
    assert await kube.get(SECRETS, "x", NS) is None                # reads are not fenced
    await a.acquire()
    await kube.create(SECRETS, {"metadata": {"name": "x"}}, NS)
    assert api.secret("x") is not None
    for k in (a.kube, kube):
        await k.aclose()


async def test_the_health_endpoint_answers_in_both_roles():
    """A standby runs no kopf: the controller's own /healthz keeps the kubelet's liveness probe passing."""
    import httpx

    from controller.__main__ import serve_health
    role = ["standby"]
    srv = await serve_health("127.0.0.1:0", lambda: role[0])
    port = srv.sockets[0].getsockname()[1]
    async with httpx.AsyncClient() as c:
        r = await c.get(f"http://127.0.0.1:{port}/healthz")
        assert (r.status_code, r.text) == (200, "standby\n")
        role[0] = "leader"
        assert (await c.get(f"http://127.0.0.1:{port}/healthz")).text == "leader\n"
        assert (await c.get(f"http://127.0.0.1:{port}/other")).status_code == 404
    srv.close()
    await srv.wait_closed()


async def test_a_release_never_frees_a_lease_someone_else_took(api):
    a, b = LeaderElector(client(api), NS, "a", timing=T), LeaderElector(client(api), NS, "b", timing=T)
    await a.acquire()
    b._seen = Seen(record_of(await b.kube.get(LEASES, "tailscale-controller", NS)), b.clock() - 100.0)
    assert await b._try() is True                      # a was frozen for longer than the Lease
    await a.release()                                  # a wakes up and stops cleanly: its release is refused
    assert held_by(api) == "b" and not a.is_leader() and b.is_leader()
    for e in (a, b):
        await e.kube.aclose()


async def test_a_leader_cut_off_from_the_api_server_leads_again_when_it_answers(api, caplog):
    from controller.leader import LeaseUnrenewed
    a = LeaderElector(client(api), NS, "a", timing=T)
    await a.acquire()
    outage = api.fail(503, count=100000, path="/leases/")
    with pytest.raises(LeaseUnrenewed):
        await asyncio.wait_for(a.hold(), 60)
    assert not a.is_leader()
    caplog.clear()
    refused = outage.count
    regain = asyncio.ensure_future(a.regain())
    # three more attempts refused: it has tried, and is still fenced
    await until_async(lambda: outage.count <= refused - 3, 30, "three more refused attempts")
    assert not regain.done() and not a.is_leader()                  # fenced while the server does not answer
    said = [r.getMessage() for r in caplog.records if "cannot be renewed yet" in r.getMessage()]
    assert len(said) == 1, said                                     # once, not at every attempt
    outage.count = 0
    await asyncio.wait_for(regain, 30)
    assert a.is_leader() and held_by(api) == "a"
    await a.kube.aclose()


async def test_a_leader_whose_lease_was_taken_meanwhile_does_not_lead_again(api):
    from controller.leader import LeaseUnrenewed
    a = LeaderElector(client(api), NS, "a", timing=T)
    await a.acquire()
    outage = api.fail(503, count=100000, path="/leases/", method="PATCH")
    with pytest.raises(LeaseUnrenewed):
        await asyncio.wait_for(a.hold(), 60)
    outage.count = 0
    b = LeaderElector(client(api), NS, "b", timing=T)
    await asyncio.wait_for(b.acquire(), 30)                         # b waits out the duration, then takes it
    with pytest.raises(LostLeadership, match="held by b"):
        await asyncio.wait_for(a.regain(), 30)
    assert not a.is_leader() and b.is_leader()
    for e in (a, b):
        await e.kube.aclose()


# ---------------------------------------------------------------- the Lease's spec and its owner (pure)

def test_lease_spec_on_create_renew_and_take():
    t = Timing()
    made = lease_spec(None, "a", "create", "t0", t)
    assert made == {"holderIdentity": "a", "leaseDurationSeconds": 15, "renewTime": "t0", "acquireTime": "t0",
                    "leaseTransitions": 0}
    renewed = lease_spec({"spec": made}, "a", "renew", "t1", t)
    assert renewed == {**made, "renewTime": "t1"}                  # acquired once: acquireTime stays
    taken = lease_spec({"spec": {**renewed, "holderIdentity": "b"}}, "c", "take", "t2", t)
    assert taken == {"holderIdentity": "c", "leaseDurationSeconds": 15, "renewTime": "t2", "acquireTime": "t2",
                     "leaseTransitions": 1}


DEPLOY = OwnerRef("apps/v1", "Deployment", "tailscale-controller", "d-uid")


def ref(kind: str, name: str, uid: str, *, controller: bool = True, api_version: str = "apps/v1") -> dict:
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "controller": controller}


def test_controller_ref_is_the_managing_owner_of_that_kind():
    pod = {"metadata": {"ownerReferences": [ref("ReplicaSet", "other", "x", controller=False),
                                            ref("ReplicaSet", "tailscale-controller-5d9", "rs-uid")]}}
    assert controller_ref(pod, "apps/v1", "ReplicaSet") == OwnerRef("apps/v1", "ReplicaSet",
                                                                    "tailscale-controller-5d9", "rs-uid")
    assert controller_ref(pod, "apps/v1", "Deployment") is None
    assert controller_ref({"metadata": {"ownerReferences": [ref("StatefulSet", "s", "u")]}}, "apps/v1",
                          "ReplicaSet") is None
    assert controller_ref({"metadata": {}}, "apps/v1", "ReplicaSet") is None
    assert controller_ref(None, "apps/v1", "ReplicaSet") is None


def test_owner_references_add_the_deployment_once_and_keep_other_owners():
    plain = {"metadata": {"name": "tailscale-controller"}}
    assert owner_references(plain, DEPLOY) == [DEPLOY.as_dict()]          # a Lease an older version made
    assert DEPLOY.as_dict() == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tailscale-controller",
                                "uid": "d-uid"}                          # no blockOwnerDeletion, no controller
    assert owner_references(None, DEPLOY) == [DEPLOY.as_dict()]
    owned = {"metadata": {"ownerReferences": [DEPLOY.as_dict()]}}
    assert owner_references(owned, DEPLOY) is None                         # nothing to write at a renewal
    assert owner_references(plain, None) is None                           # no owner (a laptop run)
    other = {"apiVersion": "v1", "kind": "ConfigMap", "name": "keep", "uid": "c"}
    stale = {**DEPLOY.as_dict(), "uid": "old-uid"}                         # the Deployment deleted and made again
    assert owner_references({"metadata": {"ownerReferences": [other, stale]}}, DEPLOY) == [other, DEPLOY.as_dict()]


# ---------------------------------------------------------------- the owner lookup, on the fake API

def controller_pod(kube: FakeKube, *, rs_owner: bool = True, pod_owner: str = "ReplicaSet") -> None:
    kube.put(DEPLOYMENTS, {"metadata": {"name": "tailscale-controller", "namespace": NS, "uid": "d-uid"}})
    kube.put(REPLICASETS, {"metadata": {"name": "tailscale-controller-5d9", "namespace": NS, "uid": "rs-uid",
                                        "ownerReferences": [ref("Deployment", "tailscale-controller", "d-uid")]
                                        if rs_owner else []}})
    kube.put(PODS, {"metadata": {"name": "tailscale-controller-5d9-abcde", "namespace": NS, "uid": "p-uid",
                                 "ownerReferences": [ref(pod_owner, "tailscale-controller-5d9", "rs-uid")]}})


async def test_find_owner_follows_the_pod_to_its_deployment():
    kube = FakeKube()
    controller_pod(kube)
    owner = await find_owner(kube, NS, "tailscale-controller-5d9-abcde")   # type: ignore[arg-type]
    assert owner == Owner(DEPLOY)
    # two reads by name in the controller's namespace, nothing listed, nothing written
    assert kube.calls == [("GET", "pods", NS, "tailscale-controller-5d9-abcde"),
                          ("GET", "replicasets", NS, "tailscale-controller-5d9")]


@pytest.mark.parametrize("setup,pod,why", [
    (None, "", "POD_NAME is not set"),
    (None, "gone", "Pod tailscale/gone (POD_NAME) does not exist"),
    ({"pod_owner": "StatefulSet"}, "tailscale-controller-5d9-abcde", "is not run by a ReplicaSet of a Deployment"),
    ({"rs_owner": False}, "tailscale-controller-5d9-abcde", "ReplicaSet tailscale/tailscale-controller-5d9 is not "
                                                           "a Deployment's"),
])
async def test_find_owner_says_why_there_is_none(setup, pod, why):
    kube = FakeKube()
    if setup is not None:
        controller_pod(kube, **setup)
    owner = await find_owner(kube, NS, pod)                                # type: ignore[arg-type]
    assert owner.ref is None and why in owner.why, owner
    if not pod:
        assert kube.calls == []                                            # a laptop run asks nothing


async def test_find_owner_names_the_missing_rbac_and_raises_what_may_pass():
    kube = FakeKube()
    controller_pod(kube)
    kube.fail_next.append(KubeError('replicasets.apps "x" is forbidden', status=403, reason="Forbidden"))
    owner = await find_owner(kube, NS, "tailscale-controller-5d9-abcde")   # type: ignore[arg-type]
    assert owner.ref is None and "get on pods and replicasets" in owner.why and "deploy/12-leader-election.yaml" \
        in owner.why, owner
    kube.fail_next.append(KubeError("GET: 503 Service Unavailable", status=503))
    with pytest.raises(KubeError):
        await find_owner(kube, NS, "tailscale-controller-5d9-abcde")       # type: ignore[arg-type]


# ---------------------------------------------------------------- the owner on the Lease

class PatchLog(FakeKube):
    """The fake API, with the body of every patch kept."""

    def __init__(self) -> None:
        super().__init__()
        self.patches: list[dict] = []

    async def patch(self, res, name, patch, namespace="", subresource=""):
        self.patches.append(copy.deepcopy(dict(patch)))
        return await super().patch(res, name, patch, namespace, subresource)


def the_lease(kube: FakeKube) -> dict:
    lease = kube.obj(LEASES, "tailscale-controller", NS)
    assert lease is not None
    return lease


async def test_a_new_lease_is_owned_by_the_controllers_deployment():
    kube = PatchLog()
    controller_pod(kube)
    e = LeaderElector(kube, NS, "a", timing=T, pod_name="tailscale-controller-5d9-abcde")  # type: ignore[arg-type]
    assert await e._try() is True
    assert the_lease(kube)["metadata"]["ownerReferences"] == [DEPLOY.as_dict()]
    assert await e._try() is True                                           # a renewal: the owner is not sent again
    assert "ownerReferences" not in kube.patches[-1]["metadata"]
    assert [c for c in kube.calls if c[1] in ("pods", "replicasets")] == [
        ("GET", "pods", NS, "tailscale-controller-5d9-abcde"), ("GET", "replicasets", NS, "tailscale-controller-5d9")]


@pytest.mark.parametrize("holder", ["a", "", "gone"])
async def test_a_lease_an_older_version_made_gets_the_owner_at_the_next_renewal_or_takeover(holder, caplog):
    """After an upgrade: the Lease exists without an owner; renewed (the same replica), taken after a release
    (holder ""), or taken over from a replica that died, it names the Deployment from then on."""
    kube = PatchLog()
    controller_pod(kube)
    kube.put(LEASES, {"metadata": {"name": "tailscale-controller", "namespace": NS},
                      "spec": {"holderIdentity": holder, "renewTime": "t0", "leaseDurationSeconds": 15}})
    e = LeaderElector(kube, NS, "a", timing=T, pod_name="tailscale-controller-5d9-abcde")  # type: ignore[arg-type]
    if holder == "gone":
        e._seen = Seen(record_of(the_lease(kube)), e.clock() - 100.0)     # silent for longer than its duration
    with caplog.at_level(logging.INFO, logger="controller.leader"):
        assert await e._try() is True
    lease = the_lease(kube)
    assert lease["metadata"]["ownerReferences"] == [DEPLOY.as_dict()] and lease["spec"]["holderIdentity"] == "a"
    assert any("is owned by Deployment tailscale/tailscale-controller" in r.getMessage() for r in caplog.records)


async def test_a_standby_does_not_look_for_an_owner():
    kube = PatchLog()
    controller_pod(kube)
    a = LeaderElector(kube, NS, "a", timing=T, pod_name="tailscale-controller-5d9-abcde")  # type: ignore[arg-type]
    b = LeaderElector(kube, NS, "b", timing=T, pod_name="other")            # type: ignore[arg-type]
    assert await a._try() is True
    before = list(kube.calls)
    assert await b._try() is False
    assert kube.calls[len(before):] == [("GET", "leases", NS, "tailscale-controller")]


async def test_a_laptop_run_makes_a_lease_without_owner_and_says_so_once(caplog):
    kube = PatchLog()
    e = LeaderElector(kube, NS, "a", timing=T)                               # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="controller.leader"):
        for _ in range(3):
            assert await e._try() is True
    assert "ownerReferences" not in the_lease(kube)["metadata"]
    said = [r for r in caplog.records if "has no owner" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, said
    assert "POD_NAME is not set" in said[0].getMessage()
    assert "kubectl -n tailscale delete lease tailscale-controller" in said[0].getMessage()


async def test_an_owner_lookup_that_failed_is_tried_again_at_the_next_renewal(caplog):
    """The API server did not answer the lookup: the Lease is made without an owner (leading is not held up)
    and the owner is added at the next renewal."""
    kube = PatchLog()
    controller_pod(kube)
    e = LeaderElector(kube, NS, "a", timing=T, pod_name="tailscale-controller-5d9-abcde")  # type: ignore[arg-type]
    real_get = kube.get
    failed = []

    async def get(res, name, namespace=""):
        if res == PODS and not failed:
            failed.append(name)
            raise KubeError("GET pods: 503 Service Unavailable", status=503)
        return await real_get(res, name, namespace)
    kube.get = get                                                          # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="controller.leader"):
        assert await e._try() is True
        assert "ownerReferences" not in the_lease(kube)["metadata"]
        assert await e._try() is True
    assert the_lease(kube)["metadata"]["ownerReferences"] == [DEPLOY.as_dict()]
    assert any("could not be looked up yet" in r.getMessage() for r in caplog.records)
    assert not any("has no owner" in r.getMessage() for r in caplog.records)


async def test_the_lease_is_owned_on_the_test_api_server_too(api):
    """The owner reference survives a real wire round trip (HTTPS, merge patch with a resourceVersion)."""
    e = LeaderElector(client(api), NS, "a", timing=T)
    e._owner = Owner(DEPLOY)                                                # as found from the Pod
    await e.acquire()
    (lease,) = [o for o in api.objects() if o["kind"] == "Lease"]
    assert lease["metadata"]["ownerReferences"] == [DEPLOY.as_dict()]
    await e.kube.aclose()


def test_pod_name_comes_from_the_downward_api_and_a_bad_one_is_refused():
    from controller.config import ConfigError, load
    assert load({"POD_NAME": "tailscale-controller-5d9-abcde"}).pod_name == "tailscale-controller-5d9-abcde"
    assert load({}).pod_name == ""                                          # a laptop run
    with pytest.raises(ConfigError, match=r"POD_NAME='\.\./secrets' is not a Pod name; set it from the downward "
                                          r"API \(valueFrom: fieldRef: fieldPath: metadata.name\)"):
        load({"POD_NAME": "../secrets"})
