"""Attention in one process under any mask of the package: the local attention of
Ulysses when it is not plain (each rank holds whole sequences of its heads after the
exchange): packed documents, sliding windows, chunks, softcapped scores, sinks.

    CUDA, fp16/bf16, head dim a multiple of 8, packed documents and nothing else
        torch's flash-attention varlen entry points (aten._flash_attention_forward /
        _backward with cu_seqlens): one launch, no padding, GQA kv heads as they are.
    otherwise    the ring's step backends (engine/step_backends.py) over the mask of one
        slot holding the whole sequence (engine/step_masks.py): on CPUs aten's flash kernel
        per block (plain torch for softcapped scores), on GPUs one Triton launch with
        per-row key intervals.

Registered as seqpar::local_attention_forward / _backward (engine/local_ops.py).
"""

from __future__ import annotations

import torch

from seqpar_kernels.attention_mask import AttentionMask
from seqpar_kernels.engine.step_backends import AUTO, step_kernels_for
from seqpar_kernels.engine.step_masks import step_masks_of
from seqpar_kernels.engine.steps import StepSpec, backward_step, forward_step, merge_sinks_, sinks_gradient


def _uses_flash(q: torch.Tensor, v: torch.Tensor, mask: AttentionMask, spec: StepSpec, sinks) -> bool:
    # torch's flash kernels take fp16/bf16 and head dims that are multiples of 8 up to 256;
    # its varlen entry points packed documents of batch 1, without windows, chunks or caps.
    # v's head dim must be q's too.
    plain = mask.has_documents and not mask.is_local and spec.softcap == 0 and sinks is None and q.shape[0] == 1
    one_head_dim = q.shape[-1] % 8 == 0 and v.shape[-1] == q.shape[-1]
    return plain and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and one_head_dim


def _step_mask(mask: AttentionMask, total: int):
    """The StepMask of the whole sequence against itself (one slot), or None."""
    return step_masks_of(mask, [((0, total),)]).step(0, 0)


def _flash_arguments(cu_seqlens, device):
    bounds = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    longest = max(end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]))
    return bounds, longest


def _tokens_major(x: torch.Tensor) -> torch.Tensor:
    """(1, S, H, D) -> the (S, H, D) view the flash kernels take (unit stride along D)."""
    x = x[0]
    return x if x.stride(-1) == 1 else x.contiguous()


def _steps(q, mask: AttentionMask, spec: StepSpec):
    return step_kernels_for(AUTO, q, spec.softcap > 0 or mask.is_local)


def local_forward(q, k, v, mask: AttentionMask, spec: StepSpec, sinks=None):
    """q: (B, S, H, D), k: (B, S, H_kv, D), v: (B, S, H_kv, Dv), any strides; mask over
    positions 0..S-1 (cu_seqlens, if any, ending at S); spec: the scale (> 0) and soft cap;
    sinks None or (H,). Returns out (B, S, H, Dv) in q's dtype, contiguous, and lse (B, H, S) fp32
    (sinks included)."""
    total = q.shape[1]
    scale = spec.scale
    if _uses_flash(q, v, mask, spec, sinks):
        bounds, longest = _flash_arguments(mask.cu_seqlens, q.device)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            _tokens_major(q), _tokens_major(k), _tokens_major(v), bounds, bounds, longest, longest, 0.0,
            mask.causal, False, scale=scale,
        )  # fmt: skip
        return out.unsqueeze(0), lse.unsqueeze(0)  # (S, H, D), (H, S)
    out = torch.zeros((*q.shape[:3], v.shape[3]), dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], total), float("-inf"), dtype=torch.float32, device=q.device)
    step = _step_mask(mask, total)
    if step is not None and q.shape[0] * q.shape[2] * q.shape[3] > 0:
        forward_step(_steps(q, mask, spec), step, q, k, v, out, lse, spec)
    if sinks is not None:
        merge_sinks_(out, lse, sinks)
    return out.to(q.dtype), lse


def local_backward(dout, q, k, v, out, lse, mask: AttentionMask, spec: StepSpec, sinks=None):
    """(dq, dk, dv, dsinks) of local_forward's out: dq, dk, dv shaped like q, k, v in q's
    dtype; dsinks (H,) in sinks' dtype, or None without sinks."""
    total = q.shape[1]
    scale = spec.scale
    if _uses_flash(q, v, mask, spec, sinks):
        bounds, longest = _flash_arguments(mask.cu_seqlens, q.device)
        # No dropout: the random-number state is never read.
        unused_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            _tokens_major(dout), _tokens_major(q), _tokens_major(k), _tokens_major(v), _tokens_major(out),
            lse[0].contiguous(), bounds, bounds, longest, longest, 0.0, mask.causal, unused_state,
            torch.empty(0, device=q.device), scale=scale,
        )  # fmt: skip
        return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0), None
    steps = _steps(q, mask, spec)
    fp32 = dict(dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.zeros(q.shape, **fp32), torch.zeros(k.shape, **fp32), torch.zeros(v.shape, **fp32)
    step = _step_mask(mask, total)
    if step is not None and q.shape[0] * q.shape[2] * q.shape[3] > 0:
        delta = steps.prepare_backward(out, dout)
        backward_step(steps, step, dout, q, k, v, out, lse, delta, dq, lambda: (dk, dv), spec)
    dsinks = None if sinks is None else sinks_gradient(out, dout, lse, sinks)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), dsinks
