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


def main(argv: list[str] | None = None) -> int:
    from labtools import kubecluster, kubecontroller, pgfailover
    from labtools.lab import Lab, ensure_binaries
    ap = argparse.ArgumentParser(prog="python -m bench.pgfailover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--firewall", default="iptables", choices=("iptables", "nftables"))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
