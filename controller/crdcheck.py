"""The project's CRDs, checked before the controller starts and watched for their removal while it runs (shell).

kopf's scanning of CRDs is off in both operators (`controller.handlers.settings`): kopf resolves the kinds it
serves once, by API discovery, when it starts, and never lists or watches the CRDs (a restart lists each kind once;
the ServiceMonitor CRD alone is watched, by name). A CRD installed after the controller started is then not served
until the controller restarts, so the controller first asks the API server (discovery of each group version: one
GET, no list) whether every CRD it serves is installed, waits up to `CRD_WAIT` for one that is not yet served
(helm applies the CRDs before the Deployment, and a new CRD takes a moment to be served), and otherwise exits
non-zero naming the missing CRDs and how to install them. Upstream's operator does the same in effect:
controller-runtime retries a kind it cannot resolve every 10 s and fails to start after its cache sync timeout
(2 minutes), and the operator exits.

A CRD removed while the controller runs: the API server deletes its objects first (their watch brings the
deletions, so the passes clean up), then the kind's watch ends and kopf's next listing is answered 404, which ends
that watch for good. `stop_on_removal` turns that 404 into a stop of the controller with an error naming the CRD:
it exits non-zero, and its restart either serves the CRD again (re-installed) or says what is missing, instead of
running on with a kind it no longer watches.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, cast

from .kubeapi import KubeError
from .resources import Resource

log = logging.getLogger("controller")

#: the API group of the project's CRDs (deploy/crds/, the chart's templates/crds/)
GROUP = "tailscale.com"
#: how long the start waits for a CRD that is not served yet before giving up (seconds; upstream's
#: controller-runtime waits 2 minutes for a kind's cache to sync)
CRD_WAIT = 120.0
#: how often the start asks again meanwhile (seconds)
CRD_POLL = 5.0

#: what a user does about a missing CRD (docs/install-headscale.md)
FIX = ("install the chart with installCRDs=true (its default), or apply the CRDs yourself: "
       "kubectl apply --server-side -f deploy/crds/")


class CRDsMissing(Exception):
    """A CRD the controller serves is not installed: the controller cannot start (or go on)."""


def crd_name(res: Resource) -> str:
    """The CRD's name, as `kubectl get crd` shows it: proxyclasses.tailscale.com."""
    return f"{res.plural}.{res.group}"


def missing(kinds: Iterable[Resource], served: Mapping[str, frozenset[str] | None]) -> list[str]:
    """The CRDs of `kinds` that discovery does not list (`served`: group version prefix -> the plurals it serves,
    None when the group version itself is not served), sorted."""
    return sorted(crd_name(r) for r in kinds if r.plural not in (served.get(r.prefix) or frozenset()))


def missing_message(names: list[str], waited: float) -> str:
    them = "CRD " + names[0] if len(names) == 1 else "CRDs " + ", ".join(names)
    verb = "is" if len(names) == 1 else "are"
    return (f"the {them} {verb} not installed (not served by the API server after {waited:.0f}s): {FIX}; "
            "the controller serves these kinds and starts once they are installed")


Discover = Callable[[str], Awaitable[frozenset[str] | None]]


async def wait_installed(kinds: Iterable[Resource], discover: Discover, *, wait: float = CRD_WAIT,
                         poll: float = CRD_POLL, clock: Callable[[], float] = time.monotonic,
                         sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
    """Return once every CRD of `kinds` is served; raise `CRDsMissing` if one still is not after `wait`. A
    discovery request that fails (the API server not answering) is asked again and does not count as an answer:
    the wait runs from the first answer that a CRD is missing."""
    kinds = tuple(kinds)
    prefixes = sorted({r.prefix for r in kinds})
    since: float | None = None
    said = ""
    while True:
        served: dict[str, frozenset[str] | None] = {}
        failed = ""
        pause = poll
        for p in prefixes:
            try:
                served[p] = await discover(p)
            except KubeError as e:      # asked again (not an answer)
                failed = str(e)
                # a 429's or 503's Retry-After is waited for
                pause = max(pause, e.retry_after or 0.0)
        gone = [] if failed else missing(kinds, served)
        if not failed and not gone:
            if since is not None or said:
                log.info("controller: every CRD it serves is installed")
            return
        if failed:
            if failed != said:          # each failure once, not at every attempt
                said = failed
                log.warning("controller: cannot ask the API server which CRDs are installed (%s); asking again "
                            "every %.0fs", failed, poll)
        else:
            now = clock()
            if since is None:
                since = now
                log.warning("controller: not served yet: %s; waiting up to %.0fs for %s", ", ".join(gone), wait,
                            "it" if len(gone) == 1 else "them")
            elif now - since >= wait:
                raise CRDsMissing(missing_message(gone, now - since))
        await sleep(pause)


_stop: Callable[[str], None] | None = None
_kinds: set[tuple[str, str]] = set()


def stop_on_removal(kinds: Iterable[Resource], stop: Callable[[str], None]) -> None:
    """A watch of one of `kinds` answered 404 (its CRD removed) stops the controller through `stop(message)`
    (kopf's watch function is wrapped once, for the process; wrapping on top of `controller.relist`'s)."""
    global _stop
    from kopf._cogs.clients import watching
    _stop = stop
    _kinds.update((r.group, r.plural) for r in kinds)
    current = watching.continuous_watch
    if getattr(current, "_crdcheck", False):
        return

    async def continuous_watch(*, resource: Any, **kwargs: Any) -> AsyncIterator[Any]:
        from kopf._cogs.clients import errors
        stream = cast(AsyncGenerator[Any, None], current(resource=resource, **kwargs))
        async with contextlib.aclosing(stream):
            try:
                async for event in stream:
                    yield event
            except errors.APINotFoundError:
                if (resource.group, resource.plural) not in _kinds or _stop is None:
                    raise
                name = f"{resource.plural}.{resource.group}"
                _stop(f"the CRD {name} was removed while the controller ran (its watch is answered 404); "
                      f"stopping: {FIX}")
                await asyncio.Event().wait()       # the stop cancels this watch with every other
    continuous_watch._crdcheck = True     # type: ignore[attr-defined]
    watching.continuous_watch = continuous_watch     # type: ignore[assignment]  # looked up by infinite_watch
