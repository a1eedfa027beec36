"""Deletions a watch missed while it was away, handed to kopf as the deletions they are (shell, around kopf's watch).

kopf lists a kind afresh whenever its watch cannot resume (the API server answers 410 Gone once the watch's
resourceVersion is older than what it keeps: after a partition or a long disconnection of the controller). The
listing's objects reach the indexes and the handlers as new events, but an object deleted while the watch was away
is simply not in the listing, and kopf neither drops it from its indexes nor calls a handler for it: the watch cache
(`controller.watchcache`) would hold it for ever, so a StatefulSet or Secret deleted meanwhile would be believed
present and never re-created, and a parent deleted meanwhile never cleaned up after. kopf has no hook for the end
of a listing (its `Bookmark.LISTED` stays inside its watcher), so its stream function (`continuous_watch`, one call
per listing and the watch that follows it) is wrapped: for each kind the cache watches, the objects the stream has
shown are remembered (by uid, only what a handler reads of a deletion: `skeleton`), and when a listing ends, every
one it did not return is sent as a DELETED event of its last version seen, just before the end of the listing. kopf
then handles it as any deletion, in order with that object's other events: dropped from the indexes, and the event
handlers poke its parent's pass. client-go's informers do the same on a re-list. It sends no API request.

The same wrapper drops each watched object's `metadata.managedFields` and kubectl's last-applied annotation as it
passes (read by nobody; the cache leaves them out too, `controller.watchcache.slim`): they are often the largest
part of an object, and kopf holds each object from the stream until its handlers have run and its worker has idled
(`controller.handlers.WORKER_IDLE`), a listing's page at a time.
"""
from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from typing import Any, cast

import kopf
from kopf._cogs.clients import watching

from .resources import Resource

log = logging.getLogger("controller")

#: (group, plural) of the kinds whose missed deletions are sent; kopf's other streams go through untouched
_kinds: set[tuple[str, str]] = set()
#: (kopf resource, namespace) -> what that stream has shown and not seen deleted: uid -> its skeleton (JSON)
_shown: dict[tuple[Any, Any], dict[str, bytes]] = {}
#: told of the listings' objects and ends (controller.watchcache.WatchCache), or None
_listings: Any = None


#: kinds whose body no handler reads beyond the metadata (labels lead to the parent): only that is kept of them
_METADATA_ONLY = frozenset({"secrets", "statefulsets", "pods", "endpointslices", "serviceaccounts", "roles",
                            "rolebindings"})
_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def skeleton(obj: Mapping[str, Any], plural: str) -> dict:
    """What a handler reads of a deleted object, kept until the next listing: apiVersion, kind and the metadata
    (without managedFields and kubectl's last-applied annotation, often the largest parts, read by nobody), and
    for the parents' kinds and ConfigMaps also their spec or data (whether the object is ours: its class, its
    type). A Secret's data, a StatefulSet's or Pod's spec and every status are left out: the watch cache holds
    them compactly, and keeping them parsed here would hold every watched object a second time."""
    md = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    ann = md.get("annotations") or {}
    if _LAST_APPLIED in ann:
        md["annotations"] = {k: v for k, v in ann.items() if k != _LAST_APPLIED}
    keep = ("apiVersion", "kind") if plural in _METADATA_ONLY else ("apiVersion", "kind", "spec", "data", "type")
    return {**{k: obj[k] for k in keep if k in obj}, "metadata": md}


def trim(event: Mapping[str, Any]) -> None:
    """Drop the object's managedFields and kubectl's last-applied annotation, in place (the event is kopf's own,
    just parsed)."""
    md = (event.get("object") or {}).get("metadata")
    if not isinstance(md, dict):
        return
    md.pop("managedFields", None)
    ann = md.get("annotations")
    if isinstance(ann, dict):
        ann.pop(_LAST_APPLIED, None)


def source(body: Any) -> Any:
    """The event's own object under a kopf `Body` (what the stream yielded), or `body` itself."""
    return body._src if isinstance(body, kopf.Body) else body


def shrink(body: Any, plural: str) -> None:
    """Once kopf has indexed an object (the cache keeps it, compactly), reduce the event's object kopf holds to its
    `skeleton`, in place: kopf holds it until its handlers have run and its worker has idled, and the handlers
    read no more than the skeleton (`controller.handlers`). Only a kopf `Body` is changed (its source is the
    event's own dict)."""
    if not isinstance(body, kopf.Body):
        return
    raw = body._src
    if isinstance(raw, dict):
        kept = skeleton(raw, plural)
        raw.clear()
        raw.update(kept)


def note(shown: dict[str, bytes], listed: set[str], event: Mapping[str, Any], plural: str = "") -> None:
    """Keep what one raw event of the stream says about its object (type None: it came in a listing), as compact
    JSON: it is read back only for a deletion missed, and a parsed skeleton of every watched object would cost as
    much memory as the watch cache itself (5,000 Services: 35,000 objects)."""
    obj = event.get("object") or {}
    md = obj.get("metadata") or {}
    uid = md.get("uid")
    if not uid:
        return
    kind = event.get("type")
    if kind == "DELETED":
        shown.pop(uid, None)
    elif kind in (None, "ADDED", "MODIFIED"):
        shown[uid] = json.dumps(skeleton(obj, plural), separators=(",", ":")).encode()
        if kind is None:
            listed.add(uid)


def missed(shown: dict[str, bytes], listed: set[str]) -> list[dict]:
    """The DELETED events of what the stream had shown and a complete listing did not return (then forgotten)."""
    return [{"type": "DELETED", "object": json.loads(shown.pop(uid))} for uid in [u for u in shown if u not in listed]]


_original = watching.continuous_watch


async def continuous_watch(*, resource: Any, namespace: Any, **kwargs: Any) -> AsyncIterator[Any]:
    """kopf's `continuous_watch`, with the DELETED events of what its listing did not return."""
    stream = cast(AsyncGenerator[Any, None], _original(resource=resource, namespace=namespace, **kwargs))
    async with contextlib.aclosing(stream):
        if (resource.group, resource.plural) not in _kinds:
            async for event in stream:
                yield event
            return
        shown = _shown.setdefault((resource, namespace), {})
        listed: set[str] = set()     # this call's listing; a listing cut short never reaches LISTED
        async for event in stream:
            if isinstance(event, Mapping):
                trim(event)
                if _listings is not None and event.get("type") is None:
                    _listings.listed(resource.plural, event.get("object"))
            if event is watching.Bookmark.LISTED and _listings is not None:
                _listings.listing_ended(resource.plural)
            if event is watching.Bookmark.LISTED:
                gone = missed(shown, listed)
                if gone:
                    log.info("watch cache: %s listed again; %d deleted while the watch was away: %s",
                             resource.plural, len(gone),
                             ", ".join(sorted(f"{(o['object']['metadata'].get('namespace') or '')}/"
                                              f"{o['object']['metadata'].get('name') or ''}" for o in gone)[:10]))
                for d in gone:
                    yield d
            elif isinstance(event, Mapping):
                note(shown, listed, event, resource.plural)
            yield event


def install(kinds: Iterable[Resource], listings: Any = None) -> None:
    """Send the missed deletions of these kinds' watches (kopf's watch function is replaced once, for the process);
    `listings` (the watch cache) is told of each object of a listing and of its end (`WatchCache.listed`)."""
    global _listings
    _listings = listings
    _kinds.update((r.group, r.plural) for r in kinds)
    watching.continuous_watch = continuous_watch     # type: ignore[assignment]  # looked up by infinite_watch
