"""Runs the selected benchmarks on one rank; rank 0 prints the summary and writes results.

Results survive a failure or a kill partway: rank 0 rewrites the CSV and JSON after every
case (the PNG comes at the end), and a case that raises (no cuDNN, out of memory, a
Triton compile error ...) becomes a row whose check is "FAILED <error type>" (the message
in detail; bench/runner/cases.py's run_case, which every bench's case loop calls) while the other
cases go on; the run then exits with status 1.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

import seqpar_kernels
from bench.runner import hardware
from bench.runner.budget import Budget, calibrate
from bench.runner.cases import failed_row
from bench.runner.context import Context, machine_threads
from bench.runner.family import found_families, runs
from bench.runner.plan import RunPlan, duration
from bench.runner.plot import write_figures
from bench.runner.report import write_report
from bench.runner.results import progress_line, summary_table, write_results
from bench.runner.rows import Row, is_failed
from bench.runner.targets import target_checks
from bench.runner.work import WorkMeter
from seqpar_kernels.extension import build_info

# The case column of the row recorded when a bench raises outside its cases.
BENCH_STOPPED = "(bench stopped here)"


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
        "triton": hardware.triton_version(),
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
        "size": ctx.size,
        "short": ctx.short,
        "warmup_rounds": ctx.warmup,
        "timed_rounds": f"{timed_rounds(ctx)} per case (column reps)",
        "timing": "median over timed rounds of the slowest rank's time per call, candidates "
        "interleaved; " + ("CUDA events" if ctx.on_gpu else "time.perf_counter after dist.barrier"),
    }
    if ctx.on_gpu:
        metadata["calibration"] = hardware.calibration(ctx.device, ctx.device_name)
    families = found_families()
    for name in only:  # each family's own entries: its baseline's note, why a part was skipped
        metadata.update((key, value) for key, value in families[name].metadata().items() if value is not None)
    return metadata


def results_stem(ctx: Context, out_dir: Path, started: datetime.datetime) -> Path:
    """<out>/<device>-<backend><P>-<YYYYMMDD-HHMM>[-quick|-full][-short]: sorts by device, then date."""
    name = f"{hardware.device_slug(ctx.device_name)}-{ctx.backend}{ctx.world_size}-{started:%Y%m%d-%H%M}"
    return out_dir / (name + ("" if ctx.size == "default" else f"-{ctx.size}") + ("-short" if ctx.short else ""))


@dataclass
class ResultsFiles:
    """The rows so far; on rank 0, rewritten to <stem>.csv and .json after each one."""

    ctx: Context
    stem: Path
    metadata: dict
    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.write(complete=False)

    def add_metadata(self, entries: dict) -> None:
        """What a bench adds to the JSON (ring-step: the step backend it measured),
        written at once."""
        self.metadata.update(entries)
        self.write(complete=False)

    def write(self, complete: bool) -> list[Path]:
        if not self.ctx.is_root:
            return []
        failed = sum(is_failed(row) for row in self.rows)
        self.metadata.update(
            complete=complete,
            status=(f"finished, {failed} failed cases" if complete
                    else "running: the cases so far (a run killed partway stops here)"),
            failed_cases=failed,
            load_average_end=load_average(),
        )  # fmt: skip
        return write_results(self.rows, target_checks(self.rows, self.ctx.on_gpu), self.metadata, self.stem)


def run_bench(ctx: Context, name: str, results: ResultsFiles, done: set) -> None:
    """One bench, its rows into results as they are made (a case that raises is a FAILED
    row: bench/runner/cases.py's run_case); an error outside its cases stops only this bench
    (all of its families' remaining cases). done: the names of the families this run has
    already run ("ring" runs "ring-probe" after it), each run once."""
    ctx.record_row = results.add
    try:
        for family in runs()[name]:
            if family.name not in done:
                done.add(family.name)
                family.run(ctx)
        return
    except Exception as error:  # noqa: BLE001 - recorded, the run exits non-zero at the end
        row = failed_row(ctx, name, BENCH_STOPPED, error)
        ctx.report_failure(f"{name} (outside a case; its remaining cases did not run)")
    finally:
        ctx.record_row = None
    ctx.release_memory()
    ctx.log(progress_line(row))
    results.add(row)
    # Where the bench was in a rank-0-only part (kernels; the ring's GPU cases), the other
    # ranks wait at its closing barrier: meet them there. Where every rank raised, they
    # all get here. (A rank that raised alone amid collectives leaves the others waiting
    # in one: no barrier helps that.)
    ctx.barrier()


def run_suite(ctx: Context, only: list[str], out_dir: Path, budget_s: float | None = None,
              run_started: float | None = None, measure_work: bool = False) -> None:  # fmt: skip
    """Runs the benches in `only` within budget_s seconds where given (bench/runner/budget.py),
    counted from run_started (time.monotonic(); default: now); rank 0 writes the results
    as it goes, then the summary, the figures and the report. Raises SystemExit(1) on
    rank 0 when any case failed on any rank."""
    started = datetime.datetime.now()
    run_started = time.monotonic() if run_started is None else run_started
    load_at_start = load_average()
    # The declared GPU estimates stand as they are: the probes time CPU work.
    calibration = None if ctx.on_gpu else calibrate(ctx.world_size, ctx.barrier, ctx.reduce_over_ranks)
    ctx.log(
        f"seqpar-kernels bench: {ctx.device_name}, {ctx.backend} x {ctx.world_size} ranks, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads per rank, "
        f"{ctx.warmup} warm-up + {timed_rounds(ctx)} timed calls per candidate"
        f"{', quick' if ctx.quick else ''}"
    )
    ctx.log("ours = seqpar fused path (sizes passed); baseline = unfused (permute/contiguous/cat + "
            "all_to_all_single); x = baseline time / ours (ring, usp, varlen, loss, transformers: see their own "
            "notes)")  # fmt: skip
    plan = RunPlan({name: runs()[name] for name in only}, ctx.size, ctx.on_gpu)
    budget = Budget(plan, calibration, budget_s if ctx.size != "quick" else None)
    for line in budget.plan_lines(ctx.world_size, ctx.backend, machine_threads()):
        ctx.log(line)
    stem = results_stem(ctx, out_dir, started)
    results = ResultsFiles(ctx, stem, run_metadata(ctx, started, load_at_start, only))
    timed = {}  # family -> seconds of timed rounds (rank 0's)
    work = {}  # family -> its shares of each kind of work, where metered (rank 0's)
    results.metadata["plan"] = budget.family_record(timed)  # per family: the estimate, then the time taken
    results.metadata["budget"] = budget.record(None)
    ctx.record_metadata = results.add_metadata
    ctx.log(f"results so far: {stem}.csv and .json, rewritten after every case")
    done, family_rows = set(), {}
    for name in only:
        ctx.repeat_scale = budget.start(name)
        ctx.log(plan.start(name))
        first, rounds = len(results.rows), ctx.rounds_clock.seconds
        with WorkMeter() if measure_work and ctx.is_root else contextlib.nullcontext() as meter:
            run_bench(ctx, name, results, done)
        if meter is not None:
            work[name] = meter.shares()
            ctx.log(f"work: {name} {work[name]} of {duration(sum(meter.seconds.values()))} (rank 0)")
        family_rows[name] = results.rows[first:]
        timed[name] = ctx.rounds_clock.seconds - rounds
        ctx.log(plan.finish(name))
        # Every rank sizes the rest alike: from the slowest rank's times.
        elapsed, run_elapsed = ctx.reduce_over_ranks(
            torch.tensor([plan.elapsed[name], time.monotonic() - run_started], dtype=torch.float64)
        ).tolist()
        plan.elapsed[name] = elapsed
        note = budget.finish(name, elapsed, run_elapsed)
        if note:
            ctx.log(f"budget: {note}")
        results.metadata.update(plan=budget.family_record(timed), budget=budget.record(None))
        if work:
            results.metadata.update(work=work)
    rows = results.rows
    failed = ctx.reduce_over_ranks(torch.tensor([sum(is_failed(row) for row in rows)])).item()
    if not ctx.is_root:
        return
    paths = results.write(complete=True)
    metadata = results.metadata
    checks = target_checks(rows, ctx.on_gpu)
    print(summary_table(rows, checks), flush=True)
    print(f"\nmachine load (1-min average, this run's ranks included): {load_at_start} at start, "
          f"{metadata['load_average_end']} at end, on {os.cpu_count()} cores", flush=True)  # fmt: skip
    try:
        figures = write_figures(family_rows, metadata, stem, families=not ctx.short)
        paths += [figure.path for figure in figures]
        plot_failed = False
    except Exception:  # noqa: BLE001 - the CSV and JSON are written; say so and exit non-zero
        print(f"FAILED plot:\n{traceback.format_exc()}", end="", flush=True)
        figures, plot_failed = [], True
    run_elapsed = time.monotonic() - run_started
    metadata.update(budget=budget.record(run_elapsed), figures=[figure.record(stem.parent) for figure in figures])
    # The short GPU check's folder keeps its few files (scripts/gpu_check.sh): the headline figure only.
    report = None if ctx.short else write_report(stem, family_rows, checks, metadata, figures,
                                                 budget.report_lines(run_elapsed))  # fmt: skip
    results.write(complete=True)
    written = ", ".join(str(path) for path in paths)
    print(f"\nwrote {written}", flush=True)
    print(budget.summary_line(run_elapsed), flush=True)
    if failed or plot_failed:
        what = [f"{failed} failed cases (any rank)"] if failed else []
        what += ["the plot failed"] if plot_failed else []
        print(f"bench: {' and '.join(what)}: exit status 1", flush=True)
    print(f"report: {report or 'none with --short (the headline figure only)'}", flush=True)
    if failed or plot_failed:
        raise SystemExit(1)
