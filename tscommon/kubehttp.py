"""The HTTP exchange both Kubernetes clients make with the API server: the agent's (`containerboot.kube.client`)
and the controller's (`controller.kubeapi`). Each keeps its own calls, retries and error messages; what they
share is the wire format: a JSON body sent with the bearer token and its content type, the Status object a
failed call answers with (reason and message, or the start of a body that is not one), and the Retry-After
header of a 429 or 503 (seconds or an HTTP date). How a Pod reaches its API server is `tscommon.kubeconn`.
"""
from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx

from tscommon.jsontext import response_json

#: how much of a body that is not a Status object a message quotes (an HTML error page can be long)
BODY_QUOTE = 200


async def send(http: httpx.AsyncClient, method: str, url: str, *, token: str, body: Any = None,
               content_type: str = "application/json", params: Mapping[str, str] | None = None,
               timeout: httpx.Timeout | None = None) -> httpx.Response:
    """One request: `body` (when not None) as compact JSON with `content_type`, the bearer `token`, JSON asked
    for. `timeout` overrides the client's. Raises httpx.HTTPError when there is no answer."""
    headers, content = _wire(token, body, content_type)
    if timeout is None:
        return await http.request(method, url, params=params, content=content, headers=headers)
    return await http.request(method, url, params=params, content=content, headers=headers, timeout=timeout)


def _wire(token: str, body: Any, content_type: str) -> tuple[dict[str, str], bytes | None]:
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    if body is None:
        return headers, None
    headers["Content-Type"] = content_type
    return headers, json.dumps(body, separators=(",", ":")).encode()


def request(method: str, url: str, *, token: str, body: Any = None, content_type: str = "application/json",
            params: Mapping[str, str] | None = None, headers: Mapping[str, str] | None = None,
            timeout: httpx.Timeout | None = None) -> httpx.Request:
    """The request `send` makes, built for a transport called directly (no `httpx.AsyncClient`: its merging of
    base URL, headers and cookies, its auth and redirect steps cost more CPU than the request itself when a client
    sends thousands). `url` is absolute; `headers` are added (a User-Agent)."""
    h, content = _wire(token, body, content_type)
    if headers:
        h = {**headers, **h}
    if params:
        url = f"{url}?{urlencode(params)}"
    ext = {"timeout": timeout.as_dict()} if timeout is not None else {}
    return httpx.Request(method, url, headers=h, content=content, extensions=ext)


@dataclass(frozen=True)
class ApiStatus:
    """What a failed call's answer says. reason: the Status `reason` (NotFound, Conflict, ...), "" when absent.
    message: the Status `message`; for a body that is not JSON, its first characters; "" when neither."""
    reason: str
    message: str


def api_status(resp: httpx.Response) -> ApiStatus:
    """The Status object of a failed call's answer, tolerant of any body (a proxy's page, a cut stream)."""
    try:
        st = response_json(resp)
    except ValueError:
        return ApiStatus(reason="", message=resp.text[:BODY_QUOTE])
    if not isinstance(st, dict):
        return ApiStatus(reason="", message="")
    return ApiStatus(reason=str(st.get("reason") or ""), message=str(st.get("message") or ""))


def retry_after_seconds(value: str | None, now: Callable[[], float] = time.time) -> float | None:
    """A Retry-After header's delay in seconds (never negative): a number, or an HTTP date measured from
    `now` (wall clock). None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - now())
    except (TypeError, ValueError):
        return None
