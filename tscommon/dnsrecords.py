"""The records file between the controller and the nameserver (upstream's ``records.json`` in the ``dnsrecords``
ConfigMap): its names and how it is written. Below both, without dependencies: the controller writes it, the
``nameserver`` package reads it (``nameserver.records``)."""
from __future__ import annotations

import json
from collections.abc import Mapping

__all__ = ["VERSION", "CONFIGMAP", "KEY", "render"]

#: The only records file version there is (upstream's ``v1alpha1``).
VERSION = "v1alpha1"
CONFIGMAP = "dnsrecords"
KEY = "records.json"


def render(ip4: Mapping[str, list[str]], ip6: Mapping[str, list[str]]) -> str:
    """The records file for these maps of name -> addresses: names without the trailing dot, lower-case; sorted
    keys and addresses, so the same records always give the same text (a pass that changes nothing writes
    nothing)."""
    def norm(m: Mapping[str, list[str]]) -> dict[str, list[str]]:
        # Names that differ only in case or a trailing dot are one name: their addresses are merged, not lost.
        out: dict[str, set[str]] = {}
        for k, v in m.items():
            out.setdefault(k.rstrip(".").lower(), set()).update(v)
        return {k: sorted(v) for k, v in sorted(out.items()) if v}
    return json.dumps({"version": VERSION, "ip4": norm(ip4), "ip6": norm(ip6)}, sort_keys=True, indent=2) + "\n"
