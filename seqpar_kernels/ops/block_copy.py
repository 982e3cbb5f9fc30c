"""seqpar::pack_blocks and seqpar::unpack_blocks: fake kernels, autograd, entry points.

Schemas: csrc/ops.cpp. CPU kernel: csrc/cpu/block_copy.cpp. CUDA kernel:
csrc/cuda/block_copy.cu. Tests: tests/test_block_copy.py.

A block is `tensor.narrow(split_dim, start, length)` in C order. Packing writes the
blocks of every (rank, tensor) pair into one flat buffer, rank-major then tensor, which
is the send buffer of one `all_to_all_single`. Unpacking is its adjoint: it writes each
block of a flat buffer into its range of a new tensor, summing where ranges overlap.
So each op is the other's backward.
"""

from __future__ import annotations

from typing import Sequence

import torch

from seqpar_kernels import extension  # noqa: F401  (registers torch.ops.seqpar)


def block_numel(shape: Sequence[int], split_dim: int, length: int) -> int:
    """Elements of tensor.narrow(split_dim, start, length) for a tensor of `shape`."""
    numel = length
    for dim, size in enumerate(shape):  # a plain loop: torch.compile traces it
        if dim != split_dim:
            numel *= size
    return numel


def pack_blocks(
    inputs: Sequence[torch.Tensor],
    split_dims: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
) -> torch.Tensor:
    """Packs ranges of `inputs` into one flat buffer.

    inputs: up to 4 tensors of one dtype and device, any strides (read in place).
    split_dims[t]: the dim of inputs[t] that the ranges narrow.
    starts, lengths: world_size x len(inputs) entries, index rank * len(inputs) + t.
    Returns a 1-D tensor: for each rank, for each tensor, the block in C order.
    """
    return torch.ops.seqpar.pack_blocks(list(inputs), list(split_dims), list(starts), list(lengths))


def unpack_blocks(
    buffer: torch.Tensor,
    out_shapes: Sequence[Sequence[int]],
    split_dims: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    out_dim_orders: Sequence[Sequence[int]] | None = None,
) -> list[torch.Tensor]:
    """Unpacks a flat buffer laid out as pack_blocks writes it into new tensors.

    out_shapes[t]: the logical shape of output t (all outputs have one ndim).
    out_dim_orders[t]: output t's dims from outermost to innermost in memory; the
        default is C order. (B, S, H, D) outputs with order (0, 2, 1, 3) are (B, H, S, D)
        in memory, the layout attention kernels want, written without a copy.
    Ranges of one output that overlap are summed in fp32 (fp64 for fp64); parts no
    range covers are zero.
    """
    ndim = len(out_shapes[0])
    if out_dim_orders is None:
        out_dim_orders = [list(range(ndim))] * len(out_shapes)
    return torch.ops.seqpar.unpack_blocks(
        buffer,
        [size for shape in out_shapes for size in shape],
        [dim for order in out_dim_orders for dim in order],
        list(split_dims),
        list(starts),
        list(lengths),
    )


def _strides_for_order(shape: Sequence[int], order: Sequence[int]) -> list[int]:
    strides = [0] * len(shape)
    stride = 1
    for dim in reversed(order):
        strides[dim] = stride
        stride *= max(shape[dim], 1)
    return strides


@torch.library.register_fake("seqpar::pack_blocks")
def _pack_blocks_fake(inputs, split_dims, starts, lengths):
    num_tensors = len(inputs)
    total = 0
    for index, length in enumerate(lengths):
        tensor = inputs[index % num_tensors]
        total += block_numel(tensor.shape, split_dims[index % num_tensors] % tensor.dim(), length)
    return inputs[0].new_empty(total)


@torch.library.register_fake("seqpar::unpack_blocks")
def _unpack_blocks_fake(buffer, out_shapes, out_dim_orders, split_dims, starts, lengths):
    num_tensors = len(split_dims)
    ndim = len(out_shapes) // num_tensors
    outputs = []
    for t in range(num_tensors):
        shape = out_shapes[t * ndim : (t + 1) * ndim]
        order = out_dim_orders[t * ndim : (t + 1) * ndim]
        outputs.append(buffer.new_empty_strided(shape, _strides_for_order(shape, order)))
    return outputs


def _pack_setup_context(ctx, inputs, output):
    tensors, split_dims, starts, lengths = inputs
    ctx.shapes = [list(tensor.shape) for tensor in tensors]
    ctx.split_dims = [dim % tensor.dim() for dim, tensor in zip(split_dims, tensors)]
    ctx.starts = starts
    ctx.lengths = lengths


def _pack_backward(ctx, grad_buffer):
    # The adjoint of a gather into a buffer is a scatter-add back into the inputs.
    grads = unpack_blocks(grad_buffer.contiguous(), ctx.shapes, ctx.split_dims, ctx.starts, ctx.lengths)
    return grads, None, None, None


def _unpack_setup_context(ctx, inputs, output):
    buffer, out_shapes, out_dim_orders, split_dims, starts, lengths = inputs
    ctx.out_shapes = [list(tensor.shape) for tensor in output]
    ctx.split_dims = split_dims
    ctx.starts = starts
    ctx.lengths = lengths


def _unpack_backward(ctx, grad_outputs):
    # An output that did not reach the loss has no gradient: its blocks get zeros.
    reference = next(grad for grad in grad_outputs if grad is not None)
    grads = [
        grad if grad is not None else reference.new_zeros(shape) for grad, shape in zip(grad_outputs, ctx.out_shapes)
    ]
    return pack_blocks(grads, ctx.split_dims, ctx.starts, ctx.lengths), None, None, None, None, None


torch.library.register_autograd("seqpar::pack_blocks", _pack_backward, setup_context=_pack_setup_context)
torch.library.register_autograd("seqpar::unpack_blocks", _unpack_backward, setup_context=_unpack_setup_context)
