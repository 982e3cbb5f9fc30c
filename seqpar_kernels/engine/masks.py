"""Attention masks: which query rows attend which key rows, and what one ring step computes.

    AttentionMask(causal, cu_seqlens)   which global positions see which: everything, or
                                        causal (keys at or before the query), either inside
                                        each document of a packed sequence when cu_seqlens
                                        bounds documents. Every mask the package takes keeps
                                        the keys a query sees one interval of positions
                                        (key_bounds) and the queries that see a key one
                                        interval (query_bounds): what the step kernels take.
    StepMasks(mask, slots)              the mask cut into ring steps, slots holding global
                                        ranges (seqpar_kernels.layouts): step(q_slot, k_slot)
                                        is what slot q_slot's queries compute against slot
                                        k_slot's keys, as a StepMask (None: nothing).

A StepMask gives one step's attention in two forms, both exact:

    block pairs   (query rows, key rows, causal diagonal or full) rectangles; the CPU path
                  hands them to aten's flash kernel, neighbouring small ones joined into one
                  masked call (coalesce). A dense sequence's step is one or two of them: all
                  of q against all or the first chunk of the block, or the causal diagonal.
    intervals     per query row the key rows it attends, [row_start, row_end), and per key
                  row the query rows that attend it, [col_start, col_end): what the Triton
                  step kernels take (MASK_INTERVALS), one launch per step. Both are
                  intervals because a slot's rows are in global order and what a query sees
                  is an interval of positions. Used for packed documents (uses_intervals).
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from seqpar_kernels.layouts import Run, document_runs

# ----------------------------------------------------------------------------------
# The mask
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionMask:
    """Which key positions each query position attends, over a sequence of global
    positions: all of them, or causal (key <= query); with cu_seqlens (document bounds,
    from 0 to the total, increasing) only those of its own document."""

    causal: bool
    cu_seqlens: tuple[int, ...] | None = None

    @property
    def has_documents(self) -> bool:
        return self.cu_seqlens is not None

    def document_bounds(self, total: int) -> tuple[int, ...]:
        """cu_seqlens, or one document of `total` positions."""
        return self.cu_seqlens if self.cu_seqlens is not None else (0, total)

    def key_bounds(self, positions: torch.Tensor, documents: torch.Tensor, bounds: torch.Tensor):
        """[low, high) of the key positions the queries at `positions` (of `documents`,
        whose bounds are `bounds`) attend; int64 tensors like positions."""
        low = bounds[documents]
        high = positions + 1 if self.causal else bounds[documents + 1]
        return low, high

    def query_bounds(self, positions: torch.Tensor, documents: torch.Tensor, bounds: torch.Tensor):
        """[low, high) of the query positions that attend the keys at `positions`."""
        low = positions if self.causal else bounds[documents]
        return low, bounds[documents + 1]

    def block_pairs(self, q_runs: Sequence[Run], k_runs: Sequence[Run], same_slot: bool) -> tuple[BlockPair, ...]:
        """The BlockPairs of the queries of `q_runs` against the keys of `k_runs`: one per
        pair of runs of one document whose keys a query may see, then joined where the
        union is one rectangle of the same kind. same_slot: the two are one slot's runs
        (step 0), where a run meets itself on the causal diagonal."""
        if same_slot and self.causal and q_runs and len({run.document for run in q_runs}) == 1:
            # One document, rows in global order: the whole block is causal by local row.
            rows = sum(run.length for run in q_runs)
            return (BlockPair(0, rows, 0, rows, True),)
        by_document = collections.defaultdict(list)
        for run in k_runs:
            by_document[run.document].append(run)
        pairs = []
        for q_run in q_runs:
            for k_run in by_document.get(q_run.document, ()):
                if not self.causal or k_run.start + k_run.length <= q_run.start:
                    pairs.append(BlockPair(q_run.local_start, q_run.length, k_run.local_start, k_run.length, False))
                elif same_slot and k_run.start == q_run.start:
                    pairs.append(BlockPair(q_run.local_start, q_run.length, k_run.local_start, k_run.length, True))
                else:
                    # Runs of different slots (or different runs of one slot) are disjoint
                    # ranges: this one lies wholly after the query run.
                    assert k_run.start >= q_run.start + q_run.length, (q_run, k_run)
        return join_full_pairs(pairs)


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


def join_full_pairs(pairs: Sequence[BlockPair]) -> tuple[BlockPair, ...]:
    """`pairs` with full rectangles that touch joined: first those of the same key rows
    and consecutive query rows, then those of the same query rows and consecutive keys.
    (A dense zigzag step's chunk pairs become the one rectangle they form.)"""

    def join(pairs, same, start, length):
        joined: list[BlockPair] = []
        for pair in sorted(pairs, key=lambda pair: (pair.causal, same(pair), start(pair))):
            last = joined[-1] if joined else None
            if last is not None and not pair.causal and not last.causal and same(last) == same(pair) \
                    and start(last) + length(last) == start(pair):  # fmt: skip
                joined[-1] = _grown(last, pair)
            else:
                joined.append(pair)
        return joined

    pairs = join(pairs, lambda p: (p.kv_start, p.kv_len), lambda p: p.q_start, lambda p: p.q_len)
    pairs = join(pairs, lambda p: (p.q_start, p.q_len), lambda p: p.kv_start, lambda p: p.kv_len)
    return tuple(sorted(pairs, key=lambda pair: (pair.q_start, pair.kv_start)))


def _grown(first: BlockPair, second: BlockPair) -> BlockPair:
    """The rectangle of two touching full rectangles."""
    q_start, kv_start = min(first.q_start, second.q_start), min(first.kv_start, second.kv_start)
    q_end = max(first.q_start + first.q_len, second.q_start + second.q_len)
    kv_end = max(first.kv_start + first.kv_len, second.kv_start + second.kv_len)
    return BlockPair(q_start, q_end - q_start, kv_start, kv_end - kv_start, False)


# ----------------------------------------------------------------------------------
# CPU kernel calls: block pairs, neighbouring small ones joined under a mask
# ----------------------------------------------------------------------------------


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
# thousand masked score elements (docs/tuning.md, "Packed documents on CPUs").
JOIN_SLACK_ELEMENTS = 4096


def coalesce(pairs: Sequence[BlockPair]) -> tuple[MaskedBlock, ...]:
    """The BlockPairs of one step as kernel calls: neighbouring pairs (in query order)
    joined into masked rectangles where that wastes little compute (JOIN_SLACK_ELEMENTS)."""
    groups: list[list[BlockPair]] = []
    for pair in sorted(pairs, key=lambda pair: (pair.q_start, pair.kv_start)):
        if groups:
            joined = groups[-1] + [pair]
            q_low = min(p.q_start for p in joined)
            q_high = max(p.q_start + p.q_len for p in joined)
            kv_low = min(p.kv_start for p in joined)
            kv_high = max(p.kv_start + p.kv_len for p in joined)
            own = sum(p.q_len * p.kv_len for p in joined)
            if (q_high - q_low) * (kv_high - kv_low) <= 2 * own + JOIN_SLACK_ELEMENTS:
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


# ----------------------------------------------------------------------------------
# One step
# ----------------------------------------------------------------------------------


def _positions(runs: Sequence[Run]) -> tuple[torch.Tensor, torch.Tensor]:
    """(global position, document) of every local row of a slot, int64."""
    if not runs:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty
    positions = torch.cat([torch.arange(run.start, run.start + run.length) for run in runs])
    documents = torch.repeat_interleave(
        torch.tensor([run.document for run in runs]), torch.tensor([run.length for run in runs])
    )
    return positions, documents


@dataclass
class StepMask:
    """Which query rows attend which key rows in one step (the module docstring).
    uses_intervals: the step kernels that take per-row intervals run the step in one
    launch with them (packed documents); otherwise each pair is a FULL or CAUSAL call."""

    pairs: tuple[BlockPair, ...]
    q_runs: tuple[Run, ...]
    k_runs: tuple[Run, ...]
    mask: AttentionMask
    bounds: tuple[int, ...]
    uses_intervals: bool
    _intervals: dict = field(default_factory=dict, repr=False)

    @functools.cached_property
    def blocks(self) -> tuple[MaskedBlock, ...]:
        """The step as CPU kernel calls (coalesce)."""
        return coalesce(self.pairs)

    def intervals(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(row_start, row_end, col_start, col_end), int32 on `device` (computed once
        per device): query row i attends key rows [row_start[i], row_end[i]), key row j
        is attended by query rows [col_start[j], col_end[j]). Both sides' rows are in
        global order, so each bound is a search among the other side's positions."""
        key = str(device)
        if key not in self._intervals:
            bounds = torch.tensor(self.bounds, dtype=torch.int64)
            q_positions, q_documents = _positions(self.q_runs)
            k_positions, k_documents = _positions(self.k_runs)
            key_low, key_high = self.mask.key_bounds(q_positions, q_documents, bounds)
            query_low, query_high = self.mask.query_bounds(k_positions, k_documents, bounds)
            found = (
                torch.searchsorted(k_positions, key_low),
                torch.searchsorted(k_positions, key_high),
                torch.searchsorted(q_positions, query_low),
                torch.searchsorted(q_positions, query_high),
            )
            self._intervals[key] = tuple(t.to(device=device, dtype=torch.int32) for t in found)
        return self._intervals[key]


class StepMasks:
    """`mask` over slots holding `slots` (each slot's global (start, length) ranges,
    increasing; the ranks of a ring, or one slot for a single process). Caches each
    step's mask: every layer asks again."""

    def __init__(self, mask: AttentionMask, slots: Sequence[Sequence[tuple[int, int]]]):
        self.mask = mask
        self.slots = tuple(tuple(slot) for slot in slots)
        self.lengths = tuple(sum(length for _, length in slot) for slot in self.slots)
        self.bounds = mask.document_bounds(sum(self.lengths))
        self.runs = tuple(document_runs(slot, self.bounds) for slot in self.slots)
        # Per instance, not functools.lru_cache on the method: that cache would keep every
        # instance (and its intervals on the GPU) alive after step_masks_of's cache drops it.
        self._steps: dict = {}

    def step(self, q_slot: int, k_slot: int) -> StepMask | None:
        """The StepMask of slot q_slot's queries against slot k_slot's keys, or None when
        no query attends any of the keys."""
        key = (q_slot, k_slot)
        if key not in self._steps:
            pairs = self.mask.block_pairs(self.runs[q_slot], self.runs[k_slot], q_slot == k_slot)
            self._steps[key] = StepMask(
                pairs, self.runs[q_slot], self.runs[k_slot], self.mask, self.bounds, self.mask.has_documents
            ) if pairs else None  # fmt: skip
        return self._steps[key]


_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 8  # a model's layers share one layout per batch


def step_masks_of(mask: AttentionMask, slots) -> StepMasks:
    """The StepMasks of `mask` over `slots` from a small cache keyed by their values."""
    key = (mask, tuple(tuple(slot) for slot in slots))
    masks = _CACHE.get(key)
    if masks is None:
        masks = _CACHE[key] = StepMasks(mask, key[1])
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return masks


def encode_segments(slots) -> torch.Tensor:
    """Every slot's global ranges as one (count, 3) int64 CPU tensor of (slot, start,
    length) rows: how the ring ops carry a packed layout (a tensor, so that a new layout
    is new data for torch.compile, not a new graph)."""
    rows = [(slot, start, length) for slot, ranges in enumerate(slots) for start, length in ranges]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 3)


def decode_segments(segments: torch.Tensor, slot_count: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """encode_segments' rows back as every slot's ranges."""
    per_slot: list[list[tuple[int, int]]] = [[] for _ in range(slot_count)]
    for slot, start, length in segments.tolist():
        per_slot[slot].append((start, length))
    return tuple(tuple(slot) for slot in per_slot)
