"""Benchmark: the nameserver's queries per second and latency, against CoreDNS serving the same records.

    .venv/bin/python -m bench.dns [--names 100] [--seconds 3] [--rounds 2] [--procs 2] [--concurrency 16]
                                  [--changes 20] [--json FILE]

Both servers run as their own processes on loopback (no namespace needed: nothing leaves 127.0.0.1):

- the nameserver (``python -m nameserver``) with ``--names`` records of ``tail.example`` in a records.json
  laid out as the kubelet mounts a ConfigMap (``..data`` swap);
- the anchor, CoreDNS (the lab's build, scripts/install-coredns.sh) answering the same names from a ``hosts``
  block in a ``tail.example`` server block, no cache (every query answered from the table, like ours; TTL
  1 s, the smallest its hosts plugin takes).

Load: dnspython's stub resolver (``dns.asyncresolver.Resolver``, no cache), ``--procs`` processes with
``--concurrency`` queries in flight each, A queries for the names in turn, for ``--seconds`` per run; runs
alternate ABBA for ``--rounds`` rounds, so drift and other load on the machine hit both alike. Reported:
queries per second (answers / wall time, all processes), p50 and p99 latency of the answered queries, and
the ratio of each to the anchor's. On a 2-core machine the load generator shares the cores with the server,
so these are the server's figures under this client, not its ceiling; the ratio is what compares.

Record change to answer: the records file is swapped as the kubelet does (new ``..data`` directory, atomic
rename) with a new address for one name, and the name is queried every millisecond until the new address
comes back; ``--changes`` times. Reported: median and max. In a cluster the kubelet's own delay in updating
the mounted ConfigMap (up to its sync period, 1 min by default) comes on top (docs/dns.md).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dns.asyncresolver
import dns.exception
import dns.resolver

from bench.results import Results, Table, machine, record
from labtools import coredns
from nameserver.records import render_records

ZONE = "tail.example"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        t.bind(("127.0.0.1", 0))
        port = t.getsockname()[1]
        u.bind(("127.0.0.1", port))
        return port


def names(n: int) -> dict[str, str]:
    return {f"host{i}.{ZONE}": f"10.{100 + i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(n)}


class Kubelet:
    """The kubelet's atomic writer of a ConfigMap volume (one key)."""

    def __init__(self, root: Path, key: str = "records.json") -> None:
        self.root, self.key, self.n = root, key, 0
        root.mkdir(parents=True, exist_ok=True)

    def publish(self, text: str) -> None:
        self.n += 1
        d = self.root / f"..2026_01_01_00_00_00.{self.n:09d}"
        d.mkdir()
        (d / self.key).write_text(text)
        old = os.readlink(self.root / "..data") if (self.root / "..data").is_symlink() else None
        os.symlink(d.name, self.root / "..data_tmp")
        os.rename(self.root / "..data_tmp", self.root / "..data")
        if not (self.root / self.key).is_symlink():
            os.symlink(f"..data/{self.key}", self.root / self.key)
        if old:
            shutil.rmtree(self.root / old)

    @property
    def path(self) -> str:
        return str(self.root / self.key)


def _resolver(port: int) -> dns.asyncresolver.Resolver:
    r = dns.asyncresolver.Resolver(configure=False)
    r.nameservers, r.port, r.lifetime, r.timeout = ["127.0.0.1"], port, 2.0, 2.0
    r.cache = None
    return r


async def _load(port: int, qnames: list[str], seconds: float, concurrency: int) -> tuple[int, int, list[float]]:
    r = _resolver(port)
    lat: list[float] = []
    errors = 0
    deadline = time.monotonic() + seconds

    async def worker(k: int) -> None:
        nonlocal errors
        i = k
        while time.monotonic() < deadline:
            name = qnames[i % len(qnames)]
            i += concurrency
            t = time.perf_counter()
            try:
                await r.resolve(name, "A")
                lat.append(time.perf_counter() - t)
            except dns.exception.DNSException:
                errors += 1
    t0 = time.monotonic()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return len(lat), errors, lat + [time.monotonic() - t0]


def _load_proc(args: tuple[int, list[str], float, int]) -> tuple[int, int, list[float]]:
    return asyncio.run(_load(*args))


def run_load(pool, port: int, qnames: list[str], seconds: float, procs: int, concurrency: int) -> dict:
    res = pool.map(_load_proc, [(port, qnames[k::procs] or qnames, seconds, concurrency) for k in range(procs)])
    lat = sorted(x for _, _, v in res for x in v[:-1])
    wall = max(v[-1] for _, _, v in res)
    ok = sum(n for n, _, _ in res)
    return {"qps": ok / wall, "answers": ok, "errors": sum(e for _, e, _ in res),
            "p50_ms": 1000 * lat[len(lat) // 2] if lat else float("nan"),
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan")}


async def wait_answer(port: int, name: str, want: str, timeout: float = 10.0, interval: float = 0.001) -> float:
    r = _resolver(port)
    r.lifetime = r.timeout = 0.5
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        try:
            if [a.to_text() for a in await r.resolve(name, "A")] == [want]:
                return time.perf_counter() - t0
        except dns.exception.DNSException:
            pass
        await asyncio.sleep(interval)
    raise TimeoutError(f"{name} did not answer {want} within {timeout}s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dns", description=__doc__.split("\n\n")[0])
    ap.add_argument("--names", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--changes", type=int, default=20)
    ap.add_argument("--json", default="")
    ap.add_argument("--record", action="store_true", help="write bench/results/dns.json (docs/dns.md)")
    ap.add_argument("--recorded", default="", help="which run and machine, for the results file")
    a = ap.parse_args(argv)
    binary = coredns.binary_path()
    if not os.access(binary, os.X_OK):
        print(f"CoreDNS is not built ({binary}): bash scripts/install-coredns.sh", file=sys.stderr)
        return 2
    recs = names(a.names)
    tmp = Path(tempfile.mkdtemp(prefix="bench-dns-"))
    procs: list[subprocess.Popen] = []
    try:
        kubelet = Kubelet(tmp / "config")
        kubelet.publish(render_records({k: [v] for k, v in recs.items()}, {}))
        ns_port, cd_port = free_port(), free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "nameserver", "--domain", ZONE, "--records", kubelet.path,
                                       "--listen", f"127.0.0.1:{ns_port}"], stderr=open(tmp / "nameserver.log", "w")))
        hosts = "\n".join(f"        {ip} {n}" for n, ip in recs.items())
        (tmp / "Corefile").write_text(f"{ZONE}:{cd_port} {{\n    hosts {{\n{hosts}\n        ttl 1\n    }}\n}}\n")
        procs.append(subprocess.Popen([str(binary), "-conf", str(tmp / "Corefile")], cwd=tmp,
                                      stdout=open(tmp / "coredns.log", "w"), stderr=subprocess.STDOUT))
        first = next(iter(recs))
        for port in (ns_port, cd_port):
            asyncio.run(wait_answer(port, first, recs[first], timeout=20, interval=0.05))
        qnames = list(recs)
        results: dict[str, list[dict]] = {"nameserver": [], "coredns": []}
        order = []
        for _ in range(a.rounds):
            order += [("nameserver", ns_port), ("coredns", cd_port), ("coredns", cd_port), ("nameserver", ns_port)]
        with multiprocessing.get_context("fork").Pool(a.procs) as pool:
            run_load(pool, ns_port, qnames, 0.5, a.procs, a.concurrency)      # warm-up, discarded
            run_load(pool, cd_port, qnames, 0.5, a.procs, a.concurrency)
            for who, port in order:
                r = run_load(pool, port, qnames, a.seconds, a.procs, a.concurrency)
                results[who].append(r)
                print(f"  {who:10s} {r['qps']:8.0f} q/s  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms"
                      f"  ({r['answers']} answers, {r['errors']} errors)")
        summary = {}
        for who, rs in results.items():
            summary[who] = {k: statistics.median(r[k] for r in rs) for k in ("qps", "p50_ms", "p99_ms")}
        ratio = {k: summary["nameserver"][k] / summary["coredns"][k] for k in ("qps", "p50_ms", "p99_ms")}
        changes = []
        name = first
        for i in range(a.changes):
            new_ip = f"10.200.{i // 256}.{i % 256}"
            recs[name] = new_ip
            t = time.perf_counter()
            kubelet.publish(render_records({k: [v] for k, v in recs.items()}, {}))
            asyncio.run(wait_answer(ns_port, name, new_ip))
            changes.append(time.perf_counter() - t)
        out = {"names": a.names, "procs": a.procs, "concurrency": a.concurrency, "seconds": a.seconds,
               "runs": results, "median": summary, "ratio_to_coredns": ratio,
               "change_to_answer_ms": {"median": 1000 * statistics.median(changes), "max": 1000 * max(changes),
                                       "samples": len(changes)}}
        print(f"nameserver {summary['nameserver']['qps']:.0f} q/s, p99 {summary['nameserver']['p99_ms']:.2f} ms; "
              f"CoreDNS (hosts, anchor) {summary['coredns']['qps']:.0f} q/s, p99 {summary['coredns']['p99_ms']:.2f} ms")
        print(f"ratio to CoreDNS: q/s {ratio['qps']:.2f}, p50 {ratio['p50_ms']:.2f}, p99 {ratio['p99_ms']:.2f}")
        print(f"record change to answer (kubelet-style swap -> inotify -> reload -> answer): median "
              f"{out['change_to_answer_ms']['median']:.1f} ms, max {out['change_to_answer_ms']['max']:.1f} ms "
              f"({len(changes)} changes)")
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
        ns, cd = summary["nameserver"], summary["coredns"]
        table = Table.of(["figure", "nameserver", "CoreDNS", "ratio"], [
            [f"queries per second ({a.names} names, {a.procs} processes × {a.concurrency} in flight)",
             f"{ns['qps']:,.0f}", f"{cd['qps']:,.0f}", f"{ratio['qps']:.2f}"],
            ["p50 latency", f"{ns['p50_ms']:.2f} ms", f"{cd['p50_ms']:.2f} ms", f"{ratio['p50_ms']:.2f}"],
            ["p99 latency", f"{ns['p99_ms']:.2f} ms", f"{cd['p99_ms']:.2f} ms", f"{ratio['p99_ms']:.2f}"],
            [f"a records file swap to the new answer (median of {len(changes)})",
             f"{out['change_to_answer_ms']['median']:.0f} ms", "", ""]])
        record(Results("dns", "python -m bench.dns", a.recorded or f"{machine()}; loopback, ABBA order",
                       {"main": table}), a.record)
        return 0
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
