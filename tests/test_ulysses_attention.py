"""ulysses_attention's accuracy on 1-4 gloo ranks (seqpar_kernels/parallel/ulysses.py).

Every rank builds the same full q/k/v (B, S, H, D) from a fixed seed, takes its
sequence piece, runs ulysses_attention, and compares its piece of the output and of
the gradients with a single-process reference computed on the same rank: fp64
attention with the score matrix materialized (tools/reference.py). fp32 must match to
reference.FP32_TOLERANCE; fp16/bf16 follow the accuracy rule (reference.error_bound).

Rank functions are module-level (the pool pickles them by reference) and run several
cases per call, because every `ranks.run` is a round trip to all ranks. The bytes:
tests/test_ulysses_bytes.py; opcheck, torch.compile and argument checks:
tests/test_ulysses_ops.py.
"""

from __future__ import annotations

import pytest
import torch
from on_ranks import backward_on_every_rank, on_every_rank, rank_and_world, timeout_group
from ulysses_cases import UNEVEN, exact_with_grads, failures_over, full_inputs, lengths_for, make_case

from seqpar_kernels import ulysses_attention
from tools import reference


def ulysses_with_grads(q_loc, k_loc, v_loc, dout_loc, causal, sizes, scale=None):
    q_loc, k_loc, v_loc = (t.detach().clone().requires_grad_() for t in (q_loc, k_loc, v_loc))
    out = ulysses_attention(
        q_loc, k_loc, v_loc, causal=causal, softmax_scale=scale, seq_lens=sizes, group=timeout_group()
    )
    backward_on_every_rank(out, dout_loc)
    return out.detach(), q_loc.grad, k_loc.grad, v_loc.grad


NAMES = ("out", "dq", "dk", "dv")


def check_case_fp32(case):
    """Runs one fp32 case on this rank. Returns {name: max abs error vs fp64 reference}
    for this rank's piece of out, dq, dk, dv."""
    rank, world = rank_and_world()
    sizes = lengths_for(case["S"], world)
    case = dict(case, S_total=sum(sizes))
    q, k, v, dout = full_inputs(case, torch.float64, seed=case.get("seed", 0))
    ref = exact_with_grads(q, k, v, dout, case["causal"], case.get("scale"))
    got = ulysses_with_grads(
        *(reference.contiguous_piece(t, sizes, rank).float() for t in (q, k, v, dout)),
        case["causal"], sizes, case.get("scale"),
    )  # fmt: skip
    errors = {}
    for name, r, g in zip(NAMES, ref, got):
        expected = reference.contiguous_piece(r, sizes, rank)
        assert g.shape == expected.shape, (name, g.shape, expected.shape)
        assert g.dtype == torch.float32, (name, g.dtype)
        errors[name] = reference.max_error(g, expected)
    return errors


@on_every_rank
def run_cases_fp32(cases):
    """All cases on this rank; returns a list of (case id, errors)."""
    return [(case["id"], check_case_fp32(case)) for case in cases]


CASE_GROUPS = {
    "mha": [
        make_case("mha-even", H=4, H_kv=4, D=64, S=16, causal=False, B=2),
        make_case("mha-causal", H=4, H_kv=4, D=64, S=16, causal=True, B=2),
        make_case("mha-scale", H=4, H_kv=4, D=64, S=12, causal=True, scale=0.3),
        make_case("mha-odd-seq", H=4, H_kv=4, D=64, S=11, causal=True),
    ],
    "heads": [
        # H not divisible by P: 5 on P=2,3,4; 6 on P=4.
        make_case("H5", H=5, H_kv=5, D=64, S=12, causal=True),
        make_case("H6", H=6, H_kv=6, D=64, S=12, causal=False),
        # GQA: H=8,H_kv=2 splits a kv group across ranks on P=3 (heads [3,3,2]).
        make_case("gqa-8-2", H=8, H_kv=2, D=64, S=12, causal=True, B=2),
        make_case("gqa-8-2-full", H=8, H_kv=2, D=64, S=12, causal=False),
        # GQA with groups split unevenly: H=6, H_kv=2 on P=4 -> heads [2,2,1,1],
        # kv head 0 serves ranks 0 and 1.
        make_case("gqa-6-2", H=6, H_kv=2, D=64, S=12, causal=True),
        make_case("gqa-6-3", H=6, H_kv=3, D=64, S=12, causal=False),
        # MQA: one kv head, fewer kv heads than ranks.
        make_case("mqa-4-1", H=4, H_kv=1, D=64, S=12, causal=True),
        make_case("mqa-5-1", H=5, H_kv=1, D=64, S=12, causal=False),
    ],
    "uneven-seq": [
        make_case("uneven", H=4, H_kv=4, D=64, S=UNEVEN, causal=False, B=2),
        make_case("uneven-causal", H=4, H_kv=4, D=64, S=UNEVEN, causal=True, B=2),
        make_case("uneven-gqa-causal", H=6, H_kv=2, D=64, S=UNEVEN, causal=True),
        make_case("uneven-mqa", H=5, H_kv=1, D=64, S=UNEVEN, causal=False),
    ],
    "head-dims": [
        make_case("D80", H=4, H_kv=2, D=80, S=12, causal=True),
        make_case("D128", H=4, H_kv=4, D=128, S=12, causal=False),
        make_case("D256", H=4, H_kv=1, D=256, S=8, causal=True),
    ],
}


@pytest.mark.parametrize("group", list(CASE_GROUPS))
def test_fp32_forward_backward_matches_fp64_reference(ranks, group):
    per_rank = ranks.run(run_cases_fp32, CASE_GROUPS[group])
    assert len(per_rank) == ranks.world_size
    assert all(len(results) == len(CASE_GROUPS[group]) for results in per_rank)
    failures = failures_over(per_rank, reference.FP32_TOLERANCE)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# fewer q heads than ranks: some ranks get no heads at all
# ----------------------------------------------------------------------------------

FEWER_HEADS = [
    make_case("H2", H=2, H_kv=2, D=64, S=8, causal=True),
    make_case("H3-mqa", H=3, H_kv=1, D=64, S=8, causal=False),
]


@on_every_rank
def run_forward_only_fp32(cases):
    rank, world = rank_and_world()
    results = []
    for case in cases:
        sizes = lengths_for(case["S"], world)
        case = dict(case, S_total=sum(sizes))
        q, k, v, _ = full_inputs(case)
        expected = reference.contiguous_piece(reference.attention(q, k, v, case["causal"])[0], sizes, rank)
        with torch.no_grad():
            out = ulysses_attention(
                *(reference.contiguous_piece(t, sizes, rank).float() for t in (q, k, v)),
                causal=case["causal"], seq_lens=sizes, group=timeout_group(),
            )  # fmt: skip
        assert out.shape == expected.shape
        results.append((case["id"], {"out": reference.max_error(out, expected)}))
    return results


def test_fewer_heads_than_ranks_forward(ranks):
    failures = failures_over(ranks.run(run_forward_only_fp32, FEWER_HEADS), reference.FP32_TOLERANCE)
    assert not failures, "\n".join(failures)


def test_fewer_heads_than_ranks_backward(ranks):
    # A rank with no q heads must still join both backward all-to-alls.
    failures = failures_over(ranks.run(run_cases_fp32, FEWER_HEADS), reference.FP32_TOLERANCE)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# fp16 / bf16: the flash-attention rule
# ----------------------------------------------------------------------------------

LOW_PRECISION_CASES = [
    make_case("mha-causal-D64", H=4, H_kv=4, D=64, S=16, causal=True, B=2),
    make_case("gqa-6-2-D80", H=6, H_kv=2, D=80, S=12, causal=False),
    make_case("mqa-uneven-D128", H=5, H_kv=1, D=128, S=UNEVEN, causal=True),
    make_case("gqa-D256", H=4, H_kv=2, D=256, S=8, causal=True),
]


@on_every_rank
def run_cases_low_precision(cases, dtype):
    """Per case: this rank's max errors vs the fp64 reference, of ulysses in `dtype` and
    of plain PyTorch attention (materialized scores) computed in `dtype`, and the
    magnitude of the exact piece."""
    rank, world = rank_and_world()
    results = []
    for case in cases:
        sizes = lengths_for(case["S"], world)
        case = dict(case, S_total=sum(sizes))
        q, k, v, dout = full_inputs(case, torch.float64, seed=1)
        ref = exact_with_grads(q, k, v, dout, case["causal"])
        plain = exact_with_grads(*(t.to(dtype) for t in (q, k, v, dout)), case["causal"])
        got = ulysses_with_grads(
            *(reference.contiguous_piece(t, sizes, rank).to(dtype) for t in (q, k, v, dout)), case["causal"], sizes
        )
        ours, pytorch, magnitude = {}, {}, {}
        for name, r, p, g in zip(NAMES, ref, plain, got):
            assert g.dtype == dtype, (name, g.dtype)
            r, p = reference.contiguous_piece(r, sizes, rank), reference.contiguous_piece(p, sizes, rank)
            ours[name], pytorch[name] = reference.max_error(g, r), reference.max_error(p, r)
            magnitude[name] = reference.magnitude(r)
        results.append((case["id"], ours, pytorch, magnitude))
    return results


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_within_2x_of_pytorch(ranks, dtype):
    per_rank = ranks.run(run_cases_low_precision, LOW_PRECISION_CASES, dtype)
    failures = []
    for rank, results in enumerate(per_rank):
        assert len(results) == len(LOW_PRECISION_CASES)
        for case_id, ours, pytorch, magnitude in results:
            for name in NAMES:
                bound = reference.error_bound(dtype, pytorch[name], magnitude[name])
                if not ours[name] <= bound:
                    failures.append(
                        f"rank {rank} {case_id} {name}: ulysses err {ours[name]:.3g} > bound {bound:.3g} "
                        f"(pytorch err {pytorch[name]:.3g})"
                    )
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# non-contiguous inputs
# ----------------------------------------------------------------------------------


@on_every_rank
def run_noncontiguous(causal):
    """q/k/v as (1) head slices of a packed qkv tensor, (2) transposed (B, H, S, D)
    storage, (3) every other element of a wider head dim. Gradients land in the
    packed/transposed leaves. Returns max errors per layout."""
    rank, world = rank_and_world()
    sizes = lengths_for(UNEVEN, world)
    case = make_case("nc", H=6, H_kv=2, D=64, S=UNEVEN, causal=causal, B=2, S_total=sum(sizes))
    heads, kv_heads = case["H"], case["H_kv"]
    q, k, v, dout = full_inputs(case, seed=2)
    ref = exact_with_grads(q, k, v, dout, causal)
    ref_local = [reference.contiguous_piece(r, sizes, rank) for r in ref]
    q_loc, k_loc, v_loc, dout_loc = (reference.contiguous_piece(t, sizes, rank).float() for t in (q, k, v, dout))
    errors = {}

    # (1) packed: (B, S_r, H + 2 H_kv, D); q, k, v are head slices of it.
    packed = torch.cat([q_loc, k_loc, v_loc], dim=2).requires_grad_()
    q_view, k_view, v_view = packed.split([heads, kv_heads, kv_heads], dim=2)
    assert sizes[rank] == 0 or not (q_view.is_contiguous() or k_view.is_contiguous())
    out = ulysses_attention(q_view, k_view, v_view, causal=causal, seq_lens=sizes, group=timeout_group())
    backward_on_every_rank(out, dout_loc)
    dq, dk, dv = packed.grad.split([heads, kv_heads, kv_heads], dim=2)
    for name, g, r in zip(NAMES, (out, dq, dk, dv), ref_local):
        errors[f"packed-{name}"] = reference.max_error(g, r)

    # (2) transposed: storage (B, H, S_r, D), viewed as (B, S_r, H, D).
    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q_loc, k_loc, v_loc)]
    views = [leaf.transpose(1, 2) for leaf in leaves]
    assert not any(view.is_contiguous() for view in views if view.shape[1] > 1)
    out = ulysses_attention(*views, causal=causal, seq_lens=sizes, group=timeout_group())
    backward_on_every_rank(out, dout_loc)
    for name, g, r in zip(NAMES, (out, *(leaf.grad.transpose(1, 2) for leaf in leaves)), ref_local):
        errors[f"transposed-{name}"] = reference.max_error(g, r)

    # (3) strided head dim: (B, S_r, H, 2D)[..., ::2].
    # (B, S_r, H, D) -> (B, S_r, H, D, 2) -> (B, S_r, H, 2D); the odd elements are poison.
    leaves = [
        torch.stack([t, torch.full_like(t, 1e6)], dim=-1).flatten(-2).requires_grad_() for t in (q_loc, k_loc, v_loc)
    ]
    views = [leaf[..., ::2] for leaf in leaves]
    out = ulysses_attention(*views, causal=causal, seq_lens=sizes, group=timeout_group())
    backward_on_every_rank(out, dout_loc)
    for name, g, r in zip(NAMES, (out, *(leaf.grad[..., ::2] for leaf in leaves)), ref_local):
        errors[f"strided-{name}"] = reference.max_error(g, r)
    # The skipped elements get exactly zero gradient.
    skipped = [leaf.grad[..., 1::2] for leaf in leaves]
    errors["strided-skipped-grad"] = max(reference.max_error(grad, torch.zeros_like(grad)) for grad in skipped)
    return [("noncontiguous", errors)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_noncontiguous_inputs(ranks, causal):
    per_rank = ranks.run(run_noncontiguous, causal)
    assert all(len(results[0][1]) == 13 for results in per_rank)
    failures = failures_over(per_rank, reference.FP32_TOLERANCE)
    assert not failures, "\n".join(failures)
