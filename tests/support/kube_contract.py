"""What the project's Kubernetes stand-ins promise, as checks that run unchanged on the fakes and on a real
kube-apiserver.

`KUBE_CHECKS` drive the controller's client interface (`controller.kubeapi.Kube`: get, list, create, merge patch,
delete); they run on the in-memory `tests.support.fakekube.FakeKube`, on `Kube` against the test API server
(`tests.support.kubeapi`), and on `Kube` against the real kube-apiserver the lab builds. `AGENT_CHECKS` drive the
agent's client (`containerboot.kube.client.KubeClient`: the three patch types, create, SSAR) on the test API server
and the real one. The fakes' runs are tests/test_kube_contract.py; the real server's are in
netns-tests/test_controller_apiserver.py (its cluster, shared). A check states one behaviour a client relies on;
a fake that passes the same checks as the real server cannot hide a difference there.
"""
from __future__ import annotations

import base64
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from controller.kubeapi import SECRETS, KubeError

B64 = lambda s: base64.b64encode(s.encode()).decode()    # noqa: E731


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def _secret(name: str, data: dict[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "data": {k: B64(v) for k, v in data.items()}}


async def _raises(aw: Awaitable[Any], status: int, reason: str = "") -> KubeError:
    try:
        await aw
    except KubeError as e:
        assert e.status == status, (e.status, str(e))
        if reason:
            assert e.reason == reason, (e.reason, str(e))
        return e
    raise AssertionError(f"no KubeError {status}")


# ---- the controller's client interface ---------------------------------------------------------------------

async def check_missing_objects(kube: Any, ns: str) -> None:
    """A missing object: get is None, delete is False, a patch is 404 NotFound."""
    name = _name("missing")
    assert await kube.get(SECRETS, name, ns) is None
    assert await kube.delete(SECRETS, name, ns) is False
    await _raises(kube.patch(SECRETS, name, {"data": {"k": B64("v")}}, ns), 404, "NotFound")


async def check_create_get_and_a_second_create(kube: Any, ns: str) -> None:
    name = _name("created")
    made = await kube.create(SECRETS, _secret(name, {"k": "v"}), ns)
    got = await kube.get(SECRETS, name, ns)
    assert got is not None and got["data"] == {"k": B64("v")}
    m = got["metadata"]
    assert m["name"] == name and m["namespace"] == ns and m["uid"] and m["resourceVersion"]
    assert made["metadata"]["uid"] == m["uid"]
    await _raises(kube.create(SECRETS, _secret(name, {"k": "other"}), ns), 409, "AlreadyExists")
    again = await kube.get(SECRETS, name, ns)
    assert again is not None and again["data"] == {"k": B64("v")}, "a refused create changed the object"


async def check_merge_patch_adds_replaces_and_deletes(kube: Any, ns: str) -> None:
    name = _name("patched")
    await kube.create(SECRETS, _secret(name, {"keep": "1", "drop": "2"}, {"a": "1"}), ns)
    out = await kube.patch(SECRETS, name, {"metadata": {"labels": {"b": "2"}},
                                          "data": {"drop": None, "new": B64("3")}}, ns)
    got = await kube.get(SECRETS, name, ns)
    assert got is not None
    assert got["data"] == {"keep": B64("1"), "new": B64("3")}
    assert got["metadata"]["labels"] == {"a": "1", "b": "2"}
    assert out["metadata"]["resourceVersion"] == got["metadata"]["resourceVersion"]


async def check_a_stale_resource_version_is_a_conflict(kube: Any, ns: str) -> None:
    name = _name("fenced")
    made = await kube.create(SECRETS, _secret(name, {"k": "1"}), ns)
    rv = made["metadata"]["resourceVersion"]
    await kube.patch(SECRETS, name, {"metadata": {"resourceVersion": rv}, "data": {"k": B64("2")}}, ns)
    await _raises(kube.patch(SECRETS, name, {"metadata": {"resourceVersion": rv}, "data": {"k": B64("3")}}, ns),
                  409, "Conflict")
    got = await kube.get(SECRETS, name, ns)
    assert got is not None and got["data"]["k"] == B64("2")


async def check_list_filters_by_label_and_namespace(kube: Any, ns: str) -> None:
    tag = secrets.token_hex(3)
    mine = [_name("listed"), _name("listed")]
    for n in mine:
        await kube.create(SECRETS, _secret(n, {}, {"contract": tag}), ns)
    await kube.create(SECRETS, _secret(_name("unlabelled"), {}), ns)
    got = await kube.list(SECRETS, ns, f"contract={tag}")
    assert sorted(o["metadata"]["name"] for o in got) == sorted(mine)
    assert await kube.list(SECRETS, ns, f"contract={tag},other=x") == []


async def check_generate_name(kube: Any, ns: str) -> None:
    made = await kube.create(SECRETS, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                       "metadata": {"generateName": "gen-"}, "data": {}}, ns)
    name = made["metadata"]["name"]
    assert name.startswith("gen-") and len(name) > len("gen-")
    assert await kube.get(SECRETS, name, ns) is not None


async def check_a_finalizer_holds_the_deletion_until_it_is_removed(kube: Any, ns: str) -> None:
    name = _name("final")
    obj = _secret(name, {"k": "v"})
    obj["metadata"]["finalizers"] = ["tailscale.com/finalizer"]
    await kube.create(SECRETS, obj, ns)
    assert await kube.delete(SECRETS, name, ns) is True
    held = await kube.get(SECRETS, name, ns)
    assert held is not None and held["metadata"].get("deletionTimestamp"), "the finalizer must hold it"
    await kube.patch(SECRETS, name, {"metadata": {"finalizers": None}}, ns)
    assert await kube.get(SECRETS, name, ns) is None


async def check_delete_removes(kube: Any, ns: str) -> None:
    name = _name("deleted")
    await kube.create(SECRETS, _secret(name, {}), ns)
    assert await kube.delete(SECRETS, name, ns) is True
    assert await kube.get(SECRETS, name, ns) is None


KubeCheck = Callable[[Any, str], Awaitable[None]]
KUBE_CHECKS: dict[str, KubeCheck] = {
    n.removeprefix("check_"): f for n, f in sorted(globals().items()) if n.startswith("check_")}


# ---- the agent's client ------------------------------------------------------------------------------------

async def agent_secret_round_trip(client: Any) -> None:
    """create, get, a strategic merge patch (None deletes), a JSON patch; a missing Secret is None."""
    name = _name("agent")
    assert await client.get_secret(name) is None
    await client.create_secret(name, {"a": b"1", "b": b"2", "skipped": None})
    got = await client.get_secret(name)
    assert got is not None and got.data == {"a": b"1", "b": b"2"}
    await client.patch_secret(name, {"b": None, "c": b"3"})
    got = await client.get_secret(name)
    assert got is not None and got.data == {"a": b"1", "c": b"3"}
    await client.json_patch_secret(name, [{"op": "remove", "path": "/data/a"}])
    got = await client.get_secret(name)
    assert got is not None and got.data == {"c": b"3"}


async def agent_create_of_an_existing_secret_is_409(client: Any) -> None:
    from containerboot.kube.client import KubeError as AgentKubeError
    name = _name("agent-dup")
    await client.create_secret(name, {"a": b"1"})
    try:
        await client.create_secret(name, {"a": b"2"})
    except AgentKubeError as e:
        assert e.status == 409, str(e)
    else:
        raise AssertionError("a second create did not fail")


async def agent_json_patch_of_a_missing_key_is_422(client: Any) -> None:
    """How the agent tells "the auth key is not there" from a failure when it deletes the key."""
    from containerboot.kube.client import KubeError as AgentKubeError
    name = _name("agent-422")
    await client.create_secret(name, {"a": b"1"})
    try:
        await client.json_patch_secret(name, [{"op": "remove", "path": "/data/authkey"}])
    except AgentKubeError as e:
        assert e.status == 422, str(e)
    else:
        raise AssertionError("removing a missing key did not fail")


async def agent_ssar_answers_for_the_caller(client: Any) -> None:
    """An admin may do anything (the restricted case is each server's RBAC set-up: see the callers)."""
    assert await client.can_i("get", "secrets", "anything") is True
    assert await client.can_i("patch", "secrets") is True


AgentCheck = Callable[[Any], Awaitable[None]]
AGENT_CHECKS: dict[str, AgentCheck] = {
    n.removeprefix("agent_"): f for n, f in sorted(globals().items()) if n.startswith("agent_")}
