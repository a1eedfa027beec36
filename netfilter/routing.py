"""Small pyroute2 helpers: interface addresses and the default-route interface."""
from __future__ import annotations

import ipaddress
import socket
from typing import Union

IPInterface = Union[ipaddress.IPv4Interface, ipaddress.IPv6Interface]


def addresses(ifname: str | None = None) -> tuple[IPInterface, ...]:
    """Addresses (with prefix length) on `ifname`, or on every interface; IPv4 first, stable order."""
    from pyroute2 import IPRoute

    out: list[IPInterface] = []
    with IPRoute() as ipr:
        kwargs = {}
        if ifname is not None:
            idx = ipr.link_lookup(ifname=ifname)
            if not idx:
                raise LookupError(f"no interface named {ifname!r}")
            kwargs["index"] = idx[0]
        for msg in ipr.get_addr(**kwargs):
            addr = msg.get_attr("IFA_ADDRESS")
            if msg["family"] == socket.AF_INET and msg.get_attr("IFA_LOCAL"):
                addr = msg.get_attr("IFA_LOCAL")
            if addr:
                out.append(ipaddress.ip_interface(f"{addr}/{msg['prefixlen']}"))
    return tuple(sorted(out, key=lambda i: (i.version, int(i.ip), i.network.prefixlen)))


def default_interface() -> str | None:
    """Name of the interface of the IPv4 default route (else the IPv6 one), or None."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        for family in (socket.AF_INET, socket.AF_INET6):
            routes = [r for r in ipr.get_routes(family=family, table=254) if r["dst_len"] == 0
                      and r.get_attr("RTA_DST") is None and r.get_attr("RTA_OIF") is not None]
            routes.sort(key=lambda r: r.get_attr("RTA_PRIORITY") or 0)
            for r in routes:
                links = ipr.get_links(r.get_attr("RTA_OIF"))
                if links:
                    return links[0].get_attr("IFLA_IFNAME")
    return None
