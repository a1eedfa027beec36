"""The test Kubernetes API server honours the wire contract: auth, Status objects, resourceVersion semantics,
the three patch types with kube-apiserver's leniencies, RBAC + SSAR, faults, the CLI, and a real tailscaled's
kube state store reading and writing through it."""
from __future__ import annotations

import base64
import json
import os
import pathlib
import shutil
import signal
import ssl
import subprocess
import sys
import time

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.support without pythonpath

from containerboot.kube import secretstate  # noqa: E402
from tests.support.kubeapi import KubeAPIServer, PatchError, apply_json_patch, merge_patch, pod_mount_namespace_argv  # noqa: E402

NS = "tailscale"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
JP = {"Content-Type": "application/json-patch+json"}
MP = {"Content-Type": "application/merge-patch+json"}
SMP = {"Content-Type": "application/strategic-merge-patch+json"}


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


@pytest.fixture
def http(kube_api):
    with httpx.Client(base_url=kube_api.url, verify=kube_api.ssl_context(),
                      headers={"Authorization": "Bearer " + kube_api.token}) as c:
        yield c


def status_of(r: httpx.Response) -> tuple[int, str, int]:
    st = r.json()
    assert st["kind"] == "Status" and st["apiVersion"] == "v1" and st["status"] == "Failure"
    assert st["code"] == r.status_code
    return r.status_code, st.get("reason", ""), st["code"]


# ---- auth, TLS, Status


def test_tls_is_verified_against_its_ca(kube_api):
    with pytest.raises(httpx.ConnectError):
        httpx.get(kube_api.url + "/version")             # system roots don't know our CA
    # the serving cert is valid for kubernetes.default.svc as well as the IPs
    out = subprocess.run(["openssl", "x509", "-in", kube_api.certs.cert_path, "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True, check=True).stdout
    assert "kubernetes.default.svc" in out and "127.0.0.1" in out and "0:0:0:0:0:0:0:1" in out


def test_bearer_token_required(kube_api):
    with httpx.Client(base_url=kube_api.url, verify=kube_api.ssl_context()) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": kube_api.token}):
            r = c.get(SECRETS + "/x", headers=headers)
            assert status_of(r) == (401, "Unauthorized", 401)


def test_not_found_status(http):
    r = http.get(SECRETS + "/missing")
    assert r.json() == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": 'secrets "missing" not found', "reason": "NotFound",
                        "details": {"name": "missing", "kind": "secrets"}, "code": 404}
    assert status_of(http.get("/api/v1/namespaces/x/widgets/y")) == (404, "NotFound", 404)


# ---- CRUD and resourceVersion


def test_create_get_conflicts_and_resource_version(http, kube_api):
    r = http.post(SECRETS, json={"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"},
                                 "data": {"a": b64("1")}, "stringData": {"b": "2"}})
    assert r.status_code == 201
    obj = r.json()
    rv1 = int(obj["metadata"]["resourceVersion"])
    assert obj["data"] == {"a": b64("1"), "b": b64("2")} and "stringData" not in obj and obj["type"] == "Opaque"
    assert obj["metadata"]["uid"] and obj["metadata"]["namespace"] == NS
    r = http.post(SECRETS, json={"metadata": {"name": "s"}})
    assert status_of(r) == (409, "AlreadyExists", 409) and r.json()["details"] == {"name": "s", "kind": "secrets"}
    # PUT with a stale resourceVersion conflicts; without one it is unconditional
    r = http.put(SECRETS + "/s", json={"metadata": {"name": "s", "resourceVersion": "1"}, "data": {}})
    assert status_of(r) == (409, "Conflict", 409)
    r = http.put(SECRETS + "/s", json={"metadata": {"name": "s", "resourceVersion": str(rv1)}, "data": {"c": b64("3")}})
    assert r.status_code == 200
    rv2 = int(r.json()["metadata"]["resourceVersion"])
    assert rv2 > rv1 and r.json()["metadata"]["uid"] == obj["metadata"]["uid"]
    assert kube_api.secret_data("s") == {"c": b"3"}
    r = http.put(SECRETS + "/s", json={"metadata": {"name": "s"}, "data": {"d": b64("4")}})
    assert r.status_code == 200 and int(r.json()["metadata"]["resourceVersion"]) > rv2
    assert status_of(http.put(SECRETS + "/nope", json={"metadata": {"name": "nope"}})) == (404, "NotFound", 404)
    assert status_of(http.put(SECRETS + "/s", json={"metadata": {"name": "other"}}))[0] == 400
    # a no-op patch does not bump the resourceVersion (etcd3 storage skips it)
    rv = kube_api.secret("s")["metadata"]["resourceVersion"]
    assert (
        http.patch(SECRETS + "/s", json={"data": {"d": b64("4")}}, headers=MP).json()["metadata"]["resourceVersion"]
        == rv
    )
    assert http.delete(SECRETS + "/s").json()["status"] == "Success"
    assert status_of(http.delete(SECRETS + "/s")) == (404, "NotFound", 404)


def test_secret_validation(http):
    assert status_of(http.post(SECRETS, json={"metadata": {"name": "a"}, "data": {"bad/key": b64("x")}}))[:2] == (
        422,
        "Invalid",
    )
    assert status_of(http.post(SECRETS, json={"metadata": {"name": "a"}, "data": {"k": "%%%"}}))[0] == 400
    assert status_of(http.post(SECRETS, json={"metadata": {}}))[:2] == (422, "Invalid")
    big = base64.b64encode(b"x" * (1024 * 1024 + 1)).decode()
    assert status_of(http.post(SECRETS, json={"metadata": {"name": "a"}, "data": {"k": big}}))[0] == 422
    r = http.post(SECRETS, json={"metadata": {"name": "empty"}})
    assert "data" not in r.json()                      # empty data is omitted, as the real server does


def test_list_with_label_selector(http, kube_api):
    kube_api.put_secret("a", labels={"tailscale.com/secret-type": "certs", "x": "1"})
    kube_api.put_secret("b", labels={"x": "2"})
    r = http.get(SECRETS, params={"labelSelector": "tailscale.com/secret-type=certs"})
    assert r.json()["kind"] == "SecretList" and [i["metadata"]["name"] for i in r.json()["items"]] == ["a"]
    assert [i["metadata"]["name"] for i in http.get(SECRETS, params={"labelSelector": "x!=1"}).json()["items"]] == ["b"]
    assert len(http.get(SECRETS).json()["items"]) == 2


# ---- patches


def test_json_patch_like_kube_apiserver(http, kube_api):
    kube_api.put_secret("s")  # no data at all
    r = http.patch(
        SECRETS + "/s", content=json.dumps([{"op": "add", "path": "/data/k", "value": b64("v")}]), headers=JP
    )
    assert status_of(r)[:2] == (422, "Invalid")  # parent /data is missing
    r = http.patch(
        SECRETS + "/s", content=json.dumps([{"op": "add", "path": "/data", "value": {"k": b64("v")}}]), headers=JP
    )
    assert r.status_code == 200 and kube_api.secret_data("s") == {"k": b"v"}
    # replace of an absent key under an existing object is accepted (evanphx/json-patch v4, defect 29)
    r = http.patch(
        SECRETS + "/s",
        content=json.dumps([{"op": "replace", "path": "/data/egress-services", "value": b64("{}")}]),
        headers=JP,
    )
    assert r.status_code == 200 and kube_api.secret_data("s")["egress-services"] == b"{}"
    r = http.patch(SECRETS + "/s", content=json.dumps([{"op": "remove", "path": "/data/authkey"}]), headers=JP)
    assert status_of(r)[:2] == (422, "Invalid")
    r = http.patch(SECRETS + "/s", content=json.dumps([{"op": "test", "path": "/data/k", "value": b64("v")},
                                                       {"op": "remove", "path": "/data/k"}]), headers=JP)
    assert r.status_code == 200 and "k" not in kube_api.secret_data("s")
    r = http.patch(SECRETS + "/s", content=json.dumps([{"op": "test", "path": "/data/egress-services", "value": "no"},
                                                       {"op": "remove", "path": "/data/egress-services"}]), headers=JP)
    assert r.status_code == 422 and "egress-services" in kube_api.secret_data("s")    # atomic
    rv = kube_api.secret("s")["metadata"]["resourceVersion"]
    r = http.patch(
        SECRETS + "/s",
        content=json.dumps(
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                {"op": "add", "path": "/data/x", "value": b64("1")},
            ]
        ),
        headers=JP,
    )
    assert r.status_code == 200
    r = http.patch(
        SECRETS + "/s",
        content=json.dumps(
            [
                {"op": "replace", "path": "/metadata/resourceVersion", "value": rv},
                {"op": "add", "path": "/data/y", "value": b64("1")},
            ]
        ),
        headers=JP,
    )
    assert status_of(r)[:2] == (409, "Conflict")
    assert status_of(http.patch(SECRETS + "/s", content="{}", headers=JP))[0] == 400
    assert status_of(http.patch(SECRETS + "/nope", content="[]", headers=JP))[:2] == (404, "NotFound")


def test_merge_and_strategic_merge_patch(http, kube_api):
    kube_api.put_secret("s", {"a": b"1", "b": b"2"})
    created = kube_api.secret("s")["metadata"]["creationTimestamp"]
    # exactly what upstream's Go client sends: name, namespace, a zero creationTimestamp, base64 or null
    body = {"metadata": {"name": "s", "namespace": NS, "creationTimestamp": "0001-01-01T00:00:00Z"},
            "data": {"a": None, "c": b64("3")}}
    r = http.patch(SECRETS + "/s", params={"fieldManager": "tailscale-container"}, json=body, headers=SMP)
    assert r.status_code == 200
    assert kube_api.secret_data("s") == {"b": b"2", "c": b"3"}
    assert kube_api.secret("s")["metadata"]["creationTimestamp"] == created
    r = http.patch(SECRETS + "/s", json={"data": {"b": None}}, headers=MP)
    assert r.status_code == 200 and kube_api.secret_data("s") == {"c": b"3"}
    r = http.patch(SECRETS + "/s", json={"metadata": {"resourceVersion": "5"}, "data": {"d": b64("4")}}, headers=SMP)
    assert status_of(r)[:2] == (409, "Conflict")
    r = http.patch(SECRETS + "/s", json={"metadata": {"namespace": "other"}}, headers=SMP)
    assert status_of(r)[0] == 400
    r = http.patch(SECRETS + "/s", content="apiVersion: v1", headers={"Content-Type": "application/apply-patch+yaml"})
    assert status_of(r)[:2] == (415, "UnsupportedMediaType")
    r = http.patch(SECRETS + "/s", json={}, headers={"Content-Type": "application/json"})
    assert status_of(r)[0] == 415
    assert status_of(http.patch(SECRETS + "/s", json={"data": {"k": "%%"}}, headers=MP))[0] == 400


def test_patch_helpers_unit():
    doc = {"a": {"b": [1, 2]}}
    assert apply_json_patch(doc, [{"op": "add", "path": "/a/b/-", "value": 3}]) == {"a": {"b": [1, 2, 3]}}
    assert apply_json_patch(doc, [{"op": "move", "from": "/a/b", "path": "/c"}]) == {"a": {}, "c": [1, 2]}
    assert apply_json_patch(doc, [{"op": "copy", "from": "/a", "path": "/x~1y"}])["x/y"] == {"b": [1, 2]}
    with pytest.raises(PatchError):
        apply_json_patch(doc, [{"op": "test", "path": "/a/b/0", "value": True}])   # 1 is not true in JSON
    with pytest.raises(PatchError):
        apply_json_patch(doc, [{"op": "replace", "path": "/a/b/5", "value": 0}])
    assert merge_patch({"a": {"x": 1, "y": 2}}, {"a": {"$patch": "replace", "z": 3}}, strategic=True) == {"a": {"z": 3}}
    assert merge_patch({"a": {"x": 1}, "b": 1}, {"a": {"$patch": "delete"}}, strategic=True) == {"b": 1}


# ---- RBAC and SSAR


def ssar(http, verb, resource="secrets", name="", ns=NS):
    attrs = {"namespace": ns, "verb": verb, "resource": resource}
    if name:
        attrs["name"] = name
    r = http.post("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                  json={"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                        "spec": {"resourceAttributes": attrs}})
    assert r.status_code == 201 and r.json()["kind"] == "SelfSubjectAccessReview"
    return r.json()["status"]["allowed"]


def test_rbac_rules_drive_403_and_ssar(http, kube_api):
    kube_api.put_secret("s")
    kube_api.set_rules([(["get", "update"], "secrets", ["s"]), (["create"], "events", [])])
    assert http.get(SECRETS + "/s").status_code == 200
    r = http.patch(SECRETS + "/s", json={"data": {}}, headers=MP)
    assert status_of(r)[:2] == (403, "Forbidden")
    assert r.json()["message"] == ('secrets "s" is forbidden: User "system:serviceaccount:tailscale:tailscale" cannot '
                                   'patch resource "secrets" in API group "" in the namespace "tailscale"')
    assert status_of(http.get(SECRETS + "/other"))[0] == 403
    assert ssar(http, "get", name="s") and ssar(http, "update", name="s")
    assert not ssar(http, "patch", name="s") and not ssar(http, "get", name="other")
    assert ssar(http, "create", "events") and not ssar(http, "create", "events", ns="default")
    # RBAC quirk: a resourceNames rule answers an SSAR for create-by-name, but never authorises the create itself
    kube_api.set_rules([(["create"], "secrets", ["new"])])
    assert ssar(http, "create", name="new")
    assert status_of(http.post(SECRETS, json={"metadata": {"name": "new"}}))[:2] == (403, "Forbidden")
    kube_api.set_rules([(["*"], "*", [])])
    assert http.post(SECRETS, json={"metadata": {"name": "new"}}).status_code == 201


def test_events_resource(http):
    ev = {"metadata": {"name": "pod.reason", "namespace": NS}, "reason": "R", "count": 1}
    assert http.post(f"/api/v1/namespaces/{NS}/events", json=ev).status_code == 201
    r = http.patch(f"/api/v1/namespaces/{NS}/events/pod.reason", headers=JP,
                   content=json.dumps([{"op": "replace", "path": "/count", "value": 2},
                                       {"op": "replace", "path": "/lastTimestamp", "value": "2026-01-01T00:00:00Z"}]))
    assert r.status_code == 200 and r.json()["count"] == 2


# ---- faults and the request log


def test_faults_and_request_log(http, kube_api):
    kube_api.put_secret("s")
    kube_api.fail(500, count=2, method="GET")
    kube_api.fail(429, retry_after=3)
    assert status_of(http.get(SECRETS + "/s"))[0] == 500
    assert http.patch(SECRETS + "/s", json={}, headers=MP).headers["Retry-After"] == "3"   # 429 matches any method
    assert status_of(http.get(SECRETS + "/s"))[0] == 500
    assert http.get(SECRETS + "/s").status_code == 200
    kube_api.drop(1)
    with pytest.raises(httpx.RemoteProtocolError):
        http.get(SECRETS + "/s")
    assert http.get(SECRETS + "/s").status_code == 200
    kube_api.latency = 0.3
    t0 = time.monotonic()
    http.get(SECRETS + "/s")
    assert time.monotonic() - t0 >= 0.3
    kube_api.latency = 0
    log = [(r.method, r.verb, r.status) for r in kube_api.requests]
    assert log == [("GET", "get", 500), ("PATCH", "patch", 429), ("GET", "get", 500), ("GET", "get", 200),
                   ("GET", "get", 0), ("GET", "get", 200), ("GET", "get", 200)]
    assert kube_api.requests[1].content_type == "application/merge-patch+json"


def test_ipv6_listen(tmp_path):
    try:
        with KubeAPIServer(host="::1", workdir=str(tmp_path / "w")) as api:
            r = httpx.get(api.url + "/version", verify=api.ssl_context(),
                          headers={"Authorization": "Bearer " + api.token})
            assert api.url.startswith("https://[::1]:") and r.status_code == 200
    except OSError as e:
        pytest.skip(f"no IPv6 loopback: {e}")


# ---- CLI


def test_cli(tmp_path):
    d = tmp_path / "sa"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.kubeapi", "--listen", "127.0.0.1:0", "--dir", str(d),
                             "--namespace", "ns1", "--secret", "pre", "--rules", '[[["get"], "secrets", []]]'],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert (d / "namespace").read_text() == "ns1" and (d / "url").read_text() == info["url"]
        token = (d / "token").read_text()
        with httpx.Client(
            base_url=info["url"],
            verify=ssl.create_default_context(cafile=str(d / "ca.crt")),
            headers={"Authorization": "Bearer " + token},
        ) as c:
            assert c.get("/api/v1/namespaces/ns1/secrets/pre").status_code == 200
            assert c.patch("/api/v1/namespaces/ns1/secrets/pre", json={}, headers=MP).status_code == 403
            # the /_test/ endpoints steer a server in another process
            assert c.put("/_test/rules", json=None).status_code == 200
            assert (
                c.patch("/api/v1/namespaces/ns1/secrets/pre", json={"data": {"a": b64("1")}}, headers=MP).status_code
                == 200
            )
            assert c.post("/_test/faults", json={"kind": "status", "status": 503}).status_code == 200
            assert c.get("/api/v1/namespaces/ns1/secrets/pre").status_code == 503
            assert [r["status"] for r in c.get("/_test/requests").json()][-1] == 503
        assert info["env"]["KUBERNETES_SERVICE_PORT_HTTPS"] == str(info["port"])
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    state = json.loads((d / "state.json").read_text())
    assert state["objects"][0]["data"] == {"a": b64("1")} and len(state["requests"]) == 4


# ---- a real tailscaled's kube state store


def _tailscale_bin_dir() -> str | None:
    d = os.environ.get("TS_BIN_DIR")
    if not d:
        try:
            d = subprocess.run(["bash", str(ROOT / "scripts/install-binaries.sh"), "--print-dir"], capture_output=True,
                               text=True, timeout=10).stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError, IndexError):
            return None
    return d if d and os.access(os.path.join(d, "tailscaled"), os.X_OK) else None


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


@pytest.mark.e2e
@pytest.mark.parametrize("scenario", ["no-secret", "empty-secret", "secret-with-data", "no-patch-permission"])
def test_real_tailscaled_kube_store(tmp_path, scenario):
    bindir = _tailscale_bin_dir()
    if bindir is None or not _can_unshare():
        why = "needs the built tailscaled (scripts/install-binaries.sh) and root for a mount namespace"
        if os.environ.get("CI"):     # CI builds the binaries and runs as root: a skip there would hide a break
            pytest.fail(f"CI is set, so this test must run, but it {why}")
        pytest.skip(why)
    rules = [(["get", "update", "create"], "secrets", [])] if scenario == "no-patch-permission" else None
    with KubeAPIServer(namespace=NS, rules=rules, workdir=str(tmp_path / "w")) as api:
        sa = api.write_sa_dir(tmp_path / "sa")
        if scenario == "empty-secret":
            api.put_secret("ts-state")
        elif scenario in ("secret-with-data", "no-patch-permission"):
            api.put_secret("ts-state", {"pod_uid": b"u0"})
        sock = str(tmp_path / "ts.sock")
        argv = [os.path.join(bindir, "tailscaled"), "--state=kube:ts-state", f"--statedir={tmp_path / 'st'}",
                f"--socket={sock}", "--tun=userspace-networking", "--port=0", "--no-logs-no-support"]
        env = {**os.environ, **api.env(), "TS_LOGS_DIR": str(tmp_path / "logs")}
        env.pop("POD_NAME", None)
        logf = open(tmp_path / "tailscaled.log", "wb")
        proc = subprocess.Popen(pod_mount_namespace_argv(argv, sa), env=env, stdout=logf, stderr=subprocess.STDOUT)
        def log_tail() -> str:
            return (tmp_path / "tailscaled.log").read_text(errors="replace")[-3000:]

        try:
            # Ready when the LocalAPI answers (the socket file exists before tailscaled serves on it).
            deadline = time.monotonic() + 60
            while True:
                st = subprocess.run([os.path.join(bindir, "tailscale"), f"--socket={sock}", "status", "--json"],
                                    capture_output=True, text=True, timeout=30)
                if st.returncode == 0 and '"BackendState"' in st.stdout:
                    break
                assert proc.poll() is None, f"tailscaled exited with status {proc.returncode}:\n{log_tail()}"
                assert time.monotonic() < deadline, \
                    f"tailscaled's LocalAPI never answered: {st.stderr[-500:]}\n{log_tail()}"
                time.sleep(0.2)   # poll: until tailscaled's LocalAPI answers (deadline asserted above)
            # Trigger state writes (machine key, prefs) without a reachable control server. `up` itself fails
            # (nothing answers at the login server), but it must have reached tailscaled: retry only a failure
            # to talk to the local tailscaled.
            for _ in range(5):
                up = subprocess.run([os.path.join(bindir, "tailscale"), f"--socket={sock}", "up",
                                     "--login-server=http://127.0.0.1:9", "--timeout=2s"],
                                    capture_output=True, text=True, timeout=60)
                unreached = "failed to connect to local tailscaled" in up.stderr.lower() \
                    or "failed to connect to local tailscale daemon" in up.stderr.lower()
                if not unreached:
                    break
                time.sleep(0.5)   # poll: retries `up` while tailscaled is not reachable yet
            assert not unreached, f"`tailscale up` never reached tailscaled: {up.stderr}\n{log_tail()}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "_machinekey" not in (api.secret_data("ts-state") or {}):
                time.sleep(0.1)   # poll: until tailscaled wrote its machine key
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            logf.close()
        data = api.secret_data("ts-state")
        log = [(r.method, r.verb, r.resource, r.content_type, r.status) for r in api.requests]
        why = (tmp_path / "tailscaled.log").read_text(errors="replace")[-3000:] + "\n" + "\n".join(map(str, log))
        assert data is not None and data.get("_machinekey"), why
        assert secretstate.is_consistent(data), why
        assert all(status in (200, 201, 404) for *_, status in log), why
        # CheckSecretPermissions: SSARs for get, update, patch, create on the Secret
        verbs = [r.json()["spec"]["resourceAttributes"]["verb"] for r in api.requests
                 if r.resource == "selfsubjectaccessreviews"
                 and r.json()["spec"]["resourceAttributes"]["resource"] == "secrets"]
        assert verbs[:4] == ["get", "update", "patch", "create"], why
        writes = [(m, ct) for m, v, res, ct, s in log if res == "secrets" and v in ("create", "patch", "update")]
        if scenario == "no-secret":
            assert writes[0] == ("POST", "application/json"), why
        elif scenario == "no-patch-permission":
            assert writes and all(m == "PUT" for m, _ in writes), why
            assert data["pod_uid"] == b"u0"
        else:
            assert writes and all(ct == "application/json-patch+json" for _, ct in writes), why
            ops = [op for r in api.requests if r.verb == "patch" and r.resource == "secrets" for op in r.json()]
            if scenario == "empty-secret":
                assert ops[0]["path"] == "/data" and ops[0]["op"] == "add", why
            else:
                assert all(op["path"].startswith("/data/") for op in ops), why
                assert data["pod_uid"] == b"u0"
