"""Packed variable-length sequences: documents packed into one sequence, sharded across
ranks, attention kept inside each document.

    plan = varlen_plan(cu_seqlens, group=group, layout="balanced")   # Ulysses or ring
    plan = varlen_plan(cu_seqlens, mesh=mesh, layout="balanced")     # USP
    q_local = plan.split(q, dim=1)            # this rank's tokens, (1, plan.seq_lens[r], H, D)
    out_local = ring_attention(q_local, k_local, v_local, group=group, causal=True, varlen=plan)
    out = plan.gather(out_local, dim=1)

A plan says which tokens every rank holds. Any document lengths (1 included), nothing
padded. The ranks form R ring slots of U Ulysses ranks each (a group: R = P, U = 1 for
ring_attention, and ulysses_attention reads its P pieces in rank order; a mesh: R x U
for usp_attention); a slot's tokens are always in global order, and the U pieces of a
slot are torch.tensor_split of its tokens.

Layouts:
    contiguous  piece p (p = i * U + j) is torch.tensor_split(range(N), R * U)[p]: the
                split_sequence / usp_split pieces.
    balanced    every ring slot gets (close to) N / R tokens and the same causal
                attention work (a token at offset t of its document attends t + 1 keys):
                  - a document too long to place whole is cut as the zigzag layout cuts a
                    sequence, into 2R chunks by torch.tensor_split; the slot that gets
                    chunk c gets chunk 2R-1-c too, so every slot gets one early and one
                    late chunk of it: equal tokens (to a token) and equal work. The pair
                    with the most tokens goes to the least loaded slot.
                  - shorter documents (under 2R tokens, or holding at most 1/64 of a
                    slot's tokens and of its causal work) stay whole, placed longest first
                    on the slot with the least load (tokens and work relative to their
                    targets, summed), which evens out what the cut documents leave.
                Each slot's tokens are then taken in global order. Ulysses splits its work
                by heads, so for ulysses_attention alone the contiguous layout is as
                balanced and saves a reordering of the exchanged sequence.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from seqpar_kernels.comm.groups import GroupInfo, resolve_group
from seqpar_kernels.comm.plan import offsets, tensor_split_sizes
from seqpar_kernels.parallel.checks import CheckedOnEveryRank, _fingerprint, check_tensor, normalize_dim
from seqpar_kernels.parallel.documents import DocumentLayout, document_runs, encode_segments
from seqpar_kernels.parallel.reshard import gather_sequence

LAYOUTS = ("contiguous", "balanced")
# A document stays whole in the balanced layout when it holds at most this share of a
# slot's tokens and of its causal work: placing it whole can then leave a slot at most
# 1/64 over its target.
WHOLE_DOCUMENT_SHARE = 64


# ----------------------------------------------------------------------------------
# Layouts: pure functions of the document lengths (no ranks)
# ----------------------------------------------------------------------------------


def check_cu_seqlens(cu_seqlens) -> tuple[int, ...]:
    """cu_seqlens as a tuple of ints: a 1-D integer tensor or a sequence of ints, from 0,
    strictly increasing (every document at least one token), at least one document.
    Raises ValueError naming what is wrong."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex \
                or cu_seqlens.dtype == torch.bool:
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor or a list of ints, got a tensor of shape "
                f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
            )
        bounds = [int(bound) for bound in cu_seqlens.tolist()]
    else:
        try:
            bounds = list(cu_seqlens)
        except TypeError:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor or a list of ints, got {cu_seqlens!r:.80}")
        if not all(isinstance(bound, int) and not isinstance(bound, bool) for bound in bounds):
            raise ValueError(f"cu_seqlens must hold ints, got {bounds!r:.200}")
    shown = f"{bounds[:8]}{'...' if len(bounds) > 8 else ''} ({len(bounds)} bounds)"
    if len(bounds) < 2:
        raise ValueError(f"cu_seqlens needs at least one document ([0, N]), got {shown}")
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {shown}")
    bad = next((index for index in range(1, len(bounds)) if bounds[index] <= bounds[index - 1]), None)
    if bad is not None:
        raise ValueError(
            f"cu_seqlens must be strictly increasing (every document at least 1 token), but "
            f"cu_seqlens[{bad - 1}] = {bounds[bad - 1]} and cu_seqlens[{bad}] = {bounds[bad]} in {shown}"
        )
    return tuple(bounds)


def _merge(segments):
    """(start, length) ranges sorted, with touching ones joined."""
    merged = []
    for start, length in sorted(segments):
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        elif length > 0:
            merged.append((start, length))
    return merged


def _document_work(offset: int, length: int) -> int:
    """Causal work of `length` tokens from offset `offset` of their document."""
    return length * offset + length * (length + 1) // 2


def balanced_slots(cu_seqlens: Sequence[int], slot_count: int) -> list[list[tuple[int, int]]]:
    """Every slot's (start, length) ranges in the balanced layout (module docstring)."""
    total = cu_seqlens[-1]
    if slot_count == 1:
        return [[(0, total)]]
    lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    token_target = total / slot_count
    work_target = sum(_document_work(0, length) for length in lengths) / slot_count
    tokens, work = [0] * slot_count, [0] * slot_count
    segments: list[list[tuple[int, int]]] = [[] for _ in range(slot_count)]

    def place(slot, start, offset, length):
        segments[slot].append((start, length))
        tokens[slot] += length
        work[slot] += _document_work(offset, length)

    whole = []
    for document, length in enumerate(lengths):
        start = cu_seqlens[document]
        small = length * WHOLE_DOCUMENT_SHARE <= token_target and \
            _document_work(0, length) * WHOLE_DOCUMENT_SHARE <= work_target
        if length < 2 * slot_count or small:
            whole.append(document)
            continue
        chunk_lengths = tensor_split_sizes(length, 2 * slot_count)
        chunk_offsets = offsets(chunk_lengths)
        # Pair p is chunks p and 2R-1-p; the first pairs are the longest (tensor_split
        # makes the first chunks one token longer): they go to the least loaded slots.
        by_load = sorted(range(slot_count), key=lambda slot: (tokens[slot], work[slot], slot))
        for pair, slot in enumerate(by_load):
            for chunk in (pair, 2 * slot_count - 1 - pair):
                place(slot, start + chunk_offsets[chunk], chunk_offsets[chunk], chunk_lengths[chunk])
    for document in sorted(whole, key=lambda document: (-lengths[document], document)):
        length = lengths[document]
        slot = min(
            range(slot_count),
            key=lambda slot: ((tokens[slot] + length) / token_target
                              + (work[slot] + _document_work(0, length)) / max(work_target, 1), slot),
        )  # fmt: skip
        place(slot, cu_seqlens[document], 0, length)
    return [_merge(slot) for slot in segments]


def _slice(segments, start: int, length: int) -> list[tuple[int, int]]:
    """Local rows [start, start + length) of a slot holding `segments`, as global ranges."""
    sliced, local = [], 0
    for segment_start, segment_length in segments:
        low, high = max(start, local), min(start + length, local + segment_length)
        if low < high:
            sliced.append((segment_start + low - local, high - low))
        local += segment_length
    return sliced


class VarlenLayout:
    """Which tokens every rank holds: R ring slots of U pieces (piece p = i * U + j).
    Pure: no ranks, no groups (varlen_plan adds those). Attributes:
        cu_seqlens       the document bounds, a tuple of ints
        layout           "contiguous" or "balanced"
        pieces           every piece's (start, length) global ranges, increasing
        seq_lens         every piece's token count
        documents        the DocumentLayout of the ring slots (what the ring ops take)
        work_imbalance   max over mean of the slots' causal work (1.0 when even)
        token_imbalance  max over mean of the slots' tokens"""

    def __init__(self, cu_seqlens, *, ring_size: int, ulysses_size: int = 1, layout: str = "contiguous"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        for name, size in (("ring_size", ring_size), ("ulysses_size", ulysses_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        self.cu_seqlens = check_cu_seqlens(cu_seqlens)
        self.layout, self.ring_size, self.ulysses_size = layout, ring_size, ulysses_size
        total, piece_count = self.cu_seqlens[-1], ring_size * ulysses_size
        if layout == "contiguous":
            sizes = tensor_split_sizes(total, piece_count)
            self.pieces = tuple(((start, size),) if size else () for start, size in zip(offsets(sizes), sizes))
        else:
            pieces = []
            for slot in balanced_slots(self.cu_seqlens, ring_size):
                slot_sizes = tensor_split_sizes(sum(length for _, length in slot), ulysses_size)
                pieces += [tuple(_slice(slot, start, size)) for start, size in zip(offsets(slot_sizes), slot_sizes)]
            self.pieces = tuple(pieces)
        self.seq_lens = [sum(length for _, length in piece) for piece in self.pieces]
        slots = [
            _merge([segment for piece in self.pieces[i * ulysses_size : (i + 1) * ulysses_size] for segment in piece])
            for i in range(ring_size)
        ]  # fmt: skip
        self.documents = DocumentLayout(self.cu_seqlens, slots)
        works = [self.documents.work(slot) for slot in range(ring_size)]
        self.work_imbalance = float(max(works) / (sum(works) / ring_size)) if sum(works) else 1.0
        slot_tokens = self.documents.lengths
        self.token_imbalance = float(max(slot_tokens) / (sum(slot_tokens) / ring_size))

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def in_global_order(self) -> bool:
        """Whether the pieces concatenated in piece order are the sequence in order."""
        segments = [segment for piece in self.pieces for segment in piece]
        return all(a[0] + a[1] == b[0] for a, b in zip(segments, segments[1:]))

    def concatenated_positions(self) -> torch.Tensor:
        """(N,) int64: the global position of each token of the pieces concatenated in
        piece order (what a Ulysses exchange gathers)."""
        return torch.cat([torch.arange(start, start + length) for piece in self.pieces for start, length in piece])

    def position_ids(self, piece: int) -> torch.Tensor:
        """(1, seq_lens[piece]) int64: each token's offset within its document."""
        runs = document_runs(self.pieces[piece], self.cu_seqlens)
        if not runs:
            return torch.zeros(1, 0, dtype=torch.int64)
        first = [run.start - self.cu_seqlens[run.document] for run in runs]
        return torch.cat([torch.arange(offset, offset + run.length) for offset, run in zip(first, runs)]).unsqueeze(0)

    def padding_of_per_document_zigzag(self) -> int:
        """Tokens the per-document zigzag of other libraries would pad: every document to
        a multiple of 2 x (sequence-parallel degree) (R x U ranks)."""
        multiple = 2 * self.ring_size * self.ulysses_size
        return sum(-(end - start) % multiple for start, end in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))


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
        self.segments_tensor = encode_segments(layout.documents.segments)

    @property
    def on_mesh(self) -> bool:
        return self.grid is not None

    @property
    def total(self) -> int:
        return self.layout.total

    def __repr__(self) -> str:
        where = f"mesh R={self.layout.ring_size} x U={self.layout.ulysses_size}" if self.on_mesh \
            else f"group of {self.layout.ring_size}"
        return (f"VarlenPlan({len(self.layout.cu_seqlens) - 1} documents, {self.total} tokens, {where}, "
                f"layout={self.layout.layout!r}, seq_lens={self.seq_lens}, "
                f"work_imbalance={self.work_imbalance:.3f})")

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
        return self._gather(x_local, dim)

    def _gather(self, x_local, dim):
        layout = self.layout
        if self.on_mesh:
            ulysses, ring = layout.ulysses_size, layout.ring_size
            row_lens = self.seq_lens[self.grid.ring.rank * ulysses : (self.grid.ring.rank + 1) * ulysses]
            slot = gather_sequence(x_local, dim, self.grid.ulysses_group, sizes=row_lens)
            slot_lens = [sum(self.seq_lens[i * ulysses : (i + 1) * ulysses]) for i in range(ring)]
            concatenated = gather_sequence(slot, dim, self.grid.ring_group, sizes=slot_lens)
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
        return ctx.plan._gather(grad, ctx.dim), None, None


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
    if mesh is not None or ulysses_group is not None or ring_group is not None:
        from seqpar_kernels.parallel.usp import _checked_on_grid, _resolve_grid

        grid = _resolve_grid("varlen_plan", mesh, ulysses_group, ring_group)
        holder: list = []

        def local_checks():
            holder.append(VarlenLayout(cu_seqlens, ring_size=grid.ring.world_size,
                                       ulysses_size=grid.ulysses.world_size, layout=layout))
            return 0, (_fingerprint(holder[0].cu_seqlens), layout), None

        _checked_on_grid("varlen_plan", grid, _device(cu_seqlens), True, local_checks)
        return VarlenPlan(holder[0], grid.piece, grid=grid, device=device)
    info: GroupInfo = resolve_group(group)
    with CheckedOnEveryRank("varlen_plan", info, _device(cu_seqlens), exchange=True) as checks:
        plan_layout = VarlenLayout(cu_seqlens, ring_size=info.world_size, layout=layout)
        checks.share(0, (_fingerprint(plan_layout.cu_seqlens), layout))
    return VarlenPlan(plan_layout, info.rank, group=group, device=device)


def _device(cu_seqlens):
    return cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None


def check_varlen_call(describe: str, plan, q: torch.Tensor, piece: int, on_mesh: bool) -> None:
    """The local checks of an attention call given varlen=plan: a VarlenPlan of the right
    kind, batch 1, this rank's token count."""
    if not isinstance(plan, VarlenPlan):
        raise ValueError(f"{describe}: varlen must be a VarlenPlan (varlen_plan(...)), got {type(plan).__name__}")
    if plan.on_mesh != on_mesh:
        made = "a mesh (usp_attention's)" if plan.on_mesh else "a group (ring or Ulysses)"
        raise ValueError(f"{describe}: varlen is a plan for {made}; build it with varlen_plan("
                         f"{'mesh=...' if on_mesh else 'group=...'})")
    if q.shape[0] != 1:
        raise ValueError(
            f"{describe}: packed sequences (varlen) take batch 1, the documents packed along the "
            f"sequence; got q of shape {tuple(q.shape)}"
        )
    if q.shape[1] != plan.seq_lens[piece]:
        raise ValueError(
            f"{describe}: q holds {q.shape[1]} tokens (shape {tuple(q.shape)}) where the varlen plan puts "
            f"{plan.seq_lens[piece]} on this rank ({piece}); every rank's: {plan.seq_lens}"
        )



def check_varlen_group(describe: str, plan, q, info: GroupInfo, seq_lens) -> None:
    """Local checks of a one-group attention call given varlen=plan: a group plan on
    this group, batch 1, this rank's token count, seq_lens (if given) the plan's."""
    check_varlen_call(describe, plan, q, info.rank, on_mesh=False)
    plan_info = resolve_group(plan.group)
    if (plan_info.name, plan_info.world_size) != (info.name, info.world_size):
        raise ValueError(
            f"{describe}: the varlen plan was made for group {plan_info.name!r} of {plan_info.world_size} "
            f"ranks, the call runs on {info.name!r} of {info.world_size}"
        )
    if seq_lens is not None and list(seq_lens) != plan.seq_lens:
        raise ValueError(f"{describe}: seq_lens={list(seq_lens)} differs from the varlen plan's {plan.seq_lens}")


__all__ = ["varlen_plan", "VarlenPlan", "VarlenLayout", "LAYOUTS"]
