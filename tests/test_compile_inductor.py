"""Inductor keeps every rank's collectives: torch.compile(fullgraph=True) with the
default backend, forward and backward, equals eager on 2 and 3 gloo ranks.

Each rank compiles its own graph, and the graphs differ where the shapes do: with fewer
heads than ranks, a rank without heads exchanges empty gradients. To inductor a custom
op is a pure function unless registered as an effect: it would drop that exchange as
dead code, the rank would run one collective fewer, and the others would hang. One graph
per world size holds Ulysses with fewer heads than ranks, more heads than ranks, and
heads not divisible by the ranks, plus the ring, so it also checks that several
collectives run in one order on every rank. Batch 1: there the exchanges send from and
receive into the tensors' own memory, and the empty gradient is a view of a received
buffer, which inductor replaces by an empty tensor of its own.
"""

from __future__ import annotations

import pytest
import torch
from on_ranks import backward_on_every_rank, on_every_rank, rank_and_world, timeout_group

import seqpar_kernels as sp
from tools.reference import max_error

HEAD_DIM = 16
LOCAL_LENGTH = 3


def head_counts(world_size: int) -> list[tuple[int, int]]:
    """(nheads, nheads_kv) per Ulysses call: fewer heads than ranks (MQA), twice as many
    (GQA), and one more than the ranks (not divisible)."""
    return [(world_size - 1, 1), (2 * world_size, 2), (world_size + 1, 1)]


def _inputs(rank: int, world_size: int):
    """This rank's q, k, v for each Ulysses call, then for the ring, flattened."""
    generator = torch.Generator().manual_seed(11 + rank)
    draw = lambda heads: torch.randn(1, LOCAL_LENGTH, heads, HEAD_DIM, generator=generator)  # noqa: E731
    shapes = head_counts(world_size) + [(4, 2)]
    return [draw(count) for heads, kv_heads in shapes for count in (heads, kv_heads, kv_heads)]


def _model(*tensors):
    group = timeout_group()
    outputs = []
    for index in range(0, len(tensors) - 3, 3):
        q, k, v = tensors[index : index + 3]
        outputs.append(sp.ulysses_attention(q * 0.5, k, v, causal=index == 0, group=group))
    q, k, v = tensors[-3:]
    outputs.append(sp.ring_attention(q, k, v, causal=True, group=group, check_ranks=False))
    return torch.cat([out.flatten() for out in outputs])


@on_every_rank
def run_compiled_and_eager():
    torch._dynamo.reset()
    inputs = _inputs(*rank_and_world())
    results = []
    for fn in (_model, torch.compile(_model, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        backward_on_every_rank(out, torch.ones_like(out))
        results.append([out.detach(), *(leaf.grad for leaf in leaves)])
    eager, compiled = results
    return max(max_error(c, e) for c, e in zip(compiled, eager))


def test_inductor_matches_eager_with_any_head_split(ranks):
    if ranks.world_size == 1:
        pytest.skip("one rank exchanges nothing")
    if ranks.world_size == 4:
        pytest.skip("3 ranks hold every head split 4 does (fewer, more, not divisible) in less time")
    differences = ranks.run(run_compiled_and_eager)
    assert max(differences) <= 1e-5, differences
