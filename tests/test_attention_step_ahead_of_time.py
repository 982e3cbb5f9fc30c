"""The ring-attention step kernels compiled ahead of time for GPUs that are not here.

Every CUDA launch the step launchers can make (dtypes fp32/fp16/bf16, head dims
64/128/256, full or causal, MHA or GQA; the interval mask of packed documents
for bf16 and fp32 at head dim 128) is compiled by
seqpar_kernels.kernels.ahead_of_time for one GPU of each family the tile choice
tells apart: sm_90 (H100/H200), sm_80 (A100), sm_86 (RTX 30xx/40xx, L4, L40S:
99 KiB of shared memory), sm_100 (B200) and sm_120 (RTX 50xx), with the same
tiles and the same argument specialization as a real launch.  Without a GPU this is how CI
knows that the kernels compile for the GPUs users have, that their shared memory
fits (a launch that does not would fail with OutOfResources), and that no
register spills land inside the K/V or Q sweep (a spilling kernel is still
correct, only slow, so no correctness test would notice).
"""

import inspect
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")
from triton.compiler import ASTSource  # noqa: E402

if "constexprs" not in inspect.signature(ASTSource).parameters:
    pytest.skip("ahead-of-time compiles need triton 3.3 or newer (ASTSource(constexprs=...))",
                allow_module_level=True)

from seqpar_kernels.kernels.ahead_of_time import DEFAULT_CAPABILITIES  # noqa: E402
from seqpar_kernels.kernels.attention_step_tiles import SHARED_MEMORY_PER_BLOCK  # noqa: E402

KERNELS = {"_attention_step_fwd_kernel", "_attention_bwd_preprocess_kernel",
           "_attention_step_bwd_dq_kernel", "_attention_step_bwd_dkdv_kernel"}


@pytest.fixture(scope="module")
def compiled():
    # The compile runs in its own process: conftest sets TRITON_INTERPRET=1 on
    # machines without a GPU, and interpreted kernels cannot be compiled.  About
    # 2 min per target on 2 cores with a cold Triton cache, 20 s with a warm one.
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "seqpar_kernels.kernels.ahead_of_time", "--json",
         "--capability", *map(str, DEFAULT_CAPABILITIES)],
        capture_output=True, text=True, env=env, timeout=2400,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def _describe(row):
    return (f"sm_{row['capability']} {row['description']} {row['constexprs']} warps {row['num_warps']} "
            f"stages {row['num_stages']}")


def test_every_kernel_compiles_for_every_target(compiled):
    assert {80, 86, 90, 100, 120} <= set(DEFAULT_CAPABILITIES)
    for capability in DEFAULT_CAPABILITIES:
        rows = [row for row in compiled if row["capability"] == capability]
        assert {row["kernel"] for row in rows} == KERNELS
        for dtype in ("bfloat16", "float16", "float32"):
            for headdim in (64, 128, 256):
                assert any(f" {dtype} d{headdim} " in row["description"] for row in rows), (capability, dtype, headdim)
        # The interval mask: each step kernel, MHA and GQA, bf16 and fp32 at d128.
        intervals = {row["description"] for row in rows if " intervals " in row["description"]}
        assert len(intervals) == 12 and {d.split()[0] for d in intervals} == KERNELS - {
            "_attention_bwd_preprocess_kernel"}, (capability, sorted(intervals))


def test_shared_memory_fits_the_target(compiled):
    too_big = [f"{_describe(row)}: {row['shared_memory_bytes']} B > {SHARED_MEMORY_PER_BLOCK[row['capability']]} B"
               for row in compiled if row["shared_memory_bytes"] > SHARED_MEMORY_PER_BLOCK[row["capability"]]]
    assert not too_big, "\n".join(too_big)


def test_the_sass_parse_finds_the_loops(compiled):
    # Every step kernel sweeps K/V or Q in a loop; a SASS listing in which the parse
    # finds none would make the spill check below pass without looking.
    loopless = [_describe(row) for row in compiled
                if row["kernel"] != "_attention_bwd_preprocess_kernel" and row["loops"] == 0]
    assert not loopless, "\n".join(loopless)


def test_no_register_spills_inside_loops(compiled):
    spilling = [f"{_describe(row)}: {row['spills_in_loops']} spill accesses in loops "
                f"({row['registers']} registers, {row['spill_bytes']} B spilled)"
                for row in compiled if row["spills_in_loops"] > 0]
    assert not spilling, "\n".join(spilling)
