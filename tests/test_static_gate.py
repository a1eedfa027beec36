"""The static gate's configuration (pyproject.toml): mypy checks exactly the packages the wheel ships, and the
lab's tooling is in neither the wheel nor the proxy image."""
from __future__ import annotations

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONF = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_mypy_checks_every_shipped_package() -> None:
    shipped = {p.rstrip("*") for p in CONF["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert set(CONF["tool"]["mypy"]["files"]) == shipped


def test_lab_tooling_is_not_shipped() -> None:
    shipped = {p.rstrip("*") for p in CONF["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert not shipped & {"labtools", "tests", "bench", "scripts"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^COPY (labtools|tests|bench)\b", dockerfile, re.M)

