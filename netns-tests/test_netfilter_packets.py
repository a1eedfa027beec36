"""Real packets through the agent's firewall rules, for every operation, both backends, both families.

Each test builds three fresh namespaces (see `nettopo.ProxyLab`):

    tailnet (tn0) ==== (tailscale0) proxy (eth1) ==== (be0) backend

installs a `netfilter.model.RuleSet` in the proxy namespace through `python -m netfilter.cli`
(exactly the code path the agent uses: `open_backend(mode).apply(rules)`), and then checks
what a user would see: which server a connection reaches, which source address that server
sees, which ports are left alone. Servers answer with a JSON report naming the node, the
local address/port they were reached on, the peer address, and the TCP MSS in effect.

Neither the tailnet nor the backend namespace has a route to the other side, so replies only
come back when the proxy translates addresses, as in a real Pod.

tailscaled normally marks packets that arrive on tailscale0 and masquerades them on the way
out (spec §2.9, [E19]); ingress (O1/O2/O6) depends on that. The tests emulate those rules
(`ts-forward` / `ts-postrouting`, in the firewall flavour matching the backend under test) and
check that the agent coexists with them and never removes them.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from nettopo import ProxyLab

from netfilter.model import Dnat, EgressForward, PortMatch, RuleSet, ServiceDnat, ServicePortMap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# "iptables" lets the backend pick the flavour (here: the plain `iptables`, nf_tables based);
# "iptables-legacy" forces x_tables, which is what the official image's iptables symlinks use.
BACKENDS = ("nftables", "iptables", "iptables-legacy")
# Overridable only to check the harness itself against a stand-in implementation.
CLI_MODULE = os.environ.get("PTEST_NETFILTER_CLI", "netfilter.cli")
FAMILIES = (4, 6)

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

# Ports used by the servers.
WEB = 8080          # generic TCP service on every node
DNS = 5353          # generic UDP service on every node
WG_PORT = 41641     # tailscaled's UDP port: exempt from egress capture
AGENT_PORT = 9002   # the agent's own HTTP port (health/metrics): exempt from egress capture
PROXY_ONLY = 7777   # a port only the proxy itself listens on
# Source port for checks made BEFORE rules are applied. It lies outside the ephemeral range, so
# later connections never reuse the 5-tuple: conntrack keeps the (un-NATed) binding of a flow, and
# a later SYN on the same tuple would be treated as a retransmission of the old, untranslated flow.
PRECHECK_SPORT = 21001

# tailscaled's own base rules (spec §2.9), reduced to what ingress depends on: mark what arrives on
# tailscale0 in FORWARD, masquerade marked packets in POSTROUTING. Installed in the same firewall
# flavour that tailscaled would use next to each backend, before the agent runs (tailscaled starts
# first), so the tests also check that the agent coexists with them and never removes them.
def _tailscaled_nft(fam: str) -> str:
    return f"""
table {fam} filter {{
    chain ts-forward {{
        iifname "tailscale0" meta mark set meta mark & 0xff00ffff | 0x40000
    }}
    chain FORWARD {{
        type filter hook forward priority filter; policy accept;
        jump ts-forward
    }}
}}
table {fam} nat {{
    chain ts-postrouting {{
        meta mark & 0xff0000 == 0x40000 masquerade
    }}
    chain POSTROUTING {{
        type nat hook postrouting priority srcnat; policy accept;
        jump ts-postrouting
    }}
}}
"""


TAILSCALED_IPTABLES = """*filter
:ts-forward - [0:0]
-A FORWARD -j ts-forward
-A ts-forward -i tailscale0 -j MARK --set-xmark 0x40000/0xff0000
COMMIT
*nat
:ts-postrouting - [0:0]
-A POSTROUTING -j ts-postrouting
-A ts-postrouting -m mark --mark 0x40000/0xff0000 -j MASQUERADE
COMMIT
"""

# Which iptables tools hold tailscaled's rules for each backend under test.
IPT_TOOLS = {"iptables": ("iptables", "ip6tables"), "iptables-legacy": ("iptables-legacy", "ip6tables-legacy")}


def install_tailscaled_emulation(lab: ProxyLab, backend: str) -> None:
    t = lab.topo
    if backend == "nftables":
        t.run(lab.proxy, "nft", "-f", "-", input=_tailscaled_nft("ip") + _tailscaled_nft("ip6"))
        return
    for tool in IPT_TOOLS[backend]:
        t.run(lab.proxy, f"{tool}-restore", "--noflush", input=TAILSCALED_IPTABLES)


def tailscaled_emulation_intact(lab: ProxyLab, backend: str) -> list[str]:
    """Problems with tailscaled's (emulated) rules; empty when they are all still there."""
    t = lab.topo
    problems = []
    if backend == "nftables":
        for fam in ("ip", "ip6"):
            r = t.run(lab.proxy, "nft", "list", "table", fam, "nat", check=False)
            if r.returncode != 0 or "masquerade" not in r.stdout or "jump ts-postrouting" not in r.stdout:
                problems.append(f"{fam} nat: {r.stdout or r.stderr}")
            r = t.run(lab.proxy, "nft", "list", "table", fam, "filter", check=False)
            if r.returncode != 0 or "jump ts-forward" not in r.stdout or "0x00040000" not in r.stdout:
                problems.append(f"{fam} filter: {r.stdout or r.stderr}")
        return problems
    for tool in IPT_TOOLS[backend]:
        dump = t.run(lab.proxy, f"{tool}-save").stdout
        for needle in ("-A POSTROUTING -j ts-postrouting", "-j MASQUERADE", "-A FORWARD -j ts-forward",
                       "-A ts-forward -i tailscale0 -j MARK"):
            if needle not in dump:
                problems.append(f"{tool}: {needle!r} missing")
    return problems


class Agent:
    """Drives the netfilter package inside the proxy namespace via its CLI, like the agent would."""

    def __init__(self, lab: ProxyLab, backend: str, workdir):
        self.lab = lab
        self.mode, _, variant = backend.partition("-")
        self.extra = ["--variant", variant] if variant else []
        self.workdir = workdir
        self.n = 0

    def _cli(self, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, TS_DEBUG_FIREWALL_MODE=self.mode,
                   PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        return self.lab.topo.run(self.lab.proxy, sys.executable, "-m", CLI_MODULE,
                                 "--mode", self.mode, *self.extra, *args, check=False, env=env, cwd=REPO,
                                 timeout=90)

    def apply(self, rules: RuleSet) -> None:
        self.n += 1
        path = self.workdir / f"rules{self.n}.json"
        path.write_text(rules.to_json())
        # Like the agent, which remembers the rule set it applied last.
        prev = ["--previous", str(self.workdir / f"rules{self.n - 1}.json")] if self.n > 1 else []
        r = self._cli("apply", str(path), *prev)
        assert r.returncode == 0, f"apply failed ({self.mode}):\n{r.stdout}\n{r.stderr}"

    def installed(self) -> str:
        r = self._cli("installed")
        assert r.returncode == 0, f"installed failed ({self.mode}):\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def cleanup(self) -> None:
        r = self._cli("cleanup")
        assert r.returncode == 0, f"cleanup failed ({self.mode}):\n{r.stdout}\n{r.stderr}"


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(params=FAMILIES, ids=lambda v: f"ipv{v}")
def family(request) -> int:
    return request.param


@pytest.fixture
def lab(proxy_lab: ProxyLab, backend: str) -> ProxyLab:
    install_tailscaled_emulation(proxy_lab, backend)
    return proxy_lab


@pytest.fixture
def agent(lab, backend, tmp_path) -> Agent:
    a = Agent(lab, backend, tmp_path)
    yield a
    # Leave nothing behind even if the test failed half-way (the namespaces go away anyway).
    a._cli("cleanup")


def one(reports: list[dict]) -> dict:
    assert len(reports) == 1
    return reports[0]


def ok(reports: list[dict]) -> list[dict]:
    errors = [r for r in reports if "error" in r]
    assert not errors, f"{len(errors)}/{len(reports)} connections failed: {errors[:3]}"
    return reports


def host_mss(lab: ProxyLab, version: int) -> int:
    """Largest MSS a path through tailscale0 allows (IPv4: 20+20 header bytes, IPv6: 40+20)."""
    return lab.tun_mtu - (40 if version == 4 else 60)


# --------------------------------------------------------------------------------------------
# O1: ingress to a single IP (TS_DEST_IP)
# --------------------------------------------------------------------------------------------

def test_o1_ingress_dnat_reaches_backend(lab, agent, backend, family):
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.backend, "backend", tcp=[WEB], udp=[DNS])
    t.serve(lab.proxy, "proxy", tcp=[WEB])
    backend_ip = f.backends[0]

    # Before any rule: the tailnet client reaches the proxy's own server.
    assert one(ok(t.connect(lab.tailnet, f.proxy_tailnet, WEB, sport=PRECHECK_SPORT)))["node"] == "proxy"

    agent.apply(RuleSet(dnats=(Dnat(f.proxy_tailnet, (backend_ip,)),), clamp_mss=True))

    rep = one(ok(t.connect(lab.tailnet, f.proxy_tailnet, WEB)))
    assert rep["node"] == "backend"
    assert rep["local"] == backend_ip and rep["lport"] == WEB
    # The backend sees the proxy's cluster address (tailscaled's masquerade, emulated).
    assert rep["peer"] == f.proxy_cluster
    # All protocols are forwarded, not only TCP.
    urep = one(ok(t.connect(lab.tailnet, f.proxy_tailnet, DNS, proto="udp")))
    assert urep["node"] == "backend" and urep["local"] == backend_ip
    assert urep["reply_from"] == f.proxy_tailnet
    assert backend_ip in agent.installed()
    # The iptables flavours program the tables they claim to: legacy x_tables vs the nf_tables one.
    if agent.mode == "iptables":
        save = {"iptables": "iptables-save", "iptables-legacy": "iptables-legacy-save"}[backend]
        if family == 6:
            save = save.replace("iptables", "ip6tables")
        dump = t.run(lab.proxy, save, "-t", "nat").stdout
        assert backend_ip in dump, f"{save} does not show the DNAT rule:\n{dump}"


# --------------------------------------------------------------------------------------------
# O2: ingress to several backends (TS_EXPERIMENTAL_DEST_DNS_NAME)
# --------------------------------------------------------------------------------------------

def test_o2_dnat_spreads_over_all_backends(lab, agent, family):
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.backend, "backend", tcp=[WEB])
    agent.apply(RuleSet(dnats=(Dnat(f.proxy_tailnet, f.backends),), clamp_mss=True))

    n = 30
    reps = ok(t.connect(lab.tailnet, f.proxy_tailnet, WEB, count=n))
    hits = {b: 0 for b in f.backends}
    for r in reps:
        assert r["node"] == "backend"
        assert r["local"] in hits, f"unexpected backend {r['local']}"
        hits[r["local"]] += 1
    assert all(v >= 1 for v in hits.values()), f"not every backend got a connection: {hits}"


# --------------------------------------------------------------------------------------------
# O3: egress to a tailnet target (TS_TAILNET_TARGET_IP)
# --------------------------------------------------------------------------------------------

def egress_rules(f, target: str, clamp: bool = True) -> RuleSet:
    return RuleSet(egress=(EgressForward(target, f.proxy_tailnet,
                                         (PortMatch("udp", WG_PORT), PortMatch("tcp", AGENT_PORT))),),
                   clamp_mss=clamp)


def test_o3_egress_reaches_target_with_snat(lab, agent, family):
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.tailnet, "tailnet", tcp=[WEB, AGENT_PORT], udp=[DNS, WG_PORT])
    t.serve(lab.proxy, "proxy", tcp=[WEB, AGENT_PORT], udp=[WG_PORT])
    target = f.targets[0]
    agent.apply(egress_rules(f, target))

    # A cluster workload talks to the proxy's cluster address and lands on the tailnet target,
    # which sees the proxy's tailnet address as the source.
    rep = one(ok(t.connect(lab.backend, f.proxy_cluster, WEB, src=f.workload)))
    assert rep["node"] == "tailnet"
    assert rep["local"] == target and rep["lport"] == WEB
    assert rep["peer"] == f.proxy_tailnet
    # Any protocol is captured, UDP too.
    urep = one(ok(t.connect(lab.backend, f.proxy_cluster, DNS, proto="udp", src=f.workload)))
    assert urep["node"] == "tailnet" and urep["local"] == target
    assert urep["peer"] == f.proxy_tailnet
    assert urep["reply_from"] == f.proxy_cluster


def test_o3_egress_exemptions(lab, agent, family):
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.tailnet, "tailnet", tcp=[WEB, AGENT_PORT], udp=[DNS, WG_PORT])
    t.serve(lab.proxy, "proxy", tcp=[WEB, AGENT_PORT], udp=[WG_PORT])
    agent.apply(egress_rules(f, f.targets[0]))

    # Control: a non-exempt port is captured (so the checks below can fail).
    assert one(ok(t.connect(lab.backend, f.proxy_cluster, WEB, src=f.workload)))["node"] == "tailnet"
    # tailscaled's UDP port and the agent's HTTP port stay with the proxy.
    wg = one(ok(t.connect(lab.backend, f.proxy_cluster, WG_PORT, proto="udp", src=f.workload)))
    assert wg["node"] == "proxy"
    http = one(ok(t.connect(lab.backend, f.proxy_cluster, AGENT_PORT, src=f.workload)))
    assert http["node"] == "proxy"
    # Traffic arriving on tailscale0 is not captured: a tailnet peer reaches the proxy itself ([E1]).
    rep = one(ok(t.connect(lab.tailnet, f.proxy_tailnet, WEB)))
    assert rep["node"] == "proxy", f"tailnet traffic to the proxy was captured: {rep}"


# --------------------------------------------------------------------------------------------
# O4: Pod IP -> own tailnet IP (forward cluster traffic via ingress)
# --------------------------------------------------------------------------------------------

def test_o4_pod_ip_to_tailnet_ip(lab, agent, family):
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.proxy, "proxy", tcp=[WEB])
    assert one(ok(t.connect(lab.backend, f.proxy_cluster, WEB, src=f.workload,
                            sport=PRECHECK_SPORT)))["local"] == f.proxy_cluster
    agent.apply(RuleSet(dnats=(Dnat(f.proxy_cluster, (f.proxy_tailnet,)),)))
    rep = one(ok(t.connect(lab.backend, f.proxy_cluster, WEB, src=f.workload)))
    assert rep["node"] == "proxy" and rep["local"] == f.proxy_tailnet


# --------------------------------------------------------------------------------------------
# O5: egress services (ProxyGroup): many port maps
# --------------------------------------------------------------------------------------------

def port_map_rules(f, maps: list[tuple[str, str, int, int, str]]) -> RuleSet:
    return RuleSet(port_maps=tuple(ServicePortMap(svc, proto, mp, tp, target, f.proxy_tailnet)
                                   for svc, proto, mp, tp, target in maps), clamp_mss=True)


def test_o5_service_port_maps(lab, agent, family):
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.tailnet, "tailnet", tcp=[5432, WEB, 10001, PROXY_ONLY], udp=[DNS, 5432])
    t.serve(lab.proxy, "proxy", tcp=[10001, PROXY_ONLY])
    maps = [("default-db", "TCP", 10001, 5432, f.targets[0]),
            ("default-web", "tcp", 10002, WEB, f.targets[1]),
            ("default-dns", "UDP", 10003, DNS, f.targets[2]),
            ("default-web2", "tcp", 10004, WEB, f.targets[2])]
    agent.apply(port_map_rules(f, maps))

    for svc, proto, mp, tp, target in maps:
        rep = one(ok(t.connect(lab.backend, f.proxy_cluster, mp, proto=proto.lower(), src=f.workload)))
        assert rep["node"] == "tailnet", (svc, rep)
        assert rep["lport"] == tp, (svc, rep)
        assert rep["local"] == target, (svc, rep)
        assert rep["peer"] == f.proxy_tailnet, (svc, rep)
    # Unmapped ports are not captured.
    assert one(ok(t.connect(lab.backend, f.proxy_cluster, PROXY_ONLY, src=f.workload)))["node"] == "proxy"
    # A mapped port on the wrong protocol is not captured: UDP 10001 has no listener on the
    # proxy (port unreachable), while a wrongly DNATed datagram would get an answer from the
    # tailnet target's UDP 5432.
    wrong = one(t.connect(lab.backend, f.proxy_cluster, 10001, proto="udp", src=f.workload, timeout=1))
    assert "error" in wrong, f"UDP to a TCP-only mapped port was forwarded: {wrong}"
    # Traffic arriving on tailscale0 is not captured by port maps ([E1] in upstream nftables).
    rep = one(ok(t.connect(lab.tailnet, f.proxy_tailnet, 10001)))
    assert rep["node"] == "proxy", f"tailnet traffic to a mapped port was captured: {rep}"


# --------------------------------------------------------------------------------------------
# O6: ingress services (Tailscale Service VIP -> ClusterIP)
# --------------------------------------------------------------------------------------------

VIPS = {4: "100.100.1.1", 6: "fd7a:115c:a1e0::100:1"}


def test_o6_service_vip_to_cluster_ip(lab, agent, family):
    f = lab.fam(family)
    t = lab.topo
    vip = VIPS[family]
    # tailscaled would route the VIP to this proxy over WireGuard; a host route does it here.
    t.route(lab.tailnet, f"{vip}/{32 if family == 4 else 128}", "via", f.proxy_tailnet, "dev", "tn0")
    t.serve(lab.backend, "backend", tcp=[WEB])
    assert "error" in one(t.connect(lab.tailnet, vip, WEB, timeout=1, sport=PRECHECK_SPORT))
    agent.apply(RuleSet(service_dnats=(ServiceDnat("svc:web", vip, f.backends[1]),), clamp_mss=True))
    rep = one(ok(t.connect(lab.tailnet, vip, WEB)))
    assert rep["node"] == "backend" and rep["local"] == f.backends[1]
    assert rep["peer"] == f.proxy_cluster


# --------------------------------------------------------------------------------------------
# MSS clamping
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("clamp", [True, False], ids=["clamp", "noclamp-control"])
def test_mss_clamp(lab, agent, family, clamp):
    """A SYN forwarded towards tailscale0 (MTU 1280) gets its MSS lowered to fit the path.

    The tailnet end of the link has MTU 1500, so without clamping the endpoints agree on a
    1500-byte MSS (the `noclamp-control` case proves the observation is sensitive)."""
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.tailnet, "tailnet", tcp=[WEB])
    t.serve(lab.backend, "backend", tcp=[WEB])
    limit = host_mss(lab, family)
    rules = RuleSet(egress=egress_rules(f, f.targets[0]).egress,
                    dnats=(Dnat(f.proxy_tailnet, (f.backends[0],)),), clamp_mss=clamp)
    agent.apply(rules)
    text = agent.installed()
    has_clamp_rule = bool(re.search(r"(?i)maxseg|TCPMSS", text))
    assert has_clamp_rule == clamp, f"clamp rule presence != {clamp}:\n{text}"

    # Egress: cluster -> proxy -> tailnet. The target's MSS is bounded by what the SYN carried.
    rep = one(ok(t.connect(lab.backend, f.proxy_cluster, WEB, src=f.workload)))
    assert rep["node"] == "tailnet"
    # Ingress: tailnet -> proxy -> backend. The client's MSS is bounded by the SYN-ACK's option.
    irep = one(ok(t.connect(lab.tailnet, f.proxy_tailnet, WEB)))
    assert irep["node"] == "backend"
    if clamp:
        assert rep["mss"] <= limit, f"egress SYN not clamped: target MSS {rep['mss']} > {limit}"
        assert irep["client_mss"] <= limit, f"ingress SYN-ACK not clamped: {irep['client_mss']} > {limit}"
    else:
        assert rep["mss"] > limit and irep["client_mss"] > limit


# --------------------------------------------------------------------------------------------
# Changing a target moves traffic; re-applying is stable; cleanup restores the namespace
# --------------------------------------------------------------------------------------------

def test_changing_ingress_target_moves_traffic(lab, agent, family):
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.backend, "backend", tcp=[WEB])
    old, new = f.backends[0], f.backends[1]
    agent.apply(RuleSet(dnats=(Dnat(f.proxy_tailnet, (old,)),), clamp_mss=True))
    assert one(ok(t.connect(lab.tailnet, f.proxy_tailnet, WEB)))["local"] == old
    agent.apply(RuleSet(dnats=(Dnat(f.proxy_tailnet, (new,)),), clamp_mss=True))
    reps = ok(t.connect(lab.tailnet, f.proxy_tailnet, WEB, count=10))
    assert {r["local"] for r in reps} == {new}, "old backend still reached after the change"
    assert old not in agent.installed()


def test_changing_egress_target_moves_traffic(lab, agent, family):
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.tailnet, "tailnet", tcp=[WEB, 5432])
    old, new = f.targets[0], f.targets[1]
    agent.apply(egress_rules(f, old))
    assert one(ok(t.connect(lab.backend, f.proxy_cluster, WEB, src=f.workload)))["local"] == old
    agent.apply(egress_rules(f, new))
    reps = ok(t.connect(lab.backend, f.proxy_cluster, WEB, count=10, src=f.workload))
    assert {r["local"] for r in reps} == {new}, "old egress target still reached after the change"
    assert all(r["peer"] == f.proxy_tailnet for r in reps)
    assert old not in agent.installed()

    # Same for a service port map: change target and target port.
    agent.apply(port_map_rules(f, [("default-db", "tcp", 10001, 5432, old)]))
    rep = one(ok(t.connect(lab.backend, f.proxy_cluster, 10001, src=f.workload)))
    assert (rep["local"], rep["lport"]) == (old, 5432)
    agent.apply(port_map_rules(f, [("default-db", "tcp", 10001, WEB, new)]))
    reps = ok(t.connect(lab.backend, f.proxy_cluster, 10001, count=10, src=f.workload))
    assert {(r["local"], r["lport"]) for r in reps} == {(new, WEB)}
    assert old not in agent.installed()


def test_reapply_is_stable_and_cleanup_restores(lab, agent, backend, family):
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.tailnet, "tailnet", tcp=[WEB])
    t.serve(lab.proxy, "proxy", tcp=[WEB])
    rules = RuleSet(egress=egress_rules(f, f.targets[0]).egress,
                    port_maps=port_map_rules(f, [("default-db", "tcp", 10001, WEB, f.targets[1])]).port_maps,
                    clamp_mss=True)
    agent.apply(rules)
    first = agent.installed()
    agent.apply(rules)
    agent.apply(rules)
    assert agent.installed() == first, "re-applying the same rule set changed the installed rules"
    assert one(ok(t.connect(lab.backend, f.proxy_cluster, WEB, src=f.workload)))["node"] == "tailnet"

    agent.cleanup()
    # Traffic is no longer captured ...
    assert one(ok(t.connect(lab.backend, f.proxy_cluster, WEB, src=f.workload)))["node"] == "proxy"
    # ... and the rules the agent does not own (tailscaled's, emulated) are untouched.
    assert tailscaled_emulation_intact(lab, backend) == []
    for addr in (f.targets[0], f.targets[1]):
        assert addr not in agent.installed()


def test_changing_egress_target_moves_existing_udp_flow(lab, agent, family):
    """A UDP client that keeps its source port (DNS resolvers, WireGuard, QUIC) must follow a target
    change too. Conntrack remembers the NAT binding of a flow until it times out (30 s unreplied, 120 s
    after replies, refreshed by every packet), so the rules alone do not move such a flow: the old
    target keeps receiving it for as long as the client keeps talking."""
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.tailnet, "tailnet", udp=[DNS])
    old, new = f.targets[0], f.targets[1]
    sport = 40123
    agent.apply(egress_rules(f, old))
    first = one(ok(t.connect(lab.backend, f.proxy_cluster, DNS, proto="udp", src=f.workload, sport=sport)))
    assert first["local"] == old
    agent.apply(egress_rules(f, new))
    after = one(ok(t.connect(lab.backend, f.proxy_cluster, DNS, proto="udp", src=f.workload, sport=sport)))
    assert after["local"] == new, (
        f"UDP flow from port {sport} still goes to the old target {old} after the change to {new}")


def test_removing_port_map_stops_existing_udp_flow(lab, agent, family):
    """Deleting an egress service must stop its traffic, also for a UDP client that keeps its source
    port: otherwise the removed tailnet target stays reachable for as long as the client talks."""
    f = lab.fam(family)
    t = lab.topo
    t.serve(lab.tailnet, "tailnet", udp=[DNS], tcp=[WEB])
    sport = 40124
    keep = ("default-web", "tcp", 10002, WEB, f.targets[1])
    gone = ("default-dns", "udp", 10003, DNS, f.targets[2])
    agent.apply(port_map_rules(f, [keep, gone]))
    first = one(ok(t.connect(lab.backend, f.proxy_cluster, 10003, proto="udp", src=f.workload, sport=sport)))
    assert first["node"] == "tailnet" and first["local"] == f.targets[2]
    agent.apply(port_map_rules(f, [keep]))
    after = one(t.connect(lab.backend, f.proxy_cluster, 10003, proto="udp", src=f.workload, sport=sport,
                          timeout=1))
    assert "error" in after, f"removed service's UDP flow still reaches {after.get('local')}: {after}"
