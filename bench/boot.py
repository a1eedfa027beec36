"""Boot time: process start to "Startup complete", this agent against upstream containerboot, same lab.

Run as root: `python -m bench.boot [--runs N] [--firewall nftables|iptables]`. Each run starts a fresh agent
(new node, new state dir) with `TS_DEST_IP` pointing at the lab's backend, measures the time until the log
line appears (read as it is written, see `bench.logwatch`), checks that traffic flows, stops the agent and
deletes the node. Prints every sample, the median of each agent with its spread (min-max) and their ratio. No
asserts: figures are for people to read.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from bench.logwatch import LogWatch
from labtools.lab import Lab, ensure_binaries

MARK = "Startup complete, waiting for shutdown signal"


def boot_once(lab: Lab, agent_cmd: list[str] | None, env: dict[str, str], marker: str,
              image: str | None = None) -> float:
    """One boot to "Startup complete" (seconds), checked by a curl through the proxy; the proxy is reset after."""
    agent = lab.start_agent(env, agent_cmd, image=image)
    try:
        try:
            with LogWatch(agent.log_path) as watch:
                elapsed = watch.wait_for(MARK, 120, agent.running) - agent.started
        except RuntimeError:
            raise RuntimeError(f"agent exited early:\n{agent.log_text()[-2000:]}") from None
        except TimeoutError:
            raise RuntimeError("no startup within 120 s") from None
        proxy_v4, _ = agent.tailnet_ips()
        lab.wait_curl("client", lab.url(proxy_v4, 8080, "/?bench"), marker, timeout=30)
        return elapsed
    finally:
        problems = lab.reset_proxy([agent], [agent.hostname])
        if problems:
            print("teardown:", "; ".join(problems), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--firewall", default="nftables", choices=("nftables", "iptables"))
    p.add_argument("--record", action="store_true", help="write bench/results/boot.json (docs/benchmarks.md)")
    p.add_argument("--recorded", default="", help="which run and machine, for the results file")
    args = p.parse_args(argv)
    bin_dir = ensure_binaries()
    agents = {"python": None, "upstream": [str(bin_dir / "containerboot")]}
    samples: dict[str, list[float]] = {k: [] for k in agents}
    with Lab.create(bin_dir=bin_dir) as lab:
        srv = lab.start_http_server("backend", None, 8080, f"bench-{lab.prefix}")
        env = {"TS_DEST_IP": lab.backend_ipv4, "TS_DEBUG_FIREWALL_MODE": args.firewall}
        # One warm-up of each, not counted: the first start pays for page cache and Python imports.
        for _name, cmd in agents.items():
            boot_once(lab, cmd, env, srv.marker)
        for i in range(args.runs):
            for name, cmd in agents.items():  # interleaved, so drift affects both alike
                t = boot_once(lab, cmd, env, srv.marker)
                samples[name].append(t)
                print(f"run {i + 1}: {name:8s} {t:7.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\nboot to 'Startup complete' ({args.firewall}, {args.runs} runs each, median):")
    for name, label in (("python", "python agent "), ("upstream", "upstream (Go)")):
        print(f"  {label}     {med[name]:7.3f} s  (min {min(samples[name]):.3f}, max {max(samples[name]):.3f})")
    print(f"  ratio python/upstream = {med['python'] / med['upstream']:.3f}")
    from bench.results import Results, Table, machine, record

    def cell(name: str) -> str:
        return f"{med[name]:.3f} s ({min(samples[name]):.3f}-{max(samples[name]):.3f})"

    table = Table.of(["figure", "this agent", "upstream containerboot", "ratio"], [
        [f'boot to "Startup complete" (median of {args.runs}; min-max)', cell("python"), cell("upstream"),
         f"{med['python'] / med['upstream']:.3f}"]])
    command = f"python -m bench.boot --runs {args.runs}" + (
        f" --firewall {args.firewall}" if args.firewall != "nftables" else "")
    record(Results("boot", command, args.recorded or f"{machine()}; L3 ingress, {args.firewall}",
                   {"main": table}), args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
