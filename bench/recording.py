"""Benchmark: what recording costs an exec session through the API server proxy, on loopback.

    .venv/bin/python -m bench.recording [--lines 300] [--megabytes 20] [--rounds 3] [--json out.json]

No lab, no root: the API server proxy (auth mode, a WhoIs stand-in whose rule names a recorder) in front of
a stand-in API server whose exec answers every stdin line on stdout and can stream a block of output, and our
recorder (protocol version 2, casts on a temporary directory, fsync'd before each acknowledgement) on
loopback. The same SPDY exec session runs with the rule (recorded) and without it (not recorded), in
alternating rounds (ABBA), reporting medians:

- the latency of one line: a stdin line sent, its answer read back (what a user typing feels);
- the throughput of `--megabytes` of stdout (a `cat` of a large file);
- the recorder's bytes on storage per recorded session.

Numbers from a shared 2-core machine vary run to run; they are an order of magnitude, not a verdict.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import struct
import sys
import tempfile
import time

import h11

from containerboot.apiproxy.identity import CAP_KUBERNETES
from containerboot.apiproxy.server import AUTH, ApiServerProxy, Upstream
from recorder.server import Recorder
from recorder.store import FileStore
from tests.support.spdyws import SpdyClient, data

EXEC = (b"POST /api/v1/namespaces/bench/pods/web/exec?command=sh&stdin=true&stdout=true HTTP/1.1\r\nHost: x\r\n"
        b"Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n")
BLOCK = 32 * 1024


async def api_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """101, then each stdin frame (stream 3) answered on stdout (stream 5); `flood N` streams N bytes."""
    conn = h11.Connection(h11.SERVER)
    while (ev := conn.next_event()) is h11.NEED_DATA or not isinstance(ev, h11.EndOfMessage):
        if ev is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
    writer.write(conn.send(h11.InformationalResponse(status_code=101, headers=[
        (b"connection", b"Upgrade"), (b"upgrade", b"SPDY/3.1")])) or b"")
    buf = bytearray(conn.trailing_data[0])
    try:
        while True:
            while len(buf) >= 8 and len(buf) >= 8 + int.from_bytes(buf[5:8], "big"):
                n = int.from_bytes(buf[5:8], "big")
                frame = bytes(buf[:8 + n])
                del buf[:8 + n]
                if frame[0] & 0x80 or struct.unpack(">I", frame[:4])[0] != 3:
                    continue
                line = frame[8:]
                if line.startswith(b"flood "):
                    left = int(line.split()[1])
                    chunk = data(5, b"x" * BLOCK)
                    while left > 0:
                        writer.write(chunk)
                        await writer.drain()
                        left -= BLOCK
                    writer.write(data(5, b"done\n"))
                else:
                    writer.write(data(5, line))
                await writer.drain()
            chunk = await reader.read(262144)
            if not chunk:
                return
            buf += chunk
    except OSError:
        pass
    finally:
        writer.close()


async def session(port: int, lines: int, flood: int) -> tuple[list[float], float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(EXEC)
    await reader.readuntil(b"\r\n\r\n")
    c = SpdyClient()
    writer.write(c.syn_stream(1, "error") + c.syn_stream(3, "stdin") + c.syn_stream(5, "stdout"))
    got = bytearray()

    async def until(marker: bytes) -> None:
        while marker not in got:
            chunk = await reader.read(262144)
            if not chunk:
                raise EOFError("the session ended")
            got.extend(chunk)
    latencies = []
    for i in range(lines):
        got.clear()
        t = time.perf_counter()
        writer.write(data(3, f"line-{i}\n".encode()))
        await until(f"line-{i}\n".encode())
        latencies.append(time.perf_counter() - t)
    got.clear()
    t = time.perf_counter()
    writer.write(data(3, f"flood {flood}".encode()))
    while b"done\n" not in got[-64:]:
        chunk = await reader.read(262144)
        if not chunk:
            raise EOFError("the session ended")
        got.extend(chunk)
        if len(got) > 1 << 20:
            del got[:-64]
    seconds = time.perf_counter() - t
    writer.close()
    return latencies, seconds


async def main_async(a: argparse.Namespace) -> dict:
    api = await asyncio.start_server(api_server, "127.0.0.1", 0)
    store = FileStore(tempfile.mkdtemp(prefix="bench-recordings-"))
    rec = Recorder(store)
    rs = await asyncio.start_server(rec.handle, "127.0.0.1", 0)
    rec_addr = f"127.0.0.1:{rs.sockets[0].getsockname()[1]}"
    rules: list[dict] = []

    async def whois(addr: str) -> dict:
        return {"Node": {"Name": "bench.t.", "StableID": "n1", "User": 1}, "UserProfile": {"LoginName": "bench"},
                "CapMap": {CAP_KUBERNETES: rules}}
    proxy = ApiServerProxy(mode=AUTH, upstream=Upstream("127.0.0.1", api.sockets[0].getsockname()[1], None, b"x"),
                           token=lambda: "t", whois=whois)
    ps = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    port = ps.sockets[0].getsockname()[1]
    results: dict[str, dict[str, list[float]]] = {"recorded": {"lat": [], "tput": []},
                                                  "not recorded": {"lat": [], "tput": []}}
    order = []
    for r in range(a.rounds):
        order += ["recorded", "not recorded"] if r % 2 == 0 else ["not recorded", "recorded"]
    flood = a.megabytes << 20
    for which in order:
        rules[:] = [{"recorderAddrs": [rec_addr], "enforceRecorder": True}] if which == "recorded" else []
        lat, secs = await session(port, a.lines, flood)
        results[which]["lat"] += lat
        results[which]["tput"].append(flood / secs / (1 << 20))
        await asyncio.sleep(0.2)
    for _ in range(100):
        if rec.active == 0:
            break
        await asyncio.sleep(0.05)
    sizes = [e.size for e in store.list()]
    out = {k: {"line_latency_ms_median": statistics.median(v["lat"]) * 1000,
               "line_latency_ms_p90": sorted(v["lat"])[int(len(v["lat"]) * 0.9)] * 1000,
               "stdout_MiB_per_s_median": statistics.median(v["tput"])} for k, v in results.items()}
    out["recording_bytes_median"] = statistics.median(sizes) if sizes else 0
    for s in (ps, rs, api):
        s.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recording")
    p.add_argument("--lines", type=int, default=300)
    p.add_argument("--megabytes", type=int, default=20)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json")
    a = p.parse_args(argv)
    out = asyncio.run(main_async(a))
    for k in ("recorded", "not recorded"):
        v = out[k]
        print(f"{k:>13}: line round trip median {v['line_latency_ms_median']:.2f} ms "
              f"(p90 {v['line_latency_ms_p90']:.2f} ms), stdout {v['stdout_MiB_per_s_median']:.1f} MiB/s")
    rec, plain = out["recorded"], out["not recorded"]
    print(f"added latency per line: {rec['line_latency_ms_median'] - plain['line_latency_ms_median']:.2f} ms; "
          f"throughput recorded / not recorded: "
          f"{rec['stdout_MiB_per_s_median'] / plain['stdout_MiB_per_s_median']:.2f}x; "
          f"a recording of one session: {out['recording_bytes_median'] / (1 << 20):.1f} MiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
