"""Inkling 2 (transformers' inkling2 and inkling2_loop text models) under sequence
parallelism.

Its decoder layers ("hybrid_sliding" and "hybrid" layer types) mix the sequence in four
places, each served here or by the package's mixers:
    attention          per-query relative position bias and per-query sinks: attention()
                       below. Mode "ulysses": each rank attends the whole sequence for its
                       heads, so the bias and sinks only follow the head split. Modes
                       "ring" and "usp": parallel/relative_bias.py (the near band, where
                       the bias applies, from each run's halo of E rows of K|V; the rest
                       through the ring over K|V shifted E rows; merged by lse with the
                       sinks); under USP that ring runs over every rank of the U x R grid
                       (one group made at apply), with all of the rank's heads
    relative bias      Inkling2RelativePositionBias returns a DistanceBias (the logits per
                       query and backward distance) instead of the model's (Q, K) bias,
                       which is built from this rank's rows only
    key/value convs    the sliding layers' static short convolutions call transformers'
                       causal_conv1d_fn (mixers.py passes their halo); the full layers'
                       dynamic ones (per-token taps) get their windows from
                       causal_conv1d (the previous rank's last kernel - 1 inputs)
    post convs         static short convolutions: mixers.py
The block attention residuals (Inkling2BlockAttentionResidual) and the looped variant's
message residuals call the attention interface over the layers' outputs of each token,
not over the sequence: they run transformers' eager attention on this rank's tokens.

Packed documents (shard_batch's varlen plan) run in every mode, the attention through
relative_bias_attention (in mode ulysses too, as a ring over the Ulysses group): the
attention's halos, its far ring and the convolutions restart at each document's start.
What is not served raises at apply(): tensor parallelism; and at the call: a KV cache,
a batch without shard_batch's sequence_shard.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from seqpar_kernels.groups import resolve_group
from seqpar_kernels.integrations.transformers.generation import running_step
from seqpar_kernels.integrations.transformers.indexed import grid_group
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.recurrent import causal_conv1d
from seqpar_kernels.parallel.relative_bias import relative_bias_attention
from seqpar_kernels.parallel.reshard import all_to_all_reshard
from seqpar_kernels.parallel.state_passing import SequenceRuns
from seqpar_kernels.parallel.training import SequenceShard

__all__ = ["DistanceBias", "install", "attention", "serves", "MODEL_TYPES", "LAYER_TYPES"]

# The configs served: Inkling 2 and its looped variant (the same layers, run again with messages).
MODEL_TYPES = ("inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text")
LAYER_TYPES = ("hybrid", "hybrid_sliding")
# The role apply() records on each module whose attention-interface calls this module serves.
ROLE_ATTRIBUTE = "seqpar_inkling_role"
# Under USP: the GridGroup (indexed.grid_group) the sequence attention's ring runs over.
GRID_ATTRIBUTE = "seqpar_inkling_grid"


@dataclasses.dataclass(frozen=True)
class DistanceBias:
    """The relative position bias of one layer as logits per query and backward distance:
    logits (B, H, Q_local, rel_extent); the bias of query q on key k is
    logits[..., q, q_row - k_row] for 0 <= q_row - k_row < rel_extent, else 0 (rows
    counted in the whole sequence). Not a tensor: eager attention given it fails loudly."""

    logits: torch.Tensor


def _config_of(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def serves(model) -> bool:
    """Whether the model is an Inkling 2 model (install() serves it or raises)."""
    types = {getattr(model.config, "model_type", None), getattr(_config_of(model), "model_type", None)}
    return bool(types & set(MODEL_TYPES))


def install(model, settings: SequenceParallelism) -> tuple[str, ...]:
    """apply()'s step for an Inkling 2 model: raises ValueError naming what cannot run;
    else replaces the relative bias and dynamic convolutions' forwards and marks the
    attention and residual modules. Returns the layer types served (LAYER_TYPES)."""
    name = type(model).__name__
    if settings.tensor_size > 1:
        raise ValueError(f"apply: tensor_dims= with {name}: its attention's bias and sinks are not split by heads")
    # Collective over the grid (every rank runs apply): one group for the ring of every layer.
    grid = grid_group(settings) if settings.mode == "usp" else None
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RelativePositionBias"):
            module.forward = _relative_logits.__get__(module)
        elif kind.endswith("DynamicShortConvolution"):
            module.forward = functools.partial(_dynamic_convolution, module, settings)
        elif kind.endswith(("SlidingAttention", "FullAttention")):
            setattr(module, ROLE_ATTRIBUTE, "sequence")
            setattr(module, GRID_ATTRIBUTE, grid)
        elif kind.endswith(("BlockAttentionResidual", "MessageAttentionResidual")):
            setattr(module, ROLE_ATTRIBUTE, "layers")
    return LAYER_TYPES


def _relative_logits(self, hidden_states: torch.Tensor, relative_distance, position_ids) -> DistanceBias:
    """Inkling2RelativePositionBias's forward without the (Q, K) gather: hidden_states
    (B, Q_local, hidden) -> DistanceBias with logits (B, H, Q_local, rel_extent)."""
    relative_states = self.linear(hidden_states).view(*hidden_states.shape[:-1], self.num_heads, -1)
    relative_states = self.norm(relative_states, position_ids)
    return DistanceBias((relative_states @ self.proj).transpose(1, 2))


def _dynamic_convolution(self, settings, hidden_states, dynamic_input, cache=None, conv_mask=None, cache_offset=0,
                         **kwargs):  # fmt: skip
    """Inkling2DynamicShortConvolution's forward on this rank's rows: hidden_states
    (B, S_local, C), dynamic_input (B, S_local, hidden) -> (B, S_local, C). Each row's
    window of kernel inputs (the previous rank's last kernel - 1 included) comes from one
    causal_conv1d with one-hot taps; the per-token taps are the model's."""
    describe = f"{type(self).__name__} (layer {self.layer_idx})"
    if cache is not None:
        raise ValueError(f"{describe}: got a cache; sequence-parallel Inkling 2 runs without one: pass use_cache=False")
    shard = _shard_of(describe, kwargs, settings)
    if kwargs.get("seq_idx") is not None and shard.varlen is None:
        raise ValueError(f"{describe}: got seq_idx with a batch sharded without documents: pass the packed batch "
                         "(position_ids restarting at each document) to shard_batch")  # fmt: skip
    kernel, (batch, rows, channels) = self.conv_kernel_size, hidden_states.shape
    dynamic = self.weight_proj(dynamic_input).float().view(batch, rows, self.num_heads, 1, kernel)
    weights = self.static_weight.float().T.view(self.num_heads, -1, kernel) + dynamic
    states = hidden_states.float()
    context = states if conv_mask is None else states * conv_mask[:, :, None]
    # Tap block `lag` picks the input `lag` rows back: one-hot at kernel - 1 - lag.
    picks = torch.eye(kernel, device=states.device).flip(-1).repeat_interleave(channels, dim=0)
    lagged = causal_conv1d(context.repeat(1, 1, kernel), picks, **_where(settings, shard))
    windows = lagged.view(batch, rows, kernel, channels).permute(0, 1, 3, 2)  # (B, S, C, lag)
    windows = windows.reshape(batch, rows, self.num_heads, -1, kernel)
    out = (windows * weights).sum(-1).reshape(batch, rows, channels)
    return ((out + states) / (2 * kernel + 1) ** 0.5).to(hidden_states.dtype)


def _where(settings: SequenceParallelism, shard: SequenceShard) -> dict:
    """The mixers' and relative_bias_attention's keyword arguments for the batch: the
    groups, and the layout and lengths (packed documents: the shard's varlen plan)."""
    if shard.varlen is not None:
        return dict(settings.group_kwargs(), varlen=shard.varlen)
    return dict(settings.group_kwargs(), layout=settings.dense_layout, seq_lens=list(shard.seq_lens))


def _shard_of(describe: str, kwargs: dict, settings: SequenceParallelism) -> SequenceShard:
    """The batch's SequenceShard (shard_batch's), checked to be for these settings and
    unpacked."""
    shard = kwargs.get("sequence_shard")
    if not isinstance(shard, SequenceShard):
        raise ValueError(f"{describe}: sequence-parallel Inkling 2 needs the batch made by shard_batch (its "
                         "'sequence_shard' entry gives every rank's length)")  # fmt: skip
    if shard.parallelism != settings:
        raise ValueError(f"{describe}: the batch was sharded for {shard.parallelism}, the model runs {settings}: "
                         "pass shard_batch the mode, layout and groups given to apply()")  # fmt: skip
    return shard


def attention(describe, module, query, key, value, mask, scaling, dropout, kwargs, settings) -> torch.Tensor:
    """The attention-interface call of a module install() marked.

    "layers" (the block attention residual): transformers' eager attention of each
    token's query over its layers' states, local: query (B, S_local, n, hidden), key,
    value (B, S_local, L, hidden) -> (B, n, S_local, hidden), as eager returns it.
    "sequence": query (B, H, S_local, D), key, value (B, H_kv, S_local, D), the
    DistanceBias (B, H, S_local, rel_extent) as position_bias, sinks (B, H, S_local, 1);
    -> (B, S_local, H, D). Ulysses: one all-to-all brings each rank the whole sequence
    for its share of the heads (key and value repeated to H heads first, so any head
    count splits), the attention runs there as transformers' eager attention computes it
    (scores, bias, mask, the sink as one more logit of zero value: memory
    (B, H / P, S, S)), and a second all-to-all brings the output back. Ring, USP and
    packed documents in any mode: relative_bias_attention on this rank's rows
    (_ring_attention; Ulysses' group then runs it as a ring)."""
    role = getattr(module, ROLE_ATTRIBUTE)
    if role == "layers":
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, None, scaling=scaling, dropout=dropout)[0]
    bias, sinks = kwargs.get("position_bias"), kwargs.get("sinks")
    if running_step() is not None:
        raise ValueError(f"{describe}: generate over a sharded cache is not served for Inkling 2 (its convolution "
                         "states and per-query bias); generate from the model in one process")  # fmt: skip
    if dropout and module.training:
        raise ValueError(f"{describe}: attention dropout {dropout} while training is not supported")
    if not isinstance(bias, DistanceBias):
        raise ValueError(f"{describe}: position_bias must be the DistanceBias of the layer's relative_position_bias "
                         f"as apply() set it up, got {type(bias).__name__}")  # fmt: skip
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{describe}: query {tuple(query.shape)} and key {tuple(key.shape)} differ in length (a KV "
                         "cache?): pass use_cache=False")  # fmt: skip
    if mask.chunk_size is not None:
        raise ValueError(f"{describe}: chunked attention with a relative position bias is not served")
    shard = _shard_of(describe, kwargs, settings)
    batch, heads, rows, head_dim = query.shape
    extent = bias.logits.shape[-1]
    if sinks is None or tuple(sinks.shape) != (batch, heads, rows, 1) or tuple(bias.logits.shape[:3]) != (
            batch, heads, rows):  # fmt: skip
        raise ValueError(f"{describe}: sinks must be (B, H, S_local, 1) = {(batch, heads, rows, 1)} and the bias "
                         f"logits (B, H, S_local, rel_extent), got {None if sinks is None else tuple(sinks.shape)} "
                         f"and {tuple(bias.logits.shape)}")  # fmt: skip
    if settings.mode != "ulysses" or shard.varlen is not None:
        return _ring_attention(describe, module, query, key, value, mask, scaling, bias, sinks, shard, settings)
    if list(shard.seq_lens) != [len(piece) for piece in torch.arange(sum(shard.seq_lens)).tensor_split(
            len(shard.seq_lens))]:  # fmt: skip
        raise ValueError(f"{describe}: pieces of {list(shard.seq_lens)} tokens; Ulysses' all-to-all returns the "
                         "output in even pieces (torch.tensor_split's)")  # fmt: skip
    groups = heads // key.shape[1]
    # (B, H, S_local, x) -> (B, S_local, H, x), packed along the last dim for one all-to-all.
    packed = torch.cat([query, key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1),
                        bias.logits.to(query.dtype), sinks.to(query.dtype)], dim=-1).transpose(1, 2)  # fmt: skip
    group = settings.group_kwargs()["group"]
    whole = all_to_all_reshard(packed, scatter_dim=2, gather_dim=1, group=group, gather_sizes=shard.seq_lens)
    q, k, v, logits, sink = whole.split([head_dim, head_dim, head_dim, extent, 1], dim=-1)  # (B, S, h, x)
    total = whole.shape[1]
    positions = torch.arange(total, device=query.device)
    distance = positions[:, None] - positions[None, :]  # (S, S): query row - key row
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scaling
    gathered = logits.transpose(1, 2).gather(-1, distance.clamp(0, extent - 1).expand(*scores.shape))
    scores = scores + gathered.masked_fill((distance < 0) | (distance >= extent), 0.0)
    scores = scores.masked_fill(~_allowed(mask, distance), torch.finfo(scores.dtype).min)
    combined = torch.cat([scores, sink.transpose(1, 2)], dim=-1).float()
    probabilities = torch.softmax(combined, dim=-1)[..., :-1].to(q.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", probabilities, v)  # (B, S, h, D)
    return all_to_all_reshard(out, scatter_dim=1, gather_dim=2, group=group)  # (B, S_local, H, D)


def _ring_attention(describe, module, query, key, value, mask, scaling, bias, sinks, shard, settings):
    """The "sequence" role in modes ring and usp, and for packed documents in mode
    ulysses: query (B, H, S_local, D), key, value (B, H_kv, S_local, D) -> (B, S_local,
    H, D) through relative_bias_attention, over the ring (or Ulysses) group, or under
    USP over the grid group apply() made."""
    left, right = mask.window
    if not mask.causal or right not in (-1, 0):
        raise ValueError(f"{describe}: a relative position bias is served under causal masks (a window to the "
                         f"left at most) in mode {settings.mode!r}, got causal={mask.causal}, "
                         f"window={mask.window}")  # fmt: skip
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, S_local, heads, D)
    runs = SequenceRuns.of(describe, q, **_where(settings, shard), inputs=(k, v, bias.logits, sinks))
    grid = getattr(module, GRID_ATTRIBUTE, None)
    if settings.mode == "usp":
        if grid is None or grid.group_names != settings.group_names:
            raise ValueError(f"{describe}: the model runs {settings}, but apply() set up its layers for another "
                             "grid: apply the model again with these groups")  # fmt: skip
        group_name, pieces = grid.group.group_name, grid.pieces
    else:
        info = resolve_group(settings.group_kwargs()["group"])
        group_name, pieces = info.name, range(info.world_size)
    return relative_bias_attention(q, k, v, bias.logits, sinks.squeeze(-1), scale=scaling, window_left=left,
                                   runs=runs, group_name=group_name, group_pieces=list(pieces),
                                   step_backend=settings.step_backend)  # fmt: skip


def _allowed(mask, distance: torch.Tensor) -> torch.Tensor:
    """(S, S) bool: the keys each query attends under the layer's mask (causal, window)."""
    left, right = mask.window
    allowed = distance >= 0 if mask.causal else torch.ones_like(distance, dtype=torch.bool)
    if left >= 0:
        allowed = allowed & (distance <= left)
    if right >= 0 and not mask.causal:
        allowed = allowed & (-distance <= right)
    return allowed
