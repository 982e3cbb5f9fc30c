"""Argument checks shared by the attention functions: local (no communication), so they
run on every rank before any collective.

    normalize_dim(dim, ndim, name, shape)   a dim argument in [0, ndim)
    check_attention_inputs(q, k, v)     shapes, dtypes, devices, GQA heads, head dim
    resolve_softmax_scale(scale, q)     the default, and ValueError for a bad one
    fold_scale_sign(q, scale)           a non-positive scale rewritten as a positive one
"""

from __future__ import annotations

import math

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def normalize_dim(dim: int, ndim: int, name: str, shape) -> int:
    """`dim` (negative counts from the end) as an index in [0, ndim); `name` is the
    argument's name and `shape` the tensor's, for the message."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"{name} must be an int, got {dim!r} (tensor of shape {tuple(shape)})")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for a tensor of shape {tuple(shape)}")
    return dim % ndim


def describe_shapes(q, k, v) -> str:
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


def check_attention_inputs(q, k, v) -> None:
    """q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_kv,
    headdim), one dtype among SUPPORTED_DTYPES, one device, nheads % nheads_kv == 0,
    1 <= headdim <= MAX_HEAD_DIM. Raises ValueError naming the shapes otherwise."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(f"{name} must be (batch, seqlen_local, nheads, headdim), got {shape}")
    shapes = describe_shapes(q, k, v)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q, k, v need one dtype among {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype} ({shapes})"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {shapes}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q, k, v must share batch and local sequence length, got {shapes}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have one head dim, got {shapes}")
    if q.shape[3] == 0:
        raise ValueError(f"head dim must be at least 1 ({shapes})")
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[3]} exceeds {MAX_HEAD_DIM} ({shapes})")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"nheads ({q.shape[2]}) must be a multiple of nheads_kv ({k.shape[2]}) ({shapes})"
        )


def resolve_softmax_scale(softmax_scale, q: torch.Tensor) -> float:
    """The scale applied to q.k: `softmax_scale`, or 1/sqrt(headdim) for None. Any
    finite number is accepted, zero and negative ones included (see fold_scale_sign)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(q.shape[3])
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale must be a number or None, got {softmax_scale!r}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return float(softmax_scale)


def fold_scale_sign(q: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, float]:
    """(q, scale) with a positive scale that gives the same scores scale * q.k.

    The attention kernels mask a causal score with -inf BEFORE scaling it (aten's CPU
    flash kernel, which SDPA runs on CPUs): a zero scale then gives -inf * 0 = NaN and a
    negative one turns a masked score into +inf. So a negative scale is applied to q
    (-q with scale |scale|, exact in every dtype), and a zero scale, whose scores are all
    0 (uniform attention over the visible keys), becomes q * 0 with scale 1. Both stay
    differentiable: dq is -dq' or exactly 0. A positive scale returns q itself."""
    if softmax_scale > 0:
        return q, softmax_scale
    if softmax_scale < 0:
        return q.neg(), -softmax_scale
    return q.mul(0.0), 1.0
