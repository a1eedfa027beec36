"""One seed per test run for every sampled search: the generated inputs of the property tests (hypothesis), the
crash point `make test` tries after boot, the hostile API server's faults. A fixed sample would check the same
few cases on every run; a seed that changes with each run covers more over time, and printing it keeps any
failure reproducible: `CB_SEED=<the printed number> make test` (or pytest) replays the same samples.

Loaded into both suites by pyproject.toml (`-p tests.support.seed`). The seed is `CB_SEED` when set, else a
new random one, put into the environment so that pytest-xdist's workers and the processes the tests start
share it; `--hypothesis-seed` still wins for hypothesis.
"""
from __future__ import annotations

import os
import random
import secrets

import pytest

VARIABLE = "CB_SEED"


def run_seed() -> int:
    """This run's seed (a new one when none was chosen: outside pytest, e.g. a bench script)."""
    if not os.environ.get(VARIABLE, "").strip():
        os.environ[VARIABLE] = str(secrets.randbelow(2**32))
    try:
        return int(os.environ[VARIABLE])
    except ValueError:
        raise pytest.UsageError(f"{VARIABLE}={os.environ[VARIABLE]!r} is not a number; set it to the seed a run "
                                f"printed (`{VARIABLE}=1234`), or unset it for a new one") from None


def rng(purpose: str) -> random.Random:
    """A generator for one sampled search, from this run's seed and the search's name (two searches in one run
    do not draw the same numbers)."""
    return random.Random(f"{run_seed()}:{purpose}")


def pytest_configure(config: pytest.Config) -> None:
    seed = run_seed()
    if config.getoption("hypothesis_seed", None) is None:
        from hypothesis import core
        core.global_force_seed = seed


def pytest_report_header(config: pytest.Config) -> str:
    return (f"{VARIABLE}={run_seed()}: this run's sample (generated inputs, crash points, faults); "
            f"set {VARIABLE} to repeat it")
