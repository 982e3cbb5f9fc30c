"""Ring attention against single-device attention of the same total size.

Rows (bench column):
  ring        ring_attention(q, k, v, causal=, layout=) forward on P ranks, each holding
              S_l rows of an S = P x S_l sequence, against one device running
              torch SDPA on the whole sequence
  ring-train  the same, forward + backward (dq, dk, dv)
(The GPU step kernel and the single-GPU overlap probe have their own modules:
bench/families/ring_step.py, bench/families/ring_probe.py.)

Per ring / ring-train case, four candidates timed side by side (interleaved):
  ours           the ring
  baseline       single-device SDPA over the whole sequence (the reference). Every rank
                 runs it at once and the slowest time counts, so that each copy gets the
                 share of the machine a ring rank gets: on a CPU whose cores the P ranks
                 share (4 gloo ranks, 2 cores) timing it on one rank while the others
                 idle would hand it a whole core where a ring rank has half of one. On
                 GPUs, one per rank, that is the same as timing one GPU alone.
                 ideal ring time = reference / P; time_ratio = ring / ideal (ideal 1.0).
  compute only   the ring driver with the exchange removed (seqpar_kernels.testing's
                 ReplacedExchange("none"): every step computes on the rank's own K|V):
                 the same kernels, no transfer. overlap_efficiency = compute only / ring.
  exchange only  the ring's exchanges alone (the same Ring/DoubleBuffer calls and
                 buffers, no compute); serial_s = compute only + exchange only
                 estimates a schedule without overlap (timed apart, the parts leave
                 out the ring's step-by-step coupling of the ranks).
Bytes sent (comm_stats) against theory (traffic.ring_bytes): forward (P-1) x the local
K+V bytes; forward + backward adds (P-1) x (K+V bytes + fp32 dK+dV bytes).

check: "matches" when ours is as accurate as torch on one device: against an exact fp64
result (computed chunk by chunk, never S x S at once), ours is within the tests' accuracy
rule (tools/reference.py: at most 2x the error of torch in the same dtype, plain
attention or fused SDPA, whichever errs more, plus about a unit of roundoff at the
tensor's magnitude), for out and, in ring-train, dq, dk and dv; "MISMATCH ..."
otherwise (bench/runner/verify.py: judge_attention). error_vs_plain: the flash-attention
rule's measure (the ring tests' yardstick), ours' error / plain torch's, at most 2 by
that rule (judged in the summary, apart from check). The errors (ours, plain, SDPA) are
in the detail column. On GPU the check covers the first kv head and its group of q heads
(the exact reference of every head at S = P x 4K would take minutes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.families.shared.baselines import leaves, sdpa, single_device_attention
from bench.families.shared.ring_parts import COMPUTE_ONLY, EXCHANGE_ONLY, driver_options, run_driver
from bench.runner.cases import AttentionCase, run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import Row, short_dtype
from bench.runner.timing import time_side_by_side
from bench.runner.verify import Accuracy, checked_heads, judge_attention, measure_volume
from seqpar_kernels import ring_attention
from seqpar_kernels.comm.ring import GRAD_KV_TAG, KV_TAG, DoubleBuffer, Ring
from seqpar_kernels.engine.step_backends import AUTO, step_kernels_for
from seqpar_kernels.groups import resolve_group
from seqpar_kernels.testing import ReplacedExchange

REFERENCE_NOTE = (
    "reference = torch SDPA over the whole sequence, run by every rank at once (slowest "
    "counts) so that each copy gets the machine share a ring rank gets; ideal ring time = "
    "reference / P; ratio = ring / ideal (1.0 ideal); overlap = compute-only / ring"
)


@dataclass(frozen=True)
class RingCase(AttentionCase):
    @property
    def bench(self) -> str:
        return "ring-train" if self.backward else "ring"


def ring_cases(ctx: Context) -> list[RingCase]:
    """Contiguous full, contiguous causal, zigzag causal; MHA and GQA; bf16 (and fp32 on
    CPU); forward, then forward + backward (shorter: CPU backward is ~5x the forward).
    The default on CPU leaves out the combinations that repeat another's finding (see
    in_cpu_default); --full runs them all."""
    bf16, fp32 = torch.bfloat16, torch.float32
    layouts = [("contiguous", False), ("contiguous", True), ("zigzag", True)]
    if ctx.quick:
        return [
            RingCase(1, 16, 4, 4, 16, bf16, "contiguous", False, False),
            RingCase(1, 16, 4, 2, 16, bf16, "zigzag", True, False),
            RingCase(1, 16, 4, 4, 16, fp32, "contiguous", True, True),
            RingCase(1, 16, 4, 2, 16, bf16, "zigzag", True, True),
        ]
    if ctx.on_gpu:
        shapes = [(4096, 32, 32, 128), (4096, 32, 8, 128)]
        dtypes = [bf16]
    else:
        shapes = [(512, 8, 8, 64), (512, 8, 2, 64)]  # S = 2048 on 4 ranks
        dtypes = [bf16, fp32]
    cases = []
    for backward in (False, True):
        for dtype in dtypes:
            for local_len, heads, kv_heads, head_dim in shapes:
                if dtype == fp32 and kv_heads != heads:
                    continue  # fp32: MHA only (GQA changes nothing dtype-specific)
                if backward and not ctx.on_gpu:
                    local_len //= 2  # CPU flash backward is slow; S = 1024 on 4 ranks
                for layout, causal in layouts:
                    cases.append(RingCase(1, local_len, heads, kv_heads, head_dim, dtype,
                                          layout, causal, backward))  # fmt: skip
    if ctx.on_gpu or ctx.full:
        return cases
    return [case for case in cases if in_cpu_default(case)]


def in_cpu_default(case: RingCase) -> bool:
    """The default CPU cases: every layout of bf16 MHA, and the zigzag ring (the layout
    causal training uses, which the zigzag target judges) of every dtype and head
    count; left out: contiguous GQA and contiguous fp32, whose rows repeat the MHA bf16
    ones' layout findings (10 of the 18 cases, at the same lengths)."""
    return case.layout == "zigzag" or (case.dtype == torch.bfloat16 and case.kv_heads == case.heads)


SIZES = Sizes(
    quick=Size("S = 64: 2 forward and 2 forward + backward cases", 3),
    default=Size(
        "S = 2048 forward, 1024 forward + backward, H = 8, D = 64: bf16 MHA in every layout, "
        "zigzag GQA and fp32: 10 cases",
        229,
        gpu_runs="S_l = 4096 per rank, H = 32 (GQA: 8 kv), D = 128, bf16, every layout: 12 cases",
    ),
    full=Size(
        "the same lengths, every layout of bf16 MHA and GQA and fp32 MHA: 18 cases",
        489,
        gpu_runs="the default's 12 cases",
    ),
)


def local_rows(case: RingCase, ctx: Context) -> torch.Tensor:
    """The global row indices this rank holds, in its local order (written out here
    rather than taken from zigzag_split, so that the check does not trust the layout
    code it checks)."""
    return rows_of(ctx.rank, ctx.world_size, case.local_len, case.layout, ctx.device)


def rows_of(rank: int, world_size: int, local_len: int, layout: str, device) -> torch.Tensor:
    if layout == "contiguous":
        return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)
    half = local_len // 2  # chunks rank and 2P-1-rank of 2P
    first, second = rank, 2 * world_size - 1 - rank
    return torch.cat([torch.arange(first * half, (first + 1) * half, device=device),
                      torch.arange(second * half, (second + 1) * half, device=device)])  # fmt: skip


def gather_rows(local: torch.Tensor, case: RingCase, ctx: Context) -> torch.Tensor | None:
    """Every rank's (B, S_l, ...) piece put back in sequence order, on rank 0 (None
    elsewhere). A plain all_gather, not seqpar's gather: the check trusts no seqpar code."""
    pieces = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(pieces, local.contiguous())
    if not ctx.is_root:
        return None
    full = local.new_empty((local.shape[0], ctx.world_size * local.shape[1], *local.shape[2:]))
    for rank, piece in enumerate(pieces):
        full[:, rows_of(rank, ctx.world_size, case.local_len, case.layout, ctx.device)] = piece
    return full


def check_ring(case, ctx, full, ours_local, scale) -> Accuracy:
    """Gathers ours to rank 0 and judges it there (judge_attention)."""
    gathered = [gather_rows(tensor, case, ctx) for tensor in ours_local]
    if not ctx.is_root:
        return Accuracy("(checked on rank 0)", "", math.nan)
    sdpas = single_device_attention(*full, case.causal, case.backward)
    heads = checked_heads(ctx.on_gpu, case.heads, case.kv_heads)
    return judge_attention(gathered, sdpas, full, case.causal, scale, heads)


def exchange_only(case: RingCase, ctx: Context, group_name: str):
    """The ring's exchanges alone: the same Ring and DoubleBuffer calls on buffers of the
    same sizes, posted and waited for in the ring's order, with no compute between.
    None when there is nothing to exchange (one rank)."""
    if ctx.world_size == 1:
        return None
    kv_numel = 2 * case.batch * case.local_len * case.kv_heads * case.head_dim
    kv_buffer = torch.zeros(kv_numel, dtype=case.dtype, device=ctx.device)
    grad_buffer = torch.zeros(kv_numel, dtype=torch.float32, device=ctx.device)
    steps = ctx.world_size - 1

    def run():
        kv = DoubleBuffer(Ring(group_name, KV_TAG), kv_buffer)
        for _ in range(steps):
            kv.post()
            kv.advance()
        if case.backward:
            kv = DoubleBuffer(Ring(group_name, KV_TAG), kv_buffer)
            grads = DoubleBuffer(Ring(group_name, GRAD_KV_TAG), grad_buffer)
            for _ in range(steps):
                kv.post()
                grads.post()
                kv.advance()
                grads.advance()

    return run


def measure_ring(case: RingCase, ctx: Context) -> Row:
    full = case.full_inputs(ctx)
    rows = local_rows(case, ctx)
    q, k, v, dout = (tensor.index_select(1, rows) for tensor in full)
    scale = 1.0 / math.sqrt(case.head_dim)

    if case.backward:
        q_l, k_l, v_l = leaves(q, k, v)
        q_f, k_f, v_f = leaves(*full[:3])
        dout_f = full[3]

        def ours():
            out = ring_attention(q_l, k_l, v_l, causal=case.causal, layout=case.layout)
            return [out.detach(), *torch.autograd.grad(out, (q_l, k_l, v_l), dout)]

        def reference():
            out = sdpa(q_f, k_f, v_f, case.causal)
            return torch.autograd.grad(out, (q_f, k_f, v_f), dout_f)
    else:

        @torch.no_grad()
        def ours():
            return [ring_attention(q, k, v, causal=case.causal, layout=case.layout)]

        @torch.no_grad()
        def reference():
            return sdpa(*full[:3], case.causal)

    group = resolve_group(None)
    options = driver_options(q, case.causal, case.layout == "zigzag", group.name, group.world_size,
                             step_kernels_for(AUTO, q))  # fmt: skip

    def compute_only():
        return run_driver(q, k, v, dout, options, ReplacedExchange("none"), case.backward)

    accuracy = check_ring(case, ctx, full, ours(), scale)
    volume = measure_volume(ctx, ours, case.ring_bytes(ctx))
    candidates = {"ours": ours, "baseline": reference, COMPUTE_ONLY: compute_only}
    exchange = exchange_only(case, ctx, resolve_group(None).name)
    if exchange is not None:
        candidates[EXCHANGE_ONLY] = exchange
    timings = time_side_by_side(candidates, ctx)
    return ring_row(case, ctx, timings, accuracy, volume)


def ring_row(case, ctx, timings, accuracy: Accuracy, volume) -> Row:
    world_size = ctx.world_size
    ring_s, reference_s = timings["ours"].median_s, timings["baseline"].median_s
    compute_s = timings[COMPUTE_ONLY].median_s
    exchange_s = timings[EXCHANGE_ONLY].median_s if EXCHANGE_ONLY in timings else None
    ideal_s = reference_s / world_size
    passes = 2 if case.backward else 1  # the backward is a second ring pass
    return timed_row(
        ctx, timings,
        bench=case.bench, case=case.label(world_size), shape=case.shape(world_size),
        dtype=short_dtype(case.dtype), check=accuracy.check, layout=case.layout,
        error_vs_plain=accuracy.vs_plain,
        bytes_sent_ours=volume.measured, bytes_sent_theory=volume.theory,
        volume_at_theory=volume.at_theory,
        ideal_s=ideal_s, time_ratio=ring_s / ideal_s,
        compute_only_s=compute_s, exchange_only_s=exchange_s,
        overlap_efficiency=compute_s / ring_s,
        serial_s=None if exchange_s is None else compute_s + exchange_s,
        compute_per_step_s=compute_s / (passes * world_size),
        transfer_per_step_s=None if exchange_s is None else exchange_s / (passes * (world_size - 1)),
        detail=accuracy.detail,
    )  # fmt: skip


def run(ctx: Context) -> list[Row]:
    rows = []
    ctx.log(REFERENCE_NOTE)
    for case in ring_cases(ctx):
        reason = unsupported(case, ctx)
        if reason:
            ctx.log(f"skipped {case.bench} {case.label(ctx.world_size)}: {reason}")
            continue
        rows += run_case(ctx, None, measure_ring, case)
    return rows


def unsupported(case: RingCase, ctx: Context) -> str | None:
    if case.layout == "zigzag" and case.local_len % 2:
        return "zigzag needs an even local length"
    return None


FAMILY = Family(
    name="ring",
    order=40,
    measures="ring_attention on P ranks against single-device SDPA (forward; forward + backward)",
    run=run,
    sizes=SIZES,
    timed_share=0.92,
    work={"float": 0.22, "half": 0.62, "exchange": 0.01, "host": 0.15},
    metadata=lambda: {"ring_reference": REFERENCE_NOTE},
    then=("ring-probe",),
)
