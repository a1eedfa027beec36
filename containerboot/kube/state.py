"""The agent's half of the state-Secret contract, over the Kubernetes API (adapter).

At boot: check RBAC, read the auth key the operator may have put in the Secret, and reset the previous run's
agent keys (creating the Secret when it is missing and creation is allowed, so that `tailscale_capver` and
`pod_uid` are there from the first boot). In the steady state the Secret fields are level-triggered like
everything else: the agent states which values it wants, and `sync` writes only what differs from what it
last wrote; a failed write is retried on the next reconcile. What is written and when is decided by the pure
`secretstate` module.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from containerboot.settings import CAPABILITY_VERSION, Settings
from tscommon.redact import redact

from . import secretstate as ss
from .client import KubeClient, KubeError
from .setup import Permissions, check_permissions, wait_for_consistent_state

log = logging.getLogger("containerboot")


#: Upstream's words for the boot refusals it shares with this agent (containerboot's setupKube, v1.102): each of
#: our messages starts with them, then says how to fix it, so that runbooks and alerts written against upstream's
#: messages still match.
UPSTREAM_WORDS = {
    "get_failed": "getting Tailscale state Secret {name}",
    "missing_not_creatable": "tailscale state Secret {name} does not exist and we don't have permissions to "
                             "create it",
    "authkey_without_patch": "authkey found in TS_KUBE_SECRET, but the pod doesn't have patch permissions on the "
                             "Secret to manage the authkey",
}


def _upstream(condition: str, **values: str) -> str:
    return UPSTREAM_WORDS[condition].format(**values)


class KubeSetupError(Exception):
    """Kubernetes set-up failed; the message says what is missing and how to fix it."""


@dataclass(frozen=True)
class KubeSetup:
    permissions: Permissions
    authkey_from_secret: str  # "" unless the Secret supplied the auth key
    has_state_store: bool  # patch allowed: the agent manages the Secret's keys


class SecretState:
    """Writes the agent's keys of the state Secret; remembers what it wrote."""

    def __init__(self, client: KubeClient, name: str):
        self.client = client
        self.name = name
        self.written: dict[str, bytes | None] = {}
        self.failed = ""
        #: The keys of the last write that failed, until one succeeds (for /status).
        self.pending: tuple[str, ...] = ()
        #: Told the outcome of every steady-state write (None: it landed), for the API server's reachability.
        self.on_result: Callable[[KubeError | None], None] | None = None
        #: The API server did not answer at all (no connection, no answer in time) at the last check or write: a
        #: write is then not attempted (it could only fail, and a pass waiting on it -- the device ID goes in before
        #: the rules -- would be held for the whole retry budget, logging every retry); it stays pending until the
        #: server answers again, when the agent pokes the reconciler. A server that answers with an error (a 500
        #: from /readyz) does not set it: writes are still tried.
        self.api_down = False

    async def setup(self, s: Settings, deadline: float, *, config_authkey: str = "") -> KubeSetup:
        try:
            perms = await check_permissions(self.client, self.name, deadline=deadline)
        except KubeError as e:
            raise KubeSetupError(str(e)) from None
        try:
            secret = await self.client.get_secret(self.name, deadline=deadline)
        except KubeError as e:
            raise KubeSetupError(f"{_upstream('get_failed', name=self.name)}: {e}") from None
        if secret is None and not perms.create:
            raise KubeSetupError(
                f"{_upstream('missing_not_creatable', name=self.name)}: create the Secret, grant create on secrets "
                f"({ss_rbac('create', self.name)}), or set TS_KUBE_SECRET=\"\" to keep no state in Kubernetes")
        authkey = ""
        if not (s.authkey or s.client_id or s.client_secret or s.one_step) and secret is not None:
            authkey = ss.authkey_from_secret(secret.data)
            if authkey and not perms.patch:
                raise KubeSetupError(
                    f"{_upstream('authkey_without_patch')} (Secret \"{self.name}\"): grant patch on secrets "
                    f"({ss_rbac('patch', self.name)}), or remove the authkey key from the Secret and pass the key "
                    "in TS_AUTHKEY")
            log.info("Using the auth key from Secret %r" if authkey else
                     "No auth key in TS_AUTHKEY or the state Secret; login will be interactive if needed",
                     self.name)
        store = s.in_kubernetes and perms.patch
        if store:
            patch = ss.boot_reset_patch(secret.data if secret else None, capver=CAPABILITY_VERSION,
                                        pod_uid=s.pod_uid, config_authkey=config_authkey)
            await self._write_boot(patch, exists=secret is not None, deadline=deadline)
        return KubeSetup(perms, authkey, store)

    async def _write_boot(self, patch: dict[str, bytes | None], *, exists: bool, deadline: float) -> None:
        try:
            if exists:
                await self.client.patch_secret(self.name, patch, deadline=deadline)
            else:
                try:
                    await self.client.create_secret(self.name, patch, deadline=deadline)
                except KubeError as e:
                    if e.status != 409:  # someone (tailscaled) created it meanwhile: patch instead
                        raise
                    await self.client.patch_secret(self.name, patch, deadline=deadline)
        except KubeError as e:
            raise KubeSetupError(f"error clearing previous state from Secret {self.name!r}: {e}") from None
        self.written.update(patch)

    async def sync(self, want: Mapping[str, bytes | None], *, budget: float = 10.0) -> bool:
        """Write the keys of `want` whose value differs from what was last written; True if all are in."""
        patch = {k: v for k, v in want.items() if self.written.get(k, b"\0unset") != v}
        if not patch:
            return True
        if self.api_down:
            self.pending = tuple(sorted(set(self.pending) | set(patch)))
            return False
        try:
            await self.client.patch_secret(self.name, patch, deadline=time.monotonic() + budget)
        except KubeError as e:
            # Reported once per kind of failure: the message itself varies between retries (attempt counts,
            # elapsed time), so it cannot tell a repeat from a new problem.
            kind = f"{sorted(patch)} {e.status} {e.reason}"
            if kind != self.failed:
                log.error("%s (will retry)",
                          redact(f"failed to update Secret {self.name!r} ({', '.join(sorted(patch))}): {e}"))
            self.failed = kind
            self.pending = tuple(sorted(patch))
            self.api_down = e.status == 0 and e.reason in ("Unreachable", "Timeout")
            if self.on_result is not None:
                self.on_result(e)
            return False
        self.failed = ""
        self.pending = ()
        self.api_down = False
        self.written.update(patch)
        if self.on_result is not None:
            self.on_result(None)
        return True

    def has_written(self, *keys: str) -> bool:
        return all(self.written.get(k) is not None for k in keys)

    async def delete_authkey(self, deadline: float) -> None:
        """After a TS_AUTH_ONCE login the key has done its job; remove it from the Secret."""
        log.info("Deleting authkey from Kubernetes Secret")
        try:
            await self.client.json_patch_secret(self.name, ss.delete_authkey_ops(), deadline=deadline)
        except KubeError as e:
            if e.status != 422:  # 422: the key is not there, nothing to delete
                raise KubeSetupError(f"failed to delete the authkey from Secret {self.name!r}: {e}") from None

    async def wait_consistent(self, deadline: float) -> None:
        """Before stopping tailscaled: give it the time to finish writing its state to the Secret."""
        log.info("Checking for consistent state")
        try:
            if not await wait_for_consistent_state(self.client, self.name, deadline):
                log.warning("tailscaled's state in Secret %r still looks incomplete; stopping it anyway",
                            self.name)
        except KubeError as e:
            log.error("Error waiting for consistent state on shutdown: %s", e)


def ss_rbac(verb: str, name: str) -> str:
    from .client import rbac_hint

    return rbac_hint(verb, "secrets", name)
