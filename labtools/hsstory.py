"""The controller's user story against each headscale version, on one real cluster (`make compat` with `--e2e`).

    from labtools import hsstory
    rows = hsstory.run(["v0.26.1", "v0.29.2"])     # {version: {feature: "works" | "refused: ..." | "failed: ..."}}

One lab (labtools.lab) and one Kubernetes cluster with a node (labtools.kubecluster) serve every version in turn:
the cluster, its images and the echo backend are made once; for each version the lab's headscale is replaced
by that version with fresh state (Lab.switch_headscale: a new database, so a new API key and user, the lab's
client logged in anew) and the controller is re-pointed with `helm upgrade` (the new API key; on 0.26 and
0.27 `headscale.user`, as the install guide says), which restarts it, so that it detects the version again.
Then, as a user would:

- the controller's start-up line (the version it detected, what it says is unavailable);
- a Service exposed (`tailscale.com/expose`): a tailnet IP in its status, a curl from the tailnet client
  through it to the backend; the device's tags in headscale (`tag:k8s`);
- a Connector advertising the node's Pod range: ConnectorReady, the route approved in headscale (its CLI, as an
  admin does), the client reaching a backend Pod by its Pod IP through the router;
- an egress Service (`tailscale.com/tailnet-ip`, the client's tailnet IP): rewritten to the egress proxy, a Pod
  fetching a page from the tailnet client through it;
- deleting the three: their devices gone from headscale, nothing left in the cluster;
- the API server proxy in auth mode: where the version has grants, a policy granting the client's user a group
  bound to `view`, and the cluster's kubectl on the client listing Pods through the proxy; where it has not,
  the controller's Warning event `ControlPlaneUnsupported` on the proxy's ConfigMap (its message is the cell).

The Service, the Connector and the egress Service are applied together (their proxies start side by side).
A step that fails is a "failed: ..." cell and the rest of that version still runs where it can; the parents are
deleted before the next version either way. Needs root, the Kubernetes binaries, helm and both images.
"""
from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Sequence

from labtools import apiproxylab as ap
from labtools import helmchart, kubecluster, kubecontroller, kubedns, kubemanifests
from labtools.lab import Lab, ensure_binaries, wait_until

#: The story's features, in the table's order.
STARTUP = "controller: start-up line"
EXPOSE = "controller: Service exposed, curl from the tailnet"
TAGS = "controller: the proxy's device tagged tag:k8s"
CONNECTOR = "controller: Connector subnet route approved, curl to a Pod IP"
EGRESS = "controller: egress Service, a Pod reaches the tailnet"
DELETION = "controller: devices deleted with their parents"
APIPROXY = "controller: API server proxy, auth mode"
FEATURES = (STARTUP, EXPOSE, TAGS, CONNECTOR, EGRESS, DELETION, APIPROXY)

NS = "apps"
GRANTS_FROM = (0, 29)


def _short(text: object, n: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _service(name: str, annotations: dict[str, str], **spec: object) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS,
                                                               "annotations": annotations},
            "spec": {"selector": {"app": "echo"}, "ports": [{"port": 8080, "targetPort": 8080}], **spec}}


def _connector(name: str, cidr: str) -> dict:
    return {"apiVersion": "tailscale.com/v1alpha1", "kind": "Connector", "metadata": {"name": name},
            "spec": {"hostname": f"{name}-router", "subnetRouter": {"advertiseRoutes": [cidr]}}}


def _nodes_named(lab: Lab, name: str) -> list[dict]:
    return [n for n in lab.hs_nodes() if name in (n.get("name"), n.get("given_name"))]


def _condition(obj: dict | None, ctype: str) -> bool:
    return any(c.get("type") == ctype and c.get("status") == "True"
               for c in ((obj or {}).get("status") or {}).get("conditions") or [])


def _api_key(lab: Lab) -> str:
    out = lab.hs("apikeys", "create", "--expiration", "2h")
    return (out if isinstance(out, str) else str((out or {}).get("key") or out)).strip()


def _user(lab: Lab) -> str:
    """headscale.user as the install guide says: the lab's user before 0.28 (no tag-only keys), none after."""
    return str(lab.user_id) if lab.hs_minor < (0, 28) and lab.user_id is not None else ""


def repoint(kc: kubecluster.KubeCluster, lab: Lab, timeout: float = 150.0) -> str:
    """The installed controller re-pointed at the lab's (new) headscale: a new API key (and headscale.user), the
    API server proxy off; helm's upgrade changes the credentials' checksum on the Pod template, so the
    Deployment rolls. Returns the new controller's start-up line once it logged it."""
    values = {"credentials": {"headscaleAPIKey": _api_key(lab)}, "headscale": {"user": _user(lab)},
              "apiServerProxy": {"mode": "off"}}
    kubecontroller.helm(kc, "upgrade", helmchart.RELEASE, str(helmchart.CHART), "--namespace", kubecontroller.NS,
                        "--reuse-values", "-f", "-", input=json.dumps(values), timeout=timeout)
    cp = kc.kubectl("-n", kubecontroller.NS, "rollout", "status", "deployment/tailscale-controller",
                    f"--timeout={int(timeout)}s", check=False, timeout=timeout + 10)
    if cp.returncode != 0:
        raise kubecluster.ClusterError(f"the controller did not roll out: {cp.stderr.strip()}")
    return startup_line(kc, lab.hs_version, timeout)


#: The controller's start-up line (controller.providers.hscompat.Capabilities.summary).
STARTUP_LINE = re.compile(r"headscale [\w.-]+( \(assumed\))?(, API of [\d.]+)?( \(not detected[^)]*\))?: "
                          r"(unavailable: .*|every feature the controller uses is available.*|.* is older than .*)$")


def startup_line(kc: kubecluster.KubeCluster, version: str, timeout: float = 90.0) -> str:
    """The start-up line of the controller's running Pod, naming `version`'s minor."""
    minor = ".".join(version.lstrip("v").split(".")[:2])

    def line() -> str | None:
        pod = kubecontroller.controller_pod(kc)
        if pod is None:
            return None
        cp = kc.kubectl("-n", kubecontroller.NS, "logs", pod["metadata"]["name"], "--tail=400", check=False)
        for ln in cp.stdout.splitlines():
            m = STARTUP_LINE.search(ln)
            if m and f"headscale {minor}" in m.group(0).replace("headscale v", "headscale "):
                return m.group(0)
        return None
    return wait_until(line, timeout, 1.0, f"the controller's start-up line for headscale {version}")


def _step(cells: dict[str, str], feature: str, fn: Callable[[], str]) -> bool:
    """Run one step: its cell is what it returns, or "failed: <why>"; True when it worked."""
    try:
        cells[feature] = fn()
        return True
    except (TimeoutError, AssertionError, kubecluster.ClusterError, RuntimeError, KeyError, ValueError) as e:
        cells[feature] = "failed: " + _short(e)
        return False


def story(lab: Lab, kc: kubecluster.KubeCluster, marker: str, port: int) -> dict[str, str]:
    """One version's story on the installed controller (already pointed at the lab's headscale)."""
    cells: dict[str, str] = {}
    cidr = kc.pod_cidr
    v4 = lab.tailnet_ips("client")[0] or ""
    tailnet_marker = f"tailnet-node-ok-{lab.prefix}-{port}"
    lab.start_http_server("client", v4, port, tailnet_marker)
    kc.apply([_service("web", {"tailscale.com/expose": "true"}, type="LoadBalancer"), _connector("pods", cidr),
              _service("to-client", {"tailscale.com/tailnet-ip": v4, "tailscale.com/hostname": "apps-to-client"},
                       type="ClusterIP")])

    def expose() -> str:
        svc = kubecontroller.wait_service_ip(kc, NS, "web", 240)
        ip = kubecontroller.lb_ips(svc)[0]
        lab.wait_peer("client", "apps-web", 60)
        lab.wait_curl("client", lab.url(ip, 8080, "/compat"), marker, timeout=60)
        return "works"

    def tags() -> str:
        (node,) = _nodes_named(lab, "apps-web")
        got = sorted(set(node.get("tags") or []) | set(node.get("forced_tags") or []))
        if "tag:k8s" not in got:
            raise AssertionError(f"the device's tags in headscale: {got}")
        return "works"

    def connector() -> str:
        wait_until(lambda: _condition(kc.get("connector", "pods"), "ConnectorReady"), 240, 1.0,
                   "the Connector ready")
        wait_until(lambda: any(cidr in (n.get("available_routes") or [])
                               for n in _nodes_named(lab, "pods-router")), 60, 0.5, "the route advertised")
        lab.approve_routes("pods-router", [cidr])
        pod = json.loads(kc.kubectl("-n", NS, "get", "pods", "-l", "app=echo", "-o", "json").stdout)["items"][0]
        lab.wait_curl("client", lab.url(pod["status"]["podIP"], 8080, "/via-connector"), marker, timeout=90)
        return "works"

    def egress() -> str:
        def rewritten() -> bool:
            s = kc.get("service", "to-client", NS)
            return _condition(s, "TailscaleProxyReady") and (s or {}).get("spec", {}).get("type") == "ExternalName"
        wait_until(rewritten, 240, 1.0, "the egress Service rewritten and its proxy ready")
        kc.wait_dns()
        out = kubedns.pod_fetch(kc, NS, "egress-client", "to-client", f"http://to-client:{port}/from-pod",
                                kubecontroller.PROXY_IMAGE)
        if tailnet_marker not in out:
            raise AssertionError(f"the Pod's fetch: {_short(out)}")
        return "works"

    _step(cells, EXPOSE, expose)
    if EXPOSE in cells and cells[EXPOSE] == "works":
        _step(cells, TAGS, tags)
    _step(cells, CONNECTOR, connector)
    _step(cells, EGRESS, egress)
    _step(cells, DELETION, lambda: delete_parents(kc, lab))
    _step(cells, APIPROXY, lambda: apiserver_proxy(lab, kc))
    return cells


def delete_parents(kc: kubecluster.KubeCluster, lab: Lab, timeout: float = 180.0) -> str:
    """The story's parents deleted: gone from the cluster (their finalizers released), with every child, and
    their devices gone from headscale."""
    kc.kubectl("-n", NS, "delete", "service", "web", "to-client", "--wait=false", "--ignore-not-found")
    kc.kubectl("delete", "connector", "pods", "--wait=false", "--ignore-not-found")
    wait_until(lambda: kc.get("service", "web", NS) is None and kc.get("service", "to-client", NS) is None
               and kc.get("connector", "pods") is None, timeout, 1.0, "the parents gone")
    left = {n: kubecontroller.children(kc, ns, n, kind) for ns, n, kind in
            ((NS, "web", "svc"), (NS, "to-client", "svc"), ("", "pods", "connector"))}
    left = {n: c for n, c in left.items() if c != kubecontroller.NO_CHILDREN}
    devices = [n.get("given_name") for n in lab.hs_nodes() if n.get("given_name") != "client"]
    if left or devices:
        raise AssertionError(f"left behind: children {left}, devices in headscale {devices}")
    return "works"


def apiserver_proxy(lab: Lab, kc: kubecluster.KubeCluster) -> str:
    """Auth mode: with grants, kubectl from the tailnet client through the proxy; without, the refusal."""
    has_grants = lab.hs_minor >= GRANTS_FROM
    try:
        if has_grants:
            with lab.hs_policy(ap.policy("e2e")):
                ap.set_mode(kc, "auth")
                ip = ap.proxy_ip(kc, 240)
                work = lab.run_dir / "apiproxy"
                client = ap.TailnetKubectl(lab, "client", kc.cfg.bin_dir / "kubectl", f"http://{ip}", work,
                                           token="unused")
                got = wait_until(lambda: (cp := client.run("-n", NS, "get", "pods")).returncode == 0 and cp, 120,
                                 1, "kubectl get pods through the API server proxy")
                if "echo-" not in got.stdout:
                    raise AssertionError(f"kubectl get pods through the proxy: {_short(got.stdout)}")
                return "works (kubectl from the tailnet client, impersonated by its grant's group)"
        ap.set_mode(kc, "auth")
        ev = wait_until(lambda: _unsupported_event(kc, "%d.%d" % lab.hs_minor), 150, 1.0,
                        "the ControlPlaneUnsupported event on the API server proxy's ConfigMap")
        return "refused: " + ev
    finally:
        ap.set_mode(kc, "off")
        wait_until(lambda: kubecontroller.children(kc, kubecontroller.NS, "apiserver-proxy", "apiserverproxy")
                   == kubecontroller.NO_CHILDREN, 150, 1, "the API server proxy's objects gone")


def _unsupported_event(kc: kubecluster.KubeCluster, minor: str) -> str | None:
    """The message of the proxy's ControlPlaneUnsupported event about grants on headscale `minor` (an earlier
    version's event may still be there)."""
    out = kc.kubectl("-n", kubecontroller.NS, "get", "events", "--field-selector",
                     "involvedObject.name=apiserver-proxy,reason=ControlPlaneUnsupported", "-o", "json").stdout
    for e in json.loads(out).get("items") or []:
        if "grants" in e.get("message", "") and re.search(rf"headscale v?{re.escape(minor)}\b", e["message"]):
            return str(e["message"])
    return None


def _cleanup(kc: kubecluster.KubeCluster, lab: Lab) -> None:
    """After a failed step: the parents deleted and the API server proxy off, so the next version starts clean."""
    try:
        delete_parents(kc, lab)
    except (TimeoutError, AssertionError, kubecluster.ClusterError):
        pass
    kc.kubectl("-n", kubecontroller.NS, "delete", "events", "--field-selector", "involvedObject.name=apiserver-proxy",
               check=False)


def run(versions: Sequence[str], say: Callable[[str], None] = print,
        seconds: dict[str, float] | None = None) -> dict[str, dict[str, str]]:
    """The story on each version in turn, on one cluster; a row of cells per version. `seconds` gets each
    version's time, and "setup" the images', the cluster's and the controller's."""
    seconds = {} if seconds is None else seconds
    t_setup = time.monotonic()
    rows: dict[str, dict[str, str]] = {}
    bin_dir = ensure_binaries(upstream=False)
    k8s_bin = kubecluster.ensure_binaries()
    helmchart.ensure_helm()
    t0 = time.monotonic()
    proxy_tar, ctl_tar = kubecontroller.build_images()
    say(f"[compat] images {time.monotonic() - t0:.0f}s")
    with Lab.create(bin_dir=bin_dir, hs_version=versions[0]) as lab:
        t0 = time.monotonic()
        with kubecluster.KubeCluster.start(lab=lab, node=True, bin_dir=k8s_bin) as kc:
            kubecontroller.install(kc, lab, proxy_tar, ctl_tar, firewall=lab.firewall_mode)
            marker = f"echo-ok-{lab.prefix}"
            kc.apply([kubemanifests.namespace(NS),
                      *kubemanifests.echo_backend(NS, "echo", marker, kubecluster.ECHO_IMAGE, replicas=1),
                      *ap.reader_rbac(NS)])
            kc.kubectl("-n", NS, "rollout", "status", "deployment/echo", "--timeout=120s", timeout=130)
            say(f"[compat] cluster and controller {time.monotonic() - t0:.0f}s")
            seconds["setup"] = time.monotonic() - t_setup
            for i, v in enumerate(versions):
                t1 = time.monotonic()
                cells: dict[str, str] = {}
                try:
                    if i:
                        lab.switch_headscale(v)
                    start = functools.partial(startup_line, kc, v) if i == 0 else functools.partial(repoint, kc, lab)
                    if not _step(cells, STARTUP, start):
                        raise RuntimeError(cells[STARTUP])
                    cells.update(story(lab, kc, marker, 18080 + i))
                except Exception as e:      # the version's row says it (at the step it stopped); the next still runs
                    cells[next((f for f in FEATURES if f not in cells), FEATURES[-1])] = "failed: " + _short(e)
                    print(kubecontroller.controller_log(kc, 60))
                if any(c.startswith("failed") for c in cells.values()):
                    print(kubecontroller.controller_log(kc, 100))
                    _cleanup(kc, lab)
                rows[v] = {f: cells.get(f, "not run (an earlier step failed)") for f in FEATURES}
                seconds[v] = time.monotonic() - t1
                say(f"[compat] headscale {v}: the controller's story {seconds[v]:.0f}s")
    return rows

