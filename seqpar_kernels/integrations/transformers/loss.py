"""The loss computed inside a transformers model's forward, where DDP and FSDP need it.

    loss_through_forward(call, model, hidden_module, loss)

The loss itself is causal_lm_loss (causal_lm.py): the model's own head and what its
forward does to the logits.
"""

from __future__ import annotations

import torch


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
