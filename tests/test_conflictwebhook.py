"""The lab's conflict-injecting admission webhook (labtools.conflictwebhook): its decisions, and its wire format
over HTTPS, without a cluster. The real API server's use of it is in netns-tests/test_realkube_agent_e2e.py."""
from __future__ import annotations

import base64
import json
import ssl
import threading
import urllib.request

from labtools.conflictwebhook import WEBHOOK_NAME, Denier, serve, webhook_configuration


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def review(old: dict | None, new: dict, *, uid: str = "u1", op: str = "UPDATE") -> dict:
    req = {"uid": uid, "operation": op, "name": "px-0", "namespace": "ns",
           "userInfo": {"username": "system:serviceaccount:ns:px"},
           "object": {"metadata": {"name": "px-0"}, "data": {k: b64(v) for k, v in new.items()}}}
    if old is not None:
        req["oldObject"] = {"metadata": {"name": "px-0"}, "data": {k: b64(v) for k, v in old.items()}}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def test_each_new_value_of_a_watched_key_gets_n_conflicts():
    d = Denier({"device_fqdn": 2})
    first = review({"_machinekey": "m"}, {"_machinekey": "m", "device_fqdn": "a.ts.net."})
    answers = [d.review(first) for _ in range(3)]
    assert [a["response"]["allowed"] for a, _ in answers] == [False, False, True]
    resp, rec = answers[0]
    assert resp["response"]["uid"] == "u1"
    assert resp["response"]["status"]["code"] == 409 and resp["response"]["status"]["reason"] == "Conflict"
    assert "device_fqdn (1/2)" in resp["response"]["status"]["message"]
    assert rec == {"operation": "UPDATE", "user": "system:serviceaccount:ns:px", "namespace": "ns", "name": "px-0",
                   "resource": "secrets", "changed": ["device_fqdn"], "allowed": False, "code": 409,
                   "denied": "device_fqdn (1/2)"}
    # tailscaled's keys, and a write that leaves the watched key as it is, pass
    assert d.review(review({"device_fqdn": "a.ts.net."}, {"device_fqdn": "a.ts.net.", "_profiles": "p"}))[0][
        "response"]["allowed"]
    # a new value (a rename) gets its own 2 conflicts; a deletion of the key is not denied
    renamed = review({"device_fqdn": "a.ts.net."}, {"device_fqdn": "b.ts.net."})
    assert [d.review(renamed)[0]["response"]["allowed"] for _ in range(3)] == [False, False, True]
    assert d.review(review({"device_fqdn": "b.ts.net."}, {}))[0]["response"]["allowed"]
    # a CREATE has no old object: every key is new
    assert not d.review(review(None, {"device_fqdn": "c.ts.net."}, op="CREATE"))[0]["response"]["allowed"]
    # values never reach the record or the message
    for _, rec in [d.review(review({}, {"device_fqdn": "secret-value"}))]:
        assert "secret-value" not in json.dumps(rec)


def test_at_random_any_write_is_denied_at_the_rate_given():
    import random
    d = Denier({}, rate=0.25, rng=random.Random(3))
    req = review({}, {"x": "1"})
    req["request"].update(resource={"group": "apps", "version": "v1", "resource": "statefulsets"}, name="ts-a")
    answers = [d.review(req) for _ in range(400)]
    denied = [(a, rec) for a, rec in answers if not a["response"]["allowed"]]
    assert 60 <= len(denied) <= 140
    a, rec = denied[0]
    assert a["response"]["status"]["code"] == 409 and a["response"]["status"]["reason"] == "Conflict"
    assert 'Operation cannot be fulfilled on statefulsets "ts-a"' in a["response"]["status"]["message"]
    assert rec["resource"] == "statefulsets" and rec["denied"] == "at random"
    # the same seed denies the same writes
    again = Denier({}, rate=0.25, rng=random.Random(3))
    assert [again.review(req)[0]["response"]["allowed"] for _ in range(400)] == [
        a["response"]["allowed"] for a, _ in answers]


def test_configuration_for_other_resources_any_name_any_namespace():
    rules = [{"apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
              "resources": ["statefulsets"], "scope": "Namespaced"}]
    w = webhook_configuration("cfg", "https://127.0.0.1:1/validate", b"PEM", namespace=None,
                              username="system:serviceaccount:tailscale:ctl", secret=None, rules=rules)["webhooks"][0]
    assert w["rules"] == rules and "namespaceSelector" not in w
    assert [m["expression"] for m in w["matchConditions"]] == [
        "request.userInfo.username == 'system:serviceaccount:tailscale:ctl'"]


def test_configuration_scopes_the_webhook():
    c = webhook_configuration("cfg", "https://10.99.0.50:8443/validate", b"PEM", namespace="ns",
                              username="system:serviceaccount:ns:px", secret="px-0")
    w = c["webhooks"][0]
    assert w["name"] == WEBHOOK_NAME and w["clientConfig"]["caBundle"] == base64.b64encode(b"PEM").decode()
    assert w["rules"][0]["operations"] == ["CREATE", "UPDATE"] and w["rules"][0]["resources"] == ["secrets"]
    assert w["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ns"}}
    assert [m["expression"] for m in w["matchConditions"]] == [
        "request.userInfo.username == 'system:serviceaccount:ns:px'", "request.name == 'px-0'"]


def test_serves_admission_reviews_over_https(tmp_path):
    from tests.support.kubeapi import make_certs
    certs = make_certs(str(tmp_path / "pki"), ("127.0.0.1",))
    srv = serve("127.0.0.1", 0, certs.cert_path, certs.key_path, Denier({"pod_uid": 1}), str(tmp_path / "r.jsonl"))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        ctx = ssl.create_default_context(cafile=certs.ca_path)
        body = json.dumps(review({}, {"pod_uid": "x"})).encode()
        for _ in range(2):
            req = urllib.request.Request(f"https://127.0.0.1:{srv.server_address[1]}/validate", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
                assert r.status == 200
    finally:
        srv.shutdown()
        srv.server_close()
    lines = [json.loads(ln) for ln in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(ln["allowed"], ln["code"]) for ln in lines] == [(False, 409), (True, 200)]
