"""Regenerate the agent's variable reference (docs/agent.md) from the settings table (`make readme`)."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from containerboot.settings import reference_markdown

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "agent.md"
BEGIN, END = "<!-- BEGIN SETTINGS REFERENCE -->", "<!-- END SETTINGS REFERENCE -->"


def render(readme: str) -> str:
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{reference_markdown().strip()}\n{END}{tail}"


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
