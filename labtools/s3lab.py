"""An S3-compatible server for the lab (gofakes3, tests/support/s3server, built from the Go module cache into
~/.cache/containerboot-py/bin/s3server-<digest>): buckets made on first use, kept in memory.

`LabS3` runs it in a lab namespace on the island (by default headscale's, which the cluster's Pods already
reach), so a Recorder with `storage.s3` in the lab's cluster stores into it; the test reads the bucket back from
inside that namespace (the host has no route to the island).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from labtools.gobuild import GoUnavailable, build_cached
from labtools.lab import stop_process, wait_until

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "tests" / "support" / "s3server"
#: gofakes3 checks no signature: any key pair is accepted (the recorder signs its requests all the same)
ACCESS_KEY, SECRET_KEY = "lab-access-key", "lab-secret-key"


#: the server cannot be built here (no Go, or gofakes3's modules are not in the module cache)
S3BuildError = GoUnavailable


def ensure_binary() -> Path:
    """The server's binary, built once per source version into the shared cache (offline)."""
    return build_cached(SRC, "s3server")


_READ = """
import json, sys
from recorder.s3 import Bucket, Credentials
b = Bucket(sys.argv[1], sys.argv[2], Credentials(sys.argv[3], sys.argv[4]))
print(json.dumps({k: (b.get(k) or b"").decode("utf-8", "replace") for k, _ in b.keys()}))
"""


class LabS3:
    """gofakes3 in lab namespace `ns`, on its IPv4 address and `port`: `endpoint` is its URL (plain HTTP)."""

    def __init__(self, lab, ns: str = "hs", port: int = 19000) -> None:
        self.lab, self.ns = lab, ns
        binary = ensure_binary()
        ip = lab.namespaces[ns].ipv4
        self.endpoint = f"http://{ip}:{port}"
        self.log_path = lab.run_dir / "s3server.log"
        self.proc = lab._popen("s3", "s3server", ns, [str(binary), f"{ip}:{port}"], {}, self.log_path)
        wait_until(lambda: self.proc.poll() is not None or self._answers(), 30, 0.2, "the S3 server answering")
        if self.proc.poll() is not None:
            raise RuntimeError(f"the S3 server exited: {self.log_path.read_text(errors='replace')[-1000:]}")

    def _answers(self) -> bool:
        cp = subprocess.run(["ip", "netns", "exec", self.lab.netns(self.ns), sys.executable, "-c",
                             "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)",
                             *self.endpoint.removeprefix("http://").split(":")], capture_output=True, timeout=20)
        return cp.returncode == 0

    def objects(self, bucket: str) -> dict[str, str]:
        """Every object of `bucket`: key to text (read in the server's namespace with the recorder's client)."""
        cp = subprocess.run(["ip", "netns", "exec", self.lab.netns(self.ns), "env", f"PYTHONPATH={REPO}",
                             sys.executable, "-c", _READ, self.endpoint, bucket, ACCESS_KEY, SECRET_KEY],
                            capture_output=True, text=True, timeout=60)
        if cp.returncode != 0:
            raise RuntimeError(f"reading bucket {bucket!r}: {cp.stderr[-1000:]}")
        return json.loads(cp.stdout)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
