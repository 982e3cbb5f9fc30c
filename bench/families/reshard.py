"""The DSP switch: all_to_all_reshard against tensor_split + contiguous + cat + all_to_all.

Video-like activations x of global shape (B, T, S, C): DSP shards S during temporal
attention and T during spatial attention, and switches between the two with one
reshard. "S->T" is the switch from S-sharded to T-sharded (scatter T, gather S).
Bytes (comm_stats) against traffic.reshard_bytes: every piece of x but this rank's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.families.shared.baselines import SentBytes, unfused_reshard
from bench.runner.cases import exchange_row, run_case
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import OURS_DEFAULT_CALL, Row, short_dtype
from bench.runner.timing import time_side_by_side
from bench.runner.verify import agreement, measure_volume
from seqpar_kernels import all_to_all_reshard
from seqpar_kernels.traffic import reshard_bytes

T_DIM, S_DIM = 1, 2
DIRECTIONS = {"S->T": (T_DIM, S_DIM), "T->S": (S_DIM, T_DIM)}  # (scatter_dim, gather_dim)


@dataclass(frozen=True)
class ReshardCase:
    shape: tuple[int, int, int, int]  # global (B, T, S, C)
    direction: str  # "S->T" or "T->S"
    dtype: torch.dtype
    # The input as a slice x = qkv[..., :C] of a (B, T, S, 3C) tensor, as a fused QKV
    # projection leaves it: not contiguous. Ours reads it in place; the baseline copies
    # each piece (contiguous) before the cat that builds its send buffer.
    sliced_input: bool = False

    @property
    def label(self) -> str:
        layout = " sliced" if self.sliced_input else ""
        return f"{self.direction} {'x'.join(map(str, self.shape))} {short_dtype(self.dtype)}{layout}"


def cases(ctx: Context) -> list[ReshardCase]:
    """Global shapes: latent video (16 frames of 32x32 = 1024 tokens, C = 1152 as in
    OpenSora/Latte), at sizes whose per-rank piece takes milliseconds to tens of ms."""
    bf16, fp32 = torch.bfloat16, torch.float32
    if ctx.quick:
        return [ReshardCase((1, 4, 16, 32), "S->T", fp32), ReshardCase((1, 5, 16, 32), "T->S", bf16)]
    if ctx.on_gpu:
        return [
            ReshardCase((1, 16, 1024, 1152), "S->T", bf16),
            ReshardCase((2, 32, 4096, 1152), "S->T", bf16),
            ReshardCase((2, 32, 4096, 1152), "T->S", bf16),
            ReshardCase((2, 32, 4096, 1152), "S->T", bf16, sliced_input=True),
            ReshardCase((2, 32, 4096, 1152), "S->T", fp32),
        ]
    return [
        ReshardCase((1, 16, 256, 1152), "S->T", bf16),
        ReshardCase((1, 16, 1024, 1152), "S->T", bf16),
        ReshardCase((1, 16, 1024, 1152), "T->S", bf16),
        ReshardCase((1, 16, 1024, 1152), "S->T", bf16, sliced_input=True),
        ReshardCase((1, 16, 1024, 1152), "S->T", fp32),
        ReshardCase((1, 15, 1000, 1152), "S->T", bf16),  # T uneven over 4 ranks
    ]


SIZES = Sizes(  # the default is the full list: the family takes under a minute on CPU
    quick=Size("2 tiny cases", 1),
    default=Size(
        "6 cases of video latents (1, 16, 256 or 1024, 1152): both directions, bf16 and fp32, a sliced input, uneven T",
        31,
        gpu_runs="5 cases up to (2, 32, 4096, 1152)",
    ),
    full=Size("the default's cases", 31, gpu_runs="the default's cases"),
)


def split_sizes(total: int, world_size: int) -> list[int]:
    """torch.tensor_split's piece sizes along a dim of `total` elements."""
    return [len(piece) for piece in torch.arange(total).tensor_split(world_size)]


def local_input(case: ReshardCase, ctx: Context, gather_dim: int) -> torch.Tensor:
    """This rank's piece (B, T, S, C) of the global tensor, sharded along gather_dim."""
    shape = list(case.shape)
    shape[gather_dim] = split_sizes(shape[gather_dim], ctx.world_size)[ctx.rank]
    if case.sliced_input:
        channels = shape[-1]
        return ctx.random((*shape[:-1], 3 * channels), case.dtype, seed=ctx.rank)[..., :channels]
    return ctx.random(shape, case.dtype, seed=ctx.rank)


def measure(case: ReshardCase, ctx: Context) -> Row:
    scatter_dim, gather_dim = DIRECTIONS[case.direction]
    x = local_input(case, ctx, gather_dim)
    gather_sizes = split_sizes(case.shape[gather_dim], ctx.world_size)
    counter = SentBytes()

    def ours():
        return all_to_all_reshard(x, scatter_dim, gather_dim, gather_sizes=gather_sizes)

    def ours_default_call():
        return all_to_all_reshard(x, scatter_dim, gather_dim)

    def baseline():
        return unfused_reshard(x, scatter_dim, gather_dim, gather_sizes)

    expected = unfused_reshard(x, scatter_dim, gather_dim, gather_sizes, counter)
    check = agreement(ctx, [ours()], [expected])
    volume = measure_volume(ctx, ours, reshard_bytes(x.shape, scatter_dim, ctx.rank, ctx.world_size, x.element_size()))
    candidates = {"ours": ours, "baseline": baseline, OURS_DEFAULT_CALL: ours_default_call}
    timings = time_side_by_side(candidates, ctx)
    return exchange_row(
        ctx, timings, volume, counter.bytes_sent,
        bench="reshard", case=case.label, shape=f"(B,T,S,C)={case.shape}",
        dtype=short_dtype(case.dtype), check=check,
    )  # fmt: skip


def run(ctx: Context) -> list[Row]:
    rows = []
    for case in cases(ctx):
        rows += run_case(ctx, "reshard", measure, case)
    return rows


FAMILY = Family(
    name="reshard",
    order=10,
    measures="all_to_all_reshard against tensor_split + cat + all_to_all_single",
    run=run,
    sizes=SIZES,
    timed_share=0.93,
    work={"float": 0.16, "half": 0.25, "exchange": 0.03, "host": 0.56},
)
