"""Session recording in the lab's real Kubernetes with the lab's real headscale: the API server proxy (the
controller's, ``apiServerProxy.mode: auth``, from this checkout's proxy image) records the lab client's real
``kubectl exec -it`` (kubectl v1.34: WebSocket, and SPDY with ``KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false``)
into our recorder (``python -m recorder``) on a tailnet node tagged ``tag:k8s-recorder``, as the grant's
``recorder: ["tag:k8s-recorder"], enforceRecorder: true`` asks: the cast's header names the user ``e2e`` and
the Pod, and it holds the command's output. With the recorder stopped, the exec is refused with upstream's
fail-closed message, and the command never ran: the marker file it would have created is not in the Pod.
With ``enforceRecorder`` off, the same exec runs unrecorded (fail open).
"""
from __future__ import annotations

import json
import subprocess

import pytest

from labtools import apiproxylab as ap, helmchart, kubecluster, kubecontroller, kubemanifests
from labtools.lab import wait_until
from needs import unavailable

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(900)]



@pytest.fixture(scope="module")
def images(lab_bin_dir):
    try:
        return kubecontroller.build_images()
    except RuntimeError as e:
        if "setup.sh --image" in str(e):
            unavailable(f"the image build's packages cannot be installed: {e}")
        raise


@pytest.fixture(scope="module")
def kube(lab, images):
    try:
        bdir = kubecluster.ensure_binaries()
        helmchart.ensure_helm()
    except (kubecluster.ClusterError, helmchart.HelmError) as e:
        unavailable(f"the Kubernetes binaries or helm cannot be built here: {e}")
    kc = kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=bdir)
    try:
        kubecontroller.install(kc, lab, *images, firewall=lab.firewall_mode)
        yield kc
    except BaseException:
        print(kubecontroller.controller_log(kc, 200))
        print(kc.diagnostics())
        raise
    finally:
        kc.close()


def policy(enforce: bool) -> dict:
    return ap.recorder_policy("e2e", "tag:k8s", enforce=enforce)


def talker(image: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "talker", "namespace": "apps"},
            "spec": {"terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "talker", "image": image, "imagePullPolicy": "Never",
                                     "command": ["/bin/sh", "-c", "sleep 100000"]}]}}


def test_kubectl_exec_recorded_and_refused_without_the_recorder(lab, kube):
    kc = kube
    kubectl = kc.cfg.bin_dir / "kubectl"
    lab.delete_node("kube-apiserver")
    kc.apply([kubemanifests.namespace("apps"), *ap.reader_rbac("apps"), talker(kubecontroller.PROXY_IMAGE)])
    rec_dir = lab.run_dir / "k8s-recordings"
    recorder = None
    work = lab.run_dir / "recording"
    work.mkdir(exist_ok=True)
    with lab.hs_policy(policy(enforce=True)):
        try:
            recorder = ap.TailnetRecorder(lab, rec_dir, ui=False)
            ap.set_mode(kc, "auth")
            ap.wait_url(kc)
            ip = ap.proxy_ip(kc)
            client = ap.TailnetKubectl(lab, "client", kubectl, f"http://{ip}", work, token="unused")
            kc.kubectl("-n", "apps", "wait", "pod/talker", "--for=condition=Ready", "--timeout=120s", timeout=130)

            # WebSocket (kubectl's default since 1.31), with a terminal
            def exec_ok():
                ex = client.run_tty("-n", "apps", "exec", "-it", "talker", "--", "sh", "-c", "echo rec-ws-$((6*7))")
                return ex if ex.returncode == 0 and "rec-ws-42" in ex.stdout else None
            try:
                wait_until(exec_ok, 120, 3, "kubectl exec -it through the proxy, recorded")
            except TimeoutError:
                raise AssertionError(ap.proxy_log(kc)) from None
            cast = wait_until(lambda: next((c for c in recorder.casts() if "rec-ws-42" in json.dumps(c[1:])), None),
                              30, 0.5, "the WebSocket session's cast")
            head = cast[0]
            assert head["srcNodeUser"] == "e2e" and head["srcNode"].startswith("client")
            assert head["kubernetes"] == {"PodName": "talker", "Namespace": "apps", "Container": "",
                                          "SessionType": "exec"}
            assert head["command"] == "sh -c echo rec-ws-$((6*7))" and head["width"] > 0 and head["height"] > 0

            # SPDY (what kubectl before 1.31 speaks)
            spdy = subprocess.run(["env", "KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false",
                                   *client.argv("-n", "apps", "exec", "talker", "--", "sh", "-c", "echo rec-spdy-7")],
                                  capture_output=True, text=True, timeout=60)
            assert spdy.returncode == 0 and "rec-spdy-7" in spdy.stdout, spdy
            wait_until(lambda: any("rec-spdy-7" in json.dumps(c[1:]) for c in recorder.casts()), 30, 0.5,
                       "the SPDY session's cast")

            # the recorder stops: the exec is refused and the command never runs
            recorder.stop()
            marker = f"/tmp/marker-{lab.prefix}"
            ex = client.run("-n", "apps", "exec", "talker", "--", "touch", marker)
            assert ex.returncode != 0 and "error connecting to session recorders" in ex.stderr, ex
            assert "failure mode is 'fail closed'" in ex.stderr
            ls = kc.kubectl("-n", "apps", "exec", "talker", "--", "ls", marker, check=False)
            assert ls.returncode != 0, "the refused exec ran in the container"
        finally:
            if recorder is not None:
                recorder.remove()
    # not enforced: the same exec runs, unrecorded, with the proxy's warning
    with lab.hs_policy(policy(enforce=False)):
        def runs():
            ex = client.run("-n", "apps", "exec", "talker", "--", "touch", marker)
            return ex if ex.returncode == 0 else None
        wait_until(runs, 60, 2, "the exec running unrecorded once recording is not enforced")
        assert kc.kubectl("-n", "apps", "exec", "talker", "--", "ls", marker, check=False).returncode == 0
        assert "failure mode is 'fail open'; continuing session without recording." in ap.proxy_log(kc, 400)
    ap.set_mode(kc, "off")
