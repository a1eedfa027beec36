"""Erase credentials from the process's own initial environment, as the kernel shows it in /proc/<pid>/environ.

Python copies the environment into `os.environ` at start-up, but the kernel keeps serving the original block
(between `env_start` and `env_end` of the process's memory map) for the process's whole life, and a child
between `fork` and `exec` shows the same block as its own. Overwriting the values in place, through
/proc/self/mem (always writable by the process itself; the block is ordinary writable stack memory), removes
them from every later read. The names stay, with an empty value: C code that calls getenv() sees an empty
string, Python code keeps reading its own copy in `os.environ`.

Best effort: a kernel without the addresses in /proc/self/stat (before 3.5) or a /proc that refuses the write
leaves the block as it was, and `scrub` says so by its result.
"""
from __future__ import annotations

from collections.abc import Iterable


def _env_bounds(stat: bytes) -> tuple[int, int]:
    """env_start and env_end: fields 50 and 51 of /proc/<pid>/stat (1-based), counted after the command name,
    which is in parentheses and may itself contain spaces."""
    fields = stat.rsplit(b")", 1)[1].split()
    # fields[0] is field 3 (state): field N is fields[N - 3].
    return int(fields[50 - 3]), int(fields[51 - 3])


def blanked(block: bytes, names: Iterable[str]) -> bytes:
    """The environment block with the value of each `names` entry replaced by NUL bytes of the same length
    (pure; the block's size and every other entry's offset are unchanged)."""
    prefixes = tuple(f"{name}=".encode() for name in names)
    out = bytearray(block)
    offset = 0
    for entry in block.split(b"\0"):
        if entry.startswith(prefixes):
            start = offset + entry.index(b"=") + 1
            out[start:offset + len(entry)] = b"\0" * (len(entry) - (start - offset))
        offset += len(entry) + 1
    return bytes(out)


def scrub(names: Iterable[str], *, proc: str = "/proc/self") -> bool:
    """Blank the values of `names` in this process's initial environment block. True when the block now holds
    none of them (also when it never did)."""
    names = tuple(names)
    try:
        with open(f"{proc}/stat", "rb") as f:
            start, end = _env_bounds(f.read())
        if end <= start:
            return False
        with open(f"{proc}/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            block = mem.read(end - start)
            new = blanked(block, names)
            if new != block:
                mem.seek(start)
                mem.write(new)
        return True
    except (OSError, ValueError, IndexError):
        return False
