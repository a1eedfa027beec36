"""A stand-in Kubernetes API server for the API server proxy's lab test and benchmark (no cluster needed).

    python -m labtools.fakeapiserver --listen 127.0.0.1:6443 --cert server.crt --key server.key [--objects 5000]
    python -m labtools.fakeapiserver --forward 0.0.0.0:8443 --to 127.0.0.1:6443    # a plain TCP forward

HTTPS, HTTP/1.1 keep-alive (http.server, one thread per connection). Answers:
- `GET /api/v1/namespaces/default/pods/small`: a small Pod object (about 600 bytes), the latency probe;
- `GET /api/v1/pods`: a PodList of `--objects` Pods (about 1.5 kB each), the list probe;
- `POST /api/v1/namespaces/<ns>/pods/<pod>/exec` with `Upgrade: SPDY/3.1` (kubectl's exec before 1.31):
  `101`, then a container that answers each stdin chunk (stream 3) with `out: <chunk>` on stdout (stream 5);
  with `--exec-log FILE` each such request's target is appended to FILE first (what "ran in the container");
- anything else: `{"method", "path", "headers": [[name, value], ...]}` of the request as the server saw it
  (what the proxy sent: identity headers included), so a test can check them.

`--forward` is the benchmark's baseline: bytes copied both ways by asyncio, nothing parsed (the same
userspace hop as the proxy, without HTTP).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import ssl
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def pod(i: int) -> dict:
    """A Pod object of a realistic shape and size (about 1.5 kB of JSON)."""
    name = f"web-{i:05d}-7d9f8c6b5-x{i % 97:02d}qz"
    return {"kind": "Pod", "apiVersion": "v1",
            "metadata": {"name": name, "namespace": f"team-{i % 40}", "uid": f"6f1c2a3b-0000-4000-8000-{i:012d}",
                         "resourceVersion": str(100000 + i), "creationTimestamp": "2026-01-01T00:00:00Z",
                         "labels": {"app": "web", "pod-template-hash": "7d9f8c6b5", "tier": "frontend"},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9f8c6b5",
                                              "uid": "11111111-2222-3333-4444-555555555555", "controller": True}]},
            "spec": {"containers": [{"name": "web", "image": "registry.example/web:1.2.3",
                                     "ports": [{"containerPort": 8080, "protocol": "TCP"}],
                                     "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                                     "terminationMessagePath": "/dev/termination-log",
                                     "imagePullPolicy": "IfNotPresent"}],
                     "restartPolicy": "Always", "dnsPolicy": "ClusterFirst", "serviceAccountName": "default",
                     "nodeName": f"node-{i % 12}", "schedulerName": "default-scheduler"},
            "status": {"phase": "Running", "podIP": f"10.244.{i // 250}.{i % 250 + 2}", "hostIP": "10.99.0.50",
                       "conditions": [{"type": t, "status": "True", "lastTransitionTime": "2026-01-01T00:00:05Z"}
                                      for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")],
                       "containerStatuses": [{"name": "web", "ready": True, "restartCount": 0,
                                              "image": "registry.example/web:1.2.3", "started": True}]}}


def make_handler(objects: int, exec_log: str = "") -> type[BaseHTTPRequestHandler]:
    small = json.dumps(pod(0)).encode()
    listing = json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "200000"},
                          "items": [pod(i) for i in range(objects)]}).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # the head and the body are two writes: without this, Nagle holds the body for the client's delayed
        # ACK (40 ms on Linux) and every small answer takes that long
        disable_nagle_algorithm = True

        def _send(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _any(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            path = self.path.split("?")[0]
            if path.endswith("/exec") and self.headers.get("Upgrade", "").lower() == "spdy/3.1":
                self._exec()
            elif path == "/api/v1/namespaces/default/pods/small":
                self._send(small)
            elif path == "/api/v1/pods":
                self._send(listing)
            else:
                self._send(json.dumps({"method": self.command, "path": self.path,
                                       "headers": [[k, v] for k, v in self.headers.items()]}).encode())

        def _exec(self) -> None:
            if exec_log:
                with open(exec_log, "a") as f:
                    f.write(self.path + "\n")
            self.send_response(101)
            self.send_header("Connection", "Upgrade")
            self.send_header("Upgrade", "SPDY/3.1")
            self.end_headers()
            self.wfile.flush()
            self.close_connection = True
            while True:
                head = self.rfile.read(8)
                if len(head) < 8:
                    return
                payload = self.rfile.read(int.from_bytes(head[5:8], "big"))
                if not head[0] & 0x80 and int.from_bytes(head[:4], "big") == 3 and payload:
                    out = b"out: " + payload
                    self.wfile.write((5).to_bytes(4, "big") + b"\0" + len(out).to_bytes(3, "big") + out)
                    self.wfile.flush()

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

        def log_message(self, *args: object) -> None:
            pass

    return Handler


async def forward(listen: str, to: str) -> None:
    lhost, _, lport = listen.rpartition(":")
    thost, _, tport = to.rpartition(":")

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except OSError:
            pass
        finally:
            w.close()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(thost, int(tport))
        except OSError:
            w.close()
            return
        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    srv = await asyncio.start_server(handle, lhost, int(lport))
    print(f"forwarding {listen} to {to}", flush=True)
    async with srv:
        await srv.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labtools.fakeapiserver")
    ap.add_argument("--listen", default="127.0.0.1:6443")
    ap.add_argument("--cert")
    ap.add_argument("--key")
    ap.add_argument("--objects", type=int, default=5000)
    ap.add_argument("--exec-log", default="", help="append each exec request's target to this file")
    ap.add_argument("--forward", help="listen here and copy bytes to --to (no HTTP)")
    ap.add_argument("--to", default="127.0.0.1:6443")
    a = ap.parse_args(argv)
    if a.forward:
        asyncio.run(forward(a.forward, a.to))
        return 0
    if not (a.cert and a.key):
        ap.error("--cert and --key are required to serve")
    host, _, port = a.listen.rpartition(":")
    srv = ThreadingHTTPServer((host.strip("[]"), int(port)), make_handler(a.objects, a.exec_log))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(a.cert, a.key)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.daemon_threads = True
    print(f"listening on {a.listen}", flush=True)
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
