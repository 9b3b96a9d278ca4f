"""A test whose machinery this machine lacks (a local Slurm cluster, a mount namespace) skips, saying why; under CI
(``CI=true``, which .ci/run sets) it fails with that reason instead, so CI cannot pass without what it is meant to test."""

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def skip_unless_ci(reason: str) -> None:
    """Skip with ``reason``; under CI=true fail with it."""
    if in_ci():
        pytest.fail(f"CI=true, and this test cannot run here: {reason}", pytrace=False)
    pytest.skip(reason)
