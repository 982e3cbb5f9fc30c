"""What the engine's attention custom ops share (seqpar::ring_attention_* in ring_ops.py,
seqpar::local_attention_* in local_ops.py): how an attention mask and a packed layout
travel as op arguments, and the autograd of a forward op through its backward op.

    mask_arguments(mask, cu_seqlens_tensor)   an AttentionMask as the ops' keyword arguments
    mask_of(causal, cu_seqlens, ...)          those arguments back as the AttentionMask
    encode_segments / decode_segments         every slot's global ranges as a tensor, and back
    register_attention_autograd(fwd, bwd)     fwd differentiable in q, k, v and the sinks (and lse)

The op schemas take primitive arguments (torch.library infers schemas from them): the
mask's document bounds and a packed layout travel as CPU int64 tensors, so that a new
layout is new data for torch.compile, not a new graph.
"""

from __future__ import annotations

import torch

from seqpar_kernels.attention_mask import AttentionMask


def mask_arguments(mask: AttentionMask, cu_seqlens_tensor: torch.Tensor | None = None) -> dict:
    """The ops' keyword arguments for `mask`: causal, window_left, window_right,
    chunk_size (0: none) and cu_seqlens (cu_seqlens_tensor: the (documents + 1,) int64
    CPU tensor of mask.cu_seqlens, made once per layout by its caller)."""
    assert (cu_seqlens_tensor is None) == (mask.cu_seqlens is None), "documents need their cu_seqlens tensor"
    window_left, window_right = mask.window
    return dict(causal=mask.causal, cu_seqlens=cu_seqlens_tensor, window_left=window_left, window_right=window_right,
                chunk_size=mask.chunk_size or 0)  # fmt: skip


def mask_of(causal: bool, cu_seqlens, window_left: int, window_right: int, chunk_size: int) -> AttentionMask:
    """The AttentionMask of the ops' arguments (mask_arguments' inverse)."""
    documents = None if cu_seqlens is None else tuple(cu_seqlens.tolist())
    return AttentionMask(causal, (window_left, window_right), chunk_size or None, documents)


def encode_segments(slots) -> torch.Tensor:
    """Every slot's global ranges as one (count, 3) int64 CPU tensor of (slot, start,
    length) rows: how the ring ops carry a packed layout."""
    rows = [(slot, start, length) for slot, ranges in enumerate(slots) for start, length in ranges]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 3)


def decode_segments(segments: torch.Tensor, slot_count: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """encode_segments' rows back as every slot's ranges."""
    per_slot: list[list[tuple[int, int]]] = [[] for _ in range(slot_count)]
    for slot, start, length in segments.tolist():
        per_slot[slot].append((start, length))
    return tuple(tuple(slot) for slot in per_slot)


def register_attention_autograd(forward_op, backward_op, lse_differentiable: bool = False) -> None:
    """Makes forward_op, (q, k, v, *args) -> (out, lse) whose last argument is the sinks
    (or None), differentiable in q, k, v and the sinks through backward_op, (dout, q, k,
    v, out, lse, *args[, grad_lse=]) -> (dq, dk, dv, dsinks). lse_differentiable: lse's
    gradient goes to backward_op as grad_lse; else lse is a non-differentiable output (as
    flash-attention's returned lse) and its gradient, if any, is ignored."""

    def setup_context(ctx, inputs, output):
        q, k, v, *args = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = tuple(args)
        # An output nothing read (lse, mostly) gets None, not zeros: a zero grad_lse would
        # still send the backward down its lse path (one more column for the aten kernels).
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        no_grads = [None] * len(ctx.args)
        more = {}
        if lse_differentiable and grad_lse is not None:
            more = dict(grad_lse=grad_lse.float())
            grad_out = torch.zeros_like(out) if grad_out is None else grad_out
        if grad_out is None:
            return None, None, None, *no_grads
        sinks = ctx.args[-1]
        # The sinks as data: the backward op is not differentiated again.
        args = (*ctx.args[:-1], None if sinks is None else sinks.detach())
        dq, dk, dv, dsinks = backward_op(grad_out, q, k, v, out, lse, *args, **more)
        if sinks is not None:
            no_grads[-1] = dsinks
        return dq, dk, dv, *no_grads

    forward_op.register_autograd(backward, setup_context=setup_context)
