"""Making a case's row and running a case: every benchmark's case loop calls run_case,
which measures the case (its row from timed_row or exchange_row), or records a FAILED row
when it raises, prints the progress line and hands the row to the suite at once. And the
case of the benches of sequence-parallel attention over P ranks (ring, USP)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bench.runner.context import Context
from bench.runner.results import progress_line
from bench.runner.rows import FAILED, OURS_DEFAULT_CALL, Row, gbps, short_dtype
from bench.runner.timing import Timing, share_faster
from bench.runner.verify import Volume
from seqpar_kernels.traffic import ring_bytes


def run_case(ctx: Context, bench: str | None, measure: Callable[..., Row | list[Row]], case,
             *extra) -> list[Row]:  # fmt: skip
    """The rows of one case, measure(case, ctx, *extra) (one row, or a list where a case
    measures several candidates side by side), each logged as a progress line and
    recorded (ctx.record_row). A case that raises (no cuDNN, out of memory, a Triton
    compile error) gives one FAILED row instead, named `bench` (None: the case's own
    .bench), and the bench goes on with its next case; the run exits non-zero at the
    end (bench/runner/suite.py)."""
    failed = False
    try:
        measured = measure(case, ctx, *extra)
        rows = measured if isinstance(measured, list) else [measured]
    except Exception as error:  # noqa: BLE001 - recorded, the run exits non-zero at the end
        name = bench or getattr(case, "bench", measure.__name__)
        dtype = short_dtype(case.dtype) if hasattr(case, "dtype") else ""
        row = failed_row(ctx, name, _case_text(case, "label", ctx, extra), error,
                         shape=_case_text(case, "shape", ctx, extra), dtype=dtype)  # fmt: skip
        ctx.report_failure(f"{name} {row.case}")
        rows, failed = [row], True
    if failed:
        ctx.release_memory()  # out of the except block: the traceback's frames are gone
    for row in rows:
        ctx.log(progress_line(row))
        if ctx.record_row is not None:
            ctx.record_row(row)
    return rows


def run_on_one_gpu(ctx: Context, benches: str, bench: str | None, measure: Callable[..., Row],
                   cases: Callable[[Context], list]) -> list[Row]:  # fmt: skip
    """GPU-only cases that time one GPU's kernels and streams: rank 0 runs them
    (run_case) while the other ranks wait at a barrier. On CPU nothing runs; the log
    says so, naming `benches`."""
    if not ctx.on_gpu:
        ctx.log(f"{benches}: GPU only (not run on CPU)")
        return []
    rows = [row for case in cases(ctx) for row in run_case(ctx, bench, measure, case)] if ctx.is_root else []
    ctx.barrier()
    return rows


def timed_row(ctx: Context, timings: dict[str, Timing], **fields) -> Row:
    """A Row from time_side_by_side's {"ours", "baseline"[, "ours default call"]} timings;
    fields gives the rest (bench, case, shape, dtype, bytes, GB/s ...)."""
    ours, baseline = timings["ours"], timings["baseline"]
    default_call = timings.get(OURS_DEFAULT_CALL)
    return Row(
        world_size=ctx.world_size,
        backend=ctx.backend,
        device=ctx.device_name,
        ours_s=ours.median_s,
        baseline_s=baseline.median_s,
        speedup=baseline.median_s / ours.median_s if ours.median_s > 0 else math.nan,
        ours_faster_share=share_faster(ours, baseline),
        noise=max(ours.spread, baseline.spread),
        reps=len(ours.samples_s),
        ours_default_call_s=default_call.median_s if default_call else None,
        **fields,
    )


def failed_row(ctx: Context, bench: str, case: str, error: BaseException, shape: str = "",
               dtype: str = "") -> Row:  # fmt: skip
    """The row of a case that raised: no timings, check "FAILED <error type>", the error
    message in detail. The other cases go on (run_case)."""
    message = " ".join(str(error).split())  # one line: CSV readers and the progress line
    if len(message) > 500:
        message = message[:500] + " ..."
    return Row(
        bench=bench, case=case, shape=shape, dtype=dtype, world_size=ctx.world_size,
        backend=ctx.backend, device=ctx.device_name, ours_s=math.nan, baseline_s=math.nan,
        speedup=math.nan, ours_faster_share=math.nan, noise=math.nan, reps=0,
        check=f"{FAILED} {type(error).__name__}", detail=f"{type(error).__name__}: {message}",
    )  # fmt: skip


def exchange_row(ctx: Context, timings: dict[str, Timing], volume: Volume, baseline_bytes: int, **fields) -> Row:
    """timed_row for a collective: bytes sent by ours (measure_volume's) and by the
    baseline, and the GB/s of both as bytes sent / time."""
    return timed_row(
        ctx, timings,
        bytes_sent_ours=volume.measured, bytes_sent_theory=volume.theory,
        volume_at_theory=volume.at_theory, bytes_sent_baseline=baseline_bytes,
        gbps_basis="bytes sent / time",
        ours_gbps=gbps(volume.measured, timings["ours"].median_s),
        baseline_gbps=gbps(baseline_bytes, timings["baseline"].median_s),
        **fields,
    )  # fmt: skip


def _case_text(case, attribute: str, ctx: Context, extra: tuple) -> str:
    """A case's label or shape, whether a property or a method of the case's world size
    (ring: label(P)) or of the call's extra argument (kernels: label(destinations))."""
    value = getattr(case, attribute, "")
    if callable(value):
        try:
            value = value(*extra) if extra else value(ctx.world_size)
        except Exception:  # noqa: BLE001 - only a name for a row that failed anyway
            value = ""
    return str(value)


@dataclass(frozen=True)
class AttentionCase:
    """Attention over P ranks, each holding S_l rows of a sequence of S = P x S_l (the
    sequence grows with P) in `layout`; forward, or forward + backward. A bench's
    subclass names its rows (bench)."""

    batch: int
    local_len: int  # S_l, each rank's rows; the sequence has P x S_l
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layout: str  # "contiguous" | "zigzag"
    causal: bool
    backward: bool  # forward + backward, or forward only
    # v's head dim (multi-head latent attention), None: head_dim; keyword-only, so that
    # the subclasses' own fields keep their positions.
    value_dim: int | None = field(default=None, kw_only=True)

    @property
    def v_dim(self) -> int:
        return self.value_dim or self.head_dim

    @property
    def attention(self) -> str:
        return "MHA" if self.kv_heads == self.heads else ("MQA" if self.kv_heads == 1 else "GQA")

    def label(self, world_size: int) -> str:
        mask = "causal" if self.causal else "full"
        return (f"{self.layout[:6]} {mask} {self.attention} S={world_size * self.local_len} "
                f"{short_dtype(self.dtype)}")  # fmt: skip

    def shape(self, world_size: int) -> str:
        return (f"B={self.batch} S={world_size * self.local_len} (S_l={self.local_len}) "
                f"H={self.heads} H_kv={self.kv_heads} D={self.head_dim}"
                + (f" Dv={self.value_dim}" if self.value_dim else ""))  # fmt: skip

    def full_inputs(self, ctx: Context):
        """q (B, S, H, D), k (B, S, H_kv, D), v (B, S, H_kv, Dv) and dout (B, S, H, Dv) of
        the whole sequence: the same on every rank (seeded), so that every rank can run
        the reference."""
        seqlen = ctx.world_size * self.local_len
        q_shape, out_shape = ((self.batch, seqlen, self.heads, dim) for dim in (self.head_dim, self.v_dim))
        k_shape, v_shape = ((self.batch, seqlen, self.kv_heads, dim) for dim in (self.head_dim, self.v_dim))
        return (ctx.random(q_shape, self.dtype, 10), ctx.random(k_shape, self.dtype, 11),
                ctx.random(v_shape, self.dtype, 12), ctx.random(out_shape, self.dtype, 13))  # fmt: skip

    def ring_bytes(self, ctx: Context, steps: int | None = None) -> int:
        """The bytes ring_attention sends from this rank in one timed call (forward, or
        forward + backward) over P pieces of S_l rows: traffic.ring_bytes, the ring
        stopping after `steps` (None: P-1)."""
        sent = ring_bytes([self.local_len] * ctx.world_size, ctx.rank, batch=self.batch, num_kv_heads=self.kv_heads,
                          head_dim=self.head_dim, element_size=self.dtype.itemsize, steps=steps,
                          value_dim=self.value_dim)  # fmt: skip
        return sent.sent(self.backward)
