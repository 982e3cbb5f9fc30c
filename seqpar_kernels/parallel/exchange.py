"""One all-to-all of ranges of up to four tensors: pack, exchange, unpack.

Every all-to-all in the package goes through `exchange_blocks`; the algorithms only
say which ranges go where (see seqpar_kernels.comm.plan).
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch

from seqpar_kernels.comm.groups import GroupInfo, all_gather_ints
from seqpar_kernels.ops import all_to_all_single, pack_blocks, unpack_blocks
from seqpar_kernels.ops.block_copy import block_numel


def _rank_split_sizes(shapes, split_dims, lengths, world_size) -> list[int]:
    """Elements per rank of a buffer laid out as pack_blocks writes it."""
    num_tensors = len(shapes)
    return [
        sum(
            block_numel(shape, dim, lengths[rank * num_tensors + t])
            for t, (shape, dim) in enumerate(zip(shapes, split_dims))
        )
        for rank in range(world_size)
    ]


def exchange_blocks(
    inputs: Sequence[torch.Tensor],
    send_dims: Sequence[int],
    send_starts: Sequence[int],
    send_lengths: Sequence[int],
    out_shapes: Sequence[Sequence[int]],
    recv_dims: Sequence[int],
    recv_starts: Sequence[int],
    recv_lengths: Sequence[int],
    group: GroupInfo,
    out_dim_orders: Sequence[Sequence[int]] | None = None,
) -> list[torch.Tensor]:
    """Sends inputs[t].narrow(send_dims[t], send_starts[r*T+t], send_lengths[r*T+t]) to
    each rank r, and writes what rank r sent for tensor t into
    out[t].narrow(recv_dims[t], recv_starts[r*T+t], recv_lengths[r*T+t]).
    One pack kernel, one all_to_all_single, one unpack kernel."""
    world_size = group.world_size
    in_shapes = [list(tensor.shape) for tensor in inputs]
    send_splits = _rank_split_sizes(in_shapes, send_dims, send_lengths, world_size)
    recv_splits = _rank_split_sizes([list(s) for s in out_shapes], recv_dims, recv_lengths, world_size)
    buffer = pack_blocks(inputs, send_dims, send_starts, send_lengths)
    received = all_to_all_single(buffer, recv_splits, send_splits, group.name)
    return unpack_blocks(received, out_shapes, recv_dims, recv_starts, recv_lengths, out_dim_orders)


def _fingerprint(value) -> int:
    """A stable small integer for metadata that every rank must agree on."""
    return zlib.crc32(repr(value).encode()) & 0x7FFFFFFF


def gather_local_sizes(local_size: int, agreed, group: GroupInfo, describe: str,
                       data_device: torch.device) -> list[int]:
    """Every rank's `local_size`, checking on the way that every rank passed equal
    `agreed` metadata (any printable value: shapes, dims, dtype, flags). A mismatch
    raises ValueError on every rank alike, so no rank is left waiting in a later
    collective. One small all_gather (on NCCL, a host sync, on `data_device`: the
    input's GPU, see metadata_device).

    Under torch.compile the sizes cannot be read at trace time: every rank is assumed
    to hold `local_size` and nothing is checked (pass sizes explicitly when they differ)."""
    if group.world_size == 1 or torch.compiler.is_compiling():
        return [local_size] * group.world_size
    rows = all_gather_ints([local_size, _fingerprint(agreed)], group.name, data_device)
    if any(row[1] != rows[0][1] for row in rows):
        raise ValueError(
            f"{describe}: ranks disagree on shapes, dims or dtype; rank {group.rank} passed "
            f"{agreed} (per rank: local size, metadata fingerprint: {rows})"
        )
    return [row[0] for row in rows]


def check_local_sizes(
    sizes: Sequence[int], group: GroupInfo, local_size: int, argument: str, shape, dim: int
) -> list[int]:
    """Checks user-passed per-rank sizes along `dim` (`argument` names the parameter):
    one per rank, this rank's equal to its local size. Returns them as a list."""
    if len(sizes) != group.world_size or sizes[group.rank] != local_size:
        raise ValueError(
            f"{argument}={list(sizes)} must list {group.world_size} ranks' sizes along dim "
            f"{dim}, with this rank's ({group.rank}) equal to {local_size} (local shape "
            f"{tuple(shape)})"
        )
    return list(sizes)
