"""The import structure's rules, read from the source (ast), for tests/test_layers.py and `make check`.

Every import counts: at module level, inside functions (a lazy import still ties two modules together) and
under `if TYPE_CHECKING:` (a type-only import is still a dependency a reader must follow, and the way a
circle hides). The rules:

- packages import only the layers below them: `tscommon` nothing of ours; `netfilter`, `serveconfig` and
  `nameserver` only `tscommon`; `containerboot` and `controller` those, never each other; `recorder` (the
  session recorder) `tscommon` and `containerboot` (it runs beside tailscaled as the agent does); the lab's tooling
  (`labtools`, `bench`, `tests`) sits on top and no shipped package imports it;
- a pure module (the list `PURE`: data in, data out, no I/O) imports only pure modules of ours and no library
  that does I/O (`IO_LIBRARIES`); every module whose docstring calls it pure is in the list;
- no circle among modules.
"""
from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

#: which packages of ours each package may import (itself included)
ALLOWED: dict[str, frozenset[str]] = {
    "tscommon": frozenset({"tscommon"}),
    "netfilter": frozenset({"netfilter", "tscommon"}),
    "serveconfig": frozenset({"serveconfig", "tscommon"}),
    "nameserver": frozenset({"nameserver", "tscommon"}),
    "recorder": frozenset({"recorder", "tscommon", "containerboot"}),
    "containerboot": frozenset({"containerboot", "tscommon", "netfilter", "serveconfig", "nameserver"}),
    "controller": frozenset({"controller", "tscommon", "netfilter", "serveconfig", "nameserver"}),
}
#: the lab's tooling: may import anything, imported by no shipped package
TOOLING = ("labtools", "bench", "tests")

#: modules that compute without I/O (no network, files, processes, clock, logging)
PURE: frozenset[str] = frozenset({
    "tscommon.dnsrecords", "tscommon.jsontext", "tscommon.pgcontract", "tscommon.redact", "tscommon.secretcontract",
    "tscommon.tlscert",
    "netfilter.model", "netfilter.plan",
    "serveconfig.model", "serveconfig.status",
    "nameserver.answer", "nameserver.records",
    "containerboot.apiproxy.apievent", "containerboot.apiproxy.cast", "containerboot.apiproxy.identity",
    "containerboot.apiproxy.recording", "containerboot.apiproxy.streams",
    "containerboot.desired", "containerboot.kube.secretstate",
    "containerboot.login", "containerboot.proxyservices", "containerboot.reachability", "containerboot.settings",
    "containerboot.state", "containerboot.status",
    "controller.adoption", "controller.config", "controller.kindfacts", "controller.kindtable", "controller.kinds",
    "controller.resources",
    "controller.kinds.apiserverproxy", "controller.kinds.connector", "controller.kinds.dnsconfig",
    "controller.kinds.egress", "controller.kinds.ingress", "controller.kinds.proxyclass",
    "controller.kinds.proxygroup", "controller.kinds.recorder", "controller.kinds.service", "controller.kinds.tailnet",
    "controller.model", "controller.pgrender", "controller.podsecurity", "controller.providers.hscompat",
    "controller.proxyrbac", "controller.replicahealth",
    "controller.render", "controller.sameness", "controller.status", "controller.validation",
})

#: libraries that talk to the world (network, files, processes, kernel, clock, logs)
IO_LIBRARIES = frozenset({
    "os", "sys", "io", "socket", "ssl", "select", "selectors", "subprocess", "signal", "threading", "asyncio",
    "multiprocessing", "shutil", "tempfile", "pathlib", "time", "logging", "ctypes", "http.client",
    "http.server", "urllib.request",
    "httpx", "h11", "aiohttp", "kopf", "pyroute2", "nftables",
})

#: the only imports of I/O a pure module keeps, each with the reason
PURE_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("containerboot.settings", "containerboot.conffile"):
        "validation checks that the tailscaled config file the settings name exists and parses, as upstream "
        "does when it reads its environment",
    ("containerboot.settings", "sys"): "`python -m containerboot.settings` prints the variable reference",
}

_SAYS_PURE = re.compile(r"\bpure\b", re.I)
_SAYS_SHELL = re.compile(r"\((adapter|shell)\b|\bshell\b", re.I)


def is_io(library: str) -> bool:
    parts = library.split(".")
    return any(".".join(parts[:n]) in IO_LIBRARIES for n in range(1, len(parts) + 1))


@dataclass(frozen=True)
class Import:
    source: str        # the importing module
    target: str        # a module of ours, or a library's module
    line: int
    type_checking: bool


def product_packages(root: Path) -> list[str]:
    conf = tomllib.loads((root / "pyproject.toml").read_text())
    return [p.rstrip("*") for p in conf["tool"]["setuptools"]["packages"]["find"]["include"]]


def modules(root: Path, packages: list[str]) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def imports(name: str, path: Path, known: set[str]) -> list[Import]:
    """Every import of the module: a module of ours, or a library's module, by its full name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def add(mod: str, line: int, tc: bool, names: list[str]) -> None:
        ours = [m for m in [mod, *(f"{mod}.{n}" for n in names)] if m in known]
        if ours:
            found.extend(Import(name, m, line, tc) for m in ours if m != name)
        elif mod and mod.split(".")[0] not in {k.split(".")[0] for k in known}:
            found.append(Import(name, mod, line, tc))

    def visit(node: ast.AST, tc: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_tc = tc
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    visit_stmt(sub, True)
                for sub in child.orelse:
                    visit_stmt(sub, tc)
                continue
            visit_stmt(child, child_tc)

    def visit_stmt(child: ast.AST, tc: bool) -> None:
        if isinstance(child, ast.Import):
            for a in child.names:
                add(a.name, child.lineno, tc, [])
        elif isinstance(child, ast.ImportFrom):
            base = package
            for _ in range(max(0, child.level - 1)):
                base = base.rpartition(".")[0]
            mod = (f"{base}.{child.module}" if child.module else base) if child.level else (child.module or "")
            if mod != "__future__":
                add(mod, child.lineno, tc, [a.name for a in child.names])
        visit(child, tc)

    visit(ast.parse(path.read_text()), False)
    return found


def _is_empty_package(path: Path) -> bool:
    """A package `__init__` with nothing but its docstring: importing it imports nothing."""
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and all(
        isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) or
        isinstance(s, ast.ImportFrom) and s.module == "__future__" for s in body)


@dataclass(frozen=True)
class Tree:
    root: Path
    product: tuple[str, ...]
    paths: dict[str, Path]
    edges: tuple[Import, ...]

    @classmethod
    def read(cls, root: Path) -> Tree:
        product = product_packages(root)
        scanned = product + [t for t in TOOLING if (root / t).is_dir()]
        paths = modules(root, scanned)
        known = set(paths)
        edges = tuple(i for name, path in paths.items() for i in imports(name, path, known))
        return cls(root, tuple(product), paths, edges)

    def ours(self, module: str) -> bool:
        return module in self.paths

    def graph(self) -> dict[str, set[str]]:
        g: dict[str, set[str]] = {n: set() for n in self.paths if n.split(".")[0] in self.product}
        for e in self.edges:
            if e.source in g and e.target in g:
                g[e.source].add(e.target)
        return g


def _where(tree: Tree, i: Import) -> str:
    tc = " (under TYPE_CHECKING)" if i.type_checking else ""
    return f"{tree.paths[i.source].relative_to(tree.root)}:{i.line}: {i.source} imports {i.target}{tc}"


def layer_violations(tree: Tree) -> list[str]:
    out = []
    for i in tree.edges:
        src_pkg = i.source.split(".")[0]
        if src_pkg not in tree.product:
            continue
        if i.target.split(".")[0] in TOOLING:
            out.append(f"{_where(tree, i)}: the lab's tooling sits on top; no shipped package imports it")
            continue
        if not tree.ours(i.target):
            continue
        allowed = ALLOWED.get(src_pkg)
        if allowed is None:
            out.append(f"{src_pkg} is shipped but has no place in tests/support/layers.py ALLOWED")
        elif i.target.split(".")[0] not in allowed:
            out.append(f"{_where(tree, i)}: {src_pkg} may import only {', '.join(sorted(allowed))}")
    return sorted(set(out))


def pure_violations(tree: Tree) -> list[str]:
    out = []
    for i in tree.edges:
        if i.source not in PURE or (i.source, i.target) in PURE_EXCEPTIONS:
            continue
        if tree.ours(i.target):
            if i.target not in PURE and not _is_empty_package(tree.paths[i.target]):
                out.append(f"{_where(tree, i)}: a pure module imports only pure modules ({i.target} is not)")
        elif is_io(i.target):
            out.append(f"{_where(tree, i)}: a pure module does no I/O ({i.target} does)")
    return sorted(out)


def pure_list_problems(tree: Tree) -> list[str]:
    """Modules whose docstring calls them pure but the list does not name, list entries that do not exist, and
    exceptions no longer needed."""
    out = [f"{m} is in PURE but there is no such module" for m in sorted(PURE) if m not in tree.paths]
    for name, path in tree.paths.items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.split("\n\n")[0]
        if (name.split(".")[0] in tree.product and _SAYS_PURE.search(first) and not _SAYS_SHELL.search(first)
                and name not in PURE and not _is_empty_package(path)):
            out.append(f"{name}: its docstring says it is pure; add it to PURE in tests/support/layers.py")
    used = {(i.source, i.target) for i in tree.edges}
    out += [f"the exception {k} is no longer needed: remove it" for k in PURE_EXCEPTIONS if k not in used]
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out
