"""Causal attention with a per-query relative position bias of bounded extent and
per-query sink logits (Inkling 2's attention), over a sequence sharded in any layout the
ring takes (contiguous, zigzag, USP pieces, packed documents).

    relative_bias_attention(q, k, v, logits, sinks, ...)

The bias of query i on key j is logits[i, i - j] for a backward distance 0 <= i - j < E
(E: the logits' extent), else 0. So each query's keys split in two:
    near    distance < E: the bias applies. Each rank takes, for each of its runs, the E
            rows of K|V before the run (from the ranks that hold them: one all-to-all of
            every run's last E rows, SequenceRuns) and computes these scores itself, a tile
            of query rows at a time, in fp32.
    far     distance >= E: no bias, plain causal attention, which the ring computes over
            K|V shifted E rows later: the row at position p holds the key of p - E, so
            "p <= i" is "distance >= E". The shifted rows of a document's first E
            positions hold keys of no one's far part (before the document): those
            positions are their own document for the ring, and the queries there take
            no far part (their ring result is dropped by the merge).
The near part, the far part and the sink merge by their log-sum-exp: the ring op's lse is
differentiable (its backward lowers delta by lse's gradient), so every gradient (q, k, v,
the bias logits, the sinks) is exact through autograd.

Bytes per rank: the halo all-to-all sends this rank's runs' last E rows of K|V to every
other rank of the grid ((P - 1) x runs x E x (D + Dv) x H_kv elements, the same in the
backward); the far ring is ring_attention's (seqpar_kernels.traffic.ring_bytes). Memory:
the near scores of one tile of TILE_ROWS query rows, (B, H, TILE_ROWS, TILE_ROWS + E) fp32,
saved for the backward by autograd (every tile: (B, H, S_local, TILE_ROWS + E)).
"""

from __future__ import annotations

from typing import Sequence

import torch

from seqpar_kernels.engine.attention_ops import encode_segments
from seqpar_kernels.engine.causal_conv import conv_tails, next_halo
from seqpar_kernels.engine.ring_ops import ring_attention_forward
from seqpar_kernels.engine.step_backends import AUTO
from seqpar_kernels.parallel.state_passing import SequenceRuns

__all__ = ["relative_bias_attention", "TILE_ROWS"]

# Query rows per tile of the near band's scores.
TILE_ROWS = 512


def relative_bias_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    logits: torch.Tensor,
    sinks: torch.Tensor | None,
    *,
    scale: float,
    window_left: int,
    runs: SequenceRuns,
    group_name: str,
    group_pieces: Sequence[int],
    step_backend: str = AUTO,
) -> torch.Tensor:
    """Causal attention of this rank's rows with a relative position bias and sinks.

    q: (B, S_local, H, D); k: (B, S_local, H_kv, D), v: (B, S_local, H_kv, Dv), H % H_kv
        == 0; this rank's rows in the order of its runs.
    logits: (B, H, S_local, E): the bias of each query row per backward distance 0..E-1.
    sinks: (B, H, S_local) per-query sink logits (a softmax term with no value), or None.
    scale: > 0, the scores' scale. window_left: -1, or a query sees the keys at most that
        many positions back (sliding attention).
    runs: SequenceRuns of the call (checked on every rank: SequenceRuns.of), whose pieces
        give every rank's rows; group_name: the group the far ring runs over (every
        rank of runs' grid), whose rank g holds piece group_pieces[g].
    Returns (B, S_local, H, Dv) in q's dtype. Collective over the grid: every rank calls
    it, a rank without rows too."""
    batch, rows, heads, _ = q.shape
    extent = logits.shape[-1]
    flat = torch.cat([k, v.to(k.dtype)], dim=-1).flatten(2)  # (B, S, H_kv x (D + Dv))
    zero = flat.new_zeros((batch, extent, flat.shape[-1]))
    gathered = runs.gather(conv_tails(flat, runs.mine, extent + 1))
    halos = runs.incoming(gathered, next_halo, zero)  # each run's E rows before it, zeros before its document
    extended = []
    near_out, near_lse = [], []
    for run, halo in zip(runs.mine, halos):
        own = flat.narrow(1, run.local_start, run.length)
        keys = torch.cat([halo.to(flat.dtype), own], dim=1).unflatten(2, (k.shape[2], -1))  # positions start - E ..
        extended.append(keys)
        before = max(0, extent - (run.start - runs.bounds[run.document]))  # halo rows before the document
        out, lse = _near_band(q.narrow(1, run.local_start, run.length), keys, logits.narrow(2, run.local_start,
                              run.length), scale, window_left, before, k.shape[-1])  # fmt: skip
        near_out.append(out)
        near_lse.append(lse)
    value_dim = v.shape[-1]
    if not extended:
        out = q.new_zeros((batch, 0, heads, value_dim), dtype=torch.float32)
        lse = q.new_zeros((batch, heads, 0), dtype=torch.float32)
    else:
        out, lse = torch.cat(near_out, dim=1), torch.cat(near_lse, dim=2)
    parts_out, parts_lse = [out], [lse]
    if _has_far_part(runs, extent, window_left):
        shifted = (torch.cat([keys[:, :run.length] for run, keys in zip(runs.mine, extended)], dim=1) if extended
                   else flat.unflatten(2, (k.shape[2], -1)))  # fmt: skip
        far_k, far_v = shifted.split([k.shape[-1], value_dim], dim=-1)
        slots = [[(run.start, run.length) for run in runs.pieces[piece]] for piece in group_pieces]
        far_out, far_lse = ring_attention_forward(
            q, far_k, far_v.to(v.dtype), causal=True, softmax_scale=scale, zigzag=False, group_name=group_name,
            step_kernels=step_backend, seq_lens=[sum(length for _, length in slot) for slot in slots],
            cu_seqlens=torch.tensor(_split_bounds(runs.bounds, extent), dtype=torch.int64),
            segments=encode_segments(slots), window_left=-1 if window_left < 0 else window_left - extent,
        )  # fmt: skip
        parts_out.append(far_out.float())
        parts_lse.append(far_lse.masked_fill(~_has_far_keys(runs, extent, q.device), float("-inf")))
    if sinks is not None:
        parts_lse.append(sinks.float())
    total = torch.logsumexp(torch.stack(parts_lse), dim=0)  # (B, H, S): finite, each query sees itself
    merged = sum(part * torch.exp(part_lse - total).transpose(1, 2).unsqueeze(-1)
                 for part, part_lse in zip(parts_out, parts_lse))  # fmt: skip
    return SequenceRuns.joined(merged.to(q.dtype), gathered)


def _near_band(q, keys, logits, scale, window_left, before, head_dim):
    """The near band of one run: q (B, L, H, D); keys (B, E + L, H_kv, D + Dv) at
    positions run.start - E .. , the first `before` rows outside the document; logits
    (B, H, L, E). Returns (out (B, L, H, Dv) fp32, lse (B, H, L) fp32)."""
    batch, length, heads, _ = q.shape
    extent, kv_heads = logits.shape[-1], keys.shape[2]
    reach = extent if window_left < 0 else min(extent, window_left + 1)  # distances 0 .. reach - 1 are seen
    k_all, v_all = keys.float().split([head_dim, keys.shape[-1] - head_dim], dim=-1)
    outs, lses = [], []
    for start in range(0, length, TILE_ROWS):
        tile = min(TILE_ROWS, length - start)
        # Query row i (run-local) sits at extended row i + E; it sees extended rows
        # i + E - reach + 1 ..= i + E.
        first = max(before, start + extent - reach + 1)
        last = start + tile + extent  # exclusive
        k_tile, v_tile = k_all[:, first:last], v_all[:, first:last]
        q_tile = q[:, start : start + tile].float().unflatten(2, (kv_heads, heads // kv_heads))  # (B, T, H_kv, G, D)
        scores = torch.einsum("btkgd,bskd->bkgts", q_tile, k_tile).flatten(1, 2) * scale  # (B, H, T, K)
        rows = torch.arange(start, start + tile, device=q.device)[:, None] + extent
        distance = rows - torch.arange(first, last, device=q.device)[None, :]  # (T, K)
        seen = (distance >= 0) & (distance < reach)
        bias = logits[:, :, start : start + tile].float().gather(
            -1, distance.clamp(0, extent - 1).expand(batch, heads, tile, -1))  # fmt: skip
        scores = (scores + bias).masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probabilities = torch.exp(scores - lse.unsqueeze(-1)).unflatten(1, (kv_heads, heads // kv_heads))
        outs.append(torch.einsum("bkgts,bskd->btkgd", probabilities, v_tile).flatten(2, 3))
        lses.append(lse)
    if not outs:
        return q.new_zeros((batch, 0, heads, v_all.shape[-1]), dtype=torch.float32), q.new_zeros(
            (batch, heads, 0), dtype=torch.float32)  # fmt: skip
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _has_far_part(runs: SequenceRuns, extent: int, window_left: int) -> bool:
    """Whether some query sees a key E or more positions back (alike on every rank)."""
    if 0 <= window_left < extent:
        return False
    return any(end - start > extent for start, end in zip(runs.bounds, runs.bounds[1:]))


def _split_bounds(bounds: Sequence[int], extent: int) -> list[int]:
    """The far ring's documents: each document's first E positions apart from the rest."""
    split = [bounds[0]]
    for start, end in zip(bounds, bounds[1:]):
        split.extend(sorted({min(start + extent, end), end} - {start}))
    return split


def _has_far_keys(runs: SequenceRuns, extent: int, device) -> torch.Tensor:
    """(S_local,) bool: this rank's rows at least E positions into their documents."""
    flags = [torch.arange(run.start, run.start + run.length) - runs.bounds[run.document] >= extent
             for run in runs.mine]  # fmt: skip
    return (torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool)).to(device)
