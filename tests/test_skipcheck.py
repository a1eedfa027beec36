"""Skips under CI (tests/support/skipcheck.py): a skip not in the expected list fails a CI run, an expected one is
printed with its reason, and a missing prerequisite (helm) fails the run instead of skipping its tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.skipcheck import LIST, ListError, parse_list

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = '''
import pytest

def test_runs():
    assert "skip".upper() == "SKIP"   # a sample test that runs and passes

def test_not_here():
    pytest.skip("no frobnicator on this machine")

@pytest.mark.parametrize("n", [1, 2])
def test_case(n):
    if n == 2:
        pytest.skip("case 2 does not apply")
'''


def _pytest(tmp_path: Path, *, ci: bool, expected: str, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "expected.txt").write_text(expected)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(ROOT), CB_EXPECTED_SKIPS=str(tmp_path / "expected.txt"))
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "tests.support.skipcheck", "--rootdir", str(tmp_path), *args, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


ALLOW_CASE = "test_sample.py::test_case[[]2[]] | case * does not apply | the second case is about something else\n"


def test_under_ci_a_skip_not_in_the_list_fails_the_run_and_is_named(tmp_path) -> None:
    cp = _pytest(tmp_path, ci=True, expected=ALLOW_CASE)
    assert cp.returncode == 1, cp.stdout
    assert "UNEXPECTED test_sample.py::test_not_here: no frobnicator on this machine" in cp.stdout
    assert "expected (1) test_sample.py::test_case[[]2[]]: case 2 does not apply -- the second case" in cp.stdout
    assert "1 skip(s) not in" in cp.stdout


def test_under_ci_listed_skips_pass_and_are_printed_with_their_reason(tmp_path) -> None:
    allow_all = ALLOW_CASE + "test_sample.py::test_not_here | no frobnicator* | the sample's own reason\n"
    cp = _pytest(tmp_path, ci=True, expected=allow_all)
    assert cp.returncode == 0, cp.stdout
    assert "expected (1) test_sample.py::test_not_here: no frobnicator on this machine -- the sample" in cp.stdout
    assert "UNEXPECTED" not in cp.stdout


def test_the_reason_must_match_too(tmp_path) -> None:
    """An entry allows one reason: the same test skipping for another reason (a missing tool) still fails."""
    other = "test_sample.py::test_not_here | no widget* | only the widget's absence is expected\n"
    cp = _pytest(tmp_path, ci=True, expected=ALLOW_CASE + other)
    assert cp.returncode == 1 and "UNEXPECTED test_sample.py::test_not_here" in cp.stdout, cp.stdout


def test_without_ci_an_unexpected_skip_is_shown_but_does_not_fail(tmp_path) -> None:
    cp = _pytest(tmp_path, ci=False, expected=ALLOW_CASE)
    assert cp.returncode == 0, cp.stdout
    assert "UNEXPECTED test_sample.py::test_not_here: no frobnicator on this machine" in cp.stdout


def test_a_failing_run_stays_failed_and_xdist_workers_report_to_the_controller(tmp_path) -> None:
    cp = _pytest(tmp_path, ci=True, expected=ALLOW_CASE, args=("-n", "2"))
    assert cp.returncode == 1 and "UNEXPECTED test_sample.py::test_not_here" in cp.stdout, cp.stdout


@pytest.mark.parametrize("line", ["tests/x.py::y | reason", "tests/x.py::y | | why", "a | b | c | d"])
def test_a_malformed_line_is_an_error_naming_the_line_and_the_format(line: str) -> None:
    with pytest.raises(ListError, match=r"list.txt:2: an expected skip is `<test id pattern> \| <reason pattern>"):
        parse_list(f"# comment\n{line}\n", "list.txt")


def test_the_projects_list_parses_and_every_entry_says_why() -> None:
    entries = parse_list(LIST.read_text(), str(LIST))
    assert entries and all(len(e.why) > 20 for e in entries)
    # a prerequisite's absence is never an expected skip
    assert not any(w in e.reason.lower() for e in entries for w in ("not installed", "not built", "cannot be"))


def test_under_ci_without_helm_the_chart_tests_fail_instead_of_skipping(tmp_path) -> None:
    """helm removed (an empty build cache): under CI the chart's tests fail, naming what is missing; without CI
    they skip with the same reason, and the summary calls the skip unexpected."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS")}
    env["CB_CACHE"] = str(tmp_path / "empty-cache")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_helm_chart.py", "-k",
            "test_deploy_is_rendered_from_the_chart_and_up_to_date"]
    ci = subprocess.run(args, cwd=ROOT, env={**env, "CI": "true"}, capture_output=True, text=True, timeout=120)
    assert ci.returncode == 1, ci.stdout
    assert "CI is set, so these tests must run, but helm is not built" in ci.stdout
    local = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert local.returncode == 0, local.stdout
    test = "tests/test_helm_chart.py::test_deploy_is_rendered_from_the_chart_and_up_to_date"
    assert f"UNEXPECTED {test}: helm is not built" in local.stdout
