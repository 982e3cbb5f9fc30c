"""A plain FlashAttention-2 in Triton: the yardstick of the ahead-of-time report (over
500 lines: one reference kernel beside each of the three step kernels).

``python -m tools.ahead_of_time`` compiles these kernels with
the tiles, warps, stages, dtype and head dim of every step launch (forward, dq,
dk/dv) and prints their registers, spills, shared memory and instructions per
loop iteration next to those of the step kernels.  The step kernels do more
(the forward merges into a running (out, lse); all of them mask ragged lengths
and head dims, handle GQA, rows without keys and packed documents); these are
what the same tiles cost when they do nothing else, written in the manner of
Triton's fused-attention tutorial:

- one program per (q tile, head, batch), or (k tile, head, batch) for dk/dv,
  over (batch, seqlen, heads, headdim) tensors addressed through strides;
- the softmax scale (times log2(e)) folded into the exp2 argument, so that each
  score costs one FMA before its exp2;
- every accumulator updated by its product itself, ``tl.dot(a, b, acc)``;
- with a causal mask, the tiles that straddle the diagonal in a loop of their
  own, the only one that builds a mask;
- results written once at the end (out and lse; dq; dk and dv), nothing read
  back.

They are compiled only, never shipped as ops, and they take the tutorial's
shortcuts: seqlen_q == seqlen_k (causal) and both a multiple of BLOCK_M and
BLOCK_N, headdim == BLOCK_D, a positive scale, every row seeing at least one
key, no GQA.
"""

import triton
import triton.language as tl


@triton.jit
def _reference_fwd_sweep(
    acc,
    l_i,
    m_i,
    q,
    k_ptrs,
    v_ptrs,
    stride_kn,
    stride_vn,
    lo,
    hi,
    offs_m,
    offs_n,
    qk_scale,
    DIAGONAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Folds keys [lo, hi) into the online softmax (acc, l_i, m_i), base 2.
    # DIAGONAL: the tiles that straddle the diagonal, where key j > row i is
    # masked; elsewhere every key is seen and no mask is built.
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        kt = tl.load(k_ptrs)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION)
        if DIAGONAL:
            # A large negative finite value rather than -inf: the row's first key
            # (j = 0 <= i) is always seen, so its maximum stays finite and no
            # inf - inf can appear.
            seen = offs_m[:, None] >= start_n + offs_n[None, :]
            s = s * qk_scale + tl.where(seen, 0.0, -1.0e6)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            s = s - m_new[:, None]
        else:
            # The scale is positive, so max(s) * scale == max(s * scale): the
            # scaling and the subtraction of the maximum are one FMA per score.
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            s = s * qk_scale - m_new[:, None]
        p = tl.exp2(s)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def reference_attention_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_om,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    stride_lm,
    seqlen_k,
    qk_scale,  # softmax_scale * log2(e), positive
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # out = softmax(q k^T * scale) v and its natural-log lse, for one q tile.
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_h.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_h.to(tl.int64) * stride_vh
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd  # K^T tile
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        # The whole k tiles before the q tile's first row, unmasked; then the
        # tiles up to its last row, masked.
        diagonal = (start_m // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _reference_fwd_sweep(
            acc,
            l_i,
            m_i,
            q,
            k_ptrs,
            v_ptrs,
            stride_kn,
            stride_vn,
            0,
            diagonal,
            offs_m,
            offs_n,
            qk_scale,
            False,
            BLOCK_N,
            DOT_PRECISION,
        )
        acc, l_i, m_i = _reference_fwd_sweep(
            acc,
            l_i,
            m_i,
            q,
            k_ptrs,
            v_ptrs,
            stride_kn,
            stride_vn,
            diagonal,
            start_m + BLOCK_M,
            offs_m,
            offs_n,
            qk_scale,
            True,
            BLOCK_N,
            DOT_PRECISION,
        )
    else:
        acc, l_i, m_i = _reference_fwd_sweep(
            acc,
            l_i,
            m_i,
            q,
            k_ptrs,
            v_ptrs,
            stride_kn,
            stride_vn,
            0,
            seqlen_k,
            offs_m,
            offs_n,
            qk_scale,
            False,
            BLOCK_N,
            DOT_PRECISION,
        )

    out = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # natural log, as flash-attention stores it
    o_base = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty))
    tl.store(Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + offs_m * stride_lm, lse)


# ----------------------------------------------------------------------------
# Backward: dq over the k tiles, dk/dv over the q tiles
# ----------------------------------------------------------------------------
#
# The step backward's two kernels, tutorial style: delta = rowsum(dout * out)
# comes precomputed, P is rebuilt from the final lse with one FMA per score,
# and each gradient is accumulated by its product (tl.dot(..., acc)); causal
# masks only on the tiles that straddle the diagonal.  Gradients are written,
# not added to.


@triton.jit
def _reference_bwd_dq_sweep(
    dq,
    q,
    do,
    lse2,
    delta,
    kt_ptrs,
    vt_ptrs,
    stride_kn,
    stride_vn,
    lo,
    hi,
    offs_m,
    offs_n,
    qk_scale,
    DIAGONAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Adds the keys [lo, hi) to dq (without the softmax scale).  K is read
    # once per tile, transposed for q k^T and transposed back for ds k.
    kt_ptrs += lo * stride_kn
    vt_ptrs += lo * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        kt = tl.load(kt_ptrs)
        vt = tl.load(vt_ptrs)
        p = tl.exp2(tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        if DIAGONAL:
            p = tl.where(offs_m[:, None] >= start_n + offs_n[None, :], p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PRECISION)
        kt_ptrs += BLOCK_N * stride_kn
        vt_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def reference_attention_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DQ,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_gb,
    stride_gm,
    stride_gh,
    stride_gd,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_eb,
    stride_eh,
    stride_em,
    stride_dqb,
    stride_dqm,
    stride_dqh,
    stride_dqd,
    seqlen_k,
    softmax_scale,
    qk_scale,  # qk_scale = softmax_scale * log2(e)
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # dq of one q tile: dq = scale * sum over k tiles of (P * (dP - delta)) K.
    start_m = tl.program_id(0) * BLOCK_M
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q = tl.load(
        Q
        + off_b.to(tl.int64) * stride_qb
        + off_h.to(tl.int64) * stride_qh
        + offs_m[:, None] * stride_qm
        + offs_d[None, :] * stride_qd
    )
    do = tl.load(
        DO
        + off_b.to(tl.int64) * stride_gb
        + off_h.to(tl.int64) * stride_gh
        + offs_m[:, None] * stride_gm
        + offs_d[None, :] * stride_gd
    )
    lse2 = (
        tl.load(Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + offs_m * stride_lm)
        * 1.4426950408889634
    )
    delta = tl.load(Delta + off_b.to(tl.int64) * stride_eb + off_h.to(tl.int64) * stride_eh + offs_m * stride_em)
    kt_ptrs = (
        K
        + off_b.to(tl.int64) * stride_kb
        + off_h.to(tl.int64) * stride_kh
        + offs_n[None, :] * stride_kn
        + offs_d[:, None] * stride_kd
    )
    vt_ptrs = (
        V
        + off_b.to(tl.int64) * stride_vb
        + off_h.to(tl.int64) * stride_vh
        + offs_n[None, :] * stride_vn
        + offs_d[:, None] * stride_vd
    )

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        diagonal = (start_m // BLOCK_N) * BLOCK_N
        dq = _reference_bwd_dq_sweep(
            dq,
            q,
            do,
            lse2,
            delta,
            kt_ptrs,
            vt_ptrs,
            stride_kn,
            stride_vn,
            0,
            diagonal,
            offs_m,
            offs_n,
            qk_scale,
            False,
            BLOCK_N,
            DOT_PRECISION,
        )
        dq = _reference_bwd_dq_sweep(
            dq,
            q,
            do,
            lse2,
            delta,
            kt_ptrs,
            vt_ptrs,
            stride_kn,
            stride_vn,
            diagonal,
            start_m + BLOCK_M,
            offs_m,
            offs_n,
            qk_scale,
            True,
            BLOCK_N,
            DOT_PRECISION,
        )
    else:
        dq = _reference_bwd_dq_sweep(
            dq,
            q,
            do,
            lse2,
            delta,
            kt_ptrs,
            vt_ptrs,
            stride_kn,
            stride_vn,
            0,
            seqlen_k,
            offs_m,
            offs_n,
            qk_scale,
            False,
            BLOCK_N,
            DOT_PRECISION,
        )
    tl.store(
        DQ
        + off_b.to(tl.int64) * stride_dqb
        + off_h.to(tl.int64) * stride_dqh
        + offs_m[:, None] * stride_dqm
        + offs_d[None, :] * stride_dqd,
        dq * softmax_scale,
    )


@triton.jit
def _reference_bwd_dkdv_sweep(
    dk,
    dv,
    k,
    v,
    q_ptrs,
    do_ptrs,
    lse_ptrs,
    delta_ptrs,
    stride_qm,
    stride_gm,
    stride_lm,
    stride_em,
    lo,
    hi,
    offs_n,
    offs_m,
    qk_scale,
    DIAGONAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Adds the q rows [lo, hi) to dk (without the softmax scale) and dv, in
    # transposed scores (keys x rows) so that dk and dv come out row-major.
    q_ptrs += lo * stride_qm
    do_ptrs += lo * stride_gm
    lse_ptrs += lo * stride_lm
    delta_ptrs += lo * stride_em
    for start_m in range(lo, hi, BLOCK_M):
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse2 = tl.load(lse_ptrs) * 1.4426950408889634
        delta = tl.load(delta_ptrs)
        pt = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
        if DIAGONAL:
            pt = tl.where(start_m + offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_gm
        lse_ptrs += BLOCK_M * stride_lm
        delta_ptrs += BLOCK_M * stride_em
    return dk, dv


@triton.jit
def reference_attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DK,
    DV,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_gb,
    stride_gm,
    stride_gh,
    stride_gd,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_eb,
    stride_eh,
    stride_em,
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dkd,
    stride_dvb,
    stride_dvn,
    stride_dvh,
    stride_dvd,
    seqlen_q,
    softmax_scale,
    qk_scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # dk, dv of one k tile: dv = P^T dout, dk = scale * (P * (dP - delta))^T q.
    start_n = tl.program_id(0) * BLOCK_N
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    k = tl.load(
        K
        + off_b.to(tl.int64) * stride_kb
        + off_h.to(tl.int64) * stride_kh
        + offs_n[:, None] * stride_kn
        + offs_d[None, :] * stride_kd
    )
    v = tl.load(
        V
        + off_b.to(tl.int64) * stride_vb
        + off_h.to(tl.int64) * stride_vh
        + offs_n[:, None] * stride_vn
        + offs_d[None, :] * stride_vd
    )
    q_ptrs = (
        Q
        + off_b.to(tl.int64) * stride_qb
        + off_h.to(tl.int64) * stride_qh
        + offs_m[:, None] * stride_qm
        + offs_d[None, :] * stride_qd
    )
    do_ptrs = (
        DO
        + off_b.to(tl.int64) * stride_gb
        + off_h.to(tl.int64) * stride_gh
        + offs_m[:, None] * stride_gm
        + offs_d[None, :] * stride_gd
    )
    lse_ptrs = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + offs_m * stride_lm
    delta_ptrs = Delta + off_b.to(tl.int64) * stride_eb + off_h.to(tl.int64) * stride_eh + offs_m * stride_em

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        # The q tiles that hold rows both before and after some of this tile's
        # keys, masked; then the rows after all of them, unmasked.
        diagonal = (start_n // BLOCK_M) * BLOCK_M
        past = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
        dk, dv = _reference_bwd_dkdv_sweep(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            lse_ptrs,
            delta_ptrs,
            stride_qm,
            stride_gm,
            stride_lm,
            stride_em,
            diagonal,
            past,
            offs_n,
            offs_m,
            qk_scale,
            True,
            BLOCK_M,
            DOT_PRECISION,
        )
        dk, dv = _reference_bwd_dkdv_sweep(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            lse_ptrs,
            delta_ptrs,
            stride_qm,
            stride_gm,
            stride_lm,
            stride_em,
            past,
            seqlen_q,
            offs_n,
            offs_m,
            qk_scale,
            False,
            BLOCK_M,
            DOT_PRECISION,
        )
    else:
        dk, dv = _reference_bwd_dkdv_sweep(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            lse_ptrs,
            delta_ptrs,
            stride_qm,
            stride_gm,
            stride_lm,
            stride_em,
            0,
            seqlen_q,
            offs_n,
            offs_m,
            qk_scale,
            False,
            BLOCK_M,
            DOT_PRECISION,
        )
    tl.store(
        DK
        + off_b.to(tl.int64) * stride_dkb
        + off_h.to(tl.int64) * stride_dkh
        + offs_n[:, None] * stride_dkn
        + offs_d[None, :] * stride_dkd,
        dk * softmax_scale,
    )
    tl.store(
        DV
        + off_b.to(tl.int64) * stride_dvb
        + off_h.to(tl.int64) * stride_dvh
        + offs_n[:, None] * stride_dvn
        + offs_d[None, :] * stride_dvd,
        dv,
    )
