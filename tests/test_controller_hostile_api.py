"""The controller under a hostile API server: many Services, and at random a 500, a 429 with Retry-After, a 409
Conflict on a write, or a slow answer (the in-memory API server of tests/support/fakekube.py behind a fault
injector, the work queue and the reconciler as the controller runs them; the faults drawn from the run's seed,
CB_SEED, tests/support/seed.py).

It converges (every Service gets its proxy and a Ready condition), it never writes in a loop (writes per Service
stay within a small multiple of a fault-free run's, and a full re-run after convergence writes nothing), it
respects Retry-After (no request for a parent before the time a 429 named), and it logs each kind of fault
without flooding (one line per kind per window, with a count of those folded in).

HOSTILE_SERVICES (default 60) sets the number of Services; `make hostile` runs 500. The figures are printed and,
with BENCH_RECORD=1 (`make hostile` sets it), written as this run's column of bench/results/hostile.json.
Dropped watch streams, kopf, and 409s from a real admission webhook are in the same story against the real API
server: netns-tests/test_controller_hostile_apiserver.py.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import random
import time
from collections import Counter
from typing import Any, cast

import pytest

from bench import runs
from controller import logfold
from controller.config import ControllerConfig
from controller.kubeapi import SERVICES, STATEFULSETS, KubeError
from controller.queue import FaultLog, WorkQueue
from controller.reconcile import Reconciler
from tests.support import seed
from tests.support.fakekube import FakeKube, FakeProvider
from tests.support.waits import until_async

N = int(os.environ.get("HOSTILE_SERVICES", "60"))
# Per API call. A pass makes about 15 calls, so about half the passes meet at least one fault.
FAULT_RATE = 0.05
CFG = ControllerConfig(namespace="tailscale", proxy_image="registry.local/proxy:1", login_server="http://hs:8080")
WRITES = ("create", "patch", "delete")
current: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("current", default=None)


class HostileKube:
    """FakeKube's interface, with faults: each call fails at random with 500, 429 + Retry-After or (writes) 409
    Conflict, or is slow. Records every call and every 429 per parent."""

    def __init__(self, inner: FakeKube, rng: random.Random, fault_rate: float) -> None:
        self.inner, self.rng, self.rate = inner, rng, fault_rate
        self.calls: Counter[tuple[tuple | None, str]] = Counter()
        self.faults: Counter[str] = Counter()
        self.not_before: dict[tuple, float] = {}       # parent -> earliest time a 429 allowed
        self.early: list[tuple[tuple, float]] = []      # requests before that time
        for name in ("get", "get_own", "list") + WRITES:
            setattr(self, name, self._wrap(name, getattr(inner, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            key = current.get()
            now = time.monotonic()
            if key is not None and now < self.not_before.get(key, 0.0):
                self.early.append((key, self.not_before[key] - now))
            self.calls[(key, "write" if name in WRITES else "read")] += 1
            r = self.rng.random()
            if r < self.rate:
                kind = self.rng.choice(["500", "429", "409"] if name in WRITES else ["500", "429"])
                self.faults[kind] += 1
                if kind == "500":
                    raise KubeError(f"{name}: 500 etcdserver: request timed out", status=500,
                                    reason="InternalError")
                if kind == "429":
                    wait = self.rng.choice([0.2, 0.5, 1.0])
                    if key is not None:
                        self.not_before[key] = now + wait
                    raise KubeError(f"{name}: 429 too many requests", status=429, reason="TooManyRequests",
                                    retry_after=wait)
                raise KubeError(f"{name}: 409 the object has been modified", status=409, reason="Conflict")
            if r < self.rate + 0.05:
                self.faults["slow"] += 1
                await asyncio.sleep(0.05)   # not a wait: a slow answer is one of the injected faults
            return await fn(*args, **kwargs)
        return call


def _service(kube: FakeKube, i: int) -> None:
    kube.put(SERVICES, {"metadata": {"name": f"s{i}", "namespace": "apps",
                                     "annotations": {"tailscale.com/expose": "true"}},
                        "spec": {"type": "ClusterIP", "clusterIP": f"10.96.{i // 250}.{i % 250 + 1}",
                                 "clusterIPs": [f"10.96.{i // 250}.{i % 250 + 1}"], "ipFamilies": ["IPv4"]}})


def _converged(kube: FakeKube) -> bool:
    if len(kube.of(STATEFULSETS)) != N:
        return False
    return all(((kube.obj(SERVICES, f"s{i}", "apps") or {}).get("status") or {}).get("conditions") for i in range(N))


async def _run(fault_rate: float) -> tuple[HostileKube, WorkQueue, float]:
    inner, prov = FakeKube(), FakeProvider()
    for i in range(N):
        _service(inner, i)
    hostile = HostileKube(inner, seed.rng("hostile-api"), fault_rate)
    rec = Reconciler(cast(Any, hostile), prov, CFG)

    async def work(key: tuple) -> float | None:
        current.set(key)
        await rec.reconcile(*key)
        return None        # the rechecks a real run schedules are not what this test is about

    q = WorkQueue(work, concurrency=16, base_delay=0.05, max_delay=2.0)
    q.fault_log = FaultLog(window=60.0)
    t0 = time.monotonic()
    for i in range(N):
        q.poke(("svc", "apps", f"s{i}"))
    try:
        await until_async(lambda: _converged(inner) and not q.failures, 300, interval=0.05)
    except AssertionError:
        pass                    # said below, with what still fails
    took = time.monotonic() - t0
    assert _converged(inner), f"not converged after {took:.0f}s; failing: {dict(list(q.failures.items())[:5])}"
    return hostile, q, took


def _writes_per_service(h: HostileKube) -> list[int]:
    return [h.calls[(("svc", "apps", f"s{i}"), "write")] for i in range(N)]


async def test_converges_with_bounded_writes_respecting_retry_after(caplog: pytest.LogCaptureFixture) -> None:
    clean, q0, clean_took = await _run(0.0)
    await q0.aclose()
    clean_max = max(_writes_per_service(clean))
    caplog.set_level(logging.WARNING, logger="controller")
    hostile, q, took = await _run(FAULT_RATE)
    writes = _writes_per_service(hostile)
    reads0 = [hostile.calls[(("svc", "apps", f"s{i}"), "read")] for i in range(N)]
    print(f"hostile API: {N} Services, faults {dict(hostile.faults)}, converged in {took:.1f}s "
          f"(fault-free {clean_took:.1f}s); writes per Service: max {max(writes)}, mean {sum(writes) / N:.1f} "
          f"(fault-free {clean_max}); reads per Service: max {max(reads0)}, mean {sum(reads0) / N:.1f}")
    assert set(hostile.faults) >= {"500", "429", "409", "slow"}
    # Bounded: a failed write is retried, nothing is written again and again.
    assert max(writes) <= 4 * clean_max, writes
    # Retry-After: no request for a parent before the time a 429 for it named.
    assert hostile.early == [], hostile.early[:5]
    # A full re-run after convergence writes nothing.
    before = sum(writes)
    hostile.rate = 0.0
    keys = [("svc", "apps", f"s{i}") for i in range(N)]
    reads = {k: hostile.calls[(k, "read")] for k in keys}
    for k in keys:
        q.poke(k)
    # every Service's pass ran again (it read its objects) and the queue is idle: it had its chance to write
    await until_async(lambda: not q._tasks and all(hostile.calls[(k, "read")] > reads[k] for k in keys), 60,
                      "every Service's pass to run again and the queue to be idle")
    assert sum(_writes_per_service(hostile)) == before
    await q.aclose()
    # Logs: every kind of fault said, but one line per kind per window (here the whole run is one window).
    lines = [r.getMessage() for r in caplog.records if r.name == "controller" and "failed (attempt" in r.message]
    kinds = {k for k in ("HTTP 500", "HTTP 429", "HTTP 409") if any(f": {k[5:]} " in m or k[5:] in m for m in lines)}
    assert kinds == {"HTTP 500", "HTTP 429", "HTTP 409"}, lines
    windows = int(took // 60.0) + 1
    assert len(lines) <= 3 * windows, lines
    runs.record_hostile("memory", f"{N} Services", runs.hostile_memory_cells({
        "faults": dict(hostile.faults), "converged_s": took, "clean_converged_s": clean_took,
        "writes_max": max(writes), "writes_mean": sum(writes) / N, "clean_writes_max": clean_max,
        "reads_max": max(reads0), "reads_mean": sum(reads0) / N, "early_after_429": len(hostile.early),
        "rerun_writes": sum(_writes_per_service(hostile)) - before, "warning_lines": len(lines)},
        runs.run_label(seed.run_seed(), "the faults drawn from it")))


def fault_log(caplog: pytest.LogCaptureFixture) -> tuple[FaultLog, list[float], KubeError]:
    """A FaultLog on a clock the test sets (`now[0]`), its lines captured, and a 500 to feed it."""
    now = [0.0]
    caplog.set_level(logging.WARNING, logger="controller")
    return (FaultLog(window=60.0, clock=lambda: now[0]), now,
            KubeError("500 boom", status=500, reason="InternalError"))


def test_fault_log_folds_repeats_into_the_next_line(caplog: pytest.LogCaptureFixture) -> None:
    fl, now, e = fault_log(caplog)
    for i in range(50):
        now[0] = i
        fl.failed(("svc", "apps", f"s{i % 7}"), 1, 1.0, e)
    fl.failed(("svc", "apps", "x"), 1, 1.0, KubeError("429", status=429, reason="TooManyRequests"))
    now[0] = 61
    fl.failed(("svc", "apps", "s0"), 2, 2.0, e)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "49 more HTTP 500 InternalError failure(s) of 7 parent(s)" in lines[2]


def test_fault_log_says_a_held_count_when_the_failures_stop(caplog: pytest.LogCaptureFixture) -> None:
    fl, now, e = fault_log(caplog)
    for i in range(10):
        now[0] = i
        fl.failed(("svc", "apps", f"s{i % 3}"), 1, 1.0, e)
    now[0] = 59.0
    fl.flush()                                   # the window is not over: a line of this kind may still come
    assert len(caplog.records) == 1
    now[0] = 60.5
    fl.flush()
    fl.flush()                                   # said once
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1:] == ["HTTP 500 InternalError: not logged in the last 60s, 9 more reconcile failure(s) of 3 "
                         "parent(s)"], lines
    # its kind, as the folding and the hostile test's count see it, is the failure's, not a number of the count
    assert logfold.line_kind(caplog.records[1]) == "controller HTTP # InternalError"
    now[0] = 70.0
    fl.failed(("svc", "apps", "s0"), 2, 2.0, e)  # the next failure is logged as a first one, with no count
    assert "not logged" not in caplog.records[-1].getMessage() and len(caplog.records) == 3
    # a kind still failing is not flushed (its next line carries the count): one line a window, not two
    for t in range(71, 136, 5):
        now[0] = t
        fl.failed(("svc", "apps", "s1"), 3, 4.0, e)
        now[0] = t + 4.5                         # the controller's flush, between two failures (at 130.5 too)
        fl.flush()
    assert len(caplog.records) == 4 and "(12 more HTTP 500 InternalError failure(s)" in caplog.records[-1].getMessage()


async def test_a_429s_retry_after_reaches_the_queue() -> None:
    import httpx

    from controller.kubeapi import Kube
    kube = Kube("http://api", token="t", transport=httpx.MockTransport(lambda request: httpx.Response(
        429, json={"kind": "Status", "reason": "TooManyRequests", "message": "slow down"},
        headers={"Retry-After": "7"})))
    with pytest.raises(KubeError) as e:
        await kube.get(SERVICES, "s", "apps")
    await kube.aclose()
    assert (e.value.status, e.value.reason, e.value.retry_after) == (429, "TooManyRequests", 7.0)


def test_kopf_request_failures_fold_into_the_next_line() -> None:
    """kopf logs each failed API request it retries; against a flaky API server with dropped watches that is many
    alike lines a minute. The controller's handler folds them: one per kind per minute, then a count."""
    from controller.logfold import FoldRepeats
    now = [0.0]
    out: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            out.append(record.getMessage())
    h = Keep()
    h.addFilter(FoldRepeats(window=60.0, clock=lambda: now[0]))
    kopf_log = logging.getLogger("kopf._cogs.clients.api")
    top = logging.getLogger("kopf")
    top.addHandler(h)
    top.propagate, level = False, top.level
    top.setLevel(logging.INFO)
    try:
        for i in range(30):
            now[0] = i
            kopf_log.error("Request attempt #1/9 failed; will retry: GET https://api/api/v1/services?watch=true "
                           "-> APIServerError('etcdserver: request timed out', {'code': 500})")
            kopf_log.error("Request attempt #1/9 failed; will retry: GET https://api/apis/apps/v1/statefulsets "
                           "-> APITooManyRequestsError('too many requests', {'code': 429})")
        kopf_log.info("not folded: below WARNING")
        kopf_log.info("not folded: below WARNING")
        now[0] = 61
        kopf_log.error("Request attempt #2/9 failed; will retry: GET https://api/api/v1/secrets "
                       "-> APIServerError('etcdserver: request timed out', {'code': 500})")
        logging.getLogger("kopf.objects").warning("another logger, another kind")
    finally:
        top.removeHandler(h)
        top.propagate = True
        top.setLevel(level)
    assert len(out) == 2 + 2 + 1 + 1, out
    assert "APIServerError" in out[0] and "APITooManyRequestsError" in out[1]
    assert out[4].endswith("(29 more like this in the last 60s not logged)") and "APIServerError" in out[4]


def test_kopf_failures_held_when_they_stop_are_counted_by_a_flush() -> None:
    """The count held for a kind whose failures stopped is said once its window has passed (flush_all, which
    the controller calls every few seconds), not left for a line that may never come."""
    from controller.logfold import FoldRepeats, flush_all
    now = [0.0]
    out: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            out.append((record.name, record.getMessage()))
    h = Keep()
    h.addFilter(FoldRepeats(window=60.0, clock=lambda: now[0]))
    top, ours = logging.getLogger("kopf"), logging.getLogger("controller.logfold")
    for lg in (top, ours):
        lg.addHandler(h)
    levels = top.level, ours.level
    top.propagate = ours.propagate = False
    try:
        for i in range(12):
            now[0] = i * 2.0
            logging.getLogger("kopf._cogs.clients.watching").error(
                "Request attempt #1/9 failed; will retry: GET https://api/api/v1/services?watch=true "
                "-> APIServerError('etcdserver: request timed out', {'code': 500})")
        flush_all([h])
        assert len(out) == 1                     # the window is not over
        now[0] = 61.0
        flush_all([h])
        flush_all([h])
    finally:
        for lg in (top, ours):
            lg.removeHandler(h)
        top.propagate = ours.propagate = True
        top.setLevel(levels[0])
        ours.setLevel(levels[1])
    assert out[1:] == [("controller.logfold", "kopf._cogs.clients.watching APIServerError: not logged in the last "
                                              "60s, 11 more like this")], out
