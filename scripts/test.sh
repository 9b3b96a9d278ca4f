#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not slow"` or `bash scripts/test.sh tests/algorithm/test_losses.py`.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${FGRPO_VENV:-$repo/.venv}
cd "$repo"
# the bench extra (TRL) too, so the benchmark's smoke test runs both systems, and the reasoning-gym extra, so
# dataset=reasoning_gym's tests run, and TRL and verl for fgrpo.integrations' tests
FGRPO_WITH_BENCH=1 FGRPO_WITH_REASONING_GYM=1 FGRPO_WITH_INTEGRATIONS=1 bash scripts/setup.sh
"$venv/bin/python" -m pytest "$@"
