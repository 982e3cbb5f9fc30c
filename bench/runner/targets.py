"""The targets the suite judges each run against, and the judging: target_checks gives
one Check (met / NOT MET / n/a) per target, shown in the summary and written to the JSON,
never asserted.

    every selected case ran                    no case raised
    bytes sent exactly at theory               comm_stats against each bench's formula
    ours computes what the baseline computes   no "MISMATCH" check (transformers: each mode's
                                               loss and gradients = the single process's)
    CPU: fused no slower than unfused in       in every case of the fused-vs-unfused benches,
         every case (at most the noise band)   speedup >= 1 or ours won >= CLEARLY_SLOWER_SHARE
                                               of the paired rounds (a tie within the noise)
    GPU: pack/unpack/merge                     >= GPU_BANDWIDTH_TARGET of peak memory
                                               bandwidth and >= GPU_SPEEDUP_TARGET x unfused
    ring, USP, varlen: error                   <= FLASH_RULE_FACTOR x plain torch's
    ring: zigzag                               >= ZIGZAG_IDEAL_TARGET of ideal (single device / P)
    ring: overlap efficiency                   >= OVERLAP_TARGET where step compute > transfer
    GPU: step kernel                           forward / backward >= STEP_TARGETS x SDPA's best
    loss: peak memory                          the fused loss within its bound (bench/families/loss.py)
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.runner.rows import (
    HYBRID_BENCH,
    INFERENCE_BENCHES,
    KERNEL_BENCHES,
    LOSS_BENCH,
    MEMORY_BENCH,
    RING_ALL,
    RING_BENCHES,
    SPARSE_BENCH,
    TRANSFORMERS_BENCH,
    USP_BENCHES,
    VIDEO_BENCH,
    Row,
    is_failed,
)
from tools.reference import ERROR_FACTOR

# On a GPU the pack/unpack/merge kernels should reach this fraction of the memory bandwidth
# and be this many times faster than the unfused copies.
GPU_BANDWIDTH_TARGET = 0.80
GPU_SPEEDUP_TARGET = 1.5
# Ring attention: the zigzag ring at this fraction of ideal or better ...
ZIGZAG_IDEAL_TARGET = 0.90
# ... the exchange hidden (overlap efficiency) where a step's compute outlasts its transfer ...
OVERLAP_TARGET = 0.90
# ... and the GPU step kernel at this many times the speed of SDPA's best backend.
STEP_TARGETS = {"ring-step-fwd": 0.9, "ring-step-bwd": 0.8}
# The flash-attention rule on error_vs_plain: ours errs at most this many times plain
# torch's error, the factor of the tests' accuracy rule (tools/reference.py).
FLASH_RULE_FACTOR = ERROR_FACTOR
# A case where ours won fewer than this share of the paired rounds is slower beyond noise;
# the CPU target allows a median slower than the baseline's only within that band.
CLEARLY_SLOWER_SHARE = 0.25
# bench/families/varlen.py's rows: packed documents against one dense sequence (or the balanced
# plan against the contiguous one), no unfused baseline.
VARLEN_BENCHES = tuple(f"varlen-{kind}{suffix}" for kind in ("ring", "ulysses", "usp", "layout")
                       for suffix in ("", "-train"))  # fmt: skip


@dataclass
class Check:
    target: str
    status: str  # "met", "NOT MET", or "n/a"
    detail: str


def _status(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def _count(passed: list[Row], rows: list[Row]) -> str:
    return f"{len(passed)}/{len(rows)} cases"


def _worst(rows: list[Row], key, describe) -> str:
    worst = min(rows, key=key)
    return f"worst: {worst.bench} {worst.case} {describe(worst)}"


def _volume_check(rows: list[Row]) -> Check:
    sized = [row for row in rows if row.volume_at_theory is not None]
    at_theory = [row for row in sized if row.volume_at_theory]
    status = _status(len(at_theory) == len(sized)) if sized else "n/a"
    return Check("bytes sent exactly at theory", status, _count(at_theory, sized))


def _agreement_check(rows: list[Row]) -> Check:
    agree = [row for row in rows if not row.check.startswith("MISMATCH")]
    target = "ours computes what the baseline computes"
    return Check(target, _status(len(agree) == len(rows)), _count(agree, rows))


def _clearly_slower(row: Row) -> bool:
    """Ours slower beyond the noise band: a slower median, and the paired rounds agree."""
    return row.speedup < 1.0 and row.ours_faster_share < CLEARLY_SLOWER_SHARE


def _cpu_speed_check(rows: list[Row], on_gpu: bool) -> Check:
    target = "CPU: fused no slower than unfused in every case (at most the noise band)"
    if on_gpu:
        return Check(target, "n/a (GPU run)", "")
    # No unfused baseline in the ring's, USP's and varlen's rows; the loss rows' target
    # is memory (their baseline does not run at every size); the transformers rows
    # compare a whole training step with one process's, not fused with unfused (and the
    # video rows a transformer's call with another library's or one process's, and the
    # hybrid rows a mixer on P ranks with one process's, the inference rows a sharded KV
    # cache with one process's whole one, the sparse rows two exchanges, whose winner
    # depends on S_r x topk against T); the memory rows' times are one step each, not
    # timings.
    excluded = (RING_ALL + USP_BENCHES + VARLEN_BENCHES + INFERENCE_BENCHES
                + (LOSS_BENCH, TRANSFORMERS_BENCH, VIDEO_BENCH, MEMORY_BENCH, HYBRID_BENCH, SPARSE_BENCH))  # fmt: skip
    rows = [row for row in rows if row.bench not in excluded]
    if not rows:
        return Check(target, "n/a (not run)", "")
    not_slower = [row for row in rows if row.speedup >= 1.0]
    clearly_slower = [row for row in rows if _clearly_slower(row)]
    detail = (
        f"{_count(not_slower, rows)} at x1 or above; {len(clearly_slower)} clearly slower (a slower "
        f"median and ours faster in < {CLEARLY_SLOWER_SHARE:.0%} of rounds); "
        + _worst(rows, lambda row: row.speedup,
                 lambda row: f"x{row.speedup:.2f} (won {row.ours_faster_share:.0%})")
    )  # fmt: skip
    return Check(target, _status(not clearly_slower), detail)


def _gpu_kernel_check(rows: list[Row], on_gpu: bool, target: str, key, goal: float, describe) -> Check:
    kernels = [row for row in rows if row.bench in KERNEL_BENCHES]
    if not on_gpu:
        return Check(target, "n/a (no GPU)", "")
    if not kernels:
        return Check(target, "n/a (kernels not run)", "")
    met = [row for row in kernels if key(row) >= goal]
    detail = f"{_count(met, kernels)}; " + _worst(kernels, key, describe)
    return Check(target, _status(len(met) == len(kernels)), detail)


def _zigzag_check(rows: list[Row]) -> Check:
    target = f"ring: zigzag >= {ZIGZAG_IDEAL_TARGET:.0%} of ideal (single device / P)"
    zigzag = [row for row in rows if row.bench in RING_BENCHES and row.layout == "zigzag"]
    if not zigzag:
        return Check(target, "n/a (ring not run)", "")
    if all(row.world_size == 1 for row in zigzag):
        # One rank: no ring, no exchange; the row compares the step kernel with SDPA.
        speed = lambda row: 1 / row.time_ratio  # noqa: E731
        worst = _worst(zigzag, speed, lambda row: f"ring on one rank at {speed(row):.0%} of SDPA's speed")
        return Check(target, "n/a (world size 1)", f"not judged; {worst}")
    met = [row for row in zigzag if 1 / row.time_ratio >= ZIGZAG_IDEAL_TARGET]
    detail = f"{_count(met, zigzag)}; " + _worst(
        zigzag, lambda row: 1 / row.time_ratio, lambda row: f"{1 / row.time_ratio:.0%} of ideal"
    )
    return Check(target, _status(len(met) == len(zigzag)), detail)


def _flash_rule_check(rows: list[Row]) -> Check:
    target = f"ring, USP, varlen: error <= {FLASH_RULE_FACTOR:g}x plain torch's (flash-attention rule)"
    judged = [row for row in rows if row.error_vs_plain is not None]
    if not judged:
        return Check(target, "n/a (ring, USP, varlen not run)", "")
    met = [row for row in judged if row.error_vs_plain <= FLASH_RULE_FACTOR]
    detail = f"{_count(met, judged)}; " + _worst(
        judged, lambda row: -row.error_vs_plain, lambda row: f"{row.error_vs_plain:.1f}x"
    )
    return Check(target, _status(len(met) == len(judged)), detail)


def _overlap_check(rows: list[Row]) -> Check:
    target = f"ring: overlap efficiency >= {OVERLAP_TARGET} where step compute > transfer"
    timed = [row for row in rows if None not in (row.overlap_efficiency, row.transfer_per_step_s)]
    judged = [row for row in timed if row.compute_per_step_s > row.transfer_per_step_s]
    if not judged:
        ran = any(row.bench in RING_ALL for row in rows)
        reason = "no such case" if timed else ("no exchange timed" if ran else "ring not run")
        return Check(target, f"n/a ({reason})", "")
    met = [row for row in judged if row.overlap_efficiency >= OVERLAP_TARGET]
    detail = f"{_count(met, judged)} ({len(timed) - len(judged)} with transfer >= compute not judged); "
    efficiency = lambda row: row.overlap_efficiency  # noqa: E731
    detail += _worst(judged, efficiency, lambda row: f"{row.overlap_efficiency:.2f}")
    return Check(target, _status(len(met) == len(judged)), detail)


def _step_check(rows: list[Row], on_gpu: bool, bench: str) -> Check:
    goal = STEP_TARGETS[bench]
    direction = "forward" if bench.endswith("fwd") else "backward"
    target = f"GPU: step kernel {direction} >= {goal}x SDPA's best backend"
    steps = [row for row in rows if row.bench == bench]
    if not on_gpu:
        return Check(target, "n/a (no GPU)", "")
    if not steps:
        return Check(target, "n/a (not run)", "")
    met = [row for row in steps if row.speedup >= goal]
    detail = f"{_count(met, steps)}; "
    detail += _worst(steps, lambda row: row.speedup, lambda row: f"x{row.speedup:.2f}")
    return Check(target, _status(len(met) == len(steps)), detail)


def _loss_memory_check(rows: list[Row]) -> Check:
    target = "loss: fused peak memory within its bound (2 chunks of fp32 logits + gradients)"
    losses = [row for row in rows if row.bench == LOSS_BENCH]
    if not losses:
        return Check(target, "n/a (loss not run)", "")
    met = [row for row in losses if row.ours_peak_bytes <= row.peak_bound_bytes]
    detail = f"{_count(met, losses)}; " + _worst(
        losses, lambda row: -row.ours_peak_bytes / row.peak_bound_bytes,
        lambda row: f"{row.ours_peak_bytes / row.peak_bound_bytes:.0%} of its bound",
    )  # fmt: skip
    return Check(target, _status(len(met) == len(losses)), detail)


def _completion_check(rows: list[Row]) -> Check:
    failed = [row for row in rows if is_failed(row)]
    detail = f"{len(rows) - len(failed)}/{len(rows)} cases ran"
    if failed:
        detail += "; failed: " + ", ".join(f"{row.bench} {row.case}" for row in failed)
    return Check("every selected case ran (no exception)", _status(not failed), detail)


def target_checks(rows: list[Row], on_gpu: bool) -> list[Check]:
    """Every target, judged on this run's rows (shown, never asserted). Failed cases
    count only in the first check: the others judge the cases that ran."""
    completion = _completion_check(rows)
    rows = [row for row in rows if not is_failed(row)]
    return [
        completion,
        _volume_check(rows),
        _agreement_check(rows),
        _cpu_speed_check(rows, on_gpu),
        _gpu_kernel_check(
            rows, on_gpu, f"GPU: pack/unpack/merge >= {GPU_BANDWIDTH_TARGET:.0%} of peak bandwidth",
            lambda row: row.ours_fraction_of_peak or 0.0, GPU_BANDWIDTH_TARGET,
            lambda row: f"{row.ours_fraction_of_peak or 0.0:.0%} of peak",
        ),
        _gpu_kernel_check(
            rows, on_gpu, f"GPU: pack/unpack/merge >= {GPU_SPEEDUP_TARGET}x unfused",
            lambda row: row.speedup, GPU_SPEEDUP_TARGET, lambda row: f"x{row.speedup:.2f}",
        ),
        _flash_rule_check(rows),
        _zigzag_check(rows),
        _overlap_check(rows),
        _step_check(rows, on_gpu, "ring-step-fwd"),
        _step_check(rows, on_gpu, "ring-step-bwd"),
        _loss_memory_check(rows),
    ]  # fmt: skip
