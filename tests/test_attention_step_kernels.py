"""Tests for the ring-attention step kernels (seqpar_kernels/kernels/attention_step_*.py:
the kernels, their tiles and their launchers) and the check that the ring can launch them.

Without CUDA the Triton kernels run in the interpreter on CPU tensors
(TRITON_INTERPRET=1 must be set before triton is imported).  The reference is
plain torch in float64 with the score matrix materialized; K/V heads are
repeated for GQA/MQA in the reference only.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402

import pytest  # noqa: E402


pytest.importorskip("triton", reason="the Triton kernels need triton (torch CPU wheels do not ship it)")
from seqpar_kernels.kernels import attention_step_kernels as kernels  # noqa: E402
from seqpar_kernels.kernels import attention_step_launch as launchers  # noqa: E402
from seqpar_kernels.kernels import attention_step_tiles as step_tiles  # noqa: E402
from seqpar_kernels.parallel.checks import check_launchable  # noqa: E402
from triton_interpreter import runs_triton_on  # noqa: E402
MASK_FULL, MASK_CAUSAL = launchers.MASK_FULL, launchers.MASK_CAUSAL
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(device=DEVICE, dtype=dtype)


def _zeros(*shape):
    return torch.zeros(*shape, dtype=torch.float32, device=DEVICE)


def _causal_keep(sq, sk, offset=0):
    """keep[i, j] = query i (at global position offset + i) may see key j."""
    i = torch.arange(sq).unsqueeze(1) + offset
    j = torch.arange(sk).unsqueeze(0)
    return (j <= i).to(DEVICE)


def _reference(q, k, v, scale, keep=None):
    """fp64 attention; returns out (b, sq, h, d) and lse (b, h, sq).

    keep: optional bool (sq, sk) mask of visible keys.  Rows with no visible
    key give out = 0 and lse = -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float64).min))
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def _torch_attention_in_dtype(q, k, v, scale, keep=None):
    """Plain (materialized) torch attention computed in q's own dtype."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2)) * scale
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.transpose(1, 2)).transpose(1, 2)


def _fresh_state(b, sq, h, d):
    out = torch.zeros(b, sq, h, d, dtype=torch.float32, device=DEVICE)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=DEVICE)
    return out, lse


def _ring_blocks(b, sq, hk, d, full_lens, dtype=torch.float32):
    """K/V of the own (diagonal, causal) block followed by full blocks of other ranks.

    Returns the list of (k, v, mask_mode) steps in ring order (diagonal first)
    and the global K/V, keep-mask in the order [full blocks..., diagonal].
    """
    fulls = [(_randn(b, n, hk, d, dtype=dtype), _randn(b, n, hk, d, dtype=dtype)) for n in full_lens]
    kd, vd = _randn(b, sq, hk, d, dtype=dtype), _randn(b, sq, hk, d, dtype=dtype)
    steps = [(kd, vd, MASK_CAUSAL)] + [(kf, vf, MASK_FULL) for kf, vf in fulls]
    k_all = torch.cat([kf for kf, _ in fulls] + [kd], dim=1)
    v_all = torch.cat([vf for _, vf in fulls] + [vd], dim=1)
    keep = _causal_keep(sq, k_all.shape[1], offset=sum(full_lens))
    return steps, k_all, v_all, keep


# ----------------------------------------------------------------------------
# forward, single step
# ----------------------------------------------------------------------------


@runs_triton_on(DEVICE)
@pytest.mark.parametrize(
    "h, hk, d, mode, sq, sk, q_transposed",
    [
        (4, 4, 64, MASK_FULL, 17, 33, False),  # MHA, odd lengths, several k tiles
        (4, 2, 80, MASK_CAUSAL, 17, 17, True),  # GQA, non-power-of-2 head dim, q a transpose view
        (3, 1, 128, MASK_CAUSAL, 40, 40, False),  # MQA, three q tiles
        (2, 1, 96, MASK_FULL, 3, 1, True),  # tiny
        (2, 2, 256, MASK_FULL, 1, 5, False),  # largest head dim, one query
    ],
)
def test_forward_single_step_fp32(h, hk, d, mode, sq, sk, q_transposed):
    torch.manual_seed(0)
    b = 2
    if q_transposed:
        # (b, h, sq, d) storage viewed as (b, sq, h, d): non-contiguous q.
        q = _randn(b, h, sq, d).transpose(1, 2)
        assert not q.is_contiguous()
    else:
        q = _randn(b, sq, h, d)
    k, v = _randn(b, sk, hk, d), _randn(b, sk, hk, d)
    scale = d ** -0.5
    out, lse = _fresh_state(b, sq, h, d)
    ret = launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    assert ret[0] is out and ret[1] is lse
    keep = _causal_keep(sq, sk) if mode == MASK_CAUSAL else None
    ref_out, ref_lse = _reference(q, k, v, scale, keep)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "h, hk, d, mode, sq, sk",
    [
        (4, 2, 64, MASK_CAUSAL, 33, 33),  # GQA diagonal block
        (2, 1, 128, MASK_FULL, 17, 40),  # MQA full block
    ],
)
def test_forward_single_step_low_precision(dtype, h, hk, d, mode, sq, sk):
    torch.manual_seed(1)
    b = 1
    q, k, v = _randn(b, sq, h, d, dtype=dtype), _randn(b, sk, hk, d, dtype=dtype), _randn(b, sk, hk, d, dtype=dtype)
    scale = d ** -0.5
    keep = _causal_keep(sq, sk) if mode == MASK_CAUSAL else None
    out, lse = _fresh_state(b, sq, h, d)
    launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    ref_out, ref_lse = _reference(q, k, v, scale, keep)  # fp64 on the same rounded inputs
    torch_out = _torch_attention_in_dtype(q, k, v, scale, keep)
    ours_err = (out.double() - ref_out).abs().max().item()
    torch_err = (torch_out.double() - ref_out).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-3, (ours_err, torch_err)
    # Scores are exact products accumulated in fp32, so lse is fp32-accurate.
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------
# forward, several ring steps merged in place
# ----------------------------------------------------------------------------


@runs_triton_on(DEVICE)
def test_forward_merge_three_steps_matches_full_attention():
    torch.manual_seed(2)
    b, sq, h, hk, d = 2, 17, 4, 2, 64
    steps, k_all, v_all, keep = _ring_blocks(b, sq, hk, d, full_lens=[9, 23])
    q = _randn(b, sq, h, d)
    scale = d ** -0.5
    # Non-contiguous running state: out stored head-major, lse stored (b, sq, h).
    out = torch.zeros(b, h, sq, d, device=DEVICE).transpose(1, 2)
    lse = torch.full((b, sq, h), float("-inf"), device=DEVICE).transpose(1, 2)
    assert not out.is_contiguous() and not lse.is_contiguous()
    for k, v, mode in steps:
        launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    ref_out, ref_lse = _reference(q, k_all, v_all, scale, keep)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


@runs_triton_on(DEVICE)
def test_forward_merge_strided_kv_and_garbage_initial_out():
    # K/V with a head-dim stride of 2 and a batch-major permutation; the initial
    # out holds NaN garbage (torch.empty-like): lse = -inf must make it ignored.
    torch.manual_seed(3)
    b, sq, h, hk, d = 2, 5, 4, 2, 80
    q = _randn(b, sq, h, d)
    big_k = _randn(b, 11, hk, 2 * d)
    big_v = _randn(hk, b, 11, d).permute(1, 2, 0, 3)
    k1, v1 = big_k[:, :6, :, ::2], big_v[:, :6]
    k2, v2 = big_k[:, 6:, :, ::2], big_v[:, 6:]
    assert k1.stride(-1) == 2 and not v1.is_contiguous()
    scale = 0.3
    out = torch.full((b, sq, h, d), float("nan"), device=DEVICE)
    lse = torch.full((b, h, sq), float("-inf"), device=DEVICE)
    launchers.attention_step_forward(q, k1, v1, out, lse, softmax_scale=scale, mask_mode=MASK_FULL)
    launchers.attention_step_forward(q, k2, v2, out, lse, softmax_scale=scale, mask_mode=MASK_FULL)
    ref_out, ref_lse = _reference(q, big_k[..., ::2], big_v, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_large_logits(dtype):
    # q scaled by 40: logits of several hundred; naive exp would overflow.
    torch.manual_seed(4)
    b, sq, h, hk, d = 1, 17, 2, 1, 64
    steps, k_all, v_all, keep = _ring_blocks(b, sq, hk, d, full_lens=[20], dtype=dtype)
    q = (_randn(b, sq, h, d) * 40).to(dtype)
    scale = d ** -0.5
    out, lse = _fresh_state(b, sq, h, d)
    for k, v, mode in steps:
        launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_out, ref_lse = _reference(q, k_all, v_all, scale, keep)
    assert ref_lse.abs().max() > 100  # the logits really are large
    out_atol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref_out, atol=out_atol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------
# fully masked rows
# ----------------------------------------------------------------------------


@runs_triton_on(DEVICE)
def test_fully_masked_rows_stay_untouched():
    torch.manual_seed(5)
    b, sq, h, hk, d = 1, 17, 2, 2, 64
    q = _randn(b, sq, h, d)
    out, lse = _fresh_state(b, sq, h, d)
    empty = _randn(b, 0, hk, d)

    # Zero steps / an empty K/V block: initial state, no NaN.
    launchers.attention_step_forward(q, empty, empty, out, lse, softmax_scale=0.125, mask_mode=MASK_FULL)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()

    # Inside the kernel: with seqlen_k = 0 no row sees a key, so nothing may be
    # written (launched directly: the launcher short-cuts empty blocks).
    k, v = _randn(b, 8, hk, d), _randn(b, 8, hk, d)
    launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=0.125, mask_mode=MASK_FULL)
    out_before, lse_before = out.clone(), lse.clone()
    fresh_out, fresh_lse = _fresh_state(b, sq, h, d)
    for o, l in ((out, lse), (fresh_out, fresh_lse)):
        kernels._attention_step_fwd_kernel[(2, h, b)](
            q, k, v, o, l,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), *l.stride(),
            sq, 0, d, 1, 0.125 * 1.4426950408889634,
            CAUSAL=False, BLOCK_M=16, BLOCK_N=32, BLOCK_D=64, DOT_PRECISION="ieee", DOT_UPCAST=False,
            SPLIT_SWEEP=step_tiles.SPLIT_FORWARD_SWEEP,
        )
    assert torch.equal(out, out_before) and torch.equal(lse, lse_before)
    assert torch.equal(fresh_out, torch.zeros_like(fresh_out)) and torch.isneginf(fresh_lse).all()


@runs_triton_on(DEVICE)
def test_backward_rows_with_neg_inf_lse_get_zero_gradient():
    torch.manual_seed(6)
    b, sq, h, hk, d = 1, 17, 2, 1, 64
    q, k, v = _randn(b, sq, h, d), _randn(b, sq, hk, d), _randn(b, sq, hk, d)
    scale = d ** -0.5
    out, lse = _fresh_state(b, sq, h, d)
    launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=MASK_CAUSAL)
    dout = _randn(b, sq, h, d)
    rows = [0, 5, 16]
    lse_masked = lse.clone()
    lse_masked[:, :, rows] = float("-inf")  # as if these rows saw no key at all
    delta = launchers.attention_backward_preprocess(out, dout)
    grads = [_zeros(b, sq, h, d), _zeros(b, sq, hk, d), _zeros(b, sq, hk, d)]
    launchers.attention_step_backward(q, k, v, out, dout, lse_masked, delta, *grads,
                                      softmax_scale=scale, mask_mode=MASK_CAUSAL)
    for g in grads:
        assert torch.isfinite(g).all()
    assert torch.equal(grads[0][:, rows], torch.zeros_like(grads[0][:, rows]))
    # dk/dv equal those of the same problem where the masked rows have no
    # upstream gradient at all.
    dout0, delta0 = dout.clone(), delta.clone()
    dout0[:, rows] = 0
    delta0[:, :, rows] = 0
    want = [_zeros(b, sq, h, d), _zeros(b, sq, hk, d), _zeros(b, sq, hk, d)]
    launchers.attention_step_backward(q, k, v, out, dout0, lse, delta0, *want,
                                      softmax_scale=scale, mask_mode=MASK_CAUSAL)
    torch.testing.assert_close(grads[1], want[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[2], want[2], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------


def test_backward_preprocess():
    torch.manual_seed(7)
    out = _randn(2, 3, 17, 80).transpose(1, 2)  # (b, sq, h, d), non-contiguous
    dout = _randn(2, 17, 3, 80, dtype=torch.bfloat16)
    delta = launchers.attention_backward_preprocess(out, dout)
    assert delta.shape == (2, 3, 17) and delta.dtype == torch.float32
    want = (out.double() * dout.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(delta.double(), want, atol=1e-5, rtol=0)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize(
    "h, hk, d, full_lens",
    [
        (4, 2, 64, [9, 23]),  # GQA: causal diagonal + two full blocks
        (2, 1, 80, [17]),  # MQA, padded head dim
        (2, 1, 96, [17]),  # MQA, padded head dim (BLOCK_D 128)
        (4, 2, 128, [9]),  # GQA
        (2, 2, 256, [9]),  # the largest head dim
    ],
)
def test_backward_multi_step_matches_autograd(h, hk, d, full_lens):
    torch.manual_seed(8)
    _check_steps_forward_and_backward(h, hk, d, full_lens, b=2, sq=17)


@runs_triton_on(DEVICE)
@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU runs the CUDA tiles in every test")
@pytest.mark.parametrize("tiles", step_tiles.all_cuda_tiles(), ids=lambda tiles: "x".join(map(str, tiles)))
def test_cuda_tiles_compute_the_same_in_the_interpreter(monkeypatch, tiles):
    # The CUDA tile shapes, run by the interpreter: q and k lengths that leave
    # partial tiles at both ends of the sweep, and (for the small tiles) several.
    monkeypatch.setattr(step_tiles, "_INTERPRETER_TILES", tiles)
    torch.manual_seed(10)
    _check_steps_forward_and_backward(h=2, hk=1, d=80, full_lens=[150], b=1, sq=70)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("split_sweep", [True, False], ids=["split-sweep", "one-sweep"])
def test_forward_with_and_without_the_split_sweep(monkeypatch, split_sweep):
    # Triton 3.8+ compiles the forward with its unmasked sweep split off, older
    # Triton with one masked sweep (SPLIT_FORWARD_SWEEP): both must be exact.
    # 45 rows in 16-row q tiles and 32-key tiles: the causal diagonal has a whole
    # tile every row of the last q tile sees, the 70-key block two and a partial one.
    monkeypatch.setattr(step_tiles, "SPLIT_FORWARD_SWEEP", split_sweep)
    assert step_tiles.forward_launch(torch.float32, 64, True, target=None, interpreted=True) \
        .constexprs["SPLIT_SWEEP"] is split_sweep
    torch.manual_seed(12)
    _check_steps_forward_and_backward(h=4, hk=2, d=64, full_lens=[9, 70], b=1, sq=45)


def _run_steps(q, steps, k_all, full_lens, dout, dq, scale):
    """The ring steps of _ring_blocks through the step kernels: every forward, then
    every backward, dq accumulated in place.  Returns (out, lse, dk_all, dv_all);
    dk/dv are slices of one fp32 buffer (like the travelling gradient buffers of the
    ring), in k_all's order [full blocks..., diagonal]."""
    b, sq, h, d = q.shape
    out, lse = _fresh_state(b, sq, h, d)
    for k, v, mode in steps:
        launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    delta = launchers.attention_backward_preprocess(out, dout)
    dk_all, dv_all = _zeros(*k_all.shape), _zeros(*k_all.shape)
    n_full = sum(full_lens)
    bounds = [(n_full, n_full + sq)]
    start = 0
    for n in full_lens:
        bounds.append((start, start + n))
        start += n
    for (k, v, mode), (lo, hi) in zip(steps, bounds):
        launchers.attention_step_backward(q, k, v, out, dout, lse, delta, dq, dk_all[:, lo:hi], dv_all[:, lo:hi],
                                          softmax_scale=scale, mask_mode=mode)
    return out, lse, dk_all, dv_all


def _check_steps_forward_and_backward(h, hk, d, full_lens, b, sq):
    """Forward over a causal diagonal block and full blocks, then the backward of
    every step, against fp64 autograd of the whole attention."""
    steps, k_all, v_all, keep = _ring_blocks(b, sq, hk, d, full_lens=full_lens)
    q = _randn(b, sq, h, d)
    scale = d ** -0.5
    dout = _randn(b, sq, h, d)
    # dq starts non-zero to check accumulation (+=).
    dq0 = _randn(b, sq, h, d)
    dq = dq0.clone()
    _, _, dk_all, dv_all = _run_steps(q, steps, k_all, full_lens, dout, dq, scale)

    qr = q.double().requires_grad_()
    kr = k_all.double().requires_grad_()
    vr = v_all.double().requires_grad_()
    ref_out, _ = _reference(qr, kr, vr, scale, keep)
    ref_out.backward(dout.double())
    torch.testing.assert_close(dq.double() - dq0.double(), qr.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(dk_all.double(), kr.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(dv_all.double(), vr.grad, atol=1e-4, rtol=0)


@runs_triton_on(DEVICE)
def test_backward_bf16_single_causal_step():
    # Low-precision inputs (P and dS are rounded to bf16 before the products,
    # as in flash-attention): check against the fp64 reference loosely.
    torch.manual_seed(9)
    b, sq, h, hk, d = 1, 17, 4, 2, 64
    q, k, v = (_randn(b, sq, n, d, dtype=torch.bfloat16) for n in (h, hk, hk))
    scale = d ** -0.5
    out, lse = _fresh_state(b, sq, h, d)
    launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=MASK_CAUSAL)
    dout = _randn(b, sq, h, d, dtype=torch.bfloat16)
    dq, dk, dv = _zeros(b, sq, h, d), _zeros(b, sq, hk, d), _zeros(b, sq, hk, d)
    launchers.attention_step_backward(q, k, v, out, dout, lse, None, dq, dk, dv,
                                      softmax_scale=scale, mask_mode=MASK_CAUSAL)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, _ = _reference(qr, kr, vr, scale, _causal_keep(sq, sq))
    ref_out.backward(dout.double())
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= 3e-2 * want.abs().max().item(), err


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU tiles; without a GPU the interpreter runs them "
                    "in test_cuda_tiles_compute_the_same_in_the_interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("split_sweep", [True, False], ids=["split-sweep", "one-sweep"])
def test_gpu_tiles_over_several_whole_tiles(monkeypatch, dtype, d, split_sweep):
    # The other tests use at most 40 keys: with the GPU tiles (up to 128 x 128) every k
    # tile there is partial, so the forward's unmasked sweep and the loops over several
    # tiles would run first in the benchmark.  A causal diagonal block of 333 rows and
    # full blocks of 700 and 260 keys, forward and backward, against fp64 autograd, with
    # at most twice the error of plain PyTorch attention in dtype (plus about one ulp).
    # Both forms of the forward's sweep (SPLIT_FORWARD_SWEEP) compile and run.
    monkeypatch.setattr(step_tiles, "SPLIT_FORWARD_SWEEP", split_sweep)
    torch.manual_seed(11)
    b, sq, h, hk = 1, 333, 4, 2
    full_lens = [700, 260]
    steps, k_all, v_all, keep = _ring_blocks(b, sq, hk, d, full_lens, dtype=dtype)
    q = _randn(b, sq, h, d, dtype=dtype)
    dout = _randn(b, sq, h, d, dtype=dtype)
    scale = d ** -0.5
    dq = _zeros(b, sq, h, d)
    out, lse, dk_all, dv_all = _run_steps(q, steps, k_all, full_lens, dout, dq, scale)

    qr, kr, vr = (t.double().requires_grad_() for t in (q, k_all, v_all))
    exact, exact_lse = _reference(qr, kr, vr, scale, keep)
    exact.backward(dout.double())
    qp, kp, vp = (t.detach().clone().requires_grad_() for t in (q, k_all, v_all))
    plain = _torch_attention_in_dtype(qp, kp, vp, scale, keep)
    plain.backward(dout)
    slack = {torch.float32: 2e-5, torch.bfloat16: 1e-4, torch.float16: 1e-5}[dtype]
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-3 if dtype != torch.float32 else 2e-5, rtol=0)
    for name, ours, yardstick, want in (("out", out, plain, exact), ("dq", dq, qp.grad, qr.grad),
                                        ("dk", dk_all, kp.grad, kr.grad), ("dv", dv_all, vp.grad, vr.grad)):
        err = (ours.double() - want).abs().max().item()
        plain_err = (yardstick.double() - want).abs().max().item()
        assert err <= 2 * plain_err + slack, f"{name}: err {err:.3g}, plain torch in {dtype} {plain_err:.3g}"


# ----------------------------------------------------------------------------
# which tiles a GPU gets
# ----------------------------------------------------------------------------


def _properties(major, minor, **extra):
    from types import SimpleNamespace
    return SimpleNamespace(major=major, minor=minor, name=f"a GPU of sm_{major}{minor}", **extra)


def test_device_target_reads_the_shared_memory(monkeypatch):
    target_of = step_tiles._device_target.__wrapped__  # the uncached function: no real device is asked
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: _properties(9, 0, shared_memory_per_block_optin=232448))
    assert target_of(0) == step_tiles.GpuTarget(90, 232448)
    # A torch without shared_memory_per_block_optin: the table, and the smallest
    # size on record for a capability the table does not know.
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _properties(12, 0))
    assert target_of(0) == step_tiles.GpuTarget(120, 101376)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _properties(11, 0))
    assert target_of(0) == step_tiles.GpuTarget(110, 101376)


def test_tiles_follow_the_target_family():
    # The sm_90 tiles, replaced where the ahead-of-time compile found a spill or an
    # overflow (see _TILE_OVERRIDES): GQA dk/dv at d128 spills with (32, 128) on
    # every target but sm_90; fp32 dq at d256 overflows 99 KiB of shared memory.
    bf16, fp32 = torch.bfloat16, torch.float32
    target = step_tiles.GpuTarget.of_capability
    assert step_tiles._tiles("dkdv", bf16, 128, target(90)) == (32, 128, 8, 2)
    for capability in (80, 86, 89, 100, 120):
        assert step_tiles._tiles("dkdv", bf16, 128, target(capability)) == (32, 64, 8, 2), capability
    assert step_tiles._tiles("dq", fp32, 256, target(80)) == (16, 32, 8, 2)
    for capability in (86, 89, 120, 121):
        assert step_tiles._tiles("dq", fp32, 256, target(capability)) == (16, 16, 8, 2), capability
    assert step_tiles._tiles("dq", fp32, 256, step_tiles.GpuTarget(110, 101376)) == (16, 16, 8, 2)
    assert step_tiles._tiles("forward", bf16, 64, target(100)) == (128, 64, 8, 3)
    assert step_tiles._tiles("forward", bf16, 64, None) == step_tiles._INTERPRETER_TILES
    with pytest.raises(ValueError, match="sm_75"):
        target(75)


# ----------------------------------------------------------------------------
# what the ring checks before it launches (parallel/checks.py check_launchable)
# ----------------------------------------------------------------------------


def _cuda_stand_in(shape):
    # What check_launchable reads of a CUDA tensor, without a GPU.
    from types import SimpleNamespace
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), shape=torch.Size(shape))


def test_check_launchable_refuses_old_gpus_and_grids_over_the_cuda_limit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _properties(7, 5))
    with pytest.raises(ValueError, match=r"sm_75 \(q \(2, 16, 4, 64\)\)"):
        check_launchable(_cuda_stand_in((2, 16, 4, 64)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _properties(8, 0))
    check_launchable(_cuda_stand_in((2, 16, 4, 64)))
    check_launchable(_cuda_stand_in((65535, 1, 65535, 8)))
    for shape in ((65536, 1, 4, 8), (1, 1, 65536, 8)):
        with pytest.raises(ValueError, match=re.escape(f"got q shape {shape}")):
            check_launchable(_cuda_stand_in(shape))


def test_check_launchable_passes_cpu_tensors_without_asking_for_a_gpu(monkeypatch):
    def no_gpu(device):
        raise AssertionError("a CPU tensor needs no GPU properties")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_gpu)
    check_launchable(torch.empty(65536, 1, 65536, 0))


@pytest.mark.skipif(DEVICE != "cuda", reason="the grid limit applies to CUDA tensors; without a GPU "
                    "test_check_launchable_refuses_old_gpus_and_grids_over_the_cuda_limit covers it")
@pytest.mark.parametrize("shape_q, shape_kv", [((1, 2, 65536, 8), (1, 2, 1, 8)), ((65536, 2, 1, 8), (65536, 2, 1, 8))])
def test_ring_attention_refuses_a_grid_over_the_cuda_limit(shape_q, shape_kv):
    import seqpar_kernels as sp
    q = torch.zeros(shape_q, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(shape_kv, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape(f"got q shape {shape_q}")):
        sp.ring_attention(q, k, k)
