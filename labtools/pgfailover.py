"""ProxyGroup failover on two nodes: the scenario that netns-tests/test_pg_failover_twonode.py asserts and
bench/pgfailover.py measures.

A two-node lab cluster (labtools.kubecluster ``nodes=2``: the replicas land on different nodes), the controller
installed from deploy/ with the headscale provider, a ProxyGroup of 2 (type egress) and an egress Service on it
for a TCP echo server on the lab's tailnet node ``client`` (it answers each line with the peer's address: the
replica's tailnet IP, so every answer says which replica carried it). A client Pod on the first node:

* opens a NEW connection to the Service every 0.2 s (2 s timeout) and logs ``<t> new ok <peer>`` or
  ``<t> new fail <error> <seconds it took>`` (``ConnectionRefusedError``: refused at once or at a SYN's
  retransmission; ``TimeoutError``: the client's own 2 s timeout);
* holds one connection through each replica and sends a line on each every 0.5 s: ``<t> held <peer> <port>
  ok|fail``; a broken one is replaced by a new connection (a new local port) until both replicas are held.

The cases (each on a group with both replicas serving, and returning a :class:`CaseResult`):

* ``delete_pod``: ``kubectl delete pod`` of one replica (its pre-stop drain, the StatefulSet's new Pod);
* ``kill_tailscaled``: SIGKILL to one replica's tailscaled (the container restarts);
* ``lose_node``: the second node cut off (island link down, kubelet stopped): its replica lives on, unreachable.
  It stops answering the controller's health probes and leaves the EndpointSlice within seconds
  (controller/replicahealth.py), long before Kubernetes marks the node unreachable (the cluster's node-loss
  timing, ``KubeCluster.start(node_loss=...)``: Kubernetes' defaults, 50 s and 300 s, unless given).

And one case that takes nothing out: ``lossy_link`` drops a share of the packets crossing the second node's link
(both directions) for a while (:func:`lossy_link`: nftables ``numgen random`` at the ingress of each end of the
link, as a lossy wire would, since the kernel has no netem), watching the EndpointSlice: a replica that still
answers must not flap out of it. It returns a :class:`LossyResult`.

Each case ends on an event, never after a fixed time: the victim serving new connections again (cases a, b), or
ten consecutive successes after the victim left the EndpointSlice (case c).
"""
from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from labtools import kubecluster, kubecontroller
from labtools.lab import Lab, wait_until

PG = "ha"
PREFIX = "ha"
NS = "fo"
SVC = "echo"
PORT = 18100

#: the client Pod's program (see the module docstring)
CLIENT = r'''
import socket, threading, time
HOST, PORT = "echo", {port}
lock = threading.Lock()

def out(*a):
    with lock:
        print(f"{{time.time():.3f}}", *a, flush=True)

def ask(s):
    s.sendall(b"ping\n")
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(256)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf.split()[0].decode()

def held():
    socks = {{}}
    while True:
        t = time.time()
        for peer, s in list(socks.items()):
            try:
                ask(s)
                out("held", peer, s.getsockname()[1], "ok")
            except Exception as e:
                out("held", peer, s.getsockname()[1], "fail", type(e).__name__)
                s.close()
                del socks[peer]
        if len(socks) < 2:
            try:
                s = socket.create_connection((HOST, PORT), timeout=2)
                peer = ask(s)
                if peer in socks:
                    s.close()
                else:
                    socks[peer] = s
            except Exception:
                pass
        time.sleep(max(0.0, 0.5 - (time.time() - t)))

threading.Thread(target=held, daemon=True).start()
while True:
    t = time.time()
    try:
        with socket.create_connection((HOST, PORT), timeout=2) as s:
            s.settimeout(2)
            peer = ask(s)
        line = f"{{t:.3f}} new ok {{peer}}"
    except Exception as e:
        line = f"{{t:.3f}} new fail {{type(e).__name__}} {{time.time() - t:.3f}}"
    with lock:   # one line at a time: the held connections' thread writes too
        print(line, flush=True)
    time.sleep(max(0.0, 0.2 - (time.time() - t)))
'''


# --------------------------------------------------------------------------------------------------------
# the client's log, pure
# --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Attempt:
    t: float
    ok: bool
    peer: str            # the replica's tailnet IP ("" for a failure)
    error: str = ""      # a failure's exception name (TimeoutError: the client's own timeout)


@dataclass(frozen=True)
class Held:
    t: float
    peer: str
    port: int            # the client's local port: one held connection
    ok: bool


def parse_log(text: str) -> tuple[list[Attempt], list[Held]]:
    new: list[Attempt] = []
    held: list[Held] = []
    for line in text.splitlines():
        p = line.split()
        try:
            if len(p) >= 4 and p[1] == "new":
                new.append(Attempt(float(p[0]), p[2] == "ok", p[3] if p[2] == "ok" else "",
                                   "" if p[2] == "ok" else p[3]))
            elif len(p) >= 5 and p[1] == "held":
                held.append(Held(float(p[0]), p[2], int(p[3]), p[4] == "ok"))
        except ValueError:
            continue
    return new, held


def longest_gap(attempts: list[Attempt], start: float, end: float) -> float:
    """The longest time between two successful new connections around [start, end]: from the last success at
    or before ``start`` to the first at or after ``end``."""
    oks = sorted(a.t for a in attempts if a.ok)
    before = [t for t in oks if t <= start]
    after = [t for t in oks if t >= end]
    inside = [t for t in oks if start < t < end]
    pts = before[-1:] + inside + after[:1]
    return max((b - a for a, b in zip(pts, pts[1:], strict=False)), default=float("inf"))


@dataclass(frozen=True)
class CaseResult:
    case: str
    victim: str                  # the replica Pod
    victim_ip: str
    survivor_ip: str
    start: float                 # the event (wall clock)
    end: float                   # the case's closing event
    gap_s: float                 # longest time between successful new connections over the case
    new_ok: int                  # new connections over the case
    new_fail: int
    new_timed_out: int           # ... of the failures, those that waited for the client's 2 s timeout
    new_ok_survivor: int         # successes through the surviving replica while the victim was out
    held_port: int               # the connection through the survivor held from before the event
    held_ok_after: bool          # ... answered after the victim was back (or gone for good)
    held_failed: bool            # ... broke during the case
    events: dict[str, float] = field(default_factory=dict)   # seconds after start


def judge(case: str, victim: str, victim_ip: str, survivor_ip: str, start: float, out_end: float, end: float,
          text: str, events: dict[str, float] | None = None, *, survivor_until: float | None = None) -> CaseResult:
    """The figures of one case from the client's log: ``out_end`` is when the victim was back (or gone for
    good), ``end`` the case's closing event; the successes through the survivor are counted until
    ``survivor_until`` (default ``out_end``: a victim that is back takes new connections again)."""
    survivor_until = out_end if survivor_until is None else survivor_until
    new, held = parse_log(text)
    window = [a for a in new if start <= a.t <= end]
    before = [h for h in held if h.peer == survivor_ip and h.t < start and h.ok]
    port = before[-1].port if before else -1
    mine = [h for h in held if h.port == port]
    return CaseResult(
        case, victim, victim_ip, survivor_ip, start, end, longest_gap(new, start, end),
        sum(a.ok for a in window), sum(not a.ok for a in window),
        sum(not a.ok and a.error == "TimeoutError" for a in window),
        sum(1 for a in window if a.ok and a.peer == survivor_ip and a.t <= survivor_until),
        port, any(h.ok and h.t >= out_end for h in mine), any(not h.ok for h in mine if h.t >= start),
        dict(events or {}))


#: case (b): what the killed replica's agent logs at each step of its exit (containerboot), and what the
#: controller logs when its probe takes a replica out (controller.replicaprober)
AGENT_STEPS = (("agent_noticed", "tailscaled exited unexpectedly"),
               ("rules_removed", "Removed the agent's firewall rules"),
               ("conntrack_flushed", "conntrack entries of connections the removed rules had translated"),
               ("health_closed", "HTTP server at "))


def _stamp(line: str) -> float | None:
    """The container runtime's RFC 3339 stamp at the start of a ``kubectl logs --timestamps`` line."""
    from datetime import datetime, timezone
    head = line.split(" ", 1)[0].rstrip("Z")
    whole, _, frac = head.partition(".")
    try:
        t = datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None
    return t + (float(f"0.{frac}") if frac.isdigit() else 0.0)


def death_steps(agent_log: str, controller_log: str, victim: str, start: float) -> dict[str, float]:
    """The first time (seconds after ``start``) each of ``AGENT_STEPS`` appears in the agent's log after
    ``start``, and ``probe_out`` when the controller's log says its probe took ``victim`` out."""
    out: dict[str, float] = {}
    for line in agent_log.splitlines():
        t = _stamp(line)
        if t is None or t < start:
            continue
        for key, text in AGENT_STEPS:
            if key not in out and text in line:
                out[key] = t - start
    for line in controller_log.splitlines():
        t = _stamp(line)
        if t is not None and t >= start and f"replica {victim} " in line and "leaves the egress" in line:
            out.setdefault("probe_out", t - start)
    return out


def in_slice(eps: dict, pod_ip: str) -> bool:
    """Whether an EndpointSlice serves ``pod_ip``: listed, and not marked not ready."""
    return any(pod_ip in (e.get("addresses") or []) and (e.get("conditions") or {}).get("ready") is not False
               for e in eps.get("endpoints") or [])


def watched_slices(text: str) -> list[dict]:
    """The objects of ``kubectl get --watch -o json``'s output (JSON documents one after the other; a
    partial last one is left out)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out
        out.append(obj)


def membership_changes(states: list[bool]) -> tuple[int, int]:
    """(changes, removals) of a replica's membership along successive states of a slice."""
    pairs = list(zip(states, states[1:], strict=False))
    return sum(a != b for a, b in pairs), sum(a and not b for a, b in pairs)


#: the nftables table of the lossy link (one in each namespace at the ends of the link)
LOSSY_TABLE = "lossylab"


def lossy_ruleset(device: str, percent: int) -> str:
    """A table dropping ``percent`` % of the packets arriving on ``device``, at random, before anything else
    sees them (a netdev ingress hook: the sender sees no error, as with a lossy wire); counters before and
    after the drop measure the loss."""
    if not 0 <= percent <= 100:
        raise ValueError(f"percent={percent}: give a share of packets from 0 to 100")
    return (f"table netdev {LOSSY_TABLE} {{\n chain ingress {{\n"
            f"  type filter hook ingress device \"{device}\" priority -500; policy accept\n"
            f"  counter numgen random mod 100 < {percent} counter drop\n }}\n}}\n")


def lossy_counts(listing: str) -> tuple[int, int]:
    """(packets seen, packets dropped) from ``nft list table`` of :func:`lossy_ruleset`'s table."""
    n = [int(x) for x in re.findall(r"counter packets (\d+)", listing)]
    if len(n) != 2:
        raise ValueError(f"no two counters in the lossy table's listing: {listing!r}")
    return n[0], n[1]


@contextlib.contextmanager
def lossy_link(kc: kubecluster.KubeCluster, node: str, percent: int) -> Iterator[Callable[[], dict[str, float]]]:
    """``percent`` % of the packets crossing ``node``'s link to the island dropped, in each direction: a table
    at the ingress of the node's ``eth0`` (into the node) and one at the ingress of the island's end of the link
    (out of the node). Yields a function giving each direction's measured loss so far (``in``, ``out``: dropped
    / seen) and the packets seen; the tables are always removed on the way out."""
    ends = [(kc._node_netns[node], "eth0", "in"), (kc.lab.namespaces["sw"].netns, kc._node_links[node], "out")]
    added: list[str] = []

    def nft(netns: str, *args: str, input: str | None = None) -> str:
        return subprocess.run(["ip", "netns", "exec", netns, "nft", *args], input=input, text=True,
                              capture_output=True, check=True, timeout=30).stdout

    def measured() -> dict[str, float]:
        out: dict[str, float] = {}
        for netns, _, way in ends:
            seen, dropped = lossy_counts(nft(netns, "list", "table", "netdev", LOSSY_TABLE))
            out[f"{way}_seen"] = seen
            out[way] = dropped / seen if seen else 0.0
        return out
    try:
        for netns, device, _ in ends:
            nft(netns, "-f", "-", input=lossy_ruleset(device, percent))
            added.append(netns)
        yield measured
    finally:
        for netns in added:
            subprocess.run(["ip", "netns", "exec", netns, "nft", "delete", "table", "netdev", LOSSY_TABLE],
                           capture_output=True, timeout=30)


@dataclass(frozen=True)
class LossyResult:
    victim: str                  # the replica Pod behind the lossy link
    percent: int                 # packets dropped in each direction, asked
    duration_s: float
    loss_in: float               # measured: dropped / seen, into the node
    loss_out: float              # ... out of the node
    packets: int                 # packets that crossed (or tried to) the link, both directions
    slice_states: int            # versions of the EndpointSlice seen by the watch
    slice_changes: int           # changes of the replica's membership over them
    slice_removals: int          # ... of which it left
    probe_out_logged: int        # the controller's log lines taking the replica out over the window
    new_ok: int                  # new connections through the Service over the window
    new_fail: int
    first_ok_after_s: float      # the link clean again -> the first successful new connection


# --------------------------------------------------------------------------------------------------------
# the scenario, on a real cluster
# --------------------------------------------------------------------------------------------------------

def echo_serve(addr: str, port: int) -> int:
    """A TCP server answering each line with ``<peer address> <line>`` (run inside the tailnet node's
    namespace)."""
    import socketserver

    class H(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            for line in self.rfile:
                self.wfile.write(f"{self.client_address[0]} ".encode() + line)

    class S(socketserver.ThreadingTCPServer):
        allow_reuse_address = True
        daemon_threads = True

    with S((addr, port), H) as srv:
        print(f"listening on {addr}:{port}", flush=True)
        srv.serve_forever()
    return 0


class Scenario:
    """One two-node cluster with the controller, the group, the Service and the client Pod (see the module
    docstring). ``Scenario.start(lab, kc, images)``; cases with ``delete_pod()``, ``kill_tailscaled()``,
    ``lose_node()``; ``stop()``."""

    def __init__(self, lab: Lab, kc: kubecluster.KubeCluster) -> None:
        self.lab, self.kc = lab, kc
        self.procs: list[subprocess.Popen] = []
        self.figures: dict[str, float] = {}
        self.target = ""

    # ------------------------------------------------------------------ set-up
    @classmethod
    def start(cls, lab: Lab, kc: kubecluster.KubeCluster, images: tuple[Any, Any], *,
              timeout: float = 240.0) -> "Scenario":
        sc = cls(lab, kc)
        try:
            sc._start(images, timeout)
        except BaseException:
            sc.stop()
            raise
        return sc

    def _start(self, images: tuple[Any, Any], timeout: float) -> None:
        lab, kc = self.lab, self.kc
        c4, _ = lab.tailnet_ips("client")
        assert c4
        self.target = c4
        self.procs.append(subprocess.Popen(
            ["ip", "netns", "exec", lab.netns("client"), sys.executable, "-m", "labtools.pgfailover", "echo-serve",
             c4, str(PORT)], env={"PYTHONPATH": str(kubecontroller.REPO), "PATH": kubecluster.SYS_PATH},
            stdout=open(kc.run_dir / "echo-server.log", "w"), stderr=subprocess.STDOUT))
        kc.wait_dns()    # the client Pod finds the egress Service by name (CoreDNS, on the first node)
        # the controller on the first node: losing the second node then loses a replica, not the controller too
        # (which a real cluster would run with replicas of its own)
        kc.kubectl("cordon", kc.nodes[1])
        kubecontroller.install(kc, lab, *images, firewall=lab.firewall_mode, method="kubectl")
        kc.kubectl("uncordon", kc.nodes[1])
        t0 = time.monotonic()
        kc.apply({"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyGroup", "metadata": {"name": PG},
                  "spec": {"type": "egress", "replicas": 2, "hostnamePrefix": PREFIX}})
        wait_until(self._group_ready, timeout, 1, "the ProxyGroup ready with 2 devices")
        self.figures["group_ready_s"] = time.monotonic() - t0
        kc.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
                  {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client", "namespace": NS},
                   "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                            "nodeName": kc.nodes[0],
                            "containers": [{"name": "c", "image": kubecontroller.PROXY_IMAGE,
                                            "imagePullPolicy": "Never",
                                            "command": ["python3", "-u", "-c", CLIENT.format(port=PORT)]}]}}])
        kc.wait_pod_ready(NS, "client")
        t_svc = time.time()
        kc.apply({"apiVersion": "v1", "kind": "Service",
                  "metadata": {"name": SVC, "namespace": NS, "annotations": {
                      "tailscale.com/proxy-group": PG, "tailscale.com/tailnet-ip": c4}},
                  "spec": {"type": "ExternalName", "externalName": "placeholder",
                           "ports": [{"name": "echo", "port": PORT, "protocol": "TCP"}]}})
        first = wait_until(lambda: next((a for a in self.new() if a.ok and a.t >= t_svc), None), timeout, 0.5,
                           "a first successful connection through the egress Service")
        self.figures["service_to_first_success_s"] = first.t - t_svc
        self.wait_both_serving(timeout)

    def _group_ready(self) -> dict | None:
        g = self.kc.get("proxygroup", PG) or {}
        conds = {c["type"]: c for c in (g.get("status") or {}).get("conditions") or []}
        ok = conds.get("ProxyGroupReady", {}).get("status") == "True"
        return g if ok and len((g.get("status") or {}).get("devices") or []) == 2 else None

    # ------------------------------------------------------------------ observations
    def log(self) -> str:
        return self.kc.kubectl("-n", NS, "logs", "client", check=False, timeout=30).stdout

    def new(self) -> list[Attempt]:
        return parse_log(self.log())[0]

    def replicas(self) -> dict[str, dict[str, str]]:
        """Replica Pod name → its node, Pod IP and tailnet IPv4 (from the group's status)."""
        g = self.kc.get("proxygroup", PG) or {}
        ips = {d["hostname"].split(".")[0]: next((i for i in d.get("tailnetIPs") or [] if ":" not in i), "")
               for d in (g.get("status") or {}).get("devices") or []}
        pods = json.loads(self.kc.kubectl("-n", kubecontroller.NS, "get", "pods", "-l",
                                          f"tailscale.com/parent-resource={PG}", "-o", "json").stdout)["items"]
        out = {}
        for p in pods:
            name = p["metadata"]["name"]
            idx = name.rsplit("-", 1)[1]
            out[name] = {"node": p["spec"].get("nodeName", ""), "pod_ip": (p.get("status") or {}).get("podIP", ""),
                         "tailnet_ip": ips.get(f"{PREFIX}-{idx}", ""), "uid": p["metadata"]["uid"]}
        return out

    def slice_addresses(self) -> set[str]:
        s = self.kc.get("service", SVC, NS) or {}
        target = (s.get("spec") or {}).get("externalName", "").split(".")[0]
        eps = self.kc.get("endpointslice", f"{target}-ipv4", kubecontroller.NS) or {}
        return {a for e in eps.get("endpoints") or [] for a in e.get("addresses") or []}

    def wait_both_serving(self, timeout: float = 240.0) -> dict[str, dict[str, str]]:
        """Both replicas in the EndpointSlice, new connections through each, a held connection through each."""
        def pred():
            reps = self.replicas()
            if len(reps) != 2 or self.slice_addresses() != {r["pod_ip"] for r in reps.values()}:
                return None
            new, held = parse_log(self.log())
            since = max((a.t for a in new), default=0) - 10
            peers = {r["tailnet_ip"] for r in reps.values()}
            fresh_new = {a.peer for a in new if a.ok and a.t > since}
            # a held connection counts when its replica's latest line is ok: one that broke moments ago (a
            # previous case's victim) must be replaced before the next case starts
            last = {h.peer: h for h in held}
            fresh_held = {p for p, h in last.items() if h.ok and h.t > since}
            return reps if peers <= fresh_new and peers <= fresh_held else None
        return wait_until(pred, timeout, 1, "both replicas serving new and held connections")

    # ------------------------------------------------------------------ the cases
    def _victim(self, node_index: int) -> tuple[str, dict[str, str], dict[str, str]]:
        reps = self.wait_both_serving()
        node = self.kc.nodes[node_index]
        victim = next(n for n, r in reps.items() if r["node"] == node)
        survivor = next(r for n, r in reps.items() if n != victim)
        return victim, reps[victim], survivor

    def _back(self, victim_ip: str, after: float, timeout: float) -> float:
        a = wait_until(lambda: next((a for a in self.new() if a.ok and a.peer == victim_ip and a.t > after), None),
                       timeout, 0.5, f"new connections through the victim ({victim_ip}) again")
        return a.t

    def _close(self, out_end: float, timeout: float) -> float:
        """The case's closing event: a held connection through the survivor answered after ``out_end``."""
        def pred():
            _, held = parse_log(self.log())
            return next((h.t for h in held if h.ok and h.t > out_end + 1), None)
        return wait_until(pred, timeout, 0.5, "a held connection answering after the case")

    def delete_pod(self, timeout: float = 240.0) -> CaseResult:
        victim, v, s = self._victim(1)
        start = time.time()
        self.kc.kubectl("-n", kubecontroller.NS, "delete", "pod", victim, "--wait=false")
        events: dict[str, float] = {}
        wait_until(lambda: v["pod_ip"] not in self.slice_addresses(), timeout, 0.2, "the victim out of the slice")
        events["left_slice"] = time.time() - start

        def replaced() -> bool:
            r = self.replicas().get(victim)
            return bool(r and r["uid"] != v["uid"] and r["pod_ip"] and r["pod_ip"] in self.slice_addresses())
        wait_until(replaced, timeout, 0.5, f"{victim}'s new Pod in the EndpointSlice")
        t_new = time.time()
        events["new_pod_in_slice"] = t_new - start
        back = self._back(v["tailnet_ip"], t_new, timeout)
        events["back"] = back - start
        end = self._close(back, timeout)
        return judge("delete_pod", victim, v["tailnet_ip"], s["tailnet_ip"], start, back, end, self.log(), events)

    def kill_tailscaled(self, timeout: float = 240.0) -> CaseResult:
        victim, v, s = self._victim(0)
        kill = ("import os, signal\n"
                "for p in os.listdir('/proc'):\n"
                "    try:\n"
                "        if p.isdigit() and open(f'/proc/{p}/comm').read().strip() == 'tailscaled':\n"
                "            os.kill(int(p), signal.SIGKILL); print('killed', p)\n"
                "    except OSError:\n"
                "        pass\n")
        start = time.time()
        cp = self.kc.kubectl("-n", kubecontroller.NS, "exec", victim, "-c", "tailscale", "--", "python3", "-c", kill)
        if "killed" not in cp.stdout:
            raise AssertionError(f"no tailscaled found in {victim}: {cp.stdout}{cp.stderr}")
        killed = time.time()
        wait_until(lambda: v["pod_ip"] not in self.slice_addresses(), timeout, 0.1, "the victim out of the slice")
        events = {"killed": killed - start, "left_slice": time.time() - start}
        back = self._back(v["tailnet_ip"], killed, timeout)
        events["back"] = back - start
        events.update(self._death_steps(victim, start))
        events = dict(sorted(events.items(), key=lambda kv: kv[1]))
        end = self._close(back, timeout)
        return judge("kill_tailscaled", victim, v["tailnet_ip"], s["tailnet_ip"], start, back, end, self.log(),
                     events)

    def _death_steps(self, victim: str, start: float) -> dict[str, float]:
        """When the killed replica's agent noticed tailscaled's exit, removed its rules, flushed their conntrack
        entries and closed its health port (its previous container's log, stamped by the container runtime), and
        when the controller's probe took it out (the controller's log), in seconds after ``start``."""
        prev = self.kc.kubectl("-n", kubecontroller.NS, "logs", victim, "-c", "tailscale", "--previous",
                               "--timestamps", check=False, timeout=30).stdout
        ctl = self.kc.kubectl("-n", kubecontroller.NS, "logs", "deployment/tailscale-controller", "--timestamps",
                              "--since=10m", check=False, timeout=30).stdout
        return death_steps(prev, ctl, victim, start)

    def lossy_link(self, percent: int = 30, duration: float = 60.0, timeout: float = 240.0) -> LossyResult:
        """``percent`` % of the packets crossing the second node's link dropped (both directions) for
        ``duration`` seconds, the replica there watched in the EndpointSlice throughout (``kubectl get --watch``:
        every version, not samples). Ends on a new connection succeeding after the link is clean again."""
        victim, v, _ = self._victim(1)
        s = self.kc.get("service", SVC, NS) or {}
        name = f"{(s.get('spec') or {}).get('externalName', '').split('.')[0]}-ipv4"
        watch_log = self.kc.run_dir / "lossy-slice-watch.json"
        with open(watch_log, "w") as f:
            watch = self.kc.popen([str(self.kc.cfg.bin_dir / "kubectl"), f"--kubeconfig={self.kc.kubeconfig}",
                                   "-n", kubecontroller.NS, "get", "endpointslice", name, "--watch", "-o", "json"],
                                  stdout=f, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: watched_slices(watch_log.read_text()), 60, 0.2, "the EndpointSlice watch's first object")
            start = time.time()
            with lossy_link(self.kc, self.kc.nodes[1], percent) as measured:
                time.sleep(duration)   # the case is the duration: nothing to wait for but the time under loss
                loss = measured()
            end = time.time()
            after = wait_until(lambda: next((a for a in self.new() if a.ok and a.t > end), None), timeout, 0.5,
                               "a new connection after the lossy minute")
            time.sleep(1)     # the watch's last events in
        finally:
            watch.terminate()
            watch.wait(10)
        objs = watched_slices(watch_log.read_text())
        changes, removals = membership_changes([in_slice(o, v["pod_ip"]) for o in objs])
        ctl = self.kc.kubectl("-n", kubecontroller.NS, "logs", "deployment/tailscale-controller", "--timestamps",
                              "--since=10m", check=False, timeout=30).stdout
        logged = sum(1 for line in ctl.splitlines() if (t := _stamp(line)) is not None and start <= t <= after.t + 1
                     and f"replica {victim} " in line and "leaves the egress" in line)
        window = [a for a in self.new() if start <= a.t <= end]
        return LossyResult(victim, percent, end - start, loss["in"], loss["out"],
                           int(loss["in_seen"] + loss["out_seen"]), len(objs), changes, removals, logged,
                           sum(a.ok for a in window), sum(not a.ok for a in window), after.t - end)

    def lose_node(self, timeout: float = 240.0, *, until_node_marked: bool = True) -> CaseResult:
        """The second node lost. Events (seconds after the loss), recorded as they are seen: ``left_slice`` (the
        controller's health probe or the node's eviction took the victim out), ``node_not_ready`` (the node
        lifecycle controller marked the node), ``pod_evicted``, ``tailnet_offline`` (headscale reports the
        victim's device offline: the tailnet control plane's view), ``ten_ok_after_slice``. With
        ``until_node_marked`` the case also waits for the node to be marked (up to the grace period and the
        kubelet's 10 s Lease renewal), so that ``node_not_ready`` is known; it never waits for the eviction."""
        victim, v, s = self._victim(1)
        node = self.kc.nodes[1]
        start = time.time()
        self.kc.lose_node(node)
        events: dict[str, float] = {}

        def node_marked() -> bool:
            n = self.kc.get("node", node) or {}
            c: dict = next((c for c in (n.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})
            return c.get("status") != "True"

        def evicted() -> bool:
            p = self.kc.get("pod", victim, kubecontroller.NS) or {}
            return bool(p.get("metadata", {}).get("uid") != v["uid"] or p.get("metadata", {}).get("deletionTimestamp"))

        device = f"{PREFIX}-{victim.rsplit('-', 1)[1]}"
        asked_hs = [0.0]

        def tailnet_offline() -> bool:
            """headscale's view of the victim's device (asked at most once a second: a CLI run each time)."""
            if time.monotonic() - asked_hs[0] < 1.0:
                return False
            asked_hs[0] = time.monotonic()
            n = self.lab.hs_node(device) or {}
            return n.get("online") is False or ("online" not in n and bool(n))

        def observe() -> None:
            now = time.time() - start
            if "tailnet_offline" not in events and tailnet_offline():
                events["tailnet_offline"] = now
            if "left_slice" not in events and v["pod_ip"] not in self.slice_addresses():
                events["left_slice"] = now
            if "node_not_ready" not in events and node_marked():
                events["node_not_ready"] = now
            if "pod_evicted" not in events and evicted():
                events["pod_evicted"] = now

        def out() -> bool:
            observe()
            return "left_slice" in events
        wait_until(out, timeout, 0.2, "the victim out of the slice")
        left = start + events["left_slice"]

        def ten_ok() -> float | None:
            observe()
            run = 0
            for a in self.new():
                if a.t <= left:
                    continue
                run = run + 1 if a.ok else 0
                if run >= 10:
                    return a.t
            return None
        settled = wait_until(ten_ok, timeout, 0.5, "ten consecutive successes after the victim left the slice")
        events["ten_ok_after_slice"] = settled - start
        end = self._close(settled, timeout)
        if until_node_marked:
            def marked() -> bool:
                observe()
                return "node_not_ready" in events
            wait_until(marked, timeout, 0.5, f"node {node} no longer Ready")
        # the lost node's replica never comes back during the case: every success through the survivor up to its
        # end is one "while the victim was out" (until it left the slice alone, a client whose first two tries
        # both meet the silent replica, 2 s each, can have none: ~3 s after the loss)
        return judge("lose_node", victim, v["tailnet_ip"], s["tailnet_ip"], start, left, end, self.log(),
                     dict(sorted(events.items(), key=lambda kv: kv[1])), survivor_until=end)

    def report(self) -> str:
        kc = self.kc
        got = kc.kubectl("get", "pods,endpointslices", "-A", "-o", "wide", check=False).stdout
        return (f"{kubecontroller.controller_log(kc, 80)}\n--- objects\n{got}\n--- client (tail)\n"
                f"{self.log()[-3000:]}")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.procs.clear()


def lossy_line(r: LossyResult) -> str:
    """The lossy case's figures in one line (the test and the benchmark print it)."""
    return (f"lossy link: {r.victim} behind {r.percent} % loss for {r.duration_s:.0f}s: measured {r.loss_in:.1%} "
            f"in, {r.loss_out:.1%} out of {r.packets} packets; EndpointSlice: {r.slice_states} versions, "
            f"{r.slice_changes} changes of the replica's membership ({r.slice_removals} removals, "
            f"{r.probe_out_logged} logged by the controller); new connections {r.new_ok} ok / {r.new_fail} failed; "
            f"first success {r.first_ok_after_s:.2f}s after the link was clean")


def run_all(lab: Lab, kc: kubecluster.KubeCluster, images: tuple[Any, Any],
            say: Callable[[str], None] = print) -> tuple[dict[str, float], list[CaseResult], LossyResult]:
    """The whole scenario: set-up, then the cases in order, the lossy link before the node's loss (the last
    case leaves the second node lost)."""
    sc = Scenario.start(lab, kc, images)
    try:
        results = []
        lossy = None
        for case in (sc.delete_pod, sc.kill_tailscaled, sc.lossy_link, sc.lose_node):
            r = case()
            if isinstance(r, LossyResult):
                say(lossy_line(r))
                lossy = r
                continue
            say(f"{r.case}: gap {r.gap_s:.2f}s, {r.new_ok} ok / {r.new_fail} failed new connections, events "
                + ", ".join(f"{k} {v:.1f}s" for k, v in r.events.items()))
            results.append(r)
        assert lossy is not None
        return sc.figures, results, lossy
    finally:
        sc.stop()

if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "echo-serve":
        sys.exit(echo_serve(sys.argv[2], int(sys.argv[3])))
    print("usage: python -m labtools.pgfailover echo-serve ADDR PORT", file=sys.stderr)
    sys.exit(2)
