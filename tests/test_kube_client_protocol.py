"""controller.kubeapi.KubeClient: every client the passes are handed satisfies the interface they are written
against, as mypy sees it: the real client, the watch cache in front of it, the in-memory API server of the unit
tests and its planted variants, and the real-cluster tests' split client (netns-tests/controller_pass.py). A
client that drifted from the interface would let tests pass against calls the controller cannot make, or fail
only in a real-cluster run."""
from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHECKED = '''
from typing import Any, Mapping
from controller.kubeapi import Kube, KubeClient, Resource
from controller.watchcache import CachedKube
from controller_pass import Split
from tests.support.fakekube import FakeKube
from tests.support.planted_kube import SpecWriteLandsStatus, StatusWriteLandsSpec

def real(k: Kube) -> KubeClient:
    return k

def cached(k: CachedKube) -> KubeClient:
    return k

def fake(k: FakeKube) -> KubeClient:
    return k

def planted(a: StatusWriteLandsSpec, b: SpecWriteLandsStatus) -> tuple[KubeClient, KubeClient]:
    return a, b

def split(k: Split) -> KubeClient:
    return k

# A client whose delete lost its keyword: mypy must refuse it, so that the two checks above can fail.
class Drifted:
    async def get(self, res: Resource, name: str, namespace: str = "") -> dict | None: ...
    async def get_own(self, res: Resource, name: str, namespace: str, labels: Mapping[str, str]) -> dict | None: ...
    async def list(self, res: Resource, namespace: str = "", selector: str = "") -> list[dict]: ...
    async def create(self, res: Resource, obj: Mapping[str, Any], namespace: str = "") -> dict: ...
    async def patch(self, res: Resource, name: str, patch: Mapping[str, Any], namespace: str = "",
                    subresource: str = "") -> dict: ...
    async def delete(self, res: Resource, name: str, namespace: str = "") -> bool: ...

def drifted(k: Drifted) -> KubeClient:
    return k
'''


def test_every_client_satisfies_the_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    api = pytest.importorskip("mypy.api")
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MYPYPATH", str(ROOT / "netns-tests"))     # controller_pass is a script there
    out, err, _ = api.run(["--config-file=", "--python-version", "3.11", "--follow-imports=silent",
                           "--ignore-missing-imports", "--disable-error-code", "empty-body", "--no-error-summary",
                           "--cache-dir", str(ROOT / ".mypy_cache"), "-c", CHECKED])
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 1 and '"Drifted"' in errors[0] and '"KubeClient"' in errors[0], out + err
