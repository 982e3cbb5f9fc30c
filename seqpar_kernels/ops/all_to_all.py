"""seqpar::all_to_all_single: the collective as a torch custom op.

The group travels by name (a string argument), so the op has a schema that
torch.compile and opcheck understand; the fake kernel sizes the output from the split
sizes. Backward is the same exchange with the splits swapped. Bytes sent to other
ranks are counted here, for comm_stats. Tests: tests/test_all_to_all_reshard.py.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from seqpar_kernels.groups import SINGLE_PROCESS, group_from_name
from seqpar_kernels.ops.cuda_graphs import refuse_capture, uncapturable_custom_op
from seqpar_kernels.traffic import record_sent


def register_as_collective(op) -> None:
    """Marks a custom op that exchanges data with the other ranks of its group as an
    ordered side effect for torch.compile.

    Otherwise inductor treats the op as a pure function of its inputs: it removes one
    whose result it finds unused (the backward exchange of an empty gradient on a rank
    that owns no heads) and may order two independent ones differently on different
    ranks, whose graphs differ with their shapes. The ranks' collectives then pair up
    wrongly: a hang, or gloo's "Received data size doesn't match expected size".
    Ordered effects are kept, in program order, on every rank."""
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    _register_effectful_op(op, _EffectType.ORDERED)


def _as_bytes(flat: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous 1-D tensor. One of 0 or 1 elements counts as
    contiguous whatever its stride (opcheck passes stride 0), and a dtype view needs
    stride 1: such a tensor is viewed with stride 1 first, the same memory."""
    if flat.stride(0) != 1:
        assert flat.numel() <= 1, "all_to_all_single takes a contiguous buffer"
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


@uncapturable_custom_op("seqpar::all_to_all_single", mutates_args=())
def all_to_all_single(
    input: torch.Tensor,
    output_split_sizes: List[int],  # typing.List: torch 2.6's schema inference knows no list[int]
    input_split_sizes: List[int],
    group_name: str,
) -> torch.Tensor:
    """input: flat (sum(input_split_sizes),), the piece for rank j at split j.
    Returns flat (sum(output_split_sizes),), rank i's piece at split i."""
    assert input.dim() == 1 and input.is_contiguous(), "all_to_all_single takes a flat buffer"
    refuse_capture("seqpar::all_to_all_single", input)
    if group_name == SINGLE_PROCESS:
        return input.clone()
    group = group_from_name(group_name)
    rank = dist.get_rank(group)
    output = input.new_empty(sum(output_split_sizes))
    # The payload travels as bytes: gloo has no all_to_all for int16, uint16, uint32 or
    # the float8 types, and moving data never needs the element type.
    element_size = input.element_size()
    dist.all_to_all_single(
        _as_bytes(output),
        _as_bytes(input),
        [size * element_size for size in output_split_sizes],
        [size * element_size for size in input_split_sizes],
        group=group,
    )
    sent = sum(input_split_sizes) - input_split_sizes[rank]
    record_sent(sent * element_size)
    return output


register_as_collective(torch.ops.seqpar.all_to_all_single.default)


@all_to_all_single.register_fake
def _all_to_all_single_fake(input, output_split_sizes, input_split_sizes, group_name):
    return input.new_empty(sum(output_split_sizes))


def _setup_context(ctx, inputs, output):
    _, output_split_sizes, input_split_sizes, group_name = inputs
    ctx.output_split_sizes = output_split_sizes
    ctx.input_split_sizes = input_split_sizes
    ctx.group_name = group_name


def _backward(ctx, grad_output):
    grad_input = all_to_all_single(
        grad_output.contiguous(), ctx.input_split_sizes, ctx.output_split_sizes, ctx.group_name
    )
    return grad_input, None, None, None


all_to_all_single.register_autograd(_backward, setup_context=_setup_context)
