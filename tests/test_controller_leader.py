"""controller.leader: two replicas and one Lease on the project's test API server (HTTPS, resourceVersion
preconditions): one leads, the standby only reads, a dead leader's Lease is taken over within a bound, a clean
stop hands over at once, a leader that cannot renew stops, and a fenced client sends nothing."""
from __future__ import annotations

import asyncio
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from controller.kubeapi import SECRETS, Kube, KubeError
from controller.leader import LEASES, LeaderElector, LostLeadership, Seen, Timing, decide, record_of
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
