"""What the agent reports while its parts come up and go down (the inputs of /readyz and /status).

Each case is a moment the IPN bus, the reconciler and the serve loop are out of step; /readyz must answer from
the slowest of them, never from a default that looks like "nothing to wait for"."""
from __future__ import annotations

import asyncio

from containerboot.agent import Agent
from containerboot.reconcile import Reconciler
from containerboot.settings import load
from containerboot.state import NodeState, apply_notify
from containerboot.status import ServeStatus
from containerboot.steady import SteadyState
from tests.support.waits import WatchedEvent, until_async


def running_node(*ips: str, cert_domain: str = "p.tailnet.test") -> NodeState:
    init = {"BackendState": "Running", "CertDomains": [cert_domain],
            "Self": {"ID": "n1", "NodeID": 1, "DNSName": "p.tailnet.test.", "TailscaleIPs": list(ips)}}
    return apply_notify(NodeState(), {"InitialStatus": init}, 1.0)


def agent_with(env: dict[str, str]) -> Agent:
    a = Agent(load(env), env)
    a.reconciler = Reconciler(a.s, None)
    return a


def steady_for(a: Agent) -> SteadyState:
    assert a.reconciler is not None
    return SteadyState(a.s, a.reconciler, object())    # type: ignore[arg-type]  # no LocalAPI call is made


async def test_not_ready_before_the_first_serve_apply(tmp_path):
    env = {"TS_SERVE_CONFIG": str(tmp_path / "serve.json")}
    a = agent_with(env)
    a.reconciler.set_node(running_node("100.64.0.5"))
    await a.reconciler.reconcile_once()
    ok, reasons = a.status().ready(a.status().started_at + 1)
    assert not ok and reasons == ["serve config not applied: waiting for the first apply"]
    a.steady = steady_for(a)
    a.steady.serve_status = ServeStatus(applied=True)      # what the serve loop reports after its first apply
    st = a.status()
    assert st.ready(st.started_at + 1) == (True, [])


async def test_without_serve_config_nothing_waits_for_serve():
    a = agent_with({})
    a.reconciler.set_node(running_node("100.64.0.5"))
    await a.reconciler.reconcile_once()
    st = a.status()
    assert st.serve is None and st.ready(st.started_at + 1) == (True, [])


async def test_not_ready_once_shutdown_begins():
    a = agent_with({})
    a.reconciler.set_node(running_node("100.64.0.5"))
    await a.reconciler.reconcile_once()
    await a.shutdown()
    st = a.status()
    assert st.ready(st.started_at + 1) == (False, ["the agent is shutting down"])


async def test_the_serve_loop_starts_with_the_cert_domain_of_the_self_node(tmp_path, monkeypatch):
    """The serve loop must not start before the bus has told the agent who it is: its first apply would use
    "no-https" (and publish it as https_endpoint) instead of the node's cert domain."""
    import serveconfig.apply as apply_mod

    started: list[str] = []

    class RecordingLoop:
        def __init__(self, path, applier, *, cert_domain, on_result):
            started.append(cert_domain)

        async def run(self):
            await asyncio.Event().wait()     # runs until cancelled

    class NoCerts:
        def __init__(self, *a, **kw):
            pass

        async def close(self):
            pass

    monkeypatch.setattr(apply_mod, "ServeLoop", RecordingLoop)
    monkeypatch.setattr(apply_mod, "CertManager", NoCerts)
    a = agent_with({"TS_SERVE_CONFIG": str(tmp_path / "serve.json")})
    steady = steady_for(a)
    steady.self_node_known = known = WatchedEvent()
    task = asyncio.create_task(steady.run_serve())
    try:
        await until_async(lambda: known.waits, what="run_serve waiting for the self node")
        assert started == [], "the serve loop started before the self node was known"
        a.reconciler.set_node(running_node("100.64.0.5"))
        known.set()     # what watch_bus does once a notification carries the self node
        await until_async(lambda: started, what="the serve loop to start")
        assert started == ["p.tailnet.test"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _pg_agent(tmp_path) -> Agent:
    d = tmp_path / "egress"
    d.mkdir()
    return agent_with({"TS_USERSPACE": "false", "TS_EGRESS_PROXIES_CONFIG_PATH": str(d),
                       "KUBERNETES_SERVICE_HOST": "10.96.0.1", "TS_KUBE_SECRET": "proxy-0"})


async def test_the_first_pass_waits_for_the_services_files_first_read(tmp_path, monkeypatch):
    """ProxyGroup: the reconcile loop starts only once the services files were read, so the first pass (and
    "Startup complete") already includes the services; a file that is never read only delays it a bounded time."""
    import containerboot.steady as steady_mod

    a = _pg_agent(tmp_path)
    steady = steady_for(a)
    runs: list[bool] = []

    async def fake_run():
        runs.append(True)

    monkeypatch.setattr(a.reconciler, "run", fake_run)
    ev = WatchedEvent()
    task = asyncio.create_task(steady.run_reconciler([ev]))
    await until_async(lambda: ev.waits, what="run_reconciler waiting for the first read")
    assert runs == [], "the reconcile loop started before the services file was read"
    ev.set()
    await asyncio.wait_for(task, 1)
    assert runs == [True]

    monkeypatch.setattr(steady_mod, "INPUTS_FIRST_READ_WAIT", 0.05)
    await asyncio.wait_for(steady.run_reconciler([asyncio.Event()]), 1)   # never read: starts anyway
    assert runs == [True, True]


async def test_the_services_watcher_reports_its_first_read_whatever_the_file_holds(tmp_path):
    a = _pg_agent(tmp_path)
    steady = steady_for(a)
    for content in (None, "{not json", '{"svc": {"tailnetTarget": {"ip": "100.64.0.9"}, '
                                         '"ports": [{"protocol": "TCP", "matchPort": 80, "targetPort": 80}]}}'):
        path = tmp_path / "egress" / "egress-services"
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(content)
        ev = asyncio.Event()
        task = asyncio.create_task(steady.watch_services("egress", ev))
        try:
            await asyncio.wait_for(ev.wait(), 10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    egress = a.reconciler.services.egress
    assert egress is not None and [s.name for s in egress.services] == ["svc"]


class _Tailscaled:
    """Stands in for the agent's tailscaled: only whether it still runs matters here."""

    def __init__(self) -> None:
        self.running = True

    def alive(self) -> bool:
        return self.running


async def test_health_fails_as_soon_as_tailscaled_has_died_before_the_agent_exits():
    """Upstream's /healthz is "the node has tailnet IPs"; with tailscaled dead it has none. The check must fail
    while the agent is still removing its rules, not only once its HTTP server is gone: the kubelet's readiness
    probe and the controller's health probe take a ProxyGroup replica out of the EndpointSlices on that answer."""
    a = agent_with({})
    a.reconciler.set_node(running_node("100.64.0.5"))
    await a.reconciler.reconcile_once()
    ts = _Tailscaled()
    a.tailscaled = ts    # type: ignore[assignment]
    assert a.status().healthy()
    ts.running = False
    st = a.status()
    assert not st.healthy() and st.tailnet_ips == ()
    assert not st.ready(st.started_at + 1)[0]
