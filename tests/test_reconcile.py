"""The reconciler: level-triggered convergence, start-up gating, and what it says about targets."""
from __future__ import annotations

import ipaddress
import logging

from containerboot.reconcile import Reconciler
from containerboot.settings import load
from containerboot.state import NodeState, apply_notify
from netfilter.fake import FakeBackend
from tests.support.waits import until_async

ip = ipaddress.ip_address


class FakeFirewall(FakeBackend):
    """The test hook's in-memory firewall, recording every rule set it was asked to apply."""

    def __init__(self):
        super().__init__()
        self.applied = []

    def apply(self, rules):
        self.applied.append(rules)
        return super().apply(rules)


def node(*ips, peers=None):
    init = {"BackendState": "Running", "Self": {"ID": "n1", "NodeID": 1, "DNSName": "p.t.", "TailscaleIPs": list(ips)},
            "Peer": peers or {}}
    return apply_notify(NodeState(), {"InitialStatus": init}, 1.0)


async def test_a_pending_dns_target_holds_start_up_back_until_it_resolves():
    fw = FakeFirewall()
    rec = Reconciler(load({"TS_USERSPACE": "false", "TS_EXPERIMENTAL_DEST_DNS_NAME": "b.example"}), fw)
    rec.set_node(node("100.64.0.5"))
    want = await rec.reconcile_once()
    assert rec.rules_installed_for(want) and not rec.ready_to_serve(want)
    rec.on_dns_answer((ip("10.0.0.1"),), "")
    want = await rec.reconcile_once()
    assert rec.ready_to_serve(want) and fw.applied[-1].dnats
    rec.on_dns_answer(None, "SERVFAIL")  # a failure keeps the last good backends
    want = await rec.reconcile_once()
    assert rec.ready_to_serve(want) and fw.applied[-1].dnats


async def test_applies_only_on_change_unless_forced():
    fw = FakeFirewall()
    rec = Reconciler(load({"TS_USERSPACE": "false", "TS_DEST_IP": "10.0.0.7"}), fw)
    rec.set_node(node("100.64.0.5"))
    await rec.reconcile_once()
    await rec.reconcile_once()
    assert len(fw.applied) == 1
    await rec.reconcile_once(force=True)  # the periodic resync repairs drift
    assert len(fw.applied) == 2


async def test_target_errors_are_logged_once_and_recovery_too(caplog):
    caplog.set_level(logging.INFO, logger="containerboot")
    peer = {"k": {"ID": "n2", "NodeID": 2, "DNSName": "c.t.", "TailscaleIPs": ["100.64.0.2"],
                  "AllowedIPs": ["100.64.0.2/32"]}}
    rec = Reconciler(load({"TS_USERSPACE": "false", "TS_TAILNET_TARGET_FQDN": "c.t"}), FakeFirewall())
    rec.set_node(node("100.64.0.5"))
    await rec.reconcile_once()
    await rec.reconcile_once()
    assert caplog.text.count("could not find Tailscale node") == 1
    rec.set_node(node("100.64.0.5", peers=peer))
    await rec.reconcile_once()
    assert "TS_TAILNET_TARGET_FQDN c.t resolved again to 100.64.0.2" in caplog.text


async def test_a_failing_firewall_is_reported_and_retried():
    class Broken(FakeFirewall):
        def apply(self, rules):
            raise RuntimeError("nft: Operation not permitted")

    rec = Reconciler(load({"TS_USERSPACE": "false", "TS_DEST_IP": "10.0.0.7"}), Broken())
    rec.set_node(node("100.64.0.5"))
    want = await rec.reconcile_once()
    assert not rec.rules_installed_for(want)
    assert "Operation not permitted" in rec.target_statuses()[0].last_error
    assert rec.stats.failures == 1
    rec.firewall = FakeFirewall()
    want = await rec.reconcile_once(force=True)
    assert rec.rules_installed_for(want) and rec.target_statuses()[0].rules_installed




async def test_services_follow_the_config_and_use_only_the_firewalls_families():
    from containerboot import proxyservices as ps

    class V4Only(FakeFirewall):
        families = (4,)

    fw = V4Only()
    env = {"TS_USERSPACE": "false", "KUBERNETES_SERVICE_HOST": "10.0.0.1", "TS_KUBE_SECRET": "s",
           "TS_EGRESS_PROXIES_CONFIG_PATH": "/etc/proxies", "POD_IPS": "10.1.2.3"}
    rec = Reconciler(load(env), fw)
    rec.set_node(node("100.64.0.5", "fd7a:115c:a1e0::5"))
    want = await rec.reconcile_once()
    assert want.services is None and fw.applied[-1].empty   # the file has not been read yet: nothing to report
    cfg = ps.parse_egress_services('{"a": {"tailnetTarget": {"ip": "fd7a:115c:a1e0::9"}, '
                                   '"ports": [{"protocol": "TCP", "matchPort": 10001, "targetPort": 80}]}, '
                                   '"b": {"tailnetTarget": {"ip": "100.64.0.9"}, '
                                   '"ports": [{"protocol": "UDP", "matchPort": 10002, "targetPort": 53}]}}')
    rec.set_services(ps.ServicesInput(egress=cfg))
    assert rec.pending
    want = await rec.reconcile_once()
    assert [p.service for p in fw.applied[-1].port_maps] == ["b"]   # the IPv6-only service cannot be installed
    assert rec.rules_installed_for(want) and rec.ready_to_serve(want)
    by_name = {t.name: t for t in rec.target_statuses()}
    assert by_name["b"].rules_installed and not by_name["a"].rules_installed
    assert "IPv6 NAT is not available" in by_name["a"].last_error and not by_name["a"].gates_readiness
    # the service goes away: its rules go with it
    rec.set_services(ps.ServicesInput(egress=ps.EgressConfig()))
    await rec.reconcile_once()
    assert fw.applied[-1].port_maps == ()


async def test_the_idle_loop_beats_but_a_stuck_pass_does_not(monkeypatch):
    """Liveness: an idle loop beats every few seconds (so a late 30 s resync timer cannot fail /livez), while
    a pass stuck in the firewall adapter stops the beat so that /livez reports the stall."""
    import asyncio
    import threading

    import containerboot.reconcile as reconcile_mod

    monkeypatch.setattr(reconcile_mod, "HEARTBEAT_INTERVAL", 0.01)
    now = [1000.0]
    release, entered = threading.Event(), threading.Event()

    class StuckFirewall(FakeFirewall):
        stuck = False
        in_process = False      # a firewall tool that hangs: the apply runs in a worker thread

        def apply(self, rules):
            if self.stuck:
                entered.set()
                release.wait(5)
            super().apply(rules)

    fw = StuckFirewall()
    rec = Reconciler(load({"TS_USERSPACE": "false", "TS_DEST_IP": "10.0.0.7"}), fw, clock=lambda: now[0])
    task = asyncio.create_task(rec.run())
    try:
        rec.set_node(node("100.64.0.5"))
        now[0] = 1100.0
        await until_async(lambda: rec.reconciled_node is not None, what="the first pass")
        assert rec.heartbeat == 1100.0
        now[0] = 1150.0                    # idle: no pass runs, only the beat can move the heartbeat
        await until_async(lambda: rec.heartbeat == 1150.0, what="the idle loop's beat")
        fw.stuck = True
        rec.poke(force=True)
        await until_async(entered.is_set, what="the pass blocked in apply")
        started = rec.heartbeat
        now[0] = 1200.0
        beats = rec.beats
        # Two ticks of the beat, so one began and ended after the clock moved: it had its chance to beat.
        await until_async(lambda: rec.beats >= beats + 2, what="two more ticks of the beat")
        assert rec.heartbeat == started, "a stuck pass must not look alive"
        release.set()
        await until_async(lambda: rec.heartbeat == 1200.0, what="the released pass's beat")
    finally:
        release.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_node_snapshot_of_the_last_pass_is_kept():
    rec = Reconciler(load({"TS_USERSPACE": "false", "TS_DEST_IP": "10.0.0.7"}), FakeFirewall())
    assert rec.reconciled_node is None
    first = node("100.64.0.5")
    rec.set_node(first)
    await rec.reconcile_once()
    rec.set_node(node("100.64.0.6"))       # the bus moved on; the rules still match the first snapshot
    assert rec.reconciled_node == first


class KernelLike(FakeFirewall):
    """A fake firewall whose rules translate connections, as the kernel backends' do."""
    translates_connections = True


def _record_conntrack_flushes(monkeypatch) -> list:
    """Replace the kernel conntrack dump with a recorder: ("flush", number of DNATs, first apply?)."""
    import netfilter.conntrack as ct
    events: list = []

    def flush(rules, previous) -> int:
        events.append(("flush", len(rules.dnats), previous is None))
        return 0

    monkeypatch.setattr(ct, "flush_stale_conntrack", flush)
    return events


async def test_the_conntrack_clean_up_runs_after_the_pass_reported_the_rules(monkeypatch):
    """The UDP conntrack clean-up (a kernel dump) still runs in the same pass, but after on_converged, so that
    the Secret and "Startup complete" do not wait for it; two applies before it keep the older rule set."""
    events = _record_conntrack_flushes(monkeypatch)

    async def converged(rec, want, node_):
        events.append(("converged", len(want.rules.dnats)))

    fw = KernelLike()
    settings = load({"TS_USERSPACE": "false", "TS_DEST_IP": "10.0.0.7"})
    rec = Reconciler(settings, fw, on_converged=converged)
    rec.set_node(node("100.64.0.5"))
    await rec.reconcile_once()
    assert events == [("converged", 1), ("flush", 1, True)]
    await rec.reconcile_once(force=True)           # the kernel already holds these rules: nothing to clean
    assert events[-1] == ("converged", 1)
    # two changes, one clean-up: the binding check sees the rule set before both
    rec.set_node(node("100.64.0.6"))
    await rec.reconcile_once(defer_cleanup=True)
    rec.set_node(node("100.64.0.7"))
    await rec.reconcile_once()
    assert events[-1] == ("flush", 1, False) and rec.pending_cleanup is None


async def test_a_firewall_without_connections_to_translate_is_never_cleaned_up(monkeypatch):
    """The test hook's fake firewall: no conntrack table exists, so no clean-up is owed or run."""
    events = _record_conntrack_flushes(monkeypatch)
    rec = Reconciler(load({"TS_USERSPACE": "false", "TS_DEST_IP": "10.0.0.7"}), FakeFirewall())
    rec.set_node(node("100.64.0.5"))
    await rec.reconcile_once()
    assert events == [] and rec.pending_cleanup is None


async def test_the_pass_before_running_leaves_the_conntrack_clean_up_to_the_pass_that_completes_start_up(
        monkeypatch):
    """The rules installed with the first netmap (state Starting) do not run the conntrack dump: it would hold
    up the login's handling of Running by tens of milliseconds. The next pass (at Running) finds the rules
    unchanged, reports them (start-up), and only then cleans up, against the rule set before the early one."""
    events = _record_conntrack_flushes(monkeypatch)

    async def converged(rec, want, node_):
        events.append(("converged", node_.backend_state))

    fw = KernelLike()
    rec = Reconciler(load({"TS_USERSPACE": "false", "TS_DEST_IP": "10.0.0.7"}), fw, on_converged=converged)
    starting = node("100.64.0.5")
    from dataclasses import replace
    rec.set_node(replace(starting, backend_state="Starting"))
    await rec.reconcile_once(defer_cleanup=True)
    assert events == [("converged", "Starting")] and rec.pending_cleanup is not None
    rec.set_node(starting)                       # Running, same addresses
    await rec.reconcile_once()
    assert len(fw.applied) == 1                  # not re-applied
    assert events == [("converged", "Starting"), ("converged", "Running"), ("flush", 1, True)]
    assert rec.pending_cleanup is None


class ThreadRecordingFirewall(FakeFirewall):
    """Records which thread ran each apply."""

    def __init__(self, in_process: bool):
        super().__init__()
        self.in_process = in_process
        self.threads: list[int] = []

    def apply(self, rules):
        import threading
        self.threads.append(threading.get_ident())
        super().apply(rules)


async def test_small_in_process_applies_stay_on_the_loop_big_ones_and_firewall_tools_go_to_a_worker(monkeypatch):
    """A small libnftables apply (about a millisecond) runs on the loop's thread: at Running a hand-off to a
    worker thread cost more than the apply. Backends that run a firewall tool, and big rule sets, run in a
    worker thread so that the loop (health, metrics, the IPN bus) keeps answering meanwhile."""
    import threading

    import containerboot.reconcile as reconcile_mod
    loop_thread = threading.get_ident()
    settings = load({"TS_USERSPACE": "false", "TS_DEST_IP": "10.0.0.7"})

    async def apply_with(fw) -> int:
        rec = Reconciler(settings, fw)
        rec.set_node(node("100.64.0.5"))
        await rec.reconcile_once()
        assert fw.applied and fw.applied[-1].dnats
        return fw.threads[-1]

    assert await apply_with(ThreadRecordingFirewall(in_process=True)) == loop_thread
    assert await apply_with(ThreadRecordingFirewall(in_process=False)) != loop_thread
    monkeypatch.setattr(reconcile_mod, "INLINE_APPLY_MAX_ENTRIES", 0)    # one DNAT is now a "big" set
    assert await apply_with(ThreadRecordingFirewall(in_process=True)) != loop_thread

