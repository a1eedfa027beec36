"""Kubernetes steps of the agent that need the API: permission checks, the shutdown consistency wait and the
auth-key reissue flow (adapter glue around ``kube.KubeClient`` and the pure ``secretstate``).

Deadlines are absolute ``time.monotonic()`` values, like in ``containerboot.kube.client``.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from containerboot.kube import secretstate
from containerboot.kube.client import KubeClient, KubeError, rbac_hint
from tscommon import crashpoint
from tscommon.aio import wait_event
from tscommon.redact import redact

log = logging.getLogger("containerboot")


@dataclass(frozen=True)
class Permissions:
    """What the ServiceAccount may do on the state Secret. get and update are required; the rest optional."""
    get: bool = True
    update: bool = True
    patch: bool = False
    create: bool = False
    checked: bool = True     # False when the SSAR API itself failed and the answers are guesses


async def check_permissions(client: KubeClient, secret_name: str, *, deadline: float | None = None) -> Permissions:
    """Ask SelfSubjectAccessReviews for get, update, patch and create on the Secret.

    Raises KubeError(status=403, reason="Forbidden") naming every missing required permission and the Role
    rule to add. As upstream, a failing SSAR call (not a denial) is logged and treated as allowed for get and
    update, and as not allowed for patch and create, so that a cluster with a broken SSAR API still boots.
    """
    missing: list[str] = []
    answers: dict[str, bool] = {}
    checked = True
    for verb in ("get", "update", "patch", "create"):
        try:
            answers[verb] = await client.can_i(verb, "secrets", secret_name, deadline=deadline)
        except KubeError as e:
            log.info("%s", redact(f"error checking {verb} permission on secret {secret_name}: {e}"))
            checked = False
            answers[verb] = verb in ("get", "update")
        if verb in ("get", "update") and not answers[verb]:
            missing.append(f'missing {verb} permission on secret "{secret_name}" '
                           f"(add: {rbac_hint(verb, 'secrets', secret_name)})")
    if missing:
        raise KubeError("some Kubernetes permissions are missing, please check your RBAC configuration: "
                        + "; ".join(missing), status=403, reason="Forbidden", verb="/".join(
                            v for v in ("get", "update") if not answers[v]), resource="secrets", name=secret_name)
    return Permissions(get=True, update=True, patch=answers["patch"], create=answers["create"], checked=checked)


def consistency_backoff(n: int) -> float:
    """The n-th consecutive sleep (n >= 1) of the consistency wait: min(n^2 * 10 ms, 2 s) x U[0.5, 1.5)."""
    return min(n * n * 0.010, 2.0) * random.uniform(0.5, 1.5)


async def wait_for_consistent_state(client: KubeClient, name: str, deadline: float) -> bool:
    """Wait until tailscaled's keys in the Secret look consistent (secretstate.is_consistent) or it is gone.

    Returns True when consistent (or the Secret does not exist), False when the deadline passed first.
    Other API errors raise KubeError (the caller logs them and proceeds with shutdown).
    """
    n = 0
    logged = False
    while True:
        if time.monotonic() >= deadline:
            return False
        try:
            secret = await client.get_secret(name, deadline=deadline)
        except KubeError as e:
            if e.reason in ("Timeout",) and time.monotonic() >= deadline:
                return False
            raise
        if secret is None or secretstate.is_consistent(secret.data):
            return True
        if not logged:
            log.info('Waiting for tailscaled to finish writing state to Secret "%s"', name)
            logged = True
        n += 1
        delay = min(consistency_backoff(n), max(0.0, deadline - time.monotonic()))
        await asyncio.sleep(delay)


async def request_reissue(client: KubeClient, name: str, old_key: str, *, deadline: float | None = None,
                          clock: Callable[[], float] = time.time) -> None:
    """Tell the operator that old_key failed (reissue_authkey = old_key), rate-limited across restarts: after
    requests in a row without a successful login, wait (secretstate.reissue_delay) before asking again."""
    secret = await client.get_secret(name, deadline=deadline)
    data = secret.data if secret is not None else None
    delay = secretstate.reissue_delay(data, clock())
    if delay > 0:
        log.info("auth key reissue: asked %d time(s) in a row already; waiting %s before asking again",
                 secretstate.reissue_attempts(data), _fmt_duration(delay))
        await asyncio.sleep(delay)
    log.info("Requesting a new auth key from operator")
    crashpoint.hit(crashpoint.REISSUE_REQUEST)
    await client.patch_secret(name, secretstate.reissue_request_patch(old_key, now=clock(), data=data),
                              deadline=deadline)


async def clear_reissue(client: KubeClient, name: str, *, deadline: float | None = None) -> None:
    """After a new key arrived: clear the request, the stale device and tailscaled's login state."""
    secret = await client.get_secret(name, deadline=deadline)
    if secret is None:
        return
    crashpoint.hit(crashpoint.REISSUE_CLEAR)
    await client.patch_secret(name, secretstate.reissue_clear_patch(secret.data), deadline=deadline)


async def await_reissued_authkey(read_authkey: Callable[[], str], old_key: str, *,
                                 changed: asyncio.Event | None = None, poll_interval: float = 5.0,
                                 max_wait: float = 600.0) -> str:
    """Wait until read_authkey() returns a non-empty key different from old_key, and return it.

    read_authkey re-reads the tailscaled config file (it must not raise; return "" on errors). changed, when
    given, is set by a file watcher on the config dir's ..data swap to check early; polling every
    poll_interval seconds is the fallback. Unlike upstream, the key is checked once immediately, and
    cancellation (SIGTERM) propagates as CancelledError instead of being reported as a timeout.
    Raises TimeoutError after max_wait seconds.
    """
    start = time.monotonic()
    log.info("Waiting for operator to provide new auth key (max wait: %s)", _fmt_duration(max_wait))
    while True:
        key = read_authkey()
        if key and key != old_key:
            log.info("New auth key received from operator after %s", _fmt_duration(time.monotonic() - start))
            return key
        remaining = start + max_wait - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"timeout waiting for auth key reissue after {_fmt_duration(max_wait)}")
        wait = min(poll_interval, remaining)
        if changed is None:
            await asyncio.sleep(wait)
            log.info("Waiting for new auth key from operator (%s elapsed)", _fmt_duration(time.monotonic() - start))
        else:
            await wait_event(changed, wait)
            changed.clear()


async def reissue_flow(client: KubeClient, name: str, old_key: str, read_authkey: Callable[[], str], *,
                       disconnect: Callable[[], Awaitable[object]] | None = None,
                       changed: asyncio.Event | None = None, poll_interval: float = 5.0,
                       max_wait: float = 600.0) -> str:
    """The whole reissue flow (spec step 11): disconnect, request, wait, clear. Returns the new key.

    A failure to clear is only a warning: the boot reset clears the request once the new key is in use.
    """
    if disconnect is not None:
        await disconnect()
    await request_reissue(client, name, old_key)
    new = await await_reissued_authkey(read_authkey, old_key, changed=changed, poll_interval=poll_interval,
                                       max_wait=max_wait)
    try:
        await clear_reissue(client, name)
    except KubeError as e:
        log.warning("%s", redact(f"[warning] failed to clear reissue_authkey from Secret {name}: {e}"))
    return new


def _fmt_duration(seconds: float) -> str:
    """Go-style duration text for the log lines upstream tests grep for (10m0s, 5.2s)."""
    if seconds >= 60:
        m, s = divmod(int(round(seconds)), 60)
        h, m = divmod(m, 60)
        return (f"{h}h" if h else "") + f"{m}m{s}s"
    return f"{seconds:.1f}s".replace(".0s", "s")
