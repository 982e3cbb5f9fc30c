"""torch's own attention kernels for one ring step's block: the kernels of the "aten"
step backend (engine/step_backends.py AtenSteps), which merges each block's result into
the running (out, lse) with seqpar::attention_merge_.

Every kernel here returns a block's log-sum-exp (forward) and takes the FINAL out and lse
(backward): with them a block's probabilities are exp(s - lse), so each block's
gradients are its exact share of the whole attention's.

    CpuFlashBlocks      aten's CPU flash kernels, computed in fp32.
    MathBlocks          plain torch in fp32 on any device, the scores materialized a tile
                        of query rows at a time: what the library kernels cannot do
                        (softcapped scores).
    CudaLibraryBlocks   CUDA: cuDNN's fused attention on sm_90 and newer where torch has
                        it (the fastest published kernel there), flash-attention 2
                        otherwise; aten's memory-efficient kernel for what neither takes
                        (fp32, an additive mask for packed documents, head dims that are
                        not a multiple of 8).

Layouts: q (B, S, H, D); k (B, S, H_kv, D); v (B, S, H_kv, Dv); dout, out (B, S, H, Dv),
any strides (Dv may differ from D: multi-head latent attention); lse (B, H, S) fp32.
Forward returns (block_out (B, S, H, Dv) view in the kernel's output dtype, block_lse
(B, H, S) fp32); backward returns (dq, dk, dv) as views shaped like q, k, v.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_aten = torch.ops.aten

# aten's private CPU flash kernels (the public SDPA checks layouts before it calls them;
# these calls bypass that). Layout they assume, read from their source and measured on
# torch 2.14: every tensor is (B, H, S, D) logically and element (b, h, s, d) is read at
# b * stride_b + h * stride_h + s * stride_s + d, so ANY strides along B, H and S but a
# unit stride along the head dim. A q (forward) or out (backward) with another last
# stride gives wrong results without an error; the kernels happen to copy k, v and dout
# first today, which nothing promises. _head_major enforces the assumption for every
# tensor they read.
_cpu_flash = _aten._scaled_dot_product_flash_attention_for_cpu.default
_cpu_flash_backward = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default

# aten's CPU flash kernel reads GQA (q head h -> kv head h // (H / H_kv)) from torch 2.9
# on; older releases read past the kv heads (docs/tuning.md), so there the kv heads are
# repeated for the local kernel, on this rank only (the ring still carries kv heads).
CPU_FLASH_READS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)


def _head_major(x: torch.Tensor, dtype: torch.dtype | None = None, dense: bool = False) -> torch.Tensor:
    """(B, S, H, D) -> the (B, H, S, D) view the kernels read, in `dtype` (default: x's),
    with a unit stride along the head dim: copied only when x has another one. dense:
    copied unless x is contiguous as (B, S, H, D) (no stride-0 expansion, no gaps of a
    fused projection, no transposed storage), the layout torch's SDPA hands cuDNN; cuDNN
    is silently wrong on some others and reads dout with out's strides."""
    if dtype is not None:
        x = x.to(dtype)
    if dense or (x.stride(-1) != 1 and x.shape[-1] > 1):
        x = x.contiguous()
    return x.transpose(1, 2)


def _one_head_dim(*tensors: torch.Tensor, width: int) -> list[torch.Tensor]:
    """Each (B, S, H, D_i) tensor zero-padded along the head dim to `width`, as aten's
    fused kernels take q, k and v of one head dim only. Exact: zero columns add nothing
    to q.k, and a zero column of v gives a zero column of out (and of dv)."""
    return [x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1])) for x in tensors]


def _value_head_dim(kernel):
    """Wraps a block kernel class's forward and backward so that they take v of another
    head dim than q and k (multi-head latent attention): every operand padded to the wider
    dim (_one_head_dim), the results cut back to their own."""

    forward, backward = kernel.forward, kernel.backward

    def padded_forward(self, q, k, v, *args, **kwargs):
        head_dim, value_dim = q.shape[-1], v.shape[-1]
        if head_dim == value_dim:
            return forward(self, q, k, v, *args, **kwargs)
        q, k, v = _one_head_dim(q, k, v, width=max(head_dim, value_dim))
        out, lse = forward(self, q, k, v, *args, **kwargs)
        return out[..., :value_dim], lse

    def padded_backward(self, dout, q, k, v, out, *args, **kwargs):
        head_dim, value_dim = q.shape[-1], v.shape[-1]
        if head_dim == value_dim:
            return backward(self, dout, q, k, v, out, *args, **kwargs)
        dout, q, k, v, out = _one_head_dim(dout, q, k, v, out, width=max(head_dim, value_dim))
        dq, dk, dv = backward(self, dout, q, k, v, out, *args, **kwargs)
        return dq[..., :head_dim], dk[..., :head_dim], dv[..., :value_dim]

    kernel.forward, kernel.backward = padded_forward, padded_backward
    return kernel


def _repeat_kv(k: torch.Tensor, v: torch.Tensor, num_heads: int):
    """k, v: (B, S, H_kv, D) -> each kv head repeated for its q heads: (B, S, H, D)."""
    if k.shape[2] == num_heads:
        return k, v
    group = num_heads // k.shape[2]
    return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)


def _sum_head_groups(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, S, H, D) gradient of repeated kv heads -> (B, S, H_kv, D)."""
    if grad.shape[2] == num_kv_heads:
        return grad
    batch, seqlen, heads, head_dim = grad.shape
    return grad.reshape(batch, seqlen, num_kv_heads, heads // num_kv_heads, head_dim).sum(3)


@_value_head_dim
class CpuFlashBlocks:
    """aten's CPU flash kernels. repeat_kv_heads: hand them q's head count of kv heads
    (each repeated, gradients summed back), for torch releases whose kernel cannot read
    GQA; only this rank's local kernel sees the copies.

    In fp32, as the Triton step kernels keep every block: aten returns a block's output
    and gradients in the input dtype, and rounding each block to bf16 before the fp32
    merge breaks the accuracy rule; on CPUs the fp32 kernel is also the faster one
    (docs/tuning.md)."""

    def __init__(self, repeat_kv_heads: bool):
        self.repeat_kv_heads = repeat_kv_heads

    def _kv(self, k, v, num_heads):
        return _repeat_kv(k, v, num_heads) if self.repeat_kv_heads else (k, v)

    def forward(self, q, k, v, scale, causal, mask=None):
        k, v = self._kv(k, v, q.shape[2])
        out, lse = _cpu_flash(
            *(_head_major(x, torch.float32) for x in (q, k, v)), 0.0, causal, attn_mask=mask, scale=scale
        )  # fmt: skip
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask=None):
        kv_heads = k.shape[2]
        k, v = self._kv(k, v, q.shape[2])
        dq, dk, dv = _cpu_flash_backward(
            *(_head_major(x, torch.float32) for x in (dout, q, k, v, out)),
            lse, 0.0, causal, attn_mask=mask, scale=scale,
        )  # fmt: skip
        return (dq.transpose(1, 2), _sum_head_groups(dk.transpose(1, 2), kv_heads),
                _sum_head_groups(dv.transpose(1, 2), kv_heads))  # fmt: skip


# ----------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------

FLASH = "flash"  # flash-attention 2 (torch's build): fp16/bf16, head dim % 8 == 0, <= 256; GQA
CUDNN = "cudnn"  # cuDNN's SDPA: fp16/bf16, head dim % 8 == 0, <= 128; kv heads repeated
EFFICIENT = "efficient"  # the memory-efficient kernel: any float dtype, additive masks


def _cudnn_available() -> bool:
    return hasattr(_aten, "_scaled_dot_product_cudnn_attention") and torch.backends.cudnn.is_available()


def cuda_block_kernel(q: torch.Tensor, masked: bool, capability: int) -> str:
    """Which library kernel computes a block of q's dtype and head dim on a GPU of
    compute capability `capability` (90 for sm_90); masked: the block carries an
    additive mask (coalesced packed documents)."""
    head_dim = q.shape[-1]
    if masked or q.dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 != 0 or head_dim > 256:
        return EFFICIENT
    if capability >= 90 and head_dim <= 128 and _cudnn_available():
        return CUDNN
    return FLASH


def _rng_state(kernel: str, device):
    """(philox seed, philox offset) tensors a backward kernel takes. Without dropout none
    is read; they only have to be tensors of the kinds the forward returns."""
    if kernel == FLASH:
        return torch.empty(2, dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)
    return torch.empty((), dtype=torch.int64, device=device), torch.empty((), dtype=torch.int64, device=device)


def _additive_bias(mask: torch.Tensor, q: torch.Tensor, heads: int) -> torch.Tensor:
    """The fp32 (q rows, k rows) additive mask as the memory-efficient kernel reads it:
    q's dtype, (B, H, q rows, k rows), its rows 16-element aligned (a view into a padded
    buffer, as SDPA prepares masks for this kernel)."""
    rows, cols = mask.shape
    padded = torch.empty((rows, -(-cols // 16) * 16), dtype=q.dtype, device=q.device)
    bias = padded[:, :cols]
    bias.copy_(mask)
    return bias.expand(q.shape[0], heads, rows, cols)


@_value_head_dim
class CudaLibraryBlocks:
    """CUDA: torch's fused attention kernels per block (cuDNN, flash, memory-efficient:
    cuda_block_kernel chooses). Blocks are computed in the input dtype: the kernels take
    fp16/bf16 inputs on tensor cores and return the block's output and gradients in that
    dtype (the merge and the dq/dk/dv accumulators stay fp32).

    kernel: force one kernel (tests, benchmarks); None: cuda_block_kernel's choice.
    capability: the GPU's compute capability; None: asked of q's device."""

    def __init__(self, kernel: str | None = None, capability: int | None = None):
        assert kernel in (None, FLASH, CUDNN, EFFICIENT), kernel
        self.kernel, self.capability = kernel, capability

    def _choose(self, q, masked):
        if self.kernel is not None:
            return self.kernel
        capability = self.capability
        if capability is None:
            major, minor = torch.cuda.get_device_capability(q.device)
            capability = 10 * major + minor
        return cuda_block_kernel(q, masked, capability)

    def forward(self, q, k, v, scale, causal, mask=None):
        kernel = self._choose(q, mask is not None)
        heads = q.shape[2]
        if kernel != FLASH:  # cuDNN and the memory-efficient kernel read as many kv heads as q heads
            k, v = _repeat_kv(k, v, heads)
        q_, k_, v_ = (_head_major(x, dense=kernel == CUDNN) for x in (q, k, v))
        if kernel == FLASH:
            out, lse, *_ = _aten._scaled_dot_product_flash_attention(q_, k_, v_, 0.0, causal, False, scale=scale)
        elif kernel == CUDNN:
            out, lse, *_ = _aten._scaled_dot_product_cudnn_attention(
                q_, k_, v_, None, True, 0.0, causal, False, scale=scale
            )  # fmt: skip
            lse = lse.view(lse.shape[:3])  # cuDNN's (B, H, S, 1)
        else:
            bias = None if mask is None else _additive_bias(mask, q, heads)
            out, lse, *_ = _aten._scaled_dot_product_efficient_attention(
                q_, k_, v_, bias, True, 0.0, causal and mask is None, scale=scale
            )  # fmt: skip
            lse = lse[..., : q.shape[1]]  # padded to a multiple of 32 rows
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask=None):
        kernel = self._choose(q, mask is not None)
        heads, kv_heads, q_len, k_len = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
        if kernel != FLASH:
            k, v = _repeat_kv(k, v, heads)
        dout_, q_, k_, v_, out_ = (_head_major(x, dense=kernel == CUDNN) for x in (dout, q, k, v, out.to(q.dtype)))
        seed, offset = _rng_state(kernel, q.device)
        if kernel == FLASH:
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
                dout_, q_, k_, v_, out_, lse.contiguous(), None, None, q_len, k_len, 0.0, causal, seed, offset,
                scale=scale,
            )  # fmt: skip
        elif kernel == CUDNN:
            dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
                dout_, q_, k_, v_, out_, lse.contiguous().unsqueeze(-1), seed, offset, None, None, None,
                q_len, k_len, 0.0, causal, scale=scale,
            )  # fmt: skip
        else:
            bias = None if mask is None else _additive_bias(mask, q, heads)
            padded_lse = torch.full((*lse.shape[:2], -(-q_len // 32) * 32), float("inf"), dtype=torch.float32,
                                    device=q.device)  # fmt: skip
            padded_lse[..., :q_len] = lse
            dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
                dout_, q_, k_, v_, bias, out_, padded_lse, seed, offset, 0.0,
                [True, True, True, False], causal and mask is None, scale=scale,
            )  # fmt: skip
        return (dq.transpose(1, 2), _sum_head_groups(dk.transpose(1, 2), kv_heads),
                _sum_head_groups(dv.transpose(1, 2), kv_heads))  # fmt: skip


# ----------------------------------------------------------------------------------
# Plain torch: softcapped scores
# ----------------------------------------------------------------------------------

# Query rows per tile of MathBlocks: at most this many fp32 scores materialized at once.
MATH_TILE_SCORES = 1 << 24


class MathBlocks:
    """Attention written out in fp32 (any device): scores = scale * q.k, capped as
    softcap * tanh(scores / softcap) when softcap > 0, plus the additive mask; the
    softmax's lse and output; the backward from the final out and lse. Used for what the
    library kernels do not take (softcap); GQA kv heads are repeated per tile."""

    @staticmethod
    def _tiles(q, k):
        rows = max(1, MATH_TILE_SCORES // max(1, q.shape[0] * q.shape[2] * k.shape[1]))
        return range(0, q.shape[1], rows), rows

    @staticmethod
    def _scores(q, k, scale, causal, mask, softcap, row_start):
        """(capped scores (B, H, rows, S_k) fp32 masked with -inf, tanh of the capped ones
        or None): q (B, rows, H, D) fp32, k (B, S_k, H, D) fp32."""
        raw = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        tanh = None
        if softcap > 0:
            tanh = torch.tanh(raw / softcap)
            raw = softcap * tanh
        if causal:
            rows = torch.arange(row_start, row_start + q.shape[1], device=q.device)
            keep = torch.arange(k.shape[1], device=q.device)[None, :] <= rows[:, None]
            raw = raw.masked_fill(~keep, float("-inf"))
        if mask is not None:
            raw = raw + mask[row_start : row_start + q.shape[1]].to(raw.device)
        return raw, tanh

    def forward(self, q, k, v, scale, causal, mask=None, softcap=0.0):
        heads = q.shape[2]
        k, v = (x.float() for x in _repeat_kv(k, v, heads))
        out = torch.empty((*q.shape[:3], v.shape[3]), dtype=torch.float32, device=q.device)
        lse = torch.empty((q.shape[0], heads, q.shape[1]), dtype=torch.float32, device=q.device)
        starts, rows = self._tiles(q, k)
        for start in starts:
            tile = slice(start, start + rows)
            scores, _ = self._scores(q[:, tile].float(), k, scale, causal, mask, softcap, start)
            tile_lse = torch.logsumexp(scores, dim=-1)
            probabilities = torch.exp(scores - tile_lse.unsqueeze(-1)).nan_to_num(0.0)
            out[:, tile] = torch.einsum("bhqk,bkhd->bqhd", probabilities, v)
            lse[:, :, tile] = tile_lse
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale, causal, mask=None, softcap=0.0):
        heads, kv_heads = q.shape[2], k.shape[2]
        k, v = (x.float() for x in _repeat_kv(k, v, heads))
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        starts, rows = self._tiles(q, k)
        for start in starts:
            tile = slice(start, start + rows)
            scores, tanh = self._scores(q[:, tile].float(), k, scale, causal, mask, softcap, start)
            # exp(s - lse) is exactly 0 where s is -inf or lse +inf (AtenSteps maps an empty
            # row's -inf to +inf): masked keys and empty rows get nothing.
            probabilities = torch.exp(scores - lse[:, :, tile].unsqueeze(-1))
            grad_out = dout[:, tile].float()
            delta = (grad_out * out[:, tile].float()).sum(-1).transpose(1, 2).unsqueeze(-1)  # (B, H, rows, 1)
            grad_scores = probabilities * (torch.einsum("bqhd,bkhd->bhqk", grad_out, v) - delta)
            if tanh is not None:
                grad_scores = grad_scores * (1 - tanh * tanh)
            grad_scores = grad_scores * scale
            dq[:, tile] = torch.einsum("bhqk,bkhd->bqhd", grad_scores, k)
            dk += torch.einsum("bhqk,bqhd->bkhd", grad_scores, q[:, tile].float())
            dv += torch.einsum("bhqk,bqhd->bkhd", probabilities, grad_out)
        return dq, _sum_head_groups(dk, kv_heads), _sum_head_groups(dv, kv_heads)
