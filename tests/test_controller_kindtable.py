"""controller.kindtable: each row agrees with itself and with the watches, so a kind added by a row alone is
whole (events name the object the API server knows, every parent kind has a pass, its children's events bring
a pass of it)."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from controller.handlers import child_key
from controller.kindtable import KINDS, PARENT, PARENT_KINDS
from controller.reconcile import Reconciler
from tests.support.fakekube import FakeKube, FakeProvider
from tests.test_controller_reconcile import CFG


def test_event_api_versions_name_the_resource_the_controller_calls() -> None:
    for info in KINDS.values():
        prefix = info.resource.prefix
        assert prefix.removeprefix("/api/").removeprefix("/apis/") == info.api_version, info.key


def test_every_parent_kind_is_decided_reported_and_dispatched() -> None:
    rec = Reconciler(FakeKube(), FakeProvider(), CFG)
    for info in KINDS.values():
        assert info.runs in rec.passes, info.key
        if info.runs == PARENT:
            assert info.decide is not None and info.handled is not None and info.proxy_type, info.key
    assert set(PARENT_KINDS) >= {k for k, i in KINDS.items() if i.runs == PARENT}


def test_every_parent_kinds_children_lead_back_to_it() -> None:
    for kind in PARENT_KINDS:
        labels = {"tailscale.com/managed": "true", "tailscale.com/parent-resource-type": kind,
                  "tailscale.com/parent-resource": "x", "tailscale.com/parent-resource-ns": "ns"}
        assert child_key({"metadata": {"labels": labels}}) == (kind, "ns", "x")
