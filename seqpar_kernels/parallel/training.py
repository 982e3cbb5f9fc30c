"""What a training step adds around sequence-parallel attention: this rank's piece of a
batch of token sequences, labels shifted on the full sequence first, and the sum of the
ranks' gradient shares.

    shard_batch(batch, *, mode, ...)         this rank's input_ids, position_ids, shift_labels
    SequenceShard                            how a batch was sharded (what the attention reads)
    document_starts(position_ids)            where a packed row's documents start
    all_reduce_gradients(parameters, ...)    each parameter's gradient summed over the ranks
                                             (the mesh's sequence and data dims named)
    hold_per_stage(parameters, mesh, dim)    records a pipeline stage's parameters: no
                                             reduction may span that dim's ranks
    check_within_stages(describe, ...)       ValueError for a reduction that would
                                             span them (all_reduce_gradients', the loss's)

Modes and layouts: SequenceParallelism's (parallel/parallelism.py), the value a batch's
sharding and the model's attention share.

Why labels are shifted before splitting: the target of token t is token t + 1, so the
last token of rank r is labelled by the first token of the next piece, which only the
full sequence has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from seqpar_kernels.comm.grid import reduction_groups
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.varlen import VarlenPlan, varlen_plan

# Keys a flattening collator (transformers' DataCollatorWithFlattening) adds to describe
# the packed documents of the FULL batch; the varlen plan replaces them, so shard_batch
# drops them rather than hand a rank the bounds of tokens it does not hold.
_FULL_BATCH_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_TOKEN_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


@dataclass(frozen=True)
class SequenceShard:
    """How a batch was sharded: what the attention functions of the transformers
    integration read from it (shard_batch puts it in the batch under "sequence_shard",
    and the model passes it down to its attention layers).

    parallelism  the mode, layout and groups
    seq_lens     every piece's token count, in piece order (the attention calls take
                 them, which spares each call the metadata all-gather)
    varlen       the VarlenPlan of a packed batch, or None
    padded       whether right padding was folded into shift_labels (exact for causal
                 attention only: the attention raises on a non-causal layer)
    vision       what this rank's image and video tokens take from a vision-language
                 model's vision tower (the transformers integration's VisionShard), or
                 None

    take(x, dim) gives this rank's tokens of a full-sequence tensor in the same layout."""

    parallelism: SequenceParallelism
    seq_lens: tuple[int, ...]
    varlen: VarlenPlan | None
    padded: bool
    vision: object | None = None

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of x (the full sequence along dim, the same on every rank),
        in the shard's layout (the varlen plan's for a packed batch). Local."""
        return self.varlen.split(x, dim) if self.varlen is not None else self.parallelism.take(x, dim)


def document_starts(position_ids: torch.Tensor) -> list[int]:
    """Where a new document starts in a (1, S) row of position ids: wherever a position
    is not its predecessor's plus one (what transformers reads as packed sequences)."""
    restarts = torch.nonzero(torch.diff(position_ids[0]) != 1).flatten() + 1
    return restarts.tolist()


def _check_right_padding(attention_mask: torch.Tensor, shape) -> None:
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError(f"shard_batch: attention_mask {tuple(shape)} must hold 0 and 1 only")
    if not bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        raise ValueError(
            f"shard_batch: attention_mask {tuple(shape)} has padding before real tokens (left padding or "
            "holes), which sequence-parallel attention cannot express; pad on the right, or pack the "
            "sequences into one row with position ids restarting at 0"
        )


def shard_batch(
    batch: Mapping[str, torch.Tensor],
    *,
    mode: str,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    sequence_dims=None,
    data_dims=(),
    layout: str = "contiguous",
    ignore_index: int = -100,
) -> dict:
    """This rank's piece of a batch of token sequences for a causal language model.

    batch: the full batch, the same on every rank:
        input_ids       (batch, seqlen) integer tokens
        labels          optional (batch, seqlen): the targets before shifting
                        (default: input_ids), ignore_index where a token has none
        attention_mask  optional (batch, seqlen) of 0/1, padding on the right only
        position_ids    optional (batch or 1, seqlen). Positions that do not count up by
                        one (restarting at 0, as transformers' DataCollatorWithFlattening
                        makes) mark packed documents: batch size 1 then
        cu_seq_lens_q/k, max_length_q/k, seq_idx (a flattening collator's description
                        of the full batch) are dropped: the varlen plan replaces them.
    mode, group / mesh / ulysses_group + ring_group, layout: as the module docstring
        says; the same as the model's attention was given (apply()). Or mesh= with
        sequence_dims= (and data_dims=): SequenceParallelism.resolve's; batch is then
        this rank's data replica's (its data_rank's), split over the sequence dims.
    Returns a dict:
        input_ids       (batch, seqlen_local): this rank's tokens in the layout
        position_ids    (batch, seqlen_local): their global positions (positions within
                        each document for a packed batch), for rotary embeddings
        shift_labels    (batch, seqlen_local): the label of the NEXT token of the full
                        sequence, shifted before splitting; ignore_index at the last
                        token, at padding, and at the last token of every packed
                        document (it would predict the next document's first token)
        attention_mask  (batch, seqlen_local) of ones: padding is folded into
                        shift_labels, which is exact because no real token of a causal
                        model attends to padding after it. Present so that transformers
                        does not read this rank's position ids (which jump in the
                        balanced layout) as packed documents
        sequence_shard  a SequenceShard: the layout, every rank's length and the varlen
                        plan, for the attention functions
    Splitting runs the split functions' small checking collectives (a bad batch on any
    rank raises on every rank); a packed batch builds its varlen_plan here."""
    describe = "shard_batch"
    parallelism = SequenceParallelism.resolve(
        describe, mode, layout, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
        sequence_dims=sequence_dims, data_dims=data_dims,
    )  # fmt: skip
    unknown = sorted(set(batch) - set(_TOKEN_KEYS) - set(_FULL_BATCH_PACKING_KEYS))
    if unknown:
        raise ValueError(
            f"{describe}: does not know how to shard {unknown} (it shards {_TOKEN_KEYS}); shard other inputs yourself"
        )
    if "input_ids" not in batch:
        raise ValueError(f"{describe}: batch has no input_ids (keys: {sorted(batch)})")
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"{describe}: input_ids must be an integer tensor (batch, seqlen), got {shape}")
    batch_size, seqlen = input_ids.shape
    labels = batch.get("labels")
    labels = input_ids if labels is None else labels
    attention_mask = batch.get("attention_mask")
    position_ids = batch.get("position_ids")
    for name, value in (("labels", labels), ("attention_mask", attention_mask)):
        if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != (batch_size, seqlen)):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{describe}: {name} must have input_ids' shape {(batch_size, seqlen)}, got {shape}")
    if position_ids is None:
        position_ids = torch.arange(seqlen, device=input_ids.device).expand(batch_size, seqlen)
    elif not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != seqlen \
            or position_ids.shape[0] not in (1, batch_size):  # fmt: skip
        shape = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise ValueError(f"{describe}: position_ids must be (batch or 1, {seqlen}), got {shape}")
    position_ids = position_ids.expand(batch_size, seqlen)

    padded = attention_mask is not None and not bool(attention_mask.all())
    if padded:
        _check_right_padding(attention_mask, attention_mask.shape)
        labels = labels.masked_fill(attention_mask == 0, ignore_index)
    # (B, S): the target of token t is labels[t + 1]; the last token has none.
    shift_labels = torch.cat([labels[:, 1:], labels.new_full((batch_size, 1), ignore_index)], dim=1)

    restarts = [row for row in range(batch_size) if seqlen > 1 and bool((torch.diff(position_ids[row]) != 1).any())]
    plan = None
    if restarts:
        if batch_size != 1:
            raise ValueError(
                f"{describe}: position_ids {tuple(position_ids.shape)} restart inside rows {restarts}: packed "
                "documents must be packed into one row (batch size 1), as DataCollatorWithFlattening makes them"
            )
        if padded:
            raise ValueError(f"{describe}: a packed batch (position ids restarting) must not be padded")
        starts = document_starts(position_ids)
        # The last token of each document would predict the next document's first one.
        shift_labels[0, torch.tensor(starts, dtype=torch.long, device=shift_labels.device) - 1] = ignore_index
        plan = varlen_plan(
            [0, *starts, seqlen], layout=parallelism.layout, device=input_ids.device, **parallelism.group_kwargs()
        )

    # One split for the three: (B, S, 3) int64.
    tokens = torch.stack([input_ids.long(), position_ids.long(), shift_labels.long()], dim=-1)
    local = plan.split(tokens, dim=1) if plan is not None else parallelism.split(tokens, dim=1)
    local_ids, local_positions, local_labels = local.unbind(-1)
    seq_lens = tuple(plan.seq_lens) if plan is not None else parallelism.piece_lengths(seqlen)
    return {
        "input_ids": local_ids.to(input_ids.dtype),
        "position_ids": local_positions.contiguous(),
        "shift_labels": local_labels.contiguous(),
        "attention_mask": torch.ones_like(local_ids),
        "sequence_shard": SequenceShard(parallelism, seq_lens, plan, padded),
    }


_BUCKET_BYTES = 64 << 20


def all_reduce_gradients(
    parameters: torch.nn.Module | Iterable[torch.nn.Parameter],
    *,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    sequence_dims=None,
    data_dims=(),
) -> None:
    """Sum every parameter's gradient over the sequence-parallel ranks (and the data
    replicas named), in place.

    Under sequence parallelism each rank's backward gives its tokens' share of every
    parameter's gradient (sequence_parallel_cross_entropy's convention); their sum is
    the gradient of the whole batch. parameters: a module or parameters; those that
    require grad take part, a missing .grad counting as zeros (so that every rank sends
    the same buffers); a DTensor's gradient (FSDP2's shard, tensor parallelism's) is
    summed shard by shard, which is right where the ranks summed over hold the same
    shards (FSDP2 over the data dims only: the sequence ranks of a replica do; tensor
    parallelism: the sequence and data ranks of a tensor rank do). A reduction over ranks
    that hold different shards of a parameter (a tensor dim named among the data dims,
    FSDP2's dims) raises ValueError naming it, on every rank, before any communication.
    group (default: the world), or mesh /
    ulysses_group + ring_group (every rank of the grid); or mesh= with sequence_dims= and
    data_dims=: the sum over exactly the dims named, never the mesh's others. Name the
    data dims where no DDP or FSDP sums over them: under a wrapper over the data dims,
    name the sequence dims alone; under FSDP over data x sequence, do not call this.
    (Wrappers average: scale the loss by their ranks for the backward, as
    SequenceParallelism.data_parallel_mesh says.) A pipeline stage's parameters
    (hold_per_stage) raise the same way for a reduction spanning other stages (the
    default, the world, included). One all_reduce per dim per bucket of
    gradients of one dtype and device (up to 64 MiB, flattened into one copy at a time)."""
    groups = [
        each for each, info in reduction_groups(
            "all_reduce_gradients", group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
            sequence_dims=sequence_dims, data_dims=data_dims,
        ) if info.world_size > 1
    ]  # fmt: skip
    named = parameters.named_parameters() if isinstance(parameters, torch.nn.Module) else \
        ((f"parameter {index}", parameter) for index, parameter in enumerate(parameters))  # fmt: skip
    named = [(name, parameter) for name, parameter in named if parameter.requires_grad]
    if not groups:
        return
    arguments = f"sequence_dims={sequence_dims!r}, data_dims={data_dims!r}"
    check_within_stages("all_reduce_gradients", named, groups, arguments)
    _check_same_shards(named, groups, arguments)
    parameters = [parameter for _, parameter in named]
    # Buckets of one dtype and device, each at most _BUCKET_BYTES (or one parameter): one
    # collective per bucket, and at most one bucket's copy of the gradients at a time.
    by_kind: dict[tuple, list[list[torch.nn.Parameter]]] = {}
    for parameter in parameters:
        buckets = by_kind.setdefault((parameter.dtype, parameter.device), [[]])
        size = sum(_local(p).numel() * p.element_size() for p in buckets[-1])
        if buckets[-1] and size + _local(parameter).numel() * parameter.element_size() > _BUCKET_BYTES:
            buckets.append([])
        buckets[-1].append(parameter)
    with torch.no_grad():
        for bucket in (bucket for buckets in by_kind.values() for bucket in buckets):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            shards = [_local(grad) for grad in grads]
            flat = torch.cat([shard.reshape(-1) for shard in shards])
            for reduce_group in groups:
                dist.all_reduce(flat, group=reduce_group)
            for parameter, grad, shard, piece in zip(bucket, grads, shards, flat.split([t.numel() for t in shards])):
                shard.copy_(piece.view_as(shard))
                if parameter.grad is None:
                    parameter.grad = grad
            del flat, grads, shards  # before the next bucket's copy


# Parameter -> (mesh, pipeline dim name): the parameters of this rank's pipeline stage,
# which the other ranks along that dim do not hold (other layers).
_STAGES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def hold_per_stage(parameters: Iterable[torch.nn.Parameter], mesh, pipeline_dim: str) -> None:
    """Records that `parameters` are this rank's pipeline stage's alone: the ranks along
    mesh dim `pipeline_dim` hold other layers, so all_reduce_gradients and the loss
    functions raise (check_within_stages) rather than sum across that dim."""
    for parameter in parameters:
        _STAGES[parameter] = (mesh, pipeline_dim)


def _ranks_of(group) -> set[int]:
    return set(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


def check_within_stages(describe: str, named, groups, arguments: str) -> None:
    """ValueError, on every rank before any communication, when a reduction over
    `groups` (process groups, None: the world) would span ranks of different pipeline stages
    for one of the (name, parameter) pairs that hold_per_stage recorded: it would sum
    other layers' gradients (or hang: the stages hold different parameters). Local:
    every rank's stage is recorded alike."""
    if not _STAGES or not groups:  # no pipeline in this process, or nothing reduced
        return
    reduced = [_ranks_of(group) for group in groups]
    for name, parameter in named:
        stage = _STAGES.get(parameter)
        if stage is None:
            continue
        mesh, dim = stage
        stages = _ranks_of(mesh.get_group(dim))
        if any(len(stages & ranks) > 1 for ranks in reduced):
            raise ValueError(
                f"{describe}: {name} {tuple(parameter.shape)} is held by one pipeline stage of mesh dim {dim!r} "
                f"({mesh.size(mesh.mesh_dim_names.index(dim))} stages, mesh {tuple(mesh.shape)} with dims "
                f"{mesh.mesh_dim_names}), and the reduction over {arguments} spans ranks of other stages: it would sum "
                "other layers' gradients. Name only the sequence and data dims, never the pipeline dim"
            )
        return  # one stage per rank: its first recorded parameter answers for all


def _check_same_shards(named, groups, arguments: str) -> None:
    """ValueError unless every rank of each reduction group holds the same shard of every
    DTensor parameter: a mesh dim the parameter is sharded over (a Shard placement,
    FSDP2's strided one too) may share no rank but this one with a group. Local: the
    groups and the meshes are the same shape on every rank, so every rank raises alike."""
    reduced = [_ranks_of(group) for group in groups]
    spans: dict[tuple[int, int], bool] = {}
    for name, parameter in named:
        if not isinstance(parameter, DTensor):
            continue
        mesh = parameter.device_mesh
        for index, placement in enumerate(parameter.placements):
            if not placement.is_shard():
                continue
            key = (id(mesh), index)
            if key not in spans:
                holders = set(dist.get_process_group_ranks(mesh.get_group(index)))
                spans[key] = any(len(holders & ranks) > 1 for ranks in reduced)
            if spans[key]:
                dim = mesh.mesh_dim_names[index] if mesh.mesh_dim_names else index
                raise ValueError(
                    f"all_reduce_gradients: {name} {tuple(parameter.shape)} is sharded ({placement}) over mesh dim "
                    f"{dim!r} of {mesh.size(index)} ranks, and the reduction over {arguments} spans ranks of it: "
                    "it would sum different shards. Name only the dims whose ranks hold the same shard (never a "
                    "tensor dim, nor the dims FSDP2 shards over)"
                )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's elements of tensor: a DTensor's local shard (the same storage), else
    the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
