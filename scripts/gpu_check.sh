#!/usr/bin/env bash
# Checks seqpar-kernels on a machine with a GPU, in one command: builds the extension
# (scripts/setup.sh, which compiles the CUDA kernels there), runs the test suite (the CUDA
# and Triton kernel tests run on the GPU), runs the GPU benchmarks (`python -m bench`:
# every local GPU over NCCL), and writes it all into one folder, ready to commit under
# bench/results/.
#
#   bash scripts/gpu_check.sh [--stages LIST] [--out DIR] [--dry-run] [BENCH ARGS...]
#
#   --stages LIST  comma-separated build, test, bench, or all (the default). They run in
#                  that order whatever the order given; an unknown stage stops the script
#                  before anything runs (exit 2). A stage runs even when an earlier one
#                  failed; the exit status is the first failure's.
#   --out DIR      where the run's folder goes (default: $SEQPAR_RESULTS_DIR, else
#                  bench/results). The run writes DIR/<device>-<YYYYMMDD-HHMM>-<commit>/:
#                    summary.txt  device, torch, commit; each stage's command, exit status, time
#                    info.txt     nvidia-smi, python -m seqpar_kernels.info, versions (after build)
#                    build.log    scripts/setup.sh's output, then pip's full build log
#                    test.log, junit.xml
#                    bench.log    the NCCL pre-flight check, then the bench's output
#                    <device>-nccl<P>-<date>.csv, .json, .png: the bench's results
#                  Every file names the device, the torch version and the commit: the logs
#                  and summary.txt in their first line, junit.xml in its suite name, the
#                  bench's files in their name, their JSON and their plot's title.
#   --dry-run      prints the run's folder and each stage's commands; runs and writes nothing.
#   BENCH ARGS     go to `python -m bench` (e.g. --quick, --only ring).
#
# Environment: PYTHON (default python3); SEQPAR_GIT_COMMIT, the commit to stamp, for a
# copy of the tree without .git (default: `git rev-parse --short HEAD`, with "+dirty"
# when the package, csrc/ or bench/ have uncommitted changes); SEQPAR_PYTEST_ARGS, more
# pytest arguments as shell words, e.g. SEQPAR_PYTEST_ARGS='-x -k "ring or merge"';
# and scripts/setup.sh's (CUDA_HOME, SEQPAR_CUDA_ARCHS, MAX_JOBS).
#
# The test stage skips tests/test_attention_step_ahead_of_time.py: it compiles the Triton
# kernels ahead of time for five GPU targets, which is how machines without a GPU (CI)
# check them; here the kernels run.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
export PYTHON
AHEAD_OF_TIME_TESTS=tests/test_attention_step_ahead_of_time.py

say() { echo "[gpu-check] $*"; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

stages_arg=all
results_dir=${SEQPAR_RESULTS_DIR:-}
dry_run=0
bench_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --stages) stages_arg=${2:?--stages needs a list}; shift 2 ;;
    --stages=*) stages_arg=${1#*=}; shift ;;
    --out) results_dir=${2:?--out needs a folder}; shift 2 ;;
    --out=*) results_dir=${1#*=}; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) bench_args+=("$1"); shift ;;
  esac
done
# A folder given is read from where the script was started; the default is the repository's.
if [ -n "$results_dir" ]; then
  results_dir=$(realpath -m -- "$results_dir")
else
  results_dir=$REPO/bench/results
fi
cd "$REPO"

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

# The GPUs, one name a line: nvidia-smi's, else torch's (when torch is installed).
gpu_names() {
  local names
  if names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) && [ -n "$names" ]; then
    echo "$names"
    return
  fi
  "$PYTHON" -c 'import torch; [print(torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]' \
    2>/dev/null
}

# As bench/hardware.py's device_slug: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3".
slug() {
  tr '[:upper:]' '[:lower:]' <<<"$1" | sed -e 's/(r)//g; s/(tm)//g; s/processor//g' \
    -e 's/[^a-z0-9][^a-z0-9]*/-/g; s/^-*//; s/-*$//'
}

# As bench/hardware.py's git_commit, which reads SEQPAR_GIT_COMMIT first: exported below,
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

torch_version() {
  "$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo "not installed"
}

mapfile -t gpus < <(gpu_names | sed '/^$/d')
if [ ${#gpus[@]} -eq 0 ]; then
  if [ $dry_run = 0 ]; then
    say "no GPU found (nvidia-smi, torch.cuda): this script checks the GPU paths." \
      "Without a GPU, scripts/test.sh and scripts/bench.sh test and benchmark the CPU paths." >&2
    exit 2
  fi
  gpus=("no GPU")
fi
device=${gpus[0]}
[ ${#gpus[@]} -gt 1 ] && device+=" x ${#gpus[@]}"
commit=$(git_commit)
if [ "$commit" = unknown ]; then
  say "WARNING: no .git here and SEQPAR_GIT_COMMIT is not set: the results will name commit 'unknown'" >&2
fi
export SEQPAR_GIT_COMMIT=$commit
run_name="$(slug "${gpus[0]}")-$(date +%Y%m%d-%H%M)-$(slug "$commit")"
RUN=$results_dir/$run_name
plan=()
[ $want_build = 1 ] && plan+=(build)
[ $want_test = 1 ] && plan+=(test)
[ $want_bench = 1 ] && plan+=(bench)

# One line that names what a file describes; torch is read when the line is written (the
# build stage may install it).
stamp() {
  echo "seqpar-kernels gpu_check | device: $device | torch: $(torch_version) | commit: $commit" \
    "| $(date -u '+%Y-%m-%d %H:%M UTC') | host: $(hostname)"
}

pytest_command() {
  eval "local extra=(${SEQPAR_PYTEST_ARGS:-})"  # shell words: quotes group, as on a command line
  local suite
  suite="seqpar-kernels | device: $device | torch: $(torch_version) | commit: $commit"
  printf '%q ' "$PYTHON" -m pytest -q -ra --durations=30 --junitxml="$RUN/junit.xml" \
    -o "junit_suite_name=$suite" --ignore="$AHEAD_OF_TIME_TESTS" ${extra[@]+"${extra[@]}"} tests
}

if [ $dry_run = 1 ]; then
  say "dry run: stages ${plan[*]}; device $device; commit $commit"
  say "the run's folder would be $RUN"
  [ $want_build = 1 ] && say "build: bash scripts/setup.sh > build.log (then build/install.log), info.txt"
  [ $want_test = 1 ] && say "test: $(pytest_command)> test.log"
  [ $want_bench = 1 ] && say "bench: NCCL pre-flight, then $(printf '%q ' "$PYTHON" -m bench --out "$RUN" \
    ${bench_args[@]+"${bench_args[@]}"})> bench.log"
  exit 0
fi

mkdir -p "$RUN"
say "stages: ${plan[*]}; device $device; commit $commit; results in $RUN"
stamp >"$RUN/summary.txt"
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

build_stage() {
  rm -f build/install.log
  bash scripts/setup.sh
  local code=$?
  if [ -f build/install.log ]; then
    echo
    echo "===== build/install.log (pip install -v --no-build-isolation -e .) ====="
    cat build/install.log
  fi
  return $code
}

write_info() {
  stamp
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

# World size 1, file:// rendezvous, one all_reduce on cuda:0: a broken NCCL shows here in
# seconds rather than as a hang or a crash inside the bench.
nccl_preflight() {
  timeout -k 10 120 "$PYTHON" - <<'PY'
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
  eval "test_command=($(pytest_command))"
  run_stage test "${test_command[@]}"
fi

if [ $want_bench = 1 ]; then
  stamp >"$RUN/bench.log"
  if ! LABEL="NCCL pre-flight (world size 1, one all_reduce on cuda:0)" run_stage bench nccl_preflight; then
    loud="!!!!! NCCL PRE-FLIGHT FAILED: torch.distributed with NCCL does not work on this machine; the bench (NCCL process group) will most likely fail too !!!!!"
    say "$loud"
    echo "$loud" >>"$RUN/bench.log"
  fi
  run_stage bench "$PYTHON" -m bench --out "$RUN" ${bench_args[@]+"${bench_args[@]}"}
fi

say "exit $status; files in $RUN:"
(cd "$RUN" && find . -type f | sed 's|^\./|  |' | LC_ALL=C sort)
echo "exit $status" >>"$RUN/summary.txt"
exit $status
