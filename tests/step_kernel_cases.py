"""What the step kernel tests share (tests/test_attention_step_*.py): inputs on the
test device, the fp64 reference with the score matrix materialized (K/V heads repeated
for GQA/MQA in the reference only), the accuracy rule of one step, and the ring steps
and packed-document intervals the kernels are driven through.

Without CUDA the Triton kernels run in the interpreter on CPU tensors
(TRITON_INTERPRET=1 must be set before triton is imported: conftest.py sets it).
"""

import pytest
import torch

# conftest.py runs the kernels in the Triton interpreter (TRITON_INTERPRET=1) without a GPU.
pytest.importorskip("triton", reason="the Triton kernels need triton (torch CPU wheels do not ship it)")
from seqpar_kernels.kernels import attention_step_launch as launchers  # noqa: E402
from seqpar_kernels.kernels import attention_step_tiles as step_tiles  # noqa: E402

MASK_FULL, MASK_CAUSAL, MASK_INTERVALS = launchers.MASK_FULL, launchers.MASK_CAUSAL, launchers.MASK_INTERVALS
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(device=DEVICE, dtype=dtype)


def zeros(*shape):
    return torch.zeros(*shape, dtype=torch.float32, device=DEVICE)


def causal_keep(sq, sk, offset=0):
    """keep[i, j] = query i (at global position offset + i) may see key j."""
    i = torch.arange(sq).unsqueeze(1) + offset
    j = torch.arange(sk).unsqueeze(0)
    return (j <= i).to(DEVICE)


def reference_attention(q, k, v, scale, keep=None, softcap=0.0):
    """fp64 attention; returns out (b, sq, h, dv) and lse (b, h, sq), dv v's head dim.

    keep: optional bool (sq, sk) mask of visible keys.  Rows with no visible
    key give out = 0 and lse = -inf.  softcap > 0: the scores are
    softcap * tanh(scale * q.k / softcap) (Gemma 2), before the mask.
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float64).min))
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def torch_attention_in_dtype(q, k, v, scale, keep=None, softcap=0.0):
    """Plain (materialized) torch attention computed in q's own dtype (with the
    soft cap as Gemma 2's eager attention computes it, when softcap > 0)."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.transpose(1, 2)).transpose(1, 2)


def assert_low_precision_accuracy(q, k, v, scale, keep, out, lse, dout=None, grads=None, softcap=0.0):
    """fp16/bf16 step results against fp64 attention on the same rounded inputs:
    ``out`` within twice the error of plain PyTorch attention in the inputs'
    dtype (a row without a key counts as 0 in both), ``lse`` fp32-accurate
    (exact products accumulated in fp32), and ``grads`` (dq, dk, dv for
    ``dout``), when given, each within 3% of its largest reference entry."""
    qr, kr, vr = (t.double().requires_grad_(grads is not None) for t in (q, k, v))
    ref_out, ref_lse = reference_attention(qr, kr, vr, scale, keep, softcap)
    torch_out = torch_attention_in_dtype(q, k, v, scale, keep, softcap).nan_to_num(0.0)
    ours_err = (out.double() - ref_out).abs().max().item()
    torch_err = (torch_out.double() - ref_out).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-3, (ours_err, torch_err)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-4, rtol=0)
    if grads is not None:
        ref_out.backward(dout.double())
        for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
            err = (got.double() - want).abs().max().item()
            assert err <= 3e-2 * want.abs().max().item(), err


def assert_within_twice_plain_torch(dtype, results, plain, exact):
    """Each of ``results`` (out, dq, dk, dv) within twice the error of plain
    PyTorch attention in ``dtype`` (``plain``: its out, dq, dk, dv) against
    ``exact`` (fp64), plus about one ulp of dtype."""
    slack = {torch.float32: 2e-5, torch.bfloat16: 1e-4, torch.float16: 1e-5}[dtype]
    for name, ours, yardstick, want in zip(("out", "dq", "dk", "dv"), results, plain, exact):
        err = (ours.double() - want).abs().max().item()
        plain_err = (yardstick.double() - want).abs().max().item()
        assert err <= 2 * plain_err + slack, f"{name}: err {err:.3g}, plain torch in {dtype} {plain_err:.3g}"


def fresh_state(b, sq, h, d):
    out = torch.zeros(b, sq, h, d, dtype=torch.float32, device=DEVICE)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=DEVICE)
    return out, lse


def ring_blocks(b, sq, hk, d, full_lens, dtype=torch.float32, dv=None):
    """K/V of the own (diagonal, causal) block followed by full blocks of other ranks;
    v of head dim dv (None: d).

    Returns the list of (k, v, mask_mode) steps in ring order (diagonal first)
    and the global K/V, keep-mask in the order [full blocks..., diagonal].
    """
    dv = dv or d
    fulls = [(randn(b, n, hk, d, dtype=dtype), randn(b, n, hk, dv, dtype=dtype)) for n in full_lens]
    kd, vd = randn(b, sq, hk, d, dtype=dtype), randn(b, sq, hk, dv, dtype=dtype)
    steps = [(kd, vd, MASK_CAUSAL)] + [(kf, vf, MASK_FULL) for kf, vf in fulls]
    k_all = torch.cat([kf for kf, _ in fulls] + [kd], dim=1)
    v_all = torch.cat([vf for _, vf in fulls] + [vd], dim=1)
    keep = causal_keep(sq, k_all.shape[1], offset=sum(full_lens))
    return steps, k_all, v_all, keep


def check_low_precision_step(mode, sq, sk, dtype=torch.bfloat16, d=128, softcap=0.0, q_scale=1.0, dv=None):
    """One fp16/bf16 GQA step, forward and backward, against fp64 autograd with
    the tolerances of the other low-precision tests: the output within twice
    plain PyTorch attention's error in ``dtype``, the gradients within 3% of
    their largest entry.  ``mode``: a mask mode, or an (intervals, keep) pair
    of MASK_INTERVALS; q_scale multiplies q (logits that a soft cap bends); dv:
    v's head dim (None: d)."""
    b, h, hk, dv = 1, 4, 2, dv or d
    q, dout = randn(b, sq, h, d, dtype=dtype, scale=q_scale), randn(b, sq, h, dv, dtype=dtype)
    k, v = randn(b, sk, hk, d, dtype=dtype), randn(b, sk, hk, dv, dtype=dtype)
    intervals = None
    if isinstance(mode, tuple):
        (intervals, keep), mode = mode, MASK_INTERVALS
    else:
        keep = causal_keep(sq, sk) if mode == MASK_CAUSAL else None
    scale = d**-0.5
    out, lse = fresh_state(b, sq, h, dv)
    options = dict(softmax_scale=scale, mask_mode=mode, intervals=intervals, softcap=softcap)
    launchers.attention_step_forward(q, k, v, out, lse, **options)
    grads = zeros(*q.shape), zeros(*k.shape), zeros(*v.shape)
    launchers.attention_step_backward(q, k, v, out, dout, lse, None, *grads, **options)
    assert_low_precision_accuracy(q, k, v, scale, keep, out, lse, dout, grads, softcap)


def run_steps(q, steps, k_all, full_lens, dout, dq, scale, softcap=0.0, first_step=False):
    """The ring steps of ring_blocks through the step kernels: every forward, then
    every backward, dq accumulated in place.  Returns (out, lse, dk_all, dv_all);
    dk/dv are slices of one fp32 buffer (like the travelling gradient buffers of the
    ring), in k_all's order [full blocks..., diagonal].  first_step: the first
    forward starts from a NaN state with first_step=True (as the ring does)."""
    b, sq, h, _ = q.shape
    out, lse = fresh_state(b, sq, h, dout.shape[3])
    if first_step:
        out.fill_(float("nan")), lse.fill_(float("nan"))
    for index, (k, v, mode) in enumerate(steps):
        launchers.attention_step_forward(
            q,
            k,
            v,
            out,
            lse,
            softmax_scale=scale,
            mask_mode=mode,
            softcap=softcap,
            first_step=first_step and index == 0,
        )
    delta = launchers.attention_backward_preprocess(out, dout)
    dk_all, dv_all = zeros(*k_all.shape), zeros(*k_all.shape[:3], steps[0][1].shape[3])
    n_full = sum(full_lens)
    bounds = [(n_full, n_full + sq)]
    start = 0
    for n in full_lens:
        bounds.append((start, start + n))
        start += n
    for (k, v, mode), (lo, hi) in zip(steps, bounds):
        launchers.attention_step_backward(
            q,
            k,
            v,
            out,
            dout,
            lse,
            delta,
            dq,
            dk_all[:, lo:hi],
            dv_all[:, lo:hi],
            softmax_scale=scale,
            mask_mode=mode,
            softcap=softcap,
        )
    return out, lse, dk_all, dv_all


def check_steps_forward_and_backward(h, hk, d, full_lens, b, sq, softcap=0.0, q_scale=1.0, dv=None):
    """Forward over a causal diagonal block and full blocks, then the backward of
    every step, against fp64 autograd of the whole attention (out and lse too
    when softcap > 0; q_scale multiplies q, for logits the cap bends); dv: v's
    head dim (None: d)."""
    steps, k_all, v_all, keep = ring_blocks(b, sq, hk, d, full_lens=full_lens, dv=dv)
    q = randn(b, sq, h, d, scale=q_scale)
    scale = d**-0.5
    dout = randn(b, sq, h, v_all.shape[3])
    # dq starts non-zero to check accumulation (+=).
    dq0 = randn(b, sq, h, d)
    dq = dq0.clone()
    out, lse, dk_all, dv_all = run_steps(
        q, steps, k_all, full_lens, dout, dq, scale, softcap=softcap, first_step=bool(softcap)
    )

    qr = q.double().requires_grad_()
    kr = k_all.double().requires_grad_()
    vr = v_all.double().requires_grad_()
    ref_out, ref_lse = reference_attention(qr, kr, vr, scale, keep, softcap)
    ref_out.backward(dout.double())
    if softcap:
        torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(dq.double() - dq0.double(), qr.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(dk_all.double(), kr.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(dv_all.double(), vr.grad, atol=1e-4, rtol=0)


# Document lengths of one packed sequence (160 positions): documents of length 1,
# documents longer than every tile of the interpreter (and of a GPU's fp32 tiles).
DOC_LENS = [1, 37, 1, 1, 5, 50, 2, 19, 1, 40, 3]


def document_intervals(q_pos, k_pos, doc_lens, causal):
    """The ``intervals`` a caller passes with MASK_INTERVALS, built as a caller
    would, and the dense keep mask (sq, sk) for the reference.

    Queries sit at the global positions ``q_pos`` and keys at ``k_pos`` (each
    sorted) of one packed sequence of documents of lengths ``doc_lens``.  A query
    sees the keys of its own document, up to its own position when causal."""
    lens = torch.tensor(doc_lens)
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), lens)  # by position
    end = lens.cumsum(0)[doc]
    start = end - lens[doc]
    # Query i: the keys from its document's start to its own position + 1 (causal)
    # or its document's end.  Key j: the queries from its own position (causal)
    # or its document's start, to its document's end.
    row_start = torch.searchsorted(k_pos, start[q_pos])
    row_end = torch.searchsorted(k_pos, q_pos + 1 if causal else end[q_pos])
    col_start = torch.searchsorted(q_pos, k_pos if causal else start[k_pos])
    col_end = torch.searchsorted(q_pos, end[k_pos])
    keep = doc[q_pos][:, None] == doc[k_pos][None, :]
    if causal:
        keep &= k_pos[None, :] <= q_pos[:, None]
    # Both halves of the intervals describe keep exactly.
    rows, cols = torch.arange(len(q_pos)), torch.arange(len(k_pos))
    assert torch.equal(keep, (cols >= row_start[:, None]) & (cols < row_end[:, None]))
    assert torch.equal(keep, (rows[:, None] >= col_start) & (rows[:, None] < col_end))
    intervals = tuple(t.to(device=DEVICE, dtype=torch.int32) for t in (row_start, row_end, col_start, col_end))
    return intervals, keep.to(DEVICE)


def positions(layout, generator):
    """(q positions, [k positions of each ring step]) of a packed sequence of
    sum(DOC_LENS) positions.  "ring": the queries are the third of four chunks of
    40 positions, the steps' keys the same chunk (the diagonal step), the chunk
    before it and the one after it (causal: a step in which no query sees a key).
    "subsets": random sorted subsets of different sizes."""
    total = sum(DOC_LENS)
    if layout == "ring":
        return torch.arange(80, 120), [torch.arange(80, 120), torch.arange(40, 80), torch.arange(120, 160)]
    subset = lambda n: torch.randperm(total, generator=generator)[:n].sort().values  # noqa: E731
    return subset(45), [subset(70), subset(23)]


def interval_steps(q, dout, steps, scale, softcap=0.0):
    """The steps [(k, v, intervals)] through the step kernels: every forward, then
    every backward with the final lse.  Returns (out, lse) after the first step,
    the final (out, lse), dq, and per step (dk, dv)."""
    b, sq, h, _ = q.shape
    out, lse = fresh_state(b, sq, h, dout.shape[3])
    first = None
    for k, v, intervals in steps:
        launchers.attention_step_forward(
            q, k, v, out, lse, softmax_scale=scale, mask_mode=MASK_INTERVALS, intervals=intervals, softcap=softcap
        )
        first = first or (out.clone(), lse.clone())
    delta = launchers.attention_backward_preprocess(out, dout)
    dq, dkv = zeros(*q.shape), []
    for k, v, intervals in steps:
        dk, dv = zeros(*k.shape), zeros(*v.shape)
        launchers.attention_step_backward(
            q,
            k,
            v,
            out,
            dout,
            lse,
            delta,
            dq,
            dk,
            dv,
            softmax_scale=scale,
            mask_mode=MASK_INTERVALS,
            intervals=intervals,
            softcap=softcap,
        )
        dkv.append((dk, dv))
    return first, (out, lse), dq, dkv


def check_intervals(h, hk, d, causal, layout, b, seed, dv=None):
    """Forward (after the first step and merged over every step) and backward of
    the steps of positions(layout) with documents DOC_LENS, against fp64 autograd
    of the dense document mask; dv: v's head dim (None: d)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    q_pos, k_positions = positions(layout, generator)
    sq, dv = len(q_pos), dv or d
    q, dout = randn(b, sq, h, d), randn(b, sq, h, dv)
    steps, keeps = [], []
    for k_pos in k_positions:
        intervals, keep = document_intervals(q_pos, k_pos, DOC_LENS, causal)
        steps.append((randn(b, len(k_pos), hk, d), randn(b, len(k_pos), hk, dv), intervals))
        keeps.append(keep)
    if layout == "ring":
        # The cases the layout is there for: rows 16-31 (a tile of the interpreter)
        # see no key of the chunk before; causal, no query sees a key of the chunk after.
        assert not keeps[1][16:32].any() and keeps[1].any()
        assert causal == (not keeps[2].any())
    scale = d**-0.5
    (out1, lse1), (out, lse), dq, dkv = interval_steps(q, dout, steps, scale)

    ref_out1, ref_lse1 = reference_attention(q, steps[0][0], steps[0][1], scale, keeps[0])
    torch.testing.assert_close(out1.double(), ref_out1, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse1.double(), ref_lse1, atol=2e-5, rtol=0)

    k_all = torch.cat([k for k, _, _ in steps], dim=1)
    v_all = torch.cat([v for _, v, _ in steps], dim=1)
    keep_all = torch.cat(keeps, dim=1)
    assert not all(keep.any(dim=1).all() for keep in keeps)  # rows that see no key of a step
    if layout == "subsets":
        assert not keep_all.any(dim=1).all()  # rows that see no key at all: lse -inf, zero gradient
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k_all, v_all))
    ref_out, ref_lse = reference_attention(qr, kr, vr, scale, keep_all)
    ref_out.backward(dout.double())
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(dq.double(), qr.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([dk for dk, _ in dkv], dim=1).double(), kr.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([dv for _, dv in dkv], dim=1).double(), vr.grad, atol=1e-4, rtol=0)
    if causal and layout == "ring":
        # The all-empty step adds exactly nothing to dk/dv.
        assert not dkv[2][0].any() and not dkv[2][1].any()


def intervals_of(keep):
    """The ``intervals`` (row_start, row_end, col_start, col_end) of a dense keep
    mask (sq, sk) in which every row's and every column's True entries are one
    run (or none: the empty [0, 0)), as MASK_INTERVALS takes them."""
    keep = keep.cpu()

    def runs(mask):  # per row: [start, end) of its run of True
        count = mask.sum(1)
        start = torch.where(count > 0, mask.int().argmax(1), 0)
        index = torch.arange(mask.shape[1])
        assert torch.equal(mask, (index >= start[:, None]) & (index < (start + count)[:, None])), "not one run"
        return start, start + count

    return tuple(t.to(device=DEVICE, dtype=torch.int32) for t in (*runs(keep), *runs(keep.T)))


def window_keep(q_pos, k_pos, left, right=0):
    """keep[i, j]: the query at position q_pos[i] sees the key at k_pos[j], a
    sliding window over one sequence of ``left`` keys before its own position
    and ``right`` after it (right=0: causal)."""
    offset = k_pos[None, :] - q_pos[:, None]
    return ((offset >= -left) & (offset <= right)).to(DEVICE)


def properties(major, minor, **extra):
    from types import SimpleNamespace

    return SimpleNamespace(major=major, minor=minor, name=f"a GPU of sm_{major}{minor}", **extra)


def cuda_stand_in(shape):
    # What check_launchable reads of a CUDA tensor, without a GPU.
    from types import SimpleNamespace

    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=torch.Size(shape))


def sweep_forms():
    """split_sweep True and False (SPLIT_FORWARD_SWEEP, SPLIT_BACKWARD_SWEEPS forced);
    the form this Triton release does not ship is marked gpu_long: the short GPU check
    leaves it out, as it compiles every kernel again."""
    shipped = step_tiles.SPLIT_FORWARD_SWEEP
    unshipped = () if shipped != step_tiles.SPLIT_BACKWARD_SWEEPS else (not shipped,)
    return [
        pytest.param(split, id=name, marks=[pytest.mark.gpu_long] if split in unshipped else [])
        for split, name in ((True, "split-sweep"), (False, "one-sweep"))
    ]
