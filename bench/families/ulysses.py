"""DeepSpeed-Ulysses: ulysses_attention against the unfused DeepSpeed/yunchang version.

Two measurements per case:
  ulysses           the whole forward: exchange, SDPA, exchange back
  ulysses-exchange  the same calls with attention replaced by an empty output of the
                    right shape, so only the data movement is timed (on CPU attention
                    dominates the whole forward and hides the exchange)
Bytes (comm_stats) against traffic.ulysses_bytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import torch

import seqpar_kernels.parallel.ulysses as ulysses_module
from bench.families.shared.baselines import SentBytes, unfused_ulysses_attention
from bench.runner.cases import exchange_row, run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import OURS_DEFAULT_CALL, Row, short_dtype
from bench.runner.timing import time_side_by_side
from bench.runner.verify import agreement, measure_volume
from seqpar_kernels import ulysses_attention
from seqpar_kernels.traffic import ulysses_bytes

# Largest |ours - baseline| accepted: both run SDPA on the same values, but on
# different memory layouts and head groupings, so the last bits may differ.
ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class UlyssesCase:
    batch: int
    seqlen: int  # global sequence length, split evenly over the ranks
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        kind = "MHA" if self.kv_heads == self.heads else ("MQA" if self.kv_heads == 1 else "GQA")
        return f"{kind} S={self.seqlen} H={self.heads}/{self.kv_heads} {short_dtype(self.dtype)}"

    @property
    def shape(self) -> str:
        return f"B={self.batch} S={self.seqlen} H={self.heads} H_kv={self.kv_heads} D={self.head_dim}"

    def unsupported_by_baseline(self, world_size: int) -> str | None:
        """Why the DeepSpeed-style baseline cannot run this case (it needs even splits)."""
        if self.seqlen % world_size or self.heads % world_size:
            return f"S and H must be multiples of P={world_size}"
        if self.kv_heads % world_size and world_size % self.kv_heads:
            return f"H_kv must divide or be a multiple of P={world_size}"
        return None


def attention_cases(ctx: Context) -> list[UlyssesCase]:
    """Whole-forward cases: sizes at which CPU attention takes tens of ms per rank."""
    bf16 = torch.bfloat16
    if ctx.quick:
        return [UlyssesCase(1, 64, 8, 8, 16, torch.float32), UlyssesCase(1, 64, 8, 2, 16, bf16)]
    if ctx.on_gpu:
        return [UlyssesCase(1, 32768, 32, 32, 128, bf16), UlyssesCase(1, 32768, 32, 8, 128, bf16)]
    return [
        UlyssesCase(1, 2048, 16, 16, 64, bf16),
        UlyssesCase(1, 2048, 16, 4, 64, bf16),  # one kv head per rank
        UlyssesCase(1, 2048, 16, 2, 64, bf16),  # fewer kv heads than ranks: baseline repeats K/V
        UlyssesCase(1, 1024, 16, 16, 64, torch.float32),
    ]


def exchange_cases(ctx: Context) -> list[UlyssesCase]:
    """Exchange-only cases: longer sequences, since no attention has to run."""
    bf16 = torch.bfloat16
    if ctx.quick:
        return [UlyssesCase(1, 64, 8, 2, 16, bf16)]
    if ctx.on_gpu:
        return [UlyssesCase(1, 131072, 32, 32, 128, bf16), UlyssesCase(1, 131072, 32, 8, 128, bf16)]
    return [
        UlyssesCase(1, 2048, 16, 16, 64, bf16),
        UlyssesCase(1, 8192, 16, 16, 128, bf16),
        UlyssesCase(1, 8192, 16, 4, 128, bf16),
        UlyssesCase(1, 8192, 16, 2, 128, bf16),
    ]


SIZES = Sizes(  # the default is the full list
    quick=Size("3 tiny cases", 2),
    default=Size(
        "4 attention cases at S = 2048 (fp32: 1024), H = 16, D = 64, MHA and GQA; 4 exchange-only cases up to S = 8192",
        58,
        gpu_runs="S = 32K attention, 128K exchange-only, H = 32, D = 128",
    ),
    full=Size("the default's cases", 58, gpu_runs="the default's cases"),
)


def local_qkv(case: UlyssesCase, ctx: Context) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's q (B, S/P, H, D) and k, v (B, S/P, H_kv, D)."""
    shape = (case.batch, case.seqlen // ctx.world_size, case.heads, case.head_dim)
    kv_shape = (*shape[:2], case.kv_heads, case.head_dim)
    seed = 3 * ctx.rank
    return (
        ctx.random(shape, case.dtype, seed),
        ctx.random(kv_shape, case.dtype, seed + 1),
        ctx.random(kv_shape, case.dtype, seed + 2),
    )


def forward_bytes(case: UlyssesCase, ctx: Context) -> int:
    """Bytes this rank sends in one forward (traffic.ulysses_bytes over P equal pieces):
    (P-1)/P x (q + k + v + o) bytes with H_kv a multiple of P; with fewer kv heads than
    ranks each rank gets the ones its q heads read."""
    seq_lens = [case.seqlen // ctx.world_size] * ctx.world_size
    return ulysses_bytes(
        seq_lens, ctx.rank, batch=case.batch, num_heads=case.heads, num_kv_heads=case.kv_heads,
        head_dim=case.head_dim, element_size=case.dtype.itemsize,
    ).forward  # fmt: skip


def empty_attention(q: torch.Tensor, *unused) -> torch.Tensor:
    """Stands in for attention: a fresh output of q's (B, S, h, D) shape, unfilled."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def identity_attention(q: torch.Tensor, *unused) -> torch.Tensor:
    """Stands in for attention when checking the exchange: the round trip must return q."""
    return q


@contextlib.contextmanager
def ours_attention_replaced_by(stand_in):
    """Replaces the local attention inside ulysses_attention, so that the exchanges of
    the shipped code path are timed without it (the alternative, re-assembling them
    here from the plan, would time a copy of the code rather than the code)."""
    with mock.patch.object(ulysses_module, "_local_attention", stand_in):
        yield


def measure_forward(case: UlyssesCase, ctx: Context) -> Row:
    q, k, v = local_qkv(case, ctx)
    seq_lens = [case.seqlen // ctx.world_size] * ctx.world_size
    counter = SentBytes()

    def ours():
        return ulysses_attention(q, k, v, seq_lens=seq_lens)

    def baseline():
        return unfused_ulysses_attention(q, k, v)

    check = agreement(ctx, [ours()], [unfused_ulysses_attention(q, k, v, counter)], ATOL[case.dtype])
    volume = measure_volume(ctx, ours, forward_bytes(case, ctx))
    timings = time_side_by_side({"ours": ours, "baseline": baseline}, ctx)
    return timed_row(
        ctx, timings,
        bench="ulysses", case=case.label, shape=case.shape,
        dtype=short_dtype(case.dtype), check=check,
        bytes_sent_ours=volume.measured, bytes_sent_theory=volume.theory,
        volume_at_theory=volume.at_theory, bytes_sent_baseline=counter.bytes_sent,
    )  # fmt: skip


def measure_exchange(case: UlyssesCase, ctx: Context) -> Row:
    q, k, v = local_qkv(case, ctx)
    seq_lens = [case.seqlen // ctx.world_size] * ctx.world_size
    counter = SentBytes()

    def ours():
        return ulysses_attention(q, k, v, seq_lens=seq_lens)

    def ours_default_call():
        return ulysses_attention(q, k, v)

    def baseline():
        return unfused_ulysses_attention(q, k, v, attention=empty_attention)

    with ours_attention_replaced_by(identity_attention):
        round_trip = [ours(), unfused_ulysses_attention(q, k, v, counter, attention=identity_attention)]
    check = agreement(ctx, round_trip, [q, q])
    with ours_attention_replaced_by(empty_attention):
        volume = measure_volume(ctx, ours, forward_bytes(case, ctx))
        timings = time_side_by_side({"ours": ours, "baseline": baseline, OURS_DEFAULT_CALL: ours_default_call}, ctx)
    return exchange_row(
        ctx, timings, volume, counter.bytes_sent,
        bench="ulysses-exchange", case=case.label, shape=case.shape,
        dtype=short_dtype(case.dtype), check=check,
    )  # fmt: skip


def run(ctx: Context) -> list[Row]:
    rows = []
    plan = [("ulysses", measure_forward, case) for case in attention_cases(ctx)]
    plan += [("ulysses-exchange", measure_exchange, case) for case in exchange_cases(ctx)]
    for bench, measure, case in plan:
        reason = case.unsupported_by_baseline(ctx.world_size)
        if reason:
            ctx.log(f"skipped {case.label}: {reason}")
            continue
        rows += run_case(ctx, bench, measure, case)
    return rows


FAMILY = Family(
    name="ulysses",
    order=20,
    measures="ulysses_attention against DeepSpeed-Ulysses (the whole forward; the exchange alone)",
    run=run,
    sizes=SIZES,
    timed_share=0.93,
    work={"float": 0.09, "half": 0.53, "exchange": 0.03, "host": 0.35},
)
