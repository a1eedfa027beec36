"""cert-manager issues the certificates the proxies serve, in the lab's real cluster on headscale, end to end.

One cluster for the module (labtools.kubecluster, a node in the island), the controller installed with helm
as in test_controller_realkube_e2e.py, and cert-manager v1.19.1 installed with its own chart
(labtools.certmanager: the controller, webhook and cainjector as the chart's Pods, from the module proxy's
source). A CA ``ClusterIssuer`` signs with a key pair in a Secret; the tests' CA is that key pair.

1. An Ingress of class tailscale annotated ``cert-manager.io/cluster-issuer`` with ``spec.tls[]`` naming a
   Secret for the proxy's MagicDNS name: cert-manager's ingress-shim makes the Certificate, the CA issuer
   signs it into the Secret, and the lab's tailnet client's ``curl --cacert <CA>`` over HTTPS reaches the
   backend with that certificate (same serial). A renewal forced as ``cmctl renew`` does reaches new
   connections within a minute while a connection opened before it keeps being answered. A certificate for
   another name in the Secret gives the Warning event naming the Secret and the problem, and the proxy keeps
   serving the last good one.
2. The API server proxy with ``apiServerProxy.tls.secretName`` set to a Secret cert-manager issues (a
   ``Certificate`` for ``kube-apiserver.tailnet.test``): the client's kubectl, with the CA in its kubeconfig
   and no insecure-skip-tls-verify, runs ``get``, ``exec`` and ``logs -f`` through it.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time

import pytest
from needs import unavailable
from test_https_e2e import HELD

from labtools import apiproxylab as ap
from labtools import certmanager, helmchart, kubecluster, kubecontroller, kubemanifests
from labtools.lab import wait_until
from tests.support.testca import TestCA

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.ecosystem, pytest.mark.timeout(900)]

ISSUER = "lab-ca"


def serial_of(cert_pem: bytes) -> str:
    """The certificate's serial as upper-case hex without leading zeros (openssl's and curl's, normalised)."""
    out = subprocess.run(["openssl", "x509", "-noout", "-serial"], input=cert_pem, capture_output=True,
                         check=True).stdout.decode()
    return out.strip().split("=", 1)[1].upper().lstrip("0")


def secret_serial(kc, namespace: str, name: str) -> str:
    data = kubecontroller.secret_data(kc, namespace, name) or {}
    return serial_of(data["tls.crt"]) if data.get("tls.crt") else ""


def curl_https(lab, fqdn: str, ip: str, ca: str, path: str = "/") -> tuple[int, str, str]:
    """(exit code, body or error, served serial) of a verified HTTPS GET of https://fqdn from the client."""
    r = lab.exec("client", ["curl", "-sS", "--noproxy", "*", "-m", "10", "--cacert", ca, "--resolve",
                            f"{fqdn}:443:{ip}", "-w", "\n%{certs}", f"https://{fqdn}{path}"], timeout=15)
    serial = next((ln.split(":", 1)[1].strip().replace(":", "").upper().lstrip("0")
                   for ln in r.stdout.splitlines() if ln.startswith("Serial Number:")), "")
    return r.returncode, r.stdout if r.returncode == 0 else r.stderr, serial


@pytest.fixture(scope="module")
def cm(lab, project_images, k8s_bin_dir, helm_bin, tmp_path_factory):
    """A cluster with a node, the controller (helm), cert-manager (its chart), a CA ClusterIssuer, a backend."""
    try:
        cmdir = certmanager.ensure_built()
    except certmanager.CertManagerError as e:
        unavailable(f"cert-manager cannot be built here: {e}")
    kc = kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin_dir)
    try:
        kc.ctl_timings = kubecontroller.install(kc, lab, *project_images, firewall=lab.firewall_mode)
        kc.cm_timings = certmanager.install(kc, cmdir)
        print(f"cert-manager installed: {kc.cm_timings}")
        kc.ca = TestCA(str(tmp_path_factory.mktemp("cm-ca")), "lab cert-manager CA")
        with open(f"{kc.ca.dir}/ca.key", "rb") as f:
            key = f.read()
        with open(kc.ca.ca_path, "rb") as f:
            kc.ca_pem = f.read()
        kc.apply(certmanager.ca_issuer(ISSUER, kc.ca_pem, key))
        wait_until(lambda: certmanager.condition(kc.get("clusterissuer", ISSUER), "Ready").get("status") == "True",
                   60, 0.5, "the CA ClusterIssuer Ready")
        kc.marker = f"echo-ok-{lab.prefix}"
        kc.apply([kubemanifests.namespace("apps"),
                  *kubemanifests.echo_backend("apps", "echo", kc.marker, kubecluster.ECHO_IMAGE)])
        kc.kubectl("-n", "apps", "rollout", "status", "deployment/echo", "--timeout=90s", timeout=100)
        yield kc
    except BaseException:
        print(certmanager.logs(kc))
        print(kubecontroller.controller_log(kc, 200))
        raise
    finally:
        kc.close()


def _report(kc, name: str) -> str:
    logs = kc.kubectl("-n", kubecontroller.NS, "logs", "-l", f"tailscale.com/parent-resource={name}",
                      "--tail=60", "--all-containers", check=False)
    certs = kc.kubectl("get", "certificates,certificaterequests", "-A", "-o", "wide", check=False)
    return (f"{certmanager.logs(kc)}\n{kubecontroller.controller_log(kc)}\n--- proxy log\n{logs.stdout}"
            f"{logs.stderr}\n--- certificates\n{certs.stdout}{certs.stderr}")


def test_ingress_certificate_issued_renewed_and_a_wrong_one_refused(lab, cm, tmp_path):
    kc = cm
    host = "apps-cm-web"
    fqdn = f"{host}.tailnet.test"
    lab.delete_node(host)
    t0 = time.monotonic()
    kc.apply({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
              "metadata": {"name": "cm-web", "namespace": "apps",
                           "annotations": {"cert-manager.io/cluster-issuer": ISSUER}},
              "spec": {"ingressClassName": "tailscale", "tls": [{"hosts": [fqdn], "secretName": "cm-web-tls"}],
                       "defaultBackend": {"service": {"name": "echo", "port": {"number": 8080}}}}})
    try:
        # cert-manager's ingress-shim made the Certificate (named after the Secret), the CA issuer signed it
        cert = wait_until(lambda: (c := kc.get("certificate.cert-manager.io", "cm-web-tls", "apps")) and
                          certmanager.condition(c, "Ready").get("status") == "True" and c, 120, 0.5,
                          "cert-manager's Certificate for the Ingress Ready")
        t_issued = time.monotonic() - t0
        assert cert["spec"]["dnsNames"] == [fqdn] and cert["spec"]["issuerRef"]["name"] == ISSUER, cert["spec"]
        first = secret_serial(kc, "apps", "cm-web-tls")
        data = kubecontroller.secret_data(kc, "apps", "cm-web-tls")
        assert data["ca.crt"].strip() == kc.ca_pem.strip()      # signed by the tests' CA
        node = wait_until(lambda: next((n for n in lab.hs_nodes() if n.get("given_name") == host), None), 180, 0.5,
                          "the Ingress proxy's node in headscale")
        ip = next(a for a in node["ip_addresses"] if ":" not in a)
        lab.wait_peer("client", host, 60)
        wait_until(lambda: curl_https(lab, fqdn, ip, kc.ca.ca_path, "/hello")[0] == 0, 120, 1,
                   "HTTPS through the Ingress proxy with cert-manager's certificate")
    except TimeoutError:
        raise AssertionError(_report(kc, "cm-web")) from None
    t_https = time.monotonic() - t0
    code, body, serial = curl_https(lab, fqdn, ip, kc.ca.ca_path, "/hello")
    assert code == 0 and kc.marker in body and "path=/hello" in body, body
    assert serial == first, (serial, first)
    # without the CA, curl refuses the certificate: it is really verified
    r = lab.exec("client", ["curl", "-sS", "-m", "10", "--resolve", f"{fqdn}:443:{ip}", f"https://{fqdn}/"],
                 timeout=15)
    assert r.returncode == 60, r.stderr
    print(f"Ingress apps/cm-web: Certificate Ready {t_issued:.1f}s, HTTPS with its serial {t_https:.1f}s "
          f"after the apply")

    # a renewal forced as `cmctl renew` does, with a connection held open across it
    marker = tmp_path / "held-ready"
    result: dict = {}

    def held() -> None:
        result["cp"] = lab.exec("client", [sys.executable, "-c", HELD, ip, fqdn, kc.ca.ca_path, str(marker), first],
                                timeout=150)
    t = threading.Thread(target=held)
    t.start()
    wait_until(lambda: marker.exists(), 30, 0.1, "the held connection")
    renewed_at = time.monotonic()
    certmanager.renew(kc, "apps", "cm-web-tls")
    second = wait_until(lambda: (s := secret_serial(kc, "apps", "cm-web-tls")) != first and s, 60, 0.3,
                        "cert-manager's re-issued certificate in the Secret")
    t_secret = time.monotonic() - renewed_at
    t.join(160)
    cp = result["cp"]
    assert cp.returncode == 0, cp.stderr[-2000:]
    out = json.loads(cp.stdout)
    took = time.monotonic() - renewed_at
    assert out["held_serial"].lstrip("0") == first and out["first"][0] == 200
    assert out["new_serial"].lstrip("0") == second, "the renewed certificate never reached a new connection"
    assert out["after"][0] == 200 and kc.marker in out["after"][1], "the held connection was cut"
    print(f"forced renewal: the Secret re-issued {t_secret:.1f}s, served to new connections at most {took:.1f}s "
          "after the renewal was triggered; the connection opened before it still answered")
    assert curl_https(lab, fqdn, ip, kc.ca.ca_path)[2] == second

    # a certificate for another name: cert-manager stops managing the Secret (the annotation goes, then the
    # Certificate; the Secret stays, as cert-manager leaves it by default) and the Secret gets the wrong pair
    kc.kubectl("-n", "apps", "annotate", "ingress", "cm-web", "cert-manager.io/cluster-issuer-")
    kc.kubectl("-n", "apps", "delete", "certificate.cert-manager.io", "cm-web-tls")
    wrong = kc.ca.issue("other.example.org")
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    kc.kubectl("-n", "apps", "patch", "secret", "cm-web-tls", "--type=merge", "-p", json.dumps(
        {"data": {"tls.crt": b64(wrong.cert_pem), "tls.key": b64(wrong.key_pem)}}))

    def warned() -> dict | None:
        events = json.loads(kc.kubectl("-n", "apps", "get", "events", "-o", "json").stdout)["items"]
        return next((e for e in events if e.get("reason") == "TLSCertificateInvalid" and e["type"] == "Warning"
                     and e["involvedObject"].get("name") == "cm-web"
                     and "covers none of the served names" in e.get("message", "")), None)
    try:
        ev = wait_until(warned, 120, 1, "the Warning event for the certificate for another name")
    except TimeoutError:
        raise AssertionError(_report(kc, "cm-web")) from None
    assert "Secret apps/cm-web-tls" in ev["message"] and fqdn in ev["message"], ev["message"]
    assert "BEGIN" not in ev["message"]
    logs = kc.kubectl("-n", kubecontroller.NS, "logs", "-l", "tailscale.com/parent-resource=cm-web",
                      "--all-containers", "--tail=400").stdout
    wait_until(lambda: "covers none of the served names" in kc.kubectl(
        "-n", kubecontroller.NS, "logs", "-l", "tailscale.com/parent-resource=cm-web", "--all-containers",
        "--tail=400").stdout, 60, 1, "the agent refusing the certificate for another name")
    code, body, serial = curl_https(lab, fqdn, ip, kc.ca.ca_path)
    assert code == 0 and serial == second, (code, body, serial)
    assert "PRIVATE KEY" not in logs

    kc.kubectl("-n", "apps", "delete", "ingress", "cm-web", "--wait=false")
    wait_until(lambda: kc.get("ingress", "cm-web", "apps") is None, 120, 0.5, "the Ingress gone")


def test_apiserver_proxy_certificate_from_cert_manager_verified_by_kubectl(lab, cm, tmp_path):
    kc = cm
    kubectl = kc.cfg.bin_dir / "kubectl"
    lab.delete_node("kube-apiserver")
    name = "kube-apiserver.tailnet.test"
    ticker = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ticker", "namespace": "apps"},
              "spec": {"terminationGracePeriodSeconds": 1,
                       "containers": [{"name": "ticker", "image": kubecontroller.PROXY_IMAGE,
                                       "imagePullPolicy": "Never", "command": ["/bin/sh", "-c",
                                       "i=0; while true; do echo tick-$i; i=$((i+1)); sleep 1; done"]}]}}
    kc.apply([*ap.reader_rbac("apps"), ticker,
              {"apiVersion": "cert-manager.io/v1", "kind": "Certificate",
               "metadata": {"name": "kube-api-tls", "namespace": kubecontroller.NS},
               "spec": {"secretName": "kube-api-tls", "dnsNames": [name],
                        "issuerRef": {"kind": "ClusterIssuer", "name": ISSUER}}}])
    wait_until(lambda: certmanager.condition(kc.get("certificate.cert-manager.io", "kube-api-tls",
                                                    kubecontroller.NS), "Ready").get("status") == "True",
               120, 0.5, "the API server proxy's Certificate Ready")
    serial = secret_serial(kc, kubecontroller.NS, "kube-api-tls")
    # the CA as a user gets it: the ca.crt cert-manager's CA issuer writes into the Secret (docs/https.md)
    ca_pem = kubecontroller.secret_data(kc, kubecontroller.NS, "kube-api-tls")["ca.crt"]
    try:
        with lab.hs_policy(ap.policy()):
            kubecontroller.helm(kc, "upgrade", helmchart.RELEASE, str(helmchart.CHART), "--namespace",
                                kubecontroller.NS, "--reuse-values", "--set", "apiServerProxy.mode=auth",
                                "--set", "apiServerProxy.tls.secretName=kube-api-tls")
            assert ap.wait_url(kc) == f"https://{name}"
            ip = ap.proxy_ip(kc)
            # the server is the tailnet IP with the MagicDNS name to verify (as MagicDNS resolving it would)
            client = ap.TailnetKubectl(lab, "client", kubectl, f"https://{ip}", tmp_path, token="unused",
                                       ca_pem=ca_pem, tls_server_name=name)
            assert "insecure-skip-tls-verify" not in client.config.read_text()
            kc.kubectl("-n", "apps", "wait", "pod/ticker", "--for=condition=Ready", "--timeout=120s", timeout=130)
            last: list = []

            def gets() -> bool:
                cp = client.run("-n", "apps", "get", "pods")
                last[:] = [cp.returncode, cp.stdout[-300:], cp.stderr[-500:]]
                return cp.returncode == 0 and "ticker" in cp.stdout
            try:
                wait_until(gets, 150, 2, "kubectl get through the API server proxy, verifying its certificate")
            except TimeoutError:
                raise AssertionError(f"last: {last}\n{ap.proxy_log(kc)}\n{kubecontroller.controller_log(kc)}") \
                    from None
            # the certificate served is cert-manager's (curl, the same CA, the same name)
            (tmp_path / "ca.crt").write_bytes(ca_pem)
            r = lab.exec("client", ["curl", "-sS", "-m", "10", "--cacert", str(tmp_path / "ca.crt"), "--resolve",
                                    f"{name}:443:{ip}", "-o", "/dev/null", "-w", "%{certs}", f"https://{name}/"],
                         timeout=15)
            assert r.returncode == 0, r
            served = next(ln.split(":", 1)[1].strip().replace(":", "").upper().lstrip("0")
                          for ln in r.stdout.splitlines() if ln.startswith("Serial Number:"))
            assert served == serial, (served, serial)
            ex = client.run("-n", "apps", "exec", "ticker", "--", "sh", "-c", "echo exec-$((6*7))")
            assert ex.returncode == 0 and ex.stdout.strip() == "exec-42", ex
            follow = client.background("-n", "apps", "logs", "-f", "ticker")
            try:
                first = follow.wait_line(lambda ln: ln.startswith("tick-"), 30, "logs -f lines")
                n = int(first.split("-")[1])
                follow.wait_line(lambda ln: ln == f"tick-{n + 3}", 30, "logs -f still streaming")
            finally:
                follow.stop()
            # the same kubeconfig without the CA: kubectl refuses the certificate, so verification is on
            cfg = json.loads(client.config.read_text())
            del cfg["clusters"][0]["cluster"]["certificate-authority-data"]
            noca = tmp_path / "kubeconfig-noca"
            noca.write_text(json.dumps(cfg))
            argv = [f"--kubeconfig={noca}" if a.startswith("--kubeconfig=") else a
                    for a in client.argv("-n", "apps", "get", "pods")]
            no = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            assert no.returncode != 0 and "certificate signed by unknown authority" in no.stderr, no
            print(f"kubectl through the API server proxy with cert-manager's certificate (serial {serial}): "
                  "get, exec, logs -f with verification on")
    finally:
        kubecontroller.helm(kc, "upgrade", helmchart.RELEASE, str(helmchart.CHART), "--namespace",
                            kubecontroller.NS, "--reuse-values", "--set", "apiServerProxy.mode=off")
