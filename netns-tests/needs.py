"""What the end-to-end tests need from the machine, and what happens when it is missing.

On a developer's machine a missing prerequisite (no podman, binaries that cannot be built) skips the tests
that need it, with the reason. Under CI (`CI` set) the same thing is a failure: CI must exercise everything,
and a build step that broke must not turn into a green run of skipped tests.
"""
from __future__ import annotations

import os

import pytest


def unavailable(reason: str) -> None:
    """Skip with the reason, or fail with it when CI is set. Never returns."""
    if os.environ.get("CI"):
        pytest.fail(f"CI is set, so these tests must run, but {reason}")
    pytest.skip(reason)
