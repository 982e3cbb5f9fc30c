"""Torch custom ops: fake kernels, autograd and Python entry points.

Schemas of the compiled ops are in csrc/ops.cpp; the collective op is defined here in
Python because it calls torch.distributed.
"""

from seqpar_kernels.ops.block_copy import pack_blocks, unpack_blocks
from seqpar_kernels.ops.all_to_all import all_to_all_single
from seqpar_kernels.ops.ring_attention import (
    attention_merge_,
    ring_attention_backward,
    ring_attention_forward,
)

__all__ = ["pack_blocks", "unpack_blocks", "all_to_all_single"]
__all__ += ["attention_merge_", "ring_attention_forward", "ring_attention_backward"]
