"""Taking over the proxies upstream's operator made: which device to keep, what to stop first (pure, no I/O).

Upstream's operator (tailscale.com v1.102.3, cmd/k8s-operator/sts.go) names a parent's headless Service and
StatefulSet `ts-<parent>-<5 random chars>` (`generateName`) and its replicas' state Secrets `<that>-<i>`, with
the same four labels this controller puts on its own children (`tailscale.com/managed`,
`tailscale.com/parent-resource`, `-ns`, `-type`). Its Pods run containerboot with `TS_KUBE_SECRET=$(POD_NAME)`,
so tailscaled keeps the device's identity in that Secret: `_machinekey`, `_current-profile` naming a
`profile-<id>` key (the prefs, with the node key under `Config.PrivateNodeKey` and the `ControlURL`),
`_profiles`, plus containerboot's `device_id`, `device_fqdn`, `device_ips`. This controller names the same
objects `ts-<parent>-<5 chars of a hash of the parent's UID>` (controller/render.py), so the two never share a
name: children with the parent's labels and another base name are upstream's.

How a device is kept: its state is **copied** into this controller's own state Secret, in the single request
that creates that Secret (so the Secret is either absent or whole), rather than running the new StatefulSet
under upstream's random name. Every pass derives the proxy's names from the parent's UID (status read-back,
the proxy's Role that allows only its own Secrets by name, cleanup, the metrics Service, the egress Service's
ExternalName); an adopted name would have to be stored and looked up in all of them.

The order keeps one node key on one Pod at a time: (1) upstream's StatefulSet is deleted with foreground
propagation and nothing of ours is written until it is gone (its Pods have stopped: tailscaled can no longer
change the state); (2) the state is read then, checked, and copied as this controller creates its Secret;
(3) its StatefulSet starts a Pod that logs in with that state (no auth key minted: the copy has `device_id`);
(4) upstream's Secrets and headless Service are deleted once this controller's replica has started on the
device (`pod_uid` written, the same `device_id`), the device itself kept. The proxy is down from (1) to (3).

Not adopted, and said in an event (the parent then gets a new device, upstream's device deleted on the same
control plane so that the new one can take its name): a replica whose Secret holds no logged-in profile (no
device to keep), one logged in to another control server than this controller's (`ServerURL`/`ControlURL`), one
whose tailnet hostname differs from the one this controller configures (tailscaled would rename the device),
several upstream proxies for one parent. ProxyGroups are not parents of this module (their proxies are
replaced, docs/install-tailscale.md).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tscommon import jsontext
from tscommon import secretcontract as sc

#: Event reasons: a device taken over, and a proxy of upstream's replaced by a new device.
REASON_ADOPTED = "UpstreamProxyAdopted"
REASON_NOT_ADOPTED = "UpstreamProxyNotAdopted"

#: Keys never copied: the config the controller writes itself, and what the running Pod writes about itself.
_NOT_COPIED = {sc.KEY_SERVE_CONFIG, sc.KEY_POD_UID, sc.KEY_CAPVER, sc.KEY_AUTHKEY, sc.KEY_REISSUE_AUTHKEY,
               sc.KEY_REISSUE_REQUESTED_AT, sc.KEY_REISSUE_ATTEMPTS}
_CAP_KEY = re.compile(r"^cap-(\d+)\.hujson$")
_ORDINAL = re.compile(r"^(?P<base>.+)-(?P<i>\d+)$")


@dataclass(frozen=True)
class Found:
    """A parent's children in the proxies' namespace, as listed by its labels (names, and Secrets' data)."""

    statefulsets: tuple[tuple[str, bool], ...] = ()          # (name, being deleted)
    secrets: tuple[tuple[str, Mapping[str, bytes]], ...] = ()
    services: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """What the pass does about upstream's children before (and after) its own proxy.

    `wait`: upstream's StatefulSet is still there (`stop` names those to delete now): write nothing of ours.
    `copies[i]`: the state to put into replica i's new Secret. `drop_secrets`: upstream's Secrets to delete
    keeping their devices; `retire_secrets`: to delete with their devices (same control plane, not adopted);
    `forget_secrets`: to delete leaving their devices (another control plane: not ours to delete).
    """

    upstream: bool = False
    wait: bool = False
    stop: tuple[str, ...] = ()
    copies: Mapping[int, Mapping[str, bytes]] = field(default_factory=dict, hash=False)
    drop_secrets: tuple[str, ...] = ()
    retire_secrets: tuple[str, ...] = ()
    forget_secrets: tuple[str, ...] = ()
    delete_services: tuple[str, ...] = ()
    events: tuple[tuple[str, str, str], ...] = ()             # (type, reason, message)


def is_ours(name: str, base: str) -> bool:
    """Whether a child's name is one this controller renders for the parent (base, base-<i>, base-metrics)."""
    return name == base or name == f"{base}-metrics" or bool(re.fullmatch(re.escape(base) + r"-\d+", name))


def foreign(found: Found, base: str) -> Found:
    """The children that are not this controller's: upstream's."""
    return Found(tuple(s for s in found.statefulsets if not is_ours(s[0], base)),
                 tuple(s for s in found.secrets if not is_ours(s[0], base)),
                 tuple(s for s in found.services if not is_ours(s, base)))


def _text(data: Mapping[str, bytes], key: str) -> str:
    return (data.get(key) or b"").decode(errors="replace").strip()


def current_profile(data: Mapping[str, bytes]) -> dict[str, Any] | None:
    """The prefs of the profile tailscaled is logged in with, or None (no profile, unreadable)."""
    key = _text(data, sc.KEY_CURRENT_PROFILE)
    if not key.startswith(sc.PROFILE_PREFIX) or not data.get(key):
        return None
    try:
        prefs = jsontext.loads(data[key])
    except ValueError:
        return None
    return prefs if isinstance(prefs, dict) else None


def logged_in(data: Mapping[str, bytes]) -> bool:
    """A device to keep: tailscaled's machine key and a current profile holding a node key. containerboot's
    `device_id` is not required: upstream's containerboot clears it each time it starts, until it is logged in
    again, so a Pod that stopped while starting leaves a device without it."""
    prefs = current_profile(data)
    if not data.get(sc.KEY_MACHINE_KEY) or prefs is None:
        return False
    persist = prefs.get("Config")
    key = persist.get("PrivateNodeKey") if isinstance(persist, dict) else None
    return isinstance(key, str) and key.startswith("privkey:") and key.rstrip("0") != "privkey:"


def latest_config(data: Mapping[str, bytes]) -> dict[str, Any]:
    """The tailscaled config of the highest capability version in the Secret ({} when none is readable)."""
    caps = sorted(((int(m.group(1)), k) for k in data if (m := _CAP_KEY.match(k)) and data[k]), reverse=True)
    for _, k in caps:
        try:
            conf = jsontext.loads(data[k])
        except ValueError:
            continue
        if isinstance(conf, dict):
            return conf
    return {}


def control_url(data: Mapping[str, bytes], default: str) -> str:
    """The control server the device logged in to: its profile's ControlURL, else its config's ServerURL,
    else `default` (Tailscale's, as tailscaled defaults)."""
    prefs = current_profile(data) or {}
    url = prefs.get("ControlURL") or latest_config(data).get("ServerURL") or default
    return str(url).rstrip("/")


def state(data: Mapping[str, bytes]) -> dict[str, bytes]:
    """What moves into this controller's Secret: tailscaled's state and the device's id, name and addresses."""
    return {k: v for k, v in data.items() if k not in _NOT_COPIED and not _CAP_KEY.match(k)}


def _by_base(secrets: Sequence[tuple[str, Mapping[str, bytes]]]) -> dict[str, dict[int, Mapping[str, bytes]]]:
    out: dict[str, dict[int, Mapping[str, bytes]]] = {}
    for name, data in secrets:
        m = _ORDINAL.match(name)
        if m:
            out.setdefault(m.group("base"), {})[int(m.group("i"))] = data
    return out


def plan(found: Found, *, base: str, hostnames: Sequence[str], server_url: str, default_server: str,
         ours: Mapping[int, Mapping[str, bytes] | None]) -> Plan:
    """What to do about upstream's children of one parent.

    `found`: every child with the parent's labels; `base`: this controller's base name for it; `hostnames[i]`:
    the tailnet hostname this controller gives replica i; `server_url`: its control server; `ours[i]`: replica
    i's Secret of this controller (None when it does not exist yet)."""
    up = foreign(found, base)
    if not (up.statefulsets or up.secrets or up.services):
        return Plan()
    server = server_url.rstrip("/")
    have_ours = any(d is not None for d in ours.values())
    if up.statefulsets:
        # Nothing of ours starts while a Pod of upstream's may run: the same node key on two Pods would fight
        # over the device, and its state can still change until the Pod is gone.
        stop = tuple(n for n, deleting in up.statefulsets if not deleting)
        return Plan(upstream=True, wait=True, stop=stop)
    if have_ours:
        return _after(up, server, default_server, ours)
    groups = _by_base(up.secrets)
    events: list[tuple[str, str, str]] = []
    copies: dict[int, Mapping[str, bytes]] = {}
    keep: set[str] = set()
    if len(groups) > 1:
        events.append(("Warning", REASON_NOT_ADOPTED,
                       f"upstream's operator left {len(groups)} proxies for this object "
                       f"({', '.join(sorted(groups))}); none is taken over: this controller's proxy is a new "
                       "device"))
    elif groups:
        (ubase, replicas), = groups.items()
        for i, hostname in enumerate(hostnames):
            data = replicas.get(i)
            if data is None or not logged_in(data):
                continue
            why = _why_not(data, hostname, server, default_server)
            if why:
                events.append(("Warning", REASON_NOT_ADOPTED,
                               f"the device of upstream's proxy {ubase}-{i} is not taken over: {why}; this "
                               "controller's replica logs in as a new device"))
                continue
            copies[i] = state(data)
            keep.add(f"{ubase}-{i}")
            fqdn = sc.parse_device_fqdn(data.get(sc.KEY_DEVICE_FQDN)) or hostname
            ips = ", ".join(sc.parse_device_ips(data.get(sc.KEY_DEVICE_IPS))) or "its addresses"
            events.append(("Normal", REASON_ADOPTED,
                           f"the device of upstream's proxy {ubase}-{i} ({fqdn}, {ips}) is taken over: its state "
                           "is copied into this controller's Secret, no new device"))
    # the adopted replicas' Secrets stay until this controller's Pods run on their devices (`_after`)
    retire, forget = _sort_rest(up, keep, server, default_server)
    return Plan(upstream=True, copies=copies, retire_secrets=retire, forget_secrets=forget,
                delete_services=up.services, events=tuple(events))


def _why_not(data: Mapping[str, bytes], hostname: str, server: str, default_server: str) -> str:
    url = control_url(data, default_server)
    if url != server:
        return (f"it is logged in to {url}, this controller's control server is {server} (a device cannot move "
                "between control servers)")
    theirs = str(latest_config(data).get("Hostname") or "")
    if theirs and theirs != hostname:
        return (f"its hostname is {theirs!r} and this controller names the device {hostname!r} (set the "
                "tailscale.com/hostname annotation or spec.hostname to keep the name)")
    return ""


def _sort_rest(up: Found, keep: set[str], server: str,
               default_server: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Upstream's Secrets but the adopted ones: to retire with their device (this control plane) or to delete
    leaving the device (another control plane's, which this controller cannot reach)."""
    retire, forget = [], []
    for name, data in up.secrets:
        if name in keep:
            continue
        if data.get(sc.KEY_DEVICE_ID) and control_url(data, default_server) != server:
            forget.append(name)
        else:
            retire.append(name)
    return tuple(sorted(retire)), tuple(sorted(forget))


def _after(up: Found, server: str, default_server: str, ours: Mapping[int, Mapping[str, bytes] | None]) -> Plan:
    """This controller's proxy exists: upstream's Secrets go once they are no longer needed. One whose device a
    replica of ours runs (same `device_id`) is deleted keeping the device, once that replica's Pod has started
    on it (`pod_uid` written: until then it is the way back); the others as when nothing was adopted."""
    ids = {_text(d, sc.KEY_DEVICE_ID): d for d in ours.values() if d is not None and _text(d, sc.KEY_DEVICE_ID)}
    drop, pending = [], set()
    for name, data in up.secrets:
        dev = _text(data, sc.KEY_DEVICE_ID)
        if dev and dev in ids:
            if ids[dev].get(sc.KEY_POD_UID):
                drop.append(name)
            else:
                pending.add(name)
    retire, forget = _sort_rest(Found(secrets=tuple(s for s in up.secrets if s[0] not in pending)),
                                   set(drop), server, default_server)
    return Plan(upstream=True, drop_secrets=tuple(sorted(drop)), retire_secrets=retire, forget_secrets=forget,
                delete_services=up.services)
