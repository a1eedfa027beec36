"""Small Go programs of the tests (tests/support/*/main.go), built offline once per source version.

A program's directory holds its go.mod, go.sum and main.go; the binary goes into the shared cache as
`<name>-<hash of those three files>`, so a changed source builds again and an unchanged one never does. The
build is offline (`GOPROXY=off`): the Go module cache must already hold the modules, which `scripts/setup.sh`
downloads.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

CACHE = Path(os.environ.get("CB_CACHE", Path.home() / ".cache" / "containerboot-py")) / "bin"


class GoUnavailable(RuntimeError):
    """The program cannot be built here: no Go toolchain, or its modules are not in the module cache."""


def build_cached(src: Path, name: str, timeout: float = 900) -> Path:
    """The binary of the Go program in `src`, built if this source version has none in the cache yet. Raises
    GoUnavailable when it cannot be built here, RuntimeError (with the compiler's words) when it does not build."""
    if shutil.which("go") is None:
        raise GoUnavailable("no Go toolchain")
    digest = hashlib.sha256(b"".join((src / f).read_bytes() for f in ("go.mod", "go.sum", "main.go"))).hexdigest()
    out = CACHE / f"{name}-{digest[:12]}"
    if out.exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOPROXY": "off", "GOSUMDB": "off", "GOTOOLCHAIN": "local",
           "CGO_ENABLED": "0"}
    tmp = f"{out}.tmp{os.getpid()}"     # two test workers may build at once: each renames its own
    r = subprocess.run(["go", "build", "-o", tmp, "."], cwd=src, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        if "module lookup disabled" in r.stderr or "missing go.sum entry" in r.stderr:
            raise GoUnavailable(f"{name}'s modules are not in the Go module cache: {r.stderr[-300:]}")
        raise RuntimeError(f"building {name} failed: {r.stderr[-1500:]}")
    os.rename(tmp, out)
    return out
