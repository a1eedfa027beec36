"""Redaction of secrets from anything that may be logged or shown in an error.

Auth keys, OAuth client secrets, ID tokens and bearer tokens must never reach a log line. Every message that
may carry user input or a command line goes through `redact` first.
"""
from __future__ import annotations

import re

# tskey-auth-..., tskey-client-..., and headscale's hex pre-auth keys all follow a flag or a key name; match
# the flag forms the agent passes on command lines and the key names it reads.
_FLAG_RE = re.compile(
    r"(--(?:auth-?key|client-secret|id-token)[= ])(\S+)", re.IGNORECASE)
_TSKEY_RE = re.compile(r"tskey-[A-Za-z0-9-]+")
_BEARER_RE = re.compile(r"(Bearer\s+)\S+", re.IGNORECASE)

_registered: set[str] = set()


def register(secret: str) -> None:
    """Remember a secret value so that it is masked wherever it appears later."""
    if secret and len(secret) >= 4 and not secret.startswith("file:"):
        _registered.add(secret)


def redact(text: str) -> str:
    """Return text with every known secret replaced by a placeholder."""
    for s in sorted(_registered, key=len, reverse=True):
        text = text.replace(s, "[REDACTED]")
    text = _FLAG_RE.sub(lambda m: m.group(1) + (m.group(2) if m.group(2).startswith("file:") else "[REDACTED]"), text)
    text = _TSKEY_RE.sub("tskey-[REDACTED]", text)
    text = _BEARER_RE.sub(r"\1[REDACTED]", text)
    return text
