"""The loss of a transformers causal language model's own head under sequence
parallelism: causal_lm_loss(model, hidden_states, shift_labels).

    hidden = model.model(**batch).last_hidden_state         # (B, S_local, hidden)
    loss = causal_lm_loss(model, hidden, batch["shift_labels"])

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

from seqpar_kernels.integrations.transformers.attention import SETTINGS_ATTRIBUTE
from seqpar_kernels.parallel.cross_entropy import sequence_parallel_cross_entropy

__all__ = ["causal_lm_loss", "head_of", "LOGIT_SCALES"]

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


def head_of(model) -> tuple[torch.Tensor, float, float]:
    """(lm_head weight (vocab, hidden), logit_softcap, logit_scale) of a transformers
    causal LM: its logits are logit_softcap * tanh(logit_scale * hidden @ weight.T /
    logit_softcap) (without the tanh when logit_softcap is 0). Raises ValueError for a
    head this cannot express."""
    name = type(model).__name__
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"causal_lm_loss: {name}'s output embeddings are {type(head).__name__}, not a Linear LM head: pass "
            "sequence_parallel_cross_entropy the head's weight yourself"
        )
    if head.bias is not None:
        raise ValueError(f"causal_lm_loss: {name}'s LM head has a bias, which the fused loss does not add")
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
                f"causal_lm_loss: {name} (model type {model_type!r}) has {scaled}, which its forward may apply to "
                "the logits in a way causal_lm_loss does not know; compute the logits' transform yourself and pass "
                "sequence_parallel_cross_entropy logit_scale= and logit_softcap="
            )
    return head.weight, float(softcap), scale


def causal_lm_loss(
    model,
    hidden_states: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group=None,
    mesh=None,
    ulysses_group=None,
    ring_group=None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The sequence-parallel causal-LM loss of `model`'s own head: its LM head and what
    its forward does to the logits (final_logit_softcapping, a logit scale), fused and
    chunked as sequence_parallel_cross_entropy (the logits never exist for all tokens).

    model: the transformers causal LM (e.g. LlamaForCausalLM) whose base model gave
        hidden_states; usually set up by apply().
    hidden_states: (..., hidden), this rank's tokens' last hidden states (the base
        model's last_hidden_state), the head's dtype and device.
    shift_labels: shard_batch's "shift_labels", hidden_states' leading shape.
    group / mesh / ulysses_group + ring_group: the ranks to reduce over; none given: the
        groups apply() recorded on the model (the world for a model it did not set up).
    ignore_index, chunk_size: sequence_parallel_cross_entropy's.
    Returns the 0-dim fp32 mean over every rank's real tokens, the same on every rank;
    its backward gives this rank's share (all_reduce_gradients sums them). Under
    autocast the head's logits are computed in the autocast dtype, as its Linear would
    compute them. Raises ValueError for a head it cannot express (head_of)."""
    weight, logit_softcap, logit_scale = head_of(model)
    groups = dict(group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group)
    settings = getattr(model, SETTINGS_ATTRIBUTE, None)
    if settings is not None and all(value is None for value in groups.values()):
        groups.update(settings.group_kwargs())
    options = dict(ignore_index=ignore_index, chunk_size=chunk_size, logit_softcap=logit_softcap,
                   logit_scale=logit_scale, **groups)  # fmt: skip
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return sequence_parallel_cross_entropy(hidden_states.to(dtype), weight.to(dtype), shift_labels, **options)
    if hidden_states.dtype != weight.dtype:  # e.g. an fp32 final norm before a bf16 head
        hidden_states = hidden_states.to(weight.dtype)
    return sequence_parallel_cross_entropy(hidden_states, weight, shift_labels, **options)
