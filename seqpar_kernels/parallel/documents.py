"""Packed documents as attention sees them: which query rows attend which key rows.

A packed sequence of N tokens holds documents [cu_seqlens[d], cu_seqlens[d + 1]); a
token attends only the tokens of its own document (causal: those at or before it). The
sequence is cut into slots (the ranks of a ring; one slot for a single process), each
slot holding some ranges of global positions, its `segments`, in increasing order: a
slot's local rows are its tokens in global order.

For one ring step (the queries of slot r against the key block of slot s) this module
gives the attention in two forms, both exact:

    block pairs   (query rows, key rows, causal or full) rectangles, one per stretch of
                  a document held by both slots; the CPU path hands them to aten's flash
                  kernel, neighbouring small ones joined into one masked call.
    intervals     per query row the key rows it attends, [row_start, row_end), and per
                  key row the query rows that attend it, [col_start, col_end): what the
                  Triton step kernels take (MASK_INTERVALS), one launch per step. Both
                  are intervals because a slot's rows are in global order and a
                  document is a range of positions.

A step with no document in common (or, causal, none of whose keys precede a query)
has no mask at all: it computes nothing.

DocumentLayout holds a layout's runs (segments cut at document boundaries) and caches
its step masks; layout_of finds it from the tensors the ring ops carry.
"""

from __future__ import annotations

import bisect
import collections
import functools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Run:
    """A stretch of one document held by one slot: `length` tokens from global position
    `start`, at local row `local_start` of the slot."""

    local_start: int
    start: int
    length: int
    document: int


@dataclass(frozen=True)
class BlockPair:
    """Query rows [q_start, +q_len) against key rows [kv_start, +kv_len) of the block:
    all of them (causal=False) or the causal diagonal (causal=True: the same global
    positions on both sides)."""

    q_start: int
    q_len: int
    kv_start: int
    kv_len: int
    causal: bool


def document_runs(segments, cu_seqlens) -> tuple[Run, ...]:
    """The runs of a slot holding `segments` ((start, length) global ranges, in
    increasing order) of a sequence whose documents are bounded by `cu_seqlens`."""
    runs, local = [], 0
    for start, length in segments:
        position, end = start, start + length
        document = bisect.bisect_right(cu_seqlens, position) - 1
        while position < end:
            stop = min(end, cu_seqlens[document + 1])
            runs.append(Run(local, position, stop - position, document))
            local += stop - position
            position, document = stop, document + 1
    return tuple(runs)


def block_pairs(q_runs, k_runs, causal: bool, same_slot: bool) -> tuple[BlockPair, ...]:
    """The BlockPairs of the queries of `q_runs` against the keys of `k_runs`: one per
    pair of runs of one document whose keys a query may see. same_slot: the two are one
    slot's runs (step 0), where a run meets itself on the causal diagonal."""
    by_document = collections.defaultdict(list)
    for run in k_runs:
        by_document[run.document].append(run)
    pairs = []
    for q_run in q_runs:
        for k_run in by_document.get(q_run.document, ()):
            if not causal or k_run.start + k_run.length <= q_run.start:
                pairs.append(BlockPair(q_run.local_start, q_run.length, k_run.local_start, k_run.length, False))
            elif same_slot and k_run.start == q_run.start:
                pairs.append(BlockPair(q_run.local_start, q_run.length, k_run.local_start, k_run.length, True))
            else:
                # Runs of different slots (or different runs of one slot) are disjoint
                # ranges: this one lies wholly after the query run.
                assert k_run.start >= q_run.start + q_run.length, (q_run, k_run)
    return tuple(pairs)


@dataclass(frozen=True)
class MaskedBlock:
    """One call of a CPU step kernel: query rows [q_start, +q_len) against key rows
    [kv_start, +kv_len). mask None: all of them (causal: the diagonal); else an fp32
    (q_len, kv_len) additive mask, 0 where a query attends a key and -inf elsewhere,
    with empty_rows (q_len,) bool marking the rows that attend none of these keys."""

    q_start: int
    q_len: int
    kv_start: int
    kv_len: int
    causal: bool
    mask: torch.Tensor | None = None
    empty_rows: torch.Tensor | None = None


# Pairs are joined into one masked call while the rectangle around them holds at most
# twice their own elements plus this many: a kernel call costs about as much as a few
# thousand masked score elements, so hundreds of short documents become a few calls
# (bench varlen on 4 CPU ranks: one call per pair made the balanced layout, with its
# cut documents, 2.4x slower than the contiguous one).
_JOIN_SLACK_ELEMENTS = 4096


def coalesce(pairs) -> tuple[MaskedBlock, ...]:
    """The BlockPairs of one step as kernel calls: neighbouring pairs (in query order)
    joined into masked rectangles where that wastes little compute (_JOIN_SLACK_ELEMENTS)."""
    groups: list[list[BlockPair]] = []
    for pair in sorted(pairs, key=lambda pair: (pair.q_start, pair.kv_start)):
        if groups:
            joined = groups[-1] + [pair]
            q_low = min(p.q_start for p in joined)
            q_high = max(p.q_start + p.q_len for p in joined)
            kv_low = min(p.kv_start for p in joined)
            kv_high = max(p.kv_start + p.kv_len for p in joined)
            own = sum(p.q_len * p.kv_len for p in joined)
            if (q_high - q_low) * (kv_high - kv_low) <= 2 * own + _JOIN_SLACK_ELEMENTS:
                groups[-1] = joined
                continue
        groups.append([pair])
    return tuple(_masked_block(group) for group in groups)


def _masked_block(group: list[BlockPair]) -> MaskedBlock:
    if len(group) == 1:
        pair = group[0]
        return MaskedBlock(pair.q_start, pair.q_len, pair.kv_start, pair.kv_len, pair.causal)
    q_low = min(pair.q_start for pair in group)
    kv_low = min(pair.kv_start for pair in group)
    q_len = max(pair.q_start + pair.q_len for pair in group) - q_low
    kv_len = max(pair.kv_start + pair.kv_len for pair in group) - kv_low
    attends = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for pair in group:
        block = torch.ones(pair.q_len, pair.kv_len, dtype=torch.bool)
        rows = slice(pair.q_start - q_low, pair.q_start - q_low + pair.q_len)
        columns = slice(pair.kv_start - kv_low, pair.kv_start - kv_low + pair.kv_len)
        attends[rows, columns] = block.tril() if pair.causal else block
    mask = torch.zeros(q_len, kv_len).masked_fill_(~attends, float("-inf"))
    return MaskedBlock(q_low, q_len, kv_low, kv_len, False, mask, ~attends.any(1))


def _positions(runs) -> tuple[torch.Tensor, torch.Tensor]:
    """(global position, document) of every local row of a slot, int64."""
    if not runs:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    positions = torch.cat([torch.arange(run.start, run.start + run.length) for run in runs])
    documents = torch.repeat_interleave(
        torch.tensor([run.document for run in runs]), torch.tensor([run.length for run in runs])
    )
    return positions, documents


def step_intervals(q_runs, k_runs, cu_seqlens, causal: bool) -> tuple[torch.Tensor, ...]:
    """(row_start, row_end, col_start, col_end), int32 CPU tensors: query row i attends
    key rows [row_start[i], row_end[i]), key row j is attended by query rows
    [col_start[j], col_end[j]). Both sides' rows are in global order, so each is a
    search among the other side's positions."""
    bounds = torch.tensor(cu_seqlens, dtype=torch.int64)
    q_positions, q_documents = _positions(q_runs)
    k_positions, k_documents = _positions(k_runs)
    # Query at position g of document d sees keys in [start(d), g + 1) causal, else
    # [start(d), end(d)); a key at position g of document d is seen by the queries in
    # [g, end(d)) causal, else [start(d), end(d)).
    row_start = torch.searchsorted(k_positions, bounds[q_documents])
    row_end = torch.searchsorted(k_positions, q_positions + 1 if causal else bounds[q_documents + 1])
    col_start = torch.searchsorted(q_positions, k_positions if causal else bounds[k_documents])
    col_end = torch.searchsorted(q_positions, bounds[k_documents + 1])
    return tuple(t.to(torch.int32) for t in (row_start, row_end, col_start, col_end))


@dataclass
class StepMask:
    """Which query rows attend which key rows in one step (see the module docstring).
    Without runs (a dense sequence's step) the pairs say it all and there are no
    intervals: the step kernels' FULL and CAUSAL modes compute each pair."""

    pairs: tuple[BlockPair, ...]
    q_runs: tuple[Run, ...] | None = None
    k_runs: tuple[Run, ...] | None = None
    cu_seqlens: tuple[int, ...] | None = None
    causal: bool = False
    _intervals: dict = field(default_factory=dict, repr=False)

    @property
    def has_intervals(self) -> bool:
        return self.q_runs is not None

    @functools.cached_property
    def blocks(self) -> tuple[MaskedBlock, ...]:
        """The step as CPU kernel calls (coalesce)."""
        return coalesce(self.pairs)

    def intervals(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The step's intervals on `device` (computed once per device)."""
        assert self.has_intervals
        key = str(device)
        if key not in self._intervals:
            intervals = step_intervals(self.q_runs, self.k_runs, self.cu_seqlens, self.causal)
            self._intervals[key] = tuple(t.to(device) for t in intervals)
        return self._intervals[key]


class DocumentLayout:
    """The slots of a packed sequence: cu_seqlens (document bounds, from 0 to N) and each
    slot's segments ((start, length) global ranges, increasing). Caches the step masks."""

    def __init__(self, cu_seqlens, segments):
        self.cu_seqlens = tuple(int(bound) for bound in cu_seqlens)
        self.segments = tuple(tuple((int(start), int(length)) for start, length in slot) for slot in segments)
        self.runs = tuple(document_runs(slot, self.cu_seqlens) for slot in self.segments)
        self.lengths = tuple(sum(length for _, length in slot) for slot in self.segments)
        # Per instance, not functools.lru_cache on the method: that cache would keep every
        # layout (and its intervals on the GPU) alive after layout_of's cache drops it.
        self._step_masks: dict = {}

    def work(self, slot: int) -> int:
        """Query-key pairs slot `slot`'s tokens attend under a causal mask (a token at
        offset p of its document sees p + 1 keys)."""
        return sum(
            run.length * (run.start - self.cu_seqlens[run.document]) + run.length * (run.length + 1) // 2
            for run in self.runs[slot]
        )

    def step_mask(self, q_slot: int, k_slot: int, causal: bool) -> StepMask | None:
        """The StepMask of slot q_slot's queries against slot k_slot's keys, or None
        when no query attends any of the keys (computed once per layout: every layer
        asks again)."""
        key = (q_slot, k_slot, causal)
        if key not in self._step_masks:
            pairs = block_pairs(self.runs[q_slot], self.runs[k_slot], causal, q_slot == k_slot)
            mask = StepMask(pairs, self.runs[q_slot], self.runs[k_slot], self.cu_seqlens, causal) if pairs else None
            self._step_masks[key] = mask
        return self._step_masks[key]


def encode_segments(segments) -> torch.Tensor:
    """Every slot's segments as one (count, 3) int64 CPU tensor of (slot, start, length)
    rows: how the ring ops carry a layout (a tensor, so that a new layout is new data
    for torch.compile, not a new graph)."""
    rows = [(slot, start, length) for slot, ranges in enumerate(segments) for start, length in ranges]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 3)


_LAYOUT_CACHE: collections.OrderedDict = collections.OrderedDict()
_LAYOUT_CACHE_SIZE = 8  # a model's layers share one layout per batch


def layout_of(cu_seqlens: torch.Tensor, segments: torch.Tensor, slot_count: int) -> DocumentLayout:
    """The DocumentLayout of the tensors a ring op carries (cu_seqlens: (D + 1,) int;
    segments: encode_segments' rows for slot_count slots), from a small cache: every
    layer of a model calls with the same layout."""
    bounds, rows = cu_seqlens.tolist(), segments.tolist()
    key = (tuple(bounds), tuple(map(tuple, rows)), slot_count)
    layout = _LAYOUT_CACHE.get(key)
    if layout is None:
        per_slot = [[] for _ in range(slot_count)]
        for slot, start, length in rows:
            per_slot[slot].append((start, length))
        layout = DocumentLayout(bounds, per_slot)
        _LAYOUT_CACHE[key] = layout
        if len(_LAYOUT_CACHE) > _LAYOUT_CACHE_SIZE:
            _LAYOUT_CACHE.popitem(last=False)
    else:
        _LAYOUT_CACHE.move_to_end(key)
    return layout
