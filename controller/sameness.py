"""Whether an object read back from the API server already says what the controller wants (shared by the
parents' reconciler and the ProxyGroups', so neither imports the other for it)."""
from __future__ import annotations

from typing import Any


def same(cur: Any, want: Any) -> bool:
    """`cur` (from the API server) says what `want` says; fields the server added by default (e.g. a
    LoadBalancer ingress's `ipMode: VIP`) do not count, or every pass would write the status again."""
    if isinstance(want, dict):
        return isinstance(cur, dict) and all(same(cur.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(cur, list) and len(cur) == len(want) and \
            all(same(c, w) for c, w in zip(cur, want, strict=True))
    return cur == want
