"""Skips under CI: every skip is a failure unless the list of expected skips (tests/expected-skips.txt) names it.

A green run of skipped tests says nothing: a missing binary, a manifest not downloaded or a tool not installed
would otherwise turn the tests that need them into skips and the run into a pass. So every run (both suites,
tests/ and netns-tests/, loaded with `-p tests.support.skipcheck` from pyproject.toml) prints its skips with
their reasons, and when `CI` is set (`.ci/run` sets it) a skip that no line of the list matches fails the
run. The list says, for each skip it allows, which test, which reason, and why that skip is right on a CI
machine too (a case that does not apply, never a missing prerequisite).

The list's format, one entry a line (`#` starts a comment line):

    <test id pattern> | <skip reason pattern> | <why this skip is expected under CI>

Both patterns are shell-style (`fnmatch`, `*` any text); the test id is pytest's (`tests/test_x.py::test_y[p]`)
and the reason is the text given to `pytest.skip` or `skipif`. `CB_EXPECTED_SKIPS` names another list (the
checker's own tests use it).
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

LIST = Path(__file__).resolve().parents[1] / "expected-skips.txt"


@dataclass(frozen=True)
class Expected:
    test: str
    reason: str
    why: str
    line: int

    def matches(self, nodeid: str, reason: str) -> bool:
        return fnmatch.fnmatchcase(nodeid, self.test) and fnmatch.fnmatchcase(reason, self.reason)


@dataclass(frozen=True)
class Skip:
    nodeid: str
    reason: str


class ListError(ValueError):
    pass


def parse_list(text: str, source: str) -> tuple[Expected, ...]:
    """The entries of an expected-skips list; a malformed line is an error naming the line and the format."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split("|")]
        if len(parts) != 3 or not all(parts):
            raise ListError(f"{source}:{n}: an expected skip is `<test id pattern> | <reason pattern> | <why it is "
                            f"expected under CI>`, three non-empty fields separated by `|`; got {raw!r}")
        out.append(Expected(parts[0], parts[1], parts[2], n))
    return tuple(out)


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skip was given, without pytest's `Skipped: ` prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def _list_path() -> Path:
    return Path(os.environ.get("CB_EXPECTED_SKIPS") or LIST)


class SkipCheck:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.skips: list[Skip] = []
        path = _list_path()
        self.source = str(path)
        self.expected = parse_list(path.read_text(), self.source) if path.exists() else ()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append(Skip(report.nodeid, skip_reason(report)))

    def _classify(self) -> tuple[list[tuple[Skip, Expected]], list[Skip]]:
        allowed, unexpected = [], []
        for s in self.skips:
            entry = next((e for e in self.expected if e.matches(s.nodeid, s.reason)), None)
            if entry is None:
                unexpected.append(s)
            else:
                allowed.append((s, entry))
        return allowed, unexpected

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.skips:
            return
        allowed, unexpected = self._classify()
        tr = terminalreporter
        tr.section("skips")
        by_entry: dict[Expected, list[Skip]] = {}
        for s, e in allowed:
            by_entry.setdefault(e, []).append(s)
        for e, skips in by_entry.items():
            tr.write_line(f"expected ({len(skips)}) {e.test}: {skips[0].reason} -- {e.why} "
                          f"({Path(self.source).name}:{e.line})")
        for s in unexpected:
            tr.write_line(f"UNEXPECTED {s.nodeid}: {s.reason}")
        if unexpected and os.environ.get("CI"):
            tr.write_line(f"CI is set: {len(unexpected)} skip(s) not in {self.source} fail the run; make the test run "
                          f"(install what it needs) or, for a case that does not apply, add a line saying why",
                          red=True, bold=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(self.config, "workerinput") or not os.environ.get("CI"):
            return      # an xdist worker's reports are counted by the controller, which decides the outcome
        _, unexpected = self._classify()
        if unexpected and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipCheck(config), "cb-skipcheck")
