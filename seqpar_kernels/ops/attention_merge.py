"""seqpar::attention_merge_: the Python entry point and the fake kernel.

Schema: csrc/ops.cpp. Kernels: csrc/cpu/attention_merge.cpp, csrc/cuda/attention_merge.cu.
Tests: tests/test_attention_merge.py. The ring's CPU step kernels use it to fold each
block into the running result (seqpar_kernels/engine/step_backends.py).
"""

from __future__ import annotations

import torch

from seqpar_kernels import extension  # noqa: F401  (registers torch.ops.seqpar)


def attention_merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Folds one block's attention into the running result, in place:

        new_lse = logaddexp(lse, block_lse)
        out     = out * exp(lse - new_lse) + block_out * exp(block_lse - new_lse)

    out: fp32 (B, S, H, D); lse: fp32 (B, H, S); block_out: (B, S, H, D) fp32, fp16 or
    bf16; block_lse: fp32 (B, H, S). Any strides (aten's CPU flash output, (B, H, S, D)
    logically, is passed as its .transpose(1, 2) view). Overflow-free for large logits.
    Rows with block_lse == -inf are untouched (so -inf stays -inf and out stays as it
    was, never NaN); rows with lse == -inf take block_out, whatever out held."""
    torch.ops.seqpar.attention_merge_(out, lse, block_out, block_lse)


@torch.library.register_fake("seqpar::attention_merge_")
def _attention_merge_fake(out, lse, block_out, block_lse):
    return None
