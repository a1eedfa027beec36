"""Footprint: memory and CPU of this agent against upstream containerboot, measured in the same lab run.

Run as root: `python -m bench.footprint [--runs 5] [--idle-minutes 5] [--firewall nftables|iptables]`.

For each agent (the same L3 ingress configuration as `bench.boot`: `TS_DEST_IP` pointing at the lab's
backend, kernel networking, a fresh node each start):

* boot: `--runs` interleaved starts (after one uncounted warm-up each); per start, the time from process start
  to "Startup complete" (read as the line is
  written, see `bench.logwatch`), the agent process's resident memory (VmRSS) at that moment and the CPU seconds it used
  until then (user + system of the agent process itself; tailscaled and the `tailscale up` CLI are the same
  binaries for both agents and are not counted);
* idle: one more start per agent, both at once (upstream's in a second lab), left alone for `--idle-minutes`:
  RSS at the end and CPU seconds per idle minute (from 5 s after start-up to the end).

Prints both agents side by side with the ratios (the boot time also with its spread, min-max), the goals as
MET / NOT MET (resident memory at most 24 MB at start-up and idle, idle CPU at most upstream's + 1 s per hour, boot
no slower than upstream's), and where this agent's memory goes for the same configuration, stage by stage
(`bench.importstages`: the interpreter, asyncio, the settings, the agent's modules, the firewall's, the
conntrack clean-up's; each after malloc_trim, with the packages it loaded). Also the part of the boot that is
the agent's own after login: from tailscaled's "-> Running" log line (tailscaled writes to the agent's output)
to "Startup complete", both read as written; the rest of a boot is tailscaled's and headscale's (see
bench/README.md). No asserts: figures are for people to read.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench import importstages, results
from bench.logwatch import LogWatch
from labtools.lab import AgentProcess, Lab, ensure_binaries

MARK = "Startup complete, waiting for shutdown signal"
#: tailscaled's own log line (it shares the agent's output) when the backend reaches Running.
RUNNING = "-> Running (WantRunning="
TICK = os.sysconf("SC_CLK_TCK")
SETTLE = 5.0    # seconds after start-up before the idle window starts


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process itself (children not included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK   # utime, stime (fields 14 and 15 of stat)


def start(lab: Lab, cmd: list[str] | None, env: dict[str, str], marker: str) -> tuple[AgentProcess, dict]:
    """Start one agent, wait for start-up; returns it (still running) and its boot sample."""
    agent = lab.start_agent(env, cmd)
    try:
        with LogWatch(agent.log_path) as watch:
            seen = watch.wait_for_each(MARK, [RUNNING], 120, agent.running)
    except RuntimeError:
        raise RuntimeError(f"agent exited early:\n{agent.log_text()[-2000:]}") from None
    except TimeoutError:
        raise RuntimeError("no start-up within 120 s") from None
    sample = {"boot_s": seen[MARK] - agent.started, "rss_mb": rss_mb(agent.pid), "cpu_s": cpu_s(agent.pid)}
    if RUNNING in seen:
        sample["after_running_ms"] = (seen[MARK] - seen[RUNNING]) * 1000
    proxy_v4, _ = agent.tailnet_ips()
    lab.wait_curl("client", lab.url(proxy_v4, 8080, "/?footprint"), marker, timeout=30)
    return agent, sample


def stop(lab: Lab, agent: AgentProcess) -> None:
    problems = lab.reset_proxy([agent], [agent.hostname])
    if problems:
        print("teardown:", "; ".join(problems), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="boots per agent (median reported)")
    p.add_argument("--idle-minutes", type=float, default=5.0, help="idle window per agent")
    p.add_argument("--firewall", default="nftables", choices=("nftables", "iptables"))
    p.add_argument("--record", action="store_true", help="write bench/results/footprint.json (docs/benchmarks.md)")
    p.add_argument("--recorded", default="", help="which run and machine, for the results file")
    args = p.parse_args(argv)
    bin_dir = ensure_binaries()
    agents = {"python": None, "upstream": [str(bin_dir / "containerboot")]}
    boots: dict[str, list[dict]] = {k: [] for k in agents}
    idle: dict[str, dict] = {}
    with Lab.create(bin_dir=bin_dir) as lab:
        srv = lab.start_http_server("backend", None, 8080, f"footprint-{lab.prefix}")
        env = {"TS_DEST_IP": lab.backend_ipv4, "TS_DEBUG_FIREWALL_MODE": args.firewall}
        stage_env = {**env, "TS_USERSPACE": "false"}
        for cmd in agents.values():   # warm-up, not counted: page cache, first Python byte-compilation
            stop(lab, start(lab, cmd, env, srv.marker)[0])
        for i in range(args.runs):
            for name, cmd in agents.items():   # interleaved, so drift affects both alike
                agent, sample = start(lab, cmd, env, srv.marker)
                stop(lab, agent)
                boots[name].append(sample)
                print(f"boot {i + 1}: {name:8s} {sample['boot_s']:7.3f} s  RSS {sample['rss_mb']:5.1f} MB  "
                      f"CPU {sample['cpu_s']:5.2f} s  Running->start-up "
                      f"{sample.get('after_running_ms', float('nan')):5.1f} ms", flush=True)
        # Idle: both agents at once, upstream's in a second lab of its own (same binaries, same configuration),
        # so an hour's window costs an hour.
        with Lab.create(bin_dir=bin_dir) as lab2:
            srv2 = lab2.start_http_server("backend", None, 8080, f"footprint-{lab2.prefix}")
            env2 = {**env, "TS_DEST_IP": lab2.backend_ipv4}
            where = {"python": (lab, env, srv.marker), "upstream": (lab2, env2, srv2.marker)}
            running = {name: start(where[name][0], cmd, where[name][1], where[name][2])[0]
                       for name, cmd in agents.items()}
            time.sleep(SETTLE)
            before = {name: (rss_mb(a.pid), cpu_s(a.pid)) for name, a in running.items()}
            t0 = time.monotonic()
            time.sleep(args.idle_minutes * 60)
            minutes = (time.monotonic() - t0) / 60
            for name, agent in running.items():
                rss0, cpu0 = before[name]
                idle[name] = {"rss0": rss0, "rss_mb": rss_mb(agent.pid),
                              "cpu_per_min": (cpu_s(agent.pid) - cpu0) / minutes}
                print(f"idle: {name:8s} RSS {rss0:5.1f} -> {idle[name]['rss_mb']:5.1f} MB over {minutes:.1f} min, "
                      f"CPU {idle[name]['cpu_per_min']:.3f} s/min", flush=True)
                stop(where[name][0], agent)

    def med(name: str, key: str) -> float:
        return statistics.median(s[key] for s in boots[name])

    def spread(name: str, key: str = "boot_s", fmt: str = ".3f") -> str:
        times = [s[key] for s in boots[name] if key in s]
        return f"{min(times):{fmt}}-{max(times):{fmt}}" if times else "-"

    def after_running(name: str) -> float:
        times = [s["after_running_ms"] for s in boots[name] if "after_running_ms" in s]
        return statistics.median(times) if times else float("nan")

    rows = [
        ("RSS after start-up (MB, median)", med("python", "rss_mb"), med("upstream", "rss_mb")),
        (f"RSS after {args.idle_minutes:g} min idle (MB)", idle["python"]["rss_mb"], idle["upstream"]["rss_mb"]),
        ("CPU during boot (s, median)", med("python", "cpu_s"), med("upstream", "cpu_s")),
        ("CPU per idle minute (s)", idle["python"]["cpu_per_min"], idle["upstream"]["cpu_per_min"]),
        (f"boot to 'Startup complete' (s, median of {args.runs})", med("python", "boot_s"),
         med("upstream", "boot_s")),
    ]
    print(f"\nfootprint ({args.firewall}, L3 ingress):")
    print(f"  {'':48s} {'python':>9s} {'upstream':>9s} {'ratio':>7s}")
    for label, py, up in rows:
        ratio = f"{py / up:7.3f}" if up > 0 else "      -"
        print(f"  {label:48s} {py:9.3f} {up:9.3f} {ratio}")
    print(f"  {'boot spread, min-max (s)':48s} {spread('python'):>15s} {spread('upstream'):>15s}")
    print(f"  {'tailscaled Running -> start-up (ms, median)':48s} {after_running('python'):9.1f} "
          f"{after_running('upstream'):9.1f}")
    print(f"  {'  its spread, min-max (ms)':48s} {spread('python', 'after_running_ms', '.1f'):>15s} "
          f"{spread('upstream', 'after_running_ms', '.1f'):>15s}")
    rss = max(med("python", "rss_mb"), idle["python"]["rss_mb"])
    idle_extra_per_hour = (idle["python"]["cpu_per_min"] - idle["upstream"]["cpu_per_min"]) * 60
    boot_ratio = med("python", "boot_s") / med("upstream", "boot_s")
    print("\ngoals (measured, not asserted):")
    print(f"  RSS <= 24 MB:                         {rss:6.1f} MB   {'MET' if rss <= 24 else 'NOT MET'}")
    print(f"  idle CPU <= upstream + 1 s per hour:  {idle_extra_per_hour:+6.2f} s/h  "
          f"{'MET' if idle_extra_per_hour <= 1 else 'NOT MET'}")
    print(f"  boot ratio <= 1.00:                   {boot_ratio:6.4f}      {'MET' if boot_ratio <= 1 else 'NOT MET'}"
          " (boot times read as the line is written)")
    print(f"\nwhere this agent's memory goes ({' '.join(f'{k}={v}' for k, v in stage_env.items())}; "
          "python -m bench.importstages):")
    print(importstages.report(importstages.measure(stage_env)))

    def pair(name: str, key: str, fmt: str, unit: str) -> str:
        vals = [s[key] for s in boots[name] if key in s]
        if not vals:
            return "-"
        return f"{statistics.median(vals):{fmt}} {unit} ({min(vals):{fmt}}-{max(vals):{fmt}})"

    def quot(py: float, up: float, fmt: str) -> str:
        return f"{py / up:{fmt}}" if up > 0 else "-"

    n, mins = args.runs, f"{args.idle_minutes:g}"
    main_table = results.Table.of(["figure", "this agent", "upstream containerboot", "ratio"], [
        [f'resident memory (VmRSS) at "Startup complete" (median of {n})', f"{med('python', 'rss_mb'):.1f} MB",
         f"{med('upstream', 'rss_mb'):.1f} MB", quot(med("python", "rss_mb"), med("upstream", "rss_mb"), ".2f")],
        [f"resident memory after {mins} minutes idle", f"{idle['python']['rss_mb']:.1f} MB",
         f"{idle['upstream']['rss_mb']:.1f} MB", quot(idle["python"]["rss_mb"], idle["upstream"]["rss_mb"], ".2f")],
        [f'CPU seconds from process start to "Startup complete" (median of {n})', f"{med('python', 'cpu_s'):.2f} s",
         f"{med('upstream', 'cpu_s'):.2f} s", quot(med("python", "cpu_s"), med("upstream", "cpu_s"), ".0f")],
        [f"CPU seconds per idle minute (over the {mins} minutes)", f"{idle['python']['cpu_per_min']:.3f} s",
         f"{idle['upstream']['cpu_per_min']:.3f} s", "-"],
        [f'boot to "Startup complete" (median of {n}; min-max)', pair("python", "boot_s", ".3f", "s"),
         pair("upstream", "boot_s", ".3f", "s"), f"{boot_ratio:.3f}"],
        [f"of which after tailscaled's Running (median of {n}; min-max)",
         pair("python", "after_running_ms", ".1f", "ms"), pair("upstream", "after_running_ms", ".1f", "ms"),
         quot(after_running("python"), after_running("upstream"), ".2f")],
    ])
    goals = results.Table.of(["goal", "measured", "verdict"], [
        ["resident memory at most 24 MB", f"{rss:.1f} MB", "MET" if rss <= 24 else "NOT MET"],
        ["idle CPU at most upstream's plus 1 s per hour", f"{idle_extra_per_hour:+.2f} s/h",
         "MET" if idle_extra_per_hour <= 1 else "NOT MET"],
        ["boot no slower than upstream (ratio of medians <= 1.00)", f"{boot_ratio:.3f}",
         "MET" if boot_ratio <= 1 else "NOT MET"],
    ])
    command = f"python -m bench.footprint --runs {n} --idle-minutes {mins}" + (
        f" --firewall {args.firewall}" if args.firewall != "nftables" else "")
    recorded = args.recorded or f"{results.machine()}; L3 ingress, {args.firewall}"
    results.record(results.Results("footprint", command, recorded, {"main": main_table, "goals": goals}),
                   args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
