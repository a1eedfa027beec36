"""Tailscale's hosted control plane: its public API v2 with OAuth client credentials.

The OAuth client (scopes `auth_keys` and `devices:core`, tagged like the proxies) gets a short-lived access
token (`POST /api/v2/oauth/token`, client_credentials grant), renewed a minute before it expires; auth keys
are single-use, pre-authorised and tagged (`POST /api/v2/tailnet/{tailnet}/keys`), devices are deleted by
their stable node ID (`DELETE /api/v2/device/{id}`, 404 = already gone) and re-tagged when their tags differ
from the proxy's wanted tags (`GET /api/v2/device/{id}`, `POST /api/v2/device/{id}/tags`).
"""
from __future__ import annotations

import re
import time

import httpx

from tscommon import crashpoint

from . import ProviderError, http_error, mint_key, not_an_id, read_secret_file

KEY_EXPIRY_S = 3600


class TailscaleProvider:
    name = "tailscale"

    def __init__(self, api_url: str = "https://api.tailscale.com", *, tailnet: str = "-",
                 client_id: str | None = None, client_secret: str | None = None, client_id_file: str = "",
                 client_secret_file: str = "", transport: httpx.AsyncBaseTransport | None = None,
                 timeout: float = 10.0, clock=time.monotonic) -> None:
        self.tailnet = tailnet
        self._id, self._secret = client_id, client_secret
        self._id_file, self._secret_file = client_id_file, client_secret_file
        self._client = httpx.AsyncClient(base_url=api_url.rstrip("/"), timeout=timeout, transport=transport)
        self._token, self._token_expiry, self._clock = "", 0.0, clock

    async def _bearer(self) -> dict[str, str]:
        if not self._token or self._clock() > self._token_expiry - 60:
            cid = self._id if self._id is not None else read_secret_file(self._id_file, "the OAuth client ID")
            secret = self._secret if self._secret is not None else read_secret_file(
                self._secret_file, "the OAuth client secret")
            from tscommon.redact import register
            register(secret)
            try:
                r = await self._client.post("/api/v2/oauth/token", data={
                    "client_id": cid, "client_secret": secret, "grant_type": "client_credentials"})
                r.raise_for_status()
                body = r.json()
            except (httpx.HTTPError, ValueError) as e:
                raise http_error("tailscale: OAuth token", e) from None
            self._token = str(body.get("access_token") or "")
            if not self._token:
                raise ProviderError("tailscale: the OAuth answer has no access_token")
            register(self._token)
            self._token_expiry = self._clock() + float(body.get("expires_in") or 3600)
        return {"Authorization": f"Bearer {self._token}"}

    async def create_auth_key(self, tags: tuple[str, ...], *, description: str = "") -> str:
        body = {"capabilities": {"devices": {"create": {"reusable": False, "ephemeral": False,
                                                        "preauthorized": True, "tags": list(tags)}}},
                "expirySeconds": KEY_EXPIRY_S, "description": key_description(description)}
        crashpoint.hit(crashpoint.KEY_MINT)
        return await mint_key("tailscale: creating an auth key",
                              self._client.post(f"/api/v2/tailnet/{self.tailnet}/keys", json=body,
                                                headers=await self._bearer()),
                              lambda doc: doc.get("key"), no_key="tailscale: the auth key answer has no key",
                              on_answer=self._forget_rejected_token)

    def _forget_rejected_token(self, r: httpx.Response) -> None:
        if r.status_code == 401:     # the OAuth token expired early or was revoked: the next call fetches one
            self._token = ""

    async def delete_device(self, device_id: str) -> bool:
        if not _is_device_id(device_id):
            return not_an_id("tailscale", device_id)
        try:
            crashpoint.hit(crashpoint.DEVICE_DELETE)
            r = await self._client.delete(f"/api/v2/device/{device_id}", headers=await self._bearer())
            if r.status_code == 404:
                return False
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise http_error(f"tailscale: deleting device {device_id}", e) from None
        return True

    async def device_tags(self, device_id: str) -> tuple[str, ...] | None:
        if not _is_device_id(device_id):
            raise ProviderError(f"tailscale: device_id {device_id!r} is not a device ID", transient=False)
        try:
            r = await self._client.get(f"/api/v2/device/{device_id}", headers=await self._bearer())
            if r.status_code == 404:
                return None
            r.raise_for_status()
            tags = r.json().get("tags") or []
        except (httpx.HTTPError, ValueError) as e:
            raise http_error(f"tailscale: reading device {device_id}", e) from None
        return tuple(sorted(set(tags)))

    async def set_device_tags(self, device_id: str, tags: tuple[str, ...]) -> None:
        if not _is_device_id(device_id):
            raise ProviderError(f"tailscale: device_id {device_id!r} is not a device ID", transient=False)
        try:
            crashpoint.hit(crashpoint.DEVICE_TAGS)
            r = await self._client.post(f"/api/v2/device/{device_id}/tags", json={"tags": sorted(set(tags))},
                                        headers=await self._bearer())
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise http_error(f"tailscale: setting the tags of device {device_id}", e) from None

    async def aclose(self) -> None:
        await self._client.aclose()


def key_description(text: str) -> str:
    """A key's description as the API takes it: at most 50 letters, digits, hyphens and spaces. The reconcilers
    name the parent ("Service apps/web", "ProxyGroup egress.a"): its '/' and '.' become '-'."""
    return re.sub(r"[^A-Za-z0-9 -]", "-", text)[:50]


def _is_device_id(device_id: str) -> bool:
    # The ID goes into an API path, and it comes from a Secret the proxy writes: anything but an ID (a '/', '..',
    # '?') would send the request to another endpoint with the controller's credentials.
    return device_id.isascii() and device_id.isalnum()
