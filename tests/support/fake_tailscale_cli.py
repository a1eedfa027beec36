#!/usr/bin/env python3
"""A stand-in for the `tailscale` CLI in unit tests: records its argv, and `up` logs the fake backend in.

Like the real CLI, a credential flag's `file:<path>` value is read from that file: `tailscale.argv` records the
flags as the CLI understood them (values read), `tailscale.rawargv` the command line as given.
FAKE_TS_UP_FAIL=1 makes `up` fail; FAKE_TS_UP_HANG=1 makes it hang (to test the boot timeout). Like the real
`up`, it exits only once the backend is Running. FAKE_TS_UP_EXIT_GATE=<path>: once Running, `up` writes
<path>.running and exits only when <path> exists (the test decides when the CLI's exit lands).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

_FILE_FLAGS = ("--authkey=", "--auth-key=", "--client-secret=", "--id-token=")


def _resolved(arg: str) -> str:
    flag, _, value = arg.partition("=")
    if arg.startswith(_FILE_FLAGS) and value.startswith("file:"):
        with open(value[len("file:"):]) as f:
            return f"{flag}={f.read().strip()}"
    return arg


def main() -> int:
    raw = sys.argv[1:]
    args = [_resolved(a) for a in raw]
    for name, recorded in (("tailscale.argv", args), ("tailscale.rawargv", raw)):
        with open(os.path.join(os.environ["FAKE_TS_DIR"], name), "a") as f:
            f.write(json.dumps(recorded) + "\n")
    sock = next((a.split("=", 1)[1] for a in args if a.startswith("--socket=")), "/tmp/tailscaled.sock")
    verb = next((a for a in args if not a.startswith("-")), "")
    if verb == "up":
        if os.environ.get("FAKE_TS_UP_FAIL"):
            print("backend error: invalid key", file=sys.stderr)
            return 1
        if os.environ.get("FAKE_TS_UP_HANG"):
            time.sleep(3600)   # not a wait: FAKE_TS_UP_HANG, an `up` that never returns
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sock)
            s.sendall(b"POST /localapi/v0/fake/login HTTP/1.1\r\nHost: local-tailscaled.sock\r\n"
                      b"Content-Length: 0\r\nConnection: close\r\n\r\n")
            s.recv(4096)
        # Like the real `tailscale up`: exit only once the backend is Running.
        while _backend_state(sock) != "Running":
            time.sleep(0.02)   # poll: like the real CLI, until the backend is Running
        if (gate := os.environ.get("FAKE_TS_UP_EXIT_GATE")):
            open(gate + ".running", "w").close()
            while not os.path.exists(gate):
                time.sleep(0.02)   # poll: until the test opens the gate
    return 0


def _backend_state(sock: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sock)
        s.sendall(b"GET /localapi/v0/status HTTP/1.1\r\nHost: local-tailscaled.sock\r\nConnection: close\r\n\r\n")
        data = b""
        while (chunk := s.recv(65536)):
            data += chunk
    return json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}").get("BackendState", "")


if __name__ == "__main__":
    sys.exit(main())
