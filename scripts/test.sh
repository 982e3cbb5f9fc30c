#!/usr/bin/env bash
# Sets up (scripts/setup.sh), lints (ruff, configured in pyproject.toml) and runs the
# test suite. Extra arguments go to pytest. Without a GPU, Triton kernels run in the
# interpreter and distributed tests on local gloo ranks (world sizes 1-4); with one,
# the CUDA kernel tests run too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
# The slow marker's tests (8 ranks) stay out; `-m slow` among the arguments runs them.
"$PYTHON" -m pytest -q -ra --durations=40 -m "not slow" tests "$@"
