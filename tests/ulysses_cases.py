"""Cases of the Ulysses tests: what a case is, the per-rank lengths, the inputs.

A case is a dict: id, H (q heads), H_kv, D, S (the sequence: an int, split as
torch.tensor_split does, or UNEVEN-style explicit lengths per world size), causal, B, and
optionally scale, seed.
"""

from __future__ import annotations

import torch

from tools import reference


def make_case(id, H, H_kv, D, S, causal, B=1, **extra):
    return dict(id=id, H=H, H_kv=H_kv, D=D, S=S, causal=causal, B=B, **extra)


# Explicit per-rank sequence lengths that differ by rank (one empty piece on P=3).
UNEVEN = {1: [7], 2: [5, 3], 3: [4, 0, 5], 4: [5, 3, 4, 1]}


def lengths_for(total_or_lengths, world_size):
    """Per-rank sequence lengths: an int is split tensor_split style; a dict maps world
    size to explicit lengths."""
    if isinstance(total_or_lengths, dict):
        lengths = list(total_or_lengths[world_size])
        assert len(lengths) == world_size
        return lengths
    return reference.even_lengths(total_or_lengths, world_size)


def full_inputs(case, dtype=torch.float64, seed=0):
    """The same full q, k, v, dout (B, S_total, heads, D) on every rank (fp64 draws, cast
    to dtype)."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, head_dim = case["B"], case["H"], case["H_kv"], case["D"]
    total = case["S_total"]
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    q = draw(batch, total, heads, head_dim)
    k = draw(batch, total, kv_heads, head_dim)
    v = draw(batch, total, kv_heads, head_dim)
    dout = draw(batch, total, heads, head_dim)
    return q, k, v, dout


def exact_with_grads(q, k, v, dout, causal, scale=None):
    """(out, dq, dk, dv) of plain attention (scores materialized) in the inputs' dtype."""
    out, _, *grads = reference.with_grads(lambda q, k, v: reference.attention(q, k, v, causal, scale), (q, k, v), dout)
    return (out, *grads)


def failures_over(per_rank, tolerance):
    """Lines for the errors above `tolerance` in per-rank lists of (case id, {name: error})."""
    failures = []
    for rank, results in enumerate(per_rank):
        for case_id, errors in results:
            for name, err in errors.items():
                if not err <= tolerance:  # also catches NaN
                    failures.append(f"rank {rank} {case_id} {name}: max err {err:.3g}")
    return failures
