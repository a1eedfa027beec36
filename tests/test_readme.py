"""The docs stay true: the variable reference in docs/agent.md is generated from the settings table, and every
relative link in the README and docs/ leads to a file and heading that exist."""
from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import update_readme  # noqa: E402


def test_variable_reference_matches_settings_table():
    text = update_readme.DOC.read_text()
    assert update_readme.render(text) == text, "docs/agent.md variable reference is stale: run `make readme`"


def test_every_ts_variable_in_the_table_is_documented():
    from containerboot.settings import SETTINGS

    text = update_readme.DOC.read_text()
    missing = [s.name for s in SETTINGS if f"`{s.name}`" not in text]
    assert not missing, f"not in docs/agent.md: {missing}"


def _anchors(md: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    out = set()
    for line in md.splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_relative_links_resolve():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for doc in docs:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken
