"""The step kernels' forward (seqpar_kernels/kernels/attention_step_*.py): one step against the
fp64 reference, steps merged in place, the first step over garbage state, any finite
scale, large logits, rows that see no key, v of another head dim than q and k.
"""

import pytest
import step_kernel_cases as cases
import torch
from step_kernel_cases import DEVICE, DOC_LENS, MASK_CAUSAL, MASK_FULL, MASK_INTERVALS
from triton_interpreter import runs_triton_on

from seqpar_kernels.kernels import attention_step_launch as launchers
from seqpar_kernels.kernels import attention_step_tiles as step_tiles
from seqpar_kernels.parallel.attention_checks import fold_scale_sign


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
        q = cases.randn(b, h, sq, d).transpose(1, 2)
        assert not q.is_contiguous()
    else:
        q = cases.randn(b, sq, h, d)
    k, v = cases.randn(b, sk, hk, d), cases.randn(b, sk, hk, d)
    scale = d**-0.5
    out, lse = cases.fresh_state(b, sq, h, d)
    ret = launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    assert ret[0] is out and ret[1] is lse
    keep = cases.causal_keep(sq, sk) if mode == MASK_CAUSAL else None
    ref_out, ref_lse = cases.reference_attention(q, k, v, scale, keep)
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
    q, k, v = (
        cases.randn(b, sq, h, d, dtype=dtype),
        cases.randn(b, sk, hk, d, dtype=dtype),
        cases.randn(b, sk, hk, d, dtype=dtype),
    )
    scale = d**-0.5
    keep = cases.causal_keep(sq, sk) if mode == MASK_CAUSAL else None
    out, lse = cases.fresh_state(b, sq, h, d)
    launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    cases.assert_low_precision_accuracy(q, k, v, scale, keep, out, lse)


@runs_triton_on(DEVICE)
def test_forward_merge_three_steps_matches_full_attention():
    torch.manual_seed(2)
    b, sq, h, hk, d = 2, 17, 4, 2, 64
    steps, k_all, v_all, keep = cases.ring_blocks(b, sq, hk, d, full_lens=[9, 23])
    q = cases.randn(b, sq, h, d)
    scale = d**-0.5
    # Non-contiguous running state: out stored head-major, lse stored (b, sq, h).
    out = torch.zeros(b, h, sq, d, device=DEVICE).transpose(1, 2)
    lse = torch.full((b, sq, h), float("-inf"), device=DEVICE).transpose(1, 2)
    assert not out.is_contiguous() and not lse.is_contiguous()
    for k, v, mode in steps:
        launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    ref_out, ref_lse = cases.reference_attention(q, k_all, v_all, scale, keep)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


@runs_triton_on(DEVICE)
def test_forward_merge_strided_kv_and_garbage_initial_out():
    # K/V with a head-dim stride of 2 and a batch-major permutation; the initial
    # out holds NaN garbage (torch.empty-like): lse = -inf must make it ignored.
    torch.manual_seed(3)
    b, sq, h, hk, d = 2, 5, 4, 2, 80
    q = cases.randn(b, sq, h, d)
    big_k = cases.randn(b, 11, hk, 2 * d)
    big_v = cases.randn(hk, b, 11, d).permute(1, 2, 0, 3)
    k1, v1 = big_k[:, :6, :, ::2], big_v[:, :6]
    k2, v2 = big_k[:, 6:, :, ::2], big_v[:, 6:]
    assert k1.stride(-1) == 2 and not v1.is_contiguous()
    scale = 0.3
    out = torch.full((b, sq, h, d), float("nan"), device=DEVICE)
    lse = torch.full((b, h, sq), float("-inf"), device=DEVICE)
    launchers.attention_step_forward(q, k1, v1, out, lse, softmax_scale=scale, mask_mode=MASK_FULL)
    launchers.attention_step_forward(q, k2, v2, out, lse, softmax_scale=scale, mask_mode=MASK_FULL)
    ref_out, ref_lse = cases.reference_attention(q, big_k[..., ::2], big_v, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("d, dv", [(80, 48), (48, 80)], ids=["narrower-v", "wider-v"])
def test_forward_value_head_dim_first_step_then_merge(d, dv):
    # v of another head dim than q and k, each padded to its own BLOCK: a first
    # step over NaN state (a causal diagonal block) and a full block merged into
    # it, with a v whose head dim has a stride of 2 and an out stored head-major.
    torch.manual_seed(16)
    b, sq, h, hk = 1, 17, 2, 1
    q = cases.randn(b, sq, h, d)
    k1, k2 = cases.randn(b, sq, hk, d), cases.randn(b, 9, hk, d)
    v1, v2 = cases.randn(b, sq, hk, 2 * dv)[..., ::2], cases.randn(b, 9, hk, dv)
    scale = d**-0.5
    out = torch.full((b, h, sq, dv), float("nan"), device=DEVICE).transpose(1, 2)
    lse = torch.full((b, h, sq), float("nan"), device=DEVICE)
    launchers.attention_step_forward(q, k1, v1, out, lse, softmax_scale=scale, mask_mode=MASK_CAUSAL, first_step=True)
    ref_out, ref_lse = cases.reference_attention(q, k1, v1, scale, cases.causal_keep(sq, sq))
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
    launchers.attention_step_forward(q, k2, v2, out, lse, softmax_scale=scale, mask_mode=MASK_FULL)
    keep = torch.cat([cases.causal_keep(sq, sq), torch.ones(sq, 9, dtype=torch.bool, device=DEVICE)], dim=1)
    ref_out, ref_lse = cases.reference_attention(q, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1), scale, keep)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("mode", [MASK_CAUSAL, MASK_FULL, MASK_INTERVALS], ids=["causal", "full", "intervals"])
def test_forward_first_step_writes_every_row_over_garbage(mode):
    # first_step=True: out and lse hold NaN (as torch.empty may) and are neither
    # read nor left unwritten.  With the intervals, rows 16-31 (a q tile of the
    # interpreter) and more see no key of the block: out 0, lse -inf.  The
    # following steps merge into the state the first one wrote.
    torch.manual_seed(14)
    b, sq, h, hk, d = 2, 40, 4, 2, 64
    q = cases.randn(b, sq, h, d)
    scale = d**-0.5
    if mode == MASK_INTERVALS:
        k_positions = [torch.arange(40, 80), torch.arange(80, 120)]
        steps = []
        for k_pos in k_positions:
            intervals, keep = cases.document_intervals(torch.arange(80, 120), k_pos, DOC_LENS, causal=True)
            steps.append((cases.randn(b, 40, hk, d), cases.randn(b, 40, hk, d), MASK_INTERVALS, intervals, keep))
        assert not steps[0][4][16:32].any() and steps[0][4].any()
    else:
        steps = [
            (cases.randn(b, n, hk, d), cases.randn(b, n, hk, d), step_mode, None, keep)
            for n, step_mode, keep in (
                (sq, mode, cases.causal_keep(sq, sq) if mode == MASK_CAUSAL else None),
                (23, MASK_FULL, None),
            )
        ]
    out = torch.full((b, sq, h, d), float("nan"), device=DEVICE)
    lse = torch.full((b, h, sq), float("nan"), device=DEVICE)
    for index, (k, v, step_mode, intervals, keep) in enumerate(steps):
        launchers.attention_step_forward(
            q, k, v, out, lse, softmax_scale=scale, mask_mode=step_mode, intervals=intervals, first_step=index == 0
        )
        if index == 0:
            ref_out, ref_lse = cases.reference_attention(q, k, v, scale, keep)
            torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
            torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
    keep_all = None
    if steps[0][4] is not None or steps[1][4] is not None:
        keep_all = torch.cat(
            [
                s[4] if s[4] is not None else torch.ones(sq, s[0].shape[1], dtype=torch.bool, device=DEVICE)
                for s in steps
            ],
            dim=1,
        )
    ref_out, ref_lse = cases.reference_attention(
        q, torch.cat([s[0] for s in steps], 1), torch.cat([s[1] for s in steps], 1), scale, keep_all
    )
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("scale", [0.0, -0.3], ids=["zero-scale", "negative-scale"])
def test_steps_take_any_finite_scale_once_its_sign_is_folded(scale):
    # The forward sweep folds the scale into its exponent, which needs a scale
    # >= 0; the public functions give a negative one to q (fold_scale_sign), and a
    # zero one makes q zero.  Forward and backward over a causal diagonal block and
    # a full block, against fp64 autograd with the scale as given.
    torch.manual_seed(15)
    b, sq, h, hk, d = 1, 40, 2, 1, 64
    steps, k_all, v_all, keep = cases.ring_blocks(b, sq, hk, d, full_lens=[37])
    q, dout = cases.randn(b, sq, h, d), cases.randn(b, sq, h, d)
    folded_q, folded_scale = fold_scale_sign(q, scale)
    folded_dq = cases.zeros(b, sq, h, d)
    out, lse, dk_all, dv_all = cases.run_steps(folded_q, steps, k_all, [37], dout, folded_dq, folded_scale)
    dq = -folded_dq if scale < 0 else folded_dq * 0.0
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k_all, v_all))
    ref_out, ref_lse = cases.reference_attention(qr, kr, vr, scale, keep)
    ref_out.backward(dout.double())
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=2e-5, rtol=0)
    for got, want in ((dq, qr.grad), (dk_all, kr.grad), (dv_all, vr.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_large_logits(dtype):
    # q scaled by 40: logits of several hundred; naive exp would overflow.
    torch.manual_seed(4)
    b, sq, h, hk, d = 1, 17, 2, 1, 64
    steps, k_all, v_all, keep = cases.ring_blocks(b, sq, hk, d, full_lens=[20], dtype=dtype)
    q = (cases.randn(b, sq, h, d) * 40).to(dtype)
    scale = d**-0.5
    out, lse = cases.fresh_state(b, sq, h, d)
    for k, v, mode in steps:
        launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_out, ref_lse = cases.reference_attention(q, k_all, v_all, scale, keep)
    assert ref_lse.abs().max() > 100  # the logits really are large
    out_atol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref_out, atol=out_atol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@runs_triton_on(DEVICE)
def test_fully_masked_rows_stay_untouched():
    torch.manual_seed(5)
    b, sq, h, hk, d = 1, 17, 2, 2, 64
    q = cases.randn(b, sq, h, d)
    out, lse = cases.fresh_state(b, sq, h, d)
    empty = cases.randn(b, 0, hk, d)

    # Zero steps / an empty K/V block: initial state, no NaN.
    launchers.attention_step_forward(q, empty, empty, out, lse, softmax_scale=0.125, mask_mode=MASK_FULL)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()

    # Inside the kernel: with seqlen_k = 0 no row sees a key, so nothing may be
    # written (launched directly: the launcher short-cuts empty blocks), and the
    # first step's kernel writes the state of no key over any garbage.
    k, v = cases.randn(b, 8, hk, d), cases.randn(b, 8, hk, d)
    launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=0.125, mask_mode=MASK_FULL)
    out_before, lse_before = out.clone(), lse.clone()
    fresh_out, fresh_lse = cases.fresh_state(b, sq, h, d)
    nan_out, nan_lse = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    for running_out, running_lse, first_step in (
        (out, lse, False),
        (fresh_out, fresh_lse, False),
        (nan_out, nan_lse, True),
    ):
        launch, grid, args = launchers._forward_call(
            q,
            k[:, :0],
            v[:, :0],
            running_out,
            running_lse,
            0.125,
            False,
            None,
            first_step=first_step,
            target=step_tiles.cuda_target(q),
            interpreted=launchers._runs_in_interpreter(q),
        )
        launch(grid, *args)
    assert torch.equal(out, out_before) and torch.equal(lse, lse_before)
    assert torch.equal(fresh_out, torch.zeros_like(fresh_out)) and torch.isneginf(fresh_lse).all()
    assert torch.equal(nan_out, torch.zeros_like(nan_out)) and torch.isneginf(nan_lse).all()
    # The launcher's short cut does the same for an empty first block.
    nan_out.fill_(float("nan")), nan_lse.fill_(float("nan"))
    launchers.attention_step_forward(
        q, empty, empty, nan_out, nan_lse, softmax_scale=0.125, mask_mode=MASK_FULL, first_step=True
    )
    assert torch.equal(nan_out, torch.zeros_like(nan_out)) and torch.isneginf(nan_lse).all()


@runs_triton_on(DEVICE)
def test_backward_rows_with_neg_inf_lse_get_zero_gradient():
    torch.manual_seed(6)
    b, sq, h, hk, d = 1, 17, 2, 1, 64
    q, k, v = cases.randn(b, sq, h, d), cases.randn(b, sq, hk, d), cases.randn(b, sq, hk, d)
    scale = d**-0.5
    out, lse = cases.fresh_state(b, sq, h, d)
    launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=MASK_CAUSAL)
    dout = cases.randn(b, sq, h, d)
    rows = [0, 5, 16]
    lse_masked = lse.clone()
    lse_masked[:, :, rows] = float("-inf")  # as if these rows saw no key at all
    delta = launchers.attention_backward_preprocess(out, dout)
    grads = [cases.zeros(b, sq, h, d), cases.zeros(b, sq, hk, d), cases.zeros(b, sq, hk, d)]
    launchers.attention_step_backward(
        q, k, v, out, dout, lse_masked, delta, *grads, softmax_scale=scale, mask_mode=MASK_CAUSAL
    )
    for g in grads:
        assert torch.isfinite(g).all()
    assert torch.equal(grads[0][:, rows], torch.zeros_like(grads[0][:, rows]))
    # dk/dv equal those of the same problem where the masked rows have no
    # upstream gradient at all.
    dout0, delta0 = dout.clone(), delta.clone()
    dout0[:, rows] = 0
    delta0[:, :, rows] = 0
    want = [cases.zeros(b, sq, h, d), cases.zeros(b, sq, hk, d), cases.zeros(b, sq, hk, d)]
    launchers.attention_step_backward(
        q, k, v, out, dout0, lse, delta0, *want, softmax_scale=scale, mask_mode=MASK_CAUSAL
    )
    torch.testing.assert_close(grads[1], want[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[2], want[2], atol=1e-6, rtol=0)
