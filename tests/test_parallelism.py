"""SequenceParallelism, the one value for a call's parallelism (seqpar_kernels/parallel/
parallelism.py): its pieces, take/split/gather of a sequence and its agreement checks,
in every mode and layout, on gloo ranks (world sizes 1-4, and USP grids of 4 and 6),
against the layouts' own definitions (the split functions, tests/test_usp.py's pieces)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import pool_for
from on_ranks import on_every_rank, raises, timeout_group
from test_usp import position, usp_groups, usp_piece

from seqpar_kernels.parallel.parallelism import SequenceParallelism


def _values_for(mode: str, layout: str, groups: dict) -> SequenceParallelism:
    return SequenceParallelism.resolve("test", mode, layout, **groups, modes=("ulysses", "ring", "usp", "dsp"))


def _cases():
    """(mode, layout, the groups' keyword arguments, (i, j, R, U)) for this world."""
    world = dist.get_world_size()
    group = {"group": timeout_group()}
    rank = dist.get_rank()
    cases = [(mode, "contiguous", group, (rank, 0, world, 1)) for mode in ("ulysses", "ring", "dsp")]
    cases.append(("ring", "balanced", group, (rank, 0, world, 1)))
    if world % 2 == 0 and world > 2:
        for kind in ("mesh", "inner"):
            groups = usp_groups(kind, 2)
            for layout in ("contiguous", "balanced"):
                cases.append(("usp", layout, groups, position(groups)))
    return cases


@on_every_rank
def run_pieces_take_split_gather():
    """Per case, what differs from the layouts' definitions (empty: nothing)."""
    failed = []
    gen = torch.Generator().manual_seed(5)
    for mode, layout, groups, (i, j, ring_size, ulysses_size) in _cases():
        parallelism = _values_for(mode, layout, groups)
        zigzag = "zigzag" if layout == "balanced" else "contiguous"
        pieces = ring_size * ulysses_size
        for total in (4 * pieces, 4 * pieces + 3, pieces - 1):
            case = f"{mode} {layout} N={total}"
            full = torch.randn(2, total, 3, generator=gen)
            weights = torch.randn(full.shape, generator=gen)
            expected = usp_piece(full, zigzag, i, j, ring_size, ulysses_size)
            lengths = [usp_piece(torch.arange(total), zigzag, a, b, ring_size, ulysses_size, dim=0).numel()
                       for a in range(ring_size) for b in range(ulysses_size)]  # fmt: skip
            x = full.clone().requires_grad_()
            taken = parallelism.take(x, 1)
            (taken * usp_piece(weights, zigzag, i, j, ring_size, ulysses_size)).sum().backward()
            split = parallelism.split(full, 1)
            leaf = expected.clone().requires_grad_()
            gathered = parallelism.gather(leaf, 1, total)
            (gathered * weights).sum().backward()
            checks = {
                "piece_lengths": list(parallelism.piece_lengths(total)) == lengths,
                "piece and pieces": (parallelism.piece, parallelism.pieces) == (i * ulysses_size + j, pieces),
                "take": torch.equal(taken, expected),
                "take's gradient is the piece's": torch.equal(
                    x.grad, _scatter_piece(weights, total, zigzag, i, j, ring_size, ulysses_size)
                ),
                "split": torch.equal(split, expected),
                "gather": torch.equal(gathered, full),
                "gather's backward keeps the piece": torch.equal(
                    leaf.grad, usp_piece(weights, zigzag, i, j, ring_size, ulysses_size)
                ),
                "gather_ints": parallelism.gather_ints([7, parallelism.piece])
                == [value for piece in range(pieces) for value in (7, piece)],
            }
            failed += [f"{case}: {name}" for name, ok in checks.items() if not ok]
    return failed


def _scatter_piece(weights, total, layout, i, j, ring_size, ulysses_size):
    """weights where this rank's piece lies, zero elsewhere (take's gradient)."""
    rows = usp_piece(torch.arange(total), layout, i, j, ring_size, ulysses_size, dim=0)
    out = torch.zeros_like(weights)
    out[:, rows] = weights[:, rows]
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6], ids=lambda size: f"P{size}")
def test_pieces_take_split_and_gather_follow_the_layouts(world_size):
    for rank, failed in enumerate(pool_for(world_size).run(run_pieces_take_split_gather)):
        assert not failed, f"rank {rank}: {failed}"


@on_every_rank
def run_disagreement():
    """Per case, whether agree() raised on every rank when one rank's value differs,
    and kept quiet when none does."""
    problems = {}
    for mode, layout, groups, _ in _cases():
        parallelism = _values_for(mode, layout, groups)
        case = f"{mode} {layout} {sorted(groups)}"
        parallelism.agree("test", ("same", 1))
        mine = ("odd", 1) if dist.get_rank() == dist.get_world_size() - 1 else ("same", 1)
        problem = raises(lambda: parallelism.agree("the ranks disagree", mine), "the ranks disagree")
        if dist.get_world_size() > 1 and problem is not None:
            problems[case] = problem
    return problems


@pytest.mark.parametrize("world_size", [2, 3, 4, 6], ids=lambda size: f"P{size}")
def test_agree_raises_on_every_rank(world_size):
    for rank, problems in enumerate(pool_for(world_size).run(run_disagreement)):
        assert not problems, f"rank {rank}: {problems}"


def test_resolve_refuses_bad_options():
    with pytest.raises(ValueError, match="mode must be one of"):
        SequenceParallelism.resolve("test", "megatron")
    with pytest.raises(ValueError, match="layout must be one of"):
        SequenceParallelism.resolve("test", "ring", "zigzag")
    with pytest.raises(ValueError, match="contiguous' only"):
        SequenceParallelism.resolve("test", "ulysses", "balanced")
    with pytest.raises(ValueError, match="step_backend must be one of"):
        SequenceParallelism.resolve("test", "ring", step_backend="flash")
    with pytest.raises(ValueError, match="mesh"):
        SequenceParallelism.resolve("test", "usp")
    with pytest.raises(ValueError, match="no attention function"):
        SequenceParallelism.resolve("test", "dsp", modes=("dsp",)).attention(*[torch.zeros(1, 2, 1, 4)] * 3)
