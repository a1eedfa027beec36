"""Command line: `containerboot` runs the agent; `containerboot rules` shows its rules (debugging)."""
from __future__ import annotations

import logging
import os
import sys

from tscommon.redact import redact

from .deferssl import import_asyncio

asyncio = import_asyncio()   # without ssl until something needs TLS (containerboot.deferssl)


class _RedactingFormatter(logging.Formatter):
    """Every log line passes through redaction: a secret can never reach the log by accident."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def setup_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    # Upstream's log format by default (tools grep for it); milliseconds when debugging.
    fmt = "boot: %(asctime)s.%(msecs)03d %(message)s" if level == logging.DEBUG else "boot: %(asctime)s %(message)s"
    handler.setFormatter(_RedactingFormatter(fmt, "%Y/%m/%d %H:%M:%S"))
    root = logging.getLogger("containerboot")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rules":
        from .rulesview import main as rules_main
        return rules_main(argv[1:])
    if argv and argv[0] == "apiserver-proxy":
        setup_logging(logging.DEBUG if os.environ.get("TS_DEBUG_AGENT_LOG") == "debug" else logging.INFO)
        from .apiproxy.run import main as proxy_main
        return proxy_main(os.environ)
    if argv and argv[0] in ("-h", "--help"):
        print("usage: containerboot            run the agent (configured by TS_* environment variables)\n"
              "       containerboot rules      show the desired and installed firewall rules\n"
              "       containerboot apiserver-proxy   the Kubernetes API server proxy (next to an agent)\n"
              "See docs/agent.md for every variable.")
        return 0
    import faulthandler
    import signal

    # `kill -USR1 <agent>` prints every thread's stack to stderr: a cheap way to see where a live agent is.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    setup_logging(logging.DEBUG if os.environ.get("TS_DEBUG_AGENT_LOG") == "debug" else logging.INFO)
    log = logging.getLogger("containerboot")
    from .settings import SettingsError, load
    try:
        settings = load(os.environ, root=os.environ.get("TS_TEST_ONLY_ROOT") or "/")
    except SettingsError as e:
        log.error("invalid configuration: %s", e)
        return 1
    from tscommon import ownenv

    from .settings import SETTINGS
    # The credentials are in `settings` now; /proc/<agent>/environ, and a child's before its exec, keep no copy.
    ownenv.scrub(setting.name for setting in SETTINGS if setting.secret)
    early = _early_tailscaled(settings)   # first: its start-up overlaps everything below
    from . import memtrim
    memtrim.limit_arenas()   # before the first thread: one malloc arena for all of them
    from .agent import Agent  # the bulk of the agent's imports, while tailscaled starts
    return asyncio.run(Agent(settings, os.environ, early=early).run())


class EarlyStart:
    """tailscaled started before the agent's imports, and a SIGTERM/SIGINT that arrived before the agent's
    own handlers were installed (the agent then shuts down as if it had arrived later)."""

    def __init__(self, popen) -> None:
        import signal
        self.popen = popen
        self.pending_signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._remember)

    def _remember(self, signum, frame) -> None:
        self.pending_signal = self.pending_signal or signum


def _early_tailscaled(settings) -> EarlyStart | None:
    """Start tailscaled now when nothing has to happen before it, so that its start-up (about 0.2 s) overlaps
    the agent's imports. Not with a state Secret (RBAC checks and the Secret reset come first) or a config
    directory; and only when the host checks that must pass before anything starts pass (otherwise the agent
    repeats them and reports the failure in order, with tailscaled never started)."""
    if settings.kube_secret or settings.one_step:
        return None
    from . import tailscaled as ts
    if not settings.userspace:
        from .privileges import missing_net_admin
        if missing_net_admin(settings.root):
            return None   # the agent reports it before starting anything
        try:
            ts.ensure_tun(settings.root)
            if any(settings.forwarding_families):
                from netfilter.sysctl import ensure_forwarding
                ensure_forwarding(*settings.forwarding_families, root=settings.root)
        except Exception:   # reported by the agent, in its place
            return None
    try:
        popen = ts.spawn(ts.tailscaled_argv(settings), ts.child_env(settings, os.environ), settings.socket)
    except OSError:
        return None    # the agent tries again and reports it
    return EarlyStart(popen)


if __name__ == "__main__":
    sys.exit(main())
