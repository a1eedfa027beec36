"""glibc malloc settings that keep a long-running, mostly idle agent's resident memory small.

Two levers, both best effort (a libc without them, e.g. musl, is simply left alone):

* `limit_arenas()`, called before the first thread starts: glibc gives every thread that allocates its own
  malloc arena (up to 8 per core), and each keeps its freed pages. The agent's threads (the asyncio default
  executor that runs firewall and file work, watchdog's observer) allocate little and rarely, so one shared
  arena costs no measurable contention and saves several MB. It also fixes glibc's trim and mmap thresholds at
  128 KiB (their defaults, which glibc otherwise raises, up to 32 MB, after each large block is freed: the
  netmap's JSON, a netlink dump): free memory at the top of the heap then goes back to the kernel when it is
  freed, not only at the next `trim()` (the agent's imports and a first rule apply, untrimmed: 21 MB resident
  instead of 22).
* `trim()`, after start-up and after a burst of work: returns the free pages at the top of the heap and the
  free parts of every arena to the kernel (malloc_trim). Python's own allocator keeps small objects in
  256 KiB arenas; this reaches what it already released and what C libraries (libnftables, OpenSSL) freed.
"""
from __future__ import annotations

M_ARENA_MAX = -8    # glibc's mallopt parameter numbers
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD = 128 * 1024


def _libc():
    import ctypes
    # The interpreter's own symbol namespace holds libc's; no library search (ctypes.util runs ldconfig).
    return ctypes.CDLL(None)


def limit_arenas(n: int = 1) -> bool:
    try:
        libc = _libc()
        if libc is None:
            return False
        libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD)
        libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD)
        return bool(libc.mallopt(M_ARENA_MAX, n))
    except (OSError, AttributeError):
        return False


def trim() -> bool:
    try:
        libc = _libc()
        return bool(libc is not None and libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
