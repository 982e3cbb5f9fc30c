"""seqpar::attention_merge_ (csrc/cpu/attention_merge.cpp, csrc/cuda/attention_merge.cu)
against a plain-torch fp64 reference: values, strides, dtypes, -inf rows, large logits,
a merge over several steps equal to attention over all blocks, opcheck. The CUDA kernel
is compared with the reference (and the CPU kernel) when a GPU is present."""

from __future__ import annotations

import math

import pytest
import torch

import seqpar_kernels  # noqa: F401  (loads the ops)
from seqpar_kernels.ops import attention_merge_

NEG_INF = float("-inf")
HAS_CUDA = torch.cuda.is_available() and seqpar_kernels.extension.build_info()["cuda"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU and a CUDA build"))]


def reference_merge(out, lse, block_out, block_lse):
    """The merge in fp64 with the kernels' conventions: block_lse == -inf leaves the row
    alone; lse == -inf takes block_out whatever out held."""
    out, lse, block_out, block_lse = (t.double() for t in (out, lse, block_out, block_lse))
    new_lse = torch.logaddexp(lse, block_lse)
    skip = block_lse == NEG_INF
    fresh = (lse == NEG_INF) & ~skip
    w_old = torch.where(fresh | skip, 0.0, torch.exp(lse - new_lse)).transpose(1, 2)[..., None]
    w_block = torch.where(skip, 0.0, torch.exp(block_lse - new_lse)).transpose(1, 2)[..., None]
    old = torch.where(fresh.transpose(1, 2)[..., None], 0.0, out)
    merged = old * w_old + torch.where(skip.transpose(1, 2)[..., None], 0.0, block_out) * w_block
    merged = torch.where(skip.transpose(1, 2)[..., None], out, merged)
    return merged, torch.where(skip, lse, new_lse)


def make_case(shape, block_dtype, device, seed=0, layout="contiguous"):
    """Random (out, lse, block_out, block_lse) of logical shapes (B, S, H, D) and (B, H, S).
    layout "strided": out is a narrow of a wider tensor, lse has (B, S, H) memory, and
    block_out/block_lse are aten CPU flash's (B, H, S, D)/(B, S, H) memory, transposed."""
    gen = torch.Generator().manual_seed(seed)
    batch, seqlen, heads, dim = shape
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    if layout == "contiguous":
        out = rand(batch, seqlen, heads, dim)
        lse = rand(batch, heads, seqlen)
        block_out = rand(batch, seqlen, heads, dim).to(block_dtype)
        block_lse = rand(batch, heads, seqlen)
    else:
        out = rand(batch, seqlen, heads, dim + 3)[..., 1 : dim + 1]
        lse = rand(batch, seqlen, heads).transpose(1, 2)
        block_out = rand(batch, heads, seqlen, dim).to(block_dtype).transpose(1, 2)
        block_lse = rand(batch, seqlen, heads).transpose(1, 2)
    return [t.to(device) for t in (out, lse, block_out, block_lse)]


def run_merge(out, lse, block_out, block_lse):
    out, lse = out.clone(), lse.clone()
    attention_merge_(out, lse, block_out, block_lse)
    return out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("head_dim", [64, 80, 6])
def test_merge_matches_reference(device, block_dtype, layout, head_dim):
    out, lse, block_out, block_lse = make_case((2, 7, 3, head_dim), block_dtype, device, layout=layout)
    expected_out, expected_lse = reference_merge(out.cpu(), lse.cpu(), block_out.cpu(), block_lse.cpu())
    got_out, got_lse = run_merge(out, lse, block_out, block_lse)
    torch.testing.assert_close(got_out.cpu().double(), expected_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got_lse.cpu().double(), expected_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_infinite_rows(device):
    out, lse, block_out, block_lse = make_case((1, 4, 2, 16), torch.float32, device)
    # row (s=0, h=0): running lse -inf and garbage out -> block_out exactly
    lse[0, 0, 0], out[0, 0, 0] = NEG_INF, float("nan")
    # row (s=1, h=0): block lse -inf, garbage block_out -> untouched
    block_lse[0, 0, 1], block_out[0, 1, 0] = NEG_INF, float("nan")
    # row (s=2, h=1): both -inf -> stays -inf, out untouched (zeros stay zeros)
    lse[0, 1, 2], block_lse[0, 1, 2], out[0, 2, 1] = NEG_INF, NEG_INF, 0.0
    got_out, got_lse = run_merge(out, lse, block_out, block_lse)
    assert not got_out.isnan().any() and not got_lse.isnan().any()
    assert torch.equal(got_out[0, 0, 0], block_out[0, 0, 0])
    assert got_lse[0, 0, 0] == block_lse[0, 0, 0]
    assert torch.equal(got_out[0, 1, 0], out[0, 1, 0]) and got_lse[0, 0, 1] == lse[0, 0, 1]
    assert got_lse[0, 1, 2] == NEG_INF and torch.equal(got_out[0, 2, 1], torch.zeros(16, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_merge_large_logits_do_not_overflow(device):
    out, lse, block_out, block_lse = make_case((2, 5, 2, 32), torch.float32, device, seed=3)
    lse = lse * 30 + 4000.0  # exp(lse) overflows fp32 (and fp64) many times over
    block_lse = block_lse * 30 + 4000.0
    got_out, got_lse = run_merge(out, lse, block_out, block_lse)
    assert torch.isfinite(got_out).all() and torch.isfinite(got_lse).all()
    expected_out, expected_lse = reference_merge(out.cpu(), lse.cpu(), block_out.cpu(), block_lse.cpu())
    torch.testing.assert_close(got_out.cpu().double(), expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse.cpu().double(), expected_lse, rtol=1e-6, atol=1e-3)


def block_attention(q, k, v, scale):
    """(out, lse) of q over one block, fp64: q (B, S, H, D), k/v (B, T, H, D)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v), scores.logsumexp(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_dtype", [torch.float32, torch.bfloat16])
def test_merge_over_steps_equals_attention_over_all_blocks(device, block_dtype):
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 6, 3, 32, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k.repeat(1, 3, 1, 1) * torch.linspace(0.5, 2, 18)[None, :, None, None], v.repeat(1, 3, 1, 1)
    scale = 32**-0.5
    expected_out, expected_lse = block_attention(q, k, v, scale)
    out = torch.empty(2, 6, 3, 32, device=device).fill_(float("nan"))  # never read
    lse = torch.full((2, 3, 6), NEG_INF, device=device)
    for start in (12, 0, 6):  # three blocks, out of order
        block_out, block_lse = block_attention(q, k[:, start : start + 6], v[:, start : start + 6], scale)
        attention_merge_(out, lse, block_out.to(block_dtype).to(device), block_lse.float().to(device))
    tol = 2e-6 if block_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().double(), expected_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu().double(), expected_lse, rtol=2e-6, atol=2e-6)


def test_merge_rejects_bad_arguments():
    out, lse, block_out, block_lse = make_case((1, 3, 2, 8), torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="float32"):
        attention_merge_(out.double(), lse, block_out, block_lse)
    with pytest.raises(RuntimeError, match="block_out"):
        attention_merge_(out, lse, block_out[:, :2], block_lse)
    with pytest.raises(RuntimeError, match="lse"):
        attention_merge_(out, lse.transpose(1, 2), block_out, block_lse)
    with pytest.raises(RuntimeError, match="block_out"):
        attention_merge_(out, lse, block_out.to(torch.int32), block_lse)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_opcheck(device):
    for layout, block_dtype in (("contiguous", torch.float32), ("strided", torch.bfloat16)):
        args = make_case((2, 3, 2, 16), block_dtype, device, layout=layout)
        torch.library.opcheck(torch.ops.seqpar.attention_merge_.default, args)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU and a CUDA build")
def test_cuda_kernel_matches_cpu_kernel():
    # Where the merge copies (running lse -inf: out = block_out) or leaves a row alone
    # (block lse -inf), the kernels agree bit for bit. Elsewhere they compute the same
    # formula with different expf/log1pf (CUDA's, the host's libm) and nvcc fuses
    # multiply-adds, so they agree to fp32 rounding, not bit for bit.
    for seed, (shape, layout) in enumerate(
        [((2, 33, 5, 128), "contiguous"), ((1, 65, 3, 80), "strided"), ((3, 9, 4, 6), "strided")]
    ):
        for block_dtype in (torch.float32, torch.float16, torch.bfloat16):
            cpu_args = make_case(shape, block_dtype, "cpu", seed=seed, layout=layout)
            cpu_args[1][0, 0, :3] = NEG_INF
            cpu_args[3][0, 1, :3] = NEG_INF
            cuda_args = [t.cuda() for t in cpu_args]
            cpu_out, cpu_lse = run_merge(*cpu_args)
            cuda_out, cuda_lse = run_merge(*cuda_args)
            copied, untouched = (0, slice(0, 3), 0), (0, slice(0, 3), 1)  # (batch, rows, head) of out
            for rows in (copied, untouched):
                assert torch.equal(cuda_out[rows].cpu(), cpu_out[rows])
                assert torch.equal(cuda_lse[rows[0], rows[2], rows[1]].cpu(), cpu_lse[rows[0], rows[2], rows[1]])
            torch.testing.assert_close(cuda_out.cpu(), cpu_out, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(cuda_lse.cpu(), cpu_lse, rtol=1e-6, atol=1e-6)


def test_merge_is_math():
    # The documented formula on one row, by hand.
    out = torch.tensor([[[[1.0, 2.0]]]])
    lse = torch.tensor([[[math.log(3.0)]]])
    block_out = torch.tensor([[[[5.0, -1.0]]]])
    block_lse = torch.tensor([[[math.log(1.0)]]])
    attention_merge_(out, lse, block_out, block_lse)
    torch.testing.assert_close(out, torch.tensor([[[[(3 * 1 + 5) / 4, (3 * 2 - 1) / 4]]]]))
    torch.testing.assert_close(lse, torch.tensor([[[math.log(4.0)]]]))
