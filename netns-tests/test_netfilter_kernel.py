"""netfilter backends against real kernels, each test in its own throw-away network namespace (root only).

Every test creates `cbnf-<random>` with `ip netns add` and deletes it in a finalizer. The package is driven
through `python -m netfilter.cli` run with `ip netns exec`, i.e. the same `Backend.apply/installed/cleanup`
code path the agent uses. Backends: nftables, iptables (legacy x_tables) and iptables (nf_tables flavour).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time

import pytest
from needs import unavailable

from netfilter.model import Dnat, EgressForward, PortMatch, RuleSet, ServiceDnat, ServicePortMap

pytestmark = pytest.mark.netns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
IP = shutil.which("ip") or "ip"   # absolute: some tests run with a $PATH that hides iptables (and maybe ip)



@pytest.fixture(autouse=True, scope="module")
def _root_and_iproute2() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        unavailable("these tests need root and iproute2 (network namespaces)")


TS = {4: "100.64.0.5", 6: "fd7a:115c:a1e0::5"}
BACKEND = {4: ("10.0.0.1", "10.0.0.2"), 6: ("fd00::1", "fd00::2")}
TARGET = {4: ("100.99.99.99", "100.99.99.98"), 6: ("fd7a:115c:a1e0::99", "fd7a:115c:a1e0::98")}
VIP = {4: ("100.100.1.1", "10.96.0.10"), 6: ("fd7a:115c:a1e0::1", "fd00:96::10")}
POD = {4: "10.1.2.3", 6: "fd00:10::3"}
EXEMPT = (PortMatch("udp", 41641), PortMatch("tcp", 9002))

# (mode, iptables variant)
BACKENDS = {"nftables": ("nftables", ""), "iptables-legacy": ("iptables", "legacy"),
            "iptables-nft": ("iptables", "nft")}


class NS:
    def __init__(self) -> None:
        self.name = f"cbnf-{secrets.token_hex(4)}"
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True, timeout=30)
        self.run("ip", "link", "set", "lo", "up")

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)

    def run(self, *argv: str, input: str | None = None, check: bool = True, env: dict | None = None
            ) -> subprocess.CompletedProcess:
        p = subprocess.run([IP, "netns", "exec", self.name, *argv], input=input, capture_output=True,
                           text=True, timeout=120, env=env, cwd=REPO)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p

    def py(self, code: str, env: dict | None = None) -> str:
        return self.run(PY, "-c", code, env=env).stdout


@pytest.fixture
def ns():
    n = NS()
    yield n
    n.close()


class Agent:
    def __init__(self, ns: NS, backend: str, tmp_path) -> None:
        self.ns, self.tmp, self.n = ns, tmp_path, 0
        self.mode, self.variant = BACKENDS[backend]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        extra = ["--variant", self.variant] if self.variant else []
        return self.ns.run(PY, "-m", "netfilter.cli", *args, "--mode", self.mode, *extra, check=check)

    def _file(self, rules: RuleSet) -> str:
        self.n += 1
        path = self.tmp / f"rules{self.n}.json"
        path.write_text(rules.to_json())
        return str(path)

    def apply(self, rules: RuleSet) -> None:
        self.cli("apply", self._file(rules))

    def render(self, rules: RuleSet) -> str:
        return self.cli("render", self._file(rules)).stdout

    def installed(self) -> str:
        return self.cli("installed").stdout

    def cleanup(self) -> None:
        self.cli("cleanup")

    def raw(self) -> str:
        """Everything in the namespace's firewall, as the plain tools show it."""
        if self.mode == "nftables":
            return self.ns.run("nft", "list", "ruleset").stdout
        out = ""
        for b in (f"iptables-{self.variant}-save", f"ip6tables-{self.variant}-save"):
            out += "\n".join(ln for ln in self.ns.run(b).stdout.splitlines() if not ln.startswith("#")) + "\n"
        return out


@pytest.fixture(params=sorted(BACKENDS))
def agent(request, ns, tmp_path) -> Agent:
    return Agent(ns, request.param, tmp_path)


@pytest.fixture(params=(4, 6), ids=lambda v: f"ipv{v}")
def family(request) -> int:
    return request.param


def everything(v: int, target_index: int = 0) -> RuleSet:
    """One of each operation for family v (O1/O2 load-balanced, O3, O4 is a Dnat too, O5, O6)."""
    t = TARGET[v][target_index]
    return RuleSet(
        dnats=(Dnat(TS[v], BACKEND[v]), Dnat(POD[v], (TS[v],))),
        egress=(EgressForward(t, TS[v], EXEMPT),),
        port_maps=(ServicePortMap("default-mysvc", "TCP", 10001, 5432, t, TS[v]),
                   ServicePortMap("default-dns", "UDP", 10002, 53, t, TS[v])),
        service_dnats=(ServiceDnat("svc:web", *VIP[v]),),
        clamp_mss=True)


# ====================================================================================================== tests

def test_apply_three_times_is_byte_identical_and_matches_render(agent, family):
    rules = everything(family)
    agent.apply(rules)
    first = agent.installed()
    raw_first = agent.raw()
    assert first and first == agent.render(rules)
    for _ in range(2):
        agent.apply(rules)
        assert agent.installed() == first
    assert agent.raw() == raw_first           # not even counters or positions moved
    if agent.mode == "iptables":
        assert first.count("-A PREROUTING -j CB-PREROUTING") == 1
        assert first.count("TCPMSS") == 2
    else:
        assert first.count("tcp option maxseg size set rt mtu") == 2


def test_both_families_at_once(agent):
    rules = RuleSet(dnats=everything(4).dnats + everything(6).dnats, clamp_mss=True)
    agent.apply(rules)
    out = agent.installed()
    assert out == agent.render(rules)
    assert TS[4] in out and TS[6] in out
    agent.cleanup()
    assert agent.installed() == ""


def test_changing_a_target_removes_every_old_rule(agent, family):
    agent.apply(everything(family, 0))
    agent.apply(everything(family, 1))
    out, raw = agent.installed(), agent.raw()
    assert out == agent.render(everything(family, 1))
    old = TARGET[family][0]
    assert old not in raw
    assert TARGET[family][1] in raw
    # a smaller rule set shrinks the installed state
    small = RuleSet(dnats=(Dnat(TS[family], (BACKEND[family][0],)),))
    agent.apply(small)
    assert agent.installed() == agent.render(small)
    assert TARGET[family][1] not in agent.raw()


NFT_FOREIGN = """
table ip other {
	chain prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		ip daddr 10.9.9.9 dnat to 10.8.8.8
	}
}
table ip filter {
	chain FORWARD {
		type filter hook forward priority filter; policy accept;
		counter jump ts-forward
	}

	chain ts-forward {
		iifname "tailscale0*" counter meta mark set meta mark & 0xff00ffff | 0x00040000
		oifname "tailscale0*" counter accept
	}
}
table ip6 nat {
	chain POSTROUTING {
		type nat hook postrouting priority srcnat; policy accept;
		counter jump ts-postrouting
	}

	chain ts-postrouting {
		meta mark & 0x00ff0000 == 0x00040000 counter masquerade
	}
}
"""


def _ipt_foreign(agent: Agent) -> None:
    v = agent.variant
    for fam, tool in ((4, f"iptables-{v}-restore"), (6, f"ip6tables-{v}-restore")):
        dst = "10.9.9.9/32" if fam == 4 else "fd00:9::9/128"
        to = "10.8.8.8" if fam == 4 else "fd00:8::8"
        agent.ns.run(tool, "--noflush", input=(
            "*nat\n:OTHER - [0:0]\n:ts-postrouting - [0:0]\n"
            f"-A PREROUTING -d {dst} -j DNAT --to-destination {to}\n"
            "-A PREROUTING -j OTHER\n"
            f"-A OTHER -d {dst} -j RETURN\n"
            "-A POSTROUTING -j ts-postrouting\n"
            "-A ts-postrouting -m mark --mark 0x40000/0xff0000 -j MASQUERADE\nCOMMIT\n"
            "*filter\n:ts-forward - [0:0]\n-A FORWARD -j ts-forward\n"
            "-A ts-forward -i tailscale0 -j MARK --set-xmark 0x40000/0xff0000\nCOMMIT\n"))


def _foreign_view(agent: Agent) -> str:
    """The firewall minus our own objects (and minus counters)."""
    if agent.mode == "nftables":
        out = []
        for fam, table in (("ip", "other"), ("ip", "filter"), ("ip6", "nat")):
            out.append(agent.ns.run("nft", "list", "table", fam, table).stdout)
        return "".join(out)
    lines = []
    for fam in ("iptables", "ip6tables"):
        for ln in agent.ns.run(f"{fam}-{agent.variant}-save").stdout.splitlines():
            # Foreign chains and rules; built-in chain headers of tables that merely got loaded are not state.
            if "CB-" in ln or not (ln.startswith("-A ") or (ln.startswith(":") and " - [" in ln)):
                continue
            lines.append(ln.split(" [")[0] if ln.startswith(":") else ln)
    return "\n".join(lines)


def test_foreign_tables_and_tailscaled_chains_are_untouched(agent, family):
    if agent.mode == "nftables":
        agent.ns.run("nft", "-f", "-", input=NFT_FOREIGN)
    else:
        _ipt_foreign(agent)
    before = _foreign_view(agent)
    assert "ts-" in before
    agent.apply(everything(family))
    assert _foreign_view(agent) == before
    agent.apply(everything(family, 1))
    assert _foreign_view(agent) == before
    agent.cleanup()
    assert _foreign_view(agent) == before
    assert agent.installed() == ""


def test_our_jump_goes_first_even_after_tailscaled_inserts_its_own(agent):
    if agent.mode != "iptables":
        pytest.skip("iptables only: nftables uses its own base chains")
    rules = everything(4)
    agent.apply(rules)
    # tailscaled (AddHooks) inserts its jump at position 1 after us
    agent.ns.run(f"iptables-{agent.variant}", "-t", "nat", "-N", "ts-postrouting")
    agent.ns.run(f"iptables-{agent.variant}", "-t", "nat", "-I", "POSTROUTING", "1", "-j", "ts-postrouting")
    agent.apply(rules)
    post = [ln for ln in agent.ns.run(f"iptables-{agent.variant}-save", "-t", "nat").stdout.splitlines()
            if ln.startswith("-A POSTROUTING")]
    assert post == ["-A POSTROUTING -j CB-POSTROUTING", "-A POSTROUTING -j ts-postrouting"]


def test_cleanup_removes_everything_of_ours(agent, family):
    pristine = agent.raw()
    agent.apply(everything(family))
    assert agent.raw() != pristine
    agent.cleanup()
    assert agent.installed() == ""
    raw = agent.raw()
    assert "containerboot" not in raw and "CB-" not in raw
    if agent.mode == "nftables":
        assert raw == pristine
    agent.cleanup()                            # idempotent
    assert agent.installed() == ""


def test_empty_rule_set_is_cleanup(agent):
    agent.apply(everything(6))
    agent.apply(RuleSet(clamp_mss=True))
    assert agent.installed() == ""


def test_many_services_apply_exactly(agent):
    # How fast is a figure, not a test: bench/rules.py times 10,000 maps against the per-rule baseline.
    maps = tuple(ServicePortMap(f"ns-svc{i}", "tcp" if i % 2 else "udp", 10000 + i, 80 + i % 7,
                                f"100.99.{i // 250}.{i % 250 + 1}", TS[4]) for i in range(1000))
    vips = tuple(ServiceDnat(f"svc:s{i}", f"100.100.{i // 250}.{i % 250 + 1}", f"10.96.{i // 250}.{i % 250 + 1}")
                 for i in range(300))
    rules = RuleSet(port_maps=maps, service_dnats=vips, clamp_mss=True)
    agent.apply(rules)
    out = agent.installed()
    assert out == agent.render(rules)
    if agent.mode == "nftables":
        # one lookup rule each for port maps, VIP DNATs and SNATs, however many services
        assert out.count("dnat") == 2 and out.count("snat to ") == 1
    else:
        assert out.count("-j DNAT") == 1300
    agent.apply(rules)
    assert agent.installed() == out


def test_ipv6_rules_refused_without_ipv6(ns, tmp_path):
    """[E11]: no crash and no half-applied state when IPv6 is unusable; IPv4 still works."""
    ns.run("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
    out = ns.py("from netfilter.detect import check_ipv6, ipv6_nat_available\n"
                "print(check_ipv6()); print(ipv6_nat_available('nftables'), ipv6_nat_available('iptables'))")
    reason, avail = out.splitlines()
    assert "disable_ipv6" in reason and avail == "False False"
    for mode in ("nftables", "iptables"):
        path = tmp_path / f"{mode}.json"
        path.write_text(everything(6).to_json())
        p = ns.run(PY, "-m", "netfilter.cli", "apply", str(path), "--mode", mode, "--no-ipv6", check=False)
        assert p.returncode == 2 and "IPv6" in p.stderr
        path.write_text(everything(4).to_json())
        ns.run(PY, "-m", "netfilter.cli", "apply", str(path), "--mode", mode, "--no-ipv6")
        ns.run(PY, "-m", "netfilter.cli", "cleanup", "--mode", mode, "--no-ipv6")


# ============================================================================================ mode detection

def _legacy_path(tmp_path) -> str:
    """A $PATH where plain `iptables` is iptables-legacy, like the official image."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name in ("iptables", "ip6tables", "iptables-save", "ip6tables-save", "iptables-restore",
                 "ip6tables-restore"):
        legacy = shutil.which(name.replace("tables", "tables-legacy", 1)) or ""
        (d / name).symlink_to(legacy)
    return f"{d}:{os.environ.get('PATH', '')}"


def _detect(ns: NS, mode: str, path: str | None = None) -> str:
    env = dict(os.environ, TS_DEBUG_FIREWALL_MODE=mode)
    if path is not None:
        env["PATH"] = path
    return ns.py("from netfilter.backend import open_backend\n"
                 "b = open_backend()\n"
                 "print(b.name, getattr(b, 'variant', '-'))", env=env).strip()


def test_auto_picks_nftables_when_only_nftables_holds_rules(ns, tmp_path):
    ns.run("nft", "-f", "-", input=NFT_FOREIGN)
    assert _detect(ns, "auto", _legacy_path(tmp_path)) == "nftables -"


def test_auto_picks_iptables_when_only_iptables_holds_rules(ns, tmp_path):
    path = _legacy_path(tmp_path)
    ns.run("iptables-legacy", "-A", "INPUT", "-s", "10.9.9.9", "-j", "ACCEPT")
    name, variant = _detect(ns, "auto", path).split()
    assert name == "iptables" and variant == "legacy"    # and the rules go where the existing ones are


def test_auto_prefers_nftables_when_both_or_neither(ns, tmp_path):
    assert _detect(ns, "auto", _legacy_path(tmp_path)).startswith("nftables")
    ns.run("iptables-nft", "-A", "INPUT", "-s", "10.9.9.9", "-j", "ACCEPT")   # counts for both
    assert _detect(ns, "auto").startswith("nftables")


def test_default_and_explicit_modes(ns, tmp_path):
    assert _detect(ns, "").startswith("iptables")           # iptables binary present
    assert _detect(ns, "nftables").startswith("nftables")
    assert _detect(ns, "iptables").startswith("iptables")
    assert _detect(ns, "NFTABLES").startswith("iptables")   # unknown values mean iptables, like upstream
    nobin = tmp_path / "empty"
    nobin.mkdir()
    env_path = f"{nobin}:{os.path.dirname(PY)}"
    assert _detect(ns, "", env_path).startswith("nftables")  # no iptables binary at all


def test_auto_mode_end_to_end_keeps_using_the_same_backend(ns, tmp_path):
    """After the agent applied rules in auto mode, a restarted agent picks the same backend."""
    env = dict(os.environ, TS_DEBUG_FIREWALL_MODE="auto", PATH=_legacy_path(tmp_path))
    path = tmp_path / "r.json"
    path.write_text(everything(4).to_json())
    ns.run(PY, "-m", "netfilter.cli", "apply", str(path), env=env)
    first = ns.run(PY, "-m", "netfilter.cli", "installed", env=env).stdout
    assert first
    assert _detect(ns, "auto", env["PATH"]).startswith("nftables")   # nothing else held rules: nft preferred
    ns.run(PY, "-m", "netfilter.cli", "cleanup", env=env)


# ================================================================================================== sysctls

def test_ensure_forwarding_in_namespace(ns):
    # A new namespace copies the host's IPv4 forwarding setting, so start from "off" explicitly.
    ns.run("sysctl", "-qw", "net.ipv4.ip_forward=0", "net.ipv6.conf.all.forwarding=0")
    out = ns.py(
        "from netfilter.sysctl import ensure_forwarding, forwarding_enabled\n"
        "print(forwarding_enabled(4), forwarding_enabled(6))\n"
        "ensure_forwarding(True, True)\n"
        "print(forwarding_enabled(4), forwarding_enabled(6))\n")
    assert out.split() == ["False", "False", "True", "True"]
    assert ns.run("sysctl", "-n", "net.ipv4.ip_forward").stdout.strip() == "1"


def test_ensure_forwarding_read_only_root(tmp_path):
    from netfilter.sysctl import ForwardingError, ensure_forwarding
    v4 = tmp_path / "proc/sys/net/ipv4/ip_forward"
    v6 = tmp_path / "proc/sys/net/ipv6/conf/all/forwarding"
    v4.parent.mkdir(parents=True)
    v6.parent.mkdir(parents=True)
    v4.write_text("1\n")
    os.utime(v4, (1_000_000, 1_000_000))
    ensure_forwarding(True, False, root=str(tmp_path))      # already on: read, never written
    assert v4.stat().st_mtime == 1_000_000 and v4.read_text() == "1\n"
    v6.write_text("0\n")
    ensure_forwarding(False, True, root=str(tmp_path))
    assert v6.read_text() == "1"
    v6.unlink()
    os.chmod(tmp_path / "proc/sys/net/ipv6/conf/all", 0o555)
    try:
        with pytest.raises(ForwardingError, match="privileged"):
            ensure_forwarding(True, True, root=str(tmp_path), in_kubernetes=True)
    finally:
        os.chmod(tmp_path / "proc/sys/net/ipv6/conf/all", 0o755)


# ================================================================================================ conntrack

def _udp_topology(client: NS, proxy: NS) -> None:
    """client --veth-- proxy --veth(tailscale0)--> nowhere: enough for conntrack entries to be confirmed."""
    subprocess.run([IP, "link", "add", "cbva", "netns", client.name, "type", "veth", "peer", "name", "cbvb",
                    "netns", proxy.name], check=True, capture_output=True, timeout=30)
    client.run("ip", "addr", "add", "10.7.0.2/24", "dev", "cbva")
    client.run("ip", "addr", "add", "fd07::2/64", "dev", "cbva", "nodad")
    client.run("ip", "link", "set", "cbva", "up")
    proxy.run("ip", "addr", "add", "10.7.0.1/24", "dev", "cbvb")
    proxy.run("ip", "addr", "add", "fd07::1/64", "dev", "cbvb", "nodad")
    proxy.run("ip", "link", "set", "cbvb", "up")
    proxy.run("ip", "link", "add", "tailscale0", "type", "veth", "peer", "name", "tspeer")
    proxy.run("ip", "link", "set", "tailscale0", "up")
    proxy.run("ip", "link", "set", "tspeer", "up")
    proxy.run("ip", "route", "add", "100.64.0.0/10", "dev", "tailscale0")
    proxy.run("ip", "-6", "route", "add", "fd7a:115c:a1e0::/48", "dev", "tailscale0")
    proxy.run("sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1")


def _send_udp(client: NS, v: int, sport: int) -> None:
    fam, src, dst = ("AF_INET", "10.7.0.2", "10.7.0.1") if v == 4 else ("AF_INET6", "fd07::2", "fd07::1")
    client.py(f"import socket\ns = socket.socket(socket.{fam}, socket.SOCK_DGRAM)\n"
              f"s.bind(({src!r}, {sport}))\ns.sendto(b'x', ({dst!r}, 53))\n")


def _udp_nat_targets(proxy: NS, v: int) -> list[str]:
    fam = "AF_INET" if v == 4 else "AF_INET6"
    out = proxy.py("import socket\nfrom pyroute2 import Conntrack\n"
                   f"ct = Conntrack(nfgen_family=socket.{fam})\n"
                   "print(' '.join(sorted(e.tuple_reply.saddr for e in ct.dump_entries()"
                   " if e.tuple_orig.proto == 17 and e.status & 32)))\nct.close()\n")
    return out.split()


def _flow(client: NS, proxy: NS, v: int) -> list[str]:
    """Send from UDP port 40123 until conntrack shows the flow (fresh links need a moment for ND/DAD).

    Each try spawns two processes (sender, conntrack dump): on a loaded machine that alone can take seconds."""
    deadline = time.monotonic() + 20
    while True:
        _send_udp(client, v, 40123)
        time.sleep(0.2)   # poll: until conntrack shows the flow (deadline above)
        got = _udp_nat_targets(proxy, v)
        if got or time.monotonic() > deadline:
            return got


def test_target_change_drops_stale_udp_bindings(agent, family, tmp_path):
    client = NS()
    try:
        _udp_topology(client, agent.ns)
        old, new = TARGET[family]
        agent.apply(RuleSet(egress=(EgressForward(old, TS[family], EXEMPT),)))
        assert _flow(client, agent.ns, family) == [old]
        agent.apply(RuleSet(egress=(EgressForward(old, TS[family], EXEMPT),)))   # no change: binding kept
        assert _udp_nat_targets(agent.ns, family) == [old]
        agent.apply(RuleSet(egress=(EgressForward(new, TS[family], EXEMPT),)))
        assert _udp_nat_targets(agent.ns, family) == []
        assert _flow(client, agent.ns, family) == [new]                           # same source port again
    finally:
        client.close()


_SHUTDOWN = """
import asyncio, sys
from containerboot.firewallsetup import FirewallSetup
from containerboot.settings import load
from netfilter.iptables import IptablesBackend
from netfilter.model import RuleSet
from netfilter.nft import NftBackend
rules = RuleSet.from_json(open(sys.argv[1]).read())
fw = FirewallSetup(load({"TS_DEST_IP": "100.64.0.9", "TS_USERSPACE": "false"}))
fw.backend = NftBackend(ipv6=True) if sys.argv[2] == "nftables" else IptablesBackend(ipv6=True, variant=sys.argv[3])
asyncio.run(fw.close(rules))
"""


def _tcp_nat_targets(proxy: NS, v: int) -> list[str]:
    fam = "AF_INET" if v == 4 else "AF_INET6"
    out = proxy.py("import socket\nfrom pyroute2 import Conntrack\n"
                   f"ct = Conntrack(nfgen_family=socket.{fam})\n"
                   "print(' '.join(sorted(e.tuple_reply.saddr for e in ct.dump_entries()"
                   " if e.tuple_orig.proto == 6 and e.status & 32)))\nct.close()\n")
    return out.split()


def test_shutdown_refuses_a_caught_connection_instead_of_blackholing_it(agent, family, tmp_path):
    """The agent's shutdown (tailscaled gone: a ProxyGroup replica's tailscaled died) removes its rules and then
    the conntrack entries of what they translated: a client whose SYN went to the dead tunnel just before gets
    its retransmission refused (it can try another replica) instead of waiting for its own timeout."""
    client = NS()
    try:
        _udp_topology(client, agent.ns)
        # tailscale0 as a dead tunnel: a tun device nobody reads drops what it is given and resolves no neighbours
        # (a veth would answer the caller with "host unreachable" once ARP gives up)
        agent.ns.run("ip", "link", "del", "tailscale0")
        agent.ns.run("ip", "tuntap", "add", "dev", "tailscale0", "mode", "tun")
        agent.ns.run("ip", "link", "set", "tailscale0", "up")
        agent.ns.run("ip", "route", "add", "100.64.0.0/10", "dev", "tailscale0")
        agent.ns.run("ip", "-6", "route", "add", "fd7a:115c:a1e0::/48", "dev", "tailscale0")
        target = TARGET[family][0]
        rules = RuleSet(egress=(EgressForward(target, TS[family], EXEMPT),))
        agent.apply(rules)
        dst = "10.7.0.1" if family == 4 else "fd07::1"
        caller = subprocess.Popen(
            [IP, "netns", "exec", client.name, PY, "-c",
             "import socket, sys\n"
             "try:\n"
             f"    socket.create_connection(({dst!r}, 8080), timeout=20)\n"
             "    print('connected')\n"
             "except Exception as e:\n"
             "    print(type(e).__name__, e)\n"], stdout=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 20
            while _tcp_nat_targets(agent.ns, family) != [target]:
                assert time.monotonic() < deadline, "the SYN never reached conntrack"
                assert caller.poll() is None, caller.stdout.read() if caller.stdout else ""
            agent.ns.run(PY, "-c", _SHUTDOWN, agent._file(rules), agent.mode, agent.variant)
            assert _tcp_nat_targets(agent.ns, family) == []
            out, _ = caller.communicate(timeout=30)
        finally:
            caller.kill()
        assert out.split()[0] == "ConnectionRefusedError", out    # not TimeoutError: the retransmission was refused
        assert agent.installed().strip() == ""                # and the rules are gone
    finally:
        client.close()


def test_ipv6_leftovers_removed_when_ipv6_becomes_unusable(agent, tmp_path):
    both = RuleSet(dnats=everything(4).dnats + everything(6).dnats)
    agent.apply(both)
    assert TS[6] in agent.raw()
    path = tmp_path / "v4.json"
    path.write_text(RuleSet(dnats=everything(4).dnats).to_json())
    extra = ["--variant", agent.variant] if agent.variant else []
    agent.ns.run(PY, "-m", "netfilter.cli", "apply", str(path), "--mode", agent.mode, "--no-ipv6", *extra)
    raw = agent.raw()
    assert TS[4] in raw and TS[6] not in raw


# --------------------------------------------------------------------------------------- nftables warm-up

_WARM_THEN_APPLY = """
import json, sys
from netfilter.model import RuleSet
from netfilter.nft import NftBackend
b = NftBackend(ipv6=True)
b.warm_up()
import subprocess
after_warm_up = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout
b.apply(RuleSet.from_json(open(sys.argv[1]).read()))
print(json.dumps({"after_warm_up": after_warm_up, "absent": b._absent_at_warm_up}))
"""


@pytest.mark.parametrize("ours_before", (False, True), ids=("no-tables", "equal-rules-installed"))
def test_nft_warm_up_changes_nothing_and_the_first_apply_still_converges(ns, tmp_path, ours_before):
    """The agent warms libnftables up in the idle second of the login with a batch in check mode: nothing in
    the kernel may change (foreign tables, tailscaled's chains, our own tables), and the first real apply after
    it must install the rules, or leave equal rules untouched (not even rewritten)."""
    agent = Agent(ns, "nftables", tmp_path)
    ns.run("nft", "add table inet foreign; add chain inet foreign c { type filter hook input priority 0; }; "
           "add rule inet foreign c tcp dport 22 counter accept")
    rules = everything(4)
    rules = RuleSet(dnats=rules.dnats + everything(6).dnats, egress=rules.egress, clamp_mss=True)
    if ours_before:
        agent.apply(rules)
    before = ns.run("nft", "list", "ruleset").stdout
    out = json.loads(ns.run(PY, "-c", _WARM_THEN_APPLY, agent._file(rules)).stdout)
    assert out["after_warm_up"] == before            # the check-mode batch committed nothing
    assert out["absent"] is (not ours_before)
    assert agent.installed() == agent.render(rules)
    if ours_before:
        assert ns.run("nft", "list", "ruleset").stdout == before   # equal rules: nothing sent at all
    assert "table inet foreign" in ns.run("nft", "list", "ruleset").stdout


_CONTEXTS_SCRIPT = """
import gc, json, sys, weakref
import nftables
from netfilter.model import RuleSet
from netfilter.nft import NftBackend
live, made = weakref.WeakSet(), []
class Counted(nftables.Nftables):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        live.add(self)
        made.append(1)
nftables.Nftables = Counted
b = NftBackend(ipv6=True)
steps = {}
for step, call in (("warm_up", b.warm_up), ("apply", lambda: b.apply(RuleSet.from_json(open(sys.argv[1]).read()))),
                   ("apply_again", lambda: b.apply(RuleSet.from_json(open(sys.argv[1]).read()))),
                   ("installed", b.installed), ("cleanup", b.cleanup)):
    call()
    gc.collect()
    steps[step] = len(live)
print(json.dumps({"live": steps, "made": len(made), "left": b.installed()}))
"""


def test_nft_operations_free_their_libnftables_context(ns, tmp_path):
    """libnftables keeps its ruleset cache (megabytes for a few tables) in a context until its next command:
    the agent must not hold one between operations. Each operation works (rules installed, then removed) and
    leaves no context alive."""
    agent = Agent(ns, "nftables", tmp_path)
    rules = RuleSet(dnats=everything(4).dnats + everything(6).dnats, egress=everything(4).egress, clamp_mss=True)
    out = json.loads(ns.run(PY, "-c", _CONTEXTS_SCRIPT, agent._file(rules)).stdout)
    assert out["made"] >= 4                                    # the operations did use libnftables
    assert out["live"] == {"warm_up": 0, "apply": 0, "apply_again": 0, "installed": 0, "cleanup": 0}
    assert out["left"] == ""                                   # the clean-up removed what the apply installed


_DELTA_SCRIPT = r'''
import json, subprocess, sys
from netfilter.model import RuleSet, ServicePortMap
from netfilter.iptables import IptablesBackend
from netfilter.nft import NftBackend
from netfilter.plan import normalize_nft_text
NFT = sys.argv[1] == "nftables"

def svc(i, v, port=80, tgt=0):
    t = f"100.100.{i // 250}.{i % 250 + 1 + tgt}" if v == 4 else f"fd7a:115c:a1e0::{i + 1 + tgt:x}"
    return ServicePortMap(f"ns-svc{i}", "tcp", 10000 + i, port, t, "100.64.0.5" if v == 4 else "fd7a:115c:a1e0::5")

def rs(maps):
    return RuleSet(port_maps=tuple(maps), clamp_mss=True)

def dump():   # the kernel's own listing, not the backend's
    if NFT:
        out = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout
        return normalize_nft_text(out)
    out = ""
    for tool in ("iptables-nft-save", "ip6tables-nft-save"):
        text = subprocess.run([tool], capture_output=True, text=True, check=True).stdout
        out += "".join(ln + "\n" for ln in text.splitlines() if not ln.startswith("#"))
    return out

keys = [(i, v) for i in range(40) for v in (4, 6)]
base = [svc(i, v) for i, v in keys]
steps = {
    "add": base + [svc(40, 4), svc(40, 6)],
    "remove": [m for m in base if m.match_port != 10003],
    "move": [svc(i, v, tgt=1) if i == 7 else m for m, (i, v) in zip(base, keys)],
    "port": [svc(i, v, port=81) if i == 9 else m for m, (i, v) in zip(base, keys)],
}
b = NftBackend(ipv6=True) if NFT else IptablesBackend(ipv6=True, variant="nft")
b.cleanup()
result = {}
for name, maps in steps.items():
    b.apply(rs(base))
    sent = []
    if NFT:
        orig = b._run
        b._run = lambda batch, what, orig=orig: (sent.append(batch), orig(batch, what))[1]
    else:
        orig = b._restore
        b._restore = lambda fam, text, orig=orig: (sent.append(text), orig(fam, text))[1]
    changed = b.apply(rs(maps))
    noop = b.apply(rs(maps))
    if NFT:
        b._run = orig
    else:
        b._restore = orig
    delta_dump = dump()
    b.cleanup()
    b.apply(rs(maps))        # a fresh full apply of the same rule set
    result[name] = {"changed": changed, "noop": noop, "sent": sent, "same": delta_dump == dump(),
                    "installed_ok": delta_dump.strip() != ""}
# a foreign change to one of our maps between two applies: the next apply repairs it
b.cleanup()
b.apply(rs(base))
if NFT:
    subprocess.run("nft 'delete element ip containerboot portmap { tcp . 10005 }'", shell=True, check=True)
    subprocess.run("nft 'add element ip6 containerboot snatmap { fd7a:115c:a1e0::ffff : fd7a:115c:a1e0::5 }'",
                   shell=True, check=True)
else:
    subprocess.run(["iptables-nft", "-t", "nat", "-D", "CB-PREROUTING", "5"], check=True)
    subprocess.run(["ip6tables-nft", "-t", "nat", "-I", "CB-POSTROUTING", "1", "-d", "fd7a:115c:a1e0::ffff",
                    "-j", "SNAT", "--to-source", "fd7a:115c:a1e0::5"], check=True)
b.apply(rs(base + [svc(40, 4)]))
repaired = dump()
b.cleanup(); b.apply(rs(base + [svc(40, 4)]))
result["foreign"] = {"same": repaired == dump(), "render": b.installed() == b.render(rs(base + [svc(40, 4)]))}
print(json.dumps(result))
'''


@pytest.mark.parametrize("backend", ["nftables", "iptables-nft"])
def test_delta_leaves_the_same_ruleset_as_a_full_apply(ns, backend):
    """One egress Service added, removed, moved to another target or port: the apply sends only map elements
    (nftables) or single-rule deletions and insertions (iptables-nft), and the kernel's ruleset then equals
    what a full apply of the same rules leaves; a foreign change to our rules is repaired by the next apply."""
    import json
    if backend == "iptables-nft" and shutil.which("iptables-nft-restore") is None:
        unavailable("iptables-nft-restore is not installed (Debian's iptables package; scripts/setup.sh installs it)")
    res = json.loads(ns.run(PY, "-c", _DELTA_SCRIPT, backend).stdout.strip().splitlines()[-1])
    for name in ("add", "remove", "move", "port"):
        r = res[name]
        assert r["same"] and r["installed_ok"], name
        assert r["changed"] is True and r["noop"] is False, name
        if backend == "nftables":
            assert len(r["sent"]) == 1 and "element" in r["sent"][0] and "table" not in r["sent"][0], r["sent"]
        else:   # one restore per changed family, of -D/-I lines only
            assert r["sent"] and all(ln.split(" ", 1)[0] in ("*nat", "-D", "-I", "COMMIT")
                                     for text in r["sent"] for ln in text.splitlines()), r["sent"]
    assert res["foreign"] == {"same": True, "render": True}
