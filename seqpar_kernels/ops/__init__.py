"""Torch custom ops of the compiled kernels and of the collectives: schema binding, fake
kernels and autograd, nothing above them.

Schemas of the compiled ops (pack_blocks, unpack_blocks, attention_merge_) are in
csrc/ops.cpp; the collective all_to_all_single is defined here in Python. The ring's
own ops (ring attention and packed-documents attention) live with the engine that runs
them (seqpar_kernels/engine/).
"""

from seqpar_kernels.ops.all_to_all import all_to_all_single
from seqpar_kernels.ops.attention_merge import attention_merge_
from seqpar_kernels.ops.block_copy import pack_blocks, unpack_blocks

__all__ = ["pack_blocks", "unpack_blocks", "all_to_all_single", "attention_merge_"]
