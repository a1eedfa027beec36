"""Level-triggered application of the serve config to tailscaled, Service advertisement and certificates.

`ServeApplier.converge(desired, cert_domain)` makes tailscaled's serve config equal to `desired` and is safe to
call at any time, as often as wanted (file change, cert-domain change, periodic tick):

1. On the first call it clears whatever serve config tailscaled persisted from an earlier run (POST `{}`), as
   upstream does at startup; that also avoids tailscaled's "cannot change the serve type of a port in place"
   rejection across restarts.
2. If the cert domain is `no-https` and the config needs HTTPS, nothing is applied and the reason is reported
   (tailscaled could not get a certificate; upstream skips silently except for a log line).
3. It GETs the current config and its ETag. Equal (semantically) to the desired one: nothing to do. Otherwise
   it POSTs with `If-Match: <etag>`; a 412 (someone else changed it in between) re-reads and retries, bounded.
   Any other rejection is retried once as clear-then-set (a port changing serve type must be cleared first);
   if the new config is still refused, the config that was in force is restored and the error reported.
   A config that failed is not retried before a backoff (1 s doubling to 5 min) unless it changes.
4. With auto-advertisement on, it makes tailscaled's `AdvertiseServices` pref equal to the Services of the config
   in force -- only when that set changes (upstream re-PATCHes and sleeps 20 s on every netmap). A Service that
   needs a certificate is advertised only once its certificate exists, so no traffic is steered to a replica
   that would fail TLS.
5. It tells the `CertManager` which domains need certificates; those are requested at once (not on the first
   TLS handshake) and retried with backoff.

`converge_text(text, cert_domain)` parses the file content first. A malformed or invalid file is reported
(`ApplyResult.error`, counters, log) and the LAST GOOD config stays in force, re-substituted with the current
cert domain (upstream exits and crash-loops the Pod instead).

The LocalAPI object needs: `get_serve_config() -> (dict | None, etag)`, `set_serve_config(dict, etag)`,
`prefs() -> dict`, `edit_prefs(dict) -> dict`, `cert_pair(domain) -> (cert, key)`. Errors are exceptions with
a `.status` (HTTP status) attribute, like `containerboot.localapi.LocalAPIError`; for 429 an optional
`.retry_after` (seconds) or `.headers["Retry-After"]` is honoured.
"""
from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from serveconfig.model import (
    NO_HTTPS,
    ServeConfig,
    ServeConfigError,
    cert_domains_needed,
    needs_https,
    parse,
    service_cert_domains,
    service_names,
)
from serveconfig.status import ServeStatus
from tscommon import crashpoint
from tscommon.aio import wait_event
from tscommon.redact import redact

log = logging.getLogger("containerboot")

__all__ = ["ApplyResult", "ServeApplier", "ServeLoop", "CertManager", "LocalAPILike", "NO_HTTPS_EXPLANATION"]

NO_HTTPS_EXPLANATION = (
    "serve proxy: this node is configured to serve HTTPS, but TLS certificates cannot be issued because "
    "HTTPS is not enabled for this tailnet (no MagicDNS cert domain). The serve config is NOT applied. "
    "Enable HTTPS for the tailnet (https://tailscale.com/kb/1153/enabling-https) or remove the HTTPS "
    "endpoints from the serve config.")


class LocalAPILike(Protocol):
    async def get_serve_config(self) -> tuple[dict | None, str]: ...
    async def set_serve_config(self, config: dict, etag: str = "") -> None: ...
    async def prefs(self) -> dict: ...
    async def edit_prefs(self, masked: dict) -> dict: ...
    async def cert_pair(self, domain: str) -> tuple[bytes, bytes]: ...


def _status_of(e: BaseException) -> int | None:
    s = getattr(e, "status", None)
    return s if isinstance(s, int) else None


def _errtext(e: BaseException) -> str:
    return redact(str(e) or type(e).__name__)


@dataclass(frozen=True)
class ApplyResult:
    """What one `converge` call found and did. The agent writes `https_endpoint` to the state Secret when it
    is not None and differs from what it last wrote."""

    applied: bool                       # the desired config (or, after a bad file, the last good one) is in force
    changed: bool = False               # this call POSTed a new config
    https_endpoint: str | None = None   # cert domain or "no-https"; None when there is no config at all
    error: str = ""                     # validation or LocalAPI error, "" if none
    skipped: str = ""                   # why the desired config was not applied (e.g. the no-https gate)
    invalid: bool = False               # the file was malformed or invalid (the last good config was used)
    advertised: tuple[str, ...] = ()    # Services advertised after this call (auto-advertisement)
    cert_required: bool = False
    cert_ready: bool = True
    cert_domains: tuple[str, ...] = ()

    def status(self) -> ServeStatus:
        return ServeStatus(applied=self.applied, last_error=self.error or self.skipped,
                           cert_required=self.cert_required, cert_ready=self.cert_ready,
                           https_endpoint=self.https_endpoint or "", advertised=self.advertised)


# --------------------------------------------------------------------------------------------------------
# Certificates.


def _retry_after(e: BaseException, now_wall: Callable[[], float] = time.time) -> float | None:
    ra = getattr(e, "retry_after", None)
    if isinstance(ra, (int, float)) and not isinstance(ra, bool):
        return max(0.0, float(ra))
    headers = getattr(e, "headers", None)
    raw = None
    if isinstance(headers, Mapping):
        raw = next((v for k, v in headers.items() if str(k).lower() == "retry-after"), None)
    if isinstance(ra, str):
        raw = ra
    if not raw:
        return None
    raw = str(raw).strip()
    if raw.isdigit():
        return float(raw)
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now_wall())


class CertManager:
    """Obtains the TLS certificates a serve config needs, ahead of the first TLS handshake.

    One task per domain calls `cert_pair(domain)` (tailscaled issues or returns the cached certificate), retries
    failures with backoff from `initial_backoff` doubling to `max_backoff`, honouring a 429's Retry-After, and
    re-requests every `refresh_interval` (tailscaled renews when needed). `sleep` is injectable for tests."""

    def __init__(self, api: LocalAPILike, *, initial_backoff: float = 1.0, max_backoff: float = 600.0,
                 refresh_interval: float = 24 * 3600.0, max_retry_after: float = 24 * 3600.0,
                 sleep: Callable[[float], Any] = asyncio.sleep,
                 on_change: Callable[[], None] | None = None,
                 counters: dict[str, float] | None = None):
        self._api = api
        self._initial = initial_backoff
        self._max = max_backoff
        self._refresh = refresh_interval
        self._max_retry_after = max_retry_after
        self._sleep = sleep
        self._on_change = on_change
        self._tasks: dict[str, asyncio.Task] = {}
        self._ready: set[str] = set()
        self._errors: dict[str, str] = {}
        self.counters = counters if counters is not None else {}

    def ensure(self, domains: Iterable[str]) -> None:
        """Make sure exactly `domains` have certificate loops (start new ones, stop those no longer needed)."""
        want = {d for d in domains if d and d != NO_HTTPS}
        for d in list(self._tasks):
            if d not in want:
                self._tasks.pop(d).cancel()
                self._ready.discard(d)
                self._errors.pop(d, None)
        for d in sorted(want):
            if d not in self._tasks or self._tasks[d].done():
                self._tasks[d] = asyncio.get_running_loop().create_task(self._loop(d), name=f"cert:{d}")

    def cert_ready(self, domain: str) -> bool:
        return domain in self._ready

    def all_ready(self, domains: Iterable[str]) -> bool:
        return all(d in self._ready for d in domains)

    def last_error(self, domain: str) -> str:
        return self._errors.get(domain, "")

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(sorted(self._tasks))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _count(self, result: str) -> None:
        key = f'containerboot_cert_requests_total{{result="{result}"}}'
        self.counters[key] = self.counters.get(key, 0) + 1

    def _notify(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception:   # a callback bug must not kill the cert loop
                log.exception("cert: on_change callback failed")

    async def _loop(self, domain: str) -> None:
        delay = self._initial
        while True:
            try:
                await self._api.cert_pair(domain)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # every failure is retried
                wait = delay
                if _status_of(e) == 429:
                    ra = _retry_after(e)
                    if ra is not None:
                        wait = min(ra, self._max_retry_after)
                delay = min(delay * 2, self._max)
                msg = _errtext(e)
                self._count("error")
                if self._errors.get(domain) != msg:
                    log.warning("cert: cannot get a certificate for %s (retrying in %.0fs): %s", domain, wait, msg)
                self._errors[domain] = msg
                await self._sleep(wait)
                continue
            self._count("ok")
            self._errors.pop(domain, None)
            delay = self._initial
            if domain not in self._ready:
                self._ready.add(domain)
                log.info("cert: certificate for %s is ready", domain)
                self._notify()
            await self._sleep(self._refresh)


# --------------------------------------------------------------------------------------------------------
# The applier.


class ServeApplier:
    """Converges tailscaled's serve config (and optionally advertised Services and certificates)."""

    def __init__(self, api: LocalAPILike, *, auto_advertise: bool = False, cert_manager: CertManager | None = None,
                 clear_on_start: bool = True, max_conflict_retries: int = 5,
                 retry_initial: float = 1.0, retry_max: float = 300.0,
                 clock: Callable[[], float] = time.monotonic,
                 counters: dict[str, float] | None = None):
        self._api = api
        self._auto_advertise = auto_advertise
        self._certs = cert_manager
        self._need_clear = clear_on_start
        self._max_conflicts = max(1, max_conflict_retries)
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._clock = clock
        self.counters: dict[str, float] = counters if counters is not None else {}
        self._in_force: ServeConfig | None = None     # what we last saw/put in tailscaled
        self._applied: ServeConfig | None = None      # the last desired config that converged successfully
        self._posted: ServeConfig | None = None       # what we last POSTed ...
        self._posted_etag: str | None = None          # ... and the ETag tailscaled reported right after
        self._failed: tuple[ServeConfig, float, float, str] | None = None   # (config, retry_at, delay, error)
        self._advertised: tuple[str, ...] | None = None   # None = not known yet (read prefs first)
        self._good_text: str | None = None
        self._logged: str = ""
        self.last_result: ApplyResult | None = None

    # -- public --------------------------------------------------------------------------------------------

    async def converge_text(self, text: str | None, cert_domain: str) -> ApplyResult:
        """Parse the file content and converge. A bad file keeps the last good config in force."""
        cert_domain = cert_domain or NO_HTTPS
        parse_error = ""
        try:
            desired = parse(text, cert_domain)
            if desired is not None:
                self._good_text = text
            elif text is not None:
                self._log_once("serve proxy: serve config file is empty, skipping")
            else:
                self._log_once("serve proxy: no serve config file, skipping")
        except ServeConfigError as e:
            parse_error = f"invalid serve config: {redact(str(e))}"
            self._count("invalid")
            desired = None
            if self._good_text is not None:
                try:
                    desired = parse(self._good_text, cert_domain)
                except ServeConfigError:   # cannot happen for a text that parsed before; be safe
                    desired = None
            keep = "keeping the last good serve config" if desired is not None else "no serve config applied"
            self._log_once(f"serve proxy: {parse_error}; {keep}", level=logging.ERROR)
        res = await self.converge(desired, cert_domain, _count=not parse_error)
        if parse_error:
            err = parse_error + (f"; {res.error}" if res.error else "")
            res = replace(res, error=err, invalid=True)
            self.last_result = res
        return res

    async def converge(self, desired: ServeConfig | None, cert_domain: str, *, _count: bool = True) -> ApplyResult:
        """Make tailscaled's serve config equal to `desired` (None = no config: change nothing)."""
        cert_domain = cert_domain or NO_HTTPS
        res = await self._converge(desired, cert_domain, _count)
        self.last_result = res
        return res

    async def unadvertise(self) -> None:
        """Withdraw every Service this agent advertised (for shutdown). Waiting for failover is the caller's."""
        if not self._auto_advertise or self._advertised == ():
            return
        await self._api.edit_prefs({"AdvertiseServices": None, "AdvertiseServicesSet": True})
        self._advertised = ()
        log.info("serve proxy: Services unadvertised")

    # -- internals -------------------------------------------------------------------------------------------

    def _count(self, result: str) -> None:
        key = f'containerboot_serve_config_applies_total{{result="{result}"}}'
        self.counters[key] = self.counters.get(key, 0) + 1

    def _log_once(self, msg: str, level: int = logging.INFO) -> None:
        if msg != self._logged:
            log.log(level, "%s", msg)
            self._logged = msg

    def _cert_state(self, cfg: ServeConfig | None) -> tuple[tuple[str, ...], bool, bool]:
        domains = cert_domains_needed(cfg)
        if self._certs is not None:
            self._certs.ensure(domains)
            ready = self._certs.all_ready(domains)
        else:
            ready = True   # nobody to ask; tailscaled issues on demand
        return domains, bool(domains) or needs_https(cfg), ready

    async def _converge(self, desired: ServeConfig | None, cert_domain: str, count: bool) -> ApplyResult:
        if self._need_clear:
            try:
                log.info("serve proxy: unsetting previous config")
                await self._api.set_serve_config({}, "")
            except Exception as e:   # retried on the next converge
                self._count("error")
                return ApplyResult(applied=False, error=f"cannot clear the previous serve config: {_errtext(e)}",
                                   https_endpoint=None)
            self._need_clear = False
            self._in_force = ServeConfig()
            self._posted, self._posted_etag = None, None

        if desired is None:
            # No file (or an empty one): change nothing, as upstream. What we applied before stays in force.
            prev = self._applied
            domains, required, ready = self._cert_state(prev)
            adv = await self._advertise_safely(prev)
            if count:
                self._count("skipped")
            return ApplyResult(applied=prev is not None, skipped="" if prev is not None else "no serve config",
                               https_endpoint=cert_domain if prev is not None else None, advertised=adv,
                               cert_required=required, cert_ready=ready, cert_domains=domains)

        if cert_domain == NO_HTTPS and needs_https(desired):
            self._log_once(NO_HTTPS_EXPLANATION, level=logging.WARNING)
            if count:
                self._count("skipped")
            domains, required, ready = self._cert_state(None)
            return ApplyResult(applied=False, skipped=NO_HTTPS_EXPLANATION, https_endpoint=NO_HTTPS,
                               advertised=self._advertised or (), cert_required=True, cert_ready=False,
                               cert_domains=domains)

        changed = False
        error = ""
        if self._failed is not None and self._failed[0] == desired and self._clock() < self._failed[1]:
            error = self._failed[3]           # same config failed recently: wait for the backoff
        else:
            try:
                changed = await self._set(desired)
                self._applied = desired
                self._failed = None
                if count:
                    self._count("applied" if changed else "unchanged")
            except Exception as e:   # reported, retried with backoff
                error = f"cannot apply the serve config: {_errtext(e)}"
                delay = self._retry_initial
                if self._failed is not None and self._failed[0] == desired:
                    delay = min(self._failed[2] * 2, self._retry_max)
                self._failed = (desired, self._clock() + delay, delay, error)
                if count:
                    self._count("error")
                self._log_once(f"serve proxy: {error} (retrying in {delay:.0f}s)", level=logging.ERROR)

        # A rejected config leaves the previous one in force (restored if need be): like a bad file, that
        # counts as applied, with the error reported, as long as what is in force is our last good config.
        in_force = desired if not error else self._in_force
        applied = not error or (self._applied is not None and in_force == self._applied)
        # Certificates follow the config in force: a transient apply failure must not stop their loops.
        domains, required, ready = self._cert_state(in_force)
        if not applied:
            required, ready = needs_https(desired), False
        adv = await self._advertise_safely(in_force)
        return ApplyResult(applied=applied, changed=changed, https_endpoint=cert_domain, error=error,
                           advertised=adv, cert_required=required, cert_ready=ready, cert_domains=domains)

    async def _set(self, desired: ServeConfig) -> bool:
        """Make tailscaled's config equal `desired`. True if a POST was needed. Raises on failure."""
        body = desired.to_json()
        for _attempt in range(self._max_conflicts):
            raw, etag = await self._api.get_serve_config()
            try:
                current = ServeConfig.from_json(raw)
            except ServeConfigError:
                current = None    # tailscaled's JSON we cannot decode: just overwrite it
            self._in_force = current
            if current == desired or (self._posted == desired and etag and etag == self._posted_etag):
                # Equal, or exactly what we posted (tailscaled may drop fields it does not know).
                self._in_force = desired
                return False
            log.info("serve proxy: applying serve config")
            crashpoint.hit(crashpoint.SERVE_APPLY)
            try:
                await self._api.set_serve_config(body, etag)
            except Exception as e:
                status = _status_of(e)
                if status == 412:
                    log.info("serve proxy: serve config changed concurrently (ETag mismatch), re-reading")
                    self._count("conflict")
                    continue
                if status not in (400, 500):   # transport errors, 401/403: clearing would not help
                    raise
                await self._clear_then_set(body, current, e)
            self._in_force = desired
            self._posted = desired
            try:
                _, self._posted_etag = await self._api.get_serve_config()
            except Exception:   # only an optimisation for the next comparison
                self._posted_etag = None
            return True
        raise RuntimeError(f"serve config kept changing under us ({self._max_conflicts} ETag conflicts)")

    async def _clear_then_set(self, body: dict, current: ServeConfig | None, first: BaseException) -> None:
        """tailscaled refuses to change a port's serve type in place: clear, then set. If the new config is still
        refused, put back what was there so the last good config stays in force."""
        if current is None or current.is_empty():
            raise first
        log.info("serve proxy: serve config rejected (%s); clearing and setting it again", _errtext(first))
        await self._api.set_serve_config({}, "")
        try:
            await self._api.set_serve_config(body, "")
        except Exception as second:
            try:
                await self._api.set_serve_config(current.to_json(), "")
            except Exception as e:
                log.error("serve proxy: cannot restore the previous serve config: %s", _errtext(e))
                self._in_force = ServeConfig()
            raise second

    def _want_advertised(self, cfg: ServeConfig | None) -> tuple[str, ...]:
        names = []
        for name in service_names(cfg):
            if self._certs is not None and not self._certs.all_ready(service_cert_domains(cfg, name)):
                continue   # don't steer traffic here before TLS can be terminated
            names.append(name)
        return tuple(sorted(names))

    async def _advertise_safely(self, cfg: ServeConfig | None) -> tuple[str, ...]:
        if not self._auto_advertise or cfg is None:
            return self._advertised or ()
        try:
            return await self._advertise(self._want_advertised(cfg))
        except Exception as e:   # retried on the next converge
            self._log_once(f"serve proxy: cannot update advertised Services: {_errtext(e)}", level=logging.ERROR)
            self._advertised = None    # re-read prefs next time
            return ()

    async def _advertise(self, want: tuple[str, ...]) -> tuple[str, ...]:
        if self._advertised is None:
            prefs = await self._api.prefs()
            self._advertised = tuple(sorted(prefs.get("AdvertiseServices") or ()))
        if want == self._advertised:
            return want
        log.info("serve proxy: advertising Services %s (was %s)", list(want) or "none",
                 list(self._advertised) or "none")
        await self._api.edit_prefs({"AdvertiseServices": list(want) if want else None,
                                    "AdvertiseServicesSet": True})
        self._advertised = want
        return want


# --------------------------------------------------------------------------------------------------------
# The loop that ties the file watch, the cert domain and the applier together.


class ServeLoop:
    """Runs the serve path: watch the file, converge on every change of file content or cert domain, and
    re-converge periodically (level-triggered: out-of-band changes are reverted, failures retried).

    Start it only once tailscaled is Running with a self node (tailscaled refuses serve configs before).
    `on_result` (sync or async) gets every ApplyResult; the agent uses it to update `/status` and to write
    `https_endpoint` to the state Secret when that value changes."""

    def __init__(self, path: str, applier: ServeApplier, *, cert_domain: str = NO_HTTPS,
                 on_result: Callable[[ApplyResult], Any] | None = None,
                 poll_interval: float = 5.0, resync_interval: float = 30.0, error_retry: float = 1.0):
        self.path = path
        self.applier = applier
        self._cert_domain = cert_domain or NO_HTTPS
        self._on_result = on_result
        self._poll_interval = poll_interval
        self._resync = resync_interval
        self._error_retry = error_retry
        self._wake = asyncio.Event()
        self._text: str | None = None
        self._have_text = asyncio.Event()
        self.last_result: ApplyResult | None = None

    @property
    def cert_domain(self) -> str:
        return self._cert_domain

    def set_cert_domain(self, domain: str) -> None:
        """Call on every self-node change with CertDomains[0] (or "" / "no-https"); wakes the loop on change."""
        domain = domain or NO_HTTPS
        if domain != self._cert_domain:
            log.info("serve proxy: cert domain is now %s", domain)
            self._cert_domain = domain
            self._wake.set()

    def poke(self) -> None:
        """Converge soon (e.g. from CertManager's on_change, so Services are advertised once their cert exists)."""
        self._wake.set()

    async def _follow_file(self) -> None:
        from tscommon.watch import watch_file  # local import: keeps this module importable without watchdog

        async for text in watch_file(self.path, self._poll_interval):
            self._text = text
            self._have_text.set()
            self._wake.set()

    async def run(self) -> None:
        follower = asyncio.get_running_loop().create_task(self._follow_file(), name="serve-config-watch")
        try:
            await self._have_text.wait()
            while True:
                if follower.done():
                    follower.result()   # surface a watcher crash instead of silently stopping
                self._wake.clear()
                res = await self.applier.converge_text(self._text, self._cert_domain)
                self.last_result = res
                if self._on_result is not None:
                    out = self._on_result(res)
                    if asyncio.iscoroutine(out):
                        await out
                timeout = self._error_retry if (res.error and not res.invalid) else self._resync
                await wait_event(self._wake, timeout)
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
