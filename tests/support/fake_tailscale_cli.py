#!/usr/bin/env python3
"""A stand-in for the `tailscale` CLI in unit tests: records its argv, and `up` logs the fake backend in.

FAKE_TS_UP_FAIL=1 makes `up` fail; FAKE_TS_UP_HANG=1 makes it hang (to test the boot timeout).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time


def main() -> int:
    args = sys.argv[1:]
    with open(os.path.join(os.environ["FAKE_TS_DIR"], "tailscale.argv"), "a") as f:
        f.write(json.dumps(args) + "\n")
    sock = next((a.split("=", 1)[1] for a in args if a.startswith("--socket=")), "/tmp/tailscaled.sock")
    verb = next((a for a in args if not a.startswith("-")), "")
    if verb == "up":
        if os.environ.get("FAKE_TS_UP_FAIL"):
            print("backend error: invalid key", file=sys.stderr)
            return 1
        if os.environ.get("FAKE_TS_UP_HANG"):
            time.sleep(3600)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sock)
            s.sendall(b"POST /localapi/v0/fake/login HTTP/1.1\r\nHost: local-tailscaled.sock\r\n"
                      b"Content-Length: 0\r\nConnection: close\r\n\r\n")
            s.recv(4096)
    return 0


if __name__ == "__main__":
    sys.exit(main())
