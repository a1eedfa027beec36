"""A small, strict parser of the Prometheus text exposition format 0.0.4, for tests."""
from __future__ import annotations

import math
import re

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r"[a-zA-Z_][a-zA-Z0-9_]*"
_TYPES = {"counter", "gauge", "summary", "histogram", "untyped"}


def _parse_labels(s: str) -> tuple[tuple[str, str], ...]:
    out = []
    i = 0
    while i < len(s):
        m = re.match(_LABEL + "=\"", s[i:])
        assert m, f"bad label at {s[i:]!r}"
        name = m.group(0)[:-2]
        i += m.end()
        val = []
        while True:
            assert i < len(s), "unterminated label value"
            c = s[i]
            if c == "\\":
                nxt = s[i + 1]
                assert nxt in '\\"n', f"bad escape \\{nxt}"
                val.append("\n" if nxt == "n" else nxt)
                i += 2
            elif c == '"':
                i += 1
                break
            else:
                assert c != "\n"
                val.append(c)
                i += 1
        out.append((name, "".join(val)))
        if i < len(s):
            assert s[i] == ",", f"expected , at {s[i:]!r}"
            i += 1
    names = [n for n, _ in out]
    assert len(names) == len(set(names)), "duplicate label"
    return tuple(out)


def _parse_value(v: str) -> float:
    if v in ("NaN", "+Inf", "-Inf"):
        return float(v.replace("+", ""))
    assert re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", v), f"bad value {v!r}"
    return float(v)


def parse_prometheus(text: str) -> dict[str, dict]:
    """Families: name -> {"type", "help", "samples": {(sample_name, labels): value}}. Asserts on any violation."""
    assert text.endswith("\n"), "exposition must end with a newline"
    fams: dict[str, dict] = {}
    order: list[str] = []      # families in the order their samples appear (must be contiguous)

    def fam(name: str) -> dict:
        return fams.setdefault(name, {"type": None, "help": None, "samples": {}})

    def family_of(sample: str) -> str:
        for suffix in ("_sum", "_count", "_bucket"):
            base = sample[: -len(suffix)]
            if sample.endswith(suffix) and fams.get(base, {}).get("type") in ("summary", "histogram"):
                return base
        return sample

    for line in text.split("\n")[:-1]:
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                name = parts[2]
                assert re.fullmatch(_NAME, name), f"bad metric name {name!r}"
                f = fam(name)
                assert not f["samples"], f"{parts[1]} for {name} after its samples"
                if parts[1] == "TYPE":
                    assert f["type"] is None, f"second TYPE for {name}"
                    assert len(parts) == 4 and parts[3] in _TYPES, f"bad TYPE line {line!r}"
                    f["type"] = parts[3]
                else:
                    assert f["help"] is None, f"second HELP for {name}"
                    f["help"] = parts[3] if len(parts) == 4 else ""
            continue
        m = re.fullmatch(rf"({_NAME})(?:\{{(.*)\}})? ([^ ]+)(?: (-?\d+))?", line)
        assert m, f"bad sample line {line!r}"
        sname, labels, value = m.group(1), _parse_labels(m.group(2) or ""), _parse_value(m.group(3))
        family = family_of(sname)
        if order and order[-1] != family:
            assert family not in order, f"samples of {family} are not contiguous"
        if not order or order[-1] != family:
            order.append(family)
        f = fam(family)
        key = (sname, labels)
        assert key not in f["samples"], f"duplicate sample {line!r}"
        if f["type"] == "counter":
            assert value >= 0 or math.isnan(value)
        f["samples"][key] = value
    return fams


def sample(fams: dict, family: str, name: str | None = None, **labels: str) -> float:
    return fams[family]["samples"][(name or family, tuple(sorted(labels.items())))]


# -- fixtures -------------------------------------------------------------------------------------------------
