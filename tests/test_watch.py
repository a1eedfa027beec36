"""tscommon.watch: kubelet-style atomic ..data swaps, rewrites, delete/recreate, polling fallback."""
from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from tests.support.kubelet import Kubelet
from tests.support.waits import until_async
from tscommon import watch as watchmod
from tscommon.watch import watch_file

# With inotify working, only events may wake the watcher within a test (the safety resync is far away).
NO_RESYNC = 3600.0


async def nxt(gen, timeout: float = 5.0):
    return await asyncio.wait_for(gen.__anext__(), timeout)


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the watcher began waiting for a wake-up (once per pass of its loop, and at its start)."""
    n = [0]
    real = watchmod.wait_event

    async def counting(ev, timeout):
        n[0] += 1
        return await real(ev, timeout)

    monkeypatch.setattr(watchmod, "wait_event", counting)
    return n


async def nothing_after_a_pass(gen, passes: list[int]) -> bool:
    """The watcher, woken by the change just made, has re-read the file and gone back to waiting, without a
    yield: it had its chance to report the change and did not."""
    start = passes[0]
    task = asyncio.ensure_future(gen.__anext__())
    # The first wait begins at once (resuming after the last yield); the second after a whole pass.
    await until_async(lambda: task.done() or passes[0] >= start + 2, what="a pass of the watcher")
    if task.done():
        return False
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, StopAsyncIteration):
        pass
    return True


async def test_kubelet_atomic_symlink_swaps(tmp_path: Path, passes: list[int]) -> None:
    k = Kubelet(tmp_path / "vol")
    k.publish('{"v":1}')
    gen = watch_file(k.path, resync_interval=NO_RESYNC)
    try:
        assert await nxt(gen) == '{"v":1}'
        k.publish('{"v":2}')
        assert await nxt(gen) == '{"v":2}'
        k.publish('{"v":3}')
        assert await nxt(gen) == '{"v":3}'
        # Same content republished (kubelet resync with a new dir): no yield.
        k.publish('{"v":3}')
        assert await nothing_after_a_pass(gen, passes)
    finally:
        await gen.aclose()


async def test_plain_rewrite_and_rename_into_place(tmp_path: Path, passes: list[int]) -> None:
    p = tmp_path / "serve.json"
    p.write_text("a")
    gen = watch_file(str(p), resync_interval=NO_RESYNC)
    try:
        assert await nxt(gen) == "a"
        p.write_text("b")
        assert await nxt(gen) == "b"
        tmp = tmp_path / ".serve.json.tmp"
        tmp.write_text("c")
        os.replace(tmp, p)
        assert await nxt(gen) == "c"
        # Touch without a change: nothing.
        os.utime(p)
        assert await nothing_after_a_pass(gen, passes)
    finally:
        await gen.aclose()


async def test_delete_and_recreate(tmp_path: Path) -> None:
    p = tmp_path / "serve.json"
    gen = watch_file(str(p), resync_interval=NO_RESYNC)
    try:
        assert await nxt(gen) is None        # starts missing
        p.write_text("x")
        assert await nxt(gen) == "x"
        p.unlink()
        assert await nxt(gen) is None
        p.write_text("y")
        assert await nxt(gen) == "y"
    finally:
        await gen.aclose()


async def test_forced_polling(tmp_path: Path) -> None:
    k = Kubelet(tmp_path / "vol")
    k.publish("1")
    gen = watch_file(k.path, poll_interval=0.1, force_polling=True)
    try:
        assert await nxt(gen) == "1"
        k.publish("2")
        assert await nxt(gen, 2) == "2"
        os.unlink(k.path)
        assert await nxt(gen, 2) is None
    finally:
        await gen.aclose()


async def test_falls_back_to_polling_when_inotify_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    def broken(self) -> None:
        raise OSError(24, "inotify instance limit reached")

    monkeypatch.setattr(watchmod._DirWatch, "start", broken)
    p = tmp_path / "serve.json"
    p.write_text("a")
    caplog.set_level("WARNING", logger="containerboot")
    gen = watch_file(str(p), poll_interval=0.1, resync_interval=NO_RESYNC)
    try:
        assert await nxt(gen) == "a"
        p.write_text("b")
        assert await nxt(gen, 2) == "b"
    finally:
        await gen.aclose()
    assert "polling every 0.1s instead" in caplog.text


async def test_directory_created_later(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="containerboot")
    vol = tmp_path / "later"
    path = str(vol / "serve-config")
    gen = watch_file(path, poll_interval=0.1, resync_interval=NO_RESYNC)
    try:
        assert await nxt(gen) is None
        k = Kubelet(vol)
        k.publish("hello")
        assert await nxt(gen, 2) == "hello"
        # The pass that read it set up inotify on the new directory first: a swap is seen promptly.
        assert "via inotify" in caplog.text
        k.publish("again")
        assert await nxt(gen, 2) == "again"
    finally:
        await gen.aclose()


async def test_directory_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="containerboot")
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "f").write_text("1")
    gen = watch_file(str(vol / "f"), poll_interval=0.1, resync_interval=0.2)
    try:
        assert await nxt(gen) == "1"
        shutil.rmtree(vol)
        assert await nxt(gen) is None
        vol.mkdir()
        (vol / "f").write_text("2")
        assert await nxt(gen) == "2"
        # The pass that read it moved the watch to the new directory's inode first.
        assert caplog.text.count("via inotify") == 2, caplog.text
        (vol / "f").write_text("3")
        assert await nxt(gen, 2) == "3"
    finally:
        await gen.aclose()


async def test_close_stops_observer_thread(tmp_path: Path) -> None:
    import threading

    from watchdog.observers.api import BaseObserver, EventEmitter

    def watchdog_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if isinstance(t, (BaseObserver, EventEmitter)) and t.is_alive()]

    p = tmp_path / "f"
    p.write_text("x")
    before = len(watchdog_threads())
    gen = watch_file(str(p), resync_interval=NO_RESYNC)
    assert await nxt(gen) == "x"
    assert len(watchdog_threads()) > before
    await gen.aclose()
    await until_async(lambda: len(watchdog_threads()) <= before, what="the observer threads to end")


async def test_reading_the_file_does_not_wake_the_watcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening and closing the file without writing (the watcher's own re-read, or anyone else's) is no change:
    before this was filtered, every re-read caused the next one and the watcher read the file 20 times a second
    for the life of the agent. Other readers' opens count the same."""
    reads = [0]
    real = watchmod.read_text

    def counting(path: str):
        reads[0] += 1
        return real(path)

    monkeypatch.setattr(watchmod, "read_text", counting)
    p = tmp_path / "f"
    p.write_text("x")
    seen: list[str | None] = []
    # Each event the watcher's handler gets, and whether it woke the watcher (set its asyncio.Event).
    events: list[tuple[str, str, bool]] = []
    loop = asyncio.get_running_loop()
    wakes = [0]
    real_soon = loop.call_soon_threadsafe

    def counting_soon(cb, *args, **kw):
        if getattr(cb, "__name__", "") == "set" and isinstance(getattr(cb, "__self__", None), asyncio.Event):
            wakes[0] += 1
        return real_soon(cb, *args, **kw)

    from watchdog.events import FileSystemEventHandler
    real_dispatch = FileSystemEventHandler.dispatch

    def recording_dispatch(self, event) -> None:
        before = wakes[0]
        real_dispatch(self, event)
        events.append((event.event_type, str(event.src_path), wakes[0] > before))

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting_soon)
    monkeypatch.setattr(FileSystemEventHandler, "dispatch", recording_dispatch)

    async def consume() -> None:
        async for text in watch_file(str(p), resync_interval=NO_RESYNC):
            seen.append(text)

    task = asyncio.create_task(consume())
    try:
        await until_async(lambda: seen == ["x"], what=f"the first read; seen {seen}")
        for _ in range(3):
            p.read_text()                      # someone else reads it
        # A file written in the same directory after the reads: its event comes after theirs (one inotify
        # queue, in order), so once the handler has it, the watcher has had its chance to wake on the reads.
        marker = tmp_path / "marker"
        marker.write_text("m")
        await until_async(lambda: any(path == str(marker) for _, path, _ in events), what="the marker's event")
        await until_async(lambda: reads[0] >= 2, what="the marker's re-read")
        woke = [(kind, path) for kind, path, w in events if w and path == str(p)]
        assert woke == [], f"opening and closing the unchanged file woke the watcher: {woke}"
        assert any(w for _, path, w in events if path == str(marker)), "the marker's write woke nothing"
        assert seen == ["x"]
        p.write_text("y")                      # a real change still wakes it
        await until_async(lambda: seen[-1] == "y", what="the change")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
