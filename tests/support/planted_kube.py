"""The in-memory Kubernetes fake with a planted bug in its status subresource, to show that the contract's
checks (tests/support/kube_contract.py) catch one: each class is `FakeKube` wrong in one way the controller's
tests would otherwise trust. netns-tests/test_controller_apiserver.py runs the checks on each of them, on the
unplanted fake and on the real kube-apiserver: the checks must fail here and pass there.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from controller.kubeapi import Resource
from tests.support.fakekube import FakeKube
from tests.support.kube_contract import CRD_CHECKS, install_contract_crd


class StatusWriteLandsSpec(FakeKube):
    """A write to the status subresource lands all it carries, the spec too (the API server keeps only the
    status)."""

    async def patch(self, res: Resource, name: str, patch: Mapping[str, Any], namespace: str = "",
                    subresource: str = "") -> dict:
        if subresource != "status":
            return await super().patch(res, name, patch, namespace, subresource)
        self.calls.append(("PATCH", res.plural, namespace, name + "/status"))
        self._has_status = lambda res: False       # type: ignore[method-assign]
        try:
            return await super().patch(res, name, patch, namespace)
        finally:
            del self._has_status


class SpecWriteLandsStatus(FakeKube):
    """A write to the object lands the status it carries (the API server drops it when the resource has a
    status subresource)."""

    async def patch(self, res: Resource, name: str, patch: Mapping[str, Any], namespace: str = "",
                    subresource: str = "") -> dict:
        if subresource:
            return await super().patch(res, name, patch, namespace, subresource)
        self._has_status = lambda res: False       # type: ignore[method-assign]
        try:
            return await super().patch(res, name, patch, namespace)
        finally:
            del self._has_status


PLANTED: dict[str, type[FakeKube]] = {"status write lands the spec": StatusWriteLandsSpec,
                                      "spec write lands the status": SpecWriteLandsStatus}


async def failing_checks(kube: Any, only: Iterable[str] = ()) -> list[str]:
    """The custom-resource checks (`only` these, else all) this client fails, its CRD installed first, each as
    "name: assertion"."""
    await install_contract_crd(kube)
    failed = []
    for name, check in sorted(CRD_CHECKS.items()):
        if only and name not in only:
            continue
        try:
            await check(kube)
        except AssertionError as e:
            failed.append(f"{name}: {e}")
    return failed
