"""Command line: `containerboot` runs the agent; `containerboot rules` shows its rules (debugging)."""
from __future__ import annotations

import asyncio
import logging
import os
import sys

from .redact import redact


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
    if argv and argv[0] in ("-h", "--help"):
        print("usage: containerboot            run the agent (configured by TS_* environment variables)\n"
              "       containerboot rules      show the desired and installed firewall rules\n"
              "See the README for every variable.")
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
    from . import memtrim
    memtrim.limit_arenas()   # before the first thread: one malloc arena for all of them
    from .agent import Agent
    return asyncio.run(Agent(settings, os.environ).run())


if __name__ == "__main__":
    sys.exit(main())
