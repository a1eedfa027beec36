"""Every sleep in the test code says why it is not a wait (tests/test_sleepcheck.py, `make check`).

A test that sleeps a fixed time and then asserts is a bet on the machine's speed: on a loaded machine the
thing has not happened yet (a flaky failure), and a "nothing happens within N s" check proves nothing when
the system did not get its turn in those N s (a green that means nothing). So a test waits for the event
itself (`labtools.lab.wait_until`, `tests.support.waits.until`, an asyncio Event the code under test sets, a
log line, a counter in /metrics or /status), and a "nothing happens" check first waits for an event that
proves the system had its chance (one more completed reconcile pass, loop iteration or heartbeat after the
trigger), then asserts.

What stays is a sleep that is no wait, marked on its line or on the comment line just above it:

- `# not a wait: <why>`: part of the scenario (holding a connection open while a fault is active, pacing a
  load generator or a probe, a fake program that must stay alive, a simulated slow peer);
- `# poll: <what>`: the interval of a loop that re-checks a condition until its deadline (the loop is the
  wait; the sleep only spaces the checks).

The scan reads the source lines of tests/ and netns-tests/, programs embedded in strings included (the fake
binaries and the lab's helper programs are test code too). It counts the calls of time's and asyncio's sleep
and of a bare `sleep`; a fake clock's method (`clock.sleep`) and the definition of one are not sleeps. The
check's own test is left out (its samples lack a reason on purpose). `python -m tests.support.sleepcheck` lists
them all with their reasons.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: the directories whose Python files are test code
TEST_DIRS = ("tests", "netns-tests")
#: the check's own test, whose samples are sleeps without a reason on purpose
OWN_TEST = "tests/test_sleepcheck.py"

#: a call, also one in a program written as a one-line string ("...\ntime.sleep(1)\n")
_SLEEP = re.compile(r"(?:(?<![\w.])|(?<=\\n))(?:time\.|asyncio\.)?sleep\(")
_DEF = re.compile(r"\bdef\s+sleep\(")
_MARK = re.compile(r"#\s*(not a wait|poll):\s*(\S.{4,})")
#: a justification may also sit on the comment lines just above the sleep
_ABOVE = 2


@dataclass(frozen=True)
class Sleep:
    """One sleep in the test code and, when it has one, the reason it is not a wait."""
    path: str                 # relative to the repository
    line: int
    code: str
    kind: str = ""            # "not a wait" or "poll"; "" when the line has no justification
    why: str = ""


def _justification(lines: list[str], i: int) -> tuple[str, str]:
    m = _MARK.search(lines[i])
    if m:
        return m.group(1), m.group(2).strip()
    for j in range(i - 1, max(-1, i - 1 - _ABOVE), -1):
        text = lines[j].strip()
        if not text.startswith("#"):
            break
        if m := _MARK.search(text):
            return m.group(1), m.group(2).strip()
    return "", ""


def scan_text(path: str, text: str) -> list[Sleep]:
    """The sleeps in one file's text."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0]          # a sleep named in a comment is no sleep
        if not _SLEEP.search(code) or _DEF.search(code):
            continue
        kind, why = _justification(lines, i)
        found.append(Sleep(path, i + 1, line.strip(), kind, why))
    return found


def scan(root: Path = REPO) -> list[Sleep]:
    """Every sleep in the test code under `root`, in path order."""
    found: list[Sleep] = []
    for d in TEST_DIRS:
        for p in sorted((root / d).rglob("*.py")):
            rel = p.relative_to(root)
            if any(part in (".venv", "__pycache__") for part in rel.parts) or str(rel) == OWN_TEST:
                continue
            found += scan_text(str(rel), p.read_text(errors="replace"))
    return found


def unjustified(sleeps: list[Sleep]) -> list[Sleep]:
    return [s for s in sleeps if not s.kind]


def main() -> int:
    sleeps = scan()
    for s in sleeps:
        print(f"{s.path}:{s.line}: {s.kind or 'UNJUSTIFIED'}: {s.why or s.code}")
    bad = unjustified(sleeps)
    by_kind = {k: sum(1 for s in sleeps if s.kind == k) for k in ("not a wait", "poll")}
    print(f"{len(sleeps)} sleeps in the test code: {by_kind['not a wait']} not a wait, {by_kind['poll']} poll "
          f"intervals, {len(bad)} without a reason")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
