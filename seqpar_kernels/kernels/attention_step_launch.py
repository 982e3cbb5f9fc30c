"""Launchers of the ring-attention step kernels (one file, over 500 lines: each launcher
with the argument list of its kernel, which the ahead-of-time compile reuses).

    attention_step_forward         fold one K/V block into the running fp32 (out, lse)
    attention_backward_preprocess  delta = rowsum(dout * out), once per backward
    attention_step_backward        add one K/V block's gradients to dq, dk, dv
    attention_step_backward_dq     its dq kernel alone (+= into dq)
    attention_step_backward_dkdv   its dk/dv kernel alone (+= into dk, dv)

What the kernels compute is described in attention_step_kernels.py; which tiles
and launch options a GPU gets, in attention_step_tiles.py.

The launchers trust their callers: they run at every ring step, and the ring
checks its inputs once, before any collective (seqpar_kernels/parallel/attention_checks.py:
shapes, dtypes, devices, head dim, the softmax scale, and check_launchable for
the GPU and the grid limits).  Any tensor may be non-contiguous, except the
interval tensors of MASK_INTERVALS.

Mask modes of one ring step (``mask_mode=``):

    MASK_FULL       every query attends every key of the block
    MASK_CAUSAL     the diagonal block, seqlen_q == seqlen_k: query i attends keys j <= i
    MASK_INTERVALS  packed documents (variable-length sequences in one tensor):
                    ``intervals=(row_start, row_end, col_start, col_end)`` says
                    which keys each query attends and which queries each key is
                    attended by, as index ranges into this block

For example a packed sequence of two documents, positions 0-4 and 5-9, split
between two ranks with queries at positions 2-7 and, in this step, keys at
positions 0-5.  Causal within each document, ``x`` = attended::

                 key j:  0 1 2 3 4 5        row_start row_end
    query i, pos 2:      x x x . . .            0        3
             pos 3:      x x x x . .            0        4
             pos 4:      x x x x x .            0        5
             pos 5:      . . . . . x            5        6
             pos 6:      . . . . . x            5        6
             pos 7:      . . . . . x            5        6
    col_start            0 0 0 1 2 3
    col_end              3 3 3 3 3 6

Without causality row_end would be 5 for the first document's queries and
col_start 0 for its keys.  A q tile sweeps only the keys from the smallest
row_start to the largest row_end of its rows (and a k tile of dk/dv only the
queries its column intervals span), so a step with short documents costs far
less than seqlen_q x seqlen_k.  Sliding windows and chunked attention are
intervals too (query i: the keys of its window or of its chunk): the forward
and dq kernels sweep the k tiles that every row of a q tile sees without a
mask.

Every launcher takes ``softcap=0.0``: above 0 each score is
``softcap * tanh(softmax_scale * q.k / softcap)`` before the mask and the
softmax (Gemma 2, Grok), forward and backward alike; 0 launches the kernels
without the cap.
"""

import math
import os

import torch
import triton

from . import attention_step_tiles
from .attention_step_tiles import (
    backward_launches,
    backward_preprocess_launch,
    cuda_target,
    dkdv_head_splits,
    forward_launch,
    uses_tensor_descriptors,
)

__all__ = [
    "MASK_FULL",
    "MASK_CAUSAL",
    "MASK_INTERVALS",
    "attention_step_forward",
    "attention_step_backward",
    "attention_step_backward_dq",
    "attention_step_backward_dkdv",
    "attention_backward_preprocess",
]

# Mask modes of one ring step.
MASK_FULL = 0  # every query attends every key of the block
MASK_CAUSAL = 1  # diagonal block: seqlen_q == seqlen_k, query i attends keys j <= i
MASK_INTERVALS = 2  # query i attends keys row_start[i] <= j < row_end[i] (packed documents)

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * log2(e))


def _runs_in_interpreter(t):
    # CPU tensors can only be run by the interpreter; CUDA tensors are run by
    # it when TRITON_INTERPRET=1.
    if not t.is_cuda:
        return True
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------
# Kernel calls: (KernelLaunch, grid, positional arguments)
# ----------------------------------------------------------------------------


def _tensor_descriptors(target, *tensors):
    """Whether the kernels load ``tensors`` through tensor descriptors: where
    uses_tensor_descriptors says so for their dtype, their widest head dim and
    ``target``, and every one has the layout TMA takes (unit last stride, the
    other strides and the address multiples of 16 bytes).  Any other layout
    takes pointer loads."""
    if not uses_tensor_descriptors(tensors[0].dtype, max(t.shape[-1] for t in tensors), target):
        return False
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(stride * size % 16 for stride in t.stride()[:-1]):
            return False
    _ensure_allocator(tensors[0].device)
    return True


class _Scratch:
    """Triton's allocator for the global scratch of kernels that build tensor
    descriptors on the device (128 bytes per descriptor and program): torch
    memory on ``device``, on the launch's stream."""

    def __init__(self, device):
        self.device = device

    def __call__(self, size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device=self.device)


def _ensure_allocator(device):
    # The allocator lives in a context variable: each thread (autograd runs the
    # backward on its own) starts without one.  One the caller set is kept.
    try:
        from triton.runtime._allocation import NullAllocator, _allocator

        current = _allocator.get()
        if not isinstance(current, (NullAllocator, _Scratch)) or getattr(current, "device", None) == device:
            return
    except ImportError:  # another layout of Triton's internals: set ours
        pass
    triton.set_allocator(_Scratch(device))


def _interval_args(intervals):
    """(row_start, row_end, col_start, col_end): the interval pointers the kernels
    take in every mask mode.  Without MASK_INTERVALS they are None, which Triton
    takes as a compile-time constant rather than a kernel parameter: the full and
    causal kernels keep exactly the parameters they have without the interval
    mode.  (Two unused int32 pointers instead change their registers on sm_100,
    e.g. 126 -> 130 for the bf16 d64 causal GQA forward.)"""
    return tuple(intervals) if intervals is not None else (None,) * 4


def _softcap_args(scale, softcap):
    """(softcap_qk, softcap_log2e): the kernels' runtime arguments of the soft
    cap ``softcap`` > 0 with ``scale`` (attention_step_kernels._softcapped),
    (None, None) without one: None is a compile-time constant, not a kernel
    parameter, so the kernels without the cap keep exactly their parameters."""
    if not softcap:
        return None, None
    return 2 * LOG2E * scale / softcap, softcap * LOG2E


def _check_softcap(softcap, scale):
    # 0 turns the cap off.  A negative, infinite or NaN cap, or one so small
    # that scale / softcap leaves fp32 (the kernels' tanh would see inf * 0),
    # is the caller's error; the public functions raise ValueError before.
    assert softcap == 0 or (
        0 < softcap < math.inf and abs(2 * LOG2E * scale / softcap) < torch.finfo(torch.float32).max
    ), f"softcap must be 0 (off) or a finite positive float with a finite softmax_scale / softcap, got {softcap}"


def _forward_call(q, k, v, out, lse, scale, causal, intervals, *, first_step=False, softcap=0.0, target, interpreted):
    """(KernelLaunch, grid, positional arguments) of the forward step kernel;
    ``intervals``: the 4-tuple of MASK_INTERVALS, else None; ``softcap``: the
    soft cap of the scores, 0 for none."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    launch = forward_launch(
        q.dtype,
        headdim,
        causal,
        value_dim=v.shape[3],
        intervals=intervals is not None,
        first_step=first_step,
        softcap=bool(softcap),
        tensor_descriptors=_tensor_descriptors(target, q, k, v),
        target=target,
        interpreted=interpreted,
    )
    grid = (triton.cdiv(seqlen_q, launch.constexprs["BLOCK_M"]), nheads, batch)
    row_start, row_end, _, _ = _interval_args(intervals)
    args = (
        q,
        k,
        v,
        out,
        lse,
        row_start,
        row_end,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *lse.stride(),
        seqlen_q,
        seqlen_k,
        nheads // nheads_kv,
        scale * LOG2E,
        *_softcap_args(scale, softcap),
    )
    return launch, grid, args


def _backward_preprocess_call(out, dout, delta, *, target):
    """(KernelLaunch, grid, positional arguments) of the delta = rowsum(dout * out)
    kernel, over out's (v's) head dim."""
    batch, seqlen_q, nheads, headdim = out.shape
    launch = backward_preprocess_launch(headdim, target=target)
    grid = (triton.cdiv(seqlen_q, launch.constexprs["BLOCK_M"]), nheads, batch)
    args = (out, dout, delta, *out.stride(), *dout.stride(), *delta.stride(), seqlen_q)
    return launch, grid, args


def _backward_call(
    kernel,
    q,
    k,
    v,
    dout,
    lse,
    delta,
    grads,
    scale,
    causal,
    intervals,
    *,
    softcap=0.0,
    split_heads=None,
    target,
    interpreted,
):
    """(KernelLaunch, grid, positional arguments) of one backward step kernel:
    ``kernel`` "dq" (``grads`` = (dq,)) or "dkdv" (``grads`` = (dk, dv));
    ``intervals`` and ``softcap`` as in _forward_call.  dq reads the row intervals, dk/dv the
    column intervals.  ``split_heads`` (dk/dv): split each GQA group's q heads
    over grid axis 1 (SPLIT_HEADS); None decides by whether the grid fills the
    GPU (attention_step_tiles.dkdv_head_splits)."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    dq_launch, dkdv_launch = backward_launches(
        q.dtype,
        headdim,
        causal,
        value_dim=v.shape[3],
        intervals=intervals is not None,
        softcap=bool(softcap),
        tensor_descriptors=_tensor_descriptors(target, q, k, v, dout),
        target=target,
        interpreted=interpreted,
    )
    row_start, row_end, col_start, col_end = _interval_args(intervals)
    inputs = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(), *delta.stride())
    sizes_and_scales = (
        seqlen_q,
        seqlen_k,
        nheads // nheads_kv,
        scale,
        scale * LOG2E,
        *_softcap_args(scale, softcap),
    )
    grad_strides = tuple(stride for grad in grads for stride in grad.stride())
    if kernel == "dq":
        grid = (triton.cdiv(seqlen_q, dq_launch.constexprs["BLOCK_M"]), nheads, batch)
        return (
            dq_launch,
            grid,
            (q, k, v, dout, lse, delta, *grads, row_start, row_end, *inputs, *grad_strides, *sizes_and_scales),
        )
    assert kernel == "dkdv", kernel
    k_tiles = triton.cdiv(seqlen_k, dkdv_launch.constexprs["BLOCK_N"])
    group = nheads // nheads_kv
    multiprocessors = (
        target.multiprocessors if target is not None else attention_step_tiles._INTERPRETER_MULTIPROCESSORS
    )
    splits = dkdv_head_splits(k_tiles * nheads_kv * batch, group, multiprocessors)
    if split_heads is None:
        # Split the group's q heads only where the grid would leave SMs idle,
        # and never when torch is asked for deterministic algorithms.
        split_heads = splits > 1 and not torch.are_deterministic_algorithms_enabled()
    heads_per_program = group
    if split_heads:
        heads_per_program = triton.cdiv(group, max(2, splits))
        dkdv_launch = dkdv_launch._replace(constexprs={**dkdv_launch.constexprs, "SPLIT_HEADS": True})
    grid = (k_tiles, nheads_kv * triton.cdiv(group, heads_per_program), batch)
    seqlens, scales = sizes_and_scales[:3], sizes_and_scales[3:]
    return (
        dkdv_launch,
        grid,
        (
            q,
            k,
            v,
            dout,
            lse,
            delta,
            *grads,
            col_start,
            col_end,
            *inputs,
            *grad_strides,
            *seqlens,
            heads_per_program,
            *scales,
        ),
    )


def _backward_calls(q, k, v, dout, lse, delta, dq, dk, dv, scale, causal, intervals, **options):
    """[(KernelLaunch, grid, positional arguments)] of the dq and the dk/dv kernels;
    ``options``: the keywords of _backward_call."""
    return [
        _backward_call(kernel, q, k, v, dout, lse, delta, grads, scale, causal, intervals, **options)
        for kernel, grads in (("dq", (dq,)), ("dkdv", (dk, dv)))
    ]


def cuda_kernel_calls(q, k, v, mask_mode, target, *, softcap=0.0):
    """Every kernel launch that one forward and one backward ring step with
    ``mask_mode`` and ``softcap`` (the scores' soft cap, 0 for none) run (the
    forward of the first step and of a later one; with GQA also the dk/dv
    launch that splits the group's q heads, which a grid too small for the GPU
    takes) on CUDA tensors shaped and strided like ``q``, ``k``, ``v`` (which
    may live on the meta device; v's head dim may differ from q's) on the GPU
    ``target`` (a GpuTarget), as ``[(KernelLaunch, positional arguments)]``.
    The running state (out, lse), dout, the gradients and the intervals of
    MASK_INTERVALS are taken contiguous, as the ring allocates them: out and
    dout (batch, seqlen_q, nheads, headdim_v), dq like q, dk like k, dv like v.
    tools/ahead_of_time.py compiles these for GPU targets."""
    fp32 = torch.float32
    batch, seqlen_q, nheads, _ = q.shape
    causal = mask_mode == MASK_CAUSAL
    intervals = None
    if mask_mode == MASK_INTERVALS:
        intervals = tuple(
            torch.empty(n, dtype=torch.int32, device=q.device) for n in (seqlen_q, seqlen_q, k.shape[1], k.shape[1])
        )
    out = torch.empty((batch, seqlen_q, nheads, v.shape[3]), dtype=fp32, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=fp32, device=q.device)
    dout = torch.empty(out.shape, dtype=q.dtype, device=q.device)
    delta = torch.empty_like(lse)
    dq, dk, dv = (torch.empty(t.shape, dtype=fp32, device=t.device) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5
    options = dict(softcap=softcap, target=target, interpreted=False)
    calls = [
        *(
            _forward_call(q, k, v, out, lse, scale, causal, intervals, first_step=first_step, **options)
            for first_step in (True, False)
        ),
        _backward_preprocess_call(out.to(q.dtype), dout, delta, target=target),
        *_backward_calls(q, k, v, dout, lse, delta, dq, dk, dv, scale, causal, intervals, **options),
    ]
    if nheads > k.shape[2]:
        calls.append(
            _backward_call(
                "dkdv", q, k, v, dout, lse, delta, (dk, dv), scale, causal, intervals, split_heads=True, **options
            )
        )
    return [(launch, args) for launch, _grid, args in calls]


def _is_causal(q, k, mask_mode, intervals):
    # A wrong mask mode, intervals of the wrong size, dtype, layout or device, or
    # a kv head count that does not divide the q heads would compute garbage (or
    # read out of bounds) rather than fail: the callers' invariants.  That the
    # row and the column intervals describe the same mask is the caller's too:
    # checking it would cost a kernel and a synchronization per step.
    assert mask_mode in (MASK_FULL, MASK_CAUSAL, MASK_INTERVALS), mask_mode
    assert mask_mode != MASK_CAUSAL or q.shape[1] == k.shape[1], "MASK_CAUSAL needs seqlen_q == seqlen_k"
    assert (intervals is not None) == (mask_mode == MASK_INTERVALS), (
        "intervals= is given with MASK_INTERVALS and only with it"
    )
    if intervals is not None:
        assert len(intervals) == 4, "intervals = (row_start, row_end, col_start, col_end)"
        for name, t, n in zip(
            ("row_start", "row_end", "col_start", "col_end"),
            intervals,
            (q.shape[1], q.shape[1], k.shape[1], k.shape[1]),
        ):
            assert t.dtype == torch.int32 and t.shape == (n,) and t.is_contiguous() and t.device == q.device, (
                f"{name} must be a contiguous int32 ({n},) tensor on {q.device}, got {t.dtype} {tuple(t.shape)} "
                f"on {t.device}"
            )
    assert k.shape[2] > 0 and q.shape[2] % k.shape[2] == 0, "nheads must be a multiple of nheads_kv"
    return mask_mode == MASK_CAUSAL


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def attention_step_forward(
    q, k, v, out, lse, *, softmax_scale, mask_mode, intervals=None, first_step=False, softcap=0.0
):
    """Fold one K/V block into the running attention result, in place.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float32/float16/bfloat16.
        k: (batch, seqlen_k, nheads_kv, headdim), v: (batch, seqlen_k,
            nheads_kv, headdim_v), same dtype as q; headdim_v may differ from
            headdim (multi-head latent attention); nheads % nheads_kv == 0
            (q head h uses kv head h // (nheads // nheads_kv)).
        out: float32 (batch, seqlen_q, nheads, headdim_v), running output; updated in place.
        lse: float32 (batch, nheads, seqlen_q), running natural-log log-sum-exp;
            updated in place.  Start with out = 0 and lse = -inf, or pass
            first_step=True.
        softmax_scale: multiplier of q @ k^T (usually headdim ** -0.5), a finite
            float >= 0 (a negative one goes into q: -q with its absolute value).
        mask_mode: MASK_FULL, MASK_CAUSAL for the diagonal block
            (seqlen_q == seqlen_k, query i attends keys j <= i), or MASK_INTERVALS.
        intervals: with MASK_INTERVALS (and only then) the 4-tuple
            (row_start, row_end, col_start, col_end) of contiguous int32 tensors
            on q's device: row_start, row_end (seqlen_q,), col_start, col_end
            (seqlen_k,).  Query i attends exactly the keys
            row_start[i] <= j < row_end[i]; key j is attended by exactly the
            queries col_start[j] <= i < col_end[j] (end <= start: none).  The
            two must describe the same mask; the same intervals hold for every
            batch entry and head.  The forward reads the row intervals only.
        first_step: this block is the first one folded in: out and lse are
            neither read nor merged with, so they may hold anything
            (torch.empty), and every row is written: this block's attention
            and log-sum-exp, or out = 0 and lse = -inf for a row that sees no
            key of the block.
        softcap: 0 (no cap), or the soft cap of the scores as in Gemma 2
            and flash-attention: the score of query i and key j is
            softcap * tanh(softmax_scale * q_i . k_j / softcap) before the
            softmax (and lse is that of the capped scores).  Pass the same
            value to every step and to the backward.

    Any tensor but the intervals may be non-contiguous.  After the first step,
    rows that see no key of this block are left untouched.  With
    MASK_INTERVALS the K/V rows outside [min row_start, max row_end) over the
    non-empty intervals are never read, so they may hold anything, NaN
    included.  Returns (out, lse), the same tensors.
    """
    causal = _is_causal(q, k, mask_mode, intervals)
    _check_softcap(softcap, softmax_scale)
    batch, seqlen_q, nheads, _ = q.shape
    if batch == 0 or nheads == 0 or seqlen_q == 0:
        return out, lse
    if k.shape[1] == 0:
        # An empty block changes nothing; as the first one it leaves the state
        # of no key at all.
        if first_step:
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse

    # The kernel takes the running max of the scaled scores as the max of the unscaled
    # ones times the scale, which holds for a scale >= 0: the public functions fold a
    # negative one into q first (parallel/attention_checks.py fold_scale_sign).
    assert softmax_scale >= 0, f"softmax_scale must be >= 0 here (fold its sign into q), got {softmax_scale}"
    launch, grid, args = _forward_call(
        q,
        k,
        v,
        out,
        lse,
        softmax_scale,
        causal,
        intervals,
        first_step=first_step,
        softcap=softcap,
        target=cuda_target(q),
        interpreted=_runs_in_interpreter(q),
    )
    launch(grid, *args)
    return out, lse


def attention_backward_preprocess(out, dout):
    """delta = rowsum(dout * out) in float32.

    Args:
        out: (batch, seqlen_q, nheads, headdim_v), the FINAL attention output
            (after all ring steps), float32/float16/bfloat16.
        dout: gradient of out, same shape, float32/float16/bfloat16.

    Returns:
        delta: new contiguous float32 tensor (batch, nheads, seqlen_q).
    """
    batch, seqlen_q, nheads, headdim = out.shape
    delta = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=out.device)
    if delta.numel() == 0:
        return delta
    if headdim == 0:
        return delta.zero_()
    launch, grid, args = _backward_preprocess_call(out, dout, delta, target=cuda_target(out))
    launch(grid, *args)
    return delta


def attention_step_backward(
    q, k, v, out, dout, lse, delta, dq, dk, dv, *, softmax_scale, mask_mode, intervals=None, softcap=0.0
):
    """Add one K/V block's gradients to dq, dk, dv, in place (+=): the dq kernel
    (attention_step_backward_dq), then the dk/dv kernel
    (attention_step_backward_dkdv).

    Args:
        q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_kv, headdim);
            v: (batch, seqlen_k, nheads_kv, headdim_v); same dtype
            (float32/float16/bfloat16); nheads % nheads_kv == 0.
        out: (batch, seqlen_q, nheads, headdim_v) final output; only used to build
            delta when delta is None.
        dout: (batch, seqlen_q, nheads, headdim_v) gradient of the final output.
        lse: float32 (batch, nheads, seqlen_q), the FINAL log-sum-exp after all
            ring steps (rows with -inf get zero gradient).
        delta: float32 (batch, nheads, seqlen_q) = rowsum(dout * out), from
            attention_backward_preprocess; None computes it here.
        dq: float32 (batch, seqlen_q, nheads, headdim), accumulated in place.
        dk: float32 (batch, seqlen_k, nheads_kv, headdim), dv: float32
            (batch, seqlen_k, nheads_kv, headdim_v), accumulated in place.
        softmax_scale, mask_mode, intervals, softcap: as given to
            attention_step_forward for this block (with softcap the gradient
            of a score goes through the cap: d score / d(q_i . k_j) =
            softmax_scale * (1 - tanh^2)).  dq reads the row intervals, dk/dv the column
            intervals; dk/dv never read the q, dout, lse and delta rows outside
            [min col_start, max col_end) over the non-empty intervals.

    Deterministic but for one case: dq always has a single writer per
    element, and so do dk and dv, except where GQA/MQA leaves the dk/dv grid
    (k tiles x kv heads x batch) smaller than the GPU's SM count, e.g. MQA at
    4096 keys: 64 programs for 132 SMs.  There the group's q heads are split
    over more programs (attention_step_tiles.dkdv_head_splits: 2 splits, 128
    programs, about half the time of that kernel), which add into dk/dv with
    fp32 atomics in no fixed order: dk/dv may then differ between runs by fp32
    rounding.  The cost: one fp32 atomic add per dk and dv element and
    program instead of a load and a store, 2 x 64 x 128 = 16 K per program at
    d128 (2.1 M in all for MQA at 4096 keys, against the 2 G multiply-adds
    each of its programs sweeps), and the same kernel otherwise.  With
    torch.use_deterministic_algorithms(True) nothing is split.  Returns
    (dq, dk, dv), the same tensors.
    """
    _is_causal(q, k, mask_mode, intervals)
    _check_softcap(softcap, softmax_scale)
    if delta is None:
        delta = attention_backward_preprocess(out, dout)
    options = dict(softmax_scale=softmax_scale, mask_mode=mask_mode, intervals=intervals, softcap=softcap)
    attention_step_backward_dq(q, k, v, dout, lse, delta, dq, **options)
    attention_step_backward_dkdv(q, k, v, dout, lse, delta, dk, dv, **options)
    return dq, dk, dv


def _launch_backward(kernel, q, k, v, dout, lse, delta, grads, softmax_scale, mask_mode, intervals, softcap):
    causal = _is_causal(q, k, mask_mode, intervals)
    _check_softcap(softcap, softmax_scale)
    batch, seqlen_q, nheads, _ = q.shape
    if batch == 0 or nheads == 0 or seqlen_q == 0 or k.shape[1] == 0:
        return  # an empty block adds nothing
    launch, grid, args = _backward_call(
        kernel,
        q,
        k,
        v,
        dout,
        lse,
        delta,
        grads,
        softmax_scale,
        causal,
        intervals,
        softcap=softcap,
        target=cuda_target(q),
        interpreted=_runs_in_interpreter(q),
    )
    launch(grid, *args)


def attention_step_backward_dq(q, k, v, dout, lse, delta, dq, *, softmax_scale, mask_mode, intervals=None, softcap=0.0):
    """Add one K/V block's share of the query gradient to dq, in place (+=).

    The arguments are those of attention_step_backward; ``delta`` is required
    (attention_backward_preprocess).  The dq kernel reads q, k, v, dout, lse,
    delta and the row intervals, and writes dq only, so a caller may run it
    while dk/dv of the same step are still elsewhere (e.g. on their way round
    the ring).  Deterministic: each dq element has a single writer.  Returns dq.
    """
    _launch_backward("dq", q, k, v, dout, lse, delta, (dq,), softmax_scale, mask_mode, intervals, softcap)
    return dq


def attention_step_backward_dkdv(
    q, k, v, dout, lse, delta, dk, dv, *, softmax_scale, mask_mode, intervals=None, softcap=0.0
):
    """Add one K/V block's key and value gradients to dk and dv, in place (+=).

    The arguments are those of attention_step_backward; ``delta`` is required.
    The dk/dv kernel reads q, k, v, dout, lse, delta and the column intervals,
    and writes dk and dv only.  Deterministic (a single writer per element)
    unless the grid is too small for the GPU and the GQA group's q heads are
    split over programs that add with atomics (see attention_step_backward).
    Returns (dk, dv).
    """
    _launch_backward("dkdv", q, k, v, dout, lse, delta, (dk, dv), softmax_scale, mask_mode, intervals, softcap)
    return dk, dv
