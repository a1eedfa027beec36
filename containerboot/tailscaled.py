"""tailscaled and the tailscale CLI: argv construction (pure) and process supervision (adapter).

tailscaled runs in its own process group so that a signal sent to the agent's group by a terminal does not
reach it before the agent has done its shutdown work; the agent forwards SIGTERM itself. Readiness is the
LocalAPI socket accepting a connection (upstream only checks that the file exists, so a stale socket from a
previous run passes at once).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import asyncio
    import subprocess

from tscommon.redact import redact

from .settings import SETTINGS, Settings

log = logging.getLogger("containerboot")

DEFAULT_SOCKET_LINK = "/var/run/tailscale/tailscaled.sock"

# Flags that only `tailscale up` takes; `tailscale set` rejects them. With TS_AUTH_ONCE the agent re-applies
# TS_EXTRA_ARGS through `set` (upstream drops them) and leaves these out, saying so.
UP_ONLY_FLAGS = frozenset({
    "login-server", "authkey", "auth-key", "force-reauth", "reset", "timeout", "qr", "qr-format", "json",
    "advertise-tags", "client-id", "client-secret", "id-token", "audience", "unattended",
})


def flag_name(arg: str) -> str | None:
    """`--foo=bar` -> `foo`; non-flags -> None."""
    if not arg.startswith("-"):
        return None
    return arg.lstrip("-").split("=", 1)[0]


def tailscaled_argv(s: Settings) -> list[str]:
    """The tailscaled command line, in upstream's order."""
    argv = ["tailscaled", f"--socket={s.socket}"]
    if s.kube_secret:
        argv += [f"--state=kube:{s.kube_secret}", f"--statedir={s.state_dir or '/tmp'}"]
    elif s.state_dir:
        argv.append(f"--statedir={s.state_dir}")
    else:
        argv += ["--state=mem:", "--statedir=/tmp"]
    if s.userspace:
        argv.append("--tun=userspace-networking")
    if s.socks5_server:
        argv.append(f"--socks5-server={s.socks5_server}")
    if s.outbound_http_proxy_listen:
        argv.append(f"--outbound-http-proxy-listen={s.outbound_http_proxy_listen}")
    if s.one_step:
        argv.append(f"--config={s.tailscaled_config_path}")
    if s.debug_addr_port and s.debug_addr_port not in " ".join(s.tailscaled_extra_args):
        argv.append(f"--debug={s.debug_addr_port}")
    argv += list(s.tailscaled_extra_args)
    return argv


def _common_pref_args(s: Settings) -> list[str]:
    return [f"--accept-dns={'true' if s.accept_dns else 'false'}"]


def tailscale_up_argv(s: Settings, authkey: str | None = None) -> list[str]:
    """`tailscale up` with upstream's flags and order."""
    argv = ["tailscale", f"--socket={s.socket}", "up", *_common_pref_args(s)]
    key = s.authkey if authkey is None else authkey
    if key:
        argv.append(f"--authkey={key}")
    for flag, value in (("client-id", s.client_id), ("client-secret", s.client_secret),
                        ("id-token", s.id_token), ("audience", s.audience)):
        if value:
            argv.append(f"--{flag}={value}")
    if s.routes is not None:
        argv.append(f"--advertise-routes={s.routes}")
    if s.hostname:
        argv.append(f"--hostname={s.hostname}")
    argv += list(s.extra_args)
    return argv


def tailscale_set_argv(s: Settings) -> tuple[list[str], list[str]]:
    """`tailscale set` for TS_AUTH_ONCE after login, and the extra args left out because `set` rejects them.

    Upstream passes no TS_EXTRA_ARGS to `set`, so flags such as --advertise-exit-node are lost on every
    restart after the first login; here every flag that `set` accepts is re-applied.
    """
    argv = ["tailscale", f"--socket={s.socket}", "set", *_common_pref_args(s)]
    if s.routes is not None:
        argv.append(f"--advertise-routes={s.routes}")
    if s.hostname:
        argv.append(f"--hostname={s.hostname}")
    skipped: list[str] = []
    args = list(s.extra_args)
    i = 0
    while i < len(args):
        a = args[i]
        name = flag_name(a)
        # A flag given as `--flag value` carries its value in the next token.
        takes_next = name is not None and "=" not in a and i + 1 < len(args) and flag_name(args[i + 1]) is None
        group = args[i:i + 2] if takes_next else [a]
        (skipped if name in UP_ONLY_FLAGS else argv).extend(group)
        i += len(group)
    return argv, skipped


# Variables that hold credentials. The agent passes them to `tailscale up` as flags (as files, see
# `secret_flags_to_files`); neither tailscaled nor the CLI reads them from the environment, and a child's
# environment is readable in /proc/<pid>/environ for its whole life.
SECRET_ENV = tuple(setting.name for setting in SETTINGS if setting.secret)

# `tailscale up` flags whose value is a credential, and which read a `file:<path>` value from that file
# (tailscale v1.102's CLI: --auth-key, its alias --authkey, --client-secret, --id-token).
SECRET_FLAGS = frozenset({"authkey", "auth-key", "client-secret", "id-token"})


def child_env(s: Settings, env: Mapping[str, str]) -> dict[str, str]:
    """tailscaled and the CLI inherit the agent's environment (the operator passes knobs this way), without the
    credentials: they need none of them from there."""
    out = {k: v for k, v in env.items() if k not in SECRET_ENV}
    if s.cert_share_mode:
        out["TS_CERT_SHARE_MODE"] = s.cert_share_mode
    # tailscaled's kube store joins host and port with a colon; an IPv6 host needs brackets (upstream defect 27).
    host = out.get("KUBERNETES_SERVICE_HOST", "")
    if ":" in host and not host.startswith("["):
        out["KUBERNETES_SERVICE_HOST"] = f"[{host}]"
    return out


def ensure_tun(root: str = "/") -> None:
    """Create /dev/net/tun when it is missing (kernel networking needs it)."""
    d = os.path.join(root, "dev/net")
    os.makedirs(d, mode=0o755, exist_ok=True)
    tun = os.path.join(d, "tun")
    if not os.path.exists(tun):
        os.mknod(tun, 0o600 | 0o020000, os.makedev(10, 200))


def socket_accepts(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(path)
            return True
        except OSError:
            return False


def socket_link_path(root: str = "/") -> str:
    return os.path.join(root, DEFAULT_SOCKET_LINK.lstrip("/"))


def should_link_socket(s: Settings) -> bool:
    """Link the default socket path only inside a container (or a test root): run locally for debugging,
    the host's /var/run/tailscale belongs to the host's own tailscaled, and concurrent local agents would
    overwrite each other's link."""
    return s.in_kubernetes or s.root != "/" or os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")


def link_socket(path: str, link: str) -> bool:
    """Make the default socket path point at ours so a bare `tailscale` CLI in the container works.

    Upstream fails with EEXIST after a restart; a link that already points here is fine, and a stale link is
    replaced. A real socket there (a host tailscaled, when run locally) is never touched. Returns whether the
    link now points at our socket.
    """
    if os.path.abspath(path) == link:
        return False
    try:
        os.makedirs(os.path.dirname(link), mode=0o700, exist_ok=True)
        if os.path.islink(link):
            if os.readlink(link) == path:
                return True
            os.unlink(link)
        os.symlink(path, link)
        return True
    except OSError as e:
        log.warning("[warning] failed to symlink socket: %s\n\tTo interact with the Tailscale CLI please use "
                    "`tailscale --socket=%r`", e, path)
        return False


def unlink_socket(path: str, link: str) -> None:
    """Remove the default-path link at shutdown, but only if it is still ours."""
    try:
        if os.path.islink(link) and os.readlink(link) == path:
            os.unlink(link)
    except OSError:
        pass


def _remove_stale_socket(socket_path: str) -> None:
    """A stale socket from an earlier run must not count as readiness."""
    if os.path.exists(socket_path) and not socket_accepts(socket_path):
        try:
            os.unlink(socket_path)
        except OSError:
            pass


def spawn(argv: Sequence[str], env: Mapping[str, str], socket_path: str) -> "subprocess.Popen":
    """Start tailscaled without an event loop: the agent does this before importing the rest of itself, so
    that tailscaled's own start-up overlaps the agent's imports (see __main__)."""
    import subprocess
    log.info("Starting tailscaled: %s", redact(" ".join(argv)))
    _remove_stale_socket(socket_path)
    return subprocess.Popen(list(argv), env=dict(env), process_group=0)


class ChildProcess(Protocol):
    """What the agent uses of a child process: asyncio's Process and `_AdoptedProcess` both provide it."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    async def wait(self) -> int: ...


class _AdoptedProcess:
    """The part of asyncio.subprocess.Process the agent uses, for a subprocess.Popen: its exit is noticed
    through a pidfd on the event loop (no polling), or a waiting thread where pidfds do not exist."""

    def __init__(self, popen: "subprocess.Popen") -> None:
        self._popen = popen
        self.pid = popen.pid
        self._exited: asyncio.Future[None] | None = None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll() if self._popen.returncode is None else self._popen.returncode

    def send_signal(self, sig: int) -> None:
        self._popen.send_signal(sig)

    async def wait(self) -> int:
        import asyncio
        if self.returncode is not None:
            return self._popen.returncode
        loop = asyncio.get_running_loop()
        if self._exited is None:
            self._exited = loop.create_future()
            try:
                fd = os.pidfd_open(self.pid)
            except (AttributeError, OSError):
                fut = self._exited

                def waited(_: object) -> None:
                    if not fut.done():
                        fut.set_result(None)
                loop.run_in_executor(None, self._popen.wait).add_done_callback(waited)
            else:
                def exited(fut=self._exited) -> None:
                    loop.remove_reader(fd)
                    os.close(fd)
                    if not fut.done():
                        fut.set_result(None)
                loop.add_reader(fd, exited)
        await asyncio.shield(self._exited)
        return self._popen.wait()


class TailscaledExited(Exception):
    pass


@dataclass
class Tailscaled:
    """A running tailscaled child."""

    proc: ChildProcess
    socket_path: str

    @classmethod
    async def start(cls, argv: Sequence[str], env: Mapping[str, str], socket_path: str) -> "Tailscaled":
        import asyncio
        log.info("Starting tailscaled: %s", redact(" ".join(argv)))
        _remove_stale_socket(socket_path)
        proc = await asyncio.create_subprocess_exec(*argv, env=dict(env), process_group=0)
        return cls(proc, socket_path)

    @classmethod
    def adopt(cls, popen: "subprocess.Popen", socket_path: str) -> "Tailscaled":
        """A tailscaled started by `spawn` before the event loop existed."""
        return cls(_AdoptedProcess(popen), socket_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.returncode is None

    async def wait_ready(self, deadline: float) -> None:
        """Wait until the LocalAPI socket accepts connections; fail if tailscaled exits or time runs out."""
        import asyncio
        while True:
            if not self.alive():
                raise TailscaledExited(f"tailscaled exited with status {self.proc.returncode} before its "
                                       "LocalAPI socket was ready")
            if os.path.exists(self.socket_path) and await asyncio.to_thread(socket_accepts, self.socket_path):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out waiting for tailscaled socket {self.socket_path}")
            await asyncio.sleep(0.01)   # `tailscale up` starts as soon as the socket is there

    async def stop(self, timeout: float) -> int | None:
        """SIGTERM tailscaled and wait for it; SIGKILL its group if it does not exit in time."""
        import asyncio
        if self.alive():
            log.info("Sending SIGTERM to tailscaled")
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("tailscaled did not exit within %.0fs of SIGTERM; killing it", timeout)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return await self.proc.wait()


def secret_flags_to_files(argv: Sequence[str], directory: str) -> list[str]:
    """argv with each credential flag's value written to a file in `directory` and passed as `file:<path>`.

    A command line is readable by every process on the host (/proc/<pid>/cmdline, `ps`); a 0600 file in a
    0700 directory only by the agent's user. Values already given as `file:` stay as they are. Both the
    `--flag=value` and the `--flag value` forms are handled (TS_EXTRA_ARGS may use either)."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        name = flag_name(a)
        if name not in SECRET_FLAGS:
            out.append(a)
            i += 1
            continue
        if "=" in a:
            flag, value = a.split("=", 1)
            i += 1
        elif i + 1 < len(args):
            flag, value = a, args[i + 1]
            i += 2
        else:
            out.append(a)
            i += 1
            continue
        if value and not value.startswith("file:"):
            path = os.path.join(directory, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(value)
            value = "file:" + path
        out.append(f"{flag}={value}")
    return out


async def run_cli(argv: Sequence[str], env: Mapping[str, str], deadline: float | None) -> None:
    """Run a `tailscale` CLI command; SIGKILL it when the deadline passes. Raises on failure.

    Credentials on the command line go to the CLI as files (a private directory removed when it exits)."""
    import asyncio
    import shutil
    import tempfile
    directory = tempfile.mkdtemp(prefix="containerboot-")   # 0700
    try:
        argv = secret_flags_to_files(argv, directory)
        shown = redact(" ".join(argv))
        log.info("Running %s", shown)
        proc = await asyncio.create_subprocess_exec(*argv, env=dict(env))
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            rc = await asyncio.wait_for(proc.wait(), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            proc.kill()
            await proc.wait()
            raise
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if rc != 0:
        raise RuntimeError(f"{argv[2] if len(argv) > 2 else argv[0]} failed: exit status {rc}")


def routing_warnings(s: Settings) -> list[str]:
    """Configurations that work but route differently from what the user probably means."""
    exit_flag = s.advertises_exit_node
    routes = [r.strip() for r in (s.routes or "").split(",") if r.strip()]
    default_routes = [r for r in routes if r in ("0.0.0.0/0", "::/0")]
    subnets = [r for r in routes if r not in default_routes]
    if (exit_flag or default_routes) and subnets:
        return [f"this node advertises both an exit node and subnet routes ({', '.join(subnets)}): a client that "
                "uses it as its exit node sends all its traffic here, so the default route subsumes the subnet "
                "routes, and a client that only accepts routes gets the subnets but not the exit node; the two "
                "roles fail over and scale differently. Recommended: run two proxies (two Connectors), one with "
                "TS_ROUTES for the subnets and one with --advertise-exit-node."]
    return []
