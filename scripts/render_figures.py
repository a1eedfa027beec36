"""Render the benchmarks' recorded figures (bench/results/*.json) into the docs' figure blocks (`make figures`).

A block names one table of one results file and is rewritten whole, with a line saying which run the figures
come from:

    <!-- BEGIN FIGURES footprint/boot -->
    (generated)
    <!-- END FIGURES -->

    python scripts/render_figures.py --write    # rewrite every block of docs/*.md from bench/results/
    python scripts/render_figures.py --check    # exit 1 when a block differs from its JSON, naming it
"""
from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import RESULTS, Results, ResultsError, load  # noqa: E402

BLOCK = re.compile(r"<!-- BEGIN FIGURES (?P<ref>[^ ]*) -->\n(?P<body>.*?)<!-- END FIGURES -->", re.S)
END = "<!-- END FIGURES -->"


def documents(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The documents that may carry figure blocks."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "bench" / "README.md"]


def block_body(res: Results, table: str, doc: pathlib.Path, results: pathlib.Path) -> str:
    if table not in res.tables:
        raise ResultsError(f"{res.bench}.json has no table {table!r} (it has: {', '.join(sorted(res.tables))})")
    link = os.path.relpath(results / f"{res.bench}.json", doc.parent)
    return (f"{res.tables[table].markdown()}\n\n"
            f"From `{res.command}`: {res.recorded} ([{res.bench}.json]({link})).\n")


def render(text: str, doc: pathlib.Path, results: pathlib.Path = RESULTS) -> str:
    """The document with every figure block rewritten from its results file."""
    cache: dict[str, Results] = {}

    def one(m: re.Match[str]) -> str:
        ref = m.group("ref")
        bench, sep, table = ref.partition("/")
        if not sep or not bench or not table:
            raise ResultsError(f"{doc.name}: figure block {ref!r} must name <bench>/<table>")
        if bench not in cache:
            cache[bench] = load(bench, results)
        return f"<!-- BEGIN FIGURES {ref} -->\n{block_body(cache[bench], table, doc, results)}{END}"

    out = BLOCK.sub(one, text)
    if out.count("<!-- BEGIN FIGURES") != out.count(END):
        raise ResultsError(f"{doc.name}: a figure block without its {END} line")
    return out


def blocks(text: str) -> list[str]:
    """The `<bench>/<table>` references of a document's blocks."""
    return [m.group("ref") for m in BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/render_figures.py", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the figure blocks")
    mode.add_argument("--check", action="store_true", help="exit 1 when a block is stale")
    args = ap.parse_args(argv)
    stale = 0
    for doc in documents():
        cur = doc.read_text()
        try:
            new = render(cur, doc)
        except ResultsError as e:
            print(f"render_figures: {e}", file=sys.stderr)
            return 1
        if new == cur:
            continue
        rel = doc.relative_to(ROOT).as_posix()
        if args.write:
            tmp = doc.with_name(f".{doc.name}.tmp")     # replaced whole: a test reading it never sees half
            tmp.write_text(new)
            os.replace(tmp, doc)
            print(f"render_figures: {rel} rewritten")
        else:
            stale += 1
            print("\n".join(difflib.unified_diff(cur.splitlines(), new.splitlines(), rel, "rendered", lineterm="")),
                  file=sys.stderr)
    if stale:
        print("render_figures: figure blocks differ from bench/results/: run `make figures`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
