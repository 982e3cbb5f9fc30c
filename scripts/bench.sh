#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the microbenchmark suite on the local default:
# CPU ranks over gloo without a GPU, the local GPUs over NCCL with them, at the default
# sizes (about 7 minutes on 2 cores). Results (CSV, JSON and PNG) go to bench/results/.
# Extra arguments go to `python -m bench` (e.g. --quick, --full, --plan).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
"$PYTHON" -m bench "$@"
