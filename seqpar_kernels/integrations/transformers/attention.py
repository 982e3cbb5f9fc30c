"""The attention of seqpar_kernels.integrations.transformers: the attention functions
transformers calls, their mask functions, register() and apply().

register() adds three attention implementations through transformers' public
AttentionInterface, and a mask function for each through AttentionMaskInterface:
    "seqpar_ulysses"   ulysses_attention
    "seqpar_ring"      ring_attention
    "seqpar_usp"       usp_attention
apply() switches a loaded model to one of them (model.set_attn_implementation) and records
on its modules the mode, layout and process groups the attention uses.

What the attention functions take from transformers: query (B, H, S_local, D) and
key/value (B, H_kv, S_local, D), views of (B, S_local, H, D) projections, handed to ours
as (B, S_local, H, D) views without a copy; the scaling; is_causal (a causal decoder, or
bidirectional); the SequenceShard that shard_batch put in the batch (the layout, every
rank's length, a packed batch's varlen plan), which the model passes down; without
one, the position ids, which must then be every rank's global positions in the layout
(checked once per forward, with one small all-gather). Everything else that changes
the result raises instead of being ignored: a padding mask or any mask pattern other
than plain causal/bidirectional (sliding windows, chunked attention, model-specific
overlays, packed documents not sharded by shard_batch), dropout while training,
softcapping, attention sinks, a KV cache holding more keys than queries (generation).
Padding belongs in shift_labels (shard_batch folds right padding there), packing in the
varlen plan.

Supported releases: transformers 4.56 and newer (the models that dispatch attention
through AttentionInterface and build masks through masking_utils).
"""

from __future__ import annotations

import weakref

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

__all__ = ["register", "apply", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = {"ulysses": "seqpar_ulysses", "ring": "seqpar_ring", "usp": "seqpar_usp"}
# The attribute apply() sets on every module of the model: the attention function gets
# the attention module, and reads its groups there.
SETTINGS_ATTRIBUTE = "seqpar_parallelism"
# The mask patterns the attention can honour: causal, and bidirectional (transformers
# 5 has a function for it; 4.56 builds bidirectional masks without a mask function).
_PLAIN_MASK_FUNCTIONS = tuple(
    function
    for function in (
        getattr(masking_utils, "causal_mask_function", None),
        getattr(masking_utils, "bidirectional_mask_function", None),
    )
    if function is not None
)


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


def _check_call(describe, module, query, key, attention_mask, dropout, kwargs) -> bool:
    """Raise for what the sequence-parallel attention cannot honour; returns is_causal."""
    if attention_mask is not None:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"{describe}: got an attention mask {shape}; sequence-parallel attention takes no mask (padding "
            "goes into shift_labels, packed documents into the varlen plan: shard_batch does both)"
        )
    if dropout and module.training:
        raise ValueError(f"{describe}: attention dropout {dropout} while training is not supported")
    for name in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{describe}: {name}={kwargs[name]!r} is not supported by sequence-parallel attention")
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
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if causal is None else causal)


def _attention(mode: str, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention function of one mode, as transformers calls it.

    query: (batch, nheads, seqlen_local, headdim); key, value: (batch, nheads_kv,
    seqlen_local, headdim). Returns ((batch, seqlen_local, nheads, headdim), None)."""
    describe = f"{IMPLEMENTATIONS[mode]} attention in {type(module).__name__}"
    settings = _settings_of(module, mode)
    causal = _check_call(describe, module, query, key, attention_mask, dropout, kwargs)
    shard: SequenceShard | None = kwargs.get("sequence_shard")
    if shard is None:
        _check_global_positions(kwargs.get("position_ids"), query.shape[2], settings, describe)
        seq_lens, varlen = None, None
    else:
        if not isinstance(shard, SequenceShard) or shard.parallelism != settings:
            made = shard.parallelism if isinstance(shard, SequenceShard) else type(shard).__name__
            raise ValueError(
                f"{describe}: the batch was sharded for {made}, the model's attention runs {settings}: pass "
                "shard_batch the mode, layout and groups given to apply()"
            )
        if shard.padded and not causal:
            raise ValueError(
                f"{describe}: the batch was right-padded, which only a causal layer can ignore; this layer is "
                "bidirectional: pack the sequences instead of padding them"
            )
        seq_lens, varlen = list(shard.seq_lens), shard.varlen
    # (B, H, S, D) -> (B, S, H, D): views; transformers' projections are (B, S, H, D) in
    # memory, so these are usually contiguous already.
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    common = dict(causal=causal, softmax_scale=scaling, seq_lens=None if varlen is not None else seq_lens,
                  varlen=varlen, **settings.group_kwargs())  # fmt: skip
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


# transformers' own wrappers around a mask function when it reads packed documents from
# the position ids (and_masks of the plain function, remapped positions and a
# same-document test); nothing else it wraps is honoured.
_PACKING_WRAPPERS = ("and_masks.", "remap_positions_for_packed_sequence.")
_PACKING_LEAVES = ("packed_sequence_mask_function.",)


def _only_packing(mask_function) -> bool:
    """Whether mask_function is a plain mask, at most wrapped by transformers for packed
    documents. Those are left to the attention, whose check of the position ids runs
    alike on every rank: a rank whose tokens hold no document border sees no packing
    here, and raising on some ranks only would leave the others waiting in a collective."""
    qualname = getattr(mask_function, "__qualname__", "")
    if mask_function in _PLAIN_MASK_FUNCTIONS or qualname.startswith(_PACKING_LEAVES):
        return True
    if not qualname.startswith(_PACKING_WRAPPERS):
        return False
    inner = []
    for cell in mask_function.__closure__ or ():
        value = cell.cell_contents
        inner.extend(value if isinstance(value, tuple) else [value])
    inner = [function for function in inner if callable(function)]
    return bool(inner) and all(_only_packing(function) for function in inner)


def _mask(mask_function=None, attention_mask=None, **kwargs):
    """The mask function registered for our implementations: transformers calls it once
    per forward, before the layers. The attention takes no mask, so this returns None
    when there is nothing to mask, and raises for anything it would have to drop."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            f"sequence-parallel attention: the attention mask {tuple(attention_mask.shape)} pads some tokens; "
            "padding cannot be expressed across ranks: shard the batch with shard_batch, which folds right "
            "padding into shift_labels (exact for causal models)"
        )
    if mask_function is not None and not _only_packing(mask_function):
        raise ValueError(
            f"sequence-parallel attention: the model asks for a mask other than plain causal or bidirectional "
            f"({getattr(mask_function, '__qualname__', mask_function)}): a sliding window, chunked attention, a "
            "model-specific overlay: sequence-parallel attention honours causal and bidirectional masks, and "
            "packed documents through shard_batch's varlen plan"
        )
    return None


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

    model: a PreTrainedModel whose attention goes through AttentionInterface (Llama,
        Mistral, Qwen2/3, Gemma, Phi3, ... in transformers >= 4.56), text only.
    mode: "ulysses" or "ring" (over group, default the world), or "usp" (over mesh, a
        2-D DeviceMesh with dims "ring" and "ulysses", or ulysses_group and ring_group
        from make_usp_groups).
    layout: "contiguous", or "balanced" (ring and usp: causal work balanced across the
        ring; shard_batch must be given the same).
    step_backend: "auto", "triton" or "aten": what computes the ring's steps (ring and
        usp; ring_attention's argument).
    Returns the SequenceParallelism it recorded on the model's modules (and as
    model.seqpar_parallelism). Calls register() first. Raises ValueError for a model
    that cannot switch (its attention does not dispatch through AttentionInterface) or
    that has sub-models (a vision tower's tokens are not sharded)."""
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
