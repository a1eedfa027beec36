"""Where the agent's resident memory goes, stage by stage, for one configuration (part of `bench.footprint`).

Run: `python -m bench.importstages [VAR=value ...]` (default: the footprint's L3 ingress, `TS_DEST_IP=10.0.0.7
TS_USERSPACE=false`). In a fresh interpreter it takes the agent's start-up steps that cost memory without
starting anything (no tailscaled, no rule written): the interpreter; `containerboot.__main__` (asyncio, without
ssl: containerboot/deferssl.py); the settings; the agent's modules; the firewall backend's modules with
libnftables (a context, no command; iptables' modules with TS_DEBUG_FIREWALL_MODE=iptables); what the steady
state loads for this configuration; last, what the conntrack clean-up loads (pyroute2's conntrack alone), which
the agent does in a forked child that exits when done (netfilter/conntrack.py), so it is not the agent's. After each
stage it returns freed memory to the kernel (malloc_trim, as the agent does after start-up) and prints the
resident memory, the change and the top-level packages that stage loaded; then whether ssl, httpx, certifi,
pyroute2's whole package, dnspython, watchdog and the Kubernetes client were loaded. `--json`: one JSON object.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

_CHILD = r'''
import ctypes, json, os, sys
libc = ctypes.CDLL(None)
def rss():
    libc.malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
stages, seen = [], set(sys.modules)
def stage(name):
    global seen
    new = sorted({m.split(".")[0] for m in set(sys.modules) - seen})
    seen = set(sys.modules)
    stages.append({"stage": name, "rss_mb": rss(), "packages": new})
stage("interpreter")
import containerboot.__main__
stage("containerboot.__main__ (asyncio without ssl)")
from containerboot.settings import load
env = json.loads(sys.argv[1])
settings = load(env, root="/")
stage("settings")
import containerboot.agent
from containerboot.agent import Agent
Agent(settings, env)
import containerboot.reconcile, containerboot.endpoints
stage("agent modules")
if not settings.userspace:
    from netfilter import detect
    if (env.get("TS_DEBUG_FIREWALL_MODE") or "nftables") == "nftables":
        from netfilter import nft
        import nftables
        nftables.Nftables()
        stage("firewall modules and libnftables")
    else:
        from netfilter import iptables
        stage("firewall modules (iptables)")
import containerboot.steady
import containerboot.probes
stage("steady state")
if not settings.userspace:
    from netfilter.conntrack import conntrack_class
    conntrack_class()
    stage("+ conntrack clean-up, in its forked child only")
loaded = set(sys.modules)
print(json.dumps({"stages": stages, "modules": len(loaded),
                  "loaded": {m: m in loaded for m in ("ssl", "httpx", "certifi", "pyroute2.ndb.main", "dns",
                                                      "watchdog", "containerboot.kube")}}))
'''

DEFAULT_ENV = {"TS_DEST_IP": "10.0.0.7", "TS_USERSPACE": "false"}


def measure(env: dict[str, str] | None = None, python: str = sys.executable) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([python, "-c", _CHILD, json.dumps(env or DEFAULT_ENV)], capture_output=True, text=True,
                         timeout=120, cwd=root, env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": root})
    if out.returncode != 0:
        raise RuntimeError(f"import stages failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(result: dict) -> str:
    lines = [f"  {'stage':48s} {'RSS MB':>7s} {'+MB':>6s}  packages loaded"]
    prev = 0.0
    for s in result["stages"]:
        pk = ", ".join(s["packages"][:12]) + (f" (+{len(s['packages']) - 12})" if len(s["packages"]) > 12 else "")
        lines.append(f"  {s['stage']:48s} {s['rss_mb']:7.1f} {s['rss_mb'] - prev:+6.1f}  {pk}")
        prev = s["rss_mb"]
    lines.append(f"  modules loaded: {result['modules']}; "
                 + ", ".join(f"{m} {'LOADED' if v else 'not loaded'}" for m, v in result["loaded"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    as_json = "--json" in argv
    pairs = [a for a in argv if a != "--json"]
    bad = [a for a in pairs if "=" not in a]
    if bad:
        print(f"usage: python -m bench.importstages [VAR=value ...] [--json] (not VAR=value: {bad[0]!r})",
              file=sys.stderr)
        return 2
    env = dict(a.split("=", 1) for a in pairs) if pairs else DEFAULT_ENV
    result = measure(env)
    print(json.dumps(result) if as_json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
