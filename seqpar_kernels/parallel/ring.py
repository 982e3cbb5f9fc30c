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
seqpar_kernels/parallel/ring_driver.py, the ring driver).

Argument checks run here, on every rank, before any collective; one small all_gather of
metadata then makes sure every rank passed the same shapes and options, so a mismatch
raises on every rank instead of leaving some waiting in the ring.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from seqpar_kernels.comm.groups import GroupInfo, resolve_group
from seqpar_kernels.ops.ring_attention import ring_attention_forward
from seqpar_kernels.parallel.ring_driver import zigzag_chunk_lengths, zigzag_piece_lengths
from seqpar_kernels.parallel.ring_steps import check_step_backend
from seqpar_kernels.parallel.checks import (
    CheckedOnEveryRank,
    check_gather_arguments,
    check_attention_inputs,
    check_bool,
    check_launchable,
    check_local_sizes,
    check_tensor,
    describe_shapes,
    device_of,
    fold_scale_sign,
    normalize_dim,
    resolve_softmax_scale,
)
from seqpar_kernels.parallel.reshard import gather_sequence
from seqpar_kernels.parallel.varlen import check_varlen_group

LAYOUTS = ("contiguous", "zigzag")


def _check_ring_inputs(q, k, v, causal, softmax_scale, layout) -> float:
    """Local checks (no communication); returns the softmax scale."""
    check_attention_inputs(q, k, v)
    shapes = describe_shapes(q, k, v)
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"ring_attention runs on CPU or CUDA tensors, got {q.device} ({shapes})")
    check_launchable(q)  # CUDA: GPUs older than sm_80, batch or heads over the grid limit
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check_bool("causal", causal)
    return resolve_softmax_scale(softmax_scale, q)


def _check_zigzag_lengths(lengths, info: GroupInfo, describe: str, shape) -> None:
    """Every rank's local length must be its zigzag piece of their sum (as zigzag_split
    cuts it), or the ranks would place their rows at other global positions than the
    zigzag layout says. Run on every rank with the same lengths: all raise alike."""
    total = sum(lengths)
    expected = zigzag_piece_lengths(total, info.world_size)
    wrong = [
        f"rank {rank} holds {length} rows where the layout puts {expected[rank]}"
        for rank, length in enumerate(lengths) if length != expected[rank]
    ]  # fmt: skip
    if wrong:
        raise ValueError(
            f"{describe}: local lengths {list(lengths)} are not the zigzag pieces of a sequence of "
            f"{total} rows (chunks r and 2P-1-r of torch.tensor_split into 2P = {2 * info.world_size}, "
            f"as zigzag_split makes them): {'; '.join(wrong)}. This rank ({info.rank}) has shape "
            f"{tuple(shape)}"
        )


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
):
    """Exact attention over a sequence sharded across the ranks of `group`.

    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_kv,
        headdim) with nheads % nheads_kv == 0 (GQA, MQA: only the nheads_kv heads travel,
        never repeated). fp16, bf16 or fp32, one dtype; CPU or CUDA; head dim up to 256
        (64, 80, 96, 128, 256 are the tested ones); any strides. seqlen_local may
        differ by rank (0 too); batch, heads and head dim may not.
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
    Returns out (batch, seqlen_local, nheads, headdim), contiguous, in q's dtype
    [, lse (batch, nheads, seqlen_local) fp32, detached: its gradient is not propagated].

    Autograd: dq, dk, dv through the ring backward (dK/dV accumulate in fp32 while they
    travel). Bytes sent per rank: forward (P-1) x (k + v bytes); backward (P-1) x
    (k + v bytes + fp32 dk + dv bytes), plus the check_ranks all_gather (with local
    lengths that differ: seqpar_kernels/parallel/ring_driver.py gives the formula).
    """
    return _ring_attention(
        q, k, v, group=group, causal=causal, softmax_scale=softmax_scale, layout=layout,
        return_lse=return_lse, check_ranks=check_ranks, seq_lens=seq_lens, varlen=varlen,
        step_backend=step_backend, public_backend=True,
    )  # fmt: skip


def _ring_attention(q, k, v, *, group, causal, softmax_scale, layout, return_lse, check_ranks, seq_lens,
                    step_backend, varlen=None, public_backend=False):
    """ring_attention with the step kernels named `step_backend`: one of STEP_BACKENDS
    (public_backend) or any key of STEP_KERNELS (parallel/ring_steps.py; tests)."""
    info = resolve_group(group)
    exchange = check_ranks is not False and seq_lens is None
    with CheckedOnEveryRank("ring_attention", info, device_of(q), exchange=exchange) as checks:
        scale = _check_ring_inputs(q, k, v, causal, softmax_scale, layout)
        if public_backend:
            check_step_backend(step_backend)
        check_bool("check_ranks", check_ranks)
        batch, seqlen, heads, head_dim = q.shape
        if varlen is not None:
            _check_varlen_ring(varlen, q, info, layout, seq_lens)
            seq_lens = varlen.seq_lens
        elif seq_lens is not None:
            seq_lens = check_local_sizes(seq_lens, info, seqlen, "seq_lens", q.shape, 1)
        checks.share(
            seqlen, (batch, heads, k.shape[2], head_dim, causal, layout, q.dtype, scale, seq_lens, step_backend)
        )
    seq_lens = checks.sizes if seq_lens is None else seq_lens
    if layout == "zigzag":
        _check_zigzag_lengths(seq_lens, info, "ring_attention", q.shape)
    q, scale = fold_scale_sign(q, scale)
    documents = () if varlen is None else (varlen.cu_seqlens_tensor, varlen.segments_tensor)
    out, lse = ring_attention_forward(
        q, k, v, causal, scale, layout == "zigzag", info.name, step_backend, seq_lens, *documents
    )
    return (out, lse.detach()) if return_lse else out


def _check_varlen_ring(plan, q, info: GroupInfo, layout, seq_lens) -> None:
    """Local checks of ring_attention(varlen=plan); the plan fixes the layout too."""
    check_varlen_group("ring_attention", plan, q, info, seq_lens)
    if layout != "contiguous":
        raise ValueError(f"ring_attention: with varlen the plan sets the layout; pass no layout (got {layout!r})")


# ----------------------------------------------------------------------------------
# The zigzag layout
# ----------------------------------------------------------------------------------


def _zigzag_chunks(rank: int, world_size: int) -> tuple[int, int]:
    return rank, 2 * world_size - 1 - rank


def _zigzag_gather(x: torch.Tensor, dim: int, group, info: GroupInfo, lengths: list[int]) -> torch.Tensor:
    """zigzag_gather once every rank's length is known (and checked to be its zigzag
    piece): no metadata exchange."""
    world_size = info.world_size
    # gather_sequence concatenates the ranks' pieces in rank order: chunks
    # [0, 2P-1, 1, 2P-2, ...]; putting them back in sequence order is one cat of views.
    # Its autograd (and gather_sequence's) makes the backward zigzag_split's selection.
    gathered = gather_sequence(x, dim, group, sizes=lengths)
    if world_size == 1:
        return gathered
    chunk_lengths = zigzag_chunk_lengths(sum(lengths), world_size)
    in_rank_order = [chunk for rank in range(world_size) for chunk in _zigzag_chunks(rank, world_size)]
    pieces = dict(zip(in_rank_order, gathered.split([chunk_lengths[c] for c in in_rank_order], dim)))
    return torch.cat([pieces[chunk] for chunk in range(2 * world_size)], dim)


class _ZigzagSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, info):
        total = x.shape[dim]
        ctx.dim, ctx.group, ctx.info = dim, group, info
        ctx.lengths = zigzag_piece_lengths(total, info.world_size)
        chunks = torch.tensor_split(x, 2 * info.world_size, dim)
        first, second = _zigzag_chunks(info.rank, info.world_size)
        return torch.cat([chunks[first], chunks[second]], dim)

    @staticmethod
    def backward(ctx, grad):
        return _zigzag_gather(grad, ctx.dim, ctx.group, ctx.info, ctx.lengths), None, None, None


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
    with CheckedOnEveryRank("zigzag_split", info, device_of(x), exchange=True) as checks:
        check_tensor(x, "zigzag_split")
        dim = normalize_dim(dim, x.dim(), "dim", x.shape)
        checks.share(x.shape[dim], (x.dtype, tuple(x.shape), dim))
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
    _check_zigzag_lengths(sizes, info, "zigzag_gather", x.shape)
    return _zigzag_gather(x, dim, group, info, sizes)
