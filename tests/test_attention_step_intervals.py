"""The step kernels with MASK_INTERVALS (packed documents): per-row key intervals against
the dense document mask, forward and backward, every CUDA tile in the interpreter, low
precision, v of another head dim than q and k, and no read outside the intervals' span.
"""

import pytest
import step_kernel_cases as cases
import torch
from step_kernel_cases import DEVICE, DOC_LENS, MASK_FULL, MASK_INTERVALS
from triton_interpreter import runs_triton_on

from seqpar_kernels.kernels import attention_step_launch as launchers
from seqpar_kernels.kernels import attention_step_tiles as step_tiles


@runs_triton_on(DEVICE)
@pytest.mark.parametrize(
    "h, hk, d, causal, layout",
    [
        (4, 2, 64, True, "ring"),  # GQA; a q tile whose rows see no key; an all-empty step
        (2, 2, 80, False, "ring"),  # padded head dim
        (3, 1, 64, True, "subsets"),  # MQA, seqlen_q != seqlen_k
        (4, 2, 80, False, "subsets"),
    ],
)
def test_intervals_match_the_dense_document_mask(h, hk, d, causal, layout):
    cases.check_intervals(h, hk, d, causal, layout, b=2, seed=20)


@runs_triton_on(DEVICE)
def test_intervals_with_value_head_dim():
    # Packed documents with v of another head dim than q and k (multi-head
    # latent attention on packed sequences), both padded: rows without a key,
    # MQA, seqlen_q != seqlen_k.
    cases.check_intervals(h=2, hk=1, d=80, causal=True, layout="subsets", b=1, seed=27, dv=48)


@runs_triton_on(DEVICE)
@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU runs the CUDA tiles in every test")
@pytest.mark.parametrize("tiles", step_tiles.all_cuda_tiles(), ids=lambda tiles: "x".join(map(str, tiles)))
def test_cuda_tiles_compute_the_intervals_in_the_interpreter(monkeypatch, tiles):
    monkeypatch.setattr(step_tiles, "_INTERPRETER_TILES", tiles)
    cases.check_intervals(h=2, hk=1, d=80, causal=True, layout="ring", b=1, seed=24)


@runs_triton_on(DEVICE)
def test_an_all_empty_interval_step_leaves_the_state_untouched():
    torch.manual_seed(21)
    b, h, hk, d = 1, 2, 1, 64
    q_pos, k_pos = torch.arange(80, 120), torch.arange(120, 160)
    intervals, keep = cases.document_intervals(q_pos, k_pos, DOC_LENS, causal=True)
    assert not keep.any()
    q, k, v = cases.randn(b, 40, h, d), cases.randn(b, 40, hk, d), cases.randn(b, 40, hk, d)
    out, lse = cases.randn(b, 40, h, d), cases.randn(b, h, 40)
    out0, lse0 = out.clone(), lse.clone()
    launchers.attention_step_forward(
        q, k, v, out, lse, softmax_scale=0.125, mask_mode=MASK_INTERVALS, intervals=intervals
    )
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    dq, dk, dv = cases.randn(b, 40, h, d), cases.randn(b, 40, hk, d), cases.randn(b, 40, hk, d)
    grads0 = [g.clone() for g in (dq, dk, dv)]
    launchers.attention_step_backward(
        q,
        k,
        v,
        out,
        cases.randn(b, 40, h, d),
        lse,
        None,
        dq,
        dk,
        dv,
        softmax_scale=0.125,
        mask_mode=MASK_INTERVALS,
        intervals=intervals,
    )
    for got, want in zip((dq, dk, dv), grads0):
        assert torch.equal(got, want)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_intervals_low_precision(dtype):
    # The tolerances of the other low-precision tests: the forward within twice
    # plain PyTorch attention's error in dtype, the gradients within 3% of their
    # largest entry.
    torch.manual_seed(22)
    b, h, hk, d = 1, 4, 2, 64
    q_pos, k_pos = torch.arange(80, 120), torch.arange(40, 120)
    intervals, keep = cases.document_intervals(q_pos, k_pos, DOC_LENS, causal=True)
    q, dout = cases.randn(b, 40, h, d, dtype=dtype), cases.randn(b, 40, h, d, dtype=dtype)
    k, v = cases.randn(b, 80, hk, d, dtype=dtype), cases.randn(b, 80, hk, d, dtype=dtype)
    scale = d**-0.5
    _, (out, lse), dq, [(dk, dv)] = cases.interval_steps(q, dout, [(k, v, intervals)], scale)
    cases.assert_low_precision_accuracy(q, k, v, scale, keep, out, lse, dout, (dq, dk, dv))


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("garbage", ["kv", "q"], ids=["nan-in-unseen-keys", "nan-in-unseen-queries"])
def test_intervals_read_no_rows_outside_their_span(causal, garbage):
    # Documents of 140, 10, 10, 140 and 100 positions.  The queries: positions
    # 140-179, the keys: 100-159 and 300-367.  Only documents 1 and 2 have both:
    # query rows 0-19 see key rows 40-59, all inside one 32-key tile; rows 20-39
    # (document 3) see no key, nor do key rows 0-39 (document 0) and 60-127
    # (document 4) have a query.  NaN in those K/V rows ("kv") or q/dout rows
    # ("q") must change nothing the tiles sweeping the documents compute: the
    # forward and dq skip the k tiles outside a q tile's span and mask the keys
    # past it, dk/dv do the same with q tiles.
    torch.manual_seed(23)
    b, h, hk, d = 1, 2, 1, 64
    doc_lens = [140, 10, 10, 140, 100]
    q_pos, k_pos = torch.arange(140, 180), torch.cat([torch.arange(100, 160), torch.arange(300, 368)])
    intervals, keep = cases.document_intervals(q_pos, k_pos, doc_lens, causal)
    seen_rows, seen_keys = keep.any(dim=1).cpu(), keep.any(dim=0).cpu()
    assert torch.equal(seen_rows.nonzero().flatten(), torch.arange(20))
    assert torch.equal(seen_keys.nonzero().flatten(), torch.arange(40, 60))
    q, dout = cases.randn(b, 40, h, d), cases.randn(b, 40, h, d)
    k, v = cases.randn(b, 128, hk, d), cases.randn(b, 128, hk, d)
    scale = d**-0.5

    def run(fill):
        q_, dout_, k_, v_ = (t.clone() for t in (q, dout, k, v))
        if garbage == "kv":
            k_[:, ~seen_keys], v_[:, ~seen_keys] = fill, fill
        else:
            q_[:, ~seen_rows], dout_[:, ~seen_rows] = fill, fill
        _, (out, lse), dq, [(dk, dv)] = cases.interval_steps(q_, dout_, [(k_, v_, intervals)], scale)
        return out, lse, dq, dk, dv

    with_nan, with_zero = run(float("nan")), run(0.0)
    # Everything but the gradients of the garbage rows themselves, which may be
    # 0 * NaN where they share a tile with rows that see something: a query that
    # sees no key (its dq), a key no query sees (its dk).
    names = ("out", "lse", "dq", "dk", "dv")
    checked = {"out": slice(None), "lse": slice(None), "dq": slice(None), "dk": slice(None), "dv": slice(None)}
    if garbage == "q":
        checked["dq"] = seen_rows
    else:
        checked["dk"] = seen_keys
    for name, got, want in zip(names, with_nan, with_zero):
        index = (slice(None), slice(None), checked[name]) if name == "lse" else (slice(None), checked[name])
        assert torch.equal(got[index], want[index]), name  # NaN would differ from itself
        if name != "lse":  # whose rows without a key hold -inf
            assert torch.isfinite(got[index]).all(), name
    # And the result is the attention of the documents.
    ref_out, ref_lse = cases.reference_attention(q, k, v, scale, keep)
    torch.testing.assert_close(with_nan[0].double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(with_nan[1].double(), ref_lse, atol=2e-5, rtol=0)


def test_intervals_go_with_mask_intervals_only():
    q, k = torch.zeros(1, 6, 2, 16), torch.zeros(1, 5, 1, 16)
    out, lse = torch.zeros(1, 6, 2, 16), torch.zeros(1, 2, 6)
    intervals = (
        torch.zeros(6, dtype=torch.int32),
        torch.ones(6, dtype=torch.int32),
        torch.zeros(5, dtype=torch.int32),
        torch.ones(5, dtype=torch.int32),
    )
    step = lambda mode, iv: launchers.attention_step_forward(  # noqa: E731
        q, k, k, out, lse, softmax_scale=1.0, mask_mode=mode, intervals=iv
    )
    with pytest.raises(AssertionError, match="intervals="):
        step(MASK_INTERVALS, None)
    with pytest.raises(AssertionError, match="intervals="):
        step(MASK_FULL, intervals)
    with pytest.raises(AssertionError, match="row_end must be a contiguous int32 \\(6,\\)"):
        step(MASK_INTERVALS, (intervals[0], intervals[1].long(), *intervals[2:]))
    with pytest.raises(AssertionError, match="col_start must be a contiguous int32 \\(5,\\)"):
        step(MASK_INTERVALS, (*intervals[:2], torch.zeros(6, dtype=torch.int32), intervals[3]))
    with pytest.raises(AssertionError, match="intervals="):
        launchers.attention_step_backward(
            q, k, k, out, out, lse, None, out, k, k, softmax_scale=1.0, mask_mode=MASK_INTERVALS
        )
    # The interval mask splits its sweeps where the full and causal ones do.
    launch = step_tiles.forward_launch(torch.float32, 64, False, intervals=True, target=None, interpreted=True)
    assert launch.constexprs["INTERVALS"] and launch.constexprs["SPLIT_SWEEP"] is step_tiles.SPLIT_FORWARD_SWEEP


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["no-cap", "softcap"])
def test_sliding_windows_with_and_without_the_split_sweeps(monkeypatch, softcap):
    # Sliding windows over a block as one interval per row.  With the split
    # sweeps, the k tiles every row of a q tile sees go through an unmasked
    # sweep between two masked ones in the forward and dq: a window of 100 keys
    # leaves two whole 32-key tiles of the interpreter per 16-row q tile there.
    # Split and one masked sweep give the same numbers to the last bit in the
    # interpreter (the same products in the same order; a mask that keeps
    # every score changes none), and match fp64: fp32 and bf16.  Queries at
    # positions 96-159, keys 0-159.
    torch.manual_seed(26)
    b, h, hk, d, scale = 1, 2, 1, 64, 0.125
    q_pos, k_pos = torch.arange(96, 160), torch.arange(160)
    # A causal window without the cap, a two-sided one with it.
    left, right = (100, 0) if not softcap else (60, 50)
    keep = cases.window_keep(q_pos, k_pos, left, right)
    intervals = cases.intervals_of(keep)
    for dtype in (torch.float32, torch.bfloat16):
        q, dout = cases.randn(b, 64, h, d, dtype=dtype, scale=3.0), cases.randn(b, 64, h, d, dtype=dtype)
        k, v = cases.randn(b, 160, hk, d, dtype=dtype), cases.randn(b, 160, hk, d, dtype=dtype)
        results = {}
        for split_sweep in (True, False):
            monkeypatch.setattr(step_tiles, "SPLIT_FORWARD_SWEEP", split_sweep)
            monkeypatch.setattr(step_tiles, "SPLIT_BACKWARD_SWEEPS", split_sweep)
            _, (out, lse), dq, [(dk, dv)] = cases.interval_steps(q, dout, [(k, v, intervals)], scale, softcap)
            results[split_sweep] = (out, lse, dq, dk, dv)
        for split, one in zip(results[True], results[False]):
            assert torch.equal(split, one)
        out, lse, dq, dk, dv = results[True]
        if dtype == torch.bfloat16:
            cases.assert_low_precision_accuracy(q, k, v, scale, keep, out, lse, dout, (dq, dk, dv), softcap)
            continue
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ref_out, ref_lse = cases.reference_attention(qr, kr, vr, scale, keep, softcap)
        ref_out.backward(dout.double())
        torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=2e-5, rtol=0)
        for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)
