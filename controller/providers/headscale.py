"""headscale as the control plane: its REST API (`/api/v1`) with an API key.

Auth keys are single-use pre-auth keys carrying the proxy's tags (tags-only keys need no user since
headscale 0.28; HEADSCALE_USER names one when a deployment wants user-owned keys), valid for one hour: a
proxy logs in within seconds, and a key that leaked from a Secret expires soon. Devices are deleted by node
ID; headscale's StableID, which the proxy writes as `device_id`, is that ID in decimal. A device whose tags
differ from the proxy's wanted tags is re-tagged (`POST /api/v1/node/{id}/tags`; headscale refuses tags its
policy's `tagOwners` do not define, and that refusal is reported).
"""
from __future__ import annotations

import datetime
import time

import httpx

from tscommon import crashpoint

from . import ProviderError, http_error, mint_key, not_an_id, read_secret_file

KEY_TTL = 3600.0


class HeadscaleProvider:
    name = "headscale"

    def __init__(self, url: str, *, api_key: str | None = None, api_key_file: str = "", user: str = "",
                 transport: httpx.AsyncBaseTransport | None = None, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._api_key, self._api_key_file, self.user = api_key, api_key_file, user
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout, transport=transport)

    def _headers(self) -> dict[str, str]:
        key = self._api_key if self._api_key is not None else read_secret_file(self._api_key_file,
                                                                               "the headscale API key")
        from tscommon.redact import register
        register(key)
        return {"Authorization": f"Bearer {key}"}

    async def create_auth_key(self, tags: tuple[str, ...], *, description: str = "") -> str:
        exp = datetime.datetime.fromtimestamp(time.time() + KEY_TTL, datetime.timezone.utc)
        body: dict = {"reusable": False, "ephemeral": False, "aclTags": list(tags),
                      "expiration": exp.strftime("%Y-%m-%dT%H:%M:%SZ")}
        if self.user:
            body["user"] = self.user
        crashpoint.hit(crashpoint.KEY_MINT)
        return await mint_key("headscale: creating a pre-auth key",
                              self._client.post("/api/v1/preauthkey", json=body, headers=self._headers()),
                              lambda doc: (doc.get("preAuthKey") or {}).get("key"),
                              no_key="headscale: the pre-auth key answer has no key")

    async def delete_device(self, device_id: str) -> bool:
        if not _is_node_id(device_id):
            return not_an_id("headscale", device_id)
        node = device_id
        try:
            crashpoint.hit(crashpoint.DEVICE_DELETE)
            r = await self._client.delete(f"/api/v1/node/{node}", headers=self._headers())
            if r.status_code == 404:
                return False
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise http_error(f"headscale: deleting node {device_id}", e) from None
        return True

    def _node_id(self, device_id: str) -> str:
        if not _is_node_id(device_id):
            raise ProviderError(f"headscale: device_id {device_id!r} is not a headscale node ID", transient=False)
        return device_id

    async def device_tags(self, device_id: str) -> tuple[str, ...] | None:
        node = self._node_id(device_id)
        try:
            r = await self._client.get(f"/api/v1/node/{node}", headers=self._headers())
            if r.status_code == 404:
                return None
            r.raise_for_status()
            tags = (r.json().get("node") or {}).get("tags") or []
        except (httpx.HTTPError, ValueError) as e:
            raise http_error(f"headscale: reading node {node}", e) from None
        return tuple(sorted(set(tags)))

    async def set_device_tags(self, device_id: str, tags: tuple[str, ...]) -> None:
        node = self._node_id(device_id)
        try:
            crashpoint.hit(crashpoint.DEVICE_TAGS)
            r = await self._client.post(f"/api/v1/node/{node}/tags", json={"tags": sorted(set(tags))},
                                        headers=self._headers())
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise http_error(f"headscale: setting the tags of node {node}", e) from None

    async def aclose(self) -> None:
        await self._client.aclose()


def _is_node_id(device_id: str) -> bool:
    # ASCII digits only: str.isdigit() also accepts other scripts' digits ("٣", "²"), which no node ID has.
    return device_id.isascii() and device_id.isdigit()
