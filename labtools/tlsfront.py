"""A TLS terminator for the lab: `python -m labtools.tlsfront --listen ADDR:PORT --cert C --key K --to ADDR:PORT`.

Accepts TLS on `--listen` with the given certificate and copies bytes both ways to a plain TCP `--to` (the lab's
headscale, which serves HTTP only), so that a node can be pointed at an HTTPS control server whose certificate
comes from a private CA. Byte copy after the handshake: HTTP upgrades (the control protocol's) pass unchanged.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import subprocess
import sys
from pathlib import Path


def _split(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def serve(listen: str, to: str, cert: str, key: str) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    to_host, to_port = _split(to)

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        print(f"tlsfront: connection from {writer.get_extra_info('peername')[0]}", flush=True)
        try:
            up_reader, up_writer = await asyncio.open_connection(to_host, to_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    host, port = _split(listen)
    server = await asyncio.start_server(one, host, port, ssl=ctx)
    print(f"tlsfront: serving TLS on {listen}, to {to}", flush=True)
    async with server:
        await server.serve_forever()


def start(lab, ns: str, listen: str, to: str, cert: str, key: str, log: Path) -> subprocess.Popen:
    """Run the front in the lab's namespace `ns` (stopped with the lab) and wait until it serves."""
    repo = Path(__file__).resolve().parents[1]
    p = lab._popen("http", "tlsfront", ns, [sys.executable, "-m", "labtools.tlsfront", "--listen", listen,
                                            "--to", to, "--cert", cert, "--key", key],
                   {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(repo)}, log)

    def ready() -> bool:
        if p.poll() is not None:
            raise RuntimeError(f"tlsfront exited: {log.read_text()[-2000:]}")
        return log.exists() and "serving TLS" in log.read_text()
    from labtools.lab import wait_until
    wait_until(ready, 30, 0.1, f"the TLS front on {listen}")
    return p


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True)
    p.add_argument("--to", required=True)
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    a = p.parse_args()
    asyncio.run(serve(a.listen, a.to, a.cert, a.key))


if __name__ == "__main__":
    main()
