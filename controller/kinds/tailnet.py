"""The tailnet target of an egress Service (pure), read the same way whether one proxy per Service serves it
(`kinds.service`) or a ProxyGroup does (`kinds.egress`): the `tailscale.com/tailnet-ip` annotation (or its
older spelling) or `tailscale.com/tailnet-fqdn`, exactly one of them, each checked.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..model import ANN_TAILNET_FQDN, ANN_TAILNET_IP, ANN_TAILNET_IP_OLD
from ..validation import ip_problem, magicdns_problem


def target_of(ann: Mapping[str, str]) -> tuple[str, str]:
    """(tailnet IP, tailnet FQDN) from a Service's annotations, each "" when unset."""
    ip = (ann.get(ANN_TAILNET_IP) or ann.get(ANN_TAILNET_IP_OLD) or "").strip()
    return ip, ann.get(ANN_TAILNET_FQDN, "").strip()


def is_egress(ann: Mapping[str, str]) -> bool:
    """Whether the annotations name a tailnet target at all (valid or not)."""
    return any(target_of(ann))


def target_problems(ip: str, fqdn: str, magicdns_suffix: str) -> list[str]:
    """Every problem with the target annotations, each naming the annotation and the fix; [] when valid."""
    problems: list[str] = []
    if ip and fqdn:
        problems.append(f"both {ANN_TAILNET_IP} and {ANN_TAILNET_FQDN} are set; a Service egresses to one "
                        "tailnet target, keep one of the two annotations")
    if ip and (p := ip_problem(ip)):
        problems.append(f"annotation {ANN_TAILNET_IP}: {p}")
    if fqdn and (p := magicdns_problem(fqdn, magicdns_suffix)):
        problems.append(f"annotation {ANN_TAILNET_FQDN}: {p}")
    return problems
