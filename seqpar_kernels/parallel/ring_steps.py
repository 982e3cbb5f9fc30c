"""How one ring step computes, by device: the step kernels the ring driver
(seqpar_kernels/parallel/ring_driver.py) calls.

Each folds one K/V block into this rank's running fp32 (out, lse) in place (forward),
or adds one block's share of the gradients (backward):

    "aten"              CPU: aten's CPU flash kernel for the block's (out, lse) in fp32,
                        then the attention_merge_ kernel; aten's flash backward given the
                        final out and lse. The device default on CPUs.
    "aten-repeated-kv"  the same with kv heads repeated for the local kernel: the path of
                        torch releases whose CPU flash kernel cannot read GQA
                        (CPU_FLASH_READS_GQA), selectable on any release.
    "triton"            the fused Triton step kernels (seqpar_kernels/kernels/): the
                        device default on GPUs (packed documents: one launch per step
                        with per-row key intervals, forward_intervals); on CPU tensors they run in the Triton
                        interpreter (TRITON_INTERPRET=1), which tests use to check the
                        GPU path's schedule without a GPU.
"""

from __future__ import annotations

import torch

from seqpar_kernels.ops.attention_merge import attention_merge_

# aten's private CPU flash kernels (the public SDPA checks layouts before it calls them;
# these calls bypass that). Layout they assume, read from their source and measured on
# torch 2.14: every tensor is (B, H, S, D) logically and element (b, h, s, d) is read at
# b * stride_b + h * stride_h + s * stride_s + d, so ANY strides along B, H and S but a
# unit stride along the head dim. A q (forward) or out (backward) with another last
# stride gives wrong results without an error; the kernels happen to copy k, v and dout
# first today, which nothing promises. _cpu_flash_operand enforces the assumption for
# every tensor they read.
_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _cpu_flash_operand(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, S, H, D) -> the (B, H, S, D) view aten's CPU flash kernels read, in `dtype`
    (default: x's), with a unit stride along the head dim: copied only when x has
    another one (a transposed or strided last dim, which those kernels misread)."""
    if dtype is not None:
        x = x.to(dtype)
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    return x.transpose(1, 2)


# aten's CPU flash kernel maps q head h to kv head h // (H / H_kv) from torch 2.9 on.
# Measured on 2.6.0, 2.7.1, 2.8.0, 2.9.0, 2.9.1, 2.10.0, 2.11.0, 2.12.1, 2.13.0 and
# 2.14.1, forward and backward with fewer kv heads than q heads against fp64 on
# repeated heads (8 to 24 shapes each, causal and not, head-major and sequence-major
# layouts): before 2.9 it reads past the kv heads (errors up to 1e38, NaN) and the
# backward corrupts the heap (SIGABRT) in nearly every shape; from 2.9 on it matches
# SDPA on repeated heads (max error 2.5e-6 forward, 6.2e-6 backward). Older releases
# take the repeated path: kv heads repeated for the local kernel, a copy per step on
# this rank only (what travels the ring stays the kv heads).
CPU_FLASH_READS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def _sum_head_groups(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, S, H, D) gradient of repeated kv heads -> (B, S, H_kv, D)."""
    if grad.shape[2] == num_kv_heads:
        return grad
    batch, seqlen, heads, head_dim = grad.shape
    return grad.reshape(batch, seqlen, num_kv_heads, heads // num_kv_heads, head_dim).sum(3)


class AtenCpuSteps:
    """CPU: aten's flash kernel per block + attention_merge_; aten's flash backward.
    repeat_kv_heads: hand the kernels q's head count of kv heads (each kv head repeated
    for its q heads, gradients summed back), for torch releases whose kernel cannot read
    GQA; only this rank's local kernel sees the copies."""

    def __init__(self, repeat_kv_heads: bool):
        self.repeat_kv_heads = repeat_kv_heads

    def _kv_for_kernel(self, k: torch.Tensor, v: torch.Tensor, num_heads: int):
        """k, v: (B, S, H_kv, D) -> what the kernel reads for `num_heads` q heads."""
        if k.shape[2] == num_heads or not self.repeat_kv_heads:
            return k, v
        group = num_heads // k.shape[2]
        return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)

    def prepare_backward(self, out, dout):
        return None  # aten's backward computes rowsum(dout * out) itself

    def forward(self, q, k, v, out, lse, scale, causal):
        # In fp32, as the CUDA path keeps every block: aten returns a block's output in
        # the input dtype, and rounding each block to bf16 before the fp32 merge measured
        # 2-4x plain torch's dq/dk error (randomized test, bf16, 2 ranks). On a CPU
        # without bf16 matrix units the fp32 kernel plus the casts is also faster than
        # the bf16 kernel (one thread, causal, (1, 8, 1024, 64): 19.8 ms against 26.4).
        k, v = self._kv_for_kernel(k, v, q.shape[2])
        block_out, block_lse = _cpu_flash(
            *(_cpu_flash_operand(x, torch.float32) for x in (q, k, v)), 0.0, causal, scale=scale
        )
        attention_merge_(out, lse, block_out.transpose(1, 2), block_lse)

    def forward_masked(self, q, k, v, out, lse, scale, mask, empty_rows):
        """forward under an fp32 additive (q rows, k rows) mask; empty_rows: the rows
        whose mask is all -inf, for which aten returns lse 0 (not -inf) and out 0, so
        their lse is set to -inf and the merge leaves them untouched."""
        k, v = self._kv_for_kernel(k, v, q.shape[2])
        block_out, block_lse = _cpu_flash(
            *(_cpu_flash_operand(x, torch.float32) for x in (q, k, v)), 0.0, False, attn_mask=mask, scale=scale
        )
        block_lse = block_lse.masked_fill(empty_rows, float("-inf"))
        attention_merge_(out, lse, block_out.transpose(1, 2), block_lse)

    def backward_masked(self, dout, q, k, v, out, lse, delta, dq, dk, dv, scale, mask):
        # exp(s + mask - lse) is exactly 0 where the mask is -inf: the masked keys and the
        # empty rows get nothing.
        self._backward(dout, q, k, v, out, lse, dq, dk, dv, scale, False, mask)

    def backward(self, dout, q, k, v, out, lse, delta, dq, dk, dv, scale, causal):
        self._backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, None)

    def _backward(self, dout, q, k, v, out, lse, dq, dk, dv, scale, causal, mask):
        # Given the final out and lse, aten rebuilds this block's probabilities as
        # exp(s - lse) and its delta from the final out: the block's exact share.
        # In fp32 too: aten returns each block's gradients in the input dtype, and
        # rounding every block's dk/dv to bf16 before the fp32 accumulation measured
        # 2.2-2.7x plain torch's dv error (bf16 GQA causal, 4 ranks; bench ring-train).
        kv_heads = k.shape[2]
        k, v = self._kv_for_kernel(k, v, q.shape[2])
        grad_q, grad_k, grad_v = _cpu_flash_backward(
            *(_cpu_flash_operand(x, torch.float32) for x in (dout, q, k, v, out)),
            lse, 0.0, causal, attn_mask=mask, scale=scale,
        )  # fmt: skip
        dq.add_(grad_q.transpose(1, 2))
        dk.add_(_sum_head_groups(grad_k.transpose(1, 2), kv_heads))
        dv.add_(_sum_head_groups(grad_v.transpose(1, 2), kv_heads))


class TritonSteps:
    """CUDA (or the Triton interpreter on CPU tensors, in tests): the fused step kernels."""

    def prepare_backward(self, out, dout):
        from seqpar_kernels.kernels.attention_step_launch import attention_backward_preprocess

        return attention_backward_preprocess(out, dout)

    def forward(self, q, k, v, out, lse, scale, causal):
        from seqpar_kernels.kernels import attention_step_launch as kernels

        mode = kernels.MASK_CAUSAL if causal else kernels.MASK_FULL
        kernels.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)

    def backward(self, dout, q, k, v, out, lse, delta, dq, dk, dv, scale, causal):
        from seqpar_kernels.kernels import attention_step_launch as kernels

        mode = kernels.MASK_CAUSAL if causal else kernels.MASK_FULL
        kernels.attention_step_backward(
            q, k, v, out, dout, lse, delta, dq, dk, dv, softmax_scale=scale, mask_mode=mode
        )


    def forward_intervals(self, q, k, v, out, lse, scale, intervals):
        """forward over packed documents: query row i attends key rows [row_start[i],
        row_end[i]) of the block (intervals = (row_start, row_end, col_start, col_end),
        parallel/documents.py), in one launch that skips tiles with no common document."""
        from seqpar_kernels.kernels import attention_step_launch as kernels

        kernels.attention_step_forward(
            q, k, v, out, lse, softmax_scale=scale, mask_mode=kernels.MASK_INTERVALS, intervals=intervals
        )

    def backward_intervals(self, dout, q, k, v, out, lse, delta, dq, dk, dv, scale, intervals):
        from seqpar_kernels.kernels import attention_step_launch as kernels

        kernels.attention_step_backward(
            q, k, v, out, dout, lse, delta, dq, dk, dv, softmax_scale=scale, mask_mode=kernels.MASK_INTERVALS,
            intervals=intervals,
        )


STEP_KERNELS = {
    "aten": AtenCpuSteps(repeat_kv_heads=not CPU_FLASH_READS_GQA),
    "aten-repeated-kv": AtenCpuSteps(repeat_kv_heads=True),
    "triton": TritonSteps(),
}
DEVICE_DEFAULT = "device-default"
_DEVICE_DEFAULTS = {"cpu": "aten", "cuda": "triton"}


def step_kernels_for(name: str, device: torch.device):
    """The step kernels called `name`, or DEVICE_DEFAULT's choice for `device`."""
    if name == DEVICE_DEFAULT:
        if device.type not in _DEVICE_DEFAULTS:
            raise ValueError(f"ring attention runs on CPU or CUDA tensors, got device {device}")
        name = _DEVICE_DEFAULTS[device.type]
    if name not in STEP_KERNELS:
        raise ValueError(f"step kernels must be one of {[DEVICE_DEFAULT, *STEP_KERNELS]}, got {name!r}")
    return STEP_KERNELS[name]
