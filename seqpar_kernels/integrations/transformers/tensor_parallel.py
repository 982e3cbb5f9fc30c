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
rank.

PEFT's LoRA on a layer of the plan (q_proj = lora.Linear(base_layer, lora_A, lora_B)):
its base layer is sharded as the plan says, and the adapter so that its output adds to
the base's shard: column-wise, lora_B column-wise (lora_A whole: its gradient, from
the all-reduced gradient of its output, is the same on every tensor rank); row-wise,
lora_A row-wise (its r-wide output summed over the tensor ranks) and lora_B whole.

What tensor parallelism cannot honour raises ValueError before any parameter is
sharded, alike on every rank (it reads the config and the modules, the same
everywhere): heads or key/value heads that T does not divide (a rank would hold part of
a head), a plan style other than column-wise and row-wise, a model already sharded, a
module of the plan that is neither a Linear nor a plain LoRA Linear of one (DoRA and
other variants, other adapters), LoRA dropout before a column-wise layer (each tensor
rank would draw its own mask over the same input, whose adapter output they share).
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch
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
    targets = {}
    for name, module in base.named_modules():
        styles = {style for path, style in plan.items() if _matches(name, path)}
        if len(styles) > 1:
            raise ValueError(f"{describe}: {type(model).__name__}'s tensor-parallel plan gives {name} the styles "
                             f"{sorted(styles)}")  # fmt: skip
        if styles:
            targets[name] = (module, styles.pop())
    if not targets:  # parallelize_module would only warn, leaving every layer whole
        raise ValueError(f"{describe}: no module of {type(base).__name__} matches its tensor-parallel plan's paths "
                         f"{sorted(plan)}")  # fmt: skip
    sharded_as = {}  # module name: style, LoRA wrappers' base layers and adapter halves spelled out
    for name, (module, style) in targets.items():
        sharded_as.update(_module_plan(describe, name, module, style))
    parallelize_module(base, parallelism.tensor_mesh(), {name: STYLES[style]() for name, style in sharded_as.items()})


def _matches(name: str, path: str) -> bool:
    """Whether a module's dotted name matches a plan path dot by dot (a wildcard stays
    within its part), as parallelize_module reads the plan."""
    parts, patterns = name.split("."), path.split(".")
    return len(parts) == len(patterns) and all(fnmatch(part, pattern) for part, pattern in zip(parts, patterns))


def _module_plan(describe: str, name: str, module: torch.nn.Module, style: str) -> dict[str, str]:
    """The styles that shard one module of the plan (by its name under base_model): the
    module itself where it is a Linear; for PEFT's LoRA Linear, its base layer and the
    adapter's matching half (module docstring); ValueError for anything else."""
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        return {name: style}
    base_layer = getattr(module, "base_layer", None)
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if not (isinstance(base_layer, torch.nn.Linear) and isinstance(lora_a, torch.nn.ModuleDict)
            and isinstance(lora_b, torch.nn.ModuleDict)):  # fmt: skip
        raise ValueError(
            f"{describe}: tensor parallelism shards {name} {style}-wise, which takes a Linear (or PEFT's LoRA Linear "
            f"around one); it is a {type(module).__name__}"
        )
    magnitudes = getattr(module, "lora_magnitude_vector", None) or {}  # DoRA's, in PEFT releases before lora_variant
    variants = sorted(set(getattr(module, "lora_variant", None) or {}) | set(magnitudes))
    if variants or getattr(module, "merged_adapters", None):
        raise ValueError(
            f"{describe}: tensor parallelism runs plain LoRA on {name}; its adapters {variants or 'merged'} are "
            "a LoRA variant (DoRA, ...) or merged into the weight, whose full-weight terms a tensor rank cannot form"
        )
    if style == "colwise":
        dropping = sorted(adapter for adapter, dropout in module.lora_dropout.items()
                          if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0)  # fmt: skip
        if dropping:
            raise ValueError(
                f"{describe}: tensor parallelism shards {name} column-wise, and its LoRA adapters {dropping} drop out "
                "its input: each tensor rank would draw its own mask over the input they share; use "
                "lora_dropout=0 (or no tensor parallelism)"
            )
    halves = {"colwise": ("lora_B", lora_b), "rowwise": ("lora_A", lora_a)}
    attribute, adapters = halves[style]
    return {f"{name}.base_layer": style, **{f"{name}.{attribute}.{adapter}": style for adapter in adapters}}
