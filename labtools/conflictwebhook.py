"""A validating admission webhook for the lab's real Kubernetes that answers 409 Conflict to chosen Secret writes.

The agent's and tailscaled's Secret writes are patches without a resourceVersion, so a real API server applies
them to its latest version and another writer never makes them conflict. A user still meets 409s on them: an
admission webhook (a policy engine, a backup tool's lock) may deny a write with ``code: 409, reason:
Conflict``, and the API server hands that status to the client as it is. This webhook does that on purpose,
so a test can put a real 409 from the real API server in front of the agent, deterministically.

Decision (pure, ``Denier.review``): a write (CREATE or UPDATE; a PATCH is an UPDATE to admission) is denied
when it changes a watched key of the Secret's ``data`` to a value that has been denied fewer than N times so
far (``--deny KEY=N``): each new value of the key gets N conflicts, then passes. So the first writes of
``device_fqdn`` at boot and after a device rename each meet N conflicts, while tailscaled's own keys pass.
Which requests reach the webhook (namespace, user, Secret name) is the ``ValidatingWebhookConfiguration``'s
business (``webhook_configuration``).

At random instead (``--deny-rate R --seed S``): any write that reaches the webhook, of any resource, is denied
with probability R, the generator seeded with S; this is the hostile API server's 409 for the controller
(netns-tests/test_controller_hostile_apiserver.py), whose webhook configuration sends it the controller's
writes of Services (and their status), Secrets and StatefulSets.

Every review is recorded as one JSON line (``--record``): operation, user, namespace, name, the names of the
changed keys, allowed or not, code. Never a value: values are compared through their hashes only.

Run (in the cluster's network namespace, so the API server reaches it on the island address)::

    python -m labtools.conflictwebhook --listen 10.99.0.50:0 --cert c.crt --key c.key \
        --deny device_fqdn=2 --record /path/reviews.jsonl
    # prints {"port": N} once it listens; stops on SIGTERM
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import http.server
import json
import random
import signal
import socketserver
import ssl
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

WEBHOOK_NAME = "conflict.lab.containerboot-py.test"


@dataclass
class Denier:
    """The webhook's state: how many conflicts each watched key gets per new value, and how many it got."""
    deny: Mapping[str, int]
    denied: dict[tuple[str, str], int] = field(default_factory=dict)   # (key, sha256 of value) -> conflicts given
    rate: float = 0.0                    # and at random: the share of all writes denied
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def review(self, review: Mapping[str, Any]) -> tuple[dict, dict]:
        """An AdmissionReview request in, (the AdmissionReview response, the record line) out."""
        req = review.get("request") or {}
        obj = req.get("object") or {}
        old = req.get("oldObject") or {}
        new_data = obj.get("data") or {}
        old_data = old.get("data") or {}
        changed = sorted(k for k in set(new_data) | set(old_data) if new_data.get(k) != old_data.get(k))
        hit = ""
        for key in changed:
            n = self.deny.get(key, 0)
            if key not in new_data or n <= 0:
                continue
            slot = (key, hashlib.sha256(str(new_data[key]).encode()).hexdigest())
            if self.denied.get(slot, 0) < n:
                self.denied[slot] = self.denied.get(slot, 0) + 1
                hit = f"{key} ({self.denied[slot]}/{n})"
                break
        if not hit and self.rate > 0 and self.rng.random() < self.rate:
            hit = "at random"
        res = req.get("resource") or {}
        resource = "/".join(x for x in (res.get("resource"), req.get("subResource")) if x)
        name = req.get("name") or (obj.get("metadata") or {}).get("name") or ""
        resp: dict[str, Any] = {"uid": req.get("uid", ""), "allowed": not hit}
        if hit:
            # The API server returns this status to the client as it is, prefixed with the webhook's name.
            resp["status"] = {"code": 409, "reason": "Conflict", "status": "Failure",
                              "message": f'Operation cannot be fulfilled on {res.get("resource") or "secrets"} '
                                         f'"{name}": the object has been '
                                         f"modified; please apply your changes to the latest version and try again "
                                         f"(lab conflict injection: {hit})"}
        record = {"operation": req.get("operation", ""), "user": (req.get("userInfo") or {}).get("username", ""),
                  "namespace": req.get("namespace", ""), "name": name, "resource": resource or "secrets",
                  "changed": changed, "allowed": not hit,
                  "code": 409 if hit else 200, "denied": hit}
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}, record


def webhook_configuration(name: str, url: str, ca_pem: bytes, *, namespace: str | None, username: str,
                          secret: str | None, timeout_seconds: int = 5,
                          rules: list[dict] | None = None) -> dict:
    """A ValidatingWebhookConfiguration sending CREATE and UPDATE (PATCH included) of one Secret, by one user,
    in one namespace, to url. failurePolicy Fail: a webhook that does not answer is a failed write, never a
    silently skipped test; the scope keeps that away from everything else in the cluster. ``secret=None``: any
    name; ``namespace=None``: any namespace; ``rules``: other resources than Secrets (admission rules)."""
    conditions = [{"name": "user", "expression": f"request.userInfo.username == {username!r}"}]
    if secret is not None:
        conditions.append({"name": "state-secret", "expression": f"request.name == {secret!r}"})
    hook: dict[str, Any] = {
        "name": WEBHOOK_NAME, "admissionReviewVersions": ["v1"], "sideEffects": "None",
        "failurePolicy": "Fail", "timeoutSeconds": timeout_seconds,
        "clientConfig": {"url": url, "caBundle": base64.b64encode(ca_pem).decode()},
        "rules": rules or [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                            "resources": ["secrets"], "scope": "Namespaced"}],
        "matchConditions": conditions,
    }
    if namespace is not None:
        hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name}, "webhooks": [hook]}


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def serve(host: str, port: int, cert: str, key: str, denier: Denier, record_path: str) -> _Server:
    lock = threading.Lock()
    record = open(record_path, "a", buffering=1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:   # http.server's naming
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                review = json.loads(body)
            except ValueError:
                self.send_error(400, "not JSON")
                return
            with lock:
                answer, line = denier.review(review)
                record.write(json.dumps(line) + "\n")
            out = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    srv = _Server((host, port), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    return srv


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT (port 0: pick one, printed)")
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--deny", action="append", default=[], metavar="KEY=N",
                   help="deny the first N writes of each new value of data key KEY with 409 Conflict")
    p.add_argument("--deny-rate", type=float, default=0.0, metavar="R",
                   help="also deny each write that reaches the webhook with probability R (0..1)")
    p.add_argument("--seed", type=int, default=0, help="the seed of --deny-rate's generator")
    p.add_argument("--record", required=True, help="JSON lines, one per review")
    a = p.parse_args(argv)
    deny = {}
    for item in a.deny:
        k, sep, n = item.partition("=")
        if not sep or not n.isdigit():
            p.error(f"--deny {item!r}: expected KEY=N, e.g. device_fqdn=2")
        deny[k] = int(n)
    host, _, port = a.listen.rpartition(":")
    if not 0.0 <= a.deny_rate <= 1.0:
        p.error(f"--deny-rate {a.deny_rate}: expected a share between 0 and 1, e.g. 0.05")
    srv = serve(host.strip("[]"), int(port), a.cert, a.key, Denier(deny, rate=a.deny_rate,
                                                                    rng=random.Random(a.seed)), a.record)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.shutdown).start())
    print(json.dumps({"port": srv.server_address[1]}), flush=True)
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
