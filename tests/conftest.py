"""Shared fixtures of the unit tests: the agent as a real process against fake tailscaled/tailscale binaries."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
FAKE_BIN = HERE / "support" / "bin"


class AgentRun:
    def __init__(self, tmp: Path, env: dict[str, str]):
        self.tmp = tmp
        self.log_path = tmp / "agent.log"
        full = {"PATH": f"{FAKE_BIN}:{os.environ['PATH']}", "FAKE_TS_DIR": str(tmp),
                "TS_SOCKET": str(tmp / "tailscaled.sock"), "TS_TEST_ONLY_ROOT": str(tmp / "root"),
                "PYTHONPATH": str(HERE.parent)}
        full.update(env)
        self.proc = subprocess.Popen([sys.executable, "-m", "containerboot"], env=full,
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout: float = 15) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if text in self.log():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)   # poll: until the text is logged or the agent has exited
        raise AssertionError(f"{text!r} not logged; log:\n{self.log()}")

    def wait(self, timeout: float = 20) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait()
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # show where it is stuck (faulthandler)
            time.sleep(1)   # not a wait: time for faulthandler's dump to reach the log shown below
            raise AssertionError(f"the agent did not exit after SIGTERM; log:\n{self.log()}") from None

    def cli_calls(self) -> list[list[str]]:
        p = self.tmp / "tailscale.argv"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []

    def tailscaled_argv(self) -> list[str] | None:
        p = self.tmp / "tailscaled.argv"
        return json.loads(p.read_text()) if p.exists() else None


@pytest.fixture
def run_agent(tmp_path):
    runs: list[AgentRun] = []

    def start(**env: str) -> AgentRun:
        r = AgentRun(tmp_path, env)
        runs.append(r)
        return r

    yield start
    for r in runs:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()
    # tailscaled runs in its own process group; never leave a fake one behind, whatever the test did.
    kill_fake_tailscaleds(tmp_path)


def kill_fake_tailscaleds(tmp_path: Path) -> None:
    """SIGKILL every fake tailscaled whose socket lives in this test's directory."""
    marker = str(tmp_path).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        # The fake starts as a shell wrapper (support/bin/tailscaled) that then execs python: match both.
        if (b"fake_tailscaled" in cmd or b"support/bin/tailscaled" in cmd) and marker in cmd:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass



# The test Kubernetes API server, for every test that asks for it.
from tests.support.kubeapi import kube_api  # noqa: E402,F401
