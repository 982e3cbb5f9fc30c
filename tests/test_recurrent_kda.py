"""kimi_delta_attention and lightning_attention (seqpar_kernels/parallel/gated_delta.py):
Kimi's delta attention (a decay per key channel) and MiniMax's lightning attention (no
delta, a constant decay per head), sequence-parallel. The one-process engine against
transformers' recurrent_kimi_delta_attention (run in fp64; the per-channel sequential
pass's backward by gradcheck is in tests/test_recurrent_gated_delta.py), and both ops
against their recurrences written out token by token on the whole sequence (per
document for packed ones), forward and every gradient, every layout, world sizes 1-3;
fp32 within twice plain PyTorch's error; bad inputs on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import pool_for
from on_ranks import on_every_rank, raises, timeout_group
from recurrent_cases import check_against_reference
from test_recurrent_gated_delta import Float64, engine_runner

import seqpar_kernels as sp
from seqpar_kernels.engine.gated_delta import chunk_gated_delta_rule


def kda_recurrence(q, k, v, g, beta, scale=None, use_qk_l2norm=False, initial_state=None, dtype=torch.float64):
    """Kimi's delta attention token by token in `dtype` (q, k (B, S, H, dk), v (B, S, H,
    dv), g (B, S, H, dk), beta (B, S, H)): the output (B, S, H, dv) and the final state."""
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    batch, length, heads, key_dim = q.shape
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    out = []
    for t in range(length):
        state = state * g[:, t].exp().unsqueeze(-1)
        k_t, beta_t = k[:, t].unsqueeze(-1), beta[:, t, :, None, None]
        state = state + beta_t * k_t @ (v[:, t].unsqueeze(-2) - k_t.transpose(-1, -2) @ state)
        out.append((state * q[:, t].unsqueeze(-1)).sum(-2))
    return torch.stack(out, 1), state


def lightning_recurrence(q, k, v, slope, scale=1.0, dtype=torch.float64):
    """Lightning attention token by token in `dtype`: S_t = exp(-slope) S_{t-1} + k_t v_t^T,
    o_t = S_t^T (scale q_t); q, k, v (B, S, H, d), slope (H,). The output (B, S, H, dv)."""
    q, k, v, slope = (x.to(dtype) for x in (q, k, v, slope))
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[1]):
        state = torch.exp(-slope)[:, None, None] * state + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        out.append((state * (scale * q[:, t]).unsqueeze(-1)).sum(-2))
    return torch.stack(out, 1)


def kda_inputs(batch, length, heads, key_dim, value_dim, *, generator, dtype=torch.float64):
    """q, k, v, g (per-channel log decays in (-1, 0)), beta (in (0, 1))."""
    q, k = (torch.randn(batch, length, heads, key_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, length, heads, value_dim, generator=generator, dtype=torch.float64)
    g = -torch.rand(batch, length, heads, key_dim, generator=generator, dtype=torch.float64)
    beta = torch.rand(batch, length, heads, generator=generator, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def lightning_inputs(batch, length, heads, dim, *, generator, dtype=torch.float64):
    """q, k, v (MiniMax's: after a SiLU, so mostly positive), slope (H,) in (0, 1)."""
    q, k, v = (F.silu(torch.randn(batch, length, heads, dim, generator=generator, dtype=torch.float64))
               for _ in range(3))  # fmt: skip
    slope = torch.rand(heads, generator=generator, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, slope)]


def test_engine_is_transformers_kda_recurrence():
    """The engine's per-channel chunks (19 tokens: chunks of 16 and a padded one) against
    transformers' recurrent_kimi_delta_attention run in fp64: output, final state and every gradient."""
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    generator = torch.Generator().manual_seed(3)
    inputs = kda_inputs(2, 19, 3, 5, 4, generator=generator)
    outputs_and_gradients, _ = engine_runner(inputs, 3, 5, 4, generator)
    ours = outputs_and_gradients(chunk_gated_delta_rule, use_qk_l2norm=True)
    with Float64():
        theirs = outputs_and_gradients(modeling.recurrent_kimi_delta_attention, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)  # fmt: skip
    for name, mine, expected in zip(["out", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial"], ours, theirs):
        assert mine.dtype == torch.float64
        torch.testing.assert_close(mine, expected, atol=1e-10, rtol=0, msg=name)


def _fp32_tolerance(reference, inputs, sequence_inputs, generator) -> float:
    """Twice plain PyTorch's fp32 error: its recurrence run in fp32 against fp64, the
    largest over the output and every gradient (for one random output gradient), with a
    floor of a few fp32 units of the largest of them."""
    dout = None
    results = []
    for dtype in (torch.float64, torch.float32):
        leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
        out = reference(*leaves, dtype=dtype)
        if dout is None:
            dout = torch.randn(out.shape, generator=generator, dtype=torch.float64)
        out.backward(dout.to(dtype))
        results.append([out.detach().double(), *(leaf.grad.double() for leaf in leaves)])
    error = max((fp32 - exact).abs().max().item() for exact, fp32 in zip(*results))
    magnitude = max(exact.abs().max().item() for exact in results[0])
    return max(2 * error, 8 * torch.finfo(torch.float32).eps * magnitude)


@on_every_rank
def run_against_recurrence(dtype):
    """Both ops, on lengths that leave pieces uneven (and, in fp64, cross a 16-token
    chunk), against their recurrences: fp64 within 1e-10, fp32 within twice plain
    PyTorch's fp32 error."""
    failures = []
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(7)
    total = 6 * world + 5 if dtype == torch.float64 else 4 * world + 1
    kda = kda_inputs(2, total, 2, 4, 3, generator=generator, dtype=dtype)
    light = lightning_inputs(2, total, 2, 4, generator=generator, dtype=dtype)

    def kda_reference(*inputs, dtype=dtype):
        return kda_recurrence(*inputs, use_qk_l2norm=True, dtype=dtype)[0]

    cases = [
        ("kda", lambda *x, **w: sp.kimi_delta_attention(*x, use_qk_l2norm=True, **w), kda_reference, kda,
         {0, 1, 2, 3, 4}),
        ("lightning", sp.lightning_attention, lightning_recurrence, light, {0, 1, 2}),
    ]  # fmt: skip
    for name, op, reference, inputs, sequence_inputs in cases:
        atol = 1e-10 if dtype == torch.float64 else _fp32_tolerance(reference, inputs, sequence_inputs, generator)

        def expected(*x, reference=reference):
            return reference(*x).to(dtype)

        failures += [f"{name} {failure}" for failure in check_against_reference(
            op, expected, inputs, sequence_inputs, total, generator=generator, atol=atol)]  # fmt: skip
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 3], ids=lambda size: f"P{size}")
def test_matches_the_whole_sequence_recurrence(world_size):
    for rank, failures in enumerate(pool_for(world_size).run(run_against_recurrence, torch.float64)):
        assert not failures, f"rank {rank}: {failures[:6]}"


def test_fp32_within_twice_plain_pytorch():
    for rank, failures in enumerate(pool_for(2).run(run_against_recurrence, torch.float32)):
        assert not failures, f"rank {rank}: {failures[:6]}"


@on_every_rank
def run_bad_inputs():
    rank, group = dist.get_rank(), {"group": timeout_group()}
    generator = torch.Generator().manual_seed(0)
    problems = {}
    q, k, v, g, beta = kda_inputs(1, 4, 2, 4, 3, generator=generator, dtype=torch.float32)
    per_head = g[..., 0] if rank == 0 else g
    expected = r"g must be \(batch, seqlen_local, Hv, dk\)" if rank == 0 else r"bad input on rank\(s\) \[0\]"
    problems["per-head g"] = raises(lambda: sp.kimi_delta_attention(q, k, v, per_head, beta, **group), expected)
    slope = torch.rand(3 if rank == 0 else 2)
    expected = r"slope must be \(Hv,\) = \(2,\), got \(3,\)" if rank == 0 else r"bad input on rank\(s\) \[0\]"
    problems["slope heads"] = raises(lambda: sp.lightning_attention(q, k, v, slope, **group), expected)
    problems["scale"] = raises(lambda: sp.lightning_attention(q, k, v, slope[:2], scale=0.0, **group), "scale")
    return {name: problem for name, problem in problems.items() if problem}


def test_bad_inputs_raise_on_every_rank():
    for rank, problems in enumerate(pool_for(2).run(run_bad_inputs)):
        assert not problems, f"rank {rank}: {problems}"
