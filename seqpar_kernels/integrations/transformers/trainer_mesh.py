"""The Trainer's one DeviceMesh: the degrees its arguments ask for, the mesh of them, and
FSDP2 over its data x sequence dims.

    degrees = trainer_degrees("SequenceParallelTrainer", args, world_size, sequence_parallel_size,
                              tensor_parallel_size)
    parallelism = make_parallelism(mode, layout, degrees, ulysses_degree, device, kv_heads)
    shard_model(model, parallelism, degrees)        # fully_shard, where degrees.fsdp

The arguments: sequence_parallel_size (and USP's ulysses_degree), tensor_parallel_size,
TrainingArguments' fsdp / fsdp_config (FSDP2), or accelerate's ParallelismConfig as
TrainingArguments(parallelism_config=...), whose fields map so:
    cp_size                        the sequence's ranks (sequence_parallel_size)
    tp_size                        the ranks each decoder layer is sharded over
                                   (tensor_parallel_size)
    dp_shard_size                  data replicas whose parameters FSDP2 shards
    dp_replicate_size              data replicas that hold whole copies (DDP; with
                                   dp_shard_size > 1: HSDP)
    sp_size, pp_size               refused (ValueError naming them)

The mesh, data dims outermost, then the sequence dims, then the tensor dim (where
T > 1), innermost as torchtitan orders them: a replica's T x P ranks are consecutive
ranks, a tensor group's T ranks adjacent (the busiest traffic on the closest links):
rank = (replica x P + piece) x T + tensor index, replica = dp_replicate index x
dp_shard + dp_shard index. A node holding a replica (T x P GPUs or fewer) keeps the
tensor's and the sequence's traffic in it. FSDP2 over data x sequence on the
tensor-parallel parameters needs "tp" after the dims it flattens (torch's 2-D mesh of
the two takes mesh dims in ascending order):
    ("dp_replicate", "dp_shard", "sequence"[, "tp"])          mode "ulysses" or "ring"
    ("dp_replicate", "dp_shard", "ring", "ulysses"[, "tp"])   mode "usp"
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.distributed as dist

from seqpar_kernels.parallel.parallelism import SequenceParallelism

DATA_DIMS = ("dp_replicate", "dp_shard")
TENSOR_DIM = "tp"
# ParallelismConfig's fields the Trainer cannot honour, with what to do instead.
REFUSED_FIELDS = {
    "sp_size": "DeepSpeed's sequence parallelism (cp_size names the sequence's ranks here)",
    "pp_size": "pipeline parallelism",
}


def positive_int_or_none(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


@dataclass(frozen=True)
class TrainerDegrees:
    """The Trainer's parallelism, validated once: dp_replicate x dp_shard x tensor x
    sequence = the world size. fsdp: FSDP2 (fully_shard) over dp_shard x sequence,
    replicated over dp_replicate (HSDP where dp_replicate > 1); without it the
    Trainer's DDP (or FSDP1) over the world holds whole copies, or, with tensor > 1,
    the mixin averages the gradients over data x sequence itself. fsdp_options:
    fsdp_config's reshard_after_forward and transformer_layer_cls_to_wrap. tensor: the
    ranks each decoder layer is sharded over (tensor_parallel.shard_layers)."""

    dp_replicate: int
    dp_shard: int
    sequence: int
    fsdp: bool = False
    fsdp_options: tuple = ()
    tensor: int = 1

    @property
    def replicas(self) -> int:
        """How many data replicas read different batches."""
        return self.dp_replicate * self.dp_shard


def _fsdp_version(args) -> int | None:
    """The FSDP version TrainingArguments asks for (None: no FSDP). transformers 4.x
    sets accelerate's FSDP through environment variables: left to accelerate (None)."""
    plugin = getattr(args, "fsdp_plugin_args", None)
    if not getattr(args, "fsdp", None) or plugin is None:
        return None
    return int(plugin.get("fsdp_version", 2))


def _fsdp_options(describe: str, args) -> tuple:
    """fsdp_config's options that the Trainer's own fully_shard honours; ValueError
    naming those it does not."""
    config = dict(getattr(args, "fsdp_config", None) or {})
    refused = [key for key, default in (("cpu_offload", False), ("activation_checkpointing", False),
                                        ("cpu_ram_efficient_loading", False))
               if str(config.get(key, default)).lower() not in ("false", "0")]  # fmt: skip
    if config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
        refused.append(f"auto_wrap_policy={config['auto_wrap_policy']!r}")
    if refused:
        raise ValueError(
            f"{describe}: FSDP2 over the mesh does not take fsdp_config {refused} (gradient_checkpointing=True "
            "checkpoints the layers; the layers are wrapped by their classes)"
        )
    reshard = str(config.get("reshard_after_forward", True)).lower() not in ("false", "0")
    classes = tuple(config.get("transformer_layer_cls_to_wrap") or ())
    return (("reshard_after_forward", reshard), ("transformer_layer_cls_to_wrap", classes))


def trainer_degrees(describe: str, args, world_size: int, sequence_parallel_size: int | None,
                    tensor_parallel_size: int | None = None) -> TrainerDegrees:  # fmt: skip
    """The degrees of the Trainer's arguments (TrainingArguments' fsdp and
    parallelism_config, sequence_parallel_size, tensor_parallel_size) on a world of
    world_size ranks: ValueError naming the numbers where they do not multiply to the
    world size, name the sequence's or the tensor's ranks twice apart, or ask for what
    the Trainer does not do. Local: every rank passes the same arguments and raises alike."""
    positive_int_or_none("sequence_parallel_size", sequence_parallel_size)
    positive_int_or_none("tensor_parallel_size", tensor_parallel_size)
    version = _fsdp_version(args)
    config = getattr(args, "parallelism_config", None)
    fsdp = version == 2
    if version is not None and world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{describe}: fsdp needs torch.distributed (torchrun); this process runs alone")
    if config is None:
        tensor = tensor_parallel_size or 1
        if world_size % tensor != 0:
            raise ValueError(f"{describe}: tensor_parallel_size={tensor} must divide the world size {world_size}")
        size = world_size // tensor if sequence_parallel_size is None else sequence_parallel_size
        if world_size % (size * tensor) != 0:
            raise ValueError(
                f"{describe}: sequence_parallel_size={size} x tensor_parallel_size={tensor} must divide the world "
                f"size {world_size} (the other factor is the number of data-parallel replicas)"
            )
        data = world_size // (size * tensor)
        replicate, shard = (1, data) if fsdp else (data, 1)
        return TrainerDegrees(replicate, shard, size, fsdp, _fsdp_options(describe, args) if fsdp else (), tensor)
    sizes = {name: getattr(config, name, None) or 1
             for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")}  # fmt: skip
    refused = [f"{name}={getattr(config, name)}" for name in REFUSED_FIELDS if (getattr(config, name, None) or 1) > 1]
    if refused:
        raise ValueError(
            f"{describe}: ParallelismConfig {', '.join(refused)} asks for "
            f"{', '.join(REFUSED_FIELDS[item.split('=')[0]] for item in refused)}, which the Trainer does not do"
        )
    if version == 1:
        raise ValueError(f"{describe}: ParallelismConfig shards with FSDP2; fsdp_config asks for FSDP version 1")
    if sequence_parallel_size is not None and sequence_parallel_size != sizes["cp_size"]:
        raise ValueError(
            f"{describe}: sequence_parallel_size={sequence_parallel_size} and ParallelismConfig "
            f"cp_size={sizes['cp_size']} both name the sequence's ranks and differ"
        )
    if tensor_parallel_size is not None and tensor_parallel_size != sizes["tp_size"]:
        raise ValueError(
            f"{describe}: tensor_parallel_size={tensor_parallel_size} and ParallelismConfig "
            f"tp_size={sizes['tp_size']} both name the tensor's ranks and differ"
        )
    total = prod(sizes.values())
    if total != world_size:
        raise ValueError(
            f"{describe}: ParallelismConfig "
            f"{' x '.join(f'{name}={size}' for name, size in sizes.items() if name != 'tp_size' or size > 1)} = "
            f"{total} ranks, the world has {world_size}"
        )
    fsdp = fsdp or sizes["dp_shard_size"] > 1
    return TrainerDegrees(sizes["dp_replicate_size"], sizes["dp_shard_size"], sizes["cp_size"], fsdp,
                          _fsdp_options(describe, args) if fsdp else (), sizes["tp_size"])  # fmt: skip


def default_ulysses_degree(size: int, kv_heads: int | None) -> int:
    """USP's default Ulysses degree: the largest divisor of size that divides the
    model's key/value heads (Ulysses then sends no repeated K/V), the ring the rest."""
    return max(degree for degree in range(1, size + 1) if size % degree == 0 and (kv_heads or 1) % degree == 0)


# The meshes the Trainers of this process built: {(device type, shape, names): mesh}, for
# the world they were built in (its default group).
_meshes: dict = {"world": None}


def trainer_device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """init_device_mesh(device_type, shape, mesh_dim_names=names), made once per process
    and world: a second Trainer of the same degrees (a sweep, an evaluation run) reuses it,
    as each gloo group of a new mesh would keep threads that cost CPU while idle
    (docs/tuning.md). Collective the first time: every rank calls it alike."""
    from torch.distributed.device_mesh import init_device_mesh

    if _meshes["world"] is not dist.group.WORLD:  # a new world (init_process_group again)
        _meshes.clear()
        _meshes["world"] = dist.group.WORLD
    key = (device_type, tuple(shape), tuple(names))
    if key not in _meshes:
        _meshes[key] = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    return _meshes[key]


def make_parallelism(mode: str, layout: str, degrees: TrainerDegrees, ulysses_degree: int | None,
                     device: torch.device, kv_heads: int | None = None,
                     step_backend: str = "auto") -> SequenceParallelism:  # fmt: skip
    """The parallelism on the mesh of `degrees` (the module's docstring), its data dims
    named (data_rank: which batch a rank reads); collective: every rank calls it alike,
    as it creates process groups. Without torch.distributed: one process, a group of
    one ("usp" runs as "ring" there: the same result on a group of one). kv_heads: the
    model's, of which each tensor rank's attention sees a T-th (USP's default degree)."""
    if not (dist.is_available() and dist.is_initialized()):
        if degrees.sequence != 1:
            raise ValueError(
                f"sequence_parallel_size={degrees.sequence} needs that many processes (torchrun); this process runs "
                "alone"
            )
        alone = "ring" if mode == "usp" else mode
        return SequenceParallelism.resolve("the Trainer", alone, layout, step_backend=step_backend)
    tensor = (TENSOR_DIM,) if degrees.tensor > 1 else ()
    data, inner = (degrees.dp_replicate, degrees.dp_shard), [degrees.tensor] * len(tensor)
    if mode == "usp":
        size = degrees.sequence
        local_kv_heads = kv_heads // degrees.tensor if kv_heads else None  # T not dividing them raises in apply
        degree = default_ulysses_degree(size, local_kv_heads) if ulysses_degree is None else ulysses_degree
        if size % degree != 0:
            raise ValueError(f"ulysses_degree={degree} must divide sequence_parallel_size={size}")
        mesh = trainer_device_mesh(device.type, (*data, size // degree, degree, *inner),
                                   (*DATA_DIMS, "ring", "ulysses", *tensor))  # fmt: skip
        sequence_dims = ("ulysses", "ring")
    else:
        mesh = trainer_device_mesh(device.type, (*data, degrees.sequence, *inner), (*DATA_DIMS, "sequence", *tensor))
        sequence_dims = "sequence"
    return SequenceParallelism.resolve("the Trainer", mode, layout, step_backend=step_backend, mesh=mesh,
                                       sequence_dims=sequence_dims, data_dims=DATA_DIMS,
                                       tensor_dims=tensor)  # fmt: skip


def shard_model(describe: str, model, parallelism: SequenceParallelism, degrees: TrainerDegrees) -> None:
    """FSDP2 on `model` (a transformers model, or PEFT's wrapper of one) over data x
    sequence (sequence ranks hold the same parameters, so FSDP2 shards across them too),
    replicated over dp_replicate (HSDP): fully_shard on each layer of the classes
    fsdp_config names (default: the model's _no_split_modules, as accelerate wraps),
    then on the model. The wrapper averages the gradients over the mesh's ranks: the
    world, or with tensor parallelism the world over T (the layers' tensor-parallel
    DTensors become 2-D, sharded over data x sequence and over "tp")."""
    from torch.distributed.fsdp import fully_shard

    options = dict(degrees.fsdp_options)
    mesh = parallelism.data_parallel_mesh(replicate_dims=DATA_DIMS[:1] if degrees.dp_replicate > 1 else ())
    classes = set(options.get("transformer_layer_cls_to_wrap") or ())
    if not classes:
        inner = getattr(model, "get_base_model", lambda: model)()
        classes = set(getattr(inner, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in classes]
    if not layers:
        raise ValueError(
            f"{describe}: FSDP2 found no layer of the classes {sorted(classes)} in {type(model).__name__}; name them "
            "in fsdp_config['transformer_layer_cls_to_wrap']"
        )
    reshard = options.get("reshard_after_forward", True)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
