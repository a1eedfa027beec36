"""The API server proxy demo (``make demo DEMO_ARGS="--apiserver-proxy --once"``): kubectl over the tailnet.

Builds the lab (headscale, a ``client`` tailscaled node of user ``e2e``) and a real cluster with one node,
builds and imports both images, installs the controller with helm and ``apiServerProxy.mode=auth``, sets a
headscale policy granting ``e2e`` ``impersonate.groups: ["tailnet-readers"]`` and binds that group to read
access (labtools.apiproxylab), then prints the proxy's URL, ``kubectl get nodes`` run on the tailnet client
through it, and the refusal of a write (``kubectl run``) by RBAC naming the impersonated user. Exit status 0
only if the read worked and the write was refused.

With ``--recorder`` (``make demo DEMO_ARGS="--apiserver-proxy --recorder --once"``) the grant also says
``recorder: ["tag:k8s-recorder"], enforceRecorder: true`` and a ``Recorder`` object tagged ``tag:k8s-recorder``
is created in the cluster, as a user would: the controller runs it (StatefulSet ``recorder``, device
``recorder-0``; labtools.apiproxylab.ClusterRecorder). The client's ``kubectl exec -it`` types a command in a
Pod, the cast's first lines are printed from the recorder's volume (the header naming the user and the Pod,
the command's output); then, with the Recorder scaled to 0 (its Pod and its device gone), the same exec is
refused and the marker file its command would create is not in the Pod. Exit status 0 only if both behaved.
"""
from __future__ import annotations

import json
import time

from labtools import apiproxylab as ap
from labtools import kubecluster, kubecontroller
from labtools.kubedemo import Stage, run_controller_demo
from labtools.lab import wait_until


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(firewall: str, once: bool, timeout: float = 180.0, *, recorder: bool = False) -> int:
    return run_controller_demo(firewall, once, lambda st: (recording_story if recorder else story)(st, timeout),
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


def _talker(image: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "talker", "namespace": "default"},
            "spec": {"terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "talker", "image": image, "imagePullPolicy": "Never",
                                     "command": ["/bin/sh", "-c", "sleep 100000"]}]}}


def recording_story(st: Stage, timeout: float) -> bool:
    kc, lab = st.kc, st.lab
    with lab.hs_policy(ap.recorder_policy()):
        kubecontroller.install(kc, lab, st.proxy_tar, st.ctl_tar, firewall=st.firewall,
                               values={"apiServerProxy": {"mode": "auth"}})
        kc.apply([*ap.reader_rbac("default"), _talker(kubecontroller.PROXY_IMAGE)])
        _say(f"controller installed with helm, apiServerProxy.mode=auth; headscale policy grants user e2e "
             f"impersonate.groups [{ap.GROUP}] and recorder [{ap.RECORDER_TAG}], enforceRecorder true")
        rec = ap.ClusterRecorder(kc, timeout=max(timeout, 240.0))
        try:
            dev = rec.status["devices"][0]
            _say(f"kubectl apply Recorder 'recorder' (tags [{ap.RECORDER_TAG}]): the controller runs it, device "
                 f"{dev['hostname']} {' '.join(dev.get('tailnetIPs') or [])} (status RecorderReady True)")
            ip = ap.proxy_ip(kc, timeout)
            k = ap.TailnetKubectl(lab, "client", kc.cfg.bin_dir / "kubectl", f"http://{ip}",
                                  lab.run_dir / "apiproxy", token="unused")
            kc.kubectl("wait", "pod/talker", "--for=condition=Ready", "--timeout=120s", timeout=130)
            command = "echo recorded-$((6*7)); uname -s"
            ex = wait_until(lambda: (cp := k.run_tty("exec", "-it", "talker", "--", "sh", "-c", command,
                                                     size=(100, 30)))
                            .returncode == 0 and "recorded-42" in cp.stdout and cp, 120, 3,
                            "kubectl exec -it through the proxy")
            _say(f"client$ kubectl exec -it talker -- sh -c '{command}'\n{ex.stdout.rstrip()}")
            cast = wait_until(lambda: next((c for c in rec.casts() if "recorded-42" in json.dumps(c[1:])), None),
                              30, 1, "the recording")
            lines = [json.dumps(x) for x in cast[:4]]
            _say(f"the recording's first lines (asciinema v2 cast, on the volume of Pod {rec.pod}):\n" +
                 "\n".join(lines))
            recorded = cast[0].get("srcNodeUser") == "e2e" and cast[0]["kubernetes"]["PodName"] == "talker"
            rec.stop()
            _say("kubectl patch recorder recorder -p '{\"spec\":{\"replicas\":0}}': its Pod and its device gone")
            marker = f"/tmp/marker-{lab.prefix}"
            refused = k.run("exec", "talker", "--", "touch", marker)
            _say(f"client$ kubectl exec talker -- touch {marker}   (exit {refused.returncode})\n"
                 f"{refused.stderr.rstrip()}")
            ran = kc.kubectl("exec", "talker", "--", "ls", marker, check=False).returncode == 0
            _say(f"the marker file in the Pod: {'PRESENT (the refused exec ran)' if ran else 'absent'}")
            # with the device gone every request is refused (kubectl's GET of the Pod before its exec first)
            why = ("must be recorded, but no recorders are available", "error connecting to session recorders")
            ok = recorded and refused.returncode != 0 and any(w in refused.stderr for w in why) and not ran
            if not ok:
                _say("FAILED: the exec was not recorded, or the unrecordable exec was not refused")
            return ok
        finally:
            rec.remove()
