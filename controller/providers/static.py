"""A static auth key from a Secret, for any control plane the controller has no API for.

The key must be reusable (every proxy gets the same one) and is never deleted; devices cannot be removed
from here, so cleanup leaves them to the control plane's own expiry (the status and the log say so), and
their tags cannot be read or changed (a tags change applies to keys only).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from tscommon.redact import register

from . import ProviderError


class StaticKeyProvider:
    name = "static"

    def __init__(self, read_key: Callable[[], Awaitable[str | None]], secret_name: str) -> None:
        self._read, self.secret_name = read_key, secret_name

    async def create_auth_key(self, tags: tuple[str, ...], *, description: str = "") -> str:
        key = (await self._read() or "").strip()
        if not key:
            raise ProviderError(f"no auth key: Secret {self.secret_name!r} has no 'authkey'; create it with "
                                f"kubectl create secret generic {self.secret_name} --from-literal=authkey=<key>")
        register(key)
        return key

    async def delete_device(self, device_id: str) -> bool:
        return False

    async def device_tags(self, device_id: str) -> tuple[str, ...] | None:
        return None

    async def set_device_tags(self, device_id: str, tags: tuple[str, ...]) -> None:
        return None

    async def aclose(self) -> None:
        return None
