#!/usr/bin/env bash
# For a lent GPU machine that gets a copy of the working tree without .git (the
# project's `device` tool): builds, tests and benchmarks, everything under $OUT.
#   SEQPAR_GIT_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_session.sh STAGE [bench args]
# STAGE: build | test | bench | all. SEQPAR_GIT_COMMIT stamps the results with the
# commit the tree came from (bench/hardware.py: git_commit). Each stage writes its
# log to $OUT and goes on to the next even when one fails; the exit status is the
# first failure's.
set -uo pipefail
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the next line changes directory
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stage=${1:-all}
shift || true
status=0

run_stage() {
  local name=$1
  shift
  echo "[gpu-session] $name: $*"
  local started=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local code=$?
  echo "[gpu-session] $name: exit $code after $((SECONDS - started)) s (log: $name.log)"
  tail -5 "$OUT/$name.log"
  if [ $code -ne 0 ] && [ $status -eq 0 ]; then status=$code; fi
}

if [[ $stage == build || $stage == all ]]; then
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  run_stage build bash scripts/setup.sh
  cp build/install.log "$OUT/install.log" 2>/dev/null
  "$PYTHON" -m seqpar_kernels.info >"$OUT/info.txt" 2>&1
fi
if [[ $stage == test || $stage == all ]]; then
  run_stage test "$PYTHON" -m pytest -q -ra --durations=30 --junitxml="$OUT/junit.xml" tests
fi
if [[ $stage == bench || $stage == all ]]; then
  run_stage bench "$PYTHON" -m bench --out "$OUT/results" "$@"
fi
exit $status
