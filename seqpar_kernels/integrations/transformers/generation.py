"""model.generate over a KV cache sharded across ranks (transformers 5.x generate).

After apply(model, mode, ...), `model.generate(...)` called on every rank with the same
full inputs returns the same result on every rank, what one process returns. How:

    prefill  the prompt's real tokens (left padding dropped) packed into one row of
             documents, one per sequence, sharded as in training (a varlen plan on the
             model's groups and layout); the attention runs the training path, and each
             rank's cache keeps the keys and values of the tokens it holds. Every
             sequence's last token's logits are summed over the ranks (the rank holding it
             gives them, the others zeros): the logits generate reads, on every rank.
    decode   the new tokens (the same on every rank) run on every rank; their attention is
             the partial attention over each rank's cached keys merged by lse across the
             ranks (parallel/inference.py); each step's keys and values are kept by one
             rank, the ranks taking turns, so that the shards stay even.

The cache generate sees is a ShardedCache (a transformers Cache): layers[i].keys hold
this rank's tokens only, (batch, kv_heads, capacity, head_dim), row b's first lengths[b]
valid, at global positions positions[b] (each sequence's own, from 0 at its first real
token); get_seq_length() is the padded length generate counts.

Hooks on the model (installed by apply): a pre-hook rewrites each call's inputs (the
prefill's shard, the decode step's positions, the ShardedCache in place of generate's
own), a hook on the output gives generate its logits and the cache; the attention
functions read the running step (running_step()).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import transformers
from transformers import cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from seqpar_kernels.layouts import tensor_split_sizes
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.training import SequenceShard
from seqpar_kernels.parallel.varlen import varlen_plan

__all__ = ["ShardedCache", "install", "running_step"]


class _NoRecurrentCacheLayers:
    """Stands for transformers' recurrent cache layers where a release has none (older
    than 5: install() leaves their generate alone); no layer is one."""


# Releases without recurrent cache layers still import this module.
LinearAttentionCacheLayerMixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", _NoRecurrentCacheLayers)
LinearAttentionLayer = getattr(cache_utils, "LinearAttentionLayer", CacheLayerMixin)


# ----------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------


class ShardedLayer(CacheLayerMixin):
    """One layer's keys and values of this rank's tokens: (batch, kv_heads, capacity,
    head_dim), the rows' tokens as their ShardedCache's lengths and positions say."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: ShardedCache):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, head_dim = key_states.shape
        # The cache's sequences: a prefill's keys come packed in one row.
        batch, capacity = self.cache.real_lengths.shape[0], self.cache.capacity
        self.keys = key_states.new_zeros((batch, heads, capacity, head_dim))
        self.values = value_states.new_zeros((batch, value_states.shape[1], capacity, value_states.shape[-1]))
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Keeps this rank's share of the running step's tokens; returns what the
        attention reads: the prefill's keys and values as they are (the training path),
        the decode step's this rank's whole shard (its keys then padding)."""
        step = self.cache.step
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._grow(self.cache.capacity)
        if step.kind == "prefill":
            # Packed (1, kv_heads, S_local, D) -> each token's row and slot.
            rows, slots = step.rows, step.slots
            self.keys[rows, :, slots] = key_states[0].transpose(0, 1).to(self.keys.dtype)
            self.values[rows, :, slots] = value_states[0].transpose(0, 1).to(self.values.dtype)
            return key_states, value_states
        if step.kind == "chunk":
            # This rank's piece (B, kv_heads, C_r, D) after each row's cached tokens; the attention
            # reads the cache as it was (step.cache_lengths) and the piece apart.
            pieces = key_states.shape[2]
            slots = step.slots[:, None] + torch.arange(pieces, device=key_states.device)  # (B, C_r)
            rows = torch.arange(key_states.shape[0], device=key_states.device)[:, None]
            self.keys[rows, :, slots] = key_states.transpose(1, 2).to(self.keys.dtype)
            self.values[rows, :, slots] = value_states.transpose(1, 2).to(self.values.dtype)
            return key_states, value_states
        if step.kept:
            slot = step.slots  # (batch,): each row's next slot
            rows = torch.arange(key_states.shape[0], device=key_states.device)
            self.keys[rows, :, slot] = key_states[:, :, -1].to(self.keys.dtype)
            self.values[rows, :, slot] = value_states[:, :, -1].to(self.values.dtype)
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        if self.keys.shape[2] < capacity:
            grow = capacity - self.keys.shape[2]
            self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, grow))
            self.values = torch.nn.functional.pad(self.values, (0, 0, 0, grow))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.seen

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("ShardedCache: beam search reorders the cache by sequence; it is not supported (num_beams=1)")


class ShardedStateLayer(LinearAttentionLayer):
    """A recurrent mixer's states (its convolution's last inputs, its recurrence's state),
    the same on every rank: the prompt's final states come from the sequence-parallel
    op's (return_final_states: every sequence's, on every rank), the decode steps update
    them on every rank alike (transformers' own single-token functions)."""

    # Never compiled as a static cache: generate then builds no mask tensor of the padded batch.
    is_compileable = False

    def __init__(self, cache: ShardedCache, **kwargs):
        super().__init__(**kwargs)
        self.cache = cache

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        # The prompt's inputs as they are (this rank's, packed): its convolution is the
        # sequence-parallel one, which keeps each sequence's last inputs (keep_conv_state).
        if self.cache.step is not None and self.cache.step.kind == "prefill":
            return conv_states
        return super().update_conv_state(conv_states, state_idx, conv_kernel_size, **kwargs)

    def keep_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0) -> None:
        """Every sequence's last kernel inputs (sequences, channels, kernel) after the prompt."""
        self.lazy_initialization(conv_states=conv_states, state_idx=state_idx)
        self.conv_states[state_idx].copy_(conv_states)
        self.has_previous_state[state_idx] = True


class ShardedAttentionAndStateLayer(ShardedStateLayer, ShardedLayer):
    """A layer with attention and a recurrent mixer side by side (Falcon-H1)."""

    def __init__(self, cache: ShardedCache, **kwargs):
        ShardedLayer.__init__(self, cache)
        ShardedStateLayer.__init__(self, cache, **kwargs)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # the attention's keys and values
            ShardedLayer.lazy_initialization(self, *args)
        else:
            ShardedStateLayer.lazy_initialization(self, **kwargs)


@dataclass
class Step:
    """What the running call does with the cache.

    kind    "prefill" (the prompt, packed and sharded), "decode" (new tokens on every
            rank) or "chunk" (a next turn's tokens over the cache, each rank a piece)
    rows, slots   prefill: each local token's row and slot; decode: each row's slot for
                  the step's token (when kept)
    kept    decode: whether this rank keeps the step's keys and values
    query_positions  decode: (batch, new tokens) each new token's position
    last_local, last_rows  prefill and chunk: the local rows of the sequences' last
                  tokens held here, and their sequences (whose next-token logits this
                  rank gives)
    cache_lengths, cache_rows  chunk: this rank's cache before the chunk (each row's
                  tokens, the rows in use)
    chunk_seq_lens, cache_seq_lens  chunk: every rank's piece of the chunk and rows in use
    new_columns   the columns generate counts for the call, added to the cache's seen
                  once the call is done (the model reads the count before it while it runs)"""

    kind: str
    rows: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    kept: bool = False
    query_positions: torch.Tensor | None = None
    last_local: torch.Tensor | None = None
    last_rows: torch.Tensor | None = None
    cache_lengths: torch.Tensor | None = None
    cache_rows: int = 0
    chunk_seq_lens: list[int] | None = None
    cache_seq_lens: list[int] | None = None
    new_columns: int = 0


class ShardedCache(Cache):
    """A transformers Cache whose layers hold this rank's tokens only (ShardedLayer).

    parallelism  the model's SequenceParallelism (whose ranks share the sequences)
    lengths      (batch,) int64: the tokens row b holds on this rank
    positions    (batch, capacity) int64: their positions in the sequence (from 0 at its
                 first real token)
    real_lengths (batch,) int64: every sequence's tokens so far, over all ranks
    seen         the padded length generate counts (the prompt's columns, then one a step)
    steps        decode steps run: the step's keys go to piece steps % pieces"""

    def __init__(self, parallelism: SequenceParallelism, config):
        self.parallelism = parallelism
        self.lengths: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.real_lengths: torch.Tensor | None = None
        self.seen = 0
        self.steps = 0
        self.step: Step | None = None
        # The model's own layer kinds (transformers' DynamicCache of its config): attention,
        # recurrent states, or both.
        layers = []
        for layer in DynamicCache(config=config).layers:
            states = isinstance(layer, LinearAttentionCacheLayerMixin)
            if states:
                options = dict(number_of_states=layer.number_of_states)
                kind = ShardedAttentionAndStateLayer if isinstance(layer, CacheLayerMixin) else ShardedStateLayer
                layers.append(kind(self, **options))
            else:
                layers.append(ShardedLayer(self))
        super().__init__(layers=layers)

    @property
    def capacity(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("ShardedCache: beam search reorders the cache by sequence; it is not supported (num_beams=1)")

    # -- the steps ------------------------------------------------------------------

    def begin_prefill(self, rows: torch.Tensor, positions: torch.Tensor, real_lengths: torch.Tensor, padded: int):
        """This rank's prompt tokens: each one's row (sequence) and position, in local
        order; real_lengths every sequence's prompt length; padded the prompt's columns."""
        batch = real_lengths.shape[0]
        device = real_lengths.device
        self.lengths = torch.bincount(rows, minlength=batch).to(device)
        capacity = int(self.lengths.max()) if rows.numel() else 0
        # Each token's slot: its rank among this rank's tokens of its row (local order is position order).
        order = torch.argsort(rows, stable=True)
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        slots = torch.empty_like(rows)
        slots[order] = torch.arange(rows.numel(), device=device) - starts[rows[order]]
        self.positions = torch.zeros((batch, capacity), dtype=torch.int64, device=device)
        self.positions[rows, slots] = positions
        self.real_lengths = real_lengths.clone()
        self.step = Step("prefill", rows=rows, slots=slots, new_columns=padded)

    def begin_chunk(self, new_tokens: int) -> Step:
        """A next turn of new_tokens tokens a row over the cache: piece p of its
        torch.tensor_split over the pieces is rank p's (kept in its cache)."""
        parallelism = self.parallelism
        sizes = tensor_split_sizes(new_tokens, parallelism.pieces)
        piece = parallelism.piece
        offset, local = sum(sizes[:piece]), sizes[piece]
        device = self.real_lengths.device
        cache_lengths, cache_rows = self.lengths.clone(), int(self.lengths.max()) if self.lengths.numel() else 0
        query_positions = self.real_lengths[:, None] + offset + torch.arange(local, device=device)
        grow = int((self.lengths + local).max()) - self.capacity
        if grow > 0:
            self.positions = torch.nn.functional.pad(self.positions, (0, grow))
        slots = self.lengths.clone()
        rows = torch.arange(self.positions.shape[0], device=device)[:, None]
        self.positions[rows, slots[:, None] + torch.arange(local, device=device)] = query_positions
        self.lengths = self.lengths + local
        self.real_lengths = self.real_lengths + new_tokens
        held = local > 0 and offset + local == new_tokens  # this rank holds the chunk's last token
        step = Step("chunk", slots=slots, query_positions=query_positions, cache_lengths=cache_lengths,
                    cache_rows=cache_rows, chunk_seq_lens=list(sizes),
                    cache_seq_lens=parallelism.gather_ints([cache_rows], device),
                    last_local=torch.tensor([local - 1] if held else [], dtype=torch.int64, device=device),
                    last_rows=torch.arange(self.positions.shape[0], device=device) if held else None,
                    new_columns=new_tokens)  # fmt: skip
        self.step = step
        return step

    def begin_decode(self, new_tokens: int) -> Step:
        """A decode step of new_tokens tokens a row (the same on every rank)."""
        if new_tokens != 1:
            raise ValueError(f"ShardedCache: decode steps of one token a sequence; got {new_tokens}")
        query_positions = self.real_lengths[:, None].clone()
        kept = self.steps % self.parallelism.pieces == self.parallelism.piece
        slots = self.lengths.clone()
        if kept:
            self.positions = torch.nn.functional.pad(self.positions, (0, 1)) if bool(
                (self.lengths >= self.capacity).any()) else self.positions  # fmt: skip
            self.positions[torch.arange(self.positions.shape[0]), slots] = query_positions[:, 0]
            self.lengths = self.lengths + 1
        self.real_lengths = self.real_lengths + 1
        self.steps += 1
        self.step = Step("decode", slots=slots, kept=kept, query_positions=query_positions, new_columns=1)
        return self.step


# ----------------------------------------------------------------------------------
# The running step, for the attention functions
# ----------------------------------------------------------------------------------

_running = threading.local()


def running_step() -> ShardedCache | None:
    """The ShardedCache of the model call running on this thread, or None."""
    return getattr(_running, "cache", None)


@dataclass
class _Hooks:
    parallelism: SequenceParallelism
    handles: list = field(default_factory=list)


def install(model: torch.nn.Module, parallelism: SequenceParallelism) -> None:
    """The generation hooks on model (a transformers causal LM), replacing earlier ones.
    transformers 5 and newer (its generate's cache argument); with older releases a
    generate over a cache raises in the attention (a KV cache)."""
    for handle in getattr(model, "seqpar_generation_hooks", ()):
        handle.remove()
    model.seqpar_generation_hooks = ()
    if int(transformers.__version__.split(".")[0]) < 5:
        return
    config = model.config

    def before(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if not isinstance(cache, Cache) or module.training:
            _running.cache = None
            return None
        return _prepare(module, kwargs, cache, parallelism, config)

    def after(module, args, kwargs, output):
        cache = running_step()
        _running.cache = None
        if cache is None or output is None:  # not generating, or the call raised
            return output
        return _finish(cache, output)

    model.seqpar_generation_hooks = (
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True, always_call=True),
    )


def _prepare(model, kwargs: dict, cache: Cache, parallelism: SequenceParallelism, config):
    """The call's inputs rewritten for its step (prefill or decode)."""
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError("generate over a sharded cache: pass input_ids, not inputs_embeds")
    input_ids = kwargs["input_ids"]
    if not isinstance(cache, ShardedCache):
        if cache.get_seq_length() > 0:
            raise ValueError(
                f"generate over a sharded cache: got a {type(cache).__name__} holding "
                f"{cache.get_seq_length()} tokens; pass back the ShardedCache a sequence-parallel generate returned"
            )
        cache = ShardedCache(parallelism, config)
    elif cache.parallelism != parallelism:
        raise ValueError(f"generate: the cache was made for {cache.parallelism}, the model runs {parallelism}")
    kwargs = {key: value for key, value in kwargs.items() if key != "past_key_values"}
    kwargs["cache"] = cache
    _check_same_tokens(input_ids, parallelism)
    if cache.seen == 0:
        kwargs.update(_prefill(cache, input_ids, kwargs.get("attention_mask"), parallelism))
    elif input_ids.shape[1] > 1:
        if parallelism.mode == "usp":
            raise ValueError("generate over a sharded cache: a next turn over the cache runs on one group (ulysses, "
                             "ring), not on USP's grid")  # fmt: skip
        step = cache.begin_chunk(input_ids.shape[1])
        offset, local = sum(step.chunk_seq_lens[: parallelism.piece]), step.chunk_seq_lens[parallelism.piece]
        kwargs.update(input_ids=input_ids[:, offset : offset + local], position_ids=step.query_positions,
                      attention_mask=None, logits_to_keep=step.last_local)  # fmt: skip
    else:
        step = cache.begin_decode(input_ids.shape[1])
        kwargs.update(position_ids=step.query_positions, attention_mask=None)
    _running.cache = cache
    return (), kwargs


def _check_same_tokens(input_ids: torch.Tensor, parallelism: SequenceParallelism) -> None:
    """Raises ValueError on every rank unless every rank passed the same input_ids: one
    all-reduce of 2 x batch values per call (ranks whose samplers draw differently would
    otherwise go on with different sequences)."""
    sums = input_ids.to(torch.float64) @ torch.arange(1, input_ids.shape[1] + 1, device=input_ids.device,
                                                       dtype=torch.float64)  # fmt: skip
    extremes = torch.cat([sums, -sums])  # (2 batch,) max then -min over the ranks
    for group in parallelism.groups():
        if group is not None:
            torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX, group=group)
    if not torch.equal(extremes[: sums.shape[0]], -extremes[sums.shape[0] :]):
        raise ValueError(
            "generate over a sharded cache: the ranks were given different tokens (sampling: seed every rank "
            "alike, torch.manual_seed(seed), before generate)"
        )


def _prefill(cache: ShardedCache, input_ids: torch.Tensor, attention_mask, parallelism: SequenceParallelism) -> dict:
    """The prompt's real tokens packed into one row (one document a sequence), this
    rank's piece of it: the model's inputs for the prefill."""
    batch, columns = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(torch.bool)
    if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
        raise ValueError("generate over a sharded cache: pad on the left (tokenizer.padding_side = 'left')")
    real_lengths = attention_mask.sum(1)
    if bool((real_lengths == 0).any()):
        raise ValueError("generate over a sharded cache: a sequence of the batch has no token")
    packed = input_ids[attention_mask]  # (N,) the rows' real tokens, row after row
    bounds = [0, *torch.cumsum(real_lengths, 0).tolist()]
    plan = varlen_plan(bounds, layout=parallelism.layout, device=input_ids.device, **parallelism.group_kwargs())
    positions = plan.position_ids[0].to(input_ids.device)  # (S_local,) within each sequence
    global_rows = plan.split(torch.arange(bounds[-1], device=input_ids.device), dim=0)
    rows = torch.bucketize(global_rows, torch.tensor(bounds[1:], device=input_ids.device), right=True)
    cache.begin_prefill(rows, positions, real_lengths, columns)
    # The logits of each sequence's last token held here, for generate's next token.
    last = torch.tensor(bounds[1:], device=input_ids.device) - 1
    held = torch.isin(global_rows, last)
    cache.step.last_local = torch.nonzero(held).flatten()
    cache.step.last_rows = rows[held]
    local_ids = plan.split(packed[None], dim=1)
    shard = SequenceShard(parallelism, tuple(plan.seq_lens), plan, False)
    return dict(input_ids=local_ids, position_ids=positions[None], attention_mask=None, sequence_shard=shard,
                logits_to_keep=cache.step.last_local)  # fmt: skip


def _finish(cache: ShardedCache, output):
    """generate's view of the call: every sequence's next-token logits on every rank
    (batch, 1, vocab), and the ShardedCache."""
    step = cache.step
    cache.seen += step.new_columns
    if step.kind in ("prefill", "chunk"):
        # prefill: (1, sequences ending here, vocab); chunk: (batch, 1 or 0, vocab)
        local = output.logits[0] if step.kind == "prefill" else output.logits[:, -1] if output.logits.shape[1] else None
        logits = output.logits.new_zeros((cache.real_lengths.shape[0], output.logits.shape[-1]))
        if local is not None and step.last_rows is not None:
            logits[step.last_rows] = local
        for group in cache.parallelism.groups():
            if group is not None:
                torch.distributed.all_reduce(logits, group=group)
        output.logits = logits[:, None]
    if "cache" in output:
        output.cache = cache
    else:
        output.past_key_values = cache
    return output
