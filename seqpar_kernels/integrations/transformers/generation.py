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
             ranks (parallel/inference.py); each sequence's new key and value are kept
             by the rank holding the fewest tokens, so that no rank holds more than
             its share.

The cache generate sees is a ShardedCache (a transformers Cache): layers[i].keys hold
this rank's tokens only, packed in one row, (1, kv_heads, slots, head_dim), slot s of
sequence rows[s] at its position positions[s] (each sequence's own, from 0 at its first
real token); the attention reads them through a (batch, width) index of each sequence's
slots (Step.index), gathered a layer at a time. get_seq_length() is the padded length
generate counts.

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
    """One layer's keys and values of this rank's tokens, packed in one row: (1,
    kv_heads, slots, head_dim), slot s holding the token its ShardedCache's rows[s] and
    positions[s] say (no padding: a rank's memory is its tokens)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: ShardedCache):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = key_states.new_zeros((1, key_states.shape[1], 0, key_states.shape[-1]))
        self.values = value_states.new_zeros((1, value_states.shape[1], 0, value_states.shape[-1]))
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Keeps this rank's share of the running step's tokens; returns what the
        attention reads: the prefill's and a next turn's keys and values as they are,
        a decode step's this rank's whole shard gathered by sequence,
        (batch, kv_heads, width, head_dim) (Step.index)."""
        step = self.cache.step
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if step.kind == "prefill":
            # Packed (1, kv_heads, S_local, D): the tokens in the cache's slot order already.
            self._append(key_states, value_states)
            return key_states, value_states
        if step.kind == "chunk":
            # Every rank's piece (B, kv_heads, C_p, D) -> the chunk's (B, kv_heads, N, D): this rank
            # keeps the tokens step.kept_rows / kept_columns name (its share), whoever computed them.
            chunk = (self.cache.parallelism.gather_consecutive(x, 2, step.chunk_seq_lens)
                     for x in (key_states, value_states))  # fmt: skip
            self._append(*(x[step.kept_rows, :, step.kept_columns].transpose(0, 1).unsqueeze(0) for x in chunk))
            return key_states, value_states
        if step.kept_rows.numel():
            self._append(*(x[step.kept_rows, :, -1].transpose(0, 1).unsqueeze(0) for x in (key_states, value_states)))
        return tuple(x.transpose(1, 2) for x in self.gathered(step.index))

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Adds (1, kv_heads, n, D) keys and values as the next n slots."""
        self.keys = torch.cat([self.keys, keys.to(self.keys.dtype)], 2)
        self.values = torch.cat([self.values, values.to(self.values.dtype)], 2)

    def gathered(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the slots index (batch, width) names: (batch, width,
        kv_heads, head_dim) each, a copy (a row's entries past its length are slot 0:
        padding the attention does not read)."""
        return tuple(x[0].transpose(0, 1)[index] for x in (self.keys, self.values))

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
    index, cache_positions, cache_lengths   decode: this rank's cache, the step's kept
                  tokens included, as the attention reads it (batch, width): each row's
                  slots, their positions, the count of each row's slots; chunk: the
                  cache before the chunk, the same way
    kept_rows, kept_columns   decode: the rows whose new key and value this rank
                  keeps; chunk: the (row, column) of each chunk token it keeps
    query_positions  decode and chunk: (batch, new tokens here) each new token's position
    last_local, last_rows  prefill and chunk: the local rows of the sequences' last
                  tokens held here, and their sequences (whose next-token logits this
                  rank gives)
    chunk_seq_lens, cache_seq_lens  chunk: every rank's piece of the chunk and cache
                  width, in piece order
    new_columns   the columns generate counts for the call, added to the cache's seen
                  once the call is done (the model reads the count before it while it runs)"""

    kind: str
    index: torch.Tensor | None = None
    cache_positions: torch.Tensor | None = None
    cache_lengths: torch.Tensor | None = None
    kept_rows: torch.Tensor | None = None
    kept_columns: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    last_local: torch.Tensor | None = None
    last_rows: torch.Tensor | None = None
    chunk_seq_lens: list[int] | None = None
    cache_seq_lens: list[int] | None = None
    new_columns: int = 0


class ShardedCache(Cache):
    """A transformers Cache whose layers hold this rank's tokens only, packed
    (ShardedLayer).

    parallelism  the model's SequenceParallelism (whose ranks share the sequences)
    rows         (slots,) int64: the sequence of each slot of this rank's layers
    positions    (slots,) int64: its position in the sequence (from 0 at its first real token)
    lengths      (batch,) int64: the slots of each sequence on this rank
    real_lengths (batch,) int64: every sequence's tokens so far, over all ranks
    loads        every rank's slot count, in piece order (the same on every rank)
    seen         the padded length generate counts (the prompt's columns, then one a step)

    Memory: every rank holds at most ceil(batch x seen / P) + 1 slots a layer (share()),
    where batch x seen is one process's cache (transformers' (batch, kv_heads, seen,
    head_dim), left padding included), after a next turn too: each new token is kept by
    the rank then holding the fewest, whichever rank computed it."""

    def __init__(self, parallelism: SequenceParallelism, config):
        self.parallelism = parallelism
        self.rows: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.real_lengths: torch.Tensor | None = None
        self.loads: list[int] = []
        self.seen = 0
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
    def slots(self) -> int:
        """The tokens this rank holds (each attention layer's keys and values hold as many)."""
        return 0 if self.positions is None else self.positions.shape[0]

    def share(self) -> int:
        """The most slots a layer any rank may hold: ceil(batch x seen / P) + 1."""
        batch = 0 if self.real_lengths is None else self.real_lengths.shape[0]
        return -(-batch * self.seen // self.parallelism.pieces) + 1

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("ShardedCache: beam search reorders the cache by sequence; it is not supported (num_beams=1)")

    # -- the steps ------------------------------------------------------------------

    def begin_prefill(self, rows: torch.Tensor, positions: torch.Tensor, real_lengths: torch.Tensor, padded: int,
                      loads: list[int]) -> None:  # fmt: skip
        """This rank's prompt tokens: each one's row (sequence) and position, in local
        order; real_lengths every sequence's prompt length; padded the prompt's columns;
        loads every rank's token count."""
        self.rows, self.positions = rows.clone(), positions.clone()
        self.lengths = torch.bincount(rows, minlength=real_lengths.shape[0])
        self.real_lengths = real_lengths.clone()
        self.loads = list(loads)
        self.step = Step("prefill", new_columns=padded)

    def begin_chunk(self, new_tokens: int) -> Step:
        """A next turn of new_tokens tokens a row over the cache: piece p of a
        torch.tensor_split of the columns is rank p's to compute; each token's keys and
        values are kept by the rank then holding the fewest tokens (a decode step's rule,
        token by token), so that every rank stays within its share."""
        parallelism = self.parallelism
        batch = self.real_lengths.shape[0]
        sizes = tensor_split_sizes(new_tokens, parallelism.pieces)
        piece = parallelism.piece
        offset, local = sum(sizes[:piece]), sizes[piece]
        device = self.real_lengths.device
        index, cache_positions = self._by_row()
        query_positions = self.real_lengths[:, None] + offset + torch.arange(local, device=device)  # (B, C_r)
        cache_lengths = self.lengths.clone()
        kept = [(row, column) for column in range(new_tokens) for row in range(batch) if self._keeps()]
        kept_rows, kept_columns = torch.tensor(kept, dtype=torch.int64, device=device).reshape(-1, 2).unbind(1)
        self._add(kept_rows, self.real_lengths[kept_rows] + kept_columns)
        self.real_lengths = self.real_lengths + new_tokens
        held = local > 0 and offset + local == new_tokens  # this rank holds the chunk's last token
        step = Step("chunk", index=index, cache_positions=cache_positions, cache_lengths=cache_lengths,
                    kept_rows=kept_rows, kept_columns=kept_columns, query_positions=query_positions,
                    chunk_seq_lens=sizes,
                    cache_seq_lens=parallelism.gather_ints([index.shape[1]], device),
                    last_local=torch.tensor([local - 1] if held else [], dtype=torch.int64, device=device),
                    last_rows=torch.arange(batch, device=device) if held else None,
                    new_columns=new_tokens)  # fmt: skip
        self.step = step
        return step

    def begin_decode(self, new_tokens: int) -> Step:
        """A decode step of new_tokens tokens a row (the same on every rank): each row's
        key goes to the rank holding the fewest tokens then (the lowest piece on a tie)."""
        if new_tokens != 1:
            raise ValueError(f"ShardedCache: decode steps of one token a sequence; got {new_tokens}")
        query_positions = self.real_lengths[:, None].clone()
        kept = [row for row in range(query_positions.shape[0]) if self._keeps()]
        kept_rows = torch.tensor(kept, dtype=torch.int64, device=query_positions.device)
        self._add(kept_rows, query_positions[kept_rows, 0])
        self.real_lengths = self.real_lengths + 1
        index, cache_positions = self._by_row()
        self.step = Step("decode", index=index, cache_positions=cache_positions, cache_lengths=self.lengths.clone(),
                         kept_rows=kept_rows, query_positions=query_positions, new_columns=1)  # fmt: skip
        return self.step

    def _keeps(self) -> bool:
        """Gives one new token to the rank holding the fewest (the lowest piece on a tie),
        the same choice on every rank; whether it is this rank."""
        rank = min(range(len(self.loads)), key=self.loads.__getitem__)
        self.loads[rank] += 1
        return rank == self.parallelism.piece

    def _add(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """New slots after the last: their rows and positions."""
        self.rows = torch.cat([self.rows, rows])
        self.positions = torch.cat([self.positions, positions])
        self.lengths = self.lengths + torch.bincount(rows, minlength=self.lengths.shape[0])

    def _by_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(index, positions) (batch, width): row b's slots in slot order, and their
        positions, then slot 0 (padding: past lengths[b]); width the most a row has."""
        batch, device = self.lengths.shape[0], self.lengths.device
        width = int(self.lengths.max()) if self.slots else 0
        order = torch.argsort(self.rows, stable=True)  # the slots row by row
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        columns = torch.arange(width, device=device)
        exists = columns < self.lengths[:, None]
        index = torch.zeros((batch, width), dtype=torch.int64, device=device)
        index[exists] = order[(starts[:, None] + columns)[exists]]
        return index, torch.where(exists, self.positions[index] if self.slots else index, 0)


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
    if max(plan.seq_lens) > -(-batch * columns // parallelism.pieces) + 1:
        # The balanced layout evens the causal work, not the tokens: the contiguous one
        # holds at most ceil(N / P) a rank, within the cache's share (ShardedCache).
        plan = varlen_plan(bounds, layout="contiguous", device=input_ids.device, **parallelism.group_kwargs())
    positions = plan.position_ids[0].to(input_ids.device)  # (S_local,) within each sequence
    global_rows = plan.split(torch.arange(bounds[-1], device=input_ids.device), dim=0)
    rows = torch.bucketize(global_rows, torch.tensor(bounds[1:], device=input_ids.device), right=True)
    cache.begin_prefill(rows, positions, real_lengths, columns, plan.seq_lens)
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
