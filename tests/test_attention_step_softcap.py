"""The step kernels with soft-capped scores (softcap > 0: score = softcap * tanh(scale * q.k
/ softcap), as Gemma 2 and Grok use): forward and backward of every mask mode against the
fp64 reference written out in full, GQA/MQA, head dims 64 to 256 (and 192 with v of 128),
the first step over garbage state, fp16/bf16 by the 2x rule, sliding windows as
intervals, and the launches (no trace of the cap in the kernels without it).
"""

import math

import pytest
import step_kernel_cases as cases
import torch
from step_kernel_cases import DEVICE, MASK_CAUSAL, MASK_FULL, MASK_INTERVALS
from triton_interpreter import runs_triton_on

from seqpar_kernels.kernels import attention_step_launch as launchers
from seqpar_kernels.kernels import attention_step_tiles as step_tiles


def softcap_reference(q, k, v, scale, softcap, keep=None):
    """fp64 soft-capped attention written out: (out (b, sq, h, dv), lse (b, h, sq)),
    K/V heads repeated for GQA.  A row that sees no key: out 0, lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = softcap * torch.tanh(torch.einsum("bqhd,bkhd->bhqk", q, k) * scale / softcap)
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float64).min).unsqueeze(-1)).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def window_intervals(sq, sk, left, right=0):
    """(intervals, keep) of a sliding window over a block whose queries sit at
    the last sq of sk positions (a diagonal block after earlier keys)."""
    keep = cases.window_keep(torch.arange(sk - sq, sk), torch.arange(sk), left, right)
    return cases.intervals_of(keep), keep


@runs_triton_on(DEVICE)
@pytest.mark.parametrize(
    "mode, h, hk, d, dv, sq, sk",
    [
        (MASK_FULL, 2, 2, 64, 64, 17, 40),  # MHA, partial tiles at both ends
        (MASK_CAUSAL, 4, 2, 128, 128, 33, 33),  # GQA diagonal block
        ("window", 3, 1, 256, 256, 20, 45),  # MQA, the largest head dim, a causal window of 24 keys
        ("window", 2, 1, 192, 128, 20, 45),  # v of another head dim (multi-head latent attention)
    ],
)
def test_softcap_step_fp32_matches_the_written_out_reference(mode, h, hk, d, dv, sq, sk):
    # q scaled by 4: scores of about +-4 standard deviations against a cap of 5,
    # so the tanh bends and saturates.  The gradients start non-zero (+=).
    torch.manual_seed(30)
    b, softcap, scale = 2, 5.0, d**-0.5
    q, dout = cases.randn(b, sq, h, d, scale=4.0), cases.randn(b, sq, h, dv)
    k, v = cases.randn(b, sk, hk, d), cases.randn(b, sk, hk, dv)
    intervals, keep = None, None
    if mode == "window":
        (intervals, keep), mode = window_intervals(sq, sk, left=23), MASK_INTERVALS
    elif mode == MASK_CAUSAL:
        keep = cases.causal_keep(sq, sk)
    options = dict(softmax_scale=scale, mask_mode=mode, intervals=intervals, softcap=softcap)
    out, lse = cases.fresh_state(b, sq, h, dv)
    launchers.attention_step_forward(q, k, v, out, lse, **options)
    grads0 = [cases.randn(b, sq, h, d), cases.randn(b, sk, hk, d), cases.randn(b, sk, hk, dv)]
    grads = [g.clone() for g in grads0]
    launchers.attention_step_backward(q, k, v, out, dout, lse, None, *grads, **options)

    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = softcap_reference(qr, kr, vr, scale, softcap, keep)
    ref_out.backward(dout.double())
    raw_scores = torch.einsum("bqd,bkd->bqk", q[:, :, 0].double(), k[:, :, 0].double()) * scale
    assert raw_scores.abs().max() > 2 * softcap  # the cap bends them
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=2e-5, rtol=0)
    for got, start, want in zip(grads, grads0, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close((got - start).double(), want, atol=1e-4, rtol=0)


@runs_triton_on(DEVICE)
def test_softcap_ring_steps_from_a_first_step_over_garbage():
    # A causal diagonal block and two full blocks, the first forward with
    # first_step=True over NaN state, then the backward of every step: the
    # merged result against fp64 autograd of the whole soft-capped attention.
    torch.manual_seed(31)
    cases.check_steps_forward_and_backward(h=4, hk=2, d=64, full_lens=[9, 23], b=1, sq=17, softcap=5.0, q_scale=4.0)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["causal", "window"])
def test_softcap_low_precision(dtype, mode):
    # Gemma 2's cap of 50 with logits that reach it; the 2x rule for the output,
    # 3% of the largest entry for the gradients.
    torch.manual_seed(32)
    sq, sk = 33, (33 if mode == "causal" else 70)
    mask = MASK_CAUSAL if mode == "causal" else window_intervals(sq, sk, left=40, right=3)
    cases.check_low_precision_step(mask, sq, sk, dtype=dtype, d=128, softcap=50.0, q_scale=40.0)


@runs_triton_on(DEVICE)
def test_softcap_zero_is_no_cap_and_a_negative_one_is_refused():
    # softcap=0 launches the kernels without the cap (their compile-time flag
    # off, no runtime argument of it: Triton takes None as a constant) and
    # computes exactly what a call without softcap does.
    torch.manual_seed(33)
    q, k = cases.randn(1, 20, 2, 64), cases.randn(1, 20, 1, 64)
    calls = {
        softcap: launchers._forward_call(
            q, k, k, q, q[:, :, :, 0], 0.125, False, None, softcap=softcap, target=None, interpreted=True
        )
        for softcap in (0.0, 2.0)
    }
    assert not calls[0.0][0].constexprs["SOFTCAP"] and calls[0.0][2][-2:] == (None, None)
    assert calls[2.0][0].constexprs["SOFTCAP"]
    assert calls[2.0][2][-2:] == pytest.approx((2 * launchers.LOG2E * 0.125 / 2.0, 2.0 * launchers.LOG2E))
    results = []
    for options in ({}, {"softcap": 0.0}):
        out, lse = cases.fresh_state(1, 20, 2, 64)
        launchers.attention_step_forward(q, k, k, out, lse, softmax_scale=0.125, mask_mode=MASK_CAUSAL, **options)
        results.append((out, lse))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    out, lse = results[0]
    for softcap in (-1.0, math.inf, math.nan, 1e-40):
        with pytest.raises(AssertionError, match="softcap"):
            launchers.attention_step_forward(
                q, k, k, out, lse, softmax_scale=0.125, mask_mode=MASK_FULL, softcap=softcap
            )
        with pytest.raises(AssertionError, match="softcap"):
            launchers.attention_step_backward_dq(
                q, k, k, q, lse, lse, out, softmax_scale=0.125, mask_mode=MASK_FULL, softcap=softcap
            )


def test_every_kernel_call_of_a_softcapped_step_has_the_cap():
    # What the ahead-of-time table compiles (cuda_kernel_calls) for a soft-capped
    # step: each step kernel with SOFTCAP and its two runtime arguments; the
    # backward preprocess has no scores.
    q = torch.empty(2, 256, 8, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 256, 2, 128, dtype=torch.bfloat16, device="meta")
    target = step_tiles.GpuTarget.of_capability(90)
    for mode in (MASK_FULL, MASK_CAUSAL, MASK_INTERVALS):
        calls = launchers.cuda_kernel_calls(q, k, k, mode, target, softcap=30.0)
        flags = [launch.constexprs.get("SOFTCAP") for launch, _ in calls]
        assert flags == [True, True, None, True, True, True], flags  # fwd x2, preprocess, dq, dk/dv, split dk/dv
        plain = launchers.cuda_kernel_calls(q, k, k, mode, target)
        assert [launch.constexprs.get("SOFTCAP") for launch, _ in plain] == [False, False, None, False, False, False]
        for (launch, args), (_, plain_args) in zip(calls, plain):
            if "SOFTCAP" in launch.constexprs:
                assert len(args) == len(plain_args) and plain_args[-2:] == (None, None)
                assert all(isinstance(value, float) for value in args[-2:])


@pytest.mark.skipif(
    DEVICE != "cuda",
    reason="the GPU tiles; without a GPU the interpreter runs the kernels on the other tests' shapes",
)
@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 128), (torch.float16, 256), (torch.float32, 128)], ids=str)
@pytest.mark.parametrize("mode", ["full", "causal", "window"])
def test_softcap_gpu_tiles_over_several_whole_tiles(dtype, d, mode):
    # The shipped GPU tiles over blocks of several whole tiles (the interpreter
    # tests' blocks fit in one or two): a window of 300 keys over a block of
    # 700 puts most k tiles in the unmasked middle sweep.  Against fp64 with at
    # most twice the error of plain PyTorch attention in dtype (plus about one ulp).
    torch.manual_seed(34)
    b, h, hk, softcap = 1, 4, 2, 30.0
    sq, sk = (333, 700) if mode != "causal" else (333, 333)
    q, dout = cases.randn(b, sq, h, d, dtype=dtype, scale=8.0), cases.randn(b, sq, h, d, dtype=dtype)
    k, v = cases.randn(b, sk, hk, d, dtype=dtype), cases.randn(b, sk, hk, d, dtype=dtype)
    intervals, keep, mask_mode = None, None, {"full": MASK_FULL, "causal": MASK_CAUSAL}.get(mode, MASK_INTERVALS)
    if mode == "window":
        intervals, keep = window_intervals(sq, sk, left=300)
    elif mode == "causal":
        keep = cases.causal_keep(sq, sk)
    scale = d**-0.5
    options = dict(softmax_scale=scale, mask_mode=mask_mode, intervals=intervals, softcap=softcap)
    out, lse = cases.fresh_state(b, sq, h, d)
    launchers.attention_step_forward(q, k, v, out, lse, first_step=True, **options)
    dq, dk, dv = cases.zeros(b, sq, h, d), cases.zeros(b, sk, hk, d), cases.zeros(b, sk, hk, d)
    launchers.attention_step_backward(q, k, v, out, dout, lse, None, dq, dk, dv, **options)

    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    exact, exact_lse = softcap_reference(qr, kr, vr, scale, softcap, keep)
    exact.backward(dout.double())
    qp, kp, vp = (t.detach().clone().requires_grad_() for t in (q, k, v))
    plain = cases.torch_attention_in_dtype(qp, kp, vp, scale, keep, softcap)
    plain.backward(dout)
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-3 if dtype != torch.float32 else 2e-5, rtol=0)
    cases.assert_within_twice_plain_torch(
        dtype, (out, dq, dk, dv), (plain, qp.grad, kp.grad, vp.grad), (exact, qr.grad, kr.grad, vr.grad)
    )
