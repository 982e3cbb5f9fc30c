"""The PNG: speedup per case, and the pack/unpack kernels' GB/s against the peak."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: rank 0 may run on a headless node
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from bench.results import GPU_BANDWIDTH_TARGET, GPU_SPEEDUP_TARGET, KERNEL_BENCHES, Row  # noqa: E402

BENCH_COLORS = {
    "reshard": "tab:blue",
    "ulysses": "tab:orange",
    "ulysses-exchange": "tab:green",
    "pack": "tab:purple",
    "unpack": "tab:brown",
}


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
                     label=f"{GPU_SPEEDUP_TARGET}x: GPU pack/unpack target")  # fmt: skip
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
        axis.text(0.5, 0.5, "pack/unpack kernels not run", ha="center", va="center")
        axis.set_axis_off()
        return
    positions = range(len(kernels))
    height = 0.4
    axis.barh([p - height / 2 for p in positions], [row.ours_gbps for row in kernels], height,
              label="ours (fused kernel)", color="tab:purple")  # fmt: skip
    axis.barh([p + height / 2 for p in positions], [row.baseline_gbps for row in kernels], height,
              label="unfused", color="lightgray")  # fmt: skip
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
    widest = max([row.ours_gbps or 0 for row in kernels] + [row.baseline_gbps or 0 for row in kernels])
    axis.set_xlim(0, max(widest, peak or 0) * 1.5)
    axis.set_xlabel("GB/s (bytes read + written / time)")
    axis.legend(loc="lower right", fontsize=8)
    axis.set_title("pack/unpack bandwidth" + (" vs peak" if on_gpu else " vs measured copy (CPU)"))


def plot_results(rows: list[Row], metadata: dict, path: Path) -> Path:
    figure, (left, right) = plt.subplots(
        1, 2, figsize=(16, max(4.5, 0.32 * len(rows) + 2)), gridspec_kw={"width_ratios": [3, 2]}
    )
    on_gpu = metadata["device_type"] == "cuda"
    _plot_speedups(left, rows, on_gpu)
    _plot_kernel_bandwidth(right, rows, on_gpu)
    ranks = f"{metadata['backend']} x {metadata['world_size']} ranks"
    figure.suptitle(
        f"seqpar-kernels bench: {metadata['device']}, {ranks}, torch {metadata['torch']}, "
        f"commit {metadata['git_commit']}, {metadata['date']}",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
