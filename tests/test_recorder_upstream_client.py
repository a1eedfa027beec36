"""Our recorder against upstream's own recording client (tailscale.com/sessionrecording.ConnectToRecorder, built
from the Go module cache into tests/support/upstream_recclient): it asks for version 2 of the protocol, falls
back to `/record`, uploads a cast line by line and gets the recorder's confirmation; the stored cast is what
it sent, and asciinema's own tooling reads it."""
from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import subprocess
import sys

import pytest

from containerboot.apiproxy import apievent
from labtools import gobuild
from recorder import v2
from recorder.server import Recorder
from recorder.store import FileStore

SRC = pathlib.Path(__file__).parent / "support" / "upstream_recclient"
CAST = (b'{"version":2,"width":80,"height":24,"timestamp":1700000000,"srcNode":"laptop.tail.example",'
        b'"kubernetes":{"PodName":"web","Namespace":"team-a","Container":"app","SessionType":"exec"}}\n'
        b'[0.1,"o","$ echo hi\\r\\n"]\n[0.2,"o","hi\\r\\n"]\n[0.3,"r","100x30"]\n')


def client_binary() -> pathlib.Path:
    """Built once per source version into the shared cache (offline: the module cache must hold the modules)."""
    try:
        return gobuild.build_cached(SRC, "upstream-recclient")
    except gobuild.GoUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("version", [2, 1])
async def test_upstreams_client_records_into_our_recorder_and_asciinema_reads_it(tmp_path, version, monkeypatch,
                                                                                 caplog):
    """Version 2 (HTTP/2 with acks) when the recorder has h2, else version 1 after upstream's fallback."""
    caplog.set_level(logging.INFO, logger="recorder")
    binary = client_binary()
    if version == 1:
        monkeypatch.setattr(v2, "AVAILABLE", False)
    store = FileStore(str(tmp_path / "recordings"))
    rec = Recorder(store)
    server = await asyncio.start_server(rec.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    # a closed port first: the client tries the next recorder, as it does with several
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    dead = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    proc = await asyncio.create_subprocess_exec(str(binary), f"127.0.0.1:{dead}", f"127.0.0.1:{port}",
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(CAST), 120)
    server.close()
    text = out.decode()
    assert proc.returncode == 0, text
    assert text.splitlines()[-1] == "uploaded"
    assert f'attempt 127.0.0.1:{dead} "recording: error starting recording on' in text
    (entry,) = store.list()
    path = store.path(entry.name)
    assert path and pathlib.Path(path).read_bytes() == CAST
    assert entry.kubernetes["PodName"] == "web" and entry.node == "laptop.tail.example"
    assert ("started (version 2)" in caplog.text) == (version == 2)
    pytest.importorskip("asciinema")
    cat = subprocess.run([sys.executable, "-m", "asciinema", "cat", path], capture_output=True, timeout=60)
    assert cat.returncode == 0, cat.stderr
    assert cat.stdout == b"$ echo hi\r\nhi\r\n"


async def test_upstreams_event_sender_stores_an_event_in_our_recorder(tmp_path):
    """sessionrecording.SendEvent: its `HEAD /v2/event` finds events taken, its `POST /v2/event` is stored whole;
    a recorder that has gone is an error, as upstream reports it."""
    binary = client_binary()
    who = {"Node": {"Name": "laptop.tail.example.", "StableID": "nS", "Tags": []},
           "UserProfile": {"ID": 3, "LoginName": "alice@example.com"}}
    event = apievent.encode(apievent.event(method="GET", target="/api/v1/namespaces/team-a/pods", user_agent="kubectl",
                                           body=b"", who=who, now=1795823730))
    store = FileStore(str(tmp_path / "recordings"))
    server = await asyncio.start_server(Recorder(store).handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    dead = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    proc = await asyncio.create_subprocess_exec(str(binary), "-event", f"127.0.0.1:{port}", f"127.0.0.1:{dead}",
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(event), 120)
    server.close()
    lines = out.decode().splitlines()
    assert lines[0] == f"sent 127.0.0.1:{port}", lines
    assert lines[1].startswith(f'error 127.0.0.1:{dead} "error checking support for `/v2/event` endpoint'), lines
    [(name, data)] = store.list_events()
    stored = json.loads(data)
    assert stored == {**json.loads(event), "id": f"events/{name}"}


async def test_upstreams_event_sender_sees_a_recorder_without_events_as_such():
    """Our proxy's own client and upstream's agree on what a recorder without `/v2/event` answers (404)."""
    binary = client_binary()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proc = await asyncio.create_subprocess_exec(str(binary), "-event", f"127.0.0.1:{port}",
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(b"{}\n"), 120)
    server.close()
    assert out.decode().strip() == (f'unsupported 127.0.0.1:{port} "recorder at address \\"127.0.0.1:{port}\\" '
                                    'does not support \\"/v2/event\\" endpoint"')
