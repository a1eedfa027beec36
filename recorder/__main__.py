"""``tsrecorder``: the recorder's entrypoint.

Settings (environment, as upstream's Recorder StatefulSet sets them):

| variable | meaning |
|---|---|
| `TSRECORDER_DST` | where recordings go: a directory (upstream's default `/data/recordings`) |
| `TSRECORDER_UI` | `true`: serve the list of recordings too |
| `TS_SOCKET` | tailscaled's LocalAPI socket: listen on the device's tailnet addresses (port 80) once it runs |
| `TSRECORDER_LISTEN` | instead of `TS_SOCKET`: `HOST:PORT` to listen on (tests, a recorder outside a tailnet Pod) |

Without `TS_SOCKET` nor `TSRECORDER_LISTEN` the recorder refuses to start: it would otherwise have to guess
where to listen, and recordings (and the list of them) must be reachable over the tailnet only.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping

from .server import Recorder
from .store import FileStore

log = logging.getLogger("recorder")
PORT = 80


class ConfigError(Exception):
    pass


def settings(env: Mapping[str, str]) -> tuple[str, bool, str, tuple[str, int] | None]:
    """(directory, ui, socket, listen) from the environment; ConfigError naming the variable and the fix."""
    dst = env.get("TSRECORDER_DST", "/data/recordings")
    if dst.startswith("s3://"):
        raise ConfigError(f"TSRECORDER_DST={dst!r}: S3 storage is not supported by this recorder yet; use a "
                          "directory on a volume (the Recorder's default, without spec.storage.s3)")
    if not dst.startswith("/"):
        raise ConfigError(f"TSRECORDER_DST={dst!r}: want an absolute directory such as /data/recordings")
    ui_raw = env.get("TSRECORDER_UI", "false").strip().lower()
    if ui_raw not in ("true", "false", "1", "0", ""):
        raise ConfigError(f"TSRECORDER_UI={env['TSRECORDER_UI']!r}: want true or false")
    sock = env.get("TS_SOCKET", "")
    listen = None
    if env.get("TSRECORDER_LISTEN"):
        host, sep, port = env["TSRECORDER_LISTEN"].rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"TSRECORDER_LISTEN={env['TSRECORDER_LISTEN']!r}: want HOST:PORT, e.g. "
                              "127.0.0.1:8080")
        listen = (host.strip("[]") or "127.0.0.1", int(port))
    elif not sock:
        raise ConfigError("set TS_SOCKET (tailscaled's LocalAPI socket: listen on the tailnet addresses) or "
                          "TSRECORDER_LISTEN (HOST:PORT)")
    return dst, ui_raw in ("true", "1"), sock, listen


async def serve(env: Mapping[str, str]) -> int:
    try:
        dst, ui, sock, listen = settings(env)
        store = FileStore(dst)
    except ConfigError as e:
        log.error("invalid configuration: %s", e)
        return 1
    except OSError as e:
        log.error("cannot use %s for recordings: %s; mount a writable volume there", env.get("TSRECORDER_DST"), e)
        return 1
    rec = Recorder(store, ui=ui)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if listen is not None:
        addrs = [listen]
    else:
        from containerboot.apiproxy.run import wait_running
        from containerboot.localapi import LocalAPI
        waiting = asyncio.ensure_future(wait_running(LocalAPI(sock)))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            waiting.cancel()
            return 0
        addrs = [(ip, PORT) for ip in waiting.result()["Self"]["TailscaleIPs"]]
    servers = [await asyncio.start_server(rec.handle, host, port) for host, port in addrs]
    log.info("recorder listening on %s, storing recordings in %s%s",
             ", ".join(f"{h}:{p}" for h, p in addrs), dst, " (UI on)" if ui else "")
    await stop.wait()
    for s in servers:
        s.close()
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    return asyncio.run(serve(os.environ))


if __name__ == "__main__":
    sys.exit(main())
