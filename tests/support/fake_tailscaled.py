#!/usr/bin/env python3
"""A stand-in for tailscaled in unit tests: serves a small LocalAPI on a unix socket.

It speaks the parts of the LocalAPI wire contract the agent uses (Host check, no Referer/Origin, the
Tailscale-Cap header, newline-delimited JSON on watch-ipn-bus) and plays a scripted backend: it starts in
FAKE_TS_INITIAL (default NeedsLogin) and goes to Running when the fake `tailscale up` calls
`/localapi/v0/fake/login`. It records its argv and every request in FAKE_TS_DIR. Stdlib only.

Knobs (environment):
  FAKE_TS_DIR        directory for records (required)
  FAKE_TS_INITIAL    initial backend state name
  FAKE_TS_IPS        comma-separated tailnet IPs of the self node (default 100.64.0.5,fd7a:115c:a1e0::5)
  FAKE_TS_NO_SOCKET  never create the socket (to test the boot timeout)
  FAKE_TS_HOLD_STARTING  the login stops in Starting, with the netmap (the node's addresses) already sent, as
                     real tailscaled does while it runs its network check; SIGHUP then moves it to Running
  FAKE_TS_CONFIG_REWRITE  write this text to the --config file right after start (an operator's rewrite
                     landing while the agent boots, after tailscaled has read the old text); written to a
                     temporary file and renamed into place, as kubelet does

Triggers (signals, sent by the test when it is ready for them, never on a timer; the pid is in
FAKE_TS_DIR/tailscaled.pid, written after the handlers are installed):
  SIGUSR1            the backend goes to NeedsLogin (a logout)
  SIGUSR2            exit with status 3 (a crash)
  SIGHUP             Starting -> Running (with FAKE_TS_HOLD_STARTING)
"""
from __future__ import annotations

import json
import os
import signal
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

STATES = ["NoState", "InUseOtherUser", "NeedsLogin", "NeedsMachineAuth", "Stopped", "Starting", "Running"]
CAPVER = 142


class Backend:
    def __init__(self, record_dir: str):
        self.dir = record_dir
        self.lock = threading.Condition()
        self.state = os.environ.get("FAKE_TS_INITIAL", "NeedsLogin")
        self.ips = [ip for ip in os.environ.get("FAKE_TS_IPS", "100.64.0.5,fd7a:115c:a1e0::5").split(",") if ip]
        self.events: list[dict] = []  # broadcast log; watchers follow it by index
        self.serve_config: dict | None = None
        self.serve_etag = 0
        self.prefs = {"AdvertiseServices": None, "WantRunning": True}
        self.has_netmap = self.state in ("Starting", "Running")   # as tailscaled: no netmap before the login

    def self_status(self) -> dict:
        return {"ID": "nStable1", "NodeID": 1, "PublicKey": "nodekey:01", "DNSName": "proxy.tailnet.test.",
                "TailscaleIPs": self.ips if self.state in ("Starting", "Running") else []}

    def initial(self) -> dict:
        return {"Version": "fake", "InitialStatus": {
            "BackendState": self.state, "Self": self.self_status(), "Peer": {},
            "CertDomains": ["proxy.tailnet.test"], "ExtraRecords": None}}

    def set_state(self, state: str) -> None:
        with self.lock:
            if state == "Running" and self.state != "Starting":
                self._netmap()
            if state == "Starting":
                self._netmap()      # tailscaled installs the netmap, then switches to Starting
            self.state = state
            self.events.append({"State": STATES.index(state)})
            self.lock.notify_all()

    def _netmap(self) -> None:
        self.has_netmap = True
        self.events.append({"SelfChange": {
            "ID": 1, "StableID": "nStable1", "Name": "proxy.tailnet.test.", "Key": "nodekey:01",
            "Addresses": [f"{ip}/{128 if ':' in ip else 32}" for ip in self.ips]}})

    def hold_released(self) -> None:
        if self.state == "Starting":
            self.set_state("Running")


BACKEND: Backend


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep test output quiet
        pass

    def _record(self) -> None:
        with open(os.path.join(BACKEND.dir, "requests.log"), "a") as f:
            f.write(json.dumps({"method": self.command, "path": self.path, "host": self.headers.get("Host"),
                                "referer": self.headers.get("Referer"), "origin": self.headers.get("Origin"),
                                "cap": self.headers.get("Tailscale-Cap")}) + "\n")

    def _reply(self, code: int, body: object = None, headers: dict | None = None) -> None:
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        self.send_response(code)
        self.send_header("Tailscale-Cap", str(CAPVER))
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _guard(self) -> bool:
        self._record()
        if self.headers.get("Host") not in ("local-tailscaled.sock", None) or self.headers.get("Referer") \
                or self.headers.get("Origin"):
            self._reply(403, {"Error": "invalid localapi request"})
            return False
        return True

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def do_GET(self):
        if not self._guard():
            return
        path = self.path.split("?")[0]
        if path == "/localapi/v0/watch-ipn-bus":
            return self._watch()
        if path == "/localapi/v0/status":
            return self._reply(200, {"BackendState": BACKEND.state, "Self": BACKEND.self_status()})
        if path == "/localapi/v0/prefs":
            return self._reply(200, BACKEND.prefs)
        if path == "/localapi/v0/dns-config":
            if not BACKEND.has_netmap:
                return self._reply(503, {"error": "no netmap"})
            return self._reply(200, {"CertDomains": ["proxy.tailnet.test"], "ExtraRecords": []})
        if path == "/localapi/v0/serve-config":
            return self._reply(200, BACKEND.serve_config, {"Etag": f'"{BACKEND.serve_etag}"'})
        if path == "/localapi/v0/usermetrics":
            return self._reply(200, b"# TYPE tailscaled_health_messages gauge\ntailscaled_health_messages 0\n")
        self._reply(404, {"Error": "not found"})

    def do_POST(self):
        if not self._guard():
            return
        path = self.path.split("?")[0]
        body = self._body()
        if path == "/localapi/v0/fake/login":
            BACKEND.set_state("Starting" if os.environ.get("FAKE_TS_HOLD_STARTING") else "Running")
            return self._reply(200)
        if path == "/localapi/v0/disconnect-control":
            with open(os.path.join(BACKEND.dir, "disconnected"), "w") as f:
                f.write("1")
            return self._reply(200)
        if path == "/localapi/v0/reload-config":
            with open(os.path.join(BACKEND.dir, "reloads.log"), "a") as f:
                f.write("reload\n")
            return self._reply(200, {"Reloaded": True})
        if path == "/localapi/v0/serve-config":
            if not BACKEND.has_netmap:
                return self._reply(500, {"error": "updating config: netMap is nil"})
            if self.headers.get("If-Match") and self.headers["If-Match"] != f'"{BACKEND.serve_etag}"':
                return self._reply(412, {"error": "etag mismatch"})
            BACKEND.serve_config = json.loads(body or b"{}") or None
            BACKEND.serve_etag += 1
            return self._reply(200)
        self._reply(404, {"Error": "not found"})

    def do_PATCH(self):
        if not self._guard():
            return
        if self.path.split("?")[0] == "/localapi/v0/prefs":
            BACKEND.prefs.update({k: v for k, v in json.loads(self._body() or b"{}").items()
                                  if not k.endswith("Set")})
            return self._reply(200, BACKEND.prefs)
        self._reply(404, {"Error": "not found"})

    def _watch(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Tailscale-Cap", str(CAPVER))
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(obj: dict) -> None:
            line = json.dumps(obj).encode() + b"\n"
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            self.wfile.flush()

        try:
            with BACKEND.lock:
                send(BACKEND.initial())
                i = len(BACKEND.events)
            while True:
                with BACKEND.lock:
                    while i >= len(BACKEND.events):
                        BACKEND.lock.wait(1.0)
                    pending, i = BACKEND.events[i:], len(BACKEND.events)
                for ev in pending:
                    send(ev)
        except (BrokenPipeError, ConnectionResetError):
            return


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def main() -> None:
    global BACKEND
    record_dir = os.environ["FAKE_TS_DIR"]
    os.makedirs(record_dir, exist_ok=True)
    with open(os.path.join(record_dir, "tailscaled.argv"), "w") as f:
        json.dump(sys.argv[1:], f)
    sock = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--socket="))
    BACKEND = Backend(record_dir)
    # Test-driven triggers. The handler runs in the main thread (inside serve_forever's select); the state
    # change takes the backend lock, so it is handed to a thread of its own.
    signal.signal(signal.SIGUSR1,
                  lambda *_: threading.Thread(target=BACKEND.set_state, args=("NeedsLogin",)).start())
    signal.signal(signal.SIGUSR2, lambda *_: os._exit(3))
    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=BACKEND.hold_released).start())
    pid_tmp = os.path.join(record_dir, ".tailscaled.pid.tmp")
    with open(pid_tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_tmp, os.path.join(record_dir, "tailscaled.pid"))  # never seen empty or half-written
    rewrite = os.environ.get("FAKE_TS_CONFIG_REWRITE")
    config = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")), None)
    if rewrite and config:
        tmp = os.path.join(os.path.dirname(config), ".fake-tailscaled-rewrite.tmp")
        with open(tmp, "w") as f:
            f.write(rewrite)
        os.replace(tmp, config)
    if os.environ.get("FAKE_TS_NO_SOCKET"):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(1)   # not a wait: FAKE_TS_NO_SOCKET, a tailscaled that runs without a socket
    if os.path.exists(sock):
        os.unlink(sock)
    server = Server(sock, Handler)

    def stop(*_):
        with open(os.path.join(record_dir, "tailscaled.sigterm"), "w") as f:
            f.write(str(time.time()))
        try:
            os.unlink(sock)
        finally:
            os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    server.serve_forever()


if __name__ == "__main__":
    main()
