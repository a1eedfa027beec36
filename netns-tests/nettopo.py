"""nettopo: a small, reusable network-namespace topology helper for packet-level tests.

Everything runs in namespaces this module creates (names carry a unique short prefix) and
everything it starts is recorded, so teardown can kill exactly those processes and delete
exactly those namespaces. Only the `ip` command and the Python standard library are used.

The standard layout for proxy tests (`ProxyLab`) has three namespaces:

    tailnet  --[tn0 | tailscale0]--  proxy  --[eth1 | be0]--  backend

* "tailnet" stands in for the rest of the tailnet: the proxy end of its veth is named
  `tailscale0` (the interface the agent's rules refer to) and both ends use tailnet-style
  addresses (100.64.0.0/10 and fd7a:115c:a1e0::/48). Extra "tailnet targets" are additional
  addresses on the tailnet side.
* "proxy" is the Pod namespace where the firewall rules under test are installed; it forwards.
* "backend" stands in for the cluster: backend servers and cluster workloads live there.

The module is also a script: `python nettopo.py serve|connect|sink|blast ...` is what runs inside
the namespaces (an echo server that reports which address/port it was reached on and who the
peer was, a client for it, and a bounded bulk-transfer pair for throughput measurements).
"""
from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
THIS_FILE = os.path.abspath(__file__)

# TCP_MAXSEG is not exported by every Python build's socket module.
TCP_MAXSEG = getattr(socket, "TCP_MAXSEG", 2)
_IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)  # Linux value; not exported by CPython


class TopologyError(Exception):
    """A namespace/link/address operation failed; the message names the command and its output."""


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 60.0,
         input: str | None = None, env: dict | None = None,
         cwd: str | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              input=input, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        raise TopologyError(f"timed out after {timeout}s: {' '.join(argv)}") from e
    if check and proc.returncode != 0:
        raise TopologyError(f"command failed (rc={proc.returncode}): {' '.join(argv)}\n"
                            f"stdout: {proc.stdout.strip()}\nstderr: {proc.stderr.strip()}")
    return proc


def netns_supported() -> tuple[bool, str]:
    """(ok, reason): whether this process can create network namespaces at all."""
    if os.geteuid() != 0:
        return False, "network-namespace tests need root (euid != 0)"
    name = f"cbtprobe{os.getpid()}{secrets.token_hex(2)}"
    try:
        proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"`ip netns add` unavailable: {e}"
    if proc.returncode != 0:
        return False, f"`ip netns add` failed: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    return True, ""


@dataclass
class Proc:
    """A process started inside a namespace (session leader, so its group can be killed)."""
    ns: str
    argv: list[str]
    popen: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.popen.pid


class Topology:
    """Namespaces, links, addresses and processes with guaranteed teardown (use as a context manager)."""

    def __init__(self, prefix: str | None = None):
        # Short so that "<prefix>-<name>" stays readable; random so parallel runs never collide.
        self.prefix = prefix or f"pt{secrets.token_hex(3)}"
        self.namespaces: list[str] = []
        self.procs: list[Proc] = []
        self._closed = False
        atexit.register(self.close)

    # -- namespaces -------------------------------------------------------------------------
    def ns(self, short: str) -> str:
        """Create namespace `<prefix>-<short>` with lo up and sane defaults; returns its full name."""
        name = f"{self.prefix}-{short}"
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        self.ip(name, "link", "set", "lo", "up")
        # IPv4 conf is inherited from the host namespace; make reverse-path filtering neutral,
        # switch off DAD so IPv6 addresses are usable immediately, and ignore/never send ICMP
        # redirects: a router that forwards a packet back out of the interface it came in on
        # (e.g. before a DNAT rule exists) would otherwise teach the sender a direct route.
        for key, value in (("net.ipv4.conf.all.rp_filter", "0"),
                           ("net.ipv4.conf.default.rp_filter", "0"),
                           ("net.ipv4.conf.all.accept_redirects", "0"),
                           ("net.ipv4.conf.default.accept_redirects", "0"),
                           ("net.ipv4.conf.all.send_redirects", "0"),
                           ("net.ipv4.conf.default.send_redirects", "0"),
                           ("net.ipv6.conf.all.accept_redirects", "0"),
                           ("net.ipv6.conf.default.accept_redirects", "0"),
                           ("net.ipv6.conf.all.accept_dad", "0"),
                           ("net.ipv6.conf.default.accept_dad", "0")):
            self.sysctl(name, key, value)
        return name

    def ip(self, ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(["ip", "-n", ns, *args], check=check)

    def sysctl(self, ns: str, key: str, value: str) -> None:
        self.run(ns, "sysctl", "-q", "-w", f"{key}={value}")

    def forwarding(self, ns: str, v4: bool = True, v6: bool = True) -> None:
        if v4:
            self.sysctl(ns, "net.ipv4.ip_forward", "1")
        if v6:
            self.sysctl(ns, "net.ipv6.conf.all.forwarding", "1")

    # -- links and addresses -------------------------------------------------------------------
    def veth(self, ns_a: str, name_a: str, ns_b: str, name_b: str, *,
             mtu_a: int | None = None, mtu_b: int | None = None) -> None:
        """A veth pair created directly inside the two namespaces (never touches the host's links)."""
        _run(["ip", "link", "add", name_a, "netns", ns_a, "type", "veth",
              "peer", "name", name_b, "netns", ns_b])
        for ns, dev, mtu in ((ns_a, name_a, mtu_a), (ns_b, name_b, mtu_b)):
            if mtu:
                self.ip(ns, "link", "set", dev, "mtu", str(mtu))
            self.ip(ns, "link", "set", dev, "up")

    def dummy(self, ns: str, name: str) -> None:
        """A stand-alone interface named `name`: a dummy, or (no dummy module) one end of a veth pair."""
        r = self.ip(ns, "link", "add", name, "type", "dummy", check=False)
        if r.returncode != 0:
            self.ip(ns, "link", "add", name, "type", "veth", "peer", "name", f"{name[:12]}-pr")
            self.ip(ns, "link", "set", f"{name[:12]}-pr", "up")
        self.ip(ns, "link", "set", name, "up")

    def addr(self, ns: str, dev: str, cidr: str) -> None:
        iface = ipaddress.ip_interface(cidr)
        if iface.version == 6:
            self.ip(ns, "-6", "addr", "add", cidr, "dev", dev, "nodad")
        else:
            self.ip(ns, "addr", "add", cidr, "dev", dev)

    def route(self, ns: str, *spec: str) -> None:
        fam = "-6" if ":" in " ".join(spec) else "-4"
        self.ip(ns, fam, "route", "replace", *spec)

    # -- processes -------------------------------------------------------------------------------
    def run(self, ns: str, *argv: str, check: bool = True, timeout: float = 60.0,
            input: str | None = None, env: dict | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        return _run(["ip", "netns", "exec", ns, *argv], check=check, timeout=timeout,
                    input=input, env=env, cwd=cwd)

    def python(self, ns: str, *args: str, check: bool = True, timeout: float = 60.0,
               env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
        return self.run(ns, sys.executable, *args, check=check, timeout=timeout, env=env, cwd=cwd)

    def spawn(self, ns: str, *argv: str, ready_line: str | None = None,
              ready_timeout: float = 15.0, cwd: str | None = None) -> Proc:
        """Start a long-running process in `ns`; optionally wait (bounded) for a readiness line."""
        full = ["ip", "netns", "exec", ns, *argv]
        popen = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True, cwd=cwd)
        proc = Proc(ns, full, popen)
        self.procs.append(proc)
        if ready_line is not None:
            deadline = time.monotonic() + ready_timeout
            buf = ""
            while time.monotonic() < deadline:
                r, _, _ = select.select([popen.stdout], [], [], 0.2)
                if r:
                    line = popen.stdout.readline()
                    if not line:
                        break
                    buf += line
                    if line.strip() == ready_line:
                        return proc
                elif popen.poll() is not None:
                    break
            err = ""
            if popen.poll() is not None:
                err = popen.stderr.read()
            self.kill(proc)
            raise TopologyError(f"{' '.join(full)} not ready within {ready_timeout}s; "
                                f"stdout={buf!r} stderr={err!r}")
        return proc

    def kill(self, proc: Proc) -> None:
        """Kill one recorded process (its own session/group, by id) and reap it."""
        if proc.popen.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (proc.popen.stdout, proc.popen.stderr):
            if stream:
                stream.close()

    def serve(self, ns: str, node: str, *, tcp: Sequence[int] = (), udp: Sequence[int] = (),
              sink: Sequence[int] = ()) -> Proc:
        """Echo server in `ns`: every TCP/UDP port answers with a JSON report (see `_serve`)."""
        args = [sys.executable, THIS_FILE, "serve", "--node", node]
        for p in tcp:
            args += ["--tcp", str(p)]
        for p in udp:
            args += ["--udp", str(p)]
        for p in sink:
            args += ["--sink", str(p)]
        return self.spawn(ns, *args, ready_line="READY")

    def http_server(self, ns: str, port: int, directory: str | None = None) -> Proc:
        """A plain `python -m http.server` bound to all addresses, polled until it answers locally."""
        argv = [sys.executable, "-m", "http.server", str(port), "--bind", "::"]
        if directory:
            argv += ["--directory", directory]
        proc = self.spawn(ns, *argv)
        for _ in range(50):
            r = self.run(ns, "curl", "-s", "-o", "/dev/null", "-m", "1",
                         f"http://[::1]:{port}/", check=False)
            if r.returncode == 0:
                return proc
            time.sleep(0.1)   # poll: until the server answers
        raise TopologyError(f"http.server on port {port} in {ns} did not come up")

    def connect(self, ns: str, host: str, port: int, *, proto: str = "tcp", count: int = 1,
                timeout: float = 3.0, src: str | None = None, sport: int = 0) -> list[dict]:
        """Connect `count` times from `ns`; one report dict per attempt ({"error": ...} on failure).

        `sport` pins the source port (UDP: reuse one flow across calls, as a DNS client or a
        WireGuard peer would)."""
        args = [THIS_FILE, "connect", "--host", str(host), "--port", str(port),
                "--proto", proto, "--count", str(count), "--timeout", str(timeout)]
        if src:
            args += ["--src", src]
        if sport:
            args += ["--sport", str(sport)]
        r = self.python(ns, *args, timeout=30 + count * (timeout + 1))
        return json.loads(r.stdout)

    def blast(self, ns: str, host: str, port: int, *, megabytes: int,
              timeout: float = 60.0) -> dict:
        """Bounded bulk transfer to a `sink` port; returns bytes and seconds as seen by the sender."""
        r = self.python(ns, THIS_FILE, "blast", "--host", str(host), "--port", str(port),
                        "--megabytes", str(megabytes), "--timeout", str(timeout),
                        timeout=timeout + 30)
        return json.loads(r.stdout)

    def conn_rate(self, ns: str, host: str, port: int, *, count: int, timeout: float = 5.0) -> dict:
        """`count` sequential TCP connections to a `sink` port (connect, half-close, read the reply,
        close): {"count", "errors", "seconds"} as timed inside the namespace. Every connection is a
        new conntrack entry, so this is where per-connection NAT rule evaluation shows."""
        r = self.python(ns, THIS_FILE, "rate", "--host", str(host), "--port", str(port),
                        "--count", str(count), "--timeout", str(timeout),
                        timeout=30 + count * (timeout + 0.1))
        return json.loads(r.stdout)

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in reversed(self.procs):
            self.kill(proc)
        self.procs.clear()
        for ns in reversed(self.namespaces):
            # Any process we did not start cannot be in these namespaces, so deletion frees them.
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.namespaces.clear()
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def __enter__(self) -> "Topology":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the standard three-namespace proxy layout --------------------------------------------------

@dataclass(frozen=True)
class FamilyAddrs:
    """Addresses of one IP family in a ProxyLab."""
    version: int
    proxy_tailnet: str          # proxy's own tailnet address (on tailscale0)
    tailnet_peer: str           # the tailnet namespace's primary address (clients start here)
    targets: tuple[str, ...]    # extra tailnet addresses: egress targets
    proxy_cluster: str          # proxy's cluster-side address (on eth1)
    backends: tuple[str, ...]   # backend addresses in the backend namespace
    workload: str               # address the backend-namespace clients use as source
    tailnet_prefix: int
    cluster_prefix: int


V4 = FamilyAddrs(4, "100.64.0.5", "100.64.0.1", ("100.99.99.1", "100.99.99.2", "100.99.99.3"),
                 "10.200.0.1", ("10.200.0.11", "10.200.0.12", "10.200.0.13"), "10.200.0.2", 10, 24)
V6 = FamilyAddrs(6, "fd7a:115c:a1e0::5", "fd7a:115c:a1e0::1",
                 ("fd7a:115c:a1e0::99:1", "fd7a:115c:a1e0::99:2", "fd7a:115c:a1e0::99:3"),
                 "fd00:200::1", ("fd00:200::11", "fd00:200::12", "fd00:200::13"), "fd00:200::2", 48, 64)


@dataclass
class ProxyLab:
    """tailnet <-> proxy <-> backend, both families, forwarding on in the proxy only."""
    topo: Topology
    tailnet: str
    proxy: str
    backend: str
    tun_mtu: int
    families: dict[int, FamilyAddrs] = field(default_factory=lambda: {4: V4, 6: V6})

    @classmethod
    def build(cls, topo: Topology, *, tun_mtu: int = 1280, extra_targets: Sequence[str] = ()) -> "ProxyLab":
        tn, px, be = topo.ns("tn"), topo.ns("px"), topo.ns("be")
        # The proxy side of the tailnet link has tailscaled's MTU (1280); the far side keeps 1500 so
        # that MSS clamping by the proxy is observable from the endpoints.
        topo.veth(px, "tailscale0", tn, "tn0", mtu_a=tun_mtu, mtu_b=1500)
        topo.veth(px, "eth1", be, "be0")
        for fa in (V4, V6):
            topo.addr(px, "tailscale0", f"{fa.proxy_tailnet}/{fa.tailnet_prefix}")
            topo.addr(tn, "tn0", f"{fa.tailnet_peer}/{fa.tailnet_prefix}")
            host = 32 if fa.version == 4 else 128
            for t in fa.targets:
                topo.addr(tn, "tn0", f"{t}/{host}")
            topo.addr(px, "eth1", f"{fa.proxy_cluster}/{fa.cluster_prefix}")
            topo.addr(be, "be0", f"{fa.workload}/{fa.cluster_prefix}")
            for b in fa.backends:
                topo.addr(be, "be0", f"{b}/{fa.cluster_prefix}")
        for t in extra_targets:
            ip = ipaddress.ip_address(t)
            topo.addr(tn, "tn0", f"{t}/{32 if ip.version == 4 else 128}")
        topo.forwarding(px)
        # Neither the tailnet nor the backend namespace gets a route to the other side: replies
        # only work when the proxy NATs, which is exactly what the tests want to observe.
        return cls(topo, tn, px, be, tun_mtu)

    def fam(self, version: int) -> FamilyAddrs:
        return self.families[version]


# -- in-namespace programs (run as `python nettopo.py ...`) --------------------------------------

def _norm(addr: str) -> str:
    ip = ipaddress.ip_address(addr.split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped:
        return str(ip.ipv4_mapped)
    return str(ip)


def _dual_stack_socket(kind: int, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET6, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port))
    return s


def _serve(node: str, tcp: list[int], udp: list[int], sink: list[int]) -> None:
    """Echo/sink server. TCP: after one line from the client, answer one JSON line
    {node, proto, local, lport, peer, pport, mss} (mss = TCP_MAXSEG of the accepted socket, i.e.
    what this end will send, bounded by the MSS the peer advertised). UDP: same report per datagram.
    Sink: read until EOF, answer {"bytes": n}."""
    def tcp_conn(conn: socket.socket, lport: int) -> None:
        try:
            conn.settimeout(10)
            peer = conn.getpeername()
            local = conn.getsockname()
            conn.recv(1024)
            rep = {"node": node, "proto": "tcp", "local": _norm(local[0]), "lport": lport,
                   "peer": _norm(peer[0]), "pport": peer[1],
                   "mss": conn.getsockopt(socket.IPPROTO_TCP, TCP_MAXSEG)}
            conn.sendall((json.dumps(rep) + "\n").encode())
        except OSError:
            pass
        finally:
            conn.close()

    def sink_conn(conn: socket.socket) -> None:
        try:
            conn.settimeout(60)
            n = 0
            while True:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                n += len(chunk)
            conn.sendall((json.dumps({"bytes": n}) + "\n").encode())
        except OSError:
            pass
        finally:
            conn.close()

    def tcp_loop(s: socket.socket, lport: int, handler) -> None:
        while True:
            conn, _ = s.accept()
            threading.Thread(target=handler, args=(conn, lport) if handler is tcp_conn else (conn,),
                             daemon=True).start()

    def udp_loop(s: socket.socket, lport: int) -> None:
        # Reply from the address the datagram was sent to (IP_PKTINFO / IPV6_PKTINFO), otherwise
        # the kernel picks a source by route and NATed replies would not match their conntrack entry.
        v6 = s.family == socket.AF_INET6
        while True:
            data, anc, _flags, peer = s.recvmsg(2048, socket.CMSG_SPACE(64))
            dst = None
            for level, typ, cdata in anc:
                if v6 and level == socket.IPPROTO_IPV6 and typ == socket.IPV6_PKTINFO:
                    dst = socket.inet_ntop(socket.AF_INET6, cdata[:16])
                elif not v6 and level == socket.IPPROTO_IP and typ == _IP_PKTINFO:
                    dst = socket.inet_ntop(socket.AF_INET, cdata[8:12])
            rep = {"node": node, "proto": "udp", "local": dst and _norm(dst), "lport": lport,
                   "peer": _norm(peer[0]), "pport": peer[1]}
            payload = (json.dumps(rep) + "\n").encode()
            cmsg = []
            if dst and v6:
                cmsg = [(socket.IPPROTO_IPV6, socket.IPV6_PKTINFO,
                         socket.inet_pton(socket.AF_INET6, dst) + b"\0\0\0\0")]
            elif dst:
                cmsg = [(socket.IPPROTO_IP, _IP_PKTINFO,
                         b"\0\0\0\0" + socket.inet_pton(socket.AF_INET, dst) + b"\0\0\0\0")]
            s.sendmsg([payload], cmsg, 0, peer)

    threads = []
    for p in tcp:
        s = _dual_stack_socket(socket.SOCK_STREAM, p)
        s.listen(128)
        threads.append(threading.Thread(target=tcp_loop, args=(s, p, tcp_conn), daemon=True))
    for p in sink:
        s = _dual_stack_socket(socket.SOCK_STREAM, p)
        s.listen(16)
        threads.append(threading.Thread(target=tcp_loop, args=(s, p, sink_conn), daemon=True))
    for p in udp:
        s4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s4.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s4.setsockopt(socket.IPPROTO_IP, _IP_PKTINFO, 1)
        s4.bind(("0.0.0.0", p))
        s6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
        s6.bind(("::", p))
        for s in (s4, s6):
            threads.append(threading.Thread(target=udp_loop, args=(s, p), daemon=True))
    for t in threads:
        t.start()
    print("READY", flush=True)
    # Bounded lifetime even if teardown were skipped somehow (one hour).
    time.sleep(3600)   # not a wait: the helper program's bounded lifetime


def _connect_once(host: str, port: int, proto: str, timeout: float, src: str | None,
                  sport: int = 0) -> dict:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        if proto == "tcp":
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                if src or sport:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((src or "", sport))
                s.connect((host, port))
                client_mss = s.getsockopt(socket.IPPROTO_TCP, TCP_MAXSEG)
                s.sendall(b"hello\n")
                buf = b""
                while not buf.endswith(b"\n") and len(buf) < 65536:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    buf += chunk
            rep = json.loads(buf.decode())
            rep["client_mss"] = client_mss
            return rep
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout)
            if src or sport:
                s.bind((src or "", sport))
            s.sendto(b"hello\n", (host, port))
            data, peer = s.recvfrom(65536)
            rep = json.loads(data.decode())
            rep["reply_from"] = _norm(peer[0])
            return rep
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _blast(host: str, port: int, megabytes: int, timeout: float) -> dict:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    chunk = b"\0" * (1 << 20)
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        t0 = time.perf_counter()
        s.connect((host, port))
        for _ in range(megabytes):
            s.sendall(chunk)
        s.shutdown(socket.SHUT_WR)
        buf = b""
        while not buf.endswith(b"\n") and len(buf) < 4096:
            part = s.recv(4096)
            if not part:
                break
            buf += part
        elapsed = time.perf_counter() - t0
    rep = json.loads(buf.decode())
    return {"bytes": rep["bytes"], "sent": megabytes << 20, "seconds": elapsed}


def _rate(host: str, port: int, count: int, timeout: float) -> dict:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    errors = 0
    t0 = time.perf_counter()
    for _ in range(count):
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect((host, port))
                s.shutdown(socket.SHUT_WR)
                buf = b""
                while not buf.endswith(b"\n") and len(buf) < 4096:
                    part = s.recv(4096)
                    if not part:
                        break
                    buf += part
                if not buf:
                    errors += 1
        except OSError:
            errors += 1
    return {"count": count, "errors": errors, "seconds": time.perf_counter() - t0}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nettopo")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sv = sub.add_parser("serve")
    sv.add_argument("--node", required=True)
    sv.add_argument("--tcp", type=int, action="append", default=[])
    sv.add_argument("--udp", type=int, action="append", default=[])
    sv.add_argument("--sink", type=int, action="append", default=[])
    cn = sub.add_parser("connect")
    cn.add_argument("--host", required=True)
    cn.add_argument("--port", type=int, required=True)
    cn.add_argument("--proto", choices=("tcp", "udp"), default="tcp")
    cn.add_argument("--count", type=int, default=1)
    cn.add_argument("--timeout", type=float, default=3.0)
    cn.add_argument("--src")
    cn.add_argument("--sport", type=int, default=0)
    bl = sub.add_parser("blast")
    bl.add_argument("--host", required=True)
    bl.add_argument("--port", type=int, required=True)
    bl.add_argument("--megabytes", type=int, required=True)
    bl.add_argument("--timeout", type=float, default=60.0)
    rt = sub.add_parser("rate")
    rt.add_argument("--host", required=True)
    rt.add_argument("--port", type=int, required=True)
    rt.add_argument("--count", type=int, required=True)
    rt.add_argument("--timeout", type=float, default=5.0)
    a = ap.parse_args(argv)
    if a.cmd == "rate":
        print(json.dumps(_rate(a.host, a.port, max(1, min(a.count, 100000)), a.timeout)))
    elif a.cmd == "serve":
        _serve(a.node, a.tcp, a.udp, a.sink)
    elif a.cmd == "connect":
        out = [_connect_once(a.host, a.port, a.proto, a.timeout, a.src, a.sport)
               for _ in range(max(0, min(a.count, 10000)))]
        print(json.dumps(out))
    elif a.cmd == "blast":
        print(json.dumps(_blast(a.host, a.port, a.megabytes, a.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
