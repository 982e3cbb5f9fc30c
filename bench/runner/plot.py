"""The PNG: speedup per case, and the pack/unpack/merge kernels' GB/s against the peak; for ring
attention, each case's share of the ideal and overlap efficiency, and (GPU) the step
kernel's TFLOP/s against SDPA's; for USP, each grid's time and bytes per group; for the
LM loss, the peak memory and time of ours and of materialised logits per token count; for
the transformers training step, each mode's time and per-rank peak against one process's;
for the video transformers, each mode's time against its baseline and its bytes; for memory,
each configuration's peak per rank against the sequence's length; for the hybrid mixers, each
layout's time against one process's and the bytes per layer of state passing, gathering the
inputs and Ulysses; for inference over a sharded KV cache, each case's time against one
process's, the bytes a call sends and the KV cache a rank holds against the whole."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: rank 0 may run on a headless node
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from bench.runner.rows import (  # noqa: E402
    HYBRID_BENCH,
    INFERENCE_BENCHES,
    KERNEL_BENCHES,
    LOSS_BENCH,
    MEMORY_BENCH,
    PROBE_BENCH,
    RING_BENCHES,
    STEP_BENCHES,
    STEP_TILES_BENCH,
    TRANSFORMERS_BENCH,
    USP_BENCHES,
    VIDEO_BENCH,
    Row,
    is_failed,
    usp_grid_label,
)
from bench.runner.targets import (  # noqa: E402
    GPU_BANDWIDTH_TARGET,
    GPU_SPEEDUP_TARGET,
    OVERLAP_TARGET,
    ZIGZAG_IDEAL_TARGET,
)

BENCH_COLORS = {
    "reshard": "tab:blue",
    "ulysses": "tab:orange",
    "ulysses-exchange": "tab:green",
    "pack": "tab:purple",
    "unpack": "tab:brown",
    "merge": "tab:pink",
}
# Ring panels: the legend goes between the title and the plot, where it hides no bar.
PAD_FOR_LEGEND = 34


def _legend_on_top(axis) -> None:
    axis.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=7, frameon=False)


RING_SERIES = (  # (label, value of a row or None, color)
    ("ideal / ring time",
     lambda row: None if row.time_ratio is None else 1 / row.time_ratio, "tab:blue"),
    ("overlap: compute only / ring time", lambda row: row.overlap_efficiency, "tab:green"),
    ("serial: compute only / (compute + exchange only); probe: measured",
     lambda row: None if row.serial_s is None else row.compute_only_s / row.serial_s, "lightgray"),
)  # fmt: skip


def _plot_speedups(axis, rows: list[Row], on_gpu: bool) -> None:
    labels = [f"{row.bench}: {row.case}" for row in rows]
    positions = range(len(rows))
    # Bars grow from 1.0: to the right where ours is faster, to the left where slower.
    axis.barh(positions, [row.speedup - 1 for row in rows], left=1,
              color=[BENCH_COLORS.get(row.bench, "gray") for row in rows])  # fmt: skip
    for position, row in zip(positions, rows):
        faster = row.speedup >= 1
        axis.text(row.speedup, position, f" x{row.speedup:.2f} (won {row.ours_faster_share:.0%}) ",
                  va="center", ha="left" if faster else "right", fontsize=7)  # fmt: skip
    axis.axvline(1.0, color="black", linewidth=1, label="1.0: as fast as unfused")
    if on_gpu:
        axis.axvline(GPU_SPEEDUP_TARGET, color="red", linestyle="--", linewidth=1,
                     label=f"{GPU_SPEEDUP_TARGET}x: GPU pack/unpack/merge target")  # fmt: skip
    axis.set_yticks(list(positions), labels, fontsize=8)
    axis.invert_yaxis()
    # Log scale: 0.5x and 2x are equally far from 1, and a 20x case does not squash the rest.
    axis.set_xscale("log", base=2)
    speedups = [row.speedup for row in rows]
    axis.set_xlim(min(speedups + [0.5]) / 2.5, max(speedups + [GPU_SPEEDUP_TARGET * 1.5]) * 2.5)
    axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}x"))
    axis.set_xlabel("speedup: unfused time / ours (log scale, higher is better)")
    axis.legend(loc="lower right", fontsize=8)
    axis.set_title("ours vs unfused baseline (won: share of paired rounds ours was faster)")


def _plot_kernel_bandwidth(axis, rows: list[Row], on_gpu: bool) -> None:
    kernels = [row for row in rows if row.bench in KERNEL_BENCHES]
    if not kernels:
        axis.text(0.5, 0.5, "pack/unpack/merge kernels not run", ha="center", va="center")
        axis.set_axis_off()
        return
    positions = range(len(kernels))
    height = 0.4
    axis.barh([p - height / 2 for p in positions], [row.ours_gbps for row in kernels], height,
              label="ours (fused kernel)", color="tab:purple")  # fmt: skip
    axis.barh([p + height / 2 for p in positions], [row.baseline_gbps for row in kernels], height,
              label="unfused", color="lightgray")  # fmt: skip
    copies = [(p, row.copy_gbps) for p, row in zip(positions, kernels) if row.copy_gbps is not None]
    if copies:
        axis.scatter([gbps for _, gbps in copies], [p for p, _ in copies], marker="|", s=300, color="black",
                     zorder=3, label="plain device copy of as many bytes")  # fmt: skip
    peak = kernels[0].peak_gbps
    if peak:
        source = kernels[0].peak_source
        axis.axvline(peak, color="black", linewidth=1, label=f"{peak:.0f} GB/s ({source})")
        if on_gpu:
            axis.axvline(GPU_BANDWIDTH_TARGET * peak, color="red", linestyle="--", linewidth=1,
                         label=f"{GPU_BANDWIDTH_TARGET:.0%} of peak: target")  # fmt: skip
    axis.set_yticks(list(positions), [f"{row.bench}: {row.case}" for row in kernels], fontsize=8)
    axis.invert_yaxis()
    # Room right of the peak line for the legend, so that it hides no bar.
    widest = max([row.ours_gbps or 0 for row in kernels] + [row.baseline_gbps or 0 for row in kernels]
                 + [row.copy_gbps or 0 for row in kernels])  # fmt: skip
    axis.set_xlim(0, max(widest, peak or 0) * 1.5)
    axis.set_xlabel("GB/s (bytes read + written / time)")
    axis.legend(loc="lower right", fontsize=8)
    axis.set_title("pack/unpack/merge bandwidth" + (" vs peak" if on_gpu else " vs measured copy (CPU)"))


def _plot_ring_efficiency(axis, rows: list[Row]) -> None:
    """Per ring case (and GPU probe): share of the ideal, overlap efficiency, and what a
    serial schedule would give; 1.0 is perfect."""
    height = 0.8 / len(RING_SERIES)
    for index, (label, value, color) in enumerate(RING_SERIES):
        offset = (index - (len(RING_SERIES) - 1) / 2) * height
        placed = [(position, value(row)) for position, row in enumerate(rows) if value(row) is not None]
        if not placed:
            continue
        axis.barh([p + offset for p, _ in placed], [v for _, v in placed], height,
                  label=label, color=color)  # fmt: skip
        for position, number in placed:
            axis.text(number, position + offset, f" {number:.2f}", va="center", fontsize=6)
    axis.axvline(1.0, color="black", linewidth=1)
    targets = f"{OVERLAP_TARGET}: targets (overlap; zigzag {ZIGZAG_IDEAL_TARGET:.0%} of ideal)"
    axis.axvline(OVERLAP_TARGET, color="red", linestyle="--", linewidth=1, label=targets)
    axis.set_yticks(list(range(len(rows))), [f"{row.bench}: {row.case}" for row in rows], fontsize=8)
    axis.invert_yaxis()
    axis.set_xlim(0, 1.5)
    axis.set_xlabel("fraction (1.0 = perfect)")
    _legend_on_top(axis)
    axis.set_title("ring attention vs single-device SDPA of the same size (ideal = its time / P)",
                   pad=PAD_FOR_LEGEND)  # fmt: skip


TIME_SERIES = (  # (label, seconds of a row or None, color): where a ring's time goes
    ("ideal: single device / P", lambda row: row.ideal_s, "tab:blue"),
    ("compute only (no exchange)", lambda row: row.compute_only_s, "tab:green"),
    ("ring (probe: overlapped copy)", lambda row: row.ours_s, "tab:orange"),
    ("exchange only (no compute)", lambda row: row.exchange_only_s, "lightgray"),
)


def _plot_ring_times(axis, rows: list[Row]) -> None:
    height = 0.8 / len(TIME_SERIES)
    for index, (label, value, color) in enumerate(TIME_SERIES):
        offset = (index - (len(TIME_SERIES) - 1) / 2) * height
        placed = [(position, value(row)) for position, row in enumerate(rows) if value(row)]
        if placed:
            axis.barh([p + offset for p, _ in placed], [v * 1e3 for _, v in placed], height,
                      label=label, color=color)  # fmt: skip
    axis.set_yticks(list(range(len(rows))), [f"{row.bench}: {row.case}" for row in rows], fontsize=8)
    axis.invert_yaxis()
    axis.set_xscale("log")
    axis.set_xlabel("ms per call (median; log scale)")
    _legend_on_top(axis)
    axis.set_title("where the ring's time goes", pad=PAD_FOR_LEGEND)


def _plot_step_tflops(axis, rows: list[Row], on_gpu: bool) -> None:
    if not rows:
        note = "step kernels not run" if on_gpu else "Triton step kernel vs SDPA: GPU only"
        axis.text(0.5, 0.5, note, ha="center", va="center")
        axis.set_axis_off()
        return
    positions = range(len(rows))
    height = 0.4
    axis.barh([p - height / 2 for p in positions], [row.ours_tflops for row in rows], height,
              label="ours (Triton step)", color="tab:purple")  # fmt: skip
    axis.barh([p + height / 2 for p in positions], [row.baseline_tflops for row in rows], height,
              label="SDPA best (flash / cuDNN)", color="lightgray")  # fmt: skip
    peak = rows[0].peak_tflops
    if peak:
        source = rows[0].peak_tflops_source
        axis.axvline(peak, color="black", linewidth=1, label=f"{peak:.0f} TFLOP/s ({source})")
    axis.set_yticks(list(positions), [f"{row.bench[10:]}: {row.case}" for row in rows], fontsize=8)
    axis.invert_yaxis()
    widest = max([row.ours_tflops for row in rows] + [row.baseline_tflops for row in rows] + [peak or 0])
    axis.set_xlim(0, widest * 1.4)
    axis.set_xlabel("TFLOP/s (causal: half the FLOPs)")
    _legend_on_top(axis)
    axis.set_title("ring step kernel (one step) vs SDPA", pad=PAD_FOR_LEGEND)


def _plot_step_tiles(axis, rows: list[Row]) -> None:
    """Candidate tiles of each step kernel against the shipped ones (the tile sweep)."""
    if not rows:
        axis.set_axis_off()
        return
    positions = range(len(rows))
    height = 0.4
    axis.barh([p - height / 2 for p in positions], [row.ours_tflops or 0 for row in rows], height,
              label="candidate tiles", color="tab:purple")  # fmt: skip
    axis.barh([p + height / 2 for p in positions], [row.baseline_tflops or 0 for row in rows], height,
              label="shipped tiles", color="lightgray")  # fmt: skip
    axis.set_yticks(list(positions), [row.case for row in rows], fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel("TFLOP/s")
    _legend_on_top(axis)
    axis.set_title("step kernel tiles (BLOCK_M, BLOCK_N, warps, stages)", pad=PAD_FOR_LEGEND)


# USP: a color per Ulysses degree U (the grid U x R of a run's world), in the order they come.
GRID_COLORS = ("tab:blue", "tab:purple", "tab:red", "tab:orange", "tab:olive", "tab:cyan")
USP_GAP = 0.6  # blank space between two cases' bars


def _usp_positions(rows: list[Row]) -> list[float]:
    """A bar per row, a case's grids next to each other, a gap between cases."""
    positions, position, previous = [], 0.0, None
    for row in rows:
        case = (row.bench, row.case.removesuffix(" " + usp_grid_label(row.ulysses_degree, row.ring_degree)))
        if previous is not None and case != previous:
            position += USP_GAP
        positions.append(position)
        position, previous = position + 1, case
    return positions


def _grid_name(row: Row) -> str:
    kind = "pure ring" if row.ulysses_degree == 1 else ("pure Ulysses" if row.ring_degree == 1 else "hybrid")
    return f"{usp_grid_label(row.ulysses_degree, row.ring_degree)} ({kind})"


def _usp_axis(axis, positions: list[float], labels: list[str], title: str) -> None:
    axis.set_yticks(positions, labels, fontsize=7)
    axis.invert_yaxis()
    _legend_on_top(axis)
    axis.set_title(title, pad=PAD_FOR_LEGEND)


def _plot_usp_times(axis, rows: list[Row]) -> None:
    """Each grid's median time per call, the grids of a case side by side (fwd: usp,
    fwd + bwd: usp-train), with x = its baseline / it."""
    positions = _usp_positions(rows)
    degrees = list(dict.fromkeys(row.ulysses_degree for row in rows))
    for degree, color in zip(degrees, GRID_COLORS):
        mine = [(position, row) for position, row in zip(positions, rows) if row.ulysses_degree == degree]
        axis.barh([p for p, _ in mine], [row.ours_s * 1e3 for _, row in mine], 0.8,
                  color=color, label=_grid_name(mine[0][1]))  # fmt: skip
        for position, row in mine:
            axis.text(row.ours_s * 1e3, position, f" {row.ours_s * 1e3:.1f} ms x{row.speedup:.2f}",
                      va="center", fontsize=6)  # fmt: skip
    axis.set_xlim(0, max(row.ours_s for row in rows) * 1e3 * 1.35)
    axis.set_xlabel("ms per call (median); x = baseline / this grid (hybrid: the faster pure grid)")
    _usp_axis(axis, positions, [f"{row.bench}: {row.case}" for row in rows],
              "USP: time per degree split U x R, forward (usp) and forward + backward (usp-train)")  # fmt: skip


def _plot_usp_bytes(axis, rows: list[Row]) -> None:
    """Bytes rank 0 sent per call in each group, stacked: the Ulysses all-to-all, then the
    ring; the bars line up with the time panel's (labelled by grid only)."""
    positions = _usp_positions(rows)
    largest = max((row.bytes_sent_ulysses_group or 0) + (row.bytes_sent_ring_group or 0) for row in rows)
    unit, scale = ("MiB", 2**20) if largest >= 2**20 else ("KiB", 2**10)
    ulysses = [(row.bytes_sent_ulysses_group or 0) / scale for row in rows]
    ring = [(row.bytes_sent_ring_group or 0) / scale for row in rows]
    axis.barh(positions, ulysses, 0.8, color="tab:orange", label="Ulysses group (all-to-all)")
    axis.barh(positions, ring, 0.8, left=ulysses, color="tab:blue", label="ring group (point to point)")
    for position, row, first, second in zip(positions, rows, ulysses, ring):
        verdict = "" if row.volume_at_theory else " != theory"
        axis.text(first + second, position, f" {first:.3g} + {second:.3g}{verdict}", va="center", fontsize=6)
    axis.set_xlim(0, max(largest / scale, 1e-9) * 1.4)
    axis.set_xlabel(f"{unit} sent by rank 0 per call (comm_stats): Ulysses + ring group")
    _usp_axis(axis, positions, [usp_grid_label(row.ulysses_degree, row.ring_degree) for row in rows],
              "USP: bytes sent per group (marked where not at the formulas)")  # fmt: skip


def _loss_bars(axis, rows: list[Row], ours, baseline, unit: float, xlabel: str, title: str) -> None:
    """Ours and the materialised baseline per token count, side by side (log scale);
    where the baseline did not run, a note in its place."""
    height = 0.4
    positions = range(len(rows))
    axis.barh([p - height / 2 for p in positions], [ours(row) / unit for row in rows], height,
              color="tab:green", label="ours: fused, chunk_size tokens at a time")  # fmt: skip
    ran = [(p, row) for p, row in zip(positions, rows) if baseline(row) is not None]
    axis.barh([p + height / 2 for p, _ in ran], [baseline(row) / unit for _, row in ran], height,
              color="lightgray", label="materialised logits")  # fmt: skip
    for position, row in zip(positions, rows):
        axis.text(ours(row) / unit, position - height / 2, f" {ours(row) / unit:.3g}", va="center", fontsize=6)
        if baseline(row) is None:
            axis.text(ours(row) / unit, position + height / 2, " materialised not run (does not fit)",
                      va="center", fontsize=6)  # fmt: skip
        else:
            axis.text(baseline(row) / unit, position + height / 2, f" {baseline(row) / unit:.3g}",
                      va="center", fontsize=6)  # fmt: skip
    axis.set_yticks(list(positions), [row.case for row in rows], fontsize=8)
    axis.invert_yaxis()
    axis.set_xscale("log")
    values = [ours(row) for row in rows] + [baseline(row) for row in rows if baseline(row) is not None]
    axis.set_xlim(min(values) / unit / 4, max(values) / unit * 8)
    axis.set_xlabel(xlabel)
    _legend_on_top(axis)
    axis.set_title(title, pad=PAD_FOR_LEGEND)


def _plot_loss(left, right, rows: list[Row]) -> None:
    _loss_bars(left, rows, lambda row: row.ours_peak_bytes, lambda row: row.baseline_peak_bytes, 2**20,
               "MiB: most held by the CPU allocator during forward + backward (log scale)",
               "LM loss, one rank: peak memory")  # fmt: skip
    for position, row in enumerate(rows):
        left.plot([row.peak_bound_bytes / 2**20] * 2, [position - 0.4, position], color="red", linewidth=1,
                  label="ours' bound" if position == 0 else None)  # fmt: skip
    _legend_on_top(left)

    def baseline_seconds(row):
        return None if row.baseline_peak_bytes is None else row.baseline_s

    _loss_bars(right, rows, lambda row: row.ours_s, baseline_seconds,
               1.0, "seconds per forward + backward (median; log scale)", "LM loss, one rank: time")  # fmt: skip


def _transformers_bars(rows: list[Row]) -> list[tuple[str, str, float | None, float | None, Row | None]]:
    """The bars of the transformers panels, a case's single process first, then its
    modes: (label, color, seconds, peak bytes, the mode's row or None)."""
    bars, cases = [], list(dict.fromkeys(row.case.rsplit(" ", 1)[-1] for row in rows))
    colors = {"ulysses": "tab:orange", "ring": "tab:blue", "usp": "tab:purple"}
    for case in cases:
        mine = [row for row in rows if row.case.endswith(" " + case)]
        bars.append((f"{case}: single process", "lightgray", mine[0].baseline_s, mine[0].baseline_peak_bytes, None))
        for row in mine:
            name = row.case.split()[0]
            bars.append((f"{case}: {name} {row.layout} {usp_grid_label(row.ulysses_degree, row.ring_degree)}",
                         colors.get(name, "gray"), row.ours_s, row.ours_peak_bytes, row))  # fmt: skip
    return bars


def _plot_transformers(left, right, rows: list[Row], on_gpu: bool) -> None:
    bars = _transformers_bars(rows)
    positions = list(range(len(bars)))
    labels = [bar[0] for bar in bars]
    left.barh(positions, [bar[2] for bar in bars], 0.8, color=[bar[1] for bar in bars])
    for position, (_, _, seconds, _, row) in zip(positions, bars):
        text = f" {seconds:.3g} s" + ("" if row is None else f"  x{row.speedup:.2f} (won {row.ours_faster_share:.0%})")
        left.text(seconds, position, text, va="center", fontsize=7)
    left.set_yticks(positions, labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlim(0, max(bar[2] for bar in bars) * 1.45)
    where = "one GPU vs one GPU per rank" if on_gpu else "CPU: the same cores for both, so total work"
    left.set_xlabel(f"seconds per training step (median); x = single process / mode ({where})")
    left.set_title("transformers training step: single process (sdpa, its loss) vs sequence parallel")
    peaks = [(position, bar[3]) for position, bar in zip(positions, bars) if bar[3]]
    right.barh([p for p, _ in peaks], [peak / 2**20 for _, peak in peaks], 0.8,
               color=[bars[p][1] for p, _ in peaks])  # fmt: skip
    for position, peak in peaks:
        right.text(peak / 2**20, position, f" {peak / 2**20:.0f} MiB", va="center", fontsize=7)
    right.set_yticks(positions, labels, fontsize=8)
    right.invert_yaxis()
    right.set_xlim(0, max([peak for _, peak in peaks] + [2**20]) / 2**20 * 1.35)
    right.set_xlabel("MiB held by the allocator in one step (modes: largest rank)")
    right.set_title("transformers training step: peak memory per rank")


def _plot_video(left, right, rows: list[Row]) -> None:
    """Each mode's time beside its baseline's (named in the case), and the bytes rank 0
    sent per call: DSP against the token-sharding modes on Latte."""
    positions = list(range(len(rows)))
    labels = [row.case for row in rows]
    left.barh([p - 0.2 for p in positions], [row.ours_s * 1e3 for row in rows], 0.4, color="tab:green", label="ours")
    left.barh([p + 0.2 for p in positions], [row.baseline_s * 1e3 for row in rows], 0.4, color="lightgray",
              label="baseline (named after 'vs')")  # fmt: skip
    for position, row in zip(positions, rows):
        left.text(row.ours_s * 1e3, position - 0.2, f" {row.ours_s * 1e3:.1f} ms x{row.speedup:.2f}", va="center",
                  fontsize=6)  # fmt: skip
    left.set_xlim(0, max(max(row.ours_s, row.baseline_s) for row in rows) * 1e3 * 1.35)
    left.set_yticks(positions, labels, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel("ms per transformer call (median); x = baseline / ours")
    left.set_title("video transformers (diffusers): each mode against its baseline")
    left.legend(loc="lower right", fontsize=7)
    largest = max(row.bytes_sent_ours or 0 for row in rows)
    unit, scale = ("MiB", 2**20) if largest >= 2**20 else ("KiB", 2**10)
    right.barh(positions, [(row.bytes_sent_ours or 0) / scale for row in rows], 0.8, color="tab:orange")
    for position, row in zip(positions, rows):
        verdict = "" if row.volume_at_theory else " != theory"
        right.text((row.bytes_sent_ours or 0) / scale, position, f" {(row.bytes_sent_ours or 0) / scale:.3g}{verdict}",
                   va="center", fontsize=6)  # fmt: skip
    right.set_xlim(0, max(largest / scale, 1e-9) * 1.35)
    right.set_yticks(positions, labels, fontsize=7)
    right.invert_yaxis()
    right.set_xlabel(f"{unit} sent by rank 0 per call (comm_stats; marked where not at the formula)")
    right.set_title("video transformers: bytes per call")


def _plot_memory(left, right, rows: list[Row]) -> None:
    """Peak per rank against tokens, one line per configuration (left); each
    configuration's peak at the longest length (right)."""
    measured = [row for row in rows if row.ours_peak_bytes is not None]
    names = list(dict.fromkeys(row.case.rsplit(" T=", 1)[0] for row in measured))
    longest = {}
    for name in names:
        points = sorted((int(row.case.rsplit("T=", 1)[1]), row.ours_peak_bytes / 2**20) for row in measured
                        if row.case.rsplit(" T=", 1)[0] == name)  # fmt: skip
        left.plot([t for t, _ in points], [peak for _, peak in points], marker="o", label=name)
        longest[name] = points[-1]
    left.set_xlabel("tokens in the sequence")
    left.set_ylabel("MiB held by the allocator in one step (largest rank)")
    left.set_title("memory: peak per rank of a training step")
    left.legend(fontsize=8, loc="upper left")
    positions = list(range(len(names)))
    right.barh(positions, [longest[name][1] for name in names], 0.8, color="tab:blue")
    right.set_yticks(positions, [f"{name} (T={longest[name][0]})" for name in names], fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("MiB per rank at the longest measured length")
    right.set_title("memory: configurations side by side")


HYBRID_BYTES = (  # (label, bytes of a row, color): per layer, rank 0, forward + backward
    ("state passing (measured)", lambda row: row.bytes_sent_ours, "tab:green"),
    ("gathering the inputs", lambda row: row.bytes_if_gathered, "lightgray"),
    ("Ulysses (all-to-all of the inputs, the output back)", lambda row: row.bytes_if_ulysses, "tab:orange"),
)
INFERENCE_BYTES = (  # (label, bytes of a row, color)
    ("sent by rank 0 in a call (measured)", lambda row: row.bytes_sent_ours, "tab:green"),
    ("KV cache of the fullest rank", lambda row: row.kv_bytes_per_rank, "tab:blue"),
    ("KV cache of one process", lambda row: row.kv_bytes_whole, "lightgray"),
)


def _times_against_one_process(axis, rows: list[Row], labels: list[str], ours: str, whole: str, xlabel: str,
                               title: str) -> None:  # fmt: skip
    """Each row's time (ours) beside one process's (the baseline), log scale."""
    positions = list(range(len(rows)))
    axis.barh([p - 0.2 for p in positions], [row.ours_s * 1e3 for row in rows], 0.4, color="tab:green", label=ours)
    axis.barh([p + 0.2 for p in positions], [row.baseline_s * 1e3 for row in rows], 0.4, color="lightgray",
              label=whole)  # fmt: skip
    for position, row in zip(positions, rows):
        axis.text(row.ours_s * 1e3, position - 0.2, f" {row.ours_s * 1e3:.3g} ms x{row.speedup:.2f}", va="center",
                  fontsize=6)  # fmt: skip
    times = [seconds * 1e3 for row in rows for seconds in (row.ours_s, row.baseline_s)]
    axis.set_xscale("log")  # the cases' times differ by 100x
    axis.set_xlim(min(times) / 2, max(times) * 4)
    axis.set_yticks(positions, labels, fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel(xlabel)
    _legend_on_top(axis)
    axis.set_title(title, pad=PAD_FOR_LEGEND)


def _bytes_side_by_side(axis, rows: list[Row], labels: list[str], series, xlabel: str, title: str) -> None:
    """Each row's bytes of every series (label, bytes of a row, color), log scale; the
    first series' (the measured bytes) written beside its bar."""
    positions = list(range(len(rows)))
    height = 0.8 / len(series)
    for index, (label, value, color) in enumerate(series):
        offset = (index - (len(series) - 1) / 2) * height
        axis.barh([p + offset for p in positions], [max(value(row) or 0, 1) / 2**10 for row in rows], height,
                  color=color, label=label)  # fmt: skip
    for position, row in zip(positions, rows):
        verdict = "" if row.volume_at_theory else " != theory"
        axis.text(max(row.bytes_sent_ours or 0, 1) / 2**10, position - (len(series) - 1) / 2 * height,
                  f" {(row.bytes_sent_ours or 0) / 2**10:.3g}{verdict}", va="center", fontsize=6)  # fmt: skip
    axis.set_xscale("log")
    axis.set_yticks(positions, labels, fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel(xlabel)
    _legend_on_top(axis)
    axis.set_title(title, pad=PAD_FOR_LEGEND)


def _plot_hybrid(left, right, rows: list[Row]) -> None:
    """Each layout's time beside one process's, per case; and the bytes per layer of
    state passing against gathering the inputs and Ulysses (log scale)."""
    labels = [row.case for row in rows]
    _times_against_one_process(left, rows, labels, "ours: the mixer on every rank", "one process, the whole sequence",
                               "ms per forward + backward (median; log scale); x = one process / ours",
                               "hybrid mixers: state passed across ranks vs one process")  # fmt: skip
    _bytes_side_by_side(right, rows, labels, HYBRID_BYTES,
                        "KiB sent by rank 0 per layer, forward + backward (log scale)",
                        "hybrid mixers: bytes per layer")  # fmt: skip


def _plot_inference(left, right, rows: list[Row]) -> None:
    """Each inference case's time beside one process's; and the bytes rank 0 sends in a
    call against the KV cache the fullest rank holds and one process's (log scale)."""
    labels = [f"{row.bench} {row.case}" for row in rows]
    _times_against_one_process(left, rows, labels, "ours: the KV cache sharded across the ranks",
                               "one process, the whole cache",
                               "ms per call (generate-decode: per step; median; log scale); x = one process / ours",
                               "inference: sharded KV cache vs one process")  # fmt: skip
    _bytes_side_by_side(right, rows, labels, INFERENCE_BYTES, "KiB (log scale)",
                        "inference: bytes sent per call, KV cache held")  # fmt: skip


def _plot_general(axes, rows: list[Row], on_gpu: bool) -> None:
    _plot_speedups(axes[0], rows, on_gpu)
    if len(axes) > 1:
        _plot_kernel_bandwidth(axes[1], rows, on_gpu)


def _plot_ring(axes, rows: list[Row], on_gpu: bool) -> None:
    _plot_ring_efficiency(axes[0], rows)
    _plot_ring_times(axes[1], rows)


def _plot_steps(axes, rows: list[Row], on_gpu: bool) -> None:
    _plot_step_tflops(axes[0], [row for row in rows if row.bench in STEP_BENCHES], on_gpu)
    _plot_step_tiles(axes[1], [row for row in rows if row.bench == STEP_TILES_BENCH])


def _plot_usp(axes, rows: list[Row], on_gpu: bool) -> None:
    _plot_usp_times(axes[0], rows)
    _plot_usp_bytes(axes[1], rows)


# A family's figure: a line of panels per kind of row it made, in this order: (the benches
# of the kind, how many panels, what draws them). Rows of no kind here (reshard, Ulysses,
# varlen, variants) are fused-vs-baseline rows: their speedups, and the kernels' bandwidth
# where there are kernel rows.
PANEL_KINDS = (
    (RING_BENCHES + (PROBE_BENCH,), 2, _plot_ring),
    (STEP_BENCHES + (STEP_TILES_BENCH,), 2, _plot_steps),
    (USP_BENCHES, 2, _plot_usp),
    ((LOSS_BENCH,), 2, lambda axes, rows, on_gpu: _plot_loss(*axes, rows)),
    ((TRANSFORMERS_BENCH,), 2, lambda axes, rows, on_gpu: _plot_transformers(*axes, rows, on_gpu)),
    ((VIDEO_BENCH,), 2, lambda axes, rows, on_gpu: _plot_video(*axes, rows)),
    ((MEMORY_BENCH,), 2, lambda axes, rows, on_gpu: _plot_memory(*axes, rows)),
    ((HYBRID_BENCH,), 2, lambda axes, rows, on_gpu: _plot_hybrid(*axes, rows)),
    (INFERENCE_BENCHES, 2, lambda axes, rows, on_gpu: _plot_inference(*axes, rows)),
)
# Figures are drawn at this many pixels an inch: 16 inches wide, 1600 pixels.
DPI = 100
FIGURE_WIDTH_IN = 16
# The headline figure: four panels readable at 100% on a laptop's screen.
HEADLINE_SIZE_IN = (16, 10)


def _panel_lines(rows: list[Row]) -> list[tuple[int, object, list[Row]]]:
    """The lines of panels of a family's rows: (panels, draw, rows), in PANEL_KINDS' order.
    Memory rows without a peak (the fsdp family's state bytes; its --quick run measures no
    peak) have nothing to plot: their numbers are in the table."""
    lines = []
    rest = [row for row in rows if not (row.bench == MEMORY_BENCH and row.ours_peak_bytes is None)]
    for benches, count, draw in PANEL_KINDS:
        mine = [row for row in rest if row.bench in benches]
        if mine:
            lines.append((count, draw, mine))
            rest = [row for row in rest if row.bench not in benches]
    if rest:
        kernels = any(row.bench in KERNEL_BENCHES for row in rest)
        lines.insert(0, (2 if kernels else 1, _plot_general, rest))
    return lines


def panel_data(axis) -> int:
    """The data an axis shows: its bars and points, and its lines with markers (reference
    lines such as a target have none)."""
    marked = [line for line in axis.lines if line.get_marker() not in (None, "None", "", " ")]
    return len(axis.patches) + len(axis.collections) + len(marked)


@dataclass(frozen=True)
class Figure:
    """A written PNG and what each of its panels showed."""

    path: Path
    width_px: int
    height_px: int
    panels: dict[str, int]  # panel title -> data drawn (bars, points, marked lines; panel_data)

    def record(self, folder: Path) -> dict:
        """The JSON's entry: the file relative to the results folder, its size, its panels."""
        return {"file": str(self.path.relative_to(folder)), "width_px": self.width_px,
                "height_px": self.height_px, "panels": self.panels}  # fmt: skip


def _title(metadata: dict) -> str:
    """The machine and the software, as every figure names them."""
    return (f"{metadata['device']}, {metadata['backend']} x {metadata['world_size']} ranks, "
            f"{metadata.get('cpu_count', '?')} cores, torch {metadata['torch']}, commit {metadata['git_commit']}, "
            f"{metadata['date']}")  # fmt: skip


def _save(figure, path: Path) -> Figure:
    """Saves at DPI with the figure's own size (no tight bounding box: the pixels are known)."""
    panels = {}
    for axis in figure.axes:
        if axis.axison:
            title = axis.get_title() or axis.get_xlabel() or f"panel {len(panels) + 1}"
            panels[title] = panel_data(axis)
    width, height = figure.canvas.get_width_height()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    plt.close(figure)
    return Figure(path, width, height, panels)


def family_figure(name: str, rows: list[Row], metadata: dict, path: Path) -> Figure | None:
    """A family's rows as a figure: a line of panels per kind of row (PANEL_KINDS); None
    where no row has anything to plot."""
    on_gpu = metadata["device_type"] == "cuda"
    lines = _panel_lines(rows)
    if not lines:
        return None
    heights = [max(4.5, 0.32 * len(mine) + 2.5) for _, _, mine in lines]
    figure = plt.figure(figsize=(FIGURE_WIDTH_IN, sum(heights)), dpi=DPI)
    grid = figure.add_gridspec(len(lines), 2, width_ratios=[3, 2], height_ratios=heights)
    for index, (count, draw, mine) in enumerate(lines):
        axes = [figure.add_subplot(grid[index, :])] if count == 1 else [figure.add_subplot(grid[index, column])
                                                                          for column in range(2)]  # fmt: skip
        draw(axes, mine, on_gpu)
    figure.suptitle(f"seqpar-kernels bench, {name}: {_title(metadata)}", fontsize=10)
    figure.tight_layout()
    return _save(figure, path)


# The headline's first panel: the benches whose baseline is the unfused way or a peer's,
# with what that baseline is (bench/README.md's table).
HEADLINE_BASELINES = {
    "reshard": "unfused (tensor_split, contiguous, cat)",
    "pack": "unfused (DeepSpeed's permute + contiguous)",
    "unpack": "unfused (cat of the pieces)",
    "ulysses": "DeepSpeed-Ulysses",
    "ulysses-exchange": "DeepSpeed-Ulysses' exchange",
    "merge": "ring-flash-attention's merge",
}
MODE_COLORS = {"ulysses": "tab:orange", "ring": "tab:blue", "usp": "tab:purple"}


def _not_run(axis, what: str) -> None:
    axis.text(0.5, 0.5, f"{what}: not in this run", ha="center", va="center", transform=axis.transAxes)


def _headline_speedups(axis, rows: list[Row]) -> None:
    """Per bench, the median speedup over its cases, a line from the least to the most."""
    benches = [bench for bench in HEADLINE_BASELINES if any(row.bench == bench for row in rows)]
    for position, bench in enumerate(benches):
        speedups = sorted(row.speedup for row in rows if row.bench == bench)
        middle = statistics.median(speedups)
        axis.barh(position, middle - 1, left=1, color=BENCH_COLORS.get(bench, "gray"), height=0.6)
        axis.plot([speedups[0], speedups[-1]], [position, position], color="black", marker="|", markersize=12)
        axis.text(max(speedups[-1], middle), position, f"  x{middle:.2f} ({len(speedups)} cases)", va="center",
                  fontsize=9)  # fmt: skip
    if not benches:
        _not_run(axis, "fused against unfused")
    axis.axvline(1.0, color="black", linewidth=1)
    axis.set_yticks(range(len(benches)), [f"{bench}\nvs {HEADLINE_BASELINES[bench]}" for bench in benches], fontsize=9)
    axis.invert_yaxis()
    axis.set_xscale("log", base=2)
    axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}x"))
    axis.set_xlabel("speedup: baseline time / ours (median over cases, line: least to most; log)")
    axis.set_title("fused against unfused and the peers' way")


def _headline_bytes(axis, rows: list[Row]) -> None:
    """Bytes sent by rank 0 against the formula's, every row with both: on the diagonal when equal."""
    counted = [row for row in rows if row.bytes_sent_ours and row.bytes_sent_theory]
    if not counted:
        _not_run(axis, "bytes counted")
        axis.set_title("bytes against the formula")
        return
    families = list(dict.fromkeys(row.bench.split("-")[0] for row in counted))
    for family in families:
        mine = [row for row in counted if row.bench.split("-")[0] == family]
        axis.scatter([row.bytes_sent_theory for row in mine], [row.bytes_sent_ours for row in mine], s=24, label=family)
    values = [value for row in counted for value in (row.bytes_sent_theory, row.bytes_sent_ours)]
    axis.plot([min(values), max(values)], [min(values), max(values)], color="black", linewidth=1)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("bytes by the formula (seqpar_kernels.traffic)")
    axis.set_ylabel("bytes sent by rank 0 (comm_stats)")
    at = sum(bool(row.volume_at_theory) for row in counted)
    axis.set_title(f"bytes against the formula: {at} of {len(counted)} cases on it")
    axis.legend(fontsize=8, ncol=2, loc="upper left")


def _headline_times(axis, rows: list[Row]) -> None:
    """A training step's seconds against its tokens, one line per mode and the single
    process's (the transformers family); else attention's per USP grid."""
    steps = [row for row in rows if row.bench == TRANSFORMERS_BENCH]
    if steps:
        lines = {}
        for row in steps:
            mode, tokens = row.case.split()[0], int(row.case.rsplit("T=", 1)[1])
            lines.setdefault(mode, []).append((tokens, row.ours_s))
            lines.setdefault("single process", []).append((tokens, row.baseline_s))
        what = "a transformers training step"
    else:
        attention = [row for row in rows if row.bench == "usp"]
        lines = {}
        for row in attention:
            tokens = int(row.case.split(" S=", 1)[1].split()[0])
            lines.setdefault(usp_grid_label(row.ulysses_degree, row.ring_degree), []).append((tokens, row.ours_s))
        what = "USP attention (forward)"
    if not lines:
        _not_run(axis, "time against length")
        axis.set_title("time against sequence length per mode")
        return
    for mode, points in lines.items():
        points = sorted(dict(points).items())
        axis.plot([t for t, _ in points], [seconds * 1e3 for _, seconds in points], marker="o",
                  color=MODE_COLORS.get(mode, "gray"), linestyle="--" if mode == "single process" else "-",
                  label=mode)  # fmt: skip
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("tokens in the sequence (log)")
    axis.set_ylabel("ms per call (median; log)")
    axis.set_title(f"time against sequence length per mode: {what}")
    axis.legend(fontsize=8)


def _headline_accuracy(axis, rows: list[Row]) -> None:
    """Per bench, the largest error against the exact result as a multiple of plain
    PyTorch's (the tests' rule: at most 2)."""
    judged = [row for row in rows if row.error_vs_plain is not None]
    benches = list(dict.fromkeys(row.bench for row in judged))
    worst = [max(row.error_vs_plain for row in judged if row.bench == bench) for bench in benches]
    axis.barh(range(len(benches)), worst, color="tab:green", height=0.6)
    for position, (bench, value) in enumerate(zip(benches, worst)):
        count = sum(row.bench == bench for row in judged)
        axis.text(value, position, f"  {value:.2f} (worst of {count})", va="center", fontsize=9)
    if not benches:
        _not_run(axis, "accuracy against plain PyTorch")
    axis.axvline(2.0, color="red", linestyle="--", linewidth=1, label="2x: the rule")
    axis.set_yticks(range(len(benches)), benches, fontsize=9)
    axis.invert_yaxis()
    axis.set_xlim(0, max(worst + [2.0]) * 1.4)
    axis.set_xlabel("error against the exact result / plain PyTorch's error (at most 2)")
    axis.set_title("accuracy against plain PyTorch")
    axis.legend(fontsize=8, loc="lower right")


def headline_figure(rows: list[Row], metadata: dict, path: Path) -> Figure:
    """Four panels: fused against unfused and the peers' way, bytes against the formula,
    time against sequence length per mode, accuracy against plain PyTorch; the machine
    in the title. HEADLINE_SIZE_IN at DPI: 1600 x 1000 pixels."""
    figure, axes = plt.subplots(2, 2, figsize=HEADLINE_SIZE_IN, dpi=DPI)
    _headline_speedups(axes[0][0], rows)
    _headline_bytes(axes[0][1], rows)
    _headline_times(axes[1][0], rows)
    _headline_accuracy(axes[1][1], rows)
    figure.suptitle(f"seqpar-kernels bench: {_title(metadata)}", fontsize=12)
    figure.tight_layout()
    return _save(figure, path)


def write_figures(family_rows: dict[str, list[Row]], metadata: dict, stem: Path, families: bool = True) -> list[Figure]:
    """<stem>.png, the headline figure, and (families) <stem>/<family>.png for each family
    that made rows (failed rows left out)."""
    measured = {name: [row for row in rows if not is_failed(row)] for name, rows in family_rows.items()}
    figures = [headline_figure([row for rows in measured.values() for row in rows], metadata, stem.with_suffix(".png"))]
    for name, rows in measured.items():
        figure = family_figure(name, rows, metadata, stem / f"{name}.png") if rows and families else None
        if figure is not None:
            figures.append(figure)
    return figures
