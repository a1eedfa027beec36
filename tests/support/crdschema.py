"""A CRD's structural schema as the API server applies it, for the in-memory fake (tests/support/fakekube.py):
unknown fields pruned, then types, enums, required fields, patterns and bounds checked, each problem named by
its field path in the API server's words (`spec.type: Unsupported value: "x": supported values: ...`).

What it leaves out, because no unit test needs it: CEL rules (`x-kubernetes-validations`, which only the real
server runs: netns-tests check those), formats, defaults, and list-map key uniqueness. The contract checks
(tests/support/kube_contract.py, `CRD_CHECKS`) hold it to the real kube-apiserver's behaviour.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

#: the chart's CRDs as applied: rendered from its templates/crds/ into deploy/crds/ (tests/test_helm_chart.py
#: keeps the two in step), so each file is plain YAML
CRD_DIR = Path(__file__).resolve().parents[2] / "deploy" / "crds"


@dataclass(frozen=True)
class Crd:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    schema: dict
    status_subresource: bool

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}"

    @classmethod
    def from_document(cls, doc: dict) -> Crd:
        spec = doc["spec"]
        v = next(v for v in spec["versions"] if v.get("storage", True))
        return cls(spec["group"], v["name"], spec["names"]["plural"], spec["names"]["kind"],
                   spec["scope"] == "Namespaced", v["schema"]["openAPIV3Schema"],
                   "status" in (v.get("subresources") or {}))


def project_crds() -> list[Crd]:
    return [Crd.from_document(yaml.safe_load(p.read_text())) for p in sorted(CRD_DIR.glob("*.yaml"))]


_TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,),
                                       "integer": (int,), "number": (int, float), "boolean": (bool,)}


def _show(v: Any) -> str:
    return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


def prune(obj: Any, schema: dict) -> Any:
    """Drop the fields the schema does not name (structural pruning); metadata is the server's own."""
    keep_all = schema.get("x-kubernetes-preserve-unknown-fields")
    if not isinstance(obj, dict) or schema.get("type") != "object" or keep_all:
        if isinstance(obj, list) and isinstance(schema.get("items"), dict):
            return [prune(x, schema["items"]) for x in obj]
        return obj
    props = schema.get("properties")
    if props is None:
        extra = schema.get("additionalProperties")
        return {k: prune(v, extra) for k, v in obj.items()} if isinstance(extra, dict) else obj
    return {k: (v if k == "metadata" else prune(v, props[k])) for k, v in obj.items() if k in props}


def problems(obj: Any, schema: dict, path: str = "") -> list[str]:
    """Every way `obj` breaks `schema`, as `<field path>: <what>` (empty: valid)."""
    out: list[str] = []
    t = schema.get("type")
    if obj is None:
        return [] if schema.get("nullable") else [f"{path}: Invalid value: \"null\": {path} in body must be of type "
                                                     f"{t}: \"null\""] if t else []
    if t and not (isinstance(obj, _TYPES[t]) and not (t in ("integer", "number") and isinstance(obj, bool))):
        kind = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
                float: "number"}.get(type(obj), type(obj).__name__)
        return [f"{path}: Invalid value: \"{kind}\": {path} in body must be of type {t}: \"{kind}\""]
    if "enum" in schema and obj not in schema["enum"]:
        allowed = ", ".join(_show(v) for v in schema["enum"])
        out.append(f"{path}: Unsupported value: {_show(obj)}: supported values: {allowed}")
    if isinstance(obj, str):
        if "pattern" in schema and not re.search(schema["pattern"], obj):
            out.append(f"{path}: Invalid value: {_show(obj)}: {path} in body should match '{schema['pattern']}'")
        if "maxLength" in schema and len(obj) > schema["maxLength"]:
            out.append(f"{path}: Too long: may not be more than {schema['maxLength']} bytes")
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        if "minimum" in schema and obj < schema["minimum"]:
            out.append(f"{path}: Invalid value: {obj}: {path} in body should be greater than or equal to "
                       f"{schema['minimum']}")
        if "maximum" in schema and obj > schema["maximum"]:
            out.append(f"{path}: Invalid value: {obj}: {path} in body should be less than or equal to "
                       f"{schema['maximum']}")
    if isinstance(obj, list):
        if "maxItems" in schema and len(obj) > schema["maxItems"]:
            out.append(f"{path}: Too many: {len(obj)}: must have at most {schema['maxItems']} items")
        if isinstance(schema.get("items"), dict):
            for i, x in enumerate(obj):
                out += problems(x, schema["items"], f"{path}[{i}]")
    if isinstance(obj, dict):
        for r in schema.get("required", []):
            if r not in obj:
                out.append(f"{path + '.' if path else ''}{r}: Required value")
        props = schema.get("properties") or {}
        for k, v in obj.items():
            sub = props.get(k) or (schema.get("additionalProperties")
                                   if isinstance(schema.get("additionalProperties"), dict) else None)
            if sub is not None and k != "metadata":
                out += problems(v, sub, f"{path + '.' if path else ''}{k}")
    return out
