"""The state Secret contract (spec 4.13) as pure functions: what to write, and how to read what is there.

Every ``*_patch`` function returns ``dict[str, bytes | None]`` for ``KubeClient.patch_secret`` (a strategic
merge patch: ``None`` deletes the key). Nothing here does I/O, so every key's value in every phase (first boot,
restart, reissue request and clear, shutdown consistency) is unit-tested directly.

Differences from upstream, on purpose:
* ``boot_reset_patch`` also works when the Secret does not exist yet, so ``tailscale_capver`` and ``pod_uid`` are
  written on a first boot too (upstream skips them until the next restart, spec defect 13).
* ``is_consistent`` accepts several ``profile-*`` keys when ``_current-profile`` names one that is present, and a
  lone ``_machinekey`` (upstream waits out the whole shutdown budget in both cases, defect 18).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from tscommon.secretcontract import (  # re-exported too: the agent's callers use ss.KEY_*
    KEY_AUTHKEY,
    KEY_CAPVER,
    KEY_CURRENT_PROFILE,
    KEY_DEVICE_FQDN,
    KEY_DEVICE_ID,
    KEY_DEVICE_IPS,
    KEY_EGRESS_SERVICES,
    KEY_HTTPS_ENDPOINT,
    KEY_INGRESS_CONFIG,
    KEY_MACHINE_KEY,
    KEY_POD_UID,
    KEY_PROFILES,
    KEY_REISSUE_ATTEMPTS,
    KEY_REISSUE_AUTHKEY,
    KEY_REISSUE_REQUESTED_AT,
    NO_HTTPS,
    PROFILE_PREFIX,
    format_device_fqdn,
    format_device_ips,
)

#: The wait before the second request in a row; it doubles with each further one, up to REISSUE_MAX_DELAY.
REISSUE_BASE_DELAY = 30.0
REISSUE_MAX_DELAY = 600.0

Patch = dict[str, "bytes | None"]


def boot_reset_patch(existing: Mapping[str, bytes] | None, *, capver: int | str | None, pod_uid: str,
                     config_authkey: str) -> Patch:
    """The patch that clears the previous run's agent state at boot.

    existing is the Secret's data, or None when the Secret does not exist yet. In that case the result holds
    only values to set (no deletions), so the agent can use it to create the Secret, or to patch it if
    tailscaled created it in the meantime. device_id/device_fqdn/device_ips are kept so that the operator can
    still clean up the old device; tailscaled's own keys are never touched, except to finish an answered
    reissue request (reissue_clear_patch) that the previous run was killed before clearing.
    capver None (unknown) deletes a stale tailscale_capver rather than keep a possibly wrong one.
    """
    patch: Patch = {KEY_CAPVER: None if capver is None else str(int(capver)).encode()}
    if pod_uid:
        patch[KEY_POD_UID] = pod_uid.encode()
    if existing is None:
        return {k: v for k, v in patch.items() if v is not None}
    for k in (KEY_HTTPS_ENDPOINT, KEY_EGRESS_SERVICES, KEY_INGRESS_CONFIG):
        patch[k] = None
    # Clear the reissue request only once the operator has acted on it: the config now holds a different key.
    # Then clear all of it, the stale identity and tailscaled's login state too: the run that asked would have
    # (reissue_clear_patch) had it not been killed first, and tailscaled has not started yet to read them.
    if reissue_needs_clear(existing, config_authkey):
        patch.update(reissue_clear_patch(existing))
    if KEY_CAPVER not in existing and capver is None:
        del patch[KEY_CAPVER]
    return patch


def _stable_id(node: Any) -> str:
    if isinstance(node, str):
        return node
    return str(node.stable_id)


def device_id_patch(node: Any) -> Patch:
    """device_id = the node's StableID. node is a state.Node (or anything with stable_id) or the ID string."""
    return {KEY_DEVICE_ID: _stable_id(node).encode()}


def device_endpoints_patch(fqdn: str, ips: Iterable[Any] | None) -> Patch:
    """device_fqdn and device_ips, written together after routing is in place."""
    return {KEY_DEVICE_FQDN: format_device_fqdn(fqdn), KEY_DEVICE_IPS: format_device_ips(ips)}


def https_endpoint_patch(value: str | None) -> Patch:
    """https_endpoint = the cert domain without trailing dot, or "no-https"; None deletes it."""
    if value is None:
        return {KEY_HTTPS_ENDPOINT: None}
    return {KEY_HTTPS_ENDPOINT: (value.rstrip(".") or NO_HTTPS).encode()}


def is_consistent(data: Mapping[str, bytes] | None) -> bool:
    """Whether tailscaled's state in the Secret looks complete, so that it is safe to stop tailscaled.

    Consistent: no profile state at all (never logged in; a lone _machinekey is fine, a real tailscaled writes
    it on the first login attempt, and upstream would then wait out the whole shutdown budget), or
    _machinekey, _profiles and _current-profile all present together with the profile they point at. When
    _current-profile is empty or does not name a profile-* key, fall back to upstream's rule: exactly one
    profile-* key.
    """
    data = data or {}
    profiles = [k for k in data if k.startswith(PROFILE_PREFIX)]
    core = [k in data for k in (KEY_CURRENT_PROFILE, KEY_PROFILES, KEY_MACHINE_KEY)]
    if not profiles and KEY_CURRENT_PROFILE not in data and KEY_PROFILES not in data:
        return True
    if not all(core) or not profiles:
        return False
    current = data[KEY_CURRENT_PROFILE].decode(errors="replace").strip()
    if current.startswith(PROFILE_PREFIX):
        return current in data
    return len(profiles) == 1


def reissue_request_patch(old_key: str, *, now: float | None = None,
                          data: Mapping[str, bytes] | None = None) -> Patch:
    """Ask the operator for a new auth key: reissue_authkey = the key that failed (may be "", as upstream).

    With `now` (Unix time), also record the request for the rate limit: its time and the count of requests in
    a row (one more than `data` holds)."""
    patch: Patch = {KEY_REISSUE_AUTHKEY: old_key.encode()}
    if now is not None:
        patch[KEY_REISSUE_REQUESTED_AT] = _rfc3339(now).encode()
        patch[KEY_REISSUE_ATTEMPTS] = str(reissue_attempts(data) + 1).encode()
    return patch


def reissue_attempts(data: Mapping[str, bytes] | None) -> int:
    """Requests in a row recorded in the Secret (0 when absent or unreadable)."""
    raw = (data or {}).get(KEY_REISSUE_ATTEMPTS)
    try:
        return max(0, int(raw.decode())) if raw else 0
    except ValueError:
        return 0


def reissue_delay(data: Mapping[str, bytes] | None, now: float) -> float:
    """Seconds to wait before asking for a new key again. The first request goes at once; after n requests in a
    row without a successful login the next waits until REISSUE_BASE_DELAY * 2^(n-1) (capped) after the last one,
    so a key the control plane keeps rejecting cannot turn the Pod and the operator into a tight loop."""
    n = reissue_attempts(data)
    raw = (data or {}).get(KEY_REISSUE_REQUESTED_AT)
    if n == 0 or not raw:
        return 0.0
    last = _parse_rfc3339(raw.decode(errors="replace"))
    if last is None:
        return 0.0
    interval = min(REISSUE_MAX_DELAY, REISSUE_BASE_DELAY * 2 ** min(n - 1, 16))
    return max(0.0, min(interval, last + interval - now))


def reissue_reset_patch() -> Patch:
    """After a successful login: forget the requests in a row."""
    return {KEY_REISSUE_REQUESTED_AT: None, KEY_REISSUE_ATTEMPTS: None}


def _rfc3339(t: float) -> str:
    import datetime
    return datetime.datetime.fromtimestamp(int(t), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_rfc3339(text: str) -> float | None:
    import datetime
    try:
        return datetime.datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=datetime.timezone.utc).timestamp()
    except ValueError:
        return None


def reissue_clear_patch(data: Mapping[str, bytes] | None) -> Patch:
    """After a new key arrived: drop the request, the stale device identity and tailscaled's login state."""
    patch: Patch = {k: None for k in (KEY_REISSUE_AUTHKEY, KEY_DEVICE_ID, KEY_DEVICE_FQDN, KEY_DEVICE_IPS,
                                      KEY_MACHINE_KEY, KEY_CURRENT_PROFILE, KEY_PROFILES)}
    current = (data or {}).get(KEY_CURRENT_PROFILE)
    if current:
        name = current.decode(errors="replace").strip()
        # Only a profile key is tailscaled's to drop: a damaged _current-profile naming another key (the new
        # authkey, pod_uid) must not delete it.
        if name.startswith(PROFILE_PREFIX):
            patch[name] = None
    return patch


def reissue_needs_clear(data: Mapping[str, bytes] | None, config_authkey: str) -> bool:
    """True if a reissue was requested and the config now carries a different (new) key."""
    old = (data or {}).get(KEY_REISSUE_AUTHKEY)
    return old is not None and bool(config_authkey) and old != config_authkey.encode()


def authkey_from_secret(data: Mapping[str, bytes] | None) -> str:
    """The auth key a user or the operator put in the Secret ("" if none). Whitespace is trimmed."""
    raw = (data or {}).get(KEY_AUTHKEY)
    return raw.decode(errors="replace").strip() if raw else ""


def delete_authkey_ops() -> list[dict]:
    """JSON patch that removes the authkey after login (AuthOnce); a 422 answer means it was already gone."""
    return [{"op": "remove", "path": "/data/" + KEY_AUTHKEY}]
