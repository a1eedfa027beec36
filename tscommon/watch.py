"""Watch one file for content changes, robust to Kubernetes' atomic volume updates.

Kubelet does not write a mounted ConfigMap/Secret file in place. The volume directory holds
`..2026_11_21_10_00_00.123456789/` (the real files), a `..data` symlink to it, and per key a symlink
`serve-config -> ..data/serve-config`. An update writes a new timestamped directory, points `..data_tmp` at it
and renames `..data_tmp` over `..data` (atomic), then deletes the old directory. Watching the file itself
misses this (its inode never changes: it is a symlink), so we watch the PARENT DIRECTORY and, on any event
there, re-read the file and compare CONTENT with what was last reported. Events are only a hint; content
is the truth. That also covers plain rewrites, editors' rename-into-place, delete and recreate.

If inotify cannot be used (no inotify instances left -- a real failure mode, upstream issue #15081 -- or
the directory does not exist yet) the watcher polls every `poll_interval` seconds, and keeps trying to set up
inotify. With inotify it still re-reads every `resync_interval` seconds as a safety net for lost events.

watchdog's observer runs in its own thread; it hands events to the asyncio loop with
`loop.call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from tscommon.aio import wait_event

if TYPE_CHECKING:
    from watchdog.observers.api import BaseObserver

log = logging.getLogger("containerboot")

__all__ = ["watch_file", "read_text", "DirWatch"]

#: inotify events that cannot change content (watchdog reports opens and read-only closes too).
_READ_ONLY_EVENTS = frozenset({"opened", "closed_no_write"})


def read_text(path: str) -> str | None:
    """The file's content, or None if it does not exist (or is unreadable, which is logged)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    except OSError as e:
        # e.g. EACCES, EISDIR: treat as "no file" so the last good config stays in force.
        log.warning("cannot read %s: %s", path, e)
        return None
    return data.decode("utf-8", errors="replace")


class _DirWatch:
    """A watchdog observer on one directory that sets an asyncio.Event on any event in it."""

    def __init__(self, directory: str, loop: asyncio.AbstractEventLoop, wake: asyncio.Event):
        self.directory = directory
        self._loop = loop
        self._wake = wake
        self._observer: BaseObserver | None = None
        self.ident: tuple[int, int] | None = None   # (st_dev, st_ino) of the watched directory

    def start(self) -> None:
        # Imported here so that a broken/missing watchdog only disables inotify, not the agent.
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        wake, loop = self._wake, self._loop

        class _Handler(FileSystemEventHandler):
            def on_any_event(self, event) -> None:   # runs in the observer thread
                if event.event_type in _READ_ONLY_EVENTS:
                    return   # our own re-read opens and closes the file: waking on that would loop forever
                try:
                    loop.call_soon_threadsafe(wake.set)
                except RuntimeError:   # loop closed during shutdown
                    pass

        st = os.stat(self.directory)
        observer = Observer()
        observer.schedule(_Handler(), self.directory, recursive=False)
        observer.daemon = True
        observer.start()    # raises OSError when no inotify instance/watch can be had
        self._observer = observer
        self.ident = (st.st_dev, st.st_ino)

    def stop(self) -> None:
        obs, self._observer = self._observer, None
        if obs is not None:
            try:
                obs.stop()
                obs.join(timeout=2)
            except Exception:   # best effort on the way out
                pass

    @property
    def running(self) -> bool:
        return self._observer is not None and self._observer.is_alive()


async def watch_file(path: str, poll_interval: float = 5.0, *, resync_interval: float = 60.0,
                     force_polling: bool = False, debounce: float = 0.05,
                     label: str = "serve proxy") -> AsyncIterator[str | None]:
    """Yield the content of `path` (None while it is missing): first the current content, then each time it
    changes. Consecutive yields always differ.

    `poll_interval`: how often to re-read when inotify is unavailable (or `force_polling`).
    `resync_interval`: how often to re-read anyway while inotify works.
    `debounce`: after an event, wait this long for the rest of a burst (kubelet's swap is several events).
    `label`: what the log lines say the watch is for.
    """
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    directory = os.path.dirname(os.path.abspath(path))
    watch: _DirWatch | None = None
    warned = False

    def ensure_watch() -> None:
        nonlocal watch, warned
        if force_polling:
            return
        try:
            st = os.stat(directory)
        except OSError:
            st = None
        if watch is not None and watch.running and st is not None and watch.ident == (st.st_dev, st.st_ino):
            return
        # No watch yet, it died, or the directory was replaced (a new inode is not covered by the old watch).
        if watch is not None:
            watch.stop()
            watch = None
        if st is None:
            if not warned:
                log.info("%s: directory %s does not exist yet; polling every %ss", label, directory, poll_interval)
                warned = True
            return
        w = _DirWatch(directory, loop, wake)
        try:
            w.start()
        except Exception as e:   # inotify exhaustion, missing watchdog backend, ...
            w.stop()
            if not warned:
                log.warning("%s: cannot watch %s for changes (%s); polling every %ss instead", label,
                            directory, e, poll_interval)
                warned = True
            return
        watch = w
        warned = False
        log.info("%s: watching %s for config changes via inotify", label, directory)

    try:
        await asyncio.to_thread(ensure_watch)
        last = await asyncio.to_thread(read_text, path)
        yield last
        while True:
            interval = resync_interval if (watch is not None and watch.running) else poll_interval
            if await wait_event(wake, interval) and debounce > 0:
                await asyncio.sleep(debounce)
            wake.clear()
            await asyncio.to_thread(ensure_watch)
            cur = await asyncio.to_thread(read_text, path)
            if cur != last:
                last = cur
                yield cur
    finally:
        if watch is not None:
            await asyncio.to_thread(watch.stop)


#: One directory's inotify watch, for callers that want the wake-ups rather than the file's content (the auth
#: key reissue wait re-reads the key itself on each one).
DirWatch = _DirWatch
