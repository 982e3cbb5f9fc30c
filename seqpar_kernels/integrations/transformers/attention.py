"""The attention of seqpar_kernels.integrations.transformers: the attention functions
transformers calls, their mask functions, register() and apply().

register() adds three attention implementations through transformers' public
AttentionInterface, and a mask function for each through AttentionMaskInterface:
    "seqpar_ulysses"   ulysses_attention
    "seqpar_ring"      ring_attention
    "seqpar_usp"       usp_attention
apply() switches a loaded model to one of them (model.set_attn_implementation) and records
on its modules the mode, layout and process groups the attention uses.

Masks: the mask function registered beside them (masks.py) returns a LayerMask (the
package's AttentionMask) read off transformers' own mask functions; each layer gets the
one of its type.

What the attention functions take from transformers: query (B, H, S_local, D) and
key/value (B, H_kv, S_local, D), views of (B, S_local, H, D) projections, handed to ours
as (B, S_local, H, D) views without a copy; the scaling; the LayerMask; softcap (Gemma
2's attn_logit_softcapping); s_aux, the per-head sink logits (gpt-oss), passed to ours as
sinks so that their gradient reaches the model's parameter; the SequenceShard that
shard_batch put in the batch (the layout, every rank's length, a packed batch's varlen
plan), which the model passes down; without one, the position ids, which must then be
every rank's global positions in the layout (checked once per forward, with one small
all-gather). Everything else that changes the result raises instead of being ignored: a
padding mask or a tensor mask, dropout while training, a sliding_window argument its
mask does not carry, sinks on a module that does not pass them, a KV cache holding more
keys than queries (generation). Padding belongs in shift_labels (shard_batch folds right
padding there), packing in the varlen plan.

Llama 4's temperature tuning (its no-RoPE layers scale the queries by a function of each
token's row in the sequence, computed by the model from 0 on every rank) is put right
here: the queries are rescaled from the local rows the model used to the global ones.

Supported releases: transformers 4.56 and newer (the models that dispatch attention
through AttentionInterface and build masks through masking_utils).
"""

from __future__ import annotations

import weakref

import torch

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "seqpar_kernels.integrations.transformers needs Hugging Face transformers 4.56 or newer: "
        'pip install "seqpar-kernels[transformers]"'
    ) from error

from seqpar_kernels.integrations.transformers import inkling
from seqpar_kernels.integrations.transformers.adapters import transformers_model
from seqpar_kernels.integrations.transformers.generation import install as install_generation
from seqpar_kernels.integrations.transformers.generation import running_step
from seqpar_kernels.integrations.transformers.indexed import INDEXED_LAYER_TYPES, IndexedMask, global_rows
from seqpar_kernels.integrations.transformers.indexed import check as check_indexed
from seqpar_kernels.integrations.transformers.indexed import install as install_indexed
from seqpar_kernels.integrations.transformers.masks import CHUNKS_FROM_DOCUMENT_START, LayerMask, layer_mask
from seqpar_kernels.integrations.transformers.mixers import HANDLED_FUNCTIONS, install, mixers_of
from seqpar_kernels.integrations.transformers.router import router_loss_of
from seqpar_kernels.integrations.transformers.tensor_parallel import shard_layers
from seqpar_kernels.integrations.transformers.vision import install as install_vision
from seqpar_kernels.integrations.transformers.vision import vision_language_base
from seqpar_kernels.parallel.inference import decode_attention, prefill_attention
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.sparse import sparse_attention
from seqpar_kernels.parallel.training import SequenceShard

__all__ = ["register", "apply", "IMPLEMENTATIONS", "LayerMask"]

IMPLEMENTATIONS = {"ulysses": "seqpar_ulysses", "ring": "seqpar_ring", "usp": "seqpar_usp"}
# The attribute apply() sets on every module of the model: the attention function gets
# the attention module, and reads its groups there.
SETTINGS_ATTRIBUTE = "seqpar_parallelism"
# The per-layer types (config.layer_types) whose layers mix the sequence only through the
# attention function and the mask interface.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
# Layer types that mix nothing along the sequence (Nemotron-H's MLP and MoE layers).
UNMIXED_LAYER_TYPES = ("mlp", "moe")


def _settings_of(module: torch.nn.Module, mode: str) -> SequenceParallelism:
    settings = getattr(module, SETTINGS_ATTRIBUTE, None)
    if settings is None:
        raise ValueError(
            f"attention implementation {IMPLEMENTATIONS[mode]!r} on {type(module).__name__}, whose model was not "
            "set up by seqpar_kernels.integrations.transformers.apply(model, ...): call apply() instead of "
            "setting attn_implementation by hand, so that the attention knows its process groups"
        )
    if settings.mode != mode:
        raise ValueError(
            f"{type(module).__name__} runs {IMPLEMENTATIONS[mode]!r} but apply() set it up for mode={settings.mode!r}"
        )
    return settings


# The position ids tensor checked last: the model passes the same one to every layer,
# so the check runs once per forward (on every rank alike: they run the same model).
_checked_positions: weakref.ref | None = None


def _check_global_positions(position_ids, local_len: int, settings: SequenceParallelism, describe: str) -> None:
    """Without a SequenceShard, the position ids must be this rank's global positions
    in the layout (rotary embeddings read them): a model given only this rank's tokens
    counts them from 0 on every rank, and packed documents restart them. One small
    all-gather of the ranks' lengths per forward finds the expected ones."""
    global _checked_positions
    if position_ids is None or (_checked_positions is not None and _checked_positions() is position_ids):
        return
    lengths = settings.gather_ints([local_len], position_ids.device)
    expected = settings.take(torch.arange(sum(lengths), device=position_ids.device)[None], dim=1)
    matches = position_ids.shape[-1] == expected.shape[-1] and bool((position_ids == expected).all())
    # Every rank raises if one does: a rank that went on would wait in the attention's collectives.
    if not all(settings.gather_ints([matches], position_ids.device)):
        raise ValueError(
            f"{describe}: position_ids {tuple(position_ids.shape)} are not every rank's global positions in the "
            f"{settings.layout} layout (positions counted from 0 on every rank, packed documents, or another "
            "layout): pass the model the batch made by shard_batch, whose 'sequence_shard' entry carries the "
            "layout and the documents"
        )
    _checked_positions = weakref.ref(position_ids)


def _layer_mask(describe, module, attention_mask, kwargs) -> LayerMask:
    """The keys each query of this layer attends: the LayerMask our mask function made
    for the layer's type, or, where the model built none (attention_mask None), causal
    or bidirectional as is_causal says."""
    explicit = kwargs.get("is_causal")
    if isinstance(attention_mask, LayerMask):
        mask = attention_mask
        if explicit is not None and bool(explicit) != mask.causal:
            raise ValueError(
                f"{describe}: is_causal={explicit} but the model's mask for this layer is "
                f"{'causal' if mask.causal else 'bidirectional'}"
            )
    elif attention_mask is None:
        mask = LayerMask(causal=bool(getattr(module, "is_causal", True) if explicit is None else explicit))
    else:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"{describe}: got an attention mask {shape}; sequence-parallel attention takes the pattern of the "
            "mask transformers builds through masking_utils, not a mask tensor (padding goes into shift_labels, "
            "packed documents into the varlen plan: shard_batch does both)"
        )
    sliding_window = kwargs.get("sliding_window")
    if sliding_window is not None:
        # What the model tells flash-attention (a window of sliding_window keys) must be
        # what its mask says, or the two paths of the model itself disagree.
        if mask.window == (-1, -1) or (mask.causal and mask.window[0] != sliding_window - 1):
            raise ValueError(
                f"{describe}: the layer passes sliding_window={sliding_window} but its mask is {mask}: a sliding "
                "window is honoured through the mask transformers builds for the layer (masking_utils)"
            )
    return mask


def _check_call(describe, module, query, key, dropout, kwargs) -> None:
    """Raise for what the sequence-parallel attention cannot honour."""
    if dropout and module.training:
        raise ValueError(f"{describe}: attention dropout {dropout} while training is not supported")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{describe}: position_bias is not supported by sequence-parallel attention")
    if kwargs.get("s_aux") is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        raise ValueError(f"{describe}: the module has attention sinks but does not pass them to the attention (s_aux)")
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{describe}: got {name}: the documents of a packed batch reach the attention through "
                "shard_batch's varlen plan, not a collator's bounds of the full batch"
            )
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{describe}: query {tuple(query.shape)} and key {tuple(key.shape)} differ in length (a KV cache?): "
            "sequence-parallel attention is for training and prefill over the sharded sequence; pass use_cache=False"
        )


def _rescale_temperature(module, query: torch.Tensor, global_rows: torch.Tensor) -> torch.Tensor:
    """Llama 4's no-RoPE layers scale the queries by log1p(floor((row + 1) / floor_scale))
    x attn_scale + 1, row the token's row counted from 0 in what the model was given:
    this rank's tokens here. query (B, H, S_local, D) is rescaled from those rows to
    the global ones (exact where the local scale is 1: rows below floor_scale - 1)."""

    def scales(rows: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((rows.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    local_rows = torch.arange(query.shape[2], device=query.device)
    ratio = scales(global_rows.to(query.device)) / scales(local_rows)
    return (query * ratio.view(1, 1, -1, 1)).to(query.dtype)


def _scales_queries_by_row(module) -> bool:
    """Whether the module is a Llama 4 no-RoPE layer with temperature tuning."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the autocast dtype under autocast (rotary embeddings leave q and k
    in fp32 beside a bf16 v), as eager and sdpa attention compute them; else as given."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(tensor.to(dtype) for tensor in tensors)


def _attention(mode: str, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention function of one mode, as transformers calls it.

    query: (batch, nheads, seqlen_local, headdim); key, value: (batch, nheads_kv,
    seqlen_local, headdim). Returns ((batch, seqlen_local, nheads, headdim), None)."""
    describe = f"{IMPLEMENTATIONS[mode]} attention in {type(module).__name__}"
    if kwargs.get("output_attentions"):
        # The model would record this function's None weights as no attentions at all.
        raise ValueError(f"{describe}: output_attentions=True: sequence-parallel attention never forms the attention "
                         "weights (its softmax runs block by block); run without it, or in one process")  # fmt: skip
    settings = _settings_of(module, mode)
    if isinstance(attention_mask, IndexedMask):  # a DSA layer: the keys its indexer chose (indexed.py)
        _check_call(describe, module, query, key, dropout, kwargs)
        if kwargs.get("indices") is None:
            raise ValueError(f"{describe}: the layer passed no top-k indices (indices=)")
        q, k, v = (x.transpose(1, 2) for x in _autocast(query, key, value))
        placement = attention_mask.placement
        return sparse_attention(q, k, v, kwargs["indices"], softmax_scale=scaling, placement=placement), None
    mask = _layer_mask(describe, module, attention_mask, kwargs)
    if getattr(module, inkling.ROLE_ATTRIBUTE, None) is not None:  # Inkling 2's bias, sinks and residuals
        return inkling.attention(describe, module, query, key, value, mask, scaling, dropout, kwargs, settings), None
    cache = running_step()
    if cache is not None and _scales_queries_by_row(module) and (cache.real_lengths.shape[0] > 1
                                                                  or cache.step.kind == "chunk"):  # fmt: skip
        # The model scales a query by its column of the padded batch, which the packed prompt does not keep.
        raise ValueError(f"{describe}: generate over a sharded cache rescales queries by row (Llama 4's temperature "
                         "tuning) for one prompt at a time, without a next turn over the cache")  # fmt: skip
    if cache is not None and cache.step.kind in ("decode", "chunk"):
        return _decode(describe, module, query, key, value, mask, scaling, dropout, kwargs, settings, cache), None
    _check_call(describe, module, query, key, dropout, kwargs)
    shard: SequenceShard | None = kwargs.get("sequence_shard")
    position_ids = kwargs.get("position_ids")
    if shard is None:
        _check_global_positions(position_ids, query.shape[2], settings, describe)
        seq_lens, varlen = None, None
    else:
        if not isinstance(shard, SequenceShard) or shard.parallelism != settings:
            made = shard.parallelism if isinstance(shard, SequenceShard) else type(shard).__name__
            raise ValueError(
                f"{describe}: the batch was sharded for {made}, the model's attention runs {settings}: pass "
                "shard_batch the mode, layout and groups given to apply()"
            )
        if shard.padded and not mask.causal:
            raise ValueError(
                f"{describe}: the batch was right-padded, which only a causal layer can ignore; this layer is "
                "bidirectional: pack the sequences instead of padding them"
            )
        seq_lens, varlen = list(shard.seq_lens), shard.varlen
    if mask.chunk_size is not None and varlen is not None and not CHUNKS_FROM_DOCUMENT_START:
        raise ValueError(
            f"{describe}: chunked attention over packed documents: this transformers release counts the chunks "
            "from the start of the packed row, sequence-parallel attention from each document's start (as newer "
            "releases do)"
        )
    if _scales_queries_by_row(module):
        if shard is None and position_ids is None:
            raise ValueError(
                f"{describe}: the layer scales its queries by row; pass position_ids or shard_batch's batch"
            )
        query = _rescale_temperature(module, query, global_rows(shard, position_ids, query.device))
    # (B, H, S, D) -> (B, S, H, D): views; transformers' projections are (B, S, H, D) in
    # memory, so these are usually contiguous already.
    q, k, v = (x.transpose(1, 2) for x in _autocast(query, key, value))
    options = dict(causal=mask.causal, softmax_scale=scaling, window_size=mask.window,
                   attention_chunk_size=mask.chunk_size, softcap=kwargs.get("softcap") or 0.0,
                   sinks=kwargs.get("s_aux"))  # fmt: skip
    if varlen is not None:  # the plan sets the layout and the lengths
        options.update(varlen=varlen, **({} if mode == "ulysses" else {"layout": "contiguous"}))
    else:
        options.update(seq_lens=seq_lens)
    return settings.attention(q, k, v, **options), None  # (B, S_local, H, D), no attention weights


def _decode(describe, module, query, key, value, mask, scaling, dropout, kwargs, settings, cache):
    """A generate step's attention over the sharded cache (generation.ShardedCache).
    decode: the new queries (the same on every rank) over every rank's cached keys,
    merged across the ranks (decode_attention); query (B, H, Tq, D), key, value
    (B, H_kv, width, D): this rank's shard by sequence (Step.index). chunk: this rank's
    piece of a next turn over every rank's cache and the whole chunk (prefill_attention);
    query, key, value the piece's. Returns (B, Tq, H, D)."""
    if dropout and module.training:
        raise ValueError(f"{describe}: attention dropout {dropout} while training is not supported")
    q, k, v = (x.transpose(1, 2) for x in _autocast(query, key, value))
    variants = dict(causal=mask.causal, softmax_scale=scaling, window_size=mask.window,
                    attention_chunk_size=mask.chunk_size, softcap=kwargs.get("softcap") or 0.0,
                    sinks=kwargs.get("s_aux"))  # fmt: skip
    step = cache.step
    # Every rank runs the same step of one generate: their arguments agree by construction.
    if step.kind == "decode":
        return decode_attention(q, k, v, q_positions=step.query_positions, cache_positions=step.cache_positions,
                                cache_lengths=step.cache_lengths, check_ranks=False, **variants,
                                **settings.group_kwargs())  # fmt: skip
    # The cache keeps the keys as rotary embeddings left them (fp32 under autocast): in q's dtype, as the chunk's.
    stored_keys, stored_values = _autocast(*_stored_keys_and_values(describe, module, cache, step, k, v))
    return prefill_attention(q, k, v, stored_keys, stored_values, q_positions=step.query_positions,
                             cache_positions=step.cache_positions, cache_lengths=step.cache_lengths,
                             check_ranks=False, chunk_seq_lens=step.chunk_seq_lens,
                             cache_seq_lens=step.cache_seq_lens, **variants, **settings.group_kwargs())  # fmt: skip


def _stored_keys_and_values(describe, module, cache, step, k, v):
    """The cached keys and values of this rank's shard (batch, width, H_kv, D) and (...,
    Dv) as the attention reads them. Multi-head latent attention layers (DeepSeek-V3 and
    its kin: an expand_kv method) cache the compressed latents (kv_nope, k_rot), each
    (batch, width, 1, rank): expanded by the layer's own expand_kv, as its forward does
    for the chunk. What still differs from the chunk's k (B, C, H_kv, D), v (..., Dv)
    raises, naming the layer."""
    stored = cache.layers[module.layer_idx].gathered(step.index)
    if hasattr(module, "expand_kv"):
        stored = tuple(x.transpose(1, 2) for x in module.expand_kv(*(x.transpose(1, 2) for x in stored)))
    for name, cached, new in zip(("keys", "values"), stored, (k, v)):
        if cached.shape[2:] != new.shape[2:]:
            raise ValueError(
                f"{describe}: layer {module.layer_idx} ({type(module).__name__}) caches {name} of (heads, head dim) "
                f"{tuple(cached.shape[2:])} where its attention reads {tuple(new.shape[2:])}: a cache of something "
                "other than its keys and values, which a next turn over a sharded cache cannot read"
            )
    return stored


def _ulysses(module, query, key, value, attention_mask, **kwargs):
    return _attention("ulysses", module, query, key, value, attention_mask, **kwargs)


def _ring(module, query, key, value, attention_mask, **kwargs):
    return _attention("ring", module, query, key, value, attention_mask, **kwargs)


def _usp(module, query, key, value, attention_mask, **kwargs):
    return _attention("usp", module, query, key, value, attention_mask, **kwargs)


_ATTENTION_FUNCTIONS = {"ulysses": _ulysses, "ring": _ring, "usp": _usp}


def register() -> None:
    """Add "seqpar_ulysses", "seqpar_ring" and "seqpar_usp" to transformers'
    AttentionInterface and AttentionMaskInterface. Idempotent; raises ValueError if one
    of the names is taken by another function (it never overwrites one)."""
    for mode, name in IMPLEMENTATIONS.items():
        for interface, function in (
            (AttentionInterface, _ATTENTION_FUNCTIONS[mode]),
            (AttentionMaskInterface, layer_mask),
        ):
            existing = interface._global_mapping.get(name)
            if existing is not None and existing is not function:
                raise ValueError(
                    f"register: {interface.__name__} already has {name!r} ({existing}); seqpar_kernels does not "
                    "overwrite it"
                )
            interface.register(name, function)


def apply(
    model,
    mode: str,
    *,
    group=None,
    mesh=None,
    ulysses_group=None,
    ring_group=None,
    sequence_dims=None,
    data_dims=(),
    tensor_dims=(),
    layout: str = "contiguous",
    step_backend: str = "auto",
) -> SequenceParallelism:
    """Switch a loaded transformers model's attention to sequence-parallel attention.

    model: a PreTrainedModel whose attention goes through AttentionInterface and whose
        masks through masking_utils (Llama, Mistral, Qwen2/3, Gemma 2/3, gpt-oss,
        Llama 4's text model, Cohere 2, Phi3, ... in transformers >= 4.56): full,
        sliding-window and chunked attention layers; or a vision-language model of
        vision.VISION_LANGUAGE_TYPES (Qwen2.5-VL, Qwen3-VL, ...), whose language model
        switches (its vision tower keeps its attention) and whose base model takes the
        images and videos of shard_batch(..., model=model) (vision.install). Or PEFT's
        PeftModel of one, before or after get_peft_model: the model under it switches,
        adapters and all (adapters.transformers_model; prompt learning raises).
        Inkling 2 and Inkling 2 Loop run in every mode, without tensor parallelism
        (inkling.install raises for it).
    mode: "ulysses" or "ring" (over group, default the world), or "usp" (over mesh, a
        2-D DeviceMesh with dims "ring" and "ulysses", or ulysses_group and ring_group
        from make_usp_groups). Or one mesh for every parallelism: mesh= a DeviceMesh with
        named dims, sequence_dims= the sequence's dim (USP: (ulysses dim, ring dim)),
        data_dims= the data replicas' dims; causal_lm_loss then counts its tokens over
        both, and the mesh's other dims are never reduced over. tensor_dims= (with
        sequence_dims=): the dims tensor parallelism shards the decoder layers over,
        here, with the model's own plan (tensor_parallel.shard_layers: each rank's
        attention gets its share of the heads, which the sequence splits further; the
        embeddings and the LM head stay whole).
    layout: "contiguous", or "balanced" (ring and usp: causal work balanced across the
        ring; shard_batch must be given the same).
    step_backend: "auto", "triton" or "aten": what computes the ring's steps (ring and
        usp; ring_attention's argument).
    Returns the SequenceParallelism it recorded on the model's modules (and as
    model.seqpar_parallelism). Calls register() first. Raises ValueError for a model
    that cannot switch (its attention does not dispatch through AttentionInterface),
    that has sub-models other than a vision-language model's, or whose
    config.layer_types name layers other than ATTENTION_LAYER_TYPES (linear attention,
    convolutions, compressed attention: they would mix this rank's tokens only), and
    for a mixture-of-experts model with output_router_logits=True whose router loss
    router.py cannot compute."""
    settings = SequenceParallelism.resolve(
        "apply",
        mode,
        layout,
        group=group,
        mesh=mesh,
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        sequence_dims=sequence_dims,
        data_dims=data_dims,
        tensor_dims=tensor_dims,
        step_backend=step_backend,
    )
    model = transformers_model(model, "apply")
    if not isinstance(model, transformers.PreTrainedModel):
        raise ValueError(f"apply: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    vision_language = vision_language_base(model, "apply")
    # A vision-language model's vision tower keeps its own attention: each rank encodes whole frames.
    language = model if vision_language is None else vision_language.language_model
    indexed = check_indexed(model, settings)
    mixers = _check_layers(model, INDEXED_LAYER_TYPES if indexed else ())
    router_loss_of(model, "apply")  # a router loss the package cannot compute raises here, before training
    if inkling.serves(model):  # raises for what it cannot run, before anything changes
        inkling.install(model, settings)
    if settings.tensor_size > 1:
        if vision_language is not None or mixers:
            raise ValueError(
                f"apply: tensor_dims= shards a text model's attention and MLPs; {type(model).__name__} has "
                f"{'a vision tower' if vision_language is not None else f'sequence mixers {sorted(mixers)}'} too"
            )
        shard_layers("apply", model, settings)
    register()
    name = IMPLEMENTATIONS[mode]
    language.set_attn_implementation(name)
    if language.config._attn_implementation != name:
        raise ValueError(
            f"apply: {type(language).__name__} did not switch to {name!r} (it stays on "
            f"{language.config._attn_implementation!r}): its attention does not dispatch through AttentionInterface"
        )
    for module in model.modules():
        setattr(module, SETTINGS_ATTRIBUTE, settings)
    if mixers:
        install(model, settings)
    if indexed:
        install_indexed(model, settings)
    if vision_language is not None:
        install_vision(vision_language)
    install_generation(model, settings)
    return settings


def _check_layers(model, indexed_types=()) -> dict:
    """The model's mixers other than attention (mixers.mixers_of), after checking that
    every layer whose type (config.layer_types, or layers_block_type) is not attention
    holds one, or mixes nothing (an MLP layer): a layer of another kind would see this
    rank's tokens only. Raises ValueError naming it."""
    mixers = mixers_of(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or ()
    if not set(types) - set(ATTENTION_LAYER_TYPES) - set(UNMIXED_LAYER_TYPES) - set(indexed_types):
        return mixers
    layers = _decoder_layers(model, len(types))
    for index, layer_type in enumerate(types):
        if layer_type in (*ATTENTION_LAYER_TYPES, *UNMIXED_LAYER_TYPES, *indexed_types):
            continue
        held = [module for module in mixers.values() if any(module is sub for sub in layers[index].modules())] \
            if layers is not None else list(mixers.values())  # fmt: skip
        if not held:
            classes = sorted({type(sub).__name__ for sub in (layers[index].modules() if layers is not None else ())})
            raise ValueError(
                f"apply: {type(model).__name__}'s layer {index} is of type {layer_type!r}, whose sequence mixing "
                f"({', '.join(classes) or 'unknown'}) the package does not run sequence-parallel: it runs attention "
                f"({list(ATTENTION_LAYER_TYPES)}) and the mixers that call {sorted(HANDLED_FUNCTIONS)}"
            )
    return mixers


def _decoder_layers(model, count: int):
    """The model's list of `count` decoder layers (the ModuleList named ...layers), or None."""
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and path.split(".")[-1] == "layers" and len(module) == count:
            return module
    return None
