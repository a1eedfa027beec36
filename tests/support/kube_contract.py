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

from controller.kubeapi import CRDS, SECRETS, KubeError, Resource
from tests.support.crdschema import CRD_DIR

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


# ---- custom resources: the status subresource, deletion, conflicts and the schema ---------------------------
# On the project's ProxyGroup CRD, installed under a group of its own (`contract.tailscale.test`) so that a
# controller running against the same API server leaves the checks' objects alone. The in-memory fake runs
# them too: what the controller's unit tests rely on (tests/test_controller_*.py) is what the real server does.

CONTRACT_GROUP = "contract.tailscale.test"
PG = Resource(f"/apis/{CONTRACT_GROUP}/v1alpha1", "proxygroups", namespaced=False)


def contract_crd() -> dict[str, Any]:
    import yaml
    doc = yaml.safe_load((CRD_DIR / "tailscale.com_proxygroups.yaml").read_text())
    doc["metadata"] = {"name": f"proxygroups.{CONTRACT_GROUP}"}
    doc["spec"]["group"] = CONTRACT_GROUP
    return doc


async def install_contract_crd(kube: Any) -> None:
    """The CRD created (once) and served: the real server answers 404 for its resource until it is established,
    then 429 while the resource's storage starts."""
    import asyncio
    try:
        await kube.create(CRDS, contract_crd())
    except KubeError as e:
        if e.status != 409:
            raise
    for _ in range(150):
        try:
            await kube.list(PG)
            return
        except KubeError as e:
            if e.status not in (404, 429):
                raise
        await asyncio.sleep(0.2)   # poll: until the new CRD is served
    raise AssertionError(f"the CRD proxygroups.{CONTRACT_GROUP} is not served after 30 s")


def _pg(name: str, replicas: int = 1, **extra: Any) -> dict[str, Any]:
    return {"apiVersion": f"{CONTRACT_GROUP}/v1alpha1", "kind": "ProxyGroup", "metadata": {"name": name},
            "spec": {"type": "egress", "replicas": replicas}, **extra}


def _condition(reason: str) -> dict[str, Any]:
    return {"type": "ProxyGroupReady", "status": "False", "reason": reason, "message": "m",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}


async def crd_status_is_a_subresource(kube: Any) -> None:
    """A create or a spec write never sets the status; a status write never changes the spec. The generation
    counts spec changes only; the resourceVersion changes with every write that changes something, and not with
    one that changes nothing."""
    name = _name("status")
    made = await kube.create(PG, _pg(name, status={"conditions": [_condition("Created")]}))
    assert "status" not in made or not made["status"], made.get("status")
    assert made["metadata"]["generation"] == 1
    rv0 = made["metadata"]["resourceVersion"]
    out = await kube.patch(PG, name, {"status": {"conditions": [_condition("Written")]}}, subresource="status")
    assert out["status"]["conditions"][0]["reason"] == "Written"
    assert out["metadata"]["generation"] == 1 and out["metadata"]["resourceVersion"] != rv0
    rv1 = out["metadata"]["resourceVersion"]
    # a status write that also carries a spec: only the status lands
    out = await kube.patch(PG, name, {"spec": {"replicas": 5}, "status": {"conditions": [_condition("Again")]}},
                           subresource="status")
    assert out["spec"]["replicas"] == 1 and out["status"]["conditions"][0]["reason"] == "Again"
    assert out["metadata"]["generation"] == 1
    # a spec write that also carries a status: only the spec lands, and the generation moves
    out = await kube.patch(PG, name, {"spec": {"replicas": 2}, "status": {"conditions": [_condition("Lost")]}})
    assert out["spec"]["replicas"] == 2 and out["status"]["conditions"][0]["reason"] == "Again"
    assert out["metadata"]["generation"] == 2 and out["metadata"]["resourceVersion"] != rv1
    # metadata only: a new resourceVersion, the same generation
    out = await kube.patch(PG, name, {"metadata": {"labels": {"a": "b"}}})
    assert out["metadata"]["generation"] == 2
    rv2 = out["metadata"]["resourceVersion"]
    # nothing changed: nothing moves
    out = await kube.patch(PG, name, {"spec": {"replicas": 2}})
    assert out["metadata"]["resourceVersion"] == rv2 and out["metadata"]["generation"] == 2
    got = await kube.get(PG, name)
    assert got is not None and got["metadata"]["resourceVersion"] == rv2
    await kube.delete(PG, name)


async def crd_finalizers_hold_the_deletion(kube: Any) -> None:
    """Deleting an object with a finalizer marks it (deletionTimestamp, a new generation) and keeps it, writable,
    until the finalizer is removed; a create of its name meanwhile is 409; then it is gone."""
    name = _name("final")
    made = await kube.create(PG, _pg(name, metadata={"name": name, "finalizers": ["tailscale.com/finalizer"]}))
    assert await kube.delete(PG, name) is True
    held = await kube.get(PG, name)
    assert held is not None and held["metadata"].get("deletionTimestamp"), "the finalizer must hold it"
    assert held["metadata"]["generation"] == made["metadata"]["generation"] + 1
    assert held["metadata"]["resourceVersion"] != made["metadata"]["resourceVersion"]
    out = await kube.patch(PG, name, {"status": {"conditions": [_condition("Deleting")]}}, subresource="status")
    assert out["status"]["conditions"][0]["reason"] == "Deleting"
    await _raises(kube.create(PG, _pg(name)), 409, "AlreadyExists")
    await kube.patch(PG, name, {"metadata": {"finalizers": None}})
    assert await kube.get(PG, name) is None
    assert await kube.delete(PG, name) is False


async def crd_a_stale_resource_version_is_a_conflict(kube: Any) -> None:
    """A write fenced by a resourceVersion that is no longer current is 409 Conflict, on the spec and on the
    status, and changes nothing."""
    name = _name("fenced")
    made = await kube.create(PG, _pg(name))
    rv = made["metadata"]["resourceVersion"]
    await kube.patch(PG, name, {"metadata": {"resourceVersion": rv}, "spec": {"replicas": 2}})
    await _raises(kube.patch(PG, name, {"metadata": {"resourceVersion": rv}, "spec": {"replicas": 3}}), 409, "Conflict")
    await _raises(kube.patch(PG, name, {"metadata": {"resourceVersion": rv},
                                        "status": {"conditions": [_condition("Stale")]}}, subresource="status"),
                  409, "Conflict")
    got = await kube.get(PG, name)
    assert got is not None and got["spec"]["replicas"] == 2 and not (got.get("status") or {}).get("conditions")
    await kube.delete(PG, name)


async def crd_the_schema_refuses_with_422_naming_the_field(kube: Any) -> None:
    """What the schema refuses is 422 Invalid naming the field, on create, on a spec write and on a status write,
    and changes nothing; a field the schema does not know is dropped."""
    name = _name("schema")
    e = await _raises(kube.create(PG, {**_pg(name), "spec": {"type": "bogus"}}), 422, "Invalid")
    assert "spec.type" in str(e) and "bogus" in str(e), str(e)
    assert await kube.get(PG, name) is None
    await kube.create(PG, {**_pg(name), "spec": {"type": "egress", "replicas": 1, "notInTheSchema": True}})
    got = await kube.get(PG, name)
    assert got is not None and got["spec"] == {"type": "egress", "replicas": 1}, got["spec"]
    e = await _raises(kube.patch(PG, name, {"spec": {"replicas": -1}}), 422, "Invalid")
    assert "spec.replicas" in str(e), str(e)
    e = await _raises(kube.patch(PG, name, {"spec": {"hostnamePrefix": "Not_A_Name"}}), 422, "Invalid")
    assert "spec.hostnamePrefix" in str(e), str(e)
    bad = {"type": "ProxyGroupReady", "status": "Maybe", "reason": "r", "message": "m",
           "lastTransitionTime": "2026-01-01T00:00:00Z"}
    e = await _raises(kube.patch(PG, name, {"status": {"conditions": [bad]}}, subresource="status"), 422, "Invalid")
    assert "status.conditions[0].status" in str(e), str(e)
    e = await _raises(kube.patch(PG, name, {"status": {"conditions": [{"type": "ProxyGroupReady"}]}},
                                 subresource="status"), 422, "Invalid")
    assert "status.conditions[0].reason" in str(e), str(e)
    got = await kube.get(PG, name)
    assert got is not None and got["spec"] == {"type": "egress", "replicas": 1}
    assert not (got.get("status") or {}).get("conditions")
    await kube.delete(PG, name)


RATCHET_GROUP = "ratchet.tailscale.test"
RATCHET_PG = Resource(f"/apis/{RATCHET_GROUP}/v1alpha1", "proxygroups", namespaced=False)


async def crd_a_field_written_under_an_older_schema_does_not_block_other_writes(kube: Any) -> None:
    """Validation ratchets: an object stored while the schema allowed a value keeps it through writes that leave
    it as it is (spec and status), while a write that changes it to another invalid value is refused."""
    import asyncio
    import copy
    doc = contract_crd()
    doc["metadata"] = {"name": f"proxygroups.{RATCHET_GROUP}"}
    doc["spec"]["group"] = RATCHET_GROUP
    strict = copy.deepcopy(doc["spec"]["versions"])
    del doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "hostnamePrefix"]["pattern"]
    try:
        await kube.create(CRDS, doc)
    except KubeError as e:
        if e.status != 409:
            raise
        await kube.patch(CRDS, doc["metadata"]["name"], {"spec": {"versions": doc["spec"]["versions"]}})
    name = _name("ratchet")
    old = {"apiVersion": f"{RATCHET_GROUP}/v1alpha1", "kind": "ProxyGroup", "metadata": {"name": name},
           "spec": {"type": "egress", "replicas": 1, "hostnamePrefix": "Old_Prefix"}}
    for _ in range(150):
        try:
            await kube.create(RATCHET_PG, old)
            break
        except KubeError as e:
            if e.status not in (404, 429):
                raise
        await asyncio.sleep(0.2)   # poll: until the new CRD is served
    else:
        raise AssertionError(f"the CRD proxygroups.{RATCHET_GROUP} is not served after 30 s")
    await kube.patch(CRDS, doc["metadata"]["name"], {"spec": {"versions": strict}})
    probe = _name("probe")
    for _ in range(150):      # the stricter schema in force: a new object with the old value is refused
        try:
            await kube.create(RATCHET_PG, {**old, "metadata": {"name": probe}})
            await kube.delete(RATCHET_PG, probe)
        except KubeError as e:
            if e.status != 422:
                raise
            break
        await asyncio.sleep(0.2)   # poll: until the stricter schema is in force
    else:
        raise AssertionError("the stricter schema is not in force after 30 s")
    out = await kube.patch(RATCHET_PG, name, {"spec": {"replicas": 2}})
    assert out["spec"] == {"type": "egress", "replicas": 2, "hostnamePrefix": "Old_Prefix"}
    out = await kube.patch(RATCHET_PG, name, {"status": {"conditions": [_condition("Ratchet")]}}, subresource="status")
    assert out["status"]["conditions"][0]["reason"] == "Ratchet"
    e = await _raises(kube.patch(RATCHET_PG, name, {"spec": {"hostnamePrefix": "Other_Prefix"}}), 422, "Invalid")
    assert "spec.hostnamePrefix" in str(e), str(e)
    await kube.delete(RATCHET_PG, name)


CrdCheck = Callable[[Any], Awaitable[None]]
CRD_CHECKS: dict[str, CrdCheck] = {
    n.removeprefix("crd_"): f for n, f in sorted(globals().items()) if n.startswith("crd_")}


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
