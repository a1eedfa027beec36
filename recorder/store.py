"""Where recordings are kept: one asciinema cast file per session in a directory (a volume).

A recording's name is its start time and a random part (`20261128T001530Z-3f9a1c0b.cast`), so names sort by
time and two sessions never share one. Bytes are appended as they arrive; `sync()` makes what was appended
durable (fsync of the file, and of the directory once the file is new) before the recorder acknowledges
it. A recording still being written is a valid cast up to its last whole line.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Protocol

NAME = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{8}\.cast$")
EVENT_NAME = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{8}\.json$")
#: API request events (`/v2/event`) are kept apart from the casts: `events/<name>` in the directory or bucket
EVENTS = "events"
#: (name, event) pairs, newest first (an alias: the stores' own `list` method hides the builtin in their bodies)
Events = list[tuple[str, bytes]]


def new_name(now: float | None = None, suffix: str = ".cast") -> str:
    t = time.gmtime(time.time() if now is None else now)
    return time.strftime("%Y%m%dT%H%M%SZ", t) + "-" + secrets.token_hex(4) + suffix


class Writer(Protocol):
    name: str
    size: int

    def write(self, data: bytes) -> None: ...

    def sync(self, *, final: bool = False) -> None: ...

    def close(self) -> None: ...


class Store(Protocol):
    directory: str

    def create(self) -> Writer: ...

    def read(self, name: str) -> bytes | None: ...

    def list(self) -> list[Entry]: ...

    def put_event(self, name: str, data: bytes) -> None: ...

    def read_event(self, name: str) -> bytes | None: ...

    def list_events(self) -> Events: ...


class FileWriter:
    """One recording being written."""

    def __init__(self, directory: str, name: str) -> None:
        self.name, self.path = name, os.path.join(directory, name)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o640)
        self._dir = directory
        self._new = True
        self.size = 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.size += len(data)

    def sync(self, *, final: bool = False) -> None:
        """Everything written so far survives a crash of the recorder or of its machine."""
        os.fsync(self._fd)
        if self._new:
            dfd = os.open(self._dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._new = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class FileStore:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def create(self) -> FileWriter:
        return FileWriter(self.directory, new_name())

    def read(self, name: str) -> bytes | None:
        p = self.path(name)
        if p is None:
            return None
        with open(p, "rb") as f:
            return f.read()

    def path(self, name: str) -> str | None:
        """The file of a recording, or None for a name that is not one (no path outside the directory)."""
        if not NAME.match(name):
            return None
        p = os.path.join(self.directory, name)
        return p if os.path.isfile(p) else None

    def list(self) -> list[Entry]:
        out = []
        for name in sorted(os.listdir(self.directory), reverse=True):
            p = self.path(name)
            if p is None:
                continue
            try:
                with open(p, "rb") as f:
                    first = f.readline(1 << 16)
                size = os.path.getsize(p)
            except OSError:
                continue
            out.append(entry(name, first, size))
        return out

    def put_event(self, name: str, data: bytes) -> None:
        """One event, whole or not at all, durable on return: written to a temporary name, fsync'd, renamed,
        and the directory fsync'd."""
        d = os.path.join(self.directory, EVENTS)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, "." + name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(d, name))
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def read_event(self, name: str) -> bytes | None:
        if not EVENT_NAME.match(name):
            return None
        try:
            with open(os.path.join(self.directory, EVENTS, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def list_events(self) -> Events:
        """(name, event) of every event, newest first."""
        d = os.path.join(self.directory, EVENTS)
        try:
            names = sorted((n for n in os.listdir(d) if EVENT_NAME.match(n)), reverse=True)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            data = self.read_event(n)
            if data is not None:
                out.append((n, data))
        return out


@dataclass(frozen=True)
class Entry:
    """A recording as listed: its name and what its header says."""

    name: str
    size: int
    timestamp: int
    user: str
    node: str
    kubernetes: dict[str, str]
    command: str


def entry(name: str, first_line: bytes, size: int) -> Entry:
    """The listing of one recording from its first line (the cast header); a header that does not parse
    lists the name and size alone."""
    try:
        h: Any = json.loads(first_line)
        if not isinstance(h, dict):
            raise ValueError
    except ValueError:
        h = {}
    tags = h.get("srcNodeTags") or []
    user = str(h.get("srcNodeUser") or ", ".join(str(t) for t in tags if isinstance(t, str)))
    k = h.get("kubernetes") if isinstance(h.get("kubernetes"), dict) else {}
    ts = h.get("timestamp")
    return Entry(name=name, size=size, timestamp=ts if isinstance(ts, int) else 0, user=user,
                 node=str(h.get("srcNode") or ""), kubernetes={str(a): str(b) for a, b in k.items()},
                 command=str(h.get("command") or ""))


@dataclass(frozen=True)
class EventEntry:
    """An API request event as listed."""

    timestamp: int
    user: str
    node: str
    verb: str
    what: str       # namespace/resource/name (subresource)
    method: str
    path: str
    user_agent: str


def event_entry(data: bytes) -> EventEntry:
    """What the list shows of one event; fields of the wrong shape show empty."""
    try:
        doc: Any = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError
    except ValueError:
        doc = {}

    def obj(v: Any) -> dict:
        return v if isinstance(v, dict) else {}

    src, k, req = obj(doc.get("source")), obj(doc.get("kubernetes")), obj(doc.get("request"))
    tags: list = src["nodeTags"] if isinstance(src.get("nodeTags"), list) else []
    user = str(src.get("nodeUser") or ", ".join(str(t) for t in tags))
    what = "/".join(str(k.get(f) or "") for f in ("Namespace", "Resource", "Name") if k.get(f))
    if k.get("Subresource"):
        what += f" ({k['Subresource']})"
    ts = doc.get("timestamp")
    return EventEntry(timestamp=ts if isinstance(ts, int) else 0, user=user, node=str(src.get("node") or ""),
                      verb=str(k.get("Verb") or ""), what=what, method=str(req.get("method") or ""),
                      path=str(req.get("path") or ""), user_agent=str(doc.get("userAgent") or ""))
