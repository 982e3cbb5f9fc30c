#!/usr/bin/env bash
# Randomized exploration beyond the fixed seeds CI runs: draws the cases of COUNT new
# seeds (default 24) from FIRST (default: today's date as YYYYMMDD00, so each day draws
# new ones), each on 1-5 local gloo ranks, and checks them as tests/test_randomized.py
# does. Each failure prints the line that replays its case alone and the entry to add to
# tests/data/randomized_seeds.json once it is fixed, so that CI runs that seed from then on.
#
#   bash scripts/fuzz.sh [COUNT [FIRST]]
# Environment: SEQPAR_FUZZ_WORLD_SIZES (e.g. 2,3) narrows the world sizes; PYTHON.
# Run it after bash scripts/setup.sh; extra pytest arguments can follow FIRST.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
count=${1:-24}
first=${2:-$(date -u +%Y%m%d)00}
shift $(($# < 2 ? $# : 2))
echo "[fuzz] seeds $first to $((first + count - 1)), world sizes ${SEQPAR_FUZZ_WORLD_SIZES:-1,2,3,4,5}"
SEQPAR_FUZZ_SEEDS="$first:$count" exec "$PYTHON" -m pytest -q -ra tests/test_randomized.py -k test_explore "$@"
