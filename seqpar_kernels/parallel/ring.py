"""Ring attention (arXiv:2105.13120, in its flash-attention form) and the zigzag layout.

    ring_attention(q, k, v)       exact attention over a sequence sharded across ranks:
                                  K/V blocks travel a ring of ranks, each rank folds every
                                  block into its queries' running (out, lse).
    zigzag_split / zigzag_gather  the causal load-balancing layout: the sequence is cut
                                  into 2P equal chunks and rank r holds chunks r and
                                  2P-1-r, in that order.

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

import torch
import torch.distributed as dist

from seqpar_kernels.comm.groups import GroupInfo, resolve_group
from seqpar_kernels.ops.ring_attention import ring_attention_forward
from seqpar_kernels.parallel.ring_steps import DEVICE_DEFAULT
from seqpar_kernels.parallel.checks import (
    CheckedOnEveryRank,
    check_attention_inputs,
    check_bool,
    check_launchable,
    check_tensor,
    describe_shapes,
    device_of,
    fold_scale_sign,
    normalize_dim,
    resolve_softmax_scale,
)
from seqpar_kernels.parallel.reshard import gather_sequence

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
    if layout == "zigzag" and q.shape[1] % 2 != 0:
        raise ValueError(
            f"layout='zigzag' needs an even local sequence length (two equal chunks per rank), "
            f"got {q.shape[1]} ({shapes})"
        )
    check_bool("causal", causal)
    return resolve_softmax_scale(softmax_scale, q)


def _check_equal_lengths(lengths, info: GroupInfo, describe: str, shape) -> None:
    if any(length != lengths[0] for length in lengths):
        raise ValueError(
            f"{describe} needs the same local sequence length on every rank, got {lengths} "
            f"(rank {info.rank} has shape {tuple(shape)})"
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
):
    """Exact attention over a sequence sharded across the ranks of `group`.

    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_kv,
        headdim) with nheads % nheads_kv == 0 (GQA, MQA: only the nheads_kv heads travel,
        never repeated). fp16, bf16 or fp32, one dtype; CPU or CUDA; head dim up to 256
        (64, 80, 96, 128, 256 are the tested ones); any strides.
        seqlen_local must be the same on every rank (and even for zigzag).
    causal: mask by global position.
    layout: where this rank's rows sit in the global sequence:
        "contiguous"  rank r holds rows [r * S, (r + 1) * S).
        "zigzag"      the sequence is cut into 2P chunks of S/2 rows; rank r holds chunks
                      r and 2P-1-r, in that order (zigzag_split makes it). Balances the
                      causal work; the same as "contiguous" without a causal mask.
    softmax_scale: default 1/sqrt(headdim).
    return_lse: also return the log-sum-exp (natural log) of each row's scores.
    check_ranks: check, with one small all_gather, that every rank passed valid inputs
        with the same local length, shapes and options, so that a bad input or a
        mismatch on any rank raises on every rank instead of giving wrong results or a
        hang. On NCCL that all_gather synchronises the host with the GPU at every call
        (every layer); False skips it, for models whose ranks are known to agree (a bad
        input then raises on its own rank only; SEQPAR_DEBUG=1 turns the check back
        on). Under torch.compile it is always skipped.
    Returns out (batch, seqlen_local, nheads, headdim), contiguous, in q's dtype
    [, lse (batch, nheads, seqlen_local) fp32, detached: its gradient is not propagated].

    Autograd: dq, dk, dv through the ring backward (dK/dV accumulate in fp32 while they
    travel). Bytes sent per rank: forward (P-1) x (k + v bytes); backward (P-1) x
    (k + v bytes + fp32 dk + dv bytes), plus the check_ranks all_gather.
    """
    return _ring_attention(
        q, k, v, group=group, causal=causal, softmax_scale=softmax_scale, layout=layout,
        return_lse=return_lse, check_ranks=check_ranks, step_kernels=DEVICE_DEFAULT,
    )  # fmt: skip


def _ring_attention(q, k, v, *, group, causal, softmax_scale, layout, return_lse, check_ranks, step_kernels):
    """ring_attention with the step kernels named `step_kernels` (parallel/ring_steps.py)."""
    info = resolve_group(group)
    with CheckedOnEveryRank("ring_attention", info, device_of(q), exchange=check_ranks is not False) as checks:
        scale = _check_ring_inputs(q, k, v, causal, softmax_scale, layout)
        check_bool("check_ranks", check_ranks)
        batch, seqlen, heads, head_dim = q.shape
        checks.share(seqlen, (batch, heads, k.shape[2], head_dim, causal, layout, q.dtype, scale))
    _check_equal_lengths(checks.sizes, info, "ring_attention", q.shape)
    q, scale = fold_scale_sign(q, scale)
    out, lse = ring_attention_forward(q, k, v, causal, scale, layout == "zigzag", info.name, step_kernels)
    return (out, lse.detach()) if return_lse else out


# ----------------------------------------------------------------------------------
# The zigzag layout
# ----------------------------------------------------------------------------------


def _zigzag_chunks(rank: int, world_size: int) -> tuple[int, int]:
    return rank, 2 * world_size - 1 - rank


def _zigzag_gather(x: torch.Tensor, dim: int, group, info: GroupInfo) -> torch.Tensor:
    """zigzag_gather once sizes are known to be equal (no metadata exchange)."""
    world_size = info.world_size
    local = x.shape[dim]
    # gather_sequence concatenates the ranks' pieces in rank order: chunks
    # [0, 2P-1, 1, 2P-2, ...]; one index_select puts them in sequence order. Its
    # autograd (and gather_sequence's) makes the backward zigzag_split's selection.
    gathered = gather_sequence(x, dim, group, sizes=[local] * world_size)
    if world_size == 1:
        return gathered
    position = {}
    for rank in range(world_size):
        first, second = _zigzag_chunks(rank, world_size)
        position[first], position[second] = 2 * rank, 2 * rank + 1
    order = torch.tensor([position[chunk] for chunk in range(2 * world_size)], device=x.device)
    chunks = gathered.unflatten(dim, (2 * world_size, local // 2))
    return chunks.index_select(dim, order).flatten(dim, dim + 1)


class _ZigzagSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, info):
        ctx.dim, ctx.group, ctx.info = dim, group, info
        chunk = x.shape[dim] // (2 * info.world_size)
        first, second = _zigzag_chunks(info.rank, info.world_size)
        return torch.cat([x.narrow(dim, first * chunk, chunk), x.narrow(dim, second * chunk, chunk)], dim)

    @staticmethod
    def backward(ctx, grad):
        return _zigzag_gather(grad, ctx.dim, ctx.group, ctx.info), None, None, None


def zigzag_split(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's zigzag piece of the full sequence `x` (the same on every rank).

    x: any shape; x.shape[dim] (the full length N) must be divisible by 2P.
    Returns chunks r and 2P-1-r of the 2P equal chunks along `dim`, concatenated in that
    order: x.shape with N/P along dim (a new tensor). One small collective checks that
    every rank passed the same shape, dtype and dim (a bad input on any rank raises on
    every rank).
    Backward: zigzag_gather of the gradient."""
    info = resolve_group(group)
    with CheckedOnEveryRank("zigzag_split", info, device_of(x), exchange=True) as checks:
        check_tensor(x, "zigzag_split")
        dim = normalize_dim(dim, x.dim(), "dim", x.shape)
        if x.shape[dim] % (2 * info.world_size) != 0:
            raise ValueError(
                f"zigzag_split needs the length along dim {dim} to be divisible by 2 x world size "
                f"= {2 * info.world_size}, got shape {tuple(x.shape)}"
            )
        checks.share(x.shape[dim], (x.dtype, tuple(x.shape), dim))
    return _ZigzagSplit.apply(x, dim, group, info)


def zigzag_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full sequence from every rank's zigzag piece (the inverse of zigzag_split).

    x: this rank's piece, chunks r and 2P-1-r concatenated along `dim`; the same shape
    on every rank, with an even length along dim.
    Returns x.shape with P times the length along dim, on every rank (one all-to-all
    through gather_sequence, plus one small metadata all_gather that checks the ranks
    agree). Backward: each rank keeps its zigzag piece of the gradient."""
    info = resolve_group(group)
    with CheckedOnEveryRank("zigzag_gather", info, device_of(x), exchange=True) as checks:
        check_tensor(x, "zigzag_gather")
        dim = normalize_dim(dim, x.dim(), "dim", x.shape)
        if x.shape[dim] % 2 != 0:
            raise ValueError(
                f"zigzag_gather needs an even local length along dim {dim} (two equal chunks), "
                f"got shape {tuple(x.shape)}"
            )
        checks.share(x.shape[dim], (x.dtype, tuple(x.shape[:dim]), tuple(x.shape[dim + 1 :])))
    _check_equal_lengths(checks.sizes, info, "zigzag_gather", x.shape)
    return _zigzag_gather(x, dim, group, info)
