"""Pipeline parallelism (torch.distributed.pipelining) around sequence parallelism, on
one DeviceMesh: a mesh dim of pipeline stages, each stage's decoder layers running on
the sequence-sharded micro-batches.

    mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("pp", "cp"))
    apply(model, "ring", layout="balanced", mesh=mesh, sequence_dims="cp")
    pipe = pipeline(model, pipeline_dim="pp", schedule="1F1B", microbatches=4)
    optimizer = torch.optim.AdamW(pipe.module.parameters())
    loss = pipe.step(micro_batches)          # the loss on the last stage, None elsewhere
    all_reduce_gradients(pipe.module, mesh=mesh, sequence_dims="cp")
    optimizer.step(); optimizer.zero_grad()

What travels between stages is the hidden states alone, (batch, S_local, hidden), from
a rank to the rank of the next stage at the same sequence (and data, tensor)
coordinates. Every stage shards each micro-batch itself (shard_batch, on the same full
micro-batch): its positions, its packed documents' plan and its layout come from the
batch on every stage, never as a tensor between stages. The last stage's loss is
causal_lm_loss over the sequence and data dims, each micro-batch's weighted by its real
tokens (their counts summed over those dims on every stage before the schedule runs),
so the step's loss is the mean over every real token of the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers

from seqpar_kernels.comm.grid import all_reduce_sum, reduction_groups
from seqpar_kernels.integrations.transformers.adapters import transformers_model
from seqpar_kernels.integrations.transformers.attention import SETTINGS_ATTRIBUTE
from seqpar_kernels.integrations.transformers.causal_lm import IGNORE_INDEX, causal_lm_loss
from seqpar_kernels.integrations.transformers.vision import shard_batch
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.training import hold_per_stage

__all__ = ["pipeline", "SequencePipeline", "SCHEDULES"]

SCHEDULES = ("GPipe", "1F1B")


class _Stage(torch.nn.Module):
    """This rank's stage of a causal LM: (first stage) input_ids (B, S_local) or
    (later stages) hidden states (B, S_local, hidden) -> hidden states (B, S_local,
    hidden) after its decoder layers (and the final norm on the last stage)."""

    def __init__(self, model, first: bool):
        super().__init__()
        self.model = model
        self.first = first

    def forward(self, inputs, position_ids, attention_mask, sequence_shard):
        given = {"input_ids": inputs} if self.first else {"inputs_embeds": inputs}
        return self.model.model(
            **given,
            position_ids=position_ids,
            attention_mask=attention_mask,
            sequence_shard=sequence_shard,
            use_cache=False,
        ).last_hidden_state


@dataclass
class SequencePipeline:
    """This rank's pipeline stage and the schedule that runs it (pipeline() makes it).

    module       the stage: the model itself, holding its stage's decoder layers (the
                 embeddings on the first stage, the final norm and the LM head on the
                 last); its parameters are what this rank trains
    stage        this rank's stage index, of `stages`
    layers       the indices of the model's decoder layers this stage runs (module's
                 layers 0, 1, ... are these)"""

    module: torch.nn.Module
    stage: int
    stages: int
    layers: range
    schedule: str
    microbatches: int
    parallelism: SequenceParallelism = field(repr=False)
    pipeline_dim: str = field(repr=False)
    _runners: dict = field(default_factory=dict, repr=False)

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def step(self, micro_batches) -> torch.Tensor | None:
        """One forward and backward of the schedule over `micro_batches`: a list of
        `microbatches` full batches (each shard_batch's input: input_ids (B, S), labels,
        position_ids, attention_mask), this rank's data replica's, the same on every
        stage and sequence rank. Every micro-batch must give each rank the same local
        shape (B, S_local): the stages exchange buffers of one shape (equal S and B; a
        packed batch in the balanced layout may not). Leaves each parameter's share of
        the gradient of the mean over every real token of every micro-batch (and
        replica): sum it over the sequence and data dims (all_reduce_gradients).
        Returns the 0-dim loss (that mean, detached) on the last stage, None on the
        others. Raises ValueError on every rank of the sequence group for a wrong count
        of micro-batches or shapes that differ."""
        describe = "SequencePipeline.step"
        parallelism = self.parallelism
        if not isinstance(micro_batches, (list, tuple)) or len(micro_batches) != self.microbatches:
            count = len(micro_batches) if isinstance(micro_batches, (list, tuple)) else type(micro_batches).__name__
            raise ValueError(f"{describe}: takes a list of microbatches={self.microbatches} batches, got {count}")
        dims = parallelism.mesh_dims
        local = [
            shard_batch(
                batch,
                mode=parallelism.mode,
                layout=parallelism.layout,
                mesh=dims.mesh,
                sequence_dims=dims.sequence,
                data_dims=dims.data,
            )
            for batch in micro_batches
        ]
        shapes = [tuple(batch["input_ids"].shape) for batch in local]

        def local_checks():
            _not_fully_sharded(describe, self.module)  # fully_shard after pipeline()
            return _one_shape(describe, shapes)

        parallelism.checked(describe, local_checks)
        labels = [batch.pop("shift_labels") for batch in local]
        # Each micro-batch's real tokens over the sequence and data dims: its loss's weight is its share.
        counts = torch.stack([(label != IGNORE_INDEX).sum() for label in labels]).double()
        all_reduce_sum(counts, reduction_groups(describe, **parallelism.reduction_kwargs()))
        weights = (counts / counts.sum().clamp_min(1)).tolist()
        runner = self._runner(shapes[0], local[0]["input_ids"].device)
        # The first stage takes the tokens; the later ones the hidden states the schedule receives.
        arguments = [(batch.pop("input_ids"),) if self.stage == 0 else () for batch in local]
        for batch in local:
            batch.pop("input_ids", None)
        runner.weights = dict(zip(map(id, labels), weights))
        losses: list = []
        runner.schedule.step(
            arg_mbs=arguments,
            kwarg_mbs=local,
            target_mbs=labels if self.is_last else None,
            losses=losses,
            return_outputs=False,
        )
        return torch.stack(losses).sum().detach() if self.is_last else None

    def _runner(self, shape, device) -> _Runner:
        """The stage and schedule for micro-batches of local shape `shape` (B, S_local):
        static shapes, made once per shape."""
        if shape not in self._runners:
            self._runners[shape] = _Runner(self, shape, device)
        return self._runners[shape]


def _not_fully_sharded(describe: str, module) -> None:
    """ValueError where FSDP2 (fully_shard) wraps the stage or a module of it: the last
    stage's loss reads the LM head after the stage's forward, where FSDP2 holds it
    sharded, and the schedule's stages would wait on each other's gathers."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    wrappers = (FSDPModule, FullyShardedDataParallel)
    wrapped = [name or "the model itself" for name, inner in module.named_modules() if isinstance(inner, wrappers)]
    if wrapped:
        raise ValueError(
            f"{describe}: FSDP2 (fully_shard) wraps {wrapped[:3]} of the pipeline stage, which the pipeline does not "
            "run: its loss reads the LM head outside the stage's forward, where FSDP2 holds it sharded. Keep each "
            "stage's parameters whole and sum their gradients with all_reduce_gradients over the sequence and data dims"
        )


def _one_shape(describe: str, shapes):
    if len(set(shapes)) > 1:
        raise ValueError(
            f"{describe}: the micro-batches give this rank local input_ids of shapes {shapes}: the stages exchange "
            "hidden states in buffers of one shape, so every micro-batch must shard to one shape (the same batch "
            "size and length; packed documents in layout='contiguous')"
        )
    return None, None


class _Runner:
    """torch.distributed.pipelining's stage (static shapes) and schedule for one local
    shape; `weights` maps each micro-batch's labels (by identity) to its loss's weight."""

    def __init__(self, pipe: SequencePipeline, shape, device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        config = transformers_model(pipe.module, "pipeline").config
        dtype = next(pipe.module.parameters()).dtype
        # requires_grad: the stages send and receive the hidden states' gradients too.
        hidden = torch.empty(*shape, config.hidden_size, dtype=dtype, device=device, requires_grad=True)
        inputs = torch.zeros(shape, dtype=torch.long, device=device) if pipe.stage == 0 else hidden
        dims = pipe.parallelism.mesh_dims
        stage = PipelineStage(
            _Stage(pipe.module, pipe.stage == 0),
            pipe.stage,
            pipe.stages,
            device,
            input_args=(inputs,),
            output_args=(hidden,),
            group=dims.mesh.get_group(pipe.pipeline_dim),
        )
        self.weights: dict[int, float] = {}
        reduction = pipe.parallelism.reduction_kwargs()

        def loss_fn(hidden_states, shift_labels):
            # The micro-batch's mean over its real tokens, times its share of the step's real tokens.
            mean = causal_lm_loss(pipe.module, hidden_states, shift_labels, **reduction)
            return mean * self.weights[id(shift_labels)]

        kind = ScheduleGPipe if pipe.schedule == "GPipe" else Schedule1F1B
        # scale_grads=False: the weights make the micro-batches' losses sum to the step's mean.
        self.schedule = kind(stage, pipe.microbatches, loss_fn=loss_fn, scale_grads=False)


def pipeline(model, *, pipeline_dim: str, schedule: str = "1F1B", microbatches: int, stage_layers=None):
    """Cuts `model` (a transformers causal LM that apply() set up on a mesh, with
    mesh=, sequence_dims= and any data_dims= / tensor_dims=) into pipeline stages along
    the mesh's `pipeline_dim` (a dim apply() was not told of), keeping in place this
    rank's stage only: its decoder layers, the embeddings on the first stage, the final
    norm and the LM head on the last (the other modules become None, or nn.Identity for
    the norm).

    schedule: "GPipe" or "1F1B" (torch.distributed.pipelining's ScheduleGPipe,
        Schedule1F1B), over `microbatches` micro-batches per step.
    stage_layers: decoder layers per stage, a tuple of pipeline_dim's size summing to
        the model's layer count; default: as even as torch.tensor_split makes them.
    Returns a SequencePipeline (its step() runs one; its module is this rank's stage).
    Its parameters are recorded as this stage's (training.hold_per_stage), so that a
    gradient or loss reduction across the pipeline dim raises.

    Raises ValueError alike on every rank: a model apply() did not set up on a mesh, a
    pipeline dim the mesh lacks or that apply() was given as another dim, a schedule
    other than SCHEDULES, fewer micro-batches than stages (1F1B), stage_layers that do
    not add up, a model without the embeddings -> layers -> norm -> head structure,
    mixed layer types (config.layer_types: the base model reads them by position),
    tied embeddings on several stages (the first stage's embedding is the last stage's
    head), and FSDP2 around the model or any of its modules (also at step(), for
    fully_shard after pipeline())."""
    describe = "pipeline"
    _not_fully_sharded(describe, model)  # the model as given: a PeftModel's wrapper too
    inner = transformers_model(model, describe)
    parallelism = getattr(inner, SETTINGS_ATTRIBUTE, None)
    dims = parallelism.mesh_dims if parallelism is not None else None
    if dims is None:
        raise ValueError(
            f"{describe}: {type(inner).__name__} was not set up by apply(model, mode, mesh=..., sequence_dims=...): "
            "the pipeline dim is a dim of the mesh the sequence dims belong to"
        )
    mesh = dims.mesh
    shapes = f"mesh {tuple(mesh.shape)} with dims {mesh.mesh_dim_names}"
    named = {"sequence_dims": dims.sequence, "data_dims": dims.data, "tensor_dims": dims.tensor}
    if pipeline_dim not in mesh.mesh_dim_names:
        raise ValueError(f"{describe}: the mesh has no dim pipeline_dim={pipeline_dim!r} ({shapes})")
    for argument, names in named.items():
        if pipeline_dim in names:
            raise ValueError(f"{describe}: pipeline_dim={pipeline_dim!r} is apply()'s {argument}={names} ({shapes})")
    if schedule not in SCHEDULES:
        raise ValueError(f"{describe}: schedule must be one of {SCHEDULES}, got {schedule!r}")
    stages, stage = mesh.size(mesh.mesh_dim_names.index(pipeline_dim)), mesh.get_local_rank(pipeline_dim)
    if not isinstance(microbatches, int) or microbatches < 1 or (schedule == "1F1B" and microbatches < stages):
        raise ValueError(
            f"{describe}: microbatches={microbatches!r} must be at least 1 (1F1B: at least the "
            f"{stages} stages of {pipeline_dim!r})"
        )
    base = getattr(inner, "model", None)
    missing = [
        name
        for name, owner in (
            ("model", inner),
            ("lm_head", inner),
            ("embed_tokens", base),
            ("layers", base),
            ("norm", base),
        )
        if getattr(owner, name, None) is None
    ]
    if missing or not isinstance(inner, transformers.PreTrainedModel):
        raise ValueError(
            f"{describe}: {type(inner).__name__} is not a causal LM of embeddings -> layers -> norm -> "
            f"head (model.model.embed_tokens, .layers, .norm and model.lm_head); it lacks {missing}"
        )
    count = len(base.layers)
    layer_types = set(getattr(inner.config, "layer_types", None) or ())
    if len(layer_types) > 1:
        raise ValueError(
            f"{describe}: {type(inner).__name__} mixes layer types {sorted(layer_types)}, which its "
            "forward reads by layer position: a stage holding some of the layers would misread them"
        )
    if stages > 1 and inner.get_output_embeddings().weight is inner.get_input_embeddings().weight:
        raise ValueError(
            f"{describe}: {type(inner).__name__} ties its LM head to its input embeddings (tie_word_embeddings), "
            f"which would be on stages 0 and {stages - 1} of {pipeline_dim!r}: one weight on two ranks, its two "
            "gradients never summed. Untie them (config.tie_word_embeddings=False, the head a copy of the weight) "
            "or use one stage"
        )
    if stage_layers is None:
        stage_layers = tuple(len(part) for part in torch.arange(count).tensor_split(stages))
    if (
        len(stage_layers) != stages
        or any(not isinstance(n, int) or n < 0 for n in stage_layers)
        or sum(stage_layers) != count
    ):
        raise ValueError(
            f"{describe}: stage_layers={stage_layers!r} must give each of the {stages} stages of "
            f"{pipeline_dim!r} a count of the model's {count} decoder layers, summing to {count}"
        )
    start = sum(stage_layers[:stage])
    layers = range(start, start + stage_layers[stage])
    base.layers = torch.nn.ModuleList(base.layers[index] for index in layers)
    if stage > 0:
        base.embed_tokens = None
    if stage < stages - 1:
        base.norm = torch.nn.Identity()
        inner.lm_head = None
    hold_per_stage(inner.parameters(), mesh, pipeline_dim)
    return SequencePipeline(inner, stage, stages, layers, schedule, microbatches, parallelism, pipeline_dim)
