"""labtools.clusterdns (the lab cluster's DNS for Service names): the answers CoreDNS's kubernetes plugin gives
for the cases the controller's egress needs, from an API stand-in (no network)."""
from __future__ import annotations

import dns.message
import dns.rcode

from labtools.clusterdns import Resolver, pod_dns_config

SERVICES = {
    "/api/v1/namespaces/apps/services/egress": {
        "spec": {"type": "ExternalName", "externalName": "ts-egress-abcde.tailscale.svc.cluster.local"}
    },
    "/api/v1/namespaces/tailscale/services/ts-egress-abcde": {"spec": {"clusterIP": "None", "clusterIPs": ["None"]}},
    "/api/v1/namespaces/apps/services/web": {"spec": {"clusterIP": "10.96.0.20", "clusterIPs": ["10.96.0.20"]}},
}
SLICES = {"items": [{"endpoints": [{"addresses": ["10.244.0.9"], "conditions": {"ready": True}},
                                   {"addresses": ["10.244.0.10"], "conditions": {"ready": False}}]}]}


class FakeAPI:
    def get(self, path):
        class R:
            pass
        r = R()
        if path in SERVICES:
            r.status_code, r.json = 200, (lambda: SERVICES[path])
        elif "/endpointslices?labelSelector=kubernetes.io/service-name=ts-egress-abcde" in path:
            r.status_code, r.json = 200, (lambda: SLICES)
        else:
            r.status_code = 404
        return r


def ask(name: str, rdtype: str = "A") -> dns.message.Message:
    return dns.message.from_wire(Resolver(FakeAPI()).answer(dns.message.make_query(name, rdtype).to_wire()))


def test_external_name_is_a_cname_followed_to_the_headless_services_ready_endpoints():
    r = ask("egress.apps.svc.cluster.local.")
    assert [rr.to_text() for rr in r.answer] == [
        "egress.apps.svc.cluster.local. 1 IN CNAME ts-egress-abcde.tailscale.svc.cluster.local.",
        "ts-egress-abcde.tailscale.svc.cluster.local. 1 IN A 10.244.0.9"]


def test_cluster_ip_and_unknown_names():
    assert [rr.to_text() for rr in ask("web.apps.svc.cluster.local.").answer] == [
        "web.apps.svc.cluster.local. 1 IN A 10.96.0.20"]
    assert ask("web.apps.svc.cluster.local.", "AAAA").answer == []
    assert ask("nope.apps.svc.cluster.local.").rcode() == dns.rcode.NXDOMAIN
    assert ask("example.com.").rcode() == dns.rcode.NXDOMAIN


def test_pod_dns_config_has_kubernetes_search_list():
    c = pod_dns_config("10.99.0.50", "apps")
    assert c["dnsPolicy"] == "None" and c["dnsConfig"]["nameservers"] == ["10.99.0.50"]
    assert c["dnsConfig"]["searches"][0] == "apps.svc.cluster.local"
