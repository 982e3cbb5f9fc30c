"""seqpar::ring_attention_forward and seqpar::ring_attention_backward: Python custom ops
(they call torch.distributed), with their fake kernels and autograd.

The group travels by name, as in ops/all_to_all.py. What the ops run: the ring driver
(engine/ring_driver.py) with a step backend (engine/step_backends.py) over the attention
mask their arguments describe (engine/step_masks.py). Public entry point and argument checks:
seqpar_kernels/parallel/ring.py. Tests: tests/test_ring_attention.py.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from seqpar_kernels.engine.attention_ops import decode_segments, mask_of, register_attention_autograd
from seqpar_kernels.engine.ring_driver import ring_backward, ring_forward
from seqpar_kernels.engine.step_backends import step_kernels_for
from seqpar_kernels.engine.step_masks import StepMasks, dense_step_masks, step_masks_of
from seqpar_kernels.engine.steps import StepSpec, sinks_gradient
from seqpar_kernels.ops.all_to_all import register_as_collective
from seqpar_kernels.ops.cuda_graphs import refuse_capture, uncapturable_custom_op


@uncapturable_custom_op("seqpar::ring_attention_forward", mutates_args=())
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
    window_left: int = -1,
    window_right: int = -1,
    chunk_size: int = 0,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's q over the K/V of every rank of the group.

    q: (B, S, H, D); k: (B, S, H_kv, D); v: (B, S, H_kv, Dv), H % H_kv == 0 (Dv may
    differ from D: multi-head latent attention); every rank the same B, H, H_kv, D, Dv;
    S may differ by rank (checked by seqpar_kernels.parallel.ring.ring_attention, not
    here).
    zigzag: the ranks hold the zigzag layout (rank r holds chunks r and 2P-1-r of the 2P
    chunks torch.tensor_split cuts the sequence into).
    step_kernels: which backend computes each step (engine/step_backends.py: a name of
    STEP_KERNELS, or AUTO).
    seq_lens: every rank's S, in group rank order.
    causal, cu_seqlens, window_left, window_right, chunk_size: the AttentionMask
    (seqpar_kernels/attention_mask.py) as engine/attention_ops.py mask_arguments encodes
    it; positions of the sequence (of the document under cu_seqlens).
    segments: with cu_seqlens, the (count, 3) int64 CPU rows (rank, global start, length)
    of the ranges each rank holds in increasing order (attention_ops.encode_segments);
    zigzag is then False.
    softcap: scores capped as softcap * tanh(s / softcap) (0: not).
    sinks: None, or (H,) per-head logits joining each row's softmax denominator.
    Returns out (B, S, H, Dv) contiguous in q's dtype and lse (B, H, S) fp32 (natural
    log, sinks included; -inf for a row that saw no key and has no sink, whose out is 0)."""
    refuse_capture("seqpar::ring_attention_forward", q)
    masks = _step_masks(causal, zigzag, seq_lens, cu_seqlens, segments, window_left, window_right, chunk_size)
    steps = step_kernels_for(step_kernels, q, softcap > 0 or masks.mask.is_local)
    return ring_forward(q, k, v, StepSpec(softmax_scale, softcap), group_name, steps, masks, sinks=sinks)


def _step_masks(causal, zigzag, seq_lens, cu_seqlens, segments, window_left, window_right, chunk_size) -> StepMasks:
    """The attention mask over the ranks' rows that the ops' arguments describe."""
    mask = mask_of(causal, cu_seqlens, window_left, window_right, chunk_size)
    if cu_seqlens is None:
        return dense_step_masks(mask, seq_lens, zigzag)
    masks = step_masks_of(mask, decode_segments(segments, len(seq_lens)))
    assert list(masks.lengths) == list(seq_lens), (masks.lengths, seq_lens)
    return masks


register_as_collective(torch.ops.seqpar.ring_attention_forward.default)


@ring_attention_forward.register_fake
def _ring_attention_forward_fake(q, k, v, *args, **kwargs):
    batch, seqlen, heads, _ = q.shape
    return q.new_empty((batch, seqlen, heads, v.shape[3])), q.new_empty((batch, heads, seqlen), dtype=torch.float32)


@uncapturable_custom_op("seqpar::ring_attention_backward", mutates_args=())
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
    window_left: int = -1,
    window_right: int = -1,
    chunk_size: int = 0,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    grad_lse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ring_attention_forward's outputs: (dq, dk, dv, dsinks), contiguous,
    dq, dk, dv in q's dtype and shaped like q, k, v; dsinks this rank's share of the
    sinks' gradient, in their dtype ((0,) without sinks). out and lse are the forward's
    (final) results; grad_lse: None, or lse's gradient (B, H, S) fp32 (a caller that
    merges the result with other attention by lse); dK/dV of each block accumulate in
    fp32 while they travel the ring."""
    refuse_capture("seqpar::ring_attention_backward", q)
    masks = _step_masks(causal, zigzag, seq_lens, cu_seqlens, segments, window_left, window_right, chunk_size)
    steps = step_kernels_for(step_kernels, q, softcap > 0 or masks.mask.is_local)
    spec = StepSpec(softmax_scale, softcap)
    dq, dk, dv = ring_backward(dout, q, k, v, out, lse, spec, group_name, steps, masks, grad_lse=grad_lse)
    return dq, dk, dv, _sinks_gradient(out, dout, lse, sinks, grad_lse)


def _sinks_gradient(out, dout, lse, sinks, grad_lse):
    if sinks is None:
        return out.new_empty((0,))
    return sinks_gradient(out, dout, lse, sinks, grad_lse)


register_as_collective(torch.ops.seqpar.ring_attention_backward.default)


@ring_attention_backward.register_fake
def _ring_attention_backward_fake(
    dout, q, k, v, out, lse, causal, softmax_scale, zigzag, group_name, step_kernels, seq_lens, cu_seqlens=None,
    segments=None, window_left=-1, window_right=-1, chunk_size=0, softcap=0.0, sinks=None, grad_lse=None,
):  # fmt: skip
    dsinks = q.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


register_attention_autograd(ring_attention_forward, ring_attention_backward, lse_differentiable=True)
