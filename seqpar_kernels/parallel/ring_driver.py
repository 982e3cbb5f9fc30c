"""The ring attention driver: the step schedule and the forward and backward loops.

Run by the custom ops seqpar::ring_attention_forward and seqpar::ring_attention_backward
(seqpar_kernels/ops/ring_attention.py); the public entry point and its argument checks
are seqpar_kernels/parallel/ring.py, the per-step kernels by device
seqpar_kernels/parallel/ring_steps.py, the P2P exchange seqpar_kernels/comm/ring.py.

The ring (forward). Rank r holds q, k, v of its sequence piece. K and V are packed once
into one flat buffer that travels the ring (comm/ring.py: send to r+1, receive from
r-1). At step i the rank holds the K/V block of rank src = (r - i) mod P; step i's
exchange (for step i+1) is posted BEFORE step i's attention runs, so the transfer
overlaps the compute, and waited for only after it. Each step folds its block into a
running fp32 (out, lse) that starts at (0, -inf):

    CUDA  the Triton step kernel (kernels/attention_step_kernels.py), merge fused, no rounding
          of the running result to the input dtype between steps.
    CPU   aten's CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu) for the
          block's (out, lse), then the attention_merge_ kernel. The Triton kernels would
          also run on CPU, but only in the interpreter, which is orders of magnitude
          slower than aten's vectorized CPU flash kernel; aten's kernel returns lse, so the
          merge is the only extra kernel. It takes GQA/MQA kv heads as they are.

The ring (backward). With the FINAL (out, lse), the probabilities of any block are
exp(s - lse), so each step's gradients are independent and add up (CUDA: the Triton
backward kernels, delta = rowsum(dout * out) computed once; CPU: aten's CPU flash
backward given the final out and lse, which rebuilds the same probabilities). dq stays
home in fp32. The fp32 dK|dV accumulator of a block travels the ring behind its K|V
block: the home rank keeps its own (step 0) share; the accumulator starts at rank r+1
(step 1), collects every rank's share and arrives home after P-1 sends, where the home
share is added. Each step computes into a scratch buffer first and adds it to the
received accumulator only then, so that transfer also overlaps the step's compute.

Which part of a block a step computes (src is the K/V block's home rank):
    non-causal                     every step: all of q x all of the block
    causal, contiguous layout      src == r: causal diagonal; src < r: full; src > r: skip
    causal, zigzag layout          (rank r holds chunks r and 2P-1-r of 2P)
        step 0                     causal on the whole local block
        src < r                    all local q x the FIRST half of the block (chunk src)
        src > r                    the SECOND half of local q (chunk 2P-1-r) x all of it
    so under zigzag every step costs the same on every rank (ring-flash-attention's
    zigzag variant). Half-blocks are views (narrow along the sequence).

Bytes sent per rank: forward (P-1) x (k + v bytes); backward (P-1) x (k + v bytes) for
K|V plus (P-1) x fp32 (dk + dv) for the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqpar_kernels.comm.ring import GRAD_KV_TAG, KV_TAG, DoubleBuffer, Ring

# ----------------------------------------------------------------------------------
# The step schedule
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepBlock:
    """What one ring step computes: local q rows [q_start, q_start + q_len) against the
    first kv_len rows of the visiting K/V block, causal (diagonal) or full."""

    q_start: int
    q_len: int
    kv_len: int
    causal: bool


def step_block(step: int, rank: int, world_size: int, seqlen: int, causal: bool, zigzag: bool):
    """The StepBlock of ring step `step` on `rank`, or None when the step computes
    nothing (contiguous causal, block from a later rank). See the module docstring."""
    src = (rank - step) % world_size
    if not causal:
        return StepBlock(0, seqlen, seqlen, False)
    if src == rank:
        return StepBlock(0, seqlen, seqlen, True)
    if not zigzag:
        return StepBlock(0, seqlen, seqlen, False) if src < rank else None
    half = seqlen // 2
    if src < rank:  # chunks (src, 2P-1-src): only chunk src precedes both local chunks
        return StepBlock(0, seqlen, half, False)
    # src > r: both of the block's chunks precede local chunk 2P-1-r, none precedes chunk r
    return StepBlock(half, seqlen - half, seqlen, False)


# ----------------------------------------------------------------------------------
# K|V packing: one flat buffer per block
# ----------------------------------------------------------------------------------


def _pack_pair(a: torch.Tensor, b: torch.Tensor, dtype=None) -> torch.Tensor:
    """a and b (same shape, any strides) copied into one flat contiguous buffer."""
    numel = a.numel()
    buffer = torch.empty(2 * numel, dtype=dtype or a.dtype, device=a.device)
    buffer[:numel].view(a.shape).copy_(a)
    buffer[numel:].view(b.shape).copy_(b)
    return buffer


def _unpack_pair(buffer: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The two (contiguous) views of a buffer written by _pack_pair."""
    numel = buffer.numel() // 2
    return buffer[:numel].view(shape), buffer[numel:].view(shape)


# ----------------------------------------------------------------------------------
# The loops
# ----------------------------------------------------------------------------------


def ring_forward(q, k, v, causal, scale, zigzag, group_name, steps, exchange=Ring):
    """(out, lse) of this rank's q against every rank's K/V (seqpar::ring_attention_forward).

    steps: the per-step kernels (seqpar_kernels.parallel.ring_steps); exchange: makes the
    rings, exchange(group_name, tag) -> comm.ring.Ring or anything with its interface
    (seqpar_kernels.testing replaces it to time the compute alone)."""
    batch, seqlen, heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, seqlen), float("-inf"), dtype=torch.float32, device=q.device)
    ring = exchange(group_name, KV_TAG)
    if q.numel() == 0 or k.numel() == 0:
        return out.to(q.dtype), lse  # nothing to attend; every rank has the same shapes
    world_size, rank = ring.world_size, ring.rank
    kv = DoubleBuffer(ring, _pack_pair(k, v)) if world_size > 1 else None
    for step in range(world_size):
        if step + 1 < world_size:
            kv.post()  # the next block travels while this one is computed
        k_block, v_block = (k, v) if step == 0 else _unpack_pair(kv.current, k.shape)
        block = step_block(step, rank, world_size, seqlen, causal, zigzag)
        if block is not None:
            steps.forward(
                q.narrow(1, block.q_start, block.q_len),
                k_block.narrow(1, 0, block.kv_len),
                v_block.narrow(1, 0, block.kv_len),
                out.narrow(1, block.q_start, block.q_len),
                lse.narrow(2, block.q_start, block.q_len),
                scale,
                block.causal,
            )
        if step + 1 < world_size:
            kv.advance()
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, causal, scale, zigzag, group_name, steps, exchange=Ring):
    """(dq, dk, dv) of ring_forward's out (seqpar::ring_attention_backward); out and lse
    are its final results. steps, exchange: as in ring_forward."""
    seqlen = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grad_kv_numel = 2 * k.numel()
    fp32 = dict(dtype=torch.float32, device=q.device)
    own = torch.zeros(grad_kv_numel, **fp32)  # dK|dV of the local block from step 0
    ring = exchange(group_name, KV_TAG)
    world_size, rank = ring.world_size, ring.rank
    if q.numel() == 0 or k.numel() == 0:
        return _backward_outputs(dq, own, q, k)
    delta = steps.prepare_backward(out, dout)
    if world_size > 1:
        kv = DoubleBuffer(ring, _pack_pair(k, v))
        grad_ring = exchange(group_name, GRAD_KV_TAG)
        scratch = torch.empty(grad_kv_numel, **fp32)
        # The travelling accumulator: sent from one, received into the other.
        travelling, arriving = torch.zeros(grad_kv_numel, **fp32), torch.empty(grad_kv_numel, **fp32)
        grad_work = None
    for step in range(world_size):
        if step + 1 < world_size:
            kv.post()
        k_block, v_block = (k, v) if step == 0 else _unpack_pair(kv.current, k.shape)
        block = step_block(step, rank, world_size, seqlen, causal, zigzag)
        # Step 0: the home share; step 1: starts the accumulator that leaves; later
        # steps: a scratch share, added to the accumulator once it has arrived.
        target = own if step == 0 else travelling if step == 1 else scratch
        if step >= 2 and block is not None:
            scratch.zero_()
        if block is not None:
            dk_target, dv_target = _unpack_pair(target, k.shape)
            q_rows = lambda x: x.narrow(1, block.q_start, block.q_len)  # noqa: E731
            kv_rows = lambda x: x.narrow(1, 0, block.kv_len)  # noqa: E731
            steps.backward(
                q_rows(dout), q_rows(q), kv_rows(k_block), kv_rows(v_block), q_rows(out),
                lse.narrow(2, block.q_start, block.q_len),
                None if delta is None else delta.narrow(2, block.q_start, block.q_len),
                q_rows(dq), kv_rows(dk_target), kv_rows(dv_target),
                scale, block.causal,
            )  # fmt: skip
        if step >= 2:
            grad_work.wait()
            travelling, arriving = arriving, travelling
            if block is not None:
                travelling.add_(scratch)
        if step >= 1:
            grad_work = grad_ring.start(travelling, arriving)
        if step + 1 < world_size:
            kv.advance()
    if world_size > 1:
        grad_work.wait()  # the local block's accumulator is home
        own.add_(arriving)
    return _backward_outputs(dq, own, q, k)


def _backward_outputs(dq, grad_kv, q, k):
    dk, dv = _unpack_pair(grad_kv, k.shape)
    # copy=True: dk and dv must not be views of one buffer (outputs of an op own memory).
    return dq.to(q.dtype), dk.to(q.dtype, copy=True), dv.to(q.dtype, copy=True)
