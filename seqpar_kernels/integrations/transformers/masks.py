"""transformers' masks read as the package's AttentionMask: the mask function registered
through transformers' AttentionMaskInterface for the sequence-parallel implementations.

transformers builds each layer type's mask once per forward through the mask interface
(masking_utils: create_causal_mask, create_sliding_window_causal_mask,
create_chunked_causal_mask, ...), and hands the result to every layer of that type as its
attention_mask. Ours (layer_mask) returns a LayerMask (the package's AttentionMask)
instead of a tensor: the pattern read off the mask function transformers composed
(causal or bidirectional, a sliding window, chunks), so that each layer attends exactly
as the model's own eager/sdpa path would, over the whole sequence of every rank.
transformers' conventions, converted:
    sliding_window_overlay(w)   kv > q - w: a window of w keys, the query's own included
                                -> window (w - 1, -1) with causal
    sliding_window_bidirectional_overlay(w)   |q - kv| <= w -> window (w, w)
    chunked_overlay(c)          q // c == kv // c -> chunk_size c
Each of those functions is checked once per process and parameter against the pattern
it is read as (on a grid of positions), so that a release that changed one raises
instead of attending otherwise. Any other mask function (model-specific overlays, or_masks,
image-token blocks) raises.
"""

from __future__ import annotations

import torch
from transformers import masking_utils

from seqpar_kernels.attention_mask import AttentionMask

__all__ = ["LayerMask", "layer_mask", "CHUNKS_FROM_DOCUMENT_START"]

# Which keys the queries of a layer attend, by position in the whole sequence (in the
# document under packing): the package's AttentionMask, without documents (a packed
# batch's come from shard_batch's varlen plan). What our mask function returns to
# transformers in place of a mask tensor, and what the model then hands each layer.
LayerMask = AttentionMask


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
CHUNKS_FROM_DOCUMENT_START = hasattr(masking_utils, "remap_positions_for_packed_sequence")

_CHANGED_CONVENTION = "this transformers release changed its convention"

# (function code, its pattern) pairs already checked on the probe grid.
_verified: set = set()


def _verify(function, pattern: LayerMask, device) -> None:
    """Evaluate transformers' mask function on a grid of positions and raise unless it
    allows exactly what `pattern` does: a release that changed a convention raises
    instead of attending otherwise. Once per process for each function and pattern."""
    compiling = torch.compiler.is_compiling()
    key = (function.__code__, pattern)
    if not compiling and key in _verified:
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
    agrees = (allowed == pattern.allows(rows, columns)).all()
    if compiling:
        # A check inside the graph (a host read would break it): it raises when the graph
        # runs, with a message the graph can hold as a constant.
        torch._assert_async(agrees, "sequence-parallel attention: a mask function is not what it is read as: "
                            + _CHANGED_CONVENTION)  # fmt: skip
        return
    if not bool(agrees):
        raise ValueError(
            f"sequence-parallel attention: transformers' {function.__qualname__} does not allow what it is read "
            f"as ({pattern}): {_CHANGED_CONVENTION}"
        )
    _verified.add(key)


def qualified_name(function) -> str:
    """A function's __qualname__, read from its code object where Python has it there
    (3.11+): torch.compile traces that as a constant, the function's own attribute not."""
    code = getattr(function, "__code__", None)
    name = getattr(code, "co_qualname", None)
    return name if name is not None else getattr(function, "__qualname__", "")


def _pattern_of(mask_function, device) -> LayerMask:
    """The LayerMask of a mask function transformers composed, or ValueError."""
    qualname = qualified_name(mask_function)
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


def layer_mask(mask_function=masking_utils.causal_mask_function, attention_mask=None, **kwargs):
    """The mask function registered for our implementations: transformers calls it once
    per forward and layer type, before the layers. Returns the LayerMask the model then
    hands to the layers of that type; raises for what it would have to drop."""
    if attention_mask is not None and attention_mask.dim() == 2:
        message = (
            f"sequence-parallel attention: the attention mask {tuple(attention_mask.shape)} pads some tokens; "
            "padding cannot be expressed across ranks: shard the batch with shard_batch, which folds right "
            "padding into shift_labels (exact for causal models)"
        )
        if torch.compiler.is_compiling():
            torch._assert_async(attention_mask.all(), message)  # in the graph: raises when it runs
        elif not bool(attention_mask.all()):
            raise ValueError(message)
    # The device of the call (transformers 5 passes it; 4.56 the cache positions'), where
    # the mask function's own tensors (chunks' left padding) live.
    device = kwargs.get("device")
    if device is None:
        anchor = kwargs.get("cache_position", attention_mask)
        device = anchor.device if isinstance(anchor, torch.Tensor) else "cpu"
    return _pattern_of(mask_function, device)
