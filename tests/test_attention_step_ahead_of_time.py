"""The ring-attention step kernels compiled ahead of time for GPUs that are not here.

Every CUDA launch the step launchers can make (dtypes fp32/fp16/bf16, head dims
64/128/256, full or causal, MHA or GQA; the interval mask of packed documents and
sliding windows for bf16 at head dims 128 and 256 and fp32 at 128; soft-capped
scores for bf16/fp16 at 128 and 256 and fp32 at 128 (tools/ahead_of_time.py,
TABLE_SOFTCAP_CASES); v of another head dim than q and k (TABLE_VALUE_DIM_CASES:
192/128 bf16 and fp32, 96/64 bf16); on sm_90 the pointer loads that a q layout TMA cannot take
falls back to, bf16 at head dim 128) is compiled by
tools.ahead_of_time for one GPU of each family the tile choice
tells apart: sm_90 (H100/H200), sm_80 (A100), sm_86 (RTX 30xx/40xx, L4, L40S:
99 KiB of shared memory), sm_100 (B200) and sm_120 (RTX 50xx), with the same
tiles and the same argument specialization as a real launch.  Without a GPU this is how CI
knows that the kernels compile for the GPUs users have, that their shared memory
fits (a launch that does not would fail with OutOfResources), that ptxas did
not serialize their tensor-core products (C7515 and the other "Potential
Performance Loss: ... serialized" advisories), and that no register spills land
inside the K/V or Q sweep (a spilling or serialized kernel is still correct,
only slow, so no correctness test would notice).

Spills are held to the loops, not to zero: some shipped launches spill a few
bytes outside their loops (test_spills_outside_loops_are_listed prints them),
which costs a few cycles per program, once, where a spill in the sweep costs
every iteration.

The compiled rows come from a record (tests/data/attention_step_ahead_of_time.json)
wherever it holds a kernel's compile key: a fresh machine's cold Triton cache
would take 23 minutes on 2 cores for the whole table.

The same module reads the SASS of the extension's CUDA pack/unpack kernels
(test_the_block_copy_parse_finds_the_copy_loops) and checks that the reference
kernels the report compares against compute attention.
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
    pytest.skip("ahead-of-time compiles need triton 3.3 or newer (ASTSource(constexprs=...))", allow_module_level=True)

from seqpar_kernels.kernels.attention_step_tiles import (  # noqa: E402
    SHARED_MEMORY_PER_BLOCK,
    TENSOR_DESCRIPTORS_AVAILABLE,
)
from tools.ahead_of_time import (  # noqa: E402
    DEFAULT_CAPABILITIES,
    TABLE_VALUE_DIM_CASES,
    block_copy_report,
    is_serialization_warning,
    read_record,
)

KERNELS = {
    "attention_step_fwd_kernel",
    "attention_bwd_preprocess_kernel",
    "attention_step_bwd_dq_kernel",
    "attention_step_bwd_dkdv_kernel",
}


# The reference kernels (reference_kernels.py) are compiled for this target
# only: on every target they would add 38% to the compile (sm_90: 364 s of CPU
# time with them, 264 s without), and the comparison is for the tile choices of
# the H100 family.
REFERENCE_CAPABILITY = 90


# The compiled kernels of the table under their compile keys.  Compiling the
# whole table takes 23 minutes on 2 cores with a cold Triton cache, which a fresh
# CI machine has; with the record the fixture compiles only the kernels whose
# key it does not hold (any change to a kernel's source, tiles, specialization,
# the Triton release or the module's compile and SASS reading changes the key), and
# test_the_record_holds_every_kernel says when to write it again.
RECORD = os.path.join(os.path.dirname(__file__), "data", "attention_step_ahead_of_time.json")
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # python -m tools.ahead_of_time runs there
UPDATE_RECORD = (
    "python -m tools.ahead_of_time --record tests/data/attention_step_ahead_of_time.json "
    f"--update-record --reference-capability {REFERENCE_CAPABILITY}"
)


def _without_interpreter():
    # The compiles run in their own process: conftest sets TRITON_INTERPRET=1
    # on machines without a GPU, and interpreted kernels cannot be compiled.
    return {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def compiled():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.ahead_of_time",
            "--json",
            "--record",
            RECORD,
            "--capability",
            *map(str, DEFAULT_CAPABILITIES),
            "--reference-capability",
            str(REFERENCE_CAPABILITY),
        ],
        capture_output=True,
        text=True,
        env=_without_interpreter(),
        timeout=2400,
        cwd=REPOSITORY,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def test_the_record_holds_every_kernel(compiled):
    missing = [_describe(row) for row in compiled if not row["recorded"]]
    missing += [
        f"the reference kernel of {_describe(row)}"
        for row in compiled
        if row["reference"] and not row["reference"]["recorded"]
    ]
    assert not missing, (
        f"{len(missing)} kernels are not in the record (compiled by this run instead): write it "
        f"again with\n  {UPDATE_RECORD}\n" + "\n".join(missing[:20])
    )


def test_the_recorded_kernels_compile_as_recorded():
    # The record is only as good as its keys: a fresh compile of a few of its
    # kernels (dk/dv, the one nearest its register limit, bf16 d128 causal GQA
    # on every target: TMA and pointer loads, one program per group and split;
    # not its soft-capped variants, which would add 10 compiles) must give the
    # recorded rows.
    recorded = read_record(RECORD)
    script = (
        "import json, sys\n"
        "from tools.ahead_of_time import recompile\n"
        "json.dump([row for capability in json.loads(sys.argv[1]) for row in recompile(capability, "
        "['attention_step_bwd_dkdv_kernel bfloat16 d128 causal GQA'], without=['softcap'])], sys.stdout)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(list(DEFAULT_CAPABILITIES))],
        capture_output=True,
        text=True,
        env=_without_interpreter(),
        timeout=1200,
        cwd=REPOSITORY,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    fresh = json.loads(result.stdout)
    assert len(fresh) >= 2 * len(DEFAULT_CAPABILITIES), [row["description"] for row in fresh]
    for row in fresh:
        assert row["compile_key"] in recorded, f"sm_{row['capability']} {row['description']}: not in the record"
        expected = recorded[row["compile_key"]]
        assert {name: row[name] for name in expected} == expected, (row, expected)


def _of_value_dim(row):
    # "d192v128": v of another head dim than q's and k's.
    return "v" in row["description"].split()[2]


def _describe(row):
    return (
        f"sm_{row['capability']} {row['description']} {row['constexprs']} warps {row['num_warps']} "
        f"stages {row['num_stages']}"
    )


def test_every_kernel_compiles_for_every_target(compiled):
    assert {80, 86, 90, 100, 120} <= set(DEFAULT_CAPABILITIES)
    for capability in DEFAULT_CAPABILITIES:
        rows = [row for row in compiled if row["capability"] == capability]
        assert {row["kernel"] for row in rows} == KERNELS
        for dtype in ("bfloat16", "float16", "float32"):
            for headdim in (64, 128, 256):
                assert any(f" {dtype} d{headdim} " in row["description"] for row in rows), (capability, dtype, headdim)
        # The interval mask: each step kernel, MHA and GQA, bf16 at d128 and d256
        # and fp32 at d128 (and the launch variants of each, e.g. a first step's
        # forward); with the soft-capped scores, fp16 at d128 and d256 too.
        step_kernels = KERNELS - {"attention_bwd_preprocess_kernel"}
        for capped, cases in (
            (False, (("bfloat16", "d128"), ("bfloat16", "d256"), ("float32", "d128"))),
            (
                True,
                (
                    ("bfloat16", "d128"),
                    ("bfloat16", "d256"),
                    ("float16", "d128"),
                    ("float16", "d256"),
                    ("float32", "d128"),
                ),
            ),
        ):
            intervals = {
                tuple(row["description"].split()[:5])
                for row in rows
                if " intervals " in row["description"]
                and ("softcap" in row["description"].split()) == capped
                and not _of_value_dim(row)
            }
            assert intervals == {
                (kernel, dtype, headdim, "intervals", heads)
                for kernel in step_kernels
                for dtype, headdim in cases
                for heads in ("MHA", "GQA")
            }, (capability, capped, sorted(intervals))
        # The soft-capped scores: each step kernel, MHA and GQA, bf16 at d128 and
        # d256 with every mask, fp16 with the causal and interval ones.
        capped = {tuple(row["description"].split()[:5]) for row in rows if "softcap" in row["description"].split()}
        assert {case for case in capped if case[3] != "intervals"} == {
            (kernel, dtype, headdim, mask, heads)
            for kernel in step_kernels
            for dtype, headdim, masks in (
                ("bfloat16", "d128", ("full", "causal")),
                ("bfloat16", "d256", ("full", "causal")),
                ("float16", "d128", ("causal",)),
                ("float16", "d256", ("causal",)),
            )
            for mask in masks
            for heads in ("MHA", "GQA")
        }, (capability, sorted(capped))
        # v of another head dim: each step kernel, MHA and GQA, with the masks of
        # TABLE_VALUE_DIM_CASES.
        value_dims = {tuple(row["description"].split()[:5]) for row in rows if _of_value_dim(row)}
        assert value_dims == {
            (kernel, str(dtype).removeprefix("torch."), f"d{headdim}v{value_dim}", mask, heads)
            for (dtype, headdim, value_dim), masks in TABLE_VALUE_DIM_CASES.items()
            for kernel in step_kernels
            for mask in masks
            for heads in ("MHA", "GQA")
        }, (capability, sorted(value_dims))
    # sm_90: bf16 d128 through tensor descriptors and, for a q TMA cannot take,
    # through pointers; each step kernel, full and causal, MHA and GQA.
    if not TENSOR_DESCRIPTORS_AVAILABLE:
        return
    loads = {
        (*row["description"].split()[:5], "tensor_descriptors" in row["description"].split())
        for row in compiled
        if row["capability"] == 90
        and " bfloat16 d128 " in row["description"]
        and row["kernel"] != "attention_bwd_preprocess_kernel"
        and " intervals " not in row["description"]
        and "softcap" not in row["description"].split()
    }
    assert loads == {
        (kernel, "bfloat16", "d128", mask, heads, descriptors)
        for kernel in KERNELS - {"attention_bwd_preprocess_kernel"}
        for mask in ("full", "causal")
        for heads in ("MHA", "GQA")
        for descriptors in (False, True)
    }, sorted(loads)


def test_shared_memory_fits_the_target(compiled):
    too_big = [
        f"{_describe(row)}: {row['shared_memory_bytes']} B > {SHARED_MEMORY_PER_BLOCK[row['capability']]} B"
        for row in compiled
        if row["shared_memory_bytes"] > SHARED_MEMORY_PER_BLOCK[row["capability"]]
    ]
    assert not too_big, "\n".join(too_big)


def test_the_sass_parse_finds_the_loops(compiled):
    # Every step kernel sweeps K/V or Q in a loop; a SASS listing in which the parse
    # finds none would make the spill check below pass without looking.  The hot
    # loop must hold the products: tensor-core instructions wherever the inputs
    # are fp16/bf16 (fp32 multiplies with FMAs).
    missing = []
    for row in compiled:
        if row["kernel"] == "attention_bwd_preprocess_kernel":
            continue
        if row["loops"] == 0 or row["loop_instructions"] == 0:
            missing.append(f"{_describe(row)}: {row['loops']} loops, hot loop {row['loop_instructions']} instructions")
        elif " float32 " not in row["description"] and row["loop_matrix_instructions"] == 0:
            missing.append(f"{_describe(row)}: no tensor-core instruction in the hot loop")
    assert not missing, "\n".join(missing)


def test_the_reference_kernels_compile_with_every_tile(compiled):
    # Forward, dq and dk/dv each have a reference with their tiles, and the
    # parse finds its hot loop.
    rows = [
        row
        for row in compiled
        if row["capability"] == REFERENCE_CAPABILITY and row["kernel"] != "attention_bwd_preprocess_kernel"
    ]
    assert rows
    missing = [_describe(row) for row in rows if not row.get("reference") or row["reference"]["loop_instructions"] == 0]
    assert not missing, "\n".join(missing)


def test_no_ptxas_serialization_warnings(compiled):
    # C7515 on sm_90: ptxas found instructions other than wgmma defining a
    # wgmma's accumulator inside its pipeline stage and made every wgmma wait for
    # the one before it.  Listed per launch, with ptxas's words.
    serialized = [
        f"{_describe(row)}: "
        + " | ".join(warning for warning in row["ptxas_warnings"] if is_serialization_warning(warning))
        for row in compiled
        if any(is_serialization_warning(w) for w in row["ptxas_warnings"])
    ]
    assert not serialized, f"{len(serialized)} launches:\n" + "\n".join(serialized)


def test_no_register_spills_inside_loops(compiled):
    spilling = [
        f"{_describe(row)}: {row['spills_in_loops']} spill accesses in loops "
        f"({row['registers']} registers, {row['spill_bytes']} B spilled)"
        for row in compiled
        if row["spills_in_loops"] > 0
    ]
    assert not spilling, "\n".join(spilling)


def test_spills_outside_loops_are_listed(compiled):
    # Not a failure: a spill outside every loop is paid once per program.  The
    # list shows what the in-loop rule lets through (pytest -rP prints it).
    for row in compiled:
        if row["spill_bytes"] and not row["spills_in_loops"]:
            print(f"{_describe(row)}: {row['spill_bytes']} B spilled outside loops")


def test_the_block_copy_parse_finds_the_copy_loops():
    report = block_copy_report()
    if report["skipped"]:
        pytest.skip(report["skipped"])
    architectures = {kernel["architecture"] for kernel in report["kernels"]}
    assert architectures, report
    for architecture in architectures:
        # The 16-byte unit kernels (Unit16: every layout 16-byte aligned and
        # contiguous inside) must show a loop with at least one 16-byte load.
        wide = [
            kernel
            for kernel in report["kernels"]
            if kernel["architecture"] == architecture and "Unit16" in kernel["kernel"]
        ]
        assert wide, (architecture, [kernel["kernel"] for kernel in report["kernels"]])
        for kernel in wide:
            assert kernel["loops"] and all(
                loop["units"] >= 1 and loop["instructions"] > loop["units"] for loop in kernel["loops"]
            ), kernel


def test_the_reference_kernels_compute_attention():
    # The report compares the step kernels' loops with these kernels': they have
    # to compute attention and its gradients.  Interpreted on CPU tensors without
    # a GPU (conftest), fp32, tiles with BLOCK_M < BLOCK_N and the reverse.
    import torch
    from triton_interpreter import INTERPRETER_LOOPS_FAIL

    from tools.reference_kernels import (
        reference_attention_bwd_dkdv_kernel,
        reference_attention_bwd_dq_kernel,
        reference_attention_fwd_kernel,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and INTERPRETER_LOOPS_FAIL:
        pytest.skip("the Triton interpreter here cannot run a loop with a runtime bound")
    torch.manual_seed(0)
    batch, seqlen, heads, headdim = 2, 64, 2, 16
    scale = headdim**-0.5
    q, k, v, dout = (torch.randn(batch, seqlen, heads, headdim, device=device) for _ in range(4))
    for causal in (False, True):
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        scores = torch.einsum("bmhd,bnhd->bhmn", qr, kr) * scale
        if causal:
            scores = scores.masked_fill(
                torch.ones(seqlen, seqlen, dtype=torch.bool, device=device).triu(1), float("-inf")
            )
        expected = torch.einsum("bhmn,bnhd->bmhd", scores.softmax(-1), vr)
        expected.backward(dout)
        expected_lse = scores.logsumexp(-1).detach()
        delta = (dout * expected.detach()).sum(-1).transpose(1, 2).contiguous()
        for block_m, block_n in ((16, 32), (32, 16)):
            tiles = dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=headdim, DOT_PRECISION="ieee")
            out = torch.empty_like(q)
            lse = torch.empty(batch, heads, seqlen, device=device)
            reference_attention_fwd_kernel[(seqlen // block_m, heads, batch)](
                q,
                k,
                v,
                out,
                lse,
                *q.stride(),
                *k.stride(),
                *v.stride(),
                *out.stride(),
                *lse.stride(),
                seqlen,
                scale * 1.4426950408889634,
                **tiles,
            )
            torch.testing.assert_close(out, expected.detach(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)
            inputs = (q, k, v, dout, lse, delta)
            strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(), *delta.stride())
            dq, dk, dv = (torch.empty_like(q) for _ in range(3))
            reference_attention_bwd_dq_kernel[(seqlen // block_m, heads, batch)](
                *inputs, dq, *strides, *dq.stride(), seqlen, scale, scale * 1.4426950408889634, **tiles
            )
            reference_attention_bwd_dkdv_kernel[(seqlen // block_n, heads, batch)](
                *inputs,
                dk,
                dv,
                *strides,
                *dk.stride(),
                *dv.stride(),
                seqlen,
                scale,
                scale * 1.4426950408889634,
                **tiles,
            )
            for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
