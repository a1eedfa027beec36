"""serveconfig.apply: ETag handling, last-good on a bad file, no-https gate, advertisement, certificates."""
from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import time
from pathlib import Path

import pytest

from serveconfig.apply import NO_HTTPS_EXPLANATION, CertManager, ServeApplier, _retry_after
from serveconfig.model import ServeConfig, parse
from tests.support.waits import until_async

KNOWN_TOP = ("TCP", "Web", "Services", "AllowFunnel", "Foreground")

HTTPS_CFG = """{"TCP":{"443":{"HTTPS":true}},
 "Web":{"${TS_CERT_DOMAIN}:443":{"Handlers":{"/":{"Proxy":"http://10.0.0.5:8080/"}}}}}"""
HTTPS_CFG2 = HTTPS_CFG.replace("10.0.0.5", "10.0.0.6")
HTTP_CFG = """{"TCP":{"80":{"HTTP":true}},
 "Web":{"${TS_CERT_DOMAIN}:80":{"Handlers":{"/":{"Proxy":"http://10.0.0.5:8080/"}}}}}"""
TCP_CFG = '{"TCP":{"443":{"TCPForward":"10.0.0.5:443"}}}'
SVC_CFG = """{"Services":{
  "svc:web":{"TCP":{"443":{"HTTPS":true}},"Web":{"web.tailnet.ts.net:443":{"Handlers":{"/":{"Proxy":"http://10.0.0.9"}}}}},
  "svc:db":{"TCP":{"5432":{"TCPForward":"10.0.0.8:5432"}}}}}"""
DOMAIN = "proxy.tailnet.ts.net"


class FakeError(Exception):
    def __init__(self, msg: str, status: int, retry_after: float | None = None, headers: dict | None = None):
        super().__init__(msg)
        self.status = status
        if retry_after is not None:
            self.retry_after = retry_after
        if headers is not None:
            self.headers = headers


def _port_types(cfg: dict) -> dict[str, str]:
    out = {}
    for port, h in (cfg.get("TCP") or {}).items():
        out[port] = "https" if h.get("HTTPS") else "http" if h.get("HTTP") else "tcp"
    return out


class Backend:
    """An in-memory tailscaled serve-config store with its ETag, If-Match and validation rules."""

    def __init__(self) -> None:
        self.config: dict | None = {"TCP": {"8080": {"HTTP": True}}}     # left over from an earlier run
        self.posts: list[tuple[dict, str]] = []
        self.gets = 0
        self.interfere = 0          # this many POSTs see a concurrent writer first
        self.reject_containing = ""
        self.prefs = {"AdvertiseServices": None}
        self.pref_edits: list[dict] = []

    def etag(self) -> str:
        return hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest()

    def get(self) -> tuple[dict | None, str]:
        self.gets += 1
        return (json.loads(json.dumps(self.config)) if self.config is not None else None), self.etag()

    def post(self, cfg: dict, if_match: str) -> None:
        self.posts.append((cfg, if_match))
        if self.interfere:
            self.interfere -= 1
            self.config = {"TCP": {str(9000 + self.interfere): {"HTTP": True}}}   # someone else wrote meanwhile
        if if_match and if_match != self.etag():
            raise FakeError("412: etag mismatch", 412)
        if self.reject_containing and self.reject_containing in json.dumps(cfg):
            raise FakeError("500: funnel not allowed", 500)
        old = _port_types(self.config or {})
        for port, typ in _port_types(cfg).items():
            if port in old and old[port] != typ:
                raise FakeError(f"500: unable to change serve type of port {port} from {old[port]} to {typ}", 500)
        # tailscaled (Go) drops the fields it does not know.
        self.config = {k: v for k, v in cfg.items() if k in KNOWN_TOP}


class FakeAPI:
    def __init__(self, backend: Backend) -> None:
        self.b = backend
        self.cert_script: list = []    # per call: exception to raise, or None for success
        self.cert_calls: list[str] = []

    async def get_serve_config(self):
        return self.b.get()

    async def set_serve_config(self, config: dict, etag: str = "") -> None:
        self.b.post(config, etag)

    async def prefs(self) -> dict:
        return dict(self.b.prefs)

    async def edit_prefs(self, masked: dict) -> dict:
        self.b.pref_edits.append(masked)
        if masked.get("AdvertiseServicesSet"):
            self.b.prefs["AdvertiseServices"] = masked.get("AdvertiseServices")
        return dict(self.b.prefs)

    async def cert_pair(self, domain: str):
        self.cert_calls.append(domain)
        step = self.cert_script.pop(0) if self.cert_script else None
        if step is not None:
            raise step
        return b"CERT", b"KEY"


@pytest.fixture
def backend() -> Backend:
    return Backend()


@pytest.fixture
def api(backend: Backend) -> FakeAPI:
    return FakeAPI(backend)


# ---------------------------------------------------------------------------------------------------------


async def test_first_converge_clears_then_applies_with_if_match(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api)
    res = await a.converge_text(HTTPS_CFG, DOMAIN)
    assert res.applied and res.changed and not res.error
    assert res.https_endpoint == DOMAIN
    assert backend.posts[0] == ({}, "")                       # clear, unconditional
    body, if_match = backend.posts[1]
    assert body == parse(HTTPS_CFG, DOMAIN).to_json()
    assert if_match == hashlib.sha256(b"{}").hexdigest()     # the ETag read just before
    assert backend.config == body


async def test_unchanged_config_is_not_posted_again(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api)
    await a.converge_text(HTTPS_CFG, DOMAIN)
    n = len(backend.posts)
    for _ in range(3):
        res = await a.converge_text(HTTPS_CFG, DOMAIN)
        assert res.applied and not res.changed
    assert len(backend.posts) == n
    assert a.counters['containerboot_serve_config_applies_total{result="unchanged"}'] == 3


async def test_fields_tailscaled_drops_do_not_cause_reposts(api: FakeAPI, backend: Backend) -> None:
    text = '{"TCP":{"80":{"HTTP":true}},"Web":{"a.ts.net:80":{"Handlers":{"/":{"Text":"x"}}}},"Future":1}'
    a = ServeApplier(api)
    await a.converge_text(text, DOMAIN)
    assert "Future" not in backend.config
    n = len(backend.posts)
    res = await a.converge_text(text, DOMAIN)
    assert res.applied and not res.changed and len(backend.posts) == n


async def test_etag_conflict_rereads_and_retries(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api)
    await a.converge_text(HTTP_CFG, DOMAIN)
    backend.interfere = 2
    res = await a.converge_text(HTTPS_CFG, DOMAIN)
    assert res.applied and res.changed
    assert backend.config == parse(HTTPS_CFG, DOMAIN).to_json()
    assert a.counters['containerboot_serve_config_applies_total{result="conflict"}'] == 2


async def test_etag_conflicts_are_bounded(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api, max_conflict_retries=3)
    await a.converge_text(HTTP_CFG, DOMAIN)
    backend.interfere = 100
    n = len(backend.posts)
    res = await a.converge_text(HTTPS_CFG, DOMAIN)
    assert not res.applied and "ETag conflicts" in res.error
    assert len(backend.posts) - n == 3


async def test_out_of_band_change_is_reverted(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api)
    await a.converge_text(HTTPS_CFG, DOMAIN)
    backend.config = {}          # e.g. someone ran `tailscale serve reset`
    res = await a.converge_text(HTTPS_CFG, DOMAIN)
    assert res.changed and backend.config == parse(HTTPS_CFG, DOMAIN).to_json()


async def test_bad_file_keeps_last_good(api: FakeAPI, backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    a = ServeApplier(api)
    await a.converge_text(HTTPS_CFG, DOMAIN)
    good = backend.config
    n = len(backend.posts)
    bad = HTTPS_CFG.replace('"http://10.0.0.5:8080/"', '"http//oops"')
    res = await a.converge_text(bad, DOMAIN)
    assert res.invalid and res.applied                           # last good still in force
    assert 'Web["proxy.tailnet.ts.net:443"].Handlers["/"].Proxy: not a valid URL or port' in res.error
    assert backend.config == good and len(backend.posts) == n
    assert "keeping the last good serve config" in caplog.text
    assert res.status().last_error.startswith("invalid serve config")
    # Not JSON at all: same.
    res = await a.converge_text('{"TCP": ', DOMAIN)
    assert res.invalid and res.applied and "not valid JSON" in res.error
    # The cert domain changes while the file is still bad: the last good config follows the new domain.
    res = await a.converge_text(bad, "renamed.tailnet.ts.net")
    assert res.applied and res.invalid
    assert list(backend.config["Web"]) == ["renamed.tailnet.ts.net:443"]
    # Fixed file: applied, error cleared.
    res = await a.converge_text(HTTPS_CFG2, DOMAIN)
    assert res.applied and not res.invalid and not res.error
    assert a.counters['containerboot_serve_config_applies_total{result="invalid"}'] == 3


async def test_bad_first_file_applies_nothing(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api)
    res = await a.converge_text('{"TCP":{"443":{"HTTPS":"yes"}}}', DOMAIN)
    assert res.invalid and not res.applied and res.https_endpoint is None
    assert backend.posts == [({}, "")]


async def test_missing_or_empty_file_changes_nothing(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api)
    res = await a.converge_text(None, DOMAIN)
    assert not res.applied and res.skipped == "no serve config" and res.https_endpoint is None
    assert backend.posts == [({}, "")]     # only the startup clear
    await a.converge_text(HTTPS_CFG, DOMAIN)
    n = len(backend.posts)
    res = await a.converge_text("", DOMAIN)
    assert res.applied and res.https_endpoint == DOMAIN and len(backend.posts) == n
    res = await a.converge_text(None, DOMAIN)
    assert res.applied and len(backend.posts) == n


async def test_no_https_gate(api: FakeAPI, backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    a = ServeApplier(api)
    res = await a.converge_text(HTTPS_CFG, "no-https")
    assert not res.applied and res.skipped == NO_HTTPS_EXPLANATION
    assert res.https_endpoint == "no-https" and res.cert_required and not res.cert_ready
    assert backend.posts == [({}, "")]
    assert "HTTPS is not enabled for this tailnet" in caplog.text
    # HTTP-only configs still apply (upstream too).
    res = await a.converge_text(HTTP_CFG, "no-https")
    assert res.applied and res.https_endpoint == "no-https"
    assert list(backend.config["Web"]) == ["no-https:80"]
    # HTTPS gets enabled later: the cert domain changes and the HTTPS config applies.
    res = await a.converge_text(HTTPS_CFG, DOMAIN)
    assert res.applied


async def test_serve_type_change_clears_first(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api)
    await a.converge_text(TCP_CFG, DOMAIN)           # port 443 is raw TCP
    res = await a.converge_text(HTTPS_CFG, DOMAIN)   # port 443 becomes HTTPS: tailscaled wants a clear first
    assert res.applied and not res.error
    assert backend.config == parse(HTTPS_CFG, DOMAIN).to_json()
    assert ({}, "") in backend.posts[2:]


async def test_rejected_config_restores_previous_and_backs_off(api: FakeAPI, backend: Backend) -> None:
    now = [1000.0]
    a = ServeApplier(api, clock=lambda: now[0], retry_initial=1.0, retry_max=4.0)
    await a.converge_text(HTTPS_CFG, DOMAIN)
    good = backend.config
    backend.reject_containing = "10.0.0.6"
    res = await a.converge_text(HTTPS_CFG2, DOMAIN)
    # The last good config is back in force: still "applied", with the rejection reported.
    assert res.applied and "funnel not allowed" in res.error
    assert backend.config == good
    n = len(backend.posts)
    res = await a.converge_text(HTTPS_CFG2, DOMAIN)  # within the backoff: no LocalAPI writes
    assert "funnel not allowed" in res.error and len(backend.posts) == n
    now[0] += 1.5
    res = await a.converge_text(HTTPS_CFG2, DOMAIN)  # retried, fails again; next delay 2 s
    assert res.error and len(backend.posts) > n
    n = len(backend.posts)
    now[0] += 1.5
    await a.converge_text(HTTPS_CFG2, DOMAIN)
    assert len(backend.posts) == n
    # A different config is tried at once.
    res = await a.converge_text(HTTP_CFG, DOMAIN)
    assert res.applied and not res.error


async def test_rejected_first_config_is_not_applied(api: FakeAPI, backend: Backend) -> None:
    backend.reject_containing = "10.0.0.5"
    a = ServeApplier(api)
    res = await a.converge_text(HTTPS_CFG, DOMAIN)
    assert not res.applied and "funnel not allowed" in res.error
    assert res.status().last_error == res.error


async def test_transport_errors_do_not_clear(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api)
    await a.converge_text(HTTPS_CFG, DOMAIN)
    n = len(backend.posts)

    async def down(config, etag=""):
        raise FakeError("LocalAPI POST serve-config: ConnectError", 0)

    api.set_serve_config = down   # type: ignore[method-assign]
    res = await a.converge_text(HTTPS_CFG2, DOMAIN)
    assert "ConnectError" in res.error and len(backend.posts) == n
    assert backend.config == parse(HTTPS_CFG, DOMAIN).to_json()


async def test_clear_failure_is_retried(api: FakeAPI, backend: Backend) -> None:
    calls = []

    async def failing_set(config, etag=""):
        calls.append(config)
        raise FakeError("500: no netmap", 500)

    api.set_serve_config = failing_set   # type: ignore[method-assign]
    a = ServeApplier(api)
    res = await a.converge_text(HTTPS_CFG, DOMAIN)
    assert not res.applied and "cannot clear the previous serve config" in res.error
    del api.set_serve_config
    res = await a.converge_text(HTTPS_CFG, DOMAIN)
    assert res.applied and backend.posts[0] == ({}, "")


# -- Service advertisement -------------------------------------------------------------------------------


async def test_advertise_only_on_change(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api, auto_advertise=True)
    res = await a.converge_text(SVC_CFG, DOMAIN)
    assert res.advertised == ("svc:db", "svc:web")
    assert backend.pref_edits == [{"AdvertiseServices": ["svc:db", "svc:web"], "AdvertiseServicesSet": True}]
    for _ in range(3):
        await a.converge_text(SVC_CFG, DOMAIN)
    assert len(backend.pref_edits) == 1                      # no re-PATCH, no sleeping
    only_db = json.dumps({"Services": {"svc:db": json.loads(SVC_CFG)["Services"]["svc:db"]}})
    res = await a.converge_text(only_db, DOMAIN)
    assert res.advertised == ("svc:db",)
    assert backend.pref_edits[-1] == {"AdvertiseServices": ["svc:db"], "AdvertiseServicesSet": True}
    res = await a.converge_text(HTTP_CFG, DOMAIN)            # no Services: un-advertise (upstream never does)
    assert res.advertised == ()
    assert backend.pref_edits[-1] == {"AdvertiseServices": None, "AdvertiseServicesSet": True}
    assert len(backend.pref_edits) == 3


async def test_advertise_skips_patch_when_prefs_already_match(api: FakeAPI, backend: Backend) -> None:
    backend.prefs["AdvertiseServices"] = ["svc:web", "svc:db"]
    a = ServeApplier(api, auto_advertise=True)
    res = await a.converge_text(SVC_CFG, DOMAIN)
    assert res.advertised == ("svc:db", "svc:web") and backend.pref_edits == []
    await a.unadvertise()
    assert backend.pref_edits == [{"AdvertiseServices": None, "AdvertiseServicesSet": True}]


async def test_advertise_off_never_touches_prefs(api: FakeAPI, backend: Backend) -> None:
    a = ServeApplier(api, auto_advertise=False)
    await a.converge_text(SVC_CFG, DOMAIN)
    await a.unadvertise()
    assert backend.pref_edits == []


async def test_service_advertised_only_after_its_cert(api: FakeAPI, backend: Backend) -> None:
    api.cert_script = [FakeError("500: acme: not yet", 500)]
    gate, backing_off = asyncio.Event(), asyncio.Event()

    async def sleep(d: float) -> None:
        if d >= 3600:                      # the daily refresh: park
            await asyncio.Event().wait()
        backing_off.set()
        await gate.wait()

    changed = asyncio.Event()
    cm = CertManager(api, sleep=sleep, on_change=changed.set)
    a = ServeApplier(api, auto_advertise=True, cert_manager=cm)
    res = await a.converge_text(SVC_CFG, DOMAIN)
    await asyncio.wait_for(backing_off.wait(), 2)           # the first request for the cert failed
    res = await a.converge_text(SVC_CFG, DOMAIN)
    assert res.applied and res.cert_required and not res.cert_ready
    assert res.advertised == ("svc:db",)                    # svc:web waits for web.tailnet.ts.net's cert
    gate.set()
    await asyncio.wait_for(changed.wait(), 2)
    res = await a.converge_text(SVC_CFG, DOMAIN)
    assert res.cert_ready and res.advertised == ("svc:db", "svc:web")
    await cm.close()


# -- Certificates ------------------------------------------------------------------------------------------


class FakeSleep:
    """Records requested delays; lets the loop run `allow` sleeps, then blocks."""

    def __init__(self, allow: int) -> None:
        self.calls: list[float] = []
        self.allow = allow
        self.blocked = asyncio.Event()

    async def __call__(self, d: float) -> None:
        self.calls.append(d)
        if len(self.calls) > self.allow:
            self.blocked.set()
            await asyncio.Event().wait()
        await asyncio.sleep(0)   # not a wait: yields to the loop once, as a real sleep would


async def test_cert_backoff_doubling_and_retry_after(api: FakeAPI) -> None:
    api.cert_script = [FakeError("500: x", 500), FakeError("500: x", 500), FakeError("500: x", 500),
                       FakeError("429: rate limited", 429, retry_after=42), FakeError("500: x", 500), None]
    sleep = FakeSleep(allow=5)
    changed: list[bool] = []
    cm = CertManager(api, sleep=sleep, on_change=lambda: changed.append(True))
    cm.ensure(["a.ts.net"])
    assert not cm.cert_ready("a.ts.net")
    await asyncio.wait_for(sleep.blocked.wait(), 2)
    # 1, 2, 4, then the CA's Retry-After, then the backoff continues (16), then the daily refresh.
    assert sleep.calls == [1, 2, 4, 42, 16, 24 * 3600]
    assert cm.cert_ready("a.ts.net") and changed == [True]
    assert api.cert_calls == ["a.ts.net"] * 6
    assert cm.counters['containerboot_cert_requests_total{result="error"}'] == 5
    await cm.close()


async def test_cert_backoff_caps_at_ten_minutes(api: FakeAPI) -> None:
    api.cert_script = [FakeError("500: x", 500)] * 14
    sleep = FakeSleep(allow=13)
    cm = CertManager(api, sleep=sleep)
    cm.ensure(["a.ts.net"])
    await asyncio.wait_for(sleep.blocked.wait(), 2)
    assert sleep.calls[:11] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 600]
    assert max(sleep.calls) == 600
    assert "500: x" in cm.last_error("a.ts.net")
    await cm.close()


async def test_cert_loops_follow_the_config(api: FakeAPI) -> None:
    sleep = FakeSleep(allow=0)
    cm = CertManager(api, sleep=sleep)
    cm.ensure(["a.ts.net", "b.ts.net", "no-https"])
    await until_async(lambda: cm.all_ready(["a.ts.net", "b.ts.net"]), 2, "both certificates")
    assert cm.domains == ("a.ts.net", "b.ts.net")
    cm.ensure(["b.ts.net"])
    assert cm.domains == ("b.ts.net",) and not cm.cert_ready("a.ts.net")
    await cm.close()
    assert cm.domains == ()


async def test_applier_requests_certs_when_https_needed(api: FakeAPI) -> None:
    sleep = FakeSleep(allow=0)
    cm = CertManager(api, sleep=sleep)
    a = ServeApplier(api, cert_manager=cm)
    res = await a.converge_text(HTTP_CFG, DOMAIN)
    assert not res.cert_required and res.cert_ready and cm.domains == ()
    res = await a.converge_text(HTTPS_CFG, DOMAIN)
    assert res.cert_required and res.cert_domains == (DOMAIN,)
    await until_async(lambda: cm.cert_ready(DOMAIN), 2, "the certificate")
    assert api.cert_calls == [DOMAIN]
    res = await a.converge_text(HTTPS_CFG, DOMAIN)
    assert res.cert_ready and res.status().cert_ready
    await cm.close()


def test_retry_after_parsing() -> None:
    assert _retry_after(FakeError("x", 429, retry_after=7)) == 7
    assert _retry_after(FakeError("x", 429, headers={"retry-after": "30"})) == 30
    when = email.utils.formatdate(time.time() + 120, usegmt=True)
    got = _retry_after(FakeError("x", 429, headers={"Retry-After": when}))
    assert got is not None and 100 < got <= 121
    assert _retry_after(FakeError("x", 429)) is None
    assert _retry_after(FakeError("x", 429, headers={"Retry-After": "soon"})) is None


# -- The same against the real LocalAPI client over a unix socket ------------------------------------------


async def _serve_unix(backend: Backend, path: str) -> asyncio.AbstractServer:
    """A minimal tailscaled LocalAPI for serve-config and prefs, speaking HTTP/1.1 on a unix socket."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                lines = head.decode().split("\r\n")
                method, target, _ = lines[0].split(" ")
                hdrs = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(hdrs.get("content-length", "0")))
                status, out, extra = 200, b"", {}
                if hdrs.get("host") != "local-tailscaled.sock" or "origin" in hdrs or "referer" in hdrs:
                    status, out = 403, b"invalid localapi request"
                elif target == "/localapi/v0/serve-config" and method == "GET":
                    cfg, etag = backend.get()
                    out, extra = json.dumps(cfg).encode(), {"Etag": etag}
                elif target == "/localapi/v0/serve-config" and method == "POST":
                    try:
                        backend.post(json.loads(body), hdrs.get("if-match", ""))
                    except FakeError as e:
                        status, out = e.status, json.dumps({"error": str(e)}).encode()
                elif target == "/localapi/v0/prefs" and method == "GET":
                    out = json.dumps(backend.prefs).encode()
                elif target == "/localapi/v0/prefs" and method == "PATCH":
                    masked = json.loads(body)
                    backend.pref_edits.append(masked)
                    backend.prefs["AdvertiseServices"] = masked.get("AdvertiseServices")
                    out = json.dumps(backend.prefs).encode()
                else:
                    status, out = 404, b"not found"
                resp = [f"HTTP/1.1 {status} X", f"Content-Length: {len(out)}", "Tailscale-Cap: 145",
                        *(f"{k}: {v}" for k, v in extra.items())]
                writer.write(("\r\n".join(resp) + "\r\n\r\n").encode() + out)
                await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_unix_server(handle, path=path)


async def test_etag_flow_over_real_localapi_client(backend: Backend, tmp_path: Path) -> None:
    from containerboot.localapi import LocalAPI

    sock = str(tmp_path / "ts.sock")
    server = await _serve_unix(backend, sock)
    api = LocalAPI(sock, timeout=5)
    try:
        a = ServeApplier(api, auto_advertise=True)
        res = await a.converge_text(HTTPS_CFG, DOMAIN)
        assert res.applied and res.changed, res.error
        assert backend.posts[1][1] == hashlib.sha256(b"{}").hexdigest()
        backend.interfere = 1
        res = await a.converge_text(HTTPS_CFG2, DOMAIN)
        assert res.applied and not res.error
        assert a.counters['containerboot_serve_config_applies_total{result="conflict"}'] == 1
        assert backend.config == parse(HTTPS_CFG2, DOMAIN).to_json()
        res = await a.converge_text(SVC_CFG, DOMAIN)
        assert res.advertised == ("svc:db", "svc:web")
        assert backend.prefs["AdvertiseServices"] == ["svc:db", "svc:web"]
        # Port type change (443 HTTPS -> TCP) over the wire: clear, then set.
        res = await a.converge_text(TCP_CFG, DOMAIN)
        assert res.applied and backend.config == json.loads(TCP_CFG)
    finally:
        await api.aclose()
        server.close()
        await server.wait_closed()


def test_parse_equals_from_json_of_posted_body() -> None:
    cfg = parse(SVC_CFG, DOMAIN)
    assert ServeConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


# -- ServeLoop: file watch + cert domain + applier -----------------------------------------------------------


async def test_serve_loop_end_to_end(api: FakeAPI, backend: Backend, tmp_path: Path) -> None:
    from serveconfig.apply import ServeLoop

    path = tmp_path / "serve-config"
    path.write_text(HTTPS_CFG)
    results: asyncio.Queue = asyncio.Queue()

    async def on_result(res) -> None:
        await results.put(res)

    async def next_result(pred):
        while True:
            res = await asyncio.wait_for(results.get(), 5)
            if pred(res):
                return res

    loop = ServeLoop(str(path), ServeApplier(api), cert_domain=DOMAIN, on_result=on_result, resync_interval=3600)
    task = asyncio.ensure_future(loop.run())
    try:
        res = await next_result(lambda r: r.applied)
        assert res.https_endpoint == DOMAIN
        assert list(backend.config["Web"]) == [f"{DOMAIN}:443"]
        path.write_text(HTTPS_CFG2)
        await next_result(lambda r: r.changed)
        assert backend.config == parse(HTTPS_CFG2, DOMAIN).to_json()
        loop.set_cert_domain("renamed.tailnet.ts.net")
        res = await next_result(lambda r: r.changed)
        assert res.https_endpoint == "renamed.tailnet.ts.net"
        assert list(backend.config["Web"]) == ["renamed.tailnet.ts.net:443"]
        path.write_text("{not json")
        res = await next_result(lambda r: r.invalid)
        assert res.applied and list(backend.config["Web"]) == ["renamed.tailnet.ts.net:443"]
        # Someone changes tailscaled's config behind our back; a poke (or the periodic resync) reverts it.
        path.write_text(HTTPS_CFG2)
        await next_result(lambda r: not r.invalid)
        backend.config = {}
        loop.poke()
        await next_result(lambda r: r.changed)
        assert backend.config == parse(HTTPS_CFG2, "renamed.tailnet.ts.net").to_json()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
