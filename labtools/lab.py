"""A local tailnet on an "island" of network namespaces: headscale + real tailscaled nodes + a backend.

Used by the demo (`python -m labtools.demo`) and as the netns test fixture (`netns-tests/conftest.py`).

Topology (all names carry a per-lab prefix, e.g. ``cb1a2b-proxy``)::

    <p>-sw: bridge br0 (no link to the root namespace, so nothing can leave the machine)
      ├── v-hs     ── <p>-hs      eth0 10.99.0.1/24  fd99::1/64   headscale :8080 + embedded DERP/STUN
      ├── v-proxy  ── <p>-proxy   eth0 10.99.0.10/24 fd99::10/64  the agent under test (+ its tailscaled)
      ├── v-client ── <p>-client  eth0 10.99.0.20/24 fd99::20/64  a plain tailscaled node
      └── v-<name> ── <p>-<name>  eth0 10.99.0.N/24  fd99::N/64   more nodes via Lab.add_namespace()
    <p>-proxy eth1 10.98.0.1/24 fd98::1/64 ── <p>-backend eth0 10.98.0.2/24 fd98::2/64 (plain HTTP server)

Default routes of the tailscaled namespaces point at hs (which does not forward), because tailscaled
misbehaves without a default route (e2e-headscale.md §7 #10). Every namespace gets its own
/etc/netns/<ns>/resolv.conf pointing at 127.0.0.1 with a 1 s timeout, so nothing hangs on the host's
resolver (§7 #9). All per-instance state (sockets, state dirs, logs dirs, headscale DB/keys) lives under
one run directory per lab (§7 #2).

Only the standard library is used here, so this file can also be executed as a script by the tiny
HTTP server (``python -I lab.py http-serve ...``) inside a namespace.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

SYS_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = REPO_ROOT / "scripts" / "install-binaries.sh"
TS_VER = os.environ.get("TS_VER", "v1.102.3")
HS_VER = os.environ.get("HS_VER", "v0.29.2")
#: The headscale the lab runs: HS_VER (the pinned one, built with the tailscale binaries) unless HEADSCALE_VERSION
#: names another minor of the version matrix (HEADSCALE_VERSIONS; built on demand, one binary per version).
HEADSCALE_VERSION = os.environ.get("HEADSCALE_VERSION", "") or HS_VER
HEADSCALE_VERSIONS = ("v0.26.1", "v0.27.1", "v0.28.0", "v0.29.2")
BINARIES = ("tailscaled", "tailscale", "containerboot", "headscale")
# what a lab needs when it runs only this project's agent (the demo): upstream containerboot is the reference
# agent of the conformance tests and benchmarks, and a cold build need not wait for it
OWN_BINARIES = ("tailscaled", "tailscale", "headscale")

# Address plan (fixed: every lab has its own namespaces, so labs never see each other's addresses).
UNDERLAY_V4 = "10.99.0.{}"
UNDERLAY_V6 = "fd99::{}"  # host 10 -> fd99::10 (decimal digits are valid hex)
HS_V4 = "10.99.0.1"
HS_V6 = "fd99::1"
BACKEND_LINK_PROXY_V4 = "10.98.0.1"
BACKEND_LINK_PROXY_V6 = "fd98::1"
BACKEND_V4 = "10.98.0.2"
BACKEND_V6 = "fd98::2"
HS_PORT = 8080
LOGIN_SERVER = f"http://{HS_V4}:{HS_PORT}"

_LIVE_LABS: "weakref.WeakSet[Lab]" = weakref.WeakSet()


class LabError(RuntimeError):
    """Something in the lab did not come up or a command failed; the message says what and why."""


# --------------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------------

def wait_until(pred: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2, what: str = "") -> Any:
    """Poll ``pred`` until it returns something truthy (returned) or raise TimeoutError after ``timeout``.

    Exceptions raised by ``pred`` count as "not yet"; the last one is put in the TimeoutError message."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except _Exited:
            raise  # the process being waited for is gone: waiting longer cannot help
        except Exception as e:  # "not ready yet" may look like anything
            last_exc = e
        if time.monotonic() >= deadline:
            msg = f"timed out after {timeout:.0f}s waiting for {what or pred}"
            if last_exc is not None:
                msg += f" (last error: {last_exc!r})"
            raise TimeoutError(msg)
        time.sleep(interval)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0, sig: int = signal.SIGTERM) -> int:
    """Send `sig` to a process the lab started (if it still runs), wait up to `timeout`, then SIGKILL it;
    its exit code (negative: the signal that ended it)."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def _run(argv: Sequence[str], *, timeout: float = 30.0, check: bool = True, env: Mapping[str, str] | None = None,
         input: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        cp = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=dict(env) if env else None,
                            input=input, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise LabError(f"command timed out after {timeout}s: {shlex.join(argv)}") from e
    if check and cp.returncode != 0:
        raise LabError(f"command failed (exit {cp.returncode}): {shlex.join(argv)}\n{cp.stdout}{cp.stderr}")
    return cp


def default_bin_dir() -> Path:
    cache = Path(os.environ.get("CB_CACHE", str(Path.home() / ".cache" / "containerboot-py")))
    return cache / "bin" / f"ts-{TS_VER}-hs-{HS_VER}"


def headscale_binary(version: str = "", bin_dir: Path | None = None, *, build: bool = True,
                     timeout: float = 30 * 60) -> Path:
    """The headscale binary of ``version`` (default HEADSCALE_VERSION): the pinned one in the binaries' directory,
    another as ``headscale-<version>`` next to that directory, built by scripts/install-binaries.sh --headscale
    when missing (under the build lock)."""
    version = version or HEADSCALE_VERSION
    if version == HS_VER:
        return (bin_dir or default_bin_dir()) / "headscale"
    if not re.fullmatch(r"v\d+\.\d+\.\d+", version):
        raise LabError(f"HEADSCALE_VERSION={version!r} is not a version; use one of {', '.join(HEADSCALE_VERSIONS)}")
    path = default_bin_dir().parent / f"headscale-{version}"
    if os.access(path, os.X_OK):
        return path
    if not build:
        raise LabError(f"headscale {version} missing ({path}); build it: bash scripts/install-binaries.sh "
                       f"--headscale {version}")
    import fcntl
    lock_path = path.parent.parent / ".build.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.access(path, os.X_OK):
            cp = _run(["bash", str(INSTALL_SCRIPT), "--headscale", version], timeout=timeout, check=False,
                      env={**os.environ, "TS_VER": TS_VER, "HS_VER": HS_VER})
            if cp.returncode != 0 or not os.access(path, os.X_OK):
                raise LabError(f"building headscale {version} failed (exit {cp.returncode}):\n{cp.stderr[-4000:]}")
    return path


def binaries_present(bin_dir: Path, names: tuple[str, ...] = BINARIES) -> bool:
    return all(os.access(bin_dir / b, os.X_OK) for b in names)


def ensure_binaries(timeout: float = 45 * 60, build: bool = True, upstream: bool = True) -> Path:
    """Return the directory with tailscaled, tailscale, containerboot and headscale, building them if needed.

    ``upstream=False`` needs (and builds) only tailscaled, tailscale and headscale: upstream containerboot is
    built only for what runs it. ``CBPY_BIN_DIR`` overrides the location (no build then). The build runs
    scripts/install-binaries.sh under an flock, so two labs starting at once do not run two builds of the same
    thing."""
    names = BINARIES if upstream else OWN_BINARIES
    override = os.environ.get("CBPY_BIN_DIR")
    if override:
        p = Path(override)
        if not binaries_present(p, names):
            raise LabError(f"CBPY_BIN_DIR={override} lacks one of {names}")
        return p
    bdir = default_bin_dir()
    if binaries_present(bdir, names):
        return bdir
    if not build:
        raise LabError(f"binaries missing in {bdir}")
    if shutil.which("go") is None:
        raise LabError("binaries missing and no Go toolchain on PATH to build them")
    import fcntl

    lock_path = bdir.parent.parent / ".build.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        deadline = time.monotonic() + timeout
        while True:  # bounded wait for another labtools build
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LabError("timed out waiting for another binary build (lock held)") from None
                time.sleep(2)
        if binaries_present(bdir, names):
            return bdir
        cp = _run(["bash", str(INSTALL_SCRIPT), *([] if upstream else ["--no-upstream"])], timeout=timeout, check=False,
                  env={**os.environ, "TS_VER": TS_VER, "HS_VER": HS_VER})
        if cp.returncode != 0:
            raise LabError(f"install-binaries.sh failed (exit {cp.returncode}):\n{cp.stderr[-4000:]}")
        lines = [ln for ln in cp.stdout.splitlines() if ln.strip()]
        out = Path(lines[-1]) if lines else bdir
        if not binaries_present(out, names):
            raise LabError(f"install-binaries.sh finished but {out} lacks one of {names}")
        return out


def _short_id() -> str:
    # interface names are not derived from it, but keep netns names short and readable anyway
    return "cb" + format(os.getpid() % 36 ** 3, "x")[-4:] + secrets.token_hex(2)


# --------------------------------------------------------------------------------------------------------
# data types
# --------------------------------------------------------------------------------------------------------

@dataclass
class NsInfo:
    """One namespace of the lab: short name (``proxy``), full netns name, underlay addresses."""
    name: str
    netns: str
    ipv4: str | None = None
    ipv6: str | None = None


@dataclass
class Node:
    """A plain tailscaled node started by Lab.start_node."""
    name: str
    ns: str
    socket: str
    dir: Path
    log_path: Path
    proc: subprocess.Popen = field(repr=False)


@dataclass
class HttpServer:
    ns: str
    addrs: tuple[str, ...]
    port: int
    marker: str
    log_path: Path
    peer_log: Path
    proc: subprocess.Popen = field(repr=False)


@dataclass
class _Proc:
    kind: str  # agent | node | http | headscale
    name: str
    proc: subprocess.Popen
    logf: Any


class AgentProcess:
    """The agent under test, running in the proxy namespace (started by Lab.start_agent)."""

    def __init__(self, lab: "Lab", proc: subprocess.Popen, log_path: Path, socket: str, state_dir: str,
                 env: dict[str, str], argv: list[str], dir: Path, started: float) -> None:
        self.lab = lab
        self.proc = proc
        self.pid = proc.pid
        self.log_path = log_path
        self.socket = socket
        self.state_dir = state_dir
        self.env = env
        self.argv = argv
        self.dir = dir
        self.started = started
        self.hostname = env.get("TS_HOSTNAME", "proxy")
        self.container: str | None = None  # the podman container's name when run from an image

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def wait_for_log(self, text: str | re.Pattern, timeout: float = 60.0) -> str:
        """Wait until the log contains ``text`` (a substring or compiled regex); return the matching line.

        Fails fast with the log tail if the agent exits first."""
        def pred() -> str | None:
            log = self.log_text()
            for line in log.splitlines():
                if (text.search(line) if isinstance(text, re.Pattern) else text in line):
                    return line
            if self.proc.poll() is not None:
                raise _Exited(self.proc.returncode)
            return None
        try:
            return wait_until(pred, timeout, 0.1, f"agent log line {text!r}")
        except _Exited as e:
            raise LabError(f"agent exited ({e.args[0]}) before logging {text!r}; log tail:\n"
                           f"{self.log_text()[-3000:]}") from None
        except TimeoutError as e:
            raise TimeoutError(f"{e}; log tail:\n{self.log_text()[-3000:]}") from None

    def wait_exit(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"agent still running after {timeout}s") from None

    def wait_running(self, timeout: float = 60.0) -> dict:
        """Wait until the agent's tailscaled reports BackendState Running with tailnet IPs; return the status."""
        return self.lab.wait_running(self.socket, timeout, proc=self.proc)

    def status(self) -> dict:
        return self.lab.status(self.socket)

    def ts(self, *args: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.lab.ts(self.socket, *args, timeout=timeout, check=check)

    def tailnet_ips(self) -> tuple[str | None, str | None]:
        return self.lab.tailnet_ips(self.socket)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` and wait up to ``timeout`` for the agent to exit; return its exit code.

        If it does not exit in time it is SIGKILLed and the negative signal number is returned; callers
        that care check the return value. Processes it leaves in the namespace are NOT killed here (that
        is for the caller to observe: see Lab.ns_pids / Lab.kill_ns_leftovers)."""
        return stop_process(self.proc, timeout, sig)


class _Exited(Exception):
    pass


# --------------------------------------------------------------------------------------------------------
# the lab
# --------------------------------------------------------------------------------------------------------

class Lab:
    """See the module docstring. Create with ``Lab.create()``; use as a context manager or call close()."""

    def __init__(self, prefix: str, bin_dir: Path, ipv6: bool, firewall_mode: str, run_root: Path,
                 hs_log_level: str, hs_bin: Path | None = None, hs_version: str = "") -> None:
        self.prefix = prefix
        self.bin_dir = Path(bin_dir)
        self.hs_bin = Path(hs_bin) if hs_bin else self.bin_dir / "headscale"
        #: the headscale version the lab runs ("v0.29.2"); its minor decides the config and the CLI used
        self.hs_version = hs_version or HS_VER
        self.ipv6 = ipv6
        self.firewall_mode = firewall_mode
        self.run_dir = run_root / prefix
        self.hs_log_level = hs_log_level
        self.namespaces: dict[str, NsInfo] = {}
        self.nodes: dict[str, Node] = {}
        self.http_servers: list[HttpServer] = []
        self.agents: list[AgentProcess] = []
        self._procs: list[_Proc] = []
        self._sockets: dict[str, str] = {}
        self._next_host = 30
        self._agent_seq = 0
        self._closed = False
        self._close_lock = threading.Lock()
        self.user_id: int | None = None
        self._authkey: str | None = None
        self.timings: dict[str, float] = {}
        self.hs_config = self.run_dir / "hs" / "config.yaml"

    # ---------------------------------------------------------------- construction
    @classmethod
    def create(cls, prefix: str | None = None, bin_dir: str | Path | None = None, ipv6: bool = True, *,
               firewall_mode: str = "iptables", run_root: str | Path = "/tmp",
               hs_log_level: str = "info", client: bool = True, hs_version: str = "") -> "Lab":
        """Build the island, start headscale, create a user and a reusable key, and (``client=True``) start the
        ``client`` tailscaled node. On any failure (or Ctrl-C) during bring-up everything is torn down."""
        if os.geteuid() != 0:
            raise LabError("the lab needs root (network namespaces)")
        bdir = Path(bin_dir) if bin_dir else ensure_binaries()
        # the lab itself runs tailscaled and headscale; upstream containerboot only for those who start it
        if not binaries_present(bdir, OWN_BINARIES):
            raise LabError(f"{bdir} lacks one of {OWN_BINARIES}")
        hs_version = hs_version or HEADSCALE_VERSION
        hs_bin = bdir / "headscale" if hs_version == HS_VER else headscale_binary(hs_version, bdir)
        lab = cls(prefix or _short_id(), bdir, ipv6, firewall_mode, Path(run_root), hs_log_level, hs_bin, hs_version)
        _LIVE_LABS.add(lab)
        try:
            t0 = time.monotonic()
            lab._build_topology()
            lab.timings["topology"] = time.monotonic() - t0
            t1 = time.monotonic()
            lab._start_headscale()
            lab.timings["headscale"] = time.monotonic() - t1
            lab.create_user()
            lab._authkey = lab.preauth_key(reusable=True, ephemeral=False)
            if client:
                t2 = time.monotonic()
                lab.start_node("client", "client")
                lab.timings["client_node"] = time.monotonic() - t2
            lab.timings["create_total"] = time.monotonic() - t0
        except BaseException:
            lab.close()
            raise
        return lab

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def authkey(self) -> str:
        if self._authkey is None:
            self._authkey = self.preauth_key(reusable=True)
        return self._authkey

    def netns(self, ns: str) -> str:
        """Full netns name for a short name (``proxy``); full names are passed through."""
        if ns in self.namespaces:
            return self.namespaces[ns].netns
        if any(i.netns == ns for i in self.namespaces.values()):
            return ns
        raise LabError(f"unknown namespace {ns!r} (have {sorted(self.namespaces)})")

    def _ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(["ip", *args], check=check, timeout=15)

    def _mkns(self, short: str) -> NsInfo:
        full = f"{self.prefix}-{short}"
        self._ip("netns", "add", full)
        info = NsInfo(short, full)
        self.namespaces[short] = info  # recorded before anything else can fail, so close() removes it
        etc = Path("/etc/netns") / full
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
        self._ip("-n", full, "link", "set", "lo", "up")
        if self.ipv6:
            self._sysctl(full, "net.ipv6.conf.all.disable_ipv6", "0")
            self._sysctl(full, "net.ipv6.conf.default.disable_ipv6", "0")
            self._sysctl(full, "net.ipv6.conf.default.accept_dad", "0")
        return info

    def _sysctl(self, full_ns: str, key: str, value: str) -> None:
        # /proc/sys/net is per netns; write it from inside
        path = "/proc/sys/" + key.replace(".", "/")
        _run(["ip", "netns", "exec", full_ns, "sh", "-c", f"echo {value} > {path}"], timeout=10)

    def _addr(self, full_ns: str, dev: str, v4: str, v6: str | None) -> None:
        self._ip("-n", full_ns, "addr", "add", v4, "dev", dev)
        if self.ipv6 and v6:
            self._ip("-n", full_ns, "-6", "addr", "add", v6, "dev", dev, "nodad")
        self._ip("-n", full_ns, "link", "set", dev, "up")

    def add_namespace(self, name: str, *, host: int | None = None, default_route: bool = True) -> NsInfo:
        """Attach a new namespace ``<prefix>-<name>`` to the island bridge with 10.99.0.<host>/24 and
        fd99::<host>/64 (``host`` defaults to the next free number from 30). Returns its NsInfo."""
        if name in self.namespaces:
            raise LabError(f"namespace {name!r} exists")
        if host is None:
            host = self._next_host
            self._next_host += 1
        if not 0 < host < 255:
            raise LabError(f"bad host number {host}")
        sw = self.namespaces["sw"].netns
        swif = ("v-" + name)[:15]
        info = self._mkns(name)
        self._ip("-n", sw, "link", "add", swif, "type", "veth", "peer", "name", "eth0", "netns", info.netns)
        self._ip("-n", sw, "link", "set", swif, "master", "br0", "up")
        info.ipv4 = UNDERLAY_V4.format(host)
        info.ipv6 = UNDERLAY_V6.format(host) if self.ipv6 else None
        self._addr(info.netns, "eth0", f"{info.ipv4}/24", f"{info.ipv6}/64" if info.ipv6 else None)
        if default_route and name != "hs":
            self._ip("-n", info.netns, "route", "add", "default", "via", HS_V4)
            if self.ipv6:
                self._ip("-n", info.netns, "-6", "route", "add", "default", "via", HS_V6)
        return info

    def _build_topology(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=False)
        (self.run_dir / "owner").write_text(f"{os.getpid()}\n")
        sw = self._mkns("sw")
        self._ip("-n", sw.netns, "link", "add", "br0", "type", "bridge")
        self._ip("-n", sw.netns, "link", "set", "br0", "up")
        self.add_namespace("hs", host=1)
        self.add_namespace("proxy", host=10)
        self.add_namespace("client", host=20)
        be = self._mkns("backend")
        px = self.namespaces["proxy"].netns
        self._ip("-n", px, "link", "add", "eth1", "type", "veth", "peer", "name", "eth0", "netns", be.netns)
        self._addr(px, "eth1", f"{BACKEND_LINK_PROXY_V4}/24", f"{BACKEND_LINK_PROXY_V6}/64")
        be.ipv4, be.ipv6 = BACKEND_V4, (BACKEND_V6 if self.ipv6 else None)
        self._addr(be.netns, "eth0", f"{BACKEND_V4}/24", f"{BACKEND_V6}/64")
        # the backend answers via the proxy, so no SNAT is strictly needed for the return path
        self._ip("-n", be.netns, "route", "add", "default", "via", BACKEND_LINK_PROXY_V4)
        if self.ipv6:
            self._ip("-n", be.netns, "-6", "route", "add", "default", "via", BACKEND_LINK_PROXY_V6)

    # convenient addresses
    @property
    def hs_ip(self) -> str:
        return HS_V4

    @property
    def login_server(self) -> str:
        return LOGIN_SERVER

    @property
    def backend_ipv4(self) -> str:
        return BACKEND_V4

    @property
    def backend_ipv6(self) -> str | None:
        return BACKEND_V6 if self.ipv6 else None

    # ---------------------------------------------------------------- processes
    def _popen(self, kind: str, name: str, ns: str | None, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
               ) -> subprocess.Popen:
        """Start ``argv`` in namespace ``ns`` under ``env -i`` + ``env``, output to ``log_path``.

        ``ip netns exec`` and ``env`` both exec, so the Popen pid is the program's own pid. New session, so
        a Ctrl-C in the terminal reaches only us and teardown can stop things in order."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(log_path, "ab", buffering=0)
        # ns None: a process of the root namespace (podman, which puts the container in a lab namespace itself)
        full = ([] if ns is None else ["ip", "netns", "exec", self.netns(ns)]) + \
            ["env", "-i", *[f"{k}={v}" for k, v in env.items()], *argv]
        p = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=str(self.run_dir))
        self._procs.append(_Proc(kind, name, p, logf))
        return p

    def _base_env(self, home: Path) -> dict[str, str]:
        return {"PATH": f"{self.bin_dir}:{SYS_PATH}", "HOME": str(home)}

    def tailscaled_env(self, home: Path, logs_dir: Path) -> dict[str, str]:
        """The §4.2 environment for every test tailscaled (the agent passes it through to its tailscaled)."""
        return {
            **self._base_env(home),
            "TS_NO_LOGS_NO_SUPPORT": "true",
            "TS_LOGS_DIR": str(logs_dir),
            "TS_DEBUG_USE_DERP_HTTP": "true",
            "TS_DISABLE_PORTMAPPER": "1",
            "TS_PANIC_IF_HIT_MAIN_CONTROL": "1",
            "TS_DEBUG_FIREWALL_MODE": self.firewall_mode,
            "TS_ASSUME_NETWORK_UP_FOR_TEST": "1",
        }

    # ---------------------------------------------------------------- headscale
    def _hs_config_text(self) -> str:
        d = self.run_dir / "hs"
        # With IPv6 in the island the DERP server advertises its IPv6 address too and STUN answers on both
        # families: a DERP node without one makes every tailscaled's first network check wait out its whole
        # STUN timeout for IPv6 probes nobody answers (about 3 s before Running on every boot).
        stun = '"[::]:3478"' if self.ipv6 else f"{HS_V4}:3478"
        derp_v6 = f"\n    ipv6: {HS_V6}" if self.ipv6 else ""
        # Each minor's config-example.yaml, reduced to what the lab sets: derp.server.verify_clients arrived in
        # 0.27 (0.26 has no such key); the rest is the same from 0.26 to 0.29.
        verify = "\n    verify_clients: true" if self.hs_minor >= (0, 27) else ""
        return f"""\
server_url: {LOGIN_SERVER}
listen_addr: {HS_V4}:{HS_PORT}
metrics_listen_addr: 127.0.0.1:9090
grpc_listen_addr: 127.0.0.1:50443
grpc_allow_insecure: false
disable_check_updates: true
noise:
  private_key_path: {d}/noise_private.key
prefixes:
  v4: 100.64.0.0/10
  v6: fd7a:115c:a1e0::/48
  allocation: sequential
database:
  type: sqlite
  sqlite:
    path: {d}/db.sqlite
    write_ahead_log: true
derp:
  server:
    enabled: true
    region_id: 999
    region_code: headscale
    region_name: Headscale Embedded DERP{verify}
    stun_listen_addr: {stun}
    private_key_path: {d}/derp_server_private.key
    automatically_add_embedded_derp_region: true
    ipv4: {HS_V4}{derp_v6}
  urls: []
  paths: []
  auto_update_enabled: false
dns:
  magic_dns: true
  base_domain: tailnet.test
  override_local_dns: false
  nameservers:
    global: []
log:
  level: {self.hs_log_level}
  format: text
policy:
  mode: database
unix_socket: {d}/headscale.sock
unix_socket_permission: "0770"
logtail:
  enabled: false
"""

    def _start_headscale(self) -> None:
        d = self.run_dir / "hs"
        d.mkdir(parents=True, exist_ok=True)
        self.hs_config.write_text(self._hs_config_text())
        p = self._popen("headscale", "headscale", "hs", [str(self.hs_bin), "-c", str(self.hs_config), "serve"],
                        self._base_env(d), d / "headscale.log")
        # `headscale health` arrived in 0.27; before, any CLI call over the socket tells that it serves
        probe = ("health",) if self.hs_minor >= (0, 27) else ("users", "list")

        def ready() -> bool:
            if p.poll() is not None:
                raise _Exited(p.returncode)
            cp = _run(self._hs_argv(*probe), check=False, timeout=10, env=self._base_env(d))
            return cp.returncode == 0
        try:
            wait_until(ready, 60, 0.2, "headscale health")
        except _Exited:
            raise LabError("headscale exited during start:\n" + (d / "headscale.log").read_text()[-3000:]) from None

    def switch_headscale(self, version: str, *, client: bool = True) -> None:
        """Run headscale ``version`` in place of the current one, with fresh state (database, noise and DERP keys):
        the lab's tailscaled nodes are stopped and forgotten first (their keys mean nothing to the new server),
        a user and a reusable key are made again and (``client``) the ``client`` node logs in anew. The
        namespaces, HTTP servers and anything else on the island (a cluster's nodes) stay: this is how one
        cluster serves several headscale versions in turn (labtools.hsstory)."""
        hs_bin = self.bin_dir / "headscale" if version == HS_VER else headscale_binary(version, self.bin_dir)
        nodes = [p for p in self._procs if p.kind == "node"]
        servers = [p for p in self._procs if p.kind == "headscale"]
        self._term_and_wait(nodes, 10)
        self._term_and_wait(servers, 5)
        for p in nodes + servers:
            p.logf.close()
        self._procs = [p for p in self._procs if p not in nodes and p not in servers]
        for name, node in list(self.nodes.items()):
            shutil.rmtree(node.dir, ignore_errors=True)
            self._sockets.pop(name, None)
            del self.nodes[name]
        shutil.rmtree(self.run_dir / "hs", ignore_errors=True)
        self.hs_bin, self.hs_version = hs_bin, version
        self.user_id, self._authkey = None, None
        self._start_headscale()
        self.create_user()
        self._authkey = self.preauth_key(reusable=True, ephemeral=False)
        if client:
            self.start_node("client", "client")

    def _hs_argv(self, *args: str) -> list[str]:
        return [str(self.hs_bin), "-c", str(self.hs_config), *args, "-o", "json"]

    @property
    def hs_minor(self) -> tuple[int, int]:
        """The minor of the headscale the lab runs: (0, 29)."""
        m = re.match(r"v?(\d+)\.(\d+)", self.hs_version)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    def hs(self, *args: str, timeout: float = 30.0) -> Any:
        """Run the headscale CLI (over its unix socket, from the root namespace) with ``-o json``; parsed JSON.

        Empty output gives None; headscale prints ``null`` for empty lists."""
        cp = _run(self._hs_argv(*args), timeout=timeout, env=self._base_env(self.run_dir / "hs"))
        out = cp.stdout.strip()
        if not out:
            return None
        try:
            return json.loads(out)
        except json.JSONDecodeError:
            # some commands print a message rather than JSON
            return out

    def create_user(self, name: str = "e2e") -> dict:
        u = self.hs("users", "create", name)
        if self.user_id is None and isinstance(u, dict):
            self.user_id = int(u["id"])
        return u

    def preauth_key(self, reusable: bool = True, ephemeral: bool = False, *, user_id: int | None = None,
                    expiration: str = "24h", tags: Sequence[str] = ()) -> str:
        args = ["preauthkeys", "create", "--expiration", expiration]
        uid = user_id if user_id is not None else self.user_id
        if tags:
            args += ["--tags", ",".join(tags)]
        elif uid is None:
            raise LabError("create_user() first")
        if uid is not None and not tags:
            args += ["--user", str(uid)]
        if reusable:
            args.append("--reusable")
        if ephemeral:
            args.append("--ephemeral")
        k = self.hs(*args)
        return k["key"] if isinstance(k, dict) else str(k)

    @contextlib.contextmanager
    def hs_policy(self, policy: Mapping[str, Any]) -> Iterator[None]:
        """Run the body with ``policy`` as headscale's policy, then one that behaves as none again.

        The lab's headscale keeps its policy in its database (``policy.mode: database``) and starts without
        one, which headscale v0.29.2 treats as no policy at all, as it does an empty policy file path
        (``PolicyBytes`` is nil both ways); ``headscale policy set`` replaces it at run time. An empty policy
        cannot take it back (headscale ignores empty policy bytes and keeps the last one), so the restore is
        ``hs_open_policy``: no ACLs and no grants give the same allow-all filter as no policy, no ``tagOwners``
        the same refusal of every tag set through the API, and no SSH rules, nodeAttrs or autoApprovers
        either."""
        d = self.run_dir / "hs"
        f = d / "policy.hujson"
        f.write_text(json.dumps(dict(policy)))
        _run(self._hs_argv("policy", "set", "-f", str(f)), env=self._base_env(d))
        try:
            yield
        finally:
            f.write_text(self.hs_open_policy)
            _run(self._hs_argv("policy", "set", "-f", str(f)), env=self._base_env(d))

    @property
    def hs_open_policy(self) -> str:
        """A policy that lets every node reach every other, as no policy does: ``{}`` from headscale 0.27 (a
        policy without ACLs allows all there); 0.26 compiles a policy without ACLs to no rule at all (nothing
        reaches anything), so an ACL that accepts everything."""
        if self.hs_minor >= (0, 27):
            return "{}"
        return json.dumps({"acls": [{"action": "accept", "src": ["*"], "dst": ["*:*"]}]})

    def hs_nodes(self) -> list[dict]:
        return self.hs("nodes", "list") or []

    def hs_node(self, hostname: str) -> dict | None:
        for n in self.hs_nodes():
            if n.get("name") == hostname or n.get("given_name") == hostname:
                return n
        return None

    def delete_node(self, hostname: str) -> int:
        """Delete every headscale node whose reported hostname (or given name) is ``hostname``; return count."""
        count = 0
        for n in self.hs_nodes():
            if n.get("name") == hostname or n.get("given_name") == hostname:
                self.hs("nodes", "delete", "--identifier", str(n["id"]), "--force")
                count += 1
        return count

    def reset_proxy(self, agents: Iterable["AgentProcess"], hostnames: Iterable[str]) -> list[str]:
        """Test teardown: stop the agents, empty the proxy namespace, drop its firewall and forwarding, delete
        the nodes ``hostnames`` from headscale. Returns the problems met (each step is tried whatever the
        previous one did)."""
        problems = []
        for a in agents:
            try:
                a.stop(signal.SIGTERM, 30)
            except Exception as e:
                problems.append(f"stop agent: {e}")
        if self.wait_ns_empty("proxy", 10):
            problems.append(f"killed leftovers in proxy: {self.kill_ns_leftovers('proxy')}")
        try:
            self.flush_firewall("proxy")
            for key in ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"):
                self.exec("proxy", ["sh", "-c", f"echo 0 > /proc/sys/{key}"], timeout=10)
        except Exception as e:
            problems.append(f"reset proxy: {e}")
        for hostname in dict.fromkeys(hostnames):
            try:
                self.delete_node(hostname)
            except Exception as e:
                problems.append(f"delete node {hostname}: {e}")
        return problems

    def approve_routes(self, hostname: str, routes: Iterable[str], timeout: float = 30.0) -> dict:
        """Approve ``routes`` for the node ``hostname`` (waits for it to register first)."""
        node = wait_until(lambda: self.hs_node(hostname), timeout, 0.3, f"node {hostname} in headscale")
        return self.hs("nodes", "approve-routes", "--identifier", str(node["id"]), "--routes", ",".join(routes))

    # ---------------------------------------------------------------- tailscale nodes
    def _socket_for(self, name: str) -> str:
        if name.startswith("/"):
            return name
        if name in self._sockets:
            return self._sockets[name]
        raise LabError(f"no tailscaled known as {name!r} (have {sorted(self._sockets)})")

    def ts(self, name: str, *args: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the tailscale CLI against node ``name`` (or an absolute socket path), from the root namespace."""
        argv = [str(self.bin_dir / "tailscale"), f"--socket={self._socket_for(name)}", *args]
        return _run(argv, timeout=timeout, check=check, env=self._base_env(self.run_dir))

    def status(self, name: str) -> dict:
        return json.loads(self.ts(name, "status", "--json", timeout=15).stdout)

    def tailnet_ips(self, name: str) -> tuple[str | None, str | None]:
        ips = self.status(name).get("Self", {}).get("TailscaleIPs") or []
        v4 = next((i for i in ips if ":" not in i), None)
        v6 = next((i for i in ips if ":" in i), None)
        return v4, v6

    def wait_running(self, name: str, timeout: float = 60.0, *, proc: subprocess.Popen | None = None) -> dict:
        def pred() -> dict | None:
            if proc is not None and proc.poll() is not None:
                raise _Exited(proc.returncode)
            if not os.path.exists(self._socket_for(name)):
                return None
            s = self.status(name)
            if s.get("BackendState") == "Running" and (s.get("Self") or {}).get("TailscaleIPs"):
                return s
            return None
        try:
            return wait_until(pred, timeout, 0.25, f"{name} BackendState=Running")
        except _Exited as e:
            raise LabError(f"process exited ({e.args[0]}) before {name} was Running") from None

    def wait_peer(self, name: str, peer_hostname: str, timeout: float = 30.0, *, online: bool = True,
                  relay: bool = True) -> dict:
        """Wait until node ``name`` sees a peer with HostName ``peer_hostname``, Online and (``relay``) with a
        home DERP region known, which is what it needs to send the first WireGuard handshake. A peer that
        has just come up is first announced without DERP region/endpoints ("no UDP or DERP addr"); traffic
        sent before the next map update is dropped, so gate data-plane checks on this."""
        def pred() -> dict | None:
            for p in (self.status(name).get("Peer") or {}).values():
                if p.get("HostName") == peer_hostname and (p.get("Online") or not online) \
                        and (p.get("Relay") or not relay):
                    return p
            return None
        return wait_until(pred, timeout, 0.25, f"{name} sees peer {peer_hostname}")

    def start_node(self, name: str, ns: str, extra_up_args: Sequence[str] = (), accept_routes: bool = True, *,
                   authkey: str | None = None, timeout: float = 60.0) -> Node:
        """Run a plain tailscaled (kernel TUN) in ``ns`` and ``tailscale up`` it as hostname ``name``."""
        if name in self.nodes:
            raise LabError(f"node {name!r} exists")
        d = self.run_dir / "nodes" / name
        (d / "state").mkdir(parents=True, exist_ok=True)
        (d / "logs").mkdir(parents=True, exist_ok=True)
        sock = str(d / "tailscaled.sock")
        env = self.tailscaled_env(d, d / "logs")
        argv = ["tailscaled", f"--statedir={d / 'state'}", f"--socket={sock}", "--tun=tailscale0", "--port=41641",
                "--no-logs-no-support", "--verbose=1"]
        log = d / "tailscaled.log"
        p = self._popen("node", name, ns, argv, env, log)
        node = Node(name, ns, sock, d, log, p)
        self.nodes[name] = node
        self._sockets[name] = sock

        def sock_ready() -> bool:
            if p.poll() is not None:
                raise _Exited(p.returncode)
            return os.path.exists(sock)
        try:
            wait_until(sock_ready, 30, 0.1, f"{name} tailscaled socket")
        except _Exited:
            raise LabError(f"tailscaled {name} exited:\n{log.read_text()[-3000:]}") from None
        up = ["up", f"--login-server={LOGIN_SERVER}", f"--auth-key={authkey or self.authkey}", f"--hostname={name}",
              "--accept-dns=false", f"--timeout={int(timeout)}s"]
        if accept_routes:
            up.append("--accept-routes")
        up += list(extra_up_args)
        self.ts(name, *up, timeout=timeout + 15)
        self.wait_running(name, timeout)
        return node

    # ---------------------------------------------------------------- the agent
    def agent_env(self, env: Mapping[str, str] | None = None, *, dir: Path | None = None) -> dict[str, str]:
        """The default agent environment (§4.2 tailscaled env + TS_* defaults), with ``env`` on top."""
        d = dir or (self.run_dir / "proxy" / "agent")
        e = {
            **self.tailscaled_env(d, d / "logs"),
            "PYTHONUNBUFFERED": "1",
            "TS_USERSPACE": "false",
            "TS_HOSTNAME": "proxy",
            "TS_SOCKET": str(self.run_dir / "proxy" / "tailscaled.sock"),
            "TS_STATE_DIR": str(d / "state"),
            "TS_AUTHKEY": self.authkey,
            "TS_EXTRA_ARGS": f"--login-server={LOGIN_SERVER}",
            "TS_TAILSCALED_EXTRA_ARGS": "--no-logs-no-support --port=41641",
        }
        e.update(env or {})
        return e

    def start_agent(self, env: Mapping[str, str] | None = None, agent_cmd: Sequence[str] | None = None, *,
                    ns: str = "proxy", image: str | None = None,
                    container: Mapping[str, Any] | None = None) -> AgentProcess:
        """Start the agent in ``ns`` (default proxy) with ``env -i`` + agent_env(env); output to a log file.

        Each start gets a fresh directory (state, logs) under run_dir/proxy/agent-N, so scenarios do not
        inherit node keys. ``agent_cmd`` defaults to the Python agent (this venv's python -m containerboot).
        With ``image`` the agent runs from that container image instead (labtools.image.run_argv; keyword
        options for it in ``container``, e.g. ``{"net_admin": False}``); ``agent.container`` names it."""
        if agent_cmd is None:
            agent_cmd = [sys.executable, "-m", "containerboot"]
        self._agent_seq += 1
        d = self.run_dir / ns / f"agent-{self._agent_seq}"
        (d / "state").mkdir(parents=True, exist_ok=True)
        (d / "logs").mkdir(parents=True, exist_ok=True)
        e = self.agent_env(env, dir=d)
        sock = e.get("TS_SOCKET") or "/tmp/tailscaled.sock"
        if os.path.exists(sock):  # a stale socket from a previous (killed) agent would fool the readiness poll
            try:
                os.unlink(sock)
            except OSError:
                pass
        log = d / "agent.log"
        cname = None
        proc_env: Mapping[str, str] = e
        if image:
            from labtools import image as img
            cname = f"{self.prefix}-agent-{self._agent_seq}"
            agent_cmd = img.run_argv(cname, self.netns(ns), e, d / "agent.env",
                                     [str(self.run_dir / ns), os.path.dirname(sock)], image=image,
                                     **dict(container or {}))
            proc_env = {"PATH": os.environ.get("PATH") or SYS_PATH}
        started = time.monotonic()
        # podman runs in the root namespace: runc refuses --sysctl when it runs inside the container's netns
        # ("not allowed in host network namespace").
        p = self._popen("agent", f"agent-{self._agent_seq}", None if image else ns, list(agent_cmd), proc_env, log)
        a = AgentProcess(self, p, log, sock, e.get("TS_STATE_DIR", ""), e, list(agent_cmd), d, started)
        a.container = cname
        self.agents.append(a)
        self._sockets[ns] = sock
        self._sockets[a.hostname] = sock
        return a

    # ---------------------------------------------------------------- namespaces, commands
    def ns_pids(self, ns: str) -> list[int]:
        cp = self._ip("netns", "pids", self.netns(ns), check=False)
        return [int(x) for x in cp.stdout.split() if x.strip().isdigit()]

    def wait_ns_empty(self, ns: str, timeout: float = 15.0) -> list[int]:
        """Wait (bounded) for no process to be left in ``ns``; return what is still there (empty = clean)."""
        try:
            wait_until(lambda: not self.ns_pids(ns), timeout, 0.2, f"{ns} empty")
            return []
        except TimeoutError:
            return self.ns_pids(ns)

    def kill_ns_leftovers(self, ns: str, timeout: float = 10.0) -> list[int]:
        """SIGTERM, then SIGKILL, whatever is left in OUR namespace ``ns``; return the pids found."""
        pids = self.ns_pids(ns)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self.ns_pids(ns):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if not self.wait_ns_empty(ns, timeout if sig == signal.SIGTERM else 5):
                break
        self._reap()
        return pids

    def _reap(self) -> None:
        for pr in self._procs:
            pr.proc.poll()

    def exec(self, ns: str, argv: Sequence[str], timeout: float = 30.0, *, check: bool = False,
             env: Mapping[str, str] | None = None, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``ns`` (``ip netns exec``, so /etc/netns/<ns>/resolv.conf applies) with a clean env."""
        e = {**self._base_env(self.run_dir), **(env or {})}
        full = ["ip", "netns", "exec", self.netns(ns), "env", "-i", *[f"{k}={v}" for k, v in e.items()], *argv]
        return _run(full, timeout=timeout + 5, check=check, input=input)

    def curl(self, ns: str, url: str, timeout: float = 5.0, *,
             extra: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
        """curl ``url`` from ``ns`` (max ``timeout`` s, no proxies, -g so [v6] literals work). Not raising."""
        return self.exec(ns, ["curl", "-sS", "-g", "--noproxy", "*", "-m", str(timeout), *extra, url],
                         timeout=timeout + 5)

    def wait_curl(self, ns: str, url: str, expect: str, timeout: float = 30.0, per_try: float = 3.0) -> str:
        """Retry curl until the body contains ``expect``; return the body (TimeoutError with the last result)."""
        last: list[str] = [""]

        def pred() -> str | None:
            cp = self.curl(ns, url, per_try)
            last[0] = f"exit {cp.returncode}: {cp.stdout[-300:]}{cp.stderr[-300:]}"
            return cp.stdout if cp.returncode == 0 and expect in cp.stdout else None
        try:
            return wait_until(pred, timeout, 0.3, f"curl {url} from {ns}")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; last: {last[0]}") from None

    @staticmethod
    def url(ip: str, port: int, path: str = "/") -> str:
        host = f"[{ip}]" if ":" in ip else ip
        return f"http://{host}:{port}{path}"

    def flush_firewall(self, ns: str) -> None:
        """Remove every nftables/iptables rule in ``ns`` (between scenarios; tailscaled re-creates its own)."""
        self.exec(ns, ["nft", "flush", "ruleset"], timeout=10)
        for tool in ("iptables", "ip6tables"):
            for table in ("filter", "nat", "mangle", "raw"):
                self.exec(ns, [tool, "-t", table, "-F"], timeout=10)
                self.exec(ns, [tool, "-t", table, "-X"], timeout=10)

    # ---------------------------------------------------------------- HTTP backend
    def start_http_server(self, ns: str, addr: str | Sequence[str] | None = None, port: int = 8080,
                          body_marker: str = "backend-ok") -> HttpServer:
        """Start a tiny HTTP server in ``ns`` on every address in ``addr`` (default: the namespace's IPv4 and
        IPv6 addresses). Each GET answers ``<marker>\\npath=..\\npeer=..`` and appends a JSON line with the
        peer address to a log (see http_peer_log)."""
        if addr is None:
            info = self.namespaces[ns] if ns in self.namespaces else None
            addrs = tuple(a for a in ((info.ipv4, info.ipv6) if info else ()) if a)
            if not addrs:
                raise LabError(f"no addresses known for {ns}; pass addr")
        elif isinstance(addr, str):
            addrs = (addr,)
        else:
            addrs = tuple(addr)
        d = self.run_dir / "http" / f"{ns}-{port}"
        d.mkdir(parents=True, exist_ok=True)
        peer_log = d / "peers.jsonl"
        ready = d / "ready"
        argv = [sys.executable, "-I", str(Path(__file__).resolve()), "http-serve", "--port", str(port),
                "--marker", body_marker, "--peer-log", str(peer_log), "--ready", str(ready),
                *[f"--addr={a}" for a in addrs]]
        p = self._popen("http", f"http-{ns}-{port}", ns, argv, self._base_env(d), d / "server.log")

        def ok() -> bool:
            if p.poll() is not None:
                raise _Exited(p.returncode)
            return ready.exists()
        try:
            wait_until(ok, 15, 0.05, f"http server in {ns}")
        except _Exited:
            raise LabError(f"http server in {ns} exited:\n{(d / 'server.log').read_text()[-2000:]}") from None
        srv = HttpServer(ns, addrs, port, body_marker, d / "server.log", peer_log, p)
        self.http_servers.append(srv)
        return srv

    def http_peer_log(self, ns: str | HttpServer, port: int = 8080) -> list[dict]:
        """Requests seen by the HTTP server (``{"peer", "peer_port", "local", "path", "time"}`` per request)."""
        srv = ns if isinstance(ns, HttpServer) else next(
            (s for s in self.http_servers if s.ns == ns and s.port == port), None)
        if srv is None:
            raise LabError(f"no http server in {ns} on {port}")
        try:
            lines = srv.peer_log.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(ln) for ln in lines if ln.strip()]

    # ---------------------------------------------------------------- diagnostics
    def dump_diagnostics(self, max_log_chars: int = 20000) -> str:
        """Everything useful after a failure: logs, headscale nodes, and per-namespace netfilter/routes/rules."""
        out: list[str] = [f"=== lab {self.prefix} run_dir={self.run_dir} bin_dir={self.bin_dir} "
                          f"firewall={self.firewall_mode}"]
        if self.run_dir.exists():
            for f in sorted(self.run_dir.rglob("*")):
                if f.is_file() and (f.suffix in (".log", ".jsonl") or f.name.endswith(".log")):
                    try:
                        t = f.read_text(errors="replace")
                    except OSError as e:
                        t = f"<{e}>"
                    if len(t) > max_log_chars:
                        t = f"...[{len(t) - max_log_chars} chars cut]...\n" + t[-max_log_chars:]
                    out.append(f"\n=== {f.relative_to(self.run_dir)}\n{t}")
        try:
            out.append("\n=== headscale nodes list\n" + json.dumps(self.hs_nodes(), indent=1))
        except Exception as e:
            out.append(f"\n=== headscale nodes list failed: {e}")
        for name, sock in sorted(self._sockets.items()):
            if os.path.exists(sock):
                cp = self.ts(sock, "status", check=False, timeout=10)
                out.append(f"\n=== tailscale status ({name})\n{cp.stdout}{cp.stderr}")
        cmds = [["nft", "list", "ruleset"], ["iptables-save"], ["ip6tables-save"], ["ip", "addr"],
                ["ip", "route", "show", "table", "all"], ["ip", "-6", "route", "show", "table", "all"],
                ["ip", "rule"], ["ip", "-6", "rule"], ["sh", "-c", "cat /proc/sys/net/ipv4/ip_forward "
                                                         "/proc/sys/net/ipv6/conf/all/forwarding"]]
        for short, info in self.namespaces.items():
            if short == "sw":
                continue
            pids = self.ns_pids(short)
            out.append(f"\n##### namespace {info.netns} pids={pids}")
            for c in cmds:
                try:
                    cp = self.exec(short, c, timeout=10)
                    out.append(f"--- {' '.join(c)}\n{cp.stdout}{cp.stderr}")
                except Exception as e:
                    out.append(f"--- {' '.join(c)} failed: {e}")
        return "\n".join(out)

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        """Tear everything down; idempotent. SIGTERM our processes (agents and tailscaled first, so they remove
        their rules), wait, SIGKILL leftovers in OUR namespaces, delete the namespaces, /etc/netns entries and
        the run dir (kept if CBPY_KEEP_RUN_DIR=1)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        old = None
        if threading.current_thread() is threading.main_thread():
            try:
                old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abort teardown
            except ValueError:
                old = None
        try:
            self._teardown()
        finally:
            _LIVE_LABS.discard(self)
            if old is not None:
                signal.signal(signal.SIGINT, old)

    def _term_and_wait(self, procs: list[_Proc], timeout: float) -> None:
        for pr in procs:
            if pr.proc.poll() is None:
                try:
                    pr.proc.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for pr in procs:
            try:
                pr.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pr in procs:
            if pr.proc.poll() is None:
                pr.proc.kill()
                try:
                    pr.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass

    def _teardown(self) -> None:
        errors: list[str] = []
        by_kind = lambda *k: [p for p in self._procs if p.kind in k]  # noqa: E731
        try:
            self._term_and_wait(by_kind("agent"), 20)
            self._term_and_wait(by_kind("node"), 10)
            self._term_and_wait(by_kind("http", "headscale"), 5)
        except Exception as e:
            errors.append(f"stopping processes: {e}")
        for short in list(self.namespaces):
            try:
                if self.ns_pids(short):
                    self.kill_ns_leftovers(short, 5)
            except Exception as e:
                errors.append(f"leftovers in {short}: {e}")
        for pr in self._procs:
            try:
                pr.logf.close()
            except Exception:
                pass
        # delete non-switch namespaces first (their veths disappear with them), then the switch
        for short in sorted(self.namespaces, key=lambda s: s == "sw"):
            full = self.namespaces[short].netns
            cp = self._ip("netns", "del", full, check=False)
            if cp.returncode != 0 and "No such file" not in cp.stderr:
                errors.append(f"ip netns del {full}: {cp.stderr.strip()}")
            shutil.rmtree(Path("/etc/netns") / full, ignore_errors=True)
        self.namespaces.clear()
        if os.environ.get("CBPY_KEEP_RUN_DIR") != "1":
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if errors:
            print(f"labtools: teardown of {self.prefix} had problems: " + "; ".join(errors), file=sys.stderr)


def _close_all_labs() -> None:
    for lab in list(_LIVE_LABS):
        try:
            lab.close()
        except Exception as e:
            print(f"labtools: atexit close failed: {e}", file=sys.stderr)


atexit.register(_close_all_labs)


# --------------------------------------------------------------------------------------------------------
# the tiny HTTP server (run inside a namespace as: python -I lab.py http-serve ...)
# --------------------------------------------------------------------------------------------------------

def _http_serve(argv: list[str]) -> int:
    import argparse
    import http.server
    import socket
    import socketserver

    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", action="append", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--marker", required=True)
    ap.add_argument("--peer-log", required=True)
    ap.add_argument("--ready", required=True)
    a = ap.parse_args(argv)
    lock = threading.Lock()
    plog = open(a.peer_log, "a", buffering=1)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_GET(self) -> None:
            peer, pport = self.client_address[0], self.client_address[1]
            local = self.connection.getsockname()[0]
            rec = {"peer": peer, "peer_port": pport, "local": local, "path": self.path, "time": time.time()}
            with lock:
                plog.write(json.dumps(rec) + "\n")
            body = f"{a.marker}\npath={self.path}\npeer={peer}\nlocal={local}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Peer", peer)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            sys.stderr.write("%s %s\n" % (self.client_address[0], fmt % args))

    servers = []
    for addr in a.addr:
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET

        class Srv(socketserver.ThreadingTCPServer):
            address_family = fam
            allow_reuse_address = True
            daemon_threads = True

            def server_bind(self) -> None:
                # no socket.getfqdn() (HTTPServer does that): it would wait on DNS (e2e-headscale §7 #9)
                if self.address_family == socket.AF_INET6:
                    self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                super().server_bind()

        s = Srv((addr, a.port), Handler)
        servers.append(s)
        threading.Thread(target=s.serve_forever, daemon=True).start()
    Path(a.ready).write_text("ok\n")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    for s in servers:
        s.shutdown()
    return 0


def reap_stale(run_root: str | Path = "/tmp", dry_run: bool = False) -> list[str]:
    """Remove labs left behind by a process that died without teardown (e.g. a SIGKILLed pytest).

    Only labs made by this module are touched: a run dir ``<run_root>/<prefix>/owner`` whose owner pid is
    gone, and the netns named ``<prefix>-*``. Processes inside those namespaces are killed (they were started
    by that lab), then the namespaces, /etc/netns entries and the run dir are removed. Returns the prefixes."""
    reaped = []
    listed = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    all_ns = [ln.split()[0] for ln in listed if ln.strip()]
    for owner in sorted(Path(run_root).glob("cb*/owner")):
        try:
            pid = int(owner.read_text().strip())
            os.kill(pid, 0)
            continue  # owner alive: not stale
        except ProcessLookupError:
            pass
        except (ValueError, OSError):
            continue
        prefix = owner.parent.name
        reaped.append(prefix)
        if dry_run:
            continue
        mine = [n for n in all_ns if n.startswith(prefix + "-")]
        for n in mine:
            pids = _run(["ip", "netns", "pids", n], check=False).stdout.split()
            for p in pids:
                try:
                    os.kill(int(p), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for n in sorted(mine, key=lambda x: x.endswith("-sw")):
            _run(["ip", "netns", "del", n], check=False)
            shutil.rmtree(Path("/etc/netns") / n, ignore_errors=True)
        shutil.rmtree(owner.parent, ignore_errors=True)
    return reaped


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "http-serve":
        sys.exit(_http_serve(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] in ("reap-stale", "list-stale"):
        print("\n".join(reap_stale(dry_run=sys.argv[1] == "list-stale")) or "(none)")
        sys.exit(0)
    print("usage: python -m labtools.lab reap-stale|list-stale   (demo: python -m labtools.demo)", file=sys.stderr)
    sys.exit(2)
