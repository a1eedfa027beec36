"""kubectl from a tailnet node through the API server proxy, in the lab (real-cluster test, demo, bench).

API (root; a running ``labtools.lab.Lab`` and a ``KubeCluster`` with the controller installed)::

    with lab.hs_policy(policy()): ...            # grants the lab user "e2e" impersonate.groups [GROUP]
    policy(extra_groups=[EDITORS])               # ... and, in a second grant, [EDITORS] (merged by the proxy)
    kc.apply(reader_rbac())                      # GROUP: view, get/list nodes, exec/attach/port-forward in apps
    kc.apply(editor_rbac("rw"))                  # EDITORS: the ClusterRole edit in namespace rw only
    set_mode(kc, "auth")                         # helm upgrade --reuse-values --set apiServerProxy.mode=auth
    url = wait_url(kc); ip = proxy_ip(kc)        # from the ConfigMap annotation / the proxy's state Secret
    k = TailnetKubectl(lab, "client", kc.cfg.bin_dir / "kubectl", f"http://{ip}", workdir)
    k.run("get", "nodes"); k.run_tty("exec", "-it", ...); bg = k.background("get", "pods", "-w")
    att = k.background("attach", "-i", "pod", stdin=True); att.send("line\n"); att.wait_line(...)

A `TailnetKubectl` runs the cluster's own kubectl binary inside a lab node's network namespace (not a Pod),
with a kubeconfig whose server is the proxy's tailnet address; background commands (watch, logs -f,
port-forward) are read line by line by a thread so a caller can wait for a line without blocking.
"""
from __future__ import annotations

import base64
import json
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

from labtools import helmchart, kubecontroller
from labtools.lab import stop_process, wait_until

CAP_KUBERNETES = "tailscale.com/cap/kubernetes"
GROUP = "tailnet-readers"
EDITORS = "tailnet-editors"
LABEL = "tailscale.com/parent-resource-type=apiserverproxy"
_RBAC = "rbac.authorization.k8s.io/v1"


def policy(user: str = "e2e", dst: str = "tag:k8s", extra_groups: Sequence[str] = ()) -> dict:
    """headscale's policy: everyone reaches everyone, and `user` gets impersonate.groups [GROUP] on `dst` (the
    proxy: the controller's tag, owned by `user` so that its tagged keys are accepted, or a user's `name@`);
    `extra_groups` come from a second grant of the same capability (the proxy merges both)."""
    grants: list[dict] = [{"src": ["*"], "dst": ["*"], "ip": ["*"]},
                          {"src": [f"{user}@"], "dst": [dst],
                           "app": {CAP_KUBERNETES: [{"impersonate": {"groups": [GROUP]}}]}}]
    if extra_groups:
        grants.append({"src": [f"{user}@"], "dst": [dst],
                       "app": {CAP_KUBERNETES: [{"impersonate": {"groups": list(extra_groups)}}]}})
    return {"tagOwners": {"tag:k8s": [f"{user}@"]}, "grants": grants}


def reader_rbac(namespace: str = "apps") -> list[dict]:
    """GROUP may read (ClusterRole `view`), list nodes, and open exec/attach/port-forward in `namespace`."""
    group = [{"kind": "Group", "name": GROUP, "apiGroup": "rbac.authorization.k8s.io"}]
    ref = {"apiGroup": "rbac.authorization.k8s.io"}
    return [
        {"apiVersion": _RBAC, "kind": "ClusterRoleBinding", "metadata": {"name": f"{GROUP}-view"},
         "roleRef": {**ref, "kind": "ClusterRole", "name": "view"}, "subjects": group},
        {"apiVersion": _RBAC, "kind": "ClusterRole", "metadata": {"name": f"{GROUP}-nodes"},
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": _RBAC, "kind": "ClusterRoleBinding", "metadata": {"name": f"{GROUP}-nodes"},
         "roleRef": {**ref, "kind": "ClusterRole", "name": f"{GROUP}-nodes"}, "subjects": group},
        {"apiVersion": _RBAC, "kind": "Role", "metadata": {"name": f"{GROUP}-sessions", "namespace": namespace},
         "rules": [{"apiGroups": [""], "resources": ["pods/exec", "pods/attach", "pods/portforward"],
                    "verbs": ["create", "get"]}]},
        {"apiVersion": _RBAC, "kind": "RoleBinding", "metadata": {"name": f"{GROUP}-sessions", "namespace": namespace},
         "roleRef": {**ref, "kind": "Role", "name": f"{GROUP}-sessions"}, "subjects": group},
    ]


def editor_rbac(namespace: str) -> list[dict]:
    """EDITORS may do what the ClusterRole `edit` allows, in `namespace` only (a RoleBinding)."""
    return [{"apiVersion": _RBAC, "kind": "RoleBinding",
             "metadata": {"name": f"{EDITORS}-edit", "namespace": namespace},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
             "subjects": [{"kind": "Group", "name": EDITORS, "apiGroup": "rbac.authorization.k8s.io"}]}]


def set_mode(kc, mode: str) -> None:
    kubecontroller.helm(kc, "upgrade", helmchart.RELEASE, str(helmchart.CHART), "--namespace", kubecontroller.NS,
                        "--reuse-values", "--set", f"apiServerProxy.mode={mode}")


def wait_url(kc, timeout: float = 150.0) -> str:
    """The proxy's URL as the controller wrote it on the ConfigMap."""
    def url() -> str | None:
        cm = kc.get("configmap", "apiserver-proxy", kubecontroller.NS) or {}
        return (cm.get("metadata", {}).get("annotations") or {}).get("tailscale.com/apiserver-proxy-url")
    return wait_until(url, timeout, 0.5, "the API server proxy's URL on its ConfigMap")


def proxy_ip(kc, timeout: float = 150.0) -> str:
    """The proxy's tailnet IPv4, from its state Secret."""
    def ip() -> str | None:
        out = kc.kubectl("-n", kubecontroller.NS, "get", "secrets", "-l", LABEL, "-o", "json").stdout
        for s in json.loads(out).get("items") or []:
            raw = (s.get("data") or {}).get("device_ips")
            if raw:
                return next((a for a in json.loads(base64.b64decode(raw)) if "." in a), None)
        return None
    return wait_until(ip, timeout, 0.5, "the API server proxy's tailnet IP in its state Secret")


def proxy_log(kc, tail: int = 80) -> str:
    cp = kc.kubectl("-n", kubecontroller.NS, "logs", "-l", LABEL, "--all-containers", f"--tail={tail}", check=False)
    return f"--- API server proxy log\n{cp.stdout}{cp.stderr}"


class Background:
    """A kubectl running in the background; its stdout+stderr lines as they come; with `stdin`, `send` writes to
    its standard input (kept open until `stop`)."""

    def __init__(self, argv: list[str], stdin: bool = False) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, pred, timeout: float = 30.0, what: str = "") -> str:
        def found() -> str | None:
            return next((ln for ln in self.lines if pred(ln)), None)
        try:
            return wait_until(found, timeout, 0.2, what or "a line")
        except TimeoutError:
            raise AssertionError(f"{what}: not seen in {self.lines[-20:]}") from None

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None, "started without stdin=True"
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        stop_process(self.proc)


class TailnetKubectl:
    def __init__(self, lab, ns: str, kubectl: Path, server: str, workdir: Path, token: str = "",
                 ca_pem: bytes = b"", tls_server_name: str = "") -> None:
        """`server` http://... (auth mode on headscale) or https://...: with `ca_pem` (the proxy serves a
        certificate of yours, docs/https.md) the certificate is verified against it, for `tls_server_name` when
        the server is an IP (as MagicDNS would give the name); without, the proxy's self-signed certificate is
        not checked (insecure-skip-tls-verify, as docs/apiserver-proxy.md says for noauth on headscale)."""
        self.lab, self.ns, self.kubectl = lab, ns, str(kubectl)
        workdir.mkdir(parents=True, exist_ok=True)
        scheme = server.split(":", 1)[0]
        trust = "ca" if ca_pem else "skip"
        self.config = workdir / f"kubeconfig-{ns}-{scheme}-{'token' if token else 'none'}-{trust}"
        user: dict = {"token": token} if token else {}
        cluster: dict = {"server": server}
        if scheme == "https" and ca_pem:
            cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
            if tls_server_name:
                cluster["tls-server-name"] = tls_server_name
        elif scheme == "https":
            cluster["insecure-skip-tls-verify"] = True
        self.config.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "tailnet",
            "clusters": [{"name": "tailnet", "cluster": cluster}],
            "users": [{"name": "tailnet", "user": user}],
            "contexts": [{"name": "tailnet", "context": {"cluster": "tailnet", "user": "tailnet"}}]}))

    def argv(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.lab.netns(self.ns), self.kubectl, f"--kubeconfig={self.config}",
                "--request-timeout=30s", *args]

    def run(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def run_tty(self, *args: str, timeout: float = 60.0, size: tuple[int, int] | None = None,
                ) -> subprocess.CompletedProcess[str]:
        """With a pseudo-terminal (util-linux `script`), as an interactive `kubectl exec -it` has; `size`:
        its columns and rows (else script's, 0x0 without a terminal around it)."""
        import shlex
        line = shlex.join(self.argv(*args))
        if size:
            line = f"stty cols {size[0]} rows {size[1]}; {line}"
        return subprocess.run(["script", "-qec", line, "/dev/null"], capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def background(self, *args: str, stdin: bool = False) -> Background:
        return Background(self.argv(*args), stdin=stdin)


# ------------------------------------------------------------------------------------------------------------
# Without Kubernetes: the proxy next to a lab agent, in front of labtools.fakeapiserver (lab test, bench).

class LocalProxy:
    """`containerboot apiserver-proxy` in the lab's proxy namespace next to a running agent (kernel mode), in
    front of a stand-in API server on that namespace's loopback (TLS with `ca`/`cert`/`key`, checked by the
    proxy with `ca` as a cluster CA); and a plain TCP forward on the same tailnet address for comparison."""

    def __init__(self, lab, agent, *, ca: str, cert: str, key: str, mode: str = "auth", port: int = 80,
                 objects: int = 5000, forward_port: int = 0, exec_log: str = "") -> None:
        import os
        import sys
        self.lab, self.agent, self.port = lab, agent, port
        d = agent.dir / "apiproxy"
        sa = d / "root" / "var/run/secrets/kubernetes.io/serviceaccount"
        sa.mkdir(parents=True, exist_ok=True)
        (sa / "token").write_text("lab-proxy-token\n")
        (sa / "ca.crt").write_text(Path(ca).read_text())
        (sa / "namespace").write_text("tailscale\n")
        # this checkout first: labtools is not installed, and the proxy must be this tree's
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        self.api = lab._popen("fakeapi", "fakeapi", "proxy", [
            sys.executable, "-m", "labtools.fakeapiserver", "--listen", "127.0.0.1:6443", "--cert", cert,
            "--key", key, "--objects", str(objects), *(["--exec-log", exec_log] if exec_log else [])], env,
            d / "fakeapi.log")
        self.log_path = d / "apiserver-proxy.log"
        self.proc = lab._popen("apiproxy", "apiproxy", "proxy", [sys.executable, "-m", "containerboot",
                                                                 "apiserver-proxy"], {
            **env, "TS_APISERVER_PROXY_MODE": mode, "TS_SOCKET": agent.socket,
            "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443",
            "TS_TEST_ONLY_ROOT": str(d / "root"), "TS_APISERVER_PROXY_PORT": str(port)}, self.log_path)
        self.forward = None
        if forward_port:
            self.forward = lab._popen("tcpforward", "tcpforward", "proxy", [
                sys.executable, "-m", "labtools.fakeapiserver", "--forward", f"0.0.0.0:{forward_port}",
                "--to", "127.0.0.1:6443"], env, d / "forward.log")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_listening(self, timeout: float = 30.0) -> str:
        def seen() -> str | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"the API server proxy exited:\n{self.log_text()[-3000:]}")
            return next((ln for ln in self.log_text().splitlines() if "is listening on" in ln), None)
        return wait_until(seen, timeout, 0.1, "the API server proxy listening")

    def stop(self) -> None:
        for p in (self.proc, self.api, self.forward):
            if p is not None:
                stop_process(p)


RECORDER_TAG = "tag:k8s-recorder"


def recorder_policy(user: str = "e2e", dst: str = "tag:k8s", *, enforce: bool = True, events: bool = False) -> dict:
    """`policy()` whose grant also says `recorder: [RECORDER_TAG]` with `enforceRecorder` (and `enableEvents`
    with `events`), the tag owned by `user` so that the recorder node's tagged key is accepted."""
    return {"tagOwners": {"tag:k8s": [f"{user}@"], RECORDER_TAG: [f"{user}@"]},
            "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]},
                       {"src": [f"{user}@"], "dst": [dst], "app": {CAP_KUBERNETES: [
                           {"impersonate": {"groups": [GROUP]}},
                           {"recorder": [RECORDER_TAG], "enforceRecorder": enforce,
                            **({"enableEvents": True} if events else {})}]}}]}


class TailnetRecorder:
    """Our recorder (`python -m recorder`, this checkout) on a plain tailscaled node tagged RECORDER_TAG in
    the lab namespace `recorder`, listening on the node's tailnet addresses, storing casts in `directory`."""

    def __init__(self, lab, directory: Path, hostname: str = "k8s-recorder", ui: bool = True) -> None:
        import os
        import sys
        self.lab, self.directory, self.hostname = lab, directory, hostname
        if "recorder" not in lab.namespaces:
            lab.add_namespace("recorder")
        self.node = lab.start_node(hostname, "recorder", authkey=lab.preauth_key(tags=[RECORDER_TAG]))
        self.log_path = lab.run_dir / f"{hostname}.log"
        self.proc = lab._popen("recorder", hostname, "recorder", [sys.executable, "-m", "recorder"], {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "TSRECORDER_DST": str(directory),
            "TSRECORDER_UI": "true" if ui else "false", "TS_SOCKET": self.node.socket}, self.log_path)
        wait_until(lambda: "recorder listening on" in self.log_text() or self._exited(), 60, 0.5,
                   "the recorder listening on its tailnet address")
        if self.proc.poll() is not None:
            raise AssertionError(f"the recorder exited:\n{self.log_text()[-2000:]}")

    def _exited(self) -> bool:
        return self.proc.poll() is not None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def casts(self) -> list[list]:
        return [[json.loads(x) for x in p.read_text().splitlines() if x.strip()]
                for p in sorted(self.directory.glob("*.cast"))]

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def remove(self) -> None:
        """The recorder and its node gone from the tailnet."""
        self.stop()
        stop_process(self.node.proc)
        self.lab.delete_node(self.hostname)
        # forgotten by the lab too (its state with it), so a later module on the same lab can start it again
        self.lab.nodes.pop(self.hostname, None)
        shutil.rmtree(self.node.dir, ignore_errors=True)


class ClusterRecorder:
    """A `Recorder` object in the cluster (the controller runs it: StatefulSet `<name>`, device `<name>-0` tagged
    RECORDER_TAG, casts on its volume); the controller must be installed. `casts()` reads them from the Pod,
    `stop()` scales the Recorder to 0 and waits until its device has left the tailnet, `remove()` deletes it."""

    def __init__(self, kc, name: str = "recorder", *, ui: bool = False, timeout: float = 240.0) -> None:
        self.kc, self.name = kc, name
        self.obj = {"apiVersion": "tailscale.com/v1alpha1", "kind": "Recorder", "metadata": {"name": name},
                    "spec": {"tags": [RECORDER_TAG], "enableUI": ui}}
        kc.apply([self.obj])
        self.status = wait_until(lambda: (s := self._status()) and any(
            c["type"] == "RecorderReady" and c["status"] == "True" for c in s.get("conditions") or []) and s,
            timeout, 3, f"the Recorder {name!r} on the tailnet (RecorderReady True)")
        self.hostname = self.status["devices"][0]["hostname"]
        self.pod = f"{name}-0"
        wait_until(lambda: "recorder listening on" in self.log_text(), 60, 2, "the recorder listening")

    def _status(self) -> dict:
        cp = self.kc.kubectl("get", "recorder", self.name, "-o", "json", check=False)
        return (json.loads(cp.stdout).get("status") or {}) if cp.returncode == 0 else {}

    def log_text(self) -> str:
        cp = self.kc.kubectl("-n", kubecontroller.NS, "logs", self.pod, "-c", "recorder", check=False)
        return cp.stdout if cp.returncode == 0 else ""

    def casts(self) -> list[list]:
        cp = self.kc.kubectl("-n", kubecontroller.NS, "exec", self.pod, "-c", "recorder", "--", "sh", "-c",
                             'for f in /data/recordings/*.cast; do [ -f "$f" ] && cat "$f" && echo ---; done',
                             check=False)
        if cp.returncode != 0:
            return []
        return [[json.loads(x) for x in part.splitlines() if x.strip()]
                for part in cp.stdout.split("---\n") if part.strip()]

    def stop(self, timeout: float = 180.0) -> None:
        """Scaled to 0: its Pod gone and its device deleted from the control plane by the controller."""
        self.kc.kubectl("patch", "recorder", self.name, "--type=merge", "-p", '{"spec":{"replicas":0}}')
        wait_until(lambda: not self._status().get("devices") and self.kc.kubectl(
            "-n", kubecontroller.NS, "get", "pod", self.pod, check=False).returncode != 0,
            timeout, 2, f"the Recorder {self.name!r} scaled to 0, its device gone")

    def remove(self) -> None:
        self.kc.kubectl("delete", "recorder", self.name, "--ignore-not-found", "--timeout=180s", check=False,
                        timeout=190)
