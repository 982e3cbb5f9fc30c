"""Bytes sent: comm_stats, the one place where payload bytes are counted, and the
formulas of what each collective sends, the one place they are written.

    comm_stats()               counts what seqpar's collectives send inside a block
    reshard_bytes              all_to_all_reshard (DSP's switch)
    gather_bytes               gather_sequence
    usp_gather_bytes           usp_gather: over the Ulysses group, then the ring
    sparse_gradient_bytes      a gather's backward that sums every rank's gradient of its rows
    sparse_attention_bytes     sparse_attention (indexer-sparse, DSA): the rows asked, forward and backward
    ulysses_bytes              ulysses_attention, forward and backward (CallBytes)
    kv_heads_read              the kv heads each rank's q heads read, which Ulysses sends
    ring_bytes                 ring_attention, forward and backward (CallBytes)
    window_ring_steps          where a causal window stops the ring (equal pieces)
    usp_bytes                  usp_attention: the Ulysses group's and the ring group's
    state_passing_bytes        the recurrent mixers' state across ranks (CallBytes)
    gated_delta_summary_bytes  one run's summary of the gated delta rule
    decode_attention_bytes     decode_attention: the partials gathered over each group
    prefill_attention_bytes    prefill_attention, pass-KV or pass-Q
    prefill_attention_method   the method prefill_attention's "auto" takes: fewer bytes

The formulas are pure arithmetic on lengths, heads and element sizes: the tests and
the benchmarks compare comm_stats with them, and docs/ quotes them. Pieces follow
torch.tensor_split (seqpar_kernels.layouts). Bytes are those one rank sends to other
ranks, its own share excluded, as comm_stats counts them.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from seqpar_kernels.layouts import tensor_split_ranges, tensor_split_sizes, usp_rows


@dataclass
class CommStats:
    """Payload bytes this rank sent to other ranks (its own share excluded), and how
    many collective or point-to-point calls carried them."""

    bytes_sent: int = 0
    calls: int = 0


# One stack for the whole process, not one per thread: on CUDA the autograd engine
# runs the backward (and its collectives) on a worker thread of its own, and a
# per-thread stack there would count none of the backward's bytes.
_lock = threading.Lock()
_active: list[CommStats] = []


@contextlib.contextmanager
def comm_stats():
    """Counts the bytes that seqpar's collectives send inside the block.

    >>> with comm_stats() as stats:
    ...     out = ulysses_attention(q, k, v)
    >>> stats.bytes_sent  # ulysses_bytes(...).forward: (P-1)/P x (q + k + v + o) with even heads

    Blocks nest: an inner block's bytes count in the outer one too. A block counts
    what this process sends from any thread while it is open, the backward that the
    autograd engine runs on its own thread included.
    """
    stats = CommStats()
    with _lock:
        _active.append(stats)
    try:
        yield stats
    finally:
        with _lock:
            _active.remove(stats)


def record_sent(num_bytes: int) -> None:
    """Called by every seqpar collective with the bytes it sends to other ranks."""
    with _lock:
        for stats in _active:
            stats.bytes_sent += num_bytes
            stats.calls += 1


# ----------------------------------------------------------------------------------
# The formulas
# ----------------------------------------------------------------------------------

FP32_BYTES = 4  # the ring's dK|dV accumulators and the lse travel in fp32


class CallBytes(NamedTuple):
    """Bytes one rank sends in one call: in its forward, and in its backward."""

    forward: int
    backward: int

    def sent(self, with_backward: bool) -> int:
        """The forward's bytes, or the forward's and the backward's together."""
        return self.forward + self.backward if with_backward else self.forward


def reshard_bytes(shape: Sequence[int], scatter_dim: int, rank: int, world_size: int, element_size: int) -> int:
    """Bytes all_to_all_reshard sends from `rank`: every torch.tensor_split piece of its
    x along scatter_dim but its own.

    shape: this rank's x (its piece along the gather dim, whole along scatter_dim).
        (shape[scatter_dim] - own piece) x (the other dims' product) x element size
    (P-1)/P of x's bytes when scatter_dim divides evenly. The backward is the reverse
    reshard: reshard_bytes of the output's shape, scattered along the gather dim."""
    length = shape[scatter_dim]
    own = tensor_split_sizes(length, world_size)[rank]
    return (length - own) * math.prod(shape[:scatter_dim]) * math.prod(shape[scatter_dim + 1 :]) * element_size


def gather_bytes(seq_lens: Sequence[int], rank: int, row_bytes: int) -> int:
    """Bytes gather_sequence sends from `rank`: its piece to every other rank.

    seq_lens: every rank's length along the gathered dim; row_bytes: the bytes of one
    row along it (the other dims' product x element size).
        (P-1) x seq_lens[rank] x row_bytes
    Its backward keeps this rank's piece of the gradient: nothing sent."""
    return (len(seq_lens) - 1) * seq_lens[rank] * row_bytes


def usp_gather_bytes(
    seq_lens: Sequence[int], ring_index: int, ulysses_index: int, *, ulysses_size: int, row_bytes: int
) -> int:
    """Bytes usp_gather sends from the rank at (ring_index i, ulysses_index j): its piece
    over the Ulysses group, then its slot (the U pieces of ring slot i) over the ring.

    seq_lens: every piece's length, in piece order i * U + j; row_bytes: as gather_bytes'.
        (U-1) x S_{i,j} x row_bytes + (R-1) x L_i x row_bytes    (L_i: slot i's length)"""
    row = _slot_pieces(seq_lens, ring_index, ulysses_size)
    slots = _slot_lengths(seq_lens, ulysses_size)
    return gather_bytes(row, ulysses_index, row_bytes) + gather_bytes(slots, ring_index, row_bytes)


def sparse_gradient_bytes(seq_lens: Sequence[int], rank: int, row_bytes: int) -> int:
    """Bytes `rank` sends in the backward of a gather whose every rank used every row
    (sparse_attention's K and V): each other rank's rows of its gradient, summed there.
        (T - seq_lens[rank]) x row_bytes"""
    return (sum(seq_lens) - seq_lens[rank]) * row_bytes


def sparse_attention_bytes(
    asked: Sequence[Sequence[int]], rank: int, *, batch: int, kv_heads: int, head_dim: int, value_dim: int,
    element_size: int,
) -> CallBytes:  # fmt: skip
    """Bytes sparse_attention sends from `rank`: asked[j][i] is how many distinct rows
    the queries of rank j keep from rank i (its own included). Forward: the request
    (the P-1 counts, then the positions of the rows it asks of the others, int64), and
    the K and V rows the others asked of it; backward: the dK and dV rows it fetched,
    sent back to their ranks.
        forward   8 x (P-1) + 8 x sum_{i!=r} asked[r][i] + sum_{j!=r} asked[j][r] x row
        backward  sum_{i!=r} asked[r][i] x row          row = B x H_kv x (D + Dv) x element size
    At most (P-1) x S_r rows each way (every row of rank r asked by every rank). indexer_topk
    adds gather_bytes(seq_lens, rank, B x D_i x element size) for its keys, and
    sparse_placement gather_bytes(seq_lens, rank, 8) for the rows (once per placement)."""
    world = len(asked)
    row = batch * kv_heads * (head_dim + value_dim) * element_size
    fetched = sum(asked[rank]) - asked[rank][rank]
    served = sum(asked[other][rank] for other in range(world) if other != rank)
    request = 8 * (world - 1) + 8 * fetched if world > 1 else 0
    return CallBytes(request + served * row, fetched * row)


def kv_heads_read(num_heads: int, num_kv_heads: int, world_size: int) -> list[frozenset[int]]:
    """The kv heads each rank's q heads read (q heads split by torch.tensor_split over
    the ranks; q head h reads kv head h // (num_heads // num_kv_heads)). Derived from the
    head split alone, apart from comm.plan's ranges, so that the byte tests check the plan."""
    group_size = num_heads // num_kv_heads
    starts, counts = tensor_split_ranges(num_heads, world_size)
    return [
        frozenset(head // group_size for head in range(start, start + count)) for start, count in zip(starts, counts)
    ]


def ulysses_bytes(
    seq_lens: Sequence[int], rank: int, *, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
    element_size: int, return_lse: bool = False, value_dim: int | None = None,
) -> CallBytes:  # fmt: skip
    """Bytes ulysses_attention (or the Ulysses half of usp_attention) sends from `rank`.

    seq_lens: every rank's rows; q (batch, S_r, num_heads, D), k (batch, S_r,
    num_kv_heads, D) and v (batch, S_r, num_kv_heads, Dv) with D = head_dim, Dv =
    value_dim (None: D); out like q with Dv. Rank j works on n_j q heads
    (torch.tensor_split of num_heads) and the m_j kv heads they read (kv_heads_read);
    unit = batch x element size. Sums over j != r:
        forward   (S_r (n_j D + m_j (D + Dv)) + S_j n_r Dv) x unit     q, k, v out; out back
        backward  (S_r n_j Dv + S_j (n_r D + m_r (D + Dv))) x unit     dout out; dq, dk, dv back
    return_lse: the fp32 lse of this rank's heads goes back too (USP), forward
    S_j x n_r x batch x 4 more. With heads and lengths even: (P-1)/P x (q + k + v + out)
    bytes each way. K and V repeated to num_heads heads before the exchange would send
    ulysses_bytes(..., num_kv_heads=num_heads)."""
    world_size = len(seq_lens)
    q_heads = tensor_split_sizes(num_heads, world_size)
    kv_heads = [len(heads) for heads in kv_heads_read(num_heads, num_kv_heads, world_size)]
    unit, key, value = batch * element_size, head_dim, value_dim or head_dim
    others = [j for j in range(world_size) if j != rank]
    own_len, own_q, own_kv = seq_lens[rank], q_heads[rank], kv_heads[rank]
    forward = sum(own_len * (q_heads[j] * key + kv_heads[j] * (key + value)) + seq_lens[j] * own_q * value
                  for j in others) * unit  # fmt: skip
    backward = sum(own_len * q_heads[j] * value + seq_lens[j] * (own_q * key + own_kv * (key + value))
                   for j in others) * unit  # fmt: skip
    if return_lse:
        forward += sum(seq_lens[j] for j in others) * own_q * batch * FP32_BYTES
    return CallBytes(forward, backward)


def ring_bytes(
    seq_lens: Sequence[int], rank: int, *, batch: int, num_kv_heads: int, head_dim: int, element_size: int,
    steps: int | None = None, value_dim: int | None = None,
) -> CallBytes:  # fmt: skip
    """Bytes ring_attention sends from `rank` (engine/ring_driver.py's loops).

    seq_lens: every rank's rows, in ring order; k (batch, S_r, num_kv_heads, head_dim)
    and v (batch, S_r, num_kv_heads, value_dim; None: head_dim); kv = batch x
    num_kv_heads x (head_dim + value_dim), the K|V elements of one row.
    steps: the ring's last step m: P-1 (None), or under a window or chunks the farthest
    ring offset some rank sees (window_ring_steps; StepMasks.reach in general). At step s
    the rank holds rank r-s's block (n_{r-s} rows): it passes it on at steps 0..m-1 and
    the block's fp32 dK|dV accumulator at steps 1..m:
        forward   sum_{s=0}^{m-1} n_{r-s} x kv x element size            (K|V)
        backward  the same, plus sum_{s=1}^{m} n_{r-s} x kv x 4          (fp32 dK|dV)
    With m = P-1 the rows are N - n_{r+1} and N - n_r (N the sum); with equal pieces:
    forward m x (k + v bytes), backward m x (k + v bytes + fp32 dk + dv bytes)."""
    world_size = len(seq_lens)
    last = world_size - 1 if steps is None else steps
    kv = batch * num_kv_heads * (head_dim + (value_dim or head_dim))
    held = [seq_lens[(rank - step) % world_size] for step in range(last + 1)]  # rows held at each step
    kv_bytes = sum(held[:last]) * kv * element_size
    return CallBytes(kv_bytes, kv_bytes + sum(held[1:]) * kv * FP32_BYTES)


def window_ring_steps(window_left: int, piece_len: int, world_size: int) -> int:
    """The ring's last step under a causal window of `window_left` keys back
    (window_size=(window_left, ...); -1: no window) over equal contiguous pieces of
    piece_len > 0 rows: the farthest piece back the first row of a piece reaches.
        min(P-1, ceil(window_left / piece_len))"""
    if window_left < 0:
        return world_size - 1
    return min(world_size - 1, -(-window_left // piece_len))


def usp_bytes(
    seq_lens: Sequence[int], ring_index: int, ulysses_index: int, *, ulysses_size: int, batch: int, num_heads: int,
    num_kv_heads: int, head_dim: int, element_size: int, return_lse: bool = False, ring_steps: int | None = None,
    value_dim: int | None = None,
) -> tuple[CallBytes, CallBytes]:  # fmt: skip
    """(Ulysses group, ring group) bytes usp_attention sends from the rank at
    (ring_index i, ulysses_index j).

    seq_lens: every piece's rows, in piece order i * U + j; q, k, v (value_dim) as
    ulysses_bytes'.
        Ulysses group  ulysses_bytes over slot i's U pieces, for Ulysses rank j
                       (return_lse: its lse back too)
        ring group     ring_bytes over the R slots' lengths L, for slot i, with the m_j
                       kv heads Ulysses rank j reads (none with R = 1); ring_steps as
                       ring_bytes' steps"""
    ulysses = ulysses_bytes(
        _slot_pieces(seq_lens, ring_index, ulysses_size), ulysses_index, batch=batch, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, element_size=element_size, return_lse=return_lse,
        value_dim=value_dim,
    )  # fmt: skip
    kv_heads = len(kv_heads_read(num_heads, num_kv_heads, ulysses_size)[ulysses_index])
    ring = ring_bytes(
        _slot_lengths(seq_lens, ulysses_size), ring_index, batch=batch, num_kv_heads=kv_heads, head_dim=head_dim,
        element_size=element_size, steps=ring_steps, value_dim=value_dim,
    )  # fmt: skip
    return ulysses, ring


def state_passing_bytes(
    run_counts: Sequence[int], piece: int, *, summary_bytes: int, ulysses_size: int = 1
) -> CallBytes:
    """Bytes a recurrent mixer (parallel/recurrent.py) sends from `piece` to pass the
    state across ranks: every run's summary to every other rank (SequenceRuns.gather),
    and in the backward each summary's gradient back to the run's rank.

    run_counts: every piece's runs (consecutive rows of one document), in piece order
    i * U + j; summary_bytes: one run's summary (a convolution of kernel K: batch x (K-1)
    x channels x element size; a recurrence: its transition and final state).
    One group (ulysses_size 1), c the run counts, C their sum:
        forward   (P-1) x c_p x summary_bytes
        backward  (C - c_p) x summary_bytes
    A grid: the same over the Ulysses group (slot i's pieces), then over the ring group
    (the slots' run counts). Independent of the sequence's length."""
    rows = usp_rows(run_counts, ulysses_size)
    ring_index, ulysses_index = divmod(piece, ulysses_size)
    slots = [sum(row) for row in rows]
    row = rows[ring_index]
    forward = (len(row) - 1) * row[ulysses_index] + (len(slots) - 1) * slots[ring_index]
    backward = (sum(row) - row[ulysses_index]) + (sum(slots) - slots[ring_index])
    return CallBytes(forward * summary_bytes, backward * summary_bytes)


def gated_delta_summary_bytes(batch: int, value_heads: int, key_dim: int, value_dim: int, element_size: int = 4) -> int:
    """One run's summary in gated_delta_rule (state_passing_bytes' summary_bytes): its
    transition (dk, dk) and final state (dk, dv) per batch entry and value head, in the
    compute dtype (fp32; fp64 for fp64 inputs)."""
    return batch * value_heads * key_dim * (key_dim + value_dim) * element_size


def decode_attention_bytes(group_sizes: Sequence[int], *, batch: int, num_queries: int, num_heads: int,
                           head_dim: int) -> int:  # fmt: skip
    """Bytes decode_attention sends from any rank: its fp32 partial (out and lse) of the
    batch x num_queries x num_heads rows to every other rank of each group in turn
    (group_sizes: [P] for a group; [U, R] for a USP grid; a mesh's dims); head_dim: the
    out's, v's head dim.
        sum over groups of (size - 1) x batch x num_queries x num_heads x (head_dim + 1) x 4
    Independent of the cache's length."""
    return sum(size - 1 for size in group_sizes) * batch * num_queries * num_heads * (head_dim + 1) * FP32_BYTES


POSITION_BYTES = 8  # positions and lengths travel as int64

# The prefill methods (prefill_attention's method=).
PASS_KV, PASS_Q = "pass-kv", "pass-q"


def prefill_attention_bytes(
    cache_seq_lens: Sequence[int], chunk_seq_lens: Sequence[int], rank: int, *, method: str, batch: int,
    num_heads: int, num_kv_heads: int, head_dim: int, element_size: int, ulysses_size: int = 1,
    value_dim: int | None = None,
) -> int:  # fmt: skip
    """Bytes prefill_attention sends from `rank` by `method` (PASS_KV or PASS_Q).

    cache_seq_lens: every rank's cached rows S_j (k_cache.shape[1]); chunk_seq_lens: every
    rank's rows C_j of the new chunk; q (batch, C_r, num_heads, head_dim), k and v of the
    chunk and of the cache num_kv_heads heads, element_size bytes each; v's head dim
    Dv = value_dim (None: head_dim; below, 2 x head_dim is head_dim + Dv and the
    partials' head_dim + 1 is Dv + 1). ulysses_size: U
    of USP's grid (ranks in piece order i * U + j; pass-Q only), 1 for one group.
        pass-kv  each rank's block travels the ring: its cached and new K and V, their
                 positions and its cache's lengths. Block j, with e the element size:
                     B_j = batch x ((S_j + C_j) x (2 x num_kv_heads x head_dim x e + 8) + 8)
                 rank r passes on the blocks it holds at steps 0..P-2 (ranks r, r-1, ...):
                     sum_{s=0}^{P-2} B_{r-s}
        pass-q   the new queries and their positions go to every other rank (a gather),
                 and each rank's fp32 partial (out, lse) of every other rank's queries
                 goes back to that rank:
                     (P-1) x batch x C_r x (num_heads x head_dim x e + 8)
                     + sum_{j != r} batch x C_j x num_heads x (head_dim + 1) x 4
                 On a grid, rank (i, j) sends its queries to its slot's U - 1 others and
                 its slot's (C_i: the sum of its U pieces) to the R - 1 other slots; the
                 partials of slot i' != i's queries to ring rank i', then the merged
                 partials of its slot's piece j' != j to Ulysses rank j':
                     batch x ((U-1) x C_r + (R-1) x C_i) x (num_heads x head_dim x e + 8)
                     + batch x (sum_{i' != i} C_i' + C_i - C_r) x num_heads x (head_dim + 1) x 4
                 (U = 1: the one group's formula)."""
    world_size = len(cache_seq_lens)
    if method == PASS_KV and ulysses_size == 1:
        kv_dims = head_dim + (value_dim or head_dim)
        block = [batch * ((cache + chunk) * (num_kv_heads * kv_dims * element_size + POSITION_BYTES)
                          + POSITION_BYTES) for cache, chunk in zip(cache_seq_lens, chunk_seq_lens)]  # fmt: skip
        return sum(block[(rank - step) % world_size] for step in range(world_size - 1))
    if method != PASS_Q:
        raise ValueError(f"method must be {PASS_KV!r} (one group) or {PASS_Q!r}, got {method!r}")
    ring_size, ring_index = world_size // ulysses_size, rank // ulysses_size
    slots = _slot_lengths(chunk_seq_lens, ulysses_size)
    mine, slot = chunk_seq_lens[rank], slots[ring_index]
    query_rows = (ulysses_size - 1) * mine + (ring_size - 1) * slot
    partial_rows = sum(slots) - slot + slot - mine
    return batch * (query_rows * (num_heads * head_dim * element_size + POSITION_BYTES)
                    + partial_rows * num_heads * ((value_dim or head_dim) + 1) * FP32_BYTES)  # fmt: skip


def prefill_attention_method(
    cache_seq_lens: Sequence[int], chunk_seq_lens: Sequence[int], *, batch: int, num_heads: int, num_kv_heads: int,
    head_dim: int, element_size: int, value_dim: int | None = None,
) -> str:  # fmt: skip
    """The method prefill_attention's method="auto" takes: PASS_Q where it sends fewer
    bytes over all ranks together than PASS_KV (prefill_attention_bytes summed over the
    ranks), else PASS_KV. That is Meta's rule (arXiv:2411.01783) in bytes: pass-Q when the
    cached tokens dominate the chunk's; pass-KV for a first prompt or a long chunk. The
    same on every rank, from every rank's lengths."""
    sizes = dict(batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 element_size=element_size, value_dim=value_dim)  # fmt: skip
    ranks = range(len(cache_seq_lens))
    totals = {method: sum(prefill_attention_bytes(cache_seq_lens, chunk_seq_lens, rank, method=method, **sizes)
                          for rank in ranks) for method in (PASS_KV, PASS_Q)}  # fmt: skip
    return PASS_Q if totals[PASS_Q] < totals[PASS_KV] else PASS_KV


def _slot_pieces(seq_lens: Sequence[int], ring_index: int, ulysses_size: int) -> list[int]:
    """The lengths of ring slot ring_index's U pieces."""
    return usp_rows(seq_lens, ulysses_size)[ring_index]


def _slot_lengths(seq_lens: Sequence[int], ulysses_size: int) -> list[int]:
    """Every ring slot's length: the sum of its U pieces."""
    return [sum(row) for row in usp_rows(seq_lens, ulysses_size)]
