"""The router load-balancing loss of a transformers mixture-of-experts model under
sequence parallelism: what its forward adds to the loss with output_router_logits=True,
router_aux_loss_coef x load_balancing_loss_func(router_logits, ...).

    router_loss_of(model, describe)        the model's RouterLoss (experts, top-k,
                                           coefficient), None where its forward adds no
                                           router loss; raises for a family not in
                                           ROUTER_LOSS_FAMILIES
    load_balancing_loss(router_logits, routed, num_experts, top_k, groups)
                                           the loss over every rank's tokens

The loss (Switch Transformer's, with top-k routing; the one formula every causal-LM
family of transformers 5.25 below shares):

    num_experts x sum_e (C_e / N) x (P_e / N)

C_e the tokens routed to expert e (each token's top-k choices), P_e the sum of its
router probabilities, N the tokens counted, all summed over every MoE layer. Each is a
sum over tokens, so each rank's sums are its share; the loss is not (a product of two
means), so the sums are reduced over the ranks before the product. The tokens counted
are the model forward's attention_mask's (every token where it has none: packed
documents).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqpar_kernels.comm.grid import all_reduce_sum

__all__ = ["RouterLoss", "ROUTER_LOSS_FAMILIES", "router_loss_of", "load_balancing_loss"]

# model_type -> the attribute holding the loss's coefficient, for the families whose
# forward adds load_balancing_loss_func's loss (one formula in transformers 5.25: each
# family's copy of Mixtral's). None of these has a router z-loss; Switch Transformers
# and NLLB-MoE (encoder-decoders, which apply() does not take) and Doge (product-key
# routing, its own formula) are not here and raise.
ROUTER_LOSS_FAMILIES = {
    **dict.fromkeys(
        ("dbrx", "deepseek_v4", "ernie4_5_moe", "ernie4_5_vl_moe", "flex_olmo", "flint", "glm4v_moe", "glm5_next",
         "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "jamba", "laguna",
         "lara_mini", "mellum", "minimax", "minimax_m2", "minimax_m3_vl", "mixtral", "olmoe", "phimoe", "qwen2_moe",
         "qwen3_5_moe", "qwen3_moe", "qwen3_next", "qwen3_omni_moe", "qwen3_vl_moe", "qwen4_exp"),
        "router_aux_loss_coef",
    ),
    "jetmoe": "aux_loss_coef",
}  # fmt: skip
# What a modeling file that computes a router loss defines (the families above, and the
# ones this module cannot compute).
_ROUTER_LOSS_FUNCTIONS = ("load_balancing_loss_func", "router_z_loss_func")


@dataclass(frozen=True)
class RouterLoss:
    """A model's router loss: coefficient x load_balancing_loss(..., num_experts, top_k)."""

    num_experts: int
    top_k: int
    coefficient: float


def _has_router_loss(model) -> bool:
    import sys

    module = sys.modules.get(type(model).__module__)
    return any(hasattr(module, name) for name in _ROUTER_LOSS_FUNCTIONS)


def router_loss_of(model, describe: str, required: bool = False) -> RouterLoss | None:
    """The router loss model's forward adds with its config's output_router_logits,
    read as its forward reads it (the model's attributes, else its text config's); None
    where it adds none. required: a caller computes the loss whatever the config says
    (TRL's router_aux_loss_coef). Raises ValueError, naming the option, for a model whose
    loss this module cannot compute (its family is not in ROUTER_LOSS_FAMILIES)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model_type = getattr(model.config, "model_type", "")
    known = model_type in ROUTER_LOSS_FAMILIES
    if not required and not (getattr(config, "output_router_logits", False) and (known or _has_router_loss(model))):
        return None
    if not known:
        option = "router_aux_loss_coef" if required else "output_router_logits"
        raise ValueError(
            f"{describe}: {type(model).__name__} (model type {model_type!r}) would add a router auxiliary loss "
            f"({option}) whose formula sequence parallelism does not know, so it would be dropped or wrong: train "
            f"without it ({option}={0.0 if required else False})"
        )

    def read(*names):
        for owner in (model, config):
            for name in names:
                if getattr(owner, name, None) is not None:
                    return getattr(owner, name)
        raise ValueError(f"{describe}: {type(model).__name__} has none of {names}, which its router loss reads")

    return RouterLoss(int(read("num_experts", "num_local_experts")), int(read("num_experts_per_tok")),
                      float(read(ROUTER_LOSS_FAMILIES[model_type])))  # fmt: skip


def load_balancing_loss(router_logits, routed: torch.Tensor | None, num_experts: int, top_k: int,
                        groups) -> torch.Tensor:  # fmt: skip
    """load_balancing_loss_func's loss over every rank of `groups` (reduction_groups'
    list), as one process holding all their tokens computes it.

    router_logits: a tuple of one (tokens_local, num_experts) tensor per MoE layer, this
        rank's tokens (the base model's output router_logits: batch x seqlen_local rows).
    routed: (tokens_local,) 0/1 of the tokens counted (the attention mask's), or None:
        every token.
    Returns a 0-dim fp32 tensor, the same value on every rank; its gradient is this
    rank's share (its tokens' router probabilities' part), so that the sum over the
    ranks of their gradients is the one-process gradient. One all-reduce of
    2 x num_experts + 1 values per group."""
    if not isinstance(router_logits, (tuple, list)) or not router_logits:
        raise ValueError(
            f"router loss: router_logits must be a non-empty tuple of (tokens, {num_experts}) tensors, one per MoE "
            f"layer, got {type(router_logits).__name__}"
        )
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float64, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float64, device=device)
    for layer in router_logits:
        if layer.dim() != 2 or layer.shape[-1] != num_experts or (routed is not None and len(routed) != len(layer)):
            raise ValueError(
                f"router loss: each layer's router logits must be (tokens, {num_experts}) with the routed mask's "
                f"{None if routed is None else len(routed)} tokens, got {tuple(layer.shape)}"
            )
        weights = torch.softmax(layer.to(device), dim=-1)  # in the logits' dtype, as the model's function
        _, chosen = torch.topk(weights, top_k, dim=-1)
        weight = torch.ones(len(layer), dtype=torch.float64, device=device) if routed is None else routed.double()
        counts = counts.index_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        probabilities = probabilities + (weights.float() * weight.float().unsqueeze(-1)).sum(0)
        rows = rows + weight.sum()
    totals = all_reduce_sum(torch.cat([counts, probabilities.detach().double(), rows.reshape(1)]), groups)
    count_share = (totals[:num_experts] / totals[-1].clamp(min=1)).float()
    total = (count_share * (totals[num_experts:-1] / totals[-1].clamp(min=1)).float()).sum() * num_experts
    share = (count_share * probabilities / totals[-1].clamp(min=1).float()).sum() * num_experts
    return total + (share - share.detach())
