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

from labtools import kubecluster, kubecontroller, kubedns, kubemanifests
from labtools.lab import Lab, LabError, ensure_binaries, wait_until


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(firewall: str, once: bool, timeout: float = 240.0) -> int:
    t_all = time.monotonic()
    bin_dir = ensure_binaries(upstream=False)
    k8s_bin = kubecluster.ensure_binaries()
    t0 = time.monotonic()
    proxy_tar, ctl_tar = kubecontroller.build_images()
    _say(f"images {kubecontroller.PROXY_IMAGE} and {kubecontroller.CONTROLLER_IMAGE} ready "
         f"({time.monotonic() - t0:.1f}s)")
    ok = False
    with Lab.create(bin_dir=bin_dir, firewall_mode=firewall) as lab:
        fqdn = lab.status("client")["Self"]["DNSName"].rstrip(".")
        v4, _ = lab.tailnet_ips("client")
        marker = f"magicdns-demo-ok-{lab.prefix}"
        lab.start_http_server("client", v4, 18081, marker)
        _say(f"lab {lab.prefix} up; tailnet node {fqdn} ({v4}) serves HTTP on port 18081")
        with kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin) as kc:
            try:
                kc.wait_dns()
                _say(f"cluster up with CoreDNS at {kc.cfg.cluster_dns} (kube-system/kube-dns)")
                kubecontroller.install(kc, lab, proxy_tar, ctl_tar, firewall=firewall)
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
                ok = marker in out
            except (TimeoutError, LabError, kubecluster.ClusterError) as e:
                _say(f"FAILED: {e}")
                _say(kubecontroller.controller_log(kc))
                _say(kc.diagnostics())
            if not once:
                _say("cluster is up; press Ctrl-C to tear it down "
                     f"(kubectl: ip netns exec {kc.netns} {k8s_bin}/kubectl --kubeconfig {kc.kubeconfig} ...)")
                while True:
                    time.sleep(1)
    _say(f"done in {time.monotonic() - t_all:.1f}s; everything torn down")
    return 0 if ok else 1
