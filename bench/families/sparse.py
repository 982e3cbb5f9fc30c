"""Indexer-sparse attention (DeepSeek Sparse Attention) on P ranks: fetching only the
chosen K/V rows against gathering every rank's.

Rows (bench column "sparse"): a causal sequence of P x S_l tokens in the zigzag layout,
the indexer's top-k keys of each query (indexer_topk over every rank's indexer keys),
then the attention over them, forward + backward, q/k of head dim D and v of Dv (MLA's
shapes, scaled down on CPUs):
  ours       sparse_attention: each rank fetches the distinct rows its queries chose
             from the ranks holding them, and sends their dK, dV back
  baseline   the simple way: every rank all-gathers K and V (sparse_placement's gather,
             whose backward sums the shares), then attends to the chosen keys
Both take the same indices (computed once, outside the timing). speedup = baseline /
ours. Bytes: sparse_attention's, measured (comm_stats) against
traffic.sparse_attention_bytes from what each rank asked of each (its distinct chosen
rows by holder); the all-gather's beside them.

check: ours' out, dq, dk, dv against the same attention written out in fp64 on this
rank's queries (the chosen keys of the whole sequence), by the tests' accuracy rule with
the written-out attention in the same dtype as the yardstick.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.runner.cases import run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import SPARSE_BENCH, Row, short_dtype
from bench.runner.timing import time_side_by_side
from bench.runner.verify import volume_against_theory, within_error_rule
from seqpar_kernels import comm_stats, traffic
from seqpar_kernels.parallel.sparse import indexer_topk, sparse_attention, sparse_placement
from tools import reference

BASELINE_NOTE = "baseline = all-gather K and V, then attend to the chosen keys; speedup = baseline / ours"


@dataclass(frozen=True)
class SparseCase:
    local_len: int  # S_l: this rank's tokens
    heads: int
    head_dim: int  # D of q and k
    value_dim: int  # Dv
    index_heads: int
    index_dim: int
    topk: int
    dtype: torch.dtype = torch.float32

    def label(self, world_size: int) -> str:
        return f"top-{self.topk} of {self.local_len * world_size} keys, D {self.head_dim} / Dv {self.value_dim}"

    def shape(self, world_size: int) -> str:
        return f"(1, {self.local_len}x{world_size}, {self.heads}, {self.head_dim}/{self.value_dim})"


def sparse_cases(ctx: Context) -> list[SparseCase]:
    if ctx.quick:
        return [SparseCase(16, 2, 24, 16, 2, 8, 8)]
    if ctx.on_gpu:
        # The chosen rows are gathered per query in plain torch: (S_l, topk, H, D) elements.
        return [SparseCase(1024, 8, 192, 128, 8, 64, 256, torch.bfloat16)]
    return [SparseCase(128, 4, 48, 32, 4, 32, 64)]


def _inputs(case: SparseCase, ctx: Context) -> dict[str, torch.Tensor]:
    """The whole sequence's tensors, seeded: the same on every rank."""
    total = case.local_len * ctx.world_size
    generator = torch.Generator().manual_seed(11)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(ctx.device)

    return dict(q=randn(1, total, case.heads, case.head_dim), k=randn(1, total, case.heads, case.head_dim),
                v=randn(1, total, case.heads, case.value_dim), dout=randn(1, total, case.heads, case.value_dim),
                index_q=randn(1, total, case.index_heads, case.index_dim), index_k=randn(1, total, case.index_dim),
                weights=randn(1, total, case.index_heads))  # fmt: skip


def _attend(q, k, v, keep, scale):
    """(B, S, H, D) q over (B, T, H, D) k and (B, T, H, Dv) v where keep (B, S, T)."""
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale
    probabilities = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhst,bthe->bshe", probabilities, v)


def _kept(indices: torch.Tensor, allowed: torch.Tensor, total: int) -> torch.Tensor:
    """(B, S_l, T) bool: the keys each query chose and may see."""
    keep = torch.zeros(*indices.shape[:2], total, dtype=torch.bool, device=indices.device)
    keep.scatter_(-1, indices.clamp(min=0), indices >= 0)
    return keep & allowed[None]


def measure(case: SparseCase, ctx: Context) -> Row:
    full = _inputs(case, ctx)
    placement = sparse_placement(case.local_len, layout="zigzag", device=ctx.device)
    local = {name: placement_piece(tensor, ctx) for name, tensor in full.items()}
    scale = case.head_dim**-0.5
    indices = indexer_topk(local["index_q"], local["index_k"], local["weights"], case.topk, placement=placement)
    total = case.local_len * ctx.world_size
    keep = _kept(indices, placement.allowed(), total)
    q, k, v, dout = (local[name].to(case.dtype) for name in ("q", "k", "v", "dout"))

    def call(attend):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def run():
            out = attend(*leaves)
            return [out.detach(), *torch.autograd.grad(out, leaves, dout)]

        return run

    ours = call(lambda q_, k_, v_: sparse_attention(q_, k_, v_, indices, softmax_scale=scale, placement=placement))
    gathered = call(lambda q_, k_, v_: _attend(q_, placement.gather(k_), placement.gather(v_), keep, scale))
    check, detail, ratio = _check(case, ctx, full, ours(), keep, scale)
    with comm_stats() as ours_bytes:
        ours()
    with comm_stats() as baseline_bytes:
        gathered()
    theory = _formula(case, ctx, placement, keep)
    volume = volume_against_theory(ctx, ours_bytes.bytes_sent, theory)
    timings = time_side_by_side({"ours": ours, "baseline": gathered}, ctx)
    return timed_row(
        ctx, timings, bench=SPARSE_BENCH, case=case.label(ctx.world_size), shape=case.shape(ctx.world_size),
        dtype=short_dtype(case.dtype), check=check, layout="zigzag", error_vs_plain=ratio,
        bytes_sent_ours=volume.measured, bytes_sent_theory=volume.theory, volume_at_theory=volume.at_theory,
        bytes_sent_baseline=baseline_bytes.bytes_sent, detail=detail,
    )  # fmt: skip


def placement_piece(tensor: torch.Tensor, ctx: Context) -> torch.Tensor:
    """This rank's zigzag piece of a (B, T, ...) tensor."""
    return reference.zigzag_piece(tensor, ctx.rank, ctx.world_size)


def _formula(case: SparseCase, ctx: Context, placement, keep: torch.Tensor) -> int:
    """traffic.sparse_attention_bytes from every rank's distinct kept rows by holder."""
    holder = torch.bucketize(placement.slot_of_row.cpu(), torch.tensor(placement.sizes).cumsum(0), right=True)
    needed = keep.any(0).any(0).cpu()  # (T,): the global rows this rank's queries keep
    mine = torch.bincount(holder[needed], minlength=ctx.world_size).to(ctx.device)
    asked = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(asked, mine)
    element_size = torch.empty(0, dtype=case.dtype).element_size()
    return traffic.sparse_attention_bytes([row.tolist() for row in asked], ctx.rank, batch=1, kv_heads=case.heads,
                                          head_dim=case.head_dim, value_dim=case.value_dim,
                                          element_size=element_size).sent(with_backward=True)  # fmt: skip


def _check(case: SparseCase, ctx: Context, full: dict, ours: list[torch.Tensor], keep: torch.Tensor, scale: float):
    """(check, detail, worst error / plain's) of ours against fp64, this rank's queries."""

    def written_out(dtype):
        q = placement_piece(full["q"], ctx).to(dtype).requires_grad_()
        k, v = (full[name].to(dtype).requires_grad_() for name in ("k", "v"))
        out = _attend(q, k, v, keep, scale)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), placement_piece(full["dout"], ctx).to(dtype))
        # dk, dv over the whole sequence from this rank's queries: summed over the ranks'
        # queries, then this rank's keys (what ours holds).
        for whole in (dk, dv):
            dist.all_reduce(whole)
        return [out.detach(), dq, placement_piece(dk, ctx), placement_piece(dv, ctx)]

    exact, plain = written_out(torch.float64), written_out(case.dtype)
    failed, details, ratios = [], [], []
    for name, got, want, yardstick in zip(("out", "dq", "dk", "dv"), ours, exact, plain):
        error, plain_error = reference.max_error(got, want), reference.max_error(yardstick, want)
        if not within_error_rule(error, plain_error, want, 0.0, case.dtype):
            failed.append(name)
        details.append(f"{name} {error:.2g} (plain {plain_error:.2g})")
        ratios.append(error / plain_error if plain_error > 0 else 0.0)
    verdict = torch.tensor([len(failed)], dtype=torch.float64)
    ctx_failed = ctx.reduce_over_ranks(verdict).item()
    check = "matches" if ctx_failed == 0 and not failed else "MISMATCH " + (",".join(failed) or "on another rank")
    return check, "; ".join(details), max(ratios) if ratios else math.nan


def run(ctx: Context) -> list[Row]:
    if ctx.world_size < 2:
        ctx.log("sparse: skipped (one rank: nothing to fetch)")
        return []
    ctx.log(BASELINE_NOTE)
    return [row for case in sparse_cases(ctx) for row in run_case(ctx, SPARSE_BENCH, measure, case)]


SIZES = Sizes(
    quick=Size("S_l = 16, top-8, D 24 / Dv 16, fp32", 1),
    default=Size(
        "S_l = 128, top-64, H = 4, D 48 / Dv 32, fp32, forward + backward",
        5,
        gpu_runs="S_l = 4096, top-2048, H = 16, D 192 / Dv 128, bf16",
        gpu_s=20,
    ),
    full=Size("as the default", 5, gpu_runs="as the default", gpu_s=20),
)

FAMILY = Family(
    name="sparse",
    order=95,
    measures="indexer-sparse attention: fetching the chosen K/V rows against all-gathering K and V",
    run=run,
    sizes=SIZES,
    timed_share=0.94,
    work={"float": 0.33, "exchange": 0.04, "host": 0.63},
    metadata=lambda: {"sparse_baseline": BASELINE_NOTE},
)
