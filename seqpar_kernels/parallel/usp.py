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
grid (see _checked_on_grid).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from seqpar_kernels.comm.groups import GroupInfo, resolve_group
from seqpar_kernels.comm.plan import offsets, tensor_split_ranges, tensor_split_sizes
from seqpar_kernels.ops.ring_attention import ring_attention_forward
from seqpar_kernels.parallel.checks import (
    CheckedOnEveryRank,
    _fingerprint,
    check_bool,
    check_local_sizes,
    check_tensor,
    device_of,
    fold_scale_sign,
    normalize_dim,
)
from seqpar_kernels.parallel.reshard import gather_sequence
from seqpar_kernels.parallel.ring import (
    LAYOUTS,
    _check_ring_inputs,
    _check_zigzag_lengths,
    _zigzag_gather,
    ring_attention,
)
from seqpar_kernels.parallel.ring_driver import zigzag_chunk_lengths, zigzag_piece_lengths
from seqpar_kernels.parallel.ring_steps import check_step_backend
from seqpar_kernels.parallel.varlen import check_varlen_call
from seqpar_kernels.parallel.ulysses import (
    UlyssesPlan,
    heads_to_sequence,
    sequence_to_heads,
    ulysses_attention,
    uniform_head_runs,
)

MESH_DIM_NAMES = ("ring", "ulysses")


# ----------------------------------------------------------------------------------
# The grid: groups, and this rank's place in them
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Grid:
    """The two groups of a call: this rank is at ring index ring.rank (of R =
    ring.world_size slots) and Ulysses index ulysses.rank (of U)."""

    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup
    ulysses: GroupInfo
    ring: GroupInfo

    @property
    def piece(self) -> int:
        """This rank's sequence piece: i * U + j."""
        return self.ring.rank * self.ulysses.world_size + self.ulysses.rank

    @property
    def pieces(self) -> GroupInfo:
        """The grid as one group in piece order (for checking per-piece arguments)."""
        return GroupInfo("", self.piece, self.ring.world_size * self.ulysses.world_size)


def _resolve_grid(describe: str, mesh, ulysses_group, ring_group) -> _Grid:
    """The groups from `mesh` (dims found by name) or the two groups. Local: a program
    passes the same kind of argument on every rank, so every rank raises alike."""
    if mesh is not None:
        if ulysses_group is not None or ring_group is not None:
            raise ValueError(f"{describe}: pass mesh= or ulysses_group= and ring_group=, not both")
        names = getattr(mesh, "mesh_dim_names", None)
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or sorted(names or ()) != sorted(MESH_DIM_NAMES):
            shape = tuple(mesh.shape) if isinstance(mesh, DeviceMesh) else type(mesh).__name__
            raise ValueError(
                f"{describe}: mesh must be a 2-D DeviceMesh with dims named {MESH_DIM_NAMES} (either "
                f"order), got {shape} with dims {names}"
            )
        ulysses_group, ring_group = mesh.get_group("ulysses"), mesh.get_group("ring")
    elif ulysses_group is None or ring_group is None:
        raise ValueError(
            f"{describe}: needs mesh= (a DeviceMesh with dims {MESH_DIM_NAMES}) or both ulysses_group= and "
            f"ring_group= (make_usp_groups), got ulysses_group={ulysses_group}, ring_group={ring_group}"
        )
    return _Grid(ulysses_group, ring_group, resolve_group(ulysses_group), resolve_group(ring_group))


def _checked_on_grid(describe: str, grid: _Grid, data_device, exchange: bool, local_checks):
    """CheckedOnEveryRank over the grid. local_checks() runs this rank's checks (raising
    ValueError) and returns (local_size, agreed, result) as CheckedOnEveryRank.share
    takes them, plus what the caller keeps. Returns (result, row_lens, slot_lens): every
    Ulysses rank's local size in this slot, and every slot's total.

    Nested: the Ulysses group's gather first (inside the ring group's block), so that an
    error on a rank raises in its Ulysses group, then through the ring groups (each
    holds one member of that Ulysses group) on every rank.

    The grid. Each Ulysses group must be one ring slot (its members are the same ring
    rank i, of ring groups of one size R), and the ring groups its members belong to
    (identified by their smallest global rank), in Ulysses order, must be the same list
    for every member of a ring group. Then ring group j holds Ulysses index j of every
    slot and every slot meets the same ring groups: a grid. A ring group that fails the
    second check cannot share a Ulysses group with one that passes it (the list of a
    passing ring group's slots names every ring group through them), so every rank
    whose partners raise raises too.

    A plain function around the two `with` blocks (not a generator context manager):
    torch.compile traces it on every supported release."""
    # The messages name ranks by their rank in the group that raised.
    with CheckedOnEveryRank(f"{describe} (ring group)", grid.ring, data_device, exchange, extra_count=1) as slot_checks:
        with CheckedOnEveryRank(
            f"{describe} (Ulysses group)", grid.ulysses, data_device, exchange, extra_count=3
        ) as row_checks:
            local_size, agreed, result = local_checks()
            exchanging = row_checks.exchange or slot_checks.exchange
            # Read only when a gather runs: not while torch.compile traces.
            column = min(dist.get_process_group_ranks(grid.ring_group)) if exchanging else 0
            row_checks.share(local_size, agreed, extra=(grid.ring.rank, grid.ring.world_size, column))
        slots = [tuple(extra[:2]) for extra in row_checks.extras]
        if len(set(slots)) != 1:
            raise ValueError(
                f"{describe}: ulysses_group and ring_group do not form a grid: the ranks of a Ulysses group "
                f"must hold one ring slot (one ring rank, of ring groups of one size); Ulysses ranks "
                f"0..{grid.ulysses.world_size - 1} are (ring rank, ring size) {slots}"
            )
        columns = [extra[2] for extra in row_checks.extras]
        slot_checks.share(
            sum(row_checks.sizes), (agreed, grid.ulysses.world_size),
            extra=(_fingerprint(columns) if exchanging else 0,),
        )  # fmt: skip
    if len({extra[0] for extra in slot_checks.extras}) != 1:
        raise ValueError(
            f"{describe}: ulysses_group and ring_group do not form a grid: the Ulysses groups of this "
            f"ring group's ranks meet different ring groups (this rank's Ulysses group meets the ring "
            f"groups whose first global ranks are {columns})"
        )
    return result, row_checks.sizes, slot_checks.sizes


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
):
    """Exact attention over a sequence sharded across a grid of R x U ranks: Ulysses
    inside each ring slot, the ring across slots.

    mesh: a 2-D torch.distributed.device_mesh.DeviceMesh with dims named "ring" and
        "ulysses" (either order); or ulysses_group and ring_group (make_usp_groups), not
        both. The rank at ring index i, Ulysses index j holds sequence piece i * U + j.
    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_kv,
        headdim) with nheads % nheads_kv == 0 (GQA, MQA; kv heads are never repeated,
        fewer kv heads than U included). Heads need not divide by U. fp16, bf16 or fp32;
        CPU or CUDA; head dim up to 256; any strides. seqlen_local may differ by rank
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
    Returns out (batch, seqlen_local, nheads, headdim), contiguous, in q's dtype
    [, lse (batch, nheads, seqlen_local) fp32, detached].

    Degree 1: with U = 1 this is ring_attention over the ring group, and with R = 1
    (U > 1) ulysses_attention over the Ulysses group, bit for bit, except that R = 1
    with return_lse runs the general path (Ulysses, then a ring of one rank, which
    gives the lse).

    Bytes sent by the rank at (i, j), with n_j its q heads, n_kv_j its kv heads and
    S_p the local lengths (the README gives the formulas in full):
      Ulysses group: ulysses_attention's bytes over the slot's pieces, plus the lse
        back when asked for (the pieces of the other Ulysses ranks x n_j x batch x 4).
      ring group: ring_attention's bytes over the slots, with n_kv_j kv heads.
    """
    grid = _resolve_grid("usp_attention", mesh, ulysses_group, ring_group)

    def local_checks():
        scale = _check_ring_inputs(q, k, v, causal, softmax_scale, layout)
        check_bool("return_lse", return_lse)
        check_step_backend(step_backend)
        batch, local_len, num_heads, head_dim = q.shape
        lengths = seq_lens
        if varlen is not None:
            _check_varlen_grid(varlen, q, grid, layout, seq_lens)
            lengths = varlen.seq_lens
        elif lengths is not None:
            lengths = check_local_sizes(lengths, grid.pieces, local_len, "seq_lens", q.shape, 1)
        agreed = (batch, num_heads, k.shape[2], head_dim, causal, layout, q.dtype, scale, return_lse, lengths,
                  step_backend)
        return local_len, agreed, (scale, lengths)

    (scale, lengths), row_lens, slot_lens = _checked_on_grid(
        "usp_attention", grid, device_of(q), seq_lens is None, local_checks
    )
    ulysses_size, ring_size = grid.ulysses.world_size, grid.ring.world_size
    if lengths is not None:
        by_slot = [lengths[i * ulysses_size : (i + 1) * ulysses_size] for i in range(ring_size)]
        row_lens, slot_lens = by_slot[grid.ring.rank], [sum(slot) for slot in by_slot]
    if layout == "zigzag":
        _check_zigzag_lengths(slot_lens, grid.ring, "usp_attention (the ring slots' lengths)", q.shape)

    if varlen is not None:  # one path for every degree: the plan describes the grid
        return _usp_attention(
            q, k, v, grid, causal, scale, False, row_lens, slot_lens, return_lse, step_backend, varlen
        )  # fmt: skip
    # Degree 1: the one-dimensional algorithms themselves, their checks already run here.
    if ulysses_size == 1:
        return ring_attention(
            q, k, v, group=grid.ring_group, causal=causal, softmax_scale=softmax_scale, layout=layout,
            return_lse=return_lse, seq_lens=slot_lens, step_backend=step_backend,
        )  # fmt: skip
    if ring_size == 1 and not return_lse:
        # One slot: zigzag over one ring rank is the contiguous layout.
        return ulysses_attention(
            q, k, v, group=grid.ulysses_group, causal=causal, softmax_scale=softmax_scale, seq_lens=row_lens
        )
    return _usp_attention(
        q, k, v, grid, causal, scale, layout == "zigzag", row_lens, slot_lens, return_lse, step_backend
    )  # fmt: skip


def _check_varlen_grid(plan, q, grid: _Grid, layout, seq_lens) -> None:
    """Local checks of usp_attention(varlen=plan): a plan made on this grid, batch 1,
    this rank's token count; the plan fixes the layout and the lengths."""
    check_varlen_call("usp_attention", plan, q, grid.piece, on_mesh=True)
    made_on = (plan.grid.ulysses.name, plan.grid.ring.name)
    if made_on != (grid.ulysses.name, grid.ring.name):
        raise ValueError(
            f"usp_attention: the varlen plan was made on the groups (Ulysses, ring) {made_on}, the call runs on "
            f"{(grid.ulysses.name, grid.ring.name)}"
        )
    if layout != "contiguous":
        raise ValueError(f"usp_attention: with varlen the plan sets the layout; pass no layout (got {layout!r})")
    if seq_lens is not None and list(seq_lens) != plan.seq_lens:
        raise ValueError(f"usp_attention: seq_lens={list(seq_lens)} differs from the varlen plan's {plan.seq_lens}")


def _usp_attention(
    q, k, v, grid: _Grid, causal, scale, zigzag, row_lens, slot_lens, return_lse, step_backend, varlen=None
):
    """usp_attention once checked: Ulysses exchange, the ring per uniform head run,
    Ulysses exchange back."""
    batch, _, num_heads, _ = q.shape
    plan = UlyssesPlan.of(row_lens, num_heads, k.shape[2])
    q, scale = fold_scale_sign(q, scale)
    # (B, S_p, H, D) -> (B, S_slot, n, D) stored as (B, n, S_slot, D).
    q_heads, k_heads, v_heads = sequence_to_heads(q, k, v, plan, grid.ulysses)
    outs, lses = [], []
    documents = () if varlen is None else (varlen.cu_seqlens_tensor, varlen.segments_tensor)
    runs = uniform_head_runs(plan.head_starts[grid.ulysses.rank], q_heads.shape[2], num_heads // k.shape[2])
    for q_offset, q_count, kv_offset, kv_count in runs:
        # The ring's step kernels map q head h to kv head h // (n / n_kv), so each run of
        # q heads whose kv heads serve equally many of them gets a ring of its own (two
        # or three only where this rank's heads start or end inside a GQA group). The
        # op directly, with the slots' lengths: the checks above stand for the ring's.
        out, lse = ring_attention_forward(
            q_heads.narrow(2, q_offset, q_count),
            k_heads.narrow(2, kv_offset, kv_count),
            v_heads.narrow(2, kv_offset, kv_count),
            causal, scale, zigzag, grid.ring.name, step_backend, slot_lens, *documents,
        )  # fmt: skip
        outs.append(out)  # (B, S_slot, q_count, D)
        lses.append(lse.detach())  # (B, q_count, S_slot); not differentiable, as ring_attention's
    if not outs:
        # No heads at this Ulysses index (fewer heads than U): an empty output that stays
        # in the autograd graph, so this rank joins the backward exchanges like the others.
        out_heads = q_heads.clone()
        lse_heads = q.new_empty((batch, 0, sum(row_lens)), dtype=torch.float32)
    else:
        out_heads = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, S_slot, n, D)
        lse_heads = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)  # (B, n, S_slot)
    out = heads_to_sequence(out_heads, plan, grid.ulysses)  # (B, S_p, H, D)
    if not return_lse:
        return out
    return out, heads_to_sequence(lse_heads, plan, grid.ulysses, seq_dim=2, heads_dim=1)  # (B, H, S_p)


# ----------------------------------------------------------------------------------
# usp_split / usp_gather
# ----------------------------------------------------------------------------------


def _layout_lengths(total: int, ulysses_size: int, ring_size: int, layout: str) -> list[list[int]]:
    """lengths[i][j]: the rows of the piece at ring index i, Ulysses index j, of a
    sequence of `total` rows in `layout` (the module docstring)."""
    if layout == "contiguous":
        sizes = tensor_split_sizes(total, ring_size * ulysses_size)
        return [sizes[i * ulysses_size : (i + 1) * ulysses_size] for i in range(ring_size)]
    return [tensor_split_sizes(slot, ulysses_size) for slot in zigzag_piece_lengths(total, ring_size)]


def _piece_ranges(total: int, grid: _Grid, layout: str) -> list[tuple[int, int]]:
    """This rank's piece as (start, length) ranges of the sequence, in order: one, or
    under zigzag two where the piece spans the slot's two chunks."""
    lengths = _layout_lengths(total, grid.ulysses.world_size, grid.ring.world_size, layout)
    i, j = grid.ring.rank, grid.ulysses.rank
    if layout == "contiguous":
        return [(sum(map(sum, lengths[:i])) + sum(lengths[i][:j]), lengths[i][j])]
    ring_size = grid.ring.world_size
    chunks = zigzag_chunk_lengths(total, ring_size)
    chunk_starts = offsets(chunks)
    start, length = tensor_split_ranges(sum(lengths[i]), grid.ulysses.world_size)
    start, length = start[j], length[j]
    ranges = []
    for chunk in (i, 2 * ring_size - 1 - i):  # the slot: chunk i, then chunk 2R-1-i
        # Rows [start, start + length) of the slot that fall in this chunk.
        begin, end = max(start, 0), min(start + length, chunks[chunk])
        if end > begin:
            ranges.append((chunk_starts[chunk] + begin, end - begin))
        start -= chunks[chunk]
    return ranges or [(0, 0)]


def _usp_gather(x: torch.Tensor, dim: int, grid: _Grid, layout: str, row_lens, slot_lens) -> torch.Tensor:
    """usp_gather once every length is known: the slot over the Ulysses group, then
    the sequence over the ring. Autograd: each rank keeps its piece of the gradient."""
    slot = gather_sequence(x, dim, grid.ulysses_group, sizes=row_lens)
    if layout == "zigzag":
        return _zigzag_gather(slot, dim, grid.ring_group, grid.ring, slot_lens)
    return gather_sequence(slot, dim, grid.ring_group, sizes=slot_lens)


class _UspSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, grid, layout):
        lengths = _layout_lengths(x.shape[dim], grid.ulysses.world_size, grid.ring.world_size, layout)
        ctx.dim, ctx.grid, ctx.layout = dim, grid, layout
        ctx.row_lens, ctx.slot_lens = lengths[grid.ring.rank], [sum(row) for row in lengths]
        ranges = _piece_ranges(x.shape[dim], grid, layout)
        if len(ranges) == 1:
            return x.narrow(dim, *ranges[0])
        return torch.cat([x.narrow(dim, start, length) for start, length in ranges], dim)

    @staticmethod
    def backward(ctx, grad):
        return _usp_gather(grad, ctx.dim, ctx.grid, ctx.layout, ctx.row_lens, ctx.slot_lens), None, None, None


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
    grid = _resolve_grid("usp_split", mesh, ulysses_group, ring_group)

    def local_checks():
        checked_dim = _check_sequence(x, dim, layout, "usp_split")
        return x.shape[checked_dim], (x.dtype, tuple(x.shape), checked_dim, layout), checked_dim

    dim, _, _ = _checked_on_grid("usp_split", grid, device_of(x), True, local_checks)
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
    grid = _resolve_grid("usp_gather", mesh, ulysses_group, ring_group)

    def local_checks():
        checked_dim = _check_sequence(x, dim, layout, "usp_gather")
        others = (tuple(x.shape[:checked_dim]), tuple(x.shape[checked_dim + 1 :]))
        return x.shape[checked_dim], (x.dtype, *others, checked_dim, layout), checked_dim

    dim, row_lens, slot_lens = _checked_on_grid("usp_gather", grid, device_of(x), True, local_checks)
    if layout == "zigzag":
        _check_zigzag_lengths(slot_lens, grid.ring, "usp_gather (the ring slots' lengths)", x.shape)
    return _usp_gather(x, dim, grid, layout, row_lens, slot_lens)
