"""The attention of seqpar_kernels.integrations.transformers: the attention functions
transformers calls, their mask functions, register() and apply().

register() adds three attention implementations through transformers' public
AttentionInterface, and a mask function for each through AttentionMaskInterface:
    "seqpar_ulysses"   ulysses_attention
    "seqpar_ring"      ring_attention
    "seqpar_usp"       usp_attention
apply() switches a loaded model to one of them (model.set_attn_implementation) and records
on its modules the mode, layout and process groups the attention uses.

Masks: transformers builds each layer type's mask once per forward through the mask
interface (masking_utils: create_causal_mask, create_sliding_window_causal_mask,
create_chunked_causal_mask, ...), and hands the result to every layer of that type as its
attention_mask. Ours returns a LayerMask instead of a tensor: the pattern read off the
mask function transformers composed (causal or bidirectional, a sliding window, chunks),
so that each layer attends exactly as the model's own eager/sdpa path would, over the
whole sequence of every rank. transformers' conventions, converted:
    sliding_window_overlay(w)   kv > q - w: a window of w keys, the query's own included
                                -> window_size=(w - 1, -1) with causal
    sliding_window_bidirectional_overlay(w)   |q - kv| <= w -> window_size=(w, w)
    chunked_overlay(c)          q // c == kv // c -> attention_chunk_size=c
Each of those functions is checked once per process and parameter against the pattern
it is read as (on a grid of positions), so that a release that changed one raises
instead of attending otherwise. Any other mask function (model-specific overlays, or_masks,
image-token blocks) raises.

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
from dataclasses import dataclass

import torch

try:
    import transformers
    from transformers import AttentionInterface, masking_utils
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "seqpar_kernels.integrations.transformers needs Hugging Face transformers 4.56 or newer: "
        'pip install "seqpar-kernels[transformers]"'
    ) from error

from seqpar_kernels.groups import all_gather_ints
from seqpar_kernels.parallel.ring import ring_attention
from seqpar_kernels.parallel.training import SequenceParallelism, SequenceShard
from seqpar_kernels.parallel.ulysses import ulysses_attention
from seqpar_kernels.parallel.usp import usp_attention

__all__ = ["register", "apply", "IMPLEMENTATIONS", "LayerMask"]

IMPLEMENTATIONS = {"ulysses": "seqpar_ulysses", "ring": "seqpar_ring", "usp": "seqpar_usp"}
# The attribute apply() sets on every module of the model: the attention function gets
# the attention module, and reads its groups there.
SETTINGS_ATTRIBUTE = "seqpar_parallelism"
# The per-layer types (config.layer_types) whose layers mix the sequence only through the
# attention function and the mask interface.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


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


def _from_every_rank(value: int, settings: SequenceParallelism, device) -> list[int]:
    """Every rank's `value`, in piece order (USP: over the Ulysses group, then the ring)."""
    values = [value]
    for name in settings.group_names:
        values = [item for row in all_gather_ints(values, name, device) for item in row]
    return values


def _check_global_positions(position_ids, local_len: int, settings: SequenceParallelism, describe: str) -> None:
    """Without a SequenceShard, the position ids must be this rank's global positions
    in the layout (rotary embeddings read them): a model given only this rank's tokens
    counts them from 0 on every rank, and packed documents restart them. One small
    all-gather of the ranks' lengths per forward finds the expected ones."""
    global _checked_positions
    if position_ids is None or (_checked_positions is not None and _checked_positions() is position_ids):
        return
    lengths = _from_every_rank(local_len, settings, position_ids.device)
    expected = settings.split_dense(torch.arange(sum(lengths), device=position_ids.device)[None], dim=1)
    matches = position_ids.shape[-1] == expected.shape[-1] and bool((position_ids == expected).all())
    # Every rank raises if one does: a rank that went on would wait in the attention's collectives.
    if not all(_from_every_rank(int(matches), settings, position_ids.device)):
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


def _global_rows(shard: SequenceShard | None, position_ids, settings: SequenceParallelism, device) -> torch.Tensor:
    """(S_local,) int64: the row of each of this rank's tokens in the full sequence (the
    packed row under varlen). Without a shard, the position ids (checked to be those)."""
    if shard is None:
        return position_ids[0]
    rows = torch.arange(sum(shard.seq_lens), device=device)
    return shard.varlen.split(rows, dim=0) if shard.varlen is not None else settings.split_dense(rows, dim=0)


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


def _attention(mode: str, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention function of one mode, as transformers calls it.

    query: (batch, nheads, seqlen_local, headdim); key, value: (batch, nheads_kv,
    seqlen_local, headdim). Returns ((batch, seqlen_local, nheads, headdim), None)."""
    describe = f"{IMPLEMENTATIONS[mode]} attention in {type(module).__name__}"
    settings = _settings_of(module, mode)
    mask = _layer_mask(describe, module, attention_mask, kwargs)
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
    if mask.chunk_size is not None and varlen is not None and not _CHUNKS_FROM_DOCUMENT_START:
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
        query = _rescale_temperature(module, query, _global_rows(shard, position_ids, settings, query.device))
    # (B, H, S, D) -> (B, S, H, D): views; transformers' projections are (B, S, H, D) in
    # memory, so these are usually contiguous already.
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    common = dict(causal=mask.causal, softmax_scale=scaling, seq_lens=None if varlen is not None else seq_lens,
                  varlen=varlen, window_size=mask.window, attention_chunk_size=mask.chunk_size,
                  softcap=kwargs.get("softcap") or 0.0, sinks=kwargs.get("s_aux"),
                  **settings.group_kwargs())  # fmt: skip
    if mode == "ulysses":
        out = ulysses_attention(q, k, v, **common)
    else:
        ring_or_usp = ring_attention if mode == "ring" else usp_attention
        out = ring_or_usp(q, k, v, layout="contiguous" if varlen is not None else settings.dense_layout,
                          step_backend=settings.step_backend, **common)  # fmt: skip
    return out, None  # (B, S_local, H, D), no attention weights


def _ulysses(module, query, key, value, attention_mask, **kwargs):
    return _attention("ulysses", module, query, key, value, attention_mask, **kwargs)


def _ring(module, query, key, value, attention_mask, **kwargs):
    return _attention("ring", module, query, key, value, attention_mask, **kwargs)


def _usp(module, query, key, value, attention_mask, **kwargs):
    return _attention("usp", module, query, key, value, attention_mask, **kwargs)


_ATTENTION_FUNCTIONS = {"ulysses": _ulysses, "ring": _ring, "usp": _usp}


# ----------------------------------------------------------------------------------
# The mask: the pattern of transformers' mask function
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerMask:
    """Which keys the queries of a layer attend, by position in the whole sequence (in
    the document under packing), in the attention functions' terms: what our mask
    function returns to transformers in place of a mask tensor, and what the model then
    hands each layer of that type.

    causal       keys at or before the query only
    window       (left, right): keys at query - left ..= query + right (-1: no bound)
    chunk_size   None, or keys in the query's chunk of that many positions only"""

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    chunk_size: int | None = None

    def allows(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """Whether query position q_idx attends key position kv_idx (broadcast)."""
        allowed = torch.ones(torch.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=torch.bool, device=q_idx.device)
        left, right = self.window
        if self.causal:
            allowed &= kv_idx <= q_idx
        if left >= 0:
            allowed &= kv_idx >= q_idx - left
        if right >= 0:
            allowed &= kv_idx <= q_idx + right
        if self.chunk_size is not None:
            allowed &= torch.div(kv_idx, self.chunk_size, rounding_mode="floor") == torch.div(
                q_idx, self.chunk_size, rounding_mode="floor"
            )
        return allowed

    def __and__(self, other: LayerMask) -> LayerMask:
        """The keys both allow, where that is a LayerMask again."""

        def tighter(a: int, b: int) -> int:
            return b if a < 0 else a if b < 0 else min(a, b)

        chunks = [size for size in (self.chunk_size, other.chunk_size) if size is not None]
        if len(chunks) == 2 and max(chunks) % min(chunks):
            raise ValueError(f"sequence-parallel attention: chunks of {chunks[0]} and of {chunks[1]} positions at once")
        return LayerMask(
            self.causal or other.causal,
            (tighter(self.window[0], other.window[0]), tighter(self.window[1], other.window[1])),
            min(chunks) if chunks else None,
        )


def _closure(function) -> dict:
    """The variables a nested function closes over, by name."""
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__ or ())))


def _positive(value, name: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"sequence-parallel attention: the model's {name} must be an int >= {least}, got {value!r}")
    return value


def _without_left_padding(variables: dict) -> dict:
    left_padding = variables.get("left_padding")
    if isinstance(left_padding, torch.Tensor) and bool((left_padding != 0).any()):
        raise ValueError("sequence-parallel attention: chunked attention over a left-padded batch")
    return variables


# transformers' mask functions (masking_utils), by qualified name: the pattern each one
# allows, from the variables it closes over.
_LEAF_PATTERNS = {
    "causal_mask_function": lambda variables: LayerMask(causal=True),
    "bidirectional_mask_function": lambda variables: LayerMask(),
    "sliding_window_overlay.<locals>.inner_mask": lambda variables: LayerMask(
        window=(_positive(variables["sliding_window"], "sliding_window") - 1, -1)
    ),
    "sliding_window_bidirectional_overlay.<locals>.inner_mask": lambda variables: LayerMask(
        window=(_positive(variables["sliding_window"], "sliding_window", 0),) * 2
    ),
    "chunked_overlay.<locals>.inner_mask": lambda variables: LayerMask(
        chunk_size=_positive(_without_left_padding(variables)["chunk_size"], "attention_chunk_size")
    ),
    "_legacy_chunked_overlay.<locals>.inner_mask": lambda variables: LayerMask(
        chunk_size=_positive(variables["chunk_size"], "attention_chunk_size")
    ),
}
# Wrappers whose pattern is that of the functions they wrap: the intersection, and the
# packing transformers reads off the local position ids (a packed batch's documents are
# the varlen plan's; the attention checks the positions the same way on every rank,
# whereas a rank whose tokens hold no document border sees no packing here).
_INTERSECTIONS = ("and_masks.<locals>.and_mask", "remap_positions_for_packed_sequence.<locals>.inner_mask")
_PACKING_LEAVES = ("packed_sequence_mask_function.<locals>.inner_mask",)
# Whether transformers counts chunks from each packed document's start (newer releases
# remap positions to the documents'), as sequence-parallel attention does.
_CHUNKS_FROM_DOCUMENT_START = hasattr(masking_utils, "remap_positions_for_packed_sequence")

# (function code, its pattern) pairs already checked on the probe grid.
_verified: set = set()


def _verify(function, pattern: LayerMask, device) -> None:
    """Evaluate transformers' mask function on a grid of positions and raise unless it
    allows exactly what `pattern` does: a release that changed a convention raises
    instead of attending otherwise. Once per process for each function and pattern."""
    key = (function.__code__, pattern)
    if key in _verified:
        return
    left, right = pattern.window
    extent = max(left + 1, right + 1, pattern.chunk_size or 0, 1)
    size = 2 * extent + 3
    # Every query row for small patterns; rows near the bounds and a sample between for large.
    rows = torch.arange(size) if size <= 256 else torch.cat([torch.arange(64), torch.linspace(64, size - 65, 64).long(),
                                                              torch.arange(size - 64, size)])  # fmt: skip
    rows = rows.to(device)[None, None, :, None]
    columns = torch.arange(size, device=device)[None, None, None, :]
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    allowed = function(zero, zero, rows, columns)
    if not bool((allowed == pattern.allows(rows, columns)).all()):
        raise ValueError(
            f"sequence-parallel attention: transformers' {function.__qualname__} does not allow what it is read as "
            f"({pattern}): this transformers release changed its convention"
        )
    _verified.add(key)


def _pattern_of(mask_function, device) -> LayerMask:
    """The LayerMask of a mask function transformers composed, or ValueError."""
    qualname = getattr(mask_function, "__qualname__", "")
    if qualname in _LEAF_PATTERNS:
        pattern = _LEAF_PATTERNS[qualname](_closure(mask_function))
        _verify(mask_function, pattern, device)
        return pattern
    if qualname in _PACKING_LEAVES:
        return LayerMask()
    if qualname in _INTERSECTIONS:
        inner = []
        for value in _closure(mask_function).values():
            inner.extend(value if isinstance(value, tuple) else [value])
        inner = [function for function in inner if callable(function)]
        if inner:
            pattern = LayerMask()
            for function in inner:
                pattern = pattern & _pattern_of(function, device)
            return pattern
    raise ValueError(
        f"sequence-parallel attention: the model asks for a mask it cannot honour "
        f"({qualname or mask_function}): it honours causal and bidirectional masks, sliding windows and chunks "
        "(masking_utils' own), and packed documents through shard_batch's varlen plan; not model-specific "
        "overlays"
    )


def _mask(mask_function=masking_utils.causal_mask_function, attention_mask=None, **kwargs):
    """The mask function registered for our implementations: transformers calls it once
    per forward and layer type, before the layers. Returns the LayerMask the model then
    hands to the layers of that type; raises for what it would have to drop."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            f"sequence-parallel attention: the attention mask {tuple(attention_mask.shape)} pads some tokens; "
            "padding cannot be expressed across ranks: shard the batch with shard_batch, which folds right "
            "padding into shift_labels (exact for causal models)"
        )
    # The device of the call (transformers 5 passes it; 4.56 the cache positions'), where
    # the mask function's own tensors (chunks' left padding) live.
    device = kwargs.get("device")
    if device is None:
        anchor = kwargs.get("cache_position", attention_mask)
        device = anchor.device if isinstance(anchor, torch.Tensor) else "cpu"
    return _pattern_of(mask_function, device)


def register() -> None:
    """Add "seqpar_ulysses", "seqpar_ring" and "seqpar_usp" to transformers'
    AttentionInterface and AttentionMaskInterface. Idempotent; raises ValueError if one
    of the names is taken by another function (it never overwrites one)."""
    for mode, name in IMPLEMENTATIONS.items():
        for interface, function in ((AttentionInterface, _ATTENTION_FUNCTIONS[mode]), (AttentionMaskInterface, _mask)):
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
    layout: str = "contiguous",
    step_backend: str = "auto",
) -> SequenceParallelism:
    """Switch a loaded transformers model's attention to sequence-parallel attention.

    model: a PreTrainedModel whose attention goes through AttentionInterface and whose
        masks through masking_utils (Llama, Mistral, Qwen2/3, Gemma 2/3, gpt-oss,
        Llama 4's text model, Cohere 2, Phi3, ... in transformers >= 4.56): full,
        sliding-window and chunked attention layers; text only.
    mode: "ulysses" or "ring" (over group, default the world), or "usp" (over mesh, a
        2-D DeviceMesh with dims "ring" and "ulysses", or ulysses_group and ring_group
        from make_usp_groups).
    layout: "contiguous", or "balanced" (ring and usp: causal work balanced across the
        ring; shard_batch must be given the same).
    step_backend: "auto", "triton" or "aten": what computes the ring's steps (ring and
        usp; ring_attention's argument).
    Returns the SequenceParallelism it recorded on the model's modules (and as
    model.seqpar_parallelism). Calls register() first. Raises ValueError for a model
    that cannot switch (its attention does not dispatch through AttentionInterface),
    that has sub-models (a vision tower's tokens are not sharded), or whose
    config.layer_types name layers other than ATTENTION_LAYER_TYPES (linear attention,
    convolutions, compressed attention: they would mix this rank's tokens only)."""
    settings = SequenceParallelism.resolve(
        "apply",
        mode,
        layout,
        group=group,
        mesh=mesh,
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        step_backend=step_backend,
    )
    if not isinstance(model, transformers.PreTrainedModel):
        raise ValueError(f"apply: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if getattr(model.config, "sub_configs", None):
        raise ValueError(
            f"apply: {type(model).__name__} has sub-models ({sorted(model.config.sub_configs)}); apply sequence "
            "parallelism to its language model alone"
        )
    other_layers = sorted(set(getattr(model.config, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if other_layers:
        raise ValueError(
            f"apply: {type(model).__name__} has layers of type {other_layers}, which mix the sequence outside the "
            f"attention interface (recurrent, compressed or indexed attention) and would see this rank's tokens "
            f"only; sequence-parallel attention runs models whose layers are {list(ATTENTION_LAYER_TYPES)}"
        )
    register()
    name = IMPLEMENTATIONS[mode]
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(
            f"apply: {type(model).__name__} did not switch to {name!r} (it stays on "
            f"{model.config._attn_implementation!r}): its attention does not dispatch through AttentionInterface"
        )
    for module in model.modules():
        setattr(module, SETTINGS_ATTRIBUTE, settings)
    return settings
