"""The figures test runs write themselves: the outages, the controller under a hostile API server, the suites.

Each run formats what it measured into the row (or column) the docs show and records it in
bench/results/<bench>.json (bench/results.py: atomically, replacing only that run's row or column), with the
run's seed and the sample it drew in its `run` cell, so that `make figures` renders what the runs wrote and a
figure can be replayed (`CB_SEED=<n>`). Recorded only when asked: BENCH_RECORD=1, which `make outages` and
`make hostile` set (`BENCH_RECORD=1 make test` records the suite's rows and its 20 s outages); a run without
it prints its figures and leaves the committed ones alone. A recording into bench/results/ renders the docs'
figure blocks at once (`make figures`), so the docs and the files agree while the rest of the suite runs.
"""
from __future__ import annotations

import datetime
import os
import pathlib
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from bench.results import RESULTS, record_column, record_row, record_table, wanted

#: the outages' table (docs/reliability.md)
OUTAGE_COLUMNS = ("outage", "length", "probes / failed", "longest gap: new connections / held connection",
                  "`/status` showed it after", "recovery", "run")
OUTAGE_NAMES = {"headscale": "headscale down", "dns": "DNS down", "apiserver": "the API server down, agent",
                "apiserver-controller": "the API server down, controller"}
OUTAGE_COMMAND = "make test (20 s outages), make outages (300 s)"
#: the suites' table (docs/lab-and-tests.md)
SUITE_COLUMNS = ("suite", "time", "tests", "run")
SUITE_COMMAND = "BENCH_RECORD=1 make test (each suite's row written at its end)"
HOSTILE_COMMAND = "make test (60 and 30 Services), make hostile (500)"
#: what every run-written file says of its runs: each row or column names its own
RECORDED = "each figure from the run its `run` cell names (a 2-core machine shared with other work: upper bounds)"


def _rendered(path: pathlib.Path | None) -> pathlib.Path | None:
    """The docs' figure blocks rendered again after a recording into bench/results/ (not a test's own root)."""
    if path is not None and path.parent == RESULTS:
        script = RESULTS.parent.parent / "scripts" / "render_figures.py"
        subprocess.run([sys.executable, str(script), "--write"], check=True, stdout=subprocess.DEVNULL)
    return path


def run_label(seed: int | None, sample: str = "", load: float | None = None) -> str:
    """The `run` cell: the day, the seed and what it drew, the machine and its load."""
    load = os.getloadavg()[0] if load is None else load
    parts = [datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")]
    if seed is not None:
        parts.append(f"CB_SEED={seed}" + (f" ({sample})" if sample else ""))
    parts.append(f"{os.cpu_count()} cores, load {load:.1f}")
    return ", ".join(parts)


def _s(v: Any) -> str:
    return "?" if v is None else f"{v:g} s"


def outage_row(f: Mapping[str, Any], run: str) -> list[str]:
    """One outage's figures (the dict netns-tests/test_outages.py and test_controller_apiserver.py report) as
    its row."""
    kind = f["outage"]
    length = f"{f['seconds']:g} s"
    name = OUTAGE_NAMES[kind]
    if kind == "apiserver-controller":
        return [name, length, "(no data path)", "", f"{f['log_lines_during_outage']} log lines during the outage",
                f"a Service created after the return had its proxy {_s(f['created_after_return_reconciled_s'])} "
                f"later, the Service changed before the outage converged {_s(f['changed_before_outage_converged_s'])}"
                f" (the API server's start: {_s(f['apiserver_start_s'])})", run]
    probes = f"{f['probes']} / {f['failed_probes']}"
    gaps = f"{_s(f['data_path_gap_s'])} / {_s(f['held_connection_gap_s'])}"
    if kind == "headscale":
        shown = _s(f.get("status_shown_after_s"))
        recovery = (f"online at headscale {_s(f['recovery_s'])}; `control_plane` reachable "
                    f"{_s(f['status_recovery_s'])}")
    elif kind == "dns":
        shown = "(the target's `last_error`)"
        recovery = f"{_s(f['recovery_s'])} until the error cleared"
    else:
        shown = _s(f.get("status_shown_after_s"))
        recovery = (f"the device rename in the Secret {_s(f['secret_write_landed_s'])}; `kubernetes_api` reachable "
                    f"{_s(f['status_recovery_s'])} (the API server's start: {_s(f['apiserver_start_s'])})")
    return [name, length, probes, gaps, shown, recovery, run]


def record_outage(figures: Mapping[str, Any], root: pathlib.Path = RESULTS) -> pathlib.Path | None:
    """The outage's row in outages.json (replacing the one of the same outage and length), when asked."""
    if not wanted(False):
        return None
    sample = f"the outage {figures['onset_s']:g} s later than the earliest" if figures.get("onset_s") is not None \
        else ""
    run = run_label(figures.get("seed"), sample)
    return _rendered(record_row("outages", "main", OUTAGE_COLUMNS, outage_row(figures, run), key=2,
                                command=OUTAGE_COMMAND, recorded=RECORDED, root=root))


def hostile_memory_cells(f: Mapping[str, Any], run: str) -> dict[str, str]:
    """The in-memory hostile run's figures (tests/test_controller_hostile_api.py) as its column's cells."""
    faults = f["faults"]
    return {
        "faults injected": ", ".join(f"{faults[k]} × {k}" for k in ("500", "429", "409") if k in faults)
        + (f", {faults['slow']} slow answers" if "slow" in faults else ""),
        "converged (every Service has its proxy and a Ready condition)":
            f"{f['converged_s']:.1f} s (fault-free: {f['clean_converged_s']:.1f} s)",
        "writes per Service, max / mean":
            f"{f['writes_max']} / {f['writes_mean']:.1f} (fault-free: {f['clean_writes_max']})",
        "reads per Service, max / mean": f"{f['reads_max']} / {f['reads_mean']:.1f}",
        "requests before a 429's Retry-After had passed": str(f["early_after_429"]),
        "writes of a full re-run after convergence": str(f["rerun_writes"]),
        "warning lines": f"{f['warning_lines']} in a run of {f['converged_s']:.0f} s",
        "run": run,
    }


def hostile_apiserver_cells(f: Mapping[str, Any], run: str) -> dict[str, str]:
    """The real API server's hostile run's figures (netns-tests/test_controller_hostile_apiserver.py `figures`)
    as its column's cells."""
    faults = f["faults"]
    lines = f["warning_lines"]
    return {
        "faults injected": ", ".join(f"{n} × {k}" for k, n in sorted(faults.items()))
        + f"; {f['watches_cut']} of {f['watch_requests']} watch streams dropped; {f['webhook_409']} webhook 409s",
        "every Service's proxy (StatefulSet, state Secret)": f"{f['children_s']:.1f} s after the first create",
        "converged: every Service has its loadBalancer addresses and `TailscaleProxyReady` True and the used key "
        "out of every proxy's config": f"{f['converged_s']:.1f} s",
        "writes per Service, max / mean (fault-free: 10, the 8 of a new proxy and 2 once its agent registered)":
            f"{f['writes_per_service_max']} / {f['writes_per_service_mean']:.1f}",
        "reads per Service, max / mean (fault-free: about 23)":
            f"{f['reads_per_service_max']} / {f['reads_per_service_mean']:.1f}",
        "requests before a 429's Retry-After for the same object had passed": str(f["early_after_429"]),
        "writes in the quiet window after convergence (watches still dropped)":
            f"{f['quiet_writes']} in {f['quiet_window_s']:g} s",
        "warning lines (kinds: logger and HTTP status or exception)":
            f"{len(lines)} kinds, {sum(lines.values())} lines in all",
        "run": run,
    }


def record_hostile(table: str, column: str, cells: Mapping[str, str],
                   root: pathlib.Path = RESULTS) -> pathlib.Path | None:
    """One hostile run's column (`memory` or `apiserver`), when asked."""
    if not wanted(False):
        return None
    corner = {"memory": "in memory (`tests/test_controller_hostile_api.py`)",
              "apiserver": "the real API server (`netns-tests/test_controller_hostile_apiserver.py`)"}[table]
    return _rendered(record_column("hostile", table, corner, column, cells, command=HOSTILE_COMMAND,
                                   recorded=RECORDED, root=root))


def suite_row(suite: str, workers: int, seconds: float, counts: Mapping[str, int], run: str) -> list[str]:
    """A whole suite's run (tests/ or netns-tests/) as its row: which suite on how many workers, its time, its
    outcome."""
    how = "one process" if workers == 0 else f"{workers} workers"
    outcome = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    return [f"{suite} tests, {how}", f"{seconds / 60:.1f} minutes" if seconds >= 600 else f"{seconds:.0f} s",
            outcome or "nothing ran", run]


def record_suite(suite: str, workers: int, seconds: float, counts: Mapping[str, int], seed: int | None,
                 root: pathlib.Path = RESULTS) -> pathlib.Path | None:
    if not wanted(False):
        return None
    row = suite_row(suite, workers, seconds, counts, run_label(seed))
    return _rendered(record_row("suite", "main", SUITE_COLUMNS, row, key=1, command=SUITE_COMMAND,
                                recorded=RECORDED, root=root))


def longest_rows(durations: Mapping[str, float], top: int = 4) -> list[list[str]]:
    """The netns suite's longest modules (the sum of their tests' durations), then the rest."""
    ranked = sorted(durations.items(), key=lambda kv: -kv[1])
    rows = [[f"`{pathlib.Path(m).name}`", f"{d / 60:.1f} minutes"] for m, d in ranked[:top]]
    if rest := ranked[top:]:
        rows.append([f"the other {len(rest)}", f"under {rest[0][1] / 60:.1f} minutes each"])
    return rows


def record_longest(durations: Mapping[str, float], seed: int | None,
                   root: pathlib.Path = RESULTS) -> pathlib.Path | None:
    """The netns suite's longest modules, as one run measured them (the whole table: it is one run's)."""
    if not wanted(False):
        return None
    run = run_label(seed)
    return _rendered(record_table("suite", "longest", ("netns module", "its own duration", "run"),
                                  [[*row, run] for row in longest_rows(durations)], command=SUITE_COMMAND,
                                  recorded=RECORDED, root=root))


#: the lab cluster's table (docs/lab-and-tests.md), written by `make demo DEMO_ARGS="--kube --once"`
LABCLUSTER_COLUMNS = ("what", "figure", "run")
LABCLUSTER_COMMAND = "BENCH_RECORD=1 make demo DEMO_ARGS=\"--kube --once\"; bash scripts/install-kubernetes.sh"
CONTROL_PLANE = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd")
NODE = ("kubelet", "kube-proxy", "containerd")


def labcluster_rows(f: Mapping[str, Any], run: str) -> list[list[str]]:
    """The kube demo's figures (labtools/kubedemo.py `run`: the cluster's timings, its components' memory, the
    demo's steps) as the rows it measures (the binaries' cold build is not one of them)."""
    rss: Mapping[str, float] = f["rss_mb"]

    def mem(names: tuple[str, ...]) -> str:
        have = [(n, rss[n]) for n in names if n in rss]
        return ", ".join(f"{n} {v:.0f} MiB" for n, v in have) + f": about {sum(v for _, v in have):.0f} MiB"

    return [
        ["cluster start (empty directory) → control plane ready", f"{f['control_plane_s']:.1f} s", run],
        ["cluster start → Node Ready", f"{f['node_ready_s']:.1f} s (kubelet start → Ready "
                                       f"{f['kubelet_to_ready_s']:.1f} s)", run],
        ["control plane memory (RSS)", mem(CONTROL_PLANE), run],
        ["node memory (RSS)", mem(NODE), run],
        ["`make demo DEMO_ARGS=\"--kube --once\"`, the command to everything torn down",
         f"{f['total_s']:.1f} s (image build check {f['image_s']:.1f} s, cluster start to Node Ready "
         f"{f['node_ready_s']:.1f} s, image import {f['import_s']:.1f} s, the agent's device keys in its Secret "
         f"{f['device_keys_s']:.1f} s after the StatefulSet was applied)", run],
    ]


def record_labcluster(figures: Mapping[str, Any], root: pathlib.Path = RESULTS) -> pathlib.Path | None:
    """The demo's rows of labcluster.json (each replacing its own), when asked."""
    if not wanted(False):
        return None
    path = None
    for row in labcluster_rows(figures, run_label(None)):
        path = record_row("labcluster", "main", LABCLUSTER_COLUMNS, row, key=1, command=LABCLUSTER_COMMAND,
                          recorded=RECORDED, root=root)
    return _rendered(path)
