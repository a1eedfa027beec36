"""Kubernetes pieces for the lab: the test API server inside the island, and an agent started like a Pod.

* ``KubeAPI.start(lab)`` runs ``python -m tests.support.kubeapi`` in the lab's ``hs`` namespace, listening on
  10.99.0.1:6443 (reachable from the proxy namespace over the island bridge; the serving certificate covers
  that address). Its ServiceAccount dir (ca.crt, token, namespace) lives under the lab's run dir. The server is
  inspected and steered through its unauthenticated ``/_test/`` endpoints, with curl run inside the ``hs``
  namespace (the island has no link to the root namespace, so that is the only way in).
* ``start_pod_agent(lab, api, env, ...)`` starts an agent (ours or upstream's) in the proxy namespace wrapped
  in ``pod_mount_namespace_argv``: a private mount namespace with tmpfs on /run and /var/lib and the SA dir
  bind-mounted at /var/run/secrets/kubernetes.io/serviceaccount, so the agent AND its tailscaled child (whose
  kube client only reads that absolute path) find the ServiceAccount files; plus a fresh tmpfs on /tmp (with
  the lab's run dir bound back in), since without TS_STATE_DIR tailscaled uses ``--statedir=/tmp``. The
  environment is the lab's default agent environment with the kube variables on top and the keys in ``drop``
  removed (by default TS_STATE_DIR: the state lives in the Secret).

Everything stays inside the lab's namespaces; every wait is bounded.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from labtools import lab as labmod
from labtools.lab import AgentProcess, Lab, LabError, stop_process, wait_until
from tests.support.kubeapi import pod_mount_namespace_argv

API_HOST = labmod.HS_V4
API_PORT = 6443
NAMESPACE = "tailscale"


def wait_alive(pred: Callable[[], Any], proc: subprocess.Popen, timeout: float, what: str,
               log: Path | None = None) -> Any:
    """wait_until(pred), but fail at once if proc exits first (for predicates that are not about the log)."""
    def check() -> Any:
        v = pred()
        if not v and proc.poll() is not None:
            return _Dead(proc.returncode)
        return v
    v = wait_until(check, timeout, 0.1, what)
    if isinstance(v, _Dead):
        tail = log.read_text(errors="replace")[-3000:] if log is not None else ""
        raise LabError(f"process exited ({v.code}) before {what}; log tail:\n{tail}")
    return v


@dataclass
class _Dead:
    code: int | None

    def __bool__(self) -> bool:
        return True


def wait_log(agent: AgentProcess, text: str, timeout: float = 120.0) -> str:
    """The first agent log line containing text; fails as soon as the agent exits without logging it."""
    return agent.wait_for_log(text, timeout)


@dataclass
class KubeAPI:
    """A test API server process in the lab's hs namespace."""
    lab: Lab
    dir: Path                      # the ServiceAccount dir (ca.crt, token, namespace, url, state.json at exit)
    url: str
    host: str
    port: int
    proc: subprocess.Popen = field(repr=False)
    log_path: Path = field(repr=False, default=None)  # type: ignore[assignment]

    @classmethod
    def start(cls, lab: Lab, name: str, *, host: str = API_HOST, port: int = API_PORT,
              namespace: str = NAMESPACE, secrets: Sequence[str] = (), timeout: float = 20.0) -> "KubeAPI":
        d = lab.run_dir / "kubeapi" / name
        d.mkdir(parents=True, exist_ok=False)
        log = lab.run_dir / "kubeapi" / f"{name}.log"
        argv = [sys.executable, "-m", "tests.support.kubeapi", "--listen", f"{host}:{port}", "--dir", str(d),
                "--namespace", namespace, "--san", host]
        for s in secrets:
            argv += ["--secret", s]
        env = {**lab._base_env(d), "PYTHONPATH": str(labmod.REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        # _popen: the lab's teardown stops it too if a test dies before its own cleanup
        p = lab._popen("http", f"kubeapi-{name}", "hs", argv, env, log)

        wait_alive(lambda: (d / "url").exists() and (d / "ca.crt").exists(), p, timeout,
                   "test kube API server ready", log)
        api = cls(lab, d, (d / "url").read_text().strip(), host, port, p, log)
        # reachable with TLS verified against its CA from the proxy namespace, where the agent will run
        wait_until(lambda: api._curl("proxy", "/_test/objects", check=False).returncode == 0, timeout, 0.2,
                   "kube API server reachable from the proxy namespace")
        return api

    # ---- environment for a client in the proxy namespace
    def env(self) -> dict[str, str]:
        return {"KUBERNETES_SERVICE_HOST": self.host, "KUBERNETES_SERVICE_PORT_HTTPS": str(self.port),
                "KUBERNETES_SERVICE_PORT": str(self.port), "TS_KUBERNETES_READ_API_SERVER_ADDRESS_FROM_ENV": "true"}

    # ---- /_test endpoints
    def _curl(self, ns: str, path: str, *, method: str = "GET", body: Any = None, check: bool = True,
              timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
        argv = ["curl", "-sS", "-g", "--noproxy", "*", "-m", str(timeout), "--cacert", str(self.dir / "ca.crt"),
                "-X", method, "-o", "-", "-w", "\n%{http_code}"]
        if body is not None:
            argv += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
        argv.append(self.url + path)
        cp = self.lab.exec(ns, argv, timeout=timeout + 5)
        if check and cp.returncode != 0:
            raise LabError(f"curl {method} {path} from {ns} failed (exit {cp.returncode}): {cp.stderr}")
        return cp

    def _call(self, path: str, *, method: str = "GET", body: Any = None) -> Any:
        cp = self._curl("hs", path, method=method, body=body)
        text, _, code = cp.stdout.rpartition("\n")
        if code.strip() != "200":
            raise LabError(f"{method} {path}: HTTP {code.strip()}: {text[-500:]}")
        return json.loads(text)

    def objects(self) -> list[dict]:
        if self.proc.poll() is not None:
            state = json.loads((self.dir / "state.json").read_text())
            return state["objects"]
        return self._call("/_test/objects")

    def requests(self) -> list[dict]:
        if self.proc.poll() is not None:
            return json.loads((self.dir / "state.json").read_text())["requests"]
        return self._call("/_test/requests")

    def set_rules(self, rules: list | None) -> None:
        """Authorise only these RBAC-like rules ([verbs, resources, resourceNames] each; None = everything)."""
        self._call("/_test/rules", method="PUT", body=rules)

    def secret(self, name: str) -> dict | None:
        for o in self.objects():
            if o.get("kind") == "Secret" and o["metadata"]["name"] == name:
                return o
        return None

    def secret_data(self, name: str) -> dict[str, bytes] | None:
        o = self.secret(name)
        if o is None:
            return None
        return {k: base64.b64decode(v) for k, v in (o.get("data") or {}).items()}

    def put_secret(self, name: str, data: Mapping[str, str]) -> dict:
        """Create or overwrite a Secret as an operator would (values are plain strings)."""
        return self._call(f"/_test/secrets/{name}", method="PUT", body=dict(data))

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the server (it dumps objects and the request log to <dir>/state.json) and wait."""
        return stop_process(self.proc, timeout)


def pod_argv(argv: Sequence[str], sa_dir: str, keep: Sequence[str]) -> list[str]:
    """``pod_mount_namespace_argv`` plus a fresh tmpfs on /tmp, as a container's own /tmp.

    Without TS_STATE_DIR both agents start tailscaled with ``--statedir=/tmp``, where it writes
    derpmap.cached.json, files/ and profile-data/ (a netmap cache): on the host's /tmp that would leak onto the
    machine and be shared between runs (a restart would find the previous run's cache, which a restarted
    container never does). The paths in ``keep`` that lie under /tmp (the lab's run dir with sockets and logs,
    and the checkout with its venv when it was cloned under /tmp) stay visible at their paths."""
    import shlex
    tmp_paths = [os.path.abspath(k) for k in keep if os.path.abspath(k).startswith("/tmp/")]
    steps = ["set -e"]
    for i, k in enumerate(tmp_paths):
        steps.append(f"mkdir -p /run/.keep{i}; mount --bind {shlex.quote(k)} /run/.keep{i}")
    steps.append("mount -t tmpfs tmpfs /tmp")
    for i, k in enumerate(tmp_paths):
        q = shlex.quote(k)
        steps.append(f"mkdir -p {q}; mount --bind /run/.keep{i} {q}; umount /run/.keep{i}; rmdir /run/.keep{i}")
    inner = "; ".join(steps) + '; exec "$@"'
    return pod_mount_namespace_argv(["sh", "-c", inner, "sh", *argv], sa_dir)


def start_pod_agent(lab: Lab, api: KubeAPI, env: Mapping[str, str], agent_cmd: Sequence[str] | None = None, *,
                    drop: Sequence[str] = ("TS_STATE_DIR",), socket_name: str | None = None,
                    ns: str = "proxy") -> AgentProcess:
    """Start the agent in ``ns`` as a Pod would run it: kube env, SA files at the absolute in-Pod path.

    ``env`` goes over the lab's defaults and the API server's variables; keys in ``drop`` are then removed
    (TS_STATE_DIR by default; add TS_AUTHKEY for a key that only comes from the Secret). Each start gets its
    own directory (logs) and, unless ``socket_name`` is given, its own socket path."""
    if agent_cmd is None:
        agent_cmd = [sys.executable, "-m", "containerboot"]
    lab._agent_seq += 1
    seq = lab._agent_seq
    d = lab.run_dir / ns / f"agent-{seq}"
    (d / "logs").mkdir(parents=True, exist_ok=True)
    sock = str(lab.run_dir / ns / (socket_name or f"tailscaled-{seq}.sock"))
    e = lab.agent_env({**api.env(), "TS_SOCKET": sock, **env}, dir=d)
    for k in drop:
        e.pop(k, None)
    if os.path.exists(sock):
        os.unlink(sock)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    venv = os.path.dirname(os.path.dirname(sys.executable))
    argv = pod_argv(list(agent_cmd), str(api.dir), keep=(str(lab.run_dir), repo, venv))
    log = d / "agent.log"
    started = time.monotonic()
    p = lab._popen("agent", f"agent-{seq}", ns, argv, e, log)
    a = AgentProcess(lab, p, log, sock, e.get("TS_STATE_DIR", ""), e, argv, d, started)
    lab.agents.append(a)
    lab._sockets[ns] = sock
    lab._sockets[a.hostname] = sock
    return a


def hs_nodes_named(lab: Lab, hostname: str) -> list[dict]:
    return [n for n in lab.hs_nodes() if n.get("name") == hostname or n.get("given_name") == hostname]


class PodAgents:
    """The test API servers and Pod agents one test starts (a context manager): before it, headscale has no
    node `proxy` left from an earlier test; after it, the agents are stopped, the proxy namespace is emptied
    and the API servers are stopped, whatever the test did. `tag` prefixes the API servers' names."""

    def __init__(self, lab: Lab, tag: str = "") -> None:
        self.lab, self.tag = lab, tag
        self.apis: list[KubeAPI] = []
        self.agents: list[AgentProcess] = []

    def __enter__(self) -> "PodAgents":
        if hs_nodes_named(self.lab, "proxy"):
            self.lab.delete_node("proxy")
        return self

    def api(self, name: str, **kw: Any) -> KubeAPI:
        a = KubeAPI.start(self.lab, f"{self.tag}-{name}" if self.tag else name, **kw)
        self.apis.append(a)
        return a

    def agent(self, api: KubeAPI, env: Mapping[str, str], agent_cmd: Sequence[str] | None = None,
              **kw: Any) -> AgentProcess:
        a = start_pod_agent(self.lab, api, env, agent_cmd, **kw)
        self.agents.append(a)
        return a

    def __exit__(self, *exc: object) -> None:
        problems = self.lab.reset_proxy(self.agents, ["proxy"])
        for a in self.apis:
            a.stop()
        if problems:
            print(f"{self.tag or 'PodAgents'} teardown:", "; ".join(problems))
