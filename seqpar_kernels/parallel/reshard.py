"""Moving between sharded layouts: all_to_all_reshard (the DSP switch),
split_sequence and gather_sequence.

Sizes follow torch.tensor_split: a dim of size N over P ranks gives the first N % P
ranks one more element; pieces may be empty.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from seqpar_kernels.comm.exchange import exchange_blocks
from seqpar_kernels.groups import resolve_group
from seqpar_kernels.layouts import offsets, tensor_split_ranges
from seqpar_kernels.parallel.checks import (
    CheckedOnEveryRank,
    check_gather_arguments,
    check_local_sizes,
    check_split_arguments,
    check_tensor,
    device_of,
    normalize_dim,
)


def all_to_all_reshard(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: dist.ProcessGroup | None = None,
    *,
    gather_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Switches which dim of a distributed tensor is sharded, with one all-to-all.

    x: this rank's piece of a tensor sharded along `gather_dim` (pieces may differ in
        size between ranks) and whole along `scatter_dim`. Any dtype, any strides: x is
        read in place.
    Returns this rank's piece of the same tensor sharded along `scatter_dim`
    (torch.tensor_split convention) and whole along `gather_dim`, contiguous.

    gather_sizes: every rank's size along gather_dim. If None, they are exchanged (one
        small collective; on NCCL a host sync); under torch.compile they are assumed
        equal to this rank's.

    Autograd: the backward is the reverse reshard. Bytes sent: (P-1)/P of x's bytes
    when sizes are even (seqpar_kernels.traffic.reshard_bytes for any sizes).
    """
    info = resolve_group(group)
    with CheckedOnEveryRank("all_to_all_reshard", info, device_of(x), exchange=gather_sizes is None) as checks:
        check_tensor(x, "all_to_all_reshard")
        scatter = normalize_dim(scatter_dim, x.dim(), "scatter_dim", x.shape)
        gather = normalize_dim(gather_dim, x.dim(), "gather_dim", x.shape)
        if scatter == gather:
            raise ValueError(
                f"scatter_dim ({scatter_dim}) and gather_dim ({gather_dim}) name the same dim of a "
                f"tensor of shape {tuple(x.shape)}"
            )
        shape = list(x.shape)
        if gather_sizes is not None:
            gather_sizes = check_local_sizes(gather_sizes, info, shape[gather], "gather_sizes", x.shape, gather)
        shape_without_gather = shape[:gather] + shape[gather + 1 :]
        checks.share(shape[gather], (x.dim(), scatter, gather, x.dtype, shape_without_gather, gather_sizes))
    gather_sizes = checks.sizes if gather_sizes is None else gather_sizes

    # Send: rank j gets x.narrow(scatter, start_j, len_j). Receive: rank i's block is
    # (..., my scatter piece, ..., gather_sizes[i], ...) and lands at offset_i of gather.
    scatter_starts, scatter_lengths = tensor_split_ranges(shape[scatter], info.world_size)
    out_shape = list(shape)
    out_shape[scatter] = scatter_lengths[info.rank]
    out_shape[gather] = sum(gather_sizes)
    (out,) = exchange_blocks(
        [x], [scatter], scatter_starts, scatter_lengths,
        [out_shape], [gather], offsets(gather_sizes), gather_sizes,
        info,
    )  # fmt: skip
    return out


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        info = resolve_group(group)
        starts, lengths = tensor_split_ranges(x.shape[dim], info.world_size)
        ctx.dim, ctx.group, ctx.lengths = dim, group, lengths
        return x.narrow(dim, starts[info.rank], lengths[info.rank])

    @staticmethod
    def backward(ctx, grad):
        return _GatherSequence.apply(grad, ctx.dim, ctx.group, ctx.lengths), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, sizes):
        info = resolve_group(group)
        ctx.dim, ctx.start, ctx.length = dim, offsets(sizes)[info.rank], sizes[info.rank]
        # Every rank sends its whole piece to every rank: a reshard of x repeated along a
        # new leading dim (a stride-0 view, so nothing is copied before the pack kernel).
        repeated = x.unsqueeze(0).expand(info.world_size, *x.shape)
        return all_to_all_reshard(repeated, 0, dim + 1, group, gather_sizes=sizes).squeeze(0)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.start, ctx.length), None, None, None


def split_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's piece of `x` along `dim` (torch.tensor_split convention), a view.
    x must be the same tensor on every rank; one small collective checks that every rank
    passed the same shape, dtype and dim (a bad input on any rank raises on every rank).
    Backward: gather_sequence of the gradient."""
    dim = check_split_arguments("split_sequence", x, dim, resolve_group(group))
    return _SplitSequence.apply(x, dim, group)


def gather_sequence(
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup | None = None,
    *,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """The whole tensor from every rank's piece along `dim` (pieces may differ in size;
    `sizes` lists them, else they are exchanged as in all_to_all_reshard).
    Backward: each rank keeps its own piece of the gradient, as split_sequence does."""
    dim, sizes = check_gather_arguments("gather_sequence", x, dim, resolve_group(group), sizes)
    return _GatherSequence.apply(x, dim, group, sizes)
