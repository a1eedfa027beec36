"""The benchmarks' recorded figures: one JSON file per benchmark in bench/results/, rendered into the docs.

A benchmark ends by calling `record()` with its tables (figures formatted as the docs show them) and a line
saying which run they come from; `scripts/render_figures.py` (`make figures`) writes each table into the
blocks of docs/ that name it (`<!-- BEGIN FIGURES <bench>/<table> -->` ... `<!-- END FIGURES -->`), and
tests/test_figures.py fails when a block differs from its JSON. So a figure is typed once, by the run.

`record()` writes bench/results/<bench>.json only when asked (`--record`, or the environment variable
`BENCH_RECORD=1`), so a trial run on a busy machine does not replace the committed figures by accident.
A test run whose figures share one table with other runs (the 20 s and the five-minute outages, the suite's
two workers and one process) replaces only its own row or column (`record_row`, `record_column`,
bench/runs.py); every write is atomic (a new file renamed over the old, under a lock, so two pytest workers
recording at once lose neither's figures).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


class ResultsError(ValueError):
    """A results file or table that cannot be rendered, naming the file and the field."""


@dataclass(frozen=True)
class Table:
    """One table of figures: a header row and rows of the same width, every cell text."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    @staticmethod
    def of(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> Table:
        return Table(tuple(str(c) for c in columns), tuple(tuple(str(v) for v in r) for r in rows))

    def markdown(self) -> str:
        def line(cells: Sequence[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

        return "\n".join([line(self.columns), "|" + "---|" * len(self.columns), *(line(r) for r in self.rows)])


@dataclass(frozen=True)
class Results:
    """A benchmark's recorded figures: what ran (`command`), which run and machine (`recorded`), its tables."""

    bench: str
    command: str
    recorded: str
    tables: Mapping[str, Table]

    def to_json(self) -> str:
        """The file's text: one line per row, so a new run's diff shows the figures that changed."""
        def one(v: object) -> str:
            return json.dumps(v, ensure_ascii=False)

        tables = ",\n".join(
            f'  {one(k)}: {{\n   "columns": {one(list(t.columns))},\n   "rows": [\n'
            + ",\n".join(f"    {one(list(r))}" for r in t.rows) + "\n   ]\n  }"
            for k, t in self.tables.items())
        return (f'{{\n "bench": {one(self.bench)},\n "command": {one(self.command)},\n'
                f' "recorded": {one(self.recorded)},\n "tables": {{\n{tables}\n }}\n}}\n')


def parse(text: str, source: str) -> Results:
    """A results file's text -> Results; every mistake names `source` and the field."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultsError(f"{source}: not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ResultsError(f"{source}: the document must be an object")
    for key in ("bench", "command", "recorded"):
        if not isinstance(doc.get(key), str) or not doc[key].strip():
            raise ResultsError(f"{source}: {key!r} must be a non-empty string")
    raw = doc.get("tables")
    if not isinstance(raw, dict) or not raw:
        raise ResultsError(f"{source}: 'tables' must be an object of at least one table")
    tables = {}
    for name, t in raw.items():
        where = f"{source}: tables.{name}"
        if not isinstance(t, dict) or not isinstance(t.get("columns"), list) or not isinstance(t.get("rows"), list):
            raise ResultsError(f"{where}: needs 'columns' (a list) and 'rows' (a list of lists)")
        cols = t["columns"]
        for i, row in enumerate(t["rows"]):
            if not isinstance(row, list) or len(row) != len(cols):
                raise ResultsError(f"{where}.rows[{i}]: needs {len(cols)} cells, one per column")
        if not all(isinstance(c, str) for r in [cols, *t["rows"]] for c in r):
            raise ResultsError(f"{where}: every cell must be text (format the figure as the docs show it)")
        tables[name] = Table.of(cols, t["rows"])
    return Results(doc["bench"], doc["command"], doc["recorded"], tables)


def load(bench: str, root: pathlib.Path = RESULTS) -> Results:
    path = root / f"{bench}.json"
    if not path.exists():
        raise ResultsError(f"{path.name}: no such results file in {root}")
    res = parse(path.read_text(), path.name)
    if res.bench != bench:
        raise ResultsError(f"{path.name}: 'bench' says {res.bench!r}, the file name {bench!r}")
    return res


def machine() -> str:
    """The run's machine in the words the docs use: cores and the load beside the benchmark."""
    load = os.getloadavg()[0]
    return f"one run, {os.cpu_count()} cores, 1-minute load average {load:.1f} at its end"


def wanted(flag: bool) -> bool:
    """Whether this run's figures replace the committed ones: `--record` or BENCH_RECORD=1."""
    return flag or os.environ.get("BENCH_RECORD", "") == "1"


def record(res: Results, flag: bool = False, root: pathlib.Path = RESULTS) -> pathlib.Path | None:
    """Write the run's figures to bench/results/<bench>.json when asked (see `wanted`); the path, or None."""
    if not wanted(flag):
        print(f"figures not recorded (--record or BENCH_RECORD=1 writes bench/results/{res.bench}.json)")
        return None
    with _locked(root, res.bench):
        path = _write(res, root)
    print(f"figures recorded in {path}; `make figures` renders them into docs/")
    return path


@contextlib.contextmanager
def _locked(root: pathlib.Path, bench: str) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{bench}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _write(res: Results, root: pathlib.Path) -> pathlib.Path:
    """The file replaced whole or not at all: a reader (or a crash) never sees half of it."""
    path = root / f"{res.bench}.json"
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{res.bench}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(res.to_json())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def _update(bench: str, root: pathlib.Path, change: Callable[[Results | None], Results]) -> pathlib.Path:
    with _locked(root, bench):
        current = load(bench, root) if (root / f"{bench}.json").exists() else None
        return _write(change(current), root)


def record_table(bench: str, table: str, columns: Sequence[str], rows: Sequence[Sequence[object]], *,
                 command: str, recorded: str, root: pathlib.Path = RESULTS) -> pathlib.Path:
    """Replace `table` whole (a table one run measures all of); the other tables stay."""

    def change(cur: Results | None) -> Results:
        tables = {**(cur.tables if cur else {}), table: Table.of(columns, rows)}
        return Results(bench, command, recorded, tables) if cur is None else \
            replace(cur, command=command, recorded=recorded, tables=tables)

    return _update(bench, root, change)


def record_row(bench: str, table: str, columns: Sequence[str], row: Sequence[object], *, key: int, command: str,
               recorded: str, root: pathlib.Path = RESULTS) -> pathlib.Path:
    """Replace the row of `table` whose first `key` cells are this row's (added at the end when there is none);
    the other rows and tables stay. A table whose columns changed starts over with this row."""
    new = tuple(str(c) for c in row)
    if len(new) != len(columns):
        raise ResultsError(f"{bench}.json: tables.{table}: a row of {len(new)} cells for {len(columns)} columns")

    def change(cur: Results | None) -> Results:
        tables = dict(cur.tables) if cur else {}
        old = tables.get(table)
        rows = list(old.rows) if old is not None and old.columns == tuple(columns) else []
        at = next((i for i, r in enumerate(rows) if r[:key] == new[:key]), None)
        if at is None:
            rows.append(new)
        else:
            rows[at] = new
        tables[table] = Table.of(columns, rows)
        return Results(bench, command, recorded, tables) if cur is None else \
            replace(cur, command=command, recorded=recorded, tables=tables)

    return _update(bench, root, change)


def record_column(bench: str, table: str, corner: str, column: str, cells: Mapping[str, object], *, command: str,
                  recorded: str, root: pathlib.Path = RESULTS) -> pathlib.Path:
    """Replace (or add, at the right) the column `column` of `table`, whose first column (headed `corner`)
    names the rows: each of `cells` goes in the row of its name (rows added as needed, "" where another run
    has no figure)."""

    def change(cur: Results | None) -> Results:
        tables = dict(cur.tables) if cur else {}
        old = tables.get(table)
        if old is None or old.columns[0] != corner:
            old = Table((corner,), ())
        cols = list(old.columns)
        if column not in cols:
            cols.append(column)
        at = cols.index(column)
        rows = {r[0]: list(r) + [""] * (len(cols) - len(r)) for r in old.rows}
        for name, value in cells.items():
            rows.setdefault(name, [name] + [""] * (len(cols) - 1))[at] = str(value)
        tables[table] = Table.of(cols, list(rows.values()))
        return Results(bench, command, recorded, tables) if cur is None else \
            replace(cur, command=command, recorded=recorded, tables=tables)

    return _update(bench, root, change)
