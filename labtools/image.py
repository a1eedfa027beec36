"""The agent run from the proxy image (localhost/containerboot-py:latest, `make image`) in a lab namespace.

`podman run --network ns:/run/netns/<ns>` puts the container in the lab's namespace, so everything else in the
lab (headscale, the client, the backend, the tailscale CLI on the agent's socket) works as with the agent
run directly. The agent's directory (state, logs, socket) is bind-mounted at the same path, so the paths in
its environment mean the same inside and out. The root file system is read-only, as in a hardened Pod.

Host facts (the OCI runtime, the `--ulimit` values `podman run` needs) come from images/common.sh, the same
detection `make image` uses.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterable, Mapping

DEFAULT_IMAGE = "localhost/containerboot-py:latest"      # what `make image` builds and the manifests name
#: The lab's proxy image. Image names and their archives are one per machine, shared by every checkout on it:
#: LAB_PROXY_IMAGE (e.g. localhost/containerboot-py:<branch>) builds, imports and runs a checkout's own.
IMAGE = os.environ.get("LAB_PROXY_IMAGE") or DEFAULT_IMAGE
REPO = Path(__file__).resolve().parent.parent
# What the operator's privileged sysctler initContainer sets before the proxy starts; with podman the same is
# `--sysctl`. The container's /proc/sys is read-only, so the agent only reads these.
FORWARDING_SYSCTLS = ("net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1")


def unavailable(image: str = IMAGE) -> str | None:
    """Why the image cannot be run here, or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (bash scripts/setup.sh --image installs it; make image builds the image)"
    if subprocess.run(["podman", "image", "exists", image], capture_output=True, timeout=60).returncode != 0:
        return f"the image {image} is not built (make image)"
    return None


@functools.cache
def host_args() -> tuple[list[str], list[str]]:
    """(podman's global runtime flags, `podman run` ulimit flags) for this host, from images/common.sh."""
    out = subprocess.run(["bash", "-c", ". images/common.sh; oci_runtime; run_ulimits"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    return ["--runtime", out[0]], out[1].split()


def podman(*args: str) -> list[str]:
    """argv of `podman --runtime <detected> <args>`."""
    return ["podman", *host_args()[0], *args]


def run_argv(name: str, netns: str, env: Mapping[str, str], env_file: Path, mounts: Iterable[str], *,
             image: str = IMAGE, net_admin: bool = True, tun: bool = True,
             sysctls: Iterable[str] = FORWARDING_SYSCTLS, extra: Iterable[str] = ()) -> list[str]:
    """argv of `podman run` for the agent in container ``name``, in ``netns`` (a name under /run/netns).

    The environment goes through ``env_file`` (written here, mode 0600), not the command line, so the auth key
    is not in `ps`. PATH is left to the image."""
    env_file.parent.mkdir(parents=True, exist_ok=True)
    env_file.touch(mode=0o600)
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items() if k != "PATH"))
    argv = podman("run", "--rm", "--pull=never", "--name", name, "--network", f"ns:/run/netns/{netns}",
                  *host_args()[1], "--read-only", "--env-file", str(env_file))
    if net_admin:
        argv += ["--cap-add", "NET_ADMIN"]
    if tun:
        argv += ["--device", "/dev/net/tun"]
    for s in sysctls:
        argv += ["--sysctl", s]
    for m in dict.fromkeys(mounts):
        argv += ["-v", f"{m}:{m}"]
    # What `ip netns exec` gives a process run directly in the namespace: the namespace's own resolv.conf and
    # hosts. Without it the container gets the host's resolver, unreachable from the lab, and tailscaled's
    # captive-portal check waits out a DNS timeout (boot took 2.5 s longer).
    for f in ("resolv.conf", "hosts"):
        src = Path("/etc/netns") / netns / f
        if src.exists():
            argv += ["-v", f"{src}:/etc/{f}:ro"]
    return [*argv, *extra, image]


def stop(name: str, timeout: int = 30) -> subprocess.CompletedProcess[str]:
    """`podman stop`: SIGTERM to the container's PID 1 (the agent), SIGKILL after ``timeout`` seconds."""
    return subprocess.run(podman("stop", "-t", str(timeout), name), capture_output=True, text=True,
                          timeout=timeout + 30)
