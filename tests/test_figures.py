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


# ---- figures the test runs write themselves (bench/runs.py): what a run records is what the docs render

HEADSCALE_20 = {"outage": "headscale", "seconds": 20.0, "seed": 1234, "onset_s": 2.5, "data_path_gap_s": 0,
                "probes": 136, "failed_probes": 0, "held_connection_gap_s": 0.26, "recovery_s": 9.1,
                "status_recovery_s": 3.4, "status_shown_after_s": 11.5}
CONTROLLER_300 = {"outage": "apiserver-controller", "seconds": 300.0, "seed": 99, "onset_s": 1.0,
                  "apiserver_start_s": 4.2, "created_after_return_reconciled_s": 0.5,
                  "changed_before_outage_converged_s": 0.6, "log_lines_during_outage": 12}


def _block(ref: str, tmp_path: pathlib.Path) -> str:
    doc = tmp_path / "doc.md"
    return render_figures.render(f"<!-- BEGIN FIGURES {ref} -->\n<!-- END FIGURES -->\n", doc, tmp_path)


def test_an_outage_runs_row_is_what_the_docs_render(tmp_path, monkeypatch):
    from bench import runs
    monkeypatch.delenv("BENCH_RECORD", raising=False)
    assert runs.record_outage(HEADSCALE_20, tmp_path) is None and not (tmp_path / "outages.json").exists()
    monkeypatch.setenv("BENCH_RECORD", "1")
    runs.record_outage(HEADSCALE_20, tmp_path)
    runs.record_outage(CONTROLLER_300, tmp_path)
    again = {**HEADSCALE_20, "probes": 140, "seed": 5678}
    runs.record_outage(again, tmp_path)              # the same outage and length: its row replaced, not added
    table = results.load("outages", tmp_path).tables["main"]
    assert [list(r[:3]) for r in table.rows] == [["headscale down", "20 s", "140 / 0"],
                                                 ["the API server down, controller", "300 s", "(no data path)"]]
    assert "CB_SEED=5678 (the outage 2.5 s later than the earliest)" in table.rows[0][-1]
    block = _block("outages/main", tmp_path)
    assert "| headscale down | 20 s | 140 / 0 | 0 s / 0.26 s | 11.5 s |" in block
    assert "12 log lines during the outage" in block and "CB_SEED=99" in block
    assert [f.name for f in tmp_path.iterdir() if f.name.endswith(".tmp")] == [], "a temporary file was left"


def test_a_hostile_runs_column_is_what_the_docs_render(tmp_path, monkeypatch):
    from bench import runs
    monkeypatch.setenv("BENCH_RECORD", "1")
    figures = {"faults": {"500": 27, "429": 27, "409": 9, "slow": 81}, "converged_s": 4.5, "clean_converged_s": 1.3,
               "writes_max": 11, "writes_mean": 8.4, "clean_writes_max": 8, "reads_max": 29, "reads_mean": 11.9,
               "early_after_429": 0, "rerun_writes": 0, "warning_lines": 3}
    runs.record_hostile("memory", "60 Services", runs.hostile_memory_cells(figures, "run A"), tmp_path)
    runs.record_hostile("memory", "500 Services", runs.hostile_memory_cells({**figures, "converged_s": 47.4}, "run B"),
                        tmp_path)
    runs.record_hostile("memory", "60 Services", runs.hostile_memory_cells({**figures, "writes_max": 12}, "run C"),
                        tmp_path)
    table = results.load("hostile", tmp_path).tables["memory"]
    assert table.columns[1:] == ("60 Services", "500 Services")
    rows = {r[0]: r[1:] for r in table.rows}
    assert rows["faults injected"] == ("27 × 500, 27 × 429, 9 × 409, 81 slow answers",) * 2
    assert rows["writes per Service, max / mean"][0].startswith("12 / 8.4") and rows["run"] == ("run C", "run B")
    assert "| converged (every Service has its proxy and a Ready condition) | 4.5 s (fault-free: 1.3 s) | 47.4 s" \
        in _block("hostile/memory", tmp_path)


def test_a_whole_suites_run_writes_its_row(tmp_path, monkeypatch):
    from bench import runs
    monkeypatch.setenv("BENCH_RECORD", "1")
    runs.record_suite("unit", 2, 79.4, {"passed": 1387, "failed": 0, "errors": 0, "skipped": 14}, 42, tmp_path)
    runs.record_suite("netns", 2, 800, {"passed": 297, "failed": 1, "errors": 0, "skipped": 2}, 42, tmp_path)
    runs.record_longest({"netns-tests/test_a.py": 400, "netns-tests/test_b.py": 100, "netns-tests/test_c.py": 50,
                         "netns-tests/test_d.py": 40, "netns-tests/test_e.py": 30}, 42, tmp_path)
    block = _block("suite/main", tmp_path)
    assert "| unit tests, 2 workers | 79 s | 1387 passed, 14 skipped |" in block
    assert "| netns tests, 2 workers | 13.3 minutes | 297 passed, 1 failed, 2 skipped |" in block
    longest = _block("suite/longest", tmp_path)
    assert "| `test_a.py` | 6.7 minutes |" in longest and "| the other 1 | under 0.5 minutes each |" in longest


def test_the_kube_demos_rows_are_what_the_docs_render(tmp_path, monkeypatch):
    from bench import runs
    monkeypatch.setenv("BENCH_RECORD", "1")
    figures = {"image_s": 6.7, "control_plane_s": 3.4, "node_ready_s": 9.3, "kubelet_to_ready_s": 4.2,
               "import_s": 6.8, "device_keys_s": 3.2, "total_s": 38.5,
               "rss_mb": {"kube-apiserver": 280.4, "etcd": 42.0, "kubelet": 78.0, "containerd": 45.0, "holder": 1.0}}
    runs.record_labcluster(figures, tmp_path)
    runs.record_labcluster({**figures, "control_plane_s": 3.9}, tmp_path)
    table = results.load("labcluster", tmp_path).tables["main"]
    assert len(table.rows) == 5, table.rows
    block = _block("labcluster/main", tmp_path)
    assert "| cluster start (empty directory) → control plane ready | 3.9 s |" in block
    assert "| control plane memory (RSS) | kube-apiserver 280 MiB, etcd 42 MiB: about 322 MiB |" in block
    assert "| node memory (RSS) | kubelet 78 MiB, containerd 45 MiB: about 123 MiB |" in block
