#!/usr/bin/env bash
# Checks seqpar-kernels on a machine with a GPU, in one command, and writes it all into
# one folder, ready to commit under bench/results/. Two plans:
#
#   bash scripts/gpu_check.sh --short --out DIR [--offline] [--dry-run]
#       The short check: at most 540 s on one GPU (one H100: about 9 minutes), for a GPU
#       lent briefly. Each stage has a time box (SHORT_BOXES below): when it is up, the
#       stage gets SIGINT (pytest then writes its junit file, the bench keeps its rows),
#       SIGKILL a few seconds later, and the next stage runs; a stage may also use the
#       seconds earlier stages left unused. The stages, in order:
#         build  scripts/setup.sh for this GPU's architecture only (SEQPAR_CUDA_ARCHS
#                from nvidia-smi's compute capability, 9.0 -> 9.0a), MAX_JOBS = every
#                core, nothing installed offline; python -m seqpar_kernels.info
#         info   nvidia-smi, python -m seqpar_kernels.info, versions (into build.log)
#         preflight  NCCL with one rank under `timeout 60` (into test.log): a broken NCCL
#                costs 60 s here, not the NCCL tests' and the bench's time
#         test   the GPU tests (SHORT_TESTS: the CUDA kernels against the CPU kernels, the
#                Triton step kernels, the aten backend's library kernels, NCCL with one
#                rank, the Triton kernels of the gated delta rule and of the state-space
#                scans), on every core with pytest-xdist where installed (16 workers at
#                most, OMP_NUM_THREADS=2 each), a time limit per test with pytest-timeout,
#                each failure reported as it happens
#         bench  python -m bench --short on this GPU: the step kernels of both backends
#                against SDPA's flash and cuDNN, the bf16 d128 dk/dv tiles side by side
#                (16,128,8,2), (32,32,4,2), (32,64,8,2), (64,64,4,2) (about 20 s),
#                pack/unpack/merge against a plain copy, the ring's overlap probe; a bf16
#                matmul and a device copy measured first, the yardsticks beside the spec
#                sheet; records the measured step backend
#       then the headline numbers (python -m bench.runner.headline), printed last: TFLOP/s and
#       GB/s against the spec sheet and against the run's matmul and copy. DIR gets
#       <device>-<date>-<commit>-short/ with 8 files: summary.txt (device, driver, torch,
#       Triton, commit; each stage's exit status and time; the headline), build.log,
#       test.log, junit.xml, bench.log and the bench's .csv, .json and .png.
#
#   bash scripts/gpu_check.sh [--stages LIST] [--out DIR] [--offline] [--dry-run] [BENCH ARGS...]
#       The full check, for a machine with time: builds (scripts/setup.sh), runs the test
#       suite (the CUDA and Triton kernel tests run on the GPU), runs the GPU benchmarks
#       (`python -m bench`: every local GPU over NCCL), no time limits.
#
#   --stages LIST  comma-separated build, test, bench, or all (the default). They run in
#                  that order whatever the order given; an unknown stage stops the script
#                  before anything runs (exit 2). A stage runs even when an earlier one
#                  failed; the exit status is the first failure's (a stage stopped at
#                  its time box: 124, or 137 where it needed SIGKILL). With --short,
#                  "build" includes the info stage.
#   --out DIR      where the run's folder goes (default: $SEQPAR_RESULTS_DIR, else
#                  bench/results). The full check writes DIR/<device>-<YYYYMMDD-HHMM>-<commit>/:
#                    summary.txt  device, driver, torch, Triton, commit; each stage's
#                                 command, exit status, time
#                    info.txt     nvidia-smi, python -m seqpar_kernels.info, versions (after build)
#                    build.log    scripts/setup.sh's output, then pip's full build log
#                    test.log, junit.xml
#                    bench.log    the NCCL pre-flight check, then the bench's output
#                    <device>-nccl<P>-<date>.csv, .json, .png: the bench's results
#                  Every file names the device, the torch and Triton versions and the
#                  commit: the logs and summary.txt in their first line, junit.xml in its
#                  suite name, the bench's files in their JSON, their CSV's last columns
#                  and their plot's title (and the device in their name).
#   --offline      install nothing and ask no package index (pip gets PIP_NO_INDEX=1).
#                  Without it, whether an index answers is decided in about 2 s
#                  (scripts/package_index.sh), and offline is the same.
#   --dry-run      prints the run's folder and each stage's commands (with --short, each
#                  time box and what scripts/setup.sh would install); runs and writes nothing.
#   BENCH ARGS     go to `python -m bench` (e.g. --quick, --only ring); not with --short.
#
# After a short check on another machine, its folder comes back; then, in a checkout:
#   python -m bench.runner.headline DIR/<run>        the headline numbers again
#   python -m bench.runner.step_table DIR/<run>      the measured step backend into this
#                                             checkout's seqpar_kernels/engine/step_backends.json
#
# Environment: PYTHON (default python3); SEQPAR_GIT_COMMIT, the commit to stamp, for a
# copy of the tree without .git (default: `git rev-parse --short HEAD`, with "+dirty"
# when the package, csrc/ or bench/ have uncommitted changes); SEQPAR_PYTEST_ARGS, more
# pytest arguments as shell words, e.g. SEQPAR_PYTEST_ARGS='-x -k "ring or merge"';
# SEQPAR_OFFLINE (1/0: offline or not, decided); and scripts/setup.sh's (CUDA_HOME,
# SEQPAR_CUDA_ARCHS, MAX_JOBS). SEQPAR_GPU_CHECK_OVERRIDES names a bash file sourced
# before the plan runs, for this script's own tests (tests/test_gpu_check.py).
#
# The full test stage skips tests/test_attention_step_ahead_of_time.py: it compiles the
# Triton kernels ahead of time for five GPU targets, which is how machines without a GPU
# (CI) check them; here the kernels run.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
export PYTHON
AHEAD_OF_TIME_TESTS=tests/test_attention_step_ahead_of_time.py
# shellcheck source=scripts/package_index.sh
source "$REPO/scripts/package_index.sh"

# The short check's time boxes, in seconds, in the order the stages run; 520 of the 540
# allowed, the rest for bash itself. Why each is what it is:
#   prepare  nvidia-smi, git, two metadata reads, the package index's 2 s at most
#   build    6 C++/CUDA files side by side, one target: the slowest file (a .cu with the
#            ATen headers, about 60 s on one core) + CMake's configure and pip: ~90 s
#   info     three Python start-ups that import torch (warm after the build)
#   preflight  one Python start-up, NCCL's init (seconds); `timeout 60` inside: what it
#            leaves unused goes to the tests
#   test     a few hundred Triton compiles (2-3 s of one core each) over 16 workers,
#            their start-up, the GPU work (seconds): ~100-150 s
#   bench    the matmul and copy (~2 s), 12 step cases (each ~1 s of timed rounds after
#            its warm-up), ~8 step kernel compiles in one process, 4 dk/dv tiles (~5 s
#            each, compile included), 8 data-movement and 5 probe cases, the plot: ~110 s
#   report   one Python start-up that reads the folder
declare -A SHORT_BOXES=([prepare]=10 [build]=130 [info]=15 [preflight]=65 [test]=165 [bench]=125 [report]=10)
SHORT_ORDER=(prepare build info preflight test bench report)
SHORT_LIMIT=540
# Seconds between a stage's SIGINT and its SIGKILL, inside its box: pytest-xdist stops its
# workers and writes junit.xml; the bench has written every finished case already.
declare -A SHORT_GRACE=([build]=10 [info]=5 [preflight]=5 [test]=25 [bench]=15)
# The pre-flight's own limit in the short check (the full check's bench stage: 120 s).
SHORT_PREFLIGHT_SECONDS=60
# The short check's tests, in the order pytest-xdist hands them out: the build's report,
# the CUDA kernels against the CPU kernels, the aten backend's library kernels and NCCL
# with one rank, the Triton step kernels (the longest: a compile per kernel variant),
# then the ring on one GPU, the recurrences' kernels. `-m "not gpu_long"` leaves out the
# step kernels' variants this Triton does not ship and the state-space kernels' compiles
# for other GPUs (here they run).
SHORT_TESTS=(
  tests/test_info.py
  tests/test_block_copy.py
  tests/test_attention_merge.py
  tests/test_gpu_paths.py
  tests/test_attention_step_forward.py
  tests/test_attention_step_backward.py
  tests/test_attention_step_intervals.py
  tests/test_attention_step_tiles.py
  tests/test_ring_attention.py::test_one_gpu_matches_reference
  tests/test_ring_schedule.py::test_one_gpu_virtual_ring_overlapped_copies_match_serial_copies
  tests/test_attention_layouts.py::test_cuda_paths_take_any_layout
  tests/test_gated_delta_kernels.py
  tests/test_state_space_kernels.py
)
SHORT_TEST_TIMEOUT=120  # seconds per test (pytest-timeout), compiles included
SHORT_BENCH=(--short --world-size 1 --only ring-step --only kernels --only ring-probe)
# The short check's folder holds these and nothing else.
SHORT_FILES=(summary.txt build.log test.log junit.xml bench.log "<bench>.csv" "<bench>.json" "<bench>.png")

say() { echo "[gpu-check] $*"; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

stages_arg=all
results_dir=${SEQPAR_RESULTS_DIR:-}
dry_run=0
short=0
bench_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --short) short=1; shift ;;
    --stages) stages_arg=${2:?--stages needs a list}; shift 2 ;;
    --stages=*) stages_arg=${1#*=}; shift ;;
    --out) results_dir=${2:?--out needs a folder}; shift 2 ;;
    --out=*) results_dir=${1#*=}; shift ;;
    --offline) export SEQPAR_OFFLINE=1 SEQPAR_OFFLINE_REASON="--offline"; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bench_args+=("$1"); shift ;;
  esac
done
if [ $short = 1 ] && [ ${#bench_args[@]} -gt 0 ]; then
  say "--short runs its own bench plan; unknown arguments: ${bench_args[*]}" >&2
  exit 2
fi
# A folder given is read from where the script was started; the default is the repository's.
if [ -n "$results_dir" ]; then
  results_dir=$(realpath -m -- "$results_dir")
else
  results_dir=$REPO/bench/results
fi
cd "$REPO" || exit 2

want_build=0 want_test=0 want_bench=0
IFS=, read -ra requested <<<"$stages_arg"
[ ${#requested[@]} -gt 0 ] || requested=("")
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

# The GPUs, one line each: "name, compute capability, driver", from nvidia-smi, else
# torch where an NVIDIA device file is present (torch takes seconds to import).
gpu_query() {
  local lines
  if lines=$(timeout 10 nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null) \
    && [ -n "$lines" ]; then
    echo "$lines"
    return
  fi
  [ -e /dev/nvidia0 ] || [ -d /proc/driver/nvidia ] || return 0
  timeout 60 "$PYTHON" -c 'import torch
for i in range(torch.cuda.device_count()):
    major, minor = torch.cuda.get_device_capability(i)
    print(f"{torch.cuda.get_device_name(i)}, {major}.{minor}, unknown")' 2>/dev/null
}

# As bench/runner/hardware.py's device_slug: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3".
slug() {
  tr '[:upper:]' '[:lower:]' <<<"$1" | sed -e 's/(r)//g; s/(tm)//g; s/processor//g' \
    -e 's/[^a-z0-9][^a-z0-9]*/-/g; s/^-*//; s/-*$//'
}

# As bench/runner/hardware.py's git_commit, which reads SEQPAR_GIT_COMMIT first: exported below,
# so the bench stamps the same commit.
git_commit() {
  if [ -n "${SEQPAR_GIT_COMMIT:-}" ]; then
    echo "$SEQPAR_GIT_COMMIT"
    return
  fi
  local commit
  if ! commit=$(git rev-parse --short HEAD 2>/dev/null); then
    echo unknown
    return
  fi
  if [ -n "$(git status --porcelain -- seqpar_kernels csrc bench ':!bench/results' 2>/dev/null)" ]; then
    commit+="+dirty"
  fi
  echo "$commit"
}

# "torch: <release> | triton: <release>", from their metadata (importing torch takes seconds).
versions() {
  "$PYTHON" -c 'import importlib.metadata as m
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "not installed"
print(" | ".join(f"{name}: {version(name)}" for name in ("torch", "triton")))' 2>/dev/null || echo "torch: unknown"
}

# One line that names what a file describes; torch is read when the line is written (the
# build stage may install it).
stamp() {
  echo "seqpar-kernels gpu_check$([ $short = 1 ] && echo " --short") | device: $device | driver: $driver" \
    "| $(versions) | commit: $commit | $(date -u '+%Y-%m-%d %H:%M UTC') | host: $(hostname)"
}

pytest_command() {
  local extra=()
  eval "extra=(${SEQPAR_PYTEST_ARGS:-})"  # shell words: quotes group, as on a command line
  local suite
  suite="seqpar-kernels | device: $device | $(versions) | commit: $commit"
  local arguments=(-ra --junitxml="$RUN/junit.xml" -o "junit_suite_name=$suite") method
  if [ $short = 1 ]; then
    # -v: a line per test as it ends, so a run stopped at its box shows how far it got.
    arguments+=(-v -p no:cacheprovider --durations=15 -m "not gpu_long")
    if "$PYTHON" -c 'import xdist' 2>/dev/null; then
      # One worker per core: they compile the Triton kernels side by side (a compile
      # runs on one core) and share the GPU; a worker that a per-test time limit ends is
      # replaced, the run goes on.
      arguments+=(-n "$(($(nproc) < 16 ? $(nproc) : 16))")
      method=thread
    else
      method=signal  # one process: ending it would lose junit.xml
    fi
    if "$PYTHON" -c 'import pytest_timeout' 2>/dev/null; then
      arguments+=(--timeout "$SHORT_TEST_TIMEOUT" --timeout-method "$method")
    fi
    arguments+=(${extra[@]+"${extra[@]}"} "${SHORT_TESTS[@]}")
  else
    arguments+=(-q --durations=30 --ignore="$AHEAD_OF_TIME_TESTS" ${extra[@]+"${extra[@]}"} tests)
  fi
  printf '%q ' "$PYTHON" -m pytest "${arguments[@]}"
}

# The short check's build: this GPU's architecture only ("9.0" -> "9.0a", Hopper's own
# instructions; others as they are; none known: setup.py's default), every core.
short_build_env() {
  local archs=${SEQPAR_CUDA_ARCHS:-}
  if [ -z "$archs" ] && [[ $compute_cap =~ ^[0-9]+\.[0-9]+$ ]]; then
    archs=$compute_cap
    [ "$archs" = 9.0 ] && archs=9.0a
  fi
  echo ${archs:+"SEQPAR_CUDA_ARCHS=$archs"} "MAX_JOBS=${MAX_JOBS:-$(nproc)}"
}

# short_command STAGE: sets `command` to the argv of STAGE in the short check.
short_command() {
  case $1 in
    build)
      read -ra command <<<"env $(short_build_env)"
      command+=(bash scripts/setup.sh) ;;
    info) command=(bash -c write_info) ;;
    preflight) command=(env NCCL_PREFLIGHT_SECONDS=$SHORT_PREFLIGHT_SECONDS bash -c nccl_preflight) ;;
    test)
      eval "command=($(pytest_command))"
      # 16 workers of torch's default OpenMP threads (one per core each) would ask for
      # 16 x 16 threads on 16 cores; 2 each keep the CPU work of the tests from thrashing.
      command=(env PYTHONUNBUFFERED=1 SEQPAR_FAILURES_AT_ONCE=1 OMP_NUM_THREADS=2 "${command[@]}") ;;
    bench) command=(env PYTHONUNBUFFERED=1 "$PYTHON" -m bench "${SHORT_BENCH[@]}" --out "$RUN") ;;
  esac
}

# Which file a short stage writes its output to.
short_log() {
  case $1 in
    info) echo build.log ;;
    preflight) echo test.log ;;
    *) echo "$1.log" ;;
  esac
}

write_info() {
  stamp
  echo
  echo "===== nvidia-smi ====="
  timeout 20 nvidia-smi 2>&1 || echo "(nvidia-smi failed or is missing)"
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

# The short plan: each stage's box and what it runs (the dry run prints it; the test of
# this script checks it).
short_plan() {
  local total=0 stage
  say "short plan: at most $SHORT_LIMIT s; device $device (compute capability $compute_cap, driver $driver);" \
    "commit $commit; $offline_line"
  say "the run's folder would be $RUN"
  for stage in "${SHORT_ORDER[@]}"; do
    case $stage in
      prepare) ;;
      report) ;;
      *) [[ " ${plan[*]} " == *" $stage "* ]] || continue ;;
    esac
    total=$((total + SHORT_BOXES[$stage]))
    case $stage in
      prepare) say "box prepare ${SHORT_BOXES[prepare]} s: GPU, commit, versions; package index (at most 2 s)" ;;
      preflight)
        short_command "$stage"
        say "box preflight ${SHORT_BOXES[preflight]} s: NCCL with one rank under timeout $SHORT_PREFLIGHT_SECONDS:" \
          "$(printf '%q ' "${command[@]}")>> $(short_log "$stage")" ;;
      report) say "box report ${SHORT_BOXES[report]} s: the headline: $PYTHON -m bench.runner.headline $RUN" ;;
      *)
        short_command "$stage"
        say "box $stage ${SHORT_BOXES[$stage]} s (SIGINT when it is up, SIGKILL ${SHORT_GRACE[$stage]} s later):" \
          "$(printf '%q ' "${command[@]}")>> $(short_log "$stage")"
        if [ "$stage" = build ]; then
          bash scripts/setup.sh --dry-run 2>&1 | sed 's/^/    /'
        fi
        [ "$stage" = test ] && say "    OMP_NUM_THREADS=2 for each of the (at most 16) pytest-xdist workers"
        [ "$stage" = bench ] && say "    a bf16 matmul and a device copy first (the yardsticks beside the spec sheet);" \
          "the bf16 d128 dk/dv tiles (16,128,8,2) (32,32,4,2) (32,64,8,2) (64,64,4,2) side by side (about 20 s)"
        ;;
    esac
  done
  say "total $total s of $SHORT_LIMIT"
  say "files (${#SHORT_FILES[@]}): ${SHORT_FILES[*]}"
  say "environment: SEQPAR_OFFLINE=$SEQPAR_OFFLINE PIP_NO_INDEX=${PIP_NO_INDEX:-} PYTHON=$PYTHON"
}

# Sourced here, after every definition and before the plan: this script's own tests
# replace the GPU query, the boxes and the stages' commands (tests/test_gpu_check.py).
if [ -n "${SEQPAR_GPU_CHECK_OVERRIDES:-}" ]; then
  # shellcheck source=/dev/null
  source "$SEQPAR_GPU_CHECK_OVERRIDES"
fi

mapfile -t gpus < <(gpu_query | sed '/^$/d')
if [ ${#gpus[@]} -eq 0 ]; then
  if [ $dry_run = 0 ]; then
    say "no GPU found (nvidia-smi, torch.cuda): this script checks the GPU paths." \
      "Without a GPU, scripts/test.sh and scripts/bench.sh test and benchmark the CPU paths." >&2
    exit 2
  fi
  gpus=("no GPU, -, -")
fi
IFS=, read -r gpu_name compute_cap driver <<<"${gpus[0]}"
compute_cap=${compute_cap// /} driver=${driver// /}
device=$gpu_name
[ ${#gpus[@]} -gt 1 ] && device+=" x ${#gpus[@]}"
commit=$(git_commit)
if [ "$commit" = unknown ]; then
  say "WARNING: no .git here and SEQPAR_GIT_COMMIT is not set: the results will name commit 'unknown'" >&2
fi
export SEQPAR_GIT_COMMIT=$commit
run_name="$(slug "$gpu_name")-$(date +%Y%m%d-%H%M)-$(slug "$commit")"
[ $short = 1 ] && run_name+=-short
RUN=$results_dir/$run_name
plan=()
[ $want_build = 1 ] && plan+=(build)
[ $want_build = 1 ] && [ $short = 1 ] && plan+=(info)
[ $want_test = 1 ] && [ $short = 1 ] && plan+=(preflight)
[ $want_test = 1 ] && plan+=(test)
[ $want_bench = 1 ] && plan+=(bench)

if package_index_offline; then
  # Whatever else runs pip asks no index either.
  export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
fi
offline_line="offline: $SEQPAR_OFFLINE ($SEQPAR_OFFLINE_REASON)"
# The info stage runs write_info in a process of its own (a time box needs one).
export short device driver commit
export -f write_info stamp versions

if [ $dry_run = 1 ]; then
  if [ $short = 1 ]; then
    short_plan
    exit 0
  fi
  say "dry run: stages ${plan[*]}; device $device; commit $commit; $offline_line"
  say "the run's folder would be $RUN"
  [ $want_build = 1 ] && say "build: bash scripts/setup.sh > build.log (then build/install.log), info.txt"
  [ $want_test = 1 ] && say "test: $(pytest_command)> test.log"
  [ $want_bench = 1 ] && say "bench: NCCL pre-flight, then $(printf '%q ' "$PYTHON" -m bench --out "$RUN" \
    ${bench_args[@]+"${bench_args[@]}"})> bench.log"
  exit 0
fi

mkdir -p "$RUN"
say "stages: ${plan[*]}; device $device; commit $commit; $offline_line; results in $RUN"
stamp >"$RUN/summary.txt"
echo "$offline_line" >>"$RUN/summary.txt"
status=0

# run_stage NAME COMMAND...: runs COMMAND with its output appended to $RUN/NAME.log and
# its exit status and time added to summary.txt, where it is named by $LABEL if set.
run_stage() {
  local name=$1
  shift
  local what=${LABEL:-$*}
  say "$name: $what"
  local started=$SECONDS
  "$@" >>"$RUN/$name.log" 2>&1
  local code=$?
  local line="$name: exit $code after $((SECONDS - started)) s: $what"
  say "$line (log: $name.log)"
  echo "$line" >>"$RUN/summary.txt"
  if [ $code -eq 0 ]; then tail -5 "$RUN/$name.log"; else tail -40 "$RUN/$name.log"; fi
  if [ $code -ne 0 ] && [ $status -eq 0 ]; then status=$code; fi
  return $code
}

# shellcheck disable=SC2329  # run through run_stage
build_stage() {
  rm -f build/install.log
  bash scripts/setup.sh
  local code=$?
  if [ -f build/install.log ]; then
    echo
    echo "===== build/install.log (pip install -v --no-build-isolation -e .) ====="
    cat build/install.log
  fi
  return "$code"
}

# World size 1, file:// rendezvous, one all_reduce on cuda:0: a broken NCCL shows here in
# seconds rather than as a hang or a crash inside the bench.
# shellcheck disable=SC2329  # run through run_stage
nccl_preflight() {
  timeout -k 10 "${NCCL_PREFLIGHT_SECONDS:-120}" "$PYTHON" - <<'PY'
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    raise SystemExit("NCCL pre-flight: torch sees no CUDA GPU")
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
export -f nccl_preflight
NCCL_FAILED="!!!!! NCCL PRE-FLIGHT FAILED: torch.distributed with NCCL does not work on this machine; its tests and the bench (NCCL process group) will most likely fail too !!!!!"

# run_boxed STAGE: the short check's STAGE, its output appended to its log, given SIGINT
# when its box is up (the boxes of the stages so far, from the script's start, so that
# it also gets what earlier stages left unused) and SIGKILL its grace later; exit status,
# time and box into summary.txt.
scheduled_end=${SHORT_BOXES[prepare]}
run_boxed() {
  local stage=$1 log
  log=$(short_log "$stage")
  scheduled_end=$((scheduled_end + SHORT_BOXES[$stage]))
  local limit=$((scheduled_end - SECONDS)) grace=${SHORT_GRACE[$stage]}
  [ $limit -gt $((grace + 2)) ] || limit=$((grace + 2))  # earlier stages overran: still a try
  short_command "$stage"
  say "$stage: up to $limit s (box ${SHORT_BOXES[$stage]} s): $(printf '%q ' "${command[@]}")"
  echo "===== $stage: $(printf '%q ' "${command[@]}") =====" >>"$RUN/$log"
  local started=$SECONDS
  timeout -s INT -k "$grace" $((limit - grace)) "${command[@]}" >>"$RUN/$log" 2>&1
  local code=$?
  local outcome="exit $code"
  case $code in
    124) outcome="STOPPED at its time box (SIGINT; exit 124)" ;;
    137) outcome="STOPPED at its time box (SIGINT, then SIGKILL; exit 137)" ;;
  esac
  local line="$stage: $outcome after $((SECONDS - started)) s (box ${SHORT_BOXES[$stage]} s, limit $limit s; log: $log)"
  say "$line"
  echo "$line" >>"$RUN/summary.txt"
  STAGE_LINES+=("$line")
  if [ "$stage" = build ] && [ -f build/install.log ]; then
    {
      echo
      echo "===== build/install.log (pip install -v --no-build-isolation --no-index -e .) ====="
      cat build/install.log
    } >>"$RUN/$log"
  fi
  if [ "$stage" = preflight ] && [ $code -ne 0 ]; then
    say "$NCCL_FAILED"
    echo "$NCCL_FAILED" >>"$RUN/$log"
  fi
  if [ "$stage" = test ]; then
    # Every failure, already in the log as it happened; here too, for the console.
    grep -E "^FAILED |^ERROR " "$RUN/$log" | sort -u | head -20
  fi
  if [ $code -ne 0 ]; then tail -25 "$RUN/$log"; fi
  if [ $code -ne 0 ] && [ $status -eq 0 ]; then status=$code; fi
}

if [ $short = 1 ]; then
  STAGE_LINES=()
  rm -f build/install.log
  for stage in "${plan[@]}"; do
    [ "$stage" = info ] || stamp >>"$RUN/$(short_log "$stage")"  # write_info begins with it
    run_boxed "$stage"
  done
  # A file half written when a stage was stopped (the bench writes through .tmp files).
  find "$RUN" -name '*.tmp' -delete
  report=$(timeout 10 "$PYTHON" -m bench.runner.headline "$RUN" 2>&1)
  {
    echo
    echo "===== headline ====="
    echo "$report"
    echo "exit $status"
  } >>"$RUN/summary.txt"
  echo
  echo "===== seqpar-kernels short GPU check: $device | driver: $driver | $(versions) | commit: $commit ====="
  printf '%s\n' "${STAGE_LINES[@]}"
  echo "$report"
  echo
  echo "exit $status in $SECONDS s; $(find "$RUN" -type f | wc -l) files in $RUN:"
  (cd "$RUN" && find . -type f | sed 's|^\./|  |' | LC_ALL=C sort)
  exit $status
fi

if [ $want_build = 1 ]; then
  stamp >"$RUN/build.log"
  LABEL="bash scripts/setup.sh, then build/install.log" run_stage build build_stage
  write_info >"$RUN/info.txt" 2>&1
fi

if [ $want_test = 1 ]; then
  stamp >"$RUN/test.log"
  note="skipping $AHEAD_OF_TIME_TESTS (ahead-of-time Triton compiles, for machines without a GPU)"
  say "test: $note"
  echo "$note" >>"$RUN/test.log"
  test_command=()
  eval "test_command=($(pytest_command))"
  run_stage test "${test_command[@]}"
fi

if [ $want_bench = 1 ]; then
  stamp >"$RUN/bench.log"
  if ! LABEL="NCCL pre-flight (world size 1, one all_reduce on cuda:0)" run_stage bench nccl_preflight; then
    say "$NCCL_FAILED"
    echo "$NCCL_FAILED" >>"$RUN/bench.log"
  fi
  run_stage bench "$PYTHON" -m bench --out "$RUN" ${bench_args[@]+"${bench_args[@]}"}
fi

say "exit $status; files in $RUN:"
(cd "$RUN" && find . -type f | sed 's|^\./|  |' | LC_ALL=C sort)
echo "exit $status" >>"$RUN/summary.txt"
exit $status
