"""Fixtures for packet-level tests in network namespaces (root only).

`topology` is a factory: each call returns a fresh `nettopo.Topology` (unique namespace prefix) that is
torn down at the end of the test whatever happens. `proxy_lab` builds the standard
tailnet <-> proxy <-> backend layout on top of it. Tests using these are skipped, with the reason, when
not running as root or when `ip netns add` does not work here; under CI that fails instead (needs.py).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nettopo
from needs import unavailable

# `make test` runs this directory on two pytest-xdist workers with `--dist loadfile --no-loadscope-reorder`:
# each module runs whole on one worker (its module-scoped lab or cluster is made once), and a free worker takes
# the next module in collection order. The longest modules go first, so that the other worker works through
# the many short ones meanwhile instead of starting a 6-minute module near the end. Longest first by measured
# wall time (docs/lab-and-tests.md); modules not named keep their order after these.
_LONGEST_FIRST = (
    "test_release_realkube.py",   # its first run builds the release's arm64 images under qemu
    "test_flux_realkube.py",      # a release, Flux's install, upgrade and removal in one cluster
    "test_controller_realkube_e2e.py",
    "test_realkube_agent_e2e.py",
    "test_pg_failover_twonode.py",
    "test_certmanager_e2e.py",
    "test_outages.py",
    "test_kube_e2e.py",
    "test_netfilter_packets.py",
    "test_egress_e2e.py",
    "test_controller_apiserver.py",
    "test_agent_crash_steady.py",
    "test_image_e2e.py",
    "test_controller_hostile_apiserver.py",
    "test_agent_crash.py",
    "test_dns_ingress_e2e.py",
    "test_proxygroup_e2e.py",
    "test_realkube_e2e.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    """Under xdist, put the longest modules first (a stable sort: the order inside a module is kept)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def netns_available() -> None:
    ok, reason = nettopo.netns_supported()
    if not ok:
        unavailable(reason)


@pytest.fixture
def topology(netns_available):
    """Factory fixture: `topo = topology()`; every topology made is closed at teardown."""
    made: list[nettopo.Topology] = []

    def make(prefix: str | None = None) -> nettopo.Topology:
        t = nettopo.Topology(prefix)
        made.append(t)
        return t

    yield make
    for t in reversed(made):
        t.close()


@pytest.fixture
def proxy_lab(topology) -> nettopo.ProxyLab:
    """tailnet <-> proxy <-> backend namespaces, both families, forwarding on in the proxy."""
    return nettopo.ProxyLab.build(topology())


# ==========================================================================================================
# labtools e2e fixtures (owner: test-infrastructure; headscale + real tailscaled in an island of namespaces).
# Everything below uses labtools.lab; names are prefixed or specific so they do not clash with the
# packet-level fixtures above (a test module's own `lab`/`backend` fixtures override these, as usual).
# ==========================================================================================================
import shutil as _lt_shutil  # noqa: E402
import subprocess as _lt_subprocess  # noqa: E402
import time as _lt_time  # noqa: E402
from pathlib import Path as _LtPath  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from labtools import lab as _labmod  # noqa: E402

LAB_FIREWALL_MODES = ("iptables", "nftables")
# Set CBPY_LAB_FIREWALL to choose the lab nodes' (client's) firewall mode; agents choose their own per test.
_LAB_FIREWALL = os.environ.get("CBPY_LAB_FIREWALL", "iptables")


def _lt_netns_probe() -> str | None:
    """None if network namespaces work here, else the reason to skip."""
    if os.geteuid() != 0:
        return "labtools e2e tests need root (network namespaces, TUN, netfilter)"
    for tool in ("ip", "curl"):
        if _lt_shutil.which(tool) is None:
            return f"labtools e2e tests need `{tool}` on PATH"
    name = f"cbprobe{os.getpid()}"
    cp = _lt_subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=15)
    if cp.returncode != 0:
        return f"`ip netns add` fails here: {cp.stderr.strip()}"
    _lt_subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=15)
    return None


@pytest.fixture(scope="session")
def lab_bin_dir() -> _LtPath:
    """The directory with tailscaled, tailscale, upstream containerboot and headscale (built if needed)."""
    reason = _lt_netns_probe()
    if reason:
        unavailable(reason)
    try:
        return _labmod.ensure_binaries()
    except Exception as e:  # any build problem means "cannot run e2e here"
        unavailable(f"tailscale/headscale binaries cannot be built: {e}")


@pytest.fixture(scope="session")
def lab(lab_bin_dir):
    """One island per session: headscale, a user + reusable key, and a running `client` tailscaled node."""
    t0 = _lt_time.monotonic()
    lb = _labmod.Lab.create(bin_dir=lab_bin_dir, firewall_mode=_LAB_FIREWALL)
    lb.timings["session_fixture"] = _lt_time.monotonic() - t0
    try:
        yield lb
    finally:
        lb.close()


@pytest.fixture(scope="session")
def k8s_bin_dir(lab_bin_dir) -> _LtPath:
    """The Kubernetes binaries, built on first use by scripts/install-kubernetes.sh (about 9 min cold)."""
    from labtools import kubecluster
    try:
        return kubecluster.ensure_binaries()
    except kubecluster.ClusterError as e:
        unavailable(f"the Kubernetes binaries cannot be built here: {e}")


@pytest.fixture(scope="session")
def helm_bin() -> _LtPath:
    """helm, built on first use."""
    from labtools import helmchart
    try:
        return helmchart.ensure_helm()
    except helmchart.HelmError as e:
        unavailable(f"helm cannot be built here: {e}")


@pytest.fixture(scope="session")
def project_images(lab_bin_dir) -> tuple[_LtPath, _LtPath]:
    """The archives of the project's proxy and controller images (`kubecontroller.build_images`, cached)."""
    from labtools import kubecontroller
    try:
        return kubecontroller.build_images()
    except RuntimeError as e:
        if "setup.sh --image" in str(e):
            unavailable(f"the image build's packages cannot be installed: {e}")
        raise


@pytest.fixture(scope="session")
def lab_backend(lab) -> _labmod.HttpServer:
    """The HTTP server in `backend` on 10.98.0.2:8080 and [fd98::2]:8080; body starts with `marker`."""
    return lab.start_http_server("backend", None, 8080, f"backend-ok-{lab.prefix}")


@pytest.fixture(scope="session")
def upstream_agent_cmd(lab_bin_dir) -> list[str]:
    """argv of the upstream Go containerboot (the reference agent)."""
    return [str(lab_bin_dir / "containerboot")]


@pytest.fixture(scope="session")
def python_agent_cmd() -> list[str]:
    """argv of our agent."""
    return [sys.executable, "-m", "containerboot"]


@pytest.fixture
def start_agent(lab, request):
    """Factory: ``agent = start_agent(env: dict, agent_cmd: list[str] | None = None)`` (default: our agent).

    At teardown every agent started is SIGTERMed (30 s, then SIGKILL), anything left in the proxy namespace
    is killed, the proxy namespace's firewall and forwarding sysctls are reset, and the node is deleted from
    headscale, so the next test starts clean. Tests that assert on shutdown call ``agent.stop()`` themselves
    and check ``lab.wait_ns_empty("proxy")``."""
    started: list[_labmod.AgentProcess] = []

    def make(env: dict | None = None, agent_cmd: list[str] | None = None) -> _labmod.AgentProcess:
        a = lab.start_agent(env or {}, agent_cmd)
        started.append(a)
        return a

    yield make
    problems = lab.reset_proxy(started, [a.hostname for a in started])
    if problems:
        print("labtools start_agent teardown:", "; ".join(problems))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failing test that uses the labtools `lab`, attach lab.dump_diagnostics() to the report."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed:
        lb = getattr(item, "funcargs", {}).get("lab")
        if isinstance(lb, _labmod.Lab):
            try:
                rep.sections.append(("labtools diagnostics", lb.dump_diagnostics()))
            except Exception as e:
                rep.sections.append(("labtools diagnostics", f"dump_diagnostics failed: {e}"))
