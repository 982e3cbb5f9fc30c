#!/usr/bin/env bash
# Sets up a machine to build, test and benchmark seqpar-kernels; safe to run again.
#   - keeps the torch you have (2.6 or newer); installs torch==2.14.1 if there is none
#   - installs the build, test and benchmark tools that are missing
#   - builds the extension in place (pip install --no-build-isolation -e .): CPU kernels
#     always, CUDA kernels when a CUDA toolkit and a CUDA build of torch are present
#     (setup.py finds the toolkit and decides; its lines are in build/install.log)
# Environment: PYTHON (default python3), SEQPAR_TORCH (default torch==2.14.1),
# CUDA_HOME, SEQPAR_CUDA_ARCHS, SEQPAR_FORCE_CPU=1 (see setup.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SEQPAR_TORCH=${SEQPAR_TORCH:-torch==2.14.1}

say() { echo "[setup] $*"; }

if ! "$PYTHON" - <<'PY' 2>/dev/null
import torch
major, minor = (int(part) for part in torch.__version__.split(".")[:2])
raise SystemExit(0 if (major, minor) >= (2, 6) else 1)
PY
then
  say "installing $SEQPAR_TORCH"
  "$PYTHON" -m pip install -q "$SEQPAR_TORCH"
fi

# Python modules the build, tests and benchmarks import; install only what is missing
# (the GPU machines reach no package index, and have most of these already).
missing=()
for module_and_package in pybind11:pybind11 pytest:pytest matplotlib:matplotlib numpy:numpy; do
  module=${module_and_package%%:*}
  "$PYTHON" -c "import $module" 2>/dev/null || missing+=("${module_and_package##*:}")
done
command -v cmake >/dev/null || missing+=("cmake>=3.18")
command -v ninja >/dev/null || "$PYTHON" -c "import ninja" 2>/dev/null || missing+=(ninja)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  "$PYTHON" -m pip install -q "${missing[@]}"
fi

# The transformers integration's tests: the newest release in the environment, and the
# oldest supported one (the README says which) in build/, where its tests put it first on
# PYTHONPATH; its own pins of huggingface_hub and tokenizers go beside it. Without a
# package index (the GPU machines) both are skipped, and so are those tests.
TRANSFORMERS_OLDEST=4.56.2
if ! "$PYTHON" -c "import transformers" 2>/dev/null; then
  say "installing transformers (optional: the integration's tests)"
  "$PYTHON" -m pip install -q "transformers>=$TRANSFORMERS_OLDEST" || say "could not install transformers; its tests will skip"
fi
# The Trainer (SequenceParallelTrainer and its tests) needs accelerate.
if ! "$PYTHON" -c "import accelerate" 2>/dev/null; then
  say "installing accelerate (optional: the Trainer's tests)"
  "$PYTHON" -m pip install -q "accelerate>=1.0" || say "could not install accelerate; the Trainer's tests will skip"
fi
oldest_dir="build/transformers-$TRANSFORMERS_OLDEST"
if [ ! -d "$oldest_dir/transformers" ]; then
  say "installing transformers==$TRANSFORMERS_OLDEST into $oldest_dir (the oldest supported release)"
  mkdir -p build
  "$PYTHON" -m pip install -q --no-deps --target "$oldest_dir.partial" "transformers==$TRANSFORMERS_OLDEST" \
      "huggingface_hub==0.36.0" "tokenizers==0.22.1" && mv "$oldest_dir.partial" "$oldest_dir" \
    || { rm -rf "$oldest_dir.partial"; say "could not install it; its test will skip"; }
fi

say "building the extension (log: build/install.log)"
mkdir -p build
if ! "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e . >build/install.log 2>&1; then
  tail -40 build/install.log
  say "build failed; full log in build/install.log"
  exit 1
fi
grep "seqpar-kernels build:" build/install.log | tail -2 || true
"$PYTHON" -m seqpar_kernels.info
