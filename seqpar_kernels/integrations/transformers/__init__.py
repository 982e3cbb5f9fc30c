"""Sequence parallelism for Hugging Face transformers models.

    import seqpar_kernels.integrations.transformers as sp_transformers

    sp_transformers.apply(model, mode="ring", layout="balanced")     # once, after loading
    batch = sp_transformers.shard_batch(batch, mode="ring", layout="balanced")   # every step
    hidden = model.model(**batch).last_hidden_state                 # (B, S_local, hidden)
    loss = sp_transformers.causal_lm_loss(model, hidden, batch["shift_labels"])
    loss.backward(); sp_transformers.all_reduce_gradients(model)

or, with the Hugging Face Trainer (started by torchrun):

    trainer = sp_transformers.SequenceParallelTrainer(model=model, args=args, train_dataset=...,
                                                      mode="ring", layout="balanced")
    trainer.train()

Modules:
    attention   the attention implementations transformers dispatches to (register,
                apply)
    masks       the mask function registered beside them: transformers' masks read as
                the package's AttentionMask (LayerMask)
    causal_lm   causal_lm_loss: the loss of the model's own head (tied embeddings,
                final logit softcapping, logit scales), fused and chunked;
                causal_lm_logprobs: its tokens' log-probabilities and entropies;
                router_aux_loss: a mixture-of-experts model's router loss (router.py)
    trainer     SequenceParallelTrainer, SequenceParallelTrainerMixin (needs accelerate,
                imported on first use)
    loss        the loss computed inside the model's forward (where DDP and FSDP need it)
    tensor_parallel  what apply(..., tensor_dims=) runs: the model's own tensor-parallel
                plan over the mesh's tensor dims, each rank's attention on its heads
    memory      tile_mlp (MLPs a tile of tokens at a time), offload_activations (what
                the backward needs, held in host memory)
    pipeline    pipeline(model, pipeline_dim=...): the model cut into pipeline stages
                along a mesh dim (torch.distributed.pipelining's GPipe, 1F1B), each
                stage on the sequence-sharded micro-batches; SequencePipeline.step
    adapters    transformers_model: the transformers model under PEFT's wrapper (every
                entry point takes a PeftModel: LoRA, DoRA, ...; prompt learning raises)
    vision      shard_batch (the core's, and a vision-language batch's images, videos
                and multimodal positions: model=model), and what apply() installs on a
                vision-language model so that each rank's tokens get their features

Supported releases: transformers 4.56 and newer (the models that dispatch attention
through AttentionInterface and build masks through masking_utils).
"""

from __future__ import annotations

# attention first: it raises the ImportError that names the missing dependency.
from seqpar_kernels.integrations.transformers.attention import IMPLEMENTATIONS, apply, register
from seqpar_kernels.integrations.transformers.causal_lm import causal_lm_logprobs, causal_lm_loss, router_aux_loss
from seqpar_kernels.integrations.transformers.masks import LayerMask
from seqpar_kernels.integrations.transformers.memory import offload_activations, tile_mlp, untile_mlp
from seqpar_kernels.integrations.transformers.pipeline import SequencePipeline, pipeline
from seqpar_kernels.integrations.transformers.vision import shard_batch
from seqpar_kernels.parallel.cross_entropy import (
    sequence_parallel_cross_entropy,
    sequence_parallel_cross_entropy_from_logits,
    sequence_parallel_logprobs,
)
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.training import SequenceShard, all_reduce_gradients

__all__ = [
    "register",
    "apply",
    "shard_batch",
    "causal_lm_loss",
    "causal_lm_logprobs",
    "router_aux_loss",
    "sequence_parallel_cross_entropy",
    "sequence_parallel_cross_entropy_from_logits",
    "sequence_parallel_logprobs",
    "all_reduce_gradients",
    "SequenceParallelism",
    "SequenceShard",
    "IMPLEMENTATIONS",
    "LayerMask",
    "SequenceParallelTrainer",
    "SequenceParallelTrainerMixin",
    "tile_mlp",
    "untile_mlp",
    "offload_activations",
    "pipeline",
    "SequencePipeline",
]

_TRAINER_NAMES = ("SequenceParallelTrainer", "SequenceParallelTrainerMixin")


def __getattr__(name: str):
    # The Trainer's names import transformers.Trainer and accelerate only when asked for.
    if name in _TRAINER_NAMES:
        from seqpar_kernels.integrations.transformers import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
