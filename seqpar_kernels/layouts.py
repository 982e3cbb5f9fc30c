"""Which rank holds which rows: every layout of the package, as pure functions.

No process groups and no torch.distributed here: a layout is a function of lengths and
rank indices, and every path (the split and gather functions, the ring's schedule, the
USP grid, the varlen plan) asks this module instead of re-deriving it.

    tensor_split_sizes(N, P)          piece sizes of torch.tensor_split: the first N % P
                                      pieces one row longer
    zigzag (P ranks)                  the sequence is cut into 2P chunks by tensor_split;
                                      rank r holds chunks r and 2P-1-r, in that order
    dense_slot_segments(lengths, z)   every ring slot's global (start, length) ranges,
                                      contiguous or zigzag
    USP (R ring slots x U Ulysses)    piece p = i * U + j; a slot is a ring slot's rows
                                      (contiguous: consecutive pieces; zigzag: the ring's
                                      zigzag piece of slot i), cut by tensor_split over U
    packed documents (VarlenLayout)   documents [cu_seqlens[d], cu_seqlens[d + 1]) placed
                                      on R slots of U pieces, contiguous or balanced

A slot's or a piece's rows are always its global ranges in increasing order ("segments":
(start, length) pairs), so a rank's local row order is global order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

Segments = tuple[tuple[int, int], ...]


# ----------------------------------------------------------------------------------
# torch.tensor_split pieces
# ----------------------------------------------------------------------------------


def tensor_split_sizes(total: int, world_size: int) -> list[int]:
    """torch.tensor_split's piece sizes: the first total % world_size pieces one longer."""
    # // and %, not divmod: torch.compile traces a size that changed since the last
    # call as a symbolic int, which divmod cannot take.
    base, extra = total // world_size, total % world_size
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Exclusive prefix sums: where each piece starts."""
    return [0, *itertools.accumulate(sizes)][:-1]


def tensor_split_ranges(total: int, world_size: int) -> tuple[list[int], list[int]]:
    """(starts, lengths) of torch.tensor_split(range(total), world_size)."""
    sizes = tensor_split_sizes(total, world_size)
    return offsets(sizes), sizes


def merge_segments(segments) -> Segments:
    """(start, length) ranges sorted, empty ones dropped, touching ones joined."""
    merged: list[tuple[int, int]] = []
    for start, length in sorted(segments):
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        elif length > 0:
            merged.append((start, length))
    return tuple(merged)


def slice_segments(segments: Sequence[tuple[int, int]], start: int, length: int) -> Segments:
    """Local rows [start, start + length) of a holder of `segments`, as global ranges."""
    sliced, local = [], 0
    for segment_start, segment_length in segments:
        low, high = max(start, local), min(start + length, local + segment_length)
        if low < high:
            sliced.append((segment_start + low - local, high - low))
        local += segment_length
    return tuple(sliced)


# ----------------------------------------------------------------------------------
# Zigzag: chunks r and 2P-1-r of 2P
# ----------------------------------------------------------------------------------


def zigzag_chunks(rank: int, world_size: int) -> tuple[int, int]:
    """The two chunks rank `rank` holds in the zigzag layout, in its row order."""
    return rank, 2 * world_size - 1 - rank


def zigzag_chunk_lengths(total: int, world_size: int) -> list[int]:
    """The lengths of the 2P zigzag chunks of `total` rows (torch.tensor_split's cut)."""
    return tensor_split_sizes(total, 2 * world_size)


def zigzag_piece_lengths(total: int, world_size: int) -> list[int]:
    """Every rank's local length in the zigzag layout of `total` rows."""
    chunks = zigzag_chunk_lengths(total, world_size)
    return [sum(chunks[chunk] for chunk in zigzag_chunks(rank, world_size)) for rank in range(world_size)]


def zigzag_segments(total: int, world_size: int, rank: int) -> Segments:
    """Rank `rank`'s global ranges in the zigzag layout of `total` rows."""
    chunks = zigzag_chunk_lengths(total, world_size)
    starts = offsets(chunks)
    return tuple((starts[chunk], chunks[chunk]) for chunk in zigzag_chunks(rank, world_size) if chunks[chunk])


def dense_slot_segments(lengths: Sequence[int], zigzag: bool) -> tuple[Segments, ...]:
    """Every slot's global ranges for slots holding `lengths` rows of one sequence:
    contiguous (slot r after slots 0..r-1) or the zigzag layout of their sum."""
    if zigzag:
        total, world_size = sum(lengths), len(lengths)
        return tuple(zigzag_segments(total, world_size, rank) for rank in range(world_size))
    return tuple(((start, length),) if length else () for start, length in zip(offsets(lengths), lengths))


# ----------------------------------------------------------------------------------
# USP: R ring slots x U Ulysses ranks
# ----------------------------------------------------------------------------------


def usp_piece_lengths(total: int, ulysses_size: int, ring_size: int, zigzag: bool) -> list[list[int]]:
    """lengths[i][j]: the rows of the piece at ring index i, Ulysses index j, of a
    sequence of `total` rows (contiguous: piece i * U + j of tensor_split into R * U;
    zigzag: piece j of tensor_split of ring slot i's zigzag rows)."""
    if not zigzag:
        return usp_rows(tensor_split_sizes(total, ring_size * ulysses_size), ulysses_size)
    return [tensor_split_sizes(slot, ulysses_size) for slot in zigzag_piece_lengths(total, ring_size)]


def usp_rows(per_piece: Sequence[int], ulysses_size: int) -> list[list[int]]:
    """A per-piece list (piece i * U + j) as rows: rows[i][j] is ring slot i's Ulysses
    index j's; sum(rows[i]) is slot i's total when the values are lengths."""
    return [list(per_piece[start : start + ulysses_size]) for start in range(0, len(per_piece), ulysses_size)]


def usp_piece_segments(
    total: int, ulysses_size: int, ring_size: int, ring_index: int, ulysses_index: int, zigzag: bool
) -> Segments:
    """The global ranges of the piece at (ring_index, ulysses_index), in order: piece j of
    torch.tensor_split of its ring slot's rows (usp_piece_lengths)."""
    if zigzag:
        slot = zigzag_segments(total, ring_size, ring_index)
    else:
        lengths = usp_piece_lengths(total, ulysses_size, ring_size, False)
        slot = ((sum(map(sum, lengths[:ring_index])), sum(lengths[ring_index])),)
    starts, sizes = tensor_split_ranges(sum(length for _, length in slot), ulysses_size)
    return slice_segments(slot, starts[ulysses_index], sizes[ulysses_index])


# ----------------------------------------------------------------------------------
# Packed documents
# ----------------------------------------------------------------------------------

VARLEN_LAYOUTS = ("contiguous", "balanced")
# A document stays whole in the balanced layout when it holds at most this share of a
# slot's tokens and of its causal work: placing it whole can then leave a slot at most
# 1/64 over its target.
WHOLE_DOCUMENT_SHARE = 64


@dataclass(frozen=True)
class Run:
    """A stretch of one document held by one slot: `length` tokens from global position
    `start`, at local row `local_start` of the slot."""

    local_start: int
    start: int
    length: int
    document: int


def last_at_or_before(bounds: Sequence[int], position: int) -> int:
    """The index of the last of the increasing `bounds` at or before `position`
    (bisect_right - 1), in Python: torch.compile traces it, not the C bisect."""
    low, high = 0, len(bounds)
    while low < high:
        middle = (low + high) // 2
        if bounds[middle] <= position:
            low = middle + 1
        else:
            high = middle
    return low - 1


def document_runs(segments, cu_seqlens: Sequence[int]) -> tuple[Run, ...]:
    """The runs of a holder of `segments` ((start, length) global ranges, increasing)
    of a sequence whose documents are bounded by `cu_seqlens`."""
    runs, local = [], 0
    for start, length in segments:
        position, end = start, start + length
        document = last_at_or_before(cu_seqlens, position)
        while position < end:
            stop = min(end, cu_seqlens[document + 1])
            runs.append(Run(local, position, stop - position, document))
            local += stop - position
            position, document = stop, document + 1
    return tuple(runs)


def causal_work(offset: int, length: int) -> int:
    """Query-key pairs of `length` tokens from offset `offset` of their document under a
    causal mask (the token at offset t sees t + 1 keys)."""
    return length * offset + length * (length + 1) // 2


def segments_causal_work(segments, cu_seqlens: Sequence[int]) -> int:
    """Query-key pairs a holder of `segments` attends under a causal mask inside the
    documents bounded by `cu_seqlens`."""
    return sum(causal_work(run.start - cu_seqlens[run.document], run.length)
               for run in document_runs(segments, cu_seqlens))  # fmt: skip


def check_cu_seqlens(cu_seqlens) -> tuple[int, ...]:
    """cu_seqlens as a tuple of ints: a 1-D integer tensor or a sequence of ints, from 0,
    strictly increasing (every document at least one token), at least one document.
    Raises ValueError naming what is wrong."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex \
                or cu_seqlens.dtype == torch.bool:  # fmt: skip
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor or a list of ints, got a tensor of shape "
                f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
            )
        bounds = [int(bound) for bound in cu_seqlens.tolist()]
    else:
        try:
            bounds = list(cu_seqlens)
        except TypeError:
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor or a list of ints, got {cu_seqlens!r:.80}"
            ) from None
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


def balanced_slots(cu_seqlens: Sequence[int], slot_count: int) -> list[Segments]:
    """Every slot's (start, length) ranges in the balanced layout (VarlenLayout)."""
    total = cu_seqlens[-1]
    if slot_count == 1:
        return [((0, total),)]
    lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    token_target = total / slot_count
    work_target = sum(causal_work(0, length) for length in lengths) / slot_count
    tokens, work = [0] * slot_count, [0] * slot_count
    segments: list[list[tuple[int, int]]] = [[] for _ in range(slot_count)]

    def place(slot, start, offset, length):
        segments[slot].append((start, length))
        tokens[slot] += length
        work[slot] += causal_work(offset, length)

    whole = []
    for document, length in enumerate(lengths):
        start = cu_seqlens[document]
        small = length * WHOLE_DOCUMENT_SHARE <= token_target and \
            causal_work(0, length) * WHOLE_DOCUMENT_SHARE <= work_target  # fmt: skip
        if length < 2 * slot_count or small:
            whole.append(document)
            continue
        chunk_lengths = tensor_split_sizes(length, 2 * slot_count)
        chunk_offsets = offsets(chunk_lengths)
        # Pair p is chunks p and 2R-1-p (zigzag_chunks); the first pairs are the longest
        # (tensor_split makes the first chunks one token longer): they go to the least
        # loaded slots.
        by_load = sorted(range(slot_count), key=lambda slot: (tokens[slot], work[slot], slot))
        for pair, slot in enumerate(by_load):
            for chunk in zigzag_chunks(pair, slot_count):
                place(slot, start + chunk_offsets[chunk], chunk_offsets[chunk], chunk_lengths[chunk])
    for document in sorted(whole, key=lambda document: (-lengths[document], document)):
        length = lengths[document]
        slot = min(
            range(slot_count),
            key=lambda slot: ((tokens[slot] + length) / token_target
                              + (work[slot] + causal_work(0, length)) / max(work_target, 1), slot),
        )  # fmt: skip
        place(slot, cu_seqlens[document], 0, length)
    return [merge_segments(slot) for slot in segments]


class VarlenLayout:
    """Which tokens every rank holds: R ring slots of U pieces (piece p = i * U + j) of a
    packed sequence of documents. Pure: no ranks, no groups (varlen_plan adds those).

    Layouts:
        contiguous  piece p is torch.tensor_split(range(N), R * U)[p]: the split_sequence
                    / usp_split pieces.
        balanced    every ring slot gets (close to) N / R tokens and the same causal
                    attention work (a token at offset t of its document attends t + 1 keys):
                      - a document too long to place whole is cut as the zigzag layout cuts
                        a sequence, into 2R chunks by torch.tensor_split; the slot that gets
                        chunk c gets chunk 2R-1-c too, so every slot gets one early and one
                        late chunk of it: equal tokens (to a token) and equal work. The pair
                        with the most tokens goes to the least loaded slot.
                      - shorter documents (under 2R tokens, or holding at most
                        1/WHOLE_DOCUMENT_SHARE of a slot's tokens and work) stay whole and go,
                        longest first, to the least loaded slot.
                    Each slot's tokens are then taken in global order.
    A slot's U pieces are torch.tensor_split of its tokens.

    Attributes:
        cu_seqlens       the document bounds, a tuple of ints
        layout           "contiguous" or "balanced"
        pieces           every piece's (start, length) global ranges, increasing
        slots            every ring slot's ranges (its pieces' together)
        seq_lens         every piece's token count
        work_imbalance   max over mean of the slots' causal work (1.0 when even)
        token_imbalance  max over mean of the slots' tokens"""

    def __init__(self, cu_seqlens, *, ring_size: int, ulysses_size: int = 1, layout: str = "contiguous"):
        if layout not in VARLEN_LAYOUTS:
            raise ValueError(f"layout must be one of {VARLEN_LAYOUTS}, got {layout!r}")
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
                starts, sizes = tensor_split_ranges(sum(length for _, length in slot), ulysses_size)
                pieces += [slice_segments(slot, start, size) for start, size in zip(starts, sizes)]
            self.pieces = tuple(pieces)
        self.seq_lens = [sum(length for _, length in piece) for piece in self.pieces]
        self.slots = tuple(
            merge_segments(segment for piece in self.pieces[i * ulysses_size : (i + 1) * ulysses_size]
                           for segment in piece)
            for i in range(ring_size)
        )  # fmt: skip
        works = [segments_causal_work(slot, self.cu_seqlens) for slot in self.slots]
        self.work_imbalance = float(max(works) / (sum(works) / ring_size)) if sum(works) else 1.0
        slot_tokens = [sum(length for _, length in slot) for slot in self.slots]
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
