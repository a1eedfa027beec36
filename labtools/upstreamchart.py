"""Upstream's operator (tailscale.com v1.102.3) as its users install it: its Helm chart, CRDs, values and examples,
read from the Go module cache, and the comparison of its CRD schemas with this chart's.

Nothing of upstream is copied into the repository: the module is downloaded by the Go toolchain (``go mod
download``) and read where it lies; `chart_with_crds` runs upstream's own generator (``go run
./cmd/k8s-operator/generate helmcrd``) in a throwaway copy, which is how upstream's released chart gets its CRD
templates (the module alone has none: they are generated at release time).

API::

    module_dir()                      # the module's directory, downloaded when missing; None without Go
    crds()                            # {CRD name: CRD object} of upstream's deploy/crds
    examples()                        # upstream's deploy/examples objects
    values()                          # upstream's chart values.yaml
    chart_with_crds(workdir)          # upstream's chart directory with the generated CRD templates
    schema_gaps(upstream, ours, path) # where our schema refuses or prunes what upstream's accepts ([] = none)
    object_problems(obj, schema)      # what our schema would refuse or prune in one object ([] = accepted)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

VERSION = "v1.102.3"
MODULE = f"tailscale.com@{VERSION}"
OPERATOR = Path("cmd") / "k8s-operator"


def module_dir(download: bool = True) -> Path | None:
    """tailscale.com at the pinned version in the Go module cache (downloaded with ``go mod download`` when
    missing and `download`); None without a Go toolchain or when the download fails."""
    go = shutil.which("go")
    if go is None:
        return None
    cache = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True).stdout.strip()
    d = Path(cache) / MODULE
    if d.is_dir() or not download:
        return d if d.is_dir() else None
    cp = subprocess.run([go, "mod", "download", "-json", MODULE], capture_output=True, text=True,
                        env={**os.environ, "GOFLAGS": "-mod=mod"}, cwd="/", timeout=600)
    if cp.returncode != 0:
        return None
    got = json.loads(cp.stdout).get("Dir", "")
    return Path(got) if got and Path(got).is_dir() else None


def _need() -> Path:
    d = module_dir()
    if d is None:
        raise FileNotFoundError(f"{MODULE} is not in the Go module cache and could not be downloaded")
    return d


def crds() -> dict[str, dict]:
    out = {}
    for f in sorted((_need() / OPERATOR / "deploy" / "crds").glob("*.yaml")):
        obj = yaml.safe_load(f.read_text())
        out[obj["metadata"]["name"]] = obj
    return out


def examples() -> list[dict]:
    return [d for f in sorted((_need() / OPERATOR / "deploy" / "examples").glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text()) if d]


def values() -> dict:
    return yaml.safe_load((_need() / OPERATOR / "deploy" / "chart" / "values.yaml").read_text())


def chart_with_crds(workdir: Path) -> Path:
    """A copy of upstream's chart with its CRD templates, made by upstream's generator in a throwaway copy of
    the module (the generator finds the repository root with git, so the copy is made a git work tree)."""
    src = workdir / "tailscale"
    if not src.is_dir():
        shutil.copytree(_need(), src)
        for p in [src, *src.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | 0o200)
        subprocess.run(["git", "init", "-q", str(src)], check=True)
    cp = subprocess.run(["go", "run", "./cmd/k8s-operator/generate", "helmcrd"], cwd=src, capture_output=True,
                        text=True, env={**os.environ, "GOFLAGS": "-mod=mod"}, timeout=900)
    if cp.returncode != 0:
        raise RuntimeError(f"upstream's generator failed: {cp.stderr[-2000:]}")
    chart = src / OPERATOR / "deploy" / "chart"
    if not (chart / "templates" / "connector.yaml").is_file():
        raise RuntimeError(f"upstream's generator wrote no CRD templates into {chart}")
    return chart


# ---- schemas --------------------------------------------------------------------------------------------------

def _preserves(s: Mapping[str, Any]) -> bool:
    return bool(s.get("x-kubernetes-preserve-unknown-fields"))


def _rules(s: Mapping[str, Any]) -> set[str]:
    return {" ".join(str(r.get("rule", "")).split()) for r in s.get("x-kubernetes-validations") or []}


def schema_gaps(up: Mapping[str, Any], ours: Mapping[str, Any], path: str = "") -> list[str]:
    """Every place where `ours` (a structural schema) would refuse or prune something `up` accepts: a property
    it does not declare, a narrower type or enum, a requirement, pattern, bound or CEL rule upstream has not.
    A node of ours that preserves unknown fields accepts whatever is below it."""
    gaps: list[str] = []
    here = path or "."
    if _preserves(ours):
        return gaps
    ut, ot = up.get("type"), ours.get("type")
    if ot and ut and ot != ut and not ours.get("x-kubernetes-int-or-string"):
        gaps.append(f"{here}: type {ot}, upstream {ut}")
    if ours.get("enum") is not None:
        extra = set(up.get("enum") or []) - set(ours["enum"])
        if up.get("enum") is None or extra:
            gaps.append(f"{here}: enum {ours['enum']} refuses upstream's {sorted(extra) or 'any value'}")
    for req in set(ours.get("required") or []) - set(up.get("required") or []):
        gaps.append(f"{here}: requires {req!r}, upstream does not")
    if ours.get("pattern") and ours.get("pattern") != up.get("pattern"):
        gaps.append(f"{here}: pattern {ours['pattern']!r}, upstream {up.get('pattern')!r}")
    if ours.get("format") and ours.get("format") != up.get("format"):
        gaps.append(f"{here}: format {ours['format']!r}, upstream {up.get('format')!r}")
    for bound, tighter in (("minimum", max), ("minItems", max), ("minLength", max), ("maximum", min),
                           ("maxItems", min), ("maxLength", min)):
        if ours.get(bound) is not None and (up.get(bound) is None or
                                            tighter(ours[bound], up[bound]) != up[bound]):
            gaps.append(f"{here}: {bound} {ours[bound]}, upstream {up.get(bound)}")
    for rule in _rules(ours) - _rules(up):
        gaps.append(f"{here}: rule {rule!r} is not upstream's")
    if _preserves(up) and not _preserves(ours):
        gaps.append(f"{here}: upstream preserves unknown fields, ours prunes them")
    uprops, oprops = up.get("properties") or {}, ours.get("properties") or {}
    for name, sub in uprops.items():
        if name not in oprops:
            if not ours.get("additionalProperties"):
                gaps.append(f"{path}.{name}: not declared (pruned on write)")
            continue
        gaps += schema_gaps(sub, oprops[name], f"{path}.{name}")
    if isinstance(up.get("items"), Mapping):
        if isinstance(ours.get("items"), Mapping):
            gaps += schema_gaps(up["items"], ours["items"], f"{path}[]")
    if isinstance(up.get("additionalProperties"), Mapping) and isinstance(ours.get("additionalProperties"), Mapping):
        gaps += schema_gaps(up["additionalProperties"], ours["additionalProperties"], f"{path}{{}}")
    return gaps


def crd_gaps(up: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """schema_gaps for every version upstream serves, plus names, scope and versions."""
    gaps = []
    for key in ("group", "scope"):
        if up["spec"][key] != ours["spec"][key]:
            gaps.append(f"spec.{key}: {ours['spec'][key]!r}, upstream {up['spec'][key]!r}")
    for key in ("kind", "plural", "singular"):
        if up["spec"]["names"].get(key) != ours["spec"]["names"].get(key):
            gaps.append(f"names.{key}: {ours['spec']['names'].get(key)!r}, upstream {up['spec']['names'].get(key)!r}")
    mine = {v["name"]: v for v in ours["spec"]["versions"]}
    for v in up["spec"]["versions"]:
        if v["name"] not in mine:
            gaps.append(f"version {v['name']} is not served")
            continue
        gaps += [f"{v['name']}: {g}" for g in schema_gaps(v["schema"]["openAPIV3Schema"],
                                                          mine[v["name"]]["schema"]["openAPIV3Schema"])]
    return gaps


_TYPES = {"object": Mapping, "array": list, "string": str, "boolean": bool, "number": (int, float)}


def object_problems(obj: Any, s: Mapping[str, Any], path: str = "") -> list[str]:
    """What a structural schema refuses (type, enum, required, pattern, bounds) or prunes (undeclared fields) in
    one object; CEL rules are not evaluated (schema_gaps compares them with upstream's)."""
    here = path or "."
    if _preserves(s) or s.get("x-kubernetes-int-or-string"):
        return []
    t = s.get("type")
    if t == "integer":
        if not isinstance(obj, int) or isinstance(obj, bool):
            return [f"{here}: {obj!r} is not an integer"]
    elif t in _TYPES and (not isinstance(obj, _TYPES[t]) or (t == "number" and isinstance(obj, bool))):
        return [f"{here}: {obj!r} is not of type {t}"]
    out = []
    if s.get("enum") is not None and obj not in s["enum"]:
        out.append(f"{here}: {obj!r} is not one of {s['enum']}")
    if isinstance(obj, str) and s.get("pattern") and not re.search(s["pattern"], obj):
        out.append(f"{here}: {obj!r} does not match {s['pattern']!r}")
    if isinstance(obj, (int, float)) and s.get("minimum") is not None and obj < s["minimum"]:
        out.append(f"{here}: {obj} < minimum {s['minimum']}")
    if isinstance(obj, list):
        if s.get("minItems") is not None and len(obj) < s["minItems"]:
            out.append(f"{here}: fewer than {s['minItems']} items")
        for i, item in enumerate(obj):
            out += object_problems(item, s.get("items") or {}, f"{path}[{i}]")
    if isinstance(obj, Mapping):
        props = s.get("properties") or {}
        for req in s.get("required") or []:
            if req not in obj:
                out.append(f"{here}: {req!r} is required")
        for k, v in obj.items():
            if k in props:
                out += object_problems(v, props[k], f"{path}.{k}")
            elif isinstance(s.get("additionalProperties"), Mapping):
                out += object_problems(v, s["additionalProperties"], f"{path}.{k}")
            elif not s.get("additionalProperties") and path != ".metadata":
                out.append(f"{path}.{k}: not declared (pruned on write)")
    return out
