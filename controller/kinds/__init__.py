"""One pure module per parent kind: is the object ours, and which proxy does it ask for.

Each `decide(obj, cfg, ...)` returns a `model.Decision`, raises `model.Invalid` (condition false, a Warning event,
nothing created) or `model.Pending` (not yet: retried); each `handled(obj, cfg)` says whether the controller
should run a proxy for the object at all (False on an object that still carries the finalizer means cleanup).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def annotations_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return meta(obj).get("annotations") or {}


def labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return meta(obj).get("labels") or {}
