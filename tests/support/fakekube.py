"""An in-memory Kubernetes API with the controller client's interface (`controller.kubeapi.Kube`), for the
reconciler's tests: merge patches (RFC 7386, lists replaced), the status subresource, finalizers that hold a
deletion, foreground deletion that completes only when the test says so, resourceVersion preconditions,
generateName, the project's CRDs' schemas (pruning and 422s, tests/support/crdschema.py; a CRD created through
the fake is learnt too), and a log of every call so tests can count writes and check their order. What it
promises is checked against the real kube-apiserver (tests/support/kube_contract.py)."""
from __future__ import annotations

import base64
import copy
import itertools
import uuid
from typing import Any, Mapping

from controller.kubeapi import CRDS, SECRETS, KubeError, Resource
from tests.support.crdschema import Crd, problems, project_crds, prune
from tests.support.kubeapi import merge_patch

WRITES = ("POST", "PATCH", "DELETE")


class FakeKube:
    def __init__(self, log: list | None = None) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.calls: list[tuple[str, str, str, str]] = []      # (method, plural, namespace, name[/sub])
        self.log = log if log is not None else []             # shared with a fake provider: order of effects
        self._rv = itertools.count(1)
        self.fail_next: list[KubeError] = []
        self.crds: dict[tuple[str, str], Crd] = {(c.prefix, c.plural): c for c in _PROJECT_CRDS}

    # ---- helpers for tests

    def writes(self) -> list[tuple[str, str, str, str]]:
        return [c for c in self.calls if c[0] in WRITES]

    def put(self, res: Resource, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        m = obj.setdefault("metadata", {})
        m.setdefault("uid", str(uuid.uuid4()))
        m["resourceVersion"] = str(next(self._rv))
        m.setdefault("generation", 1)
        self.objects[(res.plural, m.get("namespace", "") if res.namespaced else "", m["name"])] = obj
        return obj

    def obj(self, res: Resource, name: str, namespace: str = "") -> dict | None:
        return self.objects.get((res.plural, namespace if res.namespaced else "", name))

    def of(self, res: Resource) -> list[dict]:
        return [o for (p, _, _), o in sorted(self.objects.items()) if p == res.plural]

    def finish_deletions(self) -> None:
        """The garbage collector finished: objects marked for deletion without finalizers disappear."""
        for k, o in list(self.objects.items()):
            if o["metadata"].get("deletionTimestamp") and not o["metadata"].get("finalizers"):
                del self.objects[k]

    # ---- the client interface

    def _admit(self, res: Resource, obj: dict, old: dict | None = None) -> dict:
        """A custom resource as its CRD's schema leaves it: pruned, or refused with 422 naming the fields. As the
        API server ratchets, a problem the stored object already had (written under an older schema, or put
        there by a test) does not refuse a write that leaves it as it was."""
        crd = self.crds.get((res.prefix, res.plural))
        if crd is None:
            return obj
        obj = prune(obj, crd.schema)
        had = set(problems({k: v for k, v in old.items() if k != "metadata"}, crd.schema)) if old else set()
        if bad := [b for b in problems({k: v for k, v in obj.items() if k != "metadata"}, crd.schema)
                   if b not in had]:
            name = obj["metadata"].get("name", "")
            raise KubeError(f'{crd.kind}.{crd.group} "{name}" is invalid: ' + ", ".join(bad), status=422,
                            reason="Invalid")
        return obj

    def _has_status(self, res: Resource) -> bool:
        crd = self.crds.get((res.prefix, res.plural))
        return crd.status_subresource if crd else True

    def _key(self, res: Resource, name: str, namespace: str) -> tuple[str, str, str]:
        return (res.plural, namespace if res.namespaced else "", name)

    def _call(self, method: str, res: Resource, namespace: str, name: str) -> None:
        self.calls.append((method, res.plural, namespace, name))
        if method in WRITES:
            self.log.append((method, res.plural, name))
        if self.fail_next:
            raise self.fail_next.pop(0)

    async def get(self, res: Resource, name: str, namespace: str = "") -> dict | None:
        self._call("GET", res, namespace, name)
        o = self.objects.get(self._key(res, name, namespace))
        return copy.deepcopy(o) if o else None

    async def get_own(self, res: Resource, name: str, namespace: str, labels: Mapping[str, str]) -> dict | None:
        return await self.get(res, name, namespace)

    async def list(self, res: Resource, namespace: str = "", selector: str = "") -> list[dict]:
        self._call("LIST", res, namespace, "")
        want = dict(kv.split("=", 1) for kv in selector.split(",") if kv)
        out = []
        for (p, ns, _), o in sorted(self.objects.items()):
            labels = o["metadata"].get("labels") or {}
            if p == res.plural and (not res.namespaced or not namespace or ns == namespace) and \
                    all(labels.get(k) == v for k, v in want.items()):
                out.append(copy.deepcopy(o))
        return out

    async def served(self, prefix: str) -> frozenset[str] | None:
        """API discovery of a custom resources' group version: the plurals of the CRDs the fake knows there
        (remove one from `crds` for a cluster without it), None when none is."""
        self._call("GET", Resource(prefix, ""), "", "")
        plurals = frozenset(plural for p, plural in self.crds if p == prefix)
        return plurals or None

    async def create(self, res: Resource, obj: Mapping[str, Any], namespace: str = "") -> dict:
        obj = copy.deepcopy(dict(obj))
        m = obj.setdefault("metadata", {})
        if not m.get("name") and m.get("generateName"):
            m["name"] = m["generateName"] + uuid.uuid4().hex[:5]
        self._call("POST", res, namespace, m["name"])
        if self._key(res, m["name"], namespace) in self.objects:
            raise KubeError(f"{res.plural} {m['name']!r} already exists", status=409, reason="AlreadyExists")
        m["namespace"] = namespace
        if res.plural == "secrets" and "stringData" in obj:
            raise AssertionError("the controller writes data, not stringData")
        if self._has_status(res):
            obj.pop("status", None)         # a create, like a spec write, never sets the status subresource
        obj = self._admit(res, obj)
        if res == CRDS:
            crd = Crd.from_document(obj)
            self.crds[(crd.prefix, crd.plural)] = crd
        return copy.deepcopy(self.put(res, obj))

    async def patch(self, res: Resource, name: str, patch: Mapping[str, Any], namespace: str = "",
                    subresource: str = "") -> dict:
        self._call("PATCH", res, namespace, name + (f"/{subresource}" if subresource else ""))
        key = self._key(res, name, namespace)
        cur = self.objects.get(key)
        if cur is None:
            raise KubeError(f"{res.plural} {name!r} not found", status=404, reason="NotFound")
        patch = copy.deepcopy(dict(patch))
        rv = (patch.get("metadata") or {}).pop("resourceVersion", None)
        if rv is not None and rv != cur["metadata"]["resourceVersion"]:
            raise KubeError("the object has been modified", status=409, reason="Conflict")
        if subresource == "status":
            patch = {"status": patch.get("status")}
        elif self._has_status(res):
            patch.pop("status", None)
        new = self._admit(res, merge_patch(cur, patch), cur)
        if new == cur:
            return copy.deepcopy(cur)       # nothing changed: no new resourceVersion, as the API server does
        new["metadata"]["resourceVersion"] = str(next(self._rv))
        if {k: v for k, v in new.items() if k not in ("metadata", "status")} != \
                {k: v for k, v in cur.items() if k not in ("metadata", "status")}:
            new["metadata"]["generation"] = cur["metadata"].get("generation", 1) + 1
        self.objects[key] = new
        if res == CRDS:
            crd = Crd.from_document(new)
            self.crds[(crd.prefix, crd.plural)] = crd
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            del self.objects[key]
        return copy.deepcopy(new)

    async def delete(self, res: Resource, name: str, namespace: str = "", *, propagation: str = "") -> bool:
        self._call("DELETE", res, namespace, name)
        key = self._key(res, name, namespace)
        cur = self.objects.get(key)
        if cur is None:
            return False
        if cur["metadata"].get("finalizers") or propagation == "Foreground":
            if not cur["metadata"].get("deletionTimestamp"):
                # marked for deletion: a new resourceVersion and generation, as the API server gives
                cur["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
                cur["metadata"]["resourceVersion"] = str(next(self._rv))
                cur["metadata"]["generation"] = cur["metadata"].get("generation", 1) + 1
        else:
            del self.objects[key]
        return True


_PROJECT_CRDS = project_crds()


class FakeProvider:
    """A control plane: numbered keys, a set of devices, an on/off switch for outages."""

    name = "fake"

    def __init__(self, log: list | None = None) -> None:
        self.log = log if log is not None else []
        self.keys: list[tuple[str, tuple[str, ...]]] = []
        self.deleted: list[str] = []
        self.down = False
        self.tags: dict[str, tuple[str, ...]] = {}     # registered devices' tags; a device not here is unknown
        self.refused_tags: set[str] = set()             # tags the control plane's policy does not permit

    async def create_auth_key(self, tags: tuple[str, ...], *, description: str = "") -> str:
        from controller.providers import ProviderError
        if self.down:
            raise ProviderError("fake: creating an auth key: control plane unreachable (ConnectError)")
        key = f"tskey-auth-k{len(self.keys) + 1}-SECRETPART"
        self.keys.append((key, tuple(tags)))
        self.log.append(("mint", tuple(tags)))
        return key

    async def delete_device(self, device_id: str) -> bool:
        """Whether there was a device to delete (a registered one), as the real providers answer
        (tests/support/provider_contract.py); every deletion of an ID is recorded in `deleted`, registered or
        not (the controller does not act on the answer)."""
        from controller.providers import ProviderError
        if self.down:
            raise ProviderError("fake: deleting a device: control plane unreachable")
        if not (device_id.isascii() and device_id.isalnum()):
            return False        # not an ID (a damaged state Secret): names no device
        self.deleted.append(device_id)
        self.log.append(("delete-device", device_id))
        return self.tags.pop(device_id, None) is not None

    async def device_tags(self, device_id: str) -> tuple[str, ...] | None:
        from controller.providers import ProviderError
        if self.down:
            raise ProviderError("fake: reading a device: control plane unreachable")
        self.log.append(("read-tags", device_id))
        return tuple(sorted(self.tags[device_id])) if device_id in self.tags else None

    async def set_device_tags(self, device_id: str, tags: tuple[str, ...]) -> None:
        from controller.providers import ProviderError
        if self.down:
            raise ProviderError("fake: setting device tags: control plane unreachable")
        if bad := sorted(set(tags) & self.refused_tags):
            raise ProviderError(f"fake: setting the tags of device {device_id}: HTTP 400: requested tags {bad} "
                                f"are invalid or not permitted", transient=False)
        self.tags[device_id] = tuple(tags)
        self.log.append(("set-tags", device_id, tuple(tags)))

    async def aclose(self) -> None:
        return None


def secret_data(kube: FakeKube, name: str, namespace: str = "tailscale") -> dict[str, bytes]:
    """A Secret's data, decoded ({} when it has none)."""
    s = kube.obj(SECRETS, name, namespace) or {}
    return {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}


def agent_writes(kube: FakeKube, name: str, patch: Mapping[str, bytes | None], namespace: str = "tailscale") -> None:
    """What a proxy's agent does to its state Secret (outside the controller): set keys, None removes one."""
    s = kube.obj(SECRETS, name, namespace)
    assert s is not None, f"no Secret {namespace}/{name}"
    data = dict(s.get("data") or {})
    for k, v in patch.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = base64.b64encode(v).decode()
    s["data"] = data
