"""Benchmark: the controller's API requests for egress Services on one ProxyGroup, as the group grows.

    .venv/bin/python -m bench.pgrequests [--services 1000] [--anchor 10]

The reconciler's passes (controller.reconcile, the same code the controller runs) against the in-memory API
server of the unit tests (tests/support/fakekube.py, which records every call) and a control plane that
mints keys in memory: no network, no root. A ProxyGroup of 2 whose replicas are registered and running; then
`--services` egress Services are added one by one (each one's pass), replica 0 reports them all as the agent
would, and the group's pass lists it in every EndpointSlice. With that many present, it counts the requests of:

1. adding one more Service (its pass),
2. a replica reporting the new Service's rules (the group's pass, which brings every EndpointSlice of the
   group to what the replicas report),
3. a second pass of each that finds nothing to do,
4. removing the Service (annotation deleted: its pass).

The same is measured with `--anchor` Services present, in the same run; the goal is that each count is the
same at both sizes (the passes stay proportional to what changed), i.e. a ratio of 1.00. Requests are counted
by verb: reads (GET, LIST) and writes (POST, PATCH, DELETE). The size of the group's `egress-services`
document is printed too (a ConfigMap holds at most 1 MiB).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
from collections import Counter
from typing import Any, cast

from controller.config import ControllerConfig
from controller.kubeapi import CONFIGMAPS, PODS, PROXYGROUPS, SECRETS, SERVICES, STATEFULSETS
from controller.passes.proxygroup import group_labels
from controller.reconcile import Reconciler
from tests.support.fakekube import FakeKube, FakeProvider

CFG = ControllerConfig(namespace="tailscale", proxy_image="proxy:1", login_server="http://hs.test:8080")
NS = "tailscale"
PG = "pg"


def _svc(i: int) -> dict:
    return {"metadata": {"name": f"s{i}", "namespace": "apps", "annotations": {
        "tailscale.com/proxy-group": PG, "tailscale.com/tailnet-ip": f"100.64.{i // 250}.{i % 250 + 1}"}},
        "spec": {"type": "ExternalName", "externalName": "placeholder",
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}}


def _must(obj: dict | None) -> dict:
    assert obj is not None
    return obj


class World:
    def __init__(self) -> None:
        self.kube, self.prov = FakeKube(), FakeProvider()
        self.rec = Reconciler(cast(Any, self.kube), self.prov, CFG, now=lambda: "2026-01-01T00:00:00Z")
        self.status: dict = {"podIPv4": "10.0.0.1", "podIPv6": "", "services": {}}

    async def setup(self) -> None:
        k = self.kube
        k.put(PROXYGROUPS, {"metadata": {"name": PG, "uid": "pg-uid", "generation": 1},
                            "spec": {"type": "egress", "replicas": 2}})
        await self.rec.reconcile("proxygroup", "", PG)
        for i in range(2):
            s = _must(k.obj(SECRETS, f"{PG}-{i}", NS))
            s["data"] = {key: base64.b64encode(v).decode() for key, v in {
                "device_id": str(11 + i).encode(), "device_fqdn": f"{PG}-{i}.ts.net.".encode(),
                "device_ips": b'["100.64.9.1"]'}.items()}
            self.prov.tags[str(11 + i)] = ("tag:k8s",)
            k.put(PODS, {"metadata": {"name": f"{PG}-{i}", "namespace": NS, "labels": group_labels(PG)},
                         "status": {"phase": "Running", "podIPs": [{"ip": f"10.0.0.{i + 1}"}],
                                    "conditions": [{"type": "Ready", "status": "True"}]}})
        k.objects[("statefulsets", NS, PG)]["status"] = {"readyReplicas": 2}
        await self.rec.reconcile("proxygroup", "", PG)

    def report(self, i: int) -> None:
        """Replica 0 applies what the ConfigMap says about s<i> and records it, as the agent does."""
        entries = json.loads(_must(self.kube.obj(CONFIGMAPS, f"{PG}-egress-config", NS))["data"]["egress-services"])
        name = f"apps-s{i}"
        if name in entries:
            e = entries[name]
            self.status["services"][name] = {"tailnetTarget": {"ip": e["tailnetTarget"].get("ip", ""), "fqdn": ""},
                                             "ports": e["ports"], "tailnetTargetIPs": [e["tailnetTarget"]["ip"]]}
        else:
            self.status["services"].pop(name, None)
        s = _must(self.kube.obj(SECRETS, f"{PG}-0", NS))
        s["data"]["egress-services"] = base64.b64encode(json.dumps(self.status).encode()).decode()

    async def add(self, i: int) -> None:
        self.kube.put(SERVICES, _svc(i))
        await self.rec.reconcile("svc", "apps", f"s{i}")

    async def counted(self, coro) -> Counter:
        before = len(self.kube.calls)
        await coro
        return Counter(c[0] for c in self.kube.calls[before:])


def _fmt(c: Counter) -> str:
    reads, writes = c["GET"] + c["LIST"], c["POST"] + c["PATCH"] + c["DELETE"]
    return f"{reads:3d} reads, {writes:2d} writes ({', '.join(f'{k} {v}' for k, v in sorted(c.items()))})"


async def measure(n: int) -> dict[str, Counter]:
    w = World()
    await w.setup()
    for i in range(n):
        await w.add(i)
    for i in range(n):
        w.report(i)
    await w.rec.reconcile("proxygroup", "", PG)
    out: dict[str, Counter] = {}
    w.kube.put(SERVICES, _svc(n))
    out["add one Service (its pass)"] = await w.counted(w.rec.reconcile("svc", "apps", f"s{n}"))
    w.report(n)
    out["a replica reports it (the group's pass)"] = await w.counted(w.rec.reconcile("proxygroup", "", PG))
    out["the Service's pass again (no change)"] = await w.counted(w.rec.reconcile("svc", "apps", f"s{n}"))
    out["the group's pass again (no change)"] = await w.counted(w.rec.reconcile("proxygroup", "", PG))
    w.kube.objects[("services", "apps", f"s{n}")]["metadata"]["annotations"] = {}
    out["remove it (annotations deleted: its pass)"] = await w.counted(w.rec.reconcile("svc", "apps", f"s{n}"))
    doc = _must(w.kube.obj(CONFIGMAPS, f"{PG}-egress-config", NS))["data"]["egress-services"]
    out["_size"] = Counter({"bytes": len(doc)})
    assert w.kube.obj(STATEFULSETS, PG, NS) is not None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pgrequests", description=__doc__.split("\n\n")[0])
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--anchor", type=int, default=10)
    ap.add_argument("--record", action="store_true", help="write bench/results/pgrequests.json (bench/README.md)")
    a = ap.parse_args(argv)
    anchor = asyncio.run(measure(a.anchor))
    big = asyncio.run(measure(a.services))
    print(f"API requests with {a.anchor} (anchor) and {a.services} egress Services on one ProxyGroup of 2")
    for step in (k for k in big if not k.startswith("_")):
        na, nb = sum(anchor[step].values()), sum(big[step].values())
        print(f"  {step}:\n    {a.anchor:5d}: {_fmt(anchor[step])}\n    {a.services:5d}: {_fmt(big[step])}"
              f"\n    ratio {nb / na if na else float('nan'):.2f}")
    size = big["_size"]["bytes"]
    print(f"egress-services with {a.services + 0} Services: {size} bytes ({size / a.services:.0f} per Service; a "
          f"ConfigMap holds about {int(1024 * 1024 / (size / a.services))})")
    from bench.results import Results, Table, record

    def rw(c: Counter) -> tuple[int, int]:
        return c["GET"] + c["LIST"], c["POST"] + c["PATCH"] + c["DELETE"]

    rows = []
    for step in (k for k in big if not k.startswith("_")):
        na, nb = sum(anchor[step].values()), sum(big[step].values())
        rows.append([step, *rw(big[step]), f"{nb / na:.2f}" if na else "-"])
    rows.append(["the `egress-services` document, per Service", f"{size / a.services:.0f} bytes", "", ""])
    table = Table.of([f"with {a.services:,} egress Services on one ProxyGroup", "reads", "writes",
                      f"ratio to {a.anchor} present"], rows)
    command = "python -m bench.pgrequests" + (f" --services {a.services}" if a.services != 1000 else "")
    record(Results("pgrequests", command, "the reconciler's passes against the unit tests' in-memory API server "
                   "(request counts do not depend on the machine)", {"main": table}), a.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
