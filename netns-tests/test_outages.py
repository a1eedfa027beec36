"""Outages longer than a retry, with real headscale, tailscaled and the kernel: the data path keeps working where
it does not need the failing part, /status says what is failing, and everything recovers without a restart.

In every case the client reaches the backend through the proxy throughout, with a new TCP connection every
0.25 s and one connection opened before the outage and used (an echo every 0.25 s) until after it, never
broken.

* headscale down: WireGuard between known peers needs no control plane; the proxy stays ready; /status's
  `control_plane` says the control server is unreachable during the outage and reachable after it (the agent
  checks it: tailscaled raises no health warning about it); after headscale returns, the proxy's node is
  online at headscale again. /status also carries tailscaled's health warnings (`tailscaled_health`) when
  tailscaled raises them.
* DNS down for a TS_EXPERIMENTAL_DEST_DNS_NAME target: the last good backends keep serving, the target's
  last_error in /status names the failure, and it clears when DNS answers again.
* The Kubernetes API server down (a real kube-apiserver, labtools.kubecluster, holding the agent's state Secret
  and tailscaled's state): the data path does not use it; the proxy stays ready; /status's `kubernetes_api`
  says it is unreachable and which Secret keys wait to be written; a device rename made during the outage (a
  Secret write the agent owes) lands in the Secret after the API server returns, without a restart.
  The controller's API-server outage is in test_controller_apiserver.py (its controller and cluster).

Measured: the data path's longest gap, the time until /status shows the outage, the times to recover.

OUTAGE_SECONDS (default 20) sets the outage length; `make outages` runs them with 300 (five minutes). When each
outage starts is drawn from the run's seed (CB_SEED, printed with the figures): up to 5 s more of traffic before
it, so that from run to run it falls at another point of the agent's 5-second checks; `CB_SEED=<n>` replays a
run's timing. The figures are printed (pytest -s shows them), written to $CB_OUTAGE_REPORT when set and, with
BENCH_RECORD=1 (`make outages` sets it), as their rows of bench/results/outages.json (bench/runs.py); nothing
asserts on how fast.
"""
from __future__ import annotations

import base64
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import kubelab
import labextras as lx
import pytest
from needs import unavailable

from bench import runs
from containerboot.dns import MAX_BACKOFF
from labtools.lab import wait_until
from tests.support import seed

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(1800)]

OUTAGE = float(os.environ.get("OUTAGE_SECONDS", "20"))
STATUS_PORT = 9002
DNS_NAME = "web.outage.test"
DNS_V4 = "10.98.0.54"


_ONSETS: dict[str, float] = {}


def onset(name: str) -> float:
    """The extra seconds of traffic before this outage starts, drawn from the run's seed (printed, so that a
    failure's timing can be replayed with CB_SEED)."""
    extra = _ONSETS[name] = round(seed.rng(f"outage-onset-{name}").uniform(0.0, 5.0), 2)
    print(f"outage {name}: starts {extra} s later than the earliest (CB_SEED={seed.run_seed()})")
    return extra


def _report(name: str, figures: dict) -> None:
    report = {"outage": name, "seconds": OUTAGE, "seed": seed.run_seed(), "onset_s": _ONSETS.get(name), **figures}
    line = json.dumps(report)
    print(line)
    runs.record_outage(report)      # with BENCH_RECORD=1 (make outages): its row of bench/results/outages.json
    if path := os.environ.get("CB_OUTAGE_REPORT"):
        with open(path, "a") as f:
            f.write(line + "\n")


class Probe:
    """curl through the proxy every 0.25 s from the client (a new connection each time); records (time, ok)."""

    def __init__(self, lab, url: str, marker: str) -> None:
        self.lab, self.url, self.marker = lab, url, marker
        self.results: list[tuple[float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            cp = self.lab.curl("client", self.url, 2)
            self.results.append((t, cp.returncode == 0 and self.marker in cp.stdout))
            self._stop.wait(max(0.0, 0.25 - (time.monotonic() - t)))

    def oks_since(self, t: float) -> int:
        return sum(1 for at, ok in list(self.results) if ok and at >= t)

    def stop(self) -> list[tuple[float, bool]]:
        self._stop.set()
        self._thread.join(10)
        return self.results

    @staticmethod
    def longest_gap(results: list[tuple[float, bool]], start: float, end: float) -> float:
        """Longest time between two successes within [start, end] (0: every probe worked)."""
        oks = [t for t, ok in results if ok and start - 1 <= t <= end + 1]
        fails = [t for t, ok in results if not ok and start <= t <= end]
        if not fails:
            return 0.0
        return max((b - a for a, b in zip(oks, oks[1:], strict=False)), default=end - start)


def _status(lab) -> dict:
    cp = lab.curl("proxy", f"http://127.0.0.1:{STATUS_PORT}/status", 3)
    return json.loads(cp.stdout) if cp.returncode == 0 else {}


HELD_PORT = 9011


def _held(lab, proxy_v4: str, tag: str) -> lx.HeldConnection:
    return lx.HeldConnection.start(lab, "backend", "client", proxy_v4, HELD_PORT, tag=tag)


def _served_since(probe: Probe, held: lx.HeldConnection, t: float, what: str, n: int = 4) -> None:
    """Wait until `n` new connections and `n` echoes of the held one have worked since `t` (monotonic): the
    figures have their samples on that side of the outage (the gap is measured between two successes)."""
    wait_until(lambda: probe.oks_since(t) >= n and sum(1 for at, ok in held.results() if ok and at >= t) >= n,
               60, 0.25, f"the data path measured {what}")


def _wait_status(lab, pred, timeout: float, what: str) -> dict:
    """Poll /status until pred(status) holds; that status."""
    return wait_until(lambda: (lambda st: st if pred(st) else None)(_status(lab)), timeout, 0.25, what)


def _reachable(part: str):
    return lambda st: (st.get(part) or {}).get("reachable") is True


def _unreachable(part: str):
    return lambda st: (st.get(part) or {}).get("reachable") is False


def _headscale(lab):
    return next(p for p in lab._procs if p.kind == "headscale" and p.proc.poll() is None)


def test_headscale_down(lab, lab_backend, start_agent) -> None:
    agent = start_agent({"TS_DEST_IP": lab.backend_ipv4, "TS_LOCAL_ADDR_PORT": f"127.0.0.1:{STATUS_PORT}",
                         "TS_ENABLE_HEALTH_CHECK": "true"})
    agent.wait_for_log("Startup complete", 60)
    proxy_v4, _ = agent.tailnet_ips()
    url = lab.url(proxy_v4, 8080, "/?outage")
    lab.wait_curl("client", url, lab_backend.marker, timeout=60)
    _wait_status(lab, _reachable("control_plane"), 60, "the control server reachable in /status")
    held = _held(lab, proxy_v4, "held-headscale")
    probe = Probe(lab, url, lab_backend.marker)
    try:
        _served_since(probe, held, time.monotonic(), "before the outage")
        time.sleep(onset("headscale"))  # not a wait: the extra traffic before the outage, drawn from CB_SEED
        hs = _headscale(lab)
        t_down = time.monotonic()
        hs.proc.terminate()
        hs.proc.wait(15)
        warned: list[str] = []
        ready_during: list[object] = []
        tailscaled_says: list[str] = []
        control_down: list[dict] = []
        shown_after: float | None = None
        # The outage lasts OUTAGE seconds, and at least until /status has shown it (bounded: the agent checks
        # every 5 to 15 s).
        while time.monotonic() < t_down + OUTAGE or (not control_down and time.monotonic() < t_down + 60):
            st = _status(lab)
            ready_during.append(st.get("ready"))
            warned += [w["code"] for w in st.get("tailscaled_health") or []]
            if _unreachable("control_plane")(st):
                control_down.append(st["control_plane"])
                if shown_after is None:
                    shown_after = time.monotonic() - t_down
            own = json.loads(agent.ts("status", "--json", check=False).stdout or "{}").get("Health") or []
            tailscaled_says += own
            time.sleep(1)   # not a wait: /status sampled once a second for as long as the outage lasts
        t_up = time.monotonic()
        lab._start_headscale()
        t_back = time.monotonic()

        # Each recovery timed on its own: the node online at headscale, the control server reachable in /status,
        # tailscaled's warnings (if it raised any) gone from /status.
        done: dict[str, float] = {}
        def recovered_all() -> bool:
            node = lab.hs_node("proxy") or {}
            st = _status(lab)
            for what, ok in (("online", bool(node.get("online"))),
                             ("status", _reachable("control_plane")(st)),
                             ("warnings", bool(st) and not {w["code"] for w in st.get("tailscaled_health") or []}
                              & set(warned))):
                if ok and what not in done:
                    done[what] = time.monotonic() - t_back
            return len(done) == 3
        wait_until(recovered_all, 120 + OUTAGE, 0.25, "the proxy online at headscale again, /status recovered")
        recovered, status_recovered = done["online"], done["status"]
        _served_since(probe, held, t_back, "after the outage")
        results = probe.stop()
        held_broken, held_gap = held.broken(), held.longest_gap(t_down, t_up)
    finally:
        probe.stop()
        held.stop()
    gap = Probe.longest_gap(results, t_down, t_up)
    _report("headscale", {"data_path_gap_s": round(gap, 2), "probes": len(results),
                          "failed_probes": sum(1 for _, ok in results if not ok),
                          "held_connection_gap_s": round(held_gap, 2),
                          "recovery_s": round(recovered, 2), "status_recovery_s": round(status_recovered, 2),
                          "status_shown_after_s": round(shown_after, 2) if shown_after is not None else None,
                          "control_plane_error": control_down[-1]["last_error"] if control_down else "",
                          "health_codes": sorted(set(warned)),
                          "tailscaled_status_health": sorted(set(tailscaled_says))[:3]})
    assert all(ok for t, ok in results if t_down <= t <= t_up), "new connections failed during the outage"
    assert held_broken == "", f"the connection held across the outage broke: {held_broken}"
    assert all(r is True for r in ready_during), f"the proxy became unready: {ready_during}"
    assert control_down, "/status never said the control server was unreachable"
    assert control_down[-1]["target"].startswith("http") and "key" in control_down[-1]["last_error"]
    said = [line for line in agent.log_text().splitlines() if "control server (" in line]
    assert len(said) == 2 and "unreachable" in said[0] and "reachable again" in said[1], said
    # /status carries what tailscaled says. tailscaled raises its warning about the control plane only after a
    # while (none within the suite's 20 s; see docs/reliability.md for the five-minute run).
    if tailscaled_says:
        assert warned, f"tailscaled warned ({tailscaled_says[:2]}) but /status did not carry it"
    assert not {w["code"] for w in _status(lab).get("tailscaled_health") or []} & set(warned), \
        "the warning stayed after recovery"


@pytest.fixture
def dns(lab, lab_backend):
    lx.add_address(lab, "backend", "eth0", f"{DNS_V4}/24")
    srv = lx.start_dnsmasq(lab, "backend", (DNS_V4,), {DNS_NAME: [lab.backend_ipv4]}, ttl=2,
                           local_domains=("outage.test",), tag="dns-outage")
    old = lx.set_resolv_conf(lab, "proxy", f"nameserver {DNS_V4}\noptions timeout:1 attempts:1\n")
    try:
        yield srv
    finally:
        lx.set_resolv_conf(lab, "proxy", old)
        srv.stop()
        lx.del_address(lab, "backend", "eth0", f"{DNS_V4}/24")


def test_dns_down_for_a_dns_name_target(lab, lab_backend, start_agent, dns) -> None:
    agent = start_agent({"TS_EXPERIMENTAL_DEST_DNS_NAME": DNS_NAME,
                         "TS_LOCAL_ADDR_PORT": f"127.0.0.1:{STATUS_PORT}",
                         "TS_ENABLE_HEALTH_CHECK": "true"})
    agent.wait_for_log("Startup complete", 60)
    proxy_v4, _ = agent.tailnet_ips()
    url = lab.url(proxy_v4, 8080, "/?dns-outage")
    lab.wait_curl("client", url, lab_backend.marker, timeout=60)
    def target_errors() -> set[str]:
        return {t["last_error"] for t in _status(lab).get("targets") or [] if t.get("last_error")}

    def lookups() -> float:
        counters = _status(lab).get("counters") or {}
        return sum(v for k, v in counters.items() if k.startswith("containerboot_dns_resolutions_total"))
    # One more lookup of the name (TTL 2 s) after the data path worked: what it says before the outage is said.
    before = lookups()
    wait_until(lambda: lookups() > before, 60, 0.25, "another lookup of the name")
    baseline = target_errors()          # e.g. the name has no AAAA record: said before the outage too
    held = _held(lab, proxy_v4, "held-dns")
    probe = Probe(lab, url, lab_backend.marker)
    try:
        time.sleep(onset("dns"))  # not a wait: the extra traffic before the outage, drawn from CB_SEED
        t_down = time.monotonic()
        dns.stop()                                    # nothing answers on port 53 any more
        errors: list[str] = []
        while time.monotonic() < t_down + OUTAGE:
            errors += sorted(target_errors() - baseline)
            time.sleep(1)   # not a wait: /status sampled once a second for as long as the outage lasts
        t_up = time.monotonic()
        restarted = lx.start_dnsmasq(lab, "backend", (DNS_V4,), {DNS_NAME: [lab.backend_ipv4]}, ttl=2,
                                     local_domains=("outage.test",), tag="dns-outage")
        dns.proc = restarted.proc                     # stopped by the fixture

        def cleared() -> bool:
            return bool(_status(lab)) and target_errors() == baseline
        # The resolver's backoff stops at a minute (docs/agent.md): the end of the outage is seen within it.
        wait_until(cleared, MAX_BACKOFF + 15, 0.5, "the DNS error cleared in /status within the backoff's cap")
        recovered = time.monotonic() - t_up
        results = probe.stop()
        held_broken, held_gap = held.broken(), held.longest_gap(t_down, t_up)
    finally:
        probe.stop()
        held.stop()
    gap = Probe.longest_gap(results, t_down, t_up)
    _report("dns", {"data_path_gap_s": round(gap, 2), "probes": len(results),
                    "failed_probes": sum(1 for _, ok in results if not ok),
                    "held_connection_gap_s": round(held_gap, 2), "recovery_s": round(recovered, 2),
                    "errors_seen": sorted(set(errors))[:3]})
    assert all(ok for t, ok in results if t_down <= t <= t_up), "the last good backend stopped serving"
    assert held_broken == "", f"the connection held across the outage broke: {held_broken}"
    assert errors, "/status never reported the DNS failure"



# -- the Kubernetes API server down ------------------------------------------------------------------------------

KUBE_NS = "outage"
SECRET = "outage-proxy"


@dataclass
class _SADir:
    """What kubelab.start_pod_agent needs of an API server: the ServiceAccount dir and the Pod's environment."""
    dir: Path
    host: str
    port: str

    def env(self) -> dict[str, str]:
        return {"KUBERNETES_SERVICE_HOST": self.host, "KUBERNETES_SERVICE_PORT_HTTPS": self.port,
                "KUBERNETES_SERVICE_PORT": self.port, "TS_KUBERNETES_READ_API_SERVER_ADDRESS_FROM_ENV": "true"}


@pytest.fixture
def realkube(lab):
    """A real control plane in the lab (10.99.0.50:6443 on the island, reachable from the proxy namespace), a
    ServiceAccount allowed what the agent needs on its state Secret, and its token mounted as a Pod's."""
    from labtools.kubecluster import ClusterError, KubeCluster
    try:
        kc = KubeCluster.start(lab=lab)
    except ClusterError as e:
        if "missing" in str(e) or "no Go toolchain" in str(e):
            unavailable(f"the Kubernetes binaries are not built here: {e}")
        raise
    try:
        kc.apply([
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUBE_NS}},
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "proxy", "namespace": KUBE_NS}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "proxy", "namespace": KUBE_NS},
             "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
                       {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [SECRET],
                        "verbs": ["get", "update", "patch"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "proxy", "namespace": KUBE_NS},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "proxy"},
             "subjects": [{"kind": "ServiceAccount", "name": "proxy", "namespace": KUBE_NS}]}])
        d = lab.run_dir / "outage-sa"
        d.mkdir(exist_ok=True)
        (d / "ca.crt").write_bytes(kc.ca_cert.read_bytes())
        (d / "token").write_text(kc.service_account_token(KUBE_NS, "proxy"))
        (d / "namespace").write_text(KUBE_NS)
        u = urlsplit(kc.server)
        yield kc, _SADir(d, str(u.hostname), str(u.port))
    finally:
        kc.close()


def _kill_apiserver(kc) -> None:
    """The API server gone at once (SIGKILL): on SIGTERM kube-apiserver drains its long requests (watches) for
    about 20 s here, still answering meanwhile."""
    kc.procs["kube-apiserver"].proc.kill()
    kc.stop_component("kube-apiserver")


def _secret(kc) -> dict[str, bytes]:
    code, body = kc.request("GET", f"/api/v1/namespaces/{KUBE_NS}/secrets/{SECRET}", timeout=5)
    if code != 200:
        return {}
    return {k: base64.b64decode(v) for k, v in (body.get("data") or {}).items()}


def test_apiserver_down(lab, lab_backend, realkube) -> None:
    kc, sa = realkube
    if kubelab.hs_nodes_named(lab, "proxy"):
        lab.delete_node("proxy")
    agent = kubelab.start_pod_agent(lab, sa, {  # type: ignore[arg-type]
        "TS_KUBE_SECRET": SECRET, "TS_DEST_IP": lab.backend_ipv4,
        "TS_LOCAL_ADDR_PORT": f"127.0.0.1:{STATUS_PORT}", "TS_ENABLE_HEALTH_CHECK": "true"})
    held: lx.HeldConnection | None = None
    probe: Probe | None = None
    try:
        agent.wait_for_log("Startup complete", 90)
        proxy_v4, _ = agent.tailnet_ips()
        url = lab.url(proxy_v4, 8080, "/?apiserver-outage")
        lab.wait_curl("client", url, lab_backend.marker, timeout=60)
        node = lab.hs_node("proxy")
        assert node is not None
        fqdn = _secret(kc).get("device_fqdn", b"").decode()
        assert fqdn.startswith("proxy."), fqdn
        _wait_status(lab, _reachable("kubernetes_api"), 60, "the API server reachable in /status")
        held = _held(lab, proxy_v4, "held-apiserver")
        probe = Probe(lab, url, lab_backend.marker)
        _served_since(probe, held, time.monotonic(), "before the outage")
        time.sleep(onset("apiserver"))  # not a wait: the extra traffic before the outage, drawn from CB_SEED

        lines_before = len(agent.log_text().splitlines())
        t_down = time.monotonic()
        _kill_apiserver(kc)
        stopped = time.monotonic() - t_down
        # A change the agent must write to the Secret meanwhile: the device's new name.
        lab.hs("nodes", "rename", "--identifier", str(node["id"]), "proxy-renamed")
        ready_during: list[object] = []
        down_seen: list[dict] = []
        shown_after: float | None = None
        while time.monotonic() < t_down + OUTAGE or (
                not any("device_fqdn" in d["pending_writes"] for d in down_seen) and time.monotonic() < t_down + 60):
            st = _status(lab)
            ready_during.append(st.get("ready"))
            if _unreachable("kubernetes_api")(st):
                down_seen.append(st["kubernetes_api"])
                if shown_after is None:
                    shown_after = time.monotonic() - t_down
            time.sleep(1)   # not a wait: /status sampled once a second for as long as the outage lasts
        t_up = time.monotonic()
        outage_log = agent.log_text().splitlines()[lines_before:]
        apiserver_start = kc.restart_apiserver(0)
        t_back = time.monotonic()
        wait_until(lambda: _secret(kc).get("device_fqdn", b"").startswith(b"proxy-renamed."), 120, 0.25,
                   "the renamed device's FQDN in the Secret")
        write_landed = time.monotonic() - t_back
        st = _wait_status(lab, lambda s: _reachable("kubernetes_api")(s) and
                          not s["kubernetes_api"]["pending_writes"], 60, "the API server reachable in /status")
        status_recovered = time.monotonic() - t_back
        _served_since(probe, held, t_back, "after the outage")
        results = probe.stop()
        held_broken, held_gap = held.broken(), held.longest_gap(t_down, t_up)
        alive = agent.proc.poll() is None
    finally:
        if probe is not None:
            probe.stop()
        if held is not None:
            held.stop()
        problems = lab.reset_proxy([agent], ["proxy"])
        if problems:
            print("test_apiserver_down teardown:", "; ".join(problems))
    gap = Probe.longest_gap(results, t_down, t_up)
    _report("apiserver", {"data_path_gap_s": round(gap, 2), "probes": len(results),
                          "failed_probes": sum(1 for _, ok in results if not ok),
                          "held_connection_gap_s": round(held_gap, 2),
                          "status_shown_after_s": round(shown_after, 2) if shown_after is not None else None,
                          "apiserver_start_s": round(apiserver_start, 2),
                          "secret_write_landed_s": round(write_landed, 2),
                          "status_recovery_s": round(status_recovered, 2),
                          "kubernetes_api_error": down_seen[-1]["last_error"] if down_seen else "",
                          "apiserver_stop_s": round(stopped, 2),
                          "agent_log_lines_during_outage": len(outage_log)})
    print("\n".join(outage_log))
    assert all(ok for t, ok in results if t_down <= t <= t_up), "new connections failed during the outage"
    assert held_broken == "", f"the connection held across the outage broke: {held_broken}"
    assert all(r is True for r in ready_during), f"the proxy became unready: {ready_during}"
    assert down_seen, "/status never said the API server was unreachable"
    assert any("device_fqdn" in d["pending_writes"] for d in down_seen), down_seen[-1]
    assert "readyz" in down_seen[-1]["last_error"] or "secrets" in down_seen[-1]["last_error"], down_seen[-1]
    log = agent.log_text()
    assert alive and log.count("Startup complete") == 1, "the agent exited or started over"
    said = [line for line in log.splitlines() if "Kubernetes API server (" in line]
    assert len(said) == 2 and "unreachable" in said[0] and "reachable again" in said[1], said
