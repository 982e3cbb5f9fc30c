"""Ring attention's ops: seqpar::attention_merge_, seqpar::ring_attention_forward and
seqpar::ring_attention_backward, with the ring driver that runs them.

    attention_merge_     schema csrc/ops.cpp; kernels csrc/cpu/attention_merge.cpp and
                         csrc/cuda/attention_merge.cu; fake kernel here.
    ring_attention_*     Python custom ops (they call torch.distributed); the group travels
                         by name, as in ops/all_to_all.py. Public entry point and argument
                         checks: seqpar_kernels/parallel/ring.py.
    Tests: tests/test_attention_merge.py, tests/test_ring_attention.py.

The ring (forward). Rank r holds q, k, v of its sequence piece. K and V are packed once
into one flat buffer that travels the ring (comm/ring.py: send to r+1, receive from
r-1). At step i the rank holds the K/V block of rank src = (r - i) mod P; step i's
exchange (for step i+1) is posted BEFORE step i's attention runs, so the transfer
overlaps the compute, and waited for only after it. Each step folds its block into a
running fp32 (out, lse) that starts at (0, -inf):

    CUDA  the Triton step kernel (kernels/attention_step.py), merge fused, no rounding
          of the running result to the input dtype between steps.
    CPU   aten's CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu) for the
          block's (out, lse), then the attention_merge_ kernel. The Triton kernels would
          also run on CPU, but only in the interpreter, which is orders of magnitude
          slower than aten's vectorized CPU flash kernel; aten's kernel returns lse, so the
          merge is the only extra kernel. It takes GQA/MQA kv heads as they are.

The ring (backward). With the FINAL (out, lse), the probabilities of any block are
exp(s - lse), so each step's gradients are independent and add up (CUDA: the Triton
backward kernels, delta = rowsum(dout * out) computed once; CPU: aten's CPU flash
backward given the final out and lse, which rebuilds the same probabilities). dq stays
home in fp32. The fp32 dK|dV accumulator of a block travels the ring behind its K|V
block: the home rank keeps its own (step 0) share; the accumulator starts at rank r+1
(step 1), collects every rank's share and arrives home after P-1 sends, where the home
share is added. Each step computes into a scratch buffer first and adds it to the
received accumulator only then, so that transfer also overlaps the step's compute.

Which part of a block a step computes (src is the K/V block's home rank):
    non-causal                     every step: all of q x all of the block
    causal, contiguous layout      src == r: causal diagonal; src < r: full; src > r: skip
    causal, zigzag layout          (rank r holds chunks r and 2P-1-r of 2P)
        step 0                     causal on the whole local block
        src < r                    all local q x the FIRST half of the block (chunk src)
        src > r                    the SECOND half of local q (chunk 2P-1-r) x all of it
    so under zigzag every step costs the same on every rank (ring-flash-attention's
    zigzag variant). Half-blocks are views (narrow along the sequence).

Bytes sent per rank: forward (P-1) x (k + v bytes); backward (P-1) x (k + v bytes) for
K|V plus (P-1) x fp32 (dk + dv) for the gradients.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from seqpar_kernels import _extension  # noqa: F401  (registers torch.ops.seqpar)
from seqpar_kernels.comm.ring import GRAD_KV_TAG, KV_TAG, DoubleBuffer, Ring
from seqpar_kernels.ops.all_to_all import register_as_collective

# ----------------------------------------------------------------------------------
# attention_merge_
# ----------------------------------------------------------------------------------


def attention_merge_(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
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


# ----------------------------------------------------------------------------------
# The step schedule
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepBlock:
    """What one ring step computes: local q rows [q_start, q_start + q_len) against the
    first kv_len rows of the visiting K/V block, causal (diagonal) or full."""

    q_start: int
    q_len: int
    kv_len: int
    causal: bool


def step_block(step: int, rank: int, world_size: int, seqlen: int, causal: bool, zigzag: bool):
    """The StepBlock of ring step `step` on `rank`, or None when the step computes
    nothing (contiguous causal, block from a later rank). See the module docstring."""
    src = (rank - step) % world_size
    if not causal:
        return StepBlock(0, seqlen, seqlen, False)
    if src == rank:
        return StepBlock(0, seqlen, seqlen, True)
    if not zigzag:
        return StepBlock(0, seqlen, seqlen, False) if src < rank else None
    half = seqlen // 2
    if src < rank:  # chunks (src, 2P-1-src): only chunk src precedes both local chunks
        return StepBlock(0, seqlen, half, False)
    # src > r: both of the block's chunks precede local chunk 2P-1-r, none precedes chunk r
    return StepBlock(half, seqlen - half, seqlen, False)


# ----------------------------------------------------------------------------------
# Per-step compute, by device
# ----------------------------------------------------------------------------------

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


# aten's CPU flash kernel maps q head h to kv head h // (H / H_kv) in torch 2.13 and 2.14
# (checked); torch 2.6's reads past the kv heads instead (measured: NaN forward, heap
# corruption in the backward). The releases in between are not checked, so they take
# the repeated path too: kv heads repeated for the local kernel, a copy per step on this
# rank only (what travels the ring stays the kv heads).
_CPU_FLASH_READS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


def _kv_for_cpu_flash(k: torch.Tensor, v: torch.Tensor, num_heads: int):
    """k, v: (B, S, H_kv, D) -> what aten's CPU flash kernel reads for `num_heads` q heads."""
    if k.shape[2] == num_heads or _CPU_FLASH_READS_GQA:
        return k, v
    group = num_heads // k.shape[2]
    return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)


def _sum_head_groups(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, S, H, D) gradient of repeated kv heads -> (B, S, H_kv, D)."""
    if grad.shape[2] == num_kv_heads:
        return grad
    batch, seqlen, heads, head_dim = grad.shape
    return grad.reshape(batch, seqlen, num_kv_heads, heads // num_kv_heads, head_dim).sum(3)


class _AtenCpuSteps:
    """CPU: aten's flash kernel per block + attention_merge_; aten's flash backward."""

    @staticmethod
    def prepare_backward(out, dout):
        return None  # aten's backward computes rowsum(dout * out) itself

    @staticmethod
    def forward(q, k, v, out, lse, scale, causal):
        # In fp32, as the CUDA path keeps every block: aten returns a block's output in
        # the input dtype, and rounding each block to bf16 before the fp32 merge measured
        # 2-4x plain torch's dq/dk error (randomized test, bf16, 2 ranks). On a CPU
        # without bf16 matrix units the fp32 kernel plus the casts is also faster than
        # the bf16 kernel (one thread, causal, (1, 8, 1024, 64): 19.8 ms against 26.4).
        k, v = _kv_for_cpu_flash(k, v, q.shape[2])
        block_out, block_lse = _cpu_flash(
            *(_cpu_flash_operand(x, torch.float32) for x in (q, k, v)), 0.0, causal, scale=scale
        )
        attention_merge_(out, lse, block_out.transpose(1, 2), block_lse)

    @staticmethod
    def backward(dout, q, k, v, out, lse, delta, dq, dk, dv, scale, causal):
        # Given the final out and lse, aten rebuilds this block's probabilities as
        # exp(s - lse) and its delta from the final out: the block's exact share.
        # In fp32 too: aten returns each block's gradients in the input dtype, and
        # rounding every block's dk/dv to bf16 before the fp32 accumulation measured
        # 2.2-2.7x plain torch's dv error (bf16 GQA causal, 4 ranks; bench ring-train).
        kv_heads = k.shape[2]
        k, v = _kv_for_cpu_flash(k, v, q.shape[2])
        grad_q, grad_k, grad_v = _cpu_flash_backward(
            *(_cpu_flash_operand(x, torch.float32) for x in (dout, q, k, v, out)),
            lse, 0.0, causal, scale=scale,
        )  # fmt: skip
        dq.add_(grad_q.transpose(1, 2))
        dk.add_(_sum_head_groups(grad_k.transpose(1, 2), kv_heads))
        dv.add_(_sum_head_groups(grad_v.transpose(1, 2), kv_heads))


class _TritonSteps:
    """CUDA (or the Triton interpreter, in tests): the fused step kernels."""

    @staticmethod
    def prepare_backward(out, dout):
        from seqpar_kernels.kernels.attention_step import attention_backward_preprocess

        return attention_backward_preprocess(out, dout)

    @staticmethod
    def forward(q, k, v, out, lse, scale, causal):
        from seqpar_kernels.kernels import attention_step as kernels

        mode = kernels.MASK_CAUSAL if causal else kernels.MASK_FULL
        kernels.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)

    @staticmethod
    def backward(dout, q, k, v, out, lse, delta, dq, dk, dv, scale, causal):
        from seqpar_kernels.kernels import attention_step as kernels

        mode = kernels.MASK_CAUSAL if causal else kernels.MASK_FULL
        kernels.attention_step_backward(
            q, k, v, out, dout, lse, delta, dq, dk, dv, softmax_scale=scale, mask_mode=mode
        )


_forced_steps = None


@contextlib.contextmanager
def force_step_kernels(name: str):
    """Testing hook: run every step with "triton" (the interpreter on CPU tensors) or
    "aten_cpu" kernels whatever the device, so that the CUDA path's schedule can be
    checked on gloo ranks without a GPU."""
    global _forced_steps
    previous = _forced_steps
    _forced_steps = {"triton": _TritonSteps, "aten_cpu": _AtenCpuSteps}[name]
    try:
        yield
    finally:
        _forced_steps = previous


def _steps_for(device: torch.device):
    if _forced_steps is not None:
        return _forced_steps
    if device.type == "cuda":
        return _TritonSteps
    if device.type == "cpu":
        return _AtenCpuSteps
    raise ValueError(f"ring attention runs on CPU or CUDA tensors, got device {device}")


# ----------------------------------------------------------------------------------
# K|V packing: one flat buffer per block
# ----------------------------------------------------------------------------------


def _pack_pair(a: torch.Tensor, b: torch.Tensor, dtype=None) -> torch.Tensor:
    """a and b (same shape, any strides) copied into one flat contiguous buffer."""
    numel = a.numel()
    buffer = torch.empty(2 * numel, dtype=dtype or a.dtype, device=a.device)
    buffer[:numel].view(a.shape).copy_(a)
    buffer[numel:].view(b.shape).copy_(b)
    return buffer


def _unpack_pair(buffer: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The two (contiguous) views of a buffer written by _pack_pair."""
    numel = buffer.numel() // 2
    return buffer[:numel].view(shape), buffer[numel:].view(shape)


# ----------------------------------------------------------------------------------
# The ring driver
# ----------------------------------------------------------------------------------


def _ring_forward(q, k, v, causal, scale, zigzag, group_name):
    batch, seqlen, heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, seqlen), float("-inf"), dtype=torch.float32, device=q.device)
    ring = Ring(group_name, KV_TAG)
    if q.numel() == 0 or k.numel() == 0:
        return out.to(q.dtype), lse  # nothing to attend; every rank has the same shapes
    steps = _steps_for(q.device)
    world_size, rank = ring.world_size, ring.rank
    kv = DoubleBuffer(ring, _pack_pair(k, v)) if world_size > 1 else None
    for step in range(world_size):
        if step + 1 < world_size:
            kv.post()  # the next block travels while this one is computed
        k_block, v_block = (k, v) if step == 0 else _unpack_pair(kv.current, k.shape)
        block = step_block(step, rank, world_size, seqlen, causal, zigzag)
        if block is not None:
            steps.forward(
                q.narrow(1, block.q_start, block.q_len),
                k_block.narrow(1, 0, block.kv_len),
                v_block.narrow(1, 0, block.kv_len),
                out.narrow(1, block.q_start, block.q_len),
                lse.narrow(2, block.q_start, block.q_len),
                scale,
                block.causal,
            )
        if step + 1 < world_size:
            kv.advance()
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, causal, scale, zigzag, group_name):
    seqlen = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grad_kv_numel = 2 * k.numel()
    fp32 = dict(dtype=torch.float32, device=q.device)
    own = torch.zeros(grad_kv_numel, **fp32)  # dK|dV of the local block from step 0
    ring = Ring(group_name, KV_TAG)
    world_size, rank = ring.world_size, ring.rank
    if q.numel() == 0 or k.numel() == 0:
        return _backward_outputs(dq, own, q, k)
    steps = _steps_for(q.device)
    delta = steps.prepare_backward(out, dout)
    if world_size > 1:
        kv = DoubleBuffer(ring, _pack_pair(k, v))
        grad_ring = Ring(group_name, GRAD_KV_TAG)
        scratch = torch.empty(grad_kv_numel, **fp32)
        # The travelling accumulator: sent from one, received into the other.
        travelling, arriving = torch.zeros(grad_kv_numel, **fp32), torch.empty(grad_kv_numel, **fp32)
        grad_work = None
    for step in range(world_size):
        if step + 1 < world_size:
            kv.post()
        k_block, v_block = (k, v) if step == 0 else _unpack_pair(kv.current, k.shape)
        block = step_block(step, rank, world_size, seqlen, causal, zigzag)
        # Step 0: the home share; step 1: starts the accumulator that leaves; later
        # steps: a scratch share, added to the accumulator once it has arrived.
        target = own if step == 0 else travelling if step == 1 else scratch
        if step >= 2 and block is not None:
            scratch.zero_()
        if block is not None:
            dk_target, dv_target = _unpack_pair(target, k.shape)
            q_rows = lambda x: x.narrow(1, block.q_start, block.q_len)  # noqa: E731
            kv_rows = lambda x: x.narrow(1, 0, block.kv_len)  # noqa: E731
            steps.backward(
                q_rows(dout), q_rows(q), kv_rows(k_block), kv_rows(v_block), q_rows(out),
                lse.narrow(2, block.q_start, block.q_len),
                None if delta is None else delta.narrow(2, block.q_start, block.q_len),
                q_rows(dq), kv_rows(dk_target), kv_rows(dv_target),
                scale, block.causal,
            )  # fmt: skip
        if step >= 2:
            grad_work.wait()
            travelling, arriving = arriving, travelling
            if block is not None:
                travelling.add_(scratch)
        if step >= 1:
            grad_work = grad_ring.start(travelling, arriving)
        if step + 1 < world_size:
            kv.advance()
    if world_size > 1:
        grad_work.wait()  # the local block's accumulator is home
        own.add_(arriving)
    return _backward_outputs(dq, own, q, k)


def _backward_outputs(dq, grad_kv, q, k):
    dk, dv = _unpack_pair(grad_kv, k.shape)
    # copy=True: dk and dv must not be views of one buffer (outputs of an op own memory).
    return dq.to(q.dtype), dk.to(q.dtype, copy=True), dv.to(q.dtype, copy=True)


# ----------------------------------------------------------------------------------
# The custom ops
# ----------------------------------------------------------------------------------


@torch.library.custom_op("seqpar::ring_attention_forward", mutates_args=())
def ring_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    zigzag: bool,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's q over the K/V of every rank of the group.

    q: (B, S, H, D); k, v: (B, S, H_kv, D), H % H_kv == 0; every rank the same shapes
    (checked by seqpar_kernels.parallel.ring.ring_attention, not here).
    zigzag: causal positions follow the zigzag layout (rank r holds chunks r and
    2P-1-r of 2P); S must be even. Ignored when not causal.
    Returns out (B, S, H, D) contiguous in q's dtype and lse (B, H, S) fp32 (natural
    log; -inf for a row that saw no key, whose out is 0)."""
    return _ring_forward(q, k, v, causal, softmax_scale, zigzag, group_name)


register_as_collective(torch.ops.seqpar.ring_attention_forward.default)


@ring_attention_forward.register_fake
def _ring_attention_forward_fake(q, k, v, causal, softmax_scale, zigzag, group_name):
    batch, seqlen, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen), dtype=torch.float32)


@torch.library.custom_op("seqpar::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    zigzag: bool,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ring_attention_forward's out: (dq, dk, dv), contiguous, in q's
    dtype, shaped like q, k, v. out and lse are the forward's (final) results; dK/dV
    of each block accumulate in fp32 while they travel the ring."""
    return _ring_backward(dout, q, k, v, out, lse, causal, softmax_scale, zigzag, group_name)


register_as_collective(torch.ops.seqpar.ring_attention_backward.default)


@ring_attention_backward.register_fake
def _ring_attention_backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, zigzag, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _forward_setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, zigzag, group_name = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (causal, softmax_scale, zigzag, group_name)


def _forward_backward(ctx, grad_out, grad_lse):
    # lse is treated as a non-differentiable output (as flash-attn's returned lse):
    # its gradient, if any, is ignored; ring_attention hands it out detached.
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None, None
    dq, dk, dv = ring_attention_backward(grad_out, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None


ring_attention_forward.register_autograd(_forward_backward, setup_context=_forward_setup_context)
