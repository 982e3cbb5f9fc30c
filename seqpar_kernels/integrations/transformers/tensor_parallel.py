"""Tensor parallelism of a transformers model beside sequence parallelism, on one mesh:
the model's own plan (its config's base_model_tp_plan) applied with torch's
parallelize_module over the mesh's tensor dims (apply(..., tensor_dims=...) runs it).

    shard_layers(describe, model, parallelism)   checks the heads, then shards the layers

q, k and v column-wise: tensor rank t of T holds attention heads [t H / T, (t + 1) H / T)
and the key/value heads they read, and the sequence-parallel attention reads its head
counts from the tensors it is given (Ulysses splits those T-th shares further, unevenly
where they do not divide; the ring runs on them as they are); o_proj row-wise (its
output summed over the tensor ranks); the MLP column-wise then row-wise. Activations
between layers stay plain tensors, whole over the tensor dims. The embeddings and the
LM head stay whole on every rank (replicated over the tensor dims): the loss's sum and
count need no reduction over them, and their gradients are the same on every tensor
rank. What tensor parallelism cannot honour raises ValueError before any parameter is
sharded, alike on every rank (it reads the config, the same everywhere): heads or
key/value heads that T does not divide (a rank would hold part of a head), a plan style
other than column-wise and row-wise, a model already sharded.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from seqpar_kernels.parallel.parallelism import SequenceParallelism

# transformers' plan styles that torch's parallel styles do exactly.
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def check_heads(describe: str, config, tensor_size: int) -> None:
    """ValueError unless tensor_size divides the model's attention heads and its
    key/value heads (each tensor rank then holds whole heads, and the kv heads its q
    heads read: GQA's grouping is the same on every rank)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or heads % tensor_size or kv_heads % tensor_size:
        raise ValueError(
            f"{describe}: tensor parallelism over {tensor_size} ranks splits the attention by heads, so "
            f"{tensor_size} must divide the attention heads and the key/value heads: the model has {heads} and "
            f"{kv_heads} (sequence parallelism then splits each rank's share further, any count)"
        )


def shard_layers(describe: str, model, parallelism: SequenceParallelism) -> None:
    """Shard `model`'s decoder layers over parallelism.tensor_mesh() with the plan its
    config names (base_model_tp_plan, relative to model.base_model), in place; checks
    first (module docstring)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    check_heads(describe, config, parallelism.tensor_size)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(f"{describe}: {type(model).__name__}'s config names no tensor-parallel plan "
                         "(base_model_tp_plan), so tensor_dims= cannot shard it")  # fmt: skip
    other = {path: style for path, style in plan.items() if style not in STYLES}
    if other:
        raise ValueError(
            f"{describe}: {type(model).__name__}'s tensor-parallel plan has styles {other} that tensor_dims= does "
            f"not run (it runs {sorted(STYLES)}: whole heads column-wise, their outputs row-wise)"
        )
    sharded = [name for name, parameter in model.named_parameters() if isinstance(parameter, DTensor)]
    if sharded:
        raise ValueError(f"{describe}: tensor_dims= shards the model itself; {sharded[:3]} are DTensors already "
                         "(apply() comes before fully_shard and instead of parallelize_module)")  # fmt: skip
    base = model.base_model
    targets = [name for name, _ in base.named_modules() if any(fnmatch(name, path) for path in plan)]
    if not targets:  # parallelize_module would only warn, leaving every layer whole
        raise ValueError(f"{describe}: no module of {type(base).__name__} matches its tensor-parallel plan's paths "
                         f"{sorted(plan)}")  # fmt: skip
    parallelize_module(base, parallelism.tensor_mesh(), {path: STYLES[style]() for path, style in plan.items()})
