"""Triton kernels for one ring-attention step.

In ring attention every rank keeps its own query block and sees the key/value
blocks of all ranks one after another.  Each arrival is one *step*: attention of
the local queries against the visiting K/V block, folded into a running result.

Forward
    ``attention_step_forward`` computes the block's attention with an online
    softmax (FlashAttention-2 style, fp32 accumulators) and merges it into the
    running fp32 ``(out, lse)`` pair in the same kernel::

        new_lse = logaddexp(lse, block_lse)
        out     = out * exp(lse - new_lse) + block_out * exp(block_lse - new_lse)

    Start from ``out = 0`` and ``lse = -inf``; after the last step ``out`` is the
    exact softmax attention over every block seen and ``lse`` its log-sum-exp.

Backward
    With the *final* ``lse`` (after all steps) the softmax probabilities of any
    block can be rebuilt locally as ``p = exp(s - lse)``, so each step's
    gradients are independent and simply add up.  ``attention_step_backward``
    adds this block's contribution to ``dq`` (owned by the local rank) and to
    ``dk``/``dv`` (which travel around the ring with K/V).
    ``attention_backward_preprocess`` computes ``delta = rowsum(dout * out)``.

Layouts follow flash-attention: ``q`` is (batch, seqlen_q, nheads, headdim),
``k``/``v`` are (batch, seqlen_k, nheads_kv, headdim) with
``nheads % nheads_kv == 0`` (GQA/MQA: q head ``h`` reads kv head
``h // (nheads // nheads_kv)``; K/V are never repeated in memory).  ``lse`` and
``delta`` are (batch, nheads, seqlen_q).  Every tensor may have arbitrary
strides: the kernels take strides and never call ``.contiguous()``.

Numerics: all softmax statistics and accumulators are fp32.  Scores are taken
to base 2 (``log2(e)`` folded into the scale) so the kernels use ``exp2``;
``lse`` is stored in natural-log units, the convention of flash-attention.
Rows that see no valid key are never written by the forward (they stay exactly
as they were), and rows whose final ``lse`` is ``-inf`` get zero gradient.
"""

import functools
import math
import os
import re
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

__all__ = [
    "MASK_FULL",
    "MASK_CAUSAL",
    "attention_step_forward",
    "attention_step_backward",
    "attention_backward_preprocess",
]

# Mask modes of one ring step.
MASK_FULL = 0  # every query attends every key of the block
MASK_CAUSAL = 1  # diagonal block: seqlen_q == seqlen_k, query i attends keys j <= i

_LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * log2(e))
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEADDIM = 256  # bigger tiles would not fit registers / shared memory on GPU
_MAX_GRID_YZ = 65535  # CUDA limit of grid axes 1 and 2


# ----------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    # The Triton CPU interpreter (TRITON_INTERPRET=1) keeps bfloat16 as raw
    # uint16 bits and its tl.dot multiplies those bits (triton-lang/triton
    # #11584).  There the launcher sets DOT_UPCAST: operands already rounded
    # to bf16 are widened to fp32 first, which gives the same numbers as a GPU
    # bf16 dot (exact products, fp32 accumulation).
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attention_fwd_sweep(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, lo, hi,
    offs_m, offs_n, mask_d, seqlen_k, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # Folds the keys [lo, hi) into the online-softmax state (acc, l_i, m_i);
    # k_ptrs/v_ptrs point at key lo and come back pointing at key hi (rounded
    # up to a whole tile).  MASKED=False: every key of every tile is valid for
    # every row, so no key mask and no causal test.
    for start_n in range(lo, hi, BLOCK_N):
        if MASKED:
            cols = start_n + offs_n
            mask_n = cols < seqlen_k
            kt = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        s = _dot(q, kt, DOT_PRECISION, DOT_UPCAST) * qk_scale
        if MASKED:
            valid = mask_n[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no valid key so far has m_new == -inf; subtracting it
        # would give (-inf) - (-inf) = NaN.  Use 0 instead: every exp2 below
        # then sees -inf and yields exactly 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated so far
        l_i = l_i * alpha + tl.sum(p, 1)

        if MASKED:
            v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
        # p goes to the input dtype so that fp16/bf16 use tensor cores; the
        # accumulation itself stays fp32.
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i, k_ptrs, v_ptrs


@triton.jit
def _attention_step_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lm,
    seqlen_q, seqlen_k, headdim, kv_group,
    qk_scale,  # softmax_scale * log2(e)
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    SPLIT_SWEEP: tl.constexpr,
):
    # One program owns (q tile, q head, batch) and sweeps the whole K/V block.
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hk = off_h // kv_group  # GQA: the kv head shared by this q head's group
    start_m = pid_m * BLOCK_M

    # 64-bit base offsets (batch, head, tile start) so that large tensors cannot
    # overflow int32 pointer arithmetic; in-tile offsets stay small int32.
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh \
        + start_m.to(tl.int64) * stride_qm
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_tm = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen_q
    # BLOCK_D is headdim padded to a power of two (80 -> 128): mask the tail.
    mask_d = offs_d < headdim

    q = tl.load(q_base + offs_tm[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    # Online softmax state in base 2: running max m_i, running sum l_i, acc.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Causal (diagonal) block: keys beyond the last row of this q tile are
    # masked for every row, so the sweep stops there.  Keys before the tile's
    # first row are visible to all of its rows.
    if CAUSAL:
        hi = tl.minimum(seqlen_k, start_m + BLOCK_M)
        all_visible = tl.minimum(start_m, seqlen_k)
    else:
        hi = seqlen_k
        all_visible = seqlen_k
    k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd  # K^T tile
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    if SPLIT_SWEEP:
        # Two sweeps, as in the Triton fused-attention tutorial: the whole k
        # tiles that every row sees go without a key mask or a causal test, the
        # rest (the diagonal tiles, a partial last tile) with them.
        unmasked_end = (all_visible // BLOCK_N) * BLOCK_N
        acc, l_i, m_i, k_ptrs, v_ptrs = _attention_fwd_sweep(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, 0, unmasked_end,
            offs_m, offs_n, mask_d, seqlen_k, qk_scale,
            False, CAUSAL, BLOCK_N, DOT_PRECISION, DOT_UPCAST)
    else:
        unmasked_end = 0
    acc, l_i, m_i, k_ptrs, v_ptrs = _attention_fwd_sweep(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, unmasked_end, hi,
        offs_m, offs_n, mask_d, seqlen_k, qk_scale,
        True, CAUSAL, BLOCK_N, DOT_PRECISION, DOT_UPCAST)

    # ---- merge this block into the running (out, lse), in place ----
    # Rows that saw no valid key in this block (l_i == 0) are not written at
    # all: the running state stays bit-for-bit what it was.
    has_keys = mask_m & (l_i > 0.0)
    l_safe = tl.where(has_keys, l_i, 1.0)
    m_blk = tl.where(has_keys, m_i, 0.0)
    block_lse = (m_blk + tl.log2(l_safe)) * 0.6931471805599453  # back to natural log

    lse_ptrs = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh \
        + offs_m * stride_lm
    old_lse = tl.load(lse_ptrs, mask=has_keys, other=float("-inf"))
    o_ptrs = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh \
        + start_m.to(tl.int64) * stride_om \
        + offs_tm[:, None] * stride_om + offs_d[None, :] * stride_od
    o_mask = has_keys[:, None] & mask_d[None, :]
    old_out = tl.load(o_ptrs, mask=o_mask, other=0.0)
    # A row whose running lse is -inf carries no information: ignore whatever
    # its out holds (e.g. torch.empty garbage) instead of letting 0 * NaN in.
    old_out = tl.where(old_lse[:, None] == float("-inf"), 0.0, old_out)

    # logaddexp written as max + log(1 + exp(-|diff|)): both exponentials stay
    # <= 1, so large logits cannot overflow.  old_lse may be -inf (first step):
    # then -|diff| = -inf, exp -> 0 and new_lse == block_lse exactly.
    # block_lse is always finite here, so no inf - inf appears.
    mx = tl.maximum(old_lse, block_lse)
    new_lse = mx + tl.log(1.0 + tl.exp(-tl.abs(old_lse - block_lse)))
    w_old = tl.exp(old_lse - new_lse)
    w_blk = tl.exp(block_lse - new_lse) / l_safe  # block_out = acc / l_i
    new_out = old_out * w_old[:, None] + acc * w_blk[:, None]

    tl.store(o_ptrs, new_out, mask=o_mask)
    tl.store(lse_ptrs, new_lse, mask=has_keys)


@triton.jit
def _attention_bwd_preprocess_kernel(
    Out, DOut, Delta,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_gb, stride_gm, stride_gh, stride_gd,
    stride_db, stride_dh, stride_dm,
    seqlen_q, headdim,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # delta_i = sum_d dout[i, d] * out[i, d]; it is the rowsum(P * dP) term of
    # the softmax backward, computed once for all ring steps.
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    start_m = pid_m * BLOCK_M
    offs_tm = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_tm
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < seqlen_q)[:, None] & (offs_d < headdim)[None, :]
    o_ptrs = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh \
        + start_m.to(tl.int64) * stride_om + offs_tm[:, None] * stride_om + offs_d[None, :] * stride_od
    g_ptrs = DOut + off_b.to(tl.int64) * stride_gb + off_h.to(tl.int64) * stride_gh \
        + start_m.to(tl.int64) * stride_gm + offs_tm[:, None] * stride_gm + offs_d[None, :] * stride_gd
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * g, 1)
    d_ptrs = Delta + off_b.to(tl.int64) * stride_db + off_h.to(tl.int64) * stride_dh + offs_m * stride_dm
    tl.store(d_ptrs, delta, mask=offs_m < seqlen_q)


@triton.jit
def _attention_step_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_gb, stride_gm, stride_gh, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_eb, stride_eh, stride_em,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    seqlen_q, seqlen_k, headdim, kv_group,
    softmax_scale, qk_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    # One program owns (q tile, q head, batch) and loops over the k tiles, so
    # its dq rows have a single writer: deterministic, no atomics.
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hk = off_h // kv_group
    start_m = pid_m * BLOCK_M

    offs_tm = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_tm
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen_q
    mask_d = offs_d < headdim
    mask_md = mask_m[:, None] & mask_d[None, :]

    q_ptrs = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh \
        + start_m.to(tl.int64) * stride_qm + offs_tm[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_ptrs = DO + off_b.to(tl.int64) * stride_gb + off_h.to(tl.int64) * stride_gh \
        + start_m.to(tl.int64) * stride_gm + offs_tm[:, None] * stride_gm + offs_d[None, :] * stride_gd
    q = tl.load(q_ptrs, mask=mask_md, other=0.0)
    do = tl.load(do_ptrs, mask=mask_md, other=0.0)
    lse = tl.load(Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
                  + offs_m * stride_lm, mask=mask_m, other=0.0)
    delta = tl.load(Delta + off_b.to(tl.int64) * stride_eb + off_h.to(tl.int64) * stride_eh
                    + offs_m * stride_em, mask=mask_m, other=0.0)
    # Final lse == -inf means the row saw no key in any step: its probabilities
    # are all zero.  Using +inf makes exp2(s - lse) exactly 0 instead of NaN/inf.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    kt_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    vt_ptrs = v_base + offs_n[None, :] * stride_vn + offs_d[:, None] * stride_vd

    if CAUSAL:
        hi = tl.minimum(seqlen_k, start_m + BLOCK_M)
    else:
        hi = seqlen_k

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < seqlen_k
        kt = tl.load(kt_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        s = _dot(q, kt, DOT_PRECISION, DOT_UPCAST)
        # Recompute P from the final lse (base 2, scale folded in).
        p = tl.exp2(s * qk_scale - lse2[:, None])
        valid = mask_m[:, None] & mask_n[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None])
        p = tl.where(valid, p, 0.0)
        vt = tl.load(vt_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        dp = _dot(do, vt, DOT_PRECISION, DOT_UPCAST)
        ds = p * (dp - delta[:, None])
        k = tl.load(k_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        dq += _dot(ds.to(k.dtype), k, DOT_PRECISION, DOT_UPCAST)
        kt_ptrs += BLOCK_N * stride_kn
        k_ptrs += BLOCK_N * stride_kn
        vt_ptrs += BLOCK_N * stride_vn

    # Accumulate (+=) into the caller's fp32 dq: one ring step's contribution.
    dq_ptrs = DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh \
        + start_m.to(tl.int64) * stride_dqm + offs_tm[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    dq_old = tl.load(dq_ptrs, mask=mask_md, other=0.0)
    tl.store(dq_ptrs, dq_old + dq * softmax_scale, mask=mask_md)


@triton.jit
def _attention_step_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_gb, stride_gm, stride_gh, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_eb, stride_eh, stride_em,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    seqlen_q, seqlen_k, headdim, kv_group,
    softmax_scale, qk_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    # One program owns (k tile, kv head, batch).  It loops over every q head of
    # the GQA group and every q tile, so all contributions to these dk/dv rows
    # are summed in registers by a single writer: no atomics, no races, and a
    # deterministic summation order.
    pid_n = tl.program_id(0)
    off_hk = tl.program_id(1)
    off_b = tl.program_id(2)
    start_n = pid_n * BLOCK_N

    offs_tn = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_tn
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < seqlen_k
    mask_d = offs_d < headdim
    mask_nd = mask_n[:, None] & mask_d[None, :]

    k_ptrs = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh \
        + start_n.to(tl.int64) * stride_kn + offs_tn[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh \
        + start_n.to(tl.int64) * stride_vn + offs_tn[:, None] * stride_vn + offs_d[None, :] * stride_vd
    k = tl.load(k_ptrs, mask=mask_nd, other=0.0)
    v = tl.load(v_ptrs, mask=mask_nd, other=0.0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Causal (diagonal) block: q rows before this k tile's first key see none
    # of its keys, so start at the q tile containing row start_n.
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
    else:
        lo = 0

    for g in range(0, kv_group):
        off_h = off_hk * kv_group + g
        q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        do_base = DO + off_b.to(tl.int64) * stride_gb + off_h.to(tl.int64) * stride_gh
        lse_base = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
        delta_base = Delta + off_b.to(tl.int64) * stride_eb + off_h.to(tl.int64) * stride_eh
        for start_m in range(lo, seqlen_q, BLOCK_M):
            rows = start_m + offs_m
            mask_m = rows < seqlen_q
            mask_md = mask_m[:, None] & mask_d[None, :]
            # The tile's start in 64 bits: rows * stride_qm in int32 would wrap once
            # seqlen_q * stride_qm reaches 2**31 (e.g. 256K rows of 64 heads x 128).
            # A scalar: 64-bit row offsets as a vector cost fp32 GQA 4-5 spill
            # accesses in this loop (sm_80/86/90).  tl.cast, not .to(): start_m is
            # a Python int in the interpreter.
            tile_start = tl.cast(start_m, tl.int64)
            q = tl.load(q_base + tile_start * stride_qm + offs_m[:, None] * stride_qm
                        + offs_d[None, :] * stride_qd, mask=mask_md, other=0.0)
            do = tl.load(do_base + tile_start * stride_gm + offs_m[:, None] * stride_gm
                         + offs_d[None, :] * stride_gd, mask=mask_md, other=0.0)
            lse = tl.load(lse_base + rows * stride_lm, mask=mask_m, other=0.0)
            delta = tl.load(delta_base + rows * stride_em, mask=mask_m, other=0.0)
            # lse == -inf: row without any key -> P == 0 (see the dq kernel).
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

            # Transposed scores (keys x queries) so dk/dv come out row-major.
            st = _dot(k, tl.trans(q), DOT_PRECISION, DOT_UPCAST)
            pt = tl.exp2(st * qk_scale - lse2[None, :])
            valid = mask_n[:, None] & mask_m[None, :]
            if CAUSAL:
                valid = valid & (rows[None, :] >= offs_n[:, None])
            pt = tl.where(valid, pt, 0.0)
            dv += _dot(pt.to(do.dtype), do, DOT_PRECISION, DOT_UPCAST)
            dpt = _dot(v, tl.trans(do), DOT_PRECISION, DOT_UPCAST)
            dst = pt * (dpt - delta[None, :])
            dk += _dot(dst.to(q.dtype), q, DOT_PRECISION, DOT_UPCAST)

    # Accumulate (+=) into the travelling fp32 dk/dv buffers.
    dk_ptrs = DK + off_b.to(tl.int64) * stride_dkb + off_hk.to(tl.int64) * stride_dkh \
        + start_n.to(tl.int64) * stride_dkn + offs_tn[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + off_b.to(tl.int64) * stride_dvb + off_hk.to(tl.int64) * stride_dvh \
        + start_n.to(tl.int64) * stride_dvn + offs_tn[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
    dk_old = tl.load(dk_ptrs, mask=mask_nd, other=0.0)
    tl.store(dk_ptrs, dk_old + dk * softmax_scale, mask=mask_nd)
    dv_old = tl.load(dv_ptrs, mask=mask_nd, other=0.0)
    tl.store(dv_ptrs, dv_old + dv, mask=mask_nd)


# ----------------------------------------------------------------------------
# Launch configuration and argument checks
# ----------------------------------------------------------------------------


class KernelLaunch(NamedTuple):
    """How a launcher starts one kernel: which kernel, its compile-time
    (``tl.constexpr``) arguments, and the launch options Triton compiles with.

    The launchers build these with the ``*_launch`` functions below, through
    the same ``_*_call`` functions that cuda_kernel_calls uses, so what
    kernels/ahead_of_time.py compiles for GPU targets in CI is what the
    launchers run.
    """

    kernel: Any  # the @triton.jit function
    constexprs: dict
    num_warps: int
    num_stages: int

    def __call__(self, grid, *args):
        """Launch the kernel on ``grid`` with the runtime arguments ``args``, on
        the device of its first tensor argument and that device's current stream."""
        device = next(arg.device for arg in args if isinstance(arg, torch.Tensor))
        if device.type != "cuda":
            self._launch(grid, args)
            return
        # Triton launches on the *current* CUDA device; a caller whose tensors
        # are on cuda:1 while cuda:0 is current would otherwise get cuda:0's
        # stream and context for cuda:1's pointers.
        with torch.cuda.device(device):
            self._launch(grid, args)

    def _launch(self, grid, args):
        self.kernel[grid](*args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


def _block_d(headdim):
    # tl.arange needs a power of two and tl.dot wants every dim >= 16.
    return max(16, triton.next_power_of_2(headdim))


def _dot_precision(dtype):
    # fp32 inputs: exact fp32 products ("ieee") rather than TF32, whose ~1e-3
    # relative error would defeat the point of asking for fp32.  For fp16/bf16
    # the setting has no effect.
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_upcast(dtype, interpreted):
    # bf16 tl.dot is wrong in the Triton interpreter (see _dot): widen there.
    return dtype == torch.bfloat16 and interpreted


def _runs_in_interpreter(t):
    # CPU tensors can only be run by the interpreter; CUDA tensors are run by
    # it when TRITON_INTERPRET=1.
    if not t.is_cuda:
        return True
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class GpuTarget(NamedTuple):
    """The two properties of a CUDA GPU that decide the step kernels' tiles."""

    capability: int  # 10 * major + minor: 90 for sm_90 (H100/H200)
    shared_memory_per_block: int  # bytes one block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin)

    @classmethod
    def of_capability(cls, capability):
        """The target of a GPU known only by its compute capability (ahead-of-time
        compiles, tests), with the shared memory that capability has."""
        if capability not in SHARED_MEMORY_PER_BLOCK:
            raise ValueError(f"no shared-memory size on record for sm_{capability}; "
                             f"known: {sorted(SHARED_MEMORY_PER_BLOCK)}")
        return cls(capability, SHARED_MEMORY_PER_BLOCK[capability])

    @property
    def matrix_instruction(self):
        """How Triton drives this GPU's tensor cores: 'mma.sync' (per warp,
        accumulators in registers: sm_8x and the sm_12x GeForce/workstation
        Blackwells) or 'warpgroup' (wgmma on sm_90, tcgen05 on sm_100-sm_11x)."""
        return "warpgroup" if 90 <= self.capability < 120 else "mma.sync"


# Largest dynamic shared memory one block may use, by compute capability (CUDA
# programming guide, "Technical Specifications per Compute Capability").
SHARED_MEMORY_PER_BLOCK = {
    80: 166912, 87: 166912,  # A100, A30; Jetson Orin
    86: 101376, 89: 101376,  # RTX 30xx, A10, A40; RTX 40xx, L4, L40S
    90: 232448, 100: 232448, 103: 232448,  # H100, H200; B200; B300
    120: 101376, 121: 101376,  # RTX 50xx, RTX PRO 6000 Blackwell; DGX Spark
}
# The 99 KiB parts (sm_86/89/12x): a tile must fit there on its own (fp32 dq at
# d256 with the sm_90 tile takes 133120 B).
_SMALLEST_SHARED_MEMORY = min(SHARED_MEMORY_PER_BLOCK.values())

# CUDA tiles, (BLOCK_M, BLOCK_N, num_warps, num_stages), by kernel and by (bytes
# per element, BLOCK_D); BLOCK_D 16 and 32 use the 64 entry.  _TILES holds the
# sm_90 choice; _TILE_OVERRIDES replace entries for other targets.
#
# fp16/bf16 follow the Triton fused-attention tutorial: wide q tiles forward and
# in dq, wide k tiles in dk/dv (on sm_90 a tile dimension of 64+ rows per
# warpgroup is what lets Triton use wgmma).  fp32 asks for exact ("ieee")
# products, which run as FMAs on registers, not on tensor cores: small tiles.
#
# Chosen by compiling every entry ahead of time (python -m
# seqpar_kernels.kernels.ahead_of_time lists them; the test
# tests/test_attention_step_ahead_of_time.py holds them to it): on every target
# of that test (sm_80, sm_86, sm_90, sm_100, sm_120) each fits the shared memory
# and has no register spill inside its K/V or Q sweep.  Spill accesses inside the
# loop of what the tiles replaced (compiled 2026-11-22, sm_90 unless named):
# - fp32 used the fp16 tiles, (128|32, 64|32|128, 8, 2): 159 to 15000 per kernel;
#   fp32 dk/dv (16, 32, 8, 2) 3 at d128 with GQA, (16, 32, 4, 2) up to 294 at d256
#   and 1 at d64 on sm_80, (16, 16, 8, 2) 2 at d128 on sm_120 (GQA);
# - bf16/fp16 dk/dv at d256 was (32, 64, 8, 1): 9 to 25;
# - bf16/fp16 dq at d256, (64, 32, 8, 1): none on sm_90; 365 on sm_80, 238 on sm_120;
# - bf16/fp16 dk/dv at d128, (32, 128, 8, 2): none on sm_90; with GQA 12-13 on
#   sm_80, 37-55 on sm_100; 6-24 on sm_120;
# - bf16/fp16 forward at d64, (128, 64, 4, 3): none on sm_90; 1 on sm_100 (causal GQA);
# - fp32 dq at d256, (16, 32, 8, 2), does not fit sm_86/sm_120 (133120 B); with
#   one stage, (16, 32, 8, 1), it spills 800-860.
# Not held to it: local lengths that are not a multiple of 16 compile to other
# variants (no divisibility hint on lengths and lse strides); at length 1170, 4 of
# 240 (bf16 and fp32, d64/128/256, all five targets) have 1-4 spill accesses in a
# loop: sm_80 bf16 dq d256 causal, and fp32 dk/dv.  Head dims 16 and 32 (BLOCK_D
# 16/32): 1 of 160, sm_100 bf16 dk/dv d16 causal, 3.
# No GPU has timed these yet: the ring-step-fwd/bwd rows of `python -m bench`
# (bench/bench_ring.py) time them against SDPA on one.
_FP32_TILES = (16, 32, 8, 2)
_FP32_NARROW_TILES = (16, 16, 8, 2)
_TILES = {
    "forward": {(2, 64): (128, 64, 4, 3), (2, 128): (128, 64, 8, 2), (2, 256): (64, 32, 8, 2),
                (4, 64): _FP32_TILES, (4, 128): _FP32_TILES, (4, 256): _FP32_TILES},
    "dq": {(2, 64): (128, 32, 8, 2), (2, 128): (128, 32, 8, 2), (2, 256): (64, 32, 8, 1),
           (4, 64): _FP32_TILES, (4, 128): _FP32_TILES, (4, 256): _FP32_TILES},
    "dkdv": {(2, 64): (32, 128, 8, 2), (2, 128): (32, 128, 8, 2), (2, 256): (32, 32, 8, 1),
             (4, 64): _FP32_NARROW_TILES, (4, 128): (16, 32, 4, 2), (4, 256): _FP32_NARROW_TILES},
}


def _uses_mma_sync(target):
    return target.matrix_instruction == "mma.sync"


def _is_datacenter_blackwell(target):
    return 100 <= target.capability < 120


def _has_small_shared_memory(target):
    return target.shared_memory_per_block <= _SMALLEST_SHARED_MEMORY


# (which targets, {kernel: {key: tiles}}), applied in order: a later match wins.
_TILE_OVERRIDES = (
    (_uses_mma_sync, {"dq": {(2, 256): (32, 64, 8, 1)}, "dkdv": {(2, 128): (32, 64, 8, 2)}}),
    (_is_datacenter_blackwell, {"forward": {(2, 64): (128, 64, 8, 3)}, "dkdv": {(2, 128): (32, 64, 8, 2)}}),
    (_has_small_shared_memory, {"dq": {(4, 256): _FP32_NARROW_TILES}}),
)

# The Triton interpreter (CPU tensors, TRITON_INTERPRET=1): small tiles keep the
# numpy work cheap and still exercise multi-tile loops and edge masks on short
# test sequences.
_INTERPRETER_TILES = (16, 32, 4, 1)


def all_cuda_tiles():
    """Every tile shape a CUDA launch can take (tests run each in the interpreter)."""
    tables = [*_TILES.values()] + [table for _, overrides in _TILE_OVERRIDES for table in overrides.values()]
    return sorted({tiles for table in tables for tiles in table.values()})


def _tiles(kernel, dtype, block_d, target):
    # kernel: "forward", "dq" or "dkdv"; target: a GpuTarget, None for CPU tensors.
    if target is None:
        return _INTERPRETER_TILES
    key = (dtype.itemsize, max(64, block_d))
    tiles = _TILES[kernel][key]
    for applies, overrides in _TILE_OVERRIDES:
        if applies(target) and key in overrides.get(kernel, {}):
            tiles = overrides[kernel][key]
    return tiles


def check_launchable(q):
    """Raises ValueError when the step kernels cannot run on ``q`` (batch, seqlen,
    nheads, headdim): a GPU older than sm_80, or batch or nheads above CUDA's grid limit.
    Local: the ring calls it before any collective."""
    if not q.is_cuda:
        return
    cuda_target(q)
    if q.shape[0] > _MAX_GRID_YZ or q.shape[2] > _MAX_GRID_YZ:
        # heads and batch index grid axes 1 and 2, which CUDA caps at 65535.
        raise ValueError(f"batch and nheads must be at most {_MAX_GRID_YZ}, got q shape {tuple(q.shape)}")


def cuda_target(t):
    """The GpuTarget of ``t``'s CUDA device, or None for a tensor that is not on
    a CUDA device.  Raises ValueError for GPUs older than sm_80."""
    if not t.is_cuda:
        return None
    return _device_target(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_target(device_index):
    # Asked once per device, not at every ring step's launch.
    properties = torch.cuda.get_device_properties(device_index)
    capability = 10 * properties.major + properties.minor
    if capability < 80:
        raise ValueError(f"ring attention's Triton kernels need a GPU of compute capability 8.0 or newer "
                         f"(bf16 tensor cores); cuda:{device_index} ({properties.name}) is sm_{capability}")
    # torch < 2.5 has no shared_memory_per_block_optin: fall back to the table,
    # and to the smallest size on record for a GPU not in it.
    shared_memory = getattr(properties, "shared_memory_per_block_optin", None) or \
        SHARED_MEMORY_PER_BLOCK.get(capability, _SMALLEST_SHARED_MEMORY)
    return GpuTarget(capability, shared_memory)


def _step_launch(kernel, tiles, dtype, block_d, causal, interpreted, **more_constexprs):
    block_m, block_n, num_warps, num_stages = tiles
    constexprs = dict(CAUSAL=bool(causal), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                      DOT_PRECISION=_dot_precision(dtype), DOT_UPCAST=_dot_upcast(dtype, interpreted),
                      **more_constexprs)
    return KernelLaunch(kernel, constexprs, num_warps, num_stages)


def _triton_version(version=triton.__version__):
    """(major, minor) of a Triton version string such as '3.6.0' or '3.8.0+git1a2b'."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


# Whether the forward kernel sweeps its whole k tiles without masks, apart from
# the diagonal and partial ones (SPLIT_SWEEP): two loops instead of one.  Triton
# before 3.8 software-pipelines each loop with its own buffers, and the pair
# does not fit.  Compiled for sm_90 (python -m seqpar_kernels.kernels.ahead_of_time
# run from an environment with that Triton), the split forward spills 40 to 135
# accesses inside its loops with Triton 3.3 to 3.7 at bf16 d64, d128 and d256,
# and takes 163840 B of shared memory at d128 where one loop takes 98304 B; with
# Triton 3.6 it also spills on sm_80/86 (d128, d256: 96 to 126) and sm_100 (d128:
# 4 to 47).  One masked loop with the same tiles compiles without a spill in a
# loop on all five targets with Triton 3.5, 3.6 (every step kernel: the one
# exception is fp32 dk/dv d64 GQA, 1 to 3 accesses) and 3.7; Triton 3.3 and 3.4
# still spill in fp32 d256 (190 to 229) and 3.4 in bf16 d128 on sm_80/86/120
# (6 to 12).  Triton 3.8 and 3.9 compile the split sweep without a spill on
# every target of the ahead-of-time test.  The two forms have not yet been
# timed against each other on a GPU.
SPLIT_FORWARD_SWEEP = _triton_version() >= (3, 8)


def forward_launch(dtype, headdim, causal, *, target, interpreted):
    """The KernelLaunch of ``_attention_step_fwd_kernel``.

    ``target`` (a GpuTarget) picks the GPU tiles; None picks the small tiles
    used on CPU tensors, which only the interpreter runs.  ``interpreted`` says
    whether the Triton interpreter runs the kernel.
    """
    block_d = _block_d(headdim)
    return _step_launch(_attention_step_fwd_kernel, _tiles("forward", dtype, block_d, target),
                        dtype, block_d, causal, interpreted, SPLIT_SWEEP=SPLIT_FORWARD_SWEEP)


def backward_preprocess_launch(headdim, *, target):
    """The KernelLaunch of ``_attention_bwd_preprocess_kernel`` (any input dtype:
    the kernel widens out and dout to fp32 before it multiplies)."""
    # num_warps / num_stages are Triton's defaults, written out so that the
    # ahead-of-time compile test builds exactly the kernel the launcher runs.
    return KernelLaunch(_attention_bwd_preprocess_kernel,
                        dict(BLOCK_M=16 if target is None else 64, BLOCK_D=_block_d(headdim)),
                        num_warps=4, num_stages=3)


def backward_launches(dtype, headdim, causal, *, target, interpreted):
    """(dq KernelLaunch, dk/dv KernelLaunch) of the backward step kernels;
    ``target`` and ``interpreted`` as in forward_launch."""
    block_d = _block_d(headdim)
    return (
        _step_launch(_attention_step_bwd_dq_kernel, _tiles("dq", dtype, block_d, target),
                     dtype, block_d, causal, interpreted),
        _step_launch(_attention_step_bwd_dkdv_kernel, _tiles("dkdv", dtype, block_d, target),
                     dtype, block_d, causal, interpreted),
    )


def _forward_call(q, k, v, out, lse, scale, causal, *, target, interpreted):
    """(KernelLaunch, grid, positional arguments) of the forward step kernel."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    launch = forward_launch(q.dtype, headdim, causal, target=target, interpreted=interpreted)
    grid = (triton.cdiv(seqlen_q, launch.constexprs["BLOCK_M"]), nheads, batch)
    args = (q, k, v, out, lse,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
            seqlen_q, seqlen_k, headdim, nheads // nheads_kv,
            scale * _LOG2E)
    return launch, grid, args


def _backward_preprocess_call(out, dout, delta, *, target):
    """(KernelLaunch, grid, positional arguments) of the delta = rowsum(dout * out) kernel."""
    batch, seqlen_q, nheads, headdim = out.shape
    launch = backward_preprocess_launch(headdim, target=target)
    grid = (triton.cdiv(seqlen_q, launch.constexprs["BLOCK_M"]), nheads, batch)
    args = (out, dout, delta, *out.stride(), *dout.stride(), *delta.stride(), seqlen_q, headdim)
    return launch, grid, args


def _backward_calls(q, k, v, dout, lse, delta, dq, dk, dv, scale, causal, *, target, interpreted):
    """[(KernelLaunch, grid, positional arguments)] of the dq and the dk/dv kernels."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    dq_launch, dkdv_launch = backward_launches(q.dtype, headdim, causal,
                                               target=target, interpreted=interpreted)
    inputs = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), *lse.stride(), *delta.stride())
    sizes_and_scales = (seqlen_q, seqlen_k, headdim, nheads // nheads_kv, scale, scale * _LOG2E)
    return [
        (dq_launch, (triton.cdiv(seqlen_q, dq_launch.constexprs["BLOCK_M"]), nheads, batch),
         (q, k, v, dout, lse, delta, dq, *inputs, *dq.stride(), *sizes_and_scales)),
        (dkdv_launch, (triton.cdiv(seqlen_k, dkdv_launch.constexprs["BLOCK_N"]), nheads_kv, batch),
         (q, k, v, dout, lse, delta, dk, dv, *inputs, *dk.stride(), *dv.stride(), *sizes_and_scales)),
    ]


def cuda_kernel_calls(q, k, v, causal, target):
    """Every kernel launch that one forward and one backward ring step run on CUDA
    tensors shaped and strided like ``q``, ``k``, ``v`` (which may live on the
    meta device) on the GPU ``target`` (a GpuTarget), as
    ``[(KernelLaunch, positional arguments)]``.  The running
    state (out, lse), dout and the gradients are taken contiguous, as the ring
    allocates them.  kernels/ahead_of_time.py compiles these for GPU targets."""
    fp32 = torch.float32
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty(q.shape, dtype=fp32, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=fp32, device=q.device)
    dout = torch.empty_like(q, memory_format=torch.contiguous_format)
    delta = torch.empty_like(lse)
    dq = torch.empty_like(out)
    dk, dv = (torch.empty(t.shape, dtype=fp32, device=t.device) for t in (k, v))
    scale = q.shape[-1] ** -0.5
    calls = [_forward_call(q, k, v, out, lse, scale, causal, target=target, interpreted=False),
             _backward_preprocess_call(out.to(q.dtype), dout, delta, target=target),
             *_backward_calls(q, k, v, dout, lse, delta, dq, dk, dv, scale, causal,
                              target=target, interpreted=False)]
    return [(launch, args) for launch, _grid, args in calls]


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of float32/float16/bfloat16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    batch, seqlen_q, nheads, headdim = q.shape
    _, seqlen_k, nheads_kv, headdim_k = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"batch mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if headdim_k != headdim:
        raise ValueError(f"head dim mismatch: q {tuple(q.shape)} has {headdim}, k {tuple(k.shape)} has {headdim_k}")
    if not 1 <= headdim <= _MAX_HEADDIM:
        raise ValueError(f"head dim must be in [1, {_MAX_HEADDIM}], got {headdim} (q shape {tuple(q.shape)})")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(
            f"nheads ({nheads}, q shape {tuple(q.shape)}) must be a multiple of nheads_kv "
            f"({nheads_kv}, k shape {tuple(k.shape)})")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_launchable(q)
    return batch, seqlen_q, nheads, headdim, seqlen_k, nheads_kv


def _check_mask_mode(mask_mode, seqlen_q, seqlen_k, q, k):
    if mask_mode not in (MASK_FULL, MASK_CAUSAL) or isinstance(mask_mode, bool):
        raise ValueError(f"mask_mode must be MASK_FULL ({MASK_FULL}) or MASK_CAUSAL ({MASK_CAUSAL}), got {mask_mode!r}")
    if mask_mode == MASK_CAUSAL and seqlen_q != seqlen_k:
        raise ValueError(
            f"MASK_CAUSAL is for the diagonal block and needs seqlen_q == seqlen_k, "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}")


def _check_fp32(name, t, shape, device):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {t.dtype} (shape {tuple(t.shape)})")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_scale(softmax_scale):
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise ValueError(f"softmax_scale must be a number, got {softmax_scale!r}") from None
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return scale


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def attention_step_forward(q, k, v, out, lse, *, softmax_scale, mask_mode):
    """Fold one K/V block into the running attention result, in place.

    Args:
        q: (batch, seqlen_q, nheads, headdim), float32/float16/bfloat16.
        k, v: (batch, seqlen_k, nheads_kv, headdim), same dtype as q;
            nheads % nheads_kv == 0 (q head h uses kv head h // (nheads // nheads_kv)).
        out: float32 (batch, seqlen_q, nheads, headdim), running output; updated in place.
        lse: float32 (batch, nheads, seqlen_q), running natural-log log-sum-exp;
            updated in place.  Start with out = 0 and lse = -inf.
        softmax_scale: multiplier of q @ k^T (usually headdim ** -0.5).
        mask_mode: MASK_FULL, or MASK_CAUSAL for the diagonal block
            (seqlen_q == seqlen_k, query i attends keys j <= i).

    Any tensor may be non-contiguous.  Rows that see no key of this block are
    left untouched.  Returns (out, lse), the same tensors.
    """
    batch, seqlen_q, nheads, headdim, seqlen_k, nheads_kv = _check_qkv(q, k, v)
    _check_mask_mode(mask_mode, seqlen_q, seqlen_k, q, k)
    scale = _check_scale(softmax_scale)
    _check_fp32("out", out, q.shape, q.device)
    _check_fp32("lse", lse, (batch, nheads, seqlen_q), q.device)
    if batch == 0 or nheads == 0 or seqlen_q == 0 or seqlen_k == 0:
        return out, lse  # an empty block changes nothing

    launch, grid, args = _forward_call(q, k, v, out, lse, scale, mask_mode == MASK_CAUSAL,
                                       target=cuda_target(q), interpreted=_runs_in_interpreter(q))
    launch(grid, *args)
    return out, lse


def attention_backward_preprocess(out, dout):
    """delta = rowsum(dout * out) in float32.

    Args:
        out: (batch, seqlen_q, nheads, headdim), the FINAL attention output
            (after all ring steps), any float dtype.
        dout: gradient of out, same shape, any float dtype.

    Returns:
        delta: new contiguous float32 tensor (batch, nheads, seqlen_q).
    """
    for name, t in (("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen_q, nheads, headdim), got shape {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype must be float32/float16/bfloat16, got {t.dtype}")
    if out.shape != dout.shape:
        raise ValueError(f"out and dout shapes differ: out {tuple(out.shape)}, dout {tuple(dout.shape)}")
    if out.device != dout.device:
        raise ValueError(f"out and dout must be on one device, got {out.device}, {dout.device}")
    batch, seqlen_q, nheads, headdim = out.shape
    if headdim > _MAX_HEADDIM:
        raise ValueError(f"head dim must be at most {_MAX_HEADDIM}, got out shape {tuple(out.shape)}")
    delta = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=out.device)
    if delta.numel() == 0:
        return delta
    if headdim == 0:
        return delta.zero_()
    launch, grid, args = _backward_preprocess_call(out, dout, delta, target=cuda_target(out))
    launch(grid, *args)
    return delta


def attention_step_backward(q, k, v, out, dout, lse, delta, dq, dk, dv, *, softmax_scale, mask_mode):
    """Add one K/V block's gradients to dq, dk, dv, in place (+=).

    Args:
        q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim),
            same dtype (float32/float16/bfloat16); nheads % nheads_kv == 0.
        out: (batch, seqlen_q, nheads, headdim) final output; only used to build
            delta when delta is None.
        dout: (batch, seqlen_q, nheads, headdim) gradient of the final output.
        lse: float32 (batch, nheads, seqlen_q), the FINAL log-sum-exp after all
            ring steps (rows with -inf get zero gradient).
        delta: float32 (batch, nheads, seqlen_q) = rowsum(dout * out), from
            attention_backward_preprocess; None computes it here.
        dq: float32 (batch, seqlen_q, nheads, headdim), accumulated in place.
        dk, dv: float32 (batch, seqlen_k, nheads_kv, headdim), accumulated in place.
        softmax_scale, mask_mode: as given to attention_step_forward for this block.

    Deterministic: every output element has a single writer (no atomics).
    Returns (dq, dk, dv), the same tensors.
    """
    batch, seqlen_q, nheads, headdim, seqlen_k, nheads_kv = _check_qkv(q, k, v)
    _check_mask_mode(mask_mode, seqlen_q, seqlen_k, q, k)
    scale = _check_scale(softmax_scale)
    for name, t in (("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype must be float32/float16/bfloat16, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")
    _check_fp32("lse", lse, (batch, nheads, seqlen_q), q.device)
    if delta is None:
        delta = attention_backward_preprocess(out, dout)
    _check_fp32("delta", delta, (batch, nheads, seqlen_q), q.device)
    _check_fp32("dq", dq, q.shape, q.device)
    _check_fp32("dk", dk, k.shape, q.device)
    _check_fp32("dv", dv, v.shape, q.device)
    if batch == 0 or nheads == 0 or seqlen_q == 0 or seqlen_k == 0:
        return dq, dk, dv

    for launch, grid, args in _backward_calls(q, k, v, dout, lse, delta, dq, dk, dv, scale,
                                              mask_mode == MASK_CAUSAL, target=cuda_target(q),
                                              interpreted=_runs_in_interpreter(q)):
        launch(grid, *args)
    return dq, dk, dv
