"""The loss of a transformers causal language model's own head under sequence
parallelism, causal_lm_loss(model, hidden_states, shift_labels), and its tokens'
log-probabilities, causal_lm_logprobs(model, hidden_states, labels) (post-training).

    hidden = model.model(**batch).last_hidden_state         # (B, S_local, hidden)
    loss = causal_lm_loss(model, hidden, batch["shift_labels"])
    logps, entropy = causal_lm_logprobs(model, hidden, batch["shift_labels"], return_entropy=True)

What a model's forward does between its last hidden states and its loss, read from the
model: the output embeddings (the LM head, tied to the input embeddings or not), and
what the forward does to the logits, which the fused loss applies in fp32 on each chunk
of logits (sequence_parallel_cross_entropy's logit_scale and logit_softcap):
    final_logit_softcapping   cap * tanh(logits / cap)   (Gemma 2 and 3, ...)
    a scale, by model type    Cohere's logit_scale (times), Granite's logits_scaling
                              (divided by), ... (LOGIT_SCALES)
A head with a bias, output embeddings that are not a Linear, or a scale attribute on a
model type whose forward is not in LOGIT_SCALES raise ValueError: a loss that ignored
them would train the model towards another objective than its own.
"""

from __future__ import annotations

import torch

from seqpar_kernels.comm.grid import reduction_groups
from seqpar_kernels.integrations.transformers.adapters import head_in_use, transformers_model
from seqpar_kernels.integrations.transformers.attention import SETTINGS_ATTRIBUTE
from seqpar_kernels.integrations.transformers.router import load_balancing_loss, router_loss_of
from seqpar_kernels.parallel.cross_entropy import sequence_parallel_cross_entropy, sequence_parallel_logprobs
from seqpar_kernels.parallel.training import SequenceShard, check_within_stages

__all__ = ["causal_lm_loss", "causal_lm_logprobs", "router_aux_loss", "head_of", "IGNORE_INDEX", "LOGIT_SCALES"]

# transformers' label of a token without a target (its loss functions' ignore_index).
IGNORE_INDEX = -100

# What a causal LM's forward multiplies its logits by, by config.model_type, as its
# modeling file computes them (transformers 5); final_logit_softcapping is the same tanh
# cap wherever a model has one.
LOGIT_SCALES = {
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), lambda config: config.logit_scale),
    **dict.fromkeys(
        ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa", "granitemoe_swa", "minicpm3"),
        lambda config: 1.0 / config.logits_scaling,
    ),
    "hyperclovax": lambda config: config.logits_scaling,
    "falcon_h1": lambda config: config.lm_head_multiplier,
}
# Config attributes through which models scale their logits: on a model type missing
# from LOGIT_SCALES they raise rather than be ignored.
_SCALE_ATTRIBUTES = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")


def head_of(model, describe: str = "causal_lm_loss") -> tuple[torch.Tensor, float, float]:
    """(lm_head weight (vocab, hidden), logit_softcap, logit_scale) of a transformers
    causal LM: its logits are logit_softcap * tanh(logit_scale * hidden @ weight.T /
    logit_softcap) (without the tanh when logit_softcap is 0); model may be PEFT's
    wrapper of one (adapters.transformers_model), whose head in use it reads
    (adapters.head_in_use). Raises ValueError for a head this cannot express."""
    model = transformers_model(model, describe)
    name = type(model).__name__
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is None else head_in_use(head, describe)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"{describe}: {name}'s output embeddings are {type(head).__name__}, not a Linear LM head: pass "
            "sequence_parallel_cross_entropy the head's weight yourself"
        )
    if head.bias is not None:
        raise ValueError(f"{describe}: {name}'s LM head has a bias, which the fused loss does not add")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    softcap = getattr(config, "final_logit_softcapping", None) or 0.0
    model_type = getattr(config, "model_type", "")
    if model_type in LOGIT_SCALES:
        scale = float(LOGIT_SCALES[model_type](config))
    else:
        scale = 1.0
        scaled = {attribute: getattr(config, attribute) for attribute in _SCALE_ATTRIBUTES
                  if getattr(config, attribute, None) not in (None, 1, 1.0)}  # fmt: skip
        if scaled:
            raise ValueError(
                f"{describe}: {name} (model type {model_type!r}) has {scaled}, which its forward may apply to "
                "the logits in a way causal_lm_loss does not know; compute the logits' transform yourself and pass "
                "sequence_parallel_cross_entropy logit_scale= and logit_softcap="
            )
    return head.weight, float(softcap), scale


def _groups_of(model, groups: dict) -> dict:
    """groups, or where none is given the reduction groups apply() recorded on model."""
    settings = getattr(model, SETTINGS_ATTRIBUTE, None)
    if settings is not None and all(value in (None, ()) for value in groups.values()):
        return settings.reduction_kwargs()
    return groups


def _arguments(groups: dict) -> str:
    """The reduction's arguments that were given, as a message names them (the mesh by its dims, which the
    message gives)."""
    given = [f"{key}={value!r}" for key, value in groups.items() if key != "mesh" and value not in (None, ())]
    return ", ".join(given) or "the world"


def _through_head(describe: str, model, hidden_states: torch.Tensor, function, labels: torch.Tensor, groups: dict,
                  **options):  # fmt: skip
    """function(hidden_states, head weight, labels, **options) with the model's head:
    its weight, logit_softcap and logit_scale (head_of), the groups apply() recorded on
    the model where none is given, and the dtype its Linear would compute the logits in
    (the autocast dtype under autocast)."""
    model = transformers_model(model, describe)
    groups = _groups_of(model, groups)
    # A pipeline stage's loss (hold_per_stage) reduced across stages raises on every stage, the head's or not.
    reduced = [group for group, info in reduction_groups(describe, any_mesh=True, **groups) if info.world_size > 1]
    check_within_stages(describe, model.named_parameters(), reduced, _arguments(groups))
    weight, logit_softcap, logit_scale = head_of(model, describe)
    options = dict(options, logit_softcap=logit_softcap, logit_scale=logit_scale, **groups)
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return function(hidden_states.to(dtype), weight.to(dtype), labels, **options)
    if hidden_states.dtype != weight.dtype:  # e.g. an fp32 final norm before a bf16 head
        hidden_states = hidden_states.to(weight.dtype)
    return function(hidden_states, weight, labels, **options)


def causal_lm_loss(
    model,
    hidden_states: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group=None,
    mesh=None,
    ulysses_group=None,
    ring_group=None,
    sequence_dims=None,
    data_dims=(),
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The sequence-parallel causal-LM loss of `model`'s own head: its LM head and what
    its forward does to the logits (final_logit_softcapping, a logit scale), fused and
    chunked as sequence_parallel_cross_entropy (the logits never exist for all tokens).

    model: the transformers causal LM (e.g. LlamaForCausalLM) whose base model gave
        hidden_states, or PEFT's wrapper of one (a PeftModel); usually set up by apply().
    hidden_states: (..., hidden), this rank's tokens' last hidden states (the base
        model's last_hidden_state), the head's dtype and device.
    shift_labels: shard_batch's "shift_labels", hidden_states' leading shape.
    group / mesh / ulysses_group + ring_group: the ranks to reduce over, or mesh= with
        sequence_dims= and data_dims= (the mean over every real token of every data
        replica); none given: what apply() recorded on the model (the world for a model
        it did not set up).
    ignore_index, chunk_size: sequence_parallel_cross_entropy's.
    Returns the 0-dim fp32 mean over every rank's real tokens, the same on every rank;
    its backward gives this rank's share (all_reduce_gradients sums them). Under
    autocast the head's logits are computed in the autocast dtype, as its Linear would
    compute them. Raises ValueError for a head it cannot express (head_of)."""
    groups = dict(group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                  sequence_dims=sequence_dims, data_dims=data_dims)  # fmt: skip
    return _through_head("causal_lm_loss", model, hidden_states, sequence_parallel_cross_entropy, shift_labels, groups,
                         ignore_index=ignore_index, chunk_size=chunk_size)  # fmt: skip


def causal_lm_logprobs(
    model,
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    *,
    group=None,
    mesh=None,
    ulysses_group=None,
    ring_group=None,
    sequence_dims=None,
    data_dims=(),
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    per_sequence: bool = False,
    sequence_shard: SequenceShard | None = None,
    statistics: tuple[str, ...] = (),
):
    """This rank's tokens' log-probabilities of their labels under `model`'s own head
    (tied embeddings, final softcapping, logit scales: what causal_lm_loss reads), and
    optionally each token's entropy, without the logits of the whole piece ever
    existing (sequence_parallel_logprobs: a chunk of tokens at a time, fp32).

        hidden = model.model(**batch).last_hidden_state          # (B, S_local, hidden)
        logps = causal_lm_logprobs(model, hidden, batch["shift_labels"])   # (B, S_local)
        # DPO: each sequence's sum over every rank's tokens, (B,), the same on every rank
        seq_logps = causal_lm_logprobs(model, hidden, batch["shift_labels"], per_sequence=True)

    model, hidden_states, group / mesh / ulysses_group + ring_group, sequence_dims,
        data_dims: as causal_lm_loss (per-sequence sums over the sequence dims only:
        each data replica holds other sequences).
    labels: shard_batch's "shift_labels" (ignore_index: prompt, padding, last token).
    temperature: the logits (after the model's own transform) are divided by it.
    return_entropy: also the entropy of each token's distribution.
    per_sequence: sums over each sequence's tokens of every rank instead: hidden_states
        (B, S_local, hidden) gives (B,); a packed batch (shard_batch's, position ids
        restarting) gives one sum per document, (documents,), given sequence_shard=
        (the batch's "sequence_shard").
    statistics: per-token "mean_logits", "is_top1", "log_sum_sq_probs" (no gradient),
        in a dict after the rest (what TRL's trainers log).
    Returns log_probs (labels' shape, fp32, 0 where the label is ignore_index), or
    (log_probs, entropy); differentiable (this rank's share, as causal_lm_loss's).
    Raises ValueError for a head it cannot express (head_of)."""
    groups = dict(group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                  sequence_dims=sequence_dims, data_dims=data_dims)  # fmt: skip
    options = dict(ignore_index=ignore_index, chunk_size=chunk_size, temperature=temperature,
                   return_entropy=return_entropy, statistics=statistics)  # fmt: skip
    if per_sequence:
        options.update(_sequence_ids(hidden_states, labels, sequence_shard))
    return _through_head("causal_lm_logprobs", model, hidden_states, sequence_parallel_logprobs, labels, groups,
                         **options)  # fmt: skip


def _sequence_ids(hidden_states, labels, sequence_shard: SequenceShard | None) -> dict:
    """sequence_ids= and num_sequences= for per-sequence sums: each token's row of
    hidden_states (B, S_local, hidden), or its document in a packed batch's plan."""
    shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else None
    if shape is None or len(shape) != 2 or not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        found = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
        raise ValueError(
            f"causal_lm_logprobs: per_sequence=True takes hidden_states (batch, seqlen_local, hidden) and labels "
            f"(batch, seqlen_local), got hidden_states {found} and labels {shape}"
        )
    plan = None if sequence_shard is None else sequence_shard.varlen
    if plan is None:
        rows = torch.arange(shape[0], device=labels.device).unsqueeze(1).expand(shape)
        return {"sequence_ids": rows, "num_sequences": shape[0]}
    bounds = plan.layout.cu_seqlens
    lengths = torch.tensor([end - start for start, end in zip(bounds[:-1], bounds[1:])], device=labels.device)
    documents = torch.repeat_interleave(torch.arange(len(lengths), device=labels.device), lengths).unsqueeze(0)
    local = plan.split(documents, dim=1)
    if tuple(local.shape) != shape:
        raise ValueError(
            f"causal_lm_logprobs: labels {shape} are not this rank's tokens of sequence_shard's packed batch "
            f"({tuple(local.shape)})"
        )
    return {"sequence_ids": local, "num_sequences": len(lengths)}


def router_aux_loss(
    model,
    router_logits,
    *,
    attention_mask: torch.Tensor | None = None,
    sequence_shard: SequenceShard | None = None,
    group=None,
    mesh=None,
    ulysses_group=None,
    ring_group=None,
    sequence_dims=None,
    data_dims=(),
) -> torch.Tensor:
    """What a mixture-of-experts model's forward adds to its loss with
    output_router_logits=True, router_aux_loss_coef x its router load-balancing loss,
    over every rank's tokens (router.py: a product of two means over the tokens, so the
    ranks' sums are reduced before it).

        outputs = model.model(**batch, output_router_logits=True)   # batch: shard_batch's
        loss = causal_lm_loss(model, outputs.last_hidden_state, shift_labels) + router_aux_loss(
            model, outputs, attention_mask=full_batch["attention_mask"], sequence_shard=batch["sequence_shard"])

    model: the transformers MoE causal LM (a family of router.ROUTER_LOSS_FAMILIES).
    router_logits: the base model's output (its router_logits), or that tuple of one
        (batch x seqlen_local, num_experts) tensor per MoE layer.
    attention_mask: the full batch's (batch, seqlen) mask, as given to shard_batch: the
        tokens the model's forward counts; None: every token (packed documents).
    sequence_shard: the sharded batch's "sequence_shard" (which tokens are this rank's);
        needed with attention_mask.
    group / mesh / ulysses_group + ring_group, sequence_dims, data_dims: causal_lm_loss's
        (with data_dims the loss of every replica's tokens together, as one process
        holding the global batch computes it).
    Returns a 0-dim fp32 tensor, the same on every rank; its backward gives this rank's
    share (all_reduce_gradients sums them), as causal_lm_loss's. Raises ValueError for a
    model without a router loss this package knows."""
    describe = "router_aux_loss"
    loss = router_loss_of(model, describe, required=True)
    logits = getattr(router_logits, "router_logits", router_logits)
    routed = None
    if attention_mask is not None:
        if not isinstance(sequence_shard, SequenceShard):
            raise ValueError(
                f"{describe}: attention_mask {tuple(attention_mask.shape)} (the full batch's) needs sequence_shard= "
                f"(shard_batch's), got {type(sequence_shard).__name__}"
            )
        routed = sequence_shard.take(attention_mask, 1).reshape(-1)
    groups = reduction_groups(describe, any_mesh=True, **_groups_of(model, dict(
        group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group, sequence_dims=sequence_dims,
        data_dims=data_dims)))  # fmt: skip
    return loss.coefficient * load_balancing_loss(logits, routed, loss.num_experts, loss.top_k, groups)
