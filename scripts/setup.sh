#!/usr/bin/env bash
# Sets up a machine to build, test and benchmark seqpar-kernels; safe to run again.
#   - keeps the torch you have (2.6 or newer); installs torch==2.14.1 if there is none
#   - installs the build, test and benchmark tools that are missing
#   - builds the extension in place (pip install --no-build-isolation -e .): CPU kernels
#     always, CUDA kernels when a CUDA toolkit and a CUDA build of torch are present
#     (setup.py finds the toolkit and decides; its lines are in build/install.log)
# Without a package index (scripts/package_index.sh decides in about 2 s; SEQPAR_OFFLINE=1
# says so at once) it installs nothing: it names what is missing, the optional parts
# (transformers, TRL, their oldest supported releases) are skipped and their tests skip.
#
#   bash scripts/setup.sh [--dry-run]
#   --dry-run  prints what it would install, skip and build; installs and builds nothing.
# Environment: PYTHON (default python3), SEQPAR_TORCH (default torch==2.14.1),
# SEQPAR_OFFLINE, CUDA_HOME, SEQPAR_CUDA_ARCHS, MAX_JOBS, SEQPAR_FORCE_CPU=1 (see setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SEQPAR_TORCH=${SEQPAR_TORCH:-torch==2.14.1}
# shellcheck source=scripts/package_index.sh
source scripts/package_index.sh

dry_run=0
case ${1:-} in
  --dry-run) dry_run=1 ;;
  "") ;;
  *) echo "usage: bash scripts/setup.sh [--dry-run]" >&2; exit 2 ;;
esac

say() { echo "[setup] $*"; }

# pip_install WHAT PIP-ARGS...: `pip install PIP-ARGS` from the package index; offline it
# says what it leaves out and returns 1 (the caller says what that costs).
pip_install() {
  local what=$1
  shift
  if package_index_offline; then
    say "offline ($SEQPAR_OFFLINE_REASON): not installing $what"
    return 1
  fi
  if [ $dry_run = 1 ]; then
    say "would install $what: $PYTHON -m pip install $*"
    return 0
  fi
  say "installing $what"
  "$PYTHON" -m pip install "$@"
}

# The modules (of module:package pairs) that cannot be imported, as their packages; found
# without importing them (torch and transformers take seconds to import).
missing_packages() {
  "$PYTHON" - "$@" <<'PY'
import importlib.util
import sys

for pair in sys.argv[1:]:
    module, package = pair.split(":", 1)
    if importlib.util.find_spec(module) is None:
        print(package)
PY
}

# The installed torch's release, read from its metadata (importing it takes seconds).
if ! "$PYTHON" - <<'PY' 2>/dev/null
from importlib.metadata import version
major, minor = (int(part) for part in version("torch").split(".")[:2])
raise SystemExit(0 if (major, minor) >= (2, 6) else 1)
PY
then
  pip_install "$SEQPAR_TORCH" -q "$SEQPAR_TORCH" || say "no torch 2.6 or newer: the build will fail"
fi

# Python modules the build, tests and benchmarks import; install only what is missing
# (the GPU machines reach no package index, and have most of these already).
mapfile -t missing < <(missing_packages pybind11:pybind11 pytest:pytest matplotlib:matplotlib numpy:numpy ruff:ruff \
    importlinter:import-linter)
command -v cmake >/dev/null || missing+=("cmake>=3.18")
command -v ninja >/dev/null || [ -z "$(missing_packages ninja:ninja)" ] || missing+=(ninja)
if [ ${#missing[@]} -gt 0 ]; then
  pip_install "${missing[*]}" -q "${missing[@]}" || say "missing ${missing[*]}: the build or some tests may fail"
fi

# The installed release of a package, or nothing; read from its metadata.
installed_version() {
  "$PYTHON" - "$1" <<'PY' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
PY
}

# An integration's library at the release its tests were last run against (NAME==TESTED),
# so that the test command says the same thing on every day, whatever the library
# released since: installed where it is missing or another release (a newer one is taken
# by moving its pin here once the tests pass with it). Offline, the release there is kept.
tested_release() {
  local name=$1 tested=$2
  local have
  have=$(installed_version "$name")
  if [ "$have" != "$tested" ]; then
    pip_install "$name==$tested (optional: the integration's tests; ${have:-none} installed)" -q "$name==$tested" ||
      say "no $name $tested: its tests run against ${have:-nothing (they skip)}"
  fi
}

# An optional dependency of an integration: the tested release in the environment for its
# tests, and the oldest supported one in build/NAME-VERSION, which its tests put first on
# PYTHONPATH (with the pins given after the version beside it). Skipped offline.
optional_dependency() {
  local name=$1 tested=$2 oldest=$3
  shift 3
  tested_release "$name" "$tested"
  local oldest_dir="build/$name-$oldest"
  # The directory records its pins: a change of them installs it again.
  if [ ! -d "$oldest_dir/$name" ] || [ "$(cat "$oldest_dir/.pins" 2>/dev/null)" != "$*" ]; then
    if [ $dry_run = 0 ]; then mkdir -p build; rm -rf "$oldest_dir.partial"; fi
    if pip_install "$name==$oldest into $oldest_dir (the oldest supported release)" -q \
      --no-deps --target "$oldest_dir.partial" "$name==$oldest" "$@"; then
      if [ $dry_run = 0 ]; then
        echo "$*" > "$oldest_dir.partial/.pins"
        rm -rf "$oldest_dir"
        mv "$oldest_dir.partial" "$oldest_dir"
      fi
    else
      if [ $dry_run = 0 ]; then rm -rf "$oldest_dir.partial"; fi
      say "no $name $oldest: its test will skip"
    fi
  fi
}
# transformers' Trainer imports datasets where it is installed: the releases of its day
# (datasets 5 needs a newer huggingface_hub than transformers 4.56 takes).
optional_dependency transformers 5.25.0 4.56.2 "huggingface_hub==0.36.0" "tokenizers==0.22.1" \
  "datasets==4.4.1" "dill==0.4.0" "multiprocess==0.70.18" "fsspec==2025.10.0" \
  "httpx==0.28.1" "httpcore==1.0.9" "h11==0.16.0" "anyio==4.16.0" "sniffio==1.3.1"
optional_dependency diffusers 0.42.1 0.35.2
# TRL (the Trainer mixin's DPOTrainer and GRPOTrainer): 1.15.0 is the first release whose
# trainers read per-token log-probs from the model's fused LM head (add_fused_lm_head).
optional_dependency trl 1.16.0 1.15.0
# The Trainer (SequenceParallelTrainer and its tests) needs accelerate.
tested_release accelerate 1.16.0
# PEFT's models at the integration's entry points (tests/test_transformers_peft.py).
tested_release peft 0.21.2

# The build needs no index (no build isolation, no dependencies): --no-index keeps pip
# from asking one anyway.
build=("$PYTHON" -m pip install -v --no-build-isolation --no-deps --no-index --disable-pip-version-check -e .)
if [ $dry_run = 1 ]; then
  say "would build the extension: ${build[*]} > build/install.log; then $PYTHON -m seqpar_kernels.info"
  exit 0
fi
say "building the extension (log: build/install.log)"
mkdir -p build
if ! "${build[@]}" >build/install.log 2>&1; then
  tail -40 build/install.log
  say "build failed; full log in build/install.log"
  exit 1
fi
grep "seqpar-kernels build:" build/install.log | tail -2 || true
"$PYTHON" -m seqpar_kernels.info
