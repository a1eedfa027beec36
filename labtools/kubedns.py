"""DNS in the lab's cluster, for the DNSConfig test and demo: ask the cluster DNS, run a Pod that resolves a name
and fetches a URL, and the DNSConfig's readiness.

    ask_cluster_dns(kc, "db.tailnet.test")         # ("NOERROR", ["10.244.0.7"]), asked from the node
    pod_fetch(kc, "apps", "client", host, url, image)  # the Pod's output once it succeeded
    wait_nameserver(kc, "ts-dns")                  # status.nameserver.ip once NameserverReady
"""
from __future__ import annotations

import sys
from typing import Any

from labtools.lab import wait_until

#: A Pod's program: resolve a name (the Pod's resolv.conf: the cluster DNS), then GET a URL; prints both.
POD_SCRIPT = ("import socket, sys, urllib.request; name, url = sys.argv[1], sys.argv[2]; "
              "print('resolved', name, socket.gethostbyname(name), flush=True); "
              "print(urllib.request.urlopen(url, timeout=10).read().decode())")


def dnsconfig(name: str = "ts-dns", **nameserver: Any) -> dict:
    return {"apiVersion": "tailscale.com/v1alpha1", "kind": "DNSConfig", "metadata": {"name": name},
            "spec": {"nameserver": nameserver}}


def ask_cluster_dns(kc, name: str, rdtype: str = "A") -> tuple[str, list[str]]:
    """(rcode, addresses) for `name` from the cluster DNS (CoreDNS's Service), asked from the node over UDP."""
    script = ("import sys, dns.message, dns.query, dns.rcode; "
              "r = dns.query.udp(dns.message.make_query(sys.argv[1], sys.argv[2]), sys.argv[3], timeout=3); "
              "print(dns.rcode.to_text(r.rcode()), *[rd.to_text() for rr in r.answer for rd in rr])")
    cp = kc.run([sys.executable, "-c", script, name, rdtype, kc.cfg.cluster_dns], check=False, timeout=15)
    words = cp.stdout.split() or [f"error: {cp.stderr.strip()[-200:]}"]
    return words[0], words[1:]


def pod_fetch(kc, namespace: str, name: str, host: str, url: str, image: str, timeout: float = 120) -> str:
    """Run a Pod (`image` with python3) that resolves `host` and GETs `url`; its output once it succeeded (the
    Pod is deleted then). Raises TimeoutError with its log."""
    kc.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
              "spec": {"restartPolicy": "OnFailure", "terminationGracePeriodSeconds": 1,
                       "containers": [{"name": "c", "image": image, "imagePullPolicy": "Never",
                                       "command": ["python3", "-c", POD_SCRIPT, host, url]}]}})

    def done():
        p = kc.get("pod", name, namespace) or {}
        return p if p.get("status", {}).get("phase") == "Succeeded" else None
    try:
        wait_until(done, timeout, 1, f"Pod {namespace}/{name}'s request")
    except TimeoutError:
        out = kc.kubectl("-n", namespace, "logs", name, check=False)
        raise TimeoutError(f"Pod {namespace}/{name} did not succeed: {out.stdout}{out.stderr}") from None
    out = kc.kubectl("-n", namespace, "logs", name).stdout
    kc.kubectl("-n", namespace, "delete", "pod", name, "--wait=false")
    return out


def wait_nameserver(kc, name: str = "ts-dns", timeout: float = 60) -> str:
    """The nameserver's address once the DNSConfig says NameserverReady."""
    def ready():
        d = kc.get("dnsconfig", name) or {}
        conds = d.get("status", {}).get("conditions") or []
        ok = any(c["type"] == "NameserverReady" and c["status"] == "True" for c in conds)
        return (d.get("status", {}).get("nameserver") or {}).get("ip") if ok else None
    return wait_until(ready, timeout, 0.5, f"DNSConfig {name} NameserverReady")


def wait_stub_zone(kc, zone: str, timeout: float = 30) -> str:
    """CoreDNS's Corefile once it has the stub zone for `zone`."""
    def has():
        c = (kc.get("configmap", "coredns", "kube-system") or {}).get("data", {}).get("Corefile", "")
        return c if f"\n{zone}:53 {{" in c else None
    return wait_until(has, timeout, 0.5, f"the stub zone {zone} in CoreDNS's Corefile")


def proxy_pod_ip(kc, namespace: str, parent: str, kind: str = "svc") -> str:
    """The first proxy Pod's IP of a parent ("" while there is none)."""
    from labtools import kubecontroller
    made = kubecontroller.children(kc, namespace, parent, kind)
    pod = kc.get("pod", made["pods"][0], kubecontroller.NS) if made["pods"] else None
    return ((pod or {}).get("status") or {}).get("podIP") or ""
