"""gated_delta_rule (seqpar_kernels/parallel/gated_delta.py), Gated DeltaNet's mixer,
sequence-parallel: its one-process engine against transformers' torch_chunk_gated_delta_rule
and torch_recurrent_gated_delta_rule (run in fp64), the sequential chunk pass's backward
by gradcheck, and the op against the recurrence written out token by token on the whole
sequence (per document for packed ones), forward and every gradient, every layout,
world sizes 1-4 and USP grids; bf16 within rounding; its bytes against
seqpar_kernels.traffic; bad inputs on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import pool_for
from on_ranks import on_every_rank, raises, timeout_group
from recurrent_cases import check_against_reference
from test_usp import usp_groups
from torch.overrides import TorchFunctionMode

import seqpar_kernels as sp
from seqpar_kernels import comm_stats
from seqpar_kernels.engine.gated_delta import chunk_gated_delta_rule, chunk_states
from seqpar_kernels.traffic import gated_delta_summary_bytes, state_passing_bytes


def recurrence(q, k, v, g, beta, scale=None, use_qk_l2norm=False, initial_state=None):
    """The gated delta rule token by token in fp64 (q, k (B, S, Hk, dk), v (B, S, Hv, dv),
    g, beta (B, S, Hv)): the output (B, S, Hv, dv) in q's dtype and the final state."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    group = v.shape[2] // k.shape[2]
    if use_qk_l2norm:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
    batch, length, heads, key_dim = q.shape
    state = q.new_zeros(batch, heads, key_dim, v.shape[-1]) if initial_state is None else initial_state.double()
    out = []
    for t in range(length):
        k_t, beta_t = k[:, t].unsqueeze(-1), beta[:, t, :, None, None]
        forget = g[:, t].exp()[..., None, None] * (state - beta_t * k_t @ (k_t.transpose(-1, -2) @ state))
        state = forget + beta_t * k_t @ v[:, t].unsqueeze(-2)
        out.append((state * q[:, t].unsqueeze(-1)).sum(-2))
    out = torch.stack(out, 1) if out else v.new_zeros(batch, 0, heads, v.shape[-1]).double()
    return out, state


def random_inputs(batch, length, key_heads, value_heads, key_dim, value_dim, *, generator, unit_keys=True,
                  dtype=torch.float64):  # fmt: skip
    """q, k, v, g (log decays in (-1, 0)), beta (in (0, 1)); unit keys keep the steps
    contractions when the op does not normalise them."""
    q = torch.randn(batch, length, key_heads, key_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(batch, length, key_heads, key_dim, generator=generator, dtype=torch.float64)
    if unit_keys:
        k = F.normalize(k, dim=-1)
    v = torch.randn(batch, length, value_heads, value_dim, generator=generator, dtype=torch.float64)
    g = -torch.rand(batch, length, value_heads, generator=generator, dtype=torch.float64)
    beta = torch.rand(batch, length, value_heads, generator=generator, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def engine_runner(inputs, value_heads, key_dim, value_dim, generator):
    """(run, initial): run(function, **options) -> [out, final state, every input's and the
    initial state's gradient] of function(*inputs, initial_state=initial) for a random
    initial state (batch, value_heads, key_dim, value_dim) and random gradients of the
    output and the final state (fp64)."""
    batch, length = inputs[0].shape[:2]
    initial = torch.randn(batch, value_heads, key_dim, value_dim, generator=generator, dtype=torch.float64)
    dout = torch.randn(batch, length, value_heads, value_dim, generator=generator, dtype=torch.float64)
    dfinal = torch.randn(initial.shape, generator=generator, dtype=torch.float64)

    def run(function, **options):
        leaves = [x.clone().requires_grad_() for x in (*inputs, initial)]
        out, final = function(*leaves[:-1], initial_state=leaves[-1], **options)
        torch.autograd.backward([out, final], [dout, dfinal])
        return [out.detach(), final.detach(), *(leaf.grad for leaf in leaves)]

    return run, initial


class Float64(TorchFunctionMode):
    """Runs code written for fp32 in fp64: every torch.float32 argument read as float64
    (transformers' references cast their inputs to fp32)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        swap = lambda x: torch.float64 if x is torch.float32 else x  # noqa: E731
        return func(*(swap(a) for a in args), **{key: swap(value) for key, value in (kwargs or {}).items()})


@pytest.mark.parametrize(
    "length, key_heads, value_heads, key_dim, value_dim, use_qk_l2norm",
    [(150, 2, 4, 8, 6, True), (64, 2, 2, 5, 7, False), (1, 1, 3, 4, 4, True)],
    ids=["3 chunks GQA l2norm", "1 chunk", "1 token"],
)
def test_engine_is_transformers_chunked_and_recurrent_form(length, key_heads, value_heads, key_dim, value_dim,
                                                            use_qk_l2norm):  # fmt: skip
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    generator = torch.Generator().manual_seed(3)
    inputs = random_inputs(2, length, key_heads, value_heads, key_dim, value_dim, generator=generator,
                           unit_keys=not use_qk_l2norm)  # fmt: skip
    outputs_and_gradients, initial = engine_runner(inputs, value_heads, key_dim, value_dim, generator)
    ours = outputs_and_gradients(chunk_gated_delta_rule, use_qk_l2norm=use_qk_l2norm)
    names = ["out", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
    # By name: with kernels installed, transformers 5.25 on holds them as Func modules, without __name__.
    for form in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        with Float64():
            theirs = outputs_and_gradients(getattr(modeling, form), output_final_state=True,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm)  # fmt: skip
        for name, mine, expected in zip(names, ours, theirs):
            assert mine.dtype == torch.float64
            torch.testing.assert_close(mine, expected, atol=1e-10, rtol=0, msg=f"{form}: {name}")
    # And the transcription the sharded tests use agrees.
    out, final = recurrence(*inputs, use_qk_l2norm=use_qk_l2norm, initial_state=initial)
    torch.testing.assert_close(ours[0], out, atol=1e-10, rtol=0)
    torch.testing.assert_close(ours[1], final, atol=1e-10, rtol=0)


def test_engine_output_in_the_input_dtype():
    generator = torch.Generator().manual_seed(4)
    inputs = random_inputs(1, 70, 1, 2, 4, 3, generator=generator, dtype=torch.bfloat16)
    out, final = chunk_gated_delta_rule(*inputs)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32


@pytest.mark.parametrize("decays", [(), ("key_dim",)], ids=["per head", "per key channel"])
def test_chunk_states_backward_is_the_gradient_of_its_forward(decays):
    """The sequential pass's hand-written backward, three runs (one of no chunk), by
    gradcheck; a decay per head, or per key channel (Kimi's delta attention)."""
    generator = torch.Generator().manual_seed(5)
    batch, heads, chunks, size, key_dim, value_dim = 1, 2, 4, 3, 2, 3
    w, k_decayed = (0.5 * torch.randn(batch, heads, chunks, size, key_dim, generator=generator, dtype=torch.float64)
                    for _ in range(2))  # fmt: skip
    u = torch.randn(batch, heads, chunks, size, value_dim, generator=generator, dtype=torch.float64)
    decay = torch.rand(batch, heads, chunks, *(key_dim for _ in decays), generator=generator, dtype=torch.float64)
    initial = torch.randn(3, batch, heads, key_dim, value_dim, generator=generator, dtype=torch.float64)
    leaves = [x.requires_grad_() for x in (w, u, k_decayed, decay, initial)]
    assert torch.autograd.gradcheck(lambda *xs: chunk_states(*xs, [0, 1, 1, 4], "torch"), leaves)


@on_every_rank
def run_against_recurrence(dtype, totals):
    failures = []
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(7)
    for index, total in enumerate(totals(world)):
        use_qk_l2norm, scale = index % 2 == 0, 0.7 if index == 1 else None
        inputs = random_inputs(2, total, 2, 4, 4, 3, generator=generator, unit_keys=not use_qk_l2norm, dtype=dtype)
        if dtype == torch.bfloat16:  # g in fp32 beside bf16 q, k, v, beta, as Qwen3-Next computes it
            inputs[3] = inputs[3].float()

        def op(*inputs, **where):
            return sp.gated_delta_rule(*inputs, scale=scale, use_qk_l2norm=use_qk_l2norm, **where)

        def reference(*inputs):
            return recurrence(*inputs, scale=scale, use_qk_l2norm=use_qk_l2norm)[0].to(dtype)

        # bf16: the op (fp32 inside) and the reference (fp64) round the same value, held to
        # fp32 accuracy, to bf16: equal, or a unit of the last place (2^-8 relative) apart
        # where it lies near a rounding boundary (two allowed); atol for values near 0,
        # where fp32's error on the sum's larger terms is more than a unit (measured: every
        # output and gradient equal but dg, within 4e-8).
        atol, rtol = (1e-10, 0.0) if dtype == torch.float64 else (1e-5, 2**-7)
        failures += [
            f"l2norm={use_qk_l2norm} scale={scale} {failure}"
            for failure in check_against_reference(
                op, reference, inputs, {0, 1, 2, 3, 4}, total, generator=generator, atol=atol, rtol=rtol
            )  # fmt: skip
        ]
    return failures


def _totals(world):
    """An uneven length and one that leaves a rank empty (six ranks: one length that does
    both, for the test's time), on two ranks also runs of several chunks."""
    if world == 6:
        return (world + 3,)
    return (3 * world + 2, max(world - 1, 1), *((140,) if world == 2 else ()))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6], ids=lambda size: f"P{size}")
def test_matches_the_whole_sequence_recurrence(world_size):
    for rank, failures in enumerate(pool_for(world_size).run(run_against_recurrence, torch.float64, _totals)):
        assert not failures, f"rank {rank}: {failures[:6]}"


def _bf16_totals(world):
    return (4 * world + 1,)


def test_bf16_within_rounding():
    for rank, failures in enumerate(pool_for(3).run(run_against_recurrence, torch.bfloat16, _bf16_totals)):
        assert not failures, f"rank {rank}: {failures[:6]}"


@on_every_rank
def run_bytes(grid):
    """(measured forward and backward bytes, the formula's) of one call on contiguous
    pieces of 3 rows, and of one on documents that each rank holds whole (nothing passed)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    where = usp_groups("mesh", 2) if grid else {"group": timeout_group()}
    generator = torch.Generator().manual_seed(rank)
    inputs = [x.float().requires_grad_() for x in random_inputs(2, 3, 1, 2, 4, 3, generator=generator)]
    with comm_stats() as forward:
        out = sp.gated_delta_rule(*inputs, seq_lens=[3] * world, **where)
    with comm_stats() as backward:
        out.sum().backward()
    summary = gated_delta_summary_bytes(2, 2, 4, 3)
    expected = state_passing_bytes([1] * world, rank, summary_bytes=summary, ulysses_size=2 if grid else 1)
    plan = sp.varlen_plan(list(range(0, 3 * world + 1, 3)), **where)
    with comm_stats() as whole_documents:
        sp.gated_delta_rule(*(x.detach()[:1] for x in inputs), varlen=plan, **where)
    return (forward.bytes_sent, backward.bytes_sent, whole_documents.bytes_sent), tuple(expected) + (0,)


@pytest.mark.parametrize("world_size, grid", [(2, False), (3, False), (4, True)], ids=["P2", "P3", "P4 grid"])
def test_bytes_are_the_runs_summaries(world_size, grid):
    for rank, (measured, expected) in enumerate(pool_for(world_size).run(run_bytes, grid)):
        assert measured == expected, f"rank {rank}: (forward, backward, whole documents) {measured} != {expected}"


@on_every_rank
def run_bad_inputs():
    rank, group = dist.get_rank(), {"group": timeout_group()}
    generator = torch.Generator().manual_seed(0)
    problems = {}
    q, k, v, g, beta = random_inputs(1, 4, 1, 2, 4, 3, generator=generator, dtype=torch.float32)
    gdr = sp.gated_delta_rule
    bad_v = torch.randn(1, 4, 3, 3) if rank == 0 else v
    # The bad rank raises its own error, the others name it.
    expected = "g must be" if rank == 0 else r"bad input on rank\(s\) \[0\]"
    problems["value heads on one rank"] = raises(lambda: gdr(q, k, bad_v, g, beta, **group), expected)
    wider = torch.randn(1, 4, 2, 3 + rank)
    problems["dv differs by rank"] = raises(lambda: gdr(q, k, wider, g, beta, **group), "disagree")
    problems["k dtype"] = raises(lambda: gdr(q, k.double(), v, g, beta, **group), "one dtype")
    problems["int g"] = raises(lambda: gdr(q, k, v, g.long(), beta, **group), "g must be")
    problems["beta shape"] = raises(lambda: gdr(q, k, v, g, beta[..., :1], **group), "beta must be")
    problems["k shape"] = raises(lambda: gdr(q, k[..., :3], v, g, beta, **group), "q and k")
    problems["scale"] = raises(lambda: gdr(q, k, v, g, beta, scale=-1.0, **group), "scale")
    problems["l2norm flag"] = raises(lambda: gdr(q, k, v, g, beta, use_qk_l2norm=1, **group), "use_qk_l2norm")
    problems["layout"] = raises(lambda: gdr(q, k, v, g, beta, layout="balanced", **group), "layout")
    if dist.get_world_size() > 1:
        uneven = random_inputs(1, 4 + rank, 1, 2, 4, 3, generator=generator, dtype=torch.float32)
        problems["not the zigzag layout"] = raises(lambda: gdr(*uneven, layout="zigzag", **group), "zigzag")
    return {name: problem for name, problem in problems.items() if problem}


def test_bad_inputs_raise_on_every_rank():
    for rank, problems in enumerate(pool_for(3).run(run_bad_inputs)):
        assert not problems, f"rank {rank}: {problems}"
