"""The import structure (rules in tests/support/layers.py): packages import only the layers below them, pure
modules import no I/O, and no circle among modules, type-checking imports included. `make check` runs this file:
a planted import from a pure module into an adapter, or a planted circle through `TYPE_CHECKING`, fails it
(shown below on a copy of the tree).

A circle means two modules that cannot be understood, changed or tested one without the other: move what both
need into a module of its own, as `netfilter.errors` and `netfilter.conntrack` are for the firewall backends.
`CB_LAYERS_ROOT` points the checks at another tree (the planted copies)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import layers

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("CB_LAYERS_ROOT") or REPO)


@pytest.fixture(scope="module")
def tree() -> layers.Tree:
    return layers.Tree.read(ROOT)


def test_packages_import_only_the_layers_below_them(tree) -> None:
    assert any(i.source == "containerboot.agent" for i in tree.edges), "the scan found no imports at all"
    assert layers.layer_violations(tree) == []


def test_pure_modules_import_no_io(tree) -> None:
    assert layers.pure_violations(tree) == []


def test_the_pure_list_matches_the_docstrings(tree) -> None:
    assert layers.pure_list_problems(tree) == []


def test_no_import_circle(tree) -> None:
    assert layers.cycles(tree.graph()) == []


# The checker itself, on planted copies of the tree.

def test_cycles_finds_a_circle_and_only_its_members() -> None:
    assert layers.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    root.mkdir()
    shutil.copy(REPO / "pyproject.toml", root)
    for pkg in layers.product_packages(REPO):
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _plant(root: Path, module: str, text: str) -> None:
    p = root / (module.replace(".", "/") + ".py")
    p.write_text(p.read_text() + "\n" + text + "\n")


def test_a_planted_import_from_a_pure_module_into_an_adapter_is_named(tmp_path) -> None:
    root = _copy(tmp_path)
    _plant(root, "controller.render", "from controller import kubeapi  # noqa: E402,F401")
    _plant(root, "netfilter.plan", "def later():\n    import subprocess\n    return subprocess")
    found = layers.pure_violations(layers.Tree.read(root))
    assert any(v.startswith("controller/render.py:") and "controller.render imports controller.kubeapi: a pure "
               "module imports only pure modules (controller.kubeapi is not)" in v for v in found), found
    assert any("netfilter.plan imports subprocess: a pure module does no I/O" in v for v in found), found


def test_a_planted_circle_through_type_checking_is_found(tmp_path) -> None:
    root = _copy(tmp_path)
    _plant(root, "controller.render", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
           "    from controller import proxyrbac  # noqa: F401")
    found = layers.cycles(layers.Tree.read(root).graph())
    assert ["controller.proxyrbac", "controller.render"] in found, found
    edge = next(i for i in layers.Tree.read(root).edges
                if (i.source, i.target) == ("controller.render", "controller.proxyrbac"))
    assert edge.type_checking


def test_a_planted_layer_breach_is_named(tmp_path) -> None:
    root = _copy(tmp_path)
    _plant(root, "netfilter.model", "from containerboot import settings  # noqa: E402,F401")
    _plant(root, "controller.queue", "import labtools.lab  # noqa: E402,F401")
    found = layers.layer_violations(layers.Tree.read(root))
    assert any("netfilter.model imports containerboot.settings: netfilter may import only netfilter, tscommon" in v
               for v in found), found
    assert any("controller.queue imports labtools.lab: the lab's tooling sits on top" in v for v in found), found


def test_the_static_gate_fails_on_a_planted_tree(tmp_path) -> None:
    """What `make check` runs, on a copy with a pure module importing an adapter: the run fails and says why."""
    root = _copy(tmp_path)
    _plant(root, "controller.status", "from controller import kubeapi  # noqa: E402,F401")
    env = {**os.environ, "CB_LAYERS_ROOT": str(root)}
    env.pop("CI", None)
    cp = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                         "-k", "not planted and not finds"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)
    assert cp.returncode == 1, cp.stdout
    assert "controller.status imports controller.kubeapi" in cp.stdout, cp.stdout
