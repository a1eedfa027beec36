"""Benchmark: the API server proxy's own cost, against a plain TCP forward over the same tailnet path.

    sudo .venv/bin/python -m bench.apiproxy [--requests 300] [--lists 6] [--objects 5000] [--json out.json]

The lab (labtools.lab: headscale, the `client` tailscaled node) with our agent in kernel mode in the proxy
namespace, a headscale policy granting the client's user `tailscale.com/cap/kubernetes`, and on that node
(labtools.apiproxylab.LocalProxy) a stand-in API server (labtools.fakeapiserver: HTTPS on loopback), the API
server proxy in auth mode on the tailnet address (port 80; every request: a LocalAPI WhoIs, the grant
decoded, headers rewritten, TLS to the API server) and, as the anchor, a plain TCP forward on the same
tailnet address (port 8443: asyncio copying bytes, no HTTP) to the same API server. The client node runs
one keep-alive HTTP client (httpx) per path: over the proxy plain HTTP, over the forward HTTPS (the TLS hop the
proxy makes itself).

Reported (medians; blocks of the two paths alternate, ABBA, so drift hits both):
- added latency of a small GET (a 600-byte Pod): median(proxy) - median(forward); goal <= 2 ms;
- a list of `--objects` Pods (about 1.5 kB each): seconds per path and throughput ratio forward/proxy
  time; goal >= 0.8;
- the proxy process's RSS after the run (VmRSS) and its peak (VmHWM).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import results  # noqa: E402
from labtools import apiproxylab as ap  # noqa: E402
from labtools.lab import Lab, ensure_binaries, wait_until  # noqa: E402

CLIENT = r'''
import json, sys, time, httpx
proxy_url, forward_url, requests, lists = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
small, listing = "/api/v1/namespaces/default/pods/small", "/api/v1/pods"
out = {"proxy": {"small": [], "list": [], "bytes": 0}, "forward": {"small": [], "list": [], "bytes": 0}}
clients = {"proxy": httpx.Client(base_url=proxy_url, timeout=60),
           "forward": httpx.Client(base_url=forward_url, timeout=60, verify=False)}
for c in clients.values():                      # connections up, TLS done, caches warm
    for _ in range(20):
        c.get(small).raise_for_status()
    c.get(listing).raise_for_status()
order = ["proxy", "forward", "forward", "proxy"]
block = max(1, requests // 20)
for i in range(20):
    for name in (order if i % 2 == 0 else order[::-1])[:2]:
        c = clients[name]
        for _ in range(block):
            t = time.perf_counter(); r = c.get(small); dt = time.perf_counter() - t
            r.raise_for_status(); out[name]["small"].append(dt)
for i in range(lists):
    for name in (order if i % 2 == 0 else order[::-1])[:2]:
        t = time.perf_counter(); r = clients[name].get(listing); dt = time.perf_counter() - t
        r.raise_for_status(); out[name]["list"].append(dt); out[name]["bytes"] = len(r.content)
print(json.dumps(out))
'''


def _rss(pid: int) -> dict[str, int]:
    out = {}
    for line in open(f"/proc/{pid}/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0])
    return out


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(prog="python -m bench.apiproxy", description=__doc__.split("\n\n")[0])
    a.add_argument("--requests", type=int, default=300, help="small GETs per path")
    a.add_argument("--lists", type=int, default=6, help="lists per path")
    a.add_argument("--objects", type=int, default=5000)
    a.add_argument("--json", help="write the figures here too")
    a.add_argument("--record", action="store_true", help="write bench/results/apiproxy.json (docs/apiserver-proxy.md)")
    a.add_argument("--recorded", default="", help="which run and machine, for the results file")
    args = a.parse_args(argv)
    from tests.support.kubeapi import make_certs
    with Lab.create(bin_dir=ensure_binaries()) as lab:
        with lab.hs_policy(ap.policy("e2e", dst="e2e@")):
            agent = lab.start_agent({"TS_HOSTNAME": "apiproxy-bench", "TS_USERSPACE": "false"})
            agent.wait_running(90)
            ip = agent.tailnet_ips()[0]
            certs = make_certs(tempfile.mkdtemp(prefix="pki-", dir=str(lab.run_dir)), ["127.0.0.1"])
            p = ap.LocalProxy(lab, agent, ca=certs.ca_path, cert=certs.cert_path, key=certs.key_path,
                              objects=args.objects, forward_port=8443)
            try:
                p.wait_listening()
                wait_until(lambda: "tailnet-readers" in lab.curl("client", f"http://{ip}/whoami", 10).stdout, 60, 1,
                           "the grant in the proxy's netmap")
                t0 = time.monotonic()
                cp = lab.exec("client", [sys.executable, "-c", CLIENT, f"http://{ip}", f"https://{ip}:8443",
                                         str(args.requests), str(args.lists)], timeout=1800,
                              env={"PYTHONPATH": str(REPO)})
                if cp.returncode != 0:
                    print(cp.stderr[-3000:], file=sys.stderr)
                    return 1
                runs = json.loads(cp.stdout)
                rss = _rss(p.proc.pid)
            finally:
                p.stop()
    med = {k: statistics.median(v["small"]) * 1000 for k, v in runs.items()}
    lst = {k: statistics.median(v["list"]) for k, v in runs.items()}
    added = med["proxy"] - med["forward"]
    ratio = lst["forward"] / lst["proxy"]
    mb = runs["proxy"]["bytes"] / 1e6
    figures = {"small_get_ms": med, "added_latency_ms": added, "list_s": lst, "list_mb": mb,
               "throughput_ratio": ratio, "proxy_rss_kb": rss, "wall_s": time.monotonic() - t0,
               "requests": args.requests, "lists": args.lists, "objects": args.objects}
    print(f"small GET, median: proxy {med['proxy']:.2f} ms, TCP forward {med['forward']:.2f} ms -> added "
          f"{added:.2f} ms (goal <= 2 ms: {'MET' if added <= 2 else 'NOT MET'})")
    print(f"list of {args.objects} Pods ({mb:.1f} MB), median: proxy {lst['proxy']:.3f} s, forward "
          f"{lst['forward']:.3f} s -> throughput {ratio:.2f}x the forward's (goal >= 0.8: "
          f"{'MET' if ratio >= 0.8 else 'NOT MET'})")
    print(f"proxy process: RSS {rss.get('VmRSS', 0) / 1024:.1f} MiB, peak {rss.get('VmHWM', 0) / 1024:.1f} MiB")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=1))
    table = results.Table.of(["figure", "measured", "goal"], [
        ["small GET, median: proxy / forward", f"{med['proxy']:.2f} / {med['forward']:.2f} ms", ""],
        ["added latency", f"{added:.2f} ms", "<= 2 ms"],
        [f"list of {args.objects:,} Pods ({mb:.1f} MB), median: proxy / forward",
         f"{lst['proxy']:.3f} / {lst['forward']:.3f} s", ""],
        ["throughput, forward time / proxy time", f"{ratio:.2f}x", ">= 0.8x"],
        ["proxy process RSS (peak)", f"{rss.get('VmRSS', 0) / 1024:.1f} ({rss.get('VmHWM', 0) / 1024:.1f}) MiB", ""]])
    recorded = args.recorded or f"{results.machine()}; the lab's tailnet, a stand-in API server over HTTPS"
    results.record(results.Results("apiproxy", "python -m bench.apiproxy", recorded, {"main": table}), args.record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
