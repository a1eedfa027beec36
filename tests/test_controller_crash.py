"""Crash consistency of the controller: the process dies just before each write of a proxy's life, and a new
one (a fresh Reconciler: nothing remembered) carries on.

A proxy's life here: a Service asks for a proxy; the controller adds its finalizer, mints a key and writes the
children; the proxy registers (device n1) and the controller reports it ready; the proxy's key is rejected and it
asks for another (the controller deletes n1, mints a key); it registers again (n2); the Service is deleted and
the controller removes everything. A clean run counts the writes (API writes and control plane calls); then for
each k the run dies before write k (the in-memory API server and control plane keep what was written, as real
ones do), a new controller takes over and the life goes on to its end. Then, whatever k was:
* no object is left behind, the Service is released (its finalizer removed and it is gone);
* no device is left behind at the control plane and none was deleted that was still in use;
* every key the controller minted went into the proxy's Secret, except at most one: the key minted when the
  process died between minting it and writing it (single-use, never given to a proxy, it expires unused);
* no second device: the proxy registered with one key per life stage.
"""
from __future__ import annotations

import base64
from typing import Any, cast

import pytest

from controller.config import ControllerConfig
from controller.kubeapi import SECRETS, SERVICES, STATEFULSETS
from controller.model import Parent
from controller.reconcile import Reconciler
from controller.render import base_name
from tests.support.fakekube import FakeKube, FakeProvider, agent_writes, secret_data

CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1",
                       login_server="http://hs.test:8080")


class Crash(BaseException):
    """The process died (a BaseException: no handler of the controller's catches it, as none survives a kill)."""


class Injector:
    """Counts the writes of FakeKube and FakeProvider and raises Crash before the chosen one."""

    def __init__(self, kube: FakeKube, prov: FakeProvider, crash_at: int | None) -> None:
        self.count, self.crash_at = 0, crash_at
        self.trail: list[str] = []
        self.stored: set[str] = set()    # every auth key that has been written into a Secret
        self.prov = prov
        for obj, names in ((kube, ("create", "patch", "delete")),
                           (prov, ("create_auth_key", "delete_device", "set_device_tags"))):
            for name in names:
                setattr(obj, name, self._wrap(name, getattr(obj, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        async def write(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            what = name + (f" {args[0].plural}" if args and hasattr(args[0], "plural") else "")
            self.trail.append(what)
            if self.count == self.crash_at:
                raise Crash(f"killed before write {self.count}: {what}")
            out = await fn(*args, **kwargs)
            if what in ("create secrets", "patch secrets") and isinstance(out, dict):
                text = "".join(v.decode(errors="replace") for _, v in _secret_items(out))
                self.stored |= {k for k, _ in self.prov.keys if k in text}
            return out
        return write


async def _life(crash_at: int | None) -> tuple[FakeKube, FakeProvider, Injector, dict[str, Any]]:
    kube, prov = FakeKube(), FakeProvider()
    inj = Injector(kube, prov, crash_at)
    seen: dict[str, Any] = {"crashed_between_mint_and_store": False, "restarts": 0, "registered": []}
    rec = Reconciler(cast(Any, kube), prov, CFG)

    async def converge(max_passes: int = 8) -> None:
        nonlocal rec
        for _ in range(max_passes):
            try:
                await rec.reconcile("svc", "apps", "web")
                return
            except Crash:
                if {k for k, _ in prov.keys} - inj.stored:
                    seen["crashed_between_mint_and_store"] = True
                seen["restarts"] += 1
                rec = Reconciler(cast(Any, kube), prov, CFG)      # the new process: nothing remembered
            kube.finish_deletions()
        raise AssertionError("no convergence")

    svc = kube.put(SERVICES, {"metadata": {"name": "web", "namespace": "apps",
                                           "annotations": {"tailscale.com/expose": "true"}},
                              "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10",
                                       "clusterIPs": ["10.96.0.10"], "ipFamilies": ["IPv4"]}})
    name = base_name(Parent("svc", "web", "apps", svc["metadata"]["uid"])) + "-0"

    def register(device: str) -> None:
        """The proxy logs in with the key in its config and writes its identity."""
        conf = secret_data(kube, name)["cap-107.hujson"].decode()
        key = next(k for k, _ in prov.keys if k in conf)
        seen["registered"].append((device, key))
        prov.tags[device] = ("tag:k8s",)
        agent_writes(kube, name, {"device_id": device.encode(), "device_fqdn": b"web.tail.test.",
                                   "device_ips": b'["100.64.0.9"]', "tailscale_capver": b"107", "pod_uid": b"u"})

    await converge()
    register("n1")
    kube.objects[("statefulsets", "tailscale", base_name(Parent("svc", "web", "apps",
                                                                 svc["metadata"]["uid"])))]["status"] = {
        "readyReplicas": 1}
    await converge()
    # The key is rejected: the proxy asks for a new one.
    conf = secret_data(kube, name)["cap-107.hujson"].decode()
    old = next(k for k, _ in prov.keys if k in conf) if any(k in conf for k, _ in prov.keys) else ""
    agent_writes(kube, name, {"reissue_authkey": old.encode()})
    await converge()
    prov.tags.pop("n1", None)       # deleted at the control plane (asserted below)
    agent_writes(kube, name, {"reissue_authkey": None, "device_id": None})
    register("n2")
    await converge()
    # The Service goes.
    kube.objects[("services", "apps", "web")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    for _ in range(6):
        await converge()
        kube.finish_deletions()
        if kube.obj(SERVICES, "web", "apps") is None:
            break
    return kube, prov, inj, seen


def _secret_items(s: dict) -> list[tuple[str, bytes]]:
    return [(k, base64.b64decode(v)) for k, v in (s.get("data") or {}).items()]


async def _clean_writes() -> int:
    _, _, inj, _ = await _life(None)
    return inj.count


@pytest.mark.parametrize("crash_at", range(1, 26))
async def test_killed_before_each_write_the_next_controller_converges(crash_at: int) -> None:
    total = await _clean_writes()
    if crash_at > total:
        pytest.skip(f"the life has {total} writes")
    kube, prov, inj, seen = await _life(crash_at)
    assert seen["restarts"] == 1
    # Nothing left behind: the Service released and gone, no child object.
    assert kube.obj(SERVICES, "web", "apps") is None
    assert kube.of(STATEFULSETS) == [] and kube.of(SECRETS) == []
    assert [o for o in kube.of(SERVICES) if o["metadata"]["namespace"] == "tailscale"] == []
    # Devices: each registered device deleted (n1 on reissue, n2 at cleanup), nothing else; none left.
    assert set(prov.deleted) == {"n1", "n2"}
    # Keys: one per life stage (first login, reissue), plus at most the one lost between mint and store.
    used = [k for _, k in seen["registered"]]
    assert len(used) == len(set(used)) == 2, seen["registered"]
    extra = len(prov.keys) - 2
    assert extra == (1 if seen["crashed_between_mint_and_store"] else 0), (prov.keys, inj.trail)


async def test_the_life_has_at_most_25_writes() -> None:
    """The parametrized test above covers every write of the life: keep its range above the count."""
    assert await _clean_writes() <= 25
