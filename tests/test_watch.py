"""tscommon.watch: kubelet-style atomic ..data swaps, rewrites, delete/recreate, polling fallback."""
from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from tests.support.kubelet import Kubelet
from tscommon import watch as watchmod
from tscommon.watch import watch_file

# With inotify working, only events may wake the watcher within a test (the safety resync is far away).
NO_RESYNC = 3600.0


async def nxt(gen, timeout: float = 5.0):
    return await asyncio.wait_for(gen.__anext__(), timeout)


async def nothing_within(gen, seconds: float) -> bool:
    task = asyncio.ensure_future(gen.__anext__())
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if done:
        return False
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, StopAsyncIteration):
        pass
    return True




async def test_kubelet_atomic_symlink_swaps(tmp_path: Path) -> None:
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
        assert await nothing_within(gen, 0.5)
    finally:
        await gen.aclose()


async def test_plain_rewrite_and_rename_into_place(tmp_path: Path) -> None:
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
        assert await nothing_within(gen, 0.4)
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


async def test_directory_created_later(tmp_path: Path) -> None:
    vol = tmp_path / "later"
    path = str(vol / "serve-config")
    gen = watch_file(path, poll_interval=0.1, resync_interval=NO_RESYNC)
    try:
        assert await nxt(gen) is None
        k = Kubelet(vol)
        k.publish("hello")
        assert await nxt(gen, 2) == "hello"
        # Now inotify is set up on the new directory: a swap is seen promptly.
        await asyncio.sleep(0.3)
        k.publish("again")
        assert await nxt(gen, 2) == "again"
    finally:
        await gen.aclose()


async def test_directory_replaced(tmp_path: Path) -> None:
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
        await asyncio.sleep(0.5)            # the watch has moved to the new directory inode
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
    for _ in range(50):
        if len(watchdog_threads()) <= before:
            break
        await asyncio.sleep(0.05)
    assert len(watchdog_threads()) <= before


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

    async def consume() -> None:
        async for text in watch_file(str(p), resync_interval=NO_RESYNC):
            seen.append(text)

    async def until(pred, timeout: float = 5.0) -> None:
        end = asyncio.get_running_loop().time() + timeout
        while not pred():
            assert asyncio.get_running_loop().time() < end, f"timed out; seen {seen}"
            await asyncio.sleep(0.01)

    task = asyncio.create_task(consume())
    try:
        await until(lambda: seen == ["x"])
        for _ in range(3):
            p.read_text()                      # someone else reads it
        await asyncio.sleep(1.0)
        assert reads[0] <= 2, f"the watcher re-read an unchanged file {reads[0]} times in 1 s"
        assert seen == ["x"]
        p.write_text("y")                      # a real change still wakes it
        await until(lambda: seen[-1] == "y")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
