"""Torch custom ops: fake kernels, autograd and Python entry points.

Schemas of the compiled ops (pack_blocks, unpack_blocks, attention_merge_) are in
csrc/ops.cpp; the ops that call torch.distributed (all_to_all_single, the ring attention
forward and backward, and the packed-documents attention that Ulysses runs locally)
are defined here in Python.
"""

from seqpar_kernels.ops.block_copy import pack_blocks, unpack_blocks
from seqpar_kernels.ops.all_to_all import all_to_all_single
from seqpar_kernels.ops.attention_merge import attention_merge_
from seqpar_kernels.ops.ring_attention import ring_attention_backward, ring_attention_forward
from seqpar_kernels.ops.varlen_attention import varlen_attention_backward, varlen_attention_forward

__all__ = [
    "pack_blocks",
    "unpack_blocks",
    "all_to_all_single",
    "attention_merge_",
    "ring_attention_forward",
    "ring_attention_backward",
    "varlen_attention_forward",
    "varlen_attention_backward",
]
