"""What every benchmark needs to know about the rank it runs on."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from bench.runner import hardware
from bench.runner.plan import size_name
from bench.runner.rows import Row


@dataclass
class RoundsClock:
    """Seconds this rank spent in warm-up and timed rounds (what the budget's repeats sizing changes)."""

    seconds: float = 0.0


@dataclass
class Context:
    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    device: torch.device  # cpu for gloo, this rank's GPU for nccl
    device_name: str
    quick: bool  # tiny shapes, few repetitions: a smoke test, not a measurement
    warmup: int  # untimed rounds (one call of each candidate) before timing
    reps: int  # timed rounds at least; the median is reported
    max_reps: int  # timed rounds at most, for cases cheap enough ...
    seconds_per_case: float  # ... to fill this much time with samples
    # Takes every row as bench/runner/cases.py's run_case makes it (bench/runner/suite.py: rewrites the
    # results files at once).
    record_row: Callable[[Row], None] | None = None
    full: bool = False  # the suite's largest sizes (--full); neither this nor quick: the default
    # The default sizes with fewer timed rounds, of the tile sweep the dk/dv tiles only: the short GPU check
    # (scripts/gpu_check.sh --short).
    short: bool = False
    # Takes entries for the run's JSON (bench/runner/suite.py: written at once; rank 0's count).
    record_metadata: Callable[[dict], None] | None = None
    # Of the timed rounds (bench/runner/budget.py: the budget's sizing; bench/runner/timing.py applies it).
    repeat_scale: float = 1.0
    # The seconds spent in timed rounds, shared by the copies families make (dataclasses.replace).
    rounds_clock: RoundsClock = field(default_factory=RoundsClock)

    @property
    def size(self) -> str:
        """ "quick", "default" or "full": the sizes a family runs (bench/runner/plan.py)."""
        return size_name(self.quick, self.full)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def log(self, message: str) -> None:
        """Rank 0 prints, flushed at once so progress shows while the run goes on."""
        if self.is_root:
            print(message, flush=True)

    def report_failure(self, what: str) -> None:
        """Inside an except block: rank 0 prints the traceback (the log is all a remote run
        leaves), other ranks one line."""
        if self.is_root:
            print(f"FAILED {what}:\n{traceback.format_exc()}", end="", flush=True)
        else:
            print(f"[rank {self.rank}] FAILED {what}: {traceback.format_exc().splitlines()[-1]}", flush=True)

    def release_memory(self) -> None:
        """After a failure: what its tensors held goes back (an out-of-memory error would
        otherwise fail the next case too)."""
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def every_core(self):
        """On CPU, this rank computes with every core of the machine inside (the one-process
        benches, while the other ranks wait at a barrier: both sides of a comparison run
        inside); on GPU nothing changes."""
        if self.on_gpu:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(machine_threads())
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def log_every_core(self, family: str) -> None:
        """On CPU, says how the family's single process (every_core) and its ranks share the cores."""
        if not self.on_gpu:
            self.log(f"{family}: the single process on rank 0 with {machine_threads()} threads, the modes on "
                     f"{self.world_size} ranks of {torch.get_num_threads()} threads each: the same cores")  # fmt: skip

    def sync(self) -> None:
        """Waits for this rank's queued device work (a no-op on CPU, where ops block)."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.world_size > 1:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def reduce_over_ranks(self, values: torch.Tensor, op=dist.ReduceOp.MAX) -> torch.Tensor:
        """values reduced elementwise over all ranks (NCCL needs them on the GPU)."""
        if self.world_size == 1:
            return values
        staged = values.to(self.device)
        dist.all_reduce(staged, op=op)
        return staged.cpu()

    def random(self, shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
        """A normal-distributed tensor made on this rank's device (GPU-sized inputs would
        take seconds to make on the host), reproducible from seed."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        return torch.randn(shape, generator=generator, device=self.device, dtype=torch.float32).to(dtype)

    @functools.cached_property
    def peak_bandwidth(self) -> tuple[float, str]:
        """(GB/s, source) of this device's memory: spec sheet for known GPUs, else measured
        (on CPU: the copy bandwidth with this rank's threads, the ceiling of any packing
        kernel run with them)."""
        return hardware.peak_memory_bandwidth(self.device, self.device_name)

    @functools.cached_property
    def peak_flops(self) -> tuple[float | None, str]:
        """(dense bf16 TFLOP/s, source): the spec sheet for known GPUs, else None."""
        return hardware.peak_bf16_tflops(self.device, self.device_name)


def machine_threads() -> int:
    """The cores this process may run on (the whole machine's, where the ranks share it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
