"""Benchmark: one ProxyGroup replica's rule change with many egress Services present.

    sudo .venv/bin/python -m bench.pgrules [--services 1000] [--runs 5]

In a network namespace of its own (created and deleted here; nothing else is touched), for each firewall
backend: the rule set of `--services` egress Services (one port map each, as bench.rules builds them) is
applied, then one Service is added (services + 1) and removed again, `--runs` times; each `Backend.apply()`
call is timed (wall time, in the namespace). Reported: the median of adding one, removing one and of a re-apply
that changes nothing, against the goal of the ProxyGroup issue (one Service added or removed changes the
replica's rules in under 20 ms with 1,000 present). The anchor, measured in the same run, is the same change
with one Service present; the ratio says how much of the cost is the size of the rule set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GOAL_MS = 20.0


def inner(backend: str, n: int, runs: int) -> dict:
    from bench.rules import port_map_ruleset
    from netfilter.backend import open_backend
    from netfilter.model import RuleSet
    b = open_backend(backend)
    b.cleanup()
    out: dict[str, list[float]] = {"add": [], "remove": [], "noop": []}
    big = port_map_ruleset(n + 1, "100.101.0.1", "100.64.0.9")
    base = RuleSet(port_maps=big.port_maps[:n], clamp_mss=True)
    b.apply(base)
    for _ in range(runs):
        for key, rules in (("add", big), ("remove", base), ("noop", base)):
            t0 = time.perf_counter()
            b.apply(rules)
            out[key].append((time.perf_counter() - t0) * 1000)
    b.cleanup()
    return {k: statistics.median(v) for k, v in out.items()}


def _in_netns(backend: str, n: int, runs: int) -> dict:
    ns = f"cbpy-pgrules-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        cp = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "bench.pgrules", "--inner", backend,
                             "--services", str(n), "--runs", str(runs)], capture_output=True, text=True, check=True,
                            timeout=600)
        return json.loads(cp.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pgrules", description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--inner", default="", help=argparse.SUPPRESS)
    ap.add_argument("--record", action="store_true", help="write bench/results/pgrules.json (bench/README.md)")
    ap.add_argument("--recorded", default="", help="which run and machine, for the results file")
    a = ap.parse_args(argv)
    if a.inner:
        print(json.dumps(inner(a.inner, a.services, a.runs)))
        return 0
    if os.geteuid() != 0:
        print("bench.pgrules needs root (it creates a network namespace)", file=sys.stderr)
        return 2
    rows = []
    for backend in ("nftables", "iptables"):
        anchor = _in_netns(backend, 1, a.runs)
        big = _in_netns(backend, a.services, a.runs)
        rows.append([backend if backend == "nftables" else "iptables-nft",
                     *(f"{big[k]:.1f} ms" for k in ("add", "remove", "noop"))])
        print(f"{backend}: one egress Service added / removed / nothing changed, median of {a.runs}")
        for key in ("add", "remove", "noop"):
            met = "MET" if big[key] < GOAL_MS else "NOT MET"
            verdict = "" if key == "noop" else f"  goal < {GOAL_MS:.0f} ms: {met}"
            print(f"  {key:6s} with {a.services}: {big[key]:7.1f} ms; with 1: {anchor[key]:6.1f} ms; "
                  f"ratio {big[key] / anchor[key]:5.1f}{verdict}")
    from bench.results import Results, Table, machine, record
    table = Table.of([f"with {a.services:,} Services", "add one", "remove one", "nothing changed"], rows)
    record(Results("pgrules", f"python -m bench.pgrules --runs {a.runs}", a.recorded or
                   f"{machine()}; medians of {a.runs}", {"main": table}), a.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
