"""Crash consistency of the agent beyond boot: SIGKILL just before each write that a config change causes while
it runs, and the auth key reissue with a real headscale; then start it again.

Real kernel, tailscaled and headscale, the test API server holding the state Secret (as test_agent_crash.py,
which covers the boot's writes). One agent runs as a ProxyGroup-like Pod with all three files the operator
rewrites while it runs: the serve config (TS_SERVE_CONFIG), the egress services and the ingress services
(kubelet ConfigMap volumes, rewritten by a ``..data`` swap). A clean run with CB_TEST_CRASH_LOG boots (the
state Secret restored to one snapshot before every boot, so every boot makes the same writes), then edits the
files one after the other, waiting each time until the agent has converged; the crash points each edit causes
(tscommon/crashpoint.py: `serve-apply`, `rules-apply`, `secret-write`) are what is tried. For each point the
agent boots the same way, the edits are replayed until it is killed there (with everything else in the proxy
namespace, as a container dies), and it is started again on the files as they stand. Then:
* the node keeps its identity: one `proxy` node in headscale, the same node ID;
* the rules converge with none missing or duplicated: the agent's own rules equal the clean run's after the
  same edit;
* the Secret is whole and says what the clean run's says: tailscaled's state consistent, the egress and
  ingress services records equal the clean run's, the serve config in tailscaled equal the clean run's;
* the data path works: through serve from the tailnet client, through an egress service from the cluster
  workload, through the ingress VIP from the tailnet client.

Both firewall backends: with iptables only the rule applies are tried (the Secret writes and serve applies do
not depend on the backend). `make test` tries one point with nftables, drawn from the run's seed (`CB_SEED`,
printed at the start; setting it repeats the choice), so that successive runs cover the points over time (the
clean run's checks cover the rest once); `make crash` (CB_CRASH_ALL=1) every point in both backends.

The reissue: the agent in one-step mode (the operator's config file with a single-use key); its node is then
expired at headscale, so tailscaled needs a new login and the used key is refused: the agent asks for a new
one (`reissue_authkey`). The test plays the operator as the controller does: deletes the device the Secret
names, mints a key, rewrites the config. Killed before the request and before the clean-up, the next runs
finish the reissue; at the end exactly one `proxy` node at headscale, the new login's, and the old one gone;
every key minted used once. `make test` tries the clean-up; `make crash` both.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import kubelab
import labextras as lx
import pytest
from test_proxygroup_e2e import (
    EGRESS_KEY,
    INGRESS_KEY,
    INGRESS_SVC,
    POD_V4,
    POD_V6,
    VIP4,
    VIP6,
    ConfigMapDir,
    normalized,
    proxy_peer_routes,
)

from containerboot.kube import secretstate
from labtools.lab import BACKEND_V4, BACKEND_V6, Lab, wait_until
from tests.support import seed

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(3600)]

STARTUP = "Startup complete, waiting for shutdown signal"
POD_UID = "7a6b5c4d-3e2f-4a1b-9c8d-7e6f5a4b3c2d"
CRASH_ALL = os.environ.get("CB_CRASH_ALL", "") not in ("", "0")
HOST = "proxy.tailnet.test"          # the serve config's host (the node's MagicDNS name)
SECOND_PORT = 8083                   # a second backend the serve edit reroutes to
TARGET_PORT = 8095                   # the egress services' target on the client node
EGRESS_PORT, EGRESS_PORT2 = 10021, 10022
LOCAL_PORT = 9012


def _normalized_rules(rules: str) -> str:
    rules = re.sub(r"counter packets \d+ bytes \d+", "counter", rules)
    return re.sub(r"\[\d+:\d+\]", "[0:0]", rules)


def _points(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [f"{name}:{n}" for name, n in (line.split() for line in path.read_text().splitlines())]


def serve_doc(backend: str) -> dict:
    return {"TCP": {"80": {"HTTP": True}}, "Web": {f"{HOST}:80": {"Handlers": {"/": {"Proxy": backend}}}}}


def write_atomically(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


@dataclass
class Step:
    """One state of the files: the clean run's points for the edit that led here and what it converged to."""
    name: str
    serve: dict
    egress: dict
    ingress: dict
    points: list[str] = field(default_factory=list)
    rules: str = ""
    egress_status: dict | None = None
    ingress_status: dict | None = None
    serve_config: dict | None = None


class Scenario:
    def __init__(self, lab, backend, second, target, api, mode: str) -> None:
        self.lab, self.backend, self.second, self.target, self.api, self.mode = lab, backend, second, target, api, mode
        self.secret = f"ts-steady-{mode}"
        root = lab.run_dir / f"steady-{mode}"
        root.mkdir()
        self.serve_path = root / "serve.json"
        self.egress_dir, self.ingress_dir = ConfigMapDir(root / "egress"), ConfigMapDir(root / "ingress")
        self.client_v4, client_v6 = lab.tailnet_ips("client")
        self.v6 = bool(lab.ipv6 and client_v6)
        self.env = {
            "TS_KUBE_SECRET": self.secret, "POD_UID": POD_UID,
            "POD_IPS": POD_V4 + (f",{POD_V6}" if lab.ipv6 else ""),
            "TS_SERVE_CONFIG": str(self.serve_path),
            "TS_EGRESS_PROXIES_CONFIG_PATH": str(self.egress_dir.path),
            "TS_INGRESS_PROXIES_CONFIG_PATH": str(self.ingress_dir.path / INGRESS_KEY),
            "TS_ROUTES": ",".join([f"{VIP4}/32"] + ([f"{VIP6}/128"] if self.v6 else [])),
            "TS_LOCAL_ADDR_PORT": f"{POD_V4}:{LOCAL_PORT}",
            "TS_DEBUG_FIREWALL_MODE": mode,
        }
        egress1 = {"svc-a": self._egress_svc(EGRESS_PORT)}
        egress2 = {**egress1, "svc-b": self._egress_svc(EGRESS_PORT2)}
        ingress1 = {INGRESS_SVC: {"IPv4Mapping": {"TailscaleServiceIP": VIP4, "ClusterIP": BACKEND_V4}}}
        # The ingress edit: the IPv6 mapping added (or, without IPv6, the service removed).
        ingress2 = ({INGRESS_SVC: {**ingress1[INGRESS_SVC],
                                   "IPv6Mapping": {"TailscaleServiceIP": VIP6, "ClusterIP": BACKEND_V6}}}
                    if self.v6 else {})
        serve1, serve2 = serve_doc(f"http://{BACKEND_V4}:8080"), serve_doc(f"http://{BACKEND_V4}:{SECOND_PORT}")
        self.steps = [Step("boot", serve1, egress1, ingress1), Step("serve edit", serve2, egress1, ingress1),
                      Step("egress edit", serve2, egress2, ingress1), Step("ingress edit", serve2, egress2, ingress2)]
        self.snapshot: dict[str, bytes] = {}
        self.node_id = ""
        self.agents: list = []
        #: when the agent's inputs last changed (its files written, or the agent started): wall clock, as /status;
        #: and whether that change runs a reconcile pass (the serve config's is applied by the serve loop alone)
        self.changed_at, self.change_reconciled = 0.0, True

    def _egress_svc(self, match: int) -> dict:
        return {"tailnetTarget": {"ip": self.client_v4, "fqdn": ""},
                "ports": [{"protocol": "TCP", "matchPort": match, "targetPort": TARGET_PORT}],
                "healthCheckEndpoint": ""}

    # ---- files and expectations
    def write_files(self, step: Step, only: str = "") -> None:
        self.changed_at, self.change_reconciled = time.time(), only != "serve"
        if only in ("", "serve"):
            write_atomically(self.serve_path, step.serve)
        if only in ("", "egress"):
            self.egress_dir.write({EGRESS_KEY: json.dumps(step.egress)})
        if only in ("", "ingress"):
            self.ingress_dir.write({INGRESS_KEY: json.dumps(step.ingress)})

    def expected_egress(self, step: Step) -> dict:
        services = {n: {"ports": c["ports"], "tailnetTargetIPs": [self.client_v4], "tailnetTarget": c["tailnetTarget"]}
                    for n, c in step.egress.items()}
        return normalized({"podIPv4": POD_V4, **({"podIPv6": POD_V6} if self.lab.ipv6 else {}),
                           "services": services or None})

    def expected_ingress(self, step: Step) -> dict:
        doc: dict = {"podIPv4": POD_V4, **({"podIPv6": POD_V6} if self.lab.ipv6 else {})}
        if step.ingress:
            doc["configs"] = step.ingress
        return doc

    def secret_doc(self, key: str):
        raw = (self.api.secret_data(self.secret) or {}).get(key)
        return None if raw is None else normalized(json.loads(raw))

    def serve_config(self, agent) -> dict:
        cp = agent.ts("serve", "status", "--json", timeout=15)
        return json.loads(cp.stdout or "{}")

    def wait_converged(self, agent, step: Step, timeout: float = 45.0) -> None:
        last: list = [None]

        def ok() -> bool:
            if not agent.running():
                raise AssertionError(f"the agent exited ({agent.returncode}):\n{agent.log_text()[-3000:]}")
            cfg = self.serve_config(agent)
            proxy = (((cfg.get("Web") or {}).get(f"{HOST}:80") or {}).get("Handlers") or {}).get("/", {})
            got = (self.secret_doc(EGRESS_KEY), self.secret_doc(INGRESS_KEY), proxy.get("Proxy"))
            last[0] = got
            return got == (self.expected_egress(step), self.expected_ingress(step),
                           step.serve["Web"][f"{HOST}:80"]["Handlers"]["/"]["Proxy"])
        try:
            wait_until(ok, timeout, 0.3, f"the agent converged after the {step.name}")
        except TimeoutError:
            want = (self.expected_egress(step), self.expected_ingress(step), step.serve)
            raise AssertionError(f"not converged after the {step.name}: (egress record, ingress record, serve "
                                 f"proxy) are\n{last[0]}\nexpected\n{want}\nlog:\n{agent.log_text()[-3000:]}"
                                 ) from None
        # The writes that follow (a record, device keys) are done: a pass has finished since the change (the
        # one that wrote what `ok` saw, or a later one; a serve edit runs none, its apply is what `ok` saw) and
        # /status owes the Secret nothing.
        def settled() -> bool:
            cp = self.lab.curl("proxy", f"http://{POD_V4}:{LOCAL_PORT}/status", 3)
            st = json.loads(cp.stdout) if cp.returncode == 0 else {}
            passed = not self.change_reconciled or (st.get("last_reconcile_at") or 0) >= self.changed_at
            return passed and (st.get("kubernetes_api") or {}).get("pending_writes") == []
        wait_until(settled, timeout, 0.2, f"the agent's writes after the {step.name}")

    def record(self, agent, step: Step) -> None:
        step.rules = _normalized_rules(lx.own_rules(self.lab, self.mode))
        step.egress_status = self.secret_doc(EGRESS_KEY)
        step.ingress_status = self.secret_doc(INGRESS_KEY)
        step.serve_config = self.serve_config(agent)

    # ---- the agent
    def start(self, **extra: str):
        self.changed_at, self.change_reconciled = time.time(), True
        a = kubelab.start_pod_agent(self.lab, self.api, {**self.env, **extra})
        self.agents.append(a)
        return a

    def boot(self, **extra: str):
        """A boot from the snapshot, the files at the first step's."""
        self.api.put_secret(self.secret, {k: v.decode() for k, v in self.snapshot.items()})
        self.write_files(self.steps[0])
        a = self.start(**extra)
        kubelab.wait_log(a, STARTUP)
        a.wait_running(30)
        return a

    def stop(self, agent) -> None:
        assert agent.stop(timeout=40) == 0, agent.log_text()[-3000:]
        assert self.lab.wait_ns_empty("proxy", 15) == []

    def check_data_path(self, step: Step, tag: str) -> None:
        proxy_v4, _ = self.lab.tailnet_ips(self.agents[-1].socket)
        want = self.second.marker if step.serve["Web"][f"{HOST}:80"]["Handlers"]["/"]["Proxy"].endswith(
            f":{SECOND_PORT}") else self.backend.marker
        url = Lab.url(proxy_v4, 80, f"/?serve-{tag}")
        wait_until(lambda: want in self.lab.curl("client", url, extra=["-H", f"Host: {HOST}"]).stdout, 45, 0.3,
                   f"serve from the client ({tag})")
        for n, svc in step.egress.items():
            port = svc["ports"][0]["matchPort"]
            self.lab.wait_curl("backend", Lab.url(POD_V4, port, f"/?egress-{n}-{tag}"), self.target.marker,
                               timeout=45)
        if step.ingress:
            self.lab.wait_curl("client", Lab.url(VIP4, 8080, f"/?vip4-{tag}"), self.backend.marker, timeout=45)
            if "IPv6Mapping" in step.ingress[INGRESS_SVC]:
                self.lab.wait_curl("client", Lab.url(VIP6, 8080, f"/?vip6-{tag}"), self.backend.marker, timeout=45)

    def clean_run(self) -> None:
        # The first boot registers the node; its Secret is the snapshot every later boot starts from.
        self.write_files(self.steps[0])
        first = self.start()
        kubelab.wait_log(first, STARTUP)
        self.node_id = first.wait_running(30)["Self"]["ID"]
        self.wait_converged(first, self.steps[0])
        routes = {f"{VIP4}/32"} | ({f"{VIP6}/128"} if self.v6 else set())
        self.lab.approve_routes("proxy", sorted(routes))
        wait_until(lambda: proxy_peer_routes(self.lab) == routes, 30, 0.3, "the client routing the VIPs")
        self.stop(first)
        self.snapshot = self.api.secret_data(self.secret) or {}
        log = self.lab.run_dir / f"steady-{self.mode}-points"
        a = self.boot(CB_TEST_CRASH_LOG=str(log))
        assert a.status()["Self"]["ID"] == self.node_id
        self.wait_converged(a, self.steps[0])
        self.steps[0].points = _points(log)
        self.record(a, self.steps[0])
        self.check_data_path(self.steps[0], "clean-boot")
        for step, only in zip(self.steps[1:], ("serve", "egress", "ingress"), strict=True):
            seen = len(_points(log))
            self.write_files(step, only)
            self.wait_converged(a, step)
            step.points = _points(log)[seen:]
            self.record(a, step)
            assert step.rules, f"no rules after the {step.name}"
        self.check_data_path(self.steps[-1], "clean-end")
        self.stop(a)

    def cases(self) -> list[tuple[int, str]]:
        out = []
        for i, step in enumerate(self.steps[1:], 1):
            pts = step.points
            if self.mode == "iptables":
                pts = [p for p in pts if p.startswith("rules-apply:")]
            out += [(i, p) for p in pts]
        if not CRASH_ALL and out:
            # one point, drawn from the run's seed (CB_SEED, printed at the start): each run tries another
            out = [seed.rng(f"agent-crash-steady-{self.mode}").choice(out)]
        return out

    def crash_at(self, i: int, point: str) -> float:
        t0 = time.monotonic()
        log = self.lab.run_dir / f"steady-{self.mode}-crash-{i}-{point.replace(':', '-')}"
        a = self.boot(CB_TEST_CRASH_AT=point, CB_TEST_CRASH_LOG=str(log))
        self.wait_converged(a, self.steps[0])
        # (The boot's writes run concurrently, so their order varies; how many of each kind does not.)
        assert sorted(_points(log)) == sorted(self.steps[0].points), \
            f"{point}: this boot's writes differ from the clean one's: {_points(log)} {self.steps[0].points}"
        for step, only in zip(self.steps[1:i], ("serve", "egress", "ingress"), strict=False):
            self.write_files(step, only)
            self.wait_converged(a, step)
        self.write_files(self.steps[i], ("serve", "egress", "ingress")[i - 1])
        assert a.wait_exit(60) != 0, f"{point}: the agent did not stop there"
        assert _points(log)[-1] == point, (point, _points(log)[-5:])
        self.lab.kill_ns_leftovers("proxy")           # the container dies with it: tailscaled too
        data = self.api.secret_data(self.secret) or {}
        assert secretstate.is_consistent(data), f"{point}: {sorted(data)}"
        for key in (EGRESS_KEY, INGRESS_KEY, "device_ips"):
            if key in data:
                json.loads(data[key])                  # whole, never half-written

        step = self.steps[i]
        again = self.start()                           # the files as they stand
        kubelab.wait_log(again, STARTUP)
        st = again.wait_running(30)
        assert st["Self"]["ID"] == self.node_id, f"{point}: a new node"
        nodes = kubelab.hs_nodes_named(self.lab, "proxy")
        assert [str(n["id"]) for n in nodes] == [self.node_id], f"{point}: {nodes}"
        self.wait_converged(again, step)
        got = _normalized_rules(lx.own_rules(self.lab, self.mode))
        assert got == step.rules, f"{point}: rules differ from the clean run's:\n{got}\n--- want ---\n{step.rules}"
        assert self.secret_doc(EGRESS_KEY) == step.egress_status, point
        assert self.secret_doc(INGRESS_KEY) == step.ingress_status, point
        assert self.serve_config(again) == step.serve_config, point
        data = self.api.secret_data(self.secret) or {}
        assert secretstate.is_consistent(data), point
        assert data.get("device_id", b"").decode() == self.node_id, point
        self.check_data_path(step, f"{self.mode}-{i}-{point}")
        self.stop(again)
        return round(time.monotonic() - t0, 1)


@pytest.fixture(scope="module")
def servers(lab):
    second = lab.start_http_server("backend", BACKEND_V4, SECOND_PORT, f"steady-second-{lab.prefix}")
    target = lab.start_http_server("client", ("0.0.0.0", "::"), TARGET_PORT, f"steady-target-{lab.prefix}")
    yield second, target
    for srv in (second, target):
        srv.proc.terminate()
        srv.proc.wait(10)


@pytest.mark.parametrize("mode", ["nftables", "iptables"] if CRASH_ALL else ["nftables"])
def test_kill_at_each_write_of_a_config_change_then_restart(lab, lab_backend, servers, mode) -> None:
    if kubelab.hs_nodes_named(lab, "proxy"):
        lab.delete_node("proxy")
    second, target = servers
    sc = Scenario(lab, lab_backend, second, target, None, mode)
    sc.api = kubelab.KubeAPI.start(lab, f"steady-{mode}", secrets=[sc.secret])
    try:
        t0 = time.monotonic()
        sc.clean_run()
        print(f"crash points after boot ({mode}): " + "; ".join(f"{s.name}: {s.points}" for s in sc.steps[1:]))
        for s in sc.steps[1:]:
            assert s.points, f"the {s.name} wrote nothing"
        assert any(p.startswith("serve-apply:") for p in sc.steps[1].points), sc.steps[1].points
        assert any(p.startswith("rules-apply:") for p in sc.steps[2].points), sc.steps[2].points
        assert any(p.startswith("secret-write:") for p in sc.steps[2].points), sc.steps[2].points
        timings = {"clean": round(time.monotonic() - t0, 1)}
        for i, point in sc.cases():
            timings[f"{sc.steps[i].name} {point}"] = sc.crash_at(i, point)
        print(f"crash points after boot ({mode}), seconds each: {timings}")
    finally:
        problems = lab.reset_proxy(sc.agents, ["proxy"])
        sc.api.stop()
        if problems:
            print("test_agent_crash_steady teardown:", "; ".join(problems))


# ------------------------------------------------------------------------------------------------ reissue

def _write_config(d: Path, key: str, server: str) -> None:
    """The operator's config file for one-step mode (cap-107.hujson), rewritten atomically."""
    conf = {"Version": "alpha0", "Locked": False, "ServerURL": server, "Hostname": "proxy", "AcceptDNS": False,
            "AcceptRoutes": False, "AuthKey": key}
    tmp = d / ".cap-107.tmp"
    tmp.write_text(json.dumps(conf))
    os.replace(tmp, d / "cap-107.hujson")


def test_reissue_killed_before_request_and_clear_then_restart(lab, lab_backend) -> None:
    if kubelab.hs_nodes_named(lab, "proxy"):
        lab.delete_node("proxy")
    secret = "ts-reissue"
    api = kubelab.KubeAPI.start(lab, "reissue", secrets=[secret])
    d = lab.run_dir / "reissue-config"
    d.mkdir()
    env = {"TS_KUBE_SECRET": secret, "POD_UID": POD_UID, "TS_EXPERIMENTAL_VERSIONED_CONFIG_DIR": str(d),
           "TS_DEST_IP": lab.backend_ipv4}
    drop = ("TS_STATE_DIR", "TS_AUTHKEY", "TS_EXTRA_ARGS", "TS_HOSTNAME")
    agents: list = []
    minted: list[str] = []

    def mint() -> str:
        minted.append(lab.preauth_key(reusable=False, expiration="1h", tags=["tag:k8s"]))
        return minted[-1]

    def start(**extra: str):
        a = kubelab.start_pod_agent(lab, api, {**env, **extra}, drop=drop)
        agents.append(a)
        return a

    def logged_in() -> str:
        a = start()
        kubelab.wait_log(a, STARTUP)
        me = a.wait_running(30)["Self"]["ID"]
        lab.wait_curl("client", lab.url(a.tailnet_ips()[0], 8080, "/?reissue"), lab_backend.marker, timeout=60)
        assert a.stop(timeout=40) == 0 and lab.wait_ns_empty("proxy", 15) == []
        return me

    def operator_answers() -> None:
        """What the controller does on a reissue request: delete the device the Secret names, mint a key."""
        wait_until(lambda: "reissue_authkey" in (api.secret_data(secret) or {}), 60, 0.3, "the reissue request")
        data = api.secret_data(secret) or {}
        dev = data.get("device_id", b"").decode()
        for n in kubelab.hs_nodes_named(lab, "proxy"):
            if str(n["id"]) == dev:
                lab.hs("nodes", "delete", "--identifier", dev, "--force")
        _write_config(d, mint(), lab.login_server)

    try:
        _write_config(d, mint(), lab.login_server)
        old = logged_in()
        timings = {}
        for point in ("reissue-request:1", "reissue-clear:1") if CRASH_ALL else ("reissue-clear:1",):
            t0 = time.monotonic()
            # The node's key expires at headscale: tailscaled needs a new login, and the used key is refused.
            lab.hs("nodes", "expire", "--identifier", old)
            a = start(CB_TEST_CRASH_AT=point)
            if point == "reissue-clear:1":
                operator_answers()
            assert a.wait_exit(90) != 0, f"{point}: the agent did not stop there:\n{a.log_text()[-3000:]}"
            lab.kill_ns_leftovers("proxy")
            data = api.secret_data(secret) or {}
            assert secretstate.is_consistent(data), (point, sorted(data))
            if point == "reissue-request:1":
                assert "reissue_authkey" not in data, point
                # The next run asks (no rate limit from a request that never went out); the operator answers.
                b = start()
                b.wait_for_log("Requesting a new auth key from operator", 90)
                operator_answers()
                assert b.wait_exit(60) == 0, b.log_text()[-3000:]      # "restarting to apply"
                lab.kill_ns_leftovers("proxy")
            new = logged_in()
            nodes = kubelab.hs_nodes_named(lab, "proxy")
            assert [str(n["id"]) for n in nodes] == [new] and new != old, (point, old, new, nodes)
            data = api.secret_data(secret) or {}
            assert "reissue_authkey" not in data and data.get("device_id", b"").decode() == new, (point, sorted(data))
            # (headscale lists a key by its public prefix, hskey-auth-<prefix>-***)
            keys = [k for k in lab.hs("preauthkeys", "list") or []
                    if any(m[len("hskey-auth-"):][:12] in str(k.get("key", "")) for m in minted)]
            assert len(keys) == len(minted) and all(k.get("used") for k in keys), (point, keys)
            old = new
            timings[point] = round(time.monotonic() - t0, 1)
        print(f"reissue crash points, seconds each: {timings}")
    finally:
        problems = lab.reset_proxy(agents, ["proxy"])
        api.stop()
        if problems:
            print("test_agent_crash_steady teardown:", "; ".join(problems))
