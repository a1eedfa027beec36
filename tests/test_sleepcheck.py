"""Every sleep in the test code says why it is not a wait (rules in tests/support/sleepcheck.py; `make check`
runs this file). A new sleep without `# not a wait: <why>` or `# poll: <what>` fails here: wait for the event
instead (docs/lab-and-tests.md, "Waiting in tests")."""
from __future__ import annotations

from pathlib import Path

from tests.support import sleepcheck


def test_every_sleep_in_the_test_code_says_why_it_is_not_a_wait() -> None:
    sleeps = sleepcheck.scan()
    assert any(s.path.startswith("netns-tests/") for s in sleeps), "the scan found no sleep in netns-tests/"
    bad = sleepcheck.unjustified(sleeps)
    assert bad == [], "sleeps without a reason (wait for the event, or say why it is no wait):\n" + "\n".join(
        f"{s.path}:{s.line}: {s.code}" for s in bad)


def test_the_scan_tells_a_sleep_with_a_reason_from_one_without() -> None:
    text = "\n".join([
        "import asyncio, time",
        "time.sleep(1)",                                          # 2: no reason
        "await asyncio.sleep(0.1)   # poll: until the file is there",
        "# not a wait: the scenario holds the connection open",
        "sleep(5)",                                               # 5: reason on the line above
        "clock.sleep(3)",                                         # a fake clock: not counted
        "async def sleep(d): ...",                                # a definition: not counted
        "# time.sleep(9) was here",                               # a comment: not counted
        'PROG = "import time\\ntime.sleep(600)\\n"',              # 9: a program in a string, no reason
        "time.sleep(2)   # poll:",                                # 10: a marker without a reason
    ])
    found = {s.line: s for s in sleepcheck.scan_text("t.py", text)}
    assert sorted(found) == [2, 3, 5, 9, 10]
    assert [s.line for s in sleepcheck.unjustified(list(found.values()))] == [2, 9, 10]
    assert (found[3].kind, found[3].why) == ("poll", "until the file is there")
    assert (found[5].kind, found[5].why) == ("not a wait", "the scenario holds the connection open")


def test_a_planted_sleep_fails_the_scan(tmp_path: Path) -> None:
    for d in sleepcheck.TEST_DIRS:
        (tmp_path / d).mkdir()
    (tmp_path / "netns-tests" / "test_planted.py").write_text(
        "import time\n\ndef test_x():\n    time.sleep(3)\n    assert True\n")
    bad = sleepcheck.unjustified(sleepcheck.scan(tmp_path))
    assert [(s.path, s.line) for s in bad] == [("netns-tests/test_planted.py", 4)]
