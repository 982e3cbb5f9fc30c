"""Starting the ranks: under torchrun, as spawned local processes, or as one process.

torchrun (RANK and WORLD_SIZE set)   this process is one rank; env:// rendezvous
world size 1                         this process is the only rank
otherwise                            P local ranks started by torch.multiprocessing
                                     (fork on CPU-only machines, else spawn),
                                     rendezvous through a file in a temporary dir
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing

from bench.runner import hardware
from bench.runner.budget import Budget, calibrate
from bench.runner.context import Context, machine_threads
from bench.runner.family import found_families, runs
from bench.runner.plan import RunPlan, size_name
from bench.runner.suite import run_suite

# Ranks a CPU-only run starts by default: enough for uneven splits and a real all-to-all.
DEFAULT_CPU_WORLD_SIZE = 4
# Per case: warm-up rounds, then at least `reps` timed rounds, more for cheap cases (up to
# `max_reps`, filling about `seconds_per_case`); see bench/runner/timing.py. --quick only shows
# that everything runs.
REPETITIONS = dict(warmup=3, reps=15, max_reps=75, seconds_per_case=3.0)
QUICK_REPETITIONS = dict(warmup=1, reps=3, max_reps=3, seconds_per_case=0.0)
# --short (the short GPU check): the full shapes in a third of the time per case; GPU
# events time a kernel to a microsecond, so 10 rounds settle a median there.
SHORT_REPETITIONS = dict(warmup=2, reps=10, max_reps=30, seconds_per_case=1.0)


@dataclass(frozen=True)
class Options:
    world_size: int | None  # None: all local GPUs, else DEFAULT_CPU_WORLD_SIZE
    backend: str | None  # None: nccl with GPUs, else gloo
    quick: bool
    only: tuple[str, ...]  # benchmarks to run, in order
    out: Path
    full: bool = False  # the suite's largest sizes (bench/runner/plan.py); neither: the default sizes
    plan_only: bool = False  # print the plan (sizes, estimates) and run nothing
    short: bool = False  # the default sizes with SHORT_REPETITIONS, the dk/dv tiles of the sweep (the GPU check)
    budget_s: float | None = None  # seconds the run may take (bench/runner/budget.py); None: none
    started: float | None = None  # time.monotonic() at the command's start (the budget counts from it)
    measure_work: bool = False  # rank 0 meters each family's seconds by kind of work (bench/runner/work.py)

    @property
    def size(self) -> str:
        return size_name(self.quick, self.full)

    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if torch.cuda.is_available() else "gloo")

    def resolved_world_size(self) -> int:
        if self.world_size is not None:
            return self.world_size
        if self.resolved_backend() == "nccl":
            return torch.cuda.device_count()
        return DEFAULT_CPU_WORLD_SIZE


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_options(options: Options) -> None:
    backend, world_size = options.resolved_backend(), options.resolved_world_size()
    if backend == "nccl" and not torch.cuda.is_available():
        raise SystemExit("--backend nccl needs CUDA GPUs; this machine has none (use gloo)")
    gpus = torch.cuda.device_count()
    if backend == "nccl" and not under_torchrun() and world_size > gpus:
        raise SystemExit(f"--world-size {world_size} with nccl needs as many local GPUs, found {gpus}")
    if world_size < 1:
        raise SystemExit(f"--world-size must be at least 1, got {world_size}")
    if options.quick and options.full:
        raise SystemExit("--quick and --full exclude each other")


def threads_per_rank(local_world_size: int) -> int:
    """CPU ranks on one machine share its cores: an equal slice each, so that ranks do
    not preempt each other in the middle of a collective."""
    return max(1, (os.cpu_count() or 1) // local_world_size)


def run_rank(rank: int, world_size: int, local_rank: int, local_world_size: int,
             init_method: str, options: Options) -> None:  # fmt: skip
    """One rank: join the process group, run the suite, leave."""
    backend = options.resolved_backend()
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():  # else torch's "invalid device ordinal"
            raise SystemExit(
                f"rank {rank}: LOCAL_RANK {local_rank} has no GPU; this node has "
                f"{torch.cuda.device_count()}. With nccl, start at most one rank per GPU "
                f"(torchrun --nproc-per-node {torch.cuda.device_count()}), or use --backend gloo"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.set_num_threads(threads_per_rank(local_world_size))
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        device_id=device if backend == "nccl" else None,
    )  # fmt: skip
    ctx = Context(
        rank=rank, world_size=world_size, backend=backend, device=device,
        device_name=hardware.device_name(device), quick=options.quick, full=options.full, short=options.short,
        **(QUICK_REPETITIONS if options.quick else SHORT_REPETITIONS if options.short else REPETITIONS),
    )  # fmt: skip
    try:
        run_suite(ctx, list(options.only), options.out, options.budget_s, options.started, options.measure_work)
    finally:
        dist.destroy_process_group()


def _started_rank(rank: int, world_size: int, init_method: str, options: Options) -> None:
    run_rank(rank, world_size, rank, world_size, init_method, options)


def launch(options: Options) -> None:
    check_options(options)
    if options.plan_only:
        print("\n".join(plan_lines(options)), flush=True)
        return
    if under_torchrun():
        run_rank(
            int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            "env://", options,
        )  # fmt: skip
        return
    world_size = options.resolved_world_size()
    rendezvous = tempfile.mkdtemp(prefix="seqpar_bench_")
    init_method = f"file://{rendezvous}/init"
    try:
        if world_size == 1:
            run_rank(0, 1, 0, 1, init_method, options)
        else:
            torch.multiprocessing.start_processes(
                _started_rank, args=(world_size, init_method, options), nprocs=world_size,
                join=True, start_method=start_method(options),
            )  # fmt: skip
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)


def plan_lines(options: Options) -> list[str]:
    """The plan of the run `options` describe, calibrated in this one process: the probes
    with a rank's threads, times the ranks per core beyond one (no round trip: the
    exchange counted at the float probe's pace)."""
    world_size, backend = options.resolved_world_size(), options.resolved_backend()
    plan = RunPlan({name: runs()[name] for name in options.only}, options.size, on_gpu=backend == "nccl")
    calibration = None
    if backend != "nccl":  # the probes time CPU work
        torch.set_num_threads(threads_per_rank(world_size))
        alone = calibrate(1, lambda: None, lambda values: values)
        crowding = max(1.0, world_size * torch.get_num_threads() / machine_threads())
        calibration = alone.scaled(crowding)
    budget = Budget(plan, calibration, options.budget_s)
    return budget.plan_lines(world_size, backend, machine_threads())


def start_method(options: Options) -> str:
    """fork on a CPU-only machine, spawn where there are GPUs.

    A spawned rank imports torch and seqpar afresh, and the first call of seqpar's
    collective (a Python torch.library custom op) imports torch._dynamo: together about
    8 s of CPU per rank, 30 s and more for 4 ranks on 2 cores. Forked ranks inherit
    those modules from this process, which imports them once (and what a family names to
    preload: transformers and its Llama, another 6 s a rank). CUDA cannot be used in a
    forked child once the parent has touched it, so GPU machines spawn."""
    if options.resolved_backend() == "nccl" or torch.cuda.is_available():
        return "spawn"
    importlib.import_module("torch._dynamo")  # see above: inherited by the forked ranks
    for family in found_families().values():
        if family.name in options.only:
            for module in family.preload:  # seconds of CPU to import: once here, not per rank
                try:
                    importlib.import_module(module)
                except ImportError:
                    pass  # the family reports itself skipped
    return "fork"
