"""Control plane providers: where auth keys come from, where devices are deleted and re-tagged.

One small interface, three adapters: `headscale` (its REST API with an API key), `tailscale` (Tailscale's API
with OAuth client credentials) and `static` (a key a user put in a Secret, for anything else). Every error is a
`ProviderError` whose message is already redacted: keys, tokens and client secrets never reach a log line,
an event or a status.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httpx

from tscommon.redact import redact

#: The Warning event's reason when the control plane's version lacks what a parent needs.
REASON_UNSUPPORTED = "ControlPlaneUnsupported"


class ProviderError(Exception):
    """The control plane refused or could not be reached. `transient` errors are retried with backoff. `reason`
    set (REASON_UNSUPPORTED): the control plane's version cannot do this at all, which the parent's Warning event
    says."""

    def __init__(self, message: str, *, transient: bool = True, reason: str = "") -> None:
        super().__init__(redact(message))
        self.transient, self.reason = transient, reason


class Provider(Protocol):
    name: str

    async def create_auth_key(self, tags: tuple[str, ...], *, description: str = "") -> str:
        """A single-use, pre-authorised auth key carrying `tags`."""

    async def delete_device(self, device_id: str) -> bool:
        """Delete the device with this stable ID; False when it was already gone."""

    async def device_tags(self, device_id: str) -> tuple[str, ...] | None:
        """The device's tags as the control plane has them, sorted; None when the device is gone or the
        provider cannot tell (then nothing is re-tagged)."""

    async def set_device_tags(self, device_id: str, tags: tuple[str, ...]) -> None:
        """Replace the device's tags (what `tailscale.com/tags` or PROXY_TAGS now say)."""

    async def aclose(self) -> None: ...


def limitations(provider: object, kind: str, auth_mode: bool = False) -> tuple[str, ...]:
    """What the provider's control plane cannot do for a parent of `kind` (`auth_mode`: an API server proxy in
    auth mode), as messages for its condition and Warning event; () when all is available or the provider does
    not tell (providers without a `limitations` method)."""
    ask = getattr(provider, "limitations", None)
    return tuple(ask(kind, auth_mode)) if ask is not None else ()


def http_error(what: str, e: Exception) -> ProviderError:
    """A transport failure or an error answer, as a redacted ProviderError."""
    if isinstance(e, httpx.HTTPStatusError):
        code = e.response.status_code
        body = e.response.text[:200].strip()
        return ProviderError(f"{what}: HTTP {code}{': ' + body if body else ''}",
                             transient=code >= 500 or code == 429)
    return ProviderError(f"{what}: control plane unreachable ({type(e).__name__}: {e})")


async def mint_key(what: str, answer: Awaitable[httpx.Response], key_of: Callable[[Any], object], *,
                   no_key: str, on_answer: Callable[[httpx.Response], None] | None = None) -> str:
    """The key from a control plane's answer to a key-minting request, registered for redaction before it can
    reach any message. `what` names the call in errors, `no_key` is the error for an answer without a key;
    `on_answer` sees the answer before its status is checked (e.g. to drop a rejected token)."""
    from tscommon.redact import register
    try:
        r = await answer
        if on_answer is not None:
            on_answer(r)
        r.raise_for_status()
        key = str(key_of(r.json()) or "")
    except (httpx.HTTPError, ValueError) as e:
        raise http_error(what, e) from None
    if not key:
        raise ProviderError(no_key)
    register(key)
    return key


def not_an_id(provider: str, device_id: str) -> bool:
    """delete_device's answer for a device_id that cannot be an ID (a damaged or hostile state Secret): it names
    no device, so there is nothing to delete; said once in the log rather than blocking the pass for good."""
    logging.getLogger("controller.providers").warning(
        "%s", redact(f"{provider}: device_id {device_id!r} in a proxy's state Secret is not a device ID; "
                     "no device deleted"))
    return False


def read_secret_file(path: str, what: str) -> str:
    """A credential from a mounted file; registered for redaction."""
    from tscommon.redact import register
    try:
        with open(path, encoding="utf-8") as f:
            v = f.read().strip()
    except OSError as e:
        raise ProviderError(f"cannot read {what} from {path}: {e.strerror or e}; mount it there", transient=True) from e
    if not v:
        raise ProviderError(f"{what} file {path} is empty", transient=True)
    register(v)
    return v
