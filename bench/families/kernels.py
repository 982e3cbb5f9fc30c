"""The data-movement kernels alone (no collective): pack and unpack in Ulysses' q, k, v
layout, and the ring's merge of a block into the running result.

    pack    q (B, S_l, H, D), k/v (B, S_l, H_kv, D) -> one flat send buffer, per
            destination j: q heads of j, then the kv heads they read
            baseline: DeepSpeed's reshape + permute + contiguous of q, k and v (with
            yunchang's repeat of K/V when H_kv < P), one copy per tensor
    unpack  the receive buffer (per source i: q, k, v blocks (B, S_l, h, D)) -> q
            (B, S, h, D) and k/v (B, S, h_kv, D) in (B, h, S, D) memory for attention
            baseline: cat of the P received pieces along the sequence, per tensor
    merge   attention_merge_: a block's (out, lse) (out in the block's dtype) into the
            running fp32 (out, lse), in place, as every ring step does
            baseline: ring-flash-attention's merge in ATen ops (unfused_attention_merge_)

GB/s counts the bytes each kernel must read plus write (pack/unpack: 2 x the buffer;
merge: out and lse read and written, the block's out and lse read), for ours and the
baseline alike, so the two are rates of the same work. Beside them, timed in the same
rounds, a plain device copy of as many bytes (copy_gbps): the practical ceiling. On a
GPU the rate is also shown as a fraction of the spec-sheet memory bandwidth; on CPU the
reference is a measured large copy.

Runs on rank 0 alone while the other ranks wait. On CPU rank 0 keeps its share of the
cores (cores / P threads), as each rank of a P-rank job on one machine would: giving it
every core would also make its timings hostage to any other load on the machine
(OpenMP teams stall whenever one of their threads is descheduled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.families.shared.baselines import heads_to_front, repeat_kv_heads, unfused_attention_merge_
from bench.runner.cases import run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import Row, gbps, short_dtype
from bench.runner.timing import time_side_by_side
from bench.runner.verify import agreement
from seqpar_kernels.comm.plan import interleave, kv_head_ranges
from seqpar_kernels.layouts import tensor_split_ranges
from seqpar_kernels.ops import attention_merge_

# (B, S, h, D) logical, (B, h, S, D) in memory: how ulysses_attention unpacks.
HEADS_MAJOR = [0, 2, 1, 3]


@dataclass(frozen=True)
class KernelCase:
    batch: int
    local_len: int  # S_l, this rank's sequence piece
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def label(self, destinations: int) -> str:
        kind = "MHA" if self.kv_heads == self.heads else "GQA"
        dtype = short_dtype(self.dtype)
        return f"{kind} H={self.heads}/{self.kv_heads} D={self.head_dim} P={destinations} {dtype}"

    def shape(self, destinations: int) -> str:
        return (
            f"q (B,S_l,H,D)=({self.batch},{self.local_len},{self.heads},{self.head_dim}) "
            f"H_kv={self.kv_heads} P={destinations}"
        )


def cases(ctx: Context) -> list[KernelCase]:
    bf16 = torch.bfloat16
    if ctx.quick:
        return [KernelCase(1, 64, 8, 8, 16, torch.float32), KernelCase(1, 64, 8, 2, 16, bf16)]
    if ctx.on_gpu:  # hundreds of MB: far above launch overhead and the L2 cache
        return [
            KernelCase(1, 16384, 32, 32, 128, bf16),
            KernelCase(1, 16384, 32, 8, 128, bf16),
            KernelCase(2, 8192, 32, 32, 128, torch.float32),
        ]
    return [
        KernelCase(1, 2048, 16, 16, 128, bf16),
        KernelCase(1, 2048, 16, 4, 128, bf16),
        KernelCase(1, 2048, 16, 2, 128, bf16),
        KernelCase(1, 2048, 16, 16, 64, torch.float32),
    ]


SIZES = Sizes(  # the default is the full list
    quick=Size("2 tiny cases", 2),
    default=Size(
        "pack and unpack of 4 q/k/v layouts at S_l = 2048, H = 16 (MHA, GQA, fp32)",
        17,
        gpu_runs="3 layouts at S_l = 8K to 16K, H = 32, D = 128",
    ),
    full=Size("the default's cases", 17, gpu_runs="the default's cases"),
)


def destinations_for(ctx: Context) -> int:
    """The number of ranks the layout is cut for. Nothing is sent here, so a world of one
    still benches the layout of a typical node (8): packing for one destination would
    be a plain copy."""
    return ctx.world_size if ctx.world_size > 1 else 8


def supported(case: KernelCase, destinations: int) -> bool:
    """The baseline's permute needs H % P == 0 and kv heads that split or repeat evenly."""
    kv_even = case.kv_heads % destinations == 0 or destinations % case.kv_heads == 0
    return case.heads % destinations == 0 and kv_even


def measure_pack(case: KernelCase, ctx: Context, destinations: int) -> Row:
    shape_q = (case.batch, case.local_len, case.heads, case.head_dim)
    shape_kv = (case.batch, case.local_len, case.kv_heads, case.head_dim)
    q = ctx.random(shape_q, case.dtype, 0)
    k, v = ctx.random(shape_kv, case.dtype, 1), ctx.random(shape_kv, case.dtype, 2)
    q_starts, q_lengths = tensor_split_ranges(case.heads, destinations)
    kv_starts, kv_lengths = kv_head_ranges(q_starts, q_lengths, case.heads, case.kv_heads)
    starts = interleave([q_starts, kv_starts, kv_starts])
    lengths = interleave([q_lengths, kv_lengths, kv_lengths])

    def ours():
        return torch.ops.seqpar.pack_blocks([q, k, v], [2, 2, 2], starts, lengths)

    def baseline():
        kv = (repeat_kv_heads(k, destinations), repeat_kv_heads(v, destinations))
        return [heads_to_front(tensor, destinations) for tensor in (q, *kv)]

    per_destination = baseline()  # (P, B, S_l, h, D) each
    as_one_buffer = torch.cat([t[j].flatten() for j in range(destinations) for t in per_destination])
    check = agreement(ctx, [ours()], [as_one_buffer], collective=False)
    candidates = {"ours": ours, "baseline": baseline}
    return kernel_row("pack", case, ctx, destinations, candidates, as_one_buffer.numel(), check)


def measure_unpack(case: KernelCase, ctx: Context, destinations: int) -> Row:
    heads = case.heads // destinations
    kv_heads = max(case.kv_heads // destinations, 1)
    block = (destinations, case.batch, case.local_len)
    received = [  # as the baseline receives them: one (P, B, S_l, h, D) buffer per tensor
        ctx.random((*block, heads, case.head_dim), case.dtype, 0),
        ctx.random((*block, kv_heads, case.head_dim), case.dtype, 1),
        ctx.random((*block, kv_heads, case.head_dim), case.dtype, 2),
    ]
    # Ours receives one buffer: per source i, its q, k and v blocks.
    buffer = torch.cat([tensor[i].flatten() for i in range(destinations) for tensor in received])
    total_len = destinations * case.local_len
    q_shape = [case.batch, total_len, heads, case.head_dim]
    kv_shape = [case.batch, total_len, kv_heads, case.head_dim]
    seq_starts, seq_lengths = tensor_split_ranges(total_len, destinations)

    def ours():
        return torch.ops.seqpar.unpack_blocks(
            buffer, q_shape + kv_shape + kv_shape, HEADS_MAJOR * 3, [1, 1, 1],
            interleave([seq_starts] * 3), interleave([seq_lengths] * 3),
        )  # fmt: skip

    def baseline():
        return [torch.cat(tensor.unbind(0), dim=1) for tensor in received]

    check = agreement(ctx, ours(), baseline(), collective=False)
    candidates = {"ours": ours, "baseline": baseline}
    return kernel_row("unpack", case, ctx, destinations, candidates, buffer.numel(), check)


def kernel_row(bench, case, ctx, destinations, candidates, buffer_numel, check) -> Row:
    moved = 2 * buffer_numel * case.dtype.itemsize  # read once, written once
    return moving_row(ctx, candidates, moved, bench=bench, case=case.label(destinations),
                      shape=case.shape(destinations), dtype=short_dtype(case.dtype), check=check)  # fmt: skip


def moving_row(ctx: Context, candidates: dict, moved: int, **fields) -> Row:
    """The row of a data-movement kernel that reads plus writes `moved` bytes: ours and
    the baseline timed side by side with a plain device copy of as many bytes (a copy
    of moved / 2 bytes reads and writes moved)."""
    source = torch.empty(moved // 2, dtype=torch.uint8, device=ctx.device)
    target = torch.empty_like(source)
    timings = time_side_by_side({**candidates, "copy": lambda: target.copy_(source)}, ctx, collective=False)
    peak, peak_source = ctx.peak_bandwidth
    ours_gbps = gbps(moved, timings["ours"].median_s)
    return timed_row(
        ctx, timings,
        gbps_basis="bytes read + written / time", ours_gbps=ours_gbps,
        baseline_gbps=gbps(moved, timings["baseline"].median_s),
        peak_gbps=peak, peak_source=peak_source, ours_fraction_of_peak=ours_gbps / peak,
        copy_gbps=gbps(moved, timings["copy"].median_s), **fields,
    )  # fmt: skip


@dataclass(frozen=True)
class MergeCase:
    """One ring step's merge: the running out (B, S, H, D) and lse (B, H, S), fp32, take
    a block's out in `dtype` and its fp32 lse."""

    batch: int
    seqlen: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"H={self.heads} D={self.head_dim} S={self.seqlen} {short_dtype(self.dtype)} block"

    @property
    def shape(self) -> str:
        return f"out (B,S,H,D)=({self.batch},{self.seqlen},{self.heads},{self.head_dim}) fp32, lse (B,H,S) fp32"

    @property
    def bytes_moved(self) -> int:
        """out read and written (fp32), the block's out read; lse read and written, the
        block's lse read (fp32)."""
        elements, rows = self.batch * self.seqlen * self.heads * self.head_dim, self.batch * self.seqlen * self.heads
        return elements * (2 * 4 + self.dtype.itemsize) + rows * 3 * 4


def merge_cases(ctx: Context) -> list[MergeCase]:
    if ctx.quick:
        return [MergeCase(1, 64, 8, 16, torch.bfloat16)]
    if ctx.on_gpu:  # a 16K-row block of 32 heads: 256 MiB of fp32 out
        return [MergeCase(1, 16384, 32, 128, torch.bfloat16), MergeCase(1, 16384, 32, 128, torch.float32)]
    return [MergeCase(1, 2048, 16, 128, torch.bfloat16)]


# The merge's results against the baseline's: both compute the same weights in fp32, by
# different formulas (exp/log1p against sigmoid/logsigmoid): a few fp32 roundings of
# values about 1 apart, where a wrong weight would be off by 0.1 or more.
MERGE_TOLERANCE = 1e-5


def measure_merge(case: MergeCase, ctx: Context) -> Row:
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    lse_shape = (case.batch, case.heads, case.seqlen)
    out, block_out = ctx.random(shape, torch.float32, 40), ctx.random(shape, case.dtype, 41)
    lse, block_lse = ctx.random(lse_shape, torch.float32, 42), ctx.random(lse_shape, torch.float32, 43)
    # Each merges into its own running result, again at every call, as ring steps do.
    ours_state, baseline_state = [out, lse], [out.clone(), lse.clone()]

    def ours():
        attention_merge_(*ours_state, block_out, block_lse)
        return ours_state

    def baseline():
        unfused_attention_merge_(*baseline_state, block_out, block_lse)
        return baseline_state

    verdict = agreement(ctx, ours(), baseline(), MERGE_TOLERANCE, collective=False)
    check = "matches" if not verdict.startswith("MISMATCH") else verdict
    row = moving_row(ctx, {"ours": ours, "baseline": baseline}, case.bytes_moved, bench="merge",
                     case=case.label, shape=case.shape, dtype=short_dtype(case.dtype), check=check)  # fmt: skip
    row.detail = f"against the unfused merge: {verdict} (tolerance {MERGE_TOLERANCE:g})"
    return row


def run(ctx: Context) -> list[Row]:
    rows = []
    destinations = destinations_for(ctx)
    if ctx.is_root:
        for case in cases(ctx):
            if not supported(case, destinations):
                ctx.log(f"skipped {case.label(destinations)}: heads do not split evenly")
                continue
            for bench, measure in (("pack", measure_pack), ("unpack", measure_unpack)):
                rows += run_case(ctx, bench, measure, case, destinations)
        for case in merge_cases(ctx):
            rows += run_case(ctx, "merge", measure_merge, case)
    ctx.barrier()  # the other ranks wait here, leaving the cores (or GPUs) to rank 0
    return rows


FAMILY = Family(
    name="kernels",
    order=30,
    measures="the pack / unpack kernels against permute + contiguous / cat; the merge kernel against ATen ops",
    run=run,
    sizes=SIZES,
    timed_share=0.86,
    work={"float": 0.43, "half": 0.18, "host": 0.39},
)
