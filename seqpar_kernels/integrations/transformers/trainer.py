"""Sequence parallelism in the Hugging Face Trainer.

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainer

    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=..., data_collator=...,
                                      mode="ring", layout="balanced", sequence_parallel_size=4)
    trainer.train(); trainer.evaluate()

    class MySFTTrainer(SequenceParallelTrainerMixin, SFTTrainer): ...   # the mixin first

Started by torchrun (one process per GPU, or per CPU rank: NCCL on GPUs, gloo on CPUs,
as the Trainer sets up torch.distributed). The world's ranks form groups of
sequence_parallel_size consecutive ranks (rank = replica x size + piece); each group
trains on one sequence split across its ranks, the groups are data-parallel replicas.
One DeviceMesh holds them (trainer_mesh.py), built from the Trainer's arguments:
sequence_parallel_size, tensor_parallel_size, TrainingArguments' fsdp (FSDP2) or
accelerate's ParallelismConfig (cp_size, tp_size, dp_shard_size, dp_replicate_size).
With tensor parallelism (T ranks) a replica is T groups (rank = (replica x size +
piece) x T + tensor index), which read the same batches: below, "a group" is a
replica's T x size ranks where it reads or counts the batch, and the decoder layers are
sharded over the T tensor ranks (apply(..., tensor_dims=), the model's own plan).

What it gives: step for step, what the plain Trainer gives in one process on the same
data with the global batch (per-device batch x replicas): every logged loss and
grad_norm, eval_loss, the weights. How:

Data. Every rank of a group reads the same batches, the replicas different ones: the
Trainer's dataloaders (accelerate shards them by world rank) are sharded by replica
instead. Each batch is sharded with shard_batch (this rank's tokens, shifted labels, the
packed documents' plan); a checksum of every rank's batch, gathered with the token
counts, raises ValueError on every rank if two ranks of a group read different ones.
Where the data does not fill the last global batch, accelerate tops up the replicas'
last batches with samples from the start (even_batches); their labels are set to -100,
so that the step is the one-process Trainer's smaller last batch.

Loss and gradients. The Trainer wraps the model in DDP (or accelerate's FSDP1) over the
whole world, or the mixin shards it with FSDP2 over data x sequence (the world; HSDP:
replicated over dp_replicate) before the Trainer sees it; either averages the gradients
over all W = replicas x size ranks (with tensor parallelism, the world over T: FSDP2
over data x sequence, or the mixin's own average over them, never over the tensor
ranks, which hold other shards of a layer or the same gradient of a whole parameter).
This rank's backward gives its tokens' share of its
group's loss (sequence_parallel_cross_entropy's convention), so the loss it
backpropagates is scaled by W x (its group's tokens) / D, D the one-process Trainer's
denominator: num_items_in_batch counted as the Trainer counts it, over every micro-batch
of the step and every replica (or, for a model that takes no num_items_in_batch, the
micro-batch's tokens over the replicas, and the Trainer divides by the accumulation
steps itself). The average over the world is then the one-process gradient, whole before
the Trainer clips it. The value this rank returns (what the Trainer logs, averaged over
the world) is replicas x (its group's loss sum) / D: the world's average is the
one-process loss.

Router loss. A mixture-of-experts model with output_router_logits=True adds
router_aux_loss_coef x its load-balancing loss (router.py), a product of two means over
the tokens: its per-expert sums are all-reduced over the world (every replica's
micro-batch, the one-process Trainer's batch), the value added on every rank and its
gradient (this rank's share) scaled by the world size, as DDP and FSDP average.

Evaluation. Every rank returns the batch's loss over every replica's tokens (one small
all-reduce), and the losses the Trainer gathers count as the one-process Trainer's
global batch counts them; eval_loss is the one-process one.

Memory. The model's forward runs with logits for no token (logits_to_keep); the loss is
computed from the base model's hidden states, a chunk of tokens at a time
(sequence_parallel_cross_entropy), inside the model's forward (where FSDP holds the LM
head unsharded). tiled_mlp= runs every decoder MLP in tiles of tokens (memory.tile_mlp);
offload_activations= keeps what the forward saves for the backward (with the Trainer's
gradient_checkpointing: each layer's input) in host memory (memory.offload_activations).

What raises (ValueError, at construction): label smoothing, compute_loss_func,
compute_metrics and preprocess_logits_for_metrics (they need the logits of the whole
sequence), DataParallel (several GPUs in one process), DeepSpeed, the "batch_rebalance"
sampling strategy, a world size that sequence_parallel_size does not divide, degrees
that do not multiply to the world size and what trainer_mesh.trainer_degrees refuses
(pipeline and DeepSpeed's sequence parallelism, fsdp_config options FSDP2 over the mesh
does not take), a tensor degree that does not divide the heads (apply's checks),
saving the optimizer's state of a model the mixin shards, loading the best model at
the end into it, or saving it on each node (its saves are whole models, gathered from
the shards on the first rank: save_model, which every rank calls);
at train(): resuming such a model from a checkpoint (no optimizer state); when
train() or evaluate() makes a dataloader: batches dispatched from rank 0 (accelerate's
dispatch_batches, its default for an IterableDataset), uneven replica batches
(even_batches=False); at a batch, on every rank: keys shard_batch does not know, ranks
of a group holding different batches.

TRL's DPOTrainer and GRPOTrainer (post_training.py): their own loss over a
sequence-parallel fused LM head of the model and the reference model (each rank's
tokens' log-probs, gathered back into the whole sequence's), GRPO's completions from the
sharded-cache generate, the same on every rank of a group; what TRL logs counted per
replica. Raises at construction for the TRL options post_training.unsupported_options
names.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

try:
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
    from transformers import Trainer
    from transformers import __version__ as transformers_version
except ImportError as error:  # pragma: no cover - exercised only without them
    raise ImportError(
        "SequenceParallelTrainer needs Hugging Face transformers 4.56 or newer and accelerate: "
        'pip install "seqpar-kernels[transformers]"'
    ) from error

from seqpar_kernels.comm.grid import reduction_groups
from seqpar_kernels.groups import all_gather_ints, resolve_group
from seqpar_kernels.integrations.transformers.adapters import transformers_model
from seqpar_kernels.integrations.transformers.attention import apply
from seqpar_kernels.integrations.transformers.causal_lm import IGNORE_INDEX, causal_lm_loss, head_of
from seqpar_kernels.integrations.transformers.loss import loss_through_forward
from seqpar_kernels.integrations.transformers.memory import offload_activations as offloading
from seqpar_kernels.integrations.transformers.memory import tile_mlp
from seqpar_kernels.integrations.transformers.post_training import (
    as_replicas,
    batch_checksum,
    generate_in_eval_mode,
    install_fused_head,
    is_dpo,
    unsupported_options,
    uses_fused_head,
)
from seqpar_kernels.integrations.transformers.router import load_balancing_loss, router_loss_of
from seqpar_kernels.integrations.transformers.trainer_mesh import (
    make_parallelism,
    positive_int_or_none,
    shard_model,
    trainer_degrees,
)
from seqpar_kernels.integrations.transformers.vision import shard_batch
from seqpar_kernels.parallel.parallelism import SequenceParallelism, check_options

__all__ = ["SequenceParallelTrainer", "SequenceParallelTrainerMixin"]

# A batch sharded by get_batch_samples carries its token counts under this key (popped
# before the model sees the batch).
_COUNTS_KEY = "seqpar_token_counts"
# The tokens a MoE model's router loss counts: a full batch's (B, S) 0/1 where samples were
# dropped (_drop_samples_after), this rank's (B x S_local,) once sharded (popped likewise).
_ROUTED_KEY = "seqpar_routed_tokens"
# Saved tensors smaller than this stay on the device under offload_activations=True
# (what a layer saves besides its checkpoint: rotary tables, norms' statistics).
OFFLOAD_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class _Epoch:
    """What a replica-sharded dataloader's padding depends on: the samples of an epoch,
    a replica's samples per batch, whether the last partial batch is dropped."""

    samples: int
    per_replica: int
    drop_last: bool


class SequenceParallelTrainerMixin:
    """Sequence parallelism for transformers.Trainer and its subclasses (TRL's trainers):
    put it first, class MyTrainer(SequenceParallelTrainerMixin, SomeTrainer). It
    replaces the subclass's compute_loss with the sequence-parallel loss.

    Arguments, besides the Trainer's:
        mode: "ulysses", "ring" or "usp" (seqpar_kernels.integrations.transformers.apply's)
        layout: "contiguous" or "balanced" (ring and usp: causal work balanced)
        sequence_parallel_size: ranks per sequence-parallel group (default: every rank,
            one group; with tensor parallelism the world over T); the world size over it
            (and T) is the number of data-parallel replicas
        ulysses_degree: USP's Ulysses degree (default: the largest divisor of the group
            size that divides a tensor rank's key/value heads); the ring takes the rest
        tensor_parallel_size: ranks each decoder layer is sharded over with the model's
            own tensor-parallel plan (tensor_parallel.shard_layers; default 1, or
            ParallelismConfig's tp_size); the world size over it and the sequence's
            ranks is the number of data-parallel replicas
        tiled_mlp: False; True: every decoder MLP runs in tiles of hidden-size tokens
            (memory.tile_mlp); an int: tokens per tile
        offload_activations: False; True: what the training forward saves for the
            backward (with gradient_checkpointing: each layer's input) waits in host
            memory, copied on a side stream on GPUs (memory.offload_activations)
        step_backend: what computes the ring's steps ("auto", "triton", "aten")
    The model: a transformers causal LM that apply() accepts (text, attention through
    AttentionInterface) with a plain Linear LM head, or PEFT's PeftModel of one (LoRA and
    the adapters that map each token on their own); it is switched to the mode's
    attention at construction."""

    def __init__(self, *args, mode: str = "ulysses", layout: str = "contiguous",
                 sequence_parallel_size: int | None = None, ulysses_degree: int | None = None,
                 tensor_parallel_size: int | None = None, tiled_mlp: bool | int = False,
                 offload_activations: bool = False, step_backend: str = "auto",
                 **kwargs):  # fmt: skip
        check_options(type(self).__name__, mode, layout, step_backend)
        positive_int_or_none("sequence_parallel_size", sequence_parallel_size)
        positive_int_or_none("ulysses_degree", ulysses_degree)
        positive_int_or_none("tensor_parallel_size", tensor_parallel_size)
        if ulysses_degree is not None and mode != "usp":
            raise ValueError(f"ulysses_degree is USP's; mode={mode!r} takes none")
        if not isinstance(tiled_mlp, (bool, int)) or (not isinstance(tiled_mlp, bool) and tiled_mlp < 1):
            raise ValueError(f"tiled_mlp must be True, False or a positive int (tokens per tile), got {tiled_mlp!r}")
        if not isinstance(offload_activations, bool):
            raise ValueError(f"offload_activations must be True or False, got {offload_activations!r}")
        self.sequence_parallel_options = dict(
            mode=mode,
            layout=layout,
            sequence_parallel_size=sequence_parallel_size,
            ulysses_degree=ulysses_degree,
            tensor_parallel_size=tensor_parallel_size,
            tiled_mlp=tiled_mlp,
            offload_activations=offload_activations,
            step_backend=step_backend,
        )
        self.sequence_parallel: SequenceParallelism | None = None
        self._epochs: dict[str, _Epoch | None] = {}
        self._eval_rows = 1
        self._fused_head = False
        self._router_loss = None
        if uses_fused_head(self):
            self._refuse(unsupported_options(kwargs.get("args")))
        args, kwargs = self._take_mesh_arguments(args, kwargs)
        super().__init__(*args, **kwargs)
        self._check_trainer_arguments()
        self._prepare_model(self.model)
        self._fused_head = uses_fused_head(self)
        if self._fused_head:
            self._prepare_post_training()

    # ---- set-up -------------------------------------------------------------------

    def _refuse(self, unsupported: list[str]) -> None:
        """Raises ValueError naming what sequence parallelism does not support, if any."""
        if unsupported:
            raise ValueError(f"{type(self).__name__}: sequence parallelism does not support {', '.join(unsupported)}")

    def _take_mesh_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The degrees of the Trainer's mesh (trainer_mesh.trainer_degrees), and the
        Trainer's arguments with a copy of its TrainingArguments where the mesh takes
        over what accelerate would do with them: parallelism_config, and FSDP2, which
        the mixin applies itself over data x sequence (shard_model)."""
        describe = type(self).__name__
        positional = len(args) > 1  # Trainer(model, args, ...)
        training_args = args[1] if positional else kwargs.get("args")
        if training_args is not None:
            training_args.device  # noqa: B018 - sets up torch.distributed under torchrun, as the Trainer does
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        options = self.sequence_parallel_options
        self._degrees = trainer_degrees(describe, training_args, world, options["sequence_parallel_size"],
                                        options["tensor_parallel_size"])  # fmt: skip
        sharded = self._sharded_before_the_trainer
        if training_args is None or (getattr(training_args, "parallelism_config", None) is None and not sharded):
            return args, kwargs
        if sharded:
            what = "FSDP2 over the mesh" if self._degrees.fsdp else "tensor parallelism"
            if uses_fused_head(self):
                self._refuse([f"{what} with TRL's DPO and GRPO trainers"])
            if int(transformers_version.split(".")[0]) < 5:
                raise ValueError(
                    f"{describe}: {what} needs transformers 5 or newer (whose Trainer takes a model sharded before "
                    f"it, without wrapping it in DDP); this is {transformers_version}"
                )
            if not self._degrees.fsdp and not hasattr(super(), "_sync_replicated_trainable_parameters"):
                raise ValueError(
                    f"{describe}: tensor parallelism without FSDP2 needs a Trainer that leaves the gradients of a "
                    f"model sharded before it to the model's owner (transformers {transformers_version}'s does not): "
                    "add fsdp=True or ParallelismConfig(dp_shard_size=...)"
                )
            if training_args.save_strategy != "no" and not training_args.save_only_model:
                raise ValueError(
                    f"{describe}: a model sharded by {what} saves no optimizer state: pass save_only_model=True or "
                    f"save_strategy='no' (got save_strategy={training_args.save_strategy!r})"
                )
            if training_args.save_on_each_node:
                raise ValueError(
                    f"{describe}: save_on_each_node: a model sharded by {what} is gathered whole on the first rank "
                    "only, which writes it; save to a filesystem every node reads"
                )
            if training_args.load_best_model_at_end:
                raise ValueError(
                    f"{describe}: load_best_model_at_end would load a whole checkpoint into a model sharded by "
                    f"{what}; load the saved model with from_pretrained instead"
                )
        training_args = copy.copy(training_args)
        training_args.parallelism_config = None
        if self._degrees.fsdp:
            training_args.fsdp, training_args.fsdp_plugin_args = None, None
        if positional:
            return (args[0], training_args, *args[2:]), kwargs
        return args, {**kwargs, "args": training_args}

    def _check_trainer_arguments(self) -> None:
        args = self.args
        unsupported = {
            "label_smoothing_factor": args.label_smoothing_factor != 0,
            "compute_loss_func": self.compute_loss_func is not None,
            "compute_metrics (the logits of the whole sequence are never gathered)": self.compute_metrics is not None,
            "preprocess_logits_for_metrics": self.preprocess_logits_for_metrics is not None,
            "several GPUs in one process (DataParallel): start one process per GPU": args.n_gpu > 1,
            "DeepSpeed": getattr(self, "is_deepspeed_enabled", False),
            "train_sampling_strategy='batch_rebalance'": getattr(args, "train_sampling_strategy", None)
            == "batch_rebalance",
        }
        self._refuse([name for name, present in unsupported.items() if present])

    def _prepare_model(self, model) -> None:
        """Switch the model's attention to the mode (and tile its MLPs); the groups are
        made on the first call (collective)."""
        options = self.sequence_parallel_options
        inner = self._transformers_model(model)
        if self.sequence_parallel is None:
            config = getattr(inner, "config", None)
            text_config = getattr(config, "get_text_config", lambda: config)()
            kv_heads = getattr(text_config, "num_key_value_heads", None) or getattr(text_config, "num_attention_heads",
                                                                                    None)  # fmt: skip
            self.sequence_parallel = make_parallelism(
                options["mode"], options["layout"], self._degrees, options["ulysses_degree"], self.args.device,
                kv_heads, options["step_backend"],
            )  # fmt: skip
        self._apply_parallelism(inner)
        self._router_loss = router_loss_of(inner, type(self).__name__)
        if options["tiled_mlp"]:
            tile_mlp(inner, None if options["tiled_mlp"] is True else options["tiled_mlp"])
        if self._degrees.fsdp:
            shard_model(type(self).__name__, self._unwrapped(model), self.sequence_parallel, self._degrees)
        if self._sharded_before_the_trainer:
            # A model sharded before the Trainer wraps it: the Trainer neither moves it nor wraps it in DDP.
            self.is_distributed_loading_by_transformers = True

    @property
    def _sharded_before_the_trainer(self) -> bool:
        """FSDP2 over the mesh or tensor parallelism: DTensor parameters, which the
        Trainer's DDP refuses; the mixin reduces their gradients (FSDP2, or
        _sync_replicated_trainable_parameters)."""
        return self._degrees.fsdp or self._degrees.tensor > 1

    def _sync_replicated_trainable_parameters(self, model) -> None:
        """The Trainer's gradient reduction for a model sharded before it; with tensor
        parallelism and no FSDP2: every trainable parameter (its local shard, for the
        layers' DTensors) made the same over data x sequence (DDP's broadcast), its
        gradient averaged over them at the step's last micro-batch, never over "tp"
        (whose ranks hold other shards, or the same gradient). Collective."""
        if self._degrees.fsdp or self._degrees.tensor == 1:
            return super()._sync_replicated_trainable_parameters(model)
        from torch.distributed.tensor import DTensor

        group = self.sequence_parallel.data_parallel_mesh().get_group()
        size = dist.get_world_size(group)

        def local(tensor):
            return tensor.to_local() if isinstance(tensor, DTensor) else tensor

        def average_gradient(parameter):
            if self.accelerator.sync_gradients:
                gradient = local(parameter.grad)
                dist.all_reduce(gradient, group=group)  # gloo has no ReduceOp.AVG
                gradient.div_(size)

        for parameter in model.parameters():
            if not parameter.requires_grad:
                continue
            with torch.no_grad():
                dist.broadcast(local(parameter.data), group=group, group_src=0)
            if not getattr(parameter, "_seqpar_gradient_hook", False):  # train() may run more than once
                parameter.register_post_accumulate_grad_hook(average_gradient)
                parameter._seqpar_gradient_hook = True

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint not in (None, False) and self._sharded_before_the_trainer:
            raise ValueError(
                f"{type(self).__name__}: resume_from_checkpoint: a model sharded by FSDP2 over the mesh or tensor "
                "parallelism saves its weights only (save_only_model=True), without the optimizer's state, so "
                "training cannot resume exactly; start a new run from the saved model (from_pretrained)"
            )
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's save_model; for a model sharded before the Trainer (FSDP2 over
        the mesh, tensor parallelism), every rank first gathers the whole state dict
        (collective: torch.distributed.checkpoint's full state dict, on the CPU of the
        first rank only; of a PeftModel, whose adapter PEFT saves, the trainable
        parameters only where every adapter parameter is trainable), which the
        Trainer's writer then saves as from_pretrained loads it: one model whatever the
        degrees. Call it on every rank."""
        if not self._sharded_before_the_trainer:
            return super().save_model(output_dir, _internal_call)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        model = self._unwrapped(self.model)
        # PEFT saves the adapter: the frozen base stays ungathered, unless a part of an adapter is frozen too.
        adapters = getattr(model, "peft_config", None) or {}
        frozen_adapter = any(not parameter.requires_grad and any(f".{adapter}." in name for adapter in adapters)
                             for name, parameter in model.named_parameters())  # fmt: skip
        options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                   ignore_frozen_params=bool(adapters) and not frozen_adapter)  # fmt: skip
        whole = get_model_state_dict(model, options=options)
        if self.args.should_save:  # the world's first rank, which holds the gathered state dict
            self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=whole)
        dist.barrier()  # the other ranks go on once the files are written
        if self.args.push_to_hub and not _internal_call:
            revision = getattr(self.args, "hub_revision", None)
            self.push_to_hub(commit_message="Model save", **({"revision": revision} if revision else {}))

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """The Trainer's no_sync between micro-batches for a model sharded before it,
        from the mesh's degrees (the Trainer's own reads a DistributedConfig that a model
        sharded by the mixin has not): FSDP2's reduce-scatter waits for the step's last
        micro-batch; under HSDP only the all-reduce across dp_replicate waits."""
        if self._degrees.dp_replicate > 1:
            self.model.set_requires_all_reduce(False)
        else:
            self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _unwrapped(self, model):
        """The model inside DDP, FSDP and torch.compile (whose wrapper accelerate keeps:
        the loss's forward hook must hold the module the compiled forward runs, not the
        wrapper, or torch.compile meets one module under two names)."""
        inner = self.accelerator.unwrap_model(model)
        return getattr(inner, "_orig_mod", inner)

    def _transformers_model(self, model):
        """The transformers model inside DDP, FSDP, torch.compile and PEFT's wrapper."""
        return transformers_model(self._unwrapped(model), type(self).__name__)

    def _apply_parallelism(self, inner) -> None:
        """The trainer's parallelism applied to a model (the trained one, or TRL's
        reference model); a head causal_lm_loss cannot express raises before training."""
        head_of(inner)
        parallelism = self.sequence_parallel
        if parallelism.tensor_size > 1:  # the mesh, whose tensor dim shards the layers
            ranks = dict(parallelism.reduction_kwargs(), tensor_dims=parallelism.mesh_dims.tensor)
        else:
            ranks = parallelism.group_kwargs()
        apply(inner, parallelism.mode, layout=parallelism.layout, step_backend=parallelism.step_backend, **ranks)

    def _prepare_post_training(self) -> None:
        """TRL's DPOTrainer and GRPOTrainer (post_training.py): their own loss over the
        sequence-parallel fused head of the model and of the reference model; GRPO's
        generation batch counted in replicas, its sampler seeded alike on every rank of
        a group (TRL seeds each process apart) so that they generate the same tokens."""
        self._refuse(unsupported_options(self.args, self))
        parallelism = self.sequence_parallel
        temperature = float(getattr(self, "temperature", 1.0))
        statistics = ("mean_logits", "is_top1") + (("log_sum_sq_probs",) if getattr(self, "use_weighting", False)
                                                  else ())  # fmt: skip
        model = self._transformers_model(self.model)
        router_loss = self._post_training_router_loss(model) if getattr(self, "aux_loss_enabled", False) else None
        install_fused_head(model, parallelism, temperature, statistics, self.accelerator.autocast,
                           router_loss)  # fmt: skip
        reference = getattr(self, "ref_model", None)
        if reference is not None:
            reference = self._unwrapped(reference)
            self._apply_parallelism(reference)
            install_fused_head(reference, parallelism, temperature, autocast=self.accelerator.autocast)
        if hasattr(self.args, "generation_batch_size") and hasattr(self, "num_generations"):
            from accelerate.utils import set_seed

            size = self.args.generation_batch_size // self._group_size  # TRL counted every rank as a process
            if size % self.num_generations != 0:
                raise ValueError(
                    f"{type(self).__name__}: the generation batch of the {self._replicas} replica(s), {size}, must "
                    f"divide by num_generations={self.num_generations}"
                )
            self.args.generation_batch_size = size
            set_seed(self.args.seed + self._replica)
            generate_in_eval_mode(self._unwrapped(self.model))

    def _post_training_router_loss(self, model):
        """TRL's router loss (output_router_logits) as TRL computes it: DPO's over every
        replica's batch, as its one-process trainer; GRPO's over each replica's, as its
        data-parallel trainer (each process its own completions). The value the same on
        every rank of those, its gradient this rank's share, scaled by the replicas
        where the value spans them (the fused head's caller scales by the group's size,
        and DDP averages over the world)."""
        describe = type(self).__name__
        spec = router_loss_of(model, describe, required=True)
        if is_dpo(self):
            groups, scale = reduction_groups(describe), self._replicas  # the world
        else:
            groups, scale = reduction_groups(describe, **self.sequence_parallel.group_kwargs()), 1

        def router_loss(router_logits, routed):
            aux = load_balancing_loss(router_logits, routed, spec.num_experts, spec.top_k, groups)
            return aux.detach() + (aux - aux.detach()) * scale

        return router_loss

    def _as_replicas(self):
        """TRL's code sees one process per replica inside (post_training.as_replicas)."""
        return as_replicas(self, self._replicas, self._replica)

    def _prepare_inputs(self, inputs):
        if not getattr(self, "_fused_head", False):
            return super()._prepare_inputs(inputs)
        with self._as_replicas():  # GRPO generates and scores here
            return super()._prepare_inputs(inputs)

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if getattr(self, "sequence_parallel_options", None) is not None:
            self._prepare_model(model)
        return model

    # ---- the world: data-parallel replicas of one sequence-parallel group each -----

    @property
    def _world_size(self) -> int:
        return resolve_group(None).world_size

    @property
    def _group_size(self) -> int:
        """P: the ranks of a sequence-parallel group (rank = replica x P + piece)."""
        return self.sequence_parallel.pieces

    @property
    def _replica_ranks(self) -> int:
        """T x P: the ranks that read one replica's batches, consecutive ranks
        (rank = (replica x P + piece) x T + tensor index)."""
        return self._world_size // self._replicas

    @property
    def _averaged_over(self) -> int:
        """The ranks DDP or FSDP2 average each gradient over: data x sequence, the world
        over T (tensor ranks hold other shards, or the same gradient)."""
        return self._world_size // self.sequence_parallel.tensor_size

    @property
    def _replicas(self) -> int:
        return self.sequence_parallel.data_size

    @property
    def _replica(self) -> int:
        """Which replica's batches this rank reads (the mesh's data index)."""
        return self.sequence_parallel.data_rank

    # ---- data ---------------------------------------------------------------------

    def _read_by_replica(self, dataloader, kind: str):
        """The Trainer's dataloader, sharded by replica instead of by rank: every rank of
        a group gets the same batches."""
        batches = getattr(dataloader, "batch_sampler", None)
        if not isinstance(batches, BatchSamplerShard):
            batches = getattr(dataloader, "sampler", None)
        dataset = getattr(dataloader, "dataset", None)
        if isinstance(dataloader, DataLoaderDispatcher):
            raise ValueError(
                f"{type(self).__name__}: accelerate dispatches this dataloader's batches from rank 0 "
                "(dispatch_batches, the default for an IterableDataset); sequence parallelism needs every rank of "
                "a group to read the same batch: pass accelerator_config={'dispatch_batches': False}"
            )
        self._epochs[kind] = None
        if isinstance(batches, BatchSamplerShard):
            if not batches.even_batches and self._replicas > 1:
                raise ValueError(
                    f"{type(self).__name__}: even_batches=False would give the replicas different numbers of "
                    "batches, while every step's collectives need them all"
                )
            batches.num_processes, batches.process_index = self._replicas, self._replica
            inner = batches.batch_sampler
            sampler = getattr(inner, "sampler", None)
            if getattr(inner, "batch_size", None) is not None and sampler is not None and hasattr(sampler, "__len__"):
                per_replica = inner.batch_size // self._replicas if batches.split_batches else inner.batch_size
                self._epochs[kind] = _Epoch(len(sampler), per_replica, bool(inner.drop_last))
        elif isinstance(dataset, IterableDatasetShard):
            dataset.num_processes, dataset.process_index = self._replicas, self._replica
        elif self._world_size > 1 and self._replica_ranks > 1 and dataloader is not None:
            raise ValueError(
                f"{type(self).__name__}: cannot tell how accelerate sharded this dataloader "
                f"({type(dataloader).__name__}); sequence parallelism needs every rank of a group to read the same "
                "batches"
            )
        return dataloader

    def get_train_dataloader(self):
        return self._read_by_replica(super().get_train_dataloader(), "train")

    def get_eval_dataloader(self, eval_dataset=None):
        return self._read_by_replica(super().get_eval_dataloader(eval_dataset), "eval")

    def get_test_dataloader(self, test_dataset):
        return self._read_by_replica(super().get_test_dataloader(test_dataset), "eval")

    def get_total_train_batch_size(self, args) -> int:
        return super().get_total_train_batch_size(args) // self._replica_ranks

    def _real_samples(self, kind: str) -> int | None:
        """At the last batch of an epoch that does not fill every replica's batch, this
        replica's real samples (accelerate topped up the rest); else None."""
        epoch = self._epochs.get(kind)
        state = self.accelerator.gradient_state
        if epoch is None or epoch.drop_last or not state.end_of_dataloader:
            return None
        remainder = epoch.samples % (epoch.per_replica * self._replicas)
        if remainder == 0:
            return None
        return min(max(remainder - self._replica * epoch.per_replica, 0), epoch.per_replica)

    @staticmethod
    def _drop_samples_after(batch: dict, real: int) -> dict:
        """The batch with the labels of its samples from index `real` on set to -100:
        rows of a batch of whole sequences, documents of a packed row (position ids
        restarting at 0, as DataCollatorWithFlattening makes)."""
        labels = batch.get("labels")
        if labels is None:
            labels = batch["input_ids"]
        labels = labels.clone()
        mask = batch.get("attention_mask")
        routed = torch.ones_like(labels) if mask is None else mask.clone()  # a router loss counts real samples only
        positions = batch.get("position_ids")
        if labels.shape[0] > 1 or positions is None:
            labels[real:] = IGNORE_INDEX
            routed[real:] = 0
        else:
            starts = torch.nonzero(positions[0] == 0).flatten().tolist()
            if real < len(starts):
                labels[0, starts[real] :] = IGNORE_INDEX
                routed[0, starts[real] :] = 0
        return {**batch, "labels": labels, _ROUTED_KEY: routed}

    def _with_padding_dropped(self, batches, kind: str):
        """batches (an iterator), with the last batch's top-up samples ignored."""
        for batch in batches:
            real = self._real_samples(kind)
            yield batch if real is None else self._drop_samples_after(batch, real)

    # ---- sharding and counting ----------------------------------------------------

    def _shard(self, batch) -> dict:
        if "labels" not in batch:
            raise ValueError(
                f"{type(self).__name__}: the batch has no labels (keys {sorted(batch)}); the data collator must "
                "give them (DataCollatorForLanguageModeling(mlm=False), DataCollatorWithFlattening)"
            )
        parallelism = self.sequence_parallel
        routed = batch.get(_ROUTED_KEY, batch.get("attention_mask"))
        batch = {key: value for key, value in batch.items() if key != _ROUTED_KEY}
        local = shard_batch(batch, mode=parallelism.mode, layout=parallelism.layout, ignore_index=IGNORE_INDEX,
                            model=self._unwrapped(self.model), **parallelism.group_kwargs())  # fmt: skip
        if self._router_loss is not None and routed is not None:
            local[_ROUTED_KEY] = local["sequence_shard"].take(routed, 1).reshape(-1)
        return local

    @staticmethod
    def _gather_rows(row: torch.Tensor) -> list[list[int]]:
        """Every rank of the world's row (an int64 vector, the same length on every
        rank), in rank order: one small all-gather."""
        return all_gather_ints(row, resolve_group(None).name, row.device)

    def _check_same_batches(self, batches: list) -> None:
        """Raise ValueError on every rank if two ranks of a replica hold different
        batches (one small all-gather of their checksums, before any sharding)."""
        size = self._replica_ranks
        if size == 1:
            return
        rows = self._gather_rows(torch.stack([batch_checksum(batch) for batch in batches]))
        groups = [rows[replica * size : (replica + 1) * size] for replica in range(self._replicas)]
        disagree = [replica for replica, group in enumerate(groups) if any(row != group[0] for row in group)]
        if disagree:
            raise ValueError(
                f"{type(self).__name__}: the ranks of sequence-parallel group(s) {disagree} read different "
                "batches (a collator or sampler with randomness of its own?); every rank of a group must read the "
                "same batch"
            )

    def _shard_and_count(self, batches: list, trainer_count=None) -> tuple[list, float | None]:
        """Every batch sharded for this rank, carrying (its group's real tokens, every
        replica's) under _COUNTS_KEY; and trainer_count (the Trainer's
        num_items_in_batch on this rank) as the one-process Trainer counts it. Two small
        all-gathers over the world: the batches' checksums, then the counts."""
        batches = [self._prepare_inputs(batch) for batch in batches]
        self._check_same_batches(batches)
        local = [self._shard(batch) for batch in batches]
        own = torch.zeros((), dtype=torch.int64, device=local[0]["shift_labels"].device)
        if trainer_count is not None:
            own += torch.as_tensor(trainer_count, device=own.device).round().long()
        counts = [(shard["shift_labels"] != IGNORE_INDEX).sum() for shard in local]
        rows = self._gather_rows(torch.stack(counts + [own]))
        size, tensor = self._replica_ranks, self.sequence_parallel.tensor_size
        group_rows = rows[self._replica * size : (self._replica + 1) * size]
        for index, shard in enumerate(local):  # each tensor rank holds a copy of its sequence rank's tokens
            shard[_COUNTS_KEY] = (sum(row[index] for row in group_rows) / tensor,
                                  sum(row[index] for row in rows) / tensor)  # fmt: skip
        one_process = None
        if trainer_count is not None:
            if self.args.average_tokens_across_devices and self._world_size > 1:
                one_process = float(trainer_count) / size  # the Trainer summed T x P copies of each replica's
            else:
                one_process = float(sum(row[-1] for row in rows)) / size
        return local, one_process

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, sharded for this rank, and num_items_in_batch as
        the one-process Trainer has it (None where it counts none)."""
        if self._fused_head:  # the full batches: the fused head shards them
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches, num_items = super().get_batch_samples(self._with_padding_dropped(epoch_iterator, "train"),
                                                       num_batches, device)  # fmt: skip
        if not batches:
            return batches, num_items
        local, one_process = self._shard_and_count(batches, num_items)
        if one_process is not None:
            num_items = torch.tensor(one_process, dtype=torch.float64, device=device)
        return local, num_items

    # ---- the loss -----------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss of this rank's tokens, scaled for the Trainer (see the module's
        docstring); inputs: a batch sharded by get_batch_samples, or a full batch
        (evaluation, or a direct call), sharded here."""
        training = model.training and torch.is_grad_enabled()
        if self._fused_head:
            return self._post_training_loss(model, inputs, return_outputs, num_items_in_batch, training)
        if _COUNTS_KEY in inputs:
            local = dict(inputs)
        else:
            if not training:
                real = self._real_samples("eval")
                inputs = inputs if real is None else self._drop_samples_after(inputs, real)
                self._eval_rows = self._one_process_rows(real)
            [local], _ = self._shard_and_count([inputs])
        group_tokens, all_tokens = local.pop(_COUNTS_KEY)
        routed = local.pop(_ROUTED_KEY, None)
        shift_labels = local.pop("shift_labels")
        inner = self._unwrapped(model)
        base = self._transformers_model(inner).base_model  # gives the hidden states (under PEFT's wrapper too)
        no_logits = torch.empty(0, dtype=torch.long, device=shift_labels.device)
        outputs = {}

        def forward():
            outputs["model"] = model(**local, logits_to_keep=no_logits, use_cache=False)
            return outputs["model"]

        def loss_of(hidden):
            return causal_lm_loss(inner, hidden, shift_labels, **self.sequence_parallel.group_kwargs())

        offload = training and self.sequence_parallel_options["offload_activations"]
        with offloading(min_bytes=OFFLOAD_MIN_BYTES) if offload else contextlib.nullcontext():
            share = loss_through_forward(forward, inner, base, loss_of)  # its group's mean
        group_sum = share.detach().double() * group_tokens
        if training:
            denominator = all_tokens if num_items_in_batch is None else float(num_items_in_batch)
            value_scale = self._replicas * group_tokens / max(denominator, 1.0)
            # DDP and FSDP average the gradients over data x sequence: each rank's share is
            # scaled by their size, so that their average is the one-process gradient.
            grad_scale = value_scale * self._averaged_over / self._replicas
            loss = share.detach() * value_scale + (share - share.detach()) * grad_scale
        else:
            if self._world_size > 1:  # each group's sum, once from each of its T x P ranks
                dist.all_reduce(group_sum)
                group_sum = group_sum / self._replica_ranks
            loss = (group_sum / max(all_tokens, 1.0)).float()
        if self._router_loss is not None:
            loss = loss + self._router_term(outputs["model"].router_logits, routed, training)
        if return_outputs:
            result = outputs["model"]
            result["loss"] = loss
            return loss, result
        return loss

    def _router_term(self, router_logits, routed: torch.Tensor | None, training: bool) -> torch.Tensor:
        """router_aux_loss_coef x the router loss of the step's micro-batch of every
        replica (the one-process Trainer's batch), as the model's forward adds it; its
        gradient (this rank's share of the world's sum) scaled by the world size, which DDP
        and FSDP average over (with tensor parallelism the world over T, each share the
        same on the T tensor ranks)."""
        spec = self._router_loss
        groups = reduction_groups(type(self).__name__)  # the world
        term = spec.coefficient * load_balancing_loss(router_logits, routed, spec.num_experts, spec.top_k, groups)
        return term.detach() + (term - term.detach()) * self._world_size if training else term.detach()

    def _post_training_loss(self, model, inputs, return_outputs, num_items_in_batch, training: bool):
        """TRL's own loss over the sequence-parallel fused head, the same on every rank of
        a group; its gradient (each rank's tokens' share) scaled by the group's size, as
        DDP and FSDP average over every rank of the world."""
        with self._as_replicas():
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)  # fmt: skip
        loss = result[0] if return_outputs else result
        if training:
            loss = loss.detach() + (loss - loss.detach()) * self._group_size
        return (loss, result[1]) if return_outputs else loss

    # ---- evaluation ---------------------------------------------------------------

    def _one_process_rows(self, real: int | None) -> int:
        """How many times the one-process Trainer counts its global batch's loss: its
        eval batch size (per-device x replicas), the real samples of a last partial batch."""
        if real is None:
            return self.args.eval_batch_size * self._replicas
        epoch = self._epochs["eval"]
        return epoch.samples % (epoch.per_replica * self._replicas)

    def _gather_eval_losses(self, losses, *args, **kwargs):
        """The Trainer's gather of the losses: every rank holds the global batch's loss,
        counted as many times as the one-process Trainer counts it."""
        return losses.reshape(-1)[:1].repeat(self._eval_rows)

    def evaluation_loop(self, *args, **kwargs):
        if self._fused_head:  # every rank of a group holds its replica's loss
            return super().evaluation_loop(*args, **kwargs)
        self.gather_function = self._gather_eval_losses  # the Trainer resets it after the loop
        return super().evaluation_loop(*args, **kwargs)

    def predict(self, *args, **kwargs):
        raise ValueError(
            f"{type(self).__name__}.predict: predictions are the logits of the whole sequence, which sequence "
            "parallelism never gathers; use evaluate() for the loss"
        )


class SequenceParallelTrainer(SequenceParallelTrainerMixin, Trainer):
    """transformers.Trainer with sequence parallelism: SequenceParallelTrainerMixin's
    arguments (mode, layout, sequence_parallel_size, ulysses_degree, tiled_mlp,
    offload_activations, step_backend) besides the Trainer's."""
