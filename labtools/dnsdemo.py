"""The DNS variant of the demo (``make demo DEMO_ARGS="--dns --once"``): MagicDNS names inside the cluster.

Builds the lab (headscale with domain ``tailnet.test``, a ``client`` tailscaled node serving HTTP) and a real
cluster with CoreDNS, builds and imports both images, installs the controller with helm (headscale provider,
``dns.stubZoneConfigMap=kube-system/coredns``), applies a DNSConfig and an egress Service whose
``tailscale.com/tailnet-fqdn`` is the client's MagicDNS name, then prints the nameserver's status, the stub
zone the controller added to CoreDNS's Corefile, the records, and a Pod resolving the client's MagicDNS name
(CoreDNS -> stub zone -> nameserver -> the egress proxy's Pod IP) and fetching its page by that name. With
``--once`` it exits after printing: status 0 only if the Pod's fetch worked.
"""
from __future__ import annotations

import time

from labtools import kubecontroller, kubedns, kubemanifests
from labtools.kubedemo import Stage, run_controller_demo
from labtools.lab import wait_until


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(firewall: str, once: bool, timeout: float = 240.0) -> int:
    return run_controller_demo(firewall, once, lambda st: story(st, timeout))


def story(st: Stage, timeout: float) -> bool:
    kc, lab = st.kc, st.lab
    fqdn = lab.status("client")["Self"]["DNSName"].rstrip(".")
    v4, _ = lab.tailnet_ips("client")
    marker = f"magicdns-demo-ok-{lab.prefix}"
    lab.start_http_server("client", v4, 18081, marker)
    _say(f"tailnet node {fqdn} ({v4}) serves HTTP on port 18081")
    kc.wait_dns()
    _say(f"the cluster's CoreDNS answers at {kc.cfg.cluster_dns} (kube-system/kube-dns)")
    kubecontroller.install(kc, lab, st.proxy_tar, st.ctl_tar, firewall=st.firewall)
    _say("controller installed with helm (dns.stubZoneConfigMap=kube-system/coredns)")
    kc.apply(kubedns.dnsconfig("ts-dns"))
    ip = kubedns.wait_nameserver(kc, "ts-dns")
    _say(kc.kubectl("get", "dnsconfig").stdout.rstrip())
    corefile = kubedns.wait_stub_zone(kc, "tailnet.test")
    _say(f"CoreDNS's Corefile, with the controller's block (nameserver {ip}):\n{corefile.rstrip()}")
    kc.apply([kubemanifests.namespace("demo"), {
        "apiVersion": "v1", "kind": "Service", "metadata": {
            "name": "client", "namespace": "demo", "annotations": {"tailscale.com/tailnet-fqdn": fqdn}},
        "spec": {"type": "ClusterIP", "ports": [{"port": 18081}]}}])
    _say(f"egress Service demo/client (tailscale.com/tailnet-fqdn: {fqdn}) applied")
    t0 = time.monotonic()

    def resolves():
        pip = kubedns.proxy_pod_ip(kc, "demo", "client")
        return pip if pip and kubedns.ask_cluster_dns(kc, fqdn) == ("NOERROR", [pip]) else None
    pip = wait_until(resolves, timeout, 1, f"{fqdn} resolving to the egress proxy's Pod IP")
    _say(f"{fqdn} -> {pip} (the egress proxy Pod) through CoreDNS, {time.monotonic() - t0:.1f}s after "
         "the Service was applied; records.json:")
    _say(((kc.get("configmap", "dnsrecords", kubecontroller.NS) or {}).get("data") or {}).get(
        "records.json", "").rstrip())
    out = kubedns.pod_fetch(kc, "demo", "magicdns-client", fqdn, f"http://{fqdn}:18081/demo-dns",
                            kubecontroller.PROXY_IMAGE)
    _say(f"a Pod in namespace demo: {out.strip().replace(chr(10), ' | ')}")
    return marker in out
