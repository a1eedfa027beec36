"""The recorder's HTTP server (adapter): upstream's recording protocol, version 1, and the list of recordings.

- `POST /record`: the body is a cast, streamed for as long as the session lasts. The recorder creates the
  file, answers `100 Continue` (the client starts sending only then), appends each chunk as it arrives and
  makes it durable (fsync) before reading on; the final `200 OK` is sent once the whole body is on storage,
  so a recording that was acknowledged was stored. A connection that breaks mid-body leaves what had arrived
  (a cast cut after its last whole line).
- An HTTP/2 connection (prior knowledge, as upstream's client opens it) is version 2 of the protocol
  (recorder/v2.py: `/v2/record` with acknowledgements of what is on storage), when the `h2` package is
  installed; without it the connection is closed and upstream's client falls back to `/record`.
- `HEAD /v2/event` answers 200 (API request events are taken) and `POST /v2/event` stores the event, a JSON
  object, whole and durable before its 200 (`events/<time>-<random>.json`, its `id` set to that name), over
  HTTP/1.1 as upstream's client sends them.
- With the UI on: `GET /` lists the recordings (newest first: time, user or tags, node, Pod, container,
  command, size), `GET /recordings/<name>` is the cast itself and `GET /recordings/<name>/play` replays it
  in asciinema's web player (served from `/static/`, recorder/static/README.md); `GET /events` lists the API
  request events (newest first) and `GET /events/<name>` is one of them.
"""
from __future__ import annotations

import asyncio
import html
import json
import logging
import os
import time
from typing import Any

import h11

from . import v2
from .store import EVENTS, Store, Writer, event_entry, new_name

log = logging.getLogger("recorder")
READ_SIZE = 65536
#: The largest API request event taken: the request body is in it (base64), and the API server's own limit on
#: a request body is 3 MiB
MAX_EVENT = 16 << 20
#: asciinema's web player for the replay page (recorder/static/README.md), served as these paths only
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
STATIC = {"/static/asciinema-player.min.js": (b"text/javascript; charset=utf-8", "asciinema-player.min.js"),
          "/static/asciinema-player.css": (b"text/css; charset=utf-8", "asciinema-player.css")}


class Recorder:
    def __init__(self, store: Store, *, ui: bool = False) -> None:
        self.store, self.ui = store, ui
        self.active = 0        # recordings being received

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        peer = writer.get_extra_info("peername") or ("?", 0)
        try:
            first = await reader.read(READ_SIZE)
            while first and v2.PREFACE.startswith(first) and len(first) < len(v2.PREFACE):
                more = await reader.read(READ_SIZE)     # the HTTP/2 preface cut short
                if not more:
                    break
                first += more
            if first.startswith(v2.PREFACE):
                if v2.AVAILABLE:
                    await v2.V2Connection(self.store, reader, writer, f"{peer[0]}:{peer[1]}", self).serve(first)
                return              # without h2: closed, and upstream's client falls back to /record
            conn.receive_data(first)
            while True:
                event = await _next(conn, reader)
                if not isinstance(event, h11.Request):
                    return
                path = event.target.decode("latin-1").partition("?")[0]
                method = event.method
                if path == "/record" and method == b"POST":
                    await self._record(conn, reader, writer, event, f"{peer[0]}:{peer[1]}")
                    return      # one recording per connection, as the client does
                if path == "/v2/event" and method == b"POST":
                    await self._event(conn, reader, writer, f"{peer[0]}:{peer[1]}")
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
                    continue
                while not isinstance(await _next(conn, reader), h11.EndOfMessage):
                    pass        # a body nobody here reads
                if path == "/v2/event" and method == b"HEAD":
                    await _send(conn, writer, 200, b"", b"text/plain", method)    # events are taken
                elif self.ui and method in (b"GET", b"HEAD") and path == "/":
                    page = await asyncio.to_thread(self.list_page)
                    await _send(conn, writer, 200, page, b"text/html; charset=utf-8", method)
                elif self.ui and method in (b"GET", b"HEAD") and path in STATIC:
                    ctype, fname = STATIC[path]
                    with open(os.path.join(STATIC_DIR, fname), "rb") as f:
                        await _send(conn, writer, 200, f.read(), ctype, method)
                elif self.ui and method in (b"GET", b"HEAD") and path == "/events":
                    page = await asyncio.to_thread(self.events_page)
                    await _send(conn, writer, 200, page, b"text/html; charset=utf-8", method)
                elif self.ui and method in (b"GET", b"HEAD") and path.startswith("/events/"):
                    body = await asyncio.to_thread(self.store.read_event, path.removeprefix("/events/"))
                    if body is None:
                        await _send(conn, writer, 404, b"no such event\n", b"text/plain", method)
                    else:
                        await _send(conn, writer, 200, body, b"application/json", method)
                elif self.ui and method in (b"GET", b"HEAD") and path.startswith("/recordings/") and \
                        path.endswith("/play"):
                    name = path.removeprefix("/recordings/").removesuffix("/play")
                    if await asyncio.to_thread(self.store.read, name) is None:
                        await _send(conn, writer, 404, b"no such recording\n", b"text/plain", method)
                    else:
                        await _send(conn, writer, 200, play_page(name), b"text/html; charset=utf-8", method)
                elif self.ui and method in (b"GET", b"HEAD") and path.startswith("/recordings/"):
                    body = await asyncio.to_thread(self.store.read, path.removeprefix("/recordings/"))
                    if body is None:
                        await _send(conn, writer, 404, b"no such recording\n", b"text/plain", method)
                    else:
                        await _send(conn, writer, 200, body, b"application/x-asciicast", method)
                else:
                    await _send(conn, writer, 404, b"not found\n", b"text/plain", method)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (OSError, h11.ProtocolError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort() if conn.our_state is h11.ERROR else writer.close()

    async def _record(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      req: h11.Request, peer: str) -> None:
        try:
            out = await asyncio.to_thread(self.store.create)
        except OSError as e:
            log.error("cannot store a recording from %s: %s", peer, e)
            await _send(conn, writer, 500, f"cannot store the recording: {e}\n".encode(), b"text/plain", b"POST")
            return
        self.active += 1
        log.info("recording %s from %s: started", out.name, peer)
        ended = False
        try:
            if conn.they_are_waiting_for_100_continue:
                writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
                await writer.drain()
            while not ended:
                # what has arrived is appended, made durable, and only then is more read
                chunks = []
                event = await _next(conn, reader)
                while True:
                    if isinstance(event, h11.Data):
                        chunks.append(bytes(event.data))
                    elif isinstance(event, h11.EndOfMessage):
                        ended = True
                        break
                    else:
                        raise EOFError("the connection closed")
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        break
                if chunks:
                    await asyncio.to_thread(_append, out, b"".join(chunks))
            await asyncio.to_thread(lambda: out.sync(final=True))
            await _send(conn, writer, 200, b"", b"text/plain", b"POST")
            log.info("recording %s from %s: stored (%d bytes)", out.name, peer, out.size)
        except (OSError, EOFError, h11.ProtocolError) as e:
            log.warning("recording %s from %s: the connection ended before the recording did (%s); %d bytes kept",
                        out.name, peer, e or type(e).__name__, out.size)
            try:
                await asyncio.to_thread(lambda: out.sync(final=True))
            except OSError:
                pass
        finally:
            await asyncio.to_thread(out.close)
            self.active -= 1

    async def _event(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     peer: str) -> None:
        """`POST /v2/event`: one API request event, a JSON object, stored whole (its `id` set to the name it is
        stored under) before the 200."""
        if conn.they_are_waiting_for_100_continue:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
        body = bytearray()
        while not isinstance(event := await _next(conn, reader), h11.EndOfMessage):
            if not isinstance(event, h11.Data):
                raise EOFError("the connection closed")
            body += event.data
            if len(body) > MAX_EVENT:
                log.warning("event from %s refused: larger than %d bytes", peer, MAX_EVENT)
                await _send(conn, writer, 413, f"event larger than {MAX_EVENT} bytes\n".encode(), b"text/plain",
                            b"POST")
                return
        try:
            doc = json.loads(body)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            log.warning("event from %s refused: not a JSON object (%s)", peer, e)
            await _send(conn, writer, 400, f"the event is not a JSON object: {e}\n".encode(), b"text/plain", b"POST")
            return
        name = new_name(suffix=".json")
        doc["id"] = f"{EVENTS}/{name}"
        try:
            await asyncio.to_thread(self.store.put_event, name, json.dumps(doc, separators=(",", ":")).encode())
        except OSError as e:
            log.error("cannot store an event from %s: %s", peer, e)
            await _send(conn, writer, 500, f"cannot store the event: {e}\n".encode(), b"text/plain", b"POST")
            return
        k: dict = doc["kubernetes"] if isinstance(doc.get("kubernetes"), dict) else {}
        log.info("event %s from %s: stored (%s %s)", name, peer, k.get("Verb", ""), k.get("Path", ""))
        await _send(conn, writer, 200, b"", b"text/plain", b"POST")

    def events_page(self) -> bytes:
        rows = []
        for name, data in self.store.list_events():
            e = event_entry(data)
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(e.timestamp)) if e.timestamp else ""
            cells = [when, e.user, e.node, e.verb, e.what, e.method, e.path, e.user_agent]
            n = html.escape(name)
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) +
                        f'<td><a href="/events/{n}">{n}</a></td></tr>')
        head = "".join(f"<th>{h}</th>" for h in ("time", "user", "node", "verb", "resource", "method", "path",
                                                   "user agent", "event"))
        return (f"<!doctype html><html><head><meta charset=\"utf-8\"><link rel=\"icon\" href=\"data:,\">"
                f"<title>API request events</title></head><body><p><a href=\"/\">recordings</a></p>"
                f"<h1>API request events</h1><table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody>"
                f"</table></body></html>").encode()

    def list_page(self) -> bytes:
        rows = []
        for e in self.store.list():
            k = e.kubernetes
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(e.timestamp)) if e.timestamp else ""
            cells = [when, e.user, e.node, k.get("SessionType", ""), f"{k.get('Namespace', '')}/{k.get('PodName', '')}",
                     k.get("Container", ""), e.command, str(e.size)]
            n = html.escape(e.name)
            link = f'<a href="/recordings/{n}/play">play</a> <a href="/recordings/{n}">{n}</a>'
            rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + f"<td>{link}</td></tr>")
        head = "".join(f"<th>{h}</th>" for h in ("started", "user", "node", "type", "Pod", "container", "command",
                                                   "bytes", "recording"))
        return (f"<!doctype html><html><head><meta charset=\"utf-8\"><link rel=\"icon\" href=\"data:,\">"
                f"<title>Recordings</title></head><body><p><a href=\"/events\">API request events</a></p>"
                f"<h1>Recordings</h1><table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
                f"</body></html>").encode()


def play_page(name: str) -> bytes:
    """The replay page of one recording: asciinema's player (served from /static/) on the cast."""
    n = html.escape(name)
    return (f'<!doctype html><html><head><meta charset="utf-8"><link rel="icon" href="data:,"><title>{n}</title>'
            f'<link rel="stylesheet" href="/static/asciinema-player.css">'
            f'<link rel="alternate" type="application/x-asciicast" href="/recordings/{n}"></head><body>'
            f'<p><a href="/">recordings</a> / {n}</p><div id="player"></div>'
            f'<script src="/static/asciinema-player.min.js"></script>'
            f'<script>AsciinemaPlayer.create({json.dumps("/recordings/" + name)}, '
            f'document.getElementById("player"), {{fit: "width"}});</script></body></html>').encode()


def _append(out: Writer, data: bytes) -> None:
    out.write(data)
    out.sync()


async def _next(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(READ_SIZE))


async def _send(conn: h11.Connection, writer: asyncio.StreamWriter, status: int, body: bytes, ctype: bytes,
                method: bytes) -> None:
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
    data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
    if method != b"HEAD":
        data += conn.send(h11.Data(data=body)) or b"" if body else b""
    data += conn.send(h11.EndOfMessage()) or b""
    writer.write(data)
    await writer.drain()
