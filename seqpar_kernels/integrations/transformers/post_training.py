"""TRL's post-training trainers (DPOTrainer, GRPOTrainer) under sequence parallelism:
what SequenceParallelTrainerMixin installs when its Trainer subclass computes its loss
from TRL's fused LM head (`model(..., labels=labels, fused_lm_head=True)`, whose output
carries each token's log_probs, entropy, ... instead of the logits).

    install_fused_head(model, parallelism, temperature, statistics, autocast)
        the model's forward with fused_lm_head=True, sequence-parallel: the full batch
        (the same on every rank of the group) sharded by shard_batch, this rank's hidden
        states, causal_lm_logprobs of its tokens, every rank's values gathered back into
        the full (batch, seqlen - 1), in sequence order
    ReplicaAccelerator(accelerator, replicas, replica)
        the Trainer's accelerator as TRL's loss, metric and generation code sees it: one
        process per data-parallel replica (its gathers take one rank of each group)
    as_replicas(trainer, replicas, replica)
        inside: the trainer's accelerator a ReplicaAccelerator, and accelerate's gather
        and gather_object as TRL's trainer modules call them (GRPO's rewards) its gathers
    unsupported_options(trainer)
        the TRL options sequence parallelism cannot honour, by name
    generate_in_eval_mode(model)
        model.generate run in eval mode: the sequence-parallel generate (its KV cache
        sharded across the group) serves eval-mode calls; TRL generates in training mode

Why gather the per-token values: TRL's losses (every DPO loss type, ld_alpha, WPO
weights, GRPO's clipped ratios, KL, entropy masks) read per-token log-probs of the whole
sequence. They are 4 bytes per token each, like the batch's token ids (the logits, vocab
x 4 bytes per token, are never formed); every rank of a group then computes TRL's own
loss on the same values, and the gather's backward hands each rank the gradient of its
own tokens. DDP averages over every rank of the world, so the mixin scales the gradient
(not the value) by the group's size.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch

from seqpar_kernels.integrations.transformers.causal_lm import IGNORE_INDEX, causal_lm_logprobs
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.training import shard_batch

__all__ = [
    "install_fused_head",
    "ReplicaAccelerator",
    "unsupported_options",
    "batch_checksum",
    "uses_fused_head",
    "is_dpo",
    "generate_in_eval_mode",
    "as_replicas",
]

# Model inputs the sequence-parallel fused head takes; others (pixel values, token type
# ids of vision-language models) raise.
_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "use_cache")


def batch_checksum(batch) -> torch.Tensor:
    """An int64 fingerprint (0-dim, on the batch's device) of a batch's token tensors: the
    same bytes give the same value on every rank (the sums wrap around alike)."""
    total = None
    for index, key in enumerate(("input_ids", "labels", "position_ids", "attention_mask")):
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            flat = value.reshape(-1).long()
            weights = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) % 65521 + 1 + index
            term = (flat * weights).sum() + flat.numel()
            total = term if total is None else total + term
    return total


def is_dpo(trainer) -> bool:
    """Whether the trainer is TRL's DPOTrainer (or a subclass)."""
    return any(cls.__module__.startswith("trl.") and cls.__name__ == "DPOTrainer" for cls in type(trainer).__mro__)


def uses_fused_head(trainer) -> bool:
    """Whether the trainer is one of TRL's whose loss reads its model's fused LM head
    (DPOTrainer, GRPOTrainer and their subclasses; SFTTrainer's loss is the causal-LM
    loss, which the mixin computes itself)."""
    return any(cls.__module__.startswith("trl.") and cls.__name__ in ("DPOTrainer", "GRPOTrainer")
               for cls in type(trainer).__mro__)  # fmt: skip


def _flush_left(*tensors: torch.Tensor, attention_mask: torch.Tensor):
    """Each row's tokens moved left past its leading padding (GRPO's prompts are padded
    on the left), and the index that moves them back: (moved tensors, index (B, S))."""
    leading = (attention_mask.cumsum(1) == 0).sum(1, keepdim=True)  # (B, 1)
    length = attention_mask.shape[1]
    index = (torch.arange(length, device=attention_mask.device) + leading) % length
    return [tensor.gather(1, index) for tensor in tensors], index


def _unflush(values: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """values (B, S) of flushed rows, back at the rows' original columns."""
    return values if index is None else torch.zeros_like(values).scatter(1, index, values)


def install_fused_head(model, parallelism: SequenceParallelism, temperature: float = 1.0,
                       statistics: tuple[str, ...] = (), autocast=contextlib.nullcontext,
                       router_loss=None) -> None:  # fmt: skip
    """Replace model.forward (TRL's fused-head forward, add_fused_lm_head's) with one whose
    fused_lm_head=True path is sequence-parallel; without it, the forward it replaces.

    The fused path takes the full batch on every rank of the group: input_ids (B, S),
    attention_mask (B, S) (padding on the left of a row is moved to its right, its
    tokens keeping their positions), labels (B, S) (unshifted, -100 where no target).
    It returns TRL's FusedCausalLMOutput: log_probs and entropy (B, S - 1), fp32,
    differentiable, 0 where the next label is -100; the statistics asked for; label_mask;
    loss (the mean negative log-likelihood over the real labels, or over
    num_items_in_batch). The model and its head run inside autocast() (the accelerator's:
    under mixed precision accelerate wraps the forward this one replaces in it). With
    output_router_logits=True (TRL's MoE load-balancing loss): aux_loss =
    router_loss(the base model's router_logits, this rank's (tokens,) 0/1 of the tokens
    counted), added to loss times the config's router_aux_loss_coef. Raises
    ValueError (on every rank) for shift_labels, inputs other than _MODEL_INPUTS,
    output_router_logits without router_loss, and ranks of a group holding different
    batches."""
    from trl.trainer.utils import FusedCausalLMOutput

    original = model.forward
    describe = f"{type(model).__name__}'s sequence-parallel fused LM head"

    @functools.wraps(original)
    def forward(*args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return original(*args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                            **kwargs)  # fmt: skip
        if args:
            kwargs["input_ids"], args = args[0], args[1:]
        with_router = bool(kwargs.pop("output_router_logits", False))
        if with_router and router_loss is None:
            raise ValueError(f"{describe}: output_router_logits=True, but no router loss was set up for this model")
        unknown = sorted(key for key, value in kwargs.items() if key not in _MODEL_INPUTS and value is not None)
        if args or unknown or shift_labels is not None or labels is None:
            raise ValueError(
                f"{describe} takes input_ids, attention_mask, position_ids and labels (unshifted), got "
                f"{unknown or ''}{' positional arguments' if args else ''}"
                f"{' shift_labels' if shift_labels is not None else ''}{' no labels' if labels is None else ''}"
            )
        input_ids = kwargs["input_ids"]
        attention_mask = kwargs.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = kwargs.get("position_ids")
        if positions is None:  # the model's own: each column's index, left padding counted; moved with the tokens
            (input_ids, labels, mask), index = _flush_left(input_ids, labels, attention_mask,
                                                           attention_mask=attention_mask)  # fmt: skip
            positions = torch.arange(input_ids.shape[1], device=input_ids.device) + (index[:, :1])
        else:  # packed documents (padding_free), or positions of the caller's: no padding moved
            mask, index = attention_mask, None
        batch = {"input_ids": input_ids, "labels": labels.masked_fill(mask == 0, IGNORE_INDEX), "attention_mask": mask,
                 "position_ids": positions}  # fmt: skip
        parallelism.agree(describe + ": the ranks of a group hold different batches; checksum",
                          int(batch_checksum(batch)), input_ids.device)  # fmt: skip
        local = shard_batch(batch, mode=parallelism.mode, layout=parallelism.layout, ignore_index=IGNORE_INDEX,
                            **parallelism.group_kwargs())  # fmt: skip
        local_labels = local.pop("shift_labels")
        shard = local["sequence_shard"]
        with autocast():
            outputs = model.base_model(**local, use_cache=False, **({"output_router_logits": True} if with_router
                                                                     else {}))  # fmt: skip
            hidden = outputs.last_hidden_state
            log_probs, entropy, *extra = causal_lm_logprobs(
                model, hidden, local_labels, temperature=temperature, return_entropy=True, statistics=statistics,
                **parallelism.group_kwargs(),
            )  # fmt: skip

        def full(values: torch.Tensor) -> torch.Tensor:
            """(B, S - 1): every rank's values in sequence order, at the rows' columns."""
            if shard.varlen is not None:
                values = shard.varlen.gather(values, 1)
            else:
                values = parallelism.gather(values, 1, input_ids.shape[1])
            return _unflush(values, index)[:, :-1]

        label_mask = _unflush(batch["labels"], index)[:, 1:] != IGNORE_INDEX
        per_token = {"log_probs": full(log_probs), "entropy": full(entropy)}
        for name, values in (extra[0] if extra else {}).items():
            values = full(values.float())
            per_token[name] = values.bool() if name == "is_top1" else values
        count = label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss, aux_loss = -per_token["log_probs"].sum() / count, None
        if with_router:
            aux_loss = router_loss(outputs.router_logits, shard.take(mask, 1).reshape(-1))
            loss = loss + getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, label_mask=label_mask, aux_loss=aux_loss, **per_token)

    model.forward = forward


def generate_in_eval_mode(model) -> None:
    """Replace model.generate with one that runs in eval mode and restores the training
    mode after: the generation hooks (generation.py) shard the prompt and its KV cache
    across the group for a model in eval mode only, and TRL's GRPO generates with the
    model in training mode; with a KV cache always (use_cache=True: without one, each
    step would rerun the left-padded prompt, which sequence-parallel attention cannot
    take). Dropout is off while generating (the mixin's models train with none:
    attention dropout raises)."""
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        training = model.training
        model.eval()
        try:
            return original(*args, **{**kwargs, "use_cache": True})
        finally:
            model.train(training)

    model.generate = generate


class ReplicaAccelerator:
    """The Trainer's accelerator as TRL's loss, metric and generation code sees it under
    sequence parallelism: one process per data-parallel replica, as the one-process (or
    plain data-parallel) trainer has them. process_index is the replica, num_processes
    the replicas; gather and gather_for_metrics keep one rank of each group (every rank
    of a group holds the same values). Everything else is the accelerator's."""

    def __init__(self, accelerator, replicas: int, replica: int):
        self._accelerator, self._replicas, self._replica = accelerator, replicas, replica

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @property
    def process_index(self) -> int:
        return self._replica

    @property
    def num_processes(self) -> int:
        return self._replicas

    def gather(self, tensor):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"sequence-parallel gather takes a tensor, got {type(tensor).__name__}")
        gathered = self._accelerator.gather(tensor)
        rows = 1 if tensor.dim() == 0 else tensor.shape[0]
        per_rank = gathered.reshape(-1, rows, *gathered.shape[1:])  # (world, rows, ...)
        group_size = per_rank.shape[0] // self._replicas
        return per_rank[::group_size].reshape(self._replicas * rows, *gathered.shape[1:])

    def gather_for_metrics(self, data, use_gather_object=False):
        return (
            self.gather_object(data) if use_gather_object or not isinstance(data, torch.Tensor) else self.gather(data)
        )

    def gather_object(self, objects: list) -> list:
        """The replicas' lists, concatenated (one rank of each group)."""
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        per_rank = [None] * world
        if world == 1:
            per_rank[0] = objects
        else:
            torch.distributed.all_gather_object(per_rank, objects)
        group_size = world // self._replicas
        return [item for rank_objects in per_rank[::group_size] for item in rank_objects]


@contextlib.contextmanager
def as_replicas(trainer, replicas: int, replica: int):
    """Inside, TRL's code sees one process per replica: trainer.accelerator is a
    ReplicaAccelerator, and the gather and gather_object that TRL's trainer modules
    import from accelerate (GRPO gathers its rewards with them) are its methods."""
    accelerator = trainer.accelerator
    replica_accelerator = ReplicaAccelerator(accelerator, replicas, replica)
    modules = {cls.__module__ for cls in type(trainer).__mro__ if cls.__module__.startswith("trl.")}
    replaced = []
    for module in (sys.modules[name] for name in modules if name in sys.modules):
        for name in ("gather", "gather_object"):
            if name in vars(module):
                replaced.append((module, name, vars(module)[name]))
                setattr(module, name, getattr(replica_accelerator, name))
    trainer.accelerator = replica_accelerator
    try:
        yield
    finally:
        trainer.accelerator = accelerator
        for module, name, original in replaced:
            setattr(module, name, original)


def unsupported_options(args, trainer=None) -> list[str]:
    """The TRL options that sequence parallelism cannot honour, by name: those of the
    trainer's arguments `args` (checkable before the trainer is made, so that every rank
    raises before TRL prepares its data), and with `trainer` its own.
    (padding_free is not one: TRL's DPOTrainer falls back to padding itself, and the
    fused head takes packed documents' position ids where a trainer passes them.)"""
    options = {
        "precompute_ref_log_probs (computed before sequence parallelism is set up)":
            getattr(args, "precompute_ref_log_probs", False),
        "use_vllm (vLLM generates outside the model: use the model's generate)": getattr(args, "use_vllm", False),
        "use_transformers_continuous_batching": getattr(args, "use_transformers_continuous_batching", False),
    }  # fmt: skip
    if trainer is not None:
        options.update({
            "vision-language data": getattr(trainer, "_is_vision_dataset", False) or getattr(trainer, "_is_vlm",
                                                                                             False),
        })  # fmt: skip
    return [name for name, present in options.items() if present]
