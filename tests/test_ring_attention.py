"""ring_attention, zigzag_split and zigzag_gather (seqpar_kernels/parallel/ring.py, the
ring driver in seqpar_kernels/ops/ring_attention.py) on 1-4 gloo ranks.

Every rank builds the same full q/k/v/dout (B, N, H, D) from a fixed seed, takes its
piece in the layout under test (contiguous: rows [r*S, (r+1)*S); zigzag: chunks r and
2P-1-r of 2P), runs ring_attention with autograd, and compares its piece of out, lse and
of the gradients with a reference on the same rank: attention with the score matrix
materialized, in fp64 (kv heads repeat_interleave'd in the reference only).

Low precision follows flash-attention's rule: the error of ours against the fp64
reference is at most 2x the error of plain PyTorch attention computed in that dtype
(plus a tiny slack), for the output and every gradient.

Rank functions are module-level (the pool pickles them by reference) and run several
cases per call: every `ranks.run` is a round trip to all ranks.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import seqpar_kernels as sp
from seqpar_kernels.parallel import checks as checks_module
from seqpar_kernels.parallel.ring_driver import step_block
from seqpar_kernels.parallel.ring_steps import DEVICE_DEFAULT
from seqpar_kernels.testing import ring_attention_with_step_kernels

# ----------------------------------------------------------------------------------
# helpers (run inside the ranks)
# ----------------------------------------------------------------------------------


def _rank():
    return dist.get_rank(), dist.get_world_size()


def reference_attention(q, k, v, causal, scale):
    """(out, lse) of plain attention in q's dtype with the scores materialized.
    q: (B, N, H, D); k, v: (B, N, H_kv, D); lse: (B, H, N)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        length = q.shape[1]
        keep = torch.ones(length, length, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return out, torch.logsumexp(scores.float() if scores.dtype != torch.float64 else scores, dim=-1)


def local_rows(x, layout, rank, world_size, dim=1):
    """This rank's rows of a full-sequence tensor, by hand (not with zigzag_split)."""
    if layout == "contiguous":
        return x.chunk(world_size, dim=dim)[rank]
    chunks = x.chunk(2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def full_inputs(case, world_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    total = case["S"] * world_size
    draw = lambda heads: torch.randn(case["B"], total, heads, case["D"], generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v, dout = draw(case["H"]), draw(case["H_kv"]), draw(case["H_kv"]), draw(case["H"])
    q = q * case.get("q_mult", 1.0)
    return [t.to(dtype) for t in (q, k, v, dout)]


def attention_with_grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


NAMES = ("out", "lse", "dq", "dk", "dv")


def max_err(a, b):
    return 0.0 if a.numel() == 0 else (a.double() - b.double()).abs().max().item()


def sdpa_attention(q, k, v, causal, scale):
    """torch's own fused attention (single device, whole sequence) in q's dtype."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    ).transpose(1, 2)  # fmt: skip
    return out, None


def run_case(case, dtype, seed=0, group=None, step_kernels=DEVICE_DEFAULT):
    """One case on this rank. Returns (errors, yardsticks): errors[name] is the max error
    of ring_attention's piece against the fp64 reference; yardsticks["plain"][name] and
    yardsticks["sdpa"][name] are those of plain attention and of torch SDPA computed in
    dtype on the whole sequence (same piece), yardsticks["magnitude"][name] the largest
    magnitude of the reference piece. group: the ring's group (default the world); the
    whole sequence is that group's, cut by the rank within it. step_kernels: which
    kernels compute each ring step (seqpar_kernels.parallel.ring_steps)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    causal, layout = case["causal"], case["layout"]
    scale = case.get("scale", 1.0 / math.sqrt(case["D"]))
    inputs = full_inputs(case, world_size, dtype, seed)
    piece = lambda x, name: local_rows(x, layout, rank, world_size, dim=2 if name == "lse" else 1)  # noqa: E731
    exact = attention_with_grads(
        lambda q, k, v: reference_attention(q, k, v, causal, scale), *(t.double() for t in inputs)
    )
    ours = attention_with_grads(
        lambda q, k, v: ring_attention_with_step_kernels(
            q, k, v, step_kernels, group=group, causal=causal, softmax_scale=case.get("scale"),
            layout=layout, return_lse=True,
        ),
        *(local_rows(t, layout, rank, world_size) for t in inputs),
    )
    plain = attention_with_grads(lambda q, k, v: reference_attention(q, k, v, causal, scale), *inputs)
    sdpa = attention_with_grads(lambda q, k, v: sdpa_attention(q, k, v, causal, scale), *inputs)
    errors = {}
    yardsticks = {"plain": {}, "sdpa": {}, "magnitude": {}}
    for index, name in enumerate(NAMES):
        expected, got = piece(exact[index], name), ours[index]
        assert got.shape == expected.shape, (name, got.shape, expected.shape)
        assert got.dtype == (torch.float32 if name == "lse" else dtype), (name, got.dtype)
        assert torch.isfinite(got).all(), f"{name} has non-finite values"
        errors[name] = max_err(got, expected)
        yardsticks["plain"][name] = max_err(piece(plain[index], name), expected)
        sdpa_result = plain[index] if sdpa[index] is None else sdpa[index]  # SDPA has no lse
        yardsticks["sdpa"][name] = max_err(piece(sdpa_result, name), expected)
        yardsticks["magnitude"][name] = expected.abs().max().item() if expected.numel() else 0.0
    return errors, yardsticks


def run_cases(cases, dtype, step_kernels=DEVICE_DEFAULT):
    return [(case["id"], *run_case(case, dtype, seed, step_kernels=step_kernels)) for seed, case in enumerate(cases)]


def run_cases_with_kernels(kernels, cases, dtype):
    return run_cases(cases, dtype, step_kernels=kernels)


def _case(id, H, H_kv, D, S, causal, layout, B=1, **extra):
    return dict(id=id, H=H, H_kv=H_kv, D=D, S=S, causal=causal, layout=layout, B=B, **extra)


# Local lengths (S) are per rank; the full sequence is S x P.
CASE_GROUPS = {
    "mha": [
        _case("contig-full", H=4, H_kv=4, D=64, S=8, causal=False, layout="contiguous", B=2),
        _case("contig-causal", H=4, H_kv=4, D=64, S=8, causal=True, layout="contiguous", B=2),
        _case("zigzag-causal", H=4, H_kv=4, D=64, S=8, causal=True, layout="zigzag", B=2),
        _case("zigzag-full", H=2, H_kv=2, D=64, S=6, causal=False, layout="zigzag"),
        _case("contig-odd-scale", H=2, H_kv=2, D=64, S=5, causal=True, layout="contiguous", scale=0.3),
    ],
    "gqa-mqa": [
        _case("gqa-contig-causal", H=6, H_kv=2, D=64, S=6, causal=True, layout="contiguous"),
        _case("gqa-zigzag-causal", H=4, H_kv=2, D=64, S=8, causal=True, layout="zigzag", B=2),
        _case("gqa-contig-full", H=4, H_kv=2, D=64, S=6, causal=False, layout="contiguous"),
        _case("mqa-contig-causal", H=4, H_kv=1, D=64, S=6, causal=True, layout="contiguous"),
        _case("mqa-zigzag-causal", H=3, H_kv=1, D=64, S=4, causal=True, layout="zigzag"),
    ],
    "head-dims": [
        _case("D80-zigzag-gqa", H=4, H_kv=2, D=80, S=6, causal=True, layout="zigzag"),
        _case("D128-contig", H=2, H_kv=2, D=128, S=6, causal=True, layout="contiguous"),
        _case("D128-zigzag-mqa", H=2, H_kv=1, D=128, S=4, causal=True, layout="zigzag"),
        _case("D96-full", H=2, H_kv=1, D=96, S=4, causal=False, layout="contiguous"),
        _case("D256-zigzag", H=1, H_kv=1, D=256, S=4, causal=True, layout="zigzag"),
    ],
}

FP32_TOL = 2e-5


def failures_of(per_rank, limit_for):
    failures = []
    for rank, results in enumerate(per_rank):
        for case_id, errors, yardsticks in results:
            for name, err in errors.items():
                limit = limit_for(name, yardsticks)
                if not err <= limit:
                    failures.append(f"rank {rank} {case_id} {name}: err {err:.3g} > {limit:.3g}")
    return failures


@pytest.mark.parametrize("group", list(CASE_GROUPS))
def test_fp32_matches_fp64_reference(ranks, group):
    per_rank = ranks.run(run_cases, CASE_GROUPS[group], torch.float32)
    failures = failures_of(per_rank, lambda name, yardsticks: FP32_TOL)
    assert not failures, "\n".join(failures)


def run_cases_with_repeated_kv_heads(cases, dtype):
    """As on torch releases whose CPU flash kernel cannot read GQA (2.6): kv heads
    repeated for the local kernel, their gradients summed back."""
    return run_cases(cases, dtype, step_kernels="aten-repeated-kv")


def test_gqa_with_kv_heads_repeated_for_the_cpu_kernel(ranks):
    per_rank = ranks.run(run_cases_with_repeated_kv_heads, CASE_GROUPS["gqa-mqa"], torch.float32)
    failures = failures_of(per_rank, lambda name, yardsticks: FP32_TOL)
    assert not failures, "\n".join(failures)


LOW_PRECISION_CASES = [
    _case("contig-causal-gqa", H=4, H_kv=2, D=64, S=16, causal=True, layout="contiguous"),
    _case("zigzag-causal", H=2, H_kv=2, D=80, S=16, causal=True, layout="zigzag"),
    _case("contig-full-mqa", H=2, H_kv=1, D=128, S=12, causal=False, layout="contiguous"),
]
# "Tiny slack": about one ulp of the dtype at 0.01-0.03 (the gradients' scale here).
SLACK = {torch.bfloat16: 1e-4, torch.float16: 1e-5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_plain_torch_error(ranks, dtype):
    per_rank = ranks.run(run_cases, LOW_PRECISION_CASES, dtype)
    failures = failures_of(per_rank, lambda name, yardsticks: 2 * yardsticks["plain"][name] + SLACK[dtype])
    assert not failures, "\n".join(failures)


def test_large_logits_stay_finite_and_accurate(ranks):
    # q x 40: scores in the hundreds; softmax is nearly one-hot, exp(score) overflows fp32.
    cases = [
        _case("contig-causal", H=2, H_kv=1, D=64, S=8, causal=True, layout="contiguous", q_mult=40.0),
        _case("zigzag-causal", H=2, H_kv=2, D=64, S=8, causal=True, layout="zigzag", q_mult=40.0),
        _case("full", H=2, H_kv=2, D=64, S=6, causal=False, layout="contiguous", q_mult=40.0),
        # Scores around 1e4: every softmax row is exactly one-hot in fp32.
        _case("extreme", H=4, H_kv=1, D=4, S=4, causal=True, layout="contiguous", B=3, q_mult=100.0, scale=50.0),
    ]
    per_rank = ranks.run(run_cases, cases, torch.float32)  # run_case asserts finiteness
    # With scores in the hundreds, fp32 rounding costs single-device attention itself more
    # than FP32_TOL. A flash-style backward forms ds = p * (dp - delta) with delta =
    # rowsum(dout * out): at a one-hot row dp and delta are the same number computed by
    # two fp32 dot products, their difference is rounding, and dq/dk multiply it by
    # scale * |q| (5e3 in "extreme"). Plain attention with the scores materialized has
    # no such cancellation: its one-hot probabilities give gradients exact to 1e-39, so it
    # is no yardstick here. Measured on "extreme" at 2 ranks: dk errs by 4.0e-3 (rank 0)
    # and 1.9e-3 (rank 1) in the ring AND in torch's SDPA on the whole sequence in one
    # process, identically; merging the blocks' lse in fp64 instead of fp32 changes
    # nothing (aten's blocks merged both ways, 1-8 blocks, scales 0.08-11). So: as
    # accurate as torch's fused attention on the whole sequence (2x its error), and
    # never worse than FP32_TOL relative to each tensor's magnitude otherwise.
    def limit(name, yardsticks):
        return 2 * yardsticks["sdpa"][name] + FP32_TOL * max(1.0, yardsticks["magnitude"][name])

    failures = failures_of(per_rank, limit)
    assert not failures, "\n".join(failures)
    bf16 = ranks.run(run_cases, cases[:2], torch.bfloat16)  # finiteness in bf16 too
    assert len(bf16) == ranks.world_size


# The Triton step kernels (the CUDA path) under the interpreter on CPU tensors: the same
# schedule and views, so the ring logic of the GPU path is tested without a GPU. Small:
# the interpreter is slow.
TRITON_CASES = [
    _case("triton-zigzag-gqa", H=2, H_kv=1, D=64, S=4, causal=True, layout="zigzag"),
    _case("triton-contig-causal", H=1, H_kv=1, D=80, S=3, causal=True, layout="contiguous"),
    _case("triton-full-gqa", H=4, H_kv=2, D=64, S=3, causal=False, layout="contiguous"),
]


def test_triton_step_path_matches_reference(ranks):
    per_rank = ranks.run(run_cases_with_kernels, "triton", TRITON_CASES, torch.float32)
    failures = failures_of(per_rank, lambda name, yardsticks: FP32_TOL)
    assert not failures, "\n".join(failures)


@contextlib.contextmanager
def interpreter_rounds_to_nearest_bf16():
    """Makes the Triton interpreter round fp32 -> bf16 to nearest even, as GPUs (and
    torch) do. The interpreter (triton 3.8: InterpreterBuilder.cast_impl) truncates
    instead, which biases the p and dS the step kernels round to bf16 before their
    products: their bf16 gradients then measure up to ~2.3x plain torch's error here,
    against at most ~1.2x with rounding to nearest (the cases below on 1, 2 and 4
    ranks, 5 seeds)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return truncating(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.cast_impl = truncating


def run_bf16_cases_with_triton(cases):
    with interpreter_rounds_to_nearest_bf16():
        return run_cases_with_kernels("triton", cases, torch.bfloat16)


# S = 16: still one q tile and one k tile of the interpreter's (16, 32), so no dearer
# than shorter pieces, and the per-piece max error is less noisy.
TRITON_BF16_CASES = [
    _case("triton-bf16-zigzag-gqa", H=4, H_kv=2, D=64, S=16, causal=True, layout="zigzag"),
    _case("triton-bf16-full-mqa", H=2, H_kv=1, D=64, S=16, causal=False, layout="contiguous"),
]


def test_triton_step_path_bf16_within_twice_plain_torch_error(ranks):
    # bf16 through the Triton step kernels (the interpreter widens bf16 dot operands,
    # see kernels/attention_step.py _dot, and here rounds to bf16 as a GPU does): the
    # rule of the low-precision test above.
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "cast_impl") or not hasattr(interpreter, "TensorHandle"):
        pytest.skip("this Triton's interpreter has no InterpreterBuilder.cast_impl to round bf16 casts")
    per_rank = ranks.run(run_bf16_cases_with_triton, TRITON_BF16_CASES)
    slack = SLACK[torch.bfloat16]
    failures = failures_of(per_rank, lambda name, yardsticks: 2 * yardsticks["plain"][name] + slack)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# a sub-group as the ring (group=): the world of 4 as {0, 2} and {1, 3}
# ----------------------------------------------------------------------------------

_sub_groups = None


def sub_groups():
    """The sub-groups {0, 2} and {1, 3} of a world of 4, made once per rank (new_group
    is collective: every rank makes both, in the same order)."""
    global _sub_groups
    if _sub_groups is None:
        _sub_groups = (dist.new_group([0, 2]), dist.new_group([1, 3]))
    return _sub_groups


def run_cases_on_sub_group(cases):
    """Each case on this rank's sub-group, whose whole sequence (its own seed: the two
    sub-groups attend over different data) is split over its 2 ranks."""
    which = dist.get_rank() % 2
    group = sub_groups()[which]
    assert dist.get_world_size(group) == 2 and dist.get_rank(group) == dist.get_rank() // 2
    return [(case["id"], *run_case(case, torch.float32, seed=10 * index + which, group=group))
            for index, case in enumerate(cases)]


SUB_GROUP_CASES = [
    _case("sub-contig-causal-gqa", H=4, H_kv=2, D=64, S=6, causal=True, layout="contiguous"),
    _case("sub-zigzag-causal", H=2, H_kv=2, D=64, S=8, causal=True, layout="zigzag", B=2),
]


@pytest.mark.parametrize("ranks", [4], indirect=True, ids=["P4"])
def test_sub_group_rings_match_their_own_sequence(ranks):
    # Two rings of 2 at once inside a world of 4: group ranks differ from global ranks
    # (global 3 is rank 1 of {1, 3}), so the ring must map its peers to global ranks.
    per_rank = ranks.run(run_cases_on_sub_group, SUB_GROUP_CASES)
    failures = failures_of(per_rank, lambda name, yardsticks: FP32_TOL)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------


def compiled_ring_matches_eager():
    """fullgraph torch.compile (aot_eager) of a function around ring_attention (zigzag,
    causal, return_lse) vs eager: {name: max abs difference} of out, lse and grads."""
    rank, world_size = _rank()
    torch._dynamo.reset()
    case = _case("compile", H=4, H_kv=2, D=16, S=4, causal=True, layout="zigzag")
    q, k, v, dout = (local_rows(t, "zigzag", rank, world_size)
                     for t in full_inputs(case, world_size, torch.float32, seed=5))

    def block(q, k, v):
        # Something before and after, so the graph is more than the op alone.
        out, lse = sp.ring_attention(q * 0.5, k, v, causal=True, layout="zigzag", return_lse=True)
        return out * 2.0, lse

    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        out.backward(dout)
        results.append((out.detach(), lse, *(leaf.grad for leaf in leaves)))
    eager, compiled = results
    return {name: max_err(c, e) for name, c, e in zip(NAMES, compiled, eager)}


def test_compile_fullgraph_matches_eager(ranks):
    # aot_eager runs the same kernels as eager: the results must agree exactly.
    for rank, errors in enumerate(ranks.run(compiled_ring_matches_eager)):
        assert all(err == 0.0 for err in errors.values()), f"rank {rank}: compiled differs from eager: {errors}"


# ----------------------------------------------------------------------------------
# the step schedule: which (query, key) scores each rank computes at each ring step
# ----------------------------------------------------------------------------------


def _global_positions(rank, world_size, seqlen, zigzag):
    """Global sequence positions of a rank's local rows (its K/V block's too)."""
    if not zigzag:
        return list(range(rank * seqlen, (rank + 1) * seqlen))
    half = seqlen // 2
    return [chunk * half + i for chunk in (rank, 2 * world_size - 1 - rank) for i in range(half)]


def _step_scores(step, rank, world_size, seqlen, zigzag):
    """The (query position, key position) pairs whose scores `rank` computes at causal
    ring step `step`, as ops.ring_attention.step_block says: its rows x the block's first
    kv_len keys, a causal block masked by local index (the diagonal's exact count)."""
    block = step_block(step, rank, world_size, seqlen, True, zigzag)
    if block is None:
        return []
    src = (rank - step) % world_size
    rows = _global_positions(rank, world_size, seqlen, zigzag)[block.q_start : block.q_start + block.q_len]
    keys = _global_positions(src, world_size, seqlen, zigzag)[: block.kv_len]
    return [(q, k) for i, q in enumerate(rows) for j, k in enumerate(keys) if not block.causal or j <= i]


def _causal_schedule(world_size, seqlen, zigzag):
    """(work[step][rank]: number of scores computed, every score computed, with repeats)."""
    work, computed = [], []
    for step in range(world_size):
        per_rank = [_step_scores(step, rank, world_size, seqlen, zigzag) for rank in range(world_size)]
        work.append([len(scores) for scores in per_rank])
        computed += [pair for scores in per_rank for pair in scores]
    return work, computed


@pytest.mark.parametrize("world_size", range(1, 9), ids=lambda size: f"P{size}")
def test_zigzag_causal_steps_do_equal_work_on_every_rank(world_size):
    for seqlen in (2, 4, 6, 10):
        total = world_size * seqlen
        causal_pairs = sorted((q, k) for q in range(total) for k in range(q + 1))
        for zigzag in (True, False):
            work, computed = _causal_schedule(world_size, seqlen, zigzag)
            unequal = [(step, per_rank) for step, per_rank in enumerate(work) if len(set(per_rank)) > 1]
            if zigzag:
                assert not unequal, f"P={world_size} S={seqlen}: zigzag work per rank differs at (step, work) {unequal}"
            elif world_size > 1:
                # The same check fails for the contiguous layout (rank r works r+1 steps).
                assert unequal, f"P={world_size} S={seqlen}: the contiguous layout looks balanced"
            # Both layouts: every causal score exactly once, nothing else.
            assert sorted(computed) == causal_pairs, f"P={world_size} S={seqlen} zigzag={zigzag}: wrong scores"


# ----------------------------------------------------------------------------------
# comm_stats
# ----------------------------------------------------------------------------------


def measure_bytes(dtype):
    rank, world_size = _rank()
    results = []
    for layout, causal, heads_kv in (("contiguous", True, 2), ("zigzag", True, 1), ("contiguous", False, 4)):
        gen = torch.Generator().manual_seed(rank)
        q = torch.randn(2, 6, 4, 64, generator=gen).to(dtype).requires_grad_()
        k = torch.randn(2, 6, heads_kv, 64, generator=gen).to(dtype).requires_grad_()
        v = torch.randn(2, 6, heads_kv, 64, generator=gen).to(dtype).requires_grad_()
        with sp.comm_stats() as forward:
            out = sp.ring_attention(q, k, v, causal=causal, layout=layout)
        with sp.comm_stats() as backward:
            # On CUDA the autograd engine runs the backward on a thread of its own:
            # run it on another thread here too, so bytes sent there must count.
            worker = threading.Thread(target=out.sum().backward)
            worker.start()
            worker.join()
        kv_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        grad_kv_bytes = 4 * (k.numel() + v.numel())  # fp32 dk|dv travel
        results.append(
            (forward.bytes_sent, (world_size - 1) * kv_bytes,
             backward.bytes_sent, (world_size - 1) * (kv_bytes + grad_kv_bytes),
             forward.calls, backward.calls)
        )  # fmt: skip
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_comm_stats_count_the_ring(ranks, dtype):
    for per_case in ranks.run(measure_bytes, dtype):
        for fwd, fwd_theory, bwd, bwd_theory, fwd_calls, bwd_calls in per_case:
            assert fwd == fwd_theory  # (P-1) x local KV bytes
            assert bwd == bwd_theory  # (P-1) x (KV bytes + fp32 dKV bytes)
            assert fwd_calls == ranks.world_size - 1
            assert bwd_calls == 2 * (ranks.world_size - 1)


# ----------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------


def opcheck_ops():
    rank, world_size = _rank()
    group_name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(rank)
    results = []
    for causal, zigzag in ((True, True), (False, False)):
        q = torch.randn(1, 4, 2, 16, generator=gen, requires_grad=True)
        k = torch.randn(1, 4, 1, 16, generator=gen, requires_grad=True)
        v = torch.randn(1, 4, 1, 16, generator=gen, requires_grad=True)
        args = (q, k, v, causal, 0.25, zigzag, group_name, DEVICE_DEFAULT)
        torch.library.opcheck(torch.ops.seqpar.ring_attention_forward.default, args)
        out, lse = torch.ops.seqpar.ring_attention_forward(*(t.detach() if torch.is_tensor(t) else t for t in args))
        dout = torch.randn(out.shape, generator=gen)
        backward_args = (dout, q.detach(), k.detach(), v.detach(), out, lse, causal, 0.25, zigzag, group_name, DEVICE_DEFAULT)
        torch.library.opcheck(torch.ops.seqpar.ring_attention_backward.default, backward_args)
        results.append(True)
    return results


def test_opcheck(ranks):
    assert ranks.run(opcheck_ops) == [[True] * 2] * ranks.world_size


def test_opcheck_single_process():
    # Without torch.distributed: the group of one process (group name "").
    q = torch.randn(2, 6, 4, 32, requires_grad=True)
    k = torch.randn(2, 6, 2, 32, requires_grad=True)
    v = torch.randn(2, 6, 2, 32, requires_grad=True)
    torch.library.opcheck(torch.ops.seqpar.ring_attention_forward.default, (q, k, v, True, 0.2, True, "", DEVICE_DEFAULT))
    out, lse = sp.ring_attention(q, k, v, causal=True, return_lse=True)
    expected, expected_lse = reference_attention(q.double(), k.double(), v.double(), True, 32**-0.5)
    assert max_err(out, expected) <= FP32_TOL and max_err(lse, expected_lse) <= FP32_TOL


def test_cpu_paths_need_no_triton():
    # CPU-only torch wheels do not ship Triton: importing the package and running the
    # CPU ring (forward and backward) and Ulysses must not import it.
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, seqpar_kernels as sp\n"
        "q = torch.randn(1, 6, 4, 16, requires_grad=True)\n"
        "k = torch.randn(1, 6, 2, 16, requires_grad=True)\n"
        "sp.ring_attention(q, k, k, causal=True).sum().backward()\n"
        "sp.ulysses_attention(q, k, k).sum().backward()\n"
        "assert q.grad is not None and 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n"
        "print('no triton: ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "no triton: ok" in result.stdout


# ----------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------


def _qkv(shape_q=(1, 4, 2, 16), shape_kv=(1, 4, 2, 16), dtype=torch.float32):
    return torch.randn(shape_q).to(dtype), torch.randn(shape_kv).to(dtype), torch.randn(shape_kv).to(dtype)


def bad_inputs_raise_everywhere():
    """Bad inputs raise ValueError on every rank (and nobody hangs); the ranks are usable
    afterwards. Returns the messages."""
    rank, world_size = _rank()
    q, k, v = _qkv()
    bad = {
        "3-D q": lambda: sp.ring_attention(q[0], k, v),
        "int dtype": lambda: sp.ring_attention(*_qkv(dtype=torch.int32)),
        "fp64": lambda: sp.ring_attention(*_qkv(dtype=torch.float64)),
        "mixed dtypes": lambda: sp.ring_attention(q, k.half(), v),
        "k/v shapes": lambda: sp.ring_attention(q, k, v[:, :, :1]),
        "seqlen q != kv": lambda: sp.ring_attention(q, k[:, :2], v[:, :2]),
        "batch q != kv": lambda: sp.ring_attention(q, torch.cat([k, k]), torch.cat([v, v])),
        "head dims": lambda: sp.ring_attention(q, k[..., :8], v[..., :8]),
        "head dim 512": lambda: sp.ring_attention(*_qkv((1, 4, 2, 512), (1, 4, 2, 512))),
        "heads % kv heads": lambda: sp.ring_attention(*_qkv((1, 4, 3, 16), (1, 4, 2, 16))),
        "devices": lambda: sp.ring_attention(q.to("meta"), k, v),
        "meta device": lambda: sp.ring_attention(*(t.to("meta") for t in (q, k, v))),
        "layout": lambda: sp.ring_attention(q, k, v, layout="striped"),
        "zigzag odd length": lambda: sp.ring_attention(*_qkv((1, 3, 2, 16), (1, 3, 2, 16)), layout="zigzag"),
        "softmax_scale": lambda: sp.ring_attention(q, k, v, softmax_scale=float("nan")),
        "zigzag_split length": lambda: sp.zigzag_split(torch.randn(2, 2 * world_size + 1), dim=1),
        "zigzag_gather odd": lambda: sp.zigzag_gather(torch.randn(3, 2), dim=0),
    }
    if world_size > 1:
        # Each rank alone is fine; together they disagree. The metadata all_gather makes
        # every rank raise.
        length = 4 if rank == 0 else 6
        bad["unequal lengths"] = lambda: sp.ring_attention(*_qkv((1, length, 2, 16), (1, length, 2, 16)))
        bad["ranks disagree on causal"] = lambda: sp.ring_attention(q, k, v, causal=rank == 0)
        bad["ranks disagree on heads"] = lambda: sp.ring_attention(
            *_qkv((1, 4, 2 + 2 * (rank == 0), 16), (1, 4, 2, 16))
        )
        bad["zigzag_gather unequal"] = lambda: sp.zigzag_gather(torch.randn(2 + 2 * (rank == 0), 3), dim=0)
    bad["check_ranks"] = lambda: sp.ring_attention(q, k, v, check_ranks=None)
    messages = {}
    for name, call in bad.items():
        try:
            call()
        except ValueError as error:
            messages[name] = str(error)
        else:
            messages[name] = None
    # Still usable: a valid call runs and is right.
    out = sp.ring_attention(q, k, v, causal=True)
    return messages, tuple(out.shape)


def test_bad_inputs_raise_on_every_rank(ranks):
    for rank, (messages, shape) in enumerate(ranks.run(bad_inputs_raise_everywhere)):
        missing = [name for name, message in messages.items() if message is None]
        assert not missing, f"rank {rank}: no ValueError for {missing}"
        assert shape == (1, 4, 2, 16)
        assert "(1, 4, 2, 16)" in messages["k/v shapes"]  # messages name the shapes


def ring_without_rank_check():
    """check_ranks=False runs no metadata all_gather and gives the same result."""
    rank, _ = _rank()
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 4, 2, 16, generator=gen) for _ in range(3))
    checked = sp.ring_attention(q, k, v, causal=True, layout="zigzag")
    gathers = []
    original = checks_module.all_gather_ints
    checks_module.all_gather_ints = lambda *args: gathers.append(args) or original(*args)
    try:
        unchecked = sp.ring_attention(q, k, v, causal=True, layout="zigzag", check_ranks=False)
        sp.ring_attention(q, k, v, causal=True, layout="zigzag")
    finally:
        checks_module.all_gather_ints = original
    return torch.equal(checked, unchecked), len(gathers)


def test_check_ranks_false_skips_the_metadata_gather(ranks):
    expected_gathers = 1 if ranks.world_size > 1 else 0  # only the checked call's
    assert ranks.run(ring_without_rank_check) == [(True, expected_gathers)] * ranks.world_size


# ----------------------------------------------------------------------------------
# zigzag_split / zigzag_gather
# ----------------------------------------------------------------------------------


def zigzag_round_trip():
    rank, world_size = _rank()
    gen = torch.Generator().manual_seed(11)
    results = {}
    full = torch.randn(2, 4 * world_size, 3, generator=gen)
    weights = torch.randn(full.shape, generator=gen)
    for dim in (1, -2):
        x = full.clone().requires_grad_()
        piece = sp.zigzag_split(x, dim)
        results[f"split dim {dim}"] = torch.equal(piece, local_rows(full, "zigzag", rank, world_size))
        # split's backward gathers: x.grad is the full gradient, the same on every rank.
        (piece * local_rows(weights, "zigzag", rank, world_size)).sum().backward()
        results[f"split grad dim {dim}"] = torch.equal(x.grad, weights)
        leaf = piece.detach().requires_grad_()
        gathered = sp.zigzag_gather(leaf, dim)
        results[f"gather dim {dim}"] = torch.equal(gathered, full)
        (gathered * weights).sum().backward()
        results[f"gather grad dim {dim}"] = torch.equal(leaf.grad, local_rows(weights, "zigzag", rank, world_size))
    # End to end: zigzag pieces of full q/k/v -> causal ring attention -> gathered out
    # equals attention over the full sequence.
    case = _case("e2e", H=2, H_kv=1, D=64, S=4, causal=True, layout="zigzag")
    q, k, v, _ = full_inputs(case, world_size, torch.float32, seed=3)
    out = sp.ring_attention(*(sp.zigzag_split(t, 1) for t in (q, k, v)), causal=True, layout="zigzag")
    expected, _ = reference_attention(q.double(), k.double(), v.double(), True, 64**-0.5)
    results["end to end"] = max_err(sp.zigzag_gather(out, 1), expected) <= FP32_TOL
    return results


def test_zigzag_split_and_gather(ranks):
    for rank, results in enumerate(ranks.run(zigzag_round_trip)):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


# ----------------------------------------------------------------------------------
# on one GPU (skipped without one): the CUDA ring driver, its streams and the step
# kernels at the GPU tiles, which the gloo ranks above never run
# ----------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_gpu_matches_reference(dtype, causal):
    # A world of one on CUDA, at lengths that give the GPU tiles several whole tiles.
    # Plain attention in dtype (the yardstick of the 2x rule) runs on the CPU.
    gen = torch.Generator().manual_seed(21)
    inputs = [torch.randn(2, 1000, heads, 128, generator=gen, dtype=torch.float64).to(dtype)
              for heads in (8, 2, 2, 8)]
    scale = 128**-0.5
    exact = attention_with_grads(lambda q, k, v: reference_attention(q, k, v, causal, scale),
                                 *(t.double() for t in inputs))
    plain = attention_with_grads(lambda q, k, v: reference_attention(q, k, v, causal, scale), *inputs)
    ours = attention_with_grads(lambda q, k, v: sp.ring_attention(q, k, v, causal=causal, return_lse=True),
                                *(t.cuda() for t in inputs))
    slack = FP32_TOL if dtype == torch.float32 else SLACK[dtype]
    for name, got, want, yardstick in zip(NAMES, ours, exact, plain):
        assert got.is_cuda and torch.isfinite(got).all(), name
        err, plain_err = max_err(got.cpu(), want), max_err(yardstick, want)
        assert err <= 2 * plain_err + slack, f"{name}: err {err:.3g}, plain torch in {dtype} {plain_err:.3g}"


@needs_gpu
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_one_gpu_virtual_ring_overlapped_copies_match_serial_copies(monkeypatch, layout):
    # The ring driver of P GPUs on one (seqpar_kernels.testing.ReplacedExchange): the
    # exchange is a device-to-device copy on a side stream ("copy", overlapped as NCCL's
    # would be) or on the compute stream ("serial_copy"). The copies deliver this rank's
    # own K|V, so both must agree bit for bit, and with no exchange at all ("none") for
    # out and dq: a block read before its copy landed, or overwritten while still read,
    # would not. Every receive buffer is filled with NaN on the compute stream before its
    # copy is posted: otherwise, from step 2 on, the spare buffer already holds this
    # rank's K|V (the last step's), and a read racing ahead of the copy would give the
    # same numbers.
    from seqpar_kernels.parallel.ring_driver import ring_backward, ring_forward
    from seqpar_kernels.parallel.ring_steps import step_kernels_for
    from seqpar_kernels.testing import ReplacedExchange

    start = ReplacedExchange.start

    def start_into_nan(self, send, recv):
        if self.mode != "none":  # "none": recv is send itself, nothing is copied
            recv.fill_(float("nan"))
        return start(self, send, recv)

    monkeypatch.setattr(ReplacedExchange, "start", start_into_nan)

    gen = torch.Generator().manual_seed(22)
    q, k, v, dout = (torch.randn(1, 2048, heads, 128, generator=gen).to("cuda", torch.bfloat16)
                     for heads in (8, 2, 2, 8))
    steps = step_kernels_for(DEVICE_DEFAULT, q.device)

    def ring(mode, rank):
        exchange = ReplacedExchange(mode, virtual_world_size=4, virtual_rank=rank)
        options = (True, 128**-0.5, layout == "zigzag", "", steps)
        out, lse = ring_forward(q, k, v, *options, exchange=exchange)
        return [out, *ring_backward(dout, q, k, v, out, lse, *options, exchange=exchange)]

    for rank in (0, 3):
        overlapped, serial, alone = ring("copy", rank), ring("serial_copy", rank), ring("none", rank)
        for name, a, b in zip(("out", "dq", "dk", "dv"), overlapped, serial):
            assert torch.equal(a, b), f"rank {rank} {name}: overlapped copies differ from serial ones"
        for name, a, b in zip(("out", "dq"), overlapped, alone):
            assert torch.equal(a, b), f"rank {rank} {name}: overlapped copies differ from no exchange"
