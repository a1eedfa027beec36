"""Recordings in an S3-compatible bucket (adapter): each recording one object `<name>` (the store's names).

S3 objects cannot be appended to, so a recording being written is kept in memory and the whole object is
written again (PUT) when it is made durable (`sync()`, what the recorder does before it acknowledges): what
was acknowledged is in the bucket, a recorder killed mid-session leaves the object as of its last sync. To
keep a busy session from rewriting its object on every chunk, a sync comes at most every SYNC_INTERVAL (the
acknowledgement waits for it) and always at the end. A recording's size is bounded by the recorder's memory.

Requests are signed with AWS Signature Version 4 (path-style URLs, `UNSIGNED-PAYLOAD` is not used: the
payload's SHA-256 is signed), so any S3-compatible server (AWS S3, MinIO, SeaweedFS, ...) takes them.
Credentials come from the environment as for AWS's tools: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_SESSION_TOKEN` (optional), `AWS_REGION` (default us-east-1).
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

import httpx

from .store import EVENT_NAME, EVENTS, NAME, Entry, Events, entry, new_name

SYNC_INTERVAL = 1.0
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class S3Error(OSError):
    """A request to the bucket failed; str(e) says which and the server's answer."""


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    session_token: str = ""
    region: str = "us-east-1"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Credentials:
        key, secret = env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", "")
        if not key or not secret:
            raise ValueError("S3 storage needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment "
                             "(the Recorder's spec.storage.s3.credentials.secret)")
        return cls(key, secret, env.get("AWS_SESSION_TOKEN", ""), env.get("AWS_REGION") or "us-east-1")


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def sign(method: str, url: str, headers: Mapping[str, str], payload_sha256: str, creds: Credentials,
         now: datetime.datetime, service: str = "s3") -> dict[str, str]:
    """The headers to send: `headers` plus host, x-amz-date, x-amz-content-sha256 (and the session token),
    and Authorization, by Signature Version 4."""
    u = urlsplit(url)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    out = {k.lower(): v.strip() for k, v in headers.items()}
    out["host"] = u.netloc
    out["x-amz-date"] = amz_date
    out["x-amz-content-sha256"] = payload_sha256
    if creds.session_token:
        out["x-amz-security-token"] = creds.session_token
    names = sorted(out)
    canonical_headers = "".join(f"{n}:{out[n]}\n" for n in names)
    signed = ";".join(names)
    # each name and value encoded exactly once, however the URL spelled it (a prefix "events/" is "events%2F")
    query = "&".join(sorted(f"{quote(unquote(k), safe='-_.~')}={quote(unquote(v), safe='-_.~')}" for k, _, v in
                            (p.partition("=") for p in u.query.split("&") if p)))
    path = quote(u.path or "/", safe="/-_.~%")
    request = "\n".join([method, path, query, canonical_headers, signed, payload_sha256])
    scope = f"{day}/{creds.region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(request.encode()).hexdigest()])
    k = _hmac(_hmac(_hmac(_hmac(("AWS4" + creds.secret_key).encode(), day), creds.region), service), "aws4_request")
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, SignedHeaders={signed}, "
                            f"Signature={signature}")
    return out


class Bucket:
    """The few S3 calls the recorder makes, synchronous (the recorder calls them from a thread)."""

    def __init__(self, endpoint: str, bucket: str, creds: Credentials, *, timeout: float = 30.0) -> None:
        if "://" not in endpoint:
            endpoint = "https://" + endpoint
        self.base = endpoint.rstrip("/") + "/" + quote(bucket, safe="")
        self.creds = creds
        self.client = httpx.Client(timeout=timeout)
        self.bucket = bucket

    def _call(self, method: str, key: str = "", *, query: str = "", body: bytes = b"",
              headers: Mapping[str, str] | None = None) -> httpx.Response:
        url = self.base + ("/" + quote(key, safe="") if key else "") + (f"?{query}" if query else "")
        h = sign(method, url, headers or {}, hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256,
                 self.creds, datetime.datetime.now(datetime.timezone.utc))
        try:
            r = self.client.request(method, url, content=body or None, headers=h)
        except httpx.HTTPError as e:
            raise S3Error(f"S3 {method} {url}: {e}") from e
        if r.status_code >= 300 and not (method in ("GET", "HEAD") and r.status_code == 404):
            raise S3Error(f"S3 {method} {url}: {r.status_code} {r.text[:300]}")
        return r

    def put(self, key: str, body: bytes, ctype: str = "application/x-asciicast") -> None:
        self._call("PUT", key, body=body, headers={"content-type": ctype})

    def get(self, key: str, *, first: int = 0) -> bytes | None:
        r = self._call("GET", key, headers={"range": f"bytes=0-{first - 1}"} if first else None)
        return None if r.status_code == 404 else r.content

    def keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """(key, size) of every object (whose key starts with `prefix`), following continuation tokens."""
        out: list[tuple[str, int]] = []
        token = ""
        while True:
            q = "list-type=2" + (f"&continuation-token={quote(token, safe='')}" if token else "") + \
                (f"&prefix={quote(prefix, safe='')}" if prefix else "")
            root = ET.fromstring(self._call("GET", query=q).content)
            ns = root.tag.partition("}")[0] + "}" if root.tag.startswith("{") else ""
            for c in root.iter(f"{ns}Contents"):
                out.append((c.findtext(f"{ns}Key") or "", int(c.findtext(f"{ns}Size") or 0)))
            token = root.findtext(f"{ns}NextContinuationToken") or ""
            if (root.findtext(f"{ns}IsTruncated") or "false") != "true" or not token:
                return out


class S3Writer:
    """One recording on its way to the bucket."""

    def __init__(self, bucket: Bucket, name: str) -> None:
        self.bucket, self.name = bucket, name
        self.data = bytearray()
        self.size = 0
        self._stored = -1
        self._last = 0.0
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        self.data += data
        self.size += len(data)

    def sync(self, *, final: bool = False) -> None:
        """The whole recording so far into the bucket (waiting for SYNC_INTERVAL since the last time)."""
        with self._lock:
            if self._stored == self.size:
                return
            wait = self._last + SYNC_INTERVAL - time.monotonic()
            if wait > 0 and not final:
                time.sleep(wait)
            size = self.size
            self.bucket.put(self.name, bytes(self.data[:size]))
            self._stored, self._last = size, time.monotonic()

    def close(self) -> None:
        try:
            self.sync(final=True)
        except OSError:
            pass


class S3Store:
    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.directory = f"s3://{bucket.bucket}"

    def create(self) -> S3Writer:
        return S3Writer(self.bucket, new_name())

    def read(self, name: str) -> bytes | None:
        return self.bucket.get(name) if NAME.match(name) else None

    def list(self) -> list[Entry]:
        out = []
        for key, size in sorted(self.bucket.keys(), reverse=True):
            if not NAME.match(key):
                continue
            head = self.bucket.get(key, first=65536) or b""
            out.append(entry(key, head.split(b"\n", 1)[0], size))
        return out

    def put_event(self, name: str, data: bytes) -> None:
        """One event as the object `events/<name>` (a PUT is whole or nothing)."""
        self.bucket.put(f"{EVENTS}/{name}", data, "application/json")

    def read_event(self, name: str) -> bytes | None:
        return self.bucket.get(f"{EVENTS}/{name}") if EVENT_NAME.match(name) else None

    def list_events(self) -> Events:
        out = []
        for key, _ in sorted(self.bucket.keys(prefix=EVENTS + "/"), reverse=True):
            name = key.removeprefix(EVENTS + "/")
            data = self.read_event(name)
            if data is not None:
                out.append((name, data))
        return out
