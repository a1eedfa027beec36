"""The README's variable reference is generated from the settings table and must not drift from it."""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import update_readme  # noqa: E402


def test_readme_reference_matches_settings_table():
    text = (ROOT / "README.md").read_text()
    assert update_readme.render(text) == text, "README variable reference is stale: run `make readme`"


def test_every_ts_variable_in_the_table_is_in_the_readme():
    from containerboot.settings import SETTINGS

    text = (ROOT / "README.md").read_text()
    missing = [s.name for s in SETTINGS if f"`{s.name}`" not in text]
    assert not missing, f"not in the README: {missing}"
