"""(GPU) The single-GPU overlap probe: does the ring hide its exchange behind compute?

ring-probe rows: one GPU runs the ring driver as a ring of P virtual ranks (virtual rank
0), its exchange replaced (seqpar_kernels.testing's ReplacedExchange) by a
device-to-device copy of the same bytes, timed four ways side by side:
  ours           the copy on a side stream, overlapped with the step's compute
  baseline       the same copy on the compute stream: the serial schedule
  compute only   no exchange (every step computes on the GPU's own K|V)
  exchange only  the copies alone
overlap_efficiency = compute only / overlapped; the serial schedule's compute only /
serial is in the detail and the progress line. check: the three runs agree bit for bit
("identical"): a copy read before it lands would not.

Rank 0 runs the cases on its GPU while the other ranks wait; on CPU nothing runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.families.shared.ring_parts import COMPUTE_ONLY, EXCHANGE_ONLY, driver_options, run_driver
from bench.runner.cases import run_on_one_gpu, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import PROBE_BENCH, Row, short_dtype
from bench.runner.timing import time_side_by_side
from bench.runner.verify import agreement
from seqpar_kernels.comm.ring import KV_TAG, DoubleBuffer
from seqpar_kernels.engine.step_backends import AUTO, step_kernels_for
from seqpar_kernels.groups import SINGLE_PROCESS
from seqpar_kernels.testing import ReplacedExchange
from seqpar_kernels.traffic import ring_bytes


@dataclass(frozen=True)
class ProbeCase:
    local_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    steps: int  # P, virtual ranks
    layout: str
    causal: bool
    backward: bool

    @property
    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        kind = "MHA" if self.kv_heads == self.heads else "GQA"
        direction = "fwd+bwd" if self.backward else "fwd"
        return f"{self.layout[:6]} {mask} {kind} S_l={self.local_len} P={self.steps} {direction}"

    @property
    def shape(self) -> str:
        return (f"B=1 S_l={self.local_len} H={self.heads} H_kv={self.kv_heads} D={self.head_dim} "
                f"P={self.steps} virtual")  # fmt: skip


def probe_cases(ctx: Context) -> list[ProbeCase]:
    """Per step, 4K rows: compute far above the copy; 1K rows with GQA: the copy is a
    larger share (it still runs at HBM speed, faster than any link would carry it)."""
    bf16 = torch.bfloat16
    if ctx.quick:
        return [ProbeCase(256, 4, 4, 128, bf16, 4, "contiguous", False, False),
                ProbeCase(256, 4, 2, 128, bf16, 4, "zigzag", True, True)]  # fmt: skip
    return [
        ProbeCase(4096, 32, 32, 128, bf16, 8, "contiguous", False, False),
        ProbeCase(4096, 32, 32, 128, bf16, 8, "zigzag", True, False),
        ProbeCase(1024, 32, 8, 128, bf16, 8, "contiguous", False, False),
        ProbeCase(4096, 32, 32, 128, bf16, 8, "contiguous", False, True),
        ProbeCase(4096, 32, 32, 128, bf16, 8, "zigzag", True, True),
    ]


SIZES = Sizes(  # GPU only: nothing runs on CPU (the ring family's CPU line names none)
    quick=Size("", 0, gpu_runs="probe: 2 tiny rings"),
    default=Size("", 0, gpu_runs="probe: 5 rings of 8 virtual steps, S_l = 1K to 4K, H = 32, D = 128"),
    full=Size("", 0, gpu_runs="probe: the default's rings"),
)


def measure_probe(case: ProbeCase, ctx: Context) -> Row:
    """A ring of case.steps virtual ranks on this GPU alone (virtual rank 0): the ring
    driver as it runs on P GPUs, its exchange replaced (seqpar_kernels.testing's
    ReplacedExchange) by a device-to-device copy of the same bytes on a side stream ("ours"), the same
    copy on the compute stream (serial schedule: "baseline"), no exchange (compute only),
    and the copies alone (exchange only)."""
    q_shape = (1, case.local_len, case.heads, case.head_dim)
    kv_shape = (1, case.local_len, case.kv_heads, case.head_dim)
    shapes = {30: q_shape, 31: kv_shape, 32: kv_shape, 33: q_shape}
    q, k, v, dout = (ctx.random(shape, case.dtype, seed) for seed, shape in shapes.items())
    steps = case.steps
    # One process: a group of one rank acting as a ring of case.steps.
    options = driver_options(q, case.causal, case.layout == "zigzag", SINGLE_PROCESS, steps, step_kernels_for(AUTO, q))

    def ring_with(mode):
        return lambda: run_driver(q, k, v, dout, options, ReplacedExchange(mode, steps), case.backward)

    kv_numel = 2 * k.numel()
    kv_buffer = torch.zeros(kv_numel, dtype=case.dtype, device=ctx.device)
    grad_buffer = torch.zeros(kv_numel, dtype=torch.float32, device=ctx.device)

    def copies_only():
        copies = ReplacedExchange("copy", steps)
        buffers = [kv_buffer, kv_buffer, grad_buffer] if case.backward else [kv_buffer]
        for buffer in buffers:  # forward K|V; backward K|V and dK|dV
            ring = DoubleBuffer(copies(SINGLE_PROCESS, KV_TAG), buffer)
            for _ in range(steps - 1):
                ring.post()
                ring.advance()

    candidates = {"ours": ring_with("copy"), "baseline": ring_with("serial_copy"),
                  COMPUTE_ONLY: ring_with("none"), EXCHANGE_ONLY: copies_only}  # fmt: skip
    # The copies deliver this rank's own K|V, as "none" leaves it in place: out (and dq)
    # must agree bit for bit, a copy read before it lands would not; dK|dV too between
    # the two copy schedules ("none" does not carry the dK|dV accumulator at all).
    results = {name: candidates[name]() for name in ("ours", "baseline", COMPUTE_ONLY)}
    same_kv = 2 if case.backward else 1  # out, dq
    check = agreement(
        ctx, results["ours"] + results["ours"][:same_kv],
        results["baseline"] + results[COMPUTE_ONLY][:same_kv], collective=False,
    )  # fmt: skip
    timings = time_side_by_side(candidates, ctx, collective=False)
    overlapped_s, serial_s = timings["ours"].median_s, timings["baseline"].median_s
    compute_s, copies_s = timings[COMPUTE_ONLY].median_s, timings[EXCHANGE_ONLY].median_s
    passes = 2 if case.backward else 1
    # The copies carry what virtual rank 0 of the ring would send.
    copied = ring_bytes([case.local_len] * steps, 0, batch=1, num_kv_heads=case.kv_heads, head_dim=case.head_dim,
                        element_size=case.dtype.itemsize).sent(case.backward)  # fmt: skip
    detail = (f"overlapped {compute_s / overlapped_s:.2f}, serial {compute_s / serial_s:.2f} "
              f"(compute only / time); {copied / 2**20:.0f} MiB copied, "
              f"{copied / copies_s / 1e9:.0f} GB/s")  # fmt: skip
    return timed_row(
        ctx, timings,
        bench=PROBE_BENCH, case=case.label, shape=case.shape, dtype=short_dtype(case.dtype),
        check=check, layout=case.layout,
        compute_only_s=compute_s, exchange_only_s=copies_s,
        overlap_efficiency=compute_s / overlapped_s, serial_s=serial_s,
        compute_per_step_s=compute_s / (passes * steps),
        transfer_per_step_s=copies_s / (passes * (steps - 1)),
        detail=detail,
    )  # fmt: skip


def run(ctx: Context) -> list[Row]:
    return run_on_one_gpu(ctx, PROBE_BENCH, PROBE_BENCH, measure_probe, probe_cases)


FAMILY = Family(
    name="ring-probe",
    order=60,
    measures="(GPU) the single-GPU overlap probe of the ring's exchange",
    run=run,
    sizes=SIZES,
)
