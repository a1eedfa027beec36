"""The companion controller end to end in the lab's real Kubernetes, with the lab's real headscale.

One cluster for the module (labtools.kubecluster, a node in the island), both images from the project's own
build (``make image`` and images/controller/Dockerfile, imported into the node's containerd), the controller
installed as a user would with helm (labtools.kubecontroller.install: ``helm install`` of
charts/tailscale-controller with provider headscale, the lab's headscale URL and an API key made with it as a
value, through stdin): it runs as the Deployment's Pod with the ServiceAccount and RBAC the chart renders (the
same as deploy/, which is rendered from it), and mints keys with headscale's REST API. helm's output (NOTES)
and the controller's log never contain the API key; at the end ``helm uninstall`` leaves nothing of the
release (the CRDs stay: they carry helm's keep policy). ``kubectl apply -R -f deploy/`` is the path of
netns-tests/test_controller_apiserver.py and ``make demo DEMO_ARGS=--controller``.

1. L3 ingress: a backend Deployment and a Service annotated ``tailscale.com/expose: "true"`` → the controller
   renders the proxy (StatefulSet, Secret, headless Service), the proxy Pod (the project's proxy image) logs in
   to headscale with the minted single-use tagged key, the Service's status gets the tailnet hostname and IP,
   and the lab's tailnet client reaches the backend Pods by that IP (tailnet → proxy Pod → ClusterIP →
   kube-proxy → backend). The proxy runs as its own ServiceAccount whose Role reaches its own Secret only: its
   Secret calls (audit log) all succeed, `kubectl auth can-i` says no to the controller's `headscale-api` and
   to other Secrets, and a real request with its token gets 403. Deleting the Service leaves nothing: no
   StatefulSet, Secret, headless Service, Pod, ServiceAccount, Role or RoleBinding in the cluster, no node in
   headscale, and the Service itself is gone (finalizer released).
2. Connector subnet router for the node's Pod CIDR: ConnectorReady with subnetRoutes, the route reaches
   headscale unapproved, the test approves it as the headscale admin would (the controller never approves
   routes), and the client reaches each backend Pod by its Pod IP through the router Pod (SNATed to it).
   Deleting the Connector leaves nothing, in the cluster or in headscale.
3. A Connector asking for subnet routes and an exit node is stored (the CRD accepts what upstream's accepts)
   and built: its device advertises both (netns-tests/test_connector_e2e.py measures that both work).
4. L3 egress: a Service annotated ``tailscale.com/tailnet-ip`` (the lab client's tailnet IP) is rewritten to an
   ExternalName for the proxy's headless Service; a Pod asks for it by its short name (the cluster's CoreDNS)
   and reaches the HTTP server on the tailnet node, which sees the proxy's tailnet address. Deleting the
   Service leaves nothing.
5. L7 Ingress on headscale, over plain HTTP on port 80 (headscale issues no certificates, so HTTPS could never
   serve; ``INGRESS_SCHEME=auto``): the userspace proxy applies a serve config for its MagicDNS name, the
   Ingress's status gets that name on port 80, and the tailnet client reaches the default backend and a path
   rule's backend through it by that name; a bare-IP request gets tailscaled's 404. Deletion leaves nothing.
6. ProxyClass: a class with labels, a node selector, resources, ``TS_EXTRA_ARGS=--advertise-tags`` and metrics
   on a Service (labelled before the class exists: it waits, then converges), an Ingress and a Connector; the
   Pods carry it, the devices the class's tag in headscale, ``/metrics`` answers on each Pod IP; the class as
   an annotation gets a Warning; editing the class rolls its three users' Pods and not the others.
7. DNSConfig with the cluster's CoreDNS: MagicDNS names of an egress Service's target and of a tailnet Ingress
   resolve in Pods through the controller's stub zone and nameserver, and stop resolving when their parent
   goes (docs/dns.md).
8. Two controller replicas: one holds the leader Lease, the other stands by; the leader's Pod is deleted, and
   a live replica (the standby or the Deployment's replacement Pod) takes the Lease over and gives a new
   annotated Service its proxy (a tailnet IP in its status); deleting it leaves nothing.
7. The API server proxy (``helm upgrade --set apiServerProxy.mode=auth``, then ``noauth``, then ``off``):
   kubectl from the lab's tailnet client through it, with the tailnet identity impersonated.
   Session recording: the client's kubectl exec (WebSocket and SPDY) recorded into our recorder on a tagged
   tailnet node, refused (and never run) with the recorder stopped (docs/recording.md). A Recorder object run
   by the controller: an exec recorded on its volume, a `kubectl get`'s API request event (`enableEvents`), then
   with `storage.s3` an exec recorded into the bucket of the lab's S3 server.
9. A control server behind a private CA (``proxy.caConfigMap``, ``loginServer`` on HTTPS): a proxy logs in
   through a TLS front of headscale and carries traffic.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import subprocess
import time

import pytest
from needs import unavailable

from labtools import helmchart, kubecluster, kubecontroller, kubedns, kubemanifests
from labtools import lab as labmod
from labtools.lab import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(900)]

CONTROLLER_SA = "system:serviceaccount:tailscale:tailscale-controller"


@pytest.fixture(scope="module")
def kube(lab, project_images, k8s_bin_dir, helm_bin):
    """A cluster with a node, the controller installed with helm (headscale provider), an echo backend."""
    kc = kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin_dir)
    try:
        kc.ctl_timings = kubecontroller.install(kc, lab, *project_images, firewall=lab.firewall_mode)
        kc.marker = f"echo-ok-{lab.prefix}"
        kc.apply([kubemanifests.namespace("apps"),
                  *kubemanifests.echo_backend("apps", "echo", kc.marker, kubecluster.ECHO_IMAGE, replicas=2)])
        kc.kubectl("-n", "apps", "rollout", "status", "deployment/echo", "--timeout=90s", timeout=100)
        yield kc
    except BaseException:
        print(kubecontroller.controller_log(kc, 200))
        print(kc.diagnostics())
        raise
    finally:
        kc.close()


def _service(name: str, annotations: dict[str, str], **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "apps", "annotations": annotations},
            "spec": {"selector": {"app": "echo"}, "ports": [{"port": 8080, "targetPort": 8080}], **spec}}


def _hs_nodes_named(lab, name: str) -> list[dict]:
    return [n for n in lab.hs_nodes() if name in (n.get("name"), n.get("given_name"))]


def _fail_report(kc, ns="apps", name="web", ctl_ns=kubecontroller.NS) -> str:
    pods = kc.kubectl("-n", ctl_ns, "get", "pods", "-o", "wide", check=False).stdout
    logs = kc.kubectl("-n", ctl_ns, "logs", "-l", f"tailscale.com/parent-resource={name}",
                      "--tail=60", "--all-containers", check=False)
    ctl = kc.kubectl("-n", ctl_ns, "logs", "deployment/tailscale-controller", "--tail=80", check=False)
    svc = kc.get("service", name, ns)
    return (f"--- controller log\n{ctl.stdout}{ctl.stderr}\n--- pods\n{pods}\n"
            f"--- proxy log\n{logs.stdout}{logs.stderr}\n"
            f"--- service status\n{json.dumps((svc or {}).get('status'), indent=1)}")


def test_expose_service_proxy_pod_logs_in_status_curl_and_clean_delete(lab, kube):
    kc = kube
    # the controller is the Deployment's Pod, from the imported image, with deploy/'s ServiceAccount
    pod = kubecontroller.controller_pod(kc)
    assert pod is not None and pod["spec"]["serviceAccountName"] == "tailscale-controller"
    assert pod["spec"]["containers"][0]["image"] == kubecontroller.CONTROLLER_IMAGE
    # ... installed by helm: the release is deployed, the API key reached the controller only through the
    # chart's Secret, and neither helm's output (NOTES) nor the controller's log shows it
    (rel,) = json.loads(kubecontroller.helm(kc, "list", "-n", kubecontroller.NS, "-o", "json").stdout)
    assert (rel["name"], rel["status"], rel["chart"]) == ("tailscale-controller", "deployed",
                                                          "tailscale-controller-0.1.0"), rel
    dep = kc.get("deployment", "tailscale-controller", kubecontroller.NS)
    assert dep["metadata"]["labels"].get("app.kubernetes.io/managed-by") == "Helm", dep["metadata"]
    key = kubecontroller.secret_data(kc, kubecontroller.NS, "headscale-api")["key"].decode()
    assert len(key) > 20 and "annotate service <name> tailscale.com/expose=true" in kc.helm_output, kc.helm_output
    assert key not in kc.helm_output and key not in kubecontroller.controller_log(kc, 2000)
    lab.delete_node("apps-web")

    t0 = time.monotonic()
    kc.apply(_service("web", {"tailscale.com/expose": "true"}, type="LoadBalancer"))
    try:
        svc = kubecontroller.wait_service_ip(kc, "apps", "web", 180)
    except TimeoutError:
        raise AssertionError(_fail_report(kc)) from None
    t_ip = time.monotonic() - t0
    ingress = svc["status"]["loadBalancer"]["ingress"]
    ips = kubecontroller.lb_ips(svc)
    print(f"Service apps/web: tailnet IP in its status {t_ip:.1f}s after it was created: {ingress}")

    # the status is what headscale knows about the proxy's node
    (node,) = _hs_nodes_named(lab, "apps-web")
    assert ingress[0] == {"hostname": f"{node['given_name']}.tailnet.test"}
    assert ips == [a for a in node["ip_addresses"] if ":" not in a], (ips, node["ip_addresses"])
    tags = set(node.get("tags") or node.get("forced_tags") or node.get("valid_tags") or [])
    assert "tag:k8s" in tags, node
    cond = next(c for c in svc["status"]["conditions"] if c["type"] == "TailscaleProxyReady")
    assert (cond["status"], cond["reason"]) == ("True", "ProxyCreated"), cond
    assert "tailscale.com/finalizer" in svc["metadata"]["finalizers"]

    # what the controller made, with upstream's labels, in its namespace; the proxy Pod runs the proxy image
    made = kubecontroller.children(kc, "apps", "web")
    assert len(made["statefulsets"]) == 1 and len(made["pods"]) == 1, made
    sts = made["statefulsets"][0]
    assert made["secrets"] == [f"{sts}-0"] and made["services"] == [sts], made
    proxy = kc.get("pod", made["pods"][0], kubecontroller.NS)
    assert proxy["spec"]["containers"][0]["image"] == kubecontroller.PROXY_IMAGE
    # ... and the proxy's own identity (a deliberate difference: no shared `proxies` ServiceAccount): the Pod
    # runs, logged in and wrote its state (above), as a ServiceAccount that may touch its own Secret only
    assert made["serviceaccounts"] == made["roles"] == made["rolebindings"] == [sts], made
    assert proxy["spec"]["serviceAccountName"] == sts
    proxy_sa = f"system:serviceaccount:{kubecontroller.NS}:{sts}"

    def can_i(*what: str) -> bool:
        cp = kc.kubectl("auth", "can-i", *what, "-n", kubecontroller.NS, f"--as={proxy_sa}", check=False)
        assert cp.stdout.strip() in ("yes", "no"), (cp.stdout, cp.stderr)
        return cp.stdout.strip() == "yes"
    assert all(can_i(verb, f"secret/{sts}-0") for verb in ("get", "update", "patch"))
    for other in ("headscale-api", "operator-oauth", "ts-db-abcde-0"):
        assert not can_i("get", f"secret/{other}") and not can_i("patch", f"secret/{other}"), other
    assert not can_i("list", "secrets") and not can_i("delete", f"secret/{sts}-0")
    # a real request with the proxy's credentials: the controller's API key is refused to it
    code, _ = kc.request("GET", f"/api/v1/namespaces/{kubecontroller.NS}/secrets/headscale-api",
                         token=kc.service_account_token(kubecontroller.NS, sts, 600))
    assert code == 403, code
    # the agent's own Secret calls (the API server's audit log) all went through, on its own Secret only
    own = [c for c in kc.audit(user=proxy_sa) if c["verb"] != "get" or
           c["objectRef"].get("name") != "headscale-api"]
    assert own and {c["objectRef"].get("name") for c in own} == {f"{sts}-0"}, [
        (c["verb"], c["objectRef"].get("name")) for c in own]
    assert all(c["responseStatus"]["code"] < 400 for c in own), [
        (c["verb"], c["objectRef"].get("name"), c["responseStatus"]["code"]) for c in own]
    data = kubecontroller.secret_data(kc, kubecontroller.NS, f"{sts}-0")
    assert json.loads(data["device_ips"])[0] == ips[0] and data["device_id"].decode() == str(node["id"])
    # the key was used once: registered, so it left the config the controller rendered
    conf = json.loads(next(v for k, v in data.items() if k.startswith("cap-")))
    assert "AuthKey" not in conf and conf["ServerURL"] == "http://10.99.0.1:8080", conf
    # every Secret call of the controller went through deploy/'s RBAC, none was refused
    calls = kc.audit(user=CONTROLLER_SA)
    assert calls and all(c["responseStatus"]["code"] < 400 or c["responseStatus"]["code"] == 404 for c in calls), [
        (c["verb"], c["objectRef"].get("name"), c["responseStatus"]["code"]) for c in calls if
        c["responseStatus"]["code"] >= 400]

    # the tailnet client reaches the backend Deployment by the IP in the status (through the proxy Pod and
    # kube-proxy: both backend Pods answer, each seeing the proxy Pod's address)
    lab.wait_peer("client", "apps-web", 60)
    seen = set()
    for i in range(12):
        body = lab.wait_curl("client", lab.url(ips[0], 8080, f"/status-ip-{i}"), kc.marker, timeout=60)
        assert f"peer={proxy['status']['podIP']}:" in body, body
        seen.add(next((w for w in body.split() if w.startswith("host=")), body))
        if len(seen) == 2:
            break
    print(f"curl client -> {ips[0]}:8080 reached backend Pods {sorted(seen)}")

    # delete the Service: the proxy, its Secret and headless Service go, the node leaves headscale, and the
    # finalizer is released so the Service is gone
    kc.kubectl("-n", "apps", "delete", "service", "web", "--wait=false")
    try:
        wait_until(lambda: kc.get("service", "web", "apps") is None, 120, 0.5, "the Service gone")
    except TimeoutError:
        raise AssertionError(_fail_report(kc)) from None
    # ... with the proxy's ServiceAccount, Role and RoleBinding
    assert kubecontroller.children(kc, "apps", "web") == kubecontroller.NO_CHILDREN
    assert kc.get("statefulset", sts, kubecontroller.NS) is None and kc.get("secret", f"{sts}-0",
                                                                            kubecontroller.NS) is None
    assert _hs_nodes_named(lab, "apps-web") == [], lab.hs_nodes()


def _connector(name: str, spec: dict) -> dict:
    return {"apiVersion": "tailscale.com/v1alpha1", "kind": "Connector", "metadata": {"name": name}, "spec": spec}


def test_connector_subnet_router_route_approved_client_reaches_a_pod_ip(lab, kube):
    """A Connector advertising the node's Pod CIDR: the proxy Pod advertises it, the headscale admin approves
    it (the controller does not approve routes: that stays the control plane's decision, by hand as here or by
    headscale's autoApprovers), and the tailnet client reaches a backend Pod by its Pod IP through the router."""
    kc = kube
    cidr = kc.pod_cidr
    lab.delete_node("pods-router")
    kc.apply(_connector("pods", {"hostname": "pods-router", "subnetRouter": {"advertiseRoutes": [cidr]}}))
    try:
        def ready():
            c = kc.get("connector", "pods")
            conds = (c or {}).get("status", {}).get("conditions") or []
            return c if any(x["type"] == "ConnectorReady" and x["status"] == "True" for x in conds) else None
        conn = wait_until(ready, 180, 0.5, "Connector pods Ready")
    except TimeoutError:
        raise AssertionError(_fail_report(kc, "", "pods")) from None
    st = conn["status"]
    assert st["subnetRoutes"] == cidr and st["isExitNode"] is False and st["hostname"].startswith("pods-router."), st
    # the router asks for the route; headscale holds it until approved
    node = wait_until(lambda: next((n for n in _hs_nodes_named(lab, "pods-router")
                                    if cidr in (n.get("available_routes") or [])), None), 60, 0.5,
                      "the advertised route in headscale")
    assert cidr not in (node.get("approved_routes") or []), node
    lab.approve_routes("pods-router", [cidr])
    pods = json.loads(kc.kubectl("-n", "apps", "get", "pods", "-l", "app=echo", "-o", "json").stdout)["items"]
    made = kubecontroller.children(kc, "", "pods", "connector")
    router = kc.get("pod", made["pods"][0], kubecontroller.NS)
    for p in pods:
        ip = p["status"]["podIP"]
        body = lab.wait_curl("client", lab.url(ip, 8080, "/via-connector"), kc.marker, timeout=90)
        # the router SNATs (tailscaled's --snat-subnet-routes default): the backend Pod sees the router Pod
        assert f"peer={router['status']['podIP']}:" in body and f"host={p['metadata']['name']}" in body, body
    print(f"curl client -> Pod IPs {[p['status']['podIP'] for p in pods]} through Connector pods: OK")

    kc.kubectl("delete", "connector", "pods", "--wait=false")
    wait_until(lambda: kc.get("connector", "pods") is None, 120, 0.5, "the Connector gone")
    assert kubecontroller.children(kc, "", "pods", "connector") == kubecontroller.NO_CHILDREN
    assert _hs_nodes_named(lab, "pods-router") == []


def test_connector_router_and_exit_node_is_stored_and_built(lab, kube):
    """The CRD accepts it, as upstream's does; the controller builds one device advertising both."""
    kc = kube
    doc = json.dumps(_connector("both", {"subnetRouter": {"advertiseRoutes": ["10.40.0.0/14"]}, "exitNode": True}))
    kc.kubectl("apply", "-f", "-", input=doc)
    wait_until(lambda: kubecontroller.children(kc, "", "both", "connector")["statefulsets"], 60, 0.5,
               "the Connector's StatefulSet")
    status = wait_until(lambda: (kc.get("connector", "both") or {}).get("status", {}).get("isExitNode") and
                        kc.get("connector", "both")["status"], 60, 0.5, "the Connector's status")
    assert status["subnetRoutes"] == "10.40.0.0/14", status
    node = wait_until(lambda: (_hs_nodes_named(lab, "both-connector") or [None])[0], 120, 1.0,
                      "the Connector's device in headscale")
    print(f"Connector both: headscale node {node.get('name')} available routes {node.get('available_routes')}")
    kc.kubectl("delete", "connector", "both", "--wait=true", timeout=120)
    assert kubecontroller.children(kc, "", "both", "connector") == kubecontroller.NO_CHILDREN


def test_egress_pod_reaches_a_tailnet_node_through_the_rewritten_service(lab, kube):
    """L3 egress: a Service annotated ``tailscale.com/tailnet-ip`` (the lab client's tailnet IP) → the controller
    renders the egress proxy and rewrites the Service to an ExternalName for the proxy's headless Service; a Pod
    in the cluster asks for the Service by name and reaches the HTTP server on the tailnet node through the
    proxy. The cluster's CoreDNS answers: ExternalName → CNAME → the headless Service's ready endpoints (the
    proxy Pod)."""
    kc = kube
    kc.wait_dns()
    v4, _ = lab.tailnet_ips("client")
    marker = f"tailnet-node-ok-{lab.prefix}"
    lab.start_http_server("client", v4, 18080, marker)
    lab.delete_node("apps-to-client")
    kc.apply(_service("to-client", {"tailscale.com/tailnet-ip": v4, "tailscale.com/hostname": "apps-to-client"},
                      type="ClusterIP"))

    def rewritten():
        s = kc.get("service", "to-client", "apps")
        conds = (s or {}).get("status", {}).get("conditions") or []
        ok = any(c["type"] == "TailscaleProxyReady" and c["status"] == "True" for c in conds)
        return s if ok and s["spec"].get("type") == "ExternalName" else None
    try:
        svc = wait_until(rewritten, 180, 0.5, "the egress Service rewritten and its proxy ready")
    except TimeoutError:
        raise AssertionError(_fail_report(kc, "apps", "to-client")) from None
    made = kubecontroller.children(kc, "apps", "to-client")
    assert svc["spec"]["externalName"] == f"{made['services'][0]}.tailscale.svc.cluster.local", svc["spec"]
    proxy = kc.get("pod", made["pods"][0], kubecontroller.NS)
    # a Pod in the cluster: the Service by its short name, through the cluster DNS, the proxy, the tailnet
    out = kubedns.pod_fetch(kc, "apps", "egress-client", "to-client", "http://to-client:18080/from-pod",
                            kubecontroller.PROXY_IMAGE)
    print(out)
    assert f"resolved to-client {proxy['status']['podIP']}" in out and marker in out, out
    # the tailnet node saw the proxy's tailnet address (SNAT), not the Pod's
    (node,) = _hs_nodes_named(lab, "apps-to-client")
    peers = [e.get("peer", "") for e in lab.http_peer_log("client", 18080)]
    assert peers and all(p in node["ip_addresses"] for p in peers), (peers, node["ip_addresses"])

    kc.kubectl("-n", "apps", "delete", "service", "to-client", "--wait=false")
    wait_until(lambda: kc.get("service", "to-client", "apps") is None, 120, 0.5, "the Service gone")
    assert kubecontroller.children(kc, "apps", "to-client") == kubecontroller.NO_CHILDREN
    assert _hs_nodes_named(lab, "apps-to-client") == []


def _curl_until(lab, url: str, expect: str, extra: list[str], timeout: float = 60.0) -> str:
    last = [""]

    def pred():
        cp = lab.curl("client", url, 3.0, extra=extra)
        last[0] = f"exit {cp.returncode}: {cp.stdout[-300:]}{cp.stderr[-300:]}"
        return cp.stdout if cp.returncode == 0 and expect in cp.stdout else None
    try:
        return wait_until(pred, timeout, 0.5, f"curl {url} {extra}")
    except TimeoutError:
        raise AssertionError(f"curl {url} {extra}: {last[0]}") from None


def test_l7_ingress_on_headscale_over_http_by_magicdns_name(lab, kube):
    """L7 Ingress (``ingressClassName: tailscale``) on headscale, served over plain HTTP on port 80 (our
    INGRESS_SCHEME=auto: headscale issues no certificates, so HTTPS could never serve). The controller renders
    the userspace proxy with a serve config for its MagicDNS name (default backend and a ``/api`` path rule to a
    second backend), the proxy logs in and applies it, the Ingress's status gets that name on port 80 and a
    Normal ``HTTPOnly`` event says why, and the lab's tailnet client reaches both backends through the proxy by
    that name. A request by bare tailnet IP gets tailscaled's 404 (it matches Web handlers by the Host name).
    The proxy still reports ``https_endpoint: no-https``: HTTPS through it stays impossible on headscale.
    Deletion leaves nothing, in the cluster or in headscale."""
    kc = kube
    host = "apps-web-ingress"
    fqdn = f"{host}.tailnet.test"
    lab.delete_node(host)
    api_marker = f"api-ok-{lab.prefix}"
    kc.apply(kubemanifests.echo_backend("apps", "echo-api", api_marker, kubecluster.ECHO_IMAGE))
    cip = kc.get("service", "echo", "apps")["spec"]["clusterIP"]
    api_cip = kc.get("service", "echo-api", "apps")["spec"]["clusterIP"]
    kc.apply({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "web", "namespace": "apps"},
              "spec": {"ingressClassName": "tailscale",
                       "defaultBackend": {"service": {"name": "echo", "port": {"number": 8080}}},
                       "rules": [{"http": {"paths": [{"path": "/api", "pathType": "Prefix", "backend": {
                           "service": {"name": "echo-api", "port": {"number": 8080}}}}]}}]}})
    t0 = time.monotonic()
    try:
        def published():
            ing = kc.get("ingress", "web", "apps") or {}
            return ing if (ing.get("status", {}).get("loadBalancer") or {}).get("ingress") else None
        ing = wait_until(published, 180, 0.5, "the Ingress's LoadBalancer status")
    except TimeoutError:
        raise AssertionError(_fail_report(kc, "apps", "web")) from None
    t_status = time.monotonic() - t0
    (node,) = _hs_nodes_named(lab, host)
    assert ing["status"]["loadBalancer"]["ingress"] == [
        {"hostname": f"{node['given_name']}.tailnet.test", "ports": [{"port": 80, "protocol": "TCP"}]}]
    assert node["given_name"] == host, node
    made = kubecontroller.children(kc, "apps", "web", "ingress")
    data = kubecontroller.secret_data(kc, kubecontroller.NS, made["secrets"][0])
    assert json.loads(data["serve-config"]) == {
        "TCP": {"80": {"HTTP": True}},
        "Web": {f"{fqdn}:80": {"Handlers": {"/": {"Proxy": f"http://{cip}:8080/"},
                                           "/api": {"Proxy": f"http://{api_cip}:8080/api"}}}}}
    assert data["device_fqdn"] == f"{fqdn}.".encode() and data["device_id"].decode() == str(node["id"])
    assert data["https_endpoint"] == b"no-https", data["https_endpoint"]     # no certificate domain from headscale
    # why: tailscaled refuses certificates on any headscale node (here the lab's client, same control plane)
    me = lab.status("client")["Self"]["DNSName"].rstrip(".")
    cp = lab.ts("client", "cert", "--cert-file", "/dev/null", "--key-file", "/dev/null", me, check=False)
    assert cp.returncode != 0 and "your Tailscale account does not support getting TLS certs" in cp.stderr, cp
    proxy = kc.get("pod", made["pods"][0], kubecontroller.NS)
    env = {e["name"]: e.get("value") for e in proxy["spec"]["containers"][0]["env"]}
    assert env["TS_USERSPACE"] == "true" and env["TS_SERVE_CONFIG"] == "/etc/tailscaled/$(POD_NAME)/serve-config"
    events = json.loads(kc.kubectl("-n", "apps", "get", "events", "-o", "json").stdout)["items"]
    http_only = [e for e in events if e.get("reason") == "HTTPOnly" and e["involvedObject"].get("name") == "web"]
    assert [(e["type"], e["message"].split(":")[0]) for e in http_only] == [
        ("Normal", "served over plain HTTP on port 80 inside the tailnet (WireGuard encrypts it), not HTTPS"),
    ], http_only

    # the tailnet client, by the MagicDNS name (resolved to the proxy's tailnet IP by curl, as MagicDNS would):
    # the default backend, and the /api rule's backend
    ip = next(a for a in node["ip_addresses"] if ":" not in a)
    lab.wait_peer("client", host, 60)
    resolve = ["--resolve", f"{fqdn}:80:{ip}"]
    body = _curl_until(lab, f"http://{fqdn}/hello", kc.marker, resolve)
    assert "path=/hello\n" in body and f"peer={proxy['status']['podIP']}:" in body, body
    body = _curl_until(lab, f"http://{fqdn}/api/items?x=1", api_marker, resolve)
    assert "path=/api/items?x=1\n" in body, body
    # the short name works too (tailscaled appends the tailnet's suffix); the bare IP matches no name: 404
    _curl_until(lab, f"http://{ip}/short", kc.marker, ["-H", f"Host: {host}"])
    cp = lab.curl("client", f"http://{ip}/", 5.0, extra=["-o", "/dev/null", "-w", "%{http_code}"])
    assert cp.stdout.strip() == "404", (cp.returncode, cp.stdout, cp.stderr)
    print(f"Ingress apps/web: status {ing['status']['loadBalancer']} {t_status:.1f}s after the apply; "
          f"curl client -> http://{fqdn}/ and /api reached both backends; http://{ip}/ -> 404")

    kc.kubectl("-n", "apps", "delete", "ingress", "web", "--wait=false")
    wait_until(lambda: kc.get("ingress", "web", "apps") is None, 120, 0.5, "the Ingress gone")
    assert kubecontroller.children(kc, "apps", "web", "ingress") == kubecontroller.NO_CHILDREN
    assert _hs_nodes_named(lab, host) == []


def test_dnsconfig_magicdns_names_resolve_in_pods_through_coredns_stub_zone(lab, kube):
    """DNSConfig on headscale with the cluster's real CoreDNS: the controller deploys the nameserver (the proxy
    image's k8s-nameserver entrypoint) and, as the chart was told (dns.stubZoneConfigMap), adds its stub zone for
    headscale's domain (tailnet.test) to CoreDNS's Corefile. A Pod resolves the tailnet client's MagicDNS name,
    the tailnet-fqdn of an egress Service, to the egress proxy's Pod IP (CoreDNS -> stub zone -> nameserver)
    and fetches a page from the tailnet node by that name; a second Pod reaches a tailnet Ingress (annotated to
    accept cluster traffic) by its MagicDNS name. Deleting the egress Service makes the name NXDOMAIN within
    the time docs/dns.md states for the lab (60 s); deleting the DNSConfig removes the nameserver and the stub
    zone, leaving the rest of the Corefile as it was."""
    kc = kube
    kc.wait_dns()
    corefile_before = kc.get("configmap", "coredns", "kube-system")["data"]["Corefile"]
    # CoreDNS answers the cluster's own names
    api = kubedns.ask_cluster_dns(kc, "kubernetes.default.svc.cluster.local")
    assert api == ("NOERROR", [kc.cfg.kubernetes_service_ip]), api
    # the DNSConfig, an egress Service for the tailnet client by its MagicDNS name and a tailnet Ingress that
    # accepts cluster traffic, all at once (their proxies start side by side)
    fqdn = lab.status("client")["Self"]["DNSName"].rstrip(".")
    v4, _ = lab.tailnet_ips("client")
    marker = f"magicdns-ok-{lab.prefix}"
    lab.start_http_server("client", v4, 18081, marker)
    host = "apps-dns-ingress"
    ing_fqdn = f"{host}.tailnet.test"
    for n in ("apps-to-client-fqdn", host):
        lab.delete_node(n)
    t0 = time.monotonic()
    kc.apply([kubedns.dnsconfig("ts-dns"),
              _service("client-fqdn", {"tailscale.com/tailnet-fqdn": fqdn,
                                        "tailscale.com/hostname": "apps-to-client-fqdn"}, type="ClusterIP"),
              {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
               "metadata": {"name": "dns-web", "namespace": "apps", "annotations": {
                   "tailscale.com/experimental-forward-cluster-traffic-via-ingress": "true"}},
               "spec": {"ingressClassName": "tailscale", "tls": [{"hosts": [host]}],
                        "defaultBackend": {"service": {"name": "echo", "port": {"number": 8080}}}}}])
    try:
        ns_ip = kubedns.wait_nameserver(kc, "ts-dns")
        kc.kubectl("-n", kubecontroller.NS, "rollout", "status", "deployment/nameserver", "--timeout=90s", timeout=100)
        corefile = kubedns.wait_stub_zone(kc, "tailnet.test")
        assert corefile.startswith(corefile_before) and f"forward . {ns_ip}" in corefile, corefile
    except TimeoutError:
        raise AssertionError(kubecontroller.controller_log(kc)) from None

    # the egress Service's tailnet name resolves to its proxy's Pod IP, and a Pod fetches a page by that name
    try:
        def resolves():
            ip = kubedns.proxy_pod_ip(kc, "apps", "client-fqdn")
            return ip if ip and kubedns.ask_cluster_dns(kc, fqdn) == ("NOERROR", [ip]) else None
        proxy_ip = wait_until(resolves, 240, 1, f"{fqdn} resolving to the egress proxy's Pod IP")
    except TimeoutError:
        cm = kc.get("configmap", "dnsrecords", kubecontroller.NS)
        raise AssertionError(f"{kubedns.ask_cluster_dns(kc, fqdn)}\n{(cm or {}).get('data')}\n"
                             f"{_fail_report(kc, 'apps', 'client-fqdn')}") from None
    print(f"{fqdn} -> {proxy_ip} (egress proxy Pod) {time.monotonic() - t0:.1f}s after it was applied")
    out = kubedns.pod_fetch(kc, "apps", "magicdns-client", fqdn, f"http://{fqdn}:18081/by-magicdns-name",
                            kubecontroller.PROXY_IMAGE)
    print(out)
    assert f"resolved {fqdn} {proxy_ip}" in out and marker in out, out

    # the Ingress, reached from a Pod by its MagicDNS name
    try:
        def ingress_resolves():
            ip = kubedns.proxy_pod_ip(kc, "apps", "dns-web", "ingress")
            return ip if ip and kubedns.ask_cluster_dns(kc, ing_fqdn) == ("NOERROR", [ip]) else None
        ing_ip = wait_until(ingress_resolves, 240, 1, f"{ing_fqdn} resolving to the Ingress proxy's Pod IP")
    except TimeoutError:
        raise AssertionError(f"{kubedns.ask_cluster_dns(kc, ing_fqdn)}\n"
                             f"{_fail_report(kc, 'apps', 'dns-web')}") from None
    out = kubedns.pod_fetch(kc, "apps", "magicdns-ingress-client", ing_fqdn, f"http://{ing_fqdn}/via-ingress-name",
                            kubecontroller.PROXY_IMAGE)
    print(out)
    assert f"resolved {ing_fqdn} {ing_ip}" in out and kc.marker in out, out

    # the egress Service goes: its name stops resolving within the stated time
    kc.kubectl("-n", "apps", "delete", "service", "client-fqdn", "--wait=false")
    t0 = time.monotonic()
    wait_until(lambda: kubedns.ask_cluster_dns(kc, fqdn)[0] == "NXDOMAIN", 60, 0.5, f"{fqdn} NXDOMAIN")
    print(f"egress Service deleted: {fqdn} NXDOMAIN after {time.monotonic() - t0:.1f}s")
    assert kubedns.ask_cluster_dns(kc, ing_fqdn) == ("NOERROR", [ing_ip])     # the other record stays
    kc.kubectl("-n", "apps", "delete", "ingress", "dns-web", "--wait=false")
    wait_until(lambda: kc.get("ingress", "dns-web", "apps") is None, 120, 0.5, "the Ingress gone")

    # the DNSConfig goes: the nameserver with it (owner references) and the stub zone, nothing else
    kc.kubectl("delete", "dnsconfig", "ts-dns")
    wait_until(lambda: kc.get("configmap", "coredns", "kube-system")["data"]["Corefile"] == corefile_before, 30, 0.5,
               "the stub zone removed")
    wait_until(lambda: all(kc.get(k, n, kubecontroller.NS) is None for k, n in (
        ("deployment", "nameserver"), ("service", "nameserver"), ("configmap", "dnsrecords"))), 60, 0.5,
        "the nameserver's objects gone")


def _lease_holder_pod(kc) -> tuple[str, int]:
    """The Pod whose controller holds the leader Lease (identity tailscale-controller@<pod>-<6 hex>), and the
    Lease's transitions."""
    spec = (kc.get("lease", "tailscale-controller", kubecontroller.NS) or {}).get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    return (holder.split("@", 1)[1].rsplit("-", 1)[0] if "@" in holder else ""), int(spec.get("leaseTransitions") or 0)


def _controller_pods(kc) -> list[dict]:
    cp = kc.kubectl("-n", kubecontroller.NS, "get", "pods", "-l", "app=tailscale-controller", "-o", "json")
    return [p for p in json.loads(cp.stdout)["items"] if not p["metadata"].get("deletionTimestamp")
            and p.get("status", {}).get("phase") == "Running"]


def _ready(kind: str, ctype: str, name: str, ns: str | None = None):
    def check(kc):
        o = kc.get(kind, name, ns) or {}
        conds = (o.get("status") or {}).get("conditions") or []
        return o if any(c["type"] == ctype and c["status"] == "True" for c in conds) else None
    return check


def _events(kc, ns: str, name: str, reason: str) -> list[dict]:
    items = json.loads(kc.kubectl("-n", ns, "get", "events", "-o", "json").stdout)["items"]
    return [e for e in items if e["involvedObject"]["name"] == name and e["reason"] == reason]


def _proxy_pods(kc, ns: str, name: str, kind: str = "svc") -> list[dict]:
    sel = f"tailscale.com/parent-resource={name},tailscale.com/parent-resource-type={kind}"
    out = kc.kubectl("-n", kubecontroller.NS, "get", "pods", "-l", sel, "-o", "json").stdout
    return [p for p in json.loads(out)["items"] if not p["metadata"].get("deletionTimestamp")]


def test_proxyclass_applied_to_service_ingress_and_connector_tags_metrics_and_a_class_change_rolls_only_its_users(
        lab, kube):
    """A ProxyClass as the platform write-ups use it: labels, a node selector, resources, tags through
    ``TS_EXTRA_ARGS=--advertise-tags``, ``metrics.enable``. A Service labelled with it before the class exists
    waits (condition ProxyClassNotReady, no proxy) and converges once it is created; an Ingress labelled with it
    and a Connector naming it get it too: their Pods carry the labels, node selector and resources, the devices
    carry the class's tag in headscale, and ``/metrics`` answers on each Pod IP (port 9002) with its metrics
    Service. A Service naming the class in an annotation (the published guide's mistake) gets a Warning, the
    default proxy, and is the proxy that must not move when the class is edited: the edit rolls the three users
    only."""
    kc = kube
    for h in ("apps-pc-web", "apps-pc-ingress", "pc-conn", "apps-pc-guide"):
        lab.delete_node(h)
    pcls = {"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyClass", "metadata": {"name": "edge"},
            "spec": {"statefulSet": {"labels": {"team": "net"}, "pod": {
                "labels": {"tier": "edge", "rev": "1"}, "nodeSelector": {"kubernetes.io/os": "linux"},
                "tailscaleContainer": {
                    "resources": {"requests": {"cpu": "5m", "memory": "24Mi"}, "limits": {"memory": "256Mi"}},
                    "env": [{"name": "TS_EXTRA_ARGS", "value": "--advertise-tags=tag:edge"}]}}},
                "metrics": {"enable": True}}}
    # the class does not exist yet: the Service waits for it
    web = _service("pc-web", {"tailscale.com/expose": "true"}, type="LoadBalancer")
    web["metadata"]["labels"] = {"tailscale.com/proxy-class": "edge"}
    kc.apply(web)
    cond = wait_until(lambda: next((c for c in ((kc.get("service", "pc-web", "apps") or {}).get("status") or {})
                                    .get("conditions") or [] if c["reason"] == "ProxyClassNotReady"), None),
                      60, 0.5, "the Service waiting for its class")
    assert cond["status"] == "False" and "'edge' does not exist" in cond["message"], cond
    assert kubecontroller.children(kc, "apps", "pc-web")["statefulsets"] == []
    # the guide's mistake: the class in an annotation
    kc.apply(_service("pc-guide", {"tailscale.com/expose": "true", "tailscale.com/proxy-class": "edge"},
                      type="ClusterIP"))
    (ev,) = wait_until(lambda: _events(kc, "apps", "pc-guide", "ProxyClassAnnotation"), 60, 0.5, "the Warning")
    assert ev["type"] == "Warning" and "use a label" in ev["message"], ev
    t0 = time.monotonic()
    kc.apply(pcls)
    kc.apply({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
              "metadata": {"name": "pc", "namespace": "apps", "labels": {"tailscale.com/proxy-class": "edge"}},
              "spec": {"ingressClassName": "tailscale",
                       "defaultBackend": {"service": {"name": "echo", "port": {"number": 8080}}}}})
    kc.apply(_connector("pc-conn", {"hostname": "pc-conn", "proxyClass": "edge",
                                    "subnetRouter": {"advertiseRoutes": ["10.123.0.0/24"]}}))
    try:
        wait_until(lambda: _ready("proxyclass", "ProxyClassReady", "edge")(kc), 60, 0.5, "the class ready")
        kubecontroller.wait_service_ip(kc, "apps", "pc-web", 240)
        wait_until(lambda: _ready("connector", "ConnectorReady", "pc-conn")(kc), 240, 0.5, "the Connector ready")
        wait_until(lambda: ((kc.get("ingress", "pc", "apps") or {}).get("status", {}).get("loadBalancer") or {})
                   .get("ingress"), 240, 0.5, "the Ingress published")
    except TimeoutError:
        raise AssertionError(_fail_report(kc, "apps", "pc-web")) from None
    print(f"ProxyClass edge: the Service, Ingress and Connector proxies ready {time.monotonic() - t0:.1f}s after "
          "the class was created")
    users = {"pc-web": ("apps", "svc"), "pc": ("apps", "ingress"), "pc-conn": ("", "connector")}
    hosts = {"pc-web": "apps-pc-web", "pc": "apps-pc-ingress", "pc-conn": "pc-conn"}
    before = {}
    for name, (ns, kind) in users.items():
        (pod,) = _proxy_pods(kc, ns, name, kind)
        before[name] = pod["metadata"]["uid"]
        assert pod["metadata"]["labels"]["tier"] == "edge" and pod["metadata"]["labels"]["rev"] == "1", name
        assert pod["metadata"]["labels"]["tailscale.com/parent-resource"] == name   # ours kept
        assert pod["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}, name
        main = next(c for c in pod["spec"]["containers"] if c["name"] == "tailscale")
        assert main["resources"] == {"requests": {"cpu": "5m", "memory": "24Mi"}, "limits": {"memory": "256Mi"}}
        made = kubecontroller.children(kc, ns, name, kind)
        sts = kc.get("statefulset", made["statefulsets"][0], kubecontroller.NS)
        assert sts["metadata"]["labels"]["team"] == "net", name
        (node,) = _hs_nodes_named(lab, hosts[name])
        tags = set(node.get("tags") or node.get("forced_tags") or node.get("valid_tags") or [])
        assert tags == {"tag:edge"}, (name, node)
        # /metrics on the Pod IP, and the metrics Service in front of it
        ip = pod["status"]["podIP"]
        body = wait_until(lambda ip=ip: (lambda cp: cp.stdout if cp.returncode == 0 else None)(
            kc.run(["curl", "-sS", "--noproxy", "*", "-m", "5", "-f", f"http://{ip}:9002/metrics"], check=False)),
            60, 1, f"{name}'s /metrics")
        assert "# TYPE" in body, body[:500]
        msvc = kc.get("service", f"{made['statefulsets'][0]}-metrics", kubecontroller.NS)
        assert msvc["spec"]["ports"][0]["port"] == 9002 and msvc["spec"]["selector"] == sts["spec"]["selector"][
            "matchLabels"]
    # the annotated Service got the default proxy, which the class does not touch
    guide = wait_until(lambda: _proxy_pods(kc, "apps", "pc-guide"), 120, 0.5, "the annotated Service's proxy")
    assert "tier" not in guide[0]["metadata"]["labels"]
    guide_sts = kubecontroller.children(kc, "apps", "pc-guide")["statefulsets"][0]
    guide_gen = kc.get("statefulset", guide_sts, kubecontroller.NS)["metadata"]["generation"]

    # editing the class rolls its users' Pods, and only theirs
    pcls["spec"]["statefulSet"]["pod"]["labels"]["rev"] = "2"
    kc.apply(pcls)
    for name, (ns, kind) in users.items():
        wait_until(lambda name=name, ns=ns, kind=kind: (lambda p: p if len(p) == 1 and
                            p[0]["metadata"]["labels"].get("rev") == "2" and
                            p[0]["metadata"]["uid"] != before[name] else None)(_proxy_pods(kc, ns, name, kind)),
                   180, 1, f"{name}'s proxy rolled")
    assert kc.get("statefulset", guide_sts, kubecontroller.NS)["metadata"]["generation"] == guide_gen
    assert _proxy_pods(kc, "apps", "pc-guide")[0]["metadata"]["uid"] == guide[0]["metadata"]["uid"]

    for args in (("-n", "apps", "delete", "service", "pc-web", "pc-guide"), ("-n", "apps", "delete", "ingress", "pc"),
                 ("delete", "connector", "pc-conn")):
        kc.kubectl(*args, "--wait=false")
    for name, (ns, kind) in {**users, "pc-guide": ("apps", "svc")}.items():
        wait_until(lambda name=name, ns=ns, kind=kind: kubecontroller.children(kc, ns, name, kind) ==
                   kubecontroller.NO_CHILDREN, 120, 0.5,
                   f"{name}'s proxy gone")
    kc.kubectl("delete", "proxyclass", "edge")


def test_two_controller_replicas_one_leads_and_the_other_takes_over_when_its_pod_is_deleted(lab, kube):
    """Next to last in the module (it changes the Deployment; the scale goes back to 1 at the end)."""
    kc = kube
    kc.kubectl("-n", kubecontroller.NS, "scale", "deployment/tailscale-controller", "--replicas=2")
    try:
        pods = wait_until(lambda: (lambda p: p if len(p) == 2 else None)(_controller_pods(kc)), 90, 0.5,
                          "two controller Pods running")
        leader, transitions = wait_until(lambda: (lambda h: h if h[0] else None)(_lease_holder_pod(kc)), 30, 0.5,
                                         "the Lease's holder")
        (standby,) = [p["metadata"]["name"] for p in pods if p["metadata"]["name"] != leader]
        wait_until(lambda: "standby, Lease tailscale/tailscale-controller is held by" in kc.kubectl(
            "-n", kubecontroller.NS, "logs", standby, check=False).stdout, 60, 0.5, "the second Pod to stand by")
        assert leader in {p["metadata"]["name"] for p in pods}

        # the active Pod is deleted (as a drain or a rollout would): it releases the Lease on SIGTERM
        lab.delete_node("apps-ha")
        kc.kubectl("-n", kubecontroller.NS, "delete", "pod", leader, "--wait=false")
        t0 = time.monotonic()
        kc.apply(_service("ha", {"tailscale.com/expose": "true"}, type="LoadBalancer"))
        try:
            svc = kubecontroller.wait_service_ip(kc, "apps", "ha", 120)
        except TimeoutError:
            raise AssertionError(_fail_report(kc, "apps", "ha")) from None
        took = time.monotonic() - t0
        # the Lease went to a live replica: the standby, or the Deployment's replacement Pod (it starts as soon as
        # the old Pod is terminating, and both wait for the release)
        now, now_transitions = _lease_holder_pod(kc)
        live = {p["metadata"]["name"] for p in _controller_pods(kc)}
        assert now != leader and now in live and now_transitions == transitions + 1, (now, live, now_transitions)
        (node,) = _hs_nodes_named(lab, "apps-ha")
        assert kubecontroller.lb_ips(svc) == [a for a in node["ip_addresses"] if ":" not in a]
        print(f"leader Pod {leader} deleted: {now} ({'the standby' if now == standby else 'the replacement'}) took "
              f"over, Service apps/ha had its tailnet IP {took:.1f}s later")
        kc.kubectl("-n", "apps", "delete", "service", "ha", "--wait=false")
        wait_until(lambda: kc.get("service", "ha", "apps") is None, 120, 0.5, "Service apps/ha gone")
        assert _hs_nodes_named(lab, "apps-ha") == []
    finally:
        kc.kubectl("-n", kubecontroller.NS, "scale", "deployment/tailscale-controller", "--replicas=1", check=False)


# ------------------------------------------------------------------------------------------------------------
# 7. The API server proxy (docs/apiserver-proxy.md); the uninstall (last) below.

def _talker_objects(image: str) -> list[dict]:
    """A Pod with a shell (the proxy image) that logs a line a second; a ServiceAccount that may view apps."""
    rbac = "rbac.authorization.k8s.io/v1"
    return [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "talker", "namespace": "apps"},
         "spec": {"terminationGracePeriodSeconds": 1,
                  "containers": [{"name": "talker", "image": image, "imagePullPolicy": "Never",
                                  "command": ["/bin/sh", "-c",
                                              "i=0; while true; do echo talker-line-$i; i=$((i+1)); sleep 1; done"]}]}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tailnet-noauth", "namespace": "apps"}},
        {"apiVersion": rbac, "kind": "RoleBinding", "metadata": {"name": "tailnet-noauth-view", "namespace": "apps"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
         "subjects": [{"kind": "ServiceAccount", "name": "tailnet-noauth", "namespace": "apps"}]},
    ]


RW = "apiproxy-rw"


def _replier(image: str) -> dict:
    """A Pod whose process answers each line of its standard input (for attach -i); the proxy image has tar
    (Debian's essential set), which kubectl cp runs in the container."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "replier", "namespace": RW},
            "spec": {"terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "replier", "image": image, "imagePullPolicy": "Never", "stdin": True,
                                     "command": ["/bin/sh", "-c", 'while read -r l; do echo "reply:$l"; done']}]}}


def test_apiserver_proxy_kubectl_from_a_tailnet_node(lab, kube):
    """``apiServerProxy.mode: auth`` with a headscale policy granting the lab client's user (``e2e``)
    ``impersonate.groups: ["tailnet-readers"]``, bound to ``view`` (plus exec/attach/port-forward in ``apps``,
    labtools.apiproxylab), and in a second grant ``["tailnet-editors"]``, bound to ``edit`` in ``apiproxy-rw``
    only.
    From the client node (a plain tailscaled, not a Pod), with the cluster's own kubectl and nothing but the
    proxy's tailnet address in its kubeconfig: get pods -A, get -w sees a change, logs -f streams, exec -it
    answers, port-forward carries a curl; in ``apiproxy-rw``: cp of a file to a Pod and back (content checked
    in the Pod and after the round trip), attach -i to a Pod that answers its stdin (the answer reaches the
    client), apply --server-side of a ~900 KB ConfigMap read back identical; the same apply in ``apps`` and
    creating a Pod there are refused by RBAC naming user "e2e"; a second node of
    another user without the grant is refused; a client speaking garbage is closed while the others carry on;
    while the API server restarts requests fail cleanly and then succeed. Then ``noauth``: a ServiceAccount
    token works, no credentials is the API server's anonymous refusal. ``off`` removes the proxy and its device."""
    import threading

    from labtools import apiproxylab as ap
    from labtools.apiproxylab import TailnetKubectl
    kc = kube
    kubectl = kc.cfg.bin_dir / "kubectl"
    lab.delete_node("kube-apiserver")
    kc.apply([*ap.reader_rbac("apps"), *_talker_objects(kubecontroller.PROXY_IMAGE), kubemanifests.namespace(RW)])
    kc.apply([*ap.editor_rbac(RW), _replier(kubecontroller.PROXY_IMAGE)])
    outsider = lab.create_user("outsider")
    if "outsider" not in lab.namespaces:
        lab.add_namespace("outsider")
        lab.start_node("outsider", "outsider", authkey=lab.preauth_key(user_id=int(outsider["id"])))
    work = lab.run_dir / "apiproxy"
    with lab.hs_policy(ap.policy("e2e", extra_groups=[ap.EDITORS])):
        try:
            ap.set_mode(kc, "auth")
            url = ap.wait_url(kc)
            assert url == "http://kube-apiserver.tailnet.test", url
            ip = ap.proxy_ip(kc)
            client = TailnetKubectl(lab, "client", kubectl, f"http://{ip}", work, token="unused")
            other = TailnetKubectl(lab, "outsider", kubectl, f"http://{ip}", work)
            got = wait_until(lambda: (cp := client.run("get", "pods", "-A")).returncode == 0 and cp, 90, 1,
                             "kubectl get pods -A through the proxy")
            assert "echo-" in got.stdout and "kube-apiserver" not in got.stderr, got
            kc.kubectl("-n", "apps", "wait", "pod/talker", "--for=condition=Ready", "--timeout=90s", timeout=100)

            # get -w sees a change made by someone else
            watch = client.background("-n", "apps", "get", "pods", "-w", "--output-watch-events")
            try:
                watch.wait_line(lambda ln: "talker" in ln, 30, "the watch's first listing")
                kc.kubectl("-n", "apps", "label", "pod", "talker", "seen=yes")
                kc.apply(kubemanifests.echo_backend("apps", "echo-watched", "w", kubecluster.ECHO_IMAGE))
                watch.wait_line(lambda ln: "ADDED" in ln and "echo-watched" in ln, 60, "the new Pod in the watch")
            finally:
                watch.stop()
            # logs -f streams lines as the Pod writes them
            logs = client.background("-n", "apps", "logs", "-f", "talker", "--tail=1")
            try:
                first = logs.wait_line(lambda ln: "talker-line-" in ln, 30, "a first log line")
                logs.wait_line(lambda ln: "talker-line-" in ln and ln != first, 30, "a later log line")
            finally:
                logs.stop()
            # exec -it, interactive (a pseudo-terminal)
            ex = client.run_tty("-n", "apps", "exec", "-it", "talker", "--", "sh", "-c", "echo exec-ok-$((6*7))")
            assert ex.returncode == 0 and "exec-ok-42" in ex.stdout, ex
            # port-forward to an echo Pod, and a curl through it from the same node
            pod = json.loads(kc.kubectl("-n", "apps", "get", "pods", "-l", "app=echo", "-o", "json").stdout)[
                "items"][0]["metadata"]["name"]
            pf = client.background("-n", "apps", "port-forward", f"pod/{pod}", "18080:8080")
            try:
                pf.wait_line(lambda ln: "Forwarding from 127.0.0.1:18080" in ln, 30, "port-forward's listener")
                assert kc.marker in lab.wait_curl("client", "http://127.0.0.1:18080/", kc.marker, 30)
            finally:
                pf.stop()
            t_rw = time.monotonic()
            # writes where the second grant's group is bound to edit: cp both ways (kubectl runs tar in the Pod)
            kc.kubectl("-n", RW, "wait", "pod/replier", "--for=condition=Ready", "--timeout=90s", timeout=100)
            up, down = work / "cp-up.bin", work / "cp-down.bin"
            up.write_bytes(os.urandom(600_000))
            down.unlink(missing_ok=True)
            cp = client.run("cp", str(up), f"{RW}/replier:/tmp/up.bin")
            assert cp.returncode == 0, cp
            inpod = kc.kubectl("-n", RW, "exec", "replier", "--", "sha256sum", "/tmp/up.bin").stdout.split()[0]
            assert inpod == hashlib.sha256(up.read_bytes()).hexdigest()
            cp = client.run("cp", f"{RW}/replier:/tmp/up.bin", str(down))
            assert cp.returncode == 0 and down.read_bytes() == up.read_bytes(), cp
            # attach -i: a line to the Pod's stdin, its answer back on the client
            att = client.background("-n", RW, "attach", "-i", "replier", stdin=True)
            try:
                att.send(f"ping-{lab.prefix}\n")
                att.wait_line(lambda ln: ln == f"reply:ping-{lab.prefix}", 30, "the attached Pod's answer")
            finally:
                att.stop()
            # apply of a large object (server-side: client-side apply would copy it into an annotation,
            # which is limited to 256 KiB), read back identical through the proxy
            big = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "big", "namespace": RW},
                   "data": {"blob": base64.b64encode(os.urandom(675_000)).decode(), "small": "x"}}
            manifest = work / "big.json"
            manifest.write_text(json.dumps(big))
            a = client.run("apply", "--server-side", "-f", str(manifest))
            assert a.returncode == 0 and "configmap/big serverside-applied" in a.stdout, a
            back = client.run("-n", RW, "get", "configmap", "big", "-o", "json")
            assert back.returncode == 0 and json.loads(back.stdout)["data"] == big["data"], back.stderr
            # ... and where the group is not bound, the same apply is refused naming the impersonated user
            manifest.write_text(json.dumps({**big, "metadata": {"name": "big", "namespace": "apps"}}))
            a = client.run("apply", "--server-side", "-f", str(manifest))
            assert a.returncode != 0 and 'User "e2e" cannot patch resource "configmaps"' in a.stderr, a
            print(f"API server proxy: cp both ways, attach -i, apply of {len(manifest.read_bytes())} bytes "
                  f"{time.monotonic() - t_rw:.1f}s (loaded 2-core machine: an upper bound)")
            # a write the groups do not allow: RBAC's 403, naming the impersonated user
            w = client.run("-n", "apps", "run", "intruder", f"--image={kubecluster.ECHO_IMAGE}")
            assert w.returncode != 0 and 'User "e2e" cannot create resource "pods"' in w.stderr, w
            # another user's node, without the grant: itself, with no group, so nothing to read
            o = other.run("get", "pods", "-A")
            assert o.returncode != 0 and 'User "outsider" cannot list resource "pods"' in o.stderr, o
            # garbage on the proxy's port: answered 400 and closed; kubectl is not affected
            g = lab.exec("client", ["python3", "-c", (
                "import socket,sys; s=socket.create_connection((sys.argv[1],80),5); "
                "s.sendall(b'\\x16\\x03\\x01 garbage\\r\\n\\r\\n'); d=b''\n"
                "while (c:=s.recv(4096)): d+=c\n"
                "print(d.split(b'\\r\\n')[0].decode())"), ip], timeout=20)
            assert g.stdout.startswith("HTTP/1.1 400"), g
            assert client.run("get", "ns").returncode == 0
            # the API server restarts: a request meanwhile fails cleanly, later ones succeed
            t = threading.Thread(target=kc.restart_apiserver, kwargs={"down_for": 4.0})
            t.start()
            try:
                down = wait_until(lambda: (cp := client.run("get", "ns", timeout=20)).returncode != 0 and cp, 10,
                                  0.3, "a request while the API server is down")
            finally:
                t.join(90)
            assert "error reaching the API server" in down.stderr or "ServiceUnavailable" in down.stderr, down
            wait_until(lambda: client.run("get", "ns").returncode == 0, 60, 1, "a request after the restart")

            # noauth: the client's own credentials
            ap.set_mode(kc, "noauth")
            # (HTTPS with a self-signed certificate: kubectl sends a kubeconfig's token over TLS only)
            sa = TailnetKubectl(lab, "client", kubectl, f"https://{ip}", work,
                                token=kc.service_account_token("apps", "tailnet-noauth"))

            last: list = []

            def noauth_serves() -> bool:
                # without credentials (curl: kubectl would prompt for a user name on an https:// server)
                cp = lab.curl("client", f"https://{ip}/api/v1/namespaces/apps/pods", 10, extra=["-k"])
                last[:] = [cp.returncode, cp.stdout[-500:], cp.stderr[-500:]]
                return '\\"system:anonymous\\" cannot list resource \\"pods\\"' in cp.stdout
            try:
                wait_until(noauth_serves, 150, 1, "the proxy in noauth mode (anonymous refused by the API server)")
            except TimeoutError:
                raise AssertionError(f"noauth: the last answer without credentials: {last}") from None
            s = sa.run("-n", "apps", "get", "pods")
            assert s.returncode == 0 and "talker" in s.stdout, s
            assert ap.wait_url(kc) == "https://kube-apiserver.tailnet.test"
        except BaseException:
            print(f"{kubecontroller.controller_log(kc)}\n{ap.proxy_log(kc)}")
            raise
        finally:
            ap.set_mode(kc, "off")
            kc.kubectl("delete", "namespace", RW, "--wait=false", check=False)
    wait_until(lambda: kubecontroller.children(kc, kubecontroller.NS, "apiserver-proxy", "apiserverproxy")
               == kubecontroller.NO_CHILDREN, 120, 1, "the API server proxy's objects gone")
    wait_until(lambda: _hs_nodes_named(lab, "kube-apiserver") == [], 60, 1, "its device gone from headscale")
    crbs = kc.kubectl("get", "clusterrolebindings", "-l", "tailscale.com/parent-resource-type=apiserverproxy",
                      "-o", "json").stdout
    assert json.loads(crbs)["items"] == []


def test_apiserver_proxy_records_kubectl_exec_and_refuses_it_without_the_recorder(lab, kube):
    """Session recording (docs/recording.md): the grant also says ``recorder: ["tag:k8s-recorder"],
    enforceRecorder: true``, and our recorder (``python -m recorder``, labtools.apiproxylab.TailnetRecorder)
    runs on a tailnet node with that tag. The client's real ``kubectl exec -it`` (kubectl v1.34: WebSocket)
    and ``kubectl exec`` over SPDY (``KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false``) through the proxy are recorded:
    the casts' headers name the user ``e2e``, the Pod and the command, and they hold the output. With the
    recorder stopped the exec is refused with upstream's fail-closed message and its command never runs (the
    marker file it would create is not in the Pod); with ``enforceRecorder: false`` it runs, unrecorded, and
    the proxy logs that it fails open."""
    kc = kube
    kubectl = kc.cfg.bin_dir / "kubectl"
    lab.delete_node("kube-apiserver")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rec-target", "namespace": "apps"},
           "spec": {"terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "target", "image": kubecontroller.PROXY_IMAGE, "imagePullPolicy": "Never",
                                    "command": ["/bin/sh", "-c", "sleep 100000"]}]}}
    from labtools import apiproxylab as ap
    kc.apply([*ap.reader_rbac("apps"), pod])
    work = lab.run_dir / "recording"
    work.mkdir(exist_ok=True)
    marker = f"/tmp/marker-{lab.prefix}"
    recorder = None
    try:
        with lab.hs_policy(ap.recorder_policy("e2e", "tag:k8s", enforce=True)):
            recorder = ap.TailnetRecorder(lab, lab.run_dir / "k8s-recordings", ui=False)
            ap.set_mode(kc, "auth")
            ap.wait_url(kc)
            ip = ap.proxy_ip(kc)
            client = ap.TailnetKubectl(lab, "client", kubectl, f"http://{ip}", work, token="unused")
            kc.kubectl("-n", "apps", "wait", "pod/rec-target", "--for=condition=Ready", "--timeout=120s", timeout=130)

            def tty(*args: str, spdy: bool = False) -> subprocess.CompletedProcess[str]:
                """kubectl in a pseudo-terminal of 100x30 (util-linux `script`), as an interactive exec -it."""
                env = "KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false " if spdy else ""
                line = f"stty cols 100 rows 30; {env}{shlex.join(client.argv(*args))}"
                return subprocess.run(["script", "-qec", line, "/dev/null"], capture_output=True, text=True,
                                      timeout=60, stdin=subprocess.DEVNULL)

            def exec_ok():
                ex = tty("-n", "apps", "exec", "-it", "rec-target", "--", "sh", "-c", "echo rec-ws-$((6*7))")
                return ex if ex.returncode == 0 and "rec-ws-42" in ex.stdout else None
            try:
                wait_until(exec_ok, 120, 3, "kubectl exec -it through the proxy, recorded")
            except TimeoutError:
                raise AssertionError(f"{ap.proxy_log(kc)}\n{recorder.log_text()[-2000:]}") from None
            rec = recorder
            for marker_text, spdy in (("rec-ws-42", False), ("rec-spdy-42", True)):
                if spdy:    # SPDY, what kubectl before 1.31 speaks
                    ex = tty("-n", "apps", "exec", "-it", "rec-target", "--", "sh", "-c", "echo rec-spdy-$((6*7))",
                             spdy=True)
                    assert ex.returncode == 0 and "rec-spdy-42" in ex.stdout, ex
                cast = wait_until(lambda marker_text=marker_text: next(
                                  (c for c in rec.casts() if marker_text in json.dumps(c[1:])), None),
                                  30, 0.5, f"the cast of {marker_text}")
                head = cast[0]
                assert head["srcNodeUser"] == "e2e" and head["srcNode"].startswith("client"), head
                assert head["kubernetes"] == {"PodName": "rec-target", "Namespace": "apps", "Container": "target",
                                              "SessionType": "exec"}, head
                assert head["command"] == f"sh -c echo {marker_text[:-2]}$((6*7))", head
                assert (head["width"], head["height"]) == (100, 30), head      # the terminal's size, read
                assert marker_text in "".join(e[2] for e in cast[1:] if e[1] == "o")
            # the recorder stops: the exec is refused, and its command never runs
            recorder.stop()
            ex = client.run("-n", "apps", "exec", "rec-target", "--", "touch", marker)
            assert ex.returncode != 0 and "error connecting to session recorders" in ex.stderr, ex
            assert "failure mode is 'fail closed'" in ex.stderr, ex
            ls = kc.kubectl("-n", "apps", "exec", "rec-target", "--", "ls", marker, check=False)
            assert ls.returncode != 0, "the refused exec ran in the container"
        with lab.hs_policy(ap.recorder_policy("e2e", "tag:k8s", enforce=False)):
            def runs():
                ex = client.run("-n", "apps", "exec", "rec-target", "--", "touch", marker)
                return ex if ex.returncode == 0 else None
            wait_until(runs, 60, 2, "the exec running unrecorded once recording is not enforced")
            assert kc.kubectl("-n", "apps", "exec", "rec-target", "--", "ls", marker, check=False).returncode == 0
            assert "failure mode is 'fail open'; continuing session without recording." in ap.proxy_log(kc, 400)
    except BaseException:
        print(f"{kubecontroller.controller_log(kc)}\n{ap.proxy_log(kc)}")
        raise
    finally:
        if recorder is not None:
            recorder.remove()
        ap.set_mode(kc, "off")


def test_a_recorder_object_runs_its_recorder_on_the_tailnet_and_its_deletion_removes_the_device(lab, kube):
    """A `Recorder` created in the cluster (docs/recording.md "How the controller runs a Recorder"): the
    controller runs its StatefulSet (tailscaled and our tsrecorder in one Pod, device `recorder-0` tagged
    `tag:k8s-recorder`), the recorder listens on the device's tailnet addresses, and the status lists the
    device with them. The API server proxy, whose grant enforces a recorder with that tag, records a real
    `kubectl exec` to it (the cast read from the recorder's volume); the grant's `enableEvents: true` makes a
    `kubectl get pods` an API request event on that volume. Then the Recorder is given `storage.s3` (an
    S3-compatible server on the island, labtools.s3lab, and a credentials Secret): the next exec is an object in
    the bucket that parses as a cast, next to its event. Deleting the Recorder deletes its device from headscale
    before the finalizer lets the object go."""
    kc = kube
    from labtools import apiproxylab as ap
    lab.delete_node("kube-apiserver")
    kc.apply([*ap.reader_rbac("apps"), {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rec-target2", "namespace": "apps"},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
            "name": "target", "image": kubecontroller.PROXY_IMAGE, "imagePullPolicy": "Never",
            "command": ["/bin/sh", "-c", "sleep 100000"]}]}}])
    rec_obj = {"apiVersion": "tailscale.com/v1alpha1", "kind": "Recorder", "metadata": {"name": "recorder"},
               "spec": {"tags": [ap.RECORDER_TAG]}}

    def status() -> dict:
        cp = kc.kubectl("get", "recorder", "recorder", "-o", "json", check=False)
        return json.loads(cp.stdout).get("status") or {} if cp.returncode == 0 else {}
    from labtools import s3lab
    s3 = None
    try:
        with lab.hs_policy(ap.recorder_policy("e2e", "tag:k8s", enforce=True, events=True)):
            kc.apply([rec_obj])
            st = wait_until(lambda: (s := status()) and any(c["type"] == "RecorderReady" and c["status"] == "True"
                                                            for c in s.get("conditions") or []) and s,
                            240, 3, "the Recorder's recorder on the tailnet (RecorderReady True)")
            (dev,) = st["devices"]
            assert dev["hostname"] == "recorder-0" and dev["tailnetIPs"], st
            (node,) = _hs_nodes_named(lab, "recorder-0")
            assert ap.RECORDER_TAG in json.dumps(node), node
            logs = wait_until(lambda: (cp := kc.kubectl("-n", "tailscale", "logs", "recorder-0", "-c", "recorder",
                                                        check=False)).returncode == 0
                              and "recorder listening on" in cp.stdout and cp.stdout, 60, 2, "the recorder listening")
            assert dev["tailnetIPs"][0] in logs, logs
            # the API server proxy, whose grant enforces a recorder tagged tag:k8s-recorder, records an exec to it
            ap.set_mode(kc, "auth")
            ap.wait_url(kc)
            client = ap.TailnetKubectl(lab, "client", kc.cfg.bin_dir / "kubectl", f"http://{ap.proxy_ip(kc)}",
                                       lab.run_dir / "recording-cr", token="unused")
            kc.kubectl("-n", "apps", "wait", "pod/rec-target2", "--for=condition=Ready", "--timeout=120s",
                       timeout=130)
            wait_until(lambda: (ex := client.run("-n", "apps", "exec", "rec-target2", "--", "sh", "-c",
                                                 "echo rec-cr-$((6*7))")).returncode == 0 and "rec-cr-42" in ex.stdout,
                       120, 3, "kubectl exec through the proxy, recorded by the Recorder's recorder")

            def cast_text() -> str | None:
                cp = kc.kubectl("-n", "tailscale", "exec", "recorder-0", "-c", "recorder", "--", "sh", "-c",
                                "cat /data/recordings/*.cast", check=False)
                return cp.stdout if cp.returncode == 0 and "rec-cr-42" in cp.stdout else None
            head = json.loads(wait_until(cast_text, 30, 1, "the cast on the Recorder's volume").splitlines()[0])
            assert head["srcNodeUser"] == "e2e" and head["kubernetes"]["PodName"] == "rec-target2", head

            # enableEvents: a kubectl get through the proxy is an event on the recorder's volume
            got = client.run("-n", "apps", "get", "pods", "-o", "name")
            assert got.returncode == 0 and "pod/rec-target2" in got.stdout, got

            def listed_pods() -> dict | None:
                cp = kc.kubectl("-n", "tailscale", "exec", "recorder-0", "-c", "recorder", "--", "sh", "-c",
                                'for f in /data/recordings/events/*.json; do cat "$f"; echo; done', check=False)
                events = [json.loads(x) for x in cp.stdout.splitlines() if x.strip()] if cp.returncode == 0 else []
                return next((e for e in events if e["kubernetes"]["Verb"] == "list" and
                             e["kubernetes"]["Resource"] == "pods" and e["kubernetes"]["Namespace"] == "apps"), None)
            ev = wait_until(listed_pods, 30, 1, "the kubectl get's event on the Recorder's volume")
            assert ev["type"] == "kubernetes-api-request" and ev["source"]["nodeUser"] == "e2e", ev
            assert ev["request"]["method"] == "GET" and ev["userAgent"].startswith("kubectl/"), ev
            assert ev["id"].startswith("events/"), ev

            # S3: the same Recorder with storage.s3, its credentials in a Secret
            s3 = s3lab.LabS3(lab)
            kc.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds", "namespace": "tailscale"},
                       "stringData": {"AWS_ACCESS_KEY_ID": s3lab.ACCESS_KEY,
                                      "AWS_SECRET_ACCESS_KEY": s3lab.SECRET_KEY}},
                      {**rec_obj, "spec": {**rec_obj["spec"], "storage": {"s3": {
                          "endpoint": s3.endpoint, "bucket": "recordings",
                          "credentials": {"secret": {"name": "s3-creds"}}}}}}])

            def in_bucket() -> tuple[str, str] | None:
                ex = client.run("-n", "apps", "exec", "rec-target2", "--", "sh", "-c", "echo rec-s3-$((6*7))")
                if ex.returncode != 0:
                    return None
                return next(((k, v) for k, v in s3.objects("recordings").items()
                             if k.endswith(".cast") and "rec-s3-42" in v), None)
            key, text = wait_until(in_bucket, 240, 3, "an exec recorded into the bucket by the Recorder with S3")
            cast = [json.loads(x) for x in text.splitlines()]
            assert cast[0]["version"] == 2 and cast[0]["srcNodeUser"] == "e2e", cast[0]
            assert cast[0]["kubernetes"]["PodName"] == "rec-target2", cast[0]
            assert "rec-s3-42" in "".join(e[2] for e in cast[1:] if e[1] == "o"), cast
            events = [json.loads(v) for k, v in s3.objects("recordings").items() if k.startswith("events/")]
            assert any(e["kubernetes"]["Subresource"] == "exec" and e["kubernetes"]["Name"] == "rec-target2"
                       for e in events), events
            kc.kubectl("delete", "recorder", "recorder", "--timeout=180s", timeout=190)
            assert _hs_nodes_named(lab, "recorder-0") == [], lab.hs_nodes()
            assert kc.kubectl("-n", "tailscale", "get", "statefulset", "recorder", check=False).returncode != 0
    except BaseException:
        print(kubecontroller.controller_log(kc))
        raise
    finally:
        kc.kubectl("delete", "recorder", "recorder", "--ignore-not-found", "--wait=false", check=False)
        kc.kubectl("-n", "tailscale", "delete", "secret", "s3-creds", "--ignore-not-found", check=False)
        if s3 is not None:
            s3.stop()
        ap.set_mode(kc, "off")
        kc.kubectl("-n", "apps", "delete", "pod", "rec-target", "--wait=false", check=False)


def _pg_children(kc, name: str) -> dict[str, list[str]]:
    out = kubecontroller.children(kc, "", name, "proxygroup")
    cp = kc.kubectl("-n", kubecontroller.NS, "get", "configmaps", "-l", f"tailscale.com/parent-resource={name}",
                    "-o", "name")
    out["configmaps"] = cp.stdout.split()
    return out


def _egress_children(kc) -> list[str]:
    cp = kc.kubectl("-n", kubecontroller.NS, "get", "services,endpointslices", "-l", "tailscale.com/svc-type=egress",
                    "-o", "name")
    return cp.stdout.split()


def test_proxygroup_egress_services_scale_and_cleanup(lab, kube):
    """A ProxyGroup of 2 (type egress) and three egress Services on it (two tailnet nodes by IP, one by MagicDNS
    name). The group names a ProxyClass before it exists: it waits (ProxyClassNotReady, no StatefulSet), then its
    replicas carry the class's labels and node selector; a client Pod reaches all three through the replicas; each
    Service's EndpointSlice lists the replicas that report its rules; scaling 2 → 3 → 1 adds and removes devices
    in headscale; deleting the Services and the group leaves nothing in the cluster or in headscale."""
    import labextras as lx
    kc = kube
    kc.wait_dns()    # the client Pod finds the egress Services by name (the cluster's CoreDNS)
    pg, prefix = "egress", "egpg"
    c4, _ = lab.tailnet_ips("client")
    lab.add_namespace("pgt")
    lab.start_node("pg-target", "pgt")
    t4, _ = lab.tailnet_ips("pg-target")
    fqdn = lx.magicdns_name(lab, "client")
    marks = {n: f"{n}-ok-{lab.prefix}" for n in ("pga", "pgb", "pgc")}
    lab.start_http_server("client", c4, 18090, marks["pga"])
    lab.start_http_server("pgt", ("0.0.0.0",), 18091, marks["pgb"])
    lab.start_http_server("client", ("0.0.0.0",), 18092, marks["pgc"])

    def report() -> str:
        logs = kc.kubectl("-n", kubecontroller.NS, "logs", "-l", f"tailscale.com/parent-resource={pg}",
                          "--tail=40", "--all-containers", "--prefix", check=False)
        got = kc.kubectl("-n", kubecontroller.NS, "get", "pods,endpointslices,services,configmaps", "-o", "wide",
                         check=False).stdout
        return f"{kubecontroller.controller_log(kc, 120)}\n--- objects\n{got}\n--- replicas\n{logs.stdout}{logs.stderr}"

    def hs_pg_nodes() -> list[str]:
        return sorted(n.get("given_name") or n.get("name") for n in lab.hs_nodes()
                      if (n.get("given_name") or n.get("name") or "").startswith(prefix))

    def svc(name: str, ann: dict[str, str], port: int) -> dict:
        return {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": "apps",
                             "annotations": {"tailscale.com/proxy-group": pg, **ann}},
                "spec": {"type": "ExternalName", "externalName": "placeholder",
                         "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}}
    try:
        t0 = time.monotonic()
        # the group names a ProxyClass that does not exist yet: it waits, with nothing made
        kc.apply({"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyGroup", "metadata": {"name": pg},
                  "spec": {"type": "egress", "replicas": 2, "hostnamePrefix": prefix, "proxyClass": "pgclass"}})
        kc.apply([svc("pga", {"tailscale.com/tailnet-ip": c4}, 18090),
                  svc("pgb", {"tailscale.com/tailnet-ip": t4}, 18091),
                  svc("pgc", {"tailscale.com/tailnet-fqdn": fqdn}, 18092)])
        cond = wait_until(lambda: next((c for c in ((kc.get("proxygroup", pg) or {}).get("status") or {})
                                        .get("conditions") or [] if c["reason"] == "ProxyClassNotReady"), None),
                          60, 0.5, "the ProxyGroup waiting for its class")
        assert cond["status"] == "False" and "'pgclass' does not exist" in cond["message"], cond
        assert _pg_children(kc, pg)["statefulsets"] == []
        kc.apply({"apiVersion": "tailscale.com/v1alpha1", "kind": "ProxyClass", "metadata": {"name": "pgclass"},
                  "spec": {"statefulSet": {"labels": {"team": "net"}, "pod": {
                      "labels": {"tier": "pg"}, "nodeSelector": {"kubernetes.io/os": "linux"}}}}})
        print(f"ProxyGroup {pg} waited for its ProxyClass; the class created {time.monotonic() - t0:.1f}s after the "
              "group")

        def group_ready(n: int):
            def pred():
                g = kc.get("proxygroup", pg) or {}
                conds = {c["type"]: c for c in (g.get("status") or {}).get("conditions") or []}
                ok = conds.get("ProxyGroupReady", {}).get("status") == "True"
                return g if ok and len((g.get("status") or {}).get("devices") or []) == n else None
            return pred
        try:
            g = wait_until(group_ready(2), 240, 1, "the ProxyGroup ready with 2 devices")
        except TimeoutError:
            raise AssertionError(report()) from None
        print(f"ProxyGroup {pg} ready with 2 devices {time.monotonic() - t0:.1f}s after it was created")
        assert [d["hostname"] for d in g["status"]["devices"]] == [f"{prefix}-{i}.tailnet.test" for i in range(2)]
        assert hs_pg_nodes() == [f"{prefix}-0", f"{prefix}-1"]
        made = _pg_children(kc, pg)
        assert sorted(made["secrets"]) == [f"{pg}-0", f"{pg}-0-config", f"{pg}-1", f"{pg}-1-config"], made
        assert made["statefulsets"] == [pg] and made["configmaps"] == [f"configmap/{pg}-egress-config"], made
        assert made["serviceaccounts"] == made["roles"] == made["rolebindings"] == [pg], made
        # the class is on the StatefulSet and on every replica's Pod, the controller's labels kept
        assert kc.get("statefulset", pg, kubecontroller.NS)["metadata"]["labels"]["team"] == "net"
        replicas = json.loads(kc.kubectl("-n", kubecontroller.NS, "get", "pods", "-l",
                                         f"tailscale.com/parent-resource={pg}", "-o", "json").stdout)["items"]
        assert len(replicas) == 2
        for p in replicas:
            assert p["metadata"]["labels"]["tier"] == "pg" and p["spec"]["nodeSelector"] == {
                "kubernetes.io/os": "linux"}, p["metadata"]

        def all_served():
            out = {}
            for name in marks:
                s = kc.get("service", name, "apps") or {}
                target = (s.get("spec") or {}).get("externalName", "").split(".")[0]
                eps = kc.get("endpointslice", f"{target}-ipv4", kubecontroller.NS) or {}
                if len(eps.get("endpoints") or []) != 2:
                    return None
                out[name] = eps
            return out
        try:
            slices = wait_until(all_served, 180, 1, "both replicas in each egress Service's EndpointSlice")
        except TimeoutError:
            raise AssertionError(report()) from None
        print(f"three egress Services served by both replicas {time.monotonic() - t0:.1f}s after creation")
        pod_ips = sorted(p["status"]["podIP"] for p in json.loads(kc.kubectl(
            "-n", kubecontroller.NS, "get", "pods", "-l", f"tailscale.com/parent-resource={pg}", "-o", "json").stdout
        )["items"])
        for eps in slices.values():
            assert sorted(e["addresses"][0] for e in eps["endpoints"]) == pod_ips
        for name in marks:
            cond = {c["type"]: c for c in kc.get("service", name, "apps")["status"]["conditions"]}
            assert cond["TailscaleEgressSvcConfigured"]["status"] == "True", cond

        script = ("import urllib.request\n"
                  "for n, p in (('pga', 18090), ('pgb', 18091), ('pgc', 18092)):\n"
                  "    for i in range(4):\n"
                  "        print(n, urllib.request.urlopen(f'http://{n}:{p}/pg-{i}', timeout=10).read().decode()"
                  ".replace(chr(10), ' '))\n")
        kc.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "pg-client", "namespace": "apps"},
                  "spec": {"restartPolicy": "OnFailure", "terminationGracePeriodSeconds": 1,
                           "containers": [{"name": "c", "image": kubecontroller.PROXY_IMAGE,
                                           "imagePullPolicy": "Never", "command": ["python3", "-c", script]}]}})

        def done():
            p = kc.get("pod", "pg-client", "apps") or {}
            return p if p.get("status", {}).get("phase") == "Succeeded" else None
        try:
            wait_until(done, 120, 1, "the client Pod's requests")
        except TimeoutError:
            out = kc.kubectl("-n", "apps", "logs", "pg-client", check=False)
            raise AssertionError(f"{out.stdout}{out.stderr}\n{report()}") from None
        out = kc.kubectl("-n", "apps", "logs", "pg-client").stdout
        print(out)
        for name, mark in marks.items():
            assert out.count(f"{name} {mark}") == 4, out
        # the tailnet nodes saw the replicas' tailnet addresses (SNAT), not Pod addresses
        dev_ips = {ip for d in g["status"]["devices"] for ip in d["tailnetIPs"]}
        peers = {e.get("peer", "") for e in lab.http_peer_log("client", 18090) + lab.http_peer_log("pgt", 18091)}
        assert peers and peers <= dev_ips, (peers, dev_ips)
        kc.kubectl("-n", "apps", "delete", "pod", "pg-client", "--wait=false")

        # scale 2 -> 3 -> 1: devices follow in headscale, the removed replicas' Secrets go
        kc.kubectl("patch", "proxygroup", pg, "--type=merge", "-p", '{"spec":{"replicas":3}}')
        try:
            wait_until(group_ready(3), 240, 1, "the ProxyGroup ready with 3 devices")
        except TimeoutError:
            raise AssertionError(report()) from None
        assert hs_pg_nodes() == [f"{prefix}-0", f"{prefix}-1", f"{prefix}-2"]
        kc.kubectl("patch", "proxygroup", pg, "--type=merge", "-p", '{"spec":{"replicas":1}}')
        try:
            wait_until(lambda: hs_pg_nodes() == [f"{prefix}-0"] and sorted(_pg_children(kc, pg)["secrets"]) == [
                f"{pg}-0", f"{pg}-0-config"], 420, 1, "replicas 1 and 2 gone (devices, Secrets)")
        except TimeoutError:
            raise AssertionError(f"{hs_pg_nodes()}\n{report()}") from None
        assert len(kc.get("proxygroup", pg)["status"]["devices"]) == 1
        cm = kc.get("configmap", f"{pg}-egress-config", kubecontroller.NS)
        assert cm["data"]["hep-pings"] == "3" and len(json.loads(cm["data"]["egress-services"])) == 3

        # cleanup: the Services, then the group: nothing left, in the cluster or in headscale
        kc.kubectl("-n", "apps", "delete", "service", "pga", "pgb", "pgc", "--wait=false")
        wait_until(lambda: not any(kc.get("service", n, "apps") for n in marks), 60, 0.5, "the Services gone")
        assert _egress_children(kc) == []
        cm = kc.get("configmap", f"{pg}-egress-config", kubecontroller.NS)
        assert json.loads(cm["data"]["egress-services"]) == {}
        kc.kubectl("delete", "proxygroup", pg, "--wait=false")
        try:
            wait_until(lambda: kc.get("proxygroup", pg) is None, 420, 1, "the ProxyGroup gone")
        except TimeoutError:
            raise AssertionError(report()) from None
        assert _pg_children(kc, pg) == {**kubecontroller.NO_CHILDREN, "configmaps": []}
        assert hs_pg_nodes() == []
    finally:
        kc.kubectl("delete", "proxyclass", "pgclass", "--ignore-not-found", check=False)
        lx.stop_node(lab, "pg-target")
        lab.delete_node("pg-target")


def test_proxies_log_in_to_a_control_server_behind_a_private_ca(lab, kube):
    """``proxy.caConfigMap`` with ``loginServer`` on HTTPS: headscale behind a TLS front whose certificate comes
    from a CA made here (labtools/tlsfront.py), the CA in a ConfigMap. Set before the ConfigMap exists, a new
    Service gets a False condition and a Warning event saying how to make it, and no proxy; once it exists, the
    proxy mounts it (the kubelet's ConfigMap volume), logs in through the front and carries a curl from the
    tailnet client; the values are reset afterwards."""
    from labtools import tlsfront
    from tests.support.kubeapi import make_certs
    kc = kube
    d = lab.run_dir / "realkube-ca"
    d.mkdir(parents=True, exist_ok=True)
    certs = make_certs(str(d / "pki"), [labmod.HS_V4])
    port = 8444
    front = tlsfront.start(lab, "hs", f"{labmod.HS_V4}:{port}", f"{labmod.HS_V4}:{labmod.HS_PORT}",
                           certs.cert_path, certs.key_path, d / "tlsfront.log")
    lab.delete_node("apps-ca-web")

    def set_values(ca: str, login: str) -> None:
        kubecontroller.helm(kc, "upgrade", helmchart.RELEASE, str(helmchart.CHART), "--namespace", kubecontroller.NS,
                            "--reuse-values", "--set", f"proxy.caConfigMap={ca}", "--set", f"loginServer={login}")
        kc.kubectl("-n", kubecontroller.NS, "rollout", "status", "deployment/tailscale-controller",
                   "--timeout=120s", timeout=130)
    try:
        # the value set before its ConfigMap exists: the Service is told which ConfigMap to make and how, and
        # nothing is created for it until it is there (the controller re-checks within 10 s)
        set_values("control-plane-ca", f"https://{labmod.HS_V4}:{port}")
        kc.apply(_service("ca-web", {"tailscale.com/expose": "true"}, type="LoadBalancer"))
        msg = wait_until(lambda: (lambda m: m if "control-plane-ca" in m else None)(
            _guide_condition(kc, "apps", "ca-web")), 60, 0.5, "the missing CA's condition")
        assert f"ConfigMap {kubecontroller.NS}/control-plane-ca (PROXY_CA_CONFIGMAP" in msg, msg
        assert f"kubectl -n {kubecontroller.NS} create configmap control-plane-ca" in msg, msg
        events = kc.kubectl("-n", "apps", "get", "events", "--field-selector", "involvedObject.name=ca-web",
                            "-o", "json").stdout
        assert any(e["reason"] == "ControlPlaneCAMissing" and e["type"] == "Warning"
                   for e in json.loads(events)["items"]), events
        assert kubecontroller.children(kc, "apps", "ca-web")["statefulsets"] == []
        kc.apply({"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": "control-plane-ca", "namespace": kubecontroller.NS},
                  "data": {"ca.crt": certs.ca_pem.decode()}})
        try:
            svc = kubecontroller.wait_service_ip(kc, "apps", "ca-web", 180)
        except TimeoutError:
            raise AssertionError(_fail_report(kc, name="ca-web")) from None
        ip = kubecontroller.lb_ips(svc)[0]
        assert kc.marker in lab.wait_curl("client", f"http://{ip}:8080/", kc.marker, 60)
        (pod_name,) = kubecontroller.children(kc, "apps", "ca-web")["pods"]
        pod = kc.get("pod", pod_name, kubecontroller.NS)
        (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "tailscale"]
        assert {"name": "SSL_CERT_DIR", "value": "/etc/ssl/certs:/etc/containerboot/ca"} in c["env"]
        seen = kc.kubectl("-n", kubecontroller.NS, "exec", pod_name, "-c", "tailscale", "--",
                          "cat", "/etc/containerboot/ca/ca.crt").stdout
        assert seen == certs.ca_pem.decode()
        # Nothing else was sent to the front (the controller reaches headscale's API on its plain URL): the
        # connections it took (from the node's address, which masquerades the Pod's) are the proxy's login.
        front_log = (d / "tlsfront.log").read_text()
        assert "tlsfront: connection from" in front_log, front_log[-2000:]
    finally:
        kc.kubectl("-n", "apps", "delete", "service", "ca-web", "--ignore-not-found", "--wait=true",
                   "--timeout=120s", check=False, timeout=130)
        set_values("", "")
        kc.kubectl("-n", kubecontroller.NS, "delete", "configmap", "control-plane-ca", "--ignore-not-found",
                   check=False)
        front.terminate()
        front.wait(10)


def test_helm_uninstall_leaves_nothing_of_the_release(kube):
    """Last: ``helm uninstall`` removes every object the chart made (the credentials Secret included) and the
    controller's leader Lease, which the controller made and named its Deployment as owner of (the garbage
    collector deletes it with the Deployment; an owner taken off the Lease, as on a Lease an older version made,
    is back at the next renewal); the CRDs stay (their ``helm.sh/resource-policy: keep``), with every object of
    their kinds."""
    kc = kube
    kinds = "deployments,pods,serviceaccounts,roles,rolebindings,secrets,leases"
    before = kc.kubectl("-n", kubecontroller.NS, "get", kinds, "-o", "name").stdout.split()
    assert "deployment.apps/tailscale-controller" in before and "secret/headscale-api" in before, before
    deploy_uid = kc.get("deployment", "tailscale-controller", kubecontroller.NS)["metadata"]["uid"]

    def lease_owners() -> list[tuple[str, str, str]]:
        md = (kc.get("lease", "tailscale-controller", kubecontroller.NS) or {}).get("metadata") or {}
        return [(r["kind"], r["name"], r["uid"]) for r in md.get("ownerReferences") or []]
    owned = [("Deployment", "tailscale-controller", deploy_uid)]
    wait_until(lambda: lease_owners() == owned, 60, 0.5, "the Lease owned by the controller's Deployment")
    # a Lease without owner (as an older version made it) gets it at the leader's next renewal (every 2 s)
    kc.kubectl("-n", kubecontroller.NS, "patch", "lease", "tailscale-controller", "--type=json",
               "-p", '[{"op": "remove", "path": "/metadata/ownerReferences"}]')
    wait_until(lambda: lease_owners() == owned, 60, 0.5, "the owner written again at the next renewal")
    out = kubecontroller.uninstall(kc)
    assert "uninstalled" in out, out

    def left():
        return [n for n in kc.kubectl("-n", kubecontroller.NS, "get", kinds, "-o", "name").stdout.split()
                if not n.startswith("serviceaccount/default")]
    try:   # the controller Pod may still be terminating (its grace period); the garbage collector then
        # deletes the Lease (again, if the stopping controller made it anew: its owner is gone)
        wait_until(lambda: not left(), 120, 0.5, "nothing of the release left")
    except TimeoutError:
        raise AssertionError(f"left after helm uninstall: {left()}") from None
    for kind, name in (("clusterrole", "tailscale-controller"), ("clusterrolebinding", "tailscale-controller"),
                       ("ingressclass", "tailscale")):
        assert kc.get(kind, name) is None, (kind, name)
    assert json.loads(kubecontroller.helm(kc, "list", "-A", "-o", "json").stdout) == []
    assert kc.get("customresourcedefinition", "connectors.tailscale.com") is not None


GUIDE_NS = "ts-guide"
GUIDE_REGISTRY = "registry.example.com/tailscale"
#: the chart's CRDs, deleted by hand at the end of the guide's uninstall (they carry helm's keep policy)
GUIDE_CRDS = ("connectors.tailscale.com", "proxyclasses.tailscale.com", "proxygroups.tailscale.com",
              "dnsconfigs.tailscale.com", "recorders.tailscale.com")
#: upstream's CRDs, protected by the guide's first step
UPSTREAM_CRDS = (*GUIDE_CRDS, "tailnets.tailscale.com", "peerrelays.tailscale.com", "proxygrouppolicies.tailscale.com")


def _guide_images(tag: str, out) -> None:
    """Guide step 1 without a registry: both images for the node's platform as the registry would serve them
    (images/release.sh --offline: archives whose index names <registry>/<name>:<tag>)."""
    cp = subprocess.run(["bash", str(kubecontroller.REPO / "images" / "release.sh"), "--registry", GUIDE_REGISTRY,
                         "--tag", tag, "--platforms", "linux/amd64", "--offline", "--out", str(out)],
                        capture_output=True, text=True, timeout=1800)
    assert cp.returncode == 0, cp.stderr[-3000:]


@pytest.fixture(scope="session")
def upstream_manifests():
    """Upstream's operator manifests (cmd/k8s-operator/deploy/manifests/operator.yaml) of the pinned Tailscale
    version; first of the test's fixtures, so that a missing download fails before a cluster is built. They
    come from the module itself, downloaded (or found in the Go module cache) by `go mod download`:
    the cache the lab's binaries were once built from may be gone while the binaries are still cached."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:     # outside any module, so no go.mod is read or changed
        cp = subprocess.run(["go", "mod", "download", "-json", f"tailscale.com@{labmod.TS_VER}"], cwd=d,
                            capture_output=True, text=True, timeout=600, env={**os.environ, "GOFLAGS": "-mod=mod"})
    try:
        root = Path(json.loads(cp.stdout)["Dir"])
    except (ValueError, KeyError):
        unavailable(f"upstream's operator manifests cannot be downloaded (go mod download tailscale.com@"
                    f"{labmod.TS_VER}): {(cp.stderr or cp.stdout).strip()[-500:]}")
    p = root / "cmd" / "k8s-operator" / "deploy" / "manifests" / "operator.yaml"
    if not p.is_file():
        unavailable(f"tailscale.com@{labmod.TS_VER} has no operator manifests at {p}")
    return p


def _chart_version(tmp_path, version: str):
    """The chart packaged as another version (chart version = appVersion = the images' tag)."""
    import shutil
    d = tmp_path / f"chart-{version}" / "tailscale-controller"
    shutil.copytree(helmchart.CHART, d)
    meta = (d / "Chart.yaml").read_text()
    meta = "\n".join(f"version: {version}" if ln.startswith("version:") else
                     f'appVersion: "{version}"' if ln.startswith("appVersion:") else ln for ln in meta.splitlines())
    (d / "Chart.yaml").write_text(meta + "\n")
    helmchart.helm("package", str(d), "--destination", str(tmp_path))
    return tmp_path / f"tailscale-controller-{version}.tgz"


def _guide_condition(kc, ns: str, name: str) -> str:
    # the guide's verify command, as written there
    return kc.kubectl("-n", ns, "get", "service", name, "-o",
                      'jsonpath={.status.conditions[?(@.type=="TailscaleProxyReady")].message}', check=False).stdout


def _guide_device_ips(kc, ns: str, name: str) -> list[str]:
    cp = kc.kubectl("-n", GUIDE_NS, "get", "secret", "-l",
                    f"tailscale.com/parent-resource={name},tailscale.com/parent-resource-ns={ns}",
                    "-o", "jsonpath={.items[0].data.device_ips}", check=False)
    if cp.returncode != 0 or not cp.stdout.strip():
        return []
    import base64
    return json.loads(base64.b64decode(cp.stdout))


def test_install_guide_step_by_step_packaged_chart_upgrade_and_uninstall(upstream_manifests, lab, kube, tmp_path):
    """After the module's own release is gone: docs/install-headscale.md followed command by command, coming
    from the upstream operator (its manifests applied, a Service it exposed, then its section's steps: stopped,
    its proxies deleted, its IngressClass, which makes helm refuse the install, deleted), in namespace
    ts-guide: images from the release archives (imported as a registry would serve them), the
    packaged chart (.tgz), the API key Secret, the guide's policy, helm install with imageRegistry; the
    namespace first labelled restricted (the real API server's Pod Security admission) gives the Service the
    condition naming the label and nothing is created; the guide's label lets the proxy come up; a ClusterIP
    Service verified with the guide's commands and reached from the tailnet; upgrade to a second chart and
    image version (CRDs first) restarts the proxy on the new image with the same device; the uninstall order
    leaves nothing: no proxy object, no finalizer on the Service, no headscale node, no release, no CRD."""
    kc = kube
    t0 = time.monotonic()
    # 1. images, imported into the node as its registry would serve them; the upgrade's version is the same
    # content under the next tag (a rebuild would only re-export identical layers)
    _guide_images("0.1.0", tmp_path / "images")
    for f in sorted((tmp_path / "images").glob("*.oci.tar")):
        kc.import_image(f)
    for n in ("containerboot-py", "containerboot-py-controller"):
        kc.tag_image(f"{GUIDE_REGISTRY}/{n}:0.1.0", f"{GUIDE_REGISTRY}/{n}:0.1.1")
    have = set(kc.images())
    for tag in ("0.1.0", "0.1.1"):
        for n in ("containerboot-py", "containerboot-py-controller"):
            assert f"{GUIDE_REGISTRY}/{n}:{tag}" in have, sorted(have)
    t_images = time.monotonic() - t0
    # 2. the packaged chart, and a second version for the upgrade
    tgz = helmchart.package(tmp_path)
    assert tgz.name == "tailscale-controller-0.1.0.tgz" and tgz.is_file()
    tgz2 = _chart_version(tmp_path, "0.1.1")
    # Coming from the upstream operator: its own manifests applied (CRDs, RBAC, its Deployment, IngressClass),
    # a Service it had exposed (its finalizer on it) and a proxy Secret it had left, then the guide's way over
    upstream = upstream_manifests
    kc.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(upstream), timeout=120)
    up_svc = _service("guide", {"tailscale.com/expose": "true"})
    up_svc["metadata"]["finalizers"] = ["tailscale.com/finalizer"]
    kc.apply(up_svc)
    kc.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": "ts-guide-up000-0", "namespace": "tailscale", "labels": {
            "tailscale.com/managed": "true", "tailscale.com/parent-resource": "guide",
            "tailscale.com/parent-resource-ns": "apps", "tailscale.com/parent-resource-type": "svc"}}})
    # the guide's prepare: the CRDs protected; its cut-over: upstream stopped, its proxies deleted
    kc.kubectl("annotate", "crd", *UPSTREAM_CRDS, "helm.sh/resource-policy=keep", "--overwrite")
    kc.kubectl("-n", "tailscale", "scale", "deployment/operator", "--replicas=0")
    kc.kubectl("-n", "tailscale", "delete", "statefulset,secret,configmap,service,endpointslice", "-l",
               "tailscale.com/managed=true,tailscale.com/parent-resource-type!=nameserver")
    assert kc.get("secret", "ts-guide-up000-0", "tailscale") is None
    # from the static manifest (no release): the release takes the CRDs over
    kc.kubectl("label", "crd", *GUIDE_CRDS, "app.kubernetes.io/managed-by=Helm", "--overwrite")
    kc.kubectl("annotate", "crd", *GUIDE_CRDS, "meta.helm.sh/release-name=tailscale-controller",
               f"meta.helm.sh/release-namespace={GUIDE_NS}", "--overwrite")
    kc.kubectl("create", "namespace", GUIDE_NS)
    # its IngressClass is what then collides with the chart: helm refuses to take it over ...
    bad = kubecontroller.helm(kc, "install", "tailscale-controller", str(tgz), "-n", GUIDE_NS,
                              "--set", f"imageRegistry={GUIDE_REGISTRY}",
                              "--set", f"headscale.url={labmod.LOGIN_SERVER}", check=False)
    assert bad.returncode != 0 and "IngressClass" in bad.stderr and '"tailscale"' in bad.stderr, bad.stderr
    kc.kubectl("delete", "ingressclass", "tailscale")
    kubecontroller.helm(kc, "uninstall", "tailscale-controller", "-n", GUIDE_NS, check=False)

    # 3. the namespace's Pod Security label (first the wrong one: restricted), the API key
    kc.kubectl("label", "namespace", GUIDE_NS, "pod-security.kubernetes.io/enforce=restricted", "--overwrite")
    key = lab.hs("apikeys", "create", "--expiration", "2h")
    key = key if isinstance(key, str) else str((key or {}).get("key") or key)
    kc.kubectl("-n", GUIDE_NS, "create", "secret", "generic", "headscale-api", "--from-file=key=/dev/stdin",
               input=key)
    # 4. the guide's policy (its admin@ is any user: the lab's is e2e@)
    policy = {"tagOwners": {"tag:k8s": ["e2e@"]},
              "acls": [{"action": "accept", "src": ["autogroup:member"], "dst": ["tag:k8s:*"]},
                       {"action": "accept", "src": ["tag:k8s"], "dst": ["autogroup:member:*"]}]}
    lab.delete_node("apps-guide")
    with lab.hs_policy(policy):
        # 5. install from the .tgz; the lab's own knobs for its island go in through a values file on stdin
        values = {"proxy": {"env": kubecontroller.LAB_PROXY_ENV}}
        cp = kubecontroller.helm(kc, "install", "tailscale-controller", str(tgz), "-n", GUIDE_NS,
                                 "--set", f"imageRegistry={GUIDE_REGISTRY}",
                                 "--set", f"headscale.url={labmod.LOGIN_SERVER}",
                                 "--set", "magicDNSSuffix=tailnet.test", "-f", "-", input=json.dumps(values))
        assert "pod-security.kubernetes.io/enforce=privileged" in cp.stdout, cp.stdout
        kc.kubectl("-n", GUIDE_NS, "rollout", "status", "deployment/tailscale-controller", "--timeout=120s",
                   timeout=130)
        pod = kc.kubectl("-n", GUIDE_NS, "get", "pods", "-l", "app=tailscale-controller", "-o", "json")
        (cpod,) = json.loads(pod.stdout)["items"]
        assert cpod["spec"]["containers"][0]["image"] == f"{GUIDE_REGISTRY}/containerboot-py-controller:0.1.0"
        assert cpod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        # 6. the ClusterIP Service upstream had exposed is taken over (its finalizer is ours too): refused by
        # the namespace's level first, said in the condition and an event
        msg = wait_until(lambda: (lambda m: m if "Pod Security" in m else None)(_guide_condition(kc, "apps", "guide")),
                         60, 0.5, "the Pod Security condition")
        assert f"kubectl label namespace {GUIDE_NS} pod-security.kubernetes.io/enforce=privileged --overwrite" in msg
        assert "'restricted'" in msg, msg
        events = kc.kubectl("-n", "apps", "get", "events", "--field-selector", "involvedObject.name=guide",
                            "-o", "json").stdout
        assert any(e["reason"] == "PodSecurityRefused" for e in json.loads(events)["items"]), events
        assert kc.kubectl("-n", GUIDE_NS, "get", "statefulsets", "-o", "name").stdout.strip() == ""
        # ... the guide's label, and the proxy comes up (the controller re-checks a refused parent within 10 s)
        kc.kubectl("label", "namespace", GUIDE_NS, "pod-security.kubernetes.io/enforce=privileged", "--overwrite")
        t1 = time.monotonic()
        try:
            msg = wait_until(lambda: (lambda m: m if m.startswith("proxy ready: ") else None)(
                _guide_condition(kc, "apps", "guide")), 180, 1.0, "the guide's Service ready")
        except TimeoutError:
            raise AssertionError(_fail_report(kc, "apps", "guide", GUIDE_NS)) from None
        assert msg == "proxy ready: apps-guide.tailnet.test", msg
        ips = _guide_device_ips(kc, "apps", "guide")
        node = lab.hs_node("apps-guide")
        assert node is not None and ips and set(ips) <= set(node["ip_addresses"]), (ips, node)
        lab.wait_peer("client", "apps-guide", 60)
        lab.wait_curl("client", lab.url(ips[0], 8080, "/guide"), kc.marker, timeout=60)
        t_ready = time.monotonic() - t1

        # upgrade: the chart (its CRDs are templates; its appVersion is the new images' tag)
        kubecontroller.helm(kc, "upgrade", "tailscale-controller", str(tgz2), "-n", GUIDE_NS,
                            "--reset-then-reuse-values", timeout=180)
        kc.kubectl("-n", GUIDE_NS, "rollout", "status", "deployment/tailscale-controller", "--timeout=120s",
                   timeout=130)
        (rel,) = json.loads(kubecontroller.helm(kc, "list", "-n", GUIDE_NS, "-o", "json").stdout)
        assert (rel["chart"], rel["app_version"], str(rel["revision"])) == ("tailscale-controller-0.1.1", "0.1.1", "2")

        def proxy_on_new_image():
            pods = json.loads(kc.kubectl("-n", GUIDE_NS, "get", "pods", "-l",
                                         "tailscale.com/parent-resource=guide", "-o", "json").stdout)["items"]
            ok = [p for p in pods if p["spec"]["containers"][0]["image"] ==
                  f"{GUIDE_REGISTRY}/containerboot-py:0.1.1" and any(
                      c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
            return ok or None
        try:
            wait_until(proxy_on_new_image, 180, 1.0, "the proxy restarted on the new image")
        except TimeoutError:
            raise AssertionError(_fail_report(kc, "apps", "guide", GUIDE_NS)) from None
        assert _guide_device_ips(kc, "apps", "guide") == ips          # the same device, the same IPs
        lab.wait_curl("client", lab.url(ips[0], 8080, "/guide-upgraded"), kc.marker, timeout=90)

        # uninstall, in the guide's order: parents first, wait for the proxies to go, then the release, the CRD
        listed = kc.kubectl("-n", GUIDE_NS, "get", "statefulsets", "-l", "tailscale.com/managed=true", "-L",
                            "tailscale.com/parent-resource-type,tailscale.com/parent-resource-ns,"
                            "tailscale.com/parent-resource").stdout
        assert "svc" in listed and "apps" in listed and "guide" in listed, listed
        kc.kubectl("-n", "apps", "annotate", "service", "guide", "tailscale.com/expose-")
        kc.kubectl("delete", "connectors,proxygroups,dnsconfigs", "--all", timeout=60)
        kc.kubectl("delete", "proxyclasses", "--all", timeout=60)
        kc.kubectl("-n", GUIDE_NS, "wait", "--for=delete", "statefulset", "-l", "tailscale.com/managed=true",
                   "--timeout=120s", timeout=130, check=False)
        wait_until(lambda: not kc.kubectl("-n", GUIDE_NS, "get", "statefulsets,secrets,services,pods", "-l",
                                          "tailscale.com/managed=true", "-o", "name").stdout.strip(),
                   120, 0.5, "the proxy's objects gone")
        kubecontroller.helm(kc, "uninstall", "tailscale-controller", "-n", GUIDE_NS, "--wait", timeout=130)
        kc.kubectl("delete", "crd", *GUIDE_CRDS, timeout=60)
        kc.kubectl("delete", "namespace", GUIDE_NS, "--timeout=120s", timeout=130)
    svc = kc.get("service", "guide", "apps")
    assert svc is not None and "tailscale.com/finalizer" not in (svc["metadata"].get("finalizers") or [])
    assert lab.hs_node("apps-guide") is None
    assert kc.get("namespace", GUIDE_NS) is None
    assert json.loads(kubecontroller.helm(kc, "list", "-A", "-o", "json").stdout) == []
    for kind, name in (("clusterrole", "tailscale-controller"), ("clusterrolebinding", "tailscale-controller"),
                       ("ingressclass", "tailscale"), *(("customresourcedefinition", c) for c in GUIDE_CRDS)):
        assert kc.get(kind, name) is None, (kind, name)
    kc.kubectl("-n", "apps", "delete", "service", "guide")
    # upstream's release goes last (here: its manifests' objects), leaving nothing of either
    kc.kubectl("delete", "-f", str(upstream), "--ignore-not-found", "--wait=true", timeout=180)
    print(f"install guide: images {t_images:.1f}s, Service ready {t_ready:.1f}s after the label, "
          f"whole guide {time.monotonic() - t0:.1f}s")
