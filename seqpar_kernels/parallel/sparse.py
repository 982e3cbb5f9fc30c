"""Indexer-sparse attention over a sequence sharded across ranks (DeepSeek Sparse
Attention: DeepSeek-V3.2's and GLM-5's lightning indexer and top-k attention).

    placement = sparse_placement(S_local, group=group, layout="contiguous")
    indices = indexer_topk(index_q, index_k, weights, topk, placement=placement)
    out = sparse_attention(q, k, v, indices, placement=placement)

Each query attends to the `topk` keys of the whole sequence that a small indexer scores
highest; under sequence parallelism those keys live on any rank. indexer_topk gathers
every rank's indexer keys (one key of index_head_dim per token: small), scores all of
them in global order for this rank's queries and takes torch.topk over each full row, as
the model does in one process, so that the indices (ties included) are the model's.
sparse_attention fetches the distinct K and V rows this rank's queries keep from the
ranks holding them (all-to-alls: the counts, the positions, the rows; the backward sends
their dK, dV back, summed into the holder's) and attends each query to its chosen rows;
the value head size may differ from q/k's (MLA). Bytes: traffic.sparse_attention_bytes.

The indices are not differentiable (the models' indexers run under no_grad; an indexer
trained by a KL loss against the attention's scores, DeepSeek's warm-up stage, is the
caller's loss). Attention is causal; packed documents (cu_seqlens) keep each query to
its own document, in the indexer and in the attention alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from seqpar_kernels.groups import GroupInfo, resolve_group
from seqpar_kernels.layouts import usp_piece_segments
from seqpar_kernels.parallel.checks import CheckedOnEveryRank
from seqpar_kernels.parallel.reshard import gather_sequence
from seqpar_kernels.parallel.varlen import select_segments
from seqpar_kernels.traffic import record_sent, sparse_gradient_bytes

__all__ = ["SparsePlacement", "sparse_placement", "indexer_topk", "sparse_attention"]

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class SparsePlacement:
    """Where every rank's tokens sit in the whole sequence, once per forward.

    group        the ranks' GroupInfo
    sizes        every rank's token count, in rank order
    rows         (S_local,) int64: the global row of each of this rank's tokens
    slot_of_row  (T,) int64: each global row's place in the ranks' pieces concatenated
                 in rank order (what the gathers return)
    document     (T,) int64: each global row's document (all 0 without documents)"""

    group: GroupInfo
    sizes: tuple[int, ...]
    rows: torch.Tensor
    slot_of_row: torch.Tensor
    document: torch.Tensor

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def allows(self, query_rows: torch.Tensor, key_rows: torch.Tensor) -> torch.Tensor:
        """Whether each query row may see each key row (broadcast): causal, within its document."""
        return (key_rows <= query_rows) & (self.document[key_rows] == self.document[query_rows])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (B, S_local, ...) as (B, T, ...) in global order. Backward: every
        rank's gradient of this rank's rows, summed. Bytes: traffic.gather_bytes."""
        return _gather(x, self)[:, self.slot_of_row]

    def allowed(self) -> torch.Tensor:
        """(S_local, T) bool: the keys of the whole sequence each of this rank's queries may see."""
        return self.allows(self.rows[:, None], torch.arange(self.total, device=self.rows.device)[None])


def sparse_placement(
    local_len: int,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    seq_lens: Sequence[int] | None = None,
    rows: torch.Tensor | None = None,
    cu_seqlens: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> SparsePlacement:
    """The placement of a sequence whose rank r holds `local_len` tokens.

    layout: "contiguous" (rank r holds the rows after ranks 0..r-1's) or "zigzag" (the
        ring's: chunks r and 2P-1-r of torch.tensor_split's 2P). Or rows: (local_len,)
        int64, the global row of each of this rank's tokens, any layout (a varlen plan's,
        USP's pieces); every rank's rows together must be 0..T-1 once each.
    seq_lens: every rank's local_len, in rank order (else one small all-gather finds them).
    cu_seqlens: the documents of a packed sequence (B = 1): their bounds in global rows,
        0 first and T last. One small collective checks and gathers (every rank raises
        ValueError for a bad argument on any rank)."""
    info = resolve_group(group)
    with CheckedOnEveryRank("sparse_placement", info, None, exchange=seq_lens is None) as checks:
        if layout not in LAYOUTS:
            raise ValueError(f"sparse_placement: layout must be one of {LAYOUTS}, got {layout!r}")
        if rows is not None and tuple(rows.shape) != (local_len,):
            raise ValueError(f"sparse_placement: rows {tuple(rows.shape)} must be ({local_len},), one per local token")
        if seq_lens is not None and (len(seq_lens) != info.world_size or seq_lens[info.rank] != local_len):
            raise ValueError(f"sparse_placement: seq_lens {list(seq_lens)} must list {info.world_size} ranks' "
                             f"lengths, this rank's ({info.rank}) {local_len}")  # fmt: skip
        checks.share(local_len, (layout, rows is None, None if cu_seqlens is None else list(cu_seqlens)))
    sizes = tuple(seq_lens) if seq_lens is not None else tuple(checks.sizes)
    total = sum(sizes)
    if cu_seqlens is not None:
        bounds = list(cu_seqlens)
        if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
            raise ValueError(f"sparse_placement: cu_seqlens {bounds} must rise from 0 to the total length {total}")
    everything = torch.arange(total, device=device)
    if rows is None:
        segments = usp_piece_segments(total, 1, info.world_size, info.rank, 0, layout == "zigzag")
        rows = select_segments(everything, 0, segments)
    rows = rows.to(device=device, dtype=torch.int64)
    every_rows = rows if info.world_size == 1 else gather_sequence(rows, 0, group, sizes=list(sizes))
    slot_of_row = torch.full((total,), -1, dtype=torch.int64, device=device)
    slot_of_row[every_rows.clamp(0, max(total - 1, 0))] = everything
    if not bool((slot_of_row >= 0).all()) or bool(((every_rows < 0) | (every_rows >= total)).any()):
        raise ValueError(f"sparse_placement: the ranks' rows are not 0..{total - 1} once each")  # every rank alike
    document = torch.zeros(total, dtype=torch.int64, device=device)
    if cu_seqlens is not None:
        starts = torch.tensor(list(cu_seqlens)[1:-1], dtype=torch.int64, device=device)
        document = torch.bucketize(everything, starts, right=True)
    return SparsePlacement(info, sizes, rows, slot_of_row, document)


class _GatherRows(torch.autograd.Function):
    """x (B, S_local, ...) -> (B, T, ...): every rank's piece, in rank order. Backward:
    each rank's gradient of this rank's rows, summed (an all-to-all, then a sum)."""

    @staticmethod
    def forward(ctx, x, group: GroupInfo, sizes):
        ctx.group, ctx.sizes = group, list(sizes)
        return gather_sequence(x, 1, group.process_group(), sizes=list(sizes))

    @staticmethod
    def backward(ctx, grad):
        sizes, rank, world = ctx.sizes, ctx.group.rank, ctx.group.world_size
        send = grad.transpose(0, 1).contiguous()  # (T, B, ...): the rows each rank holds, in rank order
        received = send.new_empty((world * sizes[rank], *send.shape[1:]))
        dist.all_to_all_single(received, send, [sizes[rank]] * world, sizes, group=ctx.group.process_group())
        record_sent(sparse_gradient_bytes(sizes, rank, send[0].numel() * send.element_size()))
        summed = received.view(world, sizes[rank], *send.shape[1:]).sum(0)
        return summed.transpose(0, 1), None, None


def _gather(x: torch.Tensor, placement: SparsePlacement) -> torch.Tensor:
    """x (B, S_local, ...) -> (B, T, ...) in rank order (placement.slot_of_row finds a row)."""
    if placement.group.world_size == 1:
        return x
    return _GatherRows.apply(x, placement.group, placement.sizes)


@dataclass(frozen=True)
class _FetchPlan:
    """Which rows this rank asks of each rank (asked: its counts, in rank order) and
    which of its own rows each rank asks of it (served: local positions, grouped by the
    asking rank; serving: their counts)."""

    group: GroupInfo
    asked: list[int]
    serving: list[int]
    served: torch.Tensor


def _fetch_plan(placement: SparsePlacement, needed: torch.Tensor) -> _FetchPlan:
    """needed: (N,) sorted distinct rank-order slots this rank reads. Two all-to-alls:
    the counts, then the rows' local positions on their ranks."""
    group, sizes = placement.group, placement.sizes
    starts = torch.tensor([0, *sizes], device=needed.device).cumsum(0)
    owner = torch.bucketize(needed, starts[1:], right=True)
    asked = torch.bincount(owner, minlength=group.world_size)
    local = needed - starts[owner]
    if group.world_size == 1:
        return _FetchPlan(group, asked.tolist(), asked.tolist(), local)
    serving = torch.empty_like(asked)
    dist.all_to_all_single(serving, asked, group=group.process_group())
    asked_list, serving_list = asked.tolist(), serving.tolist()
    served = local.new_empty(sum(serving_list))
    dist.all_to_all_single(served, local, serving_list, asked_list, group=group.process_group())
    own = asked_list[group.rank]
    record_sent(8 * (group.world_size - 1) + 8 * (len(needed) - own))
    return _FetchPlan(group, asked_list, serving_list, served)


def _exchange(rows: torch.Tensor, plan: _FetchPlan, out_counts, in_counts, row_bytes: int) -> torch.Tensor:
    """(sum(in_counts), ...) rows -> (sum(out_counts), ...), grouped by rank both ways."""
    if plan.group.world_size == 1:
        return rows
    received = rows.new_empty((sum(out_counts), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), out_counts, in_counts, group=plan.group.process_group())
    record_sent((sum(in_counts) - in_counts[plan.group.rank]) * row_bytes)
    return received


class _FetchRows(torch.autograd.Function):
    """x (B, S_local, ...) -> (B, N, ...): the rows the plan asks for, from the ranks
    holding them. Backward: their gradients sent back and summed into each holder's."""

    @staticmethod
    def forward(ctx, x, plan: _FetchPlan):
        ctx.plan, ctx.shape = plan, x.shape
        rows = x[:, plan.served].transpose(0, 1)  # (served, B, ...): what the other ranks asked of this one
        row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
        return _exchange(rows, plan, plan.asked, plan.serving, row_bytes).transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        rows = grad.transpose(0, 1)
        row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
        returned = _exchange(rows, plan, plan.serving, plan.asked, row_bytes)
        grad_x = grad.new_zeros(ctx.shape)
        grad_x.index_add_(1, plan.served, returned.transpose(0, 1))
        return grad_x, None


def _checked_placement(describe, local_len, device, placement, options, local_checks, agreed) -> SparsePlacement:
    """Runs local_checks() so that a bad input on any rank raises on every rank (one
    small all-gather, which also finds every rank's length), then the placement."""
    group = placement.group if placement is not None else resolve_group(options.get("group"))
    with CheckedOnEveryRank(describe, group, None, exchange=True) as checks:
        local_checks()
        if placement is not None and (options or placement.rows.shape[0] != local_len):
            raise ValueError(f"{describe}: placement= covers {placement.rows.shape[0]} local tokens, the inputs "
                             f"{local_len}; pass it alone, without {sorted(options)}")  # fmt: skip
        rows = options.get("rows")
        if rows is not None and tuple(rows.shape) != (local_len,):
            raise ValueError(f"{describe}: rows {tuple(rows.shape)} must be ({local_len},), one per local token")
        shared = {name: value for name, value in options.items() if name not in ("rows", "group")}
        checks.share(local_len, (agreed, shared))
    if placement is not None:
        return placement
    return sparse_placement(local_len, device=device, **{"seq_lens": checks.sizes, **options})


@torch.no_grad()
def indexer_topk(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    *,
    softmax_scale: float | None = None,
    placement: SparsePlacement | None = None,
    **placement_options,
) -> torch.Tensor:
    """The lightning indexer's top-k keys of the whole sequence for this rank's queries.

    index_q: (B, S_local, H_i, D_i); index_k: (B, S_local, D_i) (one key head, after its
        norm and rotary embedding); weights: (B, S_local, H_i), each head's weight (the
        models' weights_proj output times H_i**-0.5).
    score[b, s, t] = sum_h weights[b, s, h] * relu(softmax_scale * index_q[b, s, h] . index_k[b, t])
        over the keys t the query may see (causal, its document), -inf elsewhere;
        softmax_scale defaults to D_i**-0.5. Computed in fp32 as transformers' indexers.
    Returns (B, S_local, min(topk, T)) int64: global rows, torch.topk's order over each
    full row (where a query sees fewer than topk keys, the rest are rows it may not see,
    which sparse_attention ignores). placement, or sparse_placement's keywords (group,
    layout, seq_lens, rows, cu_seqlens). Bytes: traffic.sparse_attention_bytes' index
    term. Not differentiable."""
    describe = "indexer_topk"

    def local_checks():
        if index_q.dim() != 4 or index_k.dim() != 3 or weights.dim() != 3:
            raise ValueError(f"{describe}: index_q {tuple(index_q.shape)} must be (B, S, H_i, D_i), index_k "
                             f"{tuple(index_k.shape)} (B, S, D_i), weights {tuple(weights.shape)} "
                             "(B, S, H_i)")  # fmt: skip
        batch, local_len, heads, head_dim = index_q.shape
        if tuple(index_k.shape) != (batch, local_len, head_dim) or tuple(weights.shape) != (batch, local_len, heads):
            raise ValueError(f"{describe}: index_k {tuple(index_k.shape)} must be {(batch, local_len, head_dim)} "
                             f"and weights {tuple(weights.shape)} {(batch, local_len, heads)} for index_q "
                             f"{tuple(index_q.shape)}")  # fmt: skip
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"{describe}: topk must be an int >= 1, got {topk!r}")

    agreed = (index_q.shape[0], *index_q.shape[2:], index_q.dtype, topk, softmax_scale)
    placement = _checked_placement(describe, index_q.shape[1] if index_q.dim() else 0, index_q.device, placement,
                                   placement_options, local_checks, agreed)  # fmt: skip
    head_dim = index_q.shape[-1]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    keys = placement.gather(index_k)  # (B, T, D_i)
    scores = torch.relu(torch.matmul(index_q.float(), keys.transpose(-1, -2).float().unsqueeze(1)) * scale)
    index_scores = torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)  # (B, S_local, T)
    index_scores = index_scores.masked_fill(~placement.allowed(), float("-inf"))
    return index_scores.topk(min(topk, placement.total), dim=-1).indices


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    placement: SparsePlacement | None = None,
    **placement_options,
) -> torch.Tensor:
    """Each query's attention over the keys `indices` chose, wherever they live.

    q: (B, S_local, H, D); k: (B, S_local, H_kv, D); v: (B, S_local, H_kv, Dv), H %
        H_kv == 0; Dv may differ from D (MLA). indices: (B, S_local, K) integers, global
        rows (indexer_topk's, or the model's); rows a query may not see (later, another
        document) and -1 are ignored; every query must keep one.
    Returns (B, S_local, H, Dv) in q's dtype: softmax(softmax_scale q . k_j) over the
    chosen j, computed in fp32 (fp64 for fp64 inputs); softmax_scale defaults to D**-0.5.
    Differentiable in q, k, v. placement, or sparse_placement's keywords. Bytes:
    traffic.sparse_attention_bytes (only the rows kept travel; dK, dV go back)."""
    describe = "sparse_attention"

    def local_checks():
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or indices.dim() != 3:
            raise ValueError(f"{describe}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                             f"(B, S, heads, dim) and indices {tuple(indices.shape)} (B, S, K)")  # fmt: skip
        batch, local_len, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        rows = (batch, local_len)
        if (tuple(k.shape) != (*rows, kv_heads, head_dim) or heads % kv_heads
                or tuple(v.shape[:3]) != (*rows, kv_heads) or tuple(indices.shape[:2]) != rows):  # fmt: skip
            raise ValueError(f"{describe}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and indices "
                             f"{tuple(indices.shape)} must share (B, S); k and v their heads, a divisor of q's; q "
                             "and k their head dim")  # fmt: skip
        if indices.dtype.is_floating_point or indices.dtype == torch.bool:
            raise ValueError(f"{describe}: indices must be integers, got {indices.dtype}")
        if q.dtype != k.dtype or q.dtype != v.dtype:
            raise ValueError(f"{describe}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")

    agreed = (q.shape[0], *q.shape[2:], *k.shape[2:], *v.shape[2:], indices.shape[-1], q.dtype, softmax_scale)
    placement = _checked_placement(describe, q.shape[1] if q.dim() > 1 else 0, q.device, placement,
                                   placement_options, local_checks, agreed)  # fmt: skip
    batch, local_len, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    chosen = indices.long()
    keep = (chosen >= 0) & (chosen < placement.total)
    chosen = chosen.clamp(0, max(placement.total - 1, 0))
    keep &= placement.allows(placement.rows[None, :, None], chosen)
    if not bool(keep.any(-1).all()):
        raise ValueError(f"{describe}: some query keeps none of its indices {tuple(indices.shape)} (each must "
                         "choose one key it may see: causal, in its document)")  # fmt: skip
    groups = heads // kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)
    # Only the rows some query here keeps travel, each once (for every batch row).
    slots = placement.slot_of_row[chosen]
    needed = torch.unique(slots[keep])
    plan = _fetch_plan(placement, needed)
    fetched = len(needed)
    place = torch.searchsorted(needed, slots).clamp(max=max(fetched - 1, 0))
    flat = (place + torch.arange(batch, device=q.device).view(-1, 1, 1) * fetched).flatten()
    chosen_k = _FetchRows.apply(k, plan).reshape(batch * fetched, kv_heads, head_dim)[flat]
    chosen_v = _FetchRows.apply(v, plan).reshape(batch * fetched, kv_heads, v.shape[-1])[flat]
    shape = (batch, local_len, chosen.shape[-1], kv_heads)
    scores = torch.einsum("bshgd,bskhd->bshgk", q.reshape(batch, local_len, kv_heads, groups, head_dim).to(dtype),
                          chosen_k.view(*shape, head_dim).to(dtype)) * scale  # fmt: skip
    scores = scores.masked_fill(~keep[:, :, None, None, :], float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    out = torch.einsum("bshgk,bskhe->bshge", probabilities, chosen_v.view(*shape, v.shape[-1]).to(dtype))
    return out.reshape(batch, local_len, heads, v.shape[-1]).to(q.dtype)
