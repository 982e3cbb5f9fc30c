"""Tests for ulysses_attention (seqpar_kernels/parallel/ulysses.py) on 1-4 gloo ranks.

Every rank builds the same full q/k/v (B, S, H, D) from a fixed seed, takes its
sequence piece, runs ulysses_attention, and compares its piece of the output and of
the gradients with a single-process reference computed on the same rank: fp64
attention with the score matrix materialized, kv heads repeat_interleave'd in the
reference only.

Rank functions are module-level (the pool pickles them by reference) and run several
cases per call, because every `ranks.run` is a round trip to all ranks.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist

from on_ranks import backward_on_every_rank, on_every_rank, timeout_group
from seqpar_kernels import comm_stats, ulysses_attention

# ----------------------------------------------------------------------------------
# helpers (run inside the ranks)
# ----------------------------------------------------------------------------------


def _rank():
    return dist.get_rank(), dist.get_world_size()


def reference_attention(q, k, v, causal=False, scale=None):
    """Plain attention, computed in q's dtype with the scores materialized.

    q: (B, S, H, D); k, v: (B, S, H_kv, D). Returns (B, S, H, D)."""
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=2)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # (B, H, S, S)
    if causal:
        seq = q.shape[1]
        keep = torch.ones(seq, seq, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def seq_sizes_for(total_or_sizes, world_size):
    """Per-rank sequence lengths: an int is split tensor_split style; a dict maps world
    size to explicit sizes."""
    if isinstance(total_or_sizes, dict):
        sizes = list(total_or_sizes[world_size])
        assert len(sizes) == world_size
        return sizes
    return [piece.numel() for piece in torch.arange(total_or_sizes).tensor_split(world_size)]


def full_inputs(case, dtype=torch.float64, seed=0):
    """The same full q, k, v, dout on every rank (fp64 draws, cast to dtype)."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, head_dim = case["B"], case["H"], case["H_kv"], case["D"]
    total = case["S_total"]
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    q = draw(batch, total, heads, head_dim)
    k = draw(batch, total, kv_heads, head_dim)
    v = draw(batch, total, kv_heads, head_dim)
    dout = draw(batch, total, heads, head_dim)
    return q, k, v, dout


def local_piece(x, sizes, rank, dim=1):
    start = sum(sizes[:rank])
    return x.narrow(dim, start, sizes[rank])


def reference_with_grads(q, k, v, dout, causal, scale=None):
    """(out, dq, dk, dv) of reference_attention in the inputs' dtype."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, causal, scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def ulysses_with_grads(q_loc, k_loc, v_loc, dout_loc, causal, sizes, scale=None):
    q_loc, k_loc, v_loc = (t.detach().clone().requires_grad_() for t in (q_loc, k_loc, v_loc))
    out = ulysses_attention(
        q_loc, k_loc, v_loc, causal=causal, softmax_scale=scale, seq_lens=sizes, group=timeout_group()
    )
    backward_on_every_rank(out, dout_loc)
    return out.detach(), q_loc.grad, k_loc.grad, v_loc.grad


def max_err(a, b):
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


NAMES = ("out", "dq", "dk", "dv")


def check_case_fp32(case):
    """Runs one fp32 case on this rank. Returns {name: max abs error vs fp64 reference}
    for this rank's piece of out, dq, dk, dv."""
    rank, world = _rank()
    sizes = seq_sizes_for(case["S"], world)
    case = dict(case, S_total=sum(sizes))
    q, k, v, dout = full_inputs(case, torch.float64, seed=case.get("seed", 0))
    ref = reference_with_grads(q, k, v, dout, case["causal"], case.get("scale"))
    got = ulysses_with_grads(
        *(local_piece(t, sizes, rank).float() for t in (q, k, v, dout)),
        case["causal"], sizes, case.get("scale"),
    )  # fmt: skip
    errors = {}
    for name, r, g in zip(NAMES, ref, got):
        expected = local_piece(r, sizes, rank)
        assert g.shape == expected.shape, (name, g.shape, expected.shape)
        assert g.dtype == torch.float32, (name, g.dtype)
        errors[name] = max_err(g, expected)
    return errors


@on_every_rank
def run_cases_fp32(cases):
    """All cases on this rank; returns a list of (case id, errors)."""
    return [(case["id"], check_case_fp32(case)) for case in cases]


def _case(id, H, H_kv, D, S, causal, B=1, **extra):
    return dict(id=id, H=H, H_kv=H_kv, D=D, S=S, causal=causal, B=B, **extra)


# Explicit per-rank sequence lengths that differ by rank (one empty piece on P=3).
UNEVEN = {1: [7], 2: [5, 3], 3: [4, 0, 5], 4: [5, 3, 4, 1]}

CASE_GROUPS = {
    "mha": [
        _case("mha-even", H=4, H_kv=4, D=64, S=16, causal=False, B=2),
        _case("mha-causal", H=4, H_kv=4, D=64, S=16, causal=True, B=2),
        _case("mha-scale", H=4, H_kv=4, D=64, S=12, causal=True, scale=0.3),
        _case("mha-odd-seq", H=4, H_kv=4, D=64, S=11, causal=True),
    ],
    "heads": [
        # H not divisible by P: 5 on P=2,3,4; 6 on P=4.
        _case("H5", H=5, H_kv=5, D=64, S=12, causal=True),
        _case("H6", H=6, H_kv=6, D=64, S=12, causal=False),
        # GQA: H=8,H_kv=2 splits a kv group across ranks on P=3 (heads [3,3,2]).
        _case("gqa-8-2", H=8, H_kv=2, D=64, S=12, causal=True, B=2),
        _case("gqa-8-2-full", H=8, H_kv=2, D=64, S=12, causal=False),
        # GQA with groups split unevenly: H=6, H_kv=2 on P=4 -> heads [2,2,1,1],
        # kv head 0 serves ranks 0 and 1.
        _case("gqa-6-2", H=6, H_kv=2, D=64, S=12, causal=True),
        _case("gqa-6-3", H=6, H_kv=3, D=64, S=12, causal=False),
        # MQA: one kv head, fewer kv heads than ranks.
        _case("mqa-4-1", H=4, H_kv=1, D=64, S=12, causal=True),
        _case("mqa-5-1", H=5, H_kv=1, D=64, S=12, causal=False),
    ],
    "uneven-seq": [
        _case("uneven", H=4, H_kv=4, D=64, S=UNEVEN, causal=False, B=2),
        _case("uneven-causal", H=4, H_kv=4, D=64, S=UNEVEN, causal=True, B=2),
        _case("uneven-gqa-causal", H=6, H_kv=2, D=64, S=UNEVEN, causal=True),
        _case("uneven-mqa", H=5, H_kv=1, D=64, S=UNEVEN, causal=False),
    ],
    "head-dims": [
        _case("D80", H=4, H_kv=2, D=80, S=12, causal=True),
        _case("D128", H=4, H_kv=4, D=128, S=12, causal=False),
        _case("D256", H=4, H_kv=1, D=256, S=8, causal=True),
    ],
}

FP32_TOL = 2e-5


def _failures(per_rank, tolerance):
    failures = []
    for rank, results in enumerate(per_rank):
        for case_id, errors in results:
            for name, err in errors.items():
                if not err <= tolerance:  # also catches NaN
                    failures.append(f"rank {rank} {case_id} {name}: max err {err:.3g}")
    return failures


@pytest.mark.parametrize("group", list(CASE_GROUPS))
def test_fp32_forward_backward_matches_fp64_reference(ranks, group):
    per_rank = ranks.run(run_cases_fp32, CASE_GROUPS[group])
    assert len(per_rank) == ranks.world_size
    assert all(len(results) == len(CASE_GROUPS[group]) for results in per_rank)
    failures = _failures(per_rank, FP32_TOL)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# fewer q heads than ranks: some ranks get no heads at all
# ----------------------------------------------------------------------------------

FEWER_HEADS = [
    _case("H2", H=2, H_kv=2, D=64, S=8, causal=True),
    _case("H3-mqa", H=3, H_kv=1, D=64, S=8, causal=False),
]


@on_every_rank
def run_forward_only_fp32(cases):
    rank, world = _rank()
    results = []
    for case in cases:
        sizes = seq_sizes_for(case["S"], world)
        case = dict(case, S_total=sum(sizes))
        q, k, v, _ = full_inputs(case)
        expected = local_piece(reference_attention(q, k, v, case["causal"]), sizes, rank)
        with torch.no_grad():
            out = ulysses_attention(
                *(local_piece(t, sizes, rank).float() for t in (q, k, v)),
                causal=case["causal"], seq_lens=sizes, group=timeout_group(),
            )  # fmt: skip
        assert out.shape == expected.shape
        results.append((case["id"], {"out": max_err(out, expected)}))
    return results


def test_fewer_heads_than_ranks_forward(ranks):
    failures = _failures(ranks.run(run_forward_only_fp32, FEWER_HEADS), FP32_TOL)
    assert not failures, "\n".join(failures)


def test_fewer_heads_than_ranks_backward(ranks):
    # A rank with no q heads must still join both backward all-to-alls.
    failures = _failures(ranks.run(run_cases_fp32, FEWER_HEADS), FP32_TOL)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# fp16 / bf16: the flash-attention rule
# ----------------------------------------------------------------------------------

# Absolute slack on top of 2x PyTorch's own error: a fraction of one rounding step of
# an O(1) value in the dtype (as flash-attention's tests add), so that a case where
# PyTorch happens to be almost exact does not demand exactness.
LOW_PRECISION_SLACK = {torch.float16: 1e-4, torch.bfloat16: 1e-3}

LOW_PRECISION_CASES = [
    _case("mha-causal-D64", H=4, H_kv=4, D=64, S=16, causal=True, B=2),
    _case("gqa-6-2-D80", H=6, H_kv=2, D=80, S=12, causal=False),
    _case("mqa-uneven-D128", H=5, H_kv=1, D=128, S=UNEVEN, causal=True),
    _case("gqa-D256", H=4, H_kv=2, D=256, S=8, causal=True),
]


@on_every_rank
def run_cases_low_precision(cases, dtype):
    """Per case: this rank's max errors vs the fp64 reference, of ulysses in `dtype` and
    of plain PyTorch attention (materialized scores) computed in `dtype`."""
    rank, world = _rank()
    results = []
    for case in cases:
        sizes = seq_sizes_for(case["S"], world)
        case = dict(case, S_total=sum(sizes))
        q, k, v, dout = full_inputs(case, torch.float64, seed=1)
        ref = reference_with_grads(q, k, v, dout, case["causal"])
        plain = reference_with_grads(*(t.to(dtype) for t in (q, k, v, dout)), case["causal"])
        got = ulysses_with_grads(
            *(local_piece(t, sizes, rank).to(dtype) for t in (q, k, v, dout)), case["causal"], sizes
        )
        ours, pytorch = {}, {}
        for name, r, p, g in zip(NAMES, ref, plain, got):
            assert g.dtype == dtype, (name, g.dtype)
            r, p = local_piece(r, sizes, rank), local_piece(p, sizes, rank)
            ours[name], pytorch[name] = max_err(g, r), max_err(p, r)
        results.append((case["id"], ours, pytorch))
    return results


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_within_2x_of_pytorch(ranks, dtype):
    per_rank = ranks.run(run_cases_low_precision, LOW_PRECISION_CASES, dtype)
    slack = LOW_PRECISION_SLACK[dtype]
    failures = []
    for rank, results in enumerate(per_rank):
        assert len(results) == len(LOW_PRECISION_CASES)
        for case_id, ours, pytorch in results:
            for name in NAMES:
                if not ours[name] <= 2 * pytorch[name] + slack:
                    failures.append(
                        f"rank {rank} {case_id} {name}: ulysses err {ours[name]:.3g} > 2 x "
                        f"pytorch err {pytorch[name]:.3g} + {slack}"
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
    rank, world = _rank()
    sizes = seq_sizes_for(UNEVEN, world)
    case = _case("nc", H=6, H_kv=2, D=64, S=UNEVEN, causal=causal, B=2, S_total=sum(sizes))
    heads, kv_heads = case["H"], case["H_kv"]
    q, k, v, dout = full_inputs(case, seed=2)
    ref = reference_with_grads(q, k, v, dout, causal)
    ref_local = [local_piece(r, sizes, rank) for r in ref]
    q_loc, k_loc, v_loc, dout_loc = (local_piece(t, sizes, rank).float() for t in (q, k, v, dout))
    errors = {}

    # (1) packed: (B, S_r, H + 2 H_kv, D); q, k, v are head slices of it.
    packed = torch.cat([q_loc, k_loc, v_loc], dim=2).requires_grad_()
    q_view, k_view, v_view = packed.split([heads, kv_heads, kv_heads], dim=2)
    assert sizes[rank] == 0 or not (q_view.is_contiguous() or k_view.is_contiguous())
    out = ulysses_attention(q_view, k_view, v_view, causal=causal, seq_lens=sizes, group=timeout_group())
    backward_on_every_rank(out, dout_loc)
    dq, dk, dv = packed.grad.split([heads, kv_heads, kv_heads], dim=2)
    for name, g, r in zip(NAMES, (out, dq, dk, dv), ref_local):
        errors[f"packed-{name}"] = max_err(g, r)

    # (2) transposed: storage (B, H, S_r, D), viewed as (B, S_r, H, D).
    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q_loc, k_loc, v_loc)]
    views = [leaf.transpose(1, 2) for leaf in leaves]
    assert not any(view.is_contiguous() for view in views if view.shape[1] > 1)
    out = ulysses_attention(*views, causal=causal, seq_lens=sizes, group=timeout_group())
    backward_on_every_rank(out, dout_loc)
    for name, g, r in zip(NAMES, (out, *(leaf.grad.transpose(1, 2) for leaf in leaves)), ref_local):
        errors[f"transposed-{name}"] = max_err(g, r)

    # (3) strided head dim: (B, S_r, H, 2D)[..., ::2].
    # (B, S_r, H, D) -> (B, S_r, H, D, 2) -> (B, S_r, H, 2D); the odd elements are poison.
    leaves = [
        torch.stack([t, torch.full_like(t, 1e6)], dim=-1).flatten(-2).requires_grad_()
        for t in (q_loc, k_loc, v_loc)
    ]
    views = [leaf[..., ::2] for leaf in leaves]
    out = ulysses_attention(*views, causal=causal, seq_lens=sizes, group=timeout_group())
    backward_on_every_rank(out, dout_loc)
    for name, g, r in zip(NAMES, (out, *(leaf.grad[..., ::2] for leaf in leaves)), ref_local):
        errors[f"strided-{name}"] = max_err(g, r)
    # The skipped elements get exactly zero gradient.
    skipped = [leaf.grad[..., 1::2] for leaf in leaves]
    errors["strided-skipped-grad"] = max(max_err(grad, torch.zeros_like(grad)) for grad in skipped)
    return [("noncontiguous", errors)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_noncontiguous_inputs(ranks, causal):
    per_rank = ranks.run(run_noncontiguous, causal)
    assert all(len(results[0][1]) == 13 for results in per_rank)
    failures = _failures(per_rank, FP32_TOL)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# communication volume
# ----------------------------------------------------------------------------------


@on_every_rank
def run_comm_stats(heads, kv_heads):
    """Bytes sent by one ulysses_attention call, forward and forward + backward, with
    heads and sequence divisible by P. Returns (forward, forward+backward, local
    q+k+v+out bytes, calls forward, calls forward+backward)."""
    _, world = _rank()
    batch, head_dim, total = 2, 16, 12 * world
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, total // world, heads, head_dim, generator=gen)
    k = torch.randn(batch, total // world, kv_heads, head_dim, generator=gen)
    v = torch.randn(batch, total // world, kv_heads, head_dim, generator=gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with comm_stats() as forward:
        out = ulysses_attention(q, k, v, causal=True)
    local_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, out))
    with comm_stats() as both:
        out = ulysses_attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
    return forward.bytes_sent, both.bytes_sent, local_bytes, forward.calls, both.calls


@pytest.mark.parametrize("kv_heads", ["mha", "gqa"])
def test_comm_stats_match_formula(ranks, kv_heads):
    world = ranks.world_size
    heads = 12  # divisible by every world size tested
    # GQA with H_kv = P: each rank's q heads read exactly one kv head, kv split evenly.
    num_kv = heads if kv_heads == "mha" else world
    for rank, (forward, both, local_bytes, calls_fwd, calls_both) in enumerate(
        ranks.run(run_comm_stats, heads, num_kv)
    ):
        expected = (world - 1) * local_bytes // world
        assert (world - 1) * local_bytes % world == 0
        assert forward == expected, f"rank {rank}: forward sent {forward} B, formula {expected} B"
        assert both == 2 * expected, f"rank {rank}: fwd+bwd sent {both} B, formula {2 * expected} B"
        assert calls_fwd == 2, f"rank {rank}: {calls_fwd} collectives forward, expected 2 (qkv in one)"
        assert calls_both == 4, f"rank {rank}: {calls_both} collectives fwd+bwd, expected 4"


# GQA/MQA with fewer kv heads than ranks, kv groups split across ranks, a rank with no
# heads, uneven sequence pieces: the exact bytes, derived here from the q head split
# alone (not from the library's plan), so that a plan that sends repeated K/V, or kv
# heads a rank does not read, or misses one that it does, is caught.

EVEN4 = {world: [4] * world for world in (1, 2, 3, 4)}

COMM_GQA_CASES = [
    # P=3: q heads [3,3,2], kv head 0 serves ranks 0 and 1 (a group split across
    # ranks); P=4: 2 kv heads < 4 ranks, each kv head goes to two ranks.
    _case("gqa-8-2", H=8, H_kv=2, D=16, S=EVEN4, causal=True, B=2, dtype=torch.float32),
    # P=2: q heads [3,3] need kv {0,1} and {1,2}; P=4: q heads [2,2,1,1], kv 2 serves
    # ranks 2 and 3, 3 kv heads < 4 ranks.
    _case("gqa-6-3", H=6, H_kv=3, D=16, S=EVEN4, causal=False, B=2, dtype=torch.float32),
    # MQA: the one kv head goes to every rank; bf16 (2-byte elements).
    _case("mqa-5-1", H=5, H_kv=1, D=16, S=EVEN4, causal=True, B=2, dtype=torch.bfloat16),
    # MQA with a rank that has no q heads on P=4 (heads [1,1,1,0]): it is sent nothing.
    _case("mqa-3-1", H=3, H_kv=1, D=16, S=EVEN4, causal=False, B=1, dtype=torch.float32),
    # GQA with sequence pieces that differ by rank (one empty on P=3).
    _case("gqa-6-2-uneven", H=6, H_kv=2, D=16, S=UNEVEN, causal=True, B=2, dtype=torch.float32),
]


def q_heads_per_rank(num_heads, world):
    """The q heads rank j works on: torch.tensor_split of the heads over the ranks."""
    return [piece.tolist() for piece in torch.arange(num_heads).tensor_split(world)]


def kv_heads_needed(num_heads, num_kv_heads, world):
    """The set of kv heads each rank's q heads read (q head h reads kv head h // (H/H_kv))."""
    group_size = num_heads // num_kv_heads
    return [{head // group_size for head in heads} for heads in q_heads_per_rank(num_heads, world)]


def expected_ulysses_bytes(case, world, sizes, repeated_kv=False):
    """Per rank: (forward bytes sent, backward bytes sent) by one ulysses_attention call.

    Rank r holds S_r positions of all heads; rank j works on q heads Q_j and needs kv
    heads K_j. One (position, head) costs B*D*elem bytes. Forward:
      q/k/v out:  sum_{j != r} S_r * (|Q_j| + 2 |K_j|)
      out back:   sum_{j != r} S_j * |Q_r|
    Backward runs each all-to-all reversed, so rank r sends what it received forward:
      dout:       sum_{j != r} S_r * |Q_j|
      dq/dk/dv:   sum_{j != r} S_j * (|Q_r| + 2 |K_r|)
    repeated_kv: as an implementation that repeats K/V to H heads before the exchange
    would send (|K_j| = |Q_j|)."""
    q_counts = [len(heads) for heads in q_heads_per_rank(case["H"], world)]
    if repeated_kv:
        kv_counts = list(q_counts)
    else:
        kv_counts = [len(needed) for needed in kv_heads_needed(case["H"], case["H_kv"], world)]
    row = case["B"] * case["D"] * torch.empty((), dtype=case["dtype"]).element_size()
    forward, backward = [], []
    for r in range(world):
        others = [j for j in range(world) if j != r]
        qkv_out = sum(sizes[r] * (q_counts[j] + 2 * kv_counts[j]) for j in others)
        out_back = sum(sizes[j] * q_counts[r] for j in others)
        dout_out = sum(sizes[r] * q_counts[j] for j in others)
        dqkv_back = sum(sizes[j] * (q_counts[r] + 2 * kv_counts[r]) for j in others)
        forward.append((qkv_out + out_back) * row)
        backward.append((dout_out + dqkv_back) * row)
    return forward, backward


@on_every_rank
def run_comm_stats_gqa(cases):
    """Per case: (id, forward bytes, forward calls, backward bytes, backward calls) of
    one ulysses_attention call and its backward on this rank."""
    rank, world = _rank()
    results = []
    for case in cases:
        sizes = seq_sizes_for(case["S"], world)
        case = dict(case, S_total=sum(sizes))
        q, k, v, dout = (
            local_piece(t, sizes, rank).to(case["dtype"]).detach().clone() for t in full_inputs(case, seed=7)
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with comm_stats() as forward:
            out = ulysses_attention(q, k, v, causal=case["causal"], seq_lens=sizes, group=timeout_group())
        with comm_stats() as backward:
            backward_on_every_rank(out, dout)
        results.append((case["id"], forward.bytes_sent, forward.calls, backward.bytes_sent, backward.calls))
    return results


def test_comm_stats_gqa_kv_heads_fewer_than_ranks_match_formula(ranks):
    world = ranks.world_size
    per_rank = ranks.run(run_comm_stats_gqa, COMM_GQA_CASES)
    # The cases cover what they claim on this world size.
    needed = {case["id"]: kv_heads_needed(case["H"], case["H_kv"], world) for case in COMM_GQA_CASES}
    if world >= 3:
        assert any(case["H_kv"] < world for case in COMM_GQA_CASES)
    if world >= 2:
        # Some kv head is needed by two ranks (a GQA group split across ranks).
        assert any(
            any(len([s for s in sets if kv in s]) >= 2 for kv in range(case["H_kv"]))
            for case, sets in ((c, needed[c["id"]]) for c in COMM_GQA_CASES)
            if case["H_kv"] > 1
        )
    failures, tells_repeated_apart = [], []
    for case in COMM_GQA_CASES:
        sizes = seq_sizes_for(case["S"], world)
        forward, backward = expected_ulysses_bytes(case, world, sizes)
        repeated, _ = expected_ulysses_bytes(case, world, sizes, repeated_kv=True)
        assert all(r >= f for r, f in zip(repeated, forward)), (case["id"], repeated, forward)
        if sum(repeated) > sum(forward):
            tells_repeated_apart.append(case["id"])
        if world == 1:
            assert forward == backward == [0]
        for rank, results in enumerate(per_rank):
            (case_id, fwd, fwd_calls, bwd, bwd_calls) = results[COMM_GQA_CASES.index(case)]
            assert case_id == case["id"]
            where = f"P={world} rank {rank} {case_id} (seq {sizes}, kv heads needed {needed[case_id]})"
            if fwd != forward[rank]:
                failures.append(f"{where}: forward sent {fwd} B, formula {forward[rank]} B")
            if bwd != backward[rank]:
                failures.append(f"{where}: backward sent {bwd} B, formula {backward[rank]} B")
            if (fwd_calls, bwd_calls) != (2, 2):
                failures.append(f"{where}: {fwd_calls} + {bwd_calls} collectives, expected 2 + 2")
    assert not failures, "\n".join(failures)
    if world >= 2:
        # K/V repeated to H heads before the exchange would send more in these cases
        # (not in mqa-3-1 on P=3/4, where every rank has one q head), so the formula
        # tells the two apart and the test can fail.
        assert {"gqa-8-2", "gqa-6-3", "mqa-5-1", "gqa-6-2-uneven"} <= set(tells_repeated_apart), (
            tells_repeated_apart
        )


# ----------------------------------------------------------------------------------
# opcheck of the ops as Ulysses calls them
# ----------------------------------------------------------------------------------


class _RecordSeqparOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op, args) of every torch.ops.seqpar call, tensors cloned."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "seqpar":
            clone = lambda t: t.detach().clone()
            copied = torch.utils._pytree.tree_map_only(torch.Tensor, clone, (args, kwargs))
            self.calls.append((func, copied))
        return func(*args, **kwargs)


@on_every_rank
def run_opcheck(case):
    rank, world = _rank()
    sizes = seq_sizes_for(case["S"], world)
    case = dict(case, S_total=sum(sizes))
    q, k, v, _ = full_inputs(case)
    q, k, v = (local_piece(t, sizes, rank).float() for t in (q, k, v))
    recorder = _RecordSeqparOps()
    with recorder:
        ulysses_attention(q, k, v, causal=case["causal"], seq_lens=sizes)
    names = [func.name() for func, _ in recorder.calls]
    # Two exchanges (q, k, v out; the output back), each pack, all_to_all_single,
    # unpack, except that a side whose ranges are a tensor's own memory in order
    # skips its kernel (a rank with one local row, or one head: exchange.py).
    sequence = "".join(f"{name.removeprefix('seqpar::')} " for name in names)
    assert re.fullmatch(r"((pack_blocks )?all_to_all_single (unpack_blocks )?){2}", sequence), names
    checked = []
    for func, (args, kwargs) in recorder.calls:
        # Floating inputs require grad so that opcheck exercises the autograd formula.
        args = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.requires_grad_() if t.is_floating_point() else t, args
        )
        result = torch.library.opcheck(func, args, kwargs, raise_exception=True)
        assert all(outcome == "SUCCESS" for outcome in result.values()), (func, result)
        checked.append(func.name())
    return names, checked


@pytest.mark.parametrize(
    "case",
    [
        _case("gqa-6-2-uneven", H=6, H_kv=2, D=16, S=UNEVEN, causal=True),
    ],
    ids=lambda case: case["id"],
)
def test_opcheck_ops_as_called_by_ulysses(ranks, case):
    results = ranks.run(run_opcheck, case)
    for names, checked in results:
        assert checked == names  # opcheck ran on every op ulysses called
    assert len(results[0][0]) == 6  # rank 0 (4+ rows, 2+ heads) runs both kernels twice


# ----------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------


def _compile_backend(world_size):
    # Inductor's cold start costs about a minute per process on a 2-core machine, so
    # it runs on one world size (2: a real exchange); the others use aot_eager, which
    # still traces with dynamo (fullgraph) and AOTAutograd through the fake kernels and
    # the registered autograd of every op.
    return "inductor" if world_size == 2 else "aot_eager"


@on_every_rank
def run_compile_vs_eager(case, pass_seq_lens):
    """fullgraph torch.compile of a function around ulysses_attention vs eager, forward
    and gradients. Returns {name: max abs difference}."""
    rank, world = _rank()
    torch._dynamo.reset()
    sizes = seq_sizes_for(case["S"], world)
    case = dict(case, S_total=sum(sizes))
    q, k, v, dout = (local_piece(t, sizes, rank).float() for t in full_inputs(case, seed=4))
    group = timeout_group()
    seq_lens = sizes if pass_seq_lens else None

    def block(q, k, v):
        # Something before and after, so the graph is more than the op alone.
        out = ulysses_attention(q * 0.5, k, v, causal=case["causal"], seq_lens=seq_lens, group=group)
        return out.float() * 2.0

    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend=_compile_backend(world))):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        backward_on_every_rank(out, dout)
        results.append((out.detach(), *(leaf.grad for leaf in leaves)))
    eager, compiled = results
    return [("compile", {name: max_err(c, e) for name, c, e in zip(NAMES, compiled, eager)})]


COMPILE_CASE = _case("gqa-6-2", H=6, H_kv=2, D=16, S=8, causal=True)


def test_compile_fullgraph_matches_eager(ranks):
    # Lengths differing by rank (one empty on P=3), passed as seq_lens.
    per_rank = ranks.run(run_compile_vs_eager, dict(COMPILE_CASE, S=UNEVEN), True)
    failures = _failures(per_rank, 1e-6)
    assert not failures, "\n".join(failures)


def test_compile_fullgraph_equal_lengths_without_seq_lens(ranks):
    # Equal lengths: the documented case in which seq_lens may be left out.
    per_rank = ranks.run(run_compile_vs_eager, dict(COMPILE_CASE, S=4 * ranks.world_size), False)
    failures = _failures(per_rank, 1e-6)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# bad inputs: ValueError naming the shapes, on every rank
# ----------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def bad_input_cases(world):
    """(name, (q, k, v), kwargs, indices of the tensors whose shapes the message must name)."""
    S, Q, KV = 4, (0,), (1, 2)
    return [
        ("dtypes", (_t(1, S, 4, 16), *(_t(1, S, 4, 16, dtype=torch.float16),) * 2), {}, Q),
        ("fp64", (_t(1, S, 4, 16, dtype=torch.float64),) * 3, {}, Q),
        ("head-dims", (_t(1, S, 4, 16), _t(1, S, 4, 8), _t(1, S, 4, 8)), {}, Q + KV),
        ("head-dim>256", (_t(1, S, 2, 264),) * 3, {}, Q),
        ("H%H_kv", (_t(1, S, 5, 16), _t(1, S, 2, 16), _t(1, S, 2, 16)), {}, Q + KV),
        ("q-3d", (_t(1, S, 64), _t(1, S, 4, 16), _t(1, S, 4, 16)), {}, Q),
        ("k-5d", (_t(1, S, 4, 16), _t(1, S, 4, 16, 1), _t(1, S, 4, 16)), {}, (1,)),
        ("kv-shapes", (_t(1, S, 4, 16), _t(1, S, 2, 16), _t(1, S, 1, 16)), {}, KV),
        ("batch", (_t(2, S, 4, 16), _t(1, S, 4, 16), _t(1, S, 4, 16)), {}, Q + KV),
        ("seq", (_t(1, S, 4, 16), _t(1, S + 1, 4, 16), _t(1, S + 1, 4, 16)), {}, Q + KV),
        ("seq_lens-length", (_t(1, S, 4, 16),) * 3, {"seq_lens": [S] * (world + 1)}, Q),
        ("seq_lens-mine", (_t(1, S, 4, 16),) * 3, {"seq_lens": [S + 1] * world}, Q),
    ]


@on_every_rank
def run_bad_inputs():
    """Every bad call (the same on every rank) must raise ValueError naming the shapes;
    then ranks that disagree on shapes raise together; then a good call (default group,
    seq_lens exchanged) still matches the reference. One bad rank among good ones:
    tests/test_bad_inputs.py."""
    rank, world = _rank()
    torch.manual_seed(5)
    messages = {}
    for name, (q, k, v), kwargs, must_name in bad_input_cases(world):
        try:
            ulysses_attention(q, k, v, **kwargs)
        except ValueError as error:
            message = str(error)
        else:
            shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            raise AssertionError(f"{name}: no error for {shapes}")
        for index in must_name:
            shape = str(tuple((q, k, v)[index].shape))
            assert shape in message, f"{name}: message does not name {'qkv'[index]} {shape}: {message!r}"
        messages[name] = message

    if world > 1:
        # Ranks disagree (the last rank has 2 heads, the others 4): every rank raises
        # from the size exchange instead of some entering the all-to-all.
        heads = 2 if rank == world - 1 else 4
        q = _t(1, 4, heads, 16)
        try:
            ulysses_attention(q, q, q)
        except ValueError as error:
            messages["ranks-disagree"] = str(error)
        else:
            raise AssertionError("ranks with different head counts: no error")

    # The ranks are still in step: a good call with the default group and exchanged
    # seq_lens works and matches the reference.
    sizes = seq_sizes_for(UNEVEN, world)
    case = _case("after", H=4, H_kv=2, D=16, S=UNEVEN, causal=True, S_total=sum(sizes))
    q, k, v, _ = full_inputs(case, seed=6)
    expected = local_piece(reference_attention(q, k, v, causal=True), sizes, rank)
    out = ulysses_attention(*(local_piece(t, sizes, rank).float() for t in (q, k, v)), causal=True)
    return messages, max_err(out, expected)


def test_bad_inputs_raise_on_every_rank_then_ranks_still_work(ranks):
    per_rank = ranks.run(run_bad_inputs)
    expected_names = {name for name, *_ in bad_input_cases(ranks.world_size)}
    if ranks.world_size > 1:
        expected_names.add("ranks-disagree")
    for rank, (messages, error_after) in enumerate(per_rank):
        assert set(messages) == expected_names, (rank, sorted(messages))
        assert error_after <= FP32_TOL, f"rank {rank}: a good call afterwards is off by {error_after}"
