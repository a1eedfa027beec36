"""The module map in docs/modules.md says what the code is: every module of every package is in it with its
docstring's summary, and the map fails to generate when a module has no docstring."""
from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import modulemap  # noqa: E402


def test_module_map_is_current():
    text = modulemap.DOC.read_text()
    assert modulemap.render(text) == text, "docs/modules.md is stale: run `make modulemap`"


def test_every_module_of_every_package_is_in_the_map():
    text = modulemap.DOC.read_text()
    found = {p.relative_to(ROOT).as_posix() for p in modulemap.modules()}
    assert {"containerboot/agent.py", "controller/reconcile.py", "bench/rules.py", "labtools/lab.py",
            "nameserver/answer.py", "tscommon/secretcontract.py"} <= found
    missing = sorted(m for m in found if f"| `{m}` |" not in text)
    assert not missing, f"not in docs/modules.md: {missing}: run `make modulemap`"


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, body in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(body)
    return tmp_path


def test_a_new_module_makes_the_map_stale(tmp_path):
    root = _tree(tmp_path, {"containerboot/a.py": '"""The first. More here."""\n'})
    doc = modulemap.render(f"# map\n{modulemap.BEGIN}\n{modulemap.END}\n", root)
    assert "| `containerboot/a.py` | The first. |" in doc
    _tree(tmp_path, {"containerboot/b.py": '"""The second module,\nover two lines.\n\nDetails."""\n'})
    again = modulemap.render(doc, root)
    assert again != doc
    assert "| `containerboot/b.py` | The second module, over two lines. |" in again


def test_a_changed_docstring_makes_its_line_stale(tmp_path):
    root = _tree(tmp_path, {"controller/x.py": '"""Old words (pure)."""\n'})
    doc = modulemap.render(f"{modulemap.BEGIN}\n{modulemap.END}", root)
    _tree(tmp_path, {"controller/x.py": '"""New words (pure): e.g. this. Then more."""\n'})
    assert "| `controller/x.py` | New words (pure): e.g. this. |" in modulemap.render(doc, root)


def test_a_module_without_a_docstring_is_named(tmp_path):
    root = _tree(tmp_path, {"tscommon/ok.py": '"""Fine."""\n', "tscommon/bare.py": "import os\n"})
    with pytest.raises(modulemap.ModuleMapError, match=r"tscommon/bare.py has no module docstring"):
        modulemap.render(f"{modulemap.BEGIN}\n{modulemap.END}", root)


def test_a_document_without_the_markers_is_refused():
    with pytest.raises(modulemap.ModuleMapError, match="lacks the markers"):
        modulemap.render("# no markers here\n")
