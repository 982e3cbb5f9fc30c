"""The causal-LM loss of a transformers model under sequence parallelism, from its
hidden states, with the model's own LM head.

    model_loss(model, hidden_states, shift_labels, *, group=None, mesh=None, chunk_size=None)
    check_model_head(model)                 what model_loss raises for, checked up front
    loss_through_forward(call, model, hidden_module, loss)
"""

from __future__ import annotations

import torch

from seqpar_kernels.parallel.cross_entropy import sequence_parallel_cross_entropy

# Config attributes through which a model's forward transforms its logits after the LM
# head (final softcapping: Gemma 2/3; logit_scale: Cohere; logits_scaling: Granite):
# sequence_parallel_cross_entropy would silently leave them out.
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def check_model_head(model) -> None:
    """Raise ValueError for a model whose forward transforms the logits after its LM
    head, or whose head is not a bias-free Linear."""
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)()
    for name, identity in _LOGIT_TRANSFORMS.items():
        value = getattr(text_config, name, identity)
        if value is not None and value != identity:
            raise ValueError(
                f"{type(model).__name__} transforms its logits after the LM head ({name}={value}); the "
                "sequence-parallel loss takes the head's logits as they are, so it does not support this model yet"
            )
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(
            f"{type(model).__name__}'s output embeddings are {type(head).__name__}"
            f"{' with a bias' if getattr(head, 'bias', None) is not None else ''}: the sequence-parallel loss "
            "needs a plain Linear LM head without bias"
        )


def model_loss(
    model,
    hidden_states: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    group=None,
    mesh=None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The loss of `model`'s LM head on this rank's hidden states: the mean over every
    rank's real tokens (sequence_parallel_cross_entropy's value and gradient convention:
    the gradient is this rank's share).

    hidden_states: (batch, seqlen_local, hidden), the base model's last hidden state
        (after its final norm). shift_labels: (batch, seqlen_local), shard_batch's.
    group / mesh, chunk_size: as sequence_parallel_cross_entropy's.
    Under autocast the head's logits are computed in the autocast dtype, as its Linear
    would compute them. Raises ValueError for a model whose forward transforms the
    logits (final softcapping, logit scales) or whose head is not a bias-free Linear."""
    check_model_head(model)
    weight = model.get_output_embeddings().weight
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return sequence_parallel_cross_entropy(hidden_states.to(dtype), weight.to(dtype), shift_labels,
                                                   group=group, mesh=mesh, chunk_size=chunk_size)  # fmt: skip
    if hidden_states.dtype != weight.dtype:  # e.g. an fp32 final norm before a bf16 head
        hidden_states = hidden_states.to(weight.dtype)
    return sequence_parallel_cross_entropy(
        hidden_states, weight, shift_labels, group=group, mesh=mesh, chunk_size=chunk_size
    )


def loss_through_forward(call, model: torch.nn.Module, hidden_module: torch.nn.Module, loss) -> torch.Tensor:
    """Run call() (model's forward, through whatever wraps it: DDP, FSDP, accelerate's
    autocast) and return loss(hidden states), computed when hidden_module (the base
    model) returns its last hidden state: inside the model's forward, where FSDP holds
    the LM head's weight unsharded. The loss leaves the forward in model's output (as
    "loss"), where DDP and FSDP look for what the backward starts from. call() must keep
    the LM head from computing logits (logits_to_keep selecting no token)."""
    captured = []

    def compute(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        captured.append(loss(hidden))

    def attach(module, args, output):
        if len(captured) != 1:
            raise ValueError(
                f"{type(module).__name__}'s forward ran its base model {type(hidden_module).__name__} "
                f"{len(captured)} times (expected once): the sequence-parallel loss cannot tell which hidden states "
                "to use"
            )
        if isinstance(output, tuple):
            return (captured[0], *output)
        output["loss"] = captured[0]
        return output

    handles = [hidden_module.register_forward_hook(compute),
               # first among model's hooks: FSDP's own post-forward hook then sees the loss
               model.register_forward_hook(attach, prepend=True)]  # fmt: skip
    try:
        outputs = call()
    finally:
        for handle in handles:
            handle.remove()
    return outputs[0] if isinstance(outputs, tuple) else outputs["loss"]
