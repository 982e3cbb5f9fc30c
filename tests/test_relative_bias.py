"""relative_bias_attention (seqpar_kernels/parallel/relative_bias.py), Inkling 2's causal
attention with a per-query relative position bias and per-query sinks: against the whole
sequence's attention in one process (fp64, per document for packed ones), the output and
every gradient (q, k, v, the bias logits, the sinks), every layout the ring takes (groups
contiguous and zigzag, USP grids, packed documents), world sizes 1-4, extents shorter
and longer than a rank's piece, full and sliding layers, GQA and a value head dim of its
own; in bf16 and fp16 the accuracy rule (twice plain torch's error against fp64); and
the ring op's lse gradient it relies on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import pool_for
from on_ranks import on_every_rank
from recurrent_cases import check_against_reference

from seqpar_kernels.engine.ring_ops import ring_attention_forward
from seqpar_kernels.groups import all_gather_ints, resolve_group
from seqpar_kernels.parallel.relative_bias import relative_bias_attention
from seqpar_kernels.parallel.state_passing import SequenceRuns

SCALE = 0.4


def reference(q, k, v, logits, sinks, window_left):
    """The whole sequence's attention as transformers' Inkling 2 computes it (eager), in
    fp64: q (B, S, H, D), k, v (B, S, H_kv, .), logits (B, S, H, E), sinks (B, S, H)."""
    dtype = q.dtype
    q, k, v, logits, sinks = (x.double() for x in (q, k, v, logits, sinks))
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    total, extent = q.shape[1], logits.shape[-1]
    positions = torch.arange(total)
    distance = positions[:, None] - positions[None, :]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
    bias = logits.transpose(1, 2).gather(-1, distance.clamp(0, extent - 1).expand(*scores.shape))
    scores = scores + bias.masked_fill((distance < 0) | (distance >= extent), 0.0)
    seen = (distance >= 0) if window_left < 0 else (distance >= 0) & (distance <= window_left)
    scores = scores.masked_fill(~seen, float("-inf"))
    combined = torch.cat([scores, sinks.transpose(1, 2).unsqueeze(-1)], dim=-1)
    probabilities = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probabilities, v).to(dtype)


def grid_group_of(where):
    """(group name, the piece of each of its ranks) the far ring runs over."""
    if "group" in where:
        info = resolve_group(where["group"])
        return info.name, list(range(info.world_size))
    mesh = where["mesh"]
    ulysses, ring = mesh.get_group("ulysses"), mesh.get_group("ring")
    piece = dist.get_rank(ring) * dist.get_world_size(ulysses) + dist.get_rank(ulysses)
    info = resolve_group(None)
    return info.name, [p for (p,) in all_gather_ints([piece], info.name)]


@on_every_rank
def run_against_reference(cases):
    failures = []
    generator = torch.Generator().manual_seed(11)
    world = dist.get_world_size()
    for heads, kv_heads, head_dim, value_dim, extent, window_left, (per_rank, more) in cases:
        total = per_rank * world + more
        shapes = [(2, total, heads, head_dim), (2, total, kv_heads, head_dim), (2, total, kv_heads, value_dim),
                  (2, total, heads, extent), (2, total, heads)]  # fmt: skip
        inputs = [torch.randn(shape, generator=generator) for shape in shapes]
        inputs[3] = inputs[3] * 2  # biases as large as the scores

        def op(q, k, v, logits, sinks, **where):
            runs = SequenceRuns.of("test", q, **where, inputs=(k, v, logits, sinks))
            name, pieces = grid_group_of(where)
            return relative_bias_attention(q, k, v, logits.transpose(1, 2), sinks.transpose(1, 2), scale=SCALE,
                                           window_left=window_left, runs=runs, group_name=name,
                                           group_pieces=pieces)  # fmt: skip

        def expected(q, k, v, logits, sinks):
            return reference(q, k, v, logits, sinks, window_left)

        case = f"H={heads}/{kv_heads} D={head_dim}/{value_dim} E={extent} left={window_left}"
        failures += [f"{case} {failure}" for failure in check_against_reference(
            op, expected, inputs, {0, 1, 2, 3, 4}, total, generator=generator, atol=2e-5, rtol=1e-4)]  # fmt: skip
    return failures


CASES = {
    # (H, H_kv, D, Dv, E, window left, (a, b): a total of a x world + b rows): a full layer whose extent is shorter
    # than a piece, one longer than several pieces, a sliding layer (left = E - 1).
    "full short extent": [(4, 2, 8, 6, 3, -1, (5, 3))],
    "full long extent": [(2, 1, 8, 8, 11, -1, (4, 9))],
    "sliding": [(4, 4, 6, 6, 5, 4, (3, 7))],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda size: f"P{size}")
def test_matches_the_whole_sequence(world_size, case):
    failures = pool_for(world_size).run(run_against_reference, CASES[case])
    assert not [failure for per_rank in failures for failure in per_rank], failures


@on_every_rank
def run_lse_gradient(step_kernels):
    """The ring op's (out, lse) under a loss that reads both: every gradient against fp64
    autograd of the materialized attention (zigzag, causal, GQA, Dv != D, sinks;
    softcap through the plain-torch blocks)."""
    failures = []
    generator = torch.Generator().manual_seed(5)
    world, rank = dist.get_world_size(), dist.get_rank()
    info = resolve_group(None)
    for softcap, sinks_on in ((0.0, False), (0.0, True), (3.0, True)):
        total = 4 * world + 3
        q, k, v = (torch.randn(2, total, heads, dim, generator=generator) for heads, dim in ((4, 8), (2, 8), (2, 6)))
        sinks = torch.randn(4, generator=generator)
        out_weight = torch.randn(2, total, 4, 6, generator=generator)
        lse_weight = torch.randn(2, 4, total, generator=generator)
        leaves = [x.double().requires_grad_() for x in (q, k, v, sinks)]
        scores = torch.einsum("bqhd,bkhd->bhqk", leaves[0], leaves[1].repeat_interleave(2, dim=2)) * SCALE
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(torch.ones(total, total, dtype=torch.bool).triu(1), float("-inf"))
        if sinks_on:
            scores = torch.cat([scores, leaves[3][None, :, None, None].expand(2, 4, total, 1)], dim=-1)
        lse_expected = torch.logsumexp(scores, dim=-1)
        probabilities = torch.exp(scores - lse_expected.unsqueeze(-1))[..., :total]
        out_expected = torch.einsum("bhqk,bkhd->bqhd", probabilities, leaves[2].repeat_interleave(2, dim=2))
        ((out_expected * out_weight).sum() + (lse_expected * lse_weight).sum()).backward()
        # Zigzag pieces: chunks r and 2P - 1 - r of 2P.
        chunks = list(torch.arange(total).tensor_split(2 * world))
        rows = torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
        mine = [x[:, rows].clone().requires_grad_() for x in (q, k, v)]
        my_sinks = sinks.clone().requires_grad_() if sinks_on else None
        out, lse = ring_attention_forward(
            *mine, causal=True, softmax_scale=SCALE, zigzag=True, group_name=info.name, step_kernels=step_kernels,
            seq_lens=[len(chunks[r]) + len(chunks[2 * world - 1 - r]) for r in range(world)], softcap=softcap,
            sinks=my_sinks,
        )  # fmt: skip
        ((out * out_weight[:, rows]).sum() + (lse * lse_weight[:, :, rows]).sum()).backward()
        got = [x.grad for x in mine]
        want = [leaf.grad[:, rows] for leaf in leaves[:3]]
        if sinks_on:
            summed = my_sinks.grad.clone()
            dist.all_reduce(summed)
            got.append(summed)
            want.append(leaves[3].grad)
        for name, mine_grad, expected in zip(("dq", "dk", "dv", "dsinks"), got, want):
            error = (mine_grad.double() - expected).abs().max().item()
            if not error <= 1e-4:
                failures.append(f"{step_kernels} softcap={softcap} sinks={sinks_on} {name}: max error {error:.3g}")
    return failures


@pytest.mark.parametrize("step_kernels", ["aten", "triton"])
def test_ring_op_lse_is_differentiable(step_kernels):
    failures = pool_for(2).run(run_lse_gradient, step_kernels)
    assert not [failure for per_rank in failures for failure in per_rank], failures


def plain(q, k, v, logits, sinks, window_left):
    """transformers' eager Inkling 2 attention in the inputs' dtype (the accuracy rule's
    yardstick): scores, bias and the matmuls rounded to it, the softmax in fp32."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    total, extent = q.shape[1], logits.shape[-1]
    positions = torch.arange(total)
    distance = positions[:, None] - positions[None, :]
    scores = torch.matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(2, 3)) * SCALE
    bias = logits.transpose(1, 2).gather(-1, distance.clamp(0, extent - 1).expand(*scores.shape))
    scores = scores + bias.masked_fill((distance < 0) | (distance >= extent), 0.0)
    seen = (distance >= 0) if window_left < 0 else (distance >= 0) & (distance <= window_left)
    scores = scores.masked_fill(~seen, torch.finfo(scores.dtype).min)
    combined = torch.cat([scores, sinks.transpose(1, 2).unsqueeze(-1)], dim=-1).float()
    probabilities = torch.softmax(combined, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(probabilities, v.transpose(1, 2)).transpose(1, 2)


@on_every_rank
def run_low_precision(dtype):
    """The output and every gradient in `dtype` within the accuracy rule (twice plain
    torch's error in that dtype, against fp64), contiguous and zigzag, full and sliding."""
    from tools import reference as rule

    failures = []
    generator = torch.Generator().manual_seed(3)
    world, rank = dist.get_world_size(), dist.get_rank()
    group = resolve_group(None)
    for layout, extent, window_left in (("contiguous", 6, -1), ("zigzag", 6, -1), ("zigzag", 6, 5)):
        total = 16 * world + 5
        shapes = [(1, total, 4, 64), (1, total, 2, 64), (1, total, 2, 64), (1, total, 4, extent), (1, total, 4)]
        full = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
        dout = torch.randn(1, total, 4, 64, generator=generator).to(dtype)
        answers = []
        for cast in (torch.float64, None):
            leaves = [x.to(cast or dtype, copy=True).requires_grad_() for x in full]
            out = (reference if cast else plain)(*leaves, window_left)
            out.backward(dout.to(out.dtype))
            answers.append([out.detach(), *(leaf.grad for leaf in leaves)])
        rows = _rows(total, world, rank, layout)
        mine = [x[:, rows].clone().requires_grad_() for x in full]
        runs = SequenceRuns.of("test", mine[0], layout=layout, seq_lens=_lengths(total, world, layout),
                               inputs=mine[1:])  # fmt: skip
        out = relative_bias_attention(mine[0], mine[1], mine[2], mine[3].transpose(1, 2), mine[4].transpose(1, 2),
                                      scale=SCALE, window_left=window_left, runs=runs, group_name=group.name,
                                      group_pieces=list(range(world)))  # fmt: skip
        out.backward(dout[:, rows])
        got = [out.detach(), *(x.grad for x in mine)]
        for name, ours, exact, yardstick in zip(("out", "dq", "dk", "dv", "dlogits", "dsinks"), got, *answers):
            # Each row's gradient is whole on its own rank: the shares other ranks' halos and ring
            # steps gave its k and v come home in the backward.
            try:
                rule.assert_within_rule(ours, exact[:, rows], yardstick[:, rows], dtype, f"{layout} E={extent} "
                                        f"left={window_left} rank {rank} {name}")  # fmt: skip
            except AssertionError as error:
                failures.append(str(error))
    return failures


def _rows(total, world, rank, layout):
    """The global rows rank holds: contiguous, or zigzag chunks r and 2P - 1 - r."""
    if layout == "zigzag":
        chunks = torch.arange(total).tensor_split(2 * world)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
    return torch.arange(total).tensor_split(world)[rank]


def _lengths(total, world, layout):
    return [len(_rows(total, world, rank, layout)) for rank in range(world)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_plain_torch_error(dtype):
    failures = pool_for(3).run(run_low_precision, dtype)
    assert not [failure for per_rank in failures for failure in per_rank], failures


def test_a_ring_whose_lse_nothing_reads_takes_the_plain_backward(monkeypatch):
    """The ring op's backward gets grad_lse None (not zeros) where the loss reads out
    only, eager and compiled: a zero grad_lse would still take the lse path (one more
    column for the aten kernels, and on a GPU the memory-efficient kernel for it)."""
    import seqpar_kernels as sp
    from seqpar_kernels.engine import ring_driver

    seen = []
    plain_inputs = ring_driver.backward_inputs

    def spy(steps, out, dout, grad_lse=None):
        seen.append(grad_lse)
        return plain_inputs(steps, out, dout, grad_lse)

    monkeypatch.setattr(ring_driver, "backward_inputs", spy)
    q, k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3))
    sp.ring_attention(q, k, v, causal=True).sum().backward()
    sp.ring_attention(q, k, v, causal=True, return_lse=True)[0].sum().backward()
    compiled = torch.compile(lambda q, k, v: sp.ring_attention(q, k, v, causal=True), backend="aot_eager")
    compiled(q, k, v).sum().backward()
    group_name = resolve_group(None).name
    out, lse = ring_attention_forward(q, k, v, causal=True, softmax_scale=SCALE, zigzag=False, group_name=group_name,
                                      step_kernels="aten", seq_lens=[16])  # fmt: skip
    (out.sum() + lse.sum()).backward()
    assert [grad is None for grad in seen] == [True, True, True, False], seen
