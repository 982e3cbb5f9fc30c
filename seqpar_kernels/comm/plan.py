"""Exchange plans: who sends which range of what to whom.

Everything uneven (heads or sequence not divisible by the world size, empty pieces,
GQA kv heads shared between ranks) is decided here, not in the algorithms; which rows a
rank holds is seqpar_kernels.layouts'.
"""

from __future__ import annotations


def kv_head_ranges(
    q_head_starts: list[int], q_head_lengths: list[int], num_heads: int, num_kv_heads: int
) -> tuple[list[int], list[int]]:
    """The kv heads each rank needs for its q heads (GQA/MQA: q head h reads kv head
    h // (num_heads // num_kv_heads)). Ranges of different ranks may overlap when a kv
    head serves q heads on several ranks; a rank with no q heads needs no kv heads."""
    group_size = num_heads // num_kv_heads
    starts, lengths = [], []
    for start, length in zip(q_head_starts, q_head_lengths):
        if length == 0:
            starts.append(0)
            lengths.append(0)
            continue
        first, last = start // group_size, (start + length - 1) // group_size
        starts.append(first)
        lengths.append(last - first + 1)
    return starts, lengths


def interleave(per_tensor: list[list[int]]) -> list[int]:
    """[[a0, a1, ...], [b0, b1, ...]] -> [a0, b0, a1, b1, ...]: the rank-major order
    of pack_blocks' starts and lengths."""
    return [value for per_rank in zip(*per_tensor) for value in per_rank]
