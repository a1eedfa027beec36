"""Session recording on a real tailnet without Kubernetes: `containerboot apiserver-proxy` next to our agent in
the lab's proxy namespace (labtools.apiproxylab.LocalProxy, in front of labtools.fakeapiserver, whose exec
answers stdin on stdout and notes each exec it runs), our recorder (`python -m recorder`) on a tailscaled node
tagged `tag:k8s-recorder`, and the lab's real headscale with a grant whose rule says
`recorder: ["tag:k8s-recorder"], enforceRecorder: true`.

From the client node (labtools.execclient: kubectl's SPDY exec): the exec is answered and the recorder holds
its cast (header naming the user `e2e`, the Pod, the command; the output); with the recorder stopped the exec
is refused with upstream's fail-closed message and the API server never sees it (no exec noted); with the
recorder's node gone, every request of the caller is refused (no recorder available), as upstream.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from labtools import apiproxylab as ap
from labtools.lab import wait_until
from tests.support.kubeapi import make_certs

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[1]


def policy(enforce: bool) -> dict:
    return ap.recorder_policy("e2e", "e2e@", enforce=enforce)


def _exec(lab, ip: str, *lines: str):
    return lab.exec("client", [sys.executable, "-m", "labtools.execclient", f"http://{ip}", "apps", "talker",
                               *lines], timeout=60, env={"PYTHONPATH": str(REPO)})


def test_exec_recorded_on_a_tagged_recorder_and_refused_without_one(lab, start_agent):
    agent = start_agent({"TS_HOSTNAME": "apiproxy-rec", "TS_USERSPACE": "false"})
    agent.wait_running(90)
    certs = make_certs(tempfile.mkdtemp(prefix="apiproxy-pki-", dir=str(lab.run_dir)), ["127.0.0.1"])
    exec_log = lab.run_dir / "recording-exec.log"
    exec_log.unlink(missing_ok=True)
    p = ap.LocalProxy(lab, agent, ca=certs.ca_path, cert=certs.cert_path, key=certs.key_path, objects=5,
                      exec_log=str(exec_log))
    recorder = None
    rec_dir = lab.run_dir / "recordings"
    try:
        p.wait_listening()
        ip = agent.tailnet_ips()[0]
        with lab.hs_policy(policy(enforce=True)):
            recorder = ap.TailnetRecorder(lab, rec_dir)

            # recorded: the exec runs, and its cast is on the recorder
            def recorded():
                cp = _exec(lab, ip, "echo recorded-42")
                return cp if cp.returncode == 0 else None
            try:
                cp = wait_until(recorded, 90, 2, "an exec through the proxy, recorded")
            except TimeoutError:
                raise AssertionError(f"{_exec(lab, ip, 'echo x')}\n{p.log_text()[-3000:]}") from None
            assert "out: echo recorded-42" in cp.stdout
            out = ["o", "out: echo recorded-42\n"]

            def cast_with_output() -> list | None:
                # the recorder writes a cast as the session streams it in, so it exists (its header first) before
                # the output has arrived: wait for the output, reading whole lines only
                for c in sorted(rec_dir.glob("*.cast")):
                    text = c.read_text()
                    lines = [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines()]
                    if lines and out in [ev[1:] for ev in lines[1:]]:
                        return lines
                return None
            lines = wait_until(cast_with_output, 30, 0.5, "the cast stored, with the exec's output")
            head = lines[0]
            assert head["srcNodeUser"] == "e2e" and head["srcNode"].startswith("client")
            assert head["kubernetes"] == {"PodName": "talker", "Namespace": "apps", "Container": "",
                                          "SessionType": "exec"}
            assert (head["command"], head["width"], head["height"]) == ("sh", 80, 24)
            assert "will be recorded, the recording will be sent to a recorder at" in p.log_text()

            # the recorder stops: enforced, so refused before the API server sees the exec
            recorder.stop()
            ran = exec_log.read_text().count("\n")
            cp = _exec(lab, ip, "touch /tmp/marker")
            assert cp.returncode == 3 and "HTTP/1.1 403" in cp.stdout, cp
            msg = json.loads(cp.stdout.split("\n", 1)[1])["message"]
            assert msg.startswith('error connecting to session recorders: recording: error starting recording on "')
            assert "failure mode is 'fail closed'; closing connection." in msg
            assert exec_log.read_text().count("\n") == ran            # nothing ran in the "container"

            # the recorder's node gone: no recorder available, every request of the caller refused
            recorder.remove()
            recorder = None

            def none_available():
                cp = _exec(lab, ip, "touch /tmp/marker")
                return cp if "no recorders are available" in cp.stdout else None
            cp = wait_until(none_available, 60, 2, "the recorder's node gone from the proxy's netmap")
            assert "forbidden: 'kubectl exec' session must be recorded, but no recorders are available." in cp.stdout
            assert exec_log.read_text().count("\n") == ran
            get = lab.curl("client", f"http://{ip}/api/v1/namespaces/apps/pods", 10, extra=["-w", "\\n%{http_code}"])
            assert get.stdout.endswith("403") and "must be recorded, but no recorders are available" in get.stdout
    finally:
        if recorder is not None:
            recorder.remove()
        p.stop()
