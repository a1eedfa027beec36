"""kubectl from a tailnet node through the API server proxy (helpers of the real-cluster module's test).

A `TailnetKubectl` runs the cluster's own kubectl binary inside a lab node's network namespace (not a Pod),
with a kubeconfig whose server is the proxy's tailnet address; background commands (watch, logs -f,
port-forward) are read line by line by a thread so the test can wait for a line without blocking.
"""
from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

from labtools.lab import wait_until


class Background:
    """A kubectl running in the background; its stdout+stderr lines as they come."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     stdin=subprocess.DEVNULL)
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

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class TailnetKubectl:
    def __init__(self, lab, ns: str, kubectl: Path, server: str, workdir: Path, token: str = "") -> None:
        self.lab, self.ns, self.kubectl = lab, ns, str(kubectl)
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / f"kubeconfig-{ns}-{'token' if token else 'none'}"
        user: dict = {"token": token} if token else {}
        self.config.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "tailnet",
            "clusters": [{"name": "tailnet", "cluster": {"server": server}}],
            "users": [{"name": "tailnet", "user": user}],
            "contexts": [{"name": "tailnet", "context": {"cluster": "tailnet", "user": "tailnet"}}]}))

    def argv(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.lab.netns(self.ns), self.kubectl, f"--kubeconfig={self.config}",
                "--request-timeout=30s", *args]

    def run(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def run_tty(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """With a pseudo-terminal (util-linux `script`), as an interactive `kubectl exec -it` has."""
        import shlex
        return subprocess.run(["script", "-qec", shlex.join(self.argv(*args)), "/dev/null"], capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def background(self, *args: str) -> Background:
        return Background(self.argv(*args))
