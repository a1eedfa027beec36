"""controller.kubeapi.KubeClient: the real client and the in-memory API server of the unit tests satisfy the
interface the passes are written against, as mypy sees it (a fake that drifted from the real client would let
the unit tests pass against calls the controller cannot make)."""
from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHECKED = '''
from typing import Any, Mapping
from controller.kubeapi import Kube, KubeClient, Resource
from tests.support.fakekube import FakeKube

def real(k: Kube) -> KubeClient:
    return k

def fake(k: FakeKube) -> KubeClient:
    return k

# A client whose delete lost its keyword: mypy must refuse it, so that the two checks above can fail.
class Drifted:
    async def get(self, res: Resource, name: str, namespace: str = "") -> dict | None: ...
    async def list(self, res: Resource, namespace: str = "", selector: str = "") -> list[dict]: ...
    async def create(self, res: Resource, obj: Mapping[str, Any], namespace: str = "") -> dict: ...
    async def patch(self, res: Resource, name: str, patch: Mapping[str, Any], namespace: str = "",
                    subresource: str = "") -> dict: ...
    async def delete(self, res: Resource, name: str, namespace: str = "") -> bool: ...

def drifted(k: Drifted) -> KubeClient:
    return k
'''


def test_real_and_fake_clients_satisfy_the_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    api = pytest.importorskip("mypy.api")
    monkeypatch.chdir(ROOT)
    out, err, _ = api.run(["--config-file=", "--python-version", "3.11", "--follow-imports=silent",
                           "--ignore-missing-imports", "--disable-error-code", "empty-body", "--no-error-summary",
                           "--cache-dir", str(ROOT / ".mypy_cache"), "-c", CHECKED])
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 1 and '"Drifted"' in errors[0] and '"KubeClient"' in errors[0], out + err
