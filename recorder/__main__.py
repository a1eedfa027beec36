"""``tsrecorder``: the recorder's entrypoint.

Settings (environment, as upstream's Recorder StatefulSet sets them):

| variable | meaning |
|---|---|
| `TSRECORDER_DST` | a directory (upstream's default `/data/recordings`), or `s3://<endpoint>` (S3) |
| `TSRECORDER_BUCKET` | with `s3://`: the bucket |

With S3 the endpoint is reached over HTTPS unless it says `http://` (`s3://http://minio:9000`), and the
credentials come from `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (`AWS_SESSION_TOKEN`, `AWS_REGION`).
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
from dataclasses import dataclass
from urllib.parse import urlsplit

from .s3 import Bucket, Credentials, S3Store
from .server import Recorder
from .store import FileStore, Store

log = logging.getLogger("recorder")
PORT = 80


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class Settings:
    dst: str                      # a directory, or the S3 endpoint URL
    bucket: str                   # with S3
    ui: bool
    socket: str
    listen: tuple[str, int] | None


def settings(env: Mapping[str, str]) -> Settings:
    """The recorder's settings from the environment; ConfigError naming the variable and the fix."""
    dst = env.get("TSRECORDER_DST", "/data/recordings")
    bucket = ""
    if dst.startswith("s3://"):
        endpoint = dst.removeprefix("s3://")
        if not endpoint.startswith(("http://", "https://")):
            endpoint = "https://" + endpoint
        if not urlsplit(endpoint).hostname:
            raise ConfigError(f"TSRECORDER_DST={dst!r}: want s3://<endpoint>, e.g. s3://s3.us-east-1.amazonaws.com")
        bucket = env.get("TSRECORDER_BUCKET", "").strip()
        if not bucket:
            raise ConfigError("TSRECORDER_BUCKET is empty: S3 storage needs the bucket's name (the Recorder's "
                              "spec.storage.s3.bucket)")
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            if not env.get(k):
                raise ConfigError(f"{k} is empty: S3 storage needs credentials (the Recorder's "
                                  "spec.storage.s3.credentials.secret, with AWS_ACCESS_KEY_ID and "
                                  "AWS_SECRET_ACCESS_KEY)")
        dst = endpoint
    elif not dst.startswith("/"):
        raise ConfigError(f"TSRECORDER_DST={dst!r}: want an absolute directory such as /data/recordings, or "
                          "s3://<endpoint>")
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
    return Settings(dst, bucket, ui_raw in ("true", "1"), sock, listen)


def open_store(st: Settings, env: Mapping[str, str]) -> Store:
    if st.bucket:
        return S3Store(Bucket(st.dst, st.bucket, Credentials.from_env(env)))
    return FileStore(st.dst)


async def serve(env: Mapping[str, str]) -> int:
    try:
        st = settings(env)
        store = open_store(st, env)
    except ConfigError as e:
        log.error("invalid configuration: %s", e)
        return 1
    except OSError as e:
        log.error("cannot use %s for recordings: %s; mount a writable volume there", env.get("TSRECORDER_DST"), e)
        return 1
    rec = Recorder(store, ui=st.ui)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if st.listen is not None:
        addrs = [st.listen]
    else:
        from containerboot.apiproxy.run import wait_running
        from containerboot.localapi import LocalAPI
        waiting = asyncio.ensure_future(wait_running(LocalAPI(st.socket)))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            waiting.cancel()
            return 0
        addrs = [(ip, PORT) for ip in waiting.result()["Self"]["TailscaleIPs"]]
    servers = [await asyncio.start_server(rec.handle, host, port) for host, port in addrs]
    log.info("recorder listening on %s, storing recordings in %s%s",
             ", ".join(f"{h}:{p}" for h, p in addrs), f"{st.dst} (bucket {st.bucket})" if st.bucket else st.dst,
             " (UI on)" if st.ui else "")
    await stop.wait()
    for s in servers:
        s.close()
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    return asyncio.run(serve(os.environ))


if __name__ == "__main__":
    sys.exit(main())
