"""The API server proxy demo (``make demo DEMO_ARGS="--apiserver-proxy --once"``): kubectl over the tailnet.

Builds the lab (headscale, a ``client`` tailscaled node of user ``e2e``) and a real cluster with one node,
builds and imports both images, installs the controller with helm and ``apiServerProxy.mode=auth``, sets a
headscale policy granting ``e2e`` ``impersonate.groups: ["tailnet-readers"]`` and binds that group to read
access (labtools.apiproxylab), then prints the proxy's URL, ``kubectl get nodes`` run on the tailnet client
through it, and the refusal of a write (``kubectl run``) by RBAC naming the impersonated user. Exit status 0
only if the read worked and the write was refused.
"""
from __future__ import annotations

import time

from labtools import apiproxylab as ap
from labtools import kubecluster, kubecontroller
from labtools.kubedemo import Stage, run_controller_demo
from labtools.lab import wait_until


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(firewall: str, once: bool, timeout: float = 180.0) -> int:
    return run_controller_demo(firewall, once, lambda st: story(st, timeout),
                               logs=lambda kc: [kubecontroller.controller_log(kc), ap.proxy_log(kc)])


def story(st: Stage, timeout: float) -> bool:
    kc, lab = st.kc, st.lab
    _say(f"the API server at {kc.server} is not reachable from the tailnet client")
    with lab.hs_policy(ap.policy()):
        kubecontroller.install(kc, lab, st.proxy_tar, st.ctl_tar, firewall=st.firewall,
                               values={"apiServerProxy": {"mode": "auth"}})
        _say("controller installed with helm, apiServerProxy.mode=auth; headscale policy grants user e2e "
             f"impersonate.groups [{ap.GROUP}]; {ap.GROUP} may view and list nodes")
        kc.apply(ap.reader_rbac("default"))
        url = ap.wait_url(kc, timeout)
        ip = ap.proxy_ip(kc, timeout)
        _say(f"API server proxy: {url} (tailnet IP {ip}; the client has no MagicDNS here, so kubectl uses "
             f"http://{ip})")
        k = ap.TailnetKubectl(lab, "client", kc.cfg.bin_dir / "kubectl", f"http://{ip}",
                              lab.run_dir / "apiproxy", token="unused")
        t0 = time.monotonic()
        read = wait_until(lambda: (cp := k.run("get", "nodes")).returncode == 0 and cp, 90, 1,
                          "kubectl get nodes through the proxy")
        _say(f"client$ kubectl get nodes   (through the proxy, {time.monotonic() - t0:.1f}s)\n"
             f"{read.stdout.rstrip()}")
        write = k.run("run", "demo-write", f"--image={kubecluster.ECHO_IMAGE}")
        _say(f"client$ kubectl run demo-write ...   (exit {write.returncode})\n{write.stderr.rstrip()}")
        ok = write.returncode != 0 and 'User "e2e" cannot create resource "pods"' in write.stderr
        if not ok:
            _say("FAILED: the write was not refused by RBAC as user e2e")
        return ok
