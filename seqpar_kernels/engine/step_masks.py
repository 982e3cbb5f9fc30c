"""What one ring step computes under an attention mask (seqpar_kernels/attention_mask.py).

    StepMasks(mask, slots)              the mask cut into ring steps, slots holding global
                                        ranges (seqpar_kernels.layouts): step(q_slot, k_slot)
                                        is what slot q_slot's queries compute against slot
                                        k_slot's keys, as a StepMask (None: nothing).
    step_masks_of(mask, slots)          the same from a small cache (every layer asks again)
    dense_step_masks(mask, lengths, z)  one dense sequence in the contiguous or zigzag layout

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

from seqpar_kernels.attention_mask import AttentionMask
from seqpar_kernels.layouts import Run, dense_slot_segments, document_runs

# ----------------------------------------------------------------------------------
# Block pairs: what the queries of one run see of the keys of another
# ----------------------------------------------------------------------------------

# What a query run sees of a key run (relation).
NONE, FULL, DIAGONAL, PARTIAL = "none", "full", "diagonal", "partial"


def relation(mask: AttentionMask, q_run: Run, k_run: Run, bounds: Sequence[int]) -> str:
    """What the queries of q_run see of the keys of k_run (runs of one document):
    NONE, FULL (every key), DIAGONAL (the same positions, key <= query) or PARTIAL.
    From the first and last query alone: both bounds grow with the position, and a
    query sees itself, so some query sees some key exactly when the last query's
    interval ends after the keys start and the first one's starts before they end."""
    start, end = bounds[q_run.document], bounds[q_run.document + 1]
    q_first, q_last = q_run.start, q_run.start + q_run.length - 1
    k_first, k_end = k_run.start, k_run.start + k_run.length
    first_low, first_high = mask.key_bounds(q_first, start, end)
    last_low, last_high = mask.key_bounds(q_last, start, end)
    if last_high <= k_first or first_low >= k_end:
        return NONE
    if last_low <= k_first and first_high >= k_end:
        return FULL
    if mask.causal and q_run.start == k_run.start and q_run.length == k_run.length and last_low <= k_first:
        return DIAGONAL
    return PARTIAL


def block_pairs(
    mask: AttentionMask, q_runs: Sequence[Run], k_runs: Sequence[Run], same_slot: bool, bounds
) -> tuple[BlockPair, ...]:
    """The BlockPairs of the queries of `q_runs` against the keys of `k_runs`: one per
    pair of runs of one document whose keys a query may see, then joined where the
    union is one rectangle of the same kind. same_slot: the two are one slot's runs
    (step 0), where a run meets itself on the causal diagonal. A pair that only part
    of sees is cut into tiles of PARTIAL_TILE query rows, each against the keys its
    rows reach, so that what remains masked stays small."""
    if same_slot and mask.causal and not mask.is_local and q_runs and len({run.document for run in q_runs}) == 1:
        # One document, rows in global order: the whole block is causal by local row.
        rows = sum(run.length for run in q_runs)
        return (BlockPair(0, rows, 0, rows, True),)
    by_document = collections.defaultdict(list)
    for run in k_runs:
        by_document[run.document].append(run)
    pairs = []
    for q_run in q_runs:
        for k_run in by_document.get(q_run.document, ()):
            pairs += _pairs_of(mask, q_run, k_run, bounds)
    return join_full_pairs(pairs)


def _pairs_of(mask: AttentionMask, q_run: Run, k_run: Run, bounds) -> list[BlockPair]:
    kind = relation(mask, q_run, k_run, bounds)
    if kind == NONE:
        return []
    if kind != PARTIAL:
        return [BlockPair(q_run.local_start, q_run.length, k_run.local_start, k_run.length, kind == DIAGONAL)]
    if q_run.length > PARTIAL_TILE:
        return [
            pair
            for offset in range(0, q_run.length, PARTIAL_TILE)
            for pair in _pairs_of(mask, _sub_run(q_run, offset, PARTIAL_TILE), k_run, bounds)
        ]
    # Only the keys these rows reach: a sub-run of k_run.
    start, end = bounds[q_run.document], bounds[q_run.document + 1]
    low, _ = mask.key_bounds(q_run.start, start, end)
    _, high = mask.key_bounds(q_run.start + q_run.length - 1, start, end)
    low, high = max(low, k_run.start), min(high, k_run.start + k_run.length)
    if high <= low:
        return []
    k_part = _sub_run(k_run, low - k_run.start, high - low)
    if (k_part.start, k_part.length) != (k_run.start, k_run.length) and relation(
        mask, q_run, k_part, bounds
    ) != PARTIAL:
        return _pairs_of(mask, q_run, k_part, bounds)
    return [BlockPair(q_run.local_start, q_run.length, k_part.local_start, k_part.length, False, True)]


# A pair of runs that its queries only partly see is cut into tiles of this many query
# rows, each against the keys its rows reach: a sliding window's band then costs masked
# blocks of about (PARTIAL_TILE, window + PARTIAL_TILE) on the CPU path.
PARTIAL_TILE = 128


def _sub_run(run: Run, offset: int, length: int) -> Run:
    length = min(length, run.length - offset)
    return Run(run.local_start + offset, run.start + offset, length, run.document)


@dataclass(frozen=True)
class BlockPair:
    """Query rows [q_start, +q_len) against key rows [kv_start, +kv_len) of the block:
    all of them, the causal diagonal (causal: the same global positions on both sides),
    or, partial, those the mask says (AttentionMask.key_bounds)."""

    q_start: int
    q_len: int
    kv_start: int
    kv_len: int
    causal: bool
    partial: bool = False


def join_full_pairs(pairs: Sequence[BlockPair]) -> tuple[BlockPair, ...]:
    """`pairs` with full rectangles that touch joined: first those of the same key rows
    and consecutive query rows, then those of the same query rows and consecutive keys.
    (A dense zigzag step's chunk pairs become the one rectangle they form.)"""

    def join(pairs, same, start, length):
        joined: list[BlockPair] = []
        for pair in sorted(pairs, key=lambda pair: (pair.causal or pair.partial, same(pair), start(pair))):
            last = joined[-1] if joined else None
            if last is not None and _is_full(pair) and _is_full(last) and same(last) == same(pair) \
                    and start(last) + length(last) == start(pair):  # fmt: skip
                joined[-1] = _grown(last, pair)
            else:
                joined.append(pair)
        return joined

    pairs = join(pairs, lambda p: (p.kv_start, p.kv_len), lambda p: p.q_start, lambda p: p.q_len)
    pairs = join(pairs, lambda p: (p.q_start, p.q_len), lambda p: p.kv_start, lambda p: p.kv_len)
    return tuple(sorted(pairs, key=lambda pair: (pair.q_start, pair.kv_start)))


def _is_full(pair: BlockPair) -> bool:
    return not pair.causal and not pair.partial


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


def coalesce(pairs: Sequence[BlockPair], partial_attends) -> tuple[MaskedBlock, ...]:
    """The BlockPairs of one step as kernel calls: neighbouring pairs (in query order)
    joined into masked rectangles where that wastes little compute (JOIN_SLACK_ELEMENTS).
    partial_attends(pair): the (q_len, kv_len) bool mask of a partial pair."""
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
    return tuple(_masked_block(group, partial_attends) for group in groups)


def _masked_block(group: list[BlockPair], partial_attends) -> MaskedBlock:
    if len(group) == 1 and not group[0].partial:
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
        attends[rows, columns] = partial_attends(pair) if pair.partial else block.tril() if pair.causal else block
    mask = torch.zeros(q_len, kv_len).masked_fill_(~attends, float("-inf"))
    return MaskedBlock(q_low, q_len, kv_low, kv_len, False, mask, ~attends.any(1))


# ----------------------------------------------------------------------------------
# One step
# ----------------------------------------------------------------------------------


def _positions(runs: Sequence[Run], bounds: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(global position, its document's start, its document's end) of every local row
    of a slot, int64."""
    if not runs:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty
    positions = torch.cat([torch.arange(run.start, run.start + run.length) for run in runs])
    lengths = torch.tensor([run.length for run in runs])
    starts = torch.repeat_interleave(torch.tensor([bounds[run.document] for run in runs]), lengths)
    ends = torch.repeat_interleave(torch.tensor([bounds[run.document + 1] for run in runs]), lengths)
    return positions, starts, ends


@dataclass
class StepMask:
    """Which query rows attend which key rows in one step (the module docstring).
    uses_intervals: the step kernels that take per-row intervals run the step in one
    launch with them (packed documents, windows, chunks: any step of more than one
    pair); otherwise its one pair is a FULL or CAUSAL call."""

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
        return coalesce(self.pairs, self._partial_attends)

    @functools.cached_property
    def _rows(self):
        return _positions(self.q_runs, self.bounds), _positions(self.k_runs, self.bounds)

    def _partial_attends(self, pair: BlockPair) -> torch.Tensor:
        """(q_len, kv_len) bool: which of a partial pair's keys each of its queries sees."""
        (q_positions, q_starts, q_ends), (k_positions, _, _) = self._rows
        rows = slice(pair.q_start, pair.q_start + pair.q_len)
        low, high = self.mask.key_bounds(q_positions[rows], q_starts[rows], q_ends[rows])
        keys = k_positions[pair.kv_start : pair.kv_start + pair.kv_len]
        return (keys[None, :] >= low[:, None]) & (keys[None, :] < high[:, None])

    def intervals(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(row_start, row_end, col_start, col_end), int32 on `device` (computed once
        per device): query row i attends key rows [row_start[i], row_end[i]), key row j
        is attended by query rows [col_start[j], col_end[j]). Both sides' rows are in
        global order, so each bound is a search among the other side's positions."""
        key = str(device)
        if key not in self._intervals:
            (q_positions, q_starts, q_ends), (k_positions, k_starts, k_ends) = self._rows
            key_low, key_high = self.mask.key_bounds(q_positions, q_starts, q_ends)
            query_low, query_high = self.mask.query_bounds(k_positions, k_starts, k_ends)
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
        self._reach: int | None = None

    def step(self, q_slot: int, k_slot: int) -> StepMask | None:
        """The StepMask of slot q_slot's queries against slot k_slot's keys, or None when
        no query attends any of the keys."""
        key = (q_slot, k_slot)
        if key not in self._steps:
            pairs = block_pairs(self.mask, self.runs[q_slot], self.runs[k_slot], q_slot == k_slot, self.bounds)
            # One interval launch wherever the step is more than one FULL or CAUSAL call (the
            # CPU calls may join several pairs into one masked rectangle, which the interval
            # kernels do not take).
            uses_intervals = self.mask.has_documents or len(pairs) > 1 or any(pair.partial for pair in pairs)
            self._steps[key] = StepMask(
                pairs, self.runs[q_slot], self.runs[k_slot], self.mask, self.bounds, uses_intervals
            ) if pairs else None  # fmt: skip
        return self._steps[key]

    def reach(self) -> int:
        """The largest ring offset i (1 <= i < slots) at which some slot's queries see
        keys of the slot i before it (k_slot = q_slot - i); 0 if none. A ring whose mask
        is local (windows, chunks) stops after that step: no block travels further."""
        if self._reach is None:
            count = len(self.slots)

            def seen(offset):
                return any(self.step(q_slot, (q_slot - offset) % count) is not None for q_slot in range(count))

            self._reach = next((offset for offset in range(count - 1, 0, -1) if seen(offset)), 0)
        return self._reach


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


def dense_step_masks(mask: AttentionMask, seq_lens, zigzag: bool) -> StepMasks:
    """The step masks of one dense sequence held by ranks of `seq_lens` rows each, in the
    contiguous or the zigzag layout; mask: an AttentionMask without documents."""
    return step_masks_of(mask, dense_slot_segments(seq_lens, zigzag))
