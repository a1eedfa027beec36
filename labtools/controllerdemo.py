"""The controller variant of the demo (``make demo DEMO_ARGS=--controller``): the user story of docs/controller.md.

Builds the lab (headscale, a ``client`` tailscaled node) and a real cluster with one node in the island,
builds and imports both images (the proxy's and the controller's), installs the controller from ``deploy/``
with the headscale provider (labtools.kubecontroller.install: an API key made with the lab's headscale), deploys
a backend Deployment and a Service annotated ``tailscale.com/expose: "true"``, then prints the Service's status
as the controller wrote it and a curl from the tailnet client to the tailnet IP in that status. With ``--once``
it exits after printing: status 0 only if the curl worked.

With ``--https`` (``make demo DEMO_ARGS="--controller --https --once"``, docs/https.md): the controller installed
with helm, cert-manager v1.19.1 with its own chart (labtools.certmanager), a CA ClusterIssuer (a CA made here),
and an Ingress of class tailscale annotated ``cert-manager.io/cluster-issuer`` whose ``spec.tls[]`` names the
proxy's MagicDNS name and a Secret; cert-manager issues the certificate into the Secret, and the tailnet
client's ``curl --cacert <the CA>`` over HTTPS to the MagicDNS name must reach the backend with that
certificate (its serial printed): status 0 only then.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
import time

from labtools import certmanager, kubecontroller
from labtools.kubedemo import Stage, curl_from_client, deploy_backend, run_controller_demo
from labtools.lab import wait_until


def _say(msg: str) -> None:
    print(msg, flush=True)


SERVICE = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "web", "namespace": "demo", "annotations": {"tailscale.com/expose": "true"}},
           "spec": {"type": "LoadBalancer", "selector": {"app": "backend"},
                    "ports": [{"port": 8080, "targetPort": 8080}]}}


def run(firewall: str, once: bool, timeout: float = 180.0, https: bool = False) -> int:
    if https:
        return run_controller_demo(firewall, once, lambda st: story_https(st, timeout),
                                   logs=lambda kc: [kubecontroller.controller_log(kc), certmanager.logs(kc)])
    return run_controller_demo(firewall, once, lambda st: story(st, timeout))


def story(st: Stage, timeout: float) -> bool:
    kc, lab = st.kc, st.lab
    t = kubecontroller.install(kc, lab, st.proxy_tar, st.ctl_tar, firewall=st.firewall, method="kubectl")
    _say(f"controller installed from deploy/ (kubectl apply -R -f deploy/, Secret headscale-api, "
         f"kubectl set env CONTROL_PLANE=headscale ...): images imported {t['import']:.1f}s, "
         f"rolled out {t['rollout']:.1f}s")
    _say(kc.kubectl("-n", kubecontroller.NS, "get", "deploy,pods", "-o", "wide").stdout.rstrip())
    marker = deploy_backend(kc, lab)
    t0 = time.monotonic()
    kc.apply(SERVICE)
    _say("Service demo/web (type LoadBalancer, annotated tailscale.com/expose: \"true\") applied")
    svc = kubecontroller.wait_service_ip(kc, "demo", "web", timeout)
    _say(f"the controller wrote the Service's status {time.monotonic() - t0:.1f}s after it was applied:")
    _say(json.dumps(svc["status"], indent=2))
    _say(kc.kubectl("-n", kubecontroller.NS, "get", "statefulsets,pods,secrets,services",
                    "-l", "tailscale.com/parent-resource=web").stdout.rstrip())
    ip = kubecontroller.lb_ips(svc)[0]
    host = svc["status"]["loadBalancer"]["ingress"][0].get("hostname", "")
    lab.wait_peer("client", host.split(".")[0], 60)
    curl_from_client(lab, ip, "/demo-controller", marker, host)
    return True


def _serial(cert_pem: bytes) -> str:
    out = subprocess.run(["openssl", "x509", "-noout", "-serial"], input=cert_pem, capture_output=True, check=True)
    return out.stdout.decode().strip().split("=", 1)[1].upper().lstrip("0")


def story_https(st: Stage, timeout: float) -> bool:
    kc, lab = st.kc, st.lab
    t0 = time.monotonic()
    d = certmanager.ensure_built()
    _say(f"cert-manager {certmanager.VERSION}: {d} ({time.monotonic() - t0:.1f}s)")
    t = kubecontroller.install(kc, lab, st.proxy_tar, st.ctl_tar, firewall=st.firewall)
    _say(f"controller installed with helm: images imported {t['import']:.1f}s, rolled out {t['rollout']:.1f}s")
    t = certmanager.install(kc, d)
    _say(f"cert-manager installed with its chart (helm install cert-manager ... --set crds.enabled=true): images "
         f"imported {t['import']:.1f}s, rolled out {t['rollout']:.1f}s, webhook admitting {t['webhook']:.1f}s")
    _say(kc.kubectl("-n", certmanager.NS, "get", "deploy,pods").stdout.rstrip())
    work = tempfile.mkdtemp(prefix="cm-demo-", dir=str(lab.run_dir))
    ca_key, ca_crt = f"{work}/ca.key", f"{work}/ca.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", ca_key, "-out", ca_crt, "-days", "2", "-subj", "/CN=demo CA"],
                   check=True, capture_output=True)
    with open(ca_crt, "rb") as f, open(ca_key, "rb") as g:
        kc.apply(certmanager.ca_issuer("demo-ca", f.read(), g.read()))
    _say("ClusterIssuer demo-ca (a CA key pair made with openssl, in the Secret cert-manager/demo-ca-key-pair)")
    marker = deploy_backend(kc, lab)
    host = "demo-site"
    fqdn = f"{host}.tailnet.test"
    ingress = {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
               "metadata": {"name": "site", "namespace": "demo",
                            "annotations": {"cert-manager.io/cluster-issuer": "demo-ca"}},
               "spec": {"ingressClassName": "tailscale", "tls": [{"hosts": [fqdn], "secretName": "site-tls"}],
                        "defaultBackend": {"service": {"name": "backend", "port": {"number": 8080}}}}}
    t0 = time.monotonic()
    kc.apply(ingress)
    _say(f"Ingress demo/site applied:\n{json.dumps(ingress, indent=2)}")

    def ready() -> bool:
        c = kc.get("certificate.cert-manager.io", "site-tls", "demo")
        return certmanager.condition(c, "Ready").get("status") == "True"
    wait_until(ready, timeout, 0.5, "cert-manager's Certificate demo/site-tls Ready")
    serial = _serial((kubecontroller.secret_data(kc, "demo", "site-tls") or {})["tls.crt"])
    _say(f"cert-manager issued the certificate into Secret demo/site-tls {time.monotonic() - t0:.1f}s after the "
         f"apply (serial {serial})")
    _say(kc.kubectl("-n", "demo", "get", "certificate,certificaterequest").stdout.rstrip())
    _say(kc.kubectl("-n", "demo", "get", "secret", "site-tls").stdout.rstrip())
    node = wait_until(lambda: next((n for n in lab.hs_nodes() if n.get("given_name") == host), None), timeout, 0.5,
                      "the Ingress proxy's node in headscale")
    ip = next(a for a in node["ip_addresses"] if ":" not in a)
    lab.wait_peer("client", host, 60)
    argv = ["curl", "-sS", "-m", "10", "--cacert", ca_crt, "--resolve", f"{fqdn}:443:{ip}", "-w", "\n%{certs}",
            f"https://{fqdn}/demo-https"]
    last: list = []

    def served():
        r = lab.exec("client", argv, timeout=15)
        last[:] = [r.returncode, r.stderr.strip()]
        return r if r.returncode == 0 and marker in r.stdout else None
    try:
        r = wait_until(served, timeout, 1, "HTTPS through the Ingress proxy")
    except TimeoutError:
        _say(f"curl --cacert {ca_crt} https://{fqdn}/demo-https never worked; last: {last}")
        return False
    got = next((ln.split(":", 1)[1].strip().replace(":", "").upper().lstrip("0")
                for ln in r.stdout.splitlines() if ln.startswith("Serial Number:")), "")
    body = r.stdout.split("-----BEGIN")[0].strip().replace(chr(10), " | ")
    _say(f"curl client --cacert {ca_crt} https://{fqdn}/demo-https (resolved to {ip}, as MagicDNS would): OK "
         f"{time.monotonic() - t0:.1f}s after the apply, certificate serial {got}: {body[:300]}")
    if got != serial:
        _say(f"the served certificate's serial {got} is not the Secret's {serial}")
        return False
    return True
