"""The periodic checks of the parts the data path does not need (adapter): the control server tailscaled uses, and
the Kubernetes API server holding the state Secret. What they found is in /status; each change is one log line.

tailscaled raises no health warning while its control server is gone (measured: none in five minutes, neither
in `tailscale status` nor on the IPN bus), so the agent asks the control server itself: `GET <ControlURL>/key?v=N`,
the unauthenticated request every Tailscale client makes first, answered by Tailscale's control plane and by
headscale, with the ControlURL read from tailscaled's prefs at each check (a config reload may change it). It is
a plain HTTP/1.1 request on asyncio streams (no HTTP library loaded for it), TLS verified against the system's
store; it goes direct, so a control server reached only through an HTTP proxy shows as unreachable.

The API server's check is one `GET /readyz` with the ServiceAccount token (allowed to every authenticated user by
Kubernetes' default `system:public-info-viewer` role), no retries; the agent's own Secret writes count as checks
too. When the API server answers again and Secret writes are pending, the reconciler is poked so they land at
once instead of at the next resync.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from tscommon.redact import redact

from .reachability import FIRST_CHECK_AFTER, Reachability, next_check_in, public_url

if TYPE_CHECKING:
    import ssl  # loaded at the first https check only (a control server over http never needs it)

log = logging.getLogger("containerboot")

#: Seconds one check may take; a server that does not answer within it counts as unreachable.
CHECK_TIMEOUT = 5.0

class Probe:
    """One part's reachability: `run()` checks it periodically; `record()` takes outcomes from elsewhere too.

    A check returns (target, error) -- error "" when the part answered as it should -- or None when nothing was
    checked (e.g. the ControlURL is not known yet)."""

    def __init__(self, name: str, check: Callable[[], Awaitable["tuple[str, str] | None"]], *,
                 on_change: Callable[[Reachability], None] | None = None, clock: Callable[[], float] = time.time,
                 first_after: float = FIRST_CHECK_AFTER) -> None:
        self.state = Reachability(name)
        self.check = check
        self.on_change = on_change
        self.clock = clock
        self.first_after = first_after

    def record(self, error: str, target: str | None = None) -> None:
        old = self.state
        self.state = new = old.observe(redact(error), self.clock(), target)
        msg = old.change_message(new)
        if msg:
            (log.info if new.reachable else log.warning)("%s", msg)
        if old.reachable is not new.reachable and self.on_change is not None:
            self.on_change(new)

    def note_error(self, error: str) -> None:
        self.state = self.state.note_error(redact(error), self.clock())

    async def run(self) -> None:
        await asyncio.sleep(self.first_after)
        while True:
            try:
                res = await self.check()
            except Exception as e:   # a check must never end the agent: report it as the part's failure
                res = (self.state.target, f"check failed: {type(e).__name__}: {e}")
            if res is not None:
                self.record(res[1], res[0])
            await asyncio.sleep(next_check_in(self.state))


# -- the control server ------------------------------------------------------------------------------------------

_TLS: "ssl.SSLContext | None" = None


def _tls() -> "ssl.SSLContext":
    global _TLS
    if _TLS is None:
        from .catrust import client_context
        _TLS = client_context()     # the CAs tailscaled trusts: a private CA in SSL_CERT_DIR included
    return _TLS


async def http_status(url: str, timeout: float = CHECK_TIMEOUT) -> int:
    """The HTTP status of `GET url` (HTTP/1.1, Connection: close; only the status line is read)."""
    u = urlsplit(url)
    https = u.scheme == "https"
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {public_url(url) or '(unparsable)'}")
    port = u.port or (443 if https else 80)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    host = u.hostname if ":" not in u.hostname else f"[{u.hostname}]"
    hostport = host if u.port is None else f"{host}:{u.port}"
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(u.hostname, port, ssl=_tls() if https else None,
                                                       server_hostname=u.hostname if https else None)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {hostport}\r\nUser-Agent: containerboot-py\r\n"
                         "Connection: close\r\n\r\n".encode())
            await writer.drain()
            line = await reader.readline()
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:   # ssl.SSLError is one
                pass
    parts = line.split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise ValueError("the answer is not HTTP")
    return int(parts[1])


def control_check(prefs: Callable[[], Awaitable[dict]], capver: int,
                  get: Callable[[str], Awaitable[int]] = http_status
                  ) -> Callable[[], Awaitable["tuple[str, str] | None"]]:
    """The control server's check: its ControlURL from tailscaled's prefs, then `GET <url>/key?v=<capver>`."""
    async def check() -> "tuple[str, str] | None":
        try:
            url = str((await prefs()).get("ControlURL") or "")
        except Exception:      # tailscaled busy or restarting: nothing checked this time
            return None
        target = public_url(url)
        if not target:
            return None
        try:
            status = await get(f"{target.rstrip('/')}/key?v={capver}")
        except TimeoutError:
            return target, f"GET /key: no answer within {CHECK_TIMEOUT:g}s"
        except (OSError, ValueError) as e:   # ssl.SSLError is an OSError
            return target, f"GET /key: {type(e).__name__}: {e}"
        if status != 200:
            return target, f"GET /key: HTTP {status}"
        return target, ""
    return check
