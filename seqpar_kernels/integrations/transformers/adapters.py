"""PEFT's wrappers seen through: the transformers model under a PeftModel, and the LM head
that a PEFT wrapper of it computes with.

    model = transformers_model(peft_model, "apply")    # peft_model.base_model.model
    head = head_in_use(model.get_output_embeddings(), "causal_lm_loss")

PEFT injects its adapters' layers (LoRA, DoRA, IA3, LoHa, LoKr, OFT, VeRA, ...) into the
transformers model's own modules, in place: each maps every token on its own, so the
model under the wrapper runs sequence-parallel as it is, adapters and all, whichever of
apply() and get_peft_model came first. Prompt learning (prompt tuning, prefix tuning,
P-tuning, CPT) prepends virtual tokens or key/value prefixes to every sequence and
adaption prompts (LLaMA-Adapter) run attention of their own beside the model's: those
raise. PEFT is optional: a model is a PEFT wrapper only where peft was imported.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["transformers_model", "head_in_use"]


def _peft(*names: str) -> tuple:
    """peft's classes of those names (public paths), or () where peft is not imported."""
    if "peft" not in sys.modules:
        return ()
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    known = {"PeftModel": peft.PeftModel, "PeftMixedModel": peft.PeftMixedModel, "BaseTunerLayer": BaseTunerLayer,
             "ModulesToSaveWrapper": ModulesToSaveWrapper}  # fmt: skip
    return tuple(known[name] for name in names)


def transformers_model(model, describe: str):
    """The transformers model under a PEFT wrapper (a PeftModel or PeftMixedModel: its
    base_model.model, whose modules hold the adapters' layers), or model itself. Raises
    ValueError for a wrapper holding an adapter that changes the sequence: prompt
    learning's virtual tokens and prefixes (the sequence the ranks share would not be the
    one the model runs) and adaption prompts (attention outside the model's)."""
    wrappers = _peft("PeftModel", "PeftMixedModel")
    if not wrappers or not isinstance(model, wrappers):
        return model
    refused = sorted(f"{name!r} ({type(config).__name__})" for name, config in model.peft_config.items()
                     if config.is_prompt_learning or getattr(config, "is_adaption_prompt", False))  # fmt: skip
    if refused:
        raise ValueError(
            f"{describe}: {type(model).__name__} holds the adapter(s) {', '.join(refused)}, which add virtual tokens "
            "or prefixes to every sequence (or attention of their own), so the sequence the ranks split is not the "
            "one the model runs; sequence parallelism takes the adapters that map each token on their own (LoRA, "
            "DoRA, IA3, LoHa, LoKr, OFT, VeRA, ...)"
        )
    return model.base_model.model


def head_in_use(head: torch.nn.Module, describe: str) -> torch.nn.Module:
    """The module that computes a model's logits where PEFT wraps its LM head: a
    ModulesToSaveWrapper's trained copy of the active adapter (its original with the
    adapters disabled); head itself where PEFT does not wrap it. Raises ValueError for an
    adapter layer on the head (lm_head in target_modules): the fused loss multiplies by
    the head's weight, which would leave the adapter out."""
    [saved, tuner] = _peft("ModulesToSaveWrapper", "BaseTunerLayer") or (None, None)
    if saved is not None and isinstance(head, saved):
        return head.original_module if head.disable_adapters or not head.active_adapters \
            else head.modules_to_save[head.active_adapters[0]]  # fmt: skip
    if tuner is not None and isinstance(head, tuner):
        raise ValueError(
            f"{describe}: the LM head is a PEFT adapter layer ({type(head).__module__}.{type(head).__name__}); the "
            "fused loss multiplies by the head's weight, which would leave the adapter out: take lm_head out of "
            "target_modules (modules_to_save=['lm_head'] trains the head itself)"
        )
    return head
