"""headscale as the control plane: its REST API (`/api/v1`) with an API key, from headscale 0.26 to 0.29.

Auth keys are single-use pre-auth keys carrying the proxy's tags (tags-only keys need no user since
headscale 0.28; HEADSCALE_USER names one when a deployment wants user-owned keys, and on 0.26 and 0.27, which
need one), valid for one hour: a proxy logs in within seconds, and a key that leaked from a Secret expires
soon. Devices are deleted by node ID; headscale's StableID, which the proxy writes as `device_id`, is that ID
in decimal. A device whose tags differ from the proxy's wanted tags is re-tagged (`POST
/api/v1/node/{id}/tags`; headscale 0.28+ refuses tags its policy's `tagOwners` do not define, and that refusal
is reported).

The server's version is read once, at start-up or at the first call (`hscompat.detect`): it decides where a
node's tags are read from (`tags` from 0.28, `forcedTags` and `validTags` before), whether a key can be minted
without a user, and what `limitations` tells the reconciler. Every error answer becomes a message naming the fix
(`hscompat.explain`).
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import time
from typing import Any

import httpx

from tscommon import crashpoint

from . import REASON_UNSUPPORTED, ProviderError, not_an_id, read_secret_file
from .hscompat import GRANTS, TAG_ONLY_KEYS, Capabilities, detect, explain, not_found

KEY_TTL = 3600.0
#: An exit node's routes: headscale approves both when either is asked for.
EXIT_ROUTES = ("0.0.0.0/0", "::/0")

log = logging.getLogger("controller.providers")


class HeadscaleProvider:
    name = "headscale"

    def __init__(self, url: str, *, api_key: str | None = None, api_key_file: str = "", user: str = "",
                 transport: httpx.AsyncBaseTransport | None = None, timeout: float = 10.0,
                 capabilities: Capabilities | None = None) -> None:
        self.url = url.rstrip("/")
        self._api_key, self._api_key_file, self.user = api_key, api_key_file, user
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout, transport=transport)
        #: what the server can do; read once (`detect`), or given (tests, tools that know the version)
        self.capabilities = capabilities
        self._detecting = asyncio.Lock()

    def _headers(self) -> dict[str, str]:
        key = self._api_key if self._api_key is not None else read_secret_file(self._api_key_file,
                                                                               "the headscale API key")
        from tscommon.redact import register
        register(key)
        return {"Authorization": f"Bearer {key}"}

    # ---- the server's version

    async def detect(self) -> Capabilities:
        """Read the server's version and API once (`/version`, `/swagger/v1/openapiv2.json`: neither needs the API
        key) and log it with what is unavailable. A server that cannot be reached at all is a transient
        ProviderError, and the next call tries again."""
        async with self._detecting:
            if self.capabilities is not None:
                return self.capabilities
            docs: list[Any] = []
            reached = False
            for path in ("/version", "/swagger/v1/openapiv2.json"):
                try:
                    r = await self._client.get(path)
                    reached = True
                    docs.append(r.json() if r.status_code == 200 else None)
                except ValueError:
                    docs.append(None)
                except httpx.HTTPError as e:
                    docs.append(None)
                    last = e
            if not reached:
                raise ProviderError(f"headscale: reading its version: control plane unreachable at {self.url} "
                                    f"({type(last).__name__}: {last})")
            caps = detect(docs[0], docs[1])
            self.capabilities = caps
            missing = caps.unavailable(user_set=bool(self.user))
            line = caps.summary(user_set=bool(self.user))
            log.log(logging.WARNING if missing or not caps.supported or not caps.detected else logging.INFO,
                    "%s", line)
            return caps

    async def _caps(self) -> Capabilities:
        caps = self.capabilities if self.capabilities is not None else await self.detect()
        if not caps.supported:
            raise ProviderError(f"headscale: {caps.too_old()}", transient=False, reason=REASON_UNSUPPORTED)
        return caps

    def limitations(self, kind: str, auth_mode: bool = False) -> tuple[str, ...]:
        """What this server cannot do for a parent of `kind` (controller.model's kinds); () before the version is
        known. Every parent needs a key: a server that cannot mint one without a user, with no user set, is a
        limitation of all (the same words as the minting's error, so that the event is sent once)."""
        caps = self.capabilities
        if caps is None:
            return ()
        if not caps.supported:
            return (f"headscale: {caps.too_old()}",)
        found = []
        if not self.user and not caps.has(TAG_ONLY_KEYS):
            found.append(self._no_tag_only_keys(caps))
        from ..kindfacts import FACTS
        if auth_mode and kind in FACTS and FACTS[kind].grants_in_auth_mode and not caps.has(GRANTS):
            found.append(f"headscale: {GRANTS.refusal(caps.version)}")
        return tuple(found)

    @staticmethod
    def _no_tag_only_keys(caps: Capabilities) -> str:
        return f"headscale: creating a pre-auth key: {TAG_ONLY_KEYS.refusal(caps.version)}"

    # ---- calls

    async def _call(self, method: str, path: str, what: str, *, body: dict | None = None,
                    tags: tuple[str, ...] = (), gone_ok: bool = False) -> httpx.Response | None:
        """One API call; None for a node that is not there (`gone_ok`); an error answer as a ProviderError
        whose message names the fix."""
        caps = await self._caps()
        try:
            r = await self._client.request(method, path, json=body, headers=self._headers())
        except httpx.HTTPError as e:
            raise ProviderError(f"headscale: {what}: control plane unreachable at {self.url} "
                                f"({type(e).__name__}: {e})") from None
        if r.status_code < 300:
            return r
        if gone_ok and not_found(r.status_code, r.text):
            return None
        message, transient = explain(what, r.status_code, r.text, caps, user=self.user, tags=tags)
        raise ProviderError(message, transient=transient)

    async def create_auth_key(self, tags: tuple[str, ...], *, description: str = "") -> str:
        what = "creating a pre-auth key"
        caps = await self._caps()
        if not self.user and not caps.has(TAG_ONLY_KEYS):
            raise ProviderError(self._no_tag_only_keys(caps), transient=False, reason=REASON_UNSUPPORTED)
        exp = datetime.datetime.fromtimestamp(time.time() + KEY_TTL, datetime.timezone.utc)
        body: dict = {"reusable": False, "ephemeral": False, "aclTags": list(tags),
                      "expiration": exp.strftime("%Y-%m-%dT%H:%M:%SZ")}
        if self.user:
            body["user"] = self.user
        crashpoint.hit(crashpoint.KEY_MINT)
        r = await self._call("POST", "/api/v1/preauthkey", what, body=body, tags=tags)
        assert r is not None
        try:
            key = str((r.json().get("preAuthKey") or {}).get("key") or "")
        except (ValueError, AttributeError):
            key = ""
        if not key:
            raise ProviderError("headscale: the pre-auth key answer has no key")
        from tscommon.redact import register
        register(key)
        return key

    async def delete_device(self, device_id: str) -> bool:
        if not _is_node_id(device_id):
            return not_an_id("headscale", device_id)
        crashpoint.hit(crashpoint.DEVICE_DELETE)
        r = await self._call("DELETE", f"/api/v1/node/{device_id}", f"deleting node {device_id}", gone_ok=True)
        return r is not None

    def _node_id(self, device_id: str) -> str:
        if not _is_node_id(device_id):
            raise ProviderError(f"headscale: device_id {device_id!r} is not a headscale node ID", transient=False)
        return device_id

    async def _node(self, node: str) -> dict | None:
        r = await self._call("GET", f"/api/v1/node/{node}", f"reading node {node}", gone_ok=True)
        if r is None:
            return None
        try:
            doc = r.json().get("node")
        except (ValueError, AttributeError):
            doc = None
        if not isinstance(doc, dict):
            raise ProviderError(f"headscale: reading node {node}: the answer has no node")
        return doc

    async def device_tags(self, device_id: str) -> tuple[str, ...] | None:
        node = self._node_id(device_id)
        doc = await self._node(node)
        if doc is None:
            return None
        caps = await self._caps()
        return node_tags(doc, caps)

    async def set_device_tags(self, device_id: str, tags: tuple[str, ...]) -> None:
        node = self._node_id(device_id)
        crashpoint.hit(crashpoint.DEVICE_TAGS)
        await self._call("POST", f"/api/v1/node/{node}/tags", f"setting the tags of node {node}",
                         body={"tags": sorted(set(tags))}, tags=tuple(sorted(set(tags))))

    async def approve_routes(self, device_id: str, routes: tuple[str, ...]) -> tuple[str, ...] | None:
        """Approve `routes` (CIDRs; an exit node's are EXIT_ROUTES) for the device, keeping those approved
        already; the node's approved routes after it, sorted (None: the node is gone). The same call in 0.26 to
        0.29 (`POST /api/v1/node/{id}/approve_routes`, which replaces the node's approved set)."""
        node = self._node_id(device_id)
        doc = await self._node(node)
        if doc is None:
            return None
        have = set(doc.get("approvedRoutes") or [])
        want = have | set(routes)
        if want == have:
            return tuple(sorted(have))
        r = await self._call("POST", f"/api/v1/node/{node}/approve_routes", f"approving routes of node {node}",
                             body={"routes": sorted(want)}, gone_ok=True)
        if r is None:
            return None
        try:
            return tuple(sorted(set((r.json().get("node") or {}).get("approvedRoutes") or [])))
        except (ValueError, AttributeError):
            raise ProviderError(f"headscale: approving routes of node {node}: the answer has no node") from None

    async def aclose(self) -> None:
        await self._client.aclose()


def node_tags(doc: dict, caps: Capabilities) -> tuple[str, ...]:
    """A node's tags as the API shows them, sorted: `tags` from headscale 0.28; before, the tags forced by the
    API or a pre-auth key (`forcedTags`) and those the node asked for that the policy allows (`validTags`)."""
    if caps.tags_field == "tags":
        found = doc.get("tags") or []
    else:
        found = [*(doc.get("forcedTags") or []), *(doc.get("validTags") or [])]
    return tuple(sorted(set(found)))


def _is_node_id(device_id: str) -> bool:
    # ASCII digits only: str.isdigit() also accepts other scripts' digits ("٣", "²"), which no node ID has.
    return device_id.isascii() and device_id.isdigit()
