"""The sliding-window ring against the dense ring, side by side in one run.

Rows (bench column):
  variants        ring_attention(q, k, v, causal=True, window_size=(W - 1, 0)) forward on P
                  ranks (contiguous layout, S_l rows each): a window of W keys, the query
                  itself included, at W = S_l / 8, S_l / 2 and 2 S_l
  variants-train  the same, forward + backward

Candidates, timed interleaved:
  ours       the windowed ring: a step whose block no query of the rank sees computes
             nothing, and the ring stops after the farthest block some rank sees
             (m = ceil((W - 1) / S_l) steps: one for a window shorter than a piece)
  baseline   the dense causal ring on the same inputs (every block travels P - 1 steps)
speedup = dense / windowed. Bytes (comm_stats) against the formula (traffic.ring_bytes
with m = traffic.window_ring_steps): forward m x the local K+V bytes, backward
m x (K+V + fp32 dK+dV) more, where the dense ring sends P - 1.

check: the windowed ring's out (and gradients) against attention written out in fp64
with the window's mask, by the tests' accuracy rule (tools/reference.py) with plain
attention in the same dtype as the yardstick (on GPU: the first kv head's group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bench.families.shared.baselines import leaves
from bench.runner.cases import AttentionCase, run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import Row, short_dtype
from bench.runner.timing import time_side_by_side
from bench.runner.verify import Accuracy, checked_heads, measure_volume, within_error_rule
from seqpar_kernels import comm_stats, gather_sequence, ring_attention
from seqpar_kernels.traffic import window_ring_steps
from tools import reference

BASELINE_NOTE = "baseline = the dense causal ring on the same inputs; speedup = dense / windowed"
# The windows, in units of a rank's piece S_l.
WINDOW_PIECES = (1 / 8, 1 / 2, 2)


@dataclass(frozen=True)
class WindowCase(AttentionCase):
    window: int = 1  # W keys, the query itself included

    @property
    def bench(self) -> str:
        return "variants-train" if self.backward else "variants"

    def label(self, world_size: int) -> str:
        return f"window {self.window} ({self.window / self.local_len:g} S_l) {super().label(world_size)}"

    @property
    def window_size(self) -> tuple[int, int]:
        return (self.window - 1, 0)


def variant_cases(ctx: Context) -> list[WindowCase]:
    bf16 = torch.bfloat16
    if ctx.quick:
        shapes, dtypes = [(16, 4, 2, 16)], [bf16]
    elif ctx.on_gpu:
        shapes, dtypes = [(8192, 32, 8, 128)], [bf16]
    else:
        shapes, dtypes = [(512, 8, 2, 64)], [bf16, torch.float32] if ctx.full else [bf16]
    cases = []
    for backward in (False, True):
        for dtype in dtypes:
            for local_len, heads, kv_heads, head_dim in shapes:
                if backward and not ctx.on_gpu:
                    local_len //= 2  # CPU backward is slow
                for pieces in WINDOW_PIECES:
                    window = max(1, int(pieces * local_len))
                    cases.append(WindowCase(1, local_len, heads, kv_heads, head_dim, dtype, "contiguous", True,
                                            backward, window))  # fmt: skip
    return cases


SIZES = Sizes(
    quick=Size("S_l = 16, 3 windows, forward and forward + backward", 8),
    default=Size("S_l = 512 forward, 256 forward + backward, H = 8 / 2 kv, D = 64, bf16: 3 windows each, 6 cases",
                 35, gpu_runs="S_l = 8192, H = 32 / 8 kv, D = 128, bf16: 6 cases"),
    full=Size("the default's cases in bf16 and fp32: 12 cases", 65, gpu_runs="the default's cases"),
)  # fmt: skip


def check(case: WindowCase, ctx: Context, full, ours_local) -> Accuracy:
    """The windowed ring's results, gathered whole, against fp64 attention with the mask."""
    gathered = [gather_sequence(tensor, 1) for tensor in ours_local]
    if not ctx.is_root:
        return Accuracy("(checked on rank 0)", "", math.nan)
    q_heads, kv_heads = checked_heads(ctx.on_gpu, case.heads, case.kv_heads)
    q, k, v, dout = full
    subset = [q[:, :, q_heads], k[:, :, kv_heads], v[:, :, kv_heads]]
    per_tensor = [q_heads, q_heads, kv_heads, kv_heads]

    def exact_in(dtype):
        fn = lambda q, k, v: reference.attention(q, k, v, True, window_size=case.window_size)  # noqa: E731
        result = reference.with_grads(fn, [t.to(dtype) for t in subset], dout[:, :, q_heads].to(dtype))
        return [result[0], *result[2:]] if case.backward else [result[0]]

    exact, plain = exact_in(torch.float64), exact_in(case.dtype)
    names = ["out", "dq", "dk", "dv"][: len(exact)]
    failed, details, ratios = [], [], []
    for name, got, want, yardstick, heads in zip(names, gathered, exact, plain, per_tensor):
        got = got[:, :, heads]
        error, plain_error = reference.max_error(got, want), reference.max_error(yardstick, want)
        lse_magnitude = 0.0  # ordinary logits: the lse's rounding term is negligible
        if not within_error_rule(error, plain_error, want, lse_magnitude, case.dtype):
            failed.append(name)
        details.append(f"{name} {error:.2g} (plain {plain_error:.2g})")
        ratios.append(error / plain_error if plain_error > 0 else 0.0)
    verdict = "matches" if not failed else "MISMATCH " + ",".join(failed)
    return Accuracy(verdict, "; ".join(details), max(ratios))


def measure(case: WindowCase, ctx: Context) -> Row:
    full = case.full_inputs(ctx)
    rows = torch.arange(ctx.rank * case.local_len, (ctx.rank + 1) * case.local_len, device=ctx.device)
    q, k, v, dout = (tensor.index_select(1, rows) for tensor in full)
    seq_lens = [case.local_len] * ctx.world_size

    def call(window_size):
        if case.backward:
            q_l, k_l, v_l = leaves(q, k, v)

            def run():
                out = ring_attention(q_l, k_l, v_l, causal=True, window_size=window_size, seq_lens=seq_lens)
                return [out.detach(), *torch.autograd.grad(out, (q_l, k_l, v_l), dout)]

            return run

        @torch.no_grad()
        def run():
            return [ring_attention(q, k, v, causal=True, window_size=window_size, seq_lens=seq_lens)]

        return run

    ours, dense = call(case.window_size), call((-1, -1))
    steps = window_ring_steps(case.window_size[0], case.local_len, ctx.world_size)
    accuracy = check(case, ctx, full, ours())
    volume = measure_volume(ctx, ours, case.ring_bytes(ctx, steps))
    with comm_stats() as dense_bytes:
        dense()
    timings = time_side_by_side({"ours": ours, "baseline": dense}, ctx)
    return timed_row(
        ctx, timings,
        bench=case.bench, case=case.label(ctx.world_size), shape=case.shape(ctx.world_size),
        dtype=short_dtype(case.dtype), check=accuracy.check, layout=case.layout, error_vs_plain=accuracy.vs_plain,
        bytes_sent_ours=volume.measured, bytes_sent_theory=volume.theory, volume_at_theory=volume.at_theory,
        bytes_sent_baseline=dense_bytes.bytes_sent,
        detail=f"ring steps {steps} of {ctx.world_size - 1}; {accuracy.detail}",
    )  # fmt: skip


def run(ctx: Context) -> list[Row]:
    ctx.log(BASELINE_NOTE)
    return [row for case in variant_cases(ctx) for row in run_case(ctx, None, measure, case)]


FAMILY = Family(
    name="variants",
    order=90,
    measures="the sliding-window ring against the dense one",
    run=run,
    sizes=SIZES,
    timed_share=0.45,
    metadata=lambda: {"variants_baseline": BASELINE_NOTE},
)
