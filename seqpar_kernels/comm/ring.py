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

    def spare_for(self, buffer: torch.Tensor) -> torch.Tensor:
        """The buffer a DoubleBuffer receives the next block into."""
        return torch.empty_like(buffer)


class DoubleBuffer:
    """The block a rank holds now (`current`) and the spare buffer the next one arrives
    in. `post()` sends `current` onward and receives into the spare; `advance()` waits
    for that exchange and swaps, so the received block becomes `current` and the old one
    (already sent) becomes the spare for the next exchange."""

    def __init__(self, ring: Ring, first: torch.Tensor):
        self.ring = ring
        self.current = first
        self._spare = ring.spare_for(first)
        self._work: RingWork | None = None

    def post(self) -> None:
        assert self._work is None, "post() twice without advance()"
        self._work = self.ring.start(self.current, self._spare)

    def advance(self) -> None:
        assert self._work is not None, "advance() without post()"
        self._work.wait()
        self._work = None
        self.current, self._spare = self._spare, self.current
