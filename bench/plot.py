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

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: rank 0 may run on a headless node
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from bench.rows import (  # noqa: E402
    HYBRID_BENCH,
    INFERENCE_BENCHES,
    KERNEL_BENCHES,
    LOSS_BENCH,
    MEMORY_BENCH,
    RING_ALL,
    STEP_BENCHES,
    STEP_TILES_BENCH,
    TRANSFORMERS_BENCH,
    USP_BENCHES,
    VIDEO_BENCH,
    Row,
    usp_grid_label,
)
from bench.targets import (  # noqa: E402
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


def plot_results(rows: list[Row], metadata: dict, path: Path) -> Path:
    on_gpu = metadata["device_type"] == "cuda"
    general = [
        row
        for row in rows
        if row.bench
        not in RING_ALL
        + USP_BENCHES
        + INFERENCE_BENCHES
        + (LOSS_BENCH, TRANSFORMERS_BENCH, VIDEO_BENCH, MEMORY_BENCH, HYBRID_BENCH)
    ]
    ring = [row for row in rows if row.bench in RING_ALL and row.bench not in STEP_BENCHES + (STEP_TILES_BENCH,)]
    steps = [row for row in rows if row.bench in STEP_BENCHES]
    tiles = [row for row in rows if row.bench == STEP_TILES_BENCH]
    usp = [row for row in rows if row.bench in USP_BENCHES]
    loss = [row for row in rows if row.bench == LOSS_BENCH]
    hf = [row for row in rows if row.bench == TRANSFORMERS_BENCH]
    video = [row for row in rows if row.bench == VIDEO_BENCH]
    memory = [row for row in rows if row.bench == MEMORY_BENCH]
    hybrid = [row for row in rows if row.bench == HYBRID_BENCH]
    inference = [row for row in rows if row.bench in INFERENCE_BENCHES]
    # One line of two panels each: the fused-vs-unfused benches; ring attention; (GPU)
    # the step kernels; USP; the LM loss; the transformers training step; video
    # transformers; memory; the hybrid mixers; inference.
    panels = (general, ring, steps, usp, loss, hf, video, memory, hybrid, inference)
    panel_rows = [len(panel) for panel in panels if panel] or [0]
    heights = [max(4.5, 0.32 * count + 2.5) for count in panel_rows]
    figure, axes = plt.subplots(
        len(panel_rows), 2, figsize=(16, sum(heights)), squeeze=False,
        gridspec_kw={"width_ratios": [3, 2], "height_ratios": heights},
    )  # fmt: skip
    line = iter(axes)
    if general or not any(panels[1:]):
        left, right = next(line)
        _plot_speedups(left, general, on_gpu)
        _plot_kernel_bandwidth(right, general, on_gpu)
    if ring:
        left, right = next(line)
        _plot_ring_efficiency(left, ring)
        _plot_ring_times(right, ring)
    if steps:
        left, right = next(line)
        _plot_step_tflops(left, steps, on_gpu)
        _plot_step_tiles(right, tiles)
    if usp:
        left, right = next(line)
        _plot_usp_times(left, usp)
        _plot_usp_bytes(right, usp)
    if loss:
        left, right = next(line)
        _plot_loss(left, right, loss)
    if hf:
        left, right = next(line)
        _plot_transformers(left, right, hf, on_gpu)
    if video:
        left, right = next(line)
        _plot_video(left, right, video)
    if memory:
        left, right = next(line)
        _plot_memory(left, right, memory)
    if hybrid:
        left, right = next(line)
        _plot_hybrid(left, right, hybrid)
    if inference:
        left, right = next(line)
        _plot_inference(left, right, inference)
    ranks = f"{metadata['backend']} x {metadata['world_size']} ranks"
    figure.suptitle(
        f"seqpar-kernels bench: {metadata['device']}, {ranks}, torch {metadata['torch']}, "
        f"triton {metadata.get('triton', 'unknown')}, commit {metadata['git_commit']}, {metadata['date']}",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
