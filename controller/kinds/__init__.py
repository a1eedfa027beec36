"""One pure module per kind the controller acts on: is the object ours, and what does it ask for.

Each `decide(obj, cfg, ...)` returns a `model.Decision`, raises `model.Invalid` (condition false, a Warning event,
nothing created) or `model.Pending` (not yet: retried); each `handled(obj, cfg)` says whether the controller
should run a proxy for the object at all (False on an object that still carries the finalizer means cleanup).
The kinds that own no proxy of their own have their module here too: `proxyclass` (a class: validation and its
merge into a rendering), `dnsconfig` (the nameserver and its records) and `recorder` (a Recorder's objects).
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
