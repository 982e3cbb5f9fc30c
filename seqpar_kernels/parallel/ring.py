"""Ring attention (arXiv:2105.13120, in its flash-attention form) and the zigzag layout.

    ring_attention(q, k, v)       exact attention over a sequence sharded across ranks:
                                  K/V blocks travel a ring of ranks, each rank folds every
                                  block into its queries' running (out, lse).
    zigzag_split / zigzag_gather  the causal load-balancing layout: the sequence is cut
                                  into 2P chunks (torch.tensor_split: any length) and
                                  rank r holds chunks r and 2P-1-r, in that order.

Why zigzag: under a causal mask with the contiguous layout, rank r's queries see r+1 of
the P blocks, so the last rank works P times as long as the first and every ring step
waits for the slowest rank. With zigzag every rank holds one early and one late chunk,
and every step computes the same amount on every rank (see the step table in
seqpar_kernels/engine/ring_driver.py, the ring driver).

Argument checks run here, on every rank, before any collective; one small all_gather of
metadata then makes sure every rank passed the same shapes and options, so a mismatch
raises on every rank instead of leaving some waiting in the ring.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from seqpar_kernels.engine.ring_ops import ring_attention_forward
from seqpar_kernels.engine.step_backends import AUTO, STEP_KERNELS
from seqpar_kernels.groups import GroupInfo, resolve_group
from seqpar_kernels.layouts import zigzag_chunk_lengths, zigzag_chunks, zigzag_piece_lengths
from seqpar_kernels.parallel.attention_checks import (
    RING_LAYOUTS,
    AttentionCall,
    check_zigzag_lengths,
    checked_attention_call,
    fold_scale_sign,
)
from seqpar_kernels.parallel.checks import (
    check_gather_arguments,
    check_split_arguments,
)
from seqpar_kernels.parallel.reshard import gather_sequence

LAYOUTS = RING_LAYOUTS


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
    check_ranks: bool = True,
    seq_lens: list[int] | None = None,
    varlen=None,
    step_backend: str = "auto",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
):
    """Exact attention over a sequence sharded across the ranks of `group`.

    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_kv,
        headdim) with nheads % nheads_kv == 0 (GQA, MQA: only the nheads_kv heads travel,
        never repeated). fp16, bf16 or fp32, one dtype; CPU or CUDA; head dim up to 256
        (64, 80, 96, 128, 256 are the tested ones); v's head dim headdim_v may differ
        (multi-head latent attention); any strides.
        seqlen_local may differ by rank (0 too); batch, heads and head dims may not.
    causal: mask by global position.
    layout: where this rank's rows sit in the global sequence:
        "contiguous"  rank r holds the rows after those of ranks 0..r-1.
        "zigzag"      the sequence of N rows is cut into 2P chunks by torch.tensor_split
                      (any N); rank r holds chunks r and 2P-1-r, in that order
                      (zigzag_split makes it). Balances the causal work; the same as
                      "contiguous" without a causal mask.
    softmax_scale: default 1/sqrt(headdim).
    return_lse: also return the log-sum-exp (natural log) of each row's scores.
    check_ranks: check, with one small all_gather, that every rank passed valid inputs
        with the same shapes and options (and learn every rank's local length), so
        that a bad input or a
        mismatch on any rank raises on every rank instead of giving wrong results or a
        hang. On NCCL that all_gather synchronises the host with the GPU at every call
        (every layer); False skips it, for models whose ranks are known to agree (a bad
        input then raises on its own rank only; SEQPAR_DEBUG=1 turns the check back
        on). Under torch.compile it is always skipped.
    seq_lens: every rank's seqlen_local, in group rank order. None: found by the
        check_ranks all_gather; where that is skipped (check_ranks=False, under
        torch.compile) every rank's is taken to be this rank's, so pass seq_lens there
        when they differ. Given, it also skips the all_gather (as check_ranks=False).
    varlen: a VarlenPlan (varlen_plan(cu_seqlens, group=group)) for packed documents:
        q, k, v are (1, plan.seq_lens[rank], heads, headdim), this rank's tokens in the
        plan's layout (plan.split makes them); attention stays inside each document
        (causal or not within it); a step whose K/V block shares no document with this
        rank's queries computes nothing. layout and seq_lens then come from the plan.
    step_backend: what computes each step: "triton", "aten" or "auto" (docs/ring.md).
    window_size: (left, right), flash-attention's sliding window: the query at position i
        sees the keys at positions i - left ..= i + right (-1: no bound on that side;
        causal also bounds them by i). Positions in the whole sequence (in the document
        under varlen), whatever the layout. A step no query of this rank sees computes
        nothing, and the ring stops after the farthest block some rank sees (with the
        contiguous layout and a window shorter than a piece: one block).
    softcap: > 0 caps the scores, softcap * tanh(softmax_scale * q.k / softcap) (Gemma 2).
    sinks: None, or (nheads,) per-head logits in the scores' units, the same on every
        rank: head h's softmax denominator gains exp(sinks[h]), with no value (gpt-oss).
        Differentiable: each rank's sinks.grad is its rows' share; their sum is the gradient.
    attention_chunk_size: None, or a query sees only the keys of its own chunk of that many
        positions (counted from its document's start under varlen; Llama 4).
    Returns out (batch, seqlen_local, nheads, headdim_v), contiguous, in q's dtype
    [, lse (batch, nheads, seqlen_local) fp32 (sinks included), detached: its gradient is
    not propagated].

    Autograd: dq, dk, dv through the ring backward (dK/dV accumulate in fp32 while they
    travel). Bytes sent per rank (seqpar_kernels.traffic.ring_bytes, with local lengths
    that differ too): forward (P-1) x (k + v bytes); backward (P-1) x (k + v bytes +
    fp32 dk + dv bytes), plus the check_ranks all_gather. Under a window or chunks the
    ring stops after step m, the farthest ring offset some rank sees: m in place of P-1.
    """
    return _checked_ring_attention(
        q, k, v, step_backend, group=group, causal=causal, softmax_scale=softmax_scale, layout=layout,
        return_lse=return_lse, check_ranks=check_ranks, seq_lens=seq_lens, varlen=varlen, window_size=window_size,
        softcap=softcap, sinks=sinks, attention_chunk_size=attention_chunk_size,
    )  # fmt: skip


def ring_attention_with_step_kernels(q, k, v, step_kernels: str, **options):
    """ring_attention(q, k, v, **options) with its steps computed by the step backend
    named `step_kernels`, any name of the engine's STEP_KERNELS ("aten",
    "aten-repeated-kv", "triton": on CPU tensors the Triton interpreter): what tests and
    benchmarks compare."""
    return _checked_ring_attention(q, k, v, step_kernels, step_backends=(AUTO, *STEP_KERNELS), **options)


def _checked_ring_attention(
    q, k, v, step_backend, *, group=None, check_ranks=True, seq_lens=None, layout="contiguous", **arguments
):  # fmt: skip
    info = resolve_group(group)
    call = checked_attention_call(
        "ring_attention", q, k, v, info, exchange=check_ranks is not False and seq_lens is None,
        step_backend=step_backend, seq_lens=seq_lens, layout=layout, check_ranks=check_ranks, **arguments,
    )  # fmt: skip
    return run_ring_attention(q, k, v, call, info)


def run_ring_attention(q, k, v, call: AttentionCall, info: GroupInfo):
    """ring_attention once checked: call (its AttentionCall, every rank's length known)
    over the group `info`. Returns out [, lse detached] as ring_attention does."""
    q, scale = fold_scale_sign(q, call.scale)
    segments = None if call.varlen is None else call.varlen.segments_tensor
    out, lse = ring_attention_forward(
        q, k, v, softmax_scale=scale, zigzag=call.zigzag, group_name=info.name, step_kernels=call.step_backend,
        seq_lens=call.seq_lens, segments=segments, **call.op_arguments(),
    )  # fmt: skip
    return (out, lse.detach()) if call.return_lse else out


# ----------------------------------------------------------------------------------
# The zigzag layout
# ----------------------------------------------------------------------------------


def zigzag_gather_pieces(x: torch.Tensor, dim: int, group, info: GroupInfo, lengths: list[int]) -> torch.Tensor:
    """zigzag_gather once every rank's length is known (and checked to be its zigzag
    piece): no metadata exchange; the zigzag split's backward."""
    world_size = info.world_size
    # gather_sequence concatenates the ranks' pieces in rank order: chunks
    # [0, 2P-1, 1, 2P-2, ...]; putting them back in sequence order is one cat of views.
    # Its autograd (and gather_sequence's) makes the backward zigzag_split's selection.
    gathered = gather_sequence(x, dim, group, sizes=lengths)
    if world_size == 1:
        return gathered
    chunk_lengths = zigzag_chunk_lengths(sum(lengths), world_size)
    in_rank_order = [chunk for rank in range(world_size) for chunk in zigzag_chunks(rank, world_size)]
    pieces = dict(zip(in_rank_order, gathered.split([chunk_lengths[c] for c in in_rank_order], dim)))
    return torch.cat([pieces[chunk] for chunk in range(2 * world_size)], dim)


class _ZigzagSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, info):
        total = x.shape[dim]
        ctx.dim, ctx.group, ctx.info = dim, group, info
        ctx.lengths = zigzag_piece_lengths(total, info.world_size)
        chunks = torch.tensor_split(x, 2 * info.world_size, dim)
        first, second = zigzag_chunks(info.rank, info.world_size)
        return torch.cat([chunks[first], chunks[second]], dim)

    @staticmethod
    def backward(ctx, grad):
        return zigzag_gather_pieces(grad, ctx.dim, ctx.group, ctx.info, ctx.lengths), None, None, None


def zigzag_split(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's zigzag piece of the full sequence `x` (the same on every rank).

    x: any shape, any length N along `dim` (0 and lengths below 2P too).
    Returns chunks r and 2P-1-r of the 2P chunks torch.tensor_split cuts `dim` into (the
    first N % 2P chunks one row longer), concatenated in that order: a new tensor of
    x.shape with this rank's rows along dim (N/P when 2P divides N). One small
    collective checks that every rank passed the same shape, dtype and dim (a bad input
    on any rank raises on every rank).
    Backward: zigzag_gather of the gradient."""
    info = resolve_group(group)
    dim = check_split_arguments("zigzag_split", x, dim, info)
    return _ZigzagSplit.apply(x, dim, group, info)


def zigzag_gather(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None, *, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """The full sequence from every rank's zigzag piece (the inverse of zigzag_split).

    x: this rank's piece, chunks r and 2P-1-r concatenated along `dim`, as zigzag_split
    makes them: the local lengths must be the zigzag pieces of their sum (checked, on
    every rank); the other dims the same on every rank.
    sizes: every rank's length along dim. None: found by one small metadata all_gather
    that also checks the ranks agree; under torch.compile (nothing can be gathered while
    tracing) every rank's is taken to be this rank's, so pass sizes there when they
    differ (2P not dividing the full length). Passing them skips the all_gather.
    Returns x.shape with the full length along dim, on every rank (one all-to-all
    through gather_sequence). Backward: each rank keeps its zigzag piece of the gradient."""
    info = resolve_group(group)
    dim, sizes = check_gather_arguments("zigzag_gather", x, dim, info, sizes)
    check_zigzag_lengths(sizes, info, "zigzag_gather", x.shape)
    return zigzag_gather_pieces(x, dim, group, info, sizes)
