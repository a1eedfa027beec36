"""The module map in docs/modules.md, generated from the modules' own docstrings (`make modulemap`).

Every module of the project's packages is listed under its package with the summary of its docstring: the
first sentence of its first paragraph (a docstring's first line is often cut mid-sentence, so the sentence is
joined across lines). A module without a docstring is an error naming the file: the map cannot describe it.

    python scripts/modulemap.py --write    # rewrite the generated block of docs/modules.md
    python scripts/modulemap.py --check    # exit 1 when the block is stale, naming what differs
"""
from __future__ import annotations

import argparse
import ast
import difflib
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "modules.md"
#: every package of the project, product first, then the lab and the benchmarks
PACKAGES = ("containerboot", "netfilter", "serveconfig", "nameserver", "controller", "tscommon", "labtools", "bench")
BEGIN, END = "<!-- BEGIN MODULE MAP (scripts/modulemap.py) -->", "<!-- END MODULE MAP -->"


class ModuleMapError(Exception):
    """A module the map cannot describe, or a document without the generated block's markers."""


def modules(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Every module of the packages, in package order, then by path."""
    out: list[pathlib.Path] = []
    for pkg in PACKAGES:
        out += sorted(p for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    return out


def summary(docstring: str) -> str:
    """The first sentence of the docstring's first paragraph, on one line."""
    para = " ".join(docstring.strip().split("\n\n")[0].split())
    # a sentence ends at '.', '?' or '!' followed by a space and a capital or a backquote, or at the paragraph's end
    m = re.match(r"(.+?[.?!])(?=\s+[A-Z`(]|$)", para)
    return m.group(1) if m else para


def module_summary(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    if not doc or not doc.strip():
        raise ModuleMapError(f"{path.relative_to(root)} has no module docstring: add one (its first sentence "
                             "says what the module is; it goes into docs/modules.md)")
    return summary(doc)


def render_block(root: pathlib.Path = ROOT) -> str:
    """The generated part: one table per package, a row per module."""
    lines: list[str] = []
    current = ""
    for path in modules(root):
        rel = path.relative_to(root)
        pkg = rel.parts[0]
        if pkg != current:
            if current:
                lines.append("")
            lines += [f"### `{pkg}/`", "", "| module | what it is |", "|---|---|"]
            current = pkg
        text = module_summary(path, root).replace("|", "\\|")
        lines.append(f"| `{rel.as_posix()}` | {text} |")
    return "\n".join(lines)


def render(doc: str, root: pathlib.Path = ROOT) -> str:
    """The document with its generated block replaced by the current map."""
    if BEGIN not in doc or END not in doc:
        raise ModuleMapError(f"{DOC.relative_to(ROOT)} lacks the markers {BEGIN} ... {END}")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render_block(root)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/modulemap.py", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated block of docs/modules.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when the block is stale")
    args = ap.parse_args(argv)
    try:
        cur = DOC.read_text()
        new = render(cur)
    except ModuleMapError as e:
        print(f"modulemap: {e}", file=sys.stderr)
        return 1
    if args.write:
        if new != cur:
            DOC.write_text(new)
        print(f"modulemap: {DOC.relative_to(ROOT)} {'rewritten' if new != cur else 'unchanged'}")
        return 0
    if new != cur:
        diff = difflib.unified_diff(cur.splitlines(), new.splitlines(), "docs/modules.md", "generated", lineterm="")
        print("\n".join(diff), file=sys.stderr)
        print("modulemap: docs/modules.md is stale: run `make modulemap`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
