"""Cross entropy of a causal LM under sequence parallelism: the mean over every rank's
real tokens, with the logits never materialised for all tokens at once.

    sequence_parallel_cross_entropy(hidden_states, lm_head_weight, shift_labels, ...)
        the LM head and the loss fused, chunk_size tokens at a time
    sequence_parallel_cross_entropy_from_logits(logits, shift_labels, ...)
        the same reduction over logits the caller already has
    sequence_parallel_logprobs(hidden_states, lm_head_weight, labels, ...)
        each token's log-probability of its label (and entropy), the head fused in;
        per-sequence sums over the ranks when asked (post-training losses)

Each rank holds a piece of every sequence: its tokens' hidden states and their labels,
already shifted (the label of token t is token t + 1, or ignore_index where there is
none: the last token of a sequence, padding, prompt tokens). The loss every rank
returns is

    (sum over all ranks of the per-token losses) / (tokens whose label != ignore_index,
                                                    over all ranks)

the loss of one process holding everything (`F.cross_entropy(..., reduction="mean")`),
with two small all-reduces (the count, then the sum) over the group or the mesh; with
data replicas (mesh= with sequence_dims= and data_dims=) over every rank of data x
sequence: the mean over every real token of the global batch, not a mean of the
replicas' means (which differs when replicas hold different numbers of tokens).

Gradient convention: the forward value is global, the gradient of each rank only its
own share, d(local sum) / N. So the sum over the ranks the count was reduced over
(sequence, and data where named) of their parameter gradients is the single-process
gradient of the global batch; DDP and FSDP average instead of summing, so under them the
loss is scaled by their ranks for the backward.

The chunked loss of this rank's tokens, its logits and gradients a chunk at a time, is
the engine's (engine/cross_entropy.py); this module checks the arguments, counts and
reduces over the ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar_kernels.comm.grid import all_reduce_sum, reduction_groups
from seqpar_kernels.engine.cross_entropy import (
    STATISTICS,
    ChunkedCrossEntropy,
    ChunkedLogProbs,
    LogitTransform,
    default_chunk_size,
)
from seqpar_kernels.parallel.checks import SUPPORTED_DTYPES, checked_over_groups

# ----------------------------------------------------------------------------------
# The arguments
# ----------------------------------------------------------------------------------


def check_logit_transform(logit_softcap, logit_scale, shapes: str) -> LogitTransform:
    """logit_softcap: a finite number >= 0 (0: none); logit_scale: a finite number."""
    if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float)) \
            or not 0 <= logit_softcap < math.inf:  # fmt: skip
        raise ValueError(f"logit_softcap must be a finite number >= 0 (0: none), got {logit_softcap!r:.80} ({shapes})")
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)) \
            or not -math.inf < logit_scale < math.inf:  # fmt: skip
        raise ValueError(f"logit_scale must be a finite number, got {logit_scale!r:.80} ({shapes})")
    return LogitTransform(float(logit_softcap), float(logit_scale))


# ----------------------------------------------------------------------------------
# The groups the sum and the count are reduced over
# ----------------------------------------------------------------------------------


def _check_labels(shift_labels, expected_shape, describe_shapes: str, name: str = "shift_labels") -> None:
    if not isinstance(shift_labels, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(shift_labels).__name__} ({describe_shapes})")
    if shift_labels.dtype.is_floating_point or shift_labels.dtype.is_complex or shift_labels.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {shift_labels.dtype} ({describe_shapes})")
    if tuple(shift_labels.shape) != tuple(expected_shape):
        raise ValueError(f"{name} must have shape {tuple(expected_shape)}, got {describe_shapes}")


def _check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int, describe_shapes: str,
                       name: str = "shift_labels") -> None:  # fmt: skip
    """Labels outside [0, vocab) other than ignore_index raise, as F.cross_entropy's do
    (never clamped into a wrong target). One small reduction (a host sync on GPUs,
    beside the one the argument checks' all-gather makes)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bad.any():
        value = labels[bad][0].item()
        raise ValueError(
            f"{name} holds {value}, outside [0, {vocab}) and not ignore_index={ignore_index} ({describe_shapes})"
        )


def _check_ignore_index(ignore_index) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")


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


def _check_head_inputs(hidden_states, lm_head_weight, labels, labels_name: str, ignore_index, chunk_size,
                       logit_softcap, logit_scale, temperature, shapes: str) -> LogitTransform:  # fmt: skip
    """This rank's checks of a fused head's inputs (ValueError naming the shapes); the
    checked LogitTransform."""
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
    _check_labels(labels, hidden_states.shape[:-1], shapes, labels_name)
    if labels.device != hidden_states.device:
        raise ValueError(f"{labels_name} must be on hidden_states' device ({shapes})")
    _check_ignore_index(ignore_index)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r} ({shapes})")
    _check_label_range(labels, lm_head_weight.shape[0], ignore_index, shapes, labels_name)
    transform = check_logit_transform(logit_softcap, logit_scale, shapes)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r:.80} ({shapes})")
    return LogitTransform(transform.softcap, transform.scale, float(temperature))


def _global_count(labels: torch.Tensor, ignore_index: int, groups) -> torch.Tensor:
    """The tokens whose label is not ignore_index, over every rank: fp64 (exact below
    2**53), shape (1,), on the labels' device."""
    count = (labels != ignore_index).sum(dtype=torch.float64).reshape(1)
    return all_reduce_sum(count, groups)


def _global_loss(share: torch.Tensor, local_sum: torch.Tensor, count: torch.Tensor, groups) -> torch.Tensor:
    """(sum over every rank of local_sum) / count as a 0-dim fp32 tensor, the same bytes
    on every rank, whose gradient flows through this rank's `share` alone: share -
    share.detach() is exactly 0, so the value is the global one on every rank while
    d loss / d share = 1."""
    total = all_reduce_sum(local_sum.detach().reshape(1).clone(), groups)
    value = (total / count.clamp(min=1)).float().reshape(())
    return value + (share - share.detach())


def sequence_parallel_cross_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    sequence_dims=None,
    data_dims=(),
    ignore_index: int = -100,
    chunk_size: int | None = None,
    logit_softcap: float = 0.0,
    logit_scale: float = 1.0,
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
        reduced over every rank of it, one mesh dimension after the other; or
        ulysses_group and ring_group (USP's two groups, make_usp_groups'). One of these.
        Or mesh= with sequence_dims= (the sequence's dim, or USP's (ulysses, ring) pair)
        and data_dims= (the data replicas' dims): the mean over every real token of
        every replica, the sum and the count reduced over exactly those dims (never over
        the mesh's others: tensor, pipeline).
    ignore_index: the label of tokens that count for nothing.
    chunk_size: tokens whose logits are computed at once; None picks
        default_chunk_size(vocab) = 2**26 // vocab (at least 1), so that one chunk's
        fp32 logits take 256 MiB: 512 tokens at a 128K vocabulary (half as many with a
        logit_softcap, whose tanh takes a second buffer).
    logit_scale, logit_softcap: what the model's forward does to its logits before the
        loss: z = logit_softcap * tanh(logit_scale * logits / logit_softcap) when
        logit_softcap > 0 (Gemma 2's final_logit_softcapping), else logit_scale *
        logits (Cohere's logit_scale). Exact in the backward too (the derivative
        logit_scale * (1 - tanh**2) per logit, from the tanh kept for the chunk).

    Logits are computed as nn.Linear computes them, in the inputs' dtype, then upcast to
    fp32 for the transform and the log-softmax (as Hugging Face transformers' causal-LM
    loss upcasts them; a model's own forward transforms them in its dtype before, which
    in fp32 is the same): in fp32 the result is F.cross_entropy(all transformed logits,
    all labels, ignore_index=..., reduction="mean") of one process holding every rank's
    tokens, to rounding.

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
    groups = reduction_groups(describe, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                              sequence_dims=sequence_dims, data_dims=data_dims, any_mesh=True)  # fmt: skip
    shapes = _shapes(("hidden_states", hidden_states), ("lm_head_weight", lm_head_weight),
                     ("shift_labels", shift_labels))  # fmt: skip
    transform = LogitTransform()

    def local_checks():
        nonlocal transform
        transform = _check_head_inputs(hidden_states, lm_head_weight, shift_labels, "shift_labels", ignore_index,
                                       chunk_size, logit_softcap, logit_scale, 1.0, shapes)  # fmt: skip
        return (tuple(lm_head_weight.shape), hidden_states.dtype, ignore_index, transform)

    device = hidden_states.device if isinstance(hidden_states, torch.Tensor) else None
    checked_over_groups(describe, groups, device, local_checks)
    vocab, hidden_size = lm_head_weight.shape
    hidden = hidden_states.reshape(-1, hidden_size)  # a view when it can be, else a copy
    labels = shift_labels.reshape(-1).long()
    count = _global_count(labels, ignore_index, groups)
    inv_count = (1.0 / count.clamp(min=1)).float().reshape(())
    grad_enabled = torch.is_grad_enabled()
    chunk_size = chunk_size or default_chunk_size(vocab, transform.buffers)
    share, local_sum = ChunkedCrossEntropy.apply(
        hidden, lm_head_weight, labels, inv_count, ignore_index, chunk_size,
        grad_enabled and hidden.requires_grad, grad_enabled and lm_head_weight.requires_grad, transform,
    )  # fmt: skip
    return _global_loss(share, local_sum, count, groups)


def sequence_parallel_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    sequence_dims=None,
    data_dims=(),
    ignore_index: int = -100,
    chunk_size: int | None = None,
    logit_softcap: float = 0.0,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
    return_entropy: bool = False,
    sequence_ids: torch.Tensor | None = None,
    num_sequences: int | None = None,
    statistics: tuple[str, ...] = (),
):
    """Each of this rank's tokens' log-probability of its label under the LM head (and
    the entropy of its distribution), the head fused in: at most chunk_size tokens'
    logits in memory at once, forward and backward. What post-training losses (DPO,
    GRPO, ...) are computed from.

    hidden_states: (..., hidden), this rank's tokens; any leading dims and strides; fp32,
        fp16 or bf16; lengths may differ by rank, 0 included.
    lm_head_weight: (vocab, hidden), hidden_states' dtype and device.
    labels: int tensor of hidden_states' leading shape: each token's target (the next
        token, shifted on the full sequence: shard_batch's shift_labels), ignore_index
        where there is none (its values are 0). Others outside [0, vocab) raise.
    group / mesh / ulysses_group + ring_group: as sequence_parallel_cross_entropy; the
        ranks the checks run over and the sums below are reduced over.
    logit_softcap, logit_scale: as sequence_parallel_cross_entropy; temperature: the
        transformed logits are divided by it (a sampler's temperature: TRL's).
    return_entropy: also each token's entropy -sum_v p_v log p_v.
    sequence_ids, num_sequences: instead of per-token values, their sums per sequence
        over every rank's tokens: sequence_ids (labels' shape, ints in [0,
        num_sequences)) says which sequence (a row, a packed document) each token adds
        to; (num_sequences,) fp32 the same on every rank (one all-reduce per group).
    statistics: names from STATISTICS ("mean_logits", "is_top1", "log_sum_sq_probs"):
        per-token values without gradient, returned in a dict after the rest.

    Logits as nn.Linear computes them, upcast to fp32, then transformed (fp32); the
    log-softmax and entropy in fp32, exact to rounding: log_softmax(all logits)[label]
    of one process. Returns log_probs (labels' shape, fp32; or (num_sequences,)); with
    return_entropy (log_probs, entropy); with statistics, a dict of them appended.
    Gradient (log-probs and entropy): this rank's tokens' own; for the sums, the
    gradient flows through this rank's tokens only, so that summing the parameters'
    gradients over the ranks gives the single-process gradient.

    Memory: two chunks' fp32 logits (chunk_size x vocab x 4 bytes each; default
    chunk_size: 2**26 // (vocab x buffers)), the backward computing them again; the
    fp32 weight and hidden gradients in the backward. Collectives: the argument checks'
    small all-gather, and with sequence_ids one all-reduce of num_sequences values.
    """
    describe = "sequence_parallel_logprobs"
    # Per-sequence sums over the sequence dims only: each data replica holds other sequences.
    groups = reduction_groups(describe, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                              sequence_dims=sequence_dims, data_dims=data_dims, any_mesh=True,
                              over_data=False)  # fmt: skip
    shapes = _shapes(("hidden_states", hidden_states), ("lm_head_weight", lm_head_weight), ("labels", labels),
                     ("sequence_ids", sequence_ids))  # fmt: skip
    transform = LogitTransform()

    def local_checks():
        nonlocal transform
        transform = _check_head_inputs(hidden_states, lm_head_weight, labels, "labels", ignore_index, chunk_size,
                                       logit_softcap, logit_scale, temperature, shapes)  # fmt: skip
        unknown = [name for name in statistics if name not in STATISTICS]
        if isinstance(statistics, str) or unknown:
            raise ValueError(f"statistics must name some of {STATISTICS}, got {statistics!r}")
        if sequence_ids is not None:
            if isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences < 0:
                raise ValueError(f"num_sequences must be an int >= 0 with sequence_ids, got {num_sequences!r}")
            _check_labels(sequence_ids, labels.shape, shapes, "sequence_ids")
            if sequence_ids.numel() and (sequence_ids.min() < 0 or sequence_ids.max() >= num_sequences):
                raise ValueError(f"sequence_ids must lie in [0, num_sequences={num_sequences}) ({shapes})")
        return (tuple(lm_head_weight.shape), hidden_states.dtype, ignore_index, transform, bool(return_entropy),
                sequence_ids is None, num_sequences, tuple(statistics))  # fmt: skip

    device = hidden_states.device if isinstance(hidden_states, torch.Tensor) else None
    checked_over_groups(describe, groups, device, local_checks)
    vocab, hidden_size = lm_head_weight.shape
    chunk_size = chunk_size or default_chunk_size(vocab, transform.buffers + 1)
    log_probs, entropy, *extra = ChunkedLogProbs.apply(
        hidden_states.reshape(-1, hidden_size), lm_head_weight, labels.reshape(-1).long(), ignore_index, chunk_size,
        transform, bool(return_entropy), tuple(statistics),
    )  # fmt: skip
    values = [log_probs] + ([entropy] if return_entropy else [])
    if sequence_ids is None:
        values = [value.view(labels.shape) for value in values]
    else:
        values = list(_sequence_sums(torch.stack(values), sequence_ids.reshape(-1).long(), num_sequences, groups))
    if statistics:
        values.append({name: value.view(labels.shape) for name, value in zip(statistics, extra)})
    return values[0] if len(values) == 1 else tuple(values)


def _sequence_sums(values: torch.Tensor, sequence_ids: torch.Tensor, num_sequences: int, groups) -> torch.Tensor:
    """values (K, N) summed per sequence over every rank's tokens: (K, num_sequences)
    fp32, the same on every rank (summed in fp64, one all-reduce), whose gradient flows
    through this rank's tokens alone (as _global_loss's)."""
    share = values.new_zeros(values.shape[0], num_sequences).index_add(1, sequence_ids, values)
    local = values.detach().double().new_zeros(values.shape[0], num_sequences)
    total = all_reduce_sum(local.index_add_(1, sequence_ids, values.detach().double()), groups).float()
    return total + (share - share.detach())


def sequence_parallel_cross_entropy_from_logits(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    sequence_dims=None,
    data_dims=(),
    ignore_index: int = -100,
) -> torch.Tensor:
    """The same loss as sequence_parallel_cross_entropy, from logits the caller has
    already materialised (a model whose LM head runs on its own).

    logits: (..., vocab), this rank's tokens; any leading dims and strides; fp32, fp16
        or bf16 (upcast to fp32 for the log-softmax, as Hugging Face transformers' loss
        does).
    shift_labels: int tensor of logits' leading shape (see sequence_parallel_cross_entropy).
    group, mesh, ulysses_group + ring_group, ignore_index: as in sequence_parallel_cross_entropy.

    Returns the 0-dim fp32 loss, the same on every rank: (sum of the per-token losses
    over all ranks) / (tokens whose label is not ignore_index over all ranks), 0.0 when
    there is none. Gradient: this rank's share, d(local sum) / N, as in
    sequence_parallel_cross_entropy (sum over the sequence-parallel ranks to get the
    single-process gradient). Memory: that of F.cross_entropy on the logits (their fp32
    copy when they are fp16/bf16, and its log-softmax).
    """
    describe = "sequence_parallel_cross_entropy_from_logits"
    groups = reduction_groups(describe, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                              sequence_dims=sequence_dims, data_dims=data_dims, any_mesh=True)  # fmt: skip
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
