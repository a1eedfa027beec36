"""Benchmark: ProxyGroup failover on a cluster of two nodes, the gap new connections see.

    sudo .venv/bin/python -m bench.pgfailover [--runs N] [--node-loss default|short] [--json FILE]
    .venv/bin/python -m bench.pgfailover --from-json FILE [--record]   # an earlier run's figures again

Builds the lab (headscale, the ``client`` tailnet node), a real two-node cluster (labtools.kubecluster
``nodes=2``), both images from this checkout, and runs labtools.pgfailover's scenario: the controller from
deploy/, a ProxyGroup of 2 whose replicas land on different nodes, an egress Service for a TCP echo server on
the tailnet node, and a client Pod on the first node opening a new connection every 0.2 s (2 s timeout) while
holding one connection through each replica. Then: (a) one replica's Pod deleted, (b) one replica's tailscaled
killed, a lossy link (30 % of the packets crossing the second node's link dropped in each direction for a minute),
(c) the second node lost (its island link down, its kubelet stopped).

Printed: the time from the egress Service's creation to the first successful connection (the group already ready),
and for each case the longest gap between two successful new connections, the new connections that succeeded and
failed, whether the connection held through the surviving replica was reset, and the events' times after the case
started (in (c): when the victim left the EndpointSlice, when the node was marked not Ready), and for the lossy link
the loss measured at its two ends and the changes of the replica's membership in the EndpointSlice (every version
watched; the goal: none). The cluster runs with Kubernetes' default node-loss timing (kube-controller-manager's
``--node-monitor-grace-period`` 50 s, the API server's ``--default-unreachable-toleration-seconds`` 300 s), or with
``--node-loss short`` the lab's shortened one (20 s, 5 s); the settings used are printed. With ``--runs N`` the
whole scenario runs N times, each on a fresh cluster, and each case's median and worst gap are printed.
Goals: a gap under 5 s in every case, under 2 s for (a) and (b). No anchor: the gaps are absolute
figures on this machine (the sampling interval, 0.2 s, bounds their resolution).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

#: the longest gap in new connections, per case
GOALS_S = {"delete_pod": 2.0, "kill_tailscaled": 2.0, "lose_node": 5.0}

#: the docs' words for each case (docs/proxygroup.md, "Failover on two nodes")
CASES = {
    "delete_pod": ("(a) Pod deleted", "`kubectl delete pod` of one replica", "its new Pod serves again"),
    "kill_tailscaled": ("(b) tailscaled killed", "SIGKILL to one replica's tailscaled (its container restarts)",
                        "it serves again"),
    "lose_node": ("(c) node lost", "the second node's link to the network down and its kubelet stopped: its replica "
                  "runs on, unreachable", "10 successes in a row after the replica left the EndpointSlice"),
}
EVENTS = {
    ("delete_pod", "left_slice"): "(a) the deleted replica out of the EndpointSlices (its pre-stop hook holds it "
                                  "until then)",
    ("delete_pod", "new_pod_in_slice"): "(a) its new Pod in the EndpointSlices",
    ("delete_pod", "back"): "(a) its new Pod serves",
    ("kill_tailscaled", "agent_noticed"): "(b) its agent notices tailscaled's exit (its /healthz answers 503 from "
                                          "then on)",
    ("kill_tailscaled", "rules_removed"): "(b) its agent has removed its rules (a new connection to the replica is "
                                          "refused from then on)",
    ("kill_tailscaled", "conntrack_flushed"): "(b) its agent has deleted the conntrack entries its rules made (a "
                                              "SYN caught before is refused at its retransmission)",
    ("kill_tailscaled", "health_closed"): "(b) its agent has exited (its health port refuses connections)",
    ("kill_tailscaled", "killed"): "(b) `kubectl exec` of the kill returned",
    ("kill_tailscaled", "probe_out"): "(b) the controller's probe takes the replica out",
    ("kill_tailscaled", "left_slice"): "(b) the killed replica out of the EndpointSlice",
    ("kill_tailscaled", "back"): "(b) the killed replica serves again",
    ("lose_node", "tailnet_offline"): "(c) the control server reports the lost replica's device offline",
    ("lose_node", "node_not_ready"): "(c) node marked not Ready",
    ("lose_node", "pod_evicted"): "(c) the lost replica evicted",
    ("lose_node", "left_slice"): "(c) the lost replica out of the EndpointSlice",
    ("lose_node", "ten_ok_after_slice"): "(c) 10 successes in a row after that",
}


#: the lossy link's figures, one row per run of netns-tests/test_pg_failover_twonode.py (BENCH_RECORD=1)
#: the first cell (the link's loss) is the row's key: a later run of the same case replaces its row
LOSSY_COLUMNS = ("packets dropped, each direction", "loss measured (into / out of the node)",
                 "packets across the link", "EndpointSlice versions watched",
                 "changes of the replica's membership (removals)", "new connections failed over the minute", "run")
LOSSY_COMMAND = "BENCH_RECORD=1 pytest -p no:xdist netns-tests/test_pg_failover_twonode.py"


def lossy_row(r: Mapping[str, Any], run: str) -> list[str]:
    """A :class:`labtools.pgfailover.LossyResult` (as a dict) in the docs' words."""
    return [f"{r['percent']} % for {r['duration_s']:.0f} s",
            f"{r['loss_in']:.1%} / {r['loss_out']:.1%}", str(r["packets"]), str(r["slice_states"]),
            f"{r['slice_changes']} ({r['slice_removals']}; the controller's log: {r['probe_out_logged']})",
            f"{r['new_fail']} of {r['new_ok'] + r['new_fail']}", run]


def record_lossy(r: Any) -> None:
    """The test's lossy-link row in bench/results/pgfailover_lossy.json, when asked (BENCH_RECORD=1)."""
    from bench import runs
    from bench.results import record_row, wanted
    if wanted(False):
        runs._rendered(record_row("pgfailover_lossy", "runs", LOSSY_COLUMNS, lossy_row(asdict(r), runs.run_label(None)),
                                  key=1, command=LOSSY_COMMAND, recorded=runs.RECORDED))


def main(argv: list[str] | None = None) -> int:
    from labtools import kubecluster, kubecontroller, pgfailover
    from labtools.lab import Lab, ensure_binaries
    ap = argparse.ArgumentParser(prog="python -m bench.pgfailover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--firewall", default="iptables", choices=("iptables", "nftables"))
    ap.add_argument("--runs", type=int, default=1, help="whole scenarios, each on a fresh cluster")
    ap.add_argument("--node-loss", default="default", choices=("default", "short"),
                    help="Kubernetes' node-loss timing (50 s, 300 s) or the lab's shortened one (20 s, 5 s)")
    ap.add_argument("--record", action="store_true", help="write bench/results/pgfailover.json (docs/proxygroup.md)")
    ap.add_argument("--recorded", default="", help="which run and machine, for the results file")
    ap.add_argument("--from-json", metavar="FILE",
                    help="print and record the figures of an earlier run's --json FILE instead of running")
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error(f"--runs {a.runs}: give at least 1")
    node_loss = kubecluster.KUBERNETES_NODE_LOSS if a.node_loss == "default" else kubecluster.SHORT_NODE_LOSS
    t_all = time.monotonic()
    runs = []
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        runs = saved["runs"]
        node_loss = tuple(saved["node_loss"])
        a.runs, a.firewall = len(runs), saved.get("firewall", "iptables")
        a.node_loss = "default" if node_loss == tuple(kubecluster.KUBERNETES_NODE_LOSS) else "short"
    images = kubecontroller.build_images() if not a.from_json else None
    for i in range(0 if a.from_json else a.runs):
        with Lab.create(bin_dir=ensure_binaries(), firewall_mode=a.firewall) as lab:
            with kubecluster.KubeCluster.start(lab=lab, node=True, nodes=2,
                                               node_loss=None if a.node_loss == "default" else node_loss) as kc:
                start_s = kc.timings["start_total"]
                assert images is not None
                figures, results, lossy = pgfailover.run_all(lab, kc, images,
                                                      say=lambda m, i=i: print(f"run {i + 1}: {m}", flush=True))
        runs.append({"cluster_start_s": start_s, **figures, "cases": [asdict(r) for r in results],
                     "lossy": asdict(lossy),
                     "load_average": os.getloadavg()[0]})
        print(f"run {i + 1}: two-node cluster started in {start_s:.1f}s; ProxyGroup of 2 ready in "
              f"{figures['group_ready_s']:.1f}s; egress Service created -> first successful connection "
              f"{figures['service_to_first_success_s']:.2f}s", flush=True)
    print(f"\nnode-loss timing: node-monitor-grace-period {node_loss[0]}s, unreachable toleration {node_loss[1]}s "
          f"({'Kubernetes defaults' if a.node_loss == 'default' else 'shortened by the lab'}); {a.runs} run(s)")
    for case, goal in GOALS_S.items():
        rs = [c for r in runs for c in r["cases"] if c["case"] == case]
        gaps = [c["gap_s"] for c in rs]
        worst = max(gaps)
        resets = sum(c["held_failed"] for c in rs)
        print(f"{case:16s} longest gap median {statistics.median(gaps):6.2f}s, worst {worst:6.2f}s "
              f"(goal < {goal:.0f}s: {'MET' if worst < goal else 'NOT MET'}); new connections failed "
              f"{sum(c['new_fail'] for c in rs)} of {sum(c['new_fail'] + c['new_ok'] for c in rs)} "
              f"({sum(c['new_timed_out'] for c in rs)} timed out); held connection "
              f"through the survivor {f'RESET in {resets} run(s)' if resets else 'kept'}")
        for c in rs:
            print(f"  {c['gap_s']:6.2f}s; events: " + ", ".join(f"{k} {v:.1f}s" for k, v in c["events"].items()))
    for r in runs:
        if "lossy" in r:     # an earlier run's --json may have none
            print("  | ".join(lossy_row(r["lossy"], "lossy link")))
    print(f"total {time.monotonic() - t_all:.0f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"node_loss": list(node_loss), "firewall": a.firewall, "runs": runs}, f, indent=1)
    from bench.results import Results, Table, machine, record

    def gap(case: str) -> str:
        gaps = [c["gap_s"] for r in runs for c in r["cases"] if c["case"] == case]
        return f"{gaps[0]:.2f} s" if len(gaps) == 1 else \
            f"{statistics.median(gaps):.2f} s (median of {len(gaps)}; worst {max(gaps):.2f} s)"

    def failed(case: str) -> str:
        rs = [c for r in runs for c in r["cases"] if c["case"] == case]
        return f"{sum(c['new_fail'] for c in rs)} of {sum(c['new_fail'] + c['new_ok'] for c in rs)} " \
               f"({sum(c.get('new_timed_out', 0) for c in rs)} timed out)"

    def held(case: str) -> str:
        resets = sum(c["held_failed"] for r in runs for c in r["cases"] if c["case"] == case)
        return f"reset in {resets} of {a.runs} run(s)" if resets else "kept"

    def median_of(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} s" + (f" (median of {len(values)})" if len(values) > 1 else "")

    cases = Table.of(["case", "what is done", "ends when", "longest gap between successful new connections",
                      "new connections failed", "connection held through the other replica"],
                     [[*CASES.get(case, (case, "", "")), gap(case), failed(case), held(case)] for case in GOALS_S])
    def median_at(case: str, k: str) -> float:
        return statistics.median(c["events"][k] for r in runs for c in r["cases"] if c["case"] == case
                                 and k in c["events"])
    # case by case in the cases' order, each case's events in the order they came (their medians)
    seen = list(dict.fromkeys((c["case"], k) for r in runs for c in r["cases"] for k in c["events"]))
    keys = sorted(seen, key=lambda ck: (list(GOALS_S).index(ck[0]) if ck[0] in GOALS_S else len(GOALS_S),
                                        median_at(*ck)))
    events = Table.of(["event", "after"], [
        ["the egress Service created (group Ready) → first successful connection",
         median_of([r["service_to_first_success_s"] for r in runs])],
        *([EVENTS.get((case, k), f"{case}: {k}"),
           median_of([c["events"][k] for r in runs for c in r["cases"] if c["case"] == case and k in c["events"]])]
          for case, k in keys)])
    timing = "Kubernetes' default node-loss timing" if a.node_loss == "default" else \
        f"the lab's shortened node-loss timing ({node_loss[0]} s, {node_loss[1]} s)"
    loads = [r["load_average"] for r in runs]
    where = machine() if a.runs == 1 else (
        f"{a.runs} runs, each on a fresh cluster, {os.cpu_count()} cores shared with other work, 1-minute load "
        f"average {min(loads):.1f} to {max(loads):.1f} at the runs' ends")
    recorded = a.recorded or f"{where}; {a.firewall}; {timing}; the 0.2 s between attempts bounds the resolution"
    command = "python -m bench.pgfailover" + (f" --runs {a.runs}" if a.runs > 1 else "") + (
        " --node-loss short" if a.node_loss == "short" else "")
    record(Results("pgfailover", command, recorded, {"cases": cases, "events": events}), a.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
