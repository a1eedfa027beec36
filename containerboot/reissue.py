"""One-step mode's auth key reissue: ask the operator for a new key and wait until it is in the config file.

The operator writes the new key into the mounted Secret, and kubelet swaps the directory's `..data` link: a
watch on the directory notices within milliseconds, and a poll every REISSUE_POLL_INTERVAL stays as the fallback
(upstream's 5 s ticker). The agent then exits 0 and is restarted with the new key.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from .errors import AgentError

log = logging.getLogger("containerboot")

#: How often the config file is re-read when no change event arrives (upstream's 5 s ticker).
REISSUE_POLL_INTERVAL = 5.0


async def reissue(reason: str, *, secret: Any, config_path: str, old_key: str, api: Any) -> None:
    """Ask for a new auth key through the state Secret (`secret`: kube.state.SecretState), disconnecting
    tailscaled from control first (`api`: the LocalAPI), and return once the config file holds a new key."""
    from tscommon.watch import DirWatch

    from .conffile import authkey_from_config
    from .kube.setup import reissue_flow

    log.info("%s", reason)
    directory = os.path.dirname(os.path.abspath(config_path))
    event = asyncio.Event()
    dir_watch = DirWatch(directory, asyncio.get_running_loop(), event)
    changed: asyncio.Event | None = event
    watch: DirWatch | None = dir_watch
    try:
        await asyncio.to_thread(dir_watch.start)
        log.info("Config directory %s (kubelet's ..data swap included): auth key reissue: watching for "
                 "config changes via fsnotify", directory)
    except Exception as e:   # no inotify instance left, watchdog unusable, ...
        await asyncio.to_thread(dir_watch.stop)
        watch = changed = None
        log.warning("auth key reissue: cannot watch %s for config changes (%s), using polling every %gs",
                    directory, e, REISSUE_POLL_INTERVAL)
    try:
        await reissue_flow(secret.client, secret.name, old_key, lambda: authkey_from_config(config_path),
                           disconnect=api.disconnect_control, changed=changed, poll_interval=REISSUE_POLL_INTERVAL)
    except Exception as e:
        raise AgentError(f"failed to get a reissued authkey: {e}") from None
    finally:
        if watch is not None:
            await asyncio.to_thread(watch.stop)
    log.info("Successfully received new auth key, restarting to apply configuration")
