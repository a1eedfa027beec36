"""The controller's health probes of ProxyGroup replicas (controller.replicaprober) against real sockets, and the
egress EndpointSlices following them in a whole group pass: a replica that stops answering leaves, and comes
back when it answers again. The rule's timings are scaled down (tenths of seconds) so that the tests wait for
events, not for the production timings; the rule itself is tested in tests/test_replicahealth.py."""
from __future__ import annotations

import asyncio
import json
import time

from controller import pgrender
from controller import replicahealth as rh
from controller.kinds import proxygroup
from controller.kubeapi import CONFIGMAPS, PODS, PROXYGROUPS, STATEFULSETS
from controller.reconcile import Reconciler
from controller.replicaprober import ReplicaProber, Target, target_of
from tests.support.waits import until_async
from tests.test_controller_proxygroup import (  # noqa: F401
    CFG,
    NS,
    agent_reports,
    egress_objects,
    egress_svc,
    env,
    pg_obj,
    ready_group,
)

FAST = rh.HealthRule(down_after=0.4, up_after=0.3, up_silence=0.2)


class Replicas:
    """Health endpoints on loopback standing in for replicas' Pod IPs: each answers 200 until frozen (its node
    lost: connections stay open and nothing comes back)."""

    def __init__(self) -> None:
        self.frozen: set[str] = set()
        self.servers: dict[str, asyncio.Server] = {}
        self.ports: dict[str, int] = {}
        self.requests: dict[str, int] = {}
        self.writers: dict[str, list[asyncio.StreamWriter]] = {}

    async def add(self, ip: str) -> None:
        async def serve(reader, writer):
            self.writers.setdefault(ip, []).append(writer)
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    self.requests[ip] = self.requests.get(ip, 0) + 1
                    while ip in self.frozen:
                        await asyncio.sleep(0.01)   # poll: holds the answer until the test thaws the replica
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Type: text/plain\r\n\r\nok\n")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
        self.servers[ip] = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.ports[ip] = self.servers[ip].sockets[0].getsockname()[1]

    async def open(self, host: str, port: int):
        return await asyncio.open_connection("127.0.0.1", self.ports[host])

    async def exit(self, ip: str) -> None:
        """The replica's agent has exited: its connections close and its port refuses new ones."""
        self.servers[ip].close()     # the listening socket goes at once: a new connection is refused
        for w in self.writers.pop(ip, []):
            w.close()

    def close(self) -> None:
        for s in self.servers.values():
            s.close()


def prober(reps: Replicas, changed: list[str]) -> ReplicaProber:
    return ReplicaProber(changed.append, rule=FAST, connections=3, interval=0.05, tick=0.02, stale=5.0,
                         open_connection=reps.open)


async def wait_for(cond, timeout: float = 10.0) -> None:
    await until_async(cond, timeout)


async def a_tick_after(p: ReplicaProber, seconds: float) -> None:
    """Wait until the prober has applied its rule `seconds` from now or later: a verdict due by then is given."""
    due = time.monotonic() + seconds
    await until_async(lambda: (p.last_tick_at or 0.0) >= due, seconds + 10, f"a tick of the rule after {seconds}s")


async def test_a_frozen_replica_leaves_and_comes_back_the_group_is_told_each_time():
    reps, changed = Replicas(), []
    for ip in ("10.0.0.1", "10.0.0.2"):
        await reps.add(ip)
    p = prober(reps, changed)
    a, b = Target("pg-0", "10.0.0.1", 9002), Target("pg-1", "10.0.0.2", 9002)
    runner = asyncio.ensure_future(p.run())
    try:
        p.track("pg", [a, b])
        await wait_for(lambda: reps.requests.get("10.0.0.2", 0) >= 3)
        assert p.serving([a, b]) == {a, b} and changed == []
        reps.frozen.add("10.0.0.2")
        await wait_for(lambda: changed == ["pg"])
        assert p.serving([a, b]) == {a}
        reps.frozen.clear()
        await wait_for(lambda: changed == ["pg", "pg"])
        assert p.serving([a, b]) == {a, b}
        # forgotten targets are no longer asked
        p.track("pg", [a])
        # Once the kept replica has been asked again by every connection, twice, any question to the forgotten
        # one in flight at the change has landed; after as many more, it would have been asked again.
        asked = reps.requests["10.0.0.1"]
        await wait_for(lambda: reps.requests["10.0.0.1"] >= asked + 2 * 3)
        n = reps.requests["10.0.0.2"]
        asked = reps.requests["10.0.0.1"]
        await wait_for(lambda: reps.requests["10.0.0.1"] >= asked + 2 * 3)
        assert reps.requests["10.0.0.2"] == n
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        reps.close()


async def test_when_every_replica_is_silent_both_stay_as_the_kubelet_says():
    reps, changed = Replicas(), []
    for ip in ("10.0.0.1", "10.0.0.2"):
        await reps.add(ip)
    reps.frozen.update({"10.0.0.1", "10.0.0.2"})
    p = prober(reps, changed)
    a, b = Target("pg-0", "10.0.0.1", 9002), Target("pg-1", "10.0.0.2", 9002)
    runner = asyncio.ensure_future(p.run())
    try:
        p.track("pg", [a, b])
        await a_tick_after(p, FAST.down_after * 3)     # both have been silent for longer than the rule allows
        assert p.serving([a, b]) == {a, b} and changed == []
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        reps.frozen.clear()
        reps.close()


def rendered_pod(name: str, ip: str) -> dict:
    """A replica's Pod as the StatefulSet the controller renders makes it."""
    sts = pgrender.statefulset(proxygroup.decide(pg_obj(), CFG), CFG)
    tmpl = sts["spec"]["template"]
    return {"metadata": {"name": name, "namespace": NS, "labels": tmpl["metadata"]["labels"]},
            "spec": tmpl["spec"], "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                                             "conditions": [{"type": "Ready", "status": "True"}]}}


def test_the_probe_asks_what_the_kubelet_asks_and_a_class_without_a_probe_is_not_probed():
    assert target_of(rendered_pod("pg-0", "10.0.0.1")) == Target("pg-0", "10.0.0.1", 9002, "/healthz")
    pod = rendered_pod("pg-0", "10.0.0.1")
    del pod["spec"]["containers"][0]["readinessProbe"]
    assert target_of(pod) is None
    pod = rendered_pod("pg-0", "10.0.0.1")
    pod["status"]["podIPs"] = []
    assert target_of(pod) is None


async def test_the_egress_endpointslice_follows_the_probe(env):  # noqa: F811
    kube, prov, _ = env
    reps, changed = Replicas(), []
    for ip in ("10.0.0.1", "10.0.0.2"):
        await reps.add(ip)
    p = prober(reps, changed)
    rec = Reconciler(kube, prov, CFG, prober=p)
    runner = asyncio.ensure_future(p.run())
    try:
        await ready_group(kube, prov, rec)
        for i in range(2):
            kube.put(PODS, rendered_pod(f"pg-{i}", f"10.0.0.{i + 1}"))
        assert kube.obj(STATEFULSETS, "pg", NS) is not None
        egress_svc(kube)
        await rec.reconcile("svc", "apps", "db")
        cm_entry = json.loads(kube.obj(CONFIGMAPS, "pg-egress-config", NS)["data"]["egress-services"])["apps-db"]
        for i in range(2):
            report = {"podIPv4": f"10.0.0.{i + 1}", "services": {"apps-db": {
                "tailnetTarget": {"ip": "100.64.0.5", "fqdn": ""}, "ports": cm_entry["ports"], "tailnetTargetIPs": []}}}
            agent_reports(kube, f"pg-{i}", **{"egress-services": json.dumps(report).encode()})

        async def slice_addresses() -> list[list[str]]:
            await rec.reconcile("proxygroup", "", "pg")
            return [e["addresses"] for e in egress_objects(kube)[2]["endpoints"]]
        assert await slice_addresses() == [["10.0.0.1"], ["10.0.0.2"]]
        # the second replica's node is lost: its Pod is still Ready in the API, but it no longer answers
        reps.frozen.add("10.0.0.2")
        await wait_for(lambda: changed == ["pg"])
        assert await slice_addresses() == [["10.0.0.1"]]
        reps.frozen.clear()
        await wait_for(lambda: changed == ["pg", "pg"])
        assert await slice_addresses() == [["10.0.0.1"], ["10.0.0.2"]]
        # the group's deletion stops its probes
        await rec.groups.cleanup(kube.obj(PROXYGROUPS, "pg", ""))
        assert p._groups == {}
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        reps.close()


#: the rule with a silence far longer than any test waits: a replica that leaves under it left on a refusal
PATIENT = rh.HealthRule(down_after=600.0, up_after=0.3, up_silence=0.2)


async def test_a_replica_whose_port_refuses_connections_leaves_at_once():
    reps, changed = Replicas(), []
    for ip in ("10.0.0.1", "10.0.0.2"):
        await reps.add(ip)
    p = ReplicaProber(changed.append, rule=PATIENT, connections=3, interval=0.05, tick=0.02, stale=5.0,
                      open_connection=reps.open)
    a, b = Target("pg-0", "10.0.0.1", 9002), Target("pg-1", "10.0.0.2", 9002)
    runner = asyncio.ensure_future(p.run())
    try:
        p.track("pg", [a, b])
        await wait_for(lambda: reps.requests.get("10.0.0.2", 0) >= 3)
        await reps.exit("10.0.0.2")
        await wait_for(lambda: changed == ["pg"])
        assert p.serving([a, b]) == {a}
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        reps.close()


async def test_the_agents_own_health_endpoint_is_heard_and_its_not_ready_answer_takes_it_out_at_once():
    """Against the agent's endpoint server (containerboot.endpoints), as replicas run it: the 200 of a replica
    whose tailscaled is up is heard; the 503 of one whose tailscaled is down takes it out without waiting for
    the rule's silence (600 s here), and it comes back once it answers 200 again."""
    from containerboot.endpoints import EndpointServer
    from tests.test_endpoints import Holder, not_ready_status, ready_status
    statuses = {ip: Holder(ready_status()) for ip in ("10.0.0.1", "10.0.0.2")}
    servers, ports = [], {}
    for ip, st in statuses.items():
        srv = EndpointServer(status_provider=st, metrics_source=None, enable_metrics=False, enable_health=True,
                             pod_ipv4=ip)
        ports[ip] = int((await srv.start("127.0.0.1:0")).rsplit(":", 1)[1])
        servers.append(srv)
    changed: list[str] = []
    p = ReplicaProber(changed.append, rule=PATIENT, connections=2, interval=0.05, tick=0.02, stale=5.0,
                      open_connection=lambda host, _port: asyncio.open_connection("127.0.0.1", ports[host]))
    a, b = Target("pg-0", "10.0.0.1", 9002), Target("pg-1", "10.0.0.2", 9002)
    runner = asyncio.ensure_future(p.run())
    try:
        p.track("pg", [a, b])
        await a_tick_after(p, FAST.down_after * 2)
        assert p.serving([a, b]) == {a, b} and changed == []
        statuses["10.0.0.1"].st = not_ready_status()
        await wait_for(lambda: changed == ["pg"])
        assert p.serving([a, b]) == {b}
        statuses["10.0.0.1"].st = ready_status()
        await wait_for(lambda: changed == ["pg", "pg"])
        assert p.serving([a, b]) == {a, b}
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        for srv in servers:
            await srv.close()
