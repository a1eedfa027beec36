"""The ProxyGroup variant of the demo (``make demo DEMO_ARGS="--proxygroup --once"``): egress through two replicas.

Builds the lab (headscale, a ``client`` tailscaled node with an HTTP server) and a real cluster with one node,
builds and imports both images, installs the controller from ``deploy/`` with the headscale provider, applies a
ProxyGroup of 2 (type egress) and an egress Service on it for the client's tailnet IP, and starts a client Pod
that opens a new connection to the Service every 0.2 s. It prints the first answer, deletes one replica's Pod,
prints the first answer after that, and the longest gap between successful connections over the whole run.
With ``--once`` it exits after printing: status 0 only if the requests before and after the deletion worked.
"""
from __future__ import annotations

import json
import time

from labtools import kubecontroller
from labtools.kubedemo import Stage, run_controller_demo
from labtools.lab import wait_until

PG = "demo-egress"
PORT = 18080
#: the client Pod: a new connection every 0.2 s for `seconds`, one line each: "<unix time> ok|fail <detail>"
CLIENT = ("import time, urllib.request\n"
          "end = time.time() + {seconds}\n"
          "while time.time() < end:\n"
          "    t = time.time()\n"
          "    try:\n"
          "        body = urllib.request.urlopen('http://tailnet:{port}/pg', timeout=2).read().decode()\n"
          "        print(f'{{t:.3f}} ok ' + body.replace(chr(10), ' '), flush=True)\n"
          "    except Exception as e:\n"
          "        print(f'{{t:.3f}} fail {{type(e).__name__}}', flush=True)\n"
          "    time.sleep(max(0.0, 0.2 - (time.time() - t)))\n")


def _say(msg: str) -> None:
    print(msg, flush=True)


def parse_client_log(text: str) -> list[tuple[float, bool, str]]:
    out = []
    for line in text.splitlines():
        t, _, rest = line.partition(" ")
        ok, _, detail = rest.partition(" ")
        try:
            out.append((float(t), ok == "ok", detail))
        except ValueError:
            continue
    return out


def longest_gap(results: list[tuple[float, bool, str]]) -> float:
    """The longest time between two consecutive successful connections."""
    oks = [t for t, ok, _ in results if ok]
    return max((b - a for a, b in zip(oks, oks[1:], strict=False)), default=0.0)


def run(firewall: str, once: bool, timeout: float = 240.0) -> int:
    return run_controller_demo(firewall, once, lambda st: story(st, timeout))


def story(st: Stage, timeout: float) -> bool:
    kc, lab = st.kc, st.lab
    c4, _ = lab.tailnet_ips("client")
    marker = f"tailnet-ok-{lab.prefix}"
    lab.start_http_server("client", c4, PORT, marker)
    _say(f"HTTP server on the tailnet node client at {c4}:{PORT}")
    kc.wait_dns()    # the client Pod finds the egress Service by name (the cluster's CoreDNS)
    kubecontroller.install(kc, lab, st.proxy_tar, st.ctl_tar, firewall=st.firewall, method="kubectl")
    _say("controller installed from deploy/")
    t0 = time.monotonic()
    kc.apply({"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyGroup", "metadata": {"name": PG},
              "spec": {"type": "egress", "replicas": 2}})
    kc.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}},
              {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "tailnet", "namespace": "demo", "annotations": {
                   "tailscale.com/proxy-group": PG, "tailscale.com/tailnet-ip": c4}},
               "spec": {"type": "ExternalName", "externalName": "placeholder",
                        "ports": [{"name": "http", "port": PORT, "protocol": "TCP"}]}}])
    _say(f"ProxyGroup {PG} (egress, 2 replicas) and Service demo/tailnet (-> {c4}:{PORT}) applied")

    def served():
        s = kc.get("service", "tailnet", "demo") or {}
        target = (s.get("spec") or {}).get("externalName", "").split(".")[0]
        eps = kc.get("endpointslice", f"{target}-ipv4", kubecontroller.NS) or {}
        return eps if len(eps.get("endpoints") or []) == 2 else None
    wait_until(served, timeout, 1, "both replicas serving the egress Service")
    _say(f"both replicas serve it {time.monotonic() - t0:.1f}s after it was applied:")
    _say(json.dumps(((kc.get("proxygroup", PG) or {}).get("status") or {}).get("devices"), indent=1))
    kc.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client", "namespace": "demo"},
              "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                       "containers": [{"name": "c", "image": kubecontroller.PROXY_IMAGE,
                                       "imagePullPolicy": "Never", "command": [
                                           "python3", "-c", CLIENT.format(seconds=60, port=PORT)]}]}})

    def log() -> list[tuple[float, bool, str]]:
        return parse_client_log(kc.kubectl("-n", "demo", "logs", "client", check=False).stdout)
    first = wait_until(lambda: next((r for r in log() if r[1]), None), 90, 0.5, "a first answer")
    _say(f"curl from the client Pod before: OK: {first[2]}")
    victim = f"{PG}-0"
    t_del = time.time()
    kc.kubectl("-n", kubecontroller.NS, "delete", "pod", victim, "--wait=false")
    _say(f"replica Pod {victim} deleted")
    after = wait_until(lambda: next((r for r in log() if r[1] and r[0] > t_del + 1), None), 60, 0.5,
                       "an answer after the deletion")
    _say(f"curl from the client Pod after: OK: {after[2]}")
    time.sleep(10)
    results = [r for r in log() if r[0] >= first[0]]
    fails = sum(1 for r in results if not r[1])
    _say(f"{len(results)} new connections, {fails} failed; longest gap between successful ones: "
         f"{longest_gap(results):.2f}s")
    return True
