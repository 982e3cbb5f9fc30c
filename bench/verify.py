"""Checks made once per case before timing: do ours and the baseline agree, and does
ours send exactly the theoretical volume. Every rank checks; the verdict covers all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from seqpar_kernels import comm_stats

from bench.context import Context


def agreement(
    ctx: Context,
    ours: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    atol: float = 0.0,
    *,
    collective: bool = True,
) -> str:
    """"identical", "max err <e>" (within atol) or "MISMATCH ...": values compared, not
    layouts. atol = 0 asks for bit-for-bit equality (pure data movement must be exact).
    collective: every rank calls this and the verdict covers all ranks' tensors;
    otherwise only this rank's."""
    shapes_match = all(a.shape == b.shape for a, b in zip(ours, expected)) and len(ours) == len(expected)
    error = float("inf")
    if shapes_match:
        error = max(
            ((a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
            for a, b in zip(ours, expected)
        )
    if collective:
        error = ctx.reduce_over_ranks(torch.tensor([error], dtype=torch.float64)).item()
    if error == 0.0:
        return "identical"
    if error <= atol:
        return f"max err {error:.1e}"
    if error == float("inf"):
        return "MISMATCH (shapes differ)"
    return f"MISMATCH max err {error:.2e} > {atol:.0e}"


@dataclass(frozen=True)
class Volume:
    """Bytes this rank (rank 0 reports) sent, from comm_stats, and the formula's value;
    at_theory holds when they are equal on every rank."""

    measured: int
    theory: int
    at_theory: bool


def measure_volume(ctx: Context, fn: Callable[[], object], theory: int) -> Volume:
    """Runs fn once under comm_stats and compares the bytes sent with `theory`."""
    with comm_stats() as stats:
        fn()
    equal = torch.tensor([int(stats.bytes_sent == theory)])
    all_equal = bool(ctx.reduce_over_ranks(equal, op=dist.ReduceOp.MIN).item())
    return Volume(stats.bytes_sent, theory, all_equal)
