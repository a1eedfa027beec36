"""A whole suite's run recorded by the run (pytest plugin, loaded by pyproject.toml): with BENCH_RECORD=1, a run
of all of tests/ or all of netns-tests/ writes its row of bench/results/suite.json at its end (its time, its
outcome, its workers, its seed; bench/runs.py) and, for the netns suite, its longest modules. A run of some
modules or tests writes nothing: its figures would not be the suite's.
"""
from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

SUITES = {"tests": "unit", "netns-tests": "netns"}


class SuiteRecord:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.start = time.monotonic()
        self.counts: Counter[str] = Counter()
        self.durations: defaultdict[str, float] = defaultdict(float)

    def suite(self) -> str:
        """"unit" or "netns" when the run's arguments are exactly one whole suite's directory, else ""."""
        args = [a for a in self.config.args if not a.startswith("-")]
        if len(args) != 1:
            return ""
        path = Path(args[0]).resolve()
        root = Path(str(self.config.rootpath)).resolve()
        return SUITES.get(str(path.relative_to(root)), "") if path.parent == root else ""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid.split("::")[0]] += report.duration
        if report.when == "call" or report.outcome != "passed":
            if report.when != "call" and report.outcome == "skipped":
                self.counts["skipped"] += 1
            elif report.when == "call":
                self.counts[report.outcome] += 1
            elif report.outcome == "failed":
                self.counts["errors"] += 1

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(self.config, "workerinput") or os.environ.get("BENCH_RECORD", "") != "1":
            return      # an xdist worker's reports reach the controller, which records the run
        suite = self.suite()
        if not suite:
            return
        from bench import runs
        from tests.support import seed
        workers = int(getattr(self.config.option, "numprocesses", 0) or 0)
        counts = {k: self.counts[k] for k in ("passed", "failed", "errors", "skipped")}
        path = runs.record_suite(suite, workers, time.monotonic() - self.start, counts, seed.run_seed())
        if suite == "netns":
            runs.record_longest(dict(self.durations), seed.run_seed())
        print(f"\nthe suite's figures recorded in {path}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteRecord(config), "suiterecord")
