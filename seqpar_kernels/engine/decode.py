"""Attention of a few queries over the keys one rank holds of a KV cache: the local part of
inference over a cache sharded across ranks (parallel/inference.py runs the collectives).

    partial = PartialAttention.empty(batch, queries, heads, head_dim, device)
    attend_keys_(partial, q, q_positions, k, v, k_positions, k_lengths, mask, spec)
    merge_partials_(partial, outs, lses)       other partials over other keys folded in

A partial is the fp32 (out, lse) of the queries over some keys: out the softmax-weighted
values, lse the natural-log log-sum-exp of the scores. A row that sees no key is
(out 0, lse -inf), which every merge leaves alone (seqpar::attention_merge_), so partials
over disjoint keys merge, in any order, into the attention over all of them.

Positions and lengths are per sequence (row b of the batch): k_positions[b, s] is key s's
position in sequence b, and only keys s < k_lengths[b] exist (the rest is padding, never
read into the result, NaN included). The mask (AttentionMask: causal, window, chunks)
compares positions, so a rank's keys may sit at any positions, in any order.

Plain torch, in fp32 (under autocast too): decode has one to a few queries per sequence,
and a chunk of a prompt is tiled (TILE_ELEMENTS). GQA kv heads are read in place, never
repeated.

Layouts: q (B, Tq, H, D); k, v (B, S, H_kv, D) with H % H_kv == 0; q_positions (B, Tq),
k_positions (B, S), k_lengths (B,) integer tensors on q's device; out (B, Tq, H, D) and
lse (B, H, Tq) fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seqpar_kernels.attention_mask import AttentionMask
from seqpar_kernels.engine.steps import StepSpec, inputs_precision
from seqpar_kernels.ops import attention_merge_

# fp32 values a tile may materialise: its scores, or its keys and values (64 MiB).
TILE_ELEMENTS = 1 << 24
# Query rows per tile at most (a prompt's chunk); decode's few rows make one tile.
QUERY_TILE = 256


@dataclass(frozen=True)
class PartialAttention:
    """The fp32 (out, lse) of queries (B, Tq, H) packed in one tensor, so that one
    collective carries both: packed (B, Tq, H, D + 1), out its first D values of each
    row and lse its last."""

    packed: torch.Tensor

    @classmethod
    def empty(cls, batch: int, queries: int, heads: int, head_dim: int, device) -> PartialAttention:
        """The partial over no key: out 0, lse -inf."""
        packed = torch.zeros(batch, queries, heads, head_dim + 1, dtype=torch.float32, device=device)
        packed[..., head_dim] = float("-inf")
        return cls(packed)

    @property
    def out(self) -> torch.Tensor:
        """(B, Tq, H, D) fp32 view."""
        return self.packed[..., :-1]

    @property
    def lse(self) -> torch.Tensor:
        """(B, H, Tq) fp32 view."""
        return self.packed[..., -1].transpose(1, 2)


def attend_keys_(
    partial: PartialAttention, q, q_positions, k, v, k_positions, k_lengths, mask: AttentionMask, spec: StepSpec,
    tile_elements: int = TILE_ELEMENTS,
) -> None:  # fmt: skip
    """Folds the attention of q over the keys k, v (the first k_lengths[b] of row b) into
    `partial`, in place. mask: over the positions (no documents); spec: the scale (any
    sign: scores are masked after scaling) and softcap. tile_elements: the fp32 values
    one tile may hold (tests make it small to cross tiles). In fp32 under autocast too
    (steps.inputs_precision).

    Reads k_lengths' largest value (a host sync on GPUs): keys past it are not read."""
    batch, queries, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    longest = int(k_lengths.max()) if k_lengths.numel() else 0
    if longest == 0 or queries == 0 or heads == 0:
        return
    query_tile = max(1, min(queries, QUERY_TILE, tile_elements // (batch * heads)))
    key_tile = max(1, tile_elements // (batch * max(heads * query_tile, kv_heads * (head_dim + v.shape[3]))))
    positions = q_positions.long()
    with inputs_precision(q.device):
        for key_start in range(0, longest, key_tile):
            keys = slice(key_start, min(longest, key_start + key_tile))
            exists = torch.arange(keys.start, keys.stop, device=q.device) < k_lengths[:, None]  # (B, t)
            k_tile = k[:, keys].float()
            # Padding is never read into the result: its values are zeroed (NaN * 0 is NaN).
            v_tile = v[:, keys].float().masked_fill(~exists[:, :, None, None], 0.0)
            for query_start in range(0, queries, query_tile):
                rows = slice(query_start, min(queries, query_start + query_tile))
                sees = exists[:, None, :] & mask.allows(positions[:, rows, None], k_positions[:, None, keys].long())
                block_out, block_lse = _block(q[:, rows], k_tile, v_tile, sees, spec, group)
                attention_merge_(partial.out[:, rows], partial.lse[:, :, rows], block_out, block_lse)


def _block(q, k, v, sees, spec: StepSpec, group: int):
    """(out (B, Tq, H, Dv), lse (B, H, Tq)) fp32 of q over the fp32 keys k, v (Dv) of one tile;
    sees (B, Tq, t): which keys each query row sees. q head h reads kv head h // group."""
    batch, queries, heads, head_dim = q.shape
    grouped = q.float().reshape(batch, queries, heads // group, group, head_dim)
    scores = torch.einsum("bqkgd,bskd->bkgqs", grouped, k) * spec.scale  # (B, H_kv, G, Tq, t)
    if spec.softcap > 0:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    scores = scores.masked_fill(~sees[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # A row that sees no key: lse -inf, weights exp(-inf - 0) = 0, out 0.
    weights = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    out = torch.einsum("bkgqs,bskd->bqkgd", weights, v).reshape(batch, queries, heads, v.shape[-1])
    return out, lse.reshape(batch, heads, queries)


def merge_partials_(partial: PartialAttention, outs, lses) -> None:
    """Folds partials over other keys into `partial`, in place: outs[i] (B, Tq, H, D)
    fp32, fp16 or bf16, lses[i] (B, H, Tq) fp32, any strides; a row of lse -inf is
    neutral."""
    for out, lse in zip(outs, lses):
        attention_merge_(partial.out, partial.lse, out, lse)
