"""Compile Triton kernels ahead of time for a GPU that is not here.

Triton normally compiles a kernel at its first launch, on the GPU that runs it.
Its compiler needs no GPU, though: given a target (``GPUTarget("cuda", 90, 32)``
for an H100) it produces the cubin a launch would, and the cubin records the
resources the kernel takes.  That lets a machine without a GPU check what would
otherwise only show on one:

- that every launch configuration compiles for each target (sm_80, sm_86,
  sm_90, sm_100, sm_120 by default);
- that its shared memory fits the target (Triton would refuse the launch with
  ``OutOfResources``);
- that its registers do not spill.  A spilling attention kernel still runs and
  is still correct, only slower, so no correctness test would catch it.

Used by tests/test_attention_step_ahead_of_time.py; `python -m
seqpar_kernels.kernels.ahead_of_time` prints the table of every launch.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton

from .attention_step_tiles import SHARED_MEMORY_PER_BLOCK, GpuTarget, KernelLaunch

# One target per family of tile choices (attention_step_tiles._TILE_OVERRIDES): H100
# (wgmma), A100 (mma.sync, 163 KiB of shared memory per block), RTX 30xx/40xx
# (mma.sync, 99 KiB; sm_89 compiles like sm_86), B200 (tcgen05), RTX 50xx
# (mma.sync, 99 KiB).
DEFAULT_CAPABILITIES = (90, 80, 86, 100, 120)

_TRITON_TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                torch.int32: "i32", torch.int64: "i64"}


@dataclass(frozen=True)
class KernelResources:
    """What one compiled kernel takes from the streaming multiprocessor."""

    kernel: str
    capability: int
    shared_memory_bytes: int
    registers: int  # per thread; 255 is the hardware maximum
    spill_bytes: int  # per-thread stack + local memory: 0 means nothing spilled
    spills_in_loops: int  # local-memory loads/stores (STL/LDL) inside a loop of the SASS
    loops: int  # loops found in the SASS (backward branches): a check that the parse saw them
    num_warps: int


def _specialize(launch: KernelLaunch, args: tuple) -> tuple[dict, dict, dict]:
    """Triton's signature, constexprs and attributes for a launch of ``launch``
    with the runtime arguments ``args``: what its JIT would derive when called.

    The JIT specializes on argument values, and the specialization changes the
    code: an integer equal to 1 (a unit stride) becomes a compile-time constant,
    which lets loads vectorize; a pointer or integer divisible by 16 is marked so;
    None is a compile-time constant.
    Tensors (meta tensors will do) stand for pointers to 16-byte-aligned memory,
    as torch allocates it.
    """
    names = [name for name in launch.kernel.arg_names if name not in launch.constexprs]
    assert len(names) == len(args), f"{launch.kernel.__name__} takes {names}, got {len(args)} arguments"
    signature, constexprs, attrs = {}, dict(launch.constexprs), {}
    for index, (name, value) in enumerate(zip(names, args)):
        position = (launch.kernel.arg_names.index(name),)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPE[value.dtype]
            attrs[position] = [["tt.divisibility", 16]]
        elif value is None:  # e.g. a pointer the kernel does not read in this mode
            signature[name] = "constexpr"
            constexprs[name] = None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"argument {index} ({name}) of {launch.kernel.__name__}: {value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[position] = [["tt.divisibility", 16]]
    for name in launch.constexprs:
        signature[name] = "constexpr"
    return {name: signature[name] for name in launch.kernel.arg_names}, constexprs, attrs


def _cuobjdump() -> str:
    # Triton ships the CUDA binary utilities it uses; a CUDA toolkit has them too.
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for candidate in (bundled, os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"),
                      shutil.which("cuobjdump")):
        if candidate and os.path.exists(candidate):
            return candidate
    raise RuntimeError("cuobjdump not found (neither bundled with triton nor in CUDA_HOME/bin)")


def _spills_in_loops(sass: str) -> tuple[int, int]:
    """(spill accesses inside loops, loops) of the SASS listing ``sass``: how many
    local-memory accesses (spill stores STL, reloads LDL) lie inside a loop, and
    how many loops there are.  A spill in the prologue or the epilogue costs a few
    cycles once per program; one inside the K/V sweep costs every iteration.
    Loops are found as backward branches, e.g. ``@!P4 BRA 0x2520`` at 0x4ee0 (any
    BRA/BRX/JMP variant, optionally with a uniform predicate operand)."""
    instructions = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    loops, spills = [], []
    for address_hex, text in instructions:
        address = int(address_hex, 16)
        branch = re.search(r"\b(?:BRA|BRX|JMP)(?:\.\w+)*\s+(?:!?U?P\w+\s*,\s*)?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            loops.append((int(branch.group(1), 16), address))
        if re.search(r"\b(STL|LDL)(\.|\s)", text):
            spills.append(address)
    inside = sum(any(start <= address <= end for start, end in loops) for address in spills)
    return inside, len(loops)


def compile_for_gpu(launch: KernelLaunch, args: tuple, capability: int) -> KernelResources:
    """Compile ``launch`` as a call with the runtime arguments ``args`` would, for
    an NVIDIA GPU of compute capability ``capability`` (90: H100/H200, 80: A100),
    and report what the cubin takes.  The target must be one the ptxas bundled
    with Triton knows (sm_100 and sm_120 need CUDA 12.8's or newer)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = _specialize(launch, args)
    source = ASTSource(launch.kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    with tempfile.TemporaryDirectory() as scratch:
        cubin = os.path.join(scratch, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    # e.g. "REG:255 STACK:904 SHARED:1024 LOCAL:0 CONSTANT[0]:752 ..." (SHARED is the
    # static part only; Triton's dynamic shared memory is in the metadata).
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    spills_in_loops, loops = _spills_in_loops(sass)
    assert "REG" in fields, f"no resource usage for {launch.kernel.__name__}:\n{usage}"
    return KernelResources(
        kernel=launch.kernel.__name__,
        capability=capability,
        shared_memory_bytes=int(compiled.metadata.shared),
        registers=int(fields["REG"]),
        spill_bytes=int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0)),
        spills_in_loops=spills_in_loops,
        loops=loops,
        num_warps=launch.num_warps,
    )


# ----------------------------------------------------------------------------
# The table of every CUDA launch of the ring-attention step kernels
# ----------------------------------------------------------------------------

TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# 80 and 96 compile like 128.  Head dims up to 32 take the 64 tiles with a narrower
# BLOCK_D (16 or 32): not compiled here.
TABLE_HEAD_DIMS = (64, 128, 256)
TABLE_HEADS, TABLE_SEQLEN = 16, 4096
# The interval mask (packed documents) holds its row or column intervals in
# registers through the sweep.  It is compiled for bf16 (fp16 compiles alike)
# and fp32 at head dim 128, MHA and GQA: 12 kernels per target, where every
# dtype and head dim would add 36 to the table's compile time.
TABLE_INTERVAL_CASES = ((torch.bfloat16, 128), (torch.float32, 128))


@functools.lru_cache(maxsize=None)  # each worker process builds the list once, not per case
def step_kernel_cases(capability: int):
    """The ring-attention step kernel launches worth compiling for ``capability``
    (with the shared memory attention_step_tiles.SHARED_MEMORY_PER_BLOCK gives it),
    one per distinct compiled kernel: ``[(description, KernelLaunch, args)]``.

    Inputs are contiguous (batch 2, seqlen 4096, 16 heads), the layout the ring
    passes; kv heads 16 (MHA: the GQA group size 1 is a compile-time constant)
    and 4 (GQA) on every target: register use differs between them (GQA dk/dv
    at d128 spills on sm_80 with the sm_90 tiles).  Masks full and causal
    everywhere, intervals for TABLE_INTERVAL_CASES.
    """
    from .attention_step_launch import MASK_CAUSAL, MASK_FULL, MASK_INTERVALS, cuda_kernel_calls

    mask_names = {MASK_FULL: "full", MASK_CAUSAL: "causal", MASK_INTERVALS: "intervals"}
    target = GpuTarget.of_capability(capability)
    cases, seen = [], set()
    for dtype in TABLE_DTYPES:
        for headdim in TABLE_HEAD_DIMS:
            masks = [MASK_FULL, MASK_CAUSAL] + [MASK_INTERVALS] * ((dtype, headdim) in TABLE_INTERVAL_CASES)
            for mask_mode in masks:
                for kv_heads in (TABLE_HEADS, 4):
                    q = torch.empty(2, TABLE_SEQLEN, TABLE_HEADS, headdim, dtype=dtype, device="meta")
                    k = torch.empty(2, TABLE_SEQLEN, kv_heads, headdim, dtype=dtype, device="meta")
                    for launch, args in cuda_kernel_calls(q, k, torch.empty_like(k), mask_mode, target):
                        key = (launch.kernel.__name__, repr(_specialize(launch, args)),
                               launch.num_warps, launch.num_stages)
                        if key in seen:
                            continue
                        seen.add(key)
                        description = (f"{launch.kernel.__name__} {str(dtype).removeprefix('torch.')} "
                                       f"d{headdim} {mask_names[mask_mode]} "
                                       f"{'MHA' if kv_heads == TABLE_HEADS else 'GQA'}")
                        cases.append((description, launch, args))
    return cases


def _compile_case(capability_and_index):
    # Runs in a worker process: kernels do not pickle, so cases travel by index.
    capability, index = capability_and_index
    description, launch, args = step_kernel_cases(capability)[index]
    resources = compile_for_gpu(launch, args, capability)
    return dict(description=description, constexprs={k: v for k, v in launch.constexprs.items()
                                                     if k.startswith("BLOCK")},
                num_stages=launch.num_stages, **resources.__dict__)


def main(argv=None):
    """python -m seqpar_kernels.kernels.ahead_of_time [--capability 90 80 ...] [--json]:
    compile every step kernel launch for each capability and list what it takes."""
    import argparse
    import json
    import sys
    from concurrent.futures import ProcessPoolExecutor

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--capability", type=int, nargs="+", default=list(DEFAULT_CAPABILITIES),
                        choices=sorted(SHARED_MEMORY_PER_BLOCK))
    parser.add_argument("--json", action="store_true", help="one JSON list on stdout")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    options = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled for a GPU")
    jobs = [(capability, index) for capability in options.capability
            for index in range(len(step_kernel_cases(capability)))]
    rows = []
    with ProcessPoolExecutor(options.workers) as pool:
        for row in pool.map(_compile_case, jobs):
            rows.append(row)
            if not options.json:
                print(f"sm_{row['capability']} {row['description']:<52} {row['constexprs']} "
                      f"warps {row['num_warps']} stages {row['num_stages']}: shared "
                      f"{row['shared_memory_bytes']} B (max {SHARED_MEMORY_PER_BLOCK[row['capability']]}), "
                      f"{row['registers']} registers, spill {row['spill_bytes']} B, "
                      f"{row['spills_in_loops']} spill accesses in loops", flush=True)
    if options.json:
        json.dump(rows, sys.stdout)


if __name__ == "__main__":
    main()
