"""Client for tailscaled's LocalAPI over its unix socket (httpx).

The LocalAPI refuses requests whose Host is not `local-tailscaled.sock` or that carry a Referer or Origin
header (a browser-CSRF guard), so every request here is built with exactly that Host and neither header.
The IPN bus (`watch-ipn-bus`) is a never-ending response of newline-delimited JSON Notify objects; it is
exposed as an async iterator that ends when the stream ends.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from tscommon.redact import redact

HOST = "local-tailscaled.sock"
BASE = f"http://{HOST}/localapi/v0"

# IPN bus mask bits (see the spec's table; only the ones the agent uses are named).
NOTIFY_INITIAL_STATE = 2
NOTIFY_INITIAL_PREFS = 4
NOTIFY_INITIAL_NETMAP = 8
NOTIFY_NO_PRIVATE_KEYS = 16
NOTIFY_INITIAL_HEALTH_STATE = 128
NOTIFY_PEER_CHANGES = 4096
NOTIFY_NO_NETMAP = 8192
NOTIFY_INITIAL_STATUS = 16384

#: The agent's standing watch: initial status (self, peers, DNS extra records) plus incremental peer
#: changes, without the full netmap on every change. Same as upstream's base mask.
WATCH_MASK = NOTIFY_INITIAL_STATUS | NOTIFY_PEER_CHANGES | NOTIFY_NO_NETMAP
#: The first watch also asks for prefs and health, to see a failed login at once.
FIRST_WATCH_MASK = WATCH_MASK | NOTIFY_INITIAL_PREFS | NOTIFY_INITIAL_HEALTH_STATE

#: The capability version this client speaks (sent as Tailscale-Cap, as the Go client does).
CLIENT_CAPVER = 142


class LocalAPIError(Exception):
    """A LocalAPI call failed; `status` is the HTTP status (0 for a transport error)."""

    def __init__(self, message: str, status: int = 0, retry_after: float | None = None):
        super().__init__(redact(message))
        self.status = status
        self.retry_after = retry_after  # seconds, from a 429's Retry-After header


def _error_text(resp: httpx.Response) -> str:
    body = resp.text
    try:
        doc = json.loads(body)
        if isinstance(doc, dict):
            body = doc.get("Error") or doc.get("error") or body
    except ValueError:
        pass
    return f"{resp.status_code}: {str(body).strip()}"


class LocalAPI:
    """A thin async client of one tailscaled's LocalAPI."""

    def __init__(self, socket_path: str, *, timeout: float = 30.0):
        self.socket_path = socket_path
        self.capver: int | None = None
        self._timeout = timeout
        self._client = self._new_client(timeout)

    def _new_client(self, timeout: float | None) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(uds=self.socket_path)
        return httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(timeout) if timeout else httpx.Timeout(None, connect=10.0),
            headers={"Host": HOST, "Tailscale-Cap": str(CLIENT_CAPVER)},
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def _note_capver(self, resp: httpx.Response) -> None:
        cap = resp.headers.get("Tailscale-Cap")
        if cap and cap.isdigit():
            self.capver = int(cap)

    async def _call(self, method: str, path: str, *, expect: int = 200, json_body: Any = None,
                    headers: dict[str, str] | None = None, content: bytes | None = None,
                    timeout: float | None = None) -> httpx.Response:
        extra = {"timeout": timeout} if timeout is not None else {}
        try:
            resp = await self._client.request(
                method, f"{BASE}/{path}", json=json_body, content=content, headers=headers, **extra)
        except httpx.HTTPError as e:
            raise LocalAPIError(f"LocalAPI {method} {path}: {e!r}") from None
        self._note_capver(resp)
        if resp.status_code != expect:
            ra = resp.headers.get("Retry-After", "")
            raise LocalAPIError(f"LocalAPI {method} {path}: {_error_text(resp)}", resp.status_code,
                                float(ra) if ra.replace(".", "", 1).isdigit() else None)
        return resp

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = await self._call(method, path, **kw)
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError as e:
            raise LocalAPIError(f"LocalAPI {method} {path}: bad JSON: {e}") from None

    async def status(self) -> dict:
        return await self._json("GET", "status")

    async def prefs(self) -> dict:
        return await self._json("GET", "prefs")

    async def edit_prefs(self, masked: dict) -> dict:
        return await self._json("PATCH", "prefs", json_body=masked)

    async def get_serve_config(self) -> tuple[dict | None, str]:
        resp = await self._call("GET", "serve-config")
        doc = resp.json() if resp.content else None
        return (doc or None), resp.headers.get("Etag", "")

    async def set_serve_config(self, config: dict, etag: str = "") -> None:
        headers = {"If-Match": etag} if etag else {}
        await self._call("POST", "serve-config", content=json.dumps(config).encode(),
                         headers={**headers, "Content-Type": "application/json"})

    async def dns_config(self) -> dict:
        return await self._json("GET", "dns-config") or {}

    async def cert_pair(self, domain: str) -> tuple[bytes, bytes]:
        # Issuing a certificate (ACME) can take minutes; the default timeout is for quick calls.
        resp = await self._call("GET", f"cert/{domain}?type=pair&min_validity=0s", timeout=300.0)
        return _split_pem_pair(resp.content)

    async def usermetrics(self) -> str:
        resp = await self._call("GET", "usermetrics")
        return resp.text

    async def disconnect_control(self) -> None:
        await self._call("POST", "disconnect-control")

    async def reload_config(self) -> dict:
        return await self._json("POST", "reload-config") or {}

    async def set_udp_gro_forwarding(self) -> None:
        doc = await self._json("GET", "set-udp-gro-forwarding") or {}
        if doc.get("Warning"):
            raise LocalAPIError(f"set-udp-gro-forwarding: {doc['Warning']}")

    async def watch_ipn_bus(self, mask: int) -> AsyncIterator[dict]:
        """Yield Notify objects until the stream ends (EOF) or the caller stops iterating.

        Uses its own connection with no read timeout: the bus is quiet for long stretches.
        """
        client = self._new_client(None)
        try:
            async with client.stream("GET", f"{BASE}/watch-ipn-bus?mask={mask}") as resp:
                self._note_capver(resp)
                if resp.status_code != 200:
                    await resp.aread()
                    raise LocalAPIError(f"watch-ipn-bus: {_error_text(resp)}", resp.status_code)
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        notify = json.loads(line)
                    except ValueError as e:
                        raise LocalAPIError(f"watch-ipn-bus: bad JSON line: {e}") from None
                    if isinstance(notify, dict):
                        yield notify
        except httpx.HTTPError as e:
            raise LocalAPIError(f"watch-ipn-bus: {e!r}") from None
        finally:
            await client.aclose()


def _split_pem_pair(pem: bytes) -> tuple[bytes, bytes]:
    """Split tailscaled's `type=pair` answer (key block(s) first, then the certificate chain)."""
    marker = b"-----BEGIN CERTIFICATE-----"
    i = pem.find(marker)
    if i < 0:
        raise LocalAPIError("cert pair: no certificate in the answer")
    return pem[i:], pem[:i]
