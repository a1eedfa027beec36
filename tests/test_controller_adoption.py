"""Taking over upstream's proxies (controller/adoption.py): the decision on upstream's own Secret and StatefulSet
shapes, and whole passes against the in-memory API server: upstream's Pods stop before anything of ours exists,
the device's state moves into this controller's Secret in its create, no key is minted, upstream's Secret goes
once this controller's Pod runs on the device, and the device is never deleted."""
from __future__ import annotations

import base64
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from controller import adoption
from controller.config import TAILSCALE_LOGIN_SERVER, ControllerConfig
from controller.kubeapi import CONNECTORS, EVENTS, INGRESSES, SECRETS, SERVICES, STATEFULSETS
from controller.model import Parent
from controller.passes.parents import CLEANUP_RECHECK
from controller.reconcile import Reconciler
from controller.render import base_name
from tests.support.fakekube import FakeKube, FakeProvider, agent_writes, secret_data

SERVER = "http://hs.test:8080"
CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1", login_server=SERVER)
NODE_KEY = "privkey:" + "ab" * 32


def labels(name: str, ns: str = "apps", typ: str = "svc") -> dict:
    return {"tailscale.com/managed": "true", "tailscale.com/parent-resource": name,
            "tailscale.com/parent-resource-ns": ns, "tailscale.com/parent-resource-type": typ}


def upstream_state(*, hostname: str = "apps-web", server: str = SERVER, device: str = "7",
                   node_key: str = NODE_KEY) -> dict[str, bytes]:
    """A state Secret's data as upstream's operator (cap-*.hujson: json.Marshal of ipn.ConfigVAlpha, opt.Bool as
    JSON booleans), its Go containerboot (device_*, pod_uid, tailscale_capver) and tailscaled's kube store
    (_machinekey, profiles) leave it once its proxy is logged in."""
    conf = {"Version": "alpha0", "Locked": False, "ServerURL": server, "Hostname": hostname,
            "AcceptDNS": False, "AcceptRoutes": False, "NoStatefulFiltering": True}
    prefs = {"ControlURL": server, "RouteAll": False, "WantRunning": True, "Hostname": hostname,
             "Config": {"PrivateNodeKey": node_key, "OldPrivateNodeKey": "privkey:" + "0" * 64,
                        "UserProfile": {"ID": 1, "LoginName": "tagged-devices"}, "NodeID": "n" + device}}
    return {"cap-95.hujson": json.dumps(conf).encode(),
            "cap-107.hujson": json.dumps({**conf, "AppConnector": {"Advertise": False}}).encode(),
            "_machinekey": b"privkey:" + b"cd" * 32,
            "_current-profile": b"profile-1a2b",
            "_profiles": json.dumps({"1a2b": {"ID": "1a2b", "Name": "tagged-devices",
                                              "ControlURL": server}}).encode(),
            "profile-1a2b": json.dumps(prefs).encode(),
            "device_id": device.encode(), "device_fqdn": f"{hostname}.tail.test.".encode(),
            "device_ips": b'["100.64.0.9","fd7a:115c:a1e0::9"]', "pod_uid": b"uid-of-upstreams-pod",
            "tailscale_capver": b"133"}


def put_upstream(kube: FakeKube, base: str = "ts-web-x7k2p", *, parent: str = "web", uid: str, ns: str = "apps",
                 typ: str = "svc", data: dict[str, bytes] | None = None, replicas: int = 1) -> None:
    """Upstream's children of a parent: headless Service, StatefulSet (its name) and one Secret per replica."""
    lab = labels(parent, ns, typ)
    kube.put(SERVICES, {"metadata": {"name": base, "namespace": "tailscale", "labels": lab},
                        "spec": {"clusterIP": "None", "selector": {"app": uid}}})
    kube.put(STATEFULSETS, {"metadata": {"name": base, "namespace": "tailscale", "labels": lab},
                            "spec": {"replicas": replicas, "serviceName": base,
                                     "selector": {"matchLabels": {"app": uid}}}})
    for i in range(replicas):
        d = data if data is not None else upstream_state()
        kube.put(SECRETS, {"metadata": {"name": f"{base}-{i}", "namespace": "tailscale", "labels": lab},
                           "data": {k: base64.b64encode(v).decode() for k, v in d.items()}})


# ---- the decision


def found(data: dict[str, bytes], *, sts: tuple = (), base: str = "ts-web-x7k2p") -> adoption.Found:
    return adoption.Found(sts, ((f"{base}-0", data),), (base,))


def decide(f: adoption.Found, ours=None, hostname="apps-web", server=SERVER) -> adoption.Plan:
    return adoption.plan(f, base="ts-web-abcde", hostnames=[hostname], server_url=server,
                         default_server=TAILSCALE_LOGIN_SERVER, ours=ours or {0: None})


def test_a_logged_in_upstream_proxy_is_adopted_once_its_pods_are_gone():
    data = upstream_state()
    waiting = decide(found(data, sts=(("ts-web-x7k2p", False),)))
    assert (waiting.wait, waiting.stop, dict(waiting.copies)) == (True, ("ts-web-x7k2p",), {})
    assert decide(found(data, sts=(("ts-web-x7k2p", True),))).stop == ()      # already going: no second delete
    p = decide(found(data))
    assert not p.wait
    copied = p.copies[0]
    # tailscaled's state and the device's id, name and addresses; not the config nor the old Pod's own keys
    assert set(copied) == {"_machinekey", "_current-profile", "_profiles", "profile-1a2b", "device_id",
                           "device_fqdn", "device_ips"}
    assert copied["_machinekey"] == data["_machinekey"] and copied["profile-1a2b"] == data["profile-1a2b"]
    assert (p.drop_secrets, p.retire_secrets, p.forget_secrets) == ((), (), ())   # kept until ours runs
    assert p.delete_services == ("ts-web-x7k2p",)
    ((etype, reason, msg),) = p.events
    assert (etype, reason) == ("Normal", "UpstreamProxyAdopted")
    assert "ts-web-x7k2p-0" in msg and "apps-web.tail.test" in msg and "100.64.0.9" in msg
    assert NODE_KEY not in msg and "privkey" not in msg


def test_children_of_this_controller_are_not_upstreams():
    ours = adoption.Found((("ts-web-abcde", False),), (("ts-web-abcde-0", {}),),
                          ("ts-web-abcde", "ts-web-abcde-metrics"))
    assert decide(ours) == adoption.Plan()


@pytest.mark.parametrize("change, why", [
    (dict(server="https://controlplane.tailscale.com"), "logged in to https://controlplane.tailscale.com"),
    (dict(hostname="web-old"), "its hostname is 'web-old'"),
])
def test_a_device_that_cannot_be_kept_is_replaced_and_the_event_says_why(change, why):
    data = upstream_state(**change)
    p = decide(found(data))
    assert dict(p.copies) == {}
    ((etype, reason, msg),) = p.events
    assert (etype, reason) == ("Warning", "UpstreamProxyNotAdopted") and why in msg and "new device" in msg
    if "server" in change:      # another control plane's device: deleted here would be someone else's id
        assert (p.forget_secrets, p.retire_secrets) == (("ts-web-x7k2p-0",), ())
    else:                       # the same control plane: the old device goes, so the new one gets its name
        assert (p.forget_secrets, p.retire_secrets) == ((), ("ts-web-x7k2p-0",))


@pytest.mark.parametrize("drop", ["_machinekey", "_current-profile", "profile-1a2b"])
def test_a_secret_without_a_logged_in_profile_has_nothing_to_keep(drop):
    data = {k: v for k, v in upstream_state().items() if k != drop}
    assert not adoption.logged_in(data)
    p = decide(found(data))
    assert dict(p.copies) == {} and p.events == () and p.retire_secrets == ("ts-web-x7k2p-0",)


def test_a_zero_node_key_is_not_a_login():
    assert not adoption.logged_in(upstream_state(node_key="privkey:" + "0" * 64))


def test_missing_server_url_means_tailscales_control_plane():
    data = upstream_state()
    prefs = json.loads(data["profile-1a2b"])
    del prefs["ControlURL"]
    conf = json.loads(data["cap-107.hujson"])
    del conf["ServerURL"]
    data.update({"profile-1a2b": json.dumps(prefs).encode(), "cap-107.hujson": json.dumps(conf).encode()})
    del data["cap-95.hujson"]
    assert adoption.control_url(data, TAILSCALE_LOGIN_SERVER) == TAILSCALE_LOGIN_SERVER
    assert dict(decide(found(data), server=TAILSCALE_LOGIN_SERVER + "/").copies)


def test_two_upstream_proxies_for_one_parent_are_both_replaced():
    f = adoption.Found((), (("ts-web-aaaaa-0", upstream_state()), ("ts-web-bbbbb-0", upstream_state(device="8"))))
    p = decide(f)
    assert dict(p.copies) == {} and p.events[0][1] == "UpstreamProxyNotAdopted"
    assert p.retire_secrets == ("ts-web-aaaaa-0", "ts-web-bbbbb-0")


def test_upstreams_secret_goes_once_this_controllers_pod_runs_on_the_device():
    data = upstream_state()
    copied = adoption.state(data)
    assert decide(found(data), ours={0: copied}).drop_secrets == ()
    running = {**copied, "pod_uid": b"uid-of-our-pod"}
    p = decide(found(data), ours={0: running})
    assert (p.drop_secrets, p.retire_secrets, p.copies, p.events) == (("ts-web-x7k2p-0",), (), {}, ())


# ---- whole passes


@pytest.fixture
def env():
    log: list = []
    kube, prov = FakeKube(log), FakeProvider(log)
    clock = iter(f"2026-01-01T00:00:{i:02d}Z" for i in range(60))
    return kube, prov, Reconciler(kube, prov, CFG, now=lambda: next(clock)), log


def expose(kube: FakeKube) -> dict:
    return kube.put(SERVICES, {"metadata": {"name": "web", "namespace": "apps",
                                            "annotations": {"tailscale.com/expose": "true"}},
                               "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"]}})


def events(kube: FakeKube) -> list[tuple[str, str, str]]:
    return [(e["type"], e["reason"], e["message"]) for e in kube.of(EVENTS)]


async def test_an_exposed_service_keeps_upstreams_device(env):
    kube, prov, rec, log = env
    uid = expose(kube)["metadata"]["uid"]
    put_upstream(kube, uid=uid)
    ours = base_name(Parent("svc", "web", "apps", uid))

    # 1. upstream's StatefulSet goes first (foreground: its Pods stop); nothing of ours meanwhile
    assert await rec.reconcile("svc", "apps", "web") == CLEANUP_RECHECK
    assert kube.obj(STATEFULSETS, "ts-web-x7k2p", "tailscale")["metadata"]["deletionTimestamp"]
    assert kube.obj(SECRETS, f"{ours}-0", "tailscale") is None and kube.obj(STATEFULSETS, ours, "tailscale") is None
    assert "upstream's operator's proxy to stop" in kube.obj(SERVICES, "web", "apps")["status"]["conditions"][0][
        "message"]
    assert await rec.reconcile("svc", "apps", "web") == CLEANUP_RECHECK         # still going
    kube.finish_deletions()

    # 2. the state is copied into our Secret as it is created; no key minted, the device kept
    await rec.reconcile("svc", "apps", "web")
    assert prov.keys == [] and not [e for e in log if e[0] == "delete-device"]
    creates = [c for c in kube.calls if c[:2] == ("POST", "secrets")]
    assert len(creates) == 1
    data = secret_data(kube, f"{ours}-0")
    up = upstream_state()
    for k in ("_machinekey", "_current-profile", "_profiles", "profile-1a2b", "device_id", "device_ips"):
        assert data[k] == up[k], k
    assert "pod_uid" not in data and "AuthKey" not in json.loads(data["cap-107.hujson"])
    assert json.loads(data["cap-107.hujson"])["Hostname"] == "apps-web"
    assert kube.obj(STATEFULSETS, ours, "tailscale") is not None
    assert kube.obj(SERVICES, "ts-web-x7k2p", "tailscale") is None
    assert kube.obj(SECRETS, "ts-web-x7k2p-0", "tailscale") is not None         # the way back, until ours runs
    assert [e[:2] for e in events(kube)] == [("Normal", "UpstreamProxyAdopted")]

    # 3. our Pod starts on the device: upstream's Secret goes, the device stays
    agent_writes(kube, f"{ours}-0", {"pod_uid": b"uid-of-our-pod"})
    await rec.reconcile("svc", "apps", "web")
    assert kube.obj(SECRETS, "ts-web-x7k2p-0", "tailscale") is None
    assert not [e for e in log if e[0] == "delete-device"] and prov.keys == []
    kube.calls.clear()
    await rec.reconcile("svc", "apps", "web")
    lists = [c for c in kube.calls if c[1] in ("statefulsets", "services") and c[3] == ""]
    assert lists == [], "a steady pass lists no StatefulSets or Services to look for upstream's"


async def test_a_device_whose_id_upstreams_containerboot_cleared_is_kept_without_a_key(env):
    kube, prov, rec, log = env
    uid = expose(kube)["metadata"]["uid"]
    put_upstream(kube, uid=uid, data={k: v for k, v in upstream_state().items()
                                      if k not in ("device_id", "device_fqdn", "device_ips")})
    await rec.reconcile("svc", "apps", "web")
    kube.finish_deletions()
    await rec.reconcile("svc", "apps", "web")
    data = secret_data(kube, f"{base_name(Parent('svc', 'web', 'apps', uid))}-0")
    assert data["profile-1a2b"] == upstream_state()["profile-1a2b"]
    assert prov.keys == [] and "AuthKey" not in json.loads(data["cap-107.hujson"])


async def test_a_connector_of_another_control_plane_gets_a_new_device_and_the_old_one_is_left(env):
    kube, prov, rec, log = env
    conn = kube.put(CONNECTORS, {"apiVersion": "tailscale.com/v1alpha1", "kind": "Connector",
                                 "metadata": {"name": "prod"}, "spec": {"exitNode": True}})
    uid = conn["metadata"]["uid"]
    put_upstream(kube, "ts-prod-q9w8e", parent="prod", ns="", typ="connector", uid=uid,
                 data=upstream_state(hostname="prod-connector", server=TAILSCALE_LOGIN_SERVER))
    await rec.reconcile("connector", "", "prod")
    kube.finish_deletions()
    await rec.reconcile("connector", "", "prod")
    ours = base_name(Parent("connector", "prod", "", uid))
    assert len(prov.keys) == 1 and not [e for e in log if e[0] == "delete-device"]
    assert "_machinekey" not in secret_data(kube, f"{ours}-0")
    assert kube.obj(SECRETS, "ts-prod-q9w8e-0", "tailscale") is None
    ((etype, reason, msg),) = [e for e in events(kube) if e[1].startswith("Upstream")]
    assert (etype, reason) == ("Warning", "UpstreamProxyNotAdopted") and TAILSCALE_LOGIN_SERVER in msg


async def test_a_connectors_two_replicas_keep_their_devices(env):
    kube, prov, rec, log = env
    conn = kube.put(CONNECTORS, {"apiVersion": "tailscale.com/v1alpha1", "kind": "Connector",
                                 "metadata": {"name": "prod"},
                                 "spec": {"replicas": 2, "hostnamePrefix": "prod",
                                          "subnetRouter": {"advertiseRoutes": ["10.40.0.0/16"]}}})
    uid = conn["metadata"]["uid"]
    put_upstream(kube, "ts-prod-q9w8e", parent="prod", ns="", typ="connector", uid=uid, replicas=0)
    for i in range(2):
        d = upstream_state(hostname=f"prod-{i}", device=str(20 + i))
        kube.put(SECRETS, {"metadata": {"name": f"ts-prod-q9w8e-{i}", "namespace": "tailscale",
                                        "labels": labels("prod", "", "connector")},
                           "data": {k: base64.b64encode(v).decode() for k, v in d.items()}})
    await rec.reconcile("connector", "", "prod")
    kube.finish_deletions()
    await rec.reconcile("connector", "", "prod")
    ours = base_name(Parent("connector", "prod", "", uid))
    assert prov.keys == []
    assert [secret_data(kube, f"{ours}-{i}")["device_id"] for i in range(2)] == [b"20", b"21"]
    assert [e[1] for e in events(kube) if e[1].startswith("Upstream")] == ["UpstreamProxyAdopted"] * 2


async def test_an_ingress_keeps_upstreams_device(env):
    kube, prov, rec, log = env
    kube.put(SERVICES, {"metadata": {"name": "be", "namespace": "apps"},
                        "spec": {"clusterIP": "10.96.0.20", "ports": [{"port": 80}]}})
    ing = kube.put(INGRESSES, {"metadata": {"name": "web", "namespace": "apps"},
                               "spec": {"ingressClassName": "tailscale",
                                        "defaultBackend": {"service": {"name": "be", "port": {"number": 80}}}}})
    uid = ing["metadata"]["uid"]
    # upstream names an Ingress's device <namespace>-<name>-ingress without a TLS host, as this controller does
    put_upstream(kube, "ts-web-r4t5y", typ="ingress", uid=uid, data=upstream_state(hostname="apps-web-ingress"))
    assert await rec.reconcile("ingress", "apps", "web") == CLEANUP_RECHECK    # upstream's Pods stop first
    kube.finish_deletions()
    await rec.reconcile("ingress", "apps", "web")
    ours = base_name(Parent("ingress", "web", "apps", uid))
    data = secret_data(kube, f"{ours}-0")
    assert prov.keys == [] and not [e for e in log if e[0] == "delete-device"]
    for k in ("_machinekey", "_current-profile", "profile-1a2b", "device_id"):
        assert data[k] == upstream_state(hostname="apps-web-ingress")[k], k
    assert [e[:2] for e in events(kube) if e[1].startswith("Upstream")] == [("Normal", "UpstreamProxyAdopted")]
