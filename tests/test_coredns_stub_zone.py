"""A real CoreDNS (the lab's build) in front of the nameserver: the stub zone block the controller writes
forwards the tailnet's domain to it, the rest of the Corefile keeps answering; and the lab's CoreDNS objects."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess

import dns.asyncresolver
import dns.name
import dns.resolver
import pytest

from controller.kinds import dnsconfig as dc
from labtools import coredns
from nameserver.records import parse_records
from nameserver.server import NameServer, listen

BINARY = coredns.binary_path()
needs_coredns = pytest.mark.skipif(not os.access(BINARY, os.X_OK),
                                   reason=f"CoreDNS not built ({BINARY}; scripts/install-coredns.sh)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolver(port: int) -> dns.asyncresolver.Resolver:
    r = dns.asyncresolver.Resolver(configure=False)
    r.nameservers, r.port, r.lifetime = ["127.0.0.1"], port, 5
    return r


@needs_coredns
async def test_stub_zone_forwards_the_tailnet_domain_to_the_nameserver(tmp_path):
    ns = NameServer(["tail.example"], parse_records(json.dumps(
        {"version": "v1alpha1", "ip4": {"db.tail.example": ["10.244.0.7"]}, "ip6": {}})))
    transport, srv = await listen(ns, "127.0.0.1", 0)
    ns_port = srv.sockets[0].getsockname()[1]
    hosts = "other.example:{port} {{\n    hosts {{\n        192.0.2.1 www.other.example\n    }}\n}}\n"
    port = free_port()
    corefile = dc.with_stub_zone(hosts.format(port=port), "tail.example", f"127.0.0.1:{ns_port}", port=port)
    (tmp_path / "Corefile").write_text(corefile)
    proc = subprocess.Popen([str(BINARY), "-conf", str(tmp_path / "Corefile")], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        r = resolver(port)
        async with asyncio.timeout(20):
            while True:
                try:
                    ans = await r.resolve("db.tail.example", "A")
                    break
                except (dns.resolver.LifetimeTimeout, dns.resolver.NoNameservers):
                    await asyncio.sleep(0.1)   # poll: until CoreDNS has loaded the zone (bounded above)
        assert [a.to_text() for a in ans] == ["10.244.0.7"]
        with pytest.raises(dns.resolver.NXDOMAIN):
            await r.resolve("gone.tail.example", "A")
        assert [a.to_text() for a in await r.resolve("www.other.example", "A")] == ["192.0.2.1"]
    finally:
        proc.terminate()
        out = proc.communicate(timeout=10)[0].decode(errors="replace")
        transport.close()
        srv.close()
    assert "tail.example" in out     # CoreDNS announced the stub zone's server block


def test_lab_coredns_objects_are_kubeadms():
    assert coredns.cluster_dns_ip("10.96.0.0/16") == "10.96.0.10"
    assert coredns.cluster_dns_ip("10.96.0.0/16,fd00:10:96::/112") == "10.96.0.10"
    objs = {(o["kind"], o["metadata"]["name"]): o for o in coredns.manifests("10.96.0.10")}
    assert objs[("Service", "kube-dns")]["spec"]["clusterIP"] == "10.96.0.10"
    assert objs[("Service", "kube-dns")]["metadata"]["namespace"] == "kube-system"
    assert "kubernetes cluster.local in-addr.arpa ip6.arpa" in objs[("ConfigMap", "coredns")]["data"]["Corefile"]
    pod = objs[("Deployment", "coredns")]["spec"]["template"]["spec"]
    assert pod["dnsPolicy"] == "Default" and pod["containers"][0]["image"] == coredns.IMAGE
