"""Result rows, the progress line, the targets summary and the one results writer."""

from __future__ import annotations

import csv
import dataclasses
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
# A case where ours won fewer than this share of the paired rounds is slower beyond noise.
CLEARLY_SLOWER_SHARE = 0.25
# The timing candidate name for ours called without sizes (see Row.ours_default_call_s).
OURS_DEFAULT_CALL = "ours default call"


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


def progress_line(row: Row) -> str:
    """One line per case, printed as soon as it is measured."""
    parts = [
        f"{row.bench:<16} {row.case:<32} ours {_ms(row.ours_s):>11}  baseline {_ms(row.baseline_s):>11}"
        f"  x{row.speedup:5.2f} (ours faster in {row.ours_faster_share:4.0%} of {row.reps} rounds, "
        f"noise {row.noise:.0%})",
    ]
    if row.ours_default_call_s is not None:
        parts.append(f"default call {_ms(row.ours_default_call_s)}")
    if row.bytes_sent_theory is not None:
        verdict = "= theory" if row.volume_at_theory else f"!= theory {_bytes(row.bytes_sent_theory)}"
        parts.append(f"sent {_bytes(row.bytes_sent_ours)} {verdict}")
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


def target_checks(rows: list[Row], on_gpu: bool) -> list[Check]:
    """Issue 2's targets, judged on this run's rows (shown, never asserted)."""
    return [
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
    ]  # fmt: skip


def summary_table(rows: list[Row], checks: list[Check]) -> str:
    lines = ["", "Summary (x = baseline time / ours: above 1 ours is faster; won = share of paired "
             "rounds in which ours was faster)"]  # fmt: skip
    for row in rows:
        won = f"{row.ours_faster_share:4.0%}"
        lines.append(f"  {row.bench:<16} {row.case:<32} x{row.speedup:5.2f}  won {won}  {row.check}")
    lines += ["", "Targets"]
    width = max(len(check.target) for check in checks)
    for check in checks:
        lines.append(f"  {check.target:<{width}}  {check.status:<14} {check.detail}")
    return "\n".join(lines)


def write_results(rows: list[Row], checks: list[Check], metadata: dict, stem: Path) -> list[Path]:
    """Writes <stem>.csv (one row per case) and <stem>.json (run metadata: device, torch,
    git commit, world size, backend; and the targets). Returns the paths written."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = stem.with_suffix(".csv"), stem.with_suffix(".json")
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _csv_value(value) for key, value in dataclasses.asdict(row).items()})
    document = dict(metadata, csv=csv_path.name, targets=[dataclasses.asdict(check) for check in checks])
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    return [csv_path, json_path]
