"""kopf's own event processor for one kind, as kopf's orchestrator builds it for a watcher: the tests that run
kopf's real watch loop (controller.relist's, controller.kopfready's) hand it to `queueing.watcher`."""
from __future__ import annotations

import asyncio
import functools
from typing import Any

import kopf
from kopf._core.actions import lifecycles
from kopf._core.engines import indexing
from kopf._core.reactor import inventory, processing


def processor(registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings,
              resource: kopf.Resource) -> tuple[Any, indexing.OperatorIndexers]:
    """The processor of `resource`'s events with `registry`'s handlers, and the indexes it fills."""
    indexers = indexing.OperatorIndexers()
    indexers.ensure(registry._indexing.get_all_handlers())
    return functools.partial(processing.process_resource_event, lifecycle=lifecycles.all_at_once,
                             registry=registry, settings=settings, indexers=indexers,
                             memories=inventory.ResourceMemories(), memobase=kopf.Memo(),
                             event_queue=asyncio.Queue(), resource=resource), indexers
