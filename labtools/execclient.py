"""kubectl's exec over SPDY/3.1, reduced to what a lab test needs (no kubectl, no cluster):

    python -m labtools.execclient http://100.64.0.7 NAMESPACE POD LINE...

opens `POST /api/v1/namespaces/NAMESPACE/pods/POD/exec?command=sh&stdin=true&stdout=true&tty=true` with
`Upgrade: SPDY/3.1`, creates the error, stdin, stdout and resize streams as kubectl does (header blocks
compressed with the SPDY/3 dictionary), sends the terminal size (80x24), then each LINE on stdin and waits
for the container's answer to it, printing what comes on stdout. A refusal prints the status line and the
body and exits 3.
"""
from __future__ import annotations

import json
import socket
import struct
import sys
import zlib
from urllib.parse import urlsplit

from containerboot.apiproxy.streams import SPDY3_DICTIONARY, SpdySession


def _control(kind: int, payload: bytes) -> bytes:
    return struct.pack(">HHB", 0x8003, kind, 0) + len(payload).to_bytes(3, "big") + payload


def _data(sid: int, payload: bytes) -> bytes:
    return struct.pack(">IB", sid, 0) + len(payload).to_bytes(3, "big") + payload


def main(argv: list[str]) -> int:
    url, ns, pod, *lines = argv
    u = urlsplit(url)
    s = socket.create_connection((u.hostname, u.port or 80), 20)
    s.settimeout(20)
    s.sendall(f"POST /api/v1/namespaces/{ns}/pods/{pod}/exec?command=sh&stdin=true&stdout=true&tty=true "
              f"HTTP/1.1\r\nHost: {u.hostname}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
              "X-Stream-Protocol-Version: v4.channel.k8s.io\r\nContent-Length: 0\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(65536)
        if not chunk:
            break
        head += chunk
    status, _, rest = head.partition(b"\r\n\r\n")
    if not status.startswith(b"HTTP/1.1 101"):
        while chunk := s.recv(65536):
            rest += chunk
        print(status.split(b"\r\n")[0].decode(), rest.decode(errors="replace"), sep="\n")
        return 3
    z = zlib.compressobj(zdict=SPDY3_DICTIONARY)

    def syn(sid: int, kind: str) -> bytes:
        headers = {"streamtype": kind}
        raw = struct.pack(">I", len(headers)) + b"".join(
            struct.pack(">I", len(k)) + k.encode() + struct.pack(">I", len(v)) + v.encode() for k, v in headers.items())
        return _control(1, struct.pack(">IIH", sid, 0, 0) + z.compress(raw) + z.flush(zlib.Z_SYNC_FLUSH))

    parse = SpdySession()
    opening = syn(1, "error") + syn(3, "stdin") + syn(5, "stdout") + syn(7, "resize")
    parse.client(opening)
    s.sendall(opening + _data(7, json.dumps({"Width": 80, "Height": 24}).encode()))
    got = rest
    for line in lines:
        s.sendall(_data(3, line.encode() + b"\n"))
        want = f"out: {line}\n".encode()
        while want not in got:
            chunk = s.recv(65536)
            if not chunk:
                print(got.decode(errors="replace"))
                return 4
            got += chunk
    out = b"".join(e.data for e in parse.server(got) if hasattr(e, "data"))
    sys.stdout.write(out.decode(errors="replace"))
    s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
