"""The sliding-window ring against the dense ring, side by side in one run.

Rows (bench column):
  variants        ring_attention(q, k, v, causal=True, window_size=(W - 1, 0)) forward on P
                  ranks (contiguous layout, S_l rows each): a window of W keys, the query
                  itself included, at W = S_l / 8, S_l / 2 and 2 S_l
  variants-train  the same, forward + backward
  variants-mla    multi-head latent attention: ring_attention(q, k, v, causal=True) with
                  v of head dim Dv < D (DeepSeek-V3's 192 / 128, scaled down on CPUs),
                  forward + backward; baseline: the same ring with v zero-padded to D
                  (what a kernel of one head dim needs), its out cut back to Dv

Candidates, timed interleaved:
  ours       the windowed ring: a step whose block no query of the rank sees computes
             nothing, and the ring stops after the farthest block some rank sees
             (m = ceil((W - 1) / S_l) steps: one for a window shorter than a piece)
  baseline   the dense causal ring on the same inputs (every block travels P - 1 steps)
speedup = dense / windowed. Bytes (comm_stats) against the formula (traffic.ring_bytes
with m = traffic.window_ring_steps): forward m x the local K+V bytes, backward
m x (K+V + fp32 dK+dV) more, where the dense ring sends P - 1. The MLA row: speedup =
padded / ours; bytes against traffic.ring_bytes(value_dim=Dv), the padded ring's
(value_dim=D) beside them.

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
from seqpar_kernels import comm_stats, gather_sequence, ring_attention, zigzag_gather, zigzag_split
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
    quick=Size("S_l = 16, 3 windows, forward and forward + backward; MLA D = 24 / Dv = 16", 5),
    default=Size("S_l = 512 forward, 256 forward + backward, H = 8 / 2 kv, D = 64, bf16: 3 windows each, 6 cases; "
                 "MLA S_l = 256, H = 4, D = 48 / Dv = 32, forward + backward", 62,
                 gpu_runs="S_l = 8192, H = 32 / 8 kv, D = 128, bf16: 6 cases; MLA S_l = 4096, H = 16, D = 192 / "
                 "Dv = 128"),
    full=Size("the default's cases in bf16 and fp32: 12 cases", 101, gpu_runs="the default's cases"),
)  # fmt: skip


def check(case: WindowCase, ctx: Context, full, ours_local) -> Accuracy:
    """The windowed ring's results, gathered whole, against fp64 attention with the mask."""
    gathered = [gather_sequence(tensor, 1) for tensor in ours_local]
    return check_against_fp64(case, ctx, full, gathered, case.window_size)


def check_against_fp64(case: AttentionCase, ctx: Context, full, gathered, window_size) -> Accuracy:
    """Results of the whole sequence (out[, dq, dk, dv]) against causal fp64 attention
    under window_size, by the tests' accuracy rule."""
    if not ctx.is_root:
        return Accuracy("(checked on rank 0)", "", math.nan)
    q_heads, kv_heads = checked_heads(ctx.on_gpu, case.heads, case.kv_heads)
    q, k, v, dout = full
    subset = [q[:, :, q_heads], k[:, :, kv_heads], v[:, :, kv_heads]]
    per_tensor = [q_heads, q_heads, kv_heads, kv_heads]

    def exact_in(dtype):
        fn = lambda q, k, v: reference.attention(q, k, v, True, window_size=window_size)  # noqa: E731
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
    detail = f"ring steps {steps} of {ctx.world_size - 1}; {accuracy.detail}"
    return _row(ctx, case, timings, accuracy, volume, dense_bytes.bytes_sent, detail)


def _row(ctx: Context, case: AttentionCase, timings, accuracy: Accuracy, volume, baseline_bytes: int, detail: str):
    """The Row of a case timed ours against the baseline, checked, its bytes measured."""
    return timed_row(
        ctx, timings,
        bench=case.bench, case=case.label(ctx.world_size), shape=case.shape(ctx.world_size),
        dtype=short_dtype(case.dtype), check=accuracy.check, layout=case.layout, error_vs_plain=accuracy.vs_plain,
        bytes_sent_ours=volume.measured, bytes_sent_theory=volume.theory, volume_at_theory=volume.at_theory,
        bytes_sent_baseline=baseline_bytes, detail=detail,
    )  # fmt: skip


@dataclass(frozen=True)
class MlaCase(AttentionCase):
    bench = "variants-mla"


def mla_cases(ctx: Context) -> list[MlaCase]:
    # (S_l, H, D, Dv): DeepSeek-V3's head dims on GPUs, a quarter of them on CPUs.
    if ctx.quick:
        local_len, heads, head_dim, value_dim = 16, 2, 24, 16
    elif ctx.on_gpu:
        local_len, heads, head_dim, value_dim = 4096, 16, 192, 128
    else:
        local_len, heads, head_dim, value_dim = 256, 4, 48, 32
    return [MlaCase(1, local_len, heads, heads, head_dim, torch.bfloat16, "zigzag", True, True, value_dim=value_dim)]


def measure_mla(case: MlaCase, ctx: Context) -> Row:
    full = case.full_inputs(ctx)
    q, k, v, dout = (zigzag_split(tensor, 1) for tensor in full)
    seq_lens = [q.shape[1]] * ctx.world_size

    def call(value_width):
        q_l, k_l, v_l = leaves(q, k, v)

        def run():
            padded = torch.nn.functional.pad(v_l, (0, value_width - case.v_dim))
            out = ring_attention(q_l, k_l, padded, causal=True, layout="zigzag", seq_lens=seq_lens)
            out = out[..., : case.v_dim]
            return [out.detach(), *torch.autograd.grad(out, (q_l, k_l, v_l), dout)]

        return run

    ours, padded = call(case.v_dim), call(case.head_dim)
    accuracy = check_against_fp64(case, ctx, full, [zigzag_gather(x, 1) for x in ours()], (-1, -1))
    volume = measure_volume(ctx, ours, case.ring_bytes(ctx))
    with comm_stats() as padded_bytes:
        padded()
    timings = time_side_by_side({"ours": ours, "baseline": padded}, ctx)
    detail = f"v zero-padded to D in the baseline; {accuracy.detail}"
    return _row(ctx, case, timings, accuracy, volume, padded_bytes.bytes_sent, detail)


def run(ctx: Context) -> list[Row]:
    ctx.log(BASELINE_NOTE)
    rows = [row for case in variant_cases(ctx) for row in run_case(ctx, None, measure, case)]
    return rows + [row for case in mla_cases(ctx) for row in run_case(ctx, None, measure_mla, case)]


FAMILY = Family(
    name="variants",
    order=90,
    measures="the sliding-window ring against the dense one; MLA's narrower values against padding them",
    run=run,
    sizes=SIZES,
    timed_share=0.56,
    work={"float": 0.57, "half": 0.25, "host": 0.18},
    metadata=lambda: {"variants_baseline": BASELINE_NOTE},
)
