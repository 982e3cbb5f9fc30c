"""Triton kernels of one ring-attention step (the @triton.jit functions only).

One file for all of them (over 500 lines): the three kernels share their sweep and
load helpers, and Triton keys each compiled kernel on the source of what it calls.

In ring attention every rank keeps its own query block and sees the key/value
blocks of all ranks one after another.  Each arrival is one *step*: attention of
the local queries against the visiting K/V block, folded into a running result.
The launchers are in attention_step_launch.py, the tiles and launch options per
GPU in attention_step_tiles.py.

Forward (``attention_step_fwd_kernel``)
    computes the block's attention with an online softmax (FlashAttention-2
    style, fp32 accumulators) and merges it into the running fp32 ``(out, lse)``
    pair in the same kernel::

        new_lse = logaddexp(lse, block_lse)
        out     = out * exp(lse - new_lse) + block_out * exp(block_lse - new_lse)

    Start from ``out = 0`` and ``lse = -inf``, or run the first step with
    FIRST_STEP, which reads neither and writes every row (out = block_out,
    lse = block_lse; 0 and -inf for a row that sees no key of the block);
    after the last step ``out`` is the exact softmax attention over every block
    seen and ``lse`` its log-sum-exp.

Backward (``attention_step_bwd_dq_kernel``, ``attention_step_bwd_dkdv_kernel``)
    With the *final* ``lse`` (after all steps) the softmax probabilities of any
    block can be rebuilt locally as ``p = exp(s - lse)``, so each step's
    gradients are independent and simply add up.  The kernels add this block's
    contribution to ``dq`` (owned by the local rank) and to ``dk``/``dv`` (which
    travel around the ring with K/V).  ``attention_bwd_preprocess_kernel``
    computes ``delta = rowsum(dout * out)`` once for all steps.

Mask modes (compile-time flags, so each mode compiles to its own kernel and
the others carry no trace of it):

    neither    every query row attends every key of the block (full)
    CAUSAL     the diagonal block (seqlen_q == seqlen_k): row i attends keys j <= i
    INTERVALS  packed documents, sliding windows, chunks: row i attends
               exactly the keys ``row_start[i] <= j < row_end[i]``, and key j
               is attended by exactly the rows ``col_start[j] <= i < col_end[j]``

INTERVALS is how packed variable-length sequences look from one ring step: q
rows and keys are each sorted by global position, so the keys one row may see
(its own document, causal or not) are one contiguous index range of the block,
and so are the rows that see one key.  A sliding window (the keys within a
distance of the row's position) and chunked attention (the keys of the row's
chunk, up to its own position) are one interval per row as well.
``row_start``/``row_end`` are int32 (seqlen_q,), ``col_start``/``col_end``
int32 (seqlen_k,), shared by every batch entry and head; the two describe the
same mask and the caller keeps them consistent.  An interval with end <= start is empty.  The forward and the dq
kernel read the row intervals: a q tile sweeps only the k tiles of
``[min row_start, max row_end)`` over its rows with a non-empty interval (none:
it does nothing).  A k tile of the dk/dv kernel loops over the q rows of
``[min col_start, max col_end)`` over its keys' non-empty intervals and masks
with the same column intervals.  Keys (q rows for dk/dv) outside that range
are never read, so they may hold anything.  With SPLIT_SWEEP the forward and
dq send the whole k tiles of that range which every row of the q tile sees
through an unmasked sweep between two masked ones (``_seen_by_every_row``):
most tiles of a long window or document.

Layouts follow flash-attention: ``q`` is (batch, seqlen_q, nheads, headdim),
``k`` (batch, seqlen_k, nheads_kv, headdim) and ``v`` (batch, seqlen_k,
nheads_kv, headdim_v) with ``nheads % nheads_kv == 0`` (GQA/MQA: q head ``h``
reads kv head ``h // (nheads // nheads_kv)``, ``kv_group = nheads //
nheads_kv``; K/V are never repeated in memory).  ``out`` and ``dout`` are
(batch, seqlen_q, nheads, headdim_v); ``headdim_v`` may differ from
``headdim`` either way (multi-head latent attention: D = 192, Dv = 128):
q . k runs over HEAD_DIM columns, p . v and dout . v^T over VALUE_DIM.
``lse`` and ``delta`` are (batch, nheads, seqlen_q).  Every tensor may have
arbitrary strides: the kernels take strides.

Soft-capped scores (SOFTCAP, compile-time, with any mask mode): the score of
row i and key j is ``softcap * tanh(softmax_scale * q_i . k_j / softcap)``
(Gemma 2, Grok; flash-attention's ``softcap``) before the mask and the softmax,
and the backward takes its derivative, ``softmax_scale * (1 - tanh^2)`` per
score, recomputed from ``q . k`` in the dq and the dk/dv kernels
(``_softcapped``).  The cap's two runtime arguments, ``softcap_qk`` and
``softcap_log2e``, are None without SOFTCAP: compile-time constants, not
kernel parameters, so the kernels without the cap compile exactly as they
would without the feature.

Compile-time switches of the launches (attention_step_tiles.py):

    SPLIT_SWEEP         the tiles every row (forward, dq) or every key (dk/dv)
                        sees go through a loop without a causal, interval or
                        key mask, the diagonal, edge and partial ones through
                        masked loops (dk/dv: not with INTERVALS)
    TENSOR_DESCRIPTORS  q, k, v and dout come through tensor descriptors (TMA
                        on sm_90), built per program over one (batch, head):
                        rows past the block and columns past the head dim
                        (VALUE_DIM for v and dout) load as 0, so those loads
                        need no mask and no pointer or offset tensor lives in
                        registers
    FIRST_STEP          forward: out and lse are written, never read
    SPLIT_HEADS         dk/dv: the GQA group's q heads split over programs
                        that add with atomics

Grid: axis 0 the q tiles (k tiles for dk/dv), axis 1 the q heads (kv heads for
dk/dv, times the splits of each group's q heads with SPLIT_HEADS), axis 2 the
batch.

Numerics: all softmax statistics and accumulators are fp32.  Scores are taken
to base 2 (``log2(e)`` folded into the scale, ``qk_scale``) so the kernels use
``exp2``, and the scale goes into the exponent: ``exp2(qk * qk_scale - m)`` is
one FFMA per score (the forward's running max ``m`` is kept in those scaled
units; its unmasked sweep needs ``qk_scale >= 0``, which the launcher
ensures).  With SOFTCAP the capped score is taken to base 2 the same way
(``softcap * log2(e) * tanh``) and the running max is of it.  ``lse`` is
stored in natural-log units, the convention of flash-attention.  The head
dims are compile-time constants (``HEAD_DIM``, ``VALUE_DIM``), so each
head-dim mask vanishes when its dim is a power of two; with VALUE_DIM ==
HEAD_DIM the value columns' offsets and masks are the same values as the
key columns', which the compiler merges: the kernel of one head dim.
Rows that see no valid key are never written by the forward after the first
step (they stay exactly as they were), and rows whose final ``lse`` is ``-inf``
get zero gradient.
"""

import triton
import triton.language as tl


@triton.jit
def _offset64(index0, stride0, index1=0, stride1=0, index2=0, stride2=0):
    # index0 * stride0 + index1 * stride1 + index2 * stride2 in 64 bits: the
    # element offset of a program's batch, head and first row.  In int32 it
    # would wrap once an index times its stride reaches 2**31 (e.g. 256K rows of
    # 64 heads x 128), so every such offset is taken here; offsets inside a
    # tile stay small int32.  Pairs left out are a constant 0 and compile away.
    # tl.cast, not .to(): in the interpreter a loop index is a Python int.
    return (
        tl.cast(index0, tl.int64) * stride0 + tl.cast(index1, tl.int64) * stride1 + tl.cast(index2, tl.int64) * stride2
    )


@triton.jit
def _load_intervals(Start, End, offs, mask, length):
    # The intervals [start, end) of the rows ``offs`` (q rows: row_start/row_end,
    # keys: col_start/col_end) and their hull [lo, hi), the index range of the
    # other side that this program has to sweep.  Empty intervals (end <= start)
    # and rows past the end (mask False, loaded as the empty [0, 0)) must not
    # widen the hull: when every interval is empty, lo = length >= hi = 0 and the
    # sweep runs no iteration.  Clamped to [0, length]: a sweep never leaves the
    # block.
    start = tl.load(Start + offs, mask=mask, other=0)
    end = tl.load(End + offs, mask=mask, other=0)
    nonempty = end > start
    lo = tl.maximum(tl.min(tl.where(nonempty, start, length), 0), 0)
    hi = tl.minimum(tl.max(tl.where(nonempty, end, 0), 0), length)
    return start, end, lo, hi


@triton.jit
def _seen_by_every_row(start, end, mask, lo, hi, BLOCK: tl.constexpr):
    # [mid_lo, mid_hi): the whole tiles of the sweep over [lo, hi) (tiles of
    # BLOCK counted from lo) whose every index each of the rows ``mask`` sees,
    # i.e. inside [max start, min end) over those rows.  Both are lo plus a
    # multiple of BLOCK and lo <= mid_lo <= mid_hi; mid_lo == mid_hi when no
    # tile is seen by every row (a row with an empty interval: its start >=
    # its end).  The sweep then goes masked over [lo, mid_lo) and [mid_hi, hi)
    # and unmasked over [mid_lo, mid_hi): a sliding window or a long document
    # puts most of its tiles there.  mid_lo stays within the tile that holds
    # hi, so the first masked sweep never runs past the others' end.
    tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK)
    every_lo = tl.max(tl.where(mask, start, lo), 0)
    every_hi = tl.minimum(tl.min(tl.where(mask, end, hi), 0), hi)
    first = tl.minimum(tl.cdiv(tl.maximum(every_lo - lo, 0), BLOCK), tiles)
    last = tl.maximum(every_hi - lo, 0) // BLOCK
    return lo + first * BLOCK, lo + tl.maximum(first, last) * BLOCK


@triton.jit
def _softcapped(qk, softcap_qk, softcap_log2e):
    # The soft-capped score in base-2 units, softcap * tanh(x) * log2(e) with
    # x = softmax_scale * qk / softcap, and r = 1 / (1 + exp(2x)), from which
    # tanh(x) = 1 - 2r and its derivative 1 - tanh(x)^2 = 4r(1 - r) follow.
    # softcap_qk = 2 * log2(e) * softmax_scale / softcap, softcap_log2e =
    # softcap * log2(e).  exp2 and rsqrt rather than a tanh: the interpreter
    # and every Triton release have them, and r gives the backward's
    # derivative without cancellation near tanh = +-1.  r as rsqrt(x)^2: one
    # MUFU.RSQ and a multiply, where 1 / x is div.full.f32 (MUFU.RCP and four
    # instructions of range handling; 1075 against 885 SASS instructions per
    # iteration of the sm_90 bf16 d128 forward).  tanh is exact to a few fp32
    # ulps of 1 everywhere; exp2 overflowing to inf gives r = 0, tanh = 1, as
    # it should.
    root = tl.math.rsqrt(1.0 + tl.exp2(qk * softcap_qk))
    r = root * root
    return softcap_log2e - (2.0 * softcap_log2e) * r, r


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    # a @ b (+ acc, when acc is not None: the accumulator goes into the MMA
    # itself, no separate addition).  The Triton CPU interpreter
    # (TRITON_INTERPRET=1) keeps bfloat16 as raw uint16 bits and its tl.dot
    # multiplies those bits.  There the launcher sets DOT_UPCAST: operands
    # already rounded to bf16 are widened to fp32 first, which gives the same
    # numbers as a GPU bf16 dot (exact products, fp32 accumulation).
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _dim_mask(offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    # The valid head-dim columns of a BLOCK_D-wide tile.  BLOCK_D is HEAD_DIM
    # padded to a power of two (80 -> 128); when they are equal the mask is a
    # compile-time constant True, which Triton folds away: loads and stores
    # then carry no head-dim predicate.
    if HEAD_DIM == BLOCK_D:
        return tl.full([BLOCK_D], 1, tl.int1)
    else:
        return offs_d < HEAD_DIM


@triton.jit
def _attention_fwd_sweep(
    acc,
    l_i,
    m_i,
    q,
    k_ptrs,
    v_ptrs,
    k_desc,
    v_desc,
    stride_kn,
    stride_vn,
    lo,
    hi,
    offs_m,
    offs_n,
    mask_d,
    mask_dv,
    seqlen_k,
    row_start,
    row_end,
    qk_scale,
    softcap_qk,
    softcap_log2e,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    INTERVALS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    TENSOR_DESCRIPTORS: tl.constexpr,
):
    # Folds the keys [lo, hi) into the online-softmax state (acc, l_i, m_i);
    # k_ptrs/v_ptrs point at key lo and come back pointing at key hi (rounded
    # up to a whole tile).  Keys from seqlen_k on are neither loaded nor
    # attended.  MASKED=False: every key of every tile is valid for every row,
    # so no key mask and no causal or interval test.  row_start/row_end: the
    # rows' key intervals (INTERVALS only).  The running max m_i is in scaled
    # base-2 units (of qk * qk_scale, or of the soft-capped score with
    # SOFTCAP: _softcapped).  TENSOR_DESCRIPTORS: K and V come through
    # k_desc/v_desc (TMA), whose rows end at seqlen_k and columns at the head
    # dim: what lies past either loads as 0, no mask needed.
    for start_n in range(lo, hi, BLOCK_N):
        if MASKED:
            cols = start_n + offs_n
            mask_n = cols < seqlen_k
        if TENSOR_DESCRIPTORS:
            kt = tl.trans(k_desc.load([start_n, 0]))
        elif MASKED:
            kt = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        qk = _dot(q, kt, None, DOT_PRECISION, DOT_UPCAST)
        if MASKED:
            valid = mask_n[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            if INTERVALS:
                valid = valid & (cols[None, :] >= row_start[:, None]) & (cols[None, :] < row_end[:, None])
            if SOFTCAP:
                s, _ = _softcapped(qk, softcap_qk, softcap_log2e)
            else:
                s = qk * qk_scale
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no valid key so far has m_new == -inf; subtracting it
            # would give (-inf) - (-inf) = NaN.  Use 0 instead: every exp2
            # below then sees -inf and yields exactly 0.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
        elif SOFTCAP:
            # Every row has a valid key here: m_new is finite (|s| <= softcap).
            s, _ = _softcapped(qk, softcap_qk, softcap_log2e)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
            p = tl.exp2(s - m_new[:, None])
        else:
            # Every row has a valid key here, so m_new is finite.  qk_scale >= 0
            # (the launcher turns a negative scale into a negated q), and x * c
            # rounds monotonically for c >= 0: max(qk) * qk_scale is exactly the
            # max of the scaled scores, and the scale goes into the exponent,
            # exp2(qk * qk_scale - m), one FFMA per score as in the Triton
            # fused-attention tutorial, instead of a multiply for s and a
            # subtraction.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_safe = m_new
            p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated so far
        l_i = l_i * alpha + tl.sum(p, 1)

        if TENSOR_DESCRIPTORS:
            v = v_desc.load([start_n, 0])
        elif MASKED:
            v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=mask_dv[None, :], other=0.0)
        # p goes to the input dtype so that fp16/bf16 use tensor cores; the
        # accumulation itself stays fp32, in the MMA's accumulator.
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
        if not TENSOR_DESCRIPTORS:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i, k_ptrs, v_ptrs


@triton.jit
def attention_step_fwd_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    RowStart,
    RowEnd,  # int32 (seqlen_q,) with INTERVALS, otherwise None
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
    seqlen_q,
    seqlen_k,
    kv_group,
    qk_scale,  # softmax_scale * log2(e)
    softcap_qk,  # with SOFTCAP 2 * log2(e) * softmax_scale / softcap, otherwise None
    softcap_log2e,  # with SOFTCAP softcap * log2(e), otherwise None
    CAUSAL: tl.constexpr,
    INTERVALS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # q's and k's head dim; BLOCK_D is it padded to a power of two
    VALUE_DIM: tl.constexpr,  # v's head dim (out's, dout's); BLOCK_DV is it padded
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    SPLIT_SWEEP: tl.constexpr,
    FIRST_STEP: tl.constexpr,
    TENSOR_DESCRIPTORS: tl.constexpr,
):
    # One program owns (q tile, q head, batch) and sweeps the K/V block: all of
    # it, up to the diagonal (CAUSAL), or the keys its rows' intervals span.
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2)
    off_hk = off_h // kv_group  # GQA: the kv head shared by this q head's group
    start_m = pid_m * BLOCK_M

    q_base = Q + _offset64(off_b, stride_qb, off_h, stride_qh, start_m, stride_qm)
    k_base = K + _offset64(off_b, stride_kb, off_hk, stride_kh)
    v_base = V + _offset64(off_b, stride_vb, off_hk, stride_vh)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_tm = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < seqlen_q
    mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    mask_dv = _dim_mask(offs_dv, VALUE_DIM, BLOCK_DV)

    if TENSOR_DESCRIPTORS:
        q = tl.make_tensor_descriptor(
            Q + _offset64(off_b, stride_qb, off_h, stride_qh),
            shape=[seqlen_q, HEAD_DIM],
            strides=[stride_qm, 1],
            block_shape=[BLOCK_M, BLOCK_D],
        ).load([start_m, 0])
    else:
        q = tl.load(
            q_base + offs_tm[:, None] * stride_qm + offs_d[None, :] * stride_qd,
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )

    # Online softmax state in base 2: running max m_i, running sum l_i, acc.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    if INTERVALS:
        # Packed documents, windows, chunks: only the hull [lo, hi) of the rows'
        # key intervals.  The keys end at hi: the last tile neither reads nor
        # attends keys past it.
        row_start, row_end, lo, hi = _load_intervals(RowStart, RowEnd, offs_m, mask_m, seqlen_k)
        key_end = hi
    else:
        row_start, row_end = offs_m, offs_m  # not read
        key_end = seqlen_k
        # Causal (diagonal) block: keys beyond the last row of this q tile are
        # masked for every row, so the sweep stops there.  Keys before the
        # tile's first row are visible to all of its rows.
        if CAUSAL:
            hi = tl.minimum(seqlen_k, start_m + BLOCK_M)
            all_visible = tl.minimum(start_m, seqlen_k)
        else:
            hi = seqlen_k
            all_visible = seqlen_k
    # The bounds come before the pointers, as in the full and causal kernels'
    # instruction order, which takes fewer registers on sm_100 (docs/tuning.md).
    k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd  # K^T tile
    v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    if TENSOR_DESCRIPTORS:
        # The tiles of this (batch, kv head) through TMA: rows from key_end on
        # and columns past the head dim load as 0, and no pointer tensor
        # occupies registers through the sweep.
        k_desc = tl.make_tensor_descriptor(
            k_base, shape=[key_end, HEAD_DIM], strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        v_desc = tl.make_tensor_descriptor(
            v_base, shape=[key_end, VALUE_DIM], strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_DV]
        )
    else:
        k_desc, v_desc = None, None
    # SPLIT_SWEEP, as in the Triton fused-attention tutorial: the whole k tiles
    # that every row sees go through a sweep without a key mask or a causal or
    # interval test, the rest (the diagonal tiles, a partial last tile, the
    # edges of the intervals) through masked ones.
    if INTERVALS:
        k_ptrs += _offset64(lo, stride_kn)
        v_ptrs += _offset64(lo, stride_vn)
        if SPLIT_SWEEP:
            # Masked [lo, unmasked_lo), unmasked [unmasked_lo, unmasked_hi),
            # masked [unmasked_hi, hi).
            unmasked_lo, unmasked_hi = _seen_by_every_row(row_start, row_end, mask_m, lo, hi, BLOCK_N)
            acc, l_i, m_i, k_ptrs, v_ptrs = _attention_fwd_sweep(
                acc,
                l_i,
                m_i,
                q,
                k_ptrs,
                v_ptrs,
                k_desc,
                v_desc,
                stride_kn,
                stride_vn,
                lo,
                unmasked_lo,
                offs_m,
                offs_n,
                mask_d,
                mask_dv,
                key_end,
                row_start,
                row_end,
                qk_scale,
                softcap_qk,
                softcap_log2e,
                True,
                False,
                True,
                SOFTCAP,
                BLOCK_N,
                DOT_PRECISION,
                DOT_UPCAST,
                TENSOR_DESCRIPTORS,
            )
    elif SPLIT_SWEEP:
        unmasked_lo, unmasked_hi = 0, (all_visible // BLOCK_N) * BLOCK_N
    else:
        lo = 0
    if SPLIT_SWEEP:
        acc, l_i, m_i, k_ptrs, v_ptrs = _attention_fwd_sweep(
            acc,
            l_i,
            m_i,
            q,
            k_ptrs,
            v_ptrs,
            k_desc,
            v_desc,
            stride_kn,
            stride_vn,
            unmasked_lo,
            unmasked_hi,
            offs_m,
            offs_n,
            mask_d,
            mask_dv,
            seqlen_k,
            row_start,
            row_end,
            qk_scale,
            softcap_qk,
            softcap_log2e,
            False,
            CAUSAL,
            False,
            SOFTCAP,
            BLOCK_N,
            DOT_PRECISION,
            DOT_UPCAST,
            TENSOR_DESCRIPTORS,
        )
        lo = unmasked_hi
    acc, l_i, m_i, k_ptrs, v_ptrs = _attention_fwd_sweep(
        acc,
        l_i,
        m_i,
        q,
        k_ptrs,
        v_ptrs,
        k_desc,
        v_desc,
        stride_kn,
        stride_vn,
        lo,
        hi,
        offs_m,
        offs_n,
        mask_d,
        mask_dv,
        key_end,
        row_start,
        row_end,
        qk_scale,
        softcap_qk,
        softcap_log2e,
        True,
        CAUSAL,
        INTERVALS,
        SOFTCAP,
        BLOCK_N,
        DOT_PRECISION,
        DOT_UPCAST,
        TENSOR_DESCRIPTORS,
    )

    # ---- merge this block into the running (out, lse), in place ----
    has_keys = mask_m & (l_i > 0.0)
    l_safe = tl.where(has_keys, l_i, 1.0)
    m_blk = tl.where(has_keys, m_i, 0.0)
    block_lse = (m_blk + tl.log2(l_safe)) * 0.6931471805599453  # back to natural log

    lse_ptrs = Lse + _offset64(off_b, stride_lb, off_h, stride_lh) + offs_m * stride_lm
    o_ptrs = (
        Out
        + _offset64(off_b, stride_ob, off_h, stride_oh, start_m, stride_om)
        + offs_tm[:, None] * stride_om
        + offs_dv[None, :] * stride_od
    )
    if FIRST_STEP:
        # Nothing to merge with: this block's result is the running state, and
        # out/lse are neither read (they may be torch.empty) nor left unwritten.
        # Every row of the tile is stored; a row that sees no key (l_i == 0, or
        # a tile whose intervals are all empty and whose sweep ran no
        # iteration) gets out = 0, lse = -inf, the state of no key at all.
        new_out = tl.where(has_keys[:, None], acc / l_safe[:, None], 0.0)
        tl.store(o_ptrs, new_out, mask=mask_m[:, None] & mask_dv[None, :])
        tl.store(lse_ptrs, tl.where(has_keys, block_lse, float("-inf")), mask=mask_m)
    else:
        # Rows that saw no valid key in this block (l_i == 0) are not written
        # at all: the running state stays bit-for-bit what it was.
        old_lse = tl.load(lse_ptrs, mask=has_keys, other=float("-inf"))
        o_mask = has_keys[:, None] & mask_dv[None, :]
        old_out = tl.load(o_ptrs, mask=o_mask, other=0.0)
        # A row whose running lse is -inf carries no information: ignore
        # whatever its out holds (e.g. torch.empty garbage) instead of letting
        # 0 * NaN in.
        old_out = tl.where(old_lse[:, None] == float("-inf"), 0.0, old_out)

        # logaddexp written as max + log(1 + exp(-|diff|)): both exponentials
        # stay <= 1, so large logits cannot overflow.  old_lse may be -inf:
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
def attention_bwd_preprocess_kernel(
    Out,
    DOut,
    Delta,
    stride_ob,
    stride_om,
    stride_oh,
    stride_od,
    stride_gb,
    stride_gm,
    stride_gh,
    stride_gd,
    stride_db,
    stride_dh,
    stride_dm,
    seqlen_q,
    HEAD_DIM: tl.constexpr,
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
    mask = (offs_m < seqlen_q)[:, None] & _dim_mask(offs_d, HEAD_DIM, BLOCK_D)[None, :]
    o_ptrs = (
        Out
        + _offset64(off_b, stride_ob, off_h, stride_oh, start_m, stride_om)
        + offs_tm[:, None] * stride_om
        + offs_d[None, :] * stride_od
    )
    g_ptrs = (
        DOut
        + _offset64(off_b, stride_gb, off_h, stride_gh, start_m, stride_gm)
        + offs_tm[:, None] * stride_gm
        + offs_d[None, :] * stride_gd
    )
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * g, 1)
    d_ptrs = Delta + _offset64(off_b, stride_db, off_h, stride_dh) + offs_m * stride_dm
    tl.store(d_ptrs, delta, mask=offs_m < seqlen_q)


@triton.jit
def _attention_dq_sweep(
    dq,
    q,
    do,
    lse2,
    delta,
    kt_ptrs,
    k_ptrs,
    vt_ptrs,
    k_desc,
    v_desc,
    stride_kn,
    stride_vn,
    lo,
    hi,
    offs_m,
    offs_n,
    mask_d,
    mask_dv,
    key_end,
    row_start,
    row_end,
    qk_scale,
    softcap_qk,
    softcap_log2e,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    INTERVALS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    TENSOR_DESCRIPTORS: tl.constexpr,
):
    # Adds the keys [lo, hi) to the q tile's dq; kt_ptrs/k_ptrs/vt_ptrs (K^T,
    # K, V^T tiles) point at key lo and come back pointing at key hi (rounded up to a
    # whole tile).  MASKED=False: whole k tiles every row sees, no key mask and
    # no causal or interval test.  MASKED: keys from key_end on are neither
    # loaded nor attended.  Rows past seqlen_q need no mask: their q and dout
    # are 0 and their lse and delta 0, and their dq is not stored.
    # TENSOR_DESCRIPTORS: K and V through TMA (k_desc/v_desc, rows ending at
    # key_end), one K tile serving as K and, transposed, as K^T.
    for start_n in range(lo, hi, BLOCK_N):
        if MASKED:
            cols = start_n + offs_n
            mask_n = cols < key_end
        if TENSOR_DESCRIPTORS:
            k = k_desc.load([start_n, 0])
            kt = tl.trans(k)
        elif MASKED:
            kt = tl.load(kt_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=mask_d[:, None], other=0.0)
        qk = _dot(q, kt, None, DOT_PRECISION, DOT_UPCAST)
        # Recompute P from the final lse (base 2, scale folded into the exponent).
        if SOFTCAP:
            # dS/d(softmax_scale * qk) = 1 - tanh^2 = 4r(1 - r) goes into p
            # at once: p is read by ds only, and so one tile stays live.
            s, r = _softcapped(qk, softcap_qk, softcap_log2e)
            p = tl.exp2(s - lse2[:, None]) * (4.0 * r * (1.0 - r))
        else:
            p = tl.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            valid = mask_n[None, :]
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            if INTERVALS:
                valid = valid & (cols[None, :] >= row_start[:, None]) & (cols[None, :] < row_end[:, None])
            p = tl.where(valid, p, 0.0)
        if TENSOR_DESCRIPTORS:
            vt = tl.trans(v_desc.load([start_n, 0]))
        elif MASKED:
            vt = tl.load(vt_ptrs, mask=mask_dv[:, None] & mask_n[None, :], other=0.0)
        else:
            vt = tl.load(vt_ptrs, mask=mask_dv[:, None], other=0.0)
        dp = _dot(do, vt, None, DOT_PRECISION, DOT_UPCAST)
        ds = p * (dp - delta[:, None])
        if not TENSOR_DESCRIPTORS:
            if MASKED:
                k = tl.load(k_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=mask_d[None, :], other=0.0)
        dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION, DOT_UPCAST)
        if not TENSOR_DESCRIPTORS:
            kt_ptrs += BLOCK_N * stride_kn
            k_ptrs += BLOCK_N * stride_kn
            vt_ptrs += BLOCK_N * stride_vn
    return dq, kt_ptrs, k_ptrs, vt_ptrs


@triton.jit
def attention_step_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DQ,
    RowStart,
    RowEnd,  # int32 (seqlen_q,) with INTERVALS, otherwise None
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
    seqlen_q,
    seqlen_k,
    kv_group,
    softmax_scale,
    qk_scale,
    softcap_qk,  # with SOFTCAP as in the forward, otherwise None
    softcap_log2e,
    CAUSAL: tl.constexpr,
    INTERVALS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # q's and k's head dim; BLOCK_D is it padded to a power of two
    VALUE_DIM: tl.constexpr,  # v's head dim (out's, dout's); BLOCK_DV is it padded
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    SPLIT_SWEEP: tl.constexpr,
    TENSOR_DESCRIPTORS: tl.constexpr,
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
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < seqlen_q
    mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    mask_dv = _dim_mask(offs_dv, VALUE_DIM, BLOCK_DV)
    mask_md = mask_m[:, None] & mask_d[None, :]

    q_ptrs = (
        Q
        + _offset64(off_b, stride_qb, off_h, stride_qh, start_m, stride_qm)
        + offs_tm[:, None] * stride_qm
        + offs_d[None, :] * stride_qd
    )
    do_ptrs = (
        DO
        + _offset64(off_b, stride_gb, off_h, stride_gh, start_m, stride_gm)
        + offs_tm[:, None] * stride_gm
        + offs_dv[None, :] * stride_gd
    )
    if TENSOR_DESCRIPTORS:
        q = tl.make_tensor_descriptor(
            Q + _offset64(off_b, stride_qb, off_h, stride_qh),
            shape=[seqlen_q, HEAD_DIM],
            strides=[stride_qm, 1],
            block_shape=[BLOCK_M, BLOCK_D],
        ).load([start_m, 0])
        do = tl.make_tensor_descriptor(
            DO + _offset64(off_b, stride_gb, off_h, stride_gh),
            shape=[seqlen_q, VALUE_DIM],
            strides=[stride_gm, 1],
            block_shape=[BLOCK_M, BLOCK_DV],
        ).load([start_m, 0])
    else:
        q = tl.load(q_ptrs, mask=mask_md, other=0.0)
        do = tl.load(do_ptrs, mask=mask_m[:, None] & mask_dv[None, :], other=0.0)
    lse = tl.load(Lse + _offset64(off_b, stride_lb, off_h, stride_lh) + offs_m * stride_lm, mask=mask_m, other=0.0)
    delta = tl.load(Delta + _offset64(off_b, stride_eb, off_h, stride_eh) + offs_m * stride_em, mask=mask_m, other=0.0)
    # Final lse == -inf means the row saw no key in any step: its probabilities
    # are all zero.  Using +inf makes exp2(s - lse) exactly 0 instead of NaN/inf.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

    k_base = K + _offset64(off_b, stride_kb, off_hk, stride_kh)
    v_base = V + _offset64(off_b, stride_vb, off_hk, stride_vh)
    kt_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
    k_ptrs = k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    vt_ptrs = v_base + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vd

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The keys [lo, hi) this q tile sees, as in the forward; keys from key_end
    # on are neither read nor attended.
    if INTERVALS:
        row_start, row_end, lo, hi = _load_intervals(RowStart, RowEnd, offs_m, mask_m, seqlen_k)
        key_end = hi
        kt_ptrs += _offset64(lo, stride_kn)
        k_ptrs += _offset64(lo, stride_kn)
        vt_ptrs += _offset64(lo, stride_vn)
    else:
        row_start, row_end = offs_m, offs_m  # not read
        key_end = seqlen_k
        if CAUSAL:
            hi = tl.minimum(seqlen_k, start_m + BLOCK_M)
            all_visible = tl.minimum(start_m, seqlen_k)
        else:
            hi = seqlen_k
            all_visible = seqlen_k
    if TENSOR_DESCRIPTORS:
        k_desc = tl.make_tensor_descriptor(
            k_base, shape=[key_end, HEAD_DIM], strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        v_desc = tl.make_tensor_descriptor(
            v_base, shape=[key_end, VALUE_DIM], strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_DV]
        )
    else:
        k_desc, v_desc = None, None
    # The whole k tiles every row sees without a mask, the diagonal tiles, a
    # partial last tile and the edges of the intervals with it (as in the
    # forward).  A key past seqlen_k is not harmless here even though its K and
    # V load as 0: p = exp2(-lse) may overflow for rows of very negative lse.
    if INTERVALS:
        if SPLIT_SWEEP:
            unmasked_lo, unmasked_hi = _seen_by_every_row(row_start, row_end, mask_m, lo, hi, BLOCK_N)
            dq, kt_ptrs, k_ptrs, vt_ptrs = _attention_dq_sweep(
                dq,
                q,
                do,
                lse2,
                delta,
                kt_ptrs,
                k_ptrs,
                vt_ptrs,
                k_desc,
                v_desc,
                stride_kn,
                stride_vn,
                lo,
                unmasked_lo,
                offs_m,
                offs_n,
                mask_d,
                mask_dv,
                key_end,
                row_start,
                row_end,
                qk_scale,
                softcap_qk,
                softcap_log2e,
                True,
                False,
                True,
                SOFTCAP,
                BLOCK_N,
                DOT_PRECISION,
                DOT_UPCAST,
                TENSOR_DESCRIPTORS,
            )
    elif SPLIT_SWEEP:
        unmasked_lo, unmasked_hi = 0, (all_visible // BLOCK_N) * BLOCK_N
    else:
        lo = 0
    if SPLIT_SWEEP:
        dq, kt_ptrs, k_ptrs, vt_ptrs = _attention_dq_sweep(
            dq,
            q,
            do,
            lse2,
            delta,
            kt_ptrs,
            k_ptrs,
            vt_ptrs,
            k_desc,
            v_desc,
            stride_kn,
            stride_vn,
            unmasked_lo,
            unmasked_hi,
            offs_m,
            offs_n,
            mask_d,
            mask_dv,
            key_end,
            row_start,
            row_end,
            qk_scale,
            softcap_qk,
            softcap_log2e,
            False,
            CAUSAL,
            False,
            SOFTCAP,
            BLOCK_N,
            DOT_PRECISION,
            DOT_UPCAST,
            TENSOR_DESCRIPTORS,
        )
        lo = unmasked_hi
    dq, kt_ptrs, k_ptrs, vt_ptrs = _attention_dq_sweep(
        dq,
        q,
        do,
        lse2,
        delta,
        kt_ptrs,
        k_ptrs,
        vt_ptrs,
        k_desc,
        v_desc,
        stride_kn,
        stride_vn,
        lo,
        hi,
        offs_m,
        offs_n,
        mask_d,
        mask_dv,
        key_end,
        row_start,
        row_end,
        qk_scale,
        softcap_qk,
        softcap_log2e,
        True,
        CAUSAL,
        INTERVALS,
        SOFTCAP,
        BLOCK_N,
        DOT_PRECISION,
        DOT_UPCAST,
        TENSOR_DESCRIPTORS,
    )

    # Accumulate (+=) into the caller's fp32 dq: one ring step's contribution.
    dq_ptrs = (
        DQ
        + _offset64(off_b, stride_dqb, off_h, stride_dqh, start_m, stride_dqm)
        + offs_tm[:, None] * stride_dqm
        + offs_d[None, :] * stride_dqd
    )
    dq_old = tl.load(dq_ptrs, mask=mask_md, other=0.0)
    tl.store(dq_ptrs, dq_old + dq * softmax_scale, mask=mask_md)


@triton.jit
def _attention_dkdv_sweep(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    q_desc,
    do_desc,
    lse_base,
    delta_base,
    stride_qm,
    stride_qd,
    stride_gm,
    stride_gd,
    stride_lm,
    stride_em,
    lo,
    hi,
    offs_m,
    offs_n,
    offs_d,
    offs_dv,
    mask_d,
    mask_dv,
    row_end,
    col_start,
    col_end,
    qk_scale,
    softcap_qk,
    softcap_log2e,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    INTERVALS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    TENSOR_DESCRIPTORS: tl.constexpr,
):
    # Adds the q rows [lo, hi) of one q head to the k tile's dk/dv.  Rows from
    # row_end on load as 0 (q, dout, lse, delta) and so add exactly 0: pt is 1
    # there and both of its products meet a zero row, so MASKED=False needs no
    # score mask for a partial last q tile, only the loads' row mask.  MASKED:
    # the causal or interval test (col_start/col_end: the keys' row
    # intervals).  Keys past seqlen_k need no mask either: a dk/dv row depends
    # on its own key only, and theirs are not stored.
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        mask_m = rows < row_end
        mask_md = mask_m[:, None] & mask_d[None, :]
        # The tile's start in 64 bits as a scalar, its rows in int32: 64-bit
        # row offsets as a vector spill in this loop (docs/tuning.md).
        if TENSOR_DESCRIPTORS:
            # TMA: rows from row_end on load as 0, no offsets in registers.
            q = q_desc.load([start_m, 0])
            do = do_desc.load([start_m, 0])
        else:
            q = tl.load(
                q_base + _offset64(start_m, stride_qm) + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=mask_md,
                other=0.0,
            )
            do = tl.load(
                do_base + _offset64(start_m, stride_gm) + offs_m[:, None] * stride_gm + offs_dv[None, :] * stride_gd,
                mask=mask_m[:, None] & mask_dv[None, :],
                other=0.0,
            )
        lse = tl.load(lse_base + rows * stride_lm, mask=mask_m, other=0.0)
        delta = tl.load(delta_base + rows * stride_em, mask=mask_m, other=0.0)
        # lse == -inf: row without any key -> P == 0 (see the dq kernel).
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

        # Transposed scores (keys x queries) so dk/dv come out row-major.
        st = _dot(k, tl.trans(q), None, DOT_PRECISION, DOT_UPCAST)
        if SOFTCAP:
            st, rt = _softcapped(st, softcap_qk, softcap_log2e)
            pt = tl.exp2(st - lse2[None, :])
        else:
            pt = tl.exp2(st * qk_scale - lse2[None, :])
        if MASKED:
            if CAUSAL:
                pt = tl.where(rows[None, :] >= offs_n[:, None], pt, 0.0)
            if INTERVALS:
                pt = tl.where((rows[None, :] >= col_start[:, None]) & (rows[None, :] < col_end[:, None]), pt, 0.0)
        dv = _dot(pt.to(do.dtype), do, dv, DOT_PRECISION, DOT_UPCAST)
        if SOFTCAP:
            # The derivative of the cap, 1 - tanh^2 = 4r(1 - r) (see the dq sweep).
            pt = pt * (4.0 * rt * (1.0 - rt))
        dpt = _dot(v, tl.trans(do), None, DOT_PRECISION, DOT_UPCAST)
        dst = pt * (dpt - delta[None, :])
        dk = _dot(dst.to(q.dtype), q, dk, DOT_PRECISION, DOT_UPCAST)
    return dk, dv


@triton.jit
def attention_step_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DK,
    DV,
    ColStart,
    ColEnd,  # int32 (seqlen_k,) with INTERVALS, otherwise None
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
    seqlen_k,
    kv_group,
    heads_per_program,  # q heads of the group one program sweeps: kv_group unless SPLIT_HEADS
    softmax_scale,
    qk_scale,
    softcap_qk,  # with SOFTCAP as in the forward, otherwise None
    softcap_log2e,
    CAUSAL: tl.constexpr,
    INTERVALS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # q's and k's head dim; BLOCK_D is it padded to a power of two
    VALUE_DIM: tl.constexpr,  # v's head dim (out's, dout's); BLOCK_DV is it padded
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    SPLIT_SWEEP: tl.constexpr,
    TENSOR_DESCRIPTORS: tl.constexpr,
    SPLIT_HEADS: tl.constexpr,
):
    # One program owns (k tile, kv head, batch) and loops over every q head of
    # the GQA group and every q tile, so all contributions to these dk/dv rows
    # are summed in registers by a single writer: no races, and a
    # deterministic summation order.  SPLIT_HEADS: grid axis 1 also splits the
    # group's q heads, heads_per_program per program, for grids too small to
    # fill the GPU (MQA at a few thousand keys); the programs of one k tile
    # then all add into the same dk/dv rows, in no fixed order.
    pid_n = tl.program_id(0)
    off_b = tl.program_id(2)
    if SPLIT_HEADS:
        head_splits = tl.cdiv(kv_group, heads_per_program)
        off_hk = tl.program_id(1) // head_splits
        head_lo = (tl.program_id(1) % head_splits) * heads_per_program
        head_hi = tl.minimum(head_lo + heads_per_program, kv_group)
    else:
        off_hk = tl.program_id(1)
        head_lo = 0
        head_hi = kv_group
    start_n = pid_n * BLOCK_N

    offs_tn = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_tn
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_n = offs_n < seqlen_k
    mask_d = _dim_mask(offs_d, HEAD_DIM, BLOCK_D)
    mask_dv = _dim_mask(offs_dv, VALUE_DIM, BLOCK_DV)
    mask_nd = mask_n[:, None] & mask_d[None, :]
    mask_ndv = mask_n[:, None] & mask_dv[None, :]

    k_ptrs = (
        K
        + _offset64(off_b, stride_kb, off_hk, stride_kh, start_n, stride_kn)
        + offs_tn[:, None] * stride_kn
        + offs_d[None, :] * stride_kd
    )
    v_ptrs = (
        V
        + _offset64(off_b, stride_vb, off_hk, stride_vh, start_n, stride_vn)
        + offs_tn[:, None] * stride_vn
        + offs_dv[None, :] * stride_vd
    )
    # Loaded once, through pointers also with TENSOR_DESCRIPTORS: their offsets
    # are dead after this, and with k and v through descriptors ptxas
    # serializes the wgmma of the full-mask MHA kernel (C7515, docs/tuning.md).
    k = tl.load(k_ptrs, mask=mask_nd, other=0.0)
    v = tl.load(v_ptrs, mask=mask_ndv, other=0.0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # The q rows [lo, hi) that see this k tile's keys; rows from hi on are
    # neither read nor attended.
    if INTERVALS:
        # The rows of the keys' column intervals.  The element mask takes the
        # same intervals, held through the loop: exact, as the row intervals of
        # each q tile would be, without loading two more vectors per q tile.
        col_start, col_end, lo, hi = _load_intervals(ColStart, ColEnd, offs_n, mask_n, seqlen_q)
        masked_hi = hi
    else:
        col_start, col_end = offs_n, offs_n  # not read
        hi = seqlen_q
        if CAUSAL:
            # Diagonal block: q rows before this k tile's first key see none of
            # its keys, so start at the q tile containing row start_n; the q
            # tiles from the first whole one past the tile's last key on see
            # all of its keys.
            lo = (start_n // BLOCK_M) * BLOCK_M
            masked_hi = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, hi)
        else:
            lo = 0
            masked_hi = 0
        if not SPLIT_SWEEP:
            masked_hi = hi  # one masked sweep over every q tile

    for g in range(head_lo, head_hi):
        off_h = off_hk * kv_group + g
        q_base = Q + _offset64(off_b, stride_qb, off_h, stride_qh)
        do_base = DO + _offset64(off_b, stride_gb, off_h, stride_gh)
        lse_base = Lse + _offset64(off_b, stride_lb, off_h, stride_lh)
        delta_base = Delta + _offset64(off_b, stride_eb, off_h, stride_eh)
        if TENSOR_DESCRIPTORS:
            q_desc = tl.make_tensor_descriptor(
                q_base, shape=[hi, HEAD_DIM], strides=[stride_qm, 1], block_shape=[BLOCK_M, BLOCK_D]
            )
            do_desc = tl.make_tensor_descriptor(
                do_base, shape=[hi, VALUE_DIM], strides=[stride_gm, 1], block_shape=[BLOCK_M, BLOCK_DV]
            )
        else:
            q_desc, do_desc = None, None
        if INTERVALS or CAUSAL or not SPLIT_SWEEP:
            # The diagonal tiles (causal) or the interval hull, masked ...
            dk, dv = _attention_dkdv_sweep(
                dk,
                dv,
                k,
                v,
                q_base,
                do_base,
                q_desc,
                do_desc,
                lse_base,
                delta_base,
                stride_qm,
                stride_qd,
                stride_gm,
                stride_gd,
                stride_lm,
                stride_em,
                lo,
                masked_hi,
                offs_m,
                offs_n,
                offs_d,
                offs_dv,
                mask_d,
                mask_dv,
                hi,
                col_start,
                col_end,
                qk_scale,
                softcap_qk,
                softcap_log2e,
                True,
                CAUSAL,
                INTERVALS,
                SOFTCAP,
                BLOCK_M,
                DOT_PRECISION,
                DOT_UPCAST,
                TENSOR_DESCRIPTORS,
            )
        if not INTERVALS:
            if SPLIT_SWEEP:
                # ... and the q tiles that see every key of the k tile, without.
                dk, dv = _attention_dkdv_sweep(
                    dk,
                    dv,
                    k,
                    v,
                    q_base,
                    do_base,
                    q_desc,
                    do_desc,
                    lse_base,
                    delta_base,
                    stride_qm,
                    stride_qd,
                    stride_gm,
                    stride_gd,
                    stride_lm,
                    stride_em,
                    tl.maximum(lo, masked_hi),
                    hi,
                    offs_m,
                    offs_n,
                    offs_d,
                    offs_dv,
                    mask_d,
                    mask_dv,
                    hi,
                    col_start,
                    col_end,
                    qk_scale,
                    softcap_qk,
                    softcap_log2e,
                    False,
                    CAUSAL,
                    False,
                    SOFTCAP,
                    BLOCK_M,
                    DOT_PRECISION,
                    DOT_UPCAST,
                    TENSOR_DESCRIPTORS,
                )

    # Accumulate (+=) into the travelling fp32 dk/dv buffers.
    dk_ptrs = (
        DK
        + _offset64(off_b, stride_dkb, off_hk, stride_dkh, start_n, stride_dkn)
        + offs_tn[:, None] * stride_dkn
        + offs_d[None, :] * stride_dkd
    )
    dv_ptrs = (
        DV
        + _offset64(off_b, stride_dvb, off_hk, stride_dvh, start_n, stride_dvn)
        + offs_tn[:, None] * stride_dvn
        + offs_dv[None, :] * stride_dvd
    )
    # As fp32 atomic adds (reductions, nothing returned) also when this
    # program is the only writer: then the sum is exactly the load + add +
    # store's (round to nearest; the atomics flush a subnormal to 0), and
    # ptxas keeps the sweep's wgmma pipelined: with a load of the old values
    # here it serializes every wgmma of the full-mask MHA kernel (C7515, sm_90
    # bf16 d128, 32 x 64 tiles).
    tl.atomic_add(dk_ptrs, dk * softmax_scale, mask=mask_nd, sem="relaxed")
    tl.atomic_add(dv_ptrs, dv, mask=mask_ndv, sem="relaxed")
