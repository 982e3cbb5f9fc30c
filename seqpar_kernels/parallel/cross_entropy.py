"""Cross entropy of a causal LM under sequence parallelism: the mean over every rank's
real tokens, with the logits never materialised for all tokens at once.

    sequence_parallel_cross_entropy(hidden_states, lm_head_weight, shift_labels, ...)
        the LM head and the loss fused, chunk_size tokens at a time
    sequence_parallel_cross_entropy_from_logits(logits, shift_labels, ...)
        the same reduction over logits the caller already has

Each rank holds a piece of every sequence: its tokens' hidden states and their labels,
already shifted (the label of token t is token t + 1, or ignore_index where there is
none: the last token of a sequence, padding, prompt tokens). The loss every rank
returns is

    (sum over all ranks of the per-token losses) / (tokens whose label != ignore_index,
                                                    over all ranks)

the loss of one process holding everything (`F.cross_entropy(..., reduction="mean")`),
with two small all-reduces (the count, then the sum) over the group or the mesh.

Gradient convention: the forward value is global, the gradient of each rank only its
own share, d(local sum) / N. So the sum over the sequence-parallel ranks of their
parameter gradients is the single-process gradient.

One chunk (C = chunk_size tokens, V = vocab, H = hidden):
    logits (C, V) = hidden (C, H) @ weight.T     in the inputs' dtype, as nn.Linear
    fp32 (C, V): upcast, then in place: minus the row max, exp; row sums -> losses
    in place: softmax - one-hot, times 1/N (0 on ignored rows)   -> d logits, fp32
    d hidden (C, H) = d logits @ weight          into an fp32 buffer, rounded to the
                                                 inputs' dtype once, in the backward
    d weight (V, H) += d logits.T @ hidden       fp32 accumulator
Memory beyond the inputs and the gradients (fp32 until the backward): one chunk's fp32
logits (C x V x 4 bytes), plus their product in the inputs' dtype when that is
fp16/bf16, plus C x H and C-sized vectors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar_kernels.comm.grid import reduction_groups
from seqpar_kernels.parallel.checks import SUPPORTED_DTYPES, checked_over_groups

# chunk_size=None: as many tokens as keep one chunk's fp32 logits at this many elements
# (2**26 x 4 bytes = 256 MiB): 512 tokens at a 128K vocabulary, 2048 at 32K.
DEFAULT_CHUNK_ELEMENTS = 2**26

# On CUDA (torch 2.8+) a GEMM of fp16/bf16 operands can write its fp32 result itself
# (tensor cores, fp32 accumulation and output): each chunk's weight gradient then adds
# into the fp32 accumulator, and the hidden gradient is kept in fp32, without being
# rounded to fp16/bf16 on the way.
_GEMM_TO_FP32 = "dtype_out" in torch.ops.aten.mm.overloads() and "dtype_out" in torch.ops.aten.addmm.overloads()


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk for chunk_size=None: DEFAULT_CHUNK_ELEMENTS // vocab (at least 1)."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))


# ----------------------------------------------------------------------------------
# The groups the sum and the count are reduced over
# ----------------------------------------------------------------------------------


def _all_reduce_sum(values: torch.Tensor, groups) -> torch.Tensor:
    """values summed over every rank of the groups (over each group in turn), in place.
    Every rank gets the same bytes: each group's all-reduce hands all its members one
    result, and the ranks of a later group hold equal inputs from the earlier ones."""
    for group, info in groups:
        if info.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def _check_labels(shift_labels, expected_shape, describe_shapes: str) -> None:
    if not isinstance(shift_labels, torch.Tensor):
        raise ValueError(f"shift_labels must be a tensor, got {type(shift_labels).__name__} ({describe_shapes})")
    if shift_labels.dtype.is_floating_point or shift_labels.dtype.is_complex or shift_labels.dtype == torch.bool:
        raise ValueError(f"shift_labels must hold integers, got {shift_labels.dtype} ({describe_shapes})")
    if tuple(shift_labels.shape) != tuple(expected_shape):
        raise ValueError(f"shift_labels must have shape {tuple(expected_shape)}, got {describe_shapes}")


def _check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int, describe_shapes: str) -> None:
    """Labels outside [0, vocab) other than ignore_index raise, as F.cross_entropy's do
    (never clamped into a wrong target). One small reduction (a host sync on GPUs,
    beside the one the argument checks' all-gather makes)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bad.any():
        value = labels[bad][0].item()
        raise ValueError(
            f"shift_labels holds {value}, outside [0, {vocab}) and not ignore_index={ignore_index} ({describe_shapes})"
        )


def _check_ignore_index(ignore_index) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")


# ----------------------------------------------------------------------------------
# One chunk
# ----------------------------------------------------------------------------------


def _chunk_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """The chunk's per-token losses (fp32, 0 on ignored tokens) and, for the gradient,
    (exp(logits - row max) fp32 (C, V), its row sums, target indices, valid mask).
    The logits are computed in the inputs' dtype (nn.Linear), then upcast to fp32 for
    the softmax (Hugging Face's causal-LM loss): the upcast's buffer is then worked on
    in place, so one (C, V) fp32 buffer holds logits, then exponentials."""
    logits = torch.mm(hidden, weight.t()).float()  # fp32 input: the product itself, no copy
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    target_logit = logits.gather(1, target.unsqueeze(1)).squeeze(1)
    row_max = logits.amax(1, keepdim=True)
    exps = logits.sub_(row_max).exp_()
    sum_exp = exps.sum(1)
    # lse - target = (row max + log sum) - target, with the row max subtracted from both.
    losses = torch.where(valid, sum_exp.log() - (target_logit - row_max.squeeze(1)), 0.0)
    return losses, (exps, sum_exp, target, valid)


def _mm_to_fp32(tensor: torch.Tensor) -> bool:
    """Whether GEMMs of fp16/bf16 operands on tensor's device write fp32 results
    themselves (CUDA, torch 2.8+): fp32 accumulation and output, no rounding between."""
    return _GEMM_TO_FP32 and tensor.is_cuda


def _chunk_grads_(softmax_state, scale: torch.Tensor, hidden, weight, weight_fp32, grad_hidden, grad_weight) -> None:
    """d(scale x sum of the chunk's losses) for hidden, written into grad_hidden (a
    (C, H) fp32 slice, or None), and for weight, added into the fp32 grad_weight (or
    None). Overwrites the exponentials with d logits: (softmax - one-hot) x scale on
    valid rows, 0 on ignored ones, fp32.

    fp16/bf16 inputs: on CUDA d logits are rounded to the inputs' dtype, as the
    materialised loss's backward rounds them, and the GEMMs write fp32; elsewhere the
    GEMMs run in fp32 on the unrounded d logits and `weight_fp32`, the weight's fp32
    copy (CPUs without native bf16 GEMMs run fp32 ones faster anyway)."""
    exps, sum_exp, target, valid = softmax_state
    dlogits = exps.mul_(torch.where(valid, scale / sum_exp, 0.0).unsqueeze(1))
    dlogits.scatter_add_(1, target.unsqueeze(1), torch.where(valid, -scale, 0.0).unsqueeze(1))
    if weight.dtype == torch.float32:
        weight_fp32, hidden_fp32 = weight, hidden
    elif _mm_to_fp32(weight):
        rounded = dlogits.to(weight.dtype)
        if grad_hidden is not None:
            torch.mm(rounded, weight, out_dtype=torch.float32, out=grad_hidden)
        if grad_weight is not None:
            torch.addmm(grad_weight, rounded.t(), hidden, out_dtype=torch.float32, out=grad_weight)
        return
    else:
        hidden_fp32 = hidden.float()
    if grad_hidden is not None:
        torch.mm(dlogits, weight_fp32, out=grad_hidden)
    if grad_weight is not None:
        grad_weight.addmm_(dlogits.t(), hidden_fp32)


# ----------------------------------------------------------------------------------
# The chunked loss and its gradients
# ----------------------------------------------------------------------------------


class _ChunkedLocalShare(torch.autograd.Function):
    """(local sum of the losses) x inv_count, fp32, differentiable; and the local sum
    itself, fp64, not differentiable (what the ranks add up).

    The gradients are computed in the forward, chunk by chunk, while each chunk's
    exponentials are at hand, and kept until the backward, which only scales them by
    its grad_output. The other way, keeping nothing but the inputs and recomputing each
    chunk's logits in the backward, has the same peak memory (one chunk's logits, the
    fp32 weight gradient, the hidden gradient) but computes every logit twice: measured
    on 2 CPU cores (fp32, forward + backward) 0.72 s against 1.30 s at 4096 tokens x
    32000 vocab x 64 hidden, 7.0 s against 9.7 s at 4096 x 131072 x 128, the peak
    40.1 MiB for both at 4096 x 32000 x 64 with 256-token chunks (the materialised
    loss: 2.2 s and 14.0 s, 1500 MiB). What the forward gradients cost: they are held
    from the forward to the backward (the fp32 weight gradient, V x H x 4 bytes, and the
    hidden gradient), and a forward run with grad enabled but never backpropagated
    computes them for nothing (they are computed only when grad is enabled and an input
    requires it). The backward hands the buffers over (no copy): a second backward
    through the same graph raises."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_count, ignore_index: int, chunk_size: int, grad_hidden_needed: bool,
                grad_weight_needed: bool):  # fmt: skip
        tokens = hidden.shape[0]
        low_precision = weight.dtype != torch.float32
        # Low precision: the hidden gradient is kept in fp32 until the backward scales it
        # by grad_output, so that it is rounded to the inputs' dtype once, as the
        # materialised loss's backward rounds it (scale first, then round).
        grad_hidden = (
            torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if grad_hidden_needed else None
        )
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight_needed else None
        )
        # The fp32 copy of the weight the hidden gradient's product reads where no GEMM
        # writes fp32 from fp16/bf16 operands (see _chunk_grads_).
        weight_fp32 = weight.float() if grad_hidden_needed and low_precision and not _mm_to_fp32(weight) else None
        local_sum = torch.zeros((), dtype=torch.float64, device=hidden.device)
        for start in range(0, tokens, chunk_size):
            rows = slice(start, min(tokens, start + chunk_size))
            losses, softmax_state = _chunk_losses(hidden[rows], weight, labels[rows], ignore_index)
            local_sum += losses.sum(dtype=torch.float64)
            if grad_hidden is not None or grad_weight is not None:
                _chunk_grads_(
                    softmax_state, inv_count, hidden[rows], weight, weight_fp32,
                    None if grad_hidden is None else grad_hidden[rows], grad_weight,
                )  # fmt: skip
            del softmax_state  # this chunk's (C, V) buffer goes before the next one's
        ctx.grads = [grad_hidden, grad_weight]
        ctx.dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(local_sum)
        return (local_sum * inv_count).float(), local_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_share, _grad_local_sum):
        if ctx.grads is None:
            raise RuntimeError(
                "sequence_parallel_cross_entropy: backward called twice through the same loss; its "
                "gradients were computed in the forward and handed over by the first backward"
            )
        grads, ctx.grads = ctx.grads, None
        for index, (grad, dtype) in enumerate(zip(grads, ctx.dtypes)):
            if grad is None:
                continue
            if dtype == torch.float32:
                grads[index] = grad.mul_(grad_share)
            else:  # scaled in fp32, then rounded once
                grads[index] = torch.mul(grad, grad_share, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))
        return grads[0], grads[1], None, None, None, None, None, None


# ----------------------------------------------------------------------------------
# The public functions
# ----------------------------------------------------------------------------------


def _shapes(*named) -> str:
    return ", ".join(
        f"{name} {tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}"
        for name, tensor in named
    )


def _check_inputs_tensor(name: str, tensor, shapes: str) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ValueError(f"{name} must be a tensor with at least one dim ({shapes})")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be one of {SUPPORTED_DTYPES}, got {tensor.dtype} ({shapes})")


def _global_count(labels: torch.Tensor, ignore_index: int, groups) -> torch.Tensor:
    """The tokens whose label is not ignore_index, over every rank: fp64 (exact below
    2**53), shape (1,), on the labels' device."""
    count = (labels != ignore_index).sum(dtype=torch.float64).reshape(1)
    return _all_reduce_sum(count, groups)


def _global_loss(share: torch.Tensor, local_sum: torch.Tensor, count: torch.Tensor, groups) -> torch.Tensor:
    """(sum over every rank of local_sum) / count as a 0-dim fp32 tensor, the same bytes
    on every rank, whose gradient flows through this rank's `share` alone: share -
    share.detach() is exactly 0, so the value is the global one on every rank while
    d loss / d share = 1."""
    total = _all_reduce_sum(local_sum.detach().reshape(1).clone(), groups)
    value = (total / count.clamp(min=1)).float().reshape(())
    return value + (share - share.detach())


def sequence_parallel_cross_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The causal-LM loss of a sequence sharded across ranks, the LM head fused in: the
    mean over every rank's real tokens of -log softmax(hidden @ lm_head_weight.T)[label],
    with at most chunk_size tokens' logits in memory at once, forward and backward.

    hidden_states: (..., hidden), this rank's tokens (e.g. (batch, seqlen_local,
        hidden)); any leading dims and strides; fp32, fp16 or bf16. seqlen_local may
        differ by rank, 0 included.
    lm_head_weight: (vocab, hidden), the dtype and device of hidden_states (the LM
        head's weight; tied to the input embedding or not, autograd sums both uses).
    shift_labels: int tensor of hidden_states' leading shape: each token's target, the
        next token's id (shifted on the full sequence before it was split), or
        ignore_index where there is none. Other values outside [0, vocab) raise
        ValueError, as F.cross_entropy raises for them.
    group: the ranks the sequence is split over (default: the world; without an
        initialised torch.distributed, this process alone). mesh: instead of group, a
        DeviceMesh (e.g. USP's 2-D ("ring", "ulysses") mesh): the sum and the count are
        reduced over every rank of it, one mesh dimension after the other. Not both.
    ignore_index: the label of tokens that count for nothing.
    chunk_size: tokens whose logits are computed at once; None picks
        default_chunk_size(vocab) = 2**26 // vocab (at least 1), so that one chunk's
        fp32 logits take 256 MiB: 512 tokens at a 128K vocabulary.

    Logits are computed as nn.Linear computes them, in the inputs' dtype, then upcast to
    fp32 for the log-softmax (as Hugging Face transformers' causal-LM loss does): in
    fp32 the result is F.cross_entropy(all logits, all labels, ignore_index=...,
    reduction="mean") of one process holding every rank's tokens, to rounding.

    Returns a 0-dim fp32 tensor, the same value on every rank: (sum of the per-token
    losses over all ranks) / N, N the tokens over all ranks whose label is not
    ignore_index; 0.0 when N = 0 (with zero gradients), where a plain mean would give
    nan, so that a batch whose ranks hold no real token cannot poison training.

    Gradient: this rank's share only, d(sum of this rank's losses) / N, for
    hidden_states and lm_head_weight. Summing the weight's gradient over the
    sequence-parallel ranks gives exactly the single-process gradient (not P times
    it). Under DDP or FSDP over those ranks, which average gradients, multiply the
    loss by their number first (or sum the gradients yourself).

    Memory: the fp32 weight gradient (vocab x hidden x 4 bytes) and the hidden
    gradient (fp32) are computed in the forward, chunk by chunk, and held until the
    backward; beyond them and the inputs, one chunk's logits: chunk_size x vocab x 4
    bytes in fp32 (plus their fp16/bf16 product, and on CPUs an fp32 copy of the weight,
    with fp16/bf16 inputs), plus chunk_size x hidden and per-token vectors. They are
    computed only when grad is enabled and an input requires it. A second backward
    through the same loss raises (the first one hands the gradients over).

    Collectives: the argument checks' small all-gather (a bad input on any rank raises
    ValueError on every rank; on NCCL a host sync), then two all-reduces of one number
    each (the count, the sum), per group or per mesh dimension.
    """
    describe = "sequence_parallel_cross_entropy"
    groups = reduction_groups(describe, group=group, mesh=mesh, any_mesh=True)
    shapes = _shapes(("hidden_states", hidden_states), ("lm_head_weight", lm_head_weight),
                     ("shift_labels", shift_labels))  # fmt: skip

    def local_checks():
        _check_inputs_tensor("hidden_states", hidden_states, shapes)
        if not isinstance(lm_head_weight, torch.Tensor) or lm_head_weight.dim() != 2:
            raise ValueError(f"lm_head_weight must be (vocab, hidden) ({shapes})")
        if lm_head_weight.shape[1] != hidden_states.shape[-1]:
            raise ValueError(f"lm_head_weight's hidden size must be hidden_states' last dim ({shapes})")
        if lm_head_weight.shape[0] == 0:
            raise ValueError(f"lm_head_weight has no vocabulary ({shapes})")
        if lm_head_weight.dtype != hidden_states.dtype or lm_head_weight.device != hidden_states.device:
            raise ValueError(
                f"lm_head_weight must have hidden_states' dtype and device, got {lm_head_weight.dtype} on "
                f"{lm_head_weight.device} and {hidden_states.dtype} on {hidden_states.device} ({shapes})"
            )
        _check_labels(shift_labels, hidden_states.shape[:-1], shapes)
        if shift_labels.device != hidden_states.device:
            raise ValueError(f"shift_labels must be on hidden_states' device ({shapes})")
        _check_ignore_index(ignore_index)
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size < 1):  # fmt: skip
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r} ({shapes})")
        _check_label_range(shift_labels, lm_head_weight.shape[0], ignore_index, shapes)
        return (tuple(lm_head_weight.shape), hidden_states.dtype, ignore_index)

    device = hidden_states.device if isinstance(hidden_states, torch.Tensor) else None
    checked_over_groups(describe, groups, device, local_checks)
    vocab, hidden_size = lm_head_weight.shape
    hidden = hidden_states.reshape(-1, hidden_size)  # a view when it can be, else a copy
    labels = shift_labels.reshape(-1).long()
    count = _global_count(labels, ignore_index, groups)
    inv_count = (1.0 / count.clamp(min=1)).float().reshape(())
    grad_enabled = torch.is_grad_enabled()
    share, local_sum = _ChunkedLocalShare.apply(
        hidden, lm_head_weight, labels, inv_count, ignore_index, chunk_size or default_chunk_size(vocab),
        grad_enabled and hidden.requires_grad, grad_enabled and lm_head_weight.requires_grad,
    )  # fmt: skip
    return _global_loss(share, local_sum, count, groups)


def sequence_parallel_cross_entropy_from_logits(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The same loss as sequence_parallel_cross_entropy, from logits the caller has
    already materialised (a model whose LM head runs on its own).

    logits: (..., vocab), this rank's tokens; any leading dims and strides; fp32, fp16
        or bf16 (upcast to fp32 for the log-softmax, as Hugging Face transformers' loss
        does).
    shift_labels: int tensor of logits' leading shape (see sequence_parallel_cross_entropy).
    group, mesh, ignore_index: as in sequence_parallel_cross_entropy.

    Returns the 0-dim fp32 loss, the same on every rank: (sum of the per-token losses
    over all ranks) / (tokens whose label is not ignore_index over all ranks), 0.0 when
    there is none. Gradient: this rank's share, d(local sum) / N, as in
    sequence_parallel_cross_entropy (sum over the sequence-parallel ranks to get the
    single-process gradient). Memory: that of F.cross_entropy on the logits (their fp32
    copy when they are fp16/bf16, and its log-softmax).
    """
    describe = "sequence_parallel_cross_entropy_from_logits"
    groups = reduction_groups(describe, group=group, mesh=mesh, any_mesh=True)
    shapes = _shapes(("logits", logits), ("shift_labels", shift_labels))

    def local_checks():
        _check_inputs_tensor("logits", logits, shapes)
        if logits.shape[-1] == 0:
            raise ValueError(f"logits have no vocabulary ({shapes})")
        _check_labels(shift_labels, logits.shape[:-1], shapes)
        if shift_labels.device != logits.device:
            raise ValueError(f"shift_labels must be on logits' device ({shapes})")
        _check_ignore_index(ignore_index)
        _check_label_range(shift_labels, logits.shape[-1], ignore_index, shapes)
        return (logits.shape[-1], logits.dtype, ignore_index)

    device = logits.device if isinstance(logits, torch.Tensor) else None
    checked_over_groups(describe, groups, device, local_checks)
    labels = shift_labels.reshape(-1).long()
    count = _global_count(labels, ignore_index, groups)
    local_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=ignore_index,
                                reduction="sum")  # fmt: skip
    share = local_sum * (1.0 / count.clamp(min=1)).float().reshape(())
    return _global_loss(share, local_sum.detach().double(), count, groups)
