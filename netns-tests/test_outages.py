"""Outages longer than a retry, with real headscale, tailscaled and the kernel: the data path keeps working where
it does not need the failing part, /status says what is failing, and everything recovers without a restart.

* headscale down: the client reaches the backend through the proxy throughout (WireGuard between known peers
  needs no control plane; each probe is a new TCP connection through the tunnel that carries established
  ones too); the proxy stays ready; after headscale returns, the proxy's node is online at headscale again.
  Measured: the data path's longest gap, the time to recover.
  /status carries tailscaled's health warnings (`tailscaled_health`) when tailscaled raises them.
* DNS down for a TS_EXPERIMENTAL_DEST_DNS_NAME target: the last good backends keep serving, the target's
  last_error in /status names the failure, and it clears when DNS answers again.

OUTAGE_SECONDS (default 20) sets the outage length; `make outages` runs them with 300 (five minutes). The figures
are printed (pytest -s shows them) and written to $CB_OUTAGE_REPORT when set; nothing asserts on how fast.
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

import labextras as lx
from labtools.lab import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(1800)]

OUTAGE = float(os.environ.get("OUTAGE_SECONDS", "20"))
STATUS_PORT = 9002
DNS_NAME = "web.outage.test"
DNS_V4 = "10.98.0.54"


def _report(name: str, figures: dict) -> None:
    line = json.dumps({"outage": name, "seconds": OUTAGE, **figures})
    print(line)
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
        return max((b - a for a, b in zip(oks, oks[1:])), default=end - start)


def _status(lab) -> dict:
    cp = lab.curl("proxy", f"http://127.0.0.1:{STATUS_PORT}/status", 3)
    return json.loads(cp.stdout) if cp.returncode == 0 else {}


def _headscale(lab):
    return next(p for p in lab._procs if p.kind == "headscale" and p.proc.poll() is None)


def test_headscale_down(lab, lab_backend, start_agent) -> None:
    agent = start_agent({"TS_DEST_IP": lab.backend_ipv4, "TS_LOCAL_ADDR_PORT": f"127.0.0.1:{STATUS_PORT}",
                         "TS_ENABLE_HEALTH_CHECK": "true"})
    agent.wait_for_log("Startup complete", 60)
    proxy_v4, _ = agent.tailnet_ips()
    url = lab.url(proxy_v4, 8080, "/?outage")
    lab.wait_curl("client", url, lab_backend.marker, timeout=60)
    probe = Probe(lab, url, lab_backend.marker)
    try:
        time.sleep(2)
        hs = _headscale(lab)
        t_down = time.monotonic()
        hs.proc.terminate()
        hs.proc.wait(15)
        warned: list[str] = []
        ready_during: list[object] = []
        tailscaled_says: list[str] = []
        while time.monotonic() < t_down + OUTAGE:
            st = _status(lab)
            ready_during.append(st.get("ready"))
            warned += [w["code"] for w in st.get("tailscaled_health") or []]
            own = json.loads(agent.ts("status", "--json", check=False).stdout or "{}").get("Health") or []
            tailscaled_says += own
            time.sleep(1)
        t_up = time.monotonic()
        lab._start_headscale()
        t_back = time.monotonic()

        def online() -> bool:
            node = lab.hs_node("proxy") or {}
            return bool(node.get("online"))
        wait_until(online, 120 + OUTAGE, 0.5, "the proxy online at headscale again")
        recovered = time.monotonic() - t_back

        def warning_gone() -> bool:
            return not {w["code"] for w in _status(lab).get("tailscaled_health") or []} & set(warned)
        wait_until(warning_gone, 120, 0.5, "tailscaled's warning gone from /status")
        status_recovered = time.monotonic() - t_back
        time.sleep(2)
        results = probe.stop()
    finally:
        probe.stop()
    gap = Probe.longest_gap(results, t_down, t_up)
    _report("headscale", {"data_path_gap_s": round(gap, 2), "probes": len(results),
                          "failed_probes": sum(1 for _, ok in results if not ok),
                          "recovery_s": round(recovered, 2), "status_recovery_s": round(status_recovered, 2),
                          "health_codes": sorted(set(warned)),
                          "tailscaled_status_health": sorted(set(tailscaled_says))[:3]})
    assert all(ok for t, ok in results if t_down <= t <= t_up), "new connections failed during the outage"
    assert all(r is True for r in ready_during), f"the proxy became unready: {ready_during}"
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
    time.sleep(3)
    baseline = target_errors()          # e.g. the name has no AAAA record: said before the outage too
    probe = Probe(lab, url, lab_backend.marker)
    try:
        t_down = time.monotonic()
        dns.stop()                                    # nothing answers on port 53 any more
        errors: list[str] = []
        while time.monotonic() < t_down + OUTAGE:
            errors += sorted(target_errors() - baseline)
            time.sleep(1)
        t_up = time.monotonic()
        restarted = lx.start_dnsmasq(lab, "backend", (DNS_V4,), {DNS_NAME: [lab.backend_ipv4]}, ttl=2,
                                     local_domains=("outage.test",), tag="dns-outage")
        dns.proc = restarted.proc                     # stopped by the fixture

        def cleared() -> bool:
            return bool(_status(lab)) and target_errors() == baseline
        wait_until(cleared, 60 + OUTAGE, 0.5, "the DNS error cleared in /status")
        recovered = time.monotonic() - t_up
        results = probe.stop()
    finally:
        probe.stop()
    gap = Probe.longest_gap(results, t_down, t_up)
    _report("dns", {"data_path_gap_s": round(gap, 2), "probes": len(results),
                    "failed_probes": sum(1 for _, ok in results if not ok), "recovery_s": round(recovered, 2),
                    "errors_seen": sorted(set(errors))[:3]})
    assert all(ok for t, ok in results if t_down <= t <= t_up), "the last good backend stopped serving"
    assert errors, "/status never reported the DNS failure"

