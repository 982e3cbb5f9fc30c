"""Packed variable-length sequences: documents packed into one sequence, sharded across
ranks, attention kept inside each document.

    plan = varlen_plan(cu_seqlens, group=group, layout="balanced")   # Ulysses or ring
    plan = varlen_plan(cu_seqlens, mesh=mesh, layout="balanced")     # USP
    q_local = plan.split(q, dim=1)            # this rank's tokens, (1, plan.seq_lens[r], H, D)
    out_local = ring_attention(q_local, k_local, v_local, group=group, causal=True, varlen=plan)
    out = plan.gather(out_local, dim=1)

A plan says which tokens every rank holds: a VarlenLayout (seqpar_kernels/layouts.py,
where the contiguous and balanced layouts are defined) placed on this rank's groups. Any
document lengths (1 included), nothing padded. The ranks form R ring slots of U Ulysses
ranks each (a group: R = P, U = 1 for ring_attention, and ulysses_attention reads its P
pieces in rank order; a mesh: R x U for usp_attention); a slot's tokens are always in
global order, and the U pieces of a slot are torch.tensor_split of its tokens. Ulysses
splits its work by heads, so for ulysses_attention alone the contiguous layout is as
balanced and saves a reordering of the exchanged sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar_kernels.comm.grid import Grid, resolve_ranks
from seqpar_kernels.engine.attention_ops import encode_segments
from seqpar_kernels.layouts import VARLEN_LAYOUTS, VarlenLayout
from seqpar_kernels.parallel.checks import (
    CheckedOnEveryRank,
    check_tensor,
    checked_on_grid,
    fingerprint,
    normalize_dim,
)
from seqpar_kernels.parallel.reshard import gather_sequence

LAYOUTS = VARLEN_LAYOUTS


# ----------------------------------------------------------------------------------
# The plan: a layout on this rank's groups
# ----------------------------------------------------------------------------------


class VarlenPlan:
    """A VarlenLayout placed on process groups (made by varlen_plan). Attributes:
    seq_lens          every rank's token count, in piece order (group rank order;
                      for a mesh, ring index i and Ulysses index j at i * U + j)
    position_ids      (1, seqlen_local) int64, this rank's tokens' offsets within
                      their documents (for rotary embeddings), on the plan's device
    work_imbalance    max over mean of the ring slots' causal work (a Python float;
                      Ulysses splits its work by heads, so this is the ring's)
    token_imbalance   max over mean of the ring slots' token counts
    layout            the VarlenLayout (pieces, cu_seqlens, ...)"""

    def __init__(self, layout: VarlenLayout, piece: int, group=None, grid=None, device=None):
        self.layout, self.piece, self.group, self.grid = layout, piece, group, grid
        self.seq_lens = list(layout.seq_lens)
        self.work_imbalance, self.token_imbalance = layout.work_imbalance, layout.token_imbalance
        self.position_ids = layout.position_ids(piece).to(device or "cpu")
        # What the ring ops carry (CPU int64 tensors: data, not graph constants, for
        # torch.compile).
        self.cu_seqlens_tensor = torch.tensor(layout.cu_seqlens, dtype=torch.int64)
        self.segments_tensor = encode_segments(layout.slots)

    @property
    def on_mesh(self) -> bool:
        return self.grid is not None

    @property
    def total(self) -> int:
        return self.layout.total

    def __repr__(self) -> str:
        where = (
            f"mesh R={self.layout.ring_size} x U={self.layout.ulysses_size}"
            if self.on_mesh
            else f"group of {self.layout.ring_size}"
        )
        return (
            f"VarlenPlan({len(self.layout.cu_seqlens) - 1} documents, {self.total} tokens, {where}, "
            f"layout={self.layout.layout!r}, seq_lens={self.seq_lens}, "
            f"work_imbalance={self.work_imbalance:.3f})"
        )

    # -- split and gather --------------------------------------------------------------

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of the full sequence `x` (the same on every rank).

        x: any shape with the plan's total length along `dim`. Returns x's shape with
        seq_lens[this rank] along dim: this rank's ranges, in order (a view when it holds
        one range). Local (no communication). Backward: gather of the gradient."""
        check_tensor(x, "VarlenPlan.split")
        dim = normalize_dim(dim, x.dim(), "dim", x.shape)
        if x.shape[dim] != self.total:
            raise ValueError(
                f"VarlenPlan.split: x has {x.shape[dim]} tokens along dim {dim} (shape {tuple(x.shape)}), "
                f"the plan's documents hold {self.total} (cu_seqlens ends at {self.total})"
            )
        return _VarlenSplit.apply(x, dim, self)

    def gather(self, x_local: torch.Tensor, dim: int) -> torch.Tensor:
        """The full sequence from every rank's tokens (the inverse of split).

        x_local: this rank's tokens along `dim` (seq_lens[this rank] of them), the other
        dims the same on every rank. Returns the full sequence (the plan's total along
        dim) on every rank: gather_sequence over the group (a mesh: over the Ulysses
        group, then the ring group), then the pieces put in global order. Backward: each
        rank keeps its tokens of the gradient."""
        check_tensor(x_local, "VarlenPlan.gather")
        dim = normalize_dim(dim, x_local.dim(), "dim", x_local.shape)
        expected = self.seq_lens[self.piece]
        if x_local.shape[dim] != expected:
            raise ValueError(
                f"VarlenPlan.gather: x_local has {x_local.shape[dim]} tokens along dim {dim} (shape "
                f"{tuple(x_local.shape)}); this rank ({self.piece}) holds {expected} in the plan"
            )
        return self.gather_pieces(x_local, dim)

    def gather_pieces(self, x_local, dim):
        """gather without the checks: the split's backward."""
        layout = self.layout
        if self.on_mesh:
            rows = self.grid.rows(self.seq_lens)
            slot = gather_sequence(x_local, dim, self.grid.ulysses_group, sizes=rows[self.grid.ring.rank])
            concatenated = gather_sequence(slot, dim, self.grid.ring_group, sizes=[sum(row) for row in rows])
        else:
            concatenated = gather_sequence(x_local, dim, self.group, sizes=self.seq_lens)
        if layout.in_global_order:
            return concatenated
        return reorder(concatenated, dim, [segment for piece in layout.pieces for segment in piece])


def reorder(concatenated: torch.Tensor, dim: int, segments) -> torch.Tensor:
    """`concatenated` holds the global ranges `segments` one after another along dim;
    returns them in global order (one cat of views; differentiable)."""
    pieces, local = [], 0
    for start, length in segments:
        pieces.append((start, concatenated.narrow(dim, local, length)))
        local += length
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda item: item[0])], dim)


def select_segments(x: torch.Tensor, dim: int, segments) -> torch.Tensor:
    """The global ranges `segments` of x along dim, concatenated (a view for one range)."""
    if len(segments) == 1:
        start, length = segments[0]
        return x.narrow(dim, start, length)
    if not segments:
        return x.narrow(dim, 0, 0)
    return torch.cat([x.narrow(dim, start, length) for start, length in segments], dim)


class _VarlenSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, plan):
        ctx.dim, ctx.plan = dim, plan
        return select_segments(x, dim, plan.layout.pieces[plan.piece])

    @staticmethod
    def backward(ctx, grad):
        return ctx.plan.gather_pieces(grad, ctx.dim), None, None


# ----------------------------------------------------------------------------------
# varlen_plan
# ----------------------------------------------------------------------------------


def varlen_plan(
    cu_seqlens,
    *,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    device: torch.device | str | None = None,
) -> VarlenPlan:
    """The plan of a packed sequence of documents sharded across ranks.

    cu_seqlens: the global document bounds, the same on every rank: a 1-D integer tensor
        or a list of ints, [0, end of document 0, ..., N], strictly increasing (any
        document length >= 1).
    group: the ranks of ring_attention or ulysses_attention (default: the world); or
    mesh (a 2-D DeviceMesh with dims "ring" and "ulysses"), or ulysses_group and
        ring_group (make_usp_groups), for usp_attention.
    layout: "contiguous" (rank r holds piece r of torch.tensor_split of the tokens) or
        "balanced" (every rank close to the same tokens and causal work, no padding;
        the module docstring says how).
    device: where position_ids lives (default: the CPU).
    Returns a VarlenPlan: split / gather, position_ids, seq_lens, work_imbalance.

    One small all_gather checks that every rank passed the same cu_seqlens and layout;
    a bad cu_seqlens on any rank raises ValueError on every rank. Build the plan once
    per batch, outside torch.compile; the attention calls take it as varlen=plan."""
    ranks = resolve_ranks("varlen_plan", group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group)
    if isinstance(ranks, Grid):
        holder: list = []

        def local_checks():
            holder.append(VarlenLayout(cu_seqlens, ring_size=ranks.ring.world_size,
                                       ulysses_size=ranks.ulysses.world_size, layout=layout))  # fmt: skip
            return 0, (fingerprint(holder[0].cu_seqlens), layout), None

        checked_on_grid("varlen_plan", ranks, _device(cu_seqlens), True, local_checks)
        return VarlenPlan(holder[0], ranks.piece, grid=ranks, device=device)
    with CheckedOnEveryRank("varlen_plan", ranks, _device(cu_seqlens), exchange=True) as checks:
        plan_layout = VarlenLayout(cu_seqlens, ring_size=ranks.world_size, layout=layout)
        checks.share(0, (fingerprint(plan_layout.cu_seqlens), layout))
    return VarlenPlan(plan_layout, ranks.rank, group=group, device=device)


def _device(cu_seqlens):
    return cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None


__all__ = ["varlen_plan", "VarlenPlan", "VarlenLayout", "LAYOUTS"]
