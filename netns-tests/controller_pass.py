"""One controller pass, run inside a lab namespace (where headscale and the test API server are reachable).

The parents (Services), StatefulSets and Events live in an in-memory API persisted to a JSON file after each
of its writes, as a real API server keeps what it was told even when the writer dies next
(tests/support/fakekube.py); the proxies' Secrets live in the real test API server (HTTPS, the same one
the agent's Pod uses), and auth keys and device deletion go to the real headscale. Usage:

    python controller_pass.py <state.json> <kind> <namespace> <name>      (env: see main())

prints one JSON line: {"requeue": <seconds or null>, "error": "..."}. Under CB_TEST_CRASH_AT the in-memory
API's writes are crash points too (`kube-write`, as controller.kubeapi.Kube names its own): the pass can be
killed before any write, to the in-memory API, the test API server or headscale.
"""
from __future__ import annotations

import asyncio
import json
import os
import ssl
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from controller.config import ControllerConfig
from controller.kubeapi import Kube, KubeClient, Resource
from controller.providers.headscale import HeadscaleProvider
from controller.reconcile import Reconciler
from tests.support.fakekube import FakeKube
from tscommon import crashpoint

T = TypeVar("T")


class Split:
    """Secrets over HTTP to the real test API server, everything else in memory (saved after each write). It is a
    `controller.kubeapi.KubeClient`, as tests/test_kube_client_protocol.py checks (a method the passes call and
    this lacks would fail only here, in a real-cluster run)."""

    def __init__(self, http: Kube, fake: FakeKube, state: str) -> None:
        self.http, self.fake, self.state = http, fake, state

    def _c(self, res: Resource) -> KubeClient:
        return self.http if res.plural == "secrets" else self.fake

    async def _write(self, res: Resource, call: Callable[[KubeClient], Awaitable[T]]) -> T:
        if res.plural == "secrets":
            return await call(self.http)
        crashpoint.hit(crashpoint.KUBE_WRITE)
        try:
            return await call(self.fake)
        finally:
            save(self.state, self.fake)

    async def get(self, res: Resource, name: str, namespace: str = "") -> dict | None:
        return await self._c(res).get(res, name, namespace)

    async def get_own(self, res: Resource, name: str, namespace: str, labels: Mapping[str, str]) -> dict | None:
        return await self._c(res).get_own(res, name, namespace, labels)

    async def list(self, res: Resource, namespace: str = "", selector: str = "") -> list[dict]:
        return await self._c(res).list(res, namespace, selector)

    async def create(self, res: Resource, obj: Mapping[str, Any], namespace: str = "") -> dict:
        return await self._write(res, lambda c: c.create(res, obj, namespace))

    async def patch(self, res: Resource, name: str, patch: Mapping[str, Any], namespace: str = "",
                    subresource: str = "") -> dict:
        return await self._write(res, lambda c: c.patch(res, name, patch, namespace, subresource))

    async def delete(self, res: Resource, name: str, namespace: str = "", *, propagation: str = "") -> bool:
        return await self._write(res, lambda c: c.delete(res, name, namespace, propagation=propagation))


def load(path: str) -> FakeKube:
    fk = FakeKube()
    if os.path.exists(path):
        for k, v in json.load(open(path)):
            fk.objects[tuple(k)] = v
    return fk


def save(path: str, fk: FakeKube) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump([[list(k), v] for k, v in fk.objects.items()], f)
    os.replace(path + ".tmp", path)        # whole or not at all


async def main() -> dict:
    state, kind, ns, name = sys.argv[1:5]
    fk = load(state)
    sa = os.environ["SA_DIR"]
    http = Kube(open(f"{sa}/url").read().strip(), token_file=f"{sa}/token",
                verify=ssl.create_default_context(cafile=f"{sa}/ca.crt"))
    cfg = ControllerConfig(namespace=os.environ["PROXY_NS"], proxy_image="localhost/containerboot-py:latest",
                           login_server=os.environ["HS_URL"], provider="headscale", headscale_url=os.environ["HS_URL"],
                           headscale_user=os.environ.get("HS_USER", ""))
    prov = HeadscaleProvider(os.environ["HS_URL"], api_key=os.environ["HS_API_KEY"], user=cfg.headscale_user)
    out: dict = {"requeue": None}
    try:
        out["requeue"] = await Reconciler(Split(http, fk, state), prov, cfg).reconcile(kind, ns, name)
    except Exception as e:  # reported to the test, which decides
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        await prov.aclose()
        await http.aclose()
        save(state, fk)
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
