"""The P2P ring of ring attention: send to rank + 1, receive from rank - 1.

Ring attention moves one flat buffer per step (K and V packed together in the forward;
the fp32 dK|dV accumulator in the backward), so an exchange is exactly one isend and one
irecv, posted together with `batch_isend_irecv`:

    ring = Ring(group_name)
    work = ring.start(send_buffer, recv_buffer)   # posts both, returns at once
    ...compute on send_buffer...                  # overlaps the transfer
    work.wait()                                   # recv_buffer now holds rank-1's buffer

`DoubleBuffer` wraps the common pattern (the block this rank holds now, and a spare
buffer that receives the next one).

GPU: NCCL runs P2P on its own stream, which waits for the current stream when the ops
are posted (so a buffer the compute still reads is not overwritten early); `wait()`
only makes the current stream wait for NCCL's stream: no host synchronisation per step.
Gloo (CPU): the transfer runs on gloo's threads while this thread computes.

Bytes sent are counted for comm_stats when an exchange is posted.

`replaced_exchange` is a benchmarking hook (bench/bench_ring.py): it swaps the exchange
for nothing or a local copy; outside it, nothing here changes.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from seqpar_kernels.comm.groups import SINGLE_PROCESS, group_from_name
from seqpar_kernels.comm.stats import record_sent

# Tags keep the two rings of the backward (K|V and dK|dV, in flight at once between the
# same pair of ranks) apart on gloo, whose matching is by (peer, tag). NCCL ignores
# tags; it matches P2P in posting order, which is the same on every rank.
KV_TAG = 71
GRAD_KV_TAG = 72


class RingWork:
    """A posted exchange. `wait()` returns once the receive buffer is usable (on GPU:
    once work queued after it on the current stream will see it)."""

    def __init__(self, works):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


class Ring:
    """One direction of the ring of `group_name`'s ranks: sends go to group rank
    (rank + 1) % P and receives come from (rank - 1) % P, both mapped to global ranks
    (torch.distributed P2P addresses peers by global rank)."""

    def __init__(self, group_name: str, tag: int = KV_TAG):
        self.tag = tag
        if group_name == SINGLE_PROCESS:
            self.group, self.rank, self.world_size = None, 0, 1
        else:
            self.group = group_from_name(group_name)
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.send_peer = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
            self.recv_peer = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)
        if _replacement is not None:
            _replacement.resize(self)

    def start(self, send_buffer: torch.Tensor, recv_buffer: torch.Tensor) -> RingWork:
        """Posts the send of `send_buffer` to the next rank and the receive of the previous
        rank's buffer into `recv_buffer` (both flat, contiguous, same size and dtype).
        Neither may be written (send) or read (recv) until `wait()` returns.

        World size 1: no communication; the ring of one rank hands the buffer to itself."""
        if send_buffer.shape != recv_buffer.shape or send_buffer.dtype != recv_buffer.dtype:
            raise ValueError(
                f"ring exchange needs equal buffers, got send {tuple(send_buffer.shape)} "
                f"{send_buffer.dtype}, recv {tuple(recv_buffer.shape)} {recv_buffer.dtype}"
            )
        if _replacement is not None:
            return _replacement.start(send_buffer, recv_buffer)
        if self.world_size == 1:
            recv_buffer.copy_(send_buffer)
            return RingWork([])
        ops = [
            dist.P2POp(dist.isend, send_buffer, self.send_peer, self.group, self.tag),
            dist.P2POp(dist.irecv, recv_buffer, self.recv_peer, self.group, self.tag),
        ]
        works = dist.batch_isend_irecv(ops)
        record_sent(send_buffer.numel() * send_buffer.element_size())
        return RingWork(works)


class DoubleBuffer:
    """The block a rank holds now (`current`) and the spare buffer the next one arrives
    in. `post()` sends `current` onward and receives into the spare; `advance()` waits
    for that exchange and swaps, so the received block becomes `current` and the old one
    (already sent) becomes the spare for the next exchange."""

    def __init__(self, ring: Ring, first: torch.Tensor):
        self.ring = ring
        self.current = first
        # replaced_exchange("none") moves nothing: the spare IS the current block.
        none = _replacement is not None and _replacement.mode == "none"
        self._spare = first if none else torch.empty_like(first)
        self._work: RingWork | None = None

    def post(self) -> None:
        assert self._work is None, "post() twice without advance()"
        self._work = self.ring.start(self.current, self._spare)

    def advance(self) -> None:
        assert self._work is not None, "advance() without post()"
        self._work.wait()
        self._work = None
        self.current, self._spare = self._spare, self.current


# ----------------------------------------------------------------------------------
# Benchmarking hook: the exchange replaced (bench/bench_ring.py)
# ----------------------------------------------------------------------------------


class _Replacement:
    def __init__(self, mode: str, virtual_world_size: int | None, virtual_rank: int):
        self.mode, self.virtual_world_size, self.virtual_rank = mode, virtual_world_size, virtual_rank
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def resize(self, ring: Ring) -> None:
        if self.virtual_world_size is None:
            return
        if ring.world_size != 1:
            raise ValueError(f"virtual_world_size needs a ring of one rank, not {ring.world_size}")
        ring.world_size, ring.rank = self.virtual_world_size, self.virtual_rank

    def start(self, send: torch.Tensor, recv: torch.Tensor) -> RingWork:
        if self.mode == "none":
            return RingWork([])
        if send.device.type != "cuda" and self.mode == "copy":
            raise ValueError(f"replaced_exchange('copy') needs CUDA buffers, got {send.device}")
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


class _StreamWork:
    """wait(): the current stream waits for the side stream's copy (no host sync)."""

    def __init__(self, stream: torch.cuda.Stream, event: torch.cuda.Event):
        self._stream, self._event = stream, event

    def wait(self) -> None:
        self._stream.wait_event(self._event)


_replacement: _Replacement | None = None
EXCHANGE_MODES = ("none", "copy", "serial_copy")


@contextlib.contextmanager
def replaced_exchange(mode: str, *, virtual_world_size: int | None = None, virtual_rank: int = 0):
    """Benchmarking only (not thread-safe): every ring exchange posted inside the block
    (by rings made inside it: the ring driver makes its own per call) is replaced by
        "none"         nothing: DoubleBuffer's spare buffer is its current one, so every
                       step computes on this rank's own K|V: the ring's compute alone
                       (timing only: the backward's dK|dV accumulator does not travel
                       either, so dk and dv come out meaningless).
        "copy"         CUDA only: a device-to-device copy of the same bytes on a side
                       stream, ordered as NCCL's P2P (after the work queued so far on
                       the current stream; wait() makes the current stream wait for it).
        "serial_copy"  the same copy on the current stream (CPU too): no overlap.
    virtual_world_size: rings of one rank act as rings of this many, this process being
    rank virtual_rank, so that one device runs every step of a P-rank ring (rings of
    more ranks raise). comm_stats counts nothing inside: no byte leaves the rank."""
    global _replacement
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"mode must be one of {EXCHANGE_MODES}, got {mode!r}")
    if virtual_world_size is not None and not 0 <= virtual_rank < virtual_world_size:
        raise ValueError(f"virtual_rank {virtual_rank} is not in [0, {virtual_world_size})")
    if _replacement is not None:
        raise RuntimeError("replaced_exchange blocks do not nest")
    _replacement = _Replacement(mode, virtual_world_size, virtual_rank)
    try:
        yield
    finally:
        _replacement = None
