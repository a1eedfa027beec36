"""Whether a part the agent uses but the data path does not need answers: the control server and the Kubernetes
API server. The state, the probe schedule and the one log line per change.

Pure module: no I/O, no clock reads (callers pass `now`). `containerboot.probes` runs the checks and feeds the
outcomes in; /status shows `to_json()`. Neither part gates readiness: WireGuard between peers that know each
other needs no control server, and the forwarding rules need no API server (only the state Secret's writes do,
and those are retried until they land). A proxy that went unready during a control-plane or API-server outage
would only take traffic away from a data path that still works.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["Reachability", "public_url", "next_check_in", "UP_EVERY", "DOWN_EVERY", "FIRST_CHECK_AFTER"]

#: Seconds between checks while the part answers: cheap enough for a fleet of proxies against one server.
UP_EVERY = 15.0
#: Seconds between checks while it does not: the return is noticed (and what waited for it retried) sooner.
DOWN_EVERY = 5.0
#: The first check waits until the boot is over: it is not on the start-up's critical path.
FIRST_CHECK_AFTER = 3.0


@dataclass(frozen=True)
class Reachability:
    """What the last checks of one part found."""

    name: str                         # "control server", "Kubernetes API server": for the log line
    target: str = ""                  # the URL checked, without credentials ("" until known)
    reachable: bool | None = None     # None: not checked yet
    since: float | None = None        # when `reachable` took its current value
    checked_at: float | None = None
    last_error: str = ""              # the last failure, kept after a recovery (with its time) for the record
    last_error_at: float | None = None
    failures: int = 0                 # consecutive failed checks

    def observe(self, error: str, now: float, target: str | None = None) -> "Reachability":
        """The outcome of one check: `error` is "" when the part answered as it should."""
        ok = not error
        since = self.since if self.reachable is ok else now
        new = replace(self, reachable=ok, since=since, checked_at=now, failures=0 if ok else self.failures + 1)
        if target is not None:
            new = replace(new, target=target)
        if not ok:
            new = replace(new, last_error=error, last_error_at=now)
        return new

    def note_error(self, error: str, now: float) -> "Reachability":
        """A failure that says nothing about reachability (the server answered, e.g. 403): recorded only."""
        return replace(self, last_error=error, last_error_at=now)

    def change_message(self, new: "Reachability") -> str | None:
        """The log line for going from self to new, or None when reachability did not change. A first check
        that finds the part answering is no change worth a line (nothing was wrong before)."""
        if new.reachable is self.reachable or new.reachable is None:
            return None
        where = f" ({new.target})" if new.target else ""
        if new.reachable:
            if self.reachable is None:
                return None
            down_for = f" after {new.since - self.since:.0f}s" if self.since is not None and new.since else ""
            return f"{new.name}{where} reachable again{down_for}"
        return f"{new.name}{where} unreachable: {new.last_error}"

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "reachable": self.reachable, "since": self.since,
                "checked_at": self.checked_at, "consecutive_failures": self.failures,
                "last_error": self.last_error, "last_error_at": self.last_error_at}


def next_check_in(r: Reachability, *, up_every: float = UP_EVERY, down_every: float = DOWN_EVERY,
                  rng: random.Random | None = None) -> float:
    """Seconds until the next check: `down_every` while the part is not known to answer, `up_every` when it does;
    ±10 % jitter so that a fleet of proxies restarted together does not check in step."""
    base = up_every if r.reachable else down_every
    return base * (rng or random).uniform(0.9, 1.1)


def public_url(url: str) -> str:
    """The URL without user information, query or fragment: what /status and the log may show."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        return ""
    if not u.scheme or not u.hostname:
        return ""
    host = u.hostname if ":" not in u.hostname else f"[{u.hostname}]"
    netloc = f"{host}:{port}" if port else host
    return urlunsplit((u.scheme, netloc, u.path, "", ""))
