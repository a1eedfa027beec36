"""Shared pieces of the property-based tests of the parsers: hypothesis profiles and hostile-input strategies.

Two profiles. `ci` (the default) is what `make test` runs: 100 examples a target, drawn from the run's seed
(`CB_SEED`, printed at the start of the run, tests/support/seed.py), so each run tries other examples and
`CB_SEED=<n>` repeats a run's exactly. `fuzz` is the long run (`make fuzz`): many more examples; hypothesis
prints the shrunk input of any failure, and its example database replays it on the next run. Select with
CB_FUZZ_PROFILE.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

settings.register_profile(
    "ci", derandomize=False, max_examples=int(os.environ.get("CB_FUZZ_EXAMPLES", "100")), deadline=None,
    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "fuzz", max_examples=int(os.environ.get("CB_FUZZ_EXAMPLES", "20000")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("CB_FUZZ_PROFILE", "ci"))

# Fragments that parsers treat specially: separators, brackets, Go and JSON edge cases, Unicode look-alikes,
# control characters and what a shell or a template leaves behind.
TOKENS = (
    "", " ", ",", ":", "/", "[", "]", "=", "-", "--", "\\", '"', "'", "\n", "\t", "\r", "\x7f", "\u00a0",
    "\u200b", "\ufeff", "\ud800", "\udcff", "%", "%eth0", "0", "1", "-1", "65535", "65536", "99999999999999999999",
    "true", "false", "True", "t", "yes", "null", "NaN", "Infinity", "1e309", "0x10", "٣", "²",
    "10.0.0.1", "10.0.0.0/8", "10.0.0.1/8", "0.0.0.0", "0.0.0.0/0", "255.255.255.255", "1.2.3", "01.2.3.4",
    "::", "::/0", "::1", "fd7a:115c:a1e0::1", "fe80::1%eth0", "[::1]", "[::1]:80", "1.2.3.4:80", "::ffff:1.2.3.4",
    "100.64.0.7", "/32", "/129", "/-1", "example.com", "a.b.ts.net", "svc:web", "tag:k8s", "tag:", "tag:-x",
    "http://", "https://x", "unix:/x", "unix:", "${TS_CERT_DOMAIN}", "$(POD_IP)", "1s", "1h2m", "-5s", "0s",
    "1.5h", "9999999999h", "µs", "--authkey=", "--auth-key", "--accept-dns", "--reset", "-", "a" * 64,
)

# What an environment variable can hold: anything but NUL; invalid UTF-8 bytes arrive as lone surrogates.
_ENV_CHARS = st.characters(exclude_characters="\x00")
_TEXT_CHARS = st.characters(exclude_categories=["Cs"])


def hostile_text(chars: st.SearchStrategy[str] = _TEXT_CHARS, max_size: int = 40) -> st.SearchStrategy[str]:
    """Text built from random characters and the special fragments above, joined."""
    piece = st.one_of(st.sampled_from(TOKENS), st.text(chars, max_size=8))
    return st.one_of(st.text(chars, max_size=max_size), st.lists(piece, max_size=6).map("".join))


def env_text() -> st.SearchStrategy[str]:
    return hostile_text(_ENV_CHARS)


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value (floats included: Python's json decodes them)."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                        hostile_text(max_size=20))
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(hostile_text(max_size=12), inner, max_size=4)),
        max_leaves=max_leaves)


def shaped(template: Any) -> st.SearchStrategy[Any]:
    """A value shaped like `template` (a JSON example), with some keys dropped or renamed, extra keys added, and
    some leaves replaced by anything.

    Purely random JSON rarely gets past a parser's first type check; keeping most of the structure (each part
    is kept as written three times in four) lets the examples reach the deeper checks too."""
    anything = json_values(6)
    if isinstance(template, dict):
        parts = {k: shaped(v) for k, v in template.items()}
        kept = st.fixed_dictionaries({}, optional=parts)
        full = st.fixed_dictionaries(parts)
        extra = st.dictionaries(hostile_text(max_size=12), anything, max_size=2)
        mixed = st.tuples(kept, extra).map(lambda t: {**t[0], **t[1]})
        return st.one_of(full, full, kept, mixed, anything)
    if isinstance(template, list):
        item = st.one_of(*(shaped(v) for v in template)) if template else anything
        return st.one_of(st.lists(item, min_size=1, max_size=3), st.lists(item, max_size=3), anything)
    if isinstance(template, str):
        return st.one_of(st.just(template), st.just(template), st.just(template), hostile_text(), anything)
    return st.one_of(st.just(template), st.just(template), st.just(template), anything)


def json_text(values: st.SearchStrategy[Any]) -> st.SearchStrategy[str]:
    """JSON text of `values`, sometimes cut short or with garbage around it."""
    dumped = values.map(json.dumps)
    return st.one_of(dumped, dumped, st.tuples(dumped, st.integers(0, 200)).map(lambda t: t[0][:t[1]]),
                     st.tuples(hostile_text(max_size=5), dumped, hostile_text(max_size=5)).map("".join),
                     hostile_text())


def deep_nesting(depth: int = 5000) -> list[str]:
    """Documents nested deeper than Python's recursion limit (a JSON bomb of a few hundred kilobytes)."""
    return ["[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth, "[" * depth]


# ---- the branches a property test must reach
# A parser test that only says "no crash" passes just as well when every example is refused at the first check.
# `branch(name)` records which outcome an example reached (and shows it in --hypothesis-show-statistics);
# `@reaches(...)`, outside `@given`, fails the test when a run of all its examples never reached one of them.

_REACHED: Counter[str] = Counter()


def branch(name: str) -> None:
    _REACHED[name] += 1
    event(name)


def reaches(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def check(test: str) -> None:
        missed = [n for n in names if not _REACHED[n]]
        assert not missed, (f"{test}: no example reached {missed} (reached: {dict(_REACHED)}); the strategy no "
                            f"longer produces what this branch needs")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> None:
                _REACHED.clear()
                await fn(*args, **kwargs)
                check(fn.__name__)
            return run_async

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> None:
            _REACHED.clear()
            fn(*args, **kwargs)
            check(fn.__name__)
        return run
    return wrap
