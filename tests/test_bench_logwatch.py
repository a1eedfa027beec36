"""bench.logwatch: the benchmarks' clock for "Startup complete" (the time a line is written to a log file)."""
from __future__ import annotations

import threading
import time

import pytest

from bench.logwatch import LogWatch


def test_finds_a_line_written_later_and_split_across_writes(tmp_path):
    log = tmp_path / "agent.log"
    log.write_bytes(b"boot: starting\n")
    written: list[float] = []

    def writer() -> None:
        with open(log, "ab", buffering=0) as f:
            f.write(b"boot: Startup compl")
            time.sleep(0.2)   # not a wait: the line arrives in two writes, apart
            written.append(time.monotonic())
            f.write(b"ete, waiting for shutdown signal\n")

    with LogWatch(log) as watch:
        t = threading.Thread(target=writer)
        t.start()
        seen = watch.wait_for("Startup complete, waiting for shutdown signal", 10)
        t.join()
    assert seen >= written[0], "reported before the line's second half was written"


def test_text_already_there_is_found_at_once(tmp_path):
    log = tmp_path / "agent.log"
    log.write_text("boot: Startup complete, waiting for shutdown signal\n")
    with LogWatch(log) as watch:
        assert watch.wait_for("Startup complete", 10) <= time.monotonic()


def test_writer_gone_and_timeout_are_reported(tmp_path):
    log = tmp_path / "agent.log"
    log.write_text("boot: Starting tailscaled\n")
    with LogWatch(log) as watch:
        with pytest.raises(RuntimeError, match="exited before logging"):
            watch.wait_for("Startup complete", 10, alive=lambda: False)
        with pytest.raises(TimeoutError):
            watch.wait_for("Startup complete", 0.2)


def test_each_text_gets_the_time_of_the_read_that_brought_it(tmp_path):
    log = tmp_path / "agent.log"
    log.write_bytes(b"")
    running = "Switching ipn state Starting -> Running (WantRunning=true"
    mark = "Startup complete, waiting for shutdown signal"
    gate = threading.Event()

    def writer() -> None:
        with open(log, "ab", buffering=0) as f:
            f.write(f"2026/01/01 00:00:00 {running}, nm=true)\n".encode())
            gate.wait(10)
            f.write(f"boot: {mark}\n".encode())

    with LogWatch(log) as watch:
        t = threading.Thread(target=writer)
        t.start()
        with pytest.raises(TimeoutError):     # the Running line alone does not end the wait
            watch.wait_for_each(mark, [running], 0.3)
        gate.set()
        seen = watch.wait_for_each(mark, [running], 10)
        t.join()
    assert seen[running] < seen[mark]


def test_a_text_that_never_came_is_left_out(tmp_path):
    log = tmp_path / "agent.log"
    log.write_text("boot: Startup complete, waiting for shutdown signal\n")
    with LogWatch(log) as watch:
        assert list(watch.wait_for_each("Startup complete", ["-> Running ("], 10)) == ["Startup complete"]
