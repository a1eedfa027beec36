"""A minimal cluster DNS for the lab's Kubernetes (the lab runs no CoreDNS): Service names from the API.

    python -m labtools.clusterdns --listen 10.99.0.50 --server https://10.99.0.50:6443 --token-file F --ca F

Run in the cluster's network namespace (``KubeCluster.popen``); Pods that should use it set
``dnsPolicy: None`` and ``dnsConfig.nameservers`` to its address (``pod_dns_config``), so nothing else in the
cluster changes. It answers, for ``<service>.<namespace>.svc.cluster.local``, what CoreDNS's kubernetes
plugin answers for the cases the controller's egress needs: a ClusterIP Service → its ClusterIP (A/AAAA); a
headless Service → the addresses of its ready endpoints (EndpointSlices); an ExternalName Service → a CNAME to
its ``externalName``, followed inside ``cluster.local`` in the same answer. Everything else is NXDOMAIN. Each
query reads the API server (no cache: the tests change Services under it), TTL 1 s.
"""
from __future__ import annotations

import argparse
import ipaddress
import socket
import ssl
import sys

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import httpx

DOMAIN = "cluster.local"


def pod_dns_config(nameserver: str, namespace: str) -> dict:
    """The Pod spec fields that make a Pod use this server, with Kubernetes' usual search list."""
    return {"dnsPolicy": "None", "dnsConfig": {
        "nameservers": [nameserver],
        "searches": [f"{namespace}.svc.{DOMAIN}", f"svc.{DOMAIN}", DOMAIN],
        "options": [{"name": "ndots", "value": "5"}]}}


class Resolver:
    def __init__(self, client: httpx.Client) -> None:
        self.c = client

    def _get(self, path: str) -> dict | None:
        r = self.c.get(path)
        return r.json() if r.status_code == 200 else None

    def lookup(self, qname: str, depth: int = 0) -> tuple[list[tuple[str, str]], list[str]]:
        """(CNAME chain as (owner, target) pairs, addresses) for a name; ([], []) when unknown."""
        name = qname.rstrip(".").lower()
        suffix = f".svc.{DOMAIN}"
        if not name.endswith(suffix) or depth > 5:
            return [], []
        parts = name[: -len(suffix)].split(".")
        if len(parts) != 2:
            return [], []
        svc_name, ns = parts
        svc = self._get(f"/api/v1/namespaces/{ns}/services/{svc_name}")
        if svc is None:
            return [], []
        spec = svc.get("spec") or {}
        if spec.get("type") == "ExternalName":
            target = spec.get("externalName", "").rstrip(".")
            chain, addrs = self.lookup(target, depth + 1)
            return [(name, target), *chain], addrs
        ips = [ip for ip in spec.get("clusterIPs") or [spec.get("clusterIP")] if ip and ip != "None"]
        if ips:
            return [], ips
        slices = self._get(f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
                           f"?labelSelector=kubernetes.io/service-name={svc_name}") or {}
        out = []
        for s in slices.get("items") or []:
            for ep in s.get("endpoints") or []:
                if (ep.get("conditions") or {}).get("ready", True):
                    out += ep.get("addresses") or []
        return [], out

    def answer(self, wire: bytes) -> bytes:
        q = dns.message.from_wire(wire)
        r = dns.message.make_response(q)
        r.flags |= dns.flags.AA
        if not q.question:
            r.set_rcode(dns.rcode.FORMERR)
            return r.to_wire()
        question = q.question[0]
        try:
            chain, addrs = self.lookup(question.name.to_text())
        except httpx.HTTPError:
            r.set_rcode(dns.rcode.SERVFAIL)
            return r.to_wire()
        if not chain and not addrs:
            r.set_rcode(dns.rcode.NXDOMAIN)
            return r.to_wire()
        for owner, target in chain:
            r.answer.append(dns.rrset.from_text(owner + ".", 1, "IN", "CNAME", target + "."))
        owner = (chain[-1][1] if chain else question.name.to_text().rstrip(".")) + "."
        want = {dns.rdatatype.A: 4, dns.rdatatype.AAAA: 6}.get(question.rdtype)
        if want:
            fam = [a for a in addrs if ipaddress.ip_address(a).version == want]
            if fam:
                r.answer.append(dns.rrset.from_text_list(owner, 1, "IN", dns.rdatatype.to_text(question.rdtype),
                                                         fam))
        return r.to_wire()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labtools.clusterdns")
    ap.add_argument("--listen", required=True)
    ap.add_argument("--port", type=int, default=53)
    ap.add_argument("--server", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--ca", required=True)
    a = ap.parse_args(argv)
    token = open(a.token_file, encoding="utf-8").read().strip()
    client = httpx.Client(base_url=a.server, verify=ssl.create_default_context(cafile=a.ca), timeout=5,
                          headers={"Authorization": f"Bearer {token}"})
    res = Resolver(client)
    sock = socket.socket(socket.AF_INET6 if ":" in a.listen else socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((a.listen, a.port))
    print(f"clusterdns: listening on {a.listen}:{a.port}/udp", flush=True)
    while True:
        wire, peer = sock.recvfrom(4096)
        try:
            sock.sendto(res.answer(wire), peer)
        except Exception as e:  # one bad query must not stop the server
            print(f"clusterdns: {peer}: {e}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
