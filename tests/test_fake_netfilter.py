"""The test hook TS_TEST_FAKE_NETFILTER: an L3 proxy whose rules live in an in-memory firewall.

A harness built like upstream's runs the agent with fake binaries on PATH on a developer's machine or in CI.
With the hook set, no firewall tool may run and no netlink library may even be loaded: here every firewall
tool on PATH is a recording fake, and `pyroute2` / `nftables` are shadowed by modules that record their
import. The rules must still be visible, in `containerboot rules` and in `/status`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.waits import until
from tests.test_agent_boot import _free_port, _get

FIREWALL_TOOLS = [
    f"{base}{flavour}{tool}"
    for base in ("iptables", "ip6tables")
    for flavour in ("", "-legacy", "-nft")
    for tool in ("", "-save", "-restore")
] + ["nft", "conntrack", "modprobe", "ip", "ethtool", "sysctl", "xtables-legacy-multi", "xtables-nft-multi"]


def recording_path(tmp_path: Path) -> tuple[str, str, Path]:
    """(PATH prefix of recording fakes, PYTHONPATH prefix of recording netlink modules, the record file)."""
    record = tmp_path / "firewall-calls.log"
    bin_dir = tmp_path / "fwbin"
    bin_dir.mkdir()
    for tool in FIREWALL_TOOLS:
        p = bin_dir / tool
        # As upstream's test_tailscale.sh: record "$0 $@" and succeed.
        p.write_text(f'#!/bin/sh\necho "$0 $*" >> {record}\nexit 0\n')
        p.chmod(0o755)
    mods = tmp_path / "netlink-stubs"
    (mods / "pyroute2").mkdir(parents=True)
    stub = textwrap.dedent(f"""\
        with open({str(record)!r}, "a") as _f:
            _f.write("import " + __name__ + "\\n")
        raise ImportError(__name__ + " is blocked by the fake-netfilter test")
        """)
    (mods / "pyroute2" / "__init__.py").write_text(stub)
    (mods / "nftables.py").write_text(stub)
    return str(bin_dir), str(mods), record


def kernel_root(tmp_path: Path) -> Path:
    """A TS_TEST_ONLY_ROOT like upstream's harness builds: a regular file as the tun device, sysctls at 0."""
    root = tmp_path / "root"
    (root / "dev/net").mkdir(parents=True)
    (root / "dev/net/tun").write_text("")
    for rel in ("proc/sys/net/ipv4/ip_forward", "proc/sys/net/ipv6/conf/all/forwarding"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("0\n")
    return root


def hooked_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    from tests.conftest import FAKE_BIN, HERE
    bin_dir, mods, _ = recording_path(tmp_path)
    return {"PATH": f"{bin_dir}:{FAKE_BIN}:{os.environ['PATH']}", "PYTHONPATH": f"{mods}:{HERE.parent}",
            "TS_TEST_ONLY_ROOT": str(kernel_root(tmp_path)), "TS_TEST_FAKE_NETFILTER": "true",
            "TS_USERSPACE": "false", "FAKE_TS_INITIAL": "Running", **extra}


def test_l3_proxy_with_the_hook_runs_no_firewall_tool_and_shows_its_rules(run_agent, tmp_path):
    port = _free_port()
    env = hooked_env(tmp_path, TS_DEST_IP="10.0.0.7,fd00::7", TS_ENABLE_METRICS="true",
                     TS_LOCAL_ADDR_PORT=f"127.0.0.1:{port}")
    a = run_agent(**env)
    a.wait_for("Startup complete")
    # /status: the in-memory firewall and what it holds
    code, body = _get(f"http://127.0.0.1:{port}/status")
    assert code == 200, body
    fw = json.loads(body)["firewall"]
    assert fw["backend"].startswith("fake") and fw["ipv6"] is True
    assert {(d["original_dst"], tuple(d["targets"])) for d in fw["rules"]["dnats"]} == {
        ("100.64.0.5", ("10.0.0.7",)), ("fd7a:115c:a1e0::5", ("fd00::7",))}
    # `containerboot rules`, another process with the same hook: the same rules, as installed
    rules = subprocess.run([sys.executable, "-m", "containerboot", "rules"],
                           env={**os.environ, **env, "TS_SOCKET": str(tmp_path / "tailscaled.sock")},
                           capture_output=True, text=True, timeout=60)
    assert rules.returncode == 0, rules.stderr
    installed = rules.stdout.split("# installed:")[1]
    assert "--to-destination 10.0.0.7" in installed and "--to-destination fd00::7" in installed
    # forwarding was turned on in the test root, as upstream's harness expects
    assert (tmp_path / "root/proc/sys/net/ipv4/ip_forward").read_text().strip() == "1"
    assert a.stop() == 0
    record = tmp_path / "firewall-calls.log"
    calls = record.read_text() if record.exists() else ""
    assert calls == "", f"the hook touched the firewall:\n{calls}"
    assert "Removed the agent's firewall rules" in a.log()


def test_the_hook_without_ipv6_leaves_ipv6_rules_out_and_says_why(run_agent, tmp_path):
    port = _free_port()
    a = run_agent(**hooked_env(tmp_path, TS_TEST_FAKE_NETFILTER_6="false", TS_DEST_IP="10.0.0.7,fd00::7",
                               TS_ENABLE_METRICS="true", TS_LOCAL_ADDR_PORT=f"127.0.0.1:{port}"))
    a.wait_for("Startup complete")
    st = json.loads(_get(f"http://127.0.0.1:{port}/status")[1])
    assert st["firewall"]["ipv6"] is False
    assert [d["original_dst"] for d in st["firewall"]["rules"]["dnats"]] == ["100.64.0.5"]
    (target,) = st["targets"]
    assert "IPv6 NAT is not available" in target["last_error"]
    assert a.stop() == 0
    assert not (tmp_path / "firewall-calls.log").exists()


def test_egress_services_in_userspace_start_and_record_with_the_hook(run_agent, tmp_path, kube_api):
    """Upstream's harness runs its egress-services case in userspace mode with the fake firewall: the agent
    starts and records the service (without the hook, userspace gets no rules; see test_proxyservices)."""
    from tests.test_agent_kube import data, kube_env
    cfg = tmp_path / "egress"
    cfg.mkdir()
    (cfg / "egress-services").write_text(json.dumps({"svc": {
        "tailnetTarget": {"ip": "100.64.0.9", "fqdn": ""},
        "ports": [{"protocol": "tcp", "matchPort": 10001, "targetPort": 5432}]}}))
    env = hooked_env(tmp_path)
    env.update(kube_env(kube_api, TS_AUTHKEY="tskey-auth-X", TS_EGRESS_PROXIES_CONFIG_PATH=str(cfg),
                        POD_IPS="10.1.2.3", TS_LOCAL_ADDR_PORT=f"127.0.0.1:{_free_port()}"))
    env["TS_USERSPACE"] = "true"
    env["TS_TEST_ONLY_ROOT"] = kube_api.root
    a = run_agent(**env)
    a.wait_for("Startup complete")
    until(lambda: "egress-services" in data(kube_api), 20, "the egress services' status in the Secret")
    status = json.loads(data(kube_api)["egress-services"])
    assert status["services"]["svc"] == {"ports": [{"protocol": "tcp", "matchPort": 10001, "targetPort": 5432}],
                                         "tailnetTargetIPs": ["100.64.0.9"],
                                         "tailnetTarget": {"ip": "100.64.0.9", "fqdn": ""}}
    assert a.stop() == 0
    assert not (tmp_path / "firewall-calls.log").exists()


def test_every_backend_tells_the_agent_which_families_it_translates():
    """The reconciler leaves out rules of a family the firewall lacks (and the target says why) only if the
    backend says which families it has; an iptables backend without IPv6 NAT used to fail the whole apply."""
    from netfilter.fake import FakeBackend
    from netfilter.iptables import IptablesBackend

    assert IptablesBackend(ipv6=False, variant="").families == (4,)
    assert IptablesBackend(ipv6=True, variant="").families == (4, 6)
    assert FakeBackend(ipv6=False).families == (4,)


def _installed_dnats(tmp_path: Path) -> set[tuple[str, tuple[str, ...]]]:
    """The DNATs in the in-memory firewall, as the running agent published them."""
    from netfilter.fake import read_state, state_path
    fw = read_state(state_path(str(tmp_path / "tailscaled.sock")))
    return {(str(d.original_dst), tuple(map(str, d.targets))) for d in fw.rules.dnats}


def _pass_done_after_the_firewall_write(tmp_path: Path, port: int, backend_state: str) -> dict:
    """Wait until the reconcile pass that last wrote the in-memory firewall has finished, its start-up
    bookkeeping (where "Startup complete" would be said) included, and /status shows `backend_state`. The
    status of that moment.

    /status's `last_reconcile_at` is set at the end of a pass, after that pass's write. The state is waited
    for too: the fake tailscaled sends the netmap and the state change as two notifications, and on a loaded
    machine the early-rules timer can fire between the agent's reads of the two, so the rules go in before the
    agent has seen the state (same rules; the state is shown when its notification is read)."""
    from netfilter.fake import state_path
    written = Path(state_path(str(tmp_path / "tailscaled.sock"))).stat().st_mtime

    def done() -> dict | None:
        st = json.loads(_get(f"http://127.0.0.1:{port}/status")[1])
        ended = (st.get("last_reconcile_at") or 0) >= written
        return st if ended and st["backend_state"] == backend_state else None
    return until(done, what=f"the end of the pass that installed the rules, in state {backend_state}")


def test_rules_go_in_with_the_first_netmap_and_startup_completes_at_running(run_agent, tmp_path):
    """tailscaled has the node's addresses seconds before Running (network check, home DERP): the rules are
    installed then (when Running has not followed within EARLY_RULES_DELAY), but start-up, readiness and
    `tailscale up` still wait for Running."""
    from tests.test_agent_boot import _signal_fake_tailscaled, _wait_until
    port = _free_port()
    a = run_agent(**hooked_env(tmp_path, FAKE_TS_INITIAL="NeedsLogin", FAKE_TS_HOLD_STARTING="1",
                               TS_DEST_IP="10.0.0.7", TS_LOCAL_ADDR_PORT=f"127.0.0.1:{port}",
                               TS_ENABLE_METRICS="true", TS_ENABLE_HEALTH_CHECK="true"))
    want = {("100.64.0.5", ("10.0.0.7",))}
    _wait_until(lambda: _installed_dnats(tmp_path) == want, what="the DNAT installed in state Starting")
    # The pass that installed them has ended where start-up would complete: without Running, it did not.
    st = _pass_done_after_the_firewall_write(tmp_path, port, "Starting")
    assert "Startup complete" not in a.log()
    code, body = _get(f"http://127.0.0.1:{port}/readyz")
    assert code != 200, body
    assert st["backend_state"] == "Starting" and st["startup_complete"] is False
    _signal_fake_tailscaled(tmp_path, signal.SIGHUP)      # Starting -> Running
    a.wait_for("Startup complete")
    assert _get(f"http://127.0.0.1:{port}/readyz")[0] == 200
    assert a.log().count("Applying rules") == 1, a.log()   # installed once, confirmed at Running
    assert _installed_dnats(tmp_path) == want
    assert a.stop() == 0
    assert _installed_dnats(tmp_path) == set()


def test_stop_before_running_removes_the_rules_installed_early(run_agent, tmp_path):
    from tests.test_agent_boot import _wait_until
    a = run_agent(**hooked_env(tmp_path, FAKE_TS_INITIAL="NeedsLogin", FAKE_TS_HOLD_STARTING="1",
                               TS_DEST_IP="10.0.0.7"))
    _wait_until(lambda: _installed_dnats(tmp_path), what="the DNAT installed in state Starting")
    assert a.stop() == 0
    assert _installed_dnats(tmp_path) == set()
    assert "Removed the agent's firewall rules" in a.log()
    assert "Startup complete" not in a.log()
    assert (tmp_path / "tailscaled.sigterm").exists()


def test_rules_go_in_at_running_while_tailscale_up_exits_and_startup_waits_for_it(run_agent, tmp_path):
    """At Running the rules are installed at once, while `tailscale up` is still exiting (it sees Running
    too, a few milliseconds later): the proxy is ready (Running, rules in), but start-up completes only with
    the CLI's successful exit, as upstream's."""
    from tests.test_agent_boot import _wait_until
    port = _free_port()
    gate = tmp_path / "up-may-exit"
    a = run_agent(**hooked_env(tmp_path, FAKE_TS_INITIAL="NeedsLogin", FAKE_TS_UP_EXIT_GATE=str(gate),
                               TS_DEST_IP="10.0.0.7", TS_LOCAL_ADDR_PORT=f"127.0.0.1:{port}",
                               TS_ENABLE_METRICS="true", TS_ENABLE_HEALTH_CHECK="true"))
    want = {("100.64.0.5", ("10.0.0.7",))}
    _wait_until(lambda: _installed_dnats(tmp_path) == want, what="the DNAT installed at Running")
    # The backend is Running and `tailscale up` has seen it, but still runs (its exit is gated). The CLI polls
    # the backend's state while the agent reads it from the bus: either may see Running first.
    _wait_until((tmp_path / "up-may-exit.running").exists, what="`tailscale up` seeing Running")
    # The pass that installed them has ended where start-up would complete: without the CLI's exit, it did not.
    st = _pass_done_after_the_firewall_write(tmp_path, port, "Running")
    assert "Startup complete" not in a.log()
    assert _get(f"http://127.0.0.1:{port}/readyz")[0] == 200
    assert st["startup_complete"] is False
    gate.touch()
    a.wait_for("Startup complete")
    assert json.loads(_get(f"http://127.0.0.1:{port}/status")[1])["startup_complete"] is True
    assert a.log().count("Applying rules") == 1, a.log()
    assert a.stop() == 0
    assert _installed_dnats(tmp_path) == set()


def _login_watch_mask(tmp_path: Path) -> int:
    from urllib.parse import parse_qs, urlparse

    from tests.test_localapi import requests
    for req in requests(tmp_path):
        if req["path"].startswith("/localapi/v0/watch-ipn-bus"):
            return int(parse_qs(urlparse(req["path"]).query)["mask"][0])
    raise AssertionError("no watch-ipn-bus request")


@pytest.mark.parametrize("target, peers_wanted", [({"TS_DEST_IP": "10.0.0.7"}, False),
                                                  ({"TS_TAILNET_TARGET_IP": "100.64.0.9"}, False),
                                                  ({"TS_TAILNET_TARGET_FQDN": "db.tailnet.test"}, True)])
def test_the_login_watches_peers_only_when_the_rules_need_them(run_agent, tmp_path, target, peers_wanted):
    """Whatever tailscaled computes for a watcher delays its own switch to Running: the login's watch asks for
    peer changes only when a target resolves through the tailnet's peers (a tailnet FQDN)."""
    from containerboot.localapi import NOTIFY_INITIAL_HEALTH_STATE, NOTIFY_NO_NETMAP, NOTIFY_PEER_CHANGES
    from tests.test_agent_boot import _wait_until
    a = run_agent(**hooked_env(tmp_path, FAKE_TS_INITIAL="NeedsLogin", **target))
    _wait_until(lambda: (tmp_path / "requests.log").exists() and "watch-ipn-bus" in
                (tmp_path / "requests.log").read_text(), what="the login's watch")
    mask = _login_watch_mask(tmp_path)
    assert bool(mask & NOTIFY_PEER_CHANGES) is peers_wanted
    assert mask & NOTIFY_NO_NETMAP and mask & NOTIFY_INITIAL_HEALTH_STATE
    a.stop()
