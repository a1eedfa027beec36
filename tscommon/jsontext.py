"""JSON decoding of text from outside the process, with every failure a `json.JSONDecodeError`.

Python's decoder recurses once per nesting level, so a document nested a few thousand levels deep (a few
kilobytes: `[[[[...`) raises RecursionError instead of a decoding error, and a caller that handles bad JSON
crashes on it. Every parser of files, Secrets and API answers decodes through `loads` here; the error is a
JSONDecodeError (a ValueError), so the callers' existing handling of bad JSON covers it.
"""
from __future__ import annotations

import json
from typing import Any

__all__ = ["loads", "response_json"]


def loads(text: str | bytes | bytearray, **kwargs: Any) -> Any:
    """json.loads, with too deep a nesting reported as a JSONDecodeError."""
    try:
        return json.loads(text, **kwargs)
    except RecursionError:
        doc = text if isinstance(text, str) else ""
        raise json.JSONDecodeError("the document is nested too deeply", doc, 0) from None


def response_json(resp: Any) -> Any:
    """The decoded body of an httpx response (what `resp.json()` gives), through `loads`."""
    return loads(resp.content)
