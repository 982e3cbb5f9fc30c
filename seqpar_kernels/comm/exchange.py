"""One all-to-all of ranges of up to four tensors: pack, exchange, unpack.

Every all-to-all in the package goes through `exchange_blocks`; the algorithms only
say which ranges go where (see seqpar_kernels.comm.plan).
"""

from __future__ import annotations

from typing import Sequence

import torch

from seqpar_kernels.groups import GroupInfo
from seqpar_kernels.layouts import offsets
from seqpar_kernels.ops import all_to_all_single, pack_blocks, unpack_blocks
from seqpar_kernels.ops.block_copy import block_numel

# torch 2.6's torch.compile cannot trace Tensor.is_contiguous in an autograd.Function's
# backward (docs/tuning.md): there the send side always packs under torch.compile, right
# for any strides and one copy more for an input already laid out as the send buffer.
COMPILE_READS_CONTIGUITY = torch.torch_version.TorchVersion(torch.__version__) >= (2, 7)


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
    One pack kernel, one all_to_all_single, one unpack kernel; a side whose ranges are
    already the buffer's layout (see _ranges_tile_memory) skips its kernel."""
    world_size = group.world_size
    in_shapes = [list(tensor.shape) for tensor in inputs]
    out_shapes = [list(shape) for shape in out_shapes]
    send_splits = _rank_split_sizes(in_shapes, send_dims, send_lengths, world_size)
    recv_splits = _rank_split_sizes(out_shapes, recv_dims, recv_lengths, world_size)
    if (
        len(inputs) == 1
        and (COMPILE_READS_CONTIGUITY or not torch.compiler.is_compiling())
        and inputs[0].is_contiguous()
        and _ranges_tile_memory(in_shapes[0], send_dims[0], send_starts, send_lengths)
    ):
        buffer = inputs[0].reshape(-1)  # a view: the input's memory is the send buffer
    else:
        buffer = pack_blocks(inputs, send_dims, send_starts, send_lengths)
    received = all_to_all_single(buffer, recv_splits, send_splits, group.name)
    if (
        len(out_shapes) == 1
        and (out_dim_orders is None or list(out_dim_orders[0]) == list(range(len(out_shapes[0]))))
        and _ranges_tile_memory(out_shapes[0], recv_dims[0], recv_starts, recv_lengths)
    ):
        return [received.view(out_shapes[0])]  # the received buffer is the output
    return unpack_blocks(received, out_shapes, recv_dims, recv_starts, recv_lengths, out_dim_orders)


def _ranges_tile_memory(shape: Sequence[int], split_dim: int, starts: Sequence[int], lengths: Sequence[int]) -> bool:
    """Whether one C-order tensor's ranges along split_dim, in rank order, are its
    memory cut in consecutive pieces: every dim before split_dim has size 1 and the
    ranges cover split_dim end to end. Packing (or unpacking) such ranges is a plain
    copy, so the exchange sends from (or receives into) the tensor's memory instead.
    A DSP switch of a batch-1 video tensor (1, T, S, C) is this case on one side:
    T -> S receives into the output, S -> T sends from the input."""
    split_dim %= len(shape)
    if any(size != 1 for size in shape[:split_dim]):
        return False
    return list(starts) == offsets(list(lengths)) and sum(lengths) == shape[split_dim]
