"""``k8s-nameserver``: answer the tailnet's MagicDNS names from the mounted records file.

    k8s-nameserver [--domain tailnet.example] [--records /config/records.json] [--listen :1053]

Each option also reads an environment variable (``TS_NAMESERVER_DOMAIN``, comma-separated for several;
``TS_NAMESERVER_RECORDS``; ``TS_NAMESERVER_LISTEN``), so the image's defaults suit upstream's manifests.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from .server import PORT, RECORDS_FILE, NameServer, listen, watch_records

log = logging.getLogger("nameserver")


def _parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--listen {value!r}: want [HOST]:PORT, e.g. :{PORT} or 0.0.0.0:{PORT}")
    return host.strip("[]"), int(port)


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(prog="k8s-nameserver", description=__doc__.split("\n\n")[0])
    p.add_argument("--domain", action="append", default=None,
                   help="a zone to answer for (repeatable; default: $TS_NAMESERVER_DOMAIN, else the parents of "
                        "the record names)")
    p.add_argument("--records", default=env.get("TS_NAMESERVER_RECORDS", RECORDS_FILE),
                   help=f"the records file (default {RECORDS_FILE})")
    p.add_argument("--listen", type=_parse_listen, default=env.get("TS_NAMESERVER_LISTEN", f":{PORT}"),
                   help=f"[HOST]:PORT for UDP and TCP (default :{PORT}, every address)")
    a = p.parse_args(argv)
    if isinstance(a.listen, str):
        a.listen = _parse_listen(a.listen)
    if a.domain is None:
        a.domain = [d for d in env.get("TS_NAMESERVER_DOMAIN", "").split(",") if d.strip()]
    return a


async def run(args: argparse.Namespace) -> int:
    ns = NameServer(args.domain)
    loaded = asyncio.Event()
    watch = asyncio.create_task(watch_records(ns, args.records, loaded=loaded))
    await loaded.wait()   # first records before the first answer, as upstream does
    host, port = args.listen
    transport, server = await listen(ns, host, port)
    log.info("listening for UDP and TCP queries on %s:%d", host or "*", port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    transport.close()
    server.close()
    watch.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s",
                        datefmt="%Y/%m/%d %H:%M:%S")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return asyncio.run(run(args))
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", args.listen[0] or "*", args.listen[1], e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
