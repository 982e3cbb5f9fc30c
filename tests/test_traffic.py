"""The byte formulas of seqpar_kernels.traffic on small cases worked out by hand, and
their even-split forms (the tests on ranks compare comm_stats with them)."""

from __future__ import annotations

import itertools

import pytest

from seqpar_kernels.traffic import (
    CallBytes,
    gather_bytes,
    kv_heads_read,
    reshard_bytes,
    ring_bytes,
    ulysses_bytes,
    usp_bytes,
    usp_gather_bytes,
    window_ring_steps,
)

# ----------------------------------------------------------------------------------
# reshard and gathers
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_an_even_reshard_sends_all_but_one_piece(world_size):
    shape, element_size = (2, 3, 8, 5), 2
    total = 2 * 3 * 8 * 5 * element_size
    for rank in range(world_size):
        assert reshard_bytes(shape, 2, rank, world_size, element_size) == (world_size - 1) * total // world_size


def test_an_uneven_reshard_keeps_the_tensor_split_piece():
    # 10 rows over 4 ranks: pieces 3, 3, 2, 2; a row is 4 fp32 values (16 bytes).
    sent = [reshard_bytes((1, 10, 4), 1, rank, 4, 4) for rank in range(4)]
    assert sent == [7 * 16, 7 * 16, 8 * 16, 8 * 16]


def test_gather_sends_the_piece_to_every_other_rank():
    assert [gather_bytes([3, 0, 5], rank, 10) for rank in range(3)] == [60, 0, 100]


def test_usp_gather_sends_the_piece_over_ulysses_then_the_slot_over_the_ring():
    # U = 2, R = 2, pieces [2, 3 | 4, 1]: the rank at (1, 0) sends its 4 rows to its
    # Ulysses peer, then its slot's 5 rows to the other slot.
    assert usp_gather_bytes([2, 3, 4, 1], 1, 0, ulysses_size=2, row_bytes=3) == (4 + 5) * 3
    assert usp_gather_bytes([2, 3, 4, 1], 0, 1, ulysses_size=2, row_bytes=3) == (3 + 5) * 3


# ----------------------------------------------------------------------------------
# Ulysses
# ----------------------------------------------------------------------------------


def test_even_ulysses_sends_all_but_one_share_of_q_k_v_and_out_each_way():
    # P = 4 ranks of 8 rows, 8 heads (MHA), B = 2, D = 4, bf16: each of q, k, v, out is
    # 2 x 8 x 8 x 4 x 2 = 1024 bytes locally.
    for rank in range(4):
        sent = ulysses_bytes([8] * 4, rank, batch=2, num_heads=8, num_kv_heads=8, head_dim=4, element_size=2)
        assert sent == CallBytes(3 * 4 * 1024 // 4, 3 * 4 * 1024 // 4)


def test_mqa_ulysses_sends_each_rank_the_one_kv_head():
    # P = 2, 4 q heads (2 a rank) reading 1 kv head, 3 rows a rank, one-byte rows:
    # forward 3 x (2 q + 2 x 1 kv) out and 3 x 2 out back; backward 3 x 2 dout out and
    # 3 x (2 dq + 2 x 1 dkv) back.
    shape = dict(batch=1, num_heads=4, head_dim=1, element_size=1)
    assert ulysses_bytes([3, 3], 0, num_kv_heads=1, **shape) == CallBytes(18, 18)
    # K and V repeated to the 4 heads would send 2 kv heads to each rank instead.
    assert ulysses_bytes([3, 3], 0, num_kv_heads=4, **shape) == CallBytes(24, 24)


def test_kv_heads_read_follow_the_q_head_split():
    # 6 q heads over 4 ranks: [2, 2, 1, 1] q heads, 3 kv heads (2 q heads each).
    assert kv_heads_read(6, 3, 4) == [{0}, {1}, {2}, {2}]
    # 6 q heads over 2 ranks: [0, 1, 2] and [3, 4, 5] read kv heads {0, 1} and {1, 2}.
    assert kv_heads_read(6, 3, 2) == [{0, 1}, {1, 2}]
    # 3 q heads over 4 ranks: the last rank has none and reads none.
    assert kv_heads_read(3, 1, 4) == [{0}, {0}, {0}, set()]


def test_a_rank_without_heads_sends_its_rows_and_gets_no_output_back():
    # 3 heads over 4 ranks of 2 rows: rank 3 works on none; MQA, one-byte rows.
    shape = dict(batch=1, num_heads=3, num_kv_heads=1, head_dim=1, element_size=1)
    forward, backward = ulysses_bytes([2] * 4, 3, **shape)
    assert forward == 2 * 3 * (1 + 2)  # q, k, v of its rows to each of three ranks
    assert backward == 2 * 3  # dout of its rows; no dq, dk, dv to send back


def test_return_lse_sends_the_fp32_lse_of_the_ranks_heads_back():
    # P = 2, rows [3, 5], 2 heads (1 a rank), B = 2: rank 0 sends its head's lse at the
    # other rank's 5 rows, 2 x 5 x 4 bytes; the backward is unchanged.
    shape = dict(batch=2, num_heads=2, num_kv_heads=2, head_dim=4, element_size=2)
    plain, with_lse = ulysses_bytes([3, 5], 0, **shape), ulysses_bytes([3, 5], 0, **shape, return_lse=True)
    assert with_lse.forward - plain.forward == 2 * 5 * 4 and with_lse.backward == plain.backward


# ----------------------------------------------------------------------------------
# The ring
# ----------------------------------------------------------------------------------

# A K|V row of B = 1, one kv head, D = 2: 4 elements; bf16.
RING_ROW = dict(batch=1, num_kv_heads=1, head_dim=2, element_size=2)


def test_the_ring_sends_every_block_but_the_next_ranks():
    # Rows [5, 0, 3, 1] (N = 9), rank 1: K|V of every block but rank 2's (N - 3 = 6 rows),
    # then the fp32 dK|dV of every block but its own (N - 0 = 9 rows).
    assert ring_bytes([5, 0, 3, 1], 1, **RING_ROW) == CallBytes(6 * 4 * 2, 6 * 4 * 2 + 9 * 4 * 4)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_an_even_ring_sends_p_minus_1_blocks(world_size):
    block = 6 * 4  # K|V elements of a piece of 6 rows
    for rank in range(world_size):
        sent = ring_bytes([6] * world_size, rank, **RING_ROW)
        assert sent == CallBytes((world_size - 1) * block * 2, (world_size - 1) * block * (2 + 4))


def test_a_window_stops_the_ring_after_m_steps():
    # Equal pieces of 6 rows on 4 ranks, the ring stopped after step 1: one block each way.
    block = 6 * 4
    assert ring_bytes([6] * 4, 2, **RING_ROW, steps=1) == CallBytes(block * 2, block * (2 + 4))
    # Uneven rows [5, 0, 3, 1], rank 0, stopped after step 2: it holds the blocks of
    # ranks 0, 3, 2 at steps 0, 1, 2; it passes on those of steps 0 and 1 (5 + 1 rows)
    # and the accumulators of steps 1 and 2 (1 + 3 rows).
    assert ring_bytes([5, 0, 3, 1], 0, **RING_ROW, steps=2) == CallBytes(6 * 4 * 2, 6 * 4 * 2 + 4 * 4 * 4)
    assert ring_bytes([5, 0, 3, 1], 0, **RING_ROW, steps=0) == CallBytes(0, 0)


def test_window_ring_steps_reach_the_farthest_piece_back():
    # Pieces of 5 rows on 4 ranks: the first row of a piece reaches w keys back.
    assert [window_ring_steps(left, 5, 4) for left in (0, 1, 3, 5, 6, 9, 10, 11, 100)] == [0, 1, 1, 1, 2, 2, 2, 3, 3]
    assert window_ring_steps(-1, 5, 4) == 3  # no window: the whole ring


# ----------------------------------------------------------------------------------
# USP
# ----------------------------------------------------------------------------------

HEADS = dict(batch=2, num_heads=4, num_kv_heads=2, head_dim=3, element_size=2)


def test_usp_of_degree_1_is_ulysses_or_the_ring():
    lengths = [3, 1, 4, 2]
    for rank in range(4):
        ulysses, ring = usp_bytes(lengths, 0, rank, ulysses_size=4, **HEADS)
        assert ulysses == ulysses_bytes(lengths, rank, **HEADS) and ring == CallBytes(0, 0)
        ulysses, ring = usp_bytes(lengths, rank, 0, ulysses_size=1, **HEADS)
        assert ulysses == CallBytes(0, 0)
        assert ring == ring_bytes(lengths, rank, batch=2, num_kv_heads=2, head_dim=3, element_size=2)


def test_usp_on_a_2x2_grid():
    # Pieces of 2 rows, 2 heads (MHA), one-byte rows: the rank at (0, 0) sends Ulysses
    # 2 x (1 + 2) q, k, v and 2 x 1 out; the ring K|V of slot 0 (4 rows x 1 kv head x 2),
    # and backward the fp32 dK|dV of slot 1's block.
    shape = dict(batch=1, num_heads=2, num_kv_heads=2, head_dim=1, element_size=1)
    ulysses, ring = usp_bytes([2, 2, 2, 2], 0, 0, ulysses_size=2, **shape)
    assert ulysses == CallBytes(8, 8)
    assert ring == CallBytes(8, 8 + 4 * 2 * 4)


def test_even_usp_sends_ulysses_shares_and_ring_blocks():
    # U = 2, R = 2, pieces of 4 rows, 4 heads reading 2 kv heads: Ulysses (U-1)/U of the
    # local q + k + v + out each way; the ring x the local k + v, and fp32 dk + dv
    # more backward.
    row = HEADS["batch"] * HEADS["head_dim"]  # elements of one head of one row
    q = out = 4 * 4 * row * 2
    k = v = 4 * 2 * row * 2
    for i, j in itertools.product(range(2), range(2)):
        ulysses, ring = usp_bytes([4] * 4, i, j, ulysses_size=2, **HEADS)
        assert ulysses == CallBytes((q + k + v + out) // 2, (q + k + v + out) // 2)
        # The ring carries this Ulysses rank's 1 kv head of the other slot's 8 rows: as
        # many bytes as the local k + v (2 kv heads of 4 rows); fp32 dk + dv twice that.
        assert ring == CallBytes(k + v, (k + v) + 2 * (k + v))


def test_call_bytes_sent_with_or_without_the_backward():
    assert CallBytes(3, 5).sent(with_backward=False) == 3 and CallBytes(3, 5).sent(with_backward=True) == 8
