"""seqpar::varlen_attention_forward and seqpar::varlen_attention_backward: attention over
packed documents in one process, with their fake kernels and autograd.

What they run: engine/varlen_local.py (torch's flash varlen kernels on GPUs, the ring's
step backends over the document mask otherwise). Public entry point:
ulysses_attention(varlen=plan) (parallel/ulysses.py). Tests: tests/test_varlen.py.
"""

from __future__ import annotations

import torch

from seqpar_kernels.engine.varlen_local import varlen_backward, varlen_forward


@torch.library.custom_op("seqpar::varlen_attention_forward", mutates_args=())
def varlen_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every token over the tokens of its own document (causal or not).

    q: (1, S, H, D); k, v: (1, S, H_kv, D), H % H_kv == 0; any strides.
    cu_seqlens: (documents + 1,) int64 CPU, the document bounds, from 0 to S.
    Returns out (1, S, H, D) contiguous in q's dtype and lse (1, H, S) fp32 (natural log)."""
    return varlen_forward(q, k, v, causal, softmax_scale, cu_seqlens)


@varlen_attention_forward.register_fake
def _varlen_attention_forward_fake(q, k, v, causal, softmax_scale, cu_seqlens):
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("seqpar::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of varlen_attention_forward's out: (dq, dk, dv), contiguous, in q's
    dtype, shaped like q, k, v."""
    dq, dk, dv = varlen_backward(dout, q, k, v, out, lse, causal, softmax_scale, cu_seqlens)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@varlen_attention_backward.register_fake
def _varlen_attention_backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, cu_seqlens):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, cu_seqlens = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.options = (causal, softmax_scale)


def _backward(ctx, grad_out, grad_lse):
    # lse is not differentiable (as the ring op's); its gradient, if any, is ignored.
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None
    dq, dk, dv = varlen_attention_backward(grad_out, q, k, v, out, lse, *ctx.options, cu_seqlens)
    return dq, dk, dv, None, None, None


varlen_attention_forward.register_autograd(_backward, setup_context=_setup_context)
