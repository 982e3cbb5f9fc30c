"""How rows are shown and kept: the progress line printed per case, the summary table,
and the one results writer (CSV + JSON)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path

from bench.runner.rows import (
    CSV_COLUMNS,
    FAILED,
    HYBRID_BENCH,
    INFERENCE_BENCHES,
    INFERENCE_TURN_BENCH,
    LOSS_BENCH,
    MEMORY_BENCH,
    PROBE_BENCH,
    RING_ALL,
    STEP_BENCHES,
    TRANSFORMERS_BENCH,
    USP_BENCHES,
    VIDEO_BENCH,
    Row,
    is_failed,
    usp_grid_label,
)
from bench.runner.targets import Check


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


def video_line(row: Row) -> str:
    """The part of a video row's line that says how it went (progress and summary): the
    mode's time against its baseline (named in the case), the grid, the bytes."""
    return (f"{usp_grid_label(row.ulysses_degree, row.ring_degree)}: {_ms(row.ours_s)} vs {_ms(row.baseline_s)}: "
            f"x{row.speedup:.2f} (won {row.ours_faster_share:.0%} of {row.reps} rounds, noise {row.noise:.0%}); "
            f"{_sent(row)}")  # fmt: skip


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


def usp_line(row: Row) -> str:
    """The part of a USP row's line that says how it went (progress and summary): the
    speed against its baseline, what it is compared with (the first two parts of the
    detail column, bench/families/usp.py's), the bytes per group."""
    compared = "; ".join(row.detail.split("; ")[:2])
    sent = (f"Ulysses group {_bytes(row.bytes_sent_ulysses_group)} + ring group "
            f"{_bytes(row.bytes_sent_ring_group)} " + ("= theory" if row.volume_at_theory else
                                                       f"!= theory {_bytes(row.bytes_sent_theory)}"))  # fmt: skip
    parts = [f"x{row.speedup:5.2f} (won {row.ours_faster_share:4.0%}; {compared})", sent]
    if row.error_vs_plain is not None:
        parts.append(f"err {row.error_vs_plain:.1f}x plain torch's")
    return ", ".join(parts)


def _seconds(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


def loss_line(row: Row) -> str:
    """The part of a loss row's line that says how it went (progress and summary): both
    peaks and times, or the baseline's estimate where it did not run."""
    ours = (f"ours peak {_bytes(row.ours_peak_bytes)} (bound {_bytes(row.peak_bound_bytes)}), "
            f"{_seconds(row.ours_s)}")  # fmt: skip
    if row.baseline_peak_bytes is None:
        estimate = next((part for part in row.detail.split("; ") if part.startswith("materialised not run")), "")
        return f"{ours}; {estimate or 'materialised not run'}"
    return (f"{ours}; materialised peak {_bytes(row.baseline_peak_bytes)}, {_seconds(row.baseline_s)}: "
            f"memory /{row.baseline_peak_bytes / row.ours_peak_bytes:.0f}, time x{row.speedup:.2f} "
            f"(won {row.ours_faster_share:.0%} of {row.reps} rounds)")  # fmt: skip


def transformers_line(row: Row) -> str:
    """The part of a transformers row's line that says how it went (progress and summary):
    both steps' times, the ratio, the peaks."""
    return (f"{usp_grid_label(row.ulysses_degree, row.ring_degree)}: step {_seconds(row.ours_s)}, single process "
            f"{_seconds(row.baseline_s)}: x{row.speedup:.2f} (won {row.ours_faster_share:.0%} of {row.reps} "
            f"rounds, noise {row.noise:.0%}); peak {_bytes(row.ours_peak_bytes)} per rank at most, single "
            f"process {_bytes(row.baseline_peak_bytes)}")  # fmt: skip


def memory_line(row: Row) -> str:
    """The part of a memory row's line that says how it went (progress and summary):
    the peak against one rank's, or a configuration's fitted bytes per token."""
    if row.ours_peak_bytes is None:
        return row.detail
    return (f"peak {_bytes(row.ours_peak_bytes)} per rank at most, 1 rank {_bytes(row.baseline_peak_bytes)} "
            f"(/{row.baseline_peak_bytes / max(row.ours_peak_bytes, 1):.2f})")  # fmt: skip


def hybrid_line(row: Row) -> str:
    """The part of a hybrid row's line that says how it went (progress and summary): ours
    against one process, the state passing's bytes against gathering the inputs and Ulysses."""
    sent = max(row.bytes_sent_ours or 0, 1)
    return (f"{_ms(row.ours_s)} vs one process {_ms(row.baseline_s)}: x{row.speedup:.2f} (won "
            f"{row.ours_faster_share:.0%} of {row.reps} rounds, noise {row.noise:.0%}); {_sent(row)}, gathering "
            f"{_bytes(row.bytes_if_gathered)} ({row.bytes_if_gathered / sent:.1f}x), Ulysses "
            f"{_bytes(row.bytes_if_ulysses)} ({row.bytes_if_ulysses / sent:.1f}x)")  # fmt: skip


def inference_line(row: Row) -> str:
    """The part of an inference row's line that says how it went (progress and summary):
    ours against one process, the bytes a call sends, the KV cache a rank holds against
    the whole; a turn row adds what method="auto" chose (bench/families/inference.py's detail)."""
    parts = [f"{_ms(row.ours_s)} vs one process {_ms(row.baseline_s)}: x{row.speedup:.2f} (won "
             f"{row.ours_faster_share:.0%} of {row.reps} rounds, noise {row.noise:.0%})", _sent(row),
             f"KV per rank {_bytes(row.kv_bytes_per_rank)} of {_bytes(row.kv_bytes_whole)}"]  # fmt: skip
    if row.bench == INFERENCE_TURN_BENCH:
        parts += [part.split(" (")[0] for part in row.detail.split("; ") if part.startswith("auto chose")]
    return "; ".join(parts)


def progress_line(row: Row) -> str:
    """One line per case, printed as soon as it is measured."""
    if is_failed(row):
        return f"{row.bench:<16} {row.case:<32} {FAILED}: {row.detail}"
    if row.bench in RING_ALL:
        return _ring_progress_line(row)
    if row.bench == LOSS_BENCH:
        return f"{row.bench:<16} {row.case:<32} {loss_line(row)} | {row.check}"
    if row.bench == TRANSFORMERS_BENCH:
        return f"{row.bench:<16} {row.case:<32} {transformers_line(row)} | {row.check}"
    if row.bench == VIDEO_BENCH:
        return f"{row.bench:<16} {row.case:<40} {video_line(row)} | {row.check}"
    if row.bench == MEMORY_BENCH:
        return f"{row.bench:<16} {row.case:<32} {memory_line(row)} | {row.check}"
    if row.bench == HYBRID_BENCH:
        return f"{row.bench:<16} {row.case:<32} {hybrid_line(row)} | {row.check}"
    if row.bench in INFERENCE_BENCHES:
        return f"{row.bench:<17} {row.case:<32} {inference_line(row)} | {row.check}"
    if row.bench in USP_BENCHES:
        first = (f"{row.bench:<16} {row.case:<48} {_ms(row.ours_s):>11}  baseline {_ms(row.baseline_s):>11}"
                 f" (noise {row.noise:.0%}, {row.reps} rounds)")  # fmt: skip
        return " | ".join([first, usp_line(row), row.check])
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
        if row.copy_gbps is not None:
            text += f", plain copy {row.copy_gbps:.2f}"
        parts.append(text)
    parts.append(row.check)
    return " | ".join(parts)


def _ring_summary(row: Row) -> str:
    return ring_line(row) + (f"  {_sent(row)}" if row.bytes_sent_theory is not None else "")


def _usp_summary(row: Row) -> str:
    return f"{_ms(row.ours_s):>11}  {usp_line(row)}"


# The summary's sections for the benches whose rows read differently from a
# fused-vs-unfused row: (benches, heading, what a row's line says, case column width).
SUMMARY_SECTIONS = (
    (RING_ALL, "Ring (ratio = ring time / (single-device time / P): 1.0 ideal; overlap = compute-only "
     "time / ring time; serial est. = compute only / (compute only + exchange only), timed apart; "
     "probe: serial measured)", _ring_summary, 32),
    (USP_BENCHES, "USP (one row per grid U x R of the ranks, all of a case timed side by side; x = "
     "baseline time / this grid's: a hybrid's baseline is the faster pure grid, a pure grid's the "
     "other pure grid)", _usp_summary, 48),
    ((LOSS_BENCH,), "LM loss, one rank (peak = the CPU allocator's most bytes held in forward + backward; "
     "memory /n = materialised peak / ours; time x = materialised time / ours)", loss_line, 32),
    ((TRANSFORMERS_BENCH,), "transformers training step (x = single-process step time / the mode's on every "
     "rank; on CPU ranks sharing cores: total work, not a parallel speedup; check: loss and gradients "
     "against the single process)", transformers_line, 32),
    ((VIDEO_BENCH,), "video transformer call (x = baseline time / the mode's, the baseline named in the case: "
     "diffusers' context parallelism where it ran, else the single process; check: the output against the "
     "single process)", video_line, 40),
    ((MEMORY_BENCH,), "Memory per rank of a training step (peak = the allocator's most bytes held; /n = one rank's "
     "peak / this configuration's; fit: bytes per token and the longest sequence within the budget)", memory_line,
     32),
    ((HYBRID_BENCH,), "Hybrid mixers, forward + backward (x = one-process time / the mixer's on every rank; on CPU "
     "ranks sharing cores: total work; bytes per layer on rank 0: state passing, then what gathering the inputs "
     "and Ulysses would send, as multiples of it)", hybrid_line, 32),
    (INFERENCE_BENCHES, "Inference over a KV cache sharded across the ranks (x = one-process time / ours on every "
     "rank; on CPU ranks sharing cores: total work; bytes sent by rank 0 in one call (generate-decode: a step); "
     "KV per rank = the keys and values the fullest rank holds, of one process's whole cache)", inference_line, 32),
)  # fmt: skip


def summary_table(rows: list[Row], checks: list[Check]) -> str:
    lines = ["", "Summary (x = baseline time / ours: above 1 ours is faster; won = share of paired "
             "rounds in which ours was faster)"]  # fmt: skip
    failed = [row for row in rows if is_failed(row)]
    rows = [row for row in rows if not is_failed(row)]
    for row in rows:
        if (
            row.bench in RING_ALL
            or row.bench in USP_BENCHES
            or row.bench in (LOSS_BENCH, TRANSFORMERS_BENCH, VIDEO_BENCH, MEMORY_BENCH, HYBRID_BENCH)
            or row.bench in INFERENCE_BENCHES
        ):
            continue
        won = f"{row.ours_faster_share:4.0%}"
        lines.append(f"  {row.bench:<16} {row.case:<32} x{row.speedup:5.2f}  won {won}  {row.check}")
    for benches, heading, describe, width in SUMMARY_SECTIONS:
        section = [row for row in rows if row.bench in benches]
        if section:
            lines += ["", heading]
            lines += [f"  {row.bench:<16} {row.case:<{width}} {describe(row)}  {row.check}" for row in section]
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


# The run's metadata repeated on every CSV row, after the row's own columns: a CSV read
# alone still says what software and commit it measured.
RUN_COLUMNS = ("torch", "triton", "git_commit")


def write_results(rows: list[Row], checks: list[Check], metadata: dict, stem: Path) -> list[Path]:
    """Writes <stem>.csv (one row per case, then RUN_COLUMNS) and <stem>.json (run
    metadata: device, torch, Triton, git commit, world size, backend; and the targets).
    Returns the paths written. Called again after every case (bench/runner/suite.py): each call
    replaces both files whole."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = stem.with_suffix(".csv"), stem.with_suffix(".json")
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=CSV_COLUMNS + list(RUN_COLUMNS))
    writer.writeheader()
    run = {key: metadata.get(key, "") for key in RUN_COLUMNS}
    for row in rows:
        writer.writerow({**{key: _csv_value(value) for key, value in dataclasses.asdict(row).items()}, **run})
    _replace_atomically(csv_path, table.getvalue())
    document = dict(metadata, csv=csv_path.name, targets=[dataclasses.asdict(check) for check in checks])
    _replace_atomically(json_path, json.dumps(document, indent=2) + "\n")
    return [csv_path, json_path]
