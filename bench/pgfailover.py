"""Benchmark: ProxyGroup failover on a cluster of two nodes, the gap new connections see.

    sudo .venv/bin/python -m bench.pgfailover [--json FILE]

Builds the lab (headscale, the ``client`` tailnet node), a real two-node cluster (labtools.kubecluster
``nodes=2``), both images from this checkout, and runs labtools.pgfailover's scenario: the controller from
deploy/, a ProxyGroup of 2 whose replicas land on different nodes, an egress Service for a TCP echo server on
the tailnet node, and a client Pod on the first node opening a new connection every 0.2 s (2 s timeout) while
holding one connection through each replica. Then: (a) one replica's Pod deleted, (b) one replica's tailscaled
killed, (c) the second node lost (its island link down, its kubelet stopped).

Printed: the time from the egress Service's creation to the first successful connection (the group already
ready), and for each case the longest gap between two successful new connections, the new connections that
succeeded and failed, whether the connection held through the surviving replica was reset, and the events'
times after the case started. The goal (issue: high availability): a gap under 5 s for (a) and (b); for (c)
what Kubernetes' node-loss timing allows, which this lab shortens (kubecluster.NODE_MONITOR_GRACE_S for
kube-controller-manager's ``--node-monitor-grace-period``, default 50 s, and UNREACHABLE_TOLERATION_S for the
API server's ``--default-unreachable-toleration-seconds``, default 300 s). No anchor: the gaps are absolute
figures of one run on this machine (the sampling interval, 0.2 s, bounds their resolution).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

GOAL_S = 5.0

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
    ("kill_tailscaled", "killed"): "(b) tailscaled killed",
    ("kill_tailscaled", "back"): "(b) the killed replica serves again",
    ("lose_node", "node_not_ready"): "(c) node marked not Ready",
    ("lose_node", "pod_evicted"): "(c) the lost replica evicted",
    ("lose_node", "left_slice"): "(c) the lost replica out of the EndpointSlice",
    ("lose_node", "ten_ok_after_slice"): "(c) 10 successes in a row after that",
}


def main(argv: list[str] | None = None) -> int:
    from labtools import kubecluster, kubecontroller, pgfailover
    from labtools.lab import Lab, ensure_binaries
    ap = argparse.ArgumentParser(prog="python -m bench.pgfailover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--firewall", default="iptables", choices=("iptables", "nftables"))
    ap.add_argument("--record", action="store_true", help="write bench/results/pgfailover.json (docs/proxygroup.md)")
    ap.add_argument("--recorded", default="", help="which run and machine, for the results file")
    a = ap.parse_args(argv)
    t_all = time.monotonic()
    images = kubecontroller.build_images()
    with Lab.create(bin_dir=ensure_binaries(), firewall_mode=a.firewall) as lab:
        with kubecluster.KubeCluster.start(lab=lab, node=True, nodes=2) as kc:
            start_s = kc.timings["start_total"]
            figures, results = pgfailover.run_all(lab, kc, images, say=lambda m: print(m, flush=True))
    print(f"\ntwo-node cluster started in {start_s:.1f}s; ProxyGroup of 2 ready in {figures['group_ready_s']:.1f}s")
    print(f"egress Service created -> first successful connection: {figures['service_to_first_success_s']:.2f}s")
    print(f"node-loss timing of the lab: node-monitor-grace-period {kubecluster.NODE_MONITOR_GRACE_S}s, "
          f"unreachable toleration {kubecluster.UNREACHABLE_TOLERATION_S}s (Kubernetes' defaults: 50s, 300s)")
    for r in results:
        goal = "" if r.case == "lose_node" else f" (goal < {GOAL_S:.0f}s: {'MET' if r.gap_s < GOAL_S else 'NOT MET'})"
        print(f"{r.case:16s} longest gap {r.gap_s:6.2f}s{goal}; new connections {r.new_ok} ok, {r.new_fail} "
              f"failed; held connection through the survivor {'RESET' if r.held_failed else 'kept'}; events: "
              + ", ".join(f"{k} {v:.1f}s" for k, v in r.events.items()))
    print(f"total {time.monotonic() - t_all:.0f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cluster_start_s": start_s, **figures, "cases": [asdict(r) for r in results]}, f, indent=1)
    from bench.results import Results, Table, machine, record
    cases = Table.of(["case", "what is done", "ends when", "longest gap between successful new connections",
                      "new connections failed", "connection held through the other replica"],
                     [[*CASES.get(r.case, (r.case, "", "")), f"{r.gap_s:.2f} s",
                       f"{r.new_fail} of {r.new_ok + r.new_fail}", "reset" if r.held_failed else "kept"]
                      for r in results])
    events = Table.of(["event", "after"], [
        ["the egress Service created (group Ready) → first successful connection",
         f"{figures['service_to_first_success_s']:.1f} s"],
        *([EVENTS.get((r.case, k), f"{r.case}: {k}"), f"{v:.1f} s"] for r in results for k, v in r.events.items())])
    recorded = a.recorded or f"{machine()}; {a.firewall}; the 0.2 s between attempts bounds the resolution"
    record(Results("pgfailover", "python -m bench.pgfailover", recorded, {"cases": cases, "events": events}),
           a.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
