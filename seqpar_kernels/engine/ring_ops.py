"""seqpar::ring_attention_forward and seqpar::ring_attention_backward: Python custom ops
(they call torch.distributed), with their fake kernels and autograd.

The group travels by name, as in ops/all_to_all.py. What the ops run: the ring driver
(engine/ring_driver.py) with a step backend (engine/step_backends.py) over the attention
mask their arguments describe (engine/masks.py). Public entry point and argument checks:
seqpar_kernels/parallel/ring.py. Tests: tests/test_ring_attention.py.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from seqpar_kernels.engine.masks import AttentionMask, StepMasks, decode_segments, step_masks_of
from seqpar_kernels.engine.ring_driver import dense_step_masks, ring_backward, ring_forward
from seqpar_kernels.engine.step_backends import step_kernels_for
from seqpar_kernels.ops.all_to_all import register_as_collective


@torch.library.custom_op("seqpar::ring_attention_forward", mutates_args=())
def ring_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    zigzag: bool,
    group_name: str,
    step_kernels: str,
    seq_lens: List[int],  # typing.List: torch 2.6's schema inference knows no list[int]
    cu_seqlens: Optional[torch.Tensor] = None,
    segments: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's q over the K/V of every rank of the group.

    q: (B, S, H, D); k, v: (B, S, H_kv, D), H % H_kv == 0; every rank the same B, H,
    H_kv, D; S may differ by rank (checked by seqpar_kernels.parallel.ring.ring_attention,
    not here).
    zigzag: causal positions follow the zigzag layout (rank r holds chunks r and 2P-1-r
    of the 2P chunks torch.tensor_split cuts the sequence into). Ignored when not causal.
    step_kernels: which backend computes each step (engine/step_backends.py: a name of
    STEP_KERNELS, or AUTO).
    seq_lens: every rank's S, in group rank order.
    cu_seqlens, segments: packed documents (None: one dense sequence). cu_seqlens: the
    (D + 1,) int64 CPU document bounds of the global sequence; segments: (count, 3)
    int64 CPU rows (rank, global start, length), the ranges each rank holds in
    increasing order (engine/masks.py encode_segments). Attention stays inside
    each document; zigzag is then False.
    Returns out (B, S, H, D) contiguous in q's dtype and lse (B, H, S) fp32 (natural
    log; -inf for a row that saw no key, whose out is 0)."""
    steps = step_kernels_for(step_kernels, q)
    masks = _step_masks(causal, zigzag, seq_lens, cu_seqlens, segments)
    return ring_forward(q, k, v, softmax_scale, group_name, steps, masks)


def _step_masks(causal, zigzag, seq_lens, cu_seqlens, segments) -> StepMasks:
    """The attention mask over the ranks' rows that the ops' arguments describe."""
    if cu_seqlens is None:
        return dense_step_masks(causal, seq_lens, zigzag)
    masks = step_masks_of(AttentionMask(causal, tuple(cu_seqlens.tolist())), decode_segments(segments, len(seq_lens)))
    assert list(masks.lengths) == list(seq_lens), (masks.lengths, seq_lens)
    return masks


register_as_collective(torch.ops.seqpar.ring_attention_forward.default)


@ring_attention_forward.register_fake
def _ring_attention_forward_fake(
    q, k, v, causal, softmax_scale, zigzag, group_name, step_kernels, seq_lens, cu_seqlens=None, segments=None
):
    batch, seqlen, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen), dtype=torch.float32)


@torch.library.custom_op("seqpar::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    zigzag: bool,
    group_name: str,
    step_kernels: str,
    seq_lens: List[int],
    cu_seqlens: Optional[torch.Tensor] = None,
    segments: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ring_attention_forward's out: (dq, dk, dv), contiguous, in q's
    dtype, shaped like q, k, v. out and lse are the forward's (final) results; dK/dV
    of each block accumulate in fp32 while they travel the ring."""
    steps = step_kernels_for(step_kernels, q)
    masks = _step_masks(causal, zigzag, seq_lens, cu_seqlens, segments)
    return ring_backward(dout, q, k, v, out, lse, softmax_scale, group_name, steps, masks)


register_as_collective(torch.ops.seqpar.ring_attention_backward.default)


@ring_attention_backward.register_fake
def _ring_attention_backward_fake(
    dout,
    q,
    k,
    v,
    out,
    lse,
    causal,
    softmax_scale,
    zigzag,
    group_name,
    step_kernels,
    seq_lens,
    cu_seqlens=None,
    segments=None,
):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _forward_setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, zigzag, group_name, step_kernels, seq_lens, cu_seqlens, segments = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (causal, softmax_scale, zigzag, group_name, step_kernels, seq_lens, cu_seqlens, segments)


def _forward_backward(ctx, grad_out, grad_lse):
    # lse is treated as a non-differentiable output (as flash-attn's returned lse):
    # its gradient, if any, is ignored; ring_attention hands it out detached.
    q, k, v, out, lse = ctx.saved_tensors
    no_grads = (None,) * len(ctx.args)
    if grad_out is None:
        return None, None, None, *no_grads
    dq, dk, dv = ring_attention_backward(grad_out, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, *no_grads


ring_attention_forward.register_autograd(_forward_backward, setup_context=_forward_setup_context)
