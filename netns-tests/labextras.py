"""Small additions to labtools.lab for the egress, DNS-ingress and connector end-to-end tests.

Everything here works through the Lab's surface (``exec``, ``namespaces``, ``nodes``, ``run_dir``, ``hs``...;
dnsmasq is started with the lab's ``_popen`` so that the lab's teardown stops it like its own servers) and
only touches namespaces of that lab, so nothing ever leaves the island. Every wait is bounded.
"""
from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from labtools import lab as labmod
from labtools.lab import Lab, LabError, NsInfo, stop_process, wait_until

# --------------------------------------------------------------------------------------------------------
# tailnet nodes
# --------------------------------------------------------------------------------------------------------

def stop_node(lab: Lab, name: str, timeout: float = 20.0) -> int | None:
    """SIGTERM the lab node ``name`` (a tailscaled started by lab.start_node), wait, SIGKILL if needed.

    The node stays in lab.nodes (its name cannot be reused there); its socket is gone afterwards."""
    node = lab.nodes[name]
    p = node.proc
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    return p.returncode


def rejoin_as_new_node(lab: Lab, name: str, timeout: float = 60.0) -> labmod.Node:
    """The lab node ``name`` (already stopped and deleted from headscale) joins again as a NEW machine with the
    same hostname: its state dir is wiped (new machine and node keys), so headscale registers a new node."""
    import shutil
    node = lab.nodes[name]
    if node.proc.poll() is None:
        raise LabError(f"node {name} is still running; stop_node() it first")
    del lab.nodes[name]
    shutil.rmtree(node.dir, ignore_errors=True)
    return lab.start_node(name, node.ns, timeout=timeout)


def node_self(lab: Lab, name: str) -> dict:
    return lab.status(name).get("Self") or {}


def magicdns_name(lab: Lab, name: str) -> str:
    """The node's MagicDNS FQDN as headscale assigned it, without the trailing dot."""
    dns = node_self(lab, name).get("DNSName") or ""
    if not dns:
        raise LabError(f"node {name} has no DNSName in its status")
    return dns.rstrip(".")


def peer_by_dns(lab: Lab, name: str, fqdn: str) -> dict | None:
    want = fqdn.rstrip(".").lower()
    for p in (lab.status(name).get("Peer") or {}).values():
        if (p.get("DNSName") or "").rstrip(".").lower() == want:
            return p
    return None


def wait_peer_gone(lab: Lab, name: str, fqdn: str, timeout: float = 30.0) -> None:
    wait_until(lambda: peer_by_dns(lab, name, fqdn) is None, timeout, 0.25, f"{fqdn} gone from {name}'s netmap")


# --------------------------------------------------------------------------------------------------------
# namespaces and addresses
# --------------------------------------------------------------------------------------------------------

def ip(lab: Lab, *args: str) -> None:
    cp = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    if cp.returncode != 0:
        raise LabError(f"ip {' '.join(args)} failed: {cp.stderr.strip()}")


def add_address(lab: Lab, ns: str, dev: str, cidr: str) -> None:
    """Add an address to ``dev`` in ``ns`` (nodad for IPv6, so it is usable at once)."""
    extra = ["nodad"] if ":" in cidr else []
    ip(lab, "-n", lab.netns(ns), "addr", "replace", cidr, "dev", dev, *extra)


def del_address(lab: Lab, ns: str, dev: str, cidr: str) -> None:
    subprocess.run(["ip", "-n", lab.netns(ns), "addr", "del", cidr, "dev", dev],
                   capture_output=True, text=True, timeout=15)


@dataclass
class Outside:
    """A namespace behind the proxy (not on the island bridge): the "internet" for exit-node tests.

    ``v4``/``v6`` are the server's addresses, in prefixes one router hop away from the proxy (on the outside
    namespace's loopback, routed by the proxy via the link): an exit node never forwards to subnets attached
    to its own interfaces (tailscaled cuts them out of 0.0.0.0/0 and ::/0, "guest wifi" semantics), so a
    server on the link itself would be unreachable through it by design."""
    info: NsInfo
    proxy_dev: str
    link_v4: tuple[str, str]   # (proxy side, outside side)
    link_v6: tuple[str, str]
    v4: str
    v6: str


def add_outside_namespace(lab: Lab, name: str = "outside", *, proxy_dev: str = "eth2",
                          link_v4: tuple[str, str] = ("192.0.2.1", "192.0.2.10"),
                          link_v6: tuple[str, str] = ("2001:db8::1", "2001:db8::10"),
                          server_v4: str = "198.51.100.10", server_v6: str = "2001:db8:1::10") -> Outside:
    """A namespace ``<prefix>-<name>`` linked only to the proxy namespace by a veth pair (proxy side
    ``proxy_dev``, /24 and /64 from ``link_v4``/``link_v6``), with the server addresses on its loopback and
    routes to them in the proxy. Only documentation prefixes (RFC 5737 / RFC 3849) are used, and they exist
    only inside these two namespaces. The namespace is registered in lab.namespaces, so lab.exec works in
    it and lab.close removes it."""
    if name in lab.namespaces:
        raise LabError(f"namespace {name!r} exists")
    full = f"{lab.prefix}-{name}"
    ip(lab, "netns", "add", full)
    info = NsInfo(name, full, server_v4, server_v6)
    lab.namespaces[name] = info  # before anything else can fail, so lab.close removes it
    etc = Path("/etc/netns") / full
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    ip(lab, "-n", full, "link", "set", "lo", "up")
    for key in ("all", "default"):
        lab.exec(name, ["sh", "-c", f"echo 0 > /proc/sys/net/ipv6/conf/{key}/disable_ipv6"], check=True)
    px = lab.netns("proxy")
    ip(lab, "-n", px, "link", "add", proxy_dev, "type", "veth", "peer", "name", "eth0", "netns", full)
    ip(lab, "-n", px, "addr", "add", f"{link_v4[0]}/24", "dev", proxy_dev)
    ip(lab, "-n", px, "-6", "addr", "add", f"{link_v6[0]}/64", "dev", proxy_dev, "nodad")
    ip(lab, "-n", px, "link", "set", proxy_dev, "up")
    ip(lab, "-n", full, "addr", "add", f"{link_v4[1]}/24", "dev", "eth0")
    ip(lab, "-n", full, "-6", "addr", "add", f"{link_v6[1]}/64", "dev", "eth0", "nodad")
    ip(lab, "-n", full, "link", "set", "eth0", "up")
    ip(lab, "-n", full, "addr", "add", f"{server_v4}/32", "dev", "lo")
    ip(lab, "-n", full, "-6", "addr", "add", f"{server_v6}/128", "dev", "lo", "nodad")
    ip(lab, "-n", full, "route", "add", "default", "via", link_v4[0])
    ip(lab, "-n", full, "-6", "route", "add", "default", "via", link_v6[0])
    ip(lab, "-n", px, "route", "add", f"{server_v4}/32", "via", link_v4[1], "dev", proxy_dev)
    ip(lab, "-n", px, "-6", "route", "add", f"{server_v6}/128", "via", link_v6[1], "dev", proxy_dev)
    return Outside(info, proxy_dev, link_v4, link_v6, server_v4, server_v6)


def remove_namespace(lab: Lab, name: str) -> None:
    """Kill what runs in a namespace this module added, and delete it (its veths go with it)."""
    if name not in lab.namespaces:
        return
    lab.kill_ns_leftovers(name, 5)
    full = lab.namespaces[name].netns
    subprocess.run(["ip", "netns", "del", full], capture_output=True, text=True, timeout=15)
    import shutil
    shutil.rmtree(Path("/etc/netns") / full, ignore_errors=True)
    del lab.namespaces[name]


def resolv_conf_path(lab: Lab, ns: str) -> Path:
    """The file `ip netns exec` bind-mounts over /etc/resolv.conf for processes started in ``ns``."""
    return Path("/etc/netns") / lab.netns(ns) / "resolv.conf"


def set_resolv_conf(lab: Lab, ns: str, text: str) -> str:
    """Rewrite ``ns``'s resolv.conf IN PLACE (same inode, so processes already running in the namespace see it
    through their bind mount) and return the old contents."""
    p = resolv_conf_path(lab, ns)
    old = p.read_text()
    with open(p, "r+") as f:
        f.seek(0)
        f.write(text)
        f.truncate()
    return old


# --------------------------------------------------------------------------------------------------------
# dnsmasq: an authoritative-enough DNS server for one or more names, from a hosts file
# --------------------------------------------------------------------------------------------------------

@dataclass
class Dnsmasq:
    lab: Lab
    ns: str
    listen: tuple[str, ...]
    ttl: int
    hosts_file: Path
    log_path: Path
    proc: subprocess.Popen = field(repr=False)

    def set_records(self, records: dict[str, Sequence[str]]) -> None:
        """Replace every record (name -> addresses) and make dnsmasq reload them (SIGHUP rereads addn-hosts)."""
        write_hosts(self.hosts_file, records)
        if self.proc.poll() is not None:
            raise LabError(f"dnsmasq exited ({self.proc.returncode}):\n{self.log_text()[-2000:]}")
        self.proc.send_signal(signal.SIGHUP)

    def query(self, name: str, qtype: str = "A", timeout: float = 5.0) -> list[str]:
        """Ask the server (from ``ns``) with dnspython, the agent's resolver library, for checks in tests."""
        code = ("import sys\n"
                "import dns.resolver\n"
                "r = dns.resolver.Resolver(configure=False)\n"
                "r.nameservers = [sys.argv[1]]\n"
                "r.lifetime = 2.0\n"
                "try:\n"
                "    a = r.resolve(sys.argv[2].rstrip('.') + '.', sys.argv[3])\n"
                "    print(' '.join(rr.address for rr in a))\n"
                "except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):\n"
                "    print('')\n")
        cp = self.lab.exec(self.ns, [_python(), "-c", code, self.listen[0], name, qtype], timeout=timeout,
                           env={"PYTHONPATH": str(labmod.REPO_ROOT)})
        if cp.returncode != 0:
            raise LabError(f"DNS query failed: {cp.stderr[-1000:]}")
        return cp.stdout.split()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        stop_process(self.proc)


def _python() -> str:
    import sys
    return sys.executable


def write_hosts(path: Path, records: dict[str, Sequence[str]]) -> None:
    lines = [f"{addr} {name}" for name, addrs in records.items() for addr in addrs]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def start_dnsmasq(lab: Lab, ns: str, listen: Sequence[str], records: dict[str, Sequence[str]], *,
                  ttl: int = 5, local_domains: Sequence[str] = (), tag: str = "dns") -> Dnsmasq:
    """Run ``dnsmasq`` in the foreground in ``ns``, answering only from a hosts file (no upstream servers, no
    /etc/hosts, no DHCP), bound to the ``listen`` addresses, with TTL ``ttl`` on every answer. For names under
    ``local_domains`` that the file does not hold it answers NXDOMAIN (like a real authoritative server after a
    record is deleted); other names get REFUSED (there is no upstream to forward to)."""
    d = lab.run_dir / tag
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)
    hosts = d / "hosts"
    write_hosts(hosts, records)
    log = d / "dnsmasq.log"
    argv = ["dnsmasq", "--no-daemon", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--no-poll",
            f"--addn-hosts={hosts}", f"--local-ttl={ttl}", "--bind-interfaces", "--pid-file=",
            "--user=root", "--group=root", "--log-queries", "--log-facility=-", "--cache-size=0",
            *[f"--local=/{d.strip('.')}/" for d in local_domains],
            *[f"--listen-address={a}" for a in listen]]
    p = lab._popen("http", f"dnsmasq-{ns}", ns, argv, lab._base_env(d), log)  # "http" kind: stopped at close
    srv = Dnsmasq(lab, ns, tuple(listen), ttl, hosts, log, p)

    def ready() -> bool:
        if p.poll() is not None:
            raise LabError(f"dnsmasq exited ({p.returncode}):\n{srv.log_text()[-2000:]}")
        return "started, version" in srv.log_text()
    wait_until(ready, 15, 0.1, f"dnsmasq in {ns}")
    return srv


# --------------------------------------------------------------------------------------------------------
# traffic
# --------------------------------------------------------------------------------------------------------

def curl_body(lab: Lab, ns: str, url: str, timeout: float = 4.0) -> str | None:
    cp = lab.curl(ns, url, timeout)
    return cp.stdout if cp.returncode == 0 else None


def markers_seen(lab: Lab, ns: str, url: str, markers: Sequence[str], n: int, timeout: float = 4.0) -> dict[str, int]:
    """curl ``url`` ``n`` times (each a new TCP connection, so a new NAT decision); count the answers per
    marker ("<fail>" for failed requests, "<other>" for answers with none of the markers)."""
    out: dict[str, int] = {}
    for _ in range(n):
        body = curl_body(lab, ns, url, timeout)
        if body is None:
            k = "<fail>"
        else:
            k = next((m for m in markers if body.startswith(m + "\n")), "<other>")
        out[k] = out.get(k, 0) + 1
    return out


def own_rules(lab: Lab, mode: str, ns: str = "proxy") -> str:
    """The agent's own firewall objects in ``ns`` right now ("" = none)."""
    if mode == "nftables":
        out = lab.exec(ns, ["nft", "list", "ruleset"], check=True).stdout
        keep, depth, lines = False, 0, []
        for line in out.splitlines():
            if line.startswith("table ") and " containerboot" in line:
                keep = True
            if keep:
                lines.append(line)
                depth += line.count("{") - line.count("}")
                if depth == 0:
                    keep = False
        return "\n".join(lines)
    dump = ""
    for tool in ("iptables-save", "ip6tables-save"):
        dump += lab.exec(ns, [tool], check=True).stdout
    return "\n".join(line for line in dump.splitlines() if "CB-" in line)


# --------------------------------------------------------------------------------------------------------
# a TCP connection held open across an outage
# --------------------------------------------------------------------------------------------------------

_ECHO_SERVER = """
import socketserver, sys
class H(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(line)
            self.wfile.flush()
class S(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
S((sys.argv[1], int(sys.argv[2])), H).serve_forever()
"""

_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()"

# One connection, never replaced: a line every 0.25 s, each echo awaited (5 s at most). Each outcome is a line
# "<CLOCK_MONOTONIC> ok|fail <why>"; the first failure ends the program.
_ECHO_CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
print("connected", s.getsockname()[1], flush=True)
s.settimeout(5)
f = s.makefile("rb")
n = 0
while True:
    n += 1
    t = time.monotonic()
    try:
        s.sendall(b"%d\\n" % n)
        line = f.readline()
    except OSError as e:
        print("%.3f fail %s" % (t, type(e).__name__), flush=True)
        break
    if line.strip() != str(n).encode():
        print("%.3f fail %s" % (t, "closed" if not line else "wrong echo"), flush=True)
        break
    print("%.3f ok" % t, flush=True)
    time.sleep(max(0.0, 0.25 - (time.monotonic() - t)))   # not a wait: paces the echoes, one every 0.25 s
"""


@dataclass
class HeldConnection:
    """One TCP connection from ``client_ns`` to ``addr:port`` (through the proxy), echoed by a server in
    ``server_ns``, used every 0.25 s and never replaced. Start before the outage, ``stop()`` after."""
    lab: Lab
    server: subprocess.Popen = field(repr=False)
    client: subprocess.Popen = field(repr=False)
    log: Path

    @classmethod
    def start(cls, lab: Lab, server_ns: str, client_ns: str, addr: str, port: int, *,
              tag: str = "held") -> "HeldConnection":
        d = lab.run_dir / tag
        env = lab._base_env(d)
        srv = lab._popen("http", f"{tag}-server", server_ns, [_python(), "-c", _ECHO_SERVER, "0.0.0.0", str(port)],
                         env, d / "server.log")
        log = d / "client.log"
        log.unlink(missing_ok=True)

        def connected() -> bool:
            if srv.poll() is not None:
                raise LabError(f"echo server exited: {(d / 'server.log').read_text()[-500:]}")
            return lab.exec(client_ns, [_python(), "-c", _CONNECT, addr, str(port)], timeout=8).returncode == 0
        wait_until(connected, 30, 0.5, f"the echo server at {addr}:{port} reachable from {client_ns}")
        cli = lab._popen("http", f"{tag}-client", client_ns, [_python(), "-u", "-c", _ECHO_CLIENT, addr, str(port)],
                         env, log)
        held = cls(lab, srv, cli, log)
        wait_until(lambda: held.results() or cli.poll() is not None, 30, 0.2, "the held connection's first echo")
        return held

    def results(self) -> list[tuple[float, bool]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[1] in ("ok", "fail"):
                out.append((float(parts[0]), parts[1] == "ok"))
        return out

    def broken(self) -> str:
        """"" while the connection works; else what broke it."""
        for line in self.log.read_text(errors="replace").splitlines():
            if " fail " in f" {line} ":
                return line
        if self.client.poll() is not None:
            return f"the client exited ({self.client.returncode}): {self.log.read_text()[-300:]}"
        return ""

    def longest_gap(self, start: float, end: float) -> float:
        """Longest time between two echoes within [start, end] (0.25 s when every echo came in time)."""
        oks = [t for t, ok in self.results() if ok and start - 1 <= t <= end + 1]
        return max((b - a for a, b in zip(oks, oks[1:], strict=False)), default=end - start)

    def stop(self) -> None:
        for p in (self.client, self.server):
            stop_process(p, timeout=5)
