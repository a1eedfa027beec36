"""No credential in the process table of anything the agent starts, with a real tailscaled, `tailscale up` and
headscale: while the agent boots, every process it starts (tailscaled, each CLI run) has its /proc/<pid>/environ
and /proc/<pid>/cmdline read as soon as it appears; the auth key is in none of them, and the node still logs in
with it (so the key did reach the CLI, as a file:).
"""
from __future__ import annotations

import os
import threading
import time

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.e2e]


def _children_of(pid: int) -> list[int]:
    """Every descendant of pid (one /proc scan)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                parents[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


class ProcessWatch:
    """Reads cmdline, then environ, of each descendant of `pid` every few milliseconds until stopped; keeps every
    distinct (cmdline, environ) pair seen. A child read between its fork and its exec shows the parent's command
    line and environment block; once its command line is its own, so is its environment (exec is one-way)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, set[tuple[bytes, bytes]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for child in _children_of(self.pid):
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as f:
                        cmdline = f.read()
                    with open(f"/proc/{child}/environ", "rb") as f:
                        environ = f.read()
                except OSError:
                    continue
                self.seen.setdefault(child, set()).add((cmdline, environ))
            time.sleep(0.005)   # not a wait: samples the children's command lines and environments

    def stop(self) -> dict[int, set[tuple[bytes, bytes]]]:
        self._stop.set()
        self._thread.join(5)
        return self.seen


def test_no_key_in_environ_or_cmdline_of_any_child(lab, start_agent) -> None:
    key = lab.authkey
    agent = start_agent({"TS_AUTH_ONCE": "false"})
    watch = ProcessWatch(agent.proc.pid)
    try:
        agent.wait_running(60)
        agent.wait_for_log("Startup complete", 60)
        with open(f"/proc/{agent.proc.pid}/environ", "rb") as f:
            own = f.read()
    finally:
        seen = watch.stop()
    assert key.encode() not in own and b"TS_AUTHKEY=\0" in own, "the agent's own environment keeps the key"
    with open(f"/proc/{agent.proc.pid}/cmdline", "rb") as f:
        agent_cmdline = f.read()
    samples = [(pid, cmd, env) for pid, pairs in seen.items() for cmd, env in pairs]
    names = {os.path.basename(cmd.split(b"\0", 1)[0]).decode() for _, cmd, _ in samples}
    assert {"tailscaled", "tailscale"} <= names, f"the watch missed a process: {sorted(names)}"
    for pid, cmdline, environ in samples:
        shown = cmdline.replace(b"\0", b" ").decode(errors="replace")
        assert key.encode() not in cmdline, f"auth key on the command line of {pid}: {shown}"
        assert key.encode() not in environ, f"auth key in the environment of {pid}: {shown}"
        if cmdline != agent_cmdline:   # after its exec: not even the name (before it, the agent's blanked block)
            assert b"TS_AUTHKEY=" not in environ, f"TS_AUTHKEY in the environment of {pid}: {shown}"
    up = [cmd for _, cmd, _ in samples if b"\0up\0" in cmd]
    assert up and all(b"--authkey=file:" in cmd for cmd in up), up
    # The key file is gone once `tailscale up` has exited.
    path = up[0].split(b"--authkey=file:", 1)[1].split(b"\0", 1)[0].decode()
    assert not os.path.exists(path)
    assert key not in agent.log_text()
