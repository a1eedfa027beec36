"""The proxy image end to end: the agent run from localhost/containerboot-py:latest by podman in the lab's
proxy namespace (real headscale, real tailscaled, real kernel rules), in both firewall backends.

* L3 ingress (both families), L3 egress and L7 serve through the image; the root file system is read-only;
* `podman stop` (SIGTERM to the container's PID 1) ends with exit 0, none of the agent's rules left, nothing
  left in the namespace and the container gone;
* forwarding set before the container starts (as the operator's privileged init container does) is only read
  (the container's /proc/sys is read-only); set neither way, the agent names the sysctl and both fixes;
* without NET_ADMIN or without /dev/net/tun, the agent exits 1 with one line naming what is missing.

The image is (re)built first with images/build.sh (idempotent: a few seconds when nothing changed), so what
runs is the code under test. Skipped when podman is absent, unless CI is set: then that is a failure.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import labextras as lx
import pytest
from needs import unavailable

from labtools import image as img
from labtools.lab import BACKEND_LINK_PROXY_V4, Lab

pytestmark = [pytest.mark.netns, pytest.mark.e2e, pytest.mark.timeout(420)]

MODES = ("nftables", "iptables")
REPO = Path(__file__).resolve().parent.parent
STARTUP = "Startup complete, waiting for shutdown signal"
EGRESS_PORT = 8083


@pytest.fixture(scope="module")
def image(lab) -> str:
    if shutil.which("podman") is None:
        why = "podman is not installed (bash scripts/setup.sh --image installs it)"
        unavailable(why)
    # Run the image by the ID this build produced: the name is shared by every checkout on the machine.
    iid = lab.run_dir / "image.iid"
    cp = subprocess.run(["bash", "images/build.sh", "--iidfile", str(iid)], cwd=REPO, capture_output=True,
                        text=True, timeout=1800)
    assert cp.returncode == 0, f"images/build.sh failed:\n{cp.stdout}\n{cp.stderr[-4000:]}"
    print(cp.stdout.strip())
    return iid.read_text().strip()


@pytest.fixture
def start_image_agent(lab, image):
    """Factory: ``start_image_agent(env, **container_opts)``; teardown as the start_agent fixture's."""
    started = []

    def make(env: dict, **opts):
        a = lab.start_agent(env, image=image, container=opts)
        started.append(a)
        return a

    yield make
    for a in started:
        if a.running():
            img.stop(a.container, 10)
    problems = lab.reset_proxy(started, [a.hostname for a in started])
    if problems:
        print("image agent teardown:", "; ".join(problems))


def set_forwarding(lab, value: int) -> None:
    """What a privileged init container does for the Pod's network namespace."""
    for key in ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"):
        lab.exec("proxy", ["sh", "-c", f"echo {value} > /proc/sys/{key}"], check=True, timeout=10)


def podman_stop_cleanly(lab, agent, mode: str) -> None:
    cp = img.stop(agent.container, 30)
    assert cp.returncode == 0, cp.stderr
    assert agent.wait_exit(30) == 0, agent.log_text()[-3000:]
    assert lab.wait_ns_empty("proxy", 15) == [], "processes left in the proxy namespace after podman stop"
    assert lx.own_rules(lab, mode) == "", "the agent's rules are left behind after podman stop"
    gone = subprocess.run(img.podman("container", "exists", agent.container), capture_output=True, timeout=30)
    assert gone.returncode == 1, "the container was not removed"
    assert "Traceback" not in agent.log_text()


@pytest.mark.parametrize("mode", MODES)
def test_image_ingress_both_families_then_podman_stop(lab, lab_backend, start_image_agent, mode):
    if mode == "nftables":
        set_forwarding(lab, 1)       # the init container's way: the agent only reads /proc/sys
        agent = start_image_agent({"TS_DEST_IP": f"{lab.backend_ipv4},{lab.backend_ipv6}",
                                   "TS_DEBUG_FIREWALL_MODE": mode}, sysctls=())
    else:                            # podman's way: --sysctl
        agent = start_image_agent({"TS_DEST_IP": f"{lab.backend_ipv4},{lab.backend_ipv6}",
                                   "TS_DEBUG_FIREWALL_MODE": mode})
    agent.wait_for_log(STARTUP, timeout=90)
    v4, v6 = agent.tailnet_ips()
    for ip, tag in ((v4, "img-in4"), (v6, "img-in6")):
        body = lab.wait_curl("client", lab.url(ip, 8080, f"/?{tag}-{mode}"), lab_backend.marker, timeout=45)
        assert lab_backend.marker in body
    assert lx.own_rules(lab, mode), "no rules of the agent's own are installed"
    podman_stop_cleanly(lab, agent, mode)


@pytest.mark.parametrize("mode", MODES)
def test_image_egress_by_tailnet_ip(lab, start_image_agent, mode):
    srv = lab.start_http_server("client", ("0.0.0.0", "::"), EGRESS_PORT + (mode == "iptables"),
                                f"img-egress-{mode}-{lab.prefix}")
    client_v4, _ = lab.tailnet_ips("client")
    agent = start_image_agent({"TS_TAILNET_TARGET_IP": client_v4, "TS_DEBUG_FIREWALL_MODE": mode})
    agent.wait_for_log(STARTUP, timeout=90)
    proxy_v4, _ = agent.tailnet_ips()
    tag = f"img-eg-{mode}"
    url = Lab.url(BACKEND_LINK_PROXY_V4, srv.port, f"/?{tag}")
    body = lab.wait_curl("backend", url, srv.marker, timeout=45)
    assert body.startswith(srv.marker)
    seen = [r for r in lab.http_peer_log(srv) if tag in r["path"]]
    assert seen and {r["peer"] for r in seen} == {proxy_v4}, f"not SNATed to the proxy's tailnet address: {seen}"
    assert {r["local"] for r in seen} == {client_v4}
    podman_stop_cleanly(lab, agent, mode)


@pytest.mark.parametrize("mode", MODES)
def test_image_serve_config(lab, lab_backend, start_image_agent, mode):
    # The serve config lives in the proxy namespace's run directory, which is mounted into the container.
    path = lab.run_dir / "proxy" / f"serve-{mode}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    host = "proxy.tailnet.test"
    path.write_text(json.dumps({"TCP": {"80": {"HTTP": True}},
                                "Web": {f"{host}:80": {"Handlers": {"/": {"Proxy": "http://10.98.0.2:8080"}}}}}))
    agent = start_image_agent({"TS_SERVE_CONFIG": str(path), "TS_DEBUG_FIREWALL_MODE": mode})
    agent.wait_for_log(STARTUP, timeout=90)
    v4, _ = agent.tailnet_ips()
    # curl with the Host header the serve config is keyed by (headscale issues no certificates: plain HTTP)
    deadline, last = time.monotonic() + 45, ""
    while time.monotonic() < deadline:
        r = lab.curl("client", lab.url(v4, 80, f"/img-l7-{mode}"), extra=["-H", f"Host: {host}"])
        last = r.stdout + r.stderr
        if lab_backend.marker in r.stdout:
            break
        time.sleep(0.3)   # poll: until served through the image (deadline above)
    assert lab_backend.marker in last, f"not served through the image's serve config: {last!r}"
    podman_stop_cleanly(lab, agent, mode)


def test_image_forwarding_off_and_read_only_names_the_sysctl(lab, start_image_agent):
    set_forwarding(lab, 0)
    agent = start_image_agent({"TS_DEST_IP": lab.backend_ipv4}, sysctls=())
    assert agent.wait_exit(60) == 1
    log = agent.log_text()
    assert "net.ipv4.ip_forward" in log and "--sysctl net.ipv4.ip_forward=1" in log and "initContainer" in log
    assert "Traceback" not in log and "Starting tailscaled" not in log


@pytest.mark.parametrize("missing", ["NET_ADMIN", "/dev/net/tun"])
def test_image_without_net_admin_or_tun_names_it(lab, start_image_agent, missing):
    opts = {"net_admin": False} if missing == "NET_ADMIN" else {"tun": False}
    agent = start_image_agent({"TS_DEST_IP": lab.backend_ipv4}, **opts)
    assert agent.wait_exit(60) == 1
    log = agent.log_text()
    hint = "--cap-add NET_ADMIN" if missing == "NET_ADMIN" else "--device /dev/net/tun"
    assert missing in log and hint in log and "TS_USERSPACE=true" in log, log[-3000:]
    assert "Traceback" not in log and "Starting tailscaled" not in log


def test_image_userspace_needs_neither(lab, start_image_agent):
    agent = start_image_agent({"TS_USERSPACE": "true"}, net_admin=False, tun=False, sysctls=())
    agent.wait_for_log(STARTUP, timeout=90)
    agent.wait_running(30)
    cp = img.stop(agent.container, 30)
    assert cp.returncode == 0 and agent.wait_exit(30) == 0, agent.log_text()[-3000:]
