"""Time a line's appearance in an agent's log file as it is written (inotify), not on a polling tick.

The benchmarks judge boot times of two agents that differ by milliseconds, so the moment "Startup complete"
reaches the log must be read with a resolution well below that: a 10 ms poll adds up to 10 ms of error to
each sample. Here the reader sleeps in `poll()` on an inotify descriptor watching the file for writes and reads
the new bytes as soon as the kernel reports them (tens of microseconds after the agent's write). Both agents
write their log to the same kind of file through the lab (`Lab.start_agent`) and are timed by this same code.
Linux only (ctypes over libc's inotify calls; the standard library has no binding).
"""
from __future__ import annotations

import ctypes
import os
import select
import time
from collections.abc import Callable, Sequence

IN_MODIFY = 0x00000002
IN_CLOEXEC = 0o2000000
IN_NONBLOCK = 0o4000

_libc = ctypes.CDLL(None, use_errno=True)


class LogWatch:
    """Follows one file; `wait_for` returns the monotonic time at which a text was first read from it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if _libc.inotify_add_watch(self._fd, self.path.encode(), IN_MODIFY) < 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"inotify_add_watch {self.path} failed")
        self._file = open(self.path, "rb")
        self._text = b""                    # all read so far (an agent's boot log: tens of kilobytes)
        self._seen: dict[str, float] = {}   # text -> time.monotonic() of the read that brought it

    def close(self) -> None:
        self._file.close()
        os.close(self._fd)

    def __enter__(self) -> "LogWatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for(self, text: str, timeout: float, alive: Callable[[], bool] = lambda: True) -> float:
        """Block until `text` is in the file; return time.monotonic() of the read that found it.

        Raises RuntimeError when `alive()` turns false first (checked at least twice a second), TimeoutError
        after `timeout` seconds."""
        return self.wait_for_each(text, (), timeout, alive)[text]

    def wait_for_each(self, text: str, also: Sequence[str], timeout: float,
                      alive: Callable[[], bool] = lambda: True) -> dict[str, float]:
        """Like `wait_for(text)`; also returns the time each of `also` was first read, if it was read by then
        (texts found in the same read get the same time)."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        wanted = [text, *also]
        while True:
            data = self._file.read()      # everything written since the last read (the watch is already set)
            if data:
                now = time.monotonic()
                self._text += data
                for t in wanted:
                    if t not in self._seen and t.encode() in self._text:
                        self._seen[t] = now
            if text in self._seen:
                return {t: self._seen[t] for t in wanted if t in self._seen}
            if not alive():
                raise RuntimeError(f"the process writing {self.path} exited before logging {text!r}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{text!r} not in {self.path} within {timeout:g} s")
            if poller.poll(min(left, 0.5) * 1000):
                try:
                    os.read(self._fd, 65536)    # drain the events; the file itself is read at the loop's top
                except BlockingIOError:
                    pass
