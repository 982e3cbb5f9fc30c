"""USP: Ulysses inside a ring on a 2-D grid of ranks (arXiv:2405.07719).

The ranks form a grid of R ring slots x U Ulysses ranks. The rank at ring index i and
Ulysses index j (its rank in its ring group and in its Ulysses group) holds sequence
piece p = i * U + j. The U ranks of a Ulysses group hold the pieces of one ring slot;
the R ranks of a ring group are one Ulysses index of every slot.

    forward on the rank at (i, j)                                   memory layout
    q (B, S_p, H, D), k/v (B, S_p, H_kv, D)                         as given (any strides)
      Ulysses exchange over the Ulysses group (ulysses.sequence_to_heads): q, k and v
      in one all-to-all; Ulysses rank j gets q heads [h_j, h_j + n_j) (tensor_split of H)
      and the kv heads they read
    q (B, S_slot_i, n_j, D), k/v (B, S_slot_i, n_kv_j, D) logical      (B, n, S, D) in memory
      ring attention over the ring group on the slot pieces, once per run of q heads
      with a uniform GQA mapping (usually one run; see ulysses.uniform_head_runs); only
      the n_kv_j kv heads travel the ring
    out (B, S_slot_i, n_j, D), lse (B, n_j, S_slot_i) fp32
      Ulysses exchange back (ulysses.heads_to_sequence), the lse too when asked for
    out (B, S_p, H, D), lse (B, H, S_p)                             contiguous

Every column of the grid (a ring group) holds the same heads, so its ring runs the
same runs with the same shapes on every member. The backward is the autograd of the
exchange ops and of the ring op: no op of its own.

Layouts (usp_split / usp_gather; N rows along the sequence):
    contiguous  piece p is piece p of torch.tensor_split(x, R * U): slot i is the
                concatenation of pieces i*U .. i*U + U-1.
    zigzag      the zigzag layout over the ring (ring.zigzag_split with R ranks): slot i
                holds chunks i and 2R-1-i of the 2R torch.tensor_split chunks; piece j
                of slot i is piece j of torch.tensor_split(slot, U).
usp_attention itself accepts any local lengths (empty pieces too) in the contiguous
layout, and under zigzag any split of each slot over its Ulysses group, provided the
slots' lengths are the zigzag pieces of their sum.

Checks. A call's argument checks run nested, so that a bad input on any rank raises on
every rank of the grid: one small all_gather over the Ulysses group (local length,
options, ring index and ring group), then one over the ring group (slot length,
options, the ring groups its row meets). A rank that raises in the first makes its
whole Ulysses group raise; each ring group holds one member of that Ulysses group, so
the second makes every rank raise. The same two gathers check that the groups form a
grid (parallel/checks.py checked_on_grid).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from seqpar_kernels.comm.grid import MESH_DIM_NAMES, Grid, resolve_grid
from seqpar_kernels.engine.ring_ops import ring_attention_forward
from seqpar_kernels.groups import resolve_group
from seqpar_kernels.layouts import usp_piece_lengths, usp_piece_segments
from seqpar_kernels.parallel.attention_checks import (
    AttentionCall,
    check_zigzag_lengths,
    checked_attention_call,
    fold_scale_sign,
)
from seqpar_kernels.parallel.checks import (
    CheckedOnEveryRank,
    check_bool,
    check_tensor,
    checked_on_grid,
    device_of,
    normalize_dim,
)
from seqpar_kernels.parallel.reshard import gather_sequence
from seqpar_kernels.parallel.ring import LAYOUTS, run_ring_attention, zigzag_gather_pieces
from seqpar_kernels.parallel.ulysses import (
    UlyssesPlan,
    attend_by_head_runs,
    heads_to_sequence,
    run_ulysses_attention,
    sequence_to_heads,
)

__all__ = ["make_usp_groups", "usp_attention", "usp_split", "usp_gather", "MESH_DIM_NAMES"]


# ----------------------------------------------------------------------------------
# make_usp_groups
# ----------------------------------------------------------------------------------


def make_usp_groups(
    ulysses_degree: int,
    *,
    group: dist.ProcessGroup | None = None,
    ulysses_inner: bool = True,
    timeout: timedelta | None = None,
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(ulysses_group, ring_group) of this rank, for a grid over the ranks of `group`
    (default: the world) with Ulysses degree U = ulysses_degree and ring degree R =
    size / U (either may be 1: size-1 groups are returned too).

    ulysses_inner=True: Ulysses group i is ranks i*U .. i*U + U-1 of `group` (the GPUs
    of one node under torchrun), ring group j is ranks j, U + j, ...; so rank r of
    `group` holds sequence piece r. False swaps them: Ulysses group i is ranks i, R + i,
    ..., ring group j is ranks j*R .. j*R + R-1.
    timeout: of the new groups' collectives (default: the backend's).

    Collective over the world, as dist.new_group: every rank of the world calls it, with
    the same ulysses_degree and ulysses_inner, each passing its own `group` (e.g. its
    data-parallel replica's ranks; groups must not overlap). One small all_gather over
    the world learns every rank's group, then every rank creates every group in the same
    order. A bad argument on any rank raises ValueError on every rank before any group
    is created."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("make_usp_groups needs an initialised torch.distributed (dist.init_process_group)")
    world = resolve_group(None)
    with CheckedOnEveryRank("make_usp_groups", world, None, exchange=True, extra_count=world.world_size) as checks:
        members = list(range(world.world_size)) if group is None else dist.get_process_group_ranks(group)
        if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 1:
            raise ValueError(f"ulysses_degree must be a positive int, got {ulysses_degree!r}")
        check_bool("ulysses_inner", ulysses_inner)
        if len(members) % ulysses_degree != 0:
            raise ValueError(
                f"ulysses_degree={ulysses_degree} must divide the number of ranks ({len(members)}: global "
                f"ranks {members}) of {'the world' if group is None else 'group'}"
            )
        # Padded with -1 to the world size: every rank's row of the gather has one length.
        checks.share(0, (ulysses_degree, ulysses_inner), extra=members + [-1] * (world.world_size - len(members)))
    grids = list(dict.fromkeys(tuple(rank for rank in extra if rank >= 0) for extra in checks.extras))
    overlapping = [(a, b) for n, a in enumerate(grids) for b in grids[n + 1 :] if set(a) & set(b)]
    if overlapping:
        first, second = overlapping[0]
        raise ValueError(f"make_usp_groups: ranks passed groups that overlap: global ranks {first} and {second}")
    mine = None, None
    for members in grids:
        ring_degree = len(members) // ulysses_degree
        # grid[i][j]: the global rank at ring index i, Ulysses index j.
        if ulysses_inner:
            grid = [[members[i * ulysses_degree + j] for j in range(ulysses_degree)] for i in range(ring_degree)]
        else:
            grid = [[members[j * ring_degree + i] for j in range(ulysses_degree)] for i in range(ring_degree)]
        # new_group orders a group's ranks by global rank; members is sorted, so rows
        # and columns are already in Ulysses and ring order.
        rows = [dist.new_group(row, timeout=timeout) for row in grid]
        columns = [dist.new_group([row[j] for row in grid], timeout=timeout) for j in range(ulysses_degree)]
        for i, row in enumerate(grid):
            if world.rank in row:
                mine = rows[i], columns[row.index(world.rank)]
    assert mine[0] is not None, (world.rank, grids)
    return mine


# ----------------------------------------------------------------------------------
# usp_attention
# ----------------------------------------------------------------------------------


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh=None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "contiguous",
    seq_lens: list[int] | None = None,
    return_lse: bool = False,
    varlen=None,
    step_backend: str = "auto",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
):
    """Exact attention over a sequence sharded across a grid of R x U ranks: Ulysses
    inside each ring slot, the ring across slots.

    mesh: a 2-D torch.distributed.device_mesh.DeviceMesh with dims named "ring" and
        "ulysses" (either order); or ulysses_group and ring_group (make_usp_groups), not
        both. The rank at ring index i, Ulysses index j holds sequence piece i * U + j.
    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_kv,
        headdim) with nheads % nheads_kv == 0 (GQA, MQA; kv heads are never repeated,
        fewer kv heads than U included). Heads need not divide by U. fp16, bf16 or fp32;
        CPU or CUDA; head dim up to 256; v's head dim headdim_v may differ (multi-head
        latent attention); any strides. seqlen_local may differ by rank
        (0 too).
    causal: mask by global position.
    layout: "contiguous" (pieces in order) or "zigzag" (ring slot i holds chunks i and
        2R-1-i of 2R; usp_split makes both; see the module docstring).
    softmax_scale: default 1/sqrt(headdim).
    seq_lens: every rank's seqlen_local, in piece order (i * U + j). None: exchanged in
        the two small gathers that also check every rank's inputs and that the groups
        form a grid; under torch.compile they are assumed equal. Passing them skips those
        gathers (a bad input then raises on its own rank only).
    return_lse: also return the log-sum-exp (natural log) of each row's scores.
    varlen: a VarlenPlan made on the same grid (varlen_plan(cu_seqlens, mesh=mesh) or
        with the same two groups) for packed documents: q, k, v are (1,
        plan.seq_lens[piece], heads, headdim), this rank's tokens in the plan's layout
        (plan.split makes them); attention stays inside each document. The plan's
        balanced layout balances the ring slots; Ulysses splits each slot's work by
        heads. layout and seq_lens then come from the plan.
    step_backend: "auto", "triton" or "aten": what computes each step of the ring
        (ring_attention's argument; with R = 1 there is no ring and it is not used).
    Returns out (batch, seqlen_local, nheads, headdim_v), contiguous, in q's dtype
    [, lse (batch, nheads, seqlen_local) fp32, detached].

    window_size, softcap, sinks, attention_chunk_size: as ring_attention's (positions in
        the whole sequence, in the document under varlen); the ring over the slots skips
        what a window cannot see, each Ulysses rank passes its heads' sinks.

    Degree 1: with U = 1 this is ring_attention over the ring group, and with R = 1
    (U > 1) ulysses_attention over the Ulysses group, bit for bit, except that R = 1
    with return_lse runs the general path (Ulysses, then a ring of one rank, which
    gives the lse).

    Bytes sent by the rank at (i, j), with n_j its q heads, n_kv_j its kv heads and
    S_p the local lengths (seqpar_kernels.traffic.usp_bytes gives them in full):
      Ulysses group: ulysses_attention's bytes over the slot's pieces, plus the lse
        back when asked for (the pieces of the other Ulysses ranks x n_j x batch x 4).
      ring group: ring_attention's bytes over the slots, with n_kv_j kv heads.
    """
    grid = resolve_grid("usp_attention", mesh, ulysses_group, ring_group)
    call = checked_attention_call(
        "usp_attention", q, k, v, grid, exchange=seq_lens is None, causal=causal, softmax_scale=softmax_scale,
        seq_lens=seq_lens, varlen=varlen, layout=layout, step_backend=step_backend, return_lse=return_lse,
        window_size=window_size, softcap=softcap, sinks=sinks, attention_chunk_size=attention_chunk_size,
    )  # fmt: skip
    if varlen is None:  # packed documents: one path for every degree, the plan describes the grid
        # Degree 1: the one-dimensional algorithms themselves, over the grid's one group.
        if grid.ulysses.world_size == 1:
            return run_ring_attention(q, k, v, call.with_lengths(call.slot_lens), grid.ring)
        if grid.ring.world_size == 1 and not return_lse:
            # One slot: zigzag over one ring rank is the contiguous layout.
            return run_ulysses_attention(q, k, v, call, grid.ulysses)
    return run_usp_attention(q, k, v, call, grid)


def run_usp_attention(q, k, v, call: AttentionCall, grid: Grid):
    """usp_attention once checked (call: its AttentionCall, this slot's and every slot's
    lengths known): Ulysses exchange, the ring per uniform head run, Ulysses exchange
    back. Returns out [, lse] as usp_attention does."""
    plan = UlyssesPlan.of(call.seq_lens, q.shape[2], k.shape[2])
    q, scale = fold_scale_sign(q, call.scale)
    # (B, S_p, H, D) -> (B, S_slot, n, D) stored as (B, n, S_slot, D).
    q_heads, k_heads, v_heads = sequence_to_heads(q, k, v, plan, grid.ulysses)
    segments = None if call.varlen is None else call.varlen.segments_tensor

    def ring_run(q_run, k_run, v_run, heads):
        # The ring's step kernels map q head h to kv head h // (n / n_kv), so each run of
        # q heads whose kv heads serve equally many of them gets a ring of its own (two
        # or three only where this rank's heads start or end inside a GQA group).
        out, lse = ring_attention_forward(
            q_run, k_run, v_run, softmax_scale=scale, zigzag=call.zigzag, group_name=grid.ring.name,
            step_kernels=call.step_backend, seq_lens=call.slot_lens, segments=segments, **call.op_arguments(heads),
        )  # fmt: skip
        return out, lse.detach()  # not differentiable, as ring_attention's

    out_heads, lse_heads = attend_by_head_runs(
        ring_run, q_heads, k_heads, v_heads, plan.head_starts[grid.ulysses.rank], q.shape[2] // k.shape[2], call.sinks
    )  # (B, S_slot, n, D), (B, n, S_slot)
    out = heads_to_sequence(out_heads, plan, grid.ulysses)  # (B, S_p, H, D)
    if not call.return_lse:
        return out
    return out, heads_to_sequence(lse_heads, plan, grid.ulysses, seq_dim=2, heads_dim=1)  # (B, H, S_p)


# ----------------------------------------------------------------------------------
# usp_split / usp_gather
# ----------------------------------------------------------------------------------


def _piece_ranges(total: int, grid: Grid, layout: str) -> tuple[tuple[int, int], ...]:
    """This rank's piece as (start, length) ranges of the sequence, in order."""
    return usp_piece_segments(
        total, grid.ulysses.world_size, grid.ring.world_size, grid.ring.rank, grid.ulysses.rank, layout == "zigzag"
    )  # fmt: skip


def usp_gather_pieces(x: torch.Tensor, dim: int, grid: Grid, layout: str, row_lens, slot_lens) -> torch.Tensor:
    """usp_gather once every length is known (row_lens: this slot's Ulysses ranks',
    slot_lens: every slot's): the slot over the Ulysses group, then the sequence over
    the ring. Autograd: each rank keeps its piece of the gradient."""
    slot = gather_sequence(x, dim, grid.ulysses_group, sizes=row_lens)
    if layout == "zigzag":
        return zigzag_gather_pieces(slot, dim, grid.ring_group, grid.ring, slot_lens)
    return gather_sequence(slot, dim, grid.ring_group, sizes=slot_lens)


class _UspSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, grid, layout):
        lengths = usp_piece_lengths(x.shape[dim], grid.ulysses.world_size, grid.ring.world_size, layout == "zigzag")
        ctx.dim, ctx.grid, ctx.layout = dim, grid, layout
        ctx.row_lens, ctx.slot_lens = lengths[grid.ring.rank], [sum(row) for row in lengths]
        ranges = _piece_ranges(x.shape[dim], grid, layout)
        if len(ranges) <= 1:
            return x.narrow(dim, *(ranges[0] if ranges else (0, 0)))
        return torch.cat([x.narrow(dim, start, length) for start, length in ranges], dim)

    @staticmethod
    def backward(ctx, grad):
        return usp_gather_pieces(grad, ctx.dim, ctx.grid, ctx.layout, ctx.row_lens, ctx.slot_lens), None, None, None


def _check_sequence(x, dim, layout, describe: str) -> int:
    """Local checks of usp_split's and usp_gather's arguments; returns dim in [0, x.dim())."""
    check_tensor(x, describe)
    dim = normalize_dim(dim, x.dim(), "dim", x.shape)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r} (x of shape {tuple(x.shape)})")
    return dim


def usp_split(
    x: torch.Tensor, dim: int, *, mesh=None, ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None, layout: str = "contiguous",
) -> torch.Tensor:  # fmt: skip
    """This rank's piece of the full sequence `x` (the same tensor on every rank) in the
    USP layout: piece i * U + j for the rank at ring index i, Ulysses index j.

    x: any shape, any length N along `dim` (pieces may be empty).
    layout: "contiguous": piece i*U + j of torch.tensor_split(x, R*U, dim) (a view).
        "zigzag": ring slot i is chunks i and 2R-1-i of torch.tensor_split(x, 2R, dim),
        concatenated; the piece is piece j of torch.tensor_split(slot, U, dim).
    mesh / ulysses_group, ring_group: as in usp_attention.
    Two small collectives (one per group) check that every rank passed the same shape,
    dtype, dim and layout and that the groups form a grid (a bad input on any rank
    raises on every rank). Backward: usp_gather of the gradient."""
    grid = resolve_grid("usp_split", mesh, ulysses_group, ring_group)

    def local_checks():
        checked_dim = _check_sequence(x, dim, layout, "usp_split")
        return x.shape[checked_dim], (x.dtype, tuple(x.shape), checked_dim, layout), checked_dim

    dim, _, _ = checked_on_grid("usp_split", grid, device_of(x), True, local_checks)
    return _UspSplit.apply(x, dim, grid, layout)


def usp_gather(
    x: torch.Tensor, dim: int, *, mesh=None, ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None, layout: str = "contiguous",
) -> torch.Tensor:  # fmt: skip
    """The full sequence from every rank's piece in the USP layout (the inverse of
    usp_split), on every rank.

    x: this rank's piece; the other dims the same on every rank. Contiguous: any
    lengths (the pieces are concatenated in piece order i * U + j). Zigzag: the ring
    slots' lengths (each the sum of its Ulysses group's) must be the zigzag pieces of
    their sum (checked); a slot may be split over its Ulysses group in any lengths.
    Returns x.shape with the full length along dim: a gather over the Ulysses group,
    then one over the ring group, after the two small collectives of the checks.
    Backward: each rank keeps its piece of the gradient."""
    grid = resolve_grid("usp_gather", mesh, ulysses_group, ring_group)

    def local_checks():
        checked_dim = _check_sequence(x, dim, layout, "usp_gather")
        others = (tuple(x.shape[:checked_dim]), tuple(x.shape[checked_dim + 1 :]))
        return x.shape[checked_dim], (x.dtype, *others, checked_dim, layout), checked_dim

    dim, row_lens, slot_lens = checked_on_grid("usp_gather", grid, device_of(x), True, local_checks)
    if layout == "zigzag":
        check_zigzag_lengths(slot_lens, grid.ring, "usp_gather (the ring slots' lengths)", x.shape)
    return usp_gather_pieces(x, dim, grid, layout, row_lens, slot_lens)
