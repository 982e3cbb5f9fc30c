"""The cross entropy of a causal LM's tokens with the LM head fused in, in one process:
the logits a chunk of tokens at a time, never for all tokens at once, the gradients
computed in the forward while each chunk's exponentials are at hand. The sequence-
parallel loss (parallel/cross_entropy.py) runs it on each rank's tokens and adds up the
ranks' sums and counts. ChunkedLogProbs (at the end) gives each token's log-probability
and entropy instead, from the same chunks of logits, its backward computing them again.

One chunk (C = chunk_size tokens, V = vocab, H = hidden):
    logits (C, V) = hidden (C, H) @ weight.T     in the inputs' dtype, as nn.Linear
    fp32 (C, V): upcast, then in place: the model's transform (logit_scale, logit_softcap:
        z = softcap * tanh(scale * logits / softcap), tanh kept in a second (C, V)
        buffer), minus the row max, exp; row sums -> losses
    in place: softmax - one-hot, times 1/N (0 on ignored rows), times dz/dlogits
        (scale, or scale * (1 - tanh**2))                       -> d logits, fp32
    d hidden (C, H) = d logits @ weight          into an fp32 buffer, rounded to the
                                                 inputs' dtype once, in the backward
    d weight (V, H) += d logits.T @ hidden       fp32 accumulator
Memory beyond the inputs and the gradients (fp32 until the backward): one chunk's fp32
logits (C x V x 4 bytes; twice that with a softcap), plus their product in the inputs'
dtype when that is fp16/bf16, plus C x H and C-sized vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# chunk_size=None: as many tokens as keep one chunk's fp32 logits at this many elements
# (2**26 x 4 bytes = 256 MiB): 512 tokens at a 128K vocabulary, 2048 at 32K.
DEFAULT_CHUNK_ELEMENTS = 2**26

# On CUDA (torch 2.8+) a GEMM of fp16/bf16 operands can write its fp32 result itself
# (tensor cores, fp32 accumulation and output): each chunk's weight gradient then adds
# into the fp32 accumulator, and the hidden gradient is kept in fp32, without being
# rounded to fp16/bf16 on the way.
_GEMM_TO_FP32 = "dtype_out" in torch.ops.aten.mm.overloads() and "dtype_out" in torch.ops.aten.addmm.overloads()


def default_chunk_size(vocab: int, buffers: int = 1) -> int:
    """Tokens per chunk for chunk_size=None: DEFAULT_CHUNK_ELEMENTS // (vocab x buffers)
    (at least 1); buffers: the (C, V) fp32 buffers a chunk holds (2 with a softcap)."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab * buffers, 1))


# ----------------------------------------------------------------------------------
# What a model's forward does to its logits
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogitTransform:
    """z = softcap * tanh(scale * logits / softcap) / temperature when softcap > 0, else
    scale * logits / temperature: Cohere's logit_scale (scale), Gemma 2's
    final_logit_softcapping (softcap), both in the order a model that has both applies
    them (scale, then cap), then a sampling temperature (TRL's, generate's). Applied in
    fp32, after the upcast."""

    softcap: float = 0.0
    scale: float = 1.0
    temperature: float = 1.0

    @property
    def buffers(self) -> int:
        """The (C, V) fp32 buffers a chunk holds: the logits, and the tanh with a softcap."""
        return 2 if self.softcap > 0 else 1

    def apply_(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(z, tanh): z in place of the fp32 logits without a softcap; with one, the
        logits' buffer becomes tanh (kept for the backward) and z a new buffer."""
        if self.softcap > 0:
            tanh = logits.mul_(self.scale / self.softcap).tanh_()
            return tanh * (self.softcap / self.temperature), tanh
        factor = self.scale / self.temperature
        return (logits.mul_(factor) if factor != 1.0 else logits), None

    def backward_(self, grad_z: torch.Tensor, tanh: torch.Tensor | None) -> torch.Tensor:
        """d loss / d logits from d loss / d z, in place (tanh is overwritten)."""
        factor = self.scale / self.temperature
        if tanh is not None:  # dz/dlogits = scale / temperature * (1 - tanh**2)
            return grad_z.mul_(tanh.square_().mul_(-factor).add_(factor))
        return grad_z.mul_(factor) if factor != 1.0 else grad_z


# ----------------------------------------------------------------------------------
# One chunk
# ----------------------------------------------------------------------------------


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, transform: LogitTransform):
    """(z, tanh): the chunk's transformed logits (C, V) fp32, computed in the inputs'
    dtype (nn.Linear) then upcast, and the softcap's tanh (or None) for the backward."""
    logits = torch.mm(hidden, weight.t()).float()  # fp32 input: the product itself, no copy
    return transform.apply_(logits)


def chunk_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                  transform: LogitTransform):  # fmt: skip
    """The chunk's per-token losses (fp32, 0 on ignored tokens) and, for the gradient,
    (exp(z - row max) fp32 (C, V), its row sums, target indices, valid mask, the tanh
    of a softcap or None), z the transformed logits.
    The logits are computed in the inputs' dtype (nn.Linear), then upcast to fp32 for
    the transform and the softmax (Hugging Face's causal-LM loss): the upcast's buffer is
    then worked on in place, so one (C, V) fp32 buffer holds logits, then exponentials
    (two with a softcap: its tanh, and z then exponentials)."""
    logits, tanh = chunk_logits(hidden, weight, transform)
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    target_logit = logits.gather(1, target.unsqueeze(1)).squeeze(1)
    row_max = logits.amax(1, keepdim=True)
    exps = logits.sub_(row_max).exp_()
    sum_exp = exps.sum(1)
    # lse - target = (row max + log sum) - target, with the row max subtracted from both.
    losses = torch.where(valid, sum_exp.log() - (target_logit - row_max.squeeze(1)), 0.0)
    return losses, (exps, sum_exp, target, valid, tanh)


def _mm_to_fp32(tensor: torch.Tensor) -> bool:
    """Whether GEMMs of fp16/bf16 operands on tensor's device write fp32 results
    themselves (CUDA, torch 2.8+): fp32 accumulation and output, no rounding between."""
    return _GEMM_TO_FP32 and tensor.is_cuda


def _chunk_grads_(softmax_state, scale: torch.Tensor, hidden, weight, weight_fp32, grad_hidden, grad_weight,
                  transform: LogitTransform) -> None:  # fmt: skip
    """d(scale x sum of the chunk's losses) for hidden, written into grad_hidden (a
    (C, H) fp32 slice, or None), and for weight, added into the fp32 grad_weight (or
    None). Overwrites the exponentials with d logits: (softmax - one-hot) x scale on
    valid rows, 0 on ignored ones, times the transform's derivative, fp32.

    fp16/bf16 inputs: on CUDA d logits are rounded to the inputs' dtype, as the
    materialised loss's backward rounds them, and the GEMMs write fp32; elsewhere the
    GEMMs run in fp32 on the unrounded d logits and `weight_fp32`, the weight's fp32
    copy (CPUs without native bf16 GEMMs run fp32 ones faster anyway)."""
    exps, sum_exp, target, valid, tanh = softmax_state
    dlogits = exps.mul_(torch.where(valid, scale / sum_exp, 0.0).unsqueeze(1))
    dlogits.scatter_add_(1, target.unsqueeze(1), torch.where(valid, -scale, 0.0).unsqueeze(1))
    _add_chunk_grads_(transform.backward_(dlogits, tanh), hidden, weight, weight_fp32, grad_hidden, grad_weight)


def _add_chunk_grads_(dlogits, hidden, weight, weight_fp32, grad_hidden, grad_weight) -> None:
    """d hidden = dlogits @ weight written into grad_hidden (a (C, H) fp32 slice, or
    None); d weight = dlogits.T @ hidden added into the fp32 grad_weight (or None).
    dlogits: (C, V) fp32, overwritten or rounded as _chunk_grads_ says."""
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


def _gradient_buffers(hidden, weight, grad_hidden_needed: bool, grad_weight_needed: bool):
    """(grad_hidden fp32 (N, H) or None, grad_weight fp32 zeros (V, H) or None, the fp32
    copy of the weight the hidden gradient's product reads where no GEMM writes fp32
    from fp16/bf16 operands, or None)."""
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if grad_hidden_needed else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grad_weight_needed else None
    low_precision = weight.dtype != torch.float32
    weight_fp32 = weight.float() if grad_hidden_needed and low_precision and not _mm_to_fp32(weight) else None
    return grad_hidden, grad_weight, weight_fp32


def _rounded(grad: torch.Tensor | None, dtype: torch.dtype, scale=None) -> torch.Tensor | None:
    """An fp32 gradient (times scale, in place), in dtype: fp32 as is, fp16/bf16 rounded
    once, after the scaling."""
    if grad is None:
        return None
    if dtype == torch.float32:
        return grad if scale is None else grad.mul_(scale)
    if scale is None:
        return grad.to(dtype)
    return torch.mul(grad, scale, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


# ----------------------------------------------------------------------------------
# The chunked loss and its gradients
# ----------------------------------------------------------------------------------


class ChunkedCrossEntropy(torch.autograd.Function):
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
                grad_weight_needed: bool, transform: LogitTransform):  # fmt: skip
        tokens = hidden.shape[0]
        # Low precision: the hidden gradient is kept in fp32 until the backward scales it
        # by grad_output, so that it is rounded to the inputs' dtype once, as the
        # materialised loss's backward rounds it (scale first, then round).
        grad_hidden, grad_weight, weight_fp32 = _gradient_buffers(hidden, weight, grad_hidden_needed,
                                                                  grad_weight_needed)  # fmt: skip
        local_sum = torch.zeros((), dtype=torch.float64, device=hidden.device)
        for start in range(0, tokens, chunk_size):
            rows = slice(start, min(tokens, start + chunk_size))
            losses, softmax_state = chunk_losses(hidden[rows], weight, labels[rows], ignore_index, transform)
            local_sum += losses.sum(dtype=torch.float64)
            if grad_hidden is not None or grad_weight is not None:
                _chunk_grads_(
                    softmax_state, inv_count, hidden[rows], weight, weight_fp32,
                    None if grad_hidden is None else grad_hidden[rows], grad_weight, transform,
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
        (grad_hidden, grad_weight), ctx.grads = ctx.grads, None
        hidden_dtype, weight_dtype = ctx.dtypes
        return (_rounded(grad_hidden, hidden_dtype, grad_share), _rounded(grad_weight, weight_dtype, grad_share),
                None, None, None, None, None, None, None)  # fmt: skip


# ----------------------------------------------------------------------------------
# Per-token log-probabilities and entropies
# ----------------------------------------------------------------------------------

# Per-token values ChunkedLogProbs can add, without gradient: the mean of the transformed
# logits over the vocabulary, whether the label is the first argmax, log(sum_v p_v**2).
STATISTICS = ("mean_logits", "is_top1", "log_sum_sq_probs")


class ChunkedLogProbs(torch.autograd.Function):
    """Each token's log-probability of its label, log softmax(z)[label], and optionally
    the entropy of softmax(z), z the transformed logits (LogitTransform, temperature
    included), fp32, (N,) each, 0 where the label is ignore_index; and the STATISTICS
    asked for, (N,) each, not differentiable.

    Unlike ChunkedCrossEntropy the gradients cannot be computed in the forward (each
    token's incoming gradient is not known yet): the forward keeps the inputs and each
    token's log-sum-exp (and entropy), and the backward computes each chunk's logits
    again. Per chunk of C tokens: d z = g_logp (one-hot - p) - g_H p (log p + H), then
    the transform's derivative and the two GEMMs of _add_chunk_grads_. Memory beyond the
    inputs: two (C, V) fp32 buffers (three with a softcap, briefly), the gradients in
    fp32 (as ChunkedCrossEntropy's) during the backward; two (C, V) fp32 buffers
    (three in the backward with a softcap: its tanh)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, chunk_size: int, transform: LogitTransform,
                want_entropy: bool, statistics: tuple):  # fmt: skip
        ctx.set_materialize_grads(False)
        tokens, device = hidden.shape[0], hidden.device
        log_probs = torch.zeros(tokens, dtype=torch.float32, device=device)
        log_sum_exp = torch.zeros(tokens, dtype=torch.float32, device=device)
        entropy = torch.zeros(tokens, dtype=torch.float32, device=device) if want_entropy else None
        stats = {name: torch.zeros(tokens, dtype=torch.bool if name == "is_top1" else torch.float32, device=device)
                 for name in statistics}  # fmt: skip
        valid = labels != ignore_index
        target = torch.where(valid, labels, 0)
        for start in range(0, tokens, chunk_size):
            rows = slice(start, min(tokens, start + chunk_size))
            z, tanh = chunk_logits(hidden[rows], weight, transform)
            del tanh  # the backward computes it again
            if "mean_logits" in stats:
                stats["mean_logits"][rows] = z.mean(1)
            if "is_top1" in stats:  # argmax gives the first maximum, as a tie with an earlier token loses
                stats["is_top1"][rows] = z.argmax(1) == target[rows]
            target_z = z.gather(1, target[rows].unsqueeze(1)).squeeze(1)
            row_max = z.amax(1, keepdim=True)
            shifted = z.sub_(row_max)
            exps = shifted.exp()
            sum_exp = exps.sum(1)
            lse = sum_exp.log() + row_max.squeeze(1)
            log_sum_exp[rows] = lse
            log_probs[rows] = target_z - lse
            if entropy is not None:  # H = log S - sum(e s) / S, s = z - max, e = exp(s), S = sum(e)
                entropy[rows] = sum_exp.log() - shifted.mul_(exps).sum(1) / sum_exp
            if "log_sum_sq_probs" in stats:
                stats["log_sum_sq_probs"][rows] = exps.square_().sum(1).log() - 2 * sum_exp.log()
            del z, shifted, exps
        log_probs.masked_fill_(~valid, 0.0)
        if entropy is not None:
            entropy.masked_fill_(~valid, 0.0)
        for name, values in stats.items():
            values.masked_fill_(~valid, False if name == "is_top1" else 0.0)
        ctx.save_for_backward(hidden, weight, target, valid, log_sum_exp, entropy)
        ctx.options = (chunk_size, transform)
        ctx.mark_non_differentiable(*stats.values())
        return log_probs, entropy, *stats.values()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy, *_grad_statistics):
        hidden, weight, target, valid, log_sum_exp, entropy = ctx.saved_tensors
        chunk_size, transform = ctx.options
        grad_hidden, grad_weight, weight_fp32 = _gradient_buffers(hidden, weight, ctx.needs_input_grad[0],
                                                                  ctx.needs_input_grad[1])  # fmt: skip
        if grad_log_probs is not None:
            grad_log_probs = torch.where(valid, grad_log_probs.float(), 0.0)
        if grad_entropy is not None:
            grad_entropy = torch.where(valid, grad_entropy.float(), 0.0)
        if grad_log_probs is None and grad_entropy is None:  # only the statistics were used
            return (None,) * 8
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, min(hidden.shape[0], start + chunk_size))
            z, tanh = chunk_logits(hidden[rows], weight, transform)
            log_p = z.sub_(log_sum_exp[rows].unsqueeze(1))
            p = log_p.exp()
            if grad_entropy is not None:  # dH/dz = -p (log p + H)
                dz = log_p.add_(entropy[rows].unsqueeze(1)).mul_(-grad_entropy[rows].unsqueeze(1))
                if grad_log_probs is not None:
                    dz.sub_(grad_log_probs[rows].unsqueeze(1))
                dz = dz.mul_(p)
            else:
                dz = p.mul_(-grad_log_probs[rows].unsqueeze(1))
            del p, log_p
            if grad_log_probs is not None:  # d log p_label / dz = one-hot - p
                dz.scatter_add_(1, target[rows].unsqueeze(1), grad_log_probs[rows].unsqueeze(1))
            _add_chunk_grads_(transform.backward_(dz, tanh), hidden[rows], weight, weight_fp32,
                              None if grad_hidden is None else grad_hidden[rows], grad_weight)  # fmt: skip
            del dz, tanh
        return (_rounded(grad_hidden, hidden.dtype), _rounded(grad_weight, weight.dtype),
                None, None, None, None, None, None)  # fmt: skip
