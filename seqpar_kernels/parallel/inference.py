"""Attention over a KV cache sharded across ranks, for inference: each rank holds some of
every sequence's cached keys and values, at any positions.

    decode_attention(q, k_cache, v_cache, q_positions=, cache_positions=, cache_lengths=)
        the new queries (the same on every rank) over every rank's cache: this rank's
        partial, one gather of the partials per group, their merge
    prefill_attention(q, k, v, k_cache, v_cache, q_positions=, cache_positions=, cache_lengths=)
        a new chunk, sharded across the ranks, over every rank's cache and the chunk's own
        keys: pass-KV (K/V travel a ring) or pass-Q (the queries travel, partials come back)
    decode_attention_partial(...) / merge_attention_partials(outs, lses)
        the local part and the merge on plain tensors, for serving engines that run
        their own collective

Conventions (the ones serving engines get wrong when they merge by hand):
    - a partial is fp32 (out (B, Tq, H, D), lse (B, H, Tq)), lse the NATURAL-log
      log-sum-exp of the scaled (and capped) scores; a base-2 reducer must convert it
      (lse / ln 2) first;
    - a rank, or a sequence of a rank, with no key a query sees gives (out 0, lse -inf):
      the neutral partial, which the merge leaves alone, so empty shards need no care;
    - cache_lengths are PER RANK: cache_lengths[b] keys of sequence b are cached on this
      rank (rows [0, cache_lengths[b]) of its cache), not the sequence's global length;
    - positions are each sequence's own (rotary positions): the mask (causal, windows,
      chunks) compares them, so a rank's keys may sit at any positions, in any order;
    - sinks join once, at the end of the merge, never in a partial;
    - under torch.autocast (any device type) the ops compute as without it: the partials
      and their merge stay fp32 (engine/steps.py inputs_precision).

Inference only: no autograd. An input that requires grad while grad is enabled raises
(call under torch.no_grad() or torch.inference_mode()); the results require no grad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from seqpar_kernels.attention_mask import AttentionMask
from seqpar_kernels.comm.exchange import exchange_blocks
from seqpar_kernels.comm.grid import Grid, reduction_groups
from seqpar_kernels.comm.ring import DoubleBuffer, Ring
from seqpar_kernels.engine.decode import PartialAttention, attend_keys_, merge_partials_
from seqpar_kernels.engine.steps import StepSpec, merge_sinks_
from seqpar_kernels.groups import GroupInfo
from seqpar_kernels.layouts import offsets
from seqpar_kernels.parallel.attention_checks import (
    MAX_HEAD_DIM,
    check_attention_inputs,
    check_sinks,
    check_softcap,
    fold_scale_sign,
    resolve_softmax_scale,
)
from seqpar_kernels.parallel.checks import (
    SUPPORTED_DTYPES,
    CheckedOnEveryRank,
    check_bool,
    check_local_sizes,
    checked_on_grid,
    checked_over_groups,
    debug_checks_on,
)
from seqpar_kernels.parallel.reshard import gather_sequence
from seqpar_kernels.traffic import PASS_KV, PASS_Q, prefill_attention_method

AUTO = "auto"
PREFILL_METHODS = (AUTO, PASS_KV, PASS_Q)

__all__ = [
    "decode_attention",
    "decode_attention_partial",
    "merge_attention_partials",
    "prefill_attention",
    "PREFILL_METHODS",
]


def decode_attention_partial(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    cache_positions: torch.Tensor,
    cache_lengths: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk_size: int | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial attention of the queries over the keys it holds; no
    communication. What a serving engine computes on each rank before its own gather
    and merge_attention_partials.

    q: (batch, Tq, nheads, headdim), the new queries of each sequence (Tq: 1 to a few).
    k_cache, v_cache: (batch, S, nheads_kv, headdim) and (batch, S, nheads_kv, headdim_v)
        (headdim_v may differ: multi-head latent attention), this rank's keys and values, with
        nheads % nheads_kv == 0 (GQA, MQA; read in place, never repeated). One dtype,
        fp32, fp16 or bf16, one device with q.
    q_positions: (batch, Tq) integer, each query's position in its sequence.
    cache_positions: (batch, S) integer, each cached key's position in its sequence.
    cache_lengths: (batch,) integer, this rank's cached keys per sequence: rows
        [0, cache_lengths[b]) of sequence b exist, the rest is padding (never read into
        the result). Per rank, not the sequence's length: 0 <= cache_lengths[b] <= S.
    causal, window_size, attention_chunk_size, softcap, softmax_scale: ring_attention's,
        over the positions (causal: keys at positions <= the query's).
    Returns (out (batch, Tq, nheads, headdim) fp32, lse (batch, nheads, Tq) fp32, natural
    log); a row that sees no key here is (0, -inf). No sinks: they join once, in
    merge_attention_partials. Reads cache_lengths' values (a host sync on GPUs)."""
    call = _check_call(
        "decode_attention_partial", q, q_positions, [_cache_keys(k_cache, v_cache, cache_positions, cache_lengths)],
        causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        attention_chunk_size=attention_chunk_size, softcap=softcap, sinks=None, return_lse=True,
    )  # fmt: skip
    with torch.no_grad():
        q, spec = _folded(q, call)
        partial = _local_partial(q, q_positions, [(k_cache, v_cache, cache_positions, cache_lengths)], call.mask, spec)
        return partial.out.contiguous(), partial.lse.contiguous()


def merge_attention_partials(
    outs: torch.Tensor | Sequence[torch.Tensor],
    lses: torch.Tensor | Sequence[torch.Tensor],
    *,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over every partial's keys, from the partials: no communication.

    outs: (P, batch, Tq, nheads, headdim) or P tensors (batch, Tq, nheads, headdim), fp32,
        fp16 or bf16: each rank's out (decode_attention_partial's, gathered by the caller).
    lses: (P, batch, nheads, Tq) fp32 or P such tensors: their NATURAL-log lse; -inf where
        a partial saw no key (neutral: its out is not read, NaN included).
    sinks: None, or (nheads,) per-head logits in the scores' units: each row's softmax
        denominator gains exp(sinks[h]), once, after the partials merge.
    Any order of the partials gives the same result (to rounding). Returns (out (batch,
    Tq, nheads, headdim) fp32, lse (batch, nheads, Tq) fp32, sinks included); a row no
    partial saw is (0, -inf) (with sinks: (0, sinks[h]))."""
    with torch.no_grad():
        outs, lses = _check_partials(outs, lses, sinks)
        partial = PartialAttention.empty(*outs[0].shape, outs[0].device)
        merge_partials_(partial, outs, lses)
        return _finish(partial, sinks, torch.float32, return_lse=True)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    cache_positions: torch.Tensor,
    cache_lengths: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk_size: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    check_ranks: bool = True,
):
    """Exact attention of the new queries over a KV cache sharded across ranks.

    Every rank passes the same queries (their shapes and the options are checked, not
    their values) and its own keys (the new tokens' keys and values already written into
    the cache of whichever rank stores them). q, k_cache, v_cache,
    q_positions, cache_positions, cache_lengths, causal, softmax_scale, window_size,
    attention_chunk_size, softcap: decode_attention_partial's (cache_lengths per rank;
    0 on a rank that holds none of a sequence).
    group: the ranks sharing the cache (default: the world); or mesh= (a DeviceMesh of
        any shape: its dims in turn), or USP's ulysses_group= and ring_group=.
    sinks: None, or (nheads,) per-head logits, the same on every rank (gpt-oss), merged
        once after the partials.
    check_ranks: run the checks inside one small all-gather per group, so that a bad
        input on any rank raises ValueError on every rank (on NCCL a host sync per call);
        False skips it (a bad input then raises on its own rank only; SEQPAR_DEBUG=1
        turns it back on).
    Returns out (batch, Tq, nheads, headdim) in q's dtype, the same on every rank [, lse
    (batch, nheads, Tq) fp32, natural log, sinks included].

    One collective per group: each rank's fp32 partial (out and lse, packed) gathered
    over the group and merged with seqpar::attention_merge_, then over the next group
    with the merged partials. Bytes per rank (traffic.decode_attention_bytes):
    sum over groups of (size - 1) x batch x Tq x nheads x (headdim + 1) x 4, whatever
    the cache's length."""
    describe = "decode_attention"
    groups = reduction_groups(describe, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                              any_mesh=True)  # fmt: skip
    keys = (k_cache, v_cache, cache_positions, cache_lengths)
    checked: list[_Call] = []

    def local_checks():
        call = _check_call(
            describe, q, q_positions, [_cache_keys(*keys)], causal=causal, softmax_scale=softmax_scale,
            window_size=window_size, attention_chunk_size=attention_chunk_size, softcap=softcap, sinks=sinks,
            return_lse=return_lse,
        )  # fmt: skip
        check_bool("check_ranks", check_ranks)
        checked.append(call)
        return (call.agreed, q.shape[1])

    if check_ranks is True or debug_checks_on():
        checked_over_groups(describe, groups, q.device if isinstance(q, torch.Tensor) else None, local_checks)
    else:
        local_checks()
    call = checked[0]
    with torch.no_grad():
        q_folded, spec = _folded(q, call)
        partial = _local_partial(q_folded, q_positions, [keys], call.mask, spec)
        for each_group, info in groups:
            if info.world_size > 1:
                gathered = gather_sequence(partial.packed.unsqueeze(0), 0, each_group, sizes=[1] * info.world_size)
                partial = _merged([PartialAttention(each) for each in gathered])
        return _finish(partial, call.sinks, q.dtype, call.return_lse)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    cache_positions: torch.Tensor,
    cache_lengths: torch.Tensor,
    method: str = AUTO,
    group: dist.ProcessGroup | None = None,
    mesh=None,
    ulysses_group: dist.ProcessGroup | None = None,
    ring_group: dist.ProcessGroup | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk_size: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    check_ranks: bool = True,
    chunk_seq_lens: list[int] | None = None,
    cache_seq_lens: list[int] | None = None,
):
    """Exact attention of a new chunk of tokens (a chat's next turn), sharded across the
    ranks, over every rank's cache and the chunk's own keys.

    q: (batch, C_r, nheads, headdim), k, v: (batch, C_r, nheads_kv, headdim[_v]): this rank's
        piece of the chunk (C_r may differ by rank, 0 too; usually contiguous pieces).
    q_positions: (batch, C_r) integer: the positions of this rank's new tokens, queries
        and keys alike (after the cached ones: each sequence's own).
    k_cache, v_cache (batch, S_r, nheads_kv, headdim[_v]), cache_positions, cache_lengths:
        this rank's cache, as decode_attention's (per-rank lengths; S_r may differ by
        rank). Every row given travels under pass-KV: pass the rows in use.
    Every new query attends the keys of every rank's cache and of the whole chunk that its
    mask lets it see by position (causal: those at or before it), under window_size,
    attention_chunk_size, softcap, softmax_scale as ring_attention's; sinks once at the
    end. A batch whose sequences have chunks of different lengths is right-padded:
    padded tokens placed at positions after the real ones are unseen by them (causal).
    method: how the data travels (both exact):
        "pass-kv"  each rank's cached and new K/V (with their positions and lengths)
                   travel a ring (comm/ring.py's double buffer: each block's transfer
                   overlaps the step before); queries stay.
        "pass-q"   the new queries travel (one gather), each rank computes the partials
                   of every rank's queries over its keys, and the partials go back to
                   their owner (one all-to-all), which merges them.
        "auto"     the one that sends fewer bytes over all ranks
                   (traffic.prefill_attention_method: pass-Q when the cache dominates);
                   on a grid, pass-Q.
    group: the ranks sharing the cache (default: the world); or USP's grid, mesh= (a 2-D
        DeviceMesh with dims "ring" and "ulysses") or ulysses_group= and ring_group=,
        whose every rank holds its tokens' keys of every head (a generate's cache under
        USP): pass-Q over the grid, the queries gathered over the Ulysses group then
        the ring group, the partials sent back over the ring group (merged there) then
        the Ulysses group; pass-KV raises there.
    check_ranks: as decode_attention's; the same gather learns every rank's C_r and S_r.
    chunk_seq_lens, cache_seq_lens: every rank's C_r and S_r, in group rank order (a
        grid: piece order, ring index i and Ulysses index j at i * U + j);
        passing both skips that gather (as ring_attention's seq_lens). Without them and
        check_ranks=False, every rank's are taken to be this rank's.
    Returns out (batch, C_r, nheads, headdim) in q's dtype [, lse (batch, nheads, C_r) fp32].

    Bytes per rank: traffic.prefill_attention_bytes (the formulas for both methods)."""
    describe = "prefill_attention"
    levels = reduction_groups(describe, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group)
    grid = Grid(levels[0][0], levels[1][0], levels[0][1], levels[1][1]) if len(levels) == 2 else None
    info = levels[0][1] if grid is None else grid.pieces
    cache = (k_cache, v_cache, cache_positions, cache_lengths)
    given = chunk_seq_lens is not None and cache_seq_lens is not None

    def local_checks():
        check_attention_inputs(q, k, v)
        batch = q.shape[0]
        new_lengths = torch.full((batch,), q.shape[1], dtype=torch.int64, device=q.device)
        call = _check_call(
            describe, q, q_positions, [(("k", "v", "q_positions", None), k, v, q_positions, new_lengths),
                                       _cache_keys(*cache)],
            causal=causal, softmax_scale=softmax_scale, window_size=window_size,
            attention_chunk_size=attention_chunk_size, softcap=softcap, sinks=sinks, return_lse=return_lse,
        )  # fmt: skip
        check_bool("check_ranks", check_ranks)
        if method not in PREFILL_METHODS:
            raise ValueError(f"{describe}: method must be one of {PREFILL_METHODS}, got {method!r:.80}")
        if grid is not None and method == PASS_KV:
            raise ValueError(f"{describe}: method={PASS_KV!r} passes K/V around one group's ring; on USP's grid "
                             f"the chunk runs {PASS_Q!r} (method={AUTO!r} takes it)")  # fmt: skip
        if (chunk_seq_lens is None) != (cache_seq_lens is None):
            raise ValueError(f"{describe}: pass both chunk_seq_lens and cache_seq_lens, or neither")
        sizes = (chunk_seq_lens, cache_seq_lens)
        if given:
            sizes = (
                check_local_sizes(chunk_seq_lens, info, q.shape[1], "chunk_seq_lens", q.shape, 1),
                check_local_sizes(cache_seq_lens, info, k_cache.shape[1], "cache_seq_lens", k_cache.shape, 1),
            )
        return call, new_lengths, sizes

    exchange = check_ranks is True and not given
    if grid is None:
        with CheckedOnEveryRank(describe, info, _device(q), exchange=exchange, extra_count=1) as checks:
            call, new_lengths, sizes = local_checks()
            checks.share(q.shape[1], (call.agreed, method, *sizes), extra=(k_cache.shape[1],))
        chunk_seq_lens, cache_seq_lens = sizes if given else (checks.sizes, [extra[0] for extra in checks.extras])
        level_sizes = [chunk_seq_lens]
    else:

        def grid_checks():
            call, new_lengths, sizes = local_checks()
            return q.shape[1], (call.agreed, method, *sizes), (call, new_lengths)

        (call, new_lengths), row_lens, slot_lens = checked_on_grid(describe, grid, _device(q), exchange, grid_checks)
        if given:
            rows = grid.rows(chunk_seq_lens)
            row_lens, slot_lens = rows[grid.ring.rank], [sum(row) for row in rows]
        # Each level's members' chunk rows: this slot's Ulysses ranks', then every ring slot's.
        level_sizes = [list(row_lens), list(slot_lens)]
    if method == AUTO:
        method = PASS_Q if grid is not None else prefill_attention_method(
            cache_seq_lens, chunk_seq_lens, batch=q.shape[0], num_heads=q.shape[2], num_kv_heads=k.shape[2],
            head_dim=q.shape[3], element_size=q.element_size(), value_dim=v.shape[3],
        )  # fmt: skip
    new = (k, v, q_positions, new_lengths)
    with torch.no_grad():
        q_folded, spec = _folded(q, call)
        if info.world_size == 1:
            partial = _local_partial(q_folded, q_positions, [cache, new], call.mask, spec)
        elif method == PASS_KV:
            partial = _pass_kv(q_folded, q_positions, cache, new, call.mask, spec, info, cache_seq_lens,
                               chunk_seq_lens)  # fmt: skip
        else:
            partial = _pass_q(q_folded, q_positions, cache, new, call.mask, spec, levels, level_sizes)
        return _finish(partial, call.sinks, q.dtype, call.return_lse)


# ----------------------------------------------------------------------------------
# How the prefill's data travels
# ----------------------------------------------------------------------------------


def _pass_kv(
    q, q_positions, cache, new, mask: AttentionMask, spec: StepSpec, info: GroupInfo, cache_seq_lens, chunk_seq_lens
) -> PartialAttention:  # fmt: skip
    """Each rank's block (its cached and new K/V, their positions, its cache's lengths:
    one byte buffer, _kv_block_parts) travels the ring; every rank folds every block into
    its queries' partial. The transfer of the next block overlaps the current one's."""
    batch, _, heads, head_dim = q.shape
    kv_heads, value_dim, dtype = cache[0].shape[2], cache[1].shape[3], cache[0].dtype
    world_size = info.world_size
    parts = [_kv_block_parts(batch, cache_rows, chunk_rows, kv_heads, (head_dim, value_dim), dtype)
             for cache_rows, chunk_rows in zip(cache_seq_lens, chunk_seq_lens)]  # fmt: skip
    held = [(info.rank - step) % world_size for step in range(world_size)]  # whose block each step holds
    sizes = [_byte_count(parts[rank]) for rank in held]
    buffer = torch.empty(max(sizes), dtype=torch.uint8, device=q.device)
    k_cache, v_cache, cache_positions, cache_lengths = cache
    k_new, v_new, new_positions, _ = new
    own = (cache_positions, cache_lengths, new_positions, k_cache, v_cache, k_new, v_new)
    for view, tensor in zip(_byte_views(buffer, parts[info.rank]), own):
        view.copy_(tensor)
    blocks = DoubleBuffer(Ring(info.name), buffer, sizes)
    partial = PartialAttention.empty(batch, q.shape[1], heads, value_dim, q.device)
    for step, rank in enumerate(held):
        if step < world_size - 1:
            blocks.post()
        cache_positions, cache_lengths, new_positions, k_cache, v_cache, k_new, v_new = _byte_views(
            blocks.current, parts[rank]
        )  # fmt: skip
        new_lengths = torch.full((batch,), chunk_seq_lens[rank], dtype=torch.int64, device=q.device)
        for k, v, positions, lengths in ((k_cache, v_cache, cache_positions, cache_lengths),
                                         (k_new, v_new, new_positions, new_lengths)):  # fmt: skip
            attend_keys_(partial, q, q_positions, k, v, positions, lengths, mask, spec)
        if step < world_size - 1:
            blocks.advance()
    return partial


def _kv_block_parts(batch, cache_rows, chunk_rows, kv_heads, head_dims, dtype) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of a pass-KV block's tensors in buffer order: cache positions,
    cache lengths, new positions (int64), then the cache's K, V and the chunk's K, V;
    head_dims: K's and V's. The int64 parts first: every part then starts at a multiple
    of its element size."""
    k, v = ((batch, cache_rows, kv_heads, dim) for dim in head_dims)
    new_k, new_v = ((batch, chunk_rows, kv_heads, dim) for dim in head_dims)
    return [((batch, cache_rows), torch.int64), ((batch,), torch.int64), ((batch, chunk_rows), torch.int64),
            (k, dtype), (v, dtype), (new_k, dtype), (new_v, dtype)]  # fmt: skip


def _byte_count(parts) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in parts)


def _byte_views(buffer: torch.Tensor, parts) -> list[torch.Tensor]:
    """The tensors laid out in the uint8 buffer by `parts`, as views."""
    views, start = [], 0
    for shape, dtype in parts:
        length = math.prod(shape) * dtype.itemsize
        views.append(buffer[start : start + length].view(dtype).view(shape))
        start += length
    return views


def _pass_q(q, q_positions, cache, new, mask: AttentionMask, spec: StepSpec, levels, level_sizes) -> PartialAttention:
    """Every rank's queries gathered; this rank's partial of all of them over its keys;
    each rank's rows of those partials sent back to it (one all-to-all a level), merged
    there. levels: (group, GroupInfo) innermost first (one group, or a grid's Ulysses
    then ring group); level_sizes: their members' query rows, in member order (a ring
    slot's: the sum of its Ulysses ranks')."""
    for (group, _), sizes in zip(levels, level_sizes):
        q = gather_sequence(q, 1, group, sizes=sizes)
        q_positions = gather_sequence(q_positions.long(), 1, group, sizes=sizes)
    partial = _local_partial(q, q_positions, [cache, new], mask, spec)
    batch, _, heads, packed_dim = partial.packed.shape  # v's head dim + 1
    for (_, info), sizes in reversed(list(zip(levels, level_sizes))):
        world_size, rows = info.world_size, sizes[info.rank]
        (received,) = exchange_blocks(
            [partial.packed], [1], offsets(sizes), sizes, [(world_size, batch, rows, heads, packed_dim)], [0],
            list(range(world_size)), [1] * world_size, info,
        )  # fmt: skip
        partial = _merged([PartialAttention(each) for each in received])
    return partial


# ----------------------------------------------------------------------------------
# Local parts
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """An inference call's options once checked; agreed: what every rank must pass alike."""

    mask: AttentionMask
    scale: float
    softcap: float
    sinks: torch.Tensor | None
    return_lse: bool
    agreed: tuple


def _folded(q, call: _Call) -> tuple[torch.Tensor, StepSpec]:
    """q with the scale's sign folded in (fold_scale_sign), and the StepSpec of a
    positive scale."""
    q, scale = fold_scale_sign(q, call.scale)
    return q, StepSpec(scale, call.softcap)


def _local_partial(q, q_positions, key_sets, mask: AttentionMask, spec: StepSpec) -> PartialAttention:
    """The partial of q over each (k, v, positions, lengths) of key_sets: out of v's head dim."""
    partial = PartialAttention.empty(*q.shape[:3], key_sets[0][1].shape[3], q.device)
    for k, v, positions, lengths in key_sets:
        attend_keys_(partial, q, q_positions, k, v, positions, lengths, mask, spec)
    return partial


def _merged(partials: list[PartialAttention]) -> PartialAttention:
    """The merge of partials over disjoint keys."""
    merged = PartialAttention.empty(*partials[0].out.shape, partials[0].packed.device)
    merge_partials_(merged, [each.out for each in partials], [each.lse for each in partials])
    return merged


def _finish(partial: PartialAttention, sinks, dtype, return_lse: bool):
    """out (B, Tq, H, D) contiguous in dtype [, lse (B, H, Tq) fp32], sinks merged once."""
    if sinks is not None:
        merge_sinks_(partial.out, partial.lse, sinks)
    out = partial.out.to(dtype).contiguous()
    return (out, partial.lse.contiguous()) if return_lse else out


# ----------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------


def _device(x):
    return x.device if isinstance(x, torch.Tensor) else None


def _cache_keys(k_cache, v_cache, cache_positions, cache_lengths):
    """A cache's key set as _check_call takes it."""
    names = ("k_cache", "v_cache", "cache_positions", "cache_lengths")
    return names, k_cache, v_cache, cache_positions, cache_lengths


def _check_integers(name: str, x, shape: tuple, device) -> None:
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of shape {shape}, got {_describe(x)}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {x.device}")


def _describe(x) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _check_call(
    describe: str, q, q_positions, key_sets, *, causal, softmax_scale, window_size, attention_chunk_size, softcap,
    sinks, return_lse,
) -> _Call:  # fmt: skip
    """Every local check of an inference call (raising ValueError naming what is wrong):
    q (B, Tq, H, D) in a supported dtype, its positions, each key set ((names), k, v,
    positions, lengths) (B, S, H_kv, D) with per-rank lengths 0..S (read: a host sync on
    GPUs), the mask, scale, softcap, sinks, no autograd."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"{describe}: q must be (batch, Tq, nheads, headdim), got {_describe(q)}")
    batch, queries, heads, head_dim = q.shape
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{describe}: q must be one of {SUPPORTED_DTYPES}, got {q.dtype}")
    if not 1 <= head_dim <= MAX_HEAD_DIM or batch < 1:
        raise ValueError(f"{describe}: head dim 1 to {MAX_HEAD_DIM} and batch >= 1 needed, got q {tuple(q.shape)}")
    _check_integers("q_positions", q_positions, (batch, queries), q.device)
    tensors = [q]
    for (k_name, v_name, positions_name, lengths_name), k, v, positions, lengths in key_sets:
        for name, x in ((k_name, k), (v_name, v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype != q.dtype or x.device != q.device:
                raise ValueError(f"{describe}: {name} must be (batch, S, nheads_kv, headdim) of q's dtype {q.dtype} "
                                 f"on {q.device}, got {_describe(x)}")  # fmt: skip
        value_dim_ok = 1 <= v.shape[3] <= MAX_HEAD_DIM
        if k.shape[:3] != v.shape[:3] or k.shape[0] != batch or k.shape[3] != head_dim or not value_dim_ok:
            raise ValueError(f"{describe}: {k_name} and {v_name} must be (batch, S, nheads_kv, headdim) and (batch, "
                             f"S, nheads_kv, headdim_v <= {MAX_HEAD_DIM}) with q's batch and head dim: q "
                             f"{tuple(q.shape)}, {k_name} {tuple(k.shape)}, {v_name} {tuple(v.shape)}")  # fmt: skip
        if k.shape[2] == 0 or heads % k.shape[2]:
            raise ValueError(f"{describe}: nheads ({heads}) must be a multiple of nheads_kv ({k.shape[2]})")
        if positions_name != "q_positions":
            _check_integers(positions_name, positions, tuple(k.shape[:2]), q.device)
        if lengths_name is not None:
            _check_integers(lengths_name, lengths, (batch,), q.device)
            low, high = torch.stack([lengths.min(), lengths.max()]).tolist()
            if low < 0 or high > k.shape[1]:
                raise ValueError(
                    f"{describe}: {lengths_name} counts this rank's cached keys of each sequence, 0 to {k.shape[1]} "
                    f"({k_name} holds {k.shape[1]} rows); got values from {low} to {high} (global lengths where "
                    "per-rank ones belong?)"
                )
        tensors += [k, v]
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors):
        raise ValueError(
            f"{describe} is for inference and has no backward: an input requires grad; call it under "
            "torch.no_grad() or torch.inference_mode()"
        )
    mask = AttentionMask.checked(causal, window_size, attention_chunk_size)
    scale = resolve_softmax_scale(softmax_scale, q)
    softcap = check_softcap(softcap)
    check_sinks(sinks, q)
    check_bool("return_lse", return_lse)
    kv_heads, value_dim = key_sets[0][1].shape[2], key_sets[0][2].shape[3]
    if any(k.shape[2] != kv_heads or v.shape[3] != value_dim for _, k, v, *_ in key_sets):
        raise ValueError(f"{describe}: the chunk's and the cache's keys and values must have one nheads_kv and "
                         f"one value head dim")  # fmt: skip
    sinks_kind = None if sinks is None else (tuple(sinks.shape), sinks.dtype)
    agreed = (batch, heads, kv_heads, head_dim, value_dim, q.dtype, scale, mask, softcap, sinks_kind, return_lse)
    return _Call(mask, scale, softcap, sinks, return_lse, agreed)


def _check_partials(outs, lses, sinks) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """merge_attention_partials' checks: P >= 1 outs (B, Tq, H, D) fp32/fp16/bf16 and lses
    (B, H, Tq) fp32 on one device; sinks (H,). Returns them as lists."""
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_attention_partials: one lse per out, at least one; got {len(outs)} and {len(lses)}")
    first = outs[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 4:
        raise ValueError(f"merge_attention_partials: outs must be (batch, Tq, nheads, headdim), got {_describe(first)}")
    batch, queries, heads, _ = first.shape
    for out, lse in zip(outs, lses):
        if not isinstance(out, torch.Tensor) or out.shape != first.shape or out.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"merge_attention_partials: every out must be {tuple(first.shape)} in one of "
                             f"{SUPPORTED_DTYPES}, got {_describe(out)}")  # fmt: skip
        lse_shape = (batch, heads, queries)
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != lse_shape or lse.dtype != torch.float32:
            raise ValueError(f"merge_attention_partials: every lse must be fp32 (batch, nheads, Tq) = {lse_shape} "
                             f"(natural log), got {_describe(lse)}")  # fmt: skip
        if out.device != first.device or lse.device != first.device:
            raise ValueError("merge_attention_partials: every out and lse must be on one device")
    check_sinks(sinks, first)
    return outs, lses
