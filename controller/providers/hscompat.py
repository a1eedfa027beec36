"""What each headscale minor (0.26 to 0.29) can do for the controller, and headscale's errors in words that name
the fix. Pure: no I/O; the provider (`headscale.py`) fetches the documents and asks.

The version comes from headscale's own answers, read once at start-up:

- `GET /version` (headscale 0.27 and later) gives the release (`{"version": "v0.27.1", ...}`) of a release
  build; a build from source without version control says `dev`;
- `GET /swagger/v1/openapiv2.json` (every version, no API key needed) describes the REST API that server
  serves, and is what the features are decided from: 0.26 has no `/api/v1/health`; 0.27 adds it; 0.28's node
  has `tags` (0.26 and 0.27: `forcedTags` and `validTags`); 0.29 adds `/api/v1/policy/check`. Before 0.26 there
  is no `/api/v1/node/{nodeId}/approve_routes` (routes had an API of their own), which the controller does not
  speak.

Features by minor (checked in headscale's sources, and in the lab by `make compat`):

| feature | needs |
|---|---|
| pre-auth keys without a user (tag-only) | 0.28 |
| grants with app capabilities (the API server proxy's `tailscale.com/cap/kubernetes`) | 0.29 |

Everything else the controller calls (minting a key for a user, reading and replacing a node's tags,
deleting a node, approving routes) is in all four, with the differences handled in the provider.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The oldest minor the controller speaks, and the newest it was tested with.
OLDEST = (0, 26)
NEWEST = (0, 29)
TESTED = "v0.29.2"

#: Where the controller's settings are, for messages: the chart's value, then the variable.
USER_SETTING = "headscale.user (HEADSCALE_USER)"
KEY_SETTING = "credentials.headscaleAPIKey or the Secret headscale-api (HEADSCALE_API_KEY_FILE)"


@dataclass(frozen=True)
class Feature:
    """A thing some minors cannot do: its name in logs and tables, the minor that brought it, and what to do on
    an older one."""
    name: str
    minimum: tuple[int, int]
    without: str

    def refusal(self, version: str) -> str:
        return (f"headscale {version} cannot do {self.name}: it needs headscale {_minor(self.minimum)} or later "
                f"(upgrade one minor at a time); {self.without}")


TAG_ONLY_KEYS = Feature(
    "pre-auth keys without a user (tag-only keys)", (0, 28),
    f"meanwhile set {USER_SETTING} to the numeric ID of a headscale user (`headscale users list`; "
    "`headscale users create k8s` makes one), and the keys are minted for that user")
GRANTS = Feature(
    "grants with app capabilities (the API server proxy's tailscale.com/cap/kubernetes)", (0, 29),
    "the API server proxy in auth mode gets no capabilities from headscale: it impersonates the tailnet user by "
    "login name with no groups, and refuses tagged devices (use noauth mode, or bind RBAC to the users' names)")
FEATURES = (TAG_ONLY_KEYS, GRANTS)


@dataclass(frozen=True)
class Capabilities:
    """What the detected headscale can do. `version` is what it calls itself (or the minor its API matches),
    `level` the minor whose API it serves; `detected` is False when neither document could be read (the newest
    API is assumed then, and errors still name the fix)."""
    version: str
    level: tuple[int, int]
    detected: bool = True

    @property
    def supported(self) -> bool:
        return self.level >= OLDEST

    def has(self, feature: Feature) -> bool:
        return self.level >= feature.minimum

    @property
    def tags_field(self) -> str:
        """Where a node's tags are: `tags` (0.28+, tags as identity) or `forcedTags` + `validTags`."""
        return "tags" if self.level >= (0, 28) else "forcedTags"

    def unavailable(self, *, user_set: bool) -> tuple[Feature, ...]:
        """The features this server lacks that matter with these settings (tag-only keys do not once a user is
        set)."""
        return tuple(f for f in FEATURES if not self.has(f) and not (f is TAG_ONLY_KEYS and user_set))

    def too_old(self) -> str:
        return (f"headscale {self.version} is older than {_minor(OLDEST)}, the oldest the controller speaks (its "
                f"REST API has no /api/v1/node/{{id}}/approve_routes): upgrade headscale one minor at a time to "
                f"{_minor(OLDEST)} or later (tested: {TESTED})")

    def summary(self, *, user_set: bool) -> str:
        """The start-up line: the version, and what is not available (or that everything is)."""
        how = "" if self.detected else " (not detected: its /version and /swagger/v1/openapiv2.json were unreadable)"
        if not self.supported:
            return f"headscale {self.version}{how}: {self.too_old()}"
        api = "" if self.version.lstrip("v").startswith(_minor(self.level)) else f", API of {_minor(self.level)}"
        newer = f"; newer than the tested {TESTED}" if self.level > NEWEST else ""
        missing = self.unavailable(user_set=user_set)
        if not missing:
            return f"headscale {self.version}{api}{how}: every feature the controller uses is available{newer}"
        return (f"headscale {self.version}{api}{how}: unavailable: " +
                "; ".join(f"{f.name} (needs {_minor(f.minimum)})" for f in missing) + newer)


def _minor(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


_SEMVER = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:[-+].*)?")


def parse_version(doc: Any) -> tuple[str, tuple[int, int]] | None:
    """`GET /version`'s answer → ("v0.27.1", (0, 27)); None for a build without a release (`dev`) or anything
    else."""
    v = str(doc.get("version") or "") if isinstance(doc, Mapping) else ""
    m = _SEMVER.fullmatch(v.strip())
    if not m:
        return None
    return (v.strip() if v.startswith("v") else "v" + v.strip()), (int(m.group(1)), int(m.group(2)))


def api_level(swagger: Any) -> tuple[int, int] | None:
    """The minor whose REST API this OpenAPI document describes (see the module docstring); None when it is not
    headscale's."""
    if not isinstance(swagger, Mapping):
        return None
    paths = swagger.get("paths")
    node = ((swagger.get("definitions") or {}).get("v1Node") or {}).get("properties")
    if not isinstance(paths, Mapping) or not isinstance(node, Mapping) or "/api/v1/node" not in paths:
        return None
    if "/api/v1/node/{nodeId}/approve_routes" not in paths:
        return (0, 25)
    if "/api/v1/health" not in paths:
        return (0, 26)
    if "tags" not in node:
        return (0, 27)
    if "/api/v1/policy/check" not in paths:
        return (0, 28)
    return (0, 29)


def detect(version_doc: Any, swagger: Any) -> Capabilities:
    """Capabilities from the two documents (either may be None: not served, or unreadable). The API decides the
    features; the release names the version when there is one."""
    release = parse_version(version_doc)
    level = api_level(swagger)
    if level is not None:
        return Capabilities(release[0] if release else _minor(level), level)
    if release is not None:
        return Capabilities(release[0], release[1])
    return Capabilities(f"{_minor(NEWEST)} (assumed)", NEWEST, detected=False)


# ---- errors


def error_message(body: str) -> str:
    """headscale's error text: gRPC-gateway's `{"code": .., "message": ..}`, else the body's first line."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, Mapping) and isinstance(doc.get("message"), str):
        return doc["message"].strip()
    return body.strip().splitlines()[0][:200] if body.strip() else ""


def not_found(status: int, body: str) -> bool:
    """A node that does not exist: 404 `node not found` (0.27+), or 0.26's 500 `record not found` (its
    database error passed through untyped)."""
    msg = error_message(body).lower()
    return status == 404 or (status == 500 and msg == "record not found")


def explain(what: str, status: int, body: str, caps: Capabilities | None, *, user: str = "",
            tags: tuple[str, ...] = ()) -> tuple[str, bool]:
    """An error answer to `what` ("creating a pre-auth key", ...) as (message, transient), the message naming the
    setting or the headscale command that fixes it. The body is headscale's; it never holds a key (the API key is
    only ever in the request)."""
    msg = error_message(body)
    low = msg.lower()
    version = caps.version if caps is not None and caps.detected else "(its version not detected)"
    if low == "unauthorized":
        # 401 for an unknown or expired key; 0.26 answers 500 for a key it does not know
        code = "HTTP 401 " if status == 401 else ""      # 0.26's 500 says nothing more than "Unauthorized"
        return (f"headscale: {what}: headscale refused the controller's API key ({code}Unauthorized): it "
                f"is wrong, expired or was deleted. Create a new one where headscale runs, `headscale apikeys create "
                f"--expiration 8760h`, and put it in {KEY_SETTING}; `headscale apikeys list` shows which have "
                f"expired"), False
    if "user not found" in low:
        if user:
            return (f"headscale: {what}: headscale has no user with ID {user} ({USER_SETTING}): set it to the ID of "
                    f"an existing user (`headscale users list`), or leave it empty on headscale 0.28 or later "
                    f"(tag-only keys)"), False
        return f"headscale: {what}: {TAG_ONLY_KEYS.refusal(version)}", False
    if "invalid or not permitted" in low or "not permitted" in low or "tagowner" in low or "tag owner" in low:
        # headscale names the ones it refuses ("requested tags [tag:a tag:b] are ..."); else all that were asked
        m = re.search(r"requested tags \[([^\]]*)\]", msg)
        named = ", ".join(m.group(1).split()) if m else ", ".join(tags) or "the tags asked for"
        return (f"headscale: {what}: headscale's policy refuses {named} ({msg}): add each to the policy's "
                f"tagOwners (`headscale policy get > policy.hujson`, edit, `headscale policy set -f "
                f"policy.hujson`; or the file at policy.path), or change tailscale.com/tags or PROXY_TAGS"), False
    if "cannot remove all tags" in low:
        return (f"headscale: {what}: headscale {version} keeps every tagged node tagged ({msg}): give the proxy at "
                f"least one tag (tailscale.com/tags or PROXY_TAGS)"), False
    if status == 404:
        return (f"headscale: {what}: HTTP 404 ({msg or 'no such endpoint'}): the URL in HEADSCALE_URL (headscale.url) "
                f"does not serve headscale's API under /api/v1, or headscale {version} lacks this call: point it at "
                f"headscale itself (tested: {TESTED})"), False
    transient = status >= 500 or status == 429
    detail = f": {msg}" if msg else ""
    return f"headscale: {what}: headscale answered HTTP {status}{detail}", transient
