"""The ring attention driver: the step schedule and the forward and backward loops.

Run by the custom ops seqpar::ring_attention_forward and seqpar::ring_attention_backward
(engine/ring_ops.py); the public entry point and its argument checks are
seqpar_kernels/parallel/ring.py, the per-step kernels engine/step_backends.py, the P2P
exchange seqpar_kernels/comm/ring.py.

The ring (forward). Rank r holds q, k, v of its sequence piece. K and V are packed once
into one flat buffer that travels the ring (comm/ring.py: send to r+1, receive from
r-1). At step i the rank holds the K/V block of rank src = (r - i) mod P; step i's
exchange (for step i+1) is posted BEFORE step i's attention runs, so the transfer
overlaps the compute, and waited for only after it. Each step folds its block into a
running fp32 (out, lse) that starts at (0, -inf), with the step backend's kernels
(engine/step_backends.py: the fused Triton step kernels, or torch's own attention
kernels followed by the attention_merge_ kernel).

The ring (backward). With the FINAL (out, lse), the probabilities of any block are
exp(s - lse), so each step's gradients are independent and add up (CUDA: the Triton
backward kernels, delta = rowsum(dout * out) computed once; aten: the library kernels'
backward given the final out and lse, which rebuilds the same probabilities). dq stays
home in fp32. The fp32 dK|dV accumulator of a block travels the ring behind its K|V
block: the home rank keeps its own (step 0) share; the accumulator starts at rank r+1
(step 1), collects every rank's share and arrives home after P-1 sends, where the home
share is added. The step kernels compute dq (and library kernels the block's dK|dV into
tensors of their own) first and wait for the arriving accumulator only then, so that
transfer overlaps the step's compute; they add their share straight into it (no
scratch buffer to zero and add).

Pieces may differ in length by rank (empty ones too): every buffer has room for the
largest block, and each exchange sends and receives exactly the blocks' rows. Under
zigzag the 2P chunks follow torch.tensor_split of the global length.

Which part of a block a step computes: the StepMask of the two slots' rows under the
attention mask (engine/step_masks.py StepMasks, rows placed by seqpar_kernels/layouts.py):
    non-causal                     every step: all of q x all of the block
    causal, contiguous layout      src == r: causal diagonal; src < r: full; src > r: skip
    causal, zigzag layout          (rank r holds chunks r and 2P-1-r of 2P)
        step 0                     causal on the whole local block (its rows are in
                                   global order: chunk r, then chunk 2P-1-r)
        src < r                    all local q x the block's FIRST chunk (chunk src)
        src > r                    local q's SECOND chunk (2P-1-r) x all of the block
    so under zigzag every step costs the same on every rank (ring-flash-attention's
    zigzag variant; to a row where the chunks differ by one). Chunks are views (narrow
    along the sequence). A step with no rows or no keys launches nothing.
    packed documents               only the rows of documents both ranks hold, each
                                   query against the keys of its own document (causal:
                                   those at or before it); a step with none computes
                                   nothing. On CPUs the step kernels run once per
                                   (query stretch, key stretch) of a document, small
                                   neighbouring ones joined under a mask (step_masks.coalesce);
                                   on GPUs once per step, with each query row's interval
                                   of key rows.

Bytes sent by rank r (seqpar_kernels.traffic.ring_bytes holds the formula): a block
goes on at steps 0..last-1 and its dK|dV accumulator at steps 1..last; with last = P-1,
n_j the rows of rank j and N their sum, rank r never sends the block of rank r+1, the
last it receives, nor the accumulator of its own block:
    forward   (N - n_{r+1}) x B x H_kv x (D + Dv) x element size            (K|V)
    backward  the same for K|V, plus (N - n_r) x B x H_kv x (D + Dv) x 4    (fp32 dK|dV)
(Dv: v's head dim, D's unless the call is multi-head latent attention).
"""

from __future__ import annotations

import math

import torch

from seqpar_kernels.comm.ring import GRAD_KV_TAG, KV_TAG, DoubleBuffer, Ring
from seqpar_kernels.engine.step_backends import StepBackend
from seqpar_kernels.engine.step_masks import StepMasks
from seqpar_kernels.engine.steps import (
    StepSpec,
    backward_inputs,
    backward_step,
    first_step_writes_every_row,
    forward_step,
    merge_sinks_,
)

# ----------------------------------------------------------------------------------
# K|V packing: one flat buffer per block
# ----------------------------------------------------------------------------------


def _pack_pair(a: torch.Tensor, b: torch.Tensor, capacity: int) -> torch.Tensor:
    """a then b (any shapes and strides: K and V, whose head dims may differ) copied into
    the front of one flat contiguous buffer of `capacity` elements (room for the largest
    block of the ring)."""
    buffer = torch.empty(capacity, dtype=a.dtype, device=a.device)
    buffer[: a.numel()].view(a.shape).copy_(a)
    buffer[a.numel() : a.numel() + b.numel()].view(b.shape).copy_(b)
    return buffer


def _unpack_pair(buffer: torch.Tensor, shapes) -> tuple[torch.Tensor, torch.Tensor]:
    """The two (contiguous) views of shapes = (K's, V's) at the front of a buffer written
    by _pack_pair (or laid out like one)."""
    k_numel, v_numel = (math.prod(shape) for shape in shapes)
    return buffer[:k_numel].view(shapes[0]), buffer[k_numel : k_numel + v_numel].view(shapes[1])


def _block_shapes(k: torch.Tensor, v: torch.Tensor, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a K and a V block of `length` rows: (B, length, H_kv, D) and
    (B, length, H_kv, Dv)."""
    return (k.shape[0], length, *k.shape[2:]), (v.shape[0], length, *v.shape[2:])


def _block_numels(k: torch.Tensor, v: torch.Tensor, rank: int, lengths) -> list[int]:
    """Elements of the K|V (or dK|dV) buffer of the block `rank` holds at each step."""
    world_size = len(lengths)
    return [sum(math.prod(shape) for shape in _block_shapes(k, v, lengths[(rank - step) % world_size]))
            for step in range(world_size)]  # fmt: skip


# ----------------------------------------------------------------------------------
# The loops
# ----------------------------------------------------------------------------------


def _check_slots(ring, seqlen: int, masks: StepMasks) -> None:
    assert len(masks.lengths) == ring.world_size and masks.lengths[ring.rank] == seqlen, (
        masks.lengths, ring.rank, seqlen)  # fmt: skip


def ring_forward(q, k, v, spec: StepSpec, group_name, steps: StepBackend, masks: StepMasks, exchange=Ring, sinks=None):
    """(out, lse) of this rank's q against every rank's K/V (seqpar::ring_attention_forward).

    q: (B, S, H, D); k: (B, S, H_kv, D); v: (B, S, H_kv, Dv) (Dv may differ from D).
    spec: the softmax scale (> 0) and soft cap of every step (engine/steps.py).
    steps: the step backend (engine/step_backends.py); masks: the attention mask over
    the ranks' rows (slot r = rank r's global ranges; dense_step_masks for one dense
    sequence); exchange: makes the rings, exchange(group_name, tag) -> comm.ring.Ring or
    anything with its interface (seqpar_kernels.testing replaces it to time the compute
    alone). sinks: None, or (H,) per-head logits that join each row's softmax
    denominator (merged into the final (out, lse) in fp32).
    Returns out (B, S, H, Dv) in q's dtype and lse (B, H, S) fp32."""
    batch, seqlen, heads, _ = q.shape
    out_shape = (batch, seqlen, heads, v.shape[3])
    ring = exchange(group_name, KV_TAG)
    lse = torch.full((batch, heads, seqlen), float("-inf"), dtype=torch.float32, device=q.device)
    # Every rank agrees on batch, heads and head dims, so every rank returns here alike;
    # an empty piece (seqlen 0) still relays the other ranks' blocks below.
    if batch * heads * k.shape[2] * q.shape[3] == 0:
        return q.new_zeros(out_shape), lse
    rank = ring.rank
    _check_slots(ring, seqlen, masks)
    last = last_step(masks, ring.world_size)
    # The first step's kernels may fill the running output themselves: then it starts
    # uninitialised (a zero fill is a pass over it that step 0 would overwrite).
    first_step_writes = first_step_writes_every_row(steps, masks.step(rank, rank), seqlen)
    out = (torch.empty if first_step_writes else torch.zeros)(out_shape, dtype=torch.float32, device=q.device)
    numels = _block_numels(k, v, rank, masks.lengths)[: last + 1]
    kv = DoubleBuffer(ring, _pack_pair(k, v, max(numels)), numels) if last > 0 else None
    for step in range(last + 1):
        if step < last:
            kv.post()  # the next block travels while this one is computed
        src = (rank - step) % ring.world_size
        k_block, v_block = (k, v) if step == 0 else _unpack_pair(kv.current, _block_shapes(k, v, masks.lengths[src]))
        mask = masks.step(rank, src)
        if mask is not None:
            first = step == 0 and first_step_writes
            forward_step(steps, mask, q, k_block, v_block, out, lse, spec, first_step=first)
        if step < last:
            kv.advance()
    if sinks is not None:
        merge_sinks_(out, lse, sinks)
    return out.to(q.dtype), lse


def last_step(masks: StepMasks, world_size: int) -> int:
    """The ring's last step: P - 1, or, under a local mask (windows, chunks), the
    farthest ring offset at which some rank still sees keys (StepMasks.reach): no block
    travels further, and the dK|dV accumulators go home from there."""
    return masks.reach() if masks.mask.is_local else world_size - 1


def ring_backward(dout, q, k, v, out, lse, spec: StepSpec, group_name, steps: StepBackend, masks: StepMasks,
                  exchange=Ring, grad_lse=None):  # fmt: skip
    """(dq, dk, dv) of ring_forward's out (seqpar::ring_attention_backward); out and lse
    are its final results (sinks merged). spec, steps, masks, exchange: as in
    ring_forward. grad_lse: None, or the gradient of lse (B, H, S) fp32 too."""
    batch, seqlen, heads, _ = q.shape
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    fp32 = dict(dtype=torch.float32, device=q.device)
    own = torch.zeros(k.numel() + v.numel(), **fp32)  # dK|dV of the local block from step 0
    ring = exchange(group_name, KV_TAG)
    world_size, rank = ring.world_size, ring.rank
    if batch * heads * k.shape[2] * q.shape[3] == 0:  # as in ring_forward
        return _backward_outputs(dq, own, q, k, v)
    _check_slots(ring, seqlen, masks)
    last = last_step(masks, world_size)
    dout, out, delta = backward_inputs(steps, out, dout, grad_lse)
    if last > 0:
        numels = _block_numels(k, v, rank, masks.lengths)[: last + 1]
        capacity = max(numels)
        kv = DoubleBuffer(ring, _pack_pair(k, v, capacity), numels)
        grad_ring = exchange(group_name, GRAD_KV_TAG)
        # The travelling accumulator: sent from one, received into the other. At step
        # i >= 1 it belongs to the block held at step i (numels[i]); the one received
        # then belongs to the block of step i + 1, or after the last step to the local
        # block, whose accumulator comes home from the rank `last` places on.
        travelling, arriving = torch.zeros(capacity, **fp32), torch.empty(capacity, **fp32)
        grad_work = None
    for step in range(last + 1):
        if step < last:
            kv.post()
        src = (rank - step) % world_size
        block_shapes = _block_shapes(k, v, masks.lengths[src])
        k_block, v_block = (k, v) if step == 0 else _unpack_pair(kv.current, block_shapes)
        mask = masks.step(rank, src)
        # Where this step's dK|dV share goes. Step 0: the home share; step 1: starts the
        # accumulator that leaves; later steps: the accumulator arriving from the
        # previous rank, waited for only when the step kernels ask for it (after dq and
        # whatever else they compute first), so the transfer overlaps that compute and
        # the share is added straight into it: no scratch buffer to zero and add.
        arrived = step < 2

        def grad_kv():
            nonlocal arrived, travelling, arriving
            if not arrived:
                grad_work.wait()
                travelling, arriving = arriving, travelling
                arrived = True
            return _unpack_pair(own if step == 0 else travelling, block_shapes)

        if mask is not None:
            backward_step(steps, mask, dout, q, k_block, v_block, out, lse, delta, dq, grad_kv, spec)
        grad_kv()  # a step that computed nothing still relays the accumulator
        if step >= 1:
            if step < last:  # on to the next holder of this block
                grad_work = grad_ring.start(travelling[: numels[step]], arriving[: numels[step + 1]])
            else:  # home, `last` places back; the local block's comes from `last` places on
                grad_work = grad_ring.start(travelling[: numels[step]], arriving[: numels[0]], world_size - last)
        if step < last:
            kv.advance()
    if last > 0:
        grad_work.wait()  # the local block's accumulator is home
        own.add_(arriving[: own.numel()])
    return _backward_outputs(dq, own, q, k, v)


def _backward_outputs(dq, grad_kv, q, k, v):
    dk, dv = _unpack_pair(grad_kv, (k.shape, v.shape))
    # copy=True: dk and dv must not be views of one buffer (outputs of an op own memory).
    return dq.to(q.dtype), dk.to(q.dtype, copy=True), dv.to(q.dtype, copy=True)
