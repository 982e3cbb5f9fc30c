"""USP: usp_attention on every grid of the P ranks, pure Ulysses, pure ring and the
hybrids between them, side by side.

Rows (bench column):
  usp        usp_attention(q, k, v, causal=, layout=) forward
  usp-train  the same, forward + backward (dq, dk, dv)

A case is one shape; its grids are every U x R = P with U dividing P (U Ulysses ranks
per ring slot, R ring slots; make_usp_groups(U): Ulysses groups of consecutive ranks,
as the GPUs of a node are under torchrun). U = 1 is the pure ring (usp_attention is
ring_attention then), R = 1 pure Ulysses (ulysses_attention), the others the hybrid.
All grids of a case are timed in one time_side_by_side call, interleaved round by
round, so that they share the machine's drift; each gets a row:
  ours      the row's grid
  baseline  for a hybrid, the faster (median) of the two pure grids: speedup above 1
            means the hybrid beats both; for a pure grid, the other pure grid
  speedup   baseline / ours; ours_faster_share: the rounds this grid won against it
Every grid is called with the pieces' lengths passed (seq_lens), as the other benches
pass sizes, so that the argument checks' two small gathers are not timed.

Bytes: comm_stats around one call (forward, or forward + backward), the ring's share
counted apart (the ring's point-to-point sends; the rest is the Ulysses all-to-all),
against the formulas of docs/usp.md per group (theory_bytes, by traffic.usp_bytes):
bytes_sent_ulysses_group, bytes_sent_ring_group on rank 0, volume_at_theory when both
equal the formulas on every rank.

check: each grid's out (and dq, dk, dv) gathered to rank 0 in sequence order and judged
as the ring bench judges the ring (bench/runner/verify.py: judge_attention): "matches" when
within the tests' accuracy rule against an exact fp64 result, with torch on one device
in the same dtype as the yardstick; error_vs_plain the flash-attention rule's measure.
On GPU the first kv head and its q heads are checked.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist

import seqpar_kernels.comm.ring as ring_module
from bench.families.shared.baselines import leaves, single_device_attention
from bench.runner.cases import AttentionCase, run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import Row, short_dtype, usp_grid_label
from bench.runner.timing import time_side_by_side
from bench.runner.verify import checked_heads, judge_attention
from seqpar_kernels import comm_stats, make_usp_groups, usp_attention
from seqpar_kernels.traffic import usp_bytes

BASELINE_NOTE = (
    "one row per grid U x R (U=1: pure ring, R=1: pure Ulysses), all grids of a case timed "
    "side by side; baseline = the faster pure grid for a hybrid, the other pure grid for a "
    "pure one; x = baseline / this grid"
)


@dataclass(frozen=True)
class Grid:
    """U Ulysses ranks per ring slot x R ring slots."""

    ulysses: int
    ring: int

    @property
    def label(self) -> str:
        return usp_grid_label(self.ulysses, self.ring)

    @property
    def kind(self) -> str:
        return "pure ring" if self.ulysses == 1 else ("pure Ulysses" if self.ring == 1 else "hybrid")


def grids_of(world_size: int) -> list[Grid]:
    """Every factorization of the world, pure ring first, pure Ulysses last."""
    return [Grid(u, world_size // u) for u in range(1, world_size + 1) if world_size % u == 0]


@dataclass(frozen=True)
class UspCase(AttentionCase):
    """The ring bench's kind of case (S = P x S_l), on every grid."""

    @property
    def bench(self) -> str:
        return "usp-train" if self.backward else "usp"

    def label(self, world_size: int) -> str:
        # The head counts decide how far Ulysses can go: in the label.
        return f"{super().label(world_size)} H={self.heads}/{self.kv_heads}"


def usp_cases(ctx: Context) -> list[UspCase]:
    """The ring bench's lengths: contiguous full (the first shape) and zigzag causal
    (every shape: causal USP runs zigzag); MHA, GQA and, on CPU, fewer heads than ranks
    (pure Ulysses leaves ranks without heads); forward, then forward + backward (half
    the length on CPU, whose backward is ~5x the forward)."""
    bf16 = torch.bfloat16
    if ctx.quick:
        return [
            UspCase(1, 16, 4, 2, 16, bf16, "zigzag", True, False),
            UspCase(1, 16, 4, 4, 16, torch.float32, "contiguous", False, True),
        ]
    if ctx.on_gpu:
        forward_len, train_len, shapes = 4096, 4096, [(32, 32, 128), (32, 8, 128)]
    else:
        forward_len, train_len, shapes = 512, 256, [(8, 8, 64), (8, 2, 64), (2, 2, 64)]
    cases = []
    for backward, local_len in ((False, forward_len), (True, train_len)):
        for index, (heads, kv_heads, head_dim) in enumerate(shapes):
            masks = [("contiguous", False), ("zigzag", True)] if index == 0 else [("zigzag", True)]
            for layout, causal in masks:
                cases.append(UspCase(1, local_len, heads, kv_heads, head_dim, bf16, layout, causal, backward))
    return cases


SIZES = Sizes(  # the default is the full list
    quick=Size("S = 64, 2 cases", 2),
    default=Size(
        "S = 2048 forward, 1024 forward + backward, D = 64: MHA H = 8 full and zigzag, GQA 8/2, "
        "H = 2 zigzag; 8 cases, every grid",
        107,
        gpu_runs="S_l = 4096 per rank, H = 32, D = 128",
    ),
    full=Size("the default's cases", 107, gpu_runs="the default's cases"),
)


# ----------------------------------------------------------------------------------
# The layout, written out here (not taken from usp_split: the check trusts no seqpar code)
# ----------------------------------------------------------------------------------


def piece_positions(case: UspCase, grid: Grid) -> list[torch.Tensor]:
    """The global positions of each piece p = i * U + j, in the piece's local order.
    contiguous: piece p of torch.tensor_split(positions, R * U). zigzag: slot i is
    chunks i and 2R-1-i of torch.tensor_split(positions, 2R); its piece j is piece j of
    torch.tensor_split(slot, U)."""
    positions = torch.arange(grid.ulysses * grid.ring * case.local_len)
    if case.layout == "contiguous":
        return list(positions.tensor_split(grid.ring * grid.ulysses))
    chunks = positions.tensor_split(2 * grid.ring)
    pieces = []
    for i in range(grid.ring):
        slot = torch.cat([chunks[i], chunks[2 * grid.ring - 1 - i]])
        pieces += list(slot.tensor_split(grid.ulysses))
    return pieces


def position_on_grid(groups) -> tuple[int, int]:
    """(ring index i, Ulysses index j) of this rank."""
    ulysses_group, ring_group = groups
    return dist.get_rank(ring_group), dist.get_rank(ulysses_group)


def theory_bytes(case: UspCase, grid: Grid, lengths: list[int], i: int, j: int) -> tuple[int, int]:
    """(Ulysses group, ring group) bytes the rank at (i, j) sends in one call (forward,
    or forward + backward): traffic.usp_bytes, the formulas of docs/usp.md. lengths: every
    piece's length, in piece order."""
    groups = usp_bytes(
        lengths, i, j, ulysses_size=grid.ulysses, batch=case.batch, num_heads=case.heads,
        num_kv_heads=case.kv_heads, head_dim=case.head_dim, element_size=case.dtype.itemsize,
    )  # fmt: skip
    ulysses, ring = (group.sent(case.backward) for group in groups)
    return ulysses, ring


@contextlib.contextmanager
def ring_bytes_counted():
    """comm_stats around the block, and the bytes the ring's point-to-point sends
    record counted apart: (all, ring). The rest is the Ulysses group's all-to-all."""
    ring = [0]
    record = ring_module.record_sent

    def counted(num_bytes: int) -> None:
        ring[0] += num_bytes
        record(num_bytes)

    with comm_stats() as stats, mock.patch.object(ring_module, "record_sent", counted):
        yield stats, ring


@dataclass(frozen=True)
class GroupBytes:
    """Rank 0's bytes per group, the formulas' total, and whether every rank's bytes
    per group equal the formulas."""

    ulysses: int
    ring: int
    theory_ulysses: int
    theory_ring: int
    at_theory: bool


def measure_group_bytes(ctx: Context, call, theory: tuple[int, int]) -> GroupBytes:
    with ring_bytes_counted() as (stats, ring):
        call()
    measured = (stats.bytes_sent - ring[0], ring[0])
    equal = torch.tensor([int(measured == theory)])
    at_theory = bool(ctx.reduce_over_ranks(equal, op=dist.ReduceOp.MIN).item())
    return GroupBytes(*measured, *theory, at_theory)


# ----------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------


def gather_pieces(local: torch.Tensor, pieces: list[torch.Tensor], piece: int, ctx: Context) -> torch.Tensor | None:
    """Every rank's (B, S_p, ...) piece put back in sequence order on rank 0 (None
    elsewhere): a plain all_gather of pieces padded to the longest, not seqpar's gather."""
    longest = max(len(positions) for positions in pieces)
    padded = local.new_zeros((local.shape[0], longest, *local.shape[2:]))
    padded[:, : local.shape[1]] = local
    gathered = [torch.empty_like(padded) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, padded)
    # Which piece each rank holds (the groups say; not assumed to be its global rank).
    owners = [torch.zeros(1, dtype=torch.int64, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(owners, torch.tensor([piece], device=ctx.device))
    if not ctx.is_root:
        return None
    full = local.new_empty((local.shape[0], sum(len(p) for p in pieces), *local.shape[2:]))
    for owner, block in zip(owners, gathered):
        positions = pieces[int(owner.item())]
        full[:, positions.to(ctx.device)] = block[:, : len(positions)]
    return full


@dataclass
class Candidate:
    """One grid's call on this rank: its local inputs and what it needs to be judged."""

    grid: Grid
    pieces: list[torch.Tensor]
    piece: int
    call: Callable[[], list[torch.Tensor]]  # [out] or [out, dq, dk, dv]
    theory: tuple[int, int]


def candidate(case: UspCase, ctx: Context, grid: Grid, groups, full) -> Candidate:
    ulysses_group, ring_group = groups
    i, j = position_on_grid(groups)
    piece = i * grid.ulysses + j
    pieces = piece_positions(case, grid)
    lengths = [len(positions) for positions in pieces]
    rows = pieces[piece].to(ctx.device)
    q, k, v, dout = (tensor.index_select(1, rows) for tensor in full)
    options = dict(ulysses_group=ulysses_group, ring_group=ring_group, causal=case.causal,
                   layout=case.layout, seq_lens=lengths)  # fmt: skip
    if case.backward:
        q, k, v = leaves(q, k, v)

        def call():
            out = usp_attention(q, k, v, **options)
            return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]
    else:

        @torch.no_grad()
        def call():
            return [usp_attention(q, k, v, **options)]

    return Candidate(grid, pieces, piece, call, theory_bytes(case, grid, lengths, i, j))


def measure_usp(case: UspCase, ctx: Context, grids: list[Grid], groups: dict) -> list[Row]:
    """Every grid of the case: checked, bytes counted, then timed side by side; one row
    each. A case is one run_case: when it raises, its one FAILED row stands for all grids."""
    full = case.full_inputs(ctx)
    scale = 1.0 / math.sqrt(case.head_dim)
    candidates = [candidate(case, ctx, grid, groups[grid], full) for grid in grids]
    heads = checked_heads(ctx.on_gpu, case.heads, case.kv_heads)
    sdpas = single_device_attention(*full, case.causal, case.backward) if ctx.is_root else None
    verdicts, volumes = {}, {}
    for each in candidates:
        results = each.call()
        gathered = [gather_pieces(result, each.pieces, each.piece, ctx) for result in results]
        verdicts[each.grid] = judge_attention(gathered, sdpas, full, case.causal, scale, heads) if ctx.is_root else None
        volumes[each.grid] = measure_group_bytes(ctx, each.call, each.theory)
    timings = time_side_by_side({each.grid.label: each.call for each in candidates}, ctx)
    return [grid_row(case, ctx, grid, grids, timings, verdicts[grid], volumes[grid]) for grid in grids]


def baseline_of(grid: Grid, grids: list[Grid], timings) -> Grid:
    """A hybrid's baseline: the faster pure grid; a pure grid's: the other one."""
    pure_ring, pure_ulysses = grids[0], grids[-1]
    if grid == pure_ring:
        return pure_ulysses
    if grid == pure_ulysses:
        return pure_ring
    return min((pure_ring, pure_ulysses), key=lambda pure: timings[pure.label].median_s)


def grid_row(case, ctx, grid: Grid, grids, timings, accuracy, volume: GroupBytes) -> Row:
    baseline = baseline_of(grid, grids, timings)
    detail = f"{grid.kind}; baseline {baseline.label} ({baseline.kind})"
    if not volume.at_theory:
        detail += (f"; rank 0 theory: Ulysses group {volume.theory_ulysses} B, "
                   f"ring group {volume.theory_ring} B")  # fmt: skip
    if accuracy is not None:
        detail += f"; {accuracy.detail}"
    return timed_row(
        ctx, {"ours": timings[grid.label], "baseline": timings[baseline.label]},
        bench=case.bench, case=f"{case.label(ctx.world_size)} {grid.label}", shape=case.shape(ctx.world_size),
        dtype=short_dtype(case.dtype),
        check=accuracy.check if accuracy is not None else "(checked on rank 0)",
        layout=case.layout, error_vs_plain=accuracy.vs_plain if accuracy is not None else None,
        bytes_sent_ours=volume.ulysses + volume.ring,
        bytes_sent_theory=volume.theory_ulysses + volume.theory_ring,
        volume_at_theory=volume.at_theory,
        ulysses_degree=grid.ulysses, ring_degree=grid.ring,
        bytes_sent_ulysses_group=volume.ulysses, bytes_sent_ring_group=volume.ring,
        detail=detail,
    )  # fmt: skip


def run(ctx: Context) -> list[Row]:
    grids = grids_of(ctx.world_size)
    if len(grids) < 2:
        ctx.log("usp: needs 2 or more ranks (one rank has one grid, nothing to compare)")
        return []
    ctx.log(BASELINE_NOTE)
    # Group creation is collective over the world: every rank makes every grid's, in order.
    groups = {grid: make_usp_groups(grid.ulysses) for grid in grids}
    rows = []
    for case in usp_cases(ctx):
        rows += run_case(ctx, None, measure_usp, case, grids, groups)
    return rows


FAMILY = Family(
    name="usp",
    order=70,
    measures="usp_attention on every grid U x R of the ranks (pure Ulysses, pure ring, the hybrids) against one device",
    run=run,
    sizes=SIZES,
    timed_share=0.70,
    work={"float": 0.37, "half": 0.46, "host": 0.17},
    metadata=lambda: {"usp_baseline": BASELINE_NOTE},
)
