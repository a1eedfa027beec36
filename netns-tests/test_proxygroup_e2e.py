"""ProxyGroup egress and ingress *services* end to end: real headscale, real tailscaled, the test Kubernetes
API server, our agent run like a ProxyGroup Pod (kubelab.start_pod_agent), real kernel rules, both firewall
backends (the module fixture is parametrized over TS_DEBUG_FIREWALL_MODE; every test runs for each).

One agent per firewall mode serves every scenario, so the file stays quick (about a minute). Its
configuration is what the operator gives a ProxyGroup Pod:

* TS_EGRESS_PROXIES_CONFIG_PATH: a directory laid out like a kubelet ConfigMap volume (``..<timestamp>/``
  with the files, a ``..data`` symlink to it and ``egress-services -> ..data/egress-services``), rewritten
  the way kubelet does it (new directory, ``..data_tmp`` symlink renamed over ``..data``);
* TS_INGRESS_PROXIES_CONFIG_PATH: ``ingress-config.json`` in another such directory;
* TS_ROUTES: the Tailscale Service VIPs (approved in headscale, so the client routes them to the proxy);
* POD_IPS: the proxy's cluster-side addresses (eth1, 10.98.0.1 / fd98::1); TS_LOCAL_ADDR_PORT on the IPv4 one.

The `backend` namespace plays the cluster: its workload connects to the proxy's cluster-side address on a
service's matchPort, and an HTTP server on the lab's `client` node (port 8091 on all addresses) is the
tailnet target; it logs the source address it sees.

Scenarios (in file order, sharing the agent):
1. egress service by tailnet IP (one service per family) reaches the client, SNATed to the proxy's tailnet IP;
   the same port reached from the tailnet (tailscale0) is not captured;
2. egress service by MagicDNS name (both families through one matchPort, a second port, and UDP);
3. the Secret's ``egress-services`` status is exactly the expected document (a service whose name does not
   resolve is absent, and its matchPort is not forwarded); the rules are in the requested backend only;
4. rewriting the config to drop a service removes its rules (connection refused) and its status entry while
   the others keep working; writing it back restores both; moving a service to another matchPort moves the
   rule; a broken file is reported and the last good configuration (rules and status) stays;
5. ingress service: the client reaches http://<VIP>:8080 (both families) and gets the backend's page; the
   Secret's ``ingress-config.json`` is exactly the expected document; removing the service stops the
   forwarding and its record, restoring it brings both back;
6. the pre-shutdown hook answers 200 on TS_LOCAL_ADDR_PORT: after the ~10 s settle time with services
   configured (none has a healthCheckEndpoint), at once with none (then the status says ``"services": null``);
7. SIGTERM: exit 0, nothing left in the proxy namespace, none of the agent's rules left in either backend.
Then upstream's containerboot, same configuration, as a reference for the two documents' format.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import kubelab
import labextras as lx
import pytest

from labtools.lab import BACKEND_LINK_PROXY_V4, BACKEND_LINK_PROXY_V6, BACKEND_V4, BACKEND_V6, Lab, wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(300)]

MODES = ("nftables", "iptables")
STARTUP = "Startup complete, waiting for shutdown signal"
SECRET = "ts-pg-0"
POD_UID = "5d1c0b7a-2f3e-4a59-8c6d-7e8f9a0b1c2d"
TARGET_PORT = 8091          # the client node's HTTP server (test_egress_e2e uses 8081 for its own)
BACKEND_PORT = 8080         # lab_backend, the ingress service's "ClusterIP" backend
LOCAL_PORT = 9002           # TS_LOCAL_ADDR_PORT (pre-shutdown hook)
POD_V4, POD_V6 = BACKEND_LINK_PROXY_V4, BACKEND_LINK_PROXY_V6
VIP4 = "100.100.1.1"
VIP6 = "fd7a:115c:a1e0:ab12:4843:cd96:6264:101"
SVC_IP4, SVC_IP6, SVC_FQDN, SVC_GHOST = "svc-ip4", "svc-ip6", "svc-fqdn", "svc-ghost"
PORT_IP4, PORT_IP6, PORT_FQDN, PORT_FQDN2, PORT_GHOST = 10001, 10002, 10003, 10013, 10004
INGRESS_SVC = "svc:web"
EGRESS_KEY, INGRESS_KEY = "egress-services", "ingress-config.json"
PRESHUTDOWN = "/internal-egress-services-preshutdown"

_tags = itertools.count(1)


# ------------------------------------------------------------------------------------------------ helpers

class ConfigMapDir:
    """A directory laid out and updated like a kubelet ConfigMap volume (atomic ``..data`` symlink swap)."""

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True, exist_ok=False)
        self._seq = 0

    def write(self, files: dict[str, str]) -> None:
        self._seq += 1
        ts = f"..2026_01_01_00_00_{self._seq:02d}.{os.getpid()}"
        d = self.path / ts
        d.mkdir()
        for name, text in files.items():
            (d / name).write_text(text)
        data = self.path / "..data"
        old = os.readlink(data) if data.is_symlink() else None
        tmp = self.path / "..data_tmp"
        os.symlink(ts, tmp)
        os.replace(tmp, data)               # the atomic switch
        for name in files:
            link = self.path / name
            if not link.is_symlink():
                os.symlink(f"..data/{name}", link)
        if old:
            shutil.rmtree(self.path / old, ignore_errors=True)


@dataclass
class PG:
    """The shared scenario: one agent as a ProxyGroup Pod, its API server, configs and expectations."""
    lab: Lab
    mode: str
    api: kubelab.KubeAPI
    agent: object
    egress_dir: ConfigMapDir
    ingress_dir: ConfigMapDir
    srv: object                              # the client node's HTTP server (the tailnet target)
    backend: object                          # lab_backend (the ingress service's backend)
    client_v4: str
    client_v6: str | None
    fqdn: str
    proxy_v4: str
    proxy_v6: str | None
    egress_cfg: dict = field(default_factory=dict)
    ingress_cfg: dict = field(default_factory=dict)

    @property
    def v6(self) -> bool:
        return bool(self.lab.ipv6 and self.client_v6 and self.proxy_v6)

    def write_egress(self, cfg: dict) -> None:
        self.egress_dir.write({EGRESS_KEY: json.dumps(cfg, indent=1)})


def port(proto: str, match: int, target: int = TARGET_PORT) -> dict:
    return {"protocol": proto, "matchPort": match, "targetPort": target}


def egress_config(client_v4: str, client_v6: str | None, fqdn: str) -> dict:
    cfg = {
        SVC_IP4: {"tailnetTarget": {"ip": client_v4, "fqdn": ""}, "ports": [port("TCP", PORT_IP4)],
                  "healthCheckEndpoint": ""},
        SVC_FQDN: {"tailnetTarget": {"ip": "", "fqdn": fqdn},
                   "ports": [port("TCP", PORT_FQDN), port("TCP", PORT_FQDN2), port("UDP", PORT_FQDN)],
                   "healthCheckEndpoint": ""},
        SVC_GHOST: {"tailnetTarget": {"ip": "", "fqdn": f"no-such-node.{fqdn.split('.', 1)[1]}"},
                    "ports": [port("TCP", PORT_GHOST)], "healthCheckEndpoint": ""},
    }
    if client_v6:
        cfg[SVC_IP6] = {"tailnetTarget": {"ip": client_v6, "fqdn": ""}, "ports": [port("TCP", PORT_IP6)],
                        "healthCheckEndpoint": ""}
    return cfg


def ingress_config(v6: bool) -> dict:
    mapping = {"IPv4Mapping": {"TailscaleServiceIP": VIP4, "ClusterIP": BACKEND_V4}}
    if v6:
        mapping["IPv6Mapping"] = {"TailscaleServiceIP": VIP6, "ClusterIP": BACKEND_V6}
    return {INGRESS_SVC: mapping}


def expected_egress_status(pg: PG, cfg: dict) -> dict:
    """The Secret's egress-services document for `cfg`: every service whose target resolves, with the
    target addresses it uses (both families of the client for the MagicDNS name)."""
    services = {}
    for name, c in cfg.items():
        tt = c["tailnetTarget"]
        if tt["ip"]:
            if ":" in tt["ip"] and not pg.v6:
                continue  # the proxy cannot forward to it: not recorded
            ips = [tt["ip"]]
        elif tt["fqdn"] == pg.fqdn:
            ips = [pg.client_v4] + ([pg.client_v6] if pg.v6 else [])
        else:
            continue  # does not resolve: not recorded
        services[name] = {"ports": c["ports"], "tailnetTargetIPs": ips, "tailnetTarget": tt}
    doc = {"podIPv4": POD_V4}
    if pg.lab.ipv6:
        doc["podIPv6"] = POD_V6
    doc["services"] = services or None
    return normalized(doc)


def expected_ingress_status(pg: PG) -> dict:
    doc = {"configs": pg.ingress_cfg, "podIPv4": POD_V4}
    if pg.lab.ipv6:
        doc["podIPv6"] = POD_V6
    return doc


def normalized(doc):
    """Port lists are sets (upstream marshals a Go map): compare them sorted, everything else exactly."""
    if not isinstance(doc, dict):
        return doc
    doc = json.loads(json.dumps(doc))
    for svc in (doc.get("services") or {}).values():
        if isinstance(svc, dict) and isinstance(svc.get("ports"), list):
            svc["ports"] = sorted(svc["ports"], key=lambda p: (p.get("protocol"), p.get("matchPort"),
                                                              p.get("targetPort")))
    return doc


def secret_json(api: kubelab.KubeAPI, key: str):
    data = api.secret_data(SECRET) or {}
    raw = data.get(key)
    return None if raw is None else json.loads(raw)


def wait_status(api: kubelab.KubeAPI, key: str, want: dict, timeout: float = 30.0, what: str = "") -> None:
    last: list = ["<never read>"]

    def ok() -> bool:
        got = secret_json(api, key)
        last[0] = got
        return normalized(got) == want
    try:
        wait_until(ok, timeout, 0.3, f"Secret key {key} {what}")
    except TimeoutError:
        raise AssertionError(f"Secret key {key!r} {what}: after {timeout}s it is\n{json.dumps(last[0], indent=1)}\n"
                             f"expected\n{json.dumps(want, indent=1)}") from None


def egress_url(version: int, match_port: int, tag: str) -> str:
    return Lab.url(POD_V4 if version == 4 else POD_V6, match_port, f"/?{tag}")


def check_egress(pg: PG, version: int, match_port: int, target: str, timeout: float = 30.0) -> None:
    """From the cluster workload to the proxy's cluster-side address on matchPort: the client's server answers
    and sees the proxy's tailnet address of that family as the source, its own tailnet address as the
    destination."""
    tag = f"pg-{pg.mode}-{match_port}-{version}-{next(_tags)}"
    body = pg.lab.wait_curl("backend", egress_url(version, match_port, tag), pg.srv.marker, timeout=timeout)
    assert body.startswith(pg.srv.marker)
    seen = [r for r in pg.lab.http_peer_log(pg.srv) if tag in r["path"]]
    assert seen, f"the target's server logged no request for {tag}"
    proxy_ip = pg.proxy_v4 if version == 4 else pg.proxy_v6
    assert {r["peer"] for r in seen} == {proxy_ip}, f"not SNATed to the proxy's tailnet address: {seen}"
    assert {r["local"] for r in seen} == {target}, f"not DNATed to {target}: {seen}"


def curl_code(lab: Lab, ns: str, url: str, timeout: float = 3.0) -> int:
    return lab.curl(ns, url, timeout).returncode


def wait_refused(pg: PG, version: int, match_port: int, timeout: float = 20.0) -> None:
    """The matchPort is no longer forwarded: the proxy itself answers with a RST (curl exit 7)."""
    url = egress_url(version, match_port, "refused")
    last = [None]

    def refused() -> bool:
        cp = pg.lab.curl("backend", url, 3)
        last[0] = (cp.returncode, cp.stdout[-200:], cp.stderr[-200:])
        return cp.returncode == 7 and pg.srv.marker not in cp.stdout
    try:
        wait_until(refused, timeout, 0.3, f"{url} refused")
    except TimeoutError:
        raise AssertionError(f"{url} is still forwarded (or not refused) after {timeout}s: {last[0]}") from None


def all_own_rules(lab: Lab) -> dict[str, str]:
    """The agent's rules in the proxy namespace per backend ("" = none): its nftables tables, and its CB-*
    iptables chains whichever iptables flavour holds them (iptables-nft ones show in `nft list ruleset`;
    `iptables-save` itself cannot be used, it fails on tailscaled's native nftables rules)."""
    ruleset = lab.exec("proxy", ["nft", "list", "ruleset"], check=True).stdout
    cb = [ln.strip() for ln in ruleset.splitlines() if "CB-" in ln]
    for tool in ("iptables-legacy-save", "ip6tables-legacy-save"):
        if shutil.which(tool):
            cb += [ln for ln in lab.exec("proxy", [tool]).stdout.splitlines() if "CB-" in ln]
    return {"nftables": lx.own_rules(lab, "nftables"), "iptables": "\n".join(cb)}


def proxy_peer_routes(lab: Lab) -> set[str]:
    for p in (lab.status("client").get("Peer") or {}).values():
        if p.get("HostName") == "proxy":
            return set(p.get("PrimaryRoutes") or ())
    return set()


def hook(lab: Lab, timeout: float = 40.0) -> subprocess.Popen:
    """GET the pre-shutdown hook from the backend namespace (as kubelet would, on the Pod IP), in the background;
    stdout ends with a line holding the HTTP status."""
    argv = ["ip", "netns", "exec", lab.netns("backend"), "curl", "-sS", "--noproxy", "*", "-m", str(timeout),
            "-o", "-", "-w", "\n%{http_code}", Lab.url(POD_V4, LOCAL_PORT, PRESHUTDOWN)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def hook_result(p: subprocess.Popen, timeout: float = 45.0) -> tuple[int, str]:
    out, err = p.communicate(timeout=timeout)
    body, _, code = out.rpartition("\n")
    assert p.returncode == 0, f"curl of the pre-shutdown hook failed ({p.returncode}): {err}"
    return int(code), body


UDP_ECHO = """
import socket, sys, threading
def serve(fam, addr):
    s = socket.socket(fam, socket.SOCK_DGRAM)
    if fam == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((addr, int(sys.argv[1])))
    while True:
        data, peer = s.recvfrom(2048)
        s.sendto(b"udp-ok " + peer[0].encode(), peer)
threading.Thread(target=serve, args=(socket.AF_INET6, "::"), daemon=True).start()
serve(socket.AF_INET, "0.0.0.0")
"""

UDP_PING = """
import socket, sys
fam = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(fam, socket.SOCK_DGRAM)
s.settimeout(1)
for _ in range(8):
    s.sendto(b"ping", (sys.argv[1], int(sys.argv[2])))
    try:
        print(s.recvfrom(2048)[0].decode())
        break
    except socket.timeout:
        pass
else:
    sys.exit(1)
"""


def check_udp(pg: PG, version: int, match_port: int) -> None:
    """A UDP exchange from the workload through a UDP port map: the echo server on the client saw the proxy's
    tailnet address as the source."""
    dst = POD_V4 if version == 4 else POD_V6
    cp = pg.lab.exec("backend", [sys.executable, "-I", "-c", UDP_PING, dst, str(match_port)], timeout=15)
    proxy_ip = pg.proxy_v4 if version == 4 else pg.proxy_v6
    assert cp.returncode == 0 and cp.stdout.strip() == f"udp-ok {proxy_ip}", \
        f"UDP {dst}:{match_port} -> no echo or wrong source: {cp.returncode} {cp.stdout!r} {cp.stderr[-500:]}"


# ------------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def client_target(lab):
    """An HTTP server on the lab's client node, on every address (so on its tailnet addresses too), and a UDP
    echo server on the same port number."""
    srv = lab.start_http_server("client", ("0.0.0.0", "::"), TARGET_PORT, f"pg-client-ok-{lab.prefix}")
    d = lab.run_dir / "http" / f"client-udp-{TARGET_PORT}"
    d.mkdir(parents=True, exist_ok=True)
    # _popen: the lab's teardown stops it too
    udp = lab._popen("http", f"udp-echo-{TARGET_PORT}", "client", [sys.executable, "-I", "-c", UDP_ECHO,
                     str(TARGET_PORT)], lab._base_env(d), d / "server.log")
    yield srv
    udp.terminate()
    udp.wait(10)


@contextlib.contextmanager
def proxygroup(lab, lab_backend, client_target, name: str, mode: str, agent_cmd=None, api_port: int = 6443):
    """Start an agent (ours, or `agent_cmd`) as a ProxyGroup Pod with the scenario's configs; yield a PG.
    Afterwards the agent is stopped and the proxy namespace, its node and the API server are cleaned up."""
    if kubelab.hs_nodes_named(lab, "proxy"):
        lab.delete_node("proxy")
    client_v4, client_v6 = lab.tailnet_ips("client")
    client_v6 = client_v6 if lab.ipv6 else None
    fqdn = lx.magicdns_name(lab, "client")
    root = lab.run_dir / f"proxygroup-{name}"
    egress_dir, ingress_dir = ConfigMapDir(root / "egress"), ConfigMapDir(root / "ingress")
    ecfg = egress_config(client_v4, client_v6, fqdn)
    icfg = ingress_config(lab.ipv6)
    egress_dir.write({EGRESS_KEY: json.dumps(ecfg, indent=1)})
    ingress_dir.write({INGRESS_KEY: json.dumps(icfg, indent=1)})
    routes = [f"{VIP4}/32"] + ([f"{VIP6}/128"] if lab.ipv6 else [])
    env = {
        "TS_KUBE_SECRET": SECRET, "POD_UID": POD_UID,
        "POD_IPS": POD_V4 + (f",{POD_V6}" if lab.ipv6 else ""),
        "TS_EGRESS_PROXIES_CONFIG_PATH": str(egress_dir.path),
        "TS_INGRESS_PROXIES_CONFIG_PATH": str(ingress_dir.path / INGRESS_KEY),
        "TS_ROUTES": ",".join(routes),
        "TS_LOCAL_ADDR_PORT": f"{POD_V4}:{LOCAL_PORT}",
        "TS_DEBUG_FIREWALL_MODE": mode,
    }
    api = kubelab.KubeAPI.start(lab, f"proxygroup-{name}", port=api_port, secrets=[SECRET])
    agent = None
    try:
        agent = kubelab.start_pod_agent(lab, api, env, agent_cmd)
        kubelab.wait_log(agent, STARTUP, timeout=120)
        agent.wait_running(30)
        proxy_v4, proxy_v6 = agent.tailnet_ips()
        yield PG(lab, mode, api, agent, egress_dir, ingress_dir, client_target, lab_backend, client_v4, client_v6,
                 fqdn, proxy_v4, proxy_v6, ecfg, icfg)
    finally:
        problems = lab.reset_proxy([agent] if agent is not None else [], ["proxy"])
        api.stop()
        if problems:
            print("test_proxygroup_e2e teardown:", "; ".join(problems))


@pytest.fixture(scope="module", params=MODES)
def pg(request, lab, lab_backend, client_target):
    with proxygroup(lab, lab_backend, client_target, request.param, request.param) as p:
        yield p


def _alive(pg: PG) -> None:
    if not pg.agent.running():
        pytest.fail(f"the agent exited ({pg.agent.returncode}):\n{pg.agent.log_text()[-3000:]}")


# ------------------------------------------------------------------------------------------------ 1-3 egress

def test_egress_service_by_tailnet_ip(pg):
    _alive(pg)
    # Status first: it is written once the rules are in, so traffic can be checked right after.
    wait_status(pg.api, EGRESS_KEY, expected_egress_status(pg, pg.egress_cfg), 45, "after start")
    check_egress(pg, 4, PORT_IP4, pg.client_v4)
    # Traffic that arrives from the tailnet (tailscale0) on a matchPort is not a service's: the proxy itself
    # refuses it (were it captured, it would hairpin back to the client's server and succeed).
    assert curl_code(pg.lab, "client", Lab.url(pg.proxy_v4, PORT_IP4, "/?from-tailnet")) == 7
    # The lab always has IPv6 (island and tailnet): without it the IPv6 service would go unchecked.
    assert pg.v6, f"no tailnet IPv6 on the client ({pg.client_v6}) or the proxy ({pg.proxy_v6})"
    check_egress(pg, 6, PORT_IP6, pg.client_v6)


def test_egress_service_by_magicdns_name(pg):
    _alive(pg)
    check_egress(pg, 4, PORT_FQDN, pg.client_v4)
    check_egress(pg, 4, PORT_FQDN2, pg.client_v4)
    if pg.v6:
        check_egress(pg, 6, PORT_FQDN, pg.client_v6)
    check_udp(pg, 4, PORT_FQDN)             # the service's UDP port map
    if pg.v6:
        check_udp(pg, 6, PORT_FQDN)
    # A service by IP of one family does not catch the other family's traffic on its port.
    if pg.v6:
        assert curl_code(pg.lab, "backend", egress_url(6, PORT_IP4, "wrong-family")) == 7


def test_egress_status_and_unresolvable_service(pg):
    _alive(pg)
    want = expected_egress_status(pg, pg.egress_cfg)
    assert SVC_GHOST not in want["services"] and SVC_FQDN in want["services"]
    wait_status(pg.api, EGRESS_KEY, want, 10, "(exact document)")
    # the unresolvable service's port is not forwarded, and the agent said why
    assert curl_code(pg.lab, "backend", egress_url(4, PORT_GHOST, "ghost")) == 7
    assert re.search(rf"{SVC_GHOST}\b.*could not find", pg.agent.log_text()), \
        f"the agent did not report the unresolvable service:\n{pg.agent.log_text()[-3000:]}"
    # the rules live in the backend this mode asked for, and only there
    rules = all_own_rules(pg.lab)
    assert rules[pg.mode], f"no {pg.mode} rules of the agent's own"
    other = next(m for m in MODES if m != pg.mode)
    assert rules[other] == "", f"{other} rules while running with {pg.mode}:\n{rules[other]}"


# ------------------------------------------------------------------------------------------------ 4 config edits

def test_config_edit_removes_and_restores_a_service(pg):
    _alive(pg)
    full = pg.egress_cfg
    without = {k: v for k, v in full.items() if k != SVC_IP4}
    try:
        pg.write_egress(without)
        wait_status(pg.api, EGRESS_KEY, expected_egress_status(pg, without), 20, f"without {SVC_IP4}")
        wait_refused(pg, 4, PORT_IP4)
        check_egress(pg, 4, PORT_FQDN, pg.client_v4, timeout=10)     # the others keep working
        if pg.v6:
            check_egress(pg, 6, PORT_IP6, pg.client_v6, timeout=10)
    finally:
        pg.write_egress(full)
    wait_status(pg.api, EGRESS_KEY, expected_egress_status(pg, full), 20, f"with {SVC_IP4} back")
    check_egress(pg, 4, PORT_IP4, pg.client_v4, timeout=20)
    _alive(pg)


def test_config_edit_moves_a_port_and_survives_a_broken_file(pg):
    _alive(pg)
    full = pg.egress_cfg
    moved = json.loads(json.dumps(full))
    moved[SVC_IP4]["ports"] = [port("TCP", PORT_IP4 + 10)]
    broken_line = "egress services: egress-services is not valid JSON"
    try:
        # The same service on another matchPort: the old port is no longer forwarded, the new one is.
        pg.write_egress(moved)
        wait_status(pg.api, EGRESS_KEY, expected_egress_status(pg, moved), 20, "with the port moved")
        wait_refused(pg, 4, PORT_IP4)
        check_egress(pg, 4, PORT_IP4 + 10, pg.client_v4, timeout=10)
        # A broken file is reported and the last good configuration stays in force (rules and status).
        before = pg.agent.log_text().count(broken_line)
        pg.egress_dir.write({EGRESS_KEY: '{"svc-ip4": {"tailnetTarget": '})
        wait_until(lambda: pg.agent.log_text().count(broken_line) > before, 15, 0.2, "the broken file reported")
        check_egress(pg, 4, PORT_IP4 + 10, pg.client_v4, timeout=10)
        check_egress(pg, 4, PORT_FQDN, pg.client_v4, timeout=10)
        assert normalized(secret_json(pg.api, EGRESS_KEY)) == expected_egress_status(pg, moved)
    finally:
        pg.write_egress(full)
    wait_status(pg.api, EGRESS_KEY, expected_egress_status(pg, full), 20, "restored")
    wait_refused(pg, 4, PORT_IP4 + 10)
    check_egress(pg, 4, PORT_IP4, pg.client_v4, timeout=20)
    _alive(pg)


# ------------------------------------------------------------------------------------------------ 5 ingress

def test_ingress_service_vip(pg):
    _alive(pg)
    wait_status(pg.api, INGRESS_KEY, expected_ingress_status(pg), 30)
    routes = {f"{VIP4}/32"} | ({f"{VIP6}/128"} if pg.lab.ipv6 else set())
    pg.lab.approve_routes("proxy", sorted(routes))
    wait_until(lambda: proxy_peer_routes(pg.lab) == routes, 30, 0.3, "the client routing the VIPs to the proxy")
    marker = pg.backend.marker
    body = pg.lab.wait_curl("client", Lab.url(VIP4, BACKEND_PORT, f"/?vip4-{pg.mode}"), marker, timeout=45)
    assert body.startswith(marker)
    if pg.lab.ipv6:
        body = pg.lab.wait_curl("client", Lab.url(VIP6, BACKEND_PORT, f"/?vip6-{pg.mode}"), marker, timeout=30)
        assert body.startswith(marker)
    # egress services are untouched by the ingress traffic, and vice versa
    check_egress(pg, 4, PORT_FQDN, pg.client_v4, timeout=10)
    wait_status(pg.api, INGRESS_KEY, expected_ingress_status(pg), 5, "(exact document)")

    # The service removed from the ingress config: its VIP is no longer forwarded and its record is gone.
    try:
        pg.ingress_dir.write({INGRESS_KEY: "{}"})
        empty = {"podIPv4": POD_V4, **({"podIPv6": POD_V6} if pg.lab.ipv6 else {})}
        wait_status(pg.api, INGRESS_KEY, empty, 20, "with no ingress service")
        url = Lab.url(VIP4, BACKEND_PORT, f"/?vip4-gone-{pg.mode}")
        wait_until(lambda: marker not in pg.lab.curl("client", url, 2).stdout, 10, 0.3, "the VIP not forwarded")
    finally:
        pg.ingress_dir.write({INGRESS_KEY: json.dumps(pg.ingress_cfg)})
    wait_status(pg.api, INGRESS_KEY, expected_ingress_status(pg), 20, "restored")
    pg.lab.wait_curl("client", Lab.url(VIP4, BACKEND_PORT, f"/?vip4-back-{pg.mode}"), marker, timeout=20)


# ------------------------------------------------------------------------------------------------ 6 pre-shutdown

def test_preshutdown_hook(pg):
    _alive(pg)
    settle_line = "waiting 10s for connections in flight"
    before = pg.agent.log_text().count(settle_line)
    t0 = time.monotonic()
    slow = hook(pg.lab)
    try:
        # The hook has read the config (services, none with a healthCheckEndpoint) once it logs the settle wait.
        wait_until(lambda: pg.agent.log_text().count(settle_line) > before, 10, 0.1, "the hook's settle wait")
        # Meanwhile: no services at all -> "services": null in the status, and the hook answers at once.
        pg.write_egress({})
        want_empty = expected_egress_status(pg, {})
        assert want_empty["services"] is None
        wait_status(pg.api, EGRESS_KEY, want_empty, 20, "with no services")
        # "safe to terminate" is the answer of a hook that found nothing to drain and so did not wait
        code, body = hook_result(hook(pg.lab, 10), 15)
        assert (code, body) == (200, "safe to terminate"), (code, body)
        wait_refused(pg, 4, PORT_FQDN)
    finally:
        pg.write_egress(pg.egress_cfg)
    try:
        code, body = hook_result(slow)
    finally:
        if slow.poll() is None:
            slow.kill()
            slow.wait(5)
    elapsed = time.monotonic() - t0
    assert code == 200, (code, body)
    # it logged the settle wait above and answered only after it (a lower bound: load can only lengthen it)
    assert elapsed >= 9, f"the hook with services answered after {elapsed:.1f}s, before the 10 s settle"
    wait_status(pg.api, EGRESS_KEY, expected_egress_status(pg, pg.egress_cfg), 20, "restored")
    check_egress(pg, 4, PORT_FQDN, pg.client_v4, timeout=20)


# ------------------------------------------------------------------------------------------------ 7 shutdown

def test_sigterm_leaves_no_rules(pg):
    _alive(pg)
    assert all_own_rules(pg.lab)[pg.mode], "nothing installed before the shutdown: the check would prove nothing"
    assert pg.agent.stop(timeout=40) == 0, pg.agent.log_text()[-3000:]
    assert pg.lab.wait_ns_empty("proxy", 15) == [], "processes left in the proxy namespace after SIGTERM"
    left = all_own_rules(pg.lab)
    assert left == {m: "" for m in MODES}, f"the agent's rules are left behind after SIGTERM: {left}"
    ruleset = pg.lab.exec("proxy", ["nft", "list", "ruleset"], check=True).stdout
    assert "containerboot" not in ruleset and "CB-" not in ruleset, ruleset


# ------------------------------------------------------------------------------------------------ reference

def test_upstream_reference_documents(lab, lab_backend, client_target):
    """Upstream containerboot v1.102.3, same Pod configuration (nftables): it writes the same two documents,
    except that it also records the service whose name does not resolve (with ``"tailnetTargetIPs": null``,
    so the operator routes that service to a Pod that drops its traffic) -- the difference our agent makes on
    purpose. This anchors the expected documents above to the reference implementation.

    Runs after the module's own agents (pytest orders the parametrized module fixture's tests first; the
    namespace check below guards that) and uses its own API server port."""
    assert lab.ns_pids("proxy") == [], "another agent still runs in the proxy namespace"
    with proxygroup(lab, lab_backend, client_target, "upstream", "nftables", [str(lab.bin_dir / "containerboot")],
                    api_port=6444) as up:
        want = expected_egress_status(up, up.egress_cfg)
        ghost = up.egress_cfg[SVC_GHOST]
        want["services"][SVC_GHOST] = {"ports": ghost["ports"], "tailnetTargetIPs": None,
                                       "tailnetTarget": ghost["tailnetTarget"]}
        wait_status(up.api, EGRESS_KEY, normalized(want), 45, "written by upstream")
        wait_status(up.api, INGRESS_KEY, expected_ingress_status(up), 20, "written by upstream")
        check_egress(up, 4, PORT_IP4, up.client_v4)
        check_egress(up, 4, PORT_FQDN, up.client_v4)
        if up.v6:
            check_egress(up, 6, PORT_FQDN, up.client_v6)
