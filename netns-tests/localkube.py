"""A real Kubernetes control plane on loopback, without a node: etcd, kube-apiserver and the garbage collector
(kube-controller-manager with only that controller), from the pinned binaries in the cache.

Enough for what the controller does that needs no kubelet: the API server's validation of every rendered
object, the CRD's CEL rules, RBAC of the deployed manifests, watches for kopf, Service type changes, the
status subresource and foreground deletion. Ports are picked free; everything lives in one temporary directory.
Tokens (a static token file): `admin` (system:masters) and `controller`, authenticated as the controller's
ServiceAccount user, so the manifests' RBAC is what allows or denies its calls.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.kubeapi import make_certs

CONTROLLER_USER = "system:serviceaccount:tailscale:tailscale-controller"


def bin_dir() -> Path | None:
    cache = Path(os.environ.get("CB_CACHE", Path.home() / ".cache" / "containerboot-py"))
    for d in sorted(glob.glob(str(cache / "bin" / "k8s-*")), reverse=True):
        if all(os.access(os.path.join(d, b), os.X_OK) for b in ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")):
            return Path(d)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalKube:
    dir: Path
    bins: Path
    url: str = ""
    admin_token: str = "admin-token-0123456789"
    controller_token: str = "controller-token-0123456789"
    procs: list = field(default_factory=list)
    audit: bool = False            # log every request of the controller's user (Metadata level) for counting

    @classmethod
    def start(cls, directory: Path, timeout: float = 90.0, *, audit: bool = False) -> "LocalKube":
        bins = bin_dir()
        if bins is None:
            raise RuntimeError("etcd/kube-apiserver not built (scripts/install-kubernetes.sh)")
        k = cls(Path(directory), bins, audit=audit)
        k._start(timeout)
        return k

    @property
    def audit_log(self) -> Path:
        return self.dir / "audit.log"

    def audit_events(self) -> list[dict]:
        """The controller's requests so far: one event per completed request (verb, objectRef, ...)."""
        import json
        if not self.audit_log.exists():
            return []
        out = []
        for line in self.audit_log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue           # a line being written
        return out

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def _start(self, timeout: float) -> None:
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        certs = make_certs(str(d / "pki"), ("127.0.0.1", "localhost", "kubernetes.default.svc"))
        subprocess.run(["openssl", "genrsa", "-out", str(d / "sa.key"), "2048"], check=True, capture_output=True)
        (d / "tokens.csv").write_text(
            f'{self.admin_token},admin,admin,"system:masters"\n'
            f'{self.controller_token},{CONTROLLER_USER},ctl,"system:serviceaccounts,system:serviceaccounts:tailscale"\n')
        ep, pp, ap = _free_port(), _free_port(), _free_port()
        self._spawn("etcd", [str(self.bins / "etcd"), "--name=local", f"--data-dir={d / 'etcd'}",
                             f"--listen-client-urls=http://127.0.0.1:{ep}", f"--advertise-client-urls=http://127.0.0.1:{ep}",
                             f"--listen-peer-urls=http://127.0.0.1:{pp}", f"--initial-advertise-peer-urls=http://127.0.0.1:{pp}",
                             f"--initial-cluster=local=http://127.0.0.1:{pp}", "--unsafe-no-fsync", "--log-level=warn"])
        self._spawn("kube-apiserver", [
            str(self.bins / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{ep}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={ap}", f"--tls-cert-file={certs.cert_path}",
            f"--tls-private-key-file={certs.key_path}", f"--token-auth-file={d / 'tokens.csv'}",
            f"--service-account-key-file={d / 'sa.key'}", f"--service-account-signing-key-file={d / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc", "--authorization-mode=RBAC",
            "--service-cluster-ip-range=10.96.0.0/16,fd00:10:96::/108", "--allow-privileged=true",
            "--disable-admission-plugins=ServiceAccount", "--profiling=false", "--v=1", *self._audit_flags()])
        self.url = f"https://127.0.0.1:{ap}"
        self.ca = certs.ca_path
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client().get("/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError("kube-apiserver did not become ready:\n" + self.logs())
            time.sleep(0.3)
        kc = d / "kubeconfig"
        kc.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: local, cluster: {{server: "{self.url}", certificate-authority: "{self.ca}"}}}}]
users: [{{name: admin, user: {{token: "{self.admin_token}"}}}}]
contexts: [{{name: local, context: {{cluster: local, user: admin}}}}]
current-context: local
""")
        self.kubeconfig = kc
        self._spawn("kube-controller-manager", [
            str(self.bins / "kube-controller-manager"), f"--kubeconfig={kc}", "--secure-port=0",
            "--leader-elect=false", "--controllers=garbagecollector", "--v=1"])

    def _audit_flags(self) -> list[str]:
        if not self.audit:
            return []
        policy = self.dir / "audit-policy.yaml"
        policy.write_text(f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: Metadata
    users: ["{CONTROLLER_USER}"]
  - level: None
""")
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
                "--audit-log-mode=blocking", "--audit-log-maxsize=0"]

    def client(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=ssl.create_default_context(cafile=self.ca), timeout=10,
                            headers={"Authorization": f"Bearer {token or self.admin_token}"})

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bins / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args], input=input,
                              capture_output=True, text=True, timeout=60, check=check)

    def logs(self) -> str:
        out = []
        for f in sorted(self.dir.glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text()[-2000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir / "etcd", ignore_errors=True)
