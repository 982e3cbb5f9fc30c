"""Result rows, the progress line, the targets summary and the one results writer."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.timing import Timing, share_faster

if TYPE_CHECKING:
    from bench.context import Context

# On a GPU the pack/unpack kernels should reach this fraction of the memory bandwidth
# and be this many times faster than the unfused copies (issue 2's targets).
GPU_BANDWIDTH_TARGET = 0.80
GPU_SPEEDUP_TARGET = 1.5
KERNEL_BENCHES = ("pack", "unpack")
# Ring attention (issue 3's targets): the zigzag ring within 90% of ideal, the exchange
# hidden (overlap efficiency) where a step's compute outlasts its transfer, and the GPU
# step kernel against SDPA's best backend.
RING_BENCHES = ("ring", "ring-train")  # ring_attention vs single-device SDPA
STEP_BENCHES = ("ring-step-fwd", "ring-step-bwd")  # GPU: the Triton step kernel
PROBE_BENCH = "ring-probe"  # GPU: single-GPU overlap probe
RING_ALL = RING_BENCHES + STEP_BENCHES + (PROBE_BENCH,)
ZIGZAG_IDEAL_TARGET = 0.90
OVERLAP_TARGET = 0.90
STEP_TARGETS = {"ring-step-fwd": 0.9, "ring-step-bwd": 0.8}
FLASH_RULE_FACTOR = 2.0
# A case where ours won fewer than this share of the paired rounds is slower beyond noise.
CLEARLY_SLOWER_SHARE = 0.25
# The timing candidate name for ours called without sizes (see Row.ours_default_call_s).
OURS_DEFAULT_CALL = "ours default call"
# The check column of a case that raised instead of finishing (failed_row); the error
# is in the detail column.
FAILED = "FAILED"


@dataclass
class Row:
    """One case: ours and the baseline measured side by side. CSV columns in this order."""

    bench: str  # reshard | ulysses | ulysses-exchange | pack | unpack
    case: str  # short label, e.g. "S->T bf16"
    shape: str  # the case's shapes
    dtype: str
    world_size: int
    backend: str
    device: str
    ours_s: float
    baseline_s: float
    speedup: float  # baseline_s / ours_s: above 1, ours is faster
    ours_faster_share: float  # fraction of rounds in which ours beat the baseline
    noise: float  # the larger interquartile range / median of the two timings
    reps: int  # timed rounds (one call of each candidate); the medians are over these
    check: str  # do ours and the baseline agree: "identical", "max err 1e-3", "MISMATCH ..."
    # Ours as a user calls it by default, with the ranks' sizes exchanged inside the
    # call (one small extra collective); ours_s passes the sizes, as the baseline
    # implicitly does (it assumes even sizes). Empty where not measured.
    ours_default_call_s: float | None = None
    bytes_sent_ours: int | None = None  # comm_stats().bytes_sent on rank 0
    bytes_sent_theory: int | None = None  # the formula's value on rank 0
    volume_at_theory: bool | None = None  # measured == theory on every rank
    bytes_sent_baseline: int | None = None  # counted around the baseline's collectives
    gbps_basis: str = ""  # which bytes the GB/s columns divide by the time
    ours_gbps: float | None = None
    baseline_gbps: float | None = None
    peak_gbps: float | None = None  # memory bandwidth reference (kernels rows)
    peak_source: str = ""  # "spec sheet" or "measured large copy"
    ours_fraction_of_peak: float | None = None
    # Ring attention (bench_ring.py); empty elsewhere. In ring / ring-train rows ours is
    # the ring on P ranks and the baseline single-device SDPA of the whole sequence.
    layout: str = ""  # contiguous | zigzag
    ideal_s: float | None = None  # baseline_s / P: a perfectly parallel ring
    time_ratio: float | None = None  # ours_s / ideal_s: 1.0 is ideal
    compute_only_s: float | None = None  # the ring with its exchange removed
    exchange_only_s: float | None = None  # the ring's exchanges alone (probe: the copies)
    overlap_efficiency: float | None = None  # compute_only_s / ours_s
    # No overlap: compute_only_s + exchange_only_s, each timed on its own (so without the
    # ring's step-by-step coupling of the ranks); probe: measured (copy on the compute stream).
    serial_s: float | None = None
    compute_per_step_s: float | None = None  # compute_only_s / steps
    transfer_per_step_s: float | None = None  # exchange_only_s / exchanges
    ours_tflops: float | None = None  # ring-step rows: matmul FLOPs / time
    baseline_tflops: float | None = None  # SDPA's best backend
    peak_tflops: float | None = None  # spec-sheet dense bf16
    peak_tflops_source: str = ""
    ours_fraction_of_peak_tflops: float | None = None
    # Largest error / plain torch's error in the same dtype, against an exact result
    # (the flash-attention rule: at most FLASH_RULE_FACTOR).
    error_vs_plain: float | None = None
    detail: str = ""  # per-case notes: errors against the exact result, backends ...


CSV_COLUMNS = [field.name for field in dataclasses.fields(Row)]


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
    message in detail. The other cases go on (bench/suite.py)."""
    message = " ".join(str(error).split())  # one line: CSV readers and the progress line
    if len(message) > 500:
        message = message[:500] + " ..."
    return Row(
        bench=bench, case=case, shape=shape, dtype=dtype, world_size=ctx.world_size,
        backend=ctx.backend, device=ctx.device_name, ours_s=math.nan, baseline_s=math.nan,
        speedup=math.nan, ours_faster_share=math.nan, noise=math.nan, reps=0,
        check=f"{FAILED} {type(error).__name__}", detail=f"{type(error).__name__}: {message}",
    )  # fmt: skip


def is_failed(row: Row) -> bool:
    return row.check.startswith(FAILED)


def exchange_row(ctx: Context, timings: dict[str, Timing], volume, baseline_bytes: int, **fields) -> Row:
    """timed_row for a collective: bytes sent by ours (a verify.Volume) and by the
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


def short_dtype(dtype) -> str:
    """torch.bfloat16 -> "bf16", as the case labels spell dtypes."""
    names = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
    name = str(dtype).removeprefix("torch.")
    return names.get(name, name)


def gbps(num_bytes: int, seconds: float) -> float | None:
    """num_bytes / seconds in GB/s; None when nothing moved (world size 1 sends nothing)."""
    return num_bytes / seconds / 1e9 if num_bytes and seconds > 0 else None


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _bytes(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def _sent(row: Row) -> str:
    verdict = "= theory" if row.volume_at_theory else f"!= theory {_bytes(row.bytes_sent_theory)}"
    return f"sent {_bytes(row.bytes_sent_ours)} {verdict}"


def ring_line(row: Row) -> str:
    """The part of a ring row's line that says how it went (progress and summary)."""
    if row.bench in STEP_BENCHES:
        fraction = row.ours_fraction_of_peak_tflops
        peak = "" if fraction is None else f", {fraction:.0%} of peak"
        return (f"ours {row.ours_tflops:.3g} TFLOP/s vs SDPA best {row.baseline_tflops:.3g} "
                f"(x{row.speedup:.2f}{peak})")  # fmt: skip
    if row.bench == PROBE_BENCH:
        return (f"overlap {row.overlap_efficiency:.2f}, serial {row.compute_only_s / row.serial_s:.2f} "
                f"(compute only / time; step compute {_ms(row.compute_per_step_s)}, "
                f"copy {_ms(row.transfer_per_step_s)})")  # fmt: skip
    parts = [f"ratio {row.time_ratio:5.2f} ({1 / row.time_ratio:4.0%} of ideal)",
             f"overlap {row.overlap_efficiency:.2f}"]  # fmt: skip
    if row.serial_s is not None:
        parts.append(f"serial est. {row.compute_only_s / row.serial_s:.2f}")
    if row.error_vs_plain is not None:
        parts.append(f"err {row.error_vs_plain:.1f}x plain torch's")
    return ", ".join(parts)


def _ring_progress_line(row: Row) -> str:
    if row.bench in STEP_BENCHES or row.bench == PROBE_BENCH:
        ours, baseline = ("ours", "SDPA best") if row.bench in STEP_BENCHES else ("overlapped", "serial")
        first = f"{row.bench:<16} {row.case:<32} {ours} {_ms(row.ours_s):>11}  "
        first += f"{baseline} {_ms(row.baseline_s):>11} (noise {row.noise:.0%}, {row.reps} rounds)"
        return " | ".join([first, ring_line(row), row.check])
    parts = [
        f"{row.bench:<16} {row.case:<32} ring {_ms(row.ours_s):>11}  "
        f"single device {_ms(row.baseline_s):>11}"
        f" (ideal {_ms(row.ideal_s)}, noise {row.noise:.0%}, {row.reps} rounds)",
        ring_line(row),
        f"compute only {_ms(row.compute_only_s)}, exchange only {_ms(row.exchange_only_s)}",
    ]
    if row.bytes_sent_theory is not None:
        parts.append(_sent(row))
    parts.append(row.check)
    return " | ".join(parts)


def progress_line(row: Row) -> str:
    """One line per case, printed as soon as it is measured."""
    if is_failed(row):
        return f"{row.bench:<16} {row.case:<32} {FAILED}: {row.detail}"
    if row.bench in RING_ALL:
        return _ring_progress_line(row)
    parts = [
        f"{row.bench:<16} {row.case:<32} ours {_ms(row.ours_s):>11}  baseline {_ms(row.baseline_s):>11}"
        f"  x{row.speedup:5.2f} (ours faster in {row.ours_faster_share:4.0%} of {row.reps} rounds, "
        f"noise {row.noise:.0%})",
    ]
    if row.ours_default_call_s is not None:
        parts.append(f"default call {_ms(row.ours_default_call_s)}")
    if row.bytes_sent_theory is not None:
        parts.append(_sent(row))
    if row.ours_gbps is not None and row.baseline_gbps is not None:
        text = f"{row.ours_gbps:.2f} vs {row.baseline_gbps:.2f} GB/s"
        if row.ours_fraction_of_peak is not None:
            text += f" ({row.ours_fraction_of_peak:.0%} of {row.peak_gbps:.0f})"
        parts.append(text)
    parts.append(row.check)
    return " | ".join(parts)


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


def _cpu_speed_check(rows: list[Row], on_gpu: bool) -> Check:
    target = "CPU: fused no slower than unfused"
    if on_gpu:
        return Check(target, "n/a (GPU run)", "")
    rows = [row for row in rows if row.bench not in RING_ALL]  # no unfused baseline there
    if not rows:
        return Check(target, "n/a (not run)", "")
    not_slower = [row for row in rows if row.speedup >= 1.0]
    clearly_slower = [row for row in rows if row.ours_faster_share < CLEARLY_SLOWER_SHARE]
    detail = (
        f"{_count(not_slower, rows)}; {len(clearly_slower)} clearly slower (ours faster in "
        f"< {CLEARLY_SLOWER_SHARE:.0%} of rounds); "
        + _worst(rows, lambda row: row.speedup, lambda row: f"x{row.speedup:.2f}")
    )
    return Check(target, _status(len(not_slower) == len(rows)), detail)


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
    target = f"ring: error <= {FLASH_RULE_FACTOR:g}x plain torch's (flash-attention rule)"
    judged = [row for row in rows if row.error_vs_plain is not None]
    if not judged:
        return Check(target, "n/a (ring not run)", "")
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


def _completion_check(rows: list[Row]) -> Check:
    failed = [row for row in rows if is_failed(row)]
    detail = f"{len(rows) - len(failed)}/{len(rows)} cases ran"
    if failed:
        detail += "; failed: " + ", ".join(f"{row.bench} {row.case}" for row in failed)
    return Check("every selected case ran (no exception)", _status(not failed), detail)


def target_checks(rows: list[Row], on_gpu: bool) -> list[Check]:
    """Issue 2's targets, judged on this run's rows (shown, never asserted). Failed
    cases count only in the first check: the others judge the cases that ran."""
    completion = _completion_check(rows)
    rows = [row for row in rows if not is_failed(row)]
    return [
        completion,
        _volume_check(rows),
        _agreement_check(rows),
        _cpu_speed_check(rows, on_gpu),
        _gpu_kernel_check(
            rows, on_gpu, f"GPU: pack/unpack >= {GPU_BANDWIDTH_TARGET:.0%} of peak bandwidth",
            lambda row: row.ours_fraction_of_peak or 0.0, GPU_BANDWIDTH_TARGET,
            lambda row: f"{row.ours_fraction_of_peak or 0.0:.0%} of peak",
        ),
        _gpu_kernel_check(
            rows, on_gpu, f"GPU: pack/unpack >= {GPU_SPEEDUP_TARGET}x unfused",
            lambda row: row.speedup, GPU_SPEEDUP_TARGET, lambda row: f"x{row.speedup:.2f}",
        ),
        _flash_rule_check(rows),
        _zigzag_check(rows),
        _overlap_check(rows),
        _step_check(rows, on_gpu, "ring-step-fwd"),
        _step_check(rows, on_gpu, "ring-step-bwd"),
    ]  # fmt: skip


def summary_table(rows: list[Row], checks: list[Check]) -> str:
    lines = ["", "Summary (x = baseline time / ours: above 1 ours is faster; won = share of paired "
             "rounds in which ours was faster)"]  # fmt: skip
    failed = [row for row in rows if is_failed(row)]
    rows = [row for row in rows if not is_failed(row)]
    for row in rows:
        if row.bench in RING_ALL:
            continue
        won = f"{row.ours_faster_share:4.0%}"
        lines.append(f"  {row.bench:<16} {row.case:<32} x{row.speedup:5.2f}  won {won}  {row.check}")
    ring = [row for row in rows if row.bench in RING_ALL]
    if ring:
        lines += ["", "Ring (ratio = ring time / (single-device time / P): 1.0 ideal; overlap = "
                  "compute-only time / ring time; serial est. = compute only / (compute only + "
                  "exchange only), timed apart; probe: serial measured)"]  # fmt: skip
        for row in ring:
            sent = f"  {_sent(row)}" if row.bytes_sent_theory is not None else ""
            lines.append(f"  {row.bench:<16} {row.case:<32} {ring_line(row)}{sent}  {row.check}")
    if failed:
        lines += ["", f"FAILED ({len(failed)} cases raised; the run goes on and exits non-zero)"]
        lines += [f"  {row.bench:<16} {row.case:<32} {row.detail}" for row in failed]
    lines += ["", "Targets"]
    width = max(len(check.target) for check in checks)
    for check in checks:
        lines.append(f"  {check.target:<{width}}  {check.status:<14} {check.detail}")
    return "\n".join(lines)


def _replace_atomically(path: Path, text: str) -> None:
    """Writes text to path through a temporary file and a rename, so that a process
    killed while writing leaves the previous version whole, never half a file."""
    staging = path.with_name(path.name + ".tmp")
    with staging.open("w", newline="") as handle:  # as given: the csv module's \r\n stay
        handle.write(text)
    staging.replace(path)


def write_results(rows: list[Row], checks: list[Check], metadata: dict, stem: Path) -> list[Path]:
    """Writes <stem>.csv (one row per case) and <stem>.json (run metadata: device, torch,
    git commit, world size, backend; and the targets). Returns the paths written. Called
    again after every case (bench/suite.py): each call replaces both files whole."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = stem.with_suffix(".csv"), stem.with_suffix(".json")
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for row in rows:
        writer.writerow({key: _csv_value(value) for key, value in dataclasses.asdict(row).items()})
    _replace_atomically(csv_path, table.getvalue())
    document = dict(metadata, csv=csv_path.name, targets=[dataclasses.asdict(check) for check in checks])
    _replace_atomically(json_path, json.dumps(document, indent=2) + "\n")
    return [csv_path, json_path]
