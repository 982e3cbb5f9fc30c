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

Bytes sent are counted for comm_stats when an exchange is posted. The ring driver makes
its rings through a factory argument (default: Ring); seqpar_kernels.testing has rings
that replace the exchange, to time the compute alone or one GPU's copies.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from seqpar_kernels.groups import SINGLE_PROCESS, group_from_name
from seqpar_kernels.traffic import record_sent

# Tags keep the two rings of the backward (K|V and dK|dV, in flight at once between the
# same pair of ranks) apart on gloo, whose matching is by (peer, tag). NCCL ignores
# tags; it matches P2P in posting order, which is the same on every rank.
KV_TAG = 71
GRAD_KV_TAG = 72


def device_guard(device: torch.device):
    """A context in which `device` is CUDA's current device (torch.cuda.device); a no-op
    for other devices. NCCL posts and waits on the current device's streams, and torch
    documents hangs where the current device is not the buffers'."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class RingWork:
    """A posted exchange. `wait()` returns once the receive buffer is usable (on GPU:
    once work queued after it on the current stream will see it). device: the buffers'
    device, current while waiting."""

    def __init__(self, works, device: torch.device | None = None):
        self._works, self._device = works, device

    def wait(self) -> None:
        if self._works:
            with device_guard(self._device):
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

    def _global_rank(self, offset: int) -> int:
        """The global rank of the group rank `offset` places after this one."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.world_size)

    def start(self, send_buffer: torch.Tensor, recv_buffer: torch.Tensor, hops: int = 1) -> RingWork:
        """Posts the send of `send_buffer` to the next rank and the receive of the previous
        rank's buffer into `recv_buffer` (both flat, contiguous, one dtype). Their sizes
        may differ (ranks may hold blocks of different lengths): `recv_buffer` must have
        the size of what the previous rank sends. Neither may be written (send) or read
        (recv) until `wait()` returns. hops: to the rank that many places on and from the
        rank that many places back instead (every rank passing the same, as the ring's
        last exchange of a shortened ring does).

        World size 1: no communication; the ring of one rank hands the buffer to itself."""
        assert send_buffer.dtype == recv_buffer.dtype, (send_buffer.dtype, recv_buffer.dtype)
        if self.world_size == 1:
            assert send_buffer.shape == recv_buffer.shape, (send_buffer.shape, recv_buffer.shape)
            recv_buffer.copy_(send_buffer)
            return RingWork([])
        ops = [
            dist.P2POp(dist.isend, send_buffer, self._global_rank(hops), self.group, self.tag),
            dist.P2POp(dist.irecv, recv_buffer, self._global_rank(-hops), self.group, self.tag),
        ]
        with device_guard(send_buffer.device):
            works = dist.batch_isend_irecv(ops)
        record_sent(send_buffer.numel() * send_buffer.element_size())
        return RingWork(works, send_buffer.device)

    def spare_for(self, buffer: torch.Tensor) -> torch.Tensor:
        """The buffer a DoubleBuffer receives the next block into."""
        return torch.empty_like(buffer)


class DoubleBuffer:
    """The block a rank holds now (`current`) and the spare buffer the next one arrives
    in. `post()` sends `current` onward and receives into the spare; `advance()` waits
    for that exchange and swaps, so the received block becomes `current` and the old one
    (already sent) becomes the spare for the next exchange.

    sizes: the number of elements of the block held after 0, 1, 2, ... advances, when
    blocks differ in size (ranks holding sequence pieces of different lengths). `first`
    then has room for the largest (its first sizes[0] elements are the block), and
    both buffers are that large; None: every block is the size of `first`."""

    def __init__(self, ring: Ring, first: torch.Tensor, sizes: list[int] | None = None):
        self.ring = ring
        self._sizes = sizes
        self._held = 0  # advances so far
        self._buffer, self._spare = first, ring.spare_for(first)
        self.current = first if sizes is None else first[: sizes[0]]
        self._work: RingWork | None = None

    def _size(self, advances: int) -> int:
        return self._buffer.numel() if self._sizes is None else self._sizes[advances]

    def post(self) -> None:
        assert self._work is None, "post() twice without advance()"
        self._work = self.ring.start(self.current, self._spare[: self._size(self._held + 1)])

    def advance(self) -> None:
        assert self._work is not None, "advance() without post()"
        self._work.wait()
        self._work = None
        self._held += 1
        self._buffer, self._spare = self._spare, self._buffer
        self.current = self._buffer[: self._size(self._held)]
