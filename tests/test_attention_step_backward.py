"""The step kernels' backward (seqpar_kernels/kernels/attention_step_*.py): delta, dq and
dk/dv over several ring steps against autograd of the fp64 reference, the two kernels
launched apart, the dk/dv split of a GQA group's q heads, v of another head dim than q
and k, and every CUDA tile, sweep and load path run in the interpreter.
"""

import pytest
import step_kernel_cases as cases
import torch
from step_kernel_cases import DEVICE, DOC_LENS, MASK_CAUSAL, MASK_FULL, MASK_INTERVALS
from triton_interpreter import runs_triton_on

from seqpar_kernels.kernels import attention_step_launch as launchers
from seqpar_kernels.kernels import attention_step_tiles as step_tiles


def test_backward_preprocess():
    torch.manual_seed(7)
    out = cases.randn(2, 3, 17, 80).transpose(1, 2)  # (b, sq, h, d), non-contiguous
    dout = cases.randn(2, 17, 3, 80, dtype=torch.bfloat16)
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
    cases.check_steps_forward_and_backward(h, hk, d, full_lens, b=2, sq=17)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize(
    "h, hk, d, dv, full_lens",
    [
        (2, 1, 192, 128, [9]),  # multi-head latent attention's 128 nope + 64 rope dims, v 128
        (2, 1, 64, 80, [17]),  # v wider than q and k, and padded (BLOCK_DV 128)
        (2, 2, 80, 64, [17]),  # q and k padded, v not
    ],
)
def test_value_head_dim_multi_step_matches_autograd(h, hk, d, dv, full_lens):
    # v (and out, dout, dv) of another head dim than q and k: q.k over d columns,
    # p.v and dout.v^T over dv, delta over dv.
    torch.manual_seed(19)
    cases.check_steps_forward_and_backward(h, hk, d, full_lens, b=1, sq=17, dv=dv)


@runs_triton_on(DEVICE)
def test_value_head_dim_low_precision():
    # bf16 at multi-head latent attention's head dims, by the 2x rule.
    torch.manual_seed(20)
    cases.check_low_precision_step(MASK_CAUSAL, sq=20, sk=20, d=192, dv=128)


@runs_triton_on(DEVICE)
@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU runs the CUDA tiles in every test")
@pytest.mark.parametrize("tiles", step_tiles.all_cuda_tiles(), ids=lambda tiles: "x".join(map(str, tiles)))
def test_cuda_tiles_compute_the_same_in_the_interpreter(monkeypatch, tiles):
    # The CUDA tile shapes, run by the interpreter: q and k lengths that leave
    # partial tiles at both ends of the sweep, and (for the small tiles) several.
    monkeypatch.setattr(step_tiles, "_INTERPRETER_TILES", tiles)
    torch.manual_seed(10)
    cases.check_steps_forward_and_backward(h=2, hk=1, d=80, full_lens=[150], b=1, sq=70)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("split_sweep", cases.sweep_forms())
def test_steps_with_and_without_the_split_sweeps(monkeypatch, split_sweep):
    # Triton 3.8+ compiles the forward, dq and dk/dv kernels with their unmasked
    # sweeps split off, older Triton with one masked sweep each
    # (SPLIT_FORWARD_SWEEP, SPLIT_BACKWARD_SWEEPS): both must be exact.
    # 45 rows in 16-row q tiles and 32-key tiles: the causal diagonal has a whole
    # tile every row of the last q tile sees, the 70-key block two and a partial one.
    monkeypatch.setattr(step_tiles, "SPLIT_FORWARD_SWEEP", split_sweep)
    monkeypatch.setattr(step_tiles, "SPLIT_BACKWARD_SWEEPS", split_sweep)
    assert (
        step_tiles.forward_launch(torch.float32, 64, True, target=None, interpreted=True).constexprs["SPLIT_SWEEP"]
        is split_sweep
    )
    for launch in step_tiles.backward_launches(torch.bfloat16, 64, True, target=None, interpreted=True):
        assert launch.constexprs["SPLIT_SWEEP"] is split_sweep
    # fp32 dk/dv sweeps once whatever the release (attention_step_tiles.backward_launches).
    assert not step_tiles.backward_launches(torch.float32, 64, True, target=None, interpreted=True)[1].constexprs[
        "SPLIT_SWEEP"
    ]
    torch.manual_seed(12)
    cases.check_steps_forward_and_backward(h=4, hk=2, d=64, full_lens=[9, 70], b=1, sq=45)
    # bf16, whose dk/dv splits too: a causal diagonal of 45 rows and a full block
    # of 70 keys, partial tiles at both ends.
    cases.check_low_precision_step(MASK_CAUSAL, sq=45, sk=45)
    cases.check_low_precision_step(MASK_FULL, sq=45, sk=70)


@runs_triton_on(DEVICE)
@pytest.mark.skipif(not step_tiles.TENSOR_DESCRIPTORS_AVAILABLE, reason="this Triton has no tl.make_tensor_descriptor")
@pytest.mark.parametrize("case", ["steps", "intervals", "bf16", "value-dim"])
def test_tensor_descriptor_loads(monkeypatch, case):
    # The loads through tensor descriptors (TMA on sm_90), run by the
    # interpreter: rows past the block and head-dim columns past 80 come in as
    # 0 from the descriptors' bounds instead of masks; with the intervals, the
    # descriptors end at the hull of the tile's intervals; with v of another
    # head dim, v's and dout's descriptors are of its width.
    monkeypatch.setattr(step_tiles, "_INTERPRETER_TENSOR_DESCRIPTORS", True)
    if DEVICE == "cpu":
        q = torch.zeros(1, 8, 2, 80)
        assert launchers._forward_call(q, q, q, q, q, 1.0, False, None, target=None, interpreted=True)[0].constexprs[
            "TENSOR_DESCRIPTORS"
        ]
        # A layout TMA cannot take (a head-dim stride of 2) falls back to pointer loads.
        strided = torch.zeros(1, 8, 2, 160)[..., ::2]
        assert not launchers._forward_call(strided, q, q, q, q, 1.0, False, None, target=None, interpreted=True)[
            0
        ].constexprs["TENSOR_DESCRIPTORS"]
        # So does a v of another head dim in such a layout.
        wide_v = torch.zeros(1, 8, 2, 96)
        assert launchers._forward_call(q, q, wide_v, wide_v, q, 1.0, False, None, target=None, interpreted=True)[
            0
        ].constexprs["TENSOR_DESCRIPTORS"]
        strided_v = wide_v[..., ::2]
        assert not launchers._forward_call(
            q, q, strided_v, strided_v, q, 1.0, False, None, target=None, interpreted=True
        )[0].constexprs["TENSOR_DESCRIPTORS"]
    if case == "steps":
        torch.manual_seed(16)
        cases.check_steps_forward_and_backward(h=4, hk=2, d=80, full_lens=[9, 70], b=1, sq=45)
    elif case == "intervals":
        cases.check_intervals(h=2, hk=1, d=80, causal=True, layout="ring", b=1, seed=25)
    elif case == "bf16":
        torch.manual_seed(17)
        cases.check_low_precision_step(MASK_CAUSAL, sq=33, sk=33)
    else:
        torch.manual_seed(18)
        cases.check_steps_forward_and_backward(h=2, hk=1, d=64, full_lens=[40], b=1, sq=20, dv=80)


@runs_triton_on(DEVICE)
def test_backward_bf16_single_causal_step():
    # Low-precision inputs (P and dS are rounded to bf16 before the products,
    # as in flash-attention): check against the fp64 reference loosely.
    torch.manual_seed(9)
    b, sq, h, hk, d = 1, 17, 4, 2, 64
    q, k, v = (cases.randn(b, sq, n, d, dtype=torch.bfloat16) for n in (h, hk, hk))
    scale = d**-0.5
    out, lse = cases.fresh_state(b, sq, h, d)
    launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=MASK_CAUSAL)
    dout = cases.randn(b, sq, h, d, dtype=torch.bfloat16)
    dq, dk, dv = cases.zeros(b, sq, h, d), cases.zeros(b, sq, hk, d), cases.zeros(b, sq, hk, d)
    launchers.attention_step_backward(
        q, k, v, out, dout, lse, None, dq, dk, dv, softmax_scale=scale, mask_mode=MASK_CAUSAL
    )
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, _ = cases.reference_attention(qr, kr, vr, scale, cases.causal_keep(sq, sq))
    ref_out.backward(dout.double())
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= 3e-2 * want.abs().max().item(), err


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("mode", [MASK_FULL, MASK_CAUSAL, MASK_INTERVALS], ids=["full", "causal", "intervals"])
def test_backward_dq_and_dkdv_launch_separately(monkeypatch, mode):
    # The two halves of attention_step_backward, run one at a time and in the
    # other order, add exactly what it adds, each only to its own gradients
    # (which start non-zero: the launchers accumulate).  Deterministic
    # algorithms asked for: no split of the dk/dv grid, whose atomics would add
    # in any order on a GPU.
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    torch.manual_seed(13)
    b, sq, h, hk, d = 2, 40, 4, 2, 64
    q, dout = cases.randn(b, sq, h, d), cases.randn(b, sq, h, d)
    k, v = cases.randn(b, sq, hk, d), cases.randn(b, sq, hk, d)
    intervals = None
    if mode == MASK_INTERVALS:
        intervals, _ = cases.document_intervals(torch.arange(80, 120), torch.arange(40, 80) + 40, DOC_LENS, causal=True)
    out, lse = cases.fresh_state(b, sq, h, d)
    launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=0.125, mask_mode=mode, intervals=intervals)
    delta = launchers.attention_backward_preprocess(out, dout)
    grads0 = [cases.randn(b, sq, h, d), cases.randn(b, sq, hk, d), cases.randn(b, sq, hk, d)]
    both = [g.clone() for g in grads0]
    launchers.attention_step_backward(
        q, k, v, out, dout, lse, delta, *both, softmax_scale=0.125, mask_mode=mode, intervals=intervals
    )
    dq, dk, dv = (g.clone() for g in grads0)
    assert launchers.attention_step_backward_dkdv(
        q, k, v, dout, lse, delta, dk, dv, softmax_scale=0.125, mask_mode=mode, intervals=intervals
    ) == (dk, dv)
    assert torch.equal(dq, grads0[0]) and torch.equal(dk, both[1]) and torch.equal(dv, both[2])
    assert (
        launchers.attention_step_backward_dq(
            q, k, v, dout, lse, delta, dq, softmax_scale=0.125, mask_mode=mode, intervals=intervals
        )
        is dq
    )
    assert torch.equal(dq, both[0]) and torch.equal(dk, both[1]) and torch.equal(dv, both[2])
    assert not torch.equal(dq, grads0[0]) and not torch.equal(dk, grads0[1])


def test_dkdv_head_splits_fill_the_gpu():
    splits = step_tiles.dkdv_head_splits
    # MQA, 4096 keys in 64-key tiles, batch 1, 32 q heads, 132 SMs: 64 programs
    # become 128 of 16 heads each; 3 splits (192 programs, 2 waves) would be slower.
    assert splits(64, 32, 132) == 2
    assert splits(32, 32, 132) == 4  # 128-key tiles: 32 programs of 8 heads
    assert splits(132, 32, 132) == 1 and splits(64, 1, 132) == 1  # a full grid; MHA
    assert splits(1, 3, 4) == 3


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("mode", [MASK_FULL, MASK_CAUSAL, MASK_INTERVALS], ids=["full", "causal", "intervals"])
def test_dkdv_with_the_group_heads_split(monkeypatch, mode):
    # SPLIT_HEADS: programs that share a k tile each sweep a part of the
    # group's q heads and add with atomics.  The same dk/dv as one program per
    # k tile, to fp32 rounding; asking torch for deterministic algorithms
    # keeps one program per k tile.
    torch.manual_seed(18)
    b, sq, h, hk, d = 1, 40, 5, 1, 64
    q, dout = cases.randn(b, sq, h, d), cases.randn(b, sq, h, d)
    k, v = cases.randn(b, sq, hk, d), cases.randn(b, sq, hk, d)
    intervals = None
    if mode == MASK_INTERVALS:
        intervals, _ = cases.document_intervals(torch.arange(80, 120), torch.arange(80, 120), DOC_LENS, causal=True)
    out, lse = cases.fresh_state(b, sq, h, d)
    launchers.attention_step_forward(q, k, v, out, lse, softmax_scale=0.125, mask_mode=mode, intervals=intervals)
    delta = launchers.attention_backward_preprocess(out, dout)
    target = step_tiles.cuda_target(q)
    results = {}
    for split in (False, True):
        dk, dv = cases.randn(b, sq, hk, d), cases.randn(b, sq, hk, d)
        start = (dk.clone(), dv.clone())
        launch, grid, args = launchers._backward_call(
            "dkdv",
            q,
            k,
            v,
            dout,
            lse,
            delta,
            (dk, dv),
            0.125,
            mode == MASK_CAUSAL,
            intervals,
            split_heads=split,
            target=target,
            interpreted=launchers._runs_in_interpreter(q),
        )
        assert launch.constexprs["SPLIT_HEADS"] is split and (grid[1] > hk) is split
        launch(grid, *args)
        results[split] = (dk - start[0], dv - start[1])
    for unsplit, split in zip(results[False], results[True]):
        torch.testing.assert_close(split, unsplit, atol=1e-6, rtol=1e-6)
    # The launcher splits a grid smaller than the GPU (the interpreter's stand-in
    # for one has 4 SMs), unless torch is asked for deterministic algorithms.
    monkeypatch.setattr(step_tiles, "_INTERPRETER_MULTIPROCESSORS", 4)
    if target is None:
        for deterministic in (False, True):
            monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: deterministic)
            launch, grid, _ = launchers._backward_call(
                "dkdv", q, k, v, dout, lse, delta, (dk, dv), 0.125, False, None, target=None, interpreted=True
            )
            assert launch.constexprs["SPLIT_HEADS"] is not deterministic


@pytest.mark.skipif(
    DEVICE != "cuda",
    reason="the GPU tiles; without a GPU the interpreter runs them "
    "in test_cuda_tiles_compute_the_same_in_the_interpreter",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("split_sweep", cases.sweep_forms())
def test_gpu_tiles_over_several_whole_tiles(monkeypatch, dtype, d, split_sweep):
    # The other tests use at most 40 keys: with the GPU tiles (up to 128 x 128) every k
    # tile there is partial, so the forward's unmasked sweep and the loops over several
    # tiles would run first in the benchmark.  A causal diagonal block of 333 rows and
    # full blocks of 700 and 260 keys, forward and backward, against fp64 autograd, with
    # at most twice the error of plain PyTorch attention in dtype (plus about one ulp).
    # Both forms of the sweeps (SPLIT_FORWARD_SWEEP, SPLIT_BACKWARD_SWEEPS) compile and run.
    monkeypatch.setattr(step_tiles, "SPLIT_FORWARD_SWEEP", split_sweep)
    monkeypatch.setattr(step_tiles, "SPLIT_BACKWARD_SWEEPS", split_sweep)
    torch.manual_seed(11)
    b, sq, h, hk = 1, 333, 4, 2
    full_lens = [700, 260]
    steps, k_all, v_all, keep = cases.ring_blocks(b, sq, hk, d, full_lens, dtype=dtype)
    q = cases.randn(b, sq, h, d, dtype=dtype)
    dout = cases.randn(b, sq, h, d, dtype=dtype)
    scale = d**-0.5
    dq = cases.zeros(b, sq, h, d)
    out, lse, dk_all, dv_all = cases.run_steps(q, steps, k_all, full_lens, dout, dq, scale)

    qr, kr, vr = (t.double().requires_grad_() for t in (q, k_all, v_all))
    exact, exact_lse = cases.reference_attention(qr, kr, vr, scale, keep)
    exact.backward(dout.double())
    qp, kp, vp = (t.detach().clone().requires_grad_() for t in (q, k_all, v_all))
    plain = cases.torch_attention_in_dtype(qp, kp, vp, scale, keep)
    plain.backward(dout)
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-3 if dtype != torch.float32 else 2e-5, rtol=0)
    cases.assert_within_twice_plain_torch(
        dtype, (out, dq, dk_all, dv_all), (plain, qp.grad, kp.grad, vp.grad), (exact, qr.grad, kr.grad, vr.grad)
    )
