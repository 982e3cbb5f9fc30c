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

import pytest
import torch
import torch.distributed as dist

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
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
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
    out = ulysses_attention(q_loc, k_loc, v_loc, causal=causal, softmax_scale=scale, seq_lens=sizes)
    out.backward(dout_loc)
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
        # H not divisible by P (5 on P=2,3,4; 6 on P=4), heads < P for H=2 on P=3,4.
        _case("H5", H=5, H_kv=5, D=64, S=12, causal=True),
        _case("H6", H=6, H_kv=6, D=64, S=12, causal=False),
        _case("H2", H=2, H_kv=2, D=64, S=8, causal=True),
        # GQA: even groups; H=8,H_kv=2 on P=3 splits a kv group across ranks.
        _case("gqa-8-2", H=8, H_kv=2, D=64, S=12, causal=True, B=2),
        _case("gqa-8-2-full", H=8, H_kv=2, D=64, S=12, causal=False),
        # GQA where groups split unevenly: H=6, H_kv=2 on P=4 -> heads [2,2,1,1].
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
        _case("D256", H=3, H_kv=1, D=256, S=8, causal=True),
    ],
}

FP32_TOL = 2e-5


@pytest.mark.parametrize("group", list(CASE_GROUPS))
def test_fp32_forward_backward_matches_fp64_reference(ranks, group):
    per_rank = ranks.run(run_cases_fp32, CASE_GROUPS[group])
    failures = []
    for rank, results in enumerate(per_rank):
        for case_id, errors in results:
            for name, err in errors.items():
                if not err <= FP32_TOL:
                    failures.append(f"rank {rank} {case_id} {name}: max err {err:.3g}")
    assert not failures, "\n".join(failures)
