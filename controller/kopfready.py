"""kopf runs each listed object's handlers as soon as the object is indexed, instead of holding every listed object
until all the operator's indexes are filled (shell, around kopf's watcher).

kopf runs no handler of an operator until every index of it holds its first listings: each listed object's worker
indexes the object, drops its own toggle from the operator's `ToggleSet`, and waits there, holding the object, its
kopf wrappers and its task, until no toggle is left; and kopf's set wakes every waiter at each drop, each taking
the set's lock in turn to find it still not done (N²/2 wake-ups for N objects). A controller restarted with
1,500 Services (about 10,000 objects) spent over three minutes of CPU in those wake-ups and held every listed
object meanwhile (docs/benchmarks.md). Here kopf's watchers run without that wait (`operator_indexed` is not
handed to them): each object's handlers run once it is indexed and its worker ends. That is safe because the
handlers only queue a parent's pass, and a pass waits until the watch cache is complete (`WatchCache.wait_synced`),
which the cache now learns by counting (`WatchCache.count_listings`): each object of a kind's first listing as
the stream yields it (`controller.relist`'s wrapper), each object kopf indexes (the index handler), and the end
of each listing.
"""
from __future__ import annotations

from typing import Any

from kopf._core.reactor import queueing

_original = queueing.watcher


async def watcher(*, operator_indexed: Any = None, resource_indexed: Any = None, **kwargs: Any) -> None:
    """kopf's watcher without the per-object wait for the operator's indexes. The kind's own toggle is dropped
    at once (kopf drops it when the kind's listing ends), so nothing of kopf waits on the set."""
    if operator_indexed is not None and resource_indexed is not None:
        await operator_indexed.drop_toggle(resource_indexed)
    await _original(**kwargs)


def install() -> None:
    """Replace kopf's watcher, once for the process (looked up by kopf's orchestrator at each watch's start)."""
    queueing.watcher = watcher        # type: ignore[assignment]
