"""seqpar::local_attention_forward and seqpar::local_attention_backward: attention in one
process under any mask of the package (packed documents, windows, chunks, softcap,
sinks), with their fake kernels and autograd.

What they run: engine/local_attention.py. Public entry point: ulysses_attention, whose
local attention they are when it is not plain SDPA (parallel/ulysses.py). Tests:
tests/test_varlen.py, tests/test_attention_variants.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from seqpar_kernels.engine.attention_ops import mask_of, register_attention_autograd
from seqpar_kernels.engine.local_attention import local_backward, local_forward
from seqpar_kernels.engine.steps import StepSpec
from seqpar_kernels.ops.cuda_graphs import refuse_capture, uncapturable_custom_op


@uncapturable_custom_op("seqpar::local_attention_forward", mutates_args=())
def local_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    cu_seqlens: Optional[torch.Tensor] = None,
    window_left: int = -1,
    window_right: int = -1,
    chunk_size: int = 0,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over the keys its mask gives it, in one process.

    q: (B, S, H, D); k: (B, S, H_kv, D); v: (B, S, H_kv, Dv), H % H_kv == 0; any strides.
    cu_seqlens: None, or (documents + 1,) int64 CPU document bounds from 0 to S (batch 1).
    causal, window_left, window_right, chunk_size (0: none): the AttentionMask as
    engine/attention_ops.py mask_arguments encodes it; softcap (0: none), sinks ((H,) or
    None): ring_attention_forward's.
    Returns out (B, S, H, Dv) contiguous in q's dtype and lse (B, H, S) fp32 (natural log)."""
    refuse_capture("seqpar::local_attention_forward", q)
    mask = mask_of(causal, cu_seqlens, window_left, window_right, chunk_size)
    return local_forward(q, k, v, mask, StepSpec(softmax_scale, softcap), sinks)


@local_attention_forward.register_fake
def _local_attention_forward_fake(q, k, v, *args, **kwargs):
    out_shape = (*q.shape[:3], v.shape[3])
    return q.new_empty(out_shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@uncapturable_custom_op("seqpar::local_attention_backward", mutates_args=())
def local_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    cu_seqlens: Optional[torch.Tensor] = None,
    window_left: int = -1,
    window_right: int = -1,
    chunk_size: int = 0,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of local_attention_forward's out: (dq, dk, dv, dsinks), contiguous, dq,
    dk, dv in q's dtype shaped like q, k, v; dsinks in the sinks' dtype ((0,) without)."""
    refuse_capture("seqpar::local_attention_backward", q)
    mask = mask_of(causal, cu_seqlens, window_left, window_right, chunk_size)
    dq, dk, dv, dsinks = local_backward(dout, q, k, v, out, lse, mask, StepSpec(softmax_scale, softcap), sinks)
    dsinks = q.new_empty((0,)) if dsinks is None else dsinks
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks


@local_attention_backward.register_fake
def _local_attention_backward_fake(
    dout, q, k, v, out, lse, causal, softmax_scale, cu_seqlens=None, window_left=-1, window_right=-1, chunk_size=0,
    softcap=0.0, sinks=None,
):  # fmt: skip
    dsinks = q.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


register_attention_autograd(local_attention_forward, local_attention_backward)
