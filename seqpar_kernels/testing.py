"""What tests and benchmarks swap in: not used by the library itself.

ring_attention_with_step_kernels(q, k, v, step_kernels, ...)
    ring_attention with the step backend chosen by name (seqpar_kernels.engine.
    step_backends.STEP_KERNELS): "triton" runs the GPU path's kernels on CPU tensors
    in the Triton interpreter (TRITON_INTERPRET=1), so that its schedule is checked
    on gloo ranks without a GPU.
ReplacedExchange(mode, virtual_world_size=None, virtual_rank=0)
    a ring factory for the ring driver (seqpar_kernels.engine.ring_driver's
    `exchange` argument) whose rings move nothing, or copy on one GPU instead of
    sending: the compute alone, or one GPU running every step of a P-rank ring.
peak_cpu_memory(fn, *args, **kwargs)
    (fn's result, the most bytes the CPU allocator held during the call beyond what
    it held before), from the allocator's own reports to torch.profiler (torch has
    no torch.cpu.max_memory_allocated), without the profiler's routine stderr lines.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from seqpar_kernels.comm.ring import Ring, RingWork
from seqpar_kernels.parallel.ring import ring_attention_with_step_kernels

__all__ = [
    "ring_attention_with_step_kernels",
    "ReplacedExchange",
    "EXCHANGE_MODES",
    "peak_cpu_memory",
    "without_profiler_chatter",
]


EXCHANGE_MODES = ("none", "copy", "serial_copy")


class ReplacedExchange:
    """A ring factory, exchange(group_name, tag) -> ring, whose rings replace the P2P
    exchange by
        "none"         nothing: a DoubleBuffer's spare buffer is its current one, so
                       every step computes on this rank's own K|V: the ring's compute
                       alone (timing only: the backward's dK|dV accumulator does not
                       travel either, so dk and dv come out meaningless).
        "copy"         CUDA only: a device-to-device copy of the same bytes on a side
                       stream, ordered as NCCL's P2P (after the work queued so far on the
                       current stream; wait() makes the current stream wait for it).
        "serial_copy"  the same copy on the current stream (CPU too): no overlap.
    virtual_world_size: a group of one rank acts as a ring of this many, this process
    being rank virtual_rank, so that one device runs every step of a P-rank ring (groups
    of more ranks raise). comm_stats counts nothing: no byte leaves the rank."""

    def __init__(self, mode: str, virtual_world_size: int | None = None, virtual_rank: int = 0):
        if mode not in EXCHANGE_MODES:
            raise ValueError(f"mode must be one of {EXCHANGE_MODES}, got {mode!r}")
        if virtual_world_size is not None and not 0 <= virtual_rank < virtual_world_size:
            raise ValueError(f"virtual_rank {virtual_rank} is not in [0, {virtual_world_size})")
        self.mode, self.virtual_world_size, self.virtual_rank = mode, virtual_world_size, virtual_rank
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def __call__(self, group_name: str, tag: int) -> _ReplacedRing:
        return _ReplacedRing(self, Ring(group_name, tag))

    def start(self, send: torch.Tensor, recv: torch.Tensor, hops: int = 1) -> RingWork:
        if self.mode == "none":
            return RingWork([])
        if send.device.type != "cuda" and self.mode == "copy":
            raise ValueError(f"ReplacedExchange('copy') needs CUDA buffers, got {send.device}")
        if self.mode == "serial_copy":
            recv.copy_(send)  # on the current stream: the compute waits for it
            return RingWork([])
        # As NCCL's P2P: the side stream first waits for the work queued so far.
        current = torch.cuda.current_stream(send.device)
        if send.device not in self._side_streams:
            self._side_streams[send.device] = torch.cuda.Stream(send.device)
        side = self._side_streams[send.device]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            recv.copy_(send)
        send.record_stream(side)  # not reused before the copy is done, even if freed
        recv.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
        return RingWork([_StreamWork(current, done)])


class _ReplacedRing:
    """A Ring whose exchanges its ReplacedExchange carries out."""

    def __init__(self, replacement: ReplacedExchange, ring: Ring):
        self._replacement = replacement
        self.tag, self.world_size, self.rank = ring.tag, ring.world_size, ring.rank
        if replacement.virtual_world_size is not None:
            if ring.world_size != 1:
                raise ValueError(f"virtual_world_size needs a ring of one rank, not {ring.world_size}")
            self.world_size, self.rank = replacement.virtual_world_size, replacement.virtual_rank

    def start(self, send_buffer: torch.Tensor, recv_buffer: torch.Tensor, hops: int = 1) -> RingWork:
        return self._replacement.start(send_buffer, recv_buffer, hops)

    def spare_for(self, buffer: torch.Tensor) -> torch.Tensor:
        # "none" moves nothing: the spare IS the current block.
        return buffer if self._replacement.mode == "none" else torch.empty_like(buffer)


class _StreamWork:
    """wait(): the current stream waits for the side stream's copy (no host sync)."""

    def __init__(self, stream: torch.cuda.Stream, event: torch.cuda.Event):
        self._stream, self._event = stream, event

    def wait(self) -> None:
        self._stream.wait_event(self._event)


def peak_cpu_memory(fn, *args, **kwargs) -> tuple[object, int]:
    """Runs fn(*args, **kwargs) and returns (its result, peak bytes): the most bytes
    the CPU allocator held at any moment of the call beyond what it held when the call
    began.

    Under torch.profiler with profile_memory=True, the CPU allocator reports every
    allocation (+bytes) and every free (-bytes) as a "[memory]" event; their running
    sum in time order is the memory held above the starting point, and its maximum the
    peak. A block allocated before the call and freed during it reports no size (the
    profiler warns of "a block of unknown size"), so it is not subtracted: the peak
    can only come out high, never low. What is counted: the calling thread's
    allocations and those of the threads it hands its thread-local state to (the
    autograd engine's), not buffers that intra-op worker threads allocate on their own.

    The profiler prints routine lines to stderr that read as failures (PROFILER_CHATTER:
    at its start and stop, and the warning of that unknown-size block during the call):
    they are dropped, and everything else printed meanwhile is passed on
    (profiler_chatter_dropped), fn's own stderr when the call returns."""
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with profiler_chatter_dropped():
        profiler.start()
        try:
            result = fn(*args, **kwargs)
        finally:
            profiler.stop()
    events = [
        event for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU
    ]  # fmt: skip
    held = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):  # stable: ties keep their order
        held += event.nbytes()
        peak = max(peak, held)
    return result, peak


# What torch's profiler (kineto, in C++: straight to file descriptor 2) prints when all is
# well: a USDT line at every start and stop, the CPU allocator's warning (once a process)
# when a block from before the start is freed (peak_cpu_memory's docstring: accounted for),
# and, in a CUDA build of torch on a machine without a usable GPU, an ERROR line at the
# first stop (kineto asks CUDA for the devices' properties). Only these exact lines are
# dropped: any other line, a kineto ERROR among them, still shows.
PROFILER_CHATTER = (
    re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$"),
    re.compile(
        r"^(\[rank\d+\]:)?\[W.*CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before "
        r"the profiling started, profiler results will not include the deallocation event\s*$"
    ),
)
NO_GPU_CHATTER = re.compile(r"^ERROR:.*\] gpuGetDeviceCount failed with code \d+\s*$")


def without_profiler_chatter(text: str, gpu_available: bool) -> str:
    """text less the lines of PROFILER_CHATTER (and NO_GPU_CHATTER without a GPU)."""
    chatter = PROFILER_CHATTER if gpu_available else (*PROFILER_CHATTER, NO_GPU_CHATTER)
    return "".join(line for line in text.splitlines(keepends=True)
                   if not any(pattern.match(line) for pattern in chatter))  # fmt: skip


@contextlib.contextmanager
def profiler_chatter_dropped():
    """Inside: file descriptor 2 goes to a temporary file (C++ writes there, around
    sys.stderr); on leaving, what was written, less the profiler's chatter, goes to
    stderr. Where descriptor 2 cannot be redirected, nothing is filtered."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = without_profiler_chatter(captured.read().decode(errors="replace"), torch.cuda.is_available())
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
