"""Kernel knobs the proxy needs: IP forwarding, and UDP GRO forwarding on the uplink.

`ensure_forwarding` follows upstream exactly (spec 5.1): read first and write "1" only when needed, so a
read-only /proc/sys that is already configured (the operator's privileged `sysctler` initContainer) works.
"""
from __future__ import annotations

import os

V4_PATH = "proc/sys/net/ipv4/ip_forward"
V6_PATH = "proc/sys/net/ipv6/conf/all/forwarding"


class ForwardingError(Exception):
    """IP forwarding is off and cannot be turned on; str(e) explains why it is needed and how to fix it."""


def _sysctl_name(rel: str) -> str:
    """proc/sys/net/ipv4/ip_forward -> net.ipv4.ip_forward"""
    return rel.removeprefix("proc/sys/").replace("/", ".")


def _fix_hint(sysctl: str, in_kubernetes: bool) -> str:
    # Both ways to set a namespaced sysctl from outside an unprivileged container; a read-only /proc/sys is
    # the normal state of such a container, so the fix is never "make /proc/sys writable".
    init = (f"a privileged initContainer that runs `sysctl -w {sysctl}=1` (as the Tailscale operator renders "
            f"its proxy Pods)")
    if in_kubernetes:
        return (f"set {sysctl}=1 for the Pod with {init}, or in the Pod's securityContext.sysctls (the kubelet "
                f"must allow it with --allowed-unsafe-sysctls), or run the tailscale container with "
                f"privileged=true.")
    return (f"set {sysctl}=1 for the container's network namespace with {init}, or with your container "
            f"runtime's sysctl option (podman or docker: --sysctl {sysctl}=1), or run the container with "
            f"privileged=true.")


def _ensure_one(path: str) -> None:
    with open(path) as f:
        if f.read().strip() == "1":
            return
    with open(path, "w") as f:
        f.write("1")


def ensure_forwarding(v4: bool, v6: bool, *, root: str = "/", in_kubernetes: bool | None = None) -> None:
    """Make sure IPv4 and/or IPv6 forwarding is on; raise ForwardingError with upstream's explanation if not."""
    if in_kubernetes is None:
        in_kubernetes = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    wanted = ([V4_PATH] if v4 else []) + ([V6_PATH] if v6 else [])
    for rel in wanted:
        path = os.path.join(root, rel)
        try:
            _ensure_one(path)
        except OSError as e:
            name = _sysctl_name(rel)
            raise ForwardingError(
                f"Failed to enable IP forwarding: {name} is off and {path} cannot be written "
                f"({e.strerror or e}). To run tailscale as a proxy or router container, IP forwarding must be "
                f"enabled; {_fix_hint(name, in_kubernetes)}") from e


def forwarding_enabled(version: int, *, root: str = "/") -> bool:
    path = os.path.join(root, V4_PATH if version == 4 else V6_PATH)
    try:
        with open(path) as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def enable_udp_gro_forwarding(tun: str = "tailscale0", uplink: str | None = None) -> None:
    """`ethtool -K <uplink> rx-udp-gro-forwarding on rx-gro-list off`, if the tun can segment UDP.

    The agent normally asks tailscaled to do this (LocalAPI `set-udp-gro-forwarding`, as upstream does, because
    tailscaled knows its tun); this in-process equivalent (pyroute2's ethtool ioctls) exists for setups where
    the LocalAPI endpoint is unavailable. Raises RuntimeError with the reason when it cannot be done.
    """
    from pyroute2.ethtool import Ethtool

    from .routing import default_interface

    if uplink is None:
        uplink = default_interface()
        if uplink is None:
            raise RuntimeError("no default route, so no uplink interface to tune")
    eth = Ethtool()
    try:
        tun_features = eth.get_features(tun).features
        seg = tun_features.get("tx-udp-segmentation")
        if seg is None or not seg.enable:
            raise RuntimeError(f"{tun}: tx-udp-segmentation is off, UDP GRO forwarding would not help")
        feats = eth.get_features(uplink)
        gro = feats.features.get("rx-udp-gro-forwarding")
        if gro is None:
            raise RuntimeError(f"{uplink}: the kernel/driver has no rx-udp-gro-forwarding feature")
        gro.enable = True
        if "rx-gro-list" in feats.features:
            feats.features["rx-gro-list"].enable = False
        eth.set_features(uplink, feats)
    finally:
        eth.close()
