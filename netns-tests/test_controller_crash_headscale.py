"""Crash consistency of the controller against a real headscale: SIGKILL just before each write of a proxy's
life, then a new controller process carries on.

The life is tests/test_controller_crash.py's, with the real parts where the control plane is concerned: each
pass is a process (netns-tests/controller_pass.py) on the island, its parents and StatefulSets in an in-memory
API saved after each write, the proxy's Secret in the test API server, and every key minted and device deleted
by the headscale provider over headscale's REST API. The proxy logging in is a real tailscaled (userspace, state
in memory) using the key from the Secret's config; what the agent would then write (`device_id` and the rest,
`reissue_authkey`) is patched into the Secret as the agent patches it. The life: a Service asks for a proxy; the
proxy logs in (node n1) and is ready; its key is rejected and it asks for another (the controller deletes n1 and
mints a key); it logs in again (n2); the Service's `tailscale.com/tags` change (the controller re-tags n2); the
Service is deleted and the controller removes everything.

A clean life with CB_TEST_CRASH_LOG lists every crash point of every pass (tscommon/crashpoint.py: `kube-write`,
`key-mint`, `device-delete`, `device-tags`; the controller never approves routes).
Then a life per point: the pass is killed there, the next pass is a new process, the life goes on. Asserted
from headscale itself, whatever the point:
* no device left behind: n1 is gone once the reissue pass converged, nothing is left at the end;
* no duplicate device: one node of the proxy's name after each login;
* the re-tag lands: n2 carries the new tags at headscale once the pass converged;
* no second key for the same proxy: exactly one minted key per login, used by it, plus one unused key only
  when the process died between minting a key and storing it in the Secret (documented: single-use, never
  given to a proxy, it expires within the hour);
* nothing left in Kubernetes: the Service released and gone, no child object, no Secret.

`make test` tries one point of the clean life's enumeration (`LIFE_POINTS`), drawn from the run's seed (CB_SEED,
printed: each run tries another, `CB_SEED=<n>` replays one); `make crash` (CB_CRASH_ALL=1) runs the clean life,
checks that its enumeration is still `LIFE_POINTS`, and tries every point.
"""
from __future__ import annotations

import base64
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import kubelab
import pytest

from controller.model import ANN_TAGS, Parent
from controller.render import base_name
from labtools.lab import stop_process, wait_until
from tests.support import seed

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(3600)]

REPO = str(pathlib.Path(__file__).resolve().parents[1])
HERE = str(pathlib.Path(__file__).resolve().parent)
HOST = "apps-web"            # the proxy's hostname, <namespace>-<name> of the Service
CRASH_ALL = os.environ.get("CB_CRASH_ALL", "") not in ("", "0")
RETAGGED = ("tag:k8s", "tag:web")
#: headscale refuses tags through its API unless its policy's tagOwners define them (test_controller_headscale)
POLICY = {"tagOwners": {"tag:k8s": ["e2e@"], "tag:web": ["tag:k8s"]},
          "acls": [{"action": "accept", "src": ["*"], "dst": ["*:*"]}]}


@pytest.fixture(scope="module")
def api_key(lab) -> str:
    out = lab.hs("apikeys", "create", "--expiration", "2h")
    return out if isinstance(out, str) else str(out.get("key") or out)


def _points(path: pathlib.Path) -> list[str]:
    if not path.exists():
        return []
    return [f"{name}:{n}" for name, n in (line.split() for line in path.read_text().splitlines())]


def _tagged_keys(lab) -> list[dict]:
    return [k for k in lab.hs("preauthkeys", "list") or [] if "tag:k8s" in (k.get("acl_tags") or k.get("aclTags")
                                                                         or [])]


class Life:
    """One proxy's life, its passes each a process; `crash` = (pass number, point) kills that pass there."""

    def __init__(self, lab, api_key: str, tag: str, *, crash: tuple[int, str] | None = None,
                 log_points: bool = False) -> None:
        self.lab, self.api_key, self.tag, self.crash, self.log_points = lab, api_key, tag, crash, log_points
        self.api = kubelab.KubeAPI.start(lab, f"ctlcrash-{tag}")
        self.state = lab.run_dir / f"ctlcrash-{tag}.json"
        self.uid = str(uuid.uuid4())
        self.secret = base_name(Parent("svc", "web", "apps", self.uid)) + "-0"
        self.passes = 0
        self.points: list[list[str]] = []          # per pass, when logging
        self.killed: list[str] = []
        self.crashed_between_mint_and_store = False
        self.stored: set[str] = set()              # every key seen in the proxy's Secret
        self.registered: list[tuple[str, str]] = []     # (node ID, key)
        self.key_floor = max([int(k["id"]) for k in _tagged_keys(lab)] or [0])
        self.procs: list[subprocess.Popen] = []

    # ---- the in-memory API's objects
    def objects(self) -> dict:
        return {tuple(k): v for k, v in json.loads(self.state.read_text())} if self.state.exists() else {}

    def write(self, objects: dict) -> None:
        self.state.write_text(json.dumps([[list(k), v] for k, v in objects.items()]))

    def gc(self) -> None:
        """The garbage collector: objects marked for deletion without finalizers go."""
        objs = self.objects()
        self.write({k: v for k, v in objs.items()
                    if not (v["metadata"].get("deletionTimestamp") and not v["metadata"].get("finalizers"))})

    # ---- headscale
    def keys(self) -> list[dict]:
        return [k for k in _tagged_keys(self.lab) if int(k["id"]) > self.key_floor]

    def nodes(self) -> list[dict]:
        return kubelab.hs_nodes_named(self.lab, HOST)

    # ---- the controller
    def pass_(self) -> dict | None:
        """One pass in a new process; None when it was killed at the crash point."""
        i = self.passes
        self.passes += 1
        env = {"PYTHONPATH": REPO, "SA_DIR": str(self.api.dir), "PROXY_NS": "tailscale",
               "HS_URL": self.lab.login_server, "HS_API_KEY": self.api_key}
        log = self.lab.run_dir / f"ctlcrash-{self.tag}-points-{i}"
        if self.log_points:
            env["CB_TEST_CRASH_LOG"] = str(log)
        crash_here = self.crash is not None and self.crash[0] == i
        if crash_here:
            assert self.crash is not None
            env["CB_TEST_CRASH_AT"] = self.crash[1]
        cp = self.lab.exec("client", [sys.executable, f"{HERE}/controller_pass.py", str(self.state), "svc", "apps",
                                      "web"], timeout=60, env=env)
        self._note_stored()
        if self.log_points:
            self.points.append(_points(log))
        if crash_here:
            assert cp.returncode == -signal.SIGKILL, \
                f"pass {i} did not stop at {self.crash}: exit {cp.returncode}\n{cp.stdout[-2000:]}{cp.stderr[-2000:]}"
            self.killed.append(f"{i}/{self.crash[1]}")    # type: ignore[index]
            if len(self.keys()) > len(self.stored):
                self.crashed_between_mint_and_store = True
            return None
        assert cp.returncode == 0, cp.stderr[-3000:]
        out = json.loads(cp.stdout.strip().splitlines()[-1])
        assert "error" not in out, (i, out)
        return out

    def converge(self) -> dict:
        """A pass to its end; a killed one is followed by a new process (nothing remembered)."""
        for _ in range(3):
            out = self.pass_()
            self.gc()
            if out is not None:
                return out
        raise AssertionError("no convergence")

    def _note_stored(self) -> None:
        conf = (self.api.secret_data(self.secret) or {}).get("cap-107.hujson")
        if conf:
            key = json.loads(conf).get("AuthKey")
            if key:
                self.stored.add(key)

    # ---- the proxy
    def agent_patch(self, data: dict[str, str | None]) -> None:
        """A merge patch of the Secret's data with the ServiceAccount's token, as the agent writes it."""
        body = {"data": {k: None if v is None else base64.b64encode(v.encode()).decode() for k, v in data.items()}}
        token = (self.api.dir / "token").read_text().strip()
        cp = self.lab.exec("hs", ["curl", "-sS", "-g", "--noproxy", "*", "-m", "10", "--cacert",
                                  str(self.api.dir / "ca.crt"), "-X", "PATCH", "-H", f"Authorization: Bearer {token}",
                                  "-H", "Content-Type: application/merge-patch+json", "--data-binary",
                                  json.dumps(body), "-o", "/dev/null", "-w", "%{http_code}",
                                  f"{self.api.url}/api/v1/namespaces/tailscale/secrets/{self.secret}"], timeout=15)
        assert cp.stdout.strip() == "200", (cp.stdout, cp.stderr)

    def login(self) -> str:
        """The proxy logs in with the key in its config (a fresh machine: a new node); its ID."""
        conf = json.loads(self.api.secret_data(self.secret)["cap-107.hujson"])
        key = conf["AuthKey"]
        n = len(self.registered) + 1
        d = self.lab.run_dir / f"ctlcrash-{self.tag}-n{n}"
        (d / "logs").mkdir(parents=True)
        sock = d / "tailscaled.sock"
        argv = ["tailscaled", "--state=mem:", f"--statedir={d}", f"--socket={sock}", "--tun=userspace-networking",
                "--port=0", "--no-logs-no-support"]
        p = self.lab._popen("node", f"ctlcrash-{self.tag}-n{n}", "client", argv,
                            self.lab.tailscaled_env(d, d / "logs"), d / "tailscaled.log")
        self.procs.append(p)
        wait_until(sock.exists, 30, 0.1, "tailscaled socket")
        self.lab.ts(str(sock), "up", f"--login-server={self.lab.login_server}", f"--auth-key={key}",
                    f"--hostname={HOST}", "--accept-dns=false", "--timeout=45s", timeout=60)
        me = self.lab.status(str(sock))["Self"]
        self.stop_proc(p)
        self.registered.append((me["ID"], key))
        self.agent_patch({"device_id": me["ID"], "device_fqdn": me["DNSName"],
                          "device_ips": json.dumps(me["TailscaleIPs"]), "tailscale_capver": "107", "pod_uid": "u"})
        return me["ID"]

    @staticmethod
    def stop_proc(p: subprocess.Popen) -> None:
        stop_process(p, timeout=15)

    # ---- the whole life
    def run(self) -> None:
        self.write({("services", "apps", "web"): {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "apps", "uid": self.uid, "resourceVersion": "1",
                         "generation": 1, "annotations": {"tailscale.com/expose": "true"}},
            "spec": {"type": "ClusterIP", "clusterIP": self.lab.backend_ipv4, "clusterIPs": [self.lab.backend_ipv4],
                     "ipFamilies": ["IPv4"], "ports": [{"port": 8080}]}}})
        self.converge()
        n1 = self.login()
        assert [str(n["id"]) for n in self.nodes()] == [n1], self.nodes()
        objs = self.objects()
        objs[("statefulsets", "tailscale", base_name(Parent("svc", "web", "apps", self.uid)))]["status"] = {
            "readyReplicas": 1}
        self.write(objs)
        self.converge()
        # The key is rejected: the proxy asks for a new one; the controller deletes n1 and mints a key.
        old = self.registered[-1][1]
        self.agent_patch({"reissue_authkey": old})
        self.converge()
        assert self.nodes() == [], f"n1 left behind after the reissue: {self.nodes()}"
        self.agent_patch({"reissue_authkey": None, "device_id": None})
        n2 = self.login()
        assert [str(n["id"]) for n in self.nodes()] == [n2], self.nodes()
        self.converge()
        # The Service's tags change: the controller re-tags the device (headscale takes tags its policy's
        # tagOwners define).
        with self.lab.hs_policy(POLICY):
            objs = self.objects()
            objs[("services", "apps", "web")]["metadata"]["annotations"][ANN_TAGS] = ",".join(RETAGGED)
            self.write(objs)
            self.converge()
            (node,) = self.nodes()
            assert str(node["id"]) == n2 and sorted(node.get("tags") or []) == list(RETAGGED), node
        # The Service goes.
        objs = self.objects()
        objs[("services", "apps", "web")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        self.write(objs)
        for _ in range(6):
            self.converge()
            if ("services", "apps", "web") not in self.objects():
                break

    def check(self) -> None:
        where = f"killed at {self.killed}"
        assert self.objects() == {}, f"{where}: objects left: {sorted(self.objects())}"
        assert [o for o in self.api.objects() if o.get("kind") == "Secret"] == [], where
        assert self.nodes() == [], f"{where}: devices left at headscale: {self.nodes()}"
        used = [k for _, k in self.registered]
        assert len(used) == len(set(used)) == 2, (where, self.registered)
        keys = self.keys()
        assert sum(1 for k in keys if k.get("used")) == 2, (where, keys)
        extra = len(keys) - 2
        assert extra == (1 if self.crashed_between_mint_and_store else 0), (where, keys, len(self.stored))

    def close(self) -> None:
        for p in self.procs:
            self.stop_proc(p)
        self.api.stop()
        for n in self.nodes():
            self.lab.hs("nodes", "delete", "--identifier", str(n["id"]), "--force")


#: The crash points of the clean life, per pass (what `make crash` enumerates; it fails when they change, so that
#: the suite's sample is drawn from the life as it is).
LIFE_POINTS = (
    ("kube-write:1", "key-mint:1", *(f"kube-write:{n}" for n in range(2, 9))),
    ("kube-write:1", "kube-write:2"),
    ("device-delete:1", "key-mint:1", "kube-write:1"),
    ("kube-write:1",),
    ("device-tags:1",),
    ("kube-write:1",),
    ("device-delete:1", *(f"kube-write:{n}" for n in range(1, 7))),
)


def test_controller_killed_at_each_write_converges_at_headscale(lab, api_key) -> None:
    timings = {}
    cases = [(i, p) for i, pts in enumerate(LIFE_POINTS) for p in pts]
    if CRASH_ALL:
        t0 = time.monotonic()
        clean = Life(lab, api_key, "clean", log_points=True)
        try:
            clean.run()
            clean.check()
        finally:
            clean.close()
        print(f"controller crash points: {len(cases)} in {len(clean.points)} passes: {clean.points}")
        assert tuple(tuple(pts) for pts in clean.points) == LIFE_POINTS, \
            f"the clean life's crash points changed: set LIFE_POINTS to {clean.points}"
        timings["clean"] = round(time.monotonic() - t0, 1)
    else:
        # one point of the life, drawn from the run's seed: each run tries another
        cases = [seed.rng("controller-crash-headscale").choice(cases)]
        print(f"controller crash point tried: pass {cases[0][0]} at {cases[0][1]} (CB_SEED={seed.run_seed()} "
              f"replays it; make crash tries them all)")
    for n, (i, point) in enumerate(cases):
        t1 = time.monotonic()
        life = Life(lab, api_key, f"c{n}", crash=(i, point))
        try:
            life.run()
            assert life.killed == [f"{i}/{point}"], \
                f"{life.killed}: the life did not reach {i}/{point}; `make crash` says whether LIFE_POINTS changed"
            life.check()
        finally:
            life.close()
        extra = " (+1 unused key)" if life.crashed_between_mint_and_store else ""
        timings[f"{i}/{point}{extra}"] = round(time.monotonic() - t1, 1)
    print(f"controller crash lives ({len(cases)} points): {timings}")
