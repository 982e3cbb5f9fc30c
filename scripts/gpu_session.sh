#!/usr/bin/env bash
# For a lent GPU machine that gets a copy of the working tree without .git (the
# project's `device` tool): builds, tests and benchmarks, everything under $OUT.
#   SEQPAR_GIT_COMMIT=$(git rev-parse --short HEAD) OUT=$OUT bash scripts/gpu_session.sh STAGES [bench args]
# STAGES: a comma-separated list of build, test, bench, or all (= build,test,bench),
# e.g. build,test or build,bench. They run in that order (build, test, bench) whatever
# the order given; an unknown stage stops the script before anything runs (exit 2).
# Extra arguments go to `python -m bench` (e.g. --quick, --only ring). SEQPAR_GIT_COMMIT
# stamps the results with the commit the tree came from (bench/hardware.py: git_commit).
# Each stage writes its log to $OUT and the next stage runs even when one fails; the exit
# status is the first failure's.
#
# Files under $OUT (the device tool brings back at most 8, at most 2 folders deep):
#   build  2  build.log (scripts/setup.sh's output, then pip's full build/install.log),
#             info.txt (nvidia-smi, python -m seqpar_kernels.info, versions)
#   test   2  test.log, junit.xml
#   bench  4  bench.log (NCCL pre-flight, then the bench's output),
#             results/<device>-nccl1-<date>.csv, .json (rewritten after every case, so a
#             run stopped at the time limit keeps the cases so far) and .png (at the end)
#   all    8; the script lists what $OUT holds at the end and warns above 8.
#
# build is quick when this tree is already built here: it records a fingerprint of the
# build's inputs (csrc/, CMakeLists.txt, setup.py, pyproject.toml, scripts/setup.sh,
# python and torch versions, SEQPAR_CUDA_ARCHS / SEQPAR_FORCE_CPU / CUDA_HOME) in
# build/gpu_session.stamp and skips scripts/setup.sh while it matches and the extension
# imports. SEQPAR_REBUILD=1 rebuilds anyway. A machine that went cold has no build/: the
# next call builds from scratch, so start each call with build (build,test; build,bench).
#
# test skips tests/test_attention_step_ahead_of_time.py (it compiles the Triton kernels
# for five GPU targets ahead of time: minutes, meant for CI machines without a GPU, and
# the GPU image's Triton differs). SEQPAR_PYTEST_ARGS adds pytest arguments, read as
# shell words, e.g. SEQPAR_PYTEST_ARGS='-x -k "ring or merge"'.
#
# bench first checks that NCCL works (world size 1, file:// rendezvous, one all_reduce on
# cuda:0) and says loudly in bench.log and here when it does not; the bench runs anyway.
set -uo pipefail
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the next line changes directory
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
AHEAD_OF_TIME_TESTS=tests/test_attention_step_ahead_of_time.py
STAMP=build/gpu_session.stamp
MAX_FILES=8

say() { echo "[gpu-session] $*"; }

stages_arg=${1:-all}
shift || true
if [[ ! $stages_arg =~ ^[a-z]+(,[a-z]+)*$ ]]; then
  say "stages must be a comma-separated list of build, test, bench, all; got '$stages_arg'" >&2
  exit 2
fi
want_build=0 want_test=0 want_bench=0
IFS=, read -ra requested <<<"$stages_arg"
for stage in "${requested[@]}"; do
  case $stage in
    build) want_build=1 ;;
    test) want_test=1 ;;
    bench) want_bench=1 ;;
    all) want_build=1 want_test=1 want_bench=1 ;;
    *)
      say "unknown stage '$stage' in '$stages_arg' (stages: build, test, bench, all)" >&2
      exit 2
      ;;
  esac
done
plan=()
[ $want_build = 1 ] && plan+=(build)
[ $want_test = 1 ] && plan+=(test)
[ $want_bench = 1 ] && plan+=(bench)
say "stages: ${plan[*]}; results in $OUT; commit ${SEQPAR_GIT_COMMIT:-unknown (set SEQPAR_GIT_COMMIT)}"
status=0

# run_stage NAME COMMAND...: runs COMMAND with its output appended to $OUT/NAME.log.
run_stage() {
  local name=$1
  shift
  say "$name: $*"
  local started=$SECONDS
  "$@" >>"$OUT/$name.log" 2>&1
  local code=$?
  say "$name: exit $code after $((SECONDS - started)) s (log: $name.log)"
  if [ $code -eq 0 ]; then tail -5 "$OUT/$name.log"; else tail -40 "$OUT/$name.log"; fi
  if [ $code -ne 0 ] && [ $status -eq 0 ]; then status=$code; fi
  return $code
}

# One python start (torch's import takes seconds): the versions the build depends on, then
# "built here" when the extension imports from this tree (an editable install of another
# copy would not do).
probe_install() {
  "$PYTHON" - <<'PY' 2>/dev/null
import pathlib
import sys

import torch

print(sys.version.split()[0], torch.__version__, torch.version.cuda)
try:
    import seqpar_kernels
    import seqpar_kernels._C  # noqa: F401
except Exception:  # noqa: BLE001
    raise SystemExit(0)
package = pathlib.Path(seqpar_kernels.__file__).resolve().parent
if package == (pathlib.Path.cwd() / "seqpar_kernels").resolve():
    print("built here")
PY
}

# $1: probe_install's output.
build_fingerprint() {
  {
    find csrc CMakeLists.txt setup.py pyproject.toml scripts/setup.sh -type f -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum
    head -1 <<<"$1"
    echo "SEQPAR_CUDA_ARCHS=${SEQPAR_CUDA_ARCHS:-} SEQPAR_FORCE_CPU=${SEQPAR_FORCE_CPU:-} CUDA_HOME=${CUDA_HOME:-}"
  } | sha256sum | cut -c1-16
}

build_stage() {
  local probe fingerprint
  probe=$(probe_install)
  fingerprint=$(build_fingerprint "$probe")
  if [ "${SEQPAR_REBUILD:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ] &&
    grep -qx "built here" <<<"$probe"; then
    echo "[build] up to date: this tree (fingerprint $fingerprint) is already built and installed" \
      "here; scripts/setup.sh skipped (SEQPAR_REBUILD=1 rebuilds)"
    return 0
  fi
  rm -f "$STAMP" build/install.log
  bash scripts/setup.sh
  local code=$?
  if [ -f build/install.log ]; then
    echo
    echo "===== build/install.log (pip install -v -e .) ====="
    cat build/install.log
  fi
  if [ $code -eq 0 ]; then
    # After the build: setup.sh may have installed torch, which the fingerprint covers.
    fingerprint=$(build_fingerprint "$(probe_install)")
    echo "$fingerprint" >"$STAMP"
    echo "[build] recorded fingerprint $fingerprint in $STAMP"
  fi
  return $code
}

write_info() {
  echo "commit: ${SEQPAR_GIT_COMMIT:-unknown}  date: $(date -u '+%Y-%m-%d %H:%M UTC')  host: $(hostname)"
  echo
  echo "===== nvidia-smi ====="
  nvidia-smi 2>&1 || echo "(nvidia-smi failed or is missing)"
  echo
  echo "===== python -m seqpar_kernels.info, then versions ====="
  "$PYTHON" - <<'PY' 2>&1
import platform
import runpy

import torch

try:
    runpy.run_module("seqpar_kernels.info", run_name="__main__")
except BaseException as error:  # noqa: BLE001 - the versions below still help
    print("python -m seqpar_kernels.info failed:", repr(error))
print()
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version())
try:
    print("NCCL", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as error:  # noqa: BLE001
    print("NCCL unknown:", error)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton not installed")
PY
}

nccl_preflight() {
  timeout -k 10 120 "$PYTHON" - <<'PY'
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    print("NCCL pre-flight: skipped (no CUDA GPU visible)")
    raise SystemExit(0)
started = time.perf_counter()
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
folder = tempfile.mkdtemp(prefix="seqpar_nccl_preflight_")
try:
    dist.init_process_group("nccl", init_method=f"file://{folder}/init", rank=0, world_size=1,
                            device_id=device)
    try:
        value = torch.ones(1, device=device)
        dist.all_reduce(value)
        torch.cuda.synchronize(device)
        assert value.item() == 1.0, value
    finally:
        dist.destroy_process_group()
finally:
    shutil.rmtree(folder, ignore_errors=True)
nccl = ".".join(map(str, torch.cuda.nccl.version()))
print(f"NCCL pre-flight: ok (NCCL {nccl}; init_process_group, all_reduce, destroy on "
      f"{torch.cuda.get_device_name(device)} in {time.perf_counter() - started:.1f} s)")
PY
}

if [ $want_build = 1 ]; then
  : >"$OUT/build.log"
  run_stage build build_stage
  write_info >"$OUT/info.txt" 2>&1
fi

if [ $want_test = 1 ]; then
  : >"$OUT/test.log"
  eval "pytest_extra=(${SEQPAR_PYTEST_ARGS:-})"  # shell words: quotes group, as on a command line
  note="skipping $AHEAD_OF_TIME_TESTS (--ignore: ahead-of-time Triton compiles for five GPU targets, meant for CI machines without a GPU)"
  say "test: $note"
  echo "[gpu-session] $note" >>"$OUT/test.log"
  run_stage test "$PYTHON" -m pytest -q -ra --durations=30 --junitxml="$OUT/junit.xml" \
    --ignore="$AHEAD_OF_TIME_TESTS" "${pytest_extra[@]}" tests
fi

if [ $want_bench = 1 ]; then
  : >"$OUT/bench.log"
  if ! run_stage bench nccl_preflight; then
    loud="!!!!! NCCL PRE-FLIGHT FAILED: torch.distributed with NCCL does not work on this machine; the bench (NCCL process group) will most likely fail too !!!!!"
    say "$loud"
    echo "[gpu-session] $loud" >>"$OUT/bench.log"
  fi
  run_stage bench "$PYTHON" -m bench --out "$OUT/results" "$@"
fi

files=$(cd "$OUT" && find . -type f | sed 's|^\./||' | LC_ALL=C sort)
count=$(printf '%s' "$files" | grep -c . || true)
say "$count files under \$OUT: $(printf "%s" "$files" | tr "\n" " ")"
if [ "$count" -gt $MAX_FILES ]; then
  say "WARNING: more than $MAX_FILES files under \$OUT: the device tool brings back only $MAX_FILES"
fi
exit $status
