"""Attention over packed documents in one process: the local attention of Ulysses with
varlen (each rank holds whole documents of its heads after the exchange).

    CUDA, fp16/bf16, head dim a multiple of 8 (<= 256)   torch's flash-attention varlen
        entry points (aten._flash_attention_forward / _backward with cu_seqlens): one
        launch, no padding, GQA kv heads as they are.
    otherwise (CPU; fp32 or other head dims on CUDA)    the ring's step backends
        (engine/step_backends.py) over the document mask of one slot holding the whole
        sequence (engine/masks.py): on CPUs aten's flash kernel per document and causal
        block, on GPUs one Triton launch with per-row key intervals.

Registered as seqpar::varlen_attention_forward / _backward (engine/varlen_ops.py).
"""

from __future__ import annotations

import torch

from seqpar_kernels.engine.masks import AttentionMask, step_masks_of
from seqpar_kernels.engine.ring_driver import backward_step, forward_step
from seqpar_kernels.engine.step_backends import AUTO, step_kernels_for


def _uses_flash(q: torch.Tensor) -> bool:
    # torch's flash kernels take fp16/bf16 and head dims that are multiples of 8 up to 256.
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0


def _mask(cu_seqlens: torch.Tensor, total: int, causal: bool):
    """The StepMask of the whole sequence against itself (one slot), or None."""
    mask = AttentionMask(causal, tuple(cu_seqlens.tolist()))
    return step_masks_of(mask, [((0, total),)]).step(0, 0)


def _flash_arguments(cu_seqlens: torch.Tensor, device):
    bounds = cu_seqlens.to(device=device, dtype=torch.int32)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return bounds, longest


def _tokens_major(x: torch.Tensor) -> torch.Tensor:
    """(1, S, H, D) -> the (S, H, D) view the flash kernels take (unit stride along D)."""
    x = x[0]
    return x if x.stride(-1) == 1 else x.contiguous()


def varlen_forward(q, k, v, causal: bool, scale: float, cu_seqlens: torch.Tensor):
    """q: (1, S, H, D), k, v: (1, S, H_kv, D), any strides; cu_seqlens: (documents + 1,)
    int64 CPU bounds ending at S. Returns out (1, S, H, D) in q's dtype, contiguous, and
    lse (1, H, S) fp32 (-inf for no row: every row sees itself or its document)."""
    total = q.shape[1]
    if _uses_flash(q):
        bounds, longest = _flash_arguments(cu_seqlens, q.device)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            _tokens_major(q), _tokens_major(k), _tokens_major(v), bounds, bounds, longest, longest, 0.0,
            causal, False, scale=scale,
        )  # fmt: skip
        return out.unsqueeze(0), lse.unsqueeze(0)  # (S, H, D), (H, S)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((1, q.shape[2], total), float("-inf"), dtype=torch.float32, device=q.device)
    mask = _mask(cu_seqlens, total, causal)
    if mask is not None and q.shape[2] * q.shape[3] > 0:
        forward_step(step_kernels_for(AUTO, q), mask, q, k, v, out, lse, scale)
    return out.to(q.dtype), lse


def varlen_backward(dout, q, k, v, out, lse, causal: bool, scale: float, cu_seqlens: torch.Tensor):
    """(dq, dk, dv) of varlen_forward's out, shaped like q, k, v, in q's dtype."""
    total = q.shape[1]
    if _uses_flash(q):
        bounds, longest = _flash_arguments(cu_seqlens, q.device)
        # No dropout: the random-number state is never read.
        unused_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            _tokens_major(dout), _tokens_major(q), _tokens_major(k), _tokens_major(v), _tokens_major(out),
            lse[0].contiguous(), bounds, bounds, longest, longest, 0.0, causal, unused_state,
            torch.empty(0, device=q.device), scale=scale,
        )  # fmt: skip
        return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)
    steps = step_kernels_for(AUTO, q)
    fp32 = dict(dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.zeros(q.shape, **fp32), torch.zeros(k.shape, **fp32), torch.zeros(v.shape, **fp32)
    mask = _mask(cu_seqlens, total, causal)
    if mask is not None and q.shape[2] * q.shape[3] > 0:
        delta = steps.prepare_backward(out, dout)
        backward_step(steps, mask, dout, q, k, v, out, lse, delta, dq, lambda: (dk, dv), scale)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
