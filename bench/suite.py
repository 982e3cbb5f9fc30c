"""Runs the selected benchmarks on one rank; rank 0 prints the summary and writes results."""

from __future__ import annotations

import datetime
import os
import platform
import time
from pathlib import Path

import torch

import seqpar_kernels
from seqpar_kernels._extension import build_info

from bench import bench_kernels, bench_reshard, bench_ring, bench_ulysses, hardware
from bench.context import Context
from bench.plot import plot_results
from bench.results import Row, summary_table, target_checks, write_results

BENCHES = {
    "reshard": bench_reshard.run,
    "ulysses": bench_ulysses.run,
    "kernels": bench_kernels.run,
    "ring": bench_ring.run,
}


def load_average() -> float | None:
    """The 1-minute load average (runnable processes, this run's ranks included)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def timed_rounds(ctx: Context) -> str:
    return str(ctx.reps) if ctx.reps == ctx.max_reps else f"{ctx.reps} to {ctx.max_reps}"


def run_metadata(ctx: Context, started: datetime.datetime, load_at_start: float | None,
                 only: list[str]) -> dict:  # fmt: skip
    """What the sidecar JSON records about the run (rank 0's view)."""
    metadata = {
        "benches": only,
        "device": ctx.device_name,
        "device_type": ctx.device.type,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seqpar_kernels": seqpar_kernels.__version__,
        "seqpar_build": build_info(),
        "git_commit": hardware.git_commit(),
        "date": started.strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        # Other work on the machine makes CPU timings noisy: a load well above the
        # number of cores means the ranks were competing with something else.
        "load_average_start": load_at_start,
        "load_average_end": load_average(),
        "threads_per_rank": torch.get_num_threads(),
        "quick": ctx.quick,
        "warmup_rounds": ctx.warmup,
        "timed_rounds": f"{timed_rounds(ctx)} per case (column reps)",
        "timing": "median over timed rounds of the slowest rank's time per call, candidates "
        "interleaved; " + ("CUDA events" if ctx.on_gpu else "time.perf_counter after dist.barrier"),
    }
    if "ring" in only:
        metadata["ring_reference"] = bench_ring.REFERENCE_NOTE
    return metadata


def results_stem(ctx: Context, out_dir: Path, started: datetime.datetime) -> Path:
    """<out>/<device>-<backend><P>-<YYYYMMDD-HHMM>[-quick]: sorts by device, then date."""
    name = f"{hardware.device_slug(ctx.device_name)}-{ctx.backend}{ctx.world_size}-{started:%Y%m%d-%H%M}"
    return out_dir / (name + ("-quick" if ctx.quick else ""))


def run_suite(ctx: Context, only: list[str], out_dir: Path) -> None:
    started = datetime.datetime.now()
    clock = time.perf_counter()
    load_at_start = load_average()
    ctx.log(
        f"seqpar-kernels bench: {ctx.device_name}, {ctx.backend} x {ctx.world_size} ranks, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads per rank, "
        f"{ctx.warmup} warm-up + {timed_rounds(ctx)} timed calls per candidate"
        f"{', quick' if ctx.quick else ''}"
    )
    ctx.log("ours = seqpar fused path (sizes passed); baseline = unfused (permute/contiguous/cat + "
            "all_to_all_single); x = baseline time / ours (ring: see its own note)")  # fmt: skip
    rows: list[Row] = []
    for name in only:
        ctx.log(f"== {name} ==")
        rows += BENCHES[name](ctx)
    if not ctx.is_root:
        return
    checks = target_checks(rows, ctx.on_gpu)
    metadata = run_metadata(ctx, started, load_at_start, only)
    print(summary_table(rows, checks), flush=True)
    print(f"\nmachine load (1-min average, this run's ranks included): {load_at_start} at start, "
          f"{metadata['load_average_end']} at end, on {os.cpu_count()} cores", flush=True)  # fmt: skip
    stem = results_stem(ctx, out_dir, started)
    paths = write_results(rows, checks, metadata, stem)
    paths.append(plot_results(rows, metadata, stem.with_suffix(".png")))
    written = ", ".join(str(path) for path in paths)
    print(f"\nwrote {written} ({time.perf_counter() - clock:.0f} s)", flush=True)
