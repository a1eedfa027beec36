"""What kernel networking needs from the container, checked before anything starts.

Kernel mode (TS_USERSPACE=false) needs the NET_ADMIN capability (tailscaled configures tailscale0, the agent
programs the firewall) and the TUN device /dev/net/tun. Without them tailscaled or the firewall fails later
with an errno deep in a stack; checked here first, the agent exits 1 with one line naming what is missing
and how to grant it. Userspace networking needs neither, so nothing is checked then.

The capability set is read from `<root>/proc/self/status`, so a test points TS_TEST_ONLY_ROOT at a directory
holding its own `proc/self/status` and never depends on (or touches) the real process's privileges.
"""
from __future__ import annotations

import os

CAP_NET_ADMIN = 12


def effective_caps(root: str = "/") -> int | None:
    """The effective capability mask of this process (from proc/self/status under `root`); None if unknown."""
    try:
        with open(os.path.join(root, "proc/self/status")) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def missing_net_admin(root: str = "/") -> str | None:
    """A message if the process lacks CAP_NET_ADMIN, else None (also when the mask cannot be read)."""
    caps = effective_caps(root)
    if caps is None or caps & (1 << CAP_NET_ADMIN):
        return None
    return ("kernel networking (TS_USERSPACE=false) needs the NET_ADMIN capability, and this container does "
            "not have it: add it (Kubernetes: securityContext.capabilities.add: [\"NET_ADMIN\"]; podman or "
            "docker: --cap-add NET_ADMIN), or set TS_USERSPACE=true")


def tun_hint(err: OSError) -> str:
    """The message for a /dev/net/tun that is missing and could not be created (mknod failed)."""
    return (f"unable to create tuntap device file: {err}. Kernel networking (TS_USERSPACE=false) needs the TUN "
            "device /dev/net/tun: give the container the device (podman or docker: --device /dev/net/tun; "
            "Kubernetes: the default device rules of containerd and CRI-O allow creating it, a restricted "
            "runtime needs a device plugin or privileged: true), or set TS_USERSPACE=true")
