"""The controller variant of the demo (``make demo DEMO_ARGS=--controller``): the user story of docs/controller.md.

Builds the lab (headscale, a ``client`` tailscaled node) and a real cluster with one node in the island,
builds and imports both images (the proxy's and the controller's), installs the controller from ``deploy/``
with the headscale provider (labtools.kubecontroller.install: an API key made with the lab's headscale), deploys
a backend Deployment and a Service annotated ``tailscale.com/expose: "true"``, then prints the Service's status
as the controller wrote it and a curl from the tailnet client to the tailnet IP in that status. With ``--once``
it exits after printing: status 0 only if the curl worked.
"""
from __future__ import annotations

import json
import time

from labtools import kubecontroller
from labtools.kubedemo import Stage, curl_from_client, deploy_backend, run_controller_demo


def _say(msg: str) -> None:
    print(msg, flush=True)


SERVICE = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "web", "namespace": "demo", "annotations": {"tailscale.com/expose": "true"}},
           "spec": {"type": "LoadBalancer", "selector": {"app": "backend"},
                    "ports": [{"port": 8080, "targetPort": 8080}]}}


def run(firewall: str, once: bool, timeout: float = 180.0) -> int:
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
