"""The benchmarks' figures in the docs are the ones their runs recorded: every figure block equals what its
bench/results/*.json says, every results file is shown somewhere, and a malformed file is named."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import render_figures  # noqa: E402

from bench import results  # noqa: E402


def test_every_figure_block_equals_its_results_file():
    stale = [doc.relative_to(ROOT).as_posix() for doc in render_figures.documents()
             if render_figures.render(doc.read_text(), doc) != doc.read_text()]
    assert not stale, f"figure blocks differ from bench/results/ in {stale}: run `make figures`"


def test_every_recorded_table_is_shown_in_the_docs():
    shown = {ref for doc in render_figures.documents() for ref in render_figures.blocks(doc.read_text())}
    recorded = {f"{p.stem}/{t}" for p in sorted(results.RESULTS.glob("*.json"))
                for t in results.load(p.stem).tables}
    assert recorded, "no results files in bench/results/"
    assert recorded - shown == set(), f"recorded but in no figure block: {sorted(recorded - shown)}"
    assert shown - recorded == set(), f"figure blocks naming no recorded table: {sorted(shown - recorded)}"


def _write(root: pathlib.Path, name: str, doc: object) -> None:
    (root / f"{name}.json").write_text(json.dumps(doc))


def test_a_new_run_changes_the_rendered_block(tmp_path):
    res = results.Results("demo", "python -m bench.demo", "one run", {
        "main": results.Table.of(["figure", "value"], [["boot", "2.0 s"]])})
    assert results.record(res, flag=True, root=tmp_path) == tmp_path / "demo.json"
    doc = tmp_path / "doc.md"
    text = "intro\n<!-- BEGIN FIGURES demo/main -->\nold | text\n<!-- END FIGURES -->\nafter\n"
    out = render_figures.render(text, doc, tmp_path)
    assert "| boot | 2.0 s |" in out and "old | text" not in out and out.endswith("<!-- END FIGURES -->\nafter\n")
    assert "From `python -m bench.demo`: one run ([demo.json](demo.json))." in out
    assert render_figures.render(out, doc, tmp_path) == out
    results.record(results.Results("demo", "python -m bench.demo", "another run", {
        "main": results.Table.of(["figure", "value"], [["boot", "2.1 s"]])}), flag=True, root=tmp_path)
    again = render_figures.render(out, doc, tmp_path)
    assert "| boot | 2.1 s |" in again and "2.0 s" not in again


def test_a_run_records_only_when_asked(tmp_path, monkeypatch):
    res = results.Results("demo", "c", "r", {"main": results.Table.of(["a"], [["1"]])})
    monkeypatch.delenv("BENCH_RECORD", raising=False)
    assert results.record(res, root=tmp_path) is None and not (tmp_path / "demo.json").exists()
    monkeypatch.setenv("BENCH_RECORD", "1")
    assert results.record(res, root=tmp_path) is not None
    assert results.load("demo", tmp_path) == res


@pytest.mark.parametrize(("doc", "message"), [
    ({"bench": "x", "command": "c", "recorded": "r", "tables": {"t": {"columns": ["a", "b"], "rows": [["1"]]}}},
     r"x.json: tables.t.rows\[0\]: needs 2 cells"),
    ({"bench": "x", "command": "c", "recorded": "", "tables": {}}, "x.json: 'recorded' must be a non-empty string"),
    ({"bench": "x", "command": "c", "recorded": "r", "tables": {"t": {"columns": ["a"], "rows": [[1.5]]}}},
     "every cell must be text"),
    ({"bench": "y", "command": "c", "recorded": "r", "tables": {"t": {"columns": ["a"], "rows": []}}},
     "'bench' says 'y', the file name 'x'"),
])
def test_a_malformed_results_file_is_named(tmp_path, doc, message):
    _write(tmp_path, "x", doc)
    with pytest.raises(results.ResultsError, match=message):
        results.load("x", tmp_path)


def test_a_block_naming_a_missing_table_is_named(tmp_path):
    _write(tmp_path, "x", {"bench": "x", "command": "c", "recorded": "r",
                           "tables": {"main": {"columns": ["a"], "rows": [["1"]]}}})
    with pytest.raises(results.ResultsError, match=r"x.json has no table 'other' \(it has: main\)"):
        render_figures.render("<!-- BEGIN FIGURES x/other -->\n<!-- END FIGURES -->", tmp_path / "d.md", tmp_path)
    with pytest.raises(results.ResultsError, match="no such results file"):
        render_figures.render("<!-- BEGIN FIGURES nope/main -->\n<!-- END FIGURES -->", tmp_path / "d.md", tmp_path)
