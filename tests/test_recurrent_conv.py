"""causal_conv1d (seqpar_kernels/parallel/recurrent.py), the short convolution of hybrid
models' mixers, sequence-parallel: against the convolution of the whole sequence in one
process (per document for packed ones), forward and backward, every layout, world sizes
1-4 and USP grids; its bytes against seqpar_kernels.traffic; bad inputs on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import pool_for
from on_ranks import on_every_rank, raises, timeout_group
from recurrent_cases import check_against_reference

from seqpar_kernels import comm_stats
from seqpar_kernels.parallel.recurrent import causal_conv1d
from seqpar_kernels.traffic import state_passing_bytes


def reference_conv(x, weight, bias, activation):
    """transformers' causal_conv1d_fn on (B, S, C) rows."""
    kernel = weight.shape[1]
    out = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=kernel - 1,
                   groups=x.shape[2])[:, :, : x.shape[1]]  # fmt: skip
    out = F.silu(out) if activation else out
    return out.transpose(1, 2).to(x.dtype)


@on_every_rank
def run_conv(dtype, kernels):
    failures = []
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(7)
    for kernel in kernels:
        for total in (4 * world + 3, max(world - 1, 1), 2):
            x = torch.randn(2, total, 5, generator=generator).to(dtype)
            weight = torch.randn(5, kernel, generator=generator).to(dtype)
            bias = torch.randn(5, generator=generator).to(dtype)
            activation = "silu" if kernel % 2 else None

            def op(x, weight, bias, **where):
                return causal_conv1d(x, weight, bias, activation=activation, **where)

            def reference(x, weight, bias):
                return reference_conv(x, weight, bias, activation)

            # bf16: the gradients add rows (and the ranks' shares) in another order: a few last-place units.
            atol, rtol = (1e-10, 0.0) if dtype == torch.float64 else (0.1, 0.02)
            failures += [
                f"K={kernel} {failure}"
                for failure in check_against_reference(
                    op, reference, [x, weight, bias], {0}, total, generator=generator, atol=atol, rtol=rtol
                )
            ]
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6], ids=lambda size: f"P{size}")
def test_matches_the_whole_sequence_convolution(world_size):
    for rank, failures in enumerate(pool_for(world_size).run(run_conv, torch.float64, (1, 2, 4))):
        assert not failures, f"rank {rank}: {failures[:6]}"


def test_bf16_within_rounding():
    for rank, failures in enumerate(pool_for(3).run(run_conv, torch.bfloat16, (4,))):
        assert not failures, f"rank {rank}: {failures[:6]}"


@on_every_rank
def run_bytes():
    """(measured forward bytes, formula) of one call on contiguous pieces."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(2, 3, 5)
    weight = torch.randn(5, 4)
    with comm_stats() as stats:
        causal_conv1d(x, weight, group=timeout_group(), seq_lens=[3] * world)
    expected = state_passing_bytes([1] * world, rank, summary_bytes=2 * 3 * 5 * 4).forward
    return stats.bytes_sent, expected


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda size: f"P{size}")
def test_bytes_are_the_runs_tails(world_size):
    for rank, (measured, expected) in enumerate(pool_for(world_size).run(run_bytes)):
        assert measured == expected, f"rank {rank}: {measured} bytes, the formula says {expected}"


@on_every_rank
def run_bad_inputs():
    problems = {}
    rank = dist.get_rank()
    group = {"group": timeout_group()}
    x, weight = torch.randn(1, 4, 3), torch.randn(3, 2)
    bad_weight = torch.randn(4, 2) if rank == 0 else weight
    problems["weight on one rank"] = raises(
        lambda: causal_conv1d(x, bad_weight, **group), "weight must be|bad input on rank"
    )
    kernel = torch.randn(3, 3 if rank == 0 else 2)
    problems["kernel differs by rank"] = raises(lambda: causal_conv1d(x, kernel, **group), "disagree")
    problems["activation"] = raises(lambda: causal_conv1d(x, weight, activation="gelu", **group), "activation")
    problems["layout"] = raises(lambda: causal_conv1d(x, weight, layout="balanced", **group), "layout")
    if dist.get_world_size() > 1:
        uneven = torch.randn(1, 4 + rank, 3)
        problems["not the zigzag layout"] = raises(lambda: causal_conv1d(uneven, weight, layout="zigzag", **group),
                                                   "zigzag")  # fmt: skip
    return {name: problem for name, problem in problems.items() if problem}


def test_bad_inputs_raise_on_every_rank():
    for rank, problems in enumerate(pool_for(3).run(run_bad_inputs)):
        assert not problems, f"rank {rank}: {problems}"
