"""Packed documents (varlen): attention kept inside each document of a packed sequence,
against the same tokens run as one dense causal sequence; and the balanced layout
against the contiguous one.

Rows (bench column), each forward and, with -train, forward + backward (dq, dk, dv):
  varlen-ring     ring_attention(q, k, v, causal=True, varlen=plan) on P ranks
  varlen-ulysses  ulysses_attention(..., varlen=plan)
  varlen-usp      usp_attention(..., varlen=plan) on a hybrid grid U x R (1 < U < P,
                  make_usp_groups(U)); one row per such grid
  varlen-layout   ring_attention(varlen=plan): the balanced plan against the contiguous one

The documents: a long-tailed mix, log-normal lengths (sigma 2) clipped to 1..N, drawn
with a fixed seed until they fill the N = P x S_l tokens (the last one cut to fit). The
median length scales with N (e^6 tokens at N = 64K, as in the tests' mix), so every N
gets the same shape of mix: a few documents holding most tokens, many short ones,
some of length 1.

In the first three, all timed side by side in one time_side_by_side call:
  ours      the varlen call with the balanced plan (varlen_plan(cu_seqlens, layout=
            "balanced")), each rank holding its tokens of the plan
  baseline  the same tokens as ONE dense causal sequence through the same function
            without varlen, in the zigzag layout (the dense causal layout that balances
            the ring; for Ulysses alone it is the contiguous one): attention across
            document borders too, the work a model does without packing support
  speedup   baseline / ours: attention restricted to documents does less work
varlen-layout's candidates are the varlen-ring case's own (the same call, timed in the
same rounds): ours the balanced plan, baseline the contiguous plan.
Every call gets the ranks' lengths (seq_lens), as the other benches pass sizes.

Bytes: comm_stats around one call, the ring's share counted apart, against the USP
bench's formulas per group for the ranks' lengths (bench_usp.theory_bytes, by
traffic.usp_bytes: the exchanges move the same bytes with or without documents);
bytes_sent_baseline is the dense call's, measured.

detail: the documents, the plan's work_imbalance and token_imbalance (VarlenPlan: the
most loaded ring slot over the mean, causal work and tokens), the tokens the peers'
per-document zigzag would pad (VarlenLayout.padding_of_per_document_zigzag: every
document to a multiple of 2 x the degree), then the errors.

check: each varlen result (out, and dq, dk, dv) gathered to rank 0 by the plan's
pieces (a plain all_gather, not the plan's gather) and judged against attention within
each document computed on one device: the exact fp64 result, plain attention and
torch SDPA in the inputs' dtype, document by document and concatenated; "matches" by
the tests' accuracy rule (bench/runner/verify.py: accuracy_verdict), error_vs_plain the
flash-attention rule's measure. varlen-layout judges both plans. On GPU the first kv
head and its q heads are checked.

Before the cases, the layout table (layout_table: VarlenLayout alone, no ranks) for
P = 2, 4, 8 on 64K tokens of the long-tailed mix and of hundreds of short documents:
contiguous, balanced, and the per-document zigzag of documents padded to a multiple of
2P (rank r holds chunks r and 2P-1-r of every padded document), with each one's work
and token imbalance against an even share of the documents' own tokens and causal work
(padding counts as tokens and work), and its padding. Printed, and kept in the JSON.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from dataclasses import dataclass

import torch

from bench.families.shared.baselines import leaves, single_device_attention
from bench.families.usp import Candidate, Grid, gather_pieces, measure_group_bytes, piece_positions, theory_bytes
from bench.runner.cases import AttentionCase, run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import Row, short_dtype
from bench.runner.timing import time_side_by_side
from bench.runner.verify import Accuracy, accuracy_verdict, checked_heads, chunked_attention
from seqpar_kernels import make_usp_groups, ring_attention, ulysses_attention, usp_attention, varlen_plan
from seqpar_kernels.layouts import VarlenLayout, segments_causal_work

BASELINE_NOTE = (
    "varlen-ring/-ulysses/-usp: ours = the varlen call with the balanced plan on a long-tailed "
    "document mix, baseline = the same tokens as one dense causal sequence (zigzag) through the "
    "same function; varlen-layout: ours = balanced plan, baseline = contiguous plan; "
    "x = baseline / ours"
)

SEED = 0
# The tests' long-tailed mix: log-normal lengths of median e^6 at 64K tokens, sigma 2.
LONG_TAILED_MEDIAN_AT_64K = math.exp(6.0)
LONG_TAILED_SIGMA = 2.0
# The layout table: 64K tokens; the short documents' lengths uniform in this range
# (mean 256: about 256 documents).
TABLE_TOKENS = 65536
SHORT_LENGTHS = (16, 496)
TABLE_DEGREES = (2, 4, 8)
# The candidate names besides "ours" (balanced plan) and "baseline" (dense sequence).
CONTIGUOUS_PLAN = "contiguous plan"


def long_tailed_lengths(seed: int, total: int) -> list[int]:
    """Log-normal document lengths between 1 and total, summing to total (the last one
    cut to fit); the median scales with total (module docstring)."""
    rng = random.Random(seed)
    mu = math.log(LONG_TAILED_MEDIAN_AT_64K * total / 65536)
    lengths: list[int] = []
    while sum(lengths) < total:
        length = int(min(max(rng.lognormvariate(mu, LONG_TAILED_SIGMA), 1), total))
        lengths.append(min(length, total - sum(lengths)))
    return lengths


def short_lengths(seed: int, total: int) -> list[int]:
    """Hundreds of short documents: lengths uniform in SHORT_LENGTHS, summing to total."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(*SHORT_LENGTHS), total - sum(lengths)))
    return lengths


def bounds_of(lengths: list[int]) -> tuple[int, ...]:
    """cu_seqlens of documents of these lengths: (0, end of the first, ..., N)."""
    return (0, *itertools.accumulate(lengths))


def causal_work(length: int) -> int:
    """Query-key pairs of one document under a causal mask."""
    return length * (length + 1) // 2


# ----------------------------------------------------------------------------------
# The layout table: VarlenLayout alone
# ----------------------------------------------------------------------------------


def per_document_zigzag(cu_seqlens: tuple[int, ...], degree: int) -> tuple[tuple[int, ...], list]:
    """The peers' layout: every document padded to a multiple of 2 x degree, cut into
    2 x degree equal chunks, rank r holding chunks r and 2 x degree - 1 - r of each.
    (The padded sequence's bounds, every rank's ranges of it: padding tokens are tokens
    there.)"""
    chunks = 2 * degree
    padded = [-(-(end - start) // chunks) * chunks for start, end in itertools.pairwise(cu_seqlens)]
    padded_bounds = bounds_of(padded)
    slots = []
    for rank in range(degree):
        segments = []
        for start, length in zip(padded_bounds, padded):
            chunk = length // chunks
            segments += [(start + rank * chunk, chunk), (start + (chunks - 1 - rank) * chunk, chunk)]
        slots.append([segment for segment in segments if segment[1]])
    return padded_bounds, slots


@dataclass(frozen=True)
class LayoutLine:
    """One line of the layout table. Imbalances: the most loaded rank over an even share
    of the documents' own tokens or causal work (1.0: perfectly even, no padding)."""

    mix: str
    documents: int
    tokens: int
    degree: int  # P: ring ranks
    layout: str  # contiguous | balanced | per-document zigzag (padded to 2P)
    work_imbalance: float
    token_imbalance: float
    padding_tokens: int


def layout_lines(mix: str, lengths: list[int], degree: int) -> list[LayoutLine]:
    cu_seqlens = bounds_of(lengths)
    total, documents = cu_seqlens[-1], len(lengths)
    lines = []
    for name in ("contiguous", "balanced"):
        layout = VarlenLayout(cu_seqlens, ring_size=degree, layout=name)
        lines.append(LayoutLine(mix, documents, total, degree, name, layout.work_imbalance,
                                layout.token_imbalance, 0))  # fmt: skip
    padded_bounds, padded_slots = per_document_zigzag(cu_seqlens, degree)
    padded_lengths = [sum(length for _, length in slot) for slot in padded_slots]
    padding = VarlenLayout(cu_seqlens, ring_size=degree).padding_of_per_document_zigzag()
    assert sum(padded_lengths) - total == padding, (sum(padded_lengths), total, padding)
    even_work = sum(causal_work(length) for length in lengths) / degree
    work = max(segments_causal_work(slot, padded_bounds) for slot in padded_slots) / even_work
    tokens = max(padded_lengths) / (total / degree)
    lines.append(LayoutLine(mix, documents, total, degree, f"per-document zigzag (padded to {2 * degree})",
                            work, tokens, padding))  # fmt: skip
    return lines


@functools.cache
def layout_table() -> tuple[LayoutLine, ...]:
    """Contiguous, balanced and padded per-document zigzag for P in TABLE_DEGREES, on
    TABLE_TOKENS tokens of the long-tailed mix and of hundreds of short documents."""
    mixes = {"long-tailed": long_tailed_lengths(SEED, TABLE_TOKENS), "short": short_lengths(SEED, TABLE_TOKENS)}
    return tuple(line for mix, lengths in mixes.items() for degree in TABLE_DEGREES
                 for line in layout_lines(mix, lengths, degree))  # fmt: skip


def layout_table_text() -> str:
    lines = [
        (
            f"varlen layouts of {TABLE_TOKENS} tokens (VarlenLayout alone, no ranks); imbalance = the most "
            "loaded rank / an even share of the documents' own tokens or causal work (padding counts as "
            "tokens and work):"
        ),
        f"  {'mix':<22} {'P':>2}  {'layout':<34} {'work imb':>8}  {'token imb':>9}  {'padding tokens':>14}",
    ]
    for line in layout_table():
        mix = f"{line.mix}, {line.documents} docs"
        lines.append(f"  {mix:<22} {line.degree:>2}  {line.layout:<34} {line.work_imbalance:>8.3f}  "
                     f"{line.token_imbalance:>9.3f}  {line.padding_tokens:>14}")  # fmt: skip
    return "\n".join(lines)


def layout_table_metadata() -> list[dict]:
    """The layout table as the JSON keeps it."""
    return [
        {"mix": line.mix, "documents": line.documents, "tokens": line.tokens, "P": line.degree,
         "layout": line.layout, "work_imbalance": round(line.work_imbalance, 4),
         "token_imbalance": round(line.token_imbalance, 4), "padding_tokens": line.padding_tokens}
        for line in layout_table()
    ]  # fmt: skip


# ----------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VarlenCase(AttentionCase):
    """Batch 1, causal, N = P x S_l tokens packed from the documents bounded by
    cu_seqlens, on `method` over `grid`. layout is the dense baseline's ("zigzag")."""

    method: str  # ring | ulysses | usp
    grid: Grid
    cu_seqlens: tuple[int, ...]

    @property
    def bench(self) -> str:
        return f"varlen-{self.method}" + ("-train" if self.backward else "")

    @property
    def layout_bench(self) -> str:
        return "varlen-layout" + ("-train" if self.backward else "")

    @property
    def compares_layouts(self) -> bool:
        """The ring's case also times the contiguous plan (varlen-layout); one rank has one layout."""
        return self.method == "ring" and self.grid.ring > 1

    @property
    def documents(self) -> int:
        return len(self.cu_seqlens) - 1

    def label(self, world_size: int) -> str:
        grid = f" {self.grid.label}" if self.method == "usp" else ""
        return (f"{self.documents} docs S={self.cu_seqlens[-1]} {short_dtype(self.dtype)} "
                f"H={self.heads}/{self.kv_heads}{grid}")  # fmt: skip


def methods_of(world_size: int) -> list[tuple[str, Grid]]:
    """The ring over all ranks, Ulysses over all ranks, and every hybrid grid U x R."""
    hybrids = [Grid(u, world_size // u) for u in range(2, world_size) if world_size % u == 0]
    return [("ring", Grid(1, world_size)), ("ulysses", Grid(world_size, 1))] + [("usp", grid) for grid in hybrids]


def varlen_cases(ctx: Context) -> list[VarlenCase]:
    """Forward, then forward + backward, of every method; GQA, bf16. CPU (4 ranks): N =
    2048 forward, 1024 forward + backward (as the ring bench), H = 8 / 2 kv, D = 64;
    GPU: S_l = 8192 per rank (64K tokens on 8 GPUs), H = 32 / 8 kv, D = 128."""
    if ctx.quick:
        forward_len, train_len, (heads, kv_heads, head_dim) = 64, 64, (4, 2, 16)
    elif ctx.on_gpu:
        forward_len, train_len, (heads, kv_heads, head_dim) = 8192, 8192, (32, 8, 128)
    else:
        forward_len, train_len, (heads, kv_heads, head_dim) = 512, 256, (8, 2, 64)
    cases = []
    for backward, local_len in ((False, forward_len), (True, train_len)):
        cu_seqlens = bounds_of(long_tailed_lengths(SEED, ctx.world_size * local_len))
        for method, grid in methods_of(ctx.world_size):
            cases.append(VarlenCase(1, local_len, heads, kv_heads, head_dim, torch.bfloat16, "zigzag", True,
                                    backward, method, grid, cu_seqlens))  # fmt: skip
    return cases


SIZES = Sizes(  # the default is the full list
    quick=Size("N = 256, every function and layout", 8),
    default=Size(
        "N = 2048 forward, 1024 forward + backward, H = 8 / 2 kv, D = 64, 34 documents: ring, "
        "Ulysses, USP, layouts; 8 cases",
        36,
        gpu_runs="S_l = 8192 per rank, H = 32 / 8 kv, D = 128",
    ),
    full=Size("the default's cases", 36, gpu_runs="the default's cases"),
)


# ----------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------


def attention_function(case: VarlenCase, groups):
    """The method's attention call, taking q, k, v and keyword options."""
    if case.method == "ring":
        return functools.partial(ring_attention, causal=True)
    if case.method == "ulysses":
        return functools.partial(ulysses_attention, causal=True)
    ulysses_group, ring_group = groups
    return functools.partial(usp_attention, ulysses_group=ulysses_group, ring_group=ring_group, causal=True)


def make_plan(case: VarlenCase, layout: str, groups):
    if case.method == "usp":
        ulysses_group, ring_group = groups
        return varlen_plan(case.cu_seqlens, ulysses_group=ulysses_group, ring_group=ring_group, layout=layout)
    return varlen_plan(case.cu_seqlens, layout=layout)


def plan_positions(plan) -> list[torch.Tensor]:
    """Every piece's global positions, in its local order (the plan's ranges)."""
    return [
        torch.tensor([position for start, length in piece for position in range(start, start + length)],
                     dtype=torch.int64)
        for piece in plan.layout.pieces
    ]  # fmt: skip


def candidate(case: VarlenCase, ctx: Context, full, pieces: list[torch.Tensor], piece: int, attention,
              options: dict) -> Candidate:  # fmt: skip
    """One call on this rank, holding the positions pieces[piece] of the full inputs."""
    q, k, v, dout = (tensor.index_select(1, pieces[piece].to(ctx.device)) for tensor in full)
    lengths = [len(positions) for positions in pieces]
    options = dict(options, seq_lens=lengths)
    if case.backward:
        q, k, v = leaves(q, k, v)

        def call():
            out = attention(q, k, v, **options)
            return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]
    else:

        @torch.no_grad()
        def call():
            return [attention(q, k, v, **options)]

    i, j = divmod(piece, case.grid.ulysses)
    return Candidate(case.grid, pieces, piece, call, theory_bytes(case, case.grid, lengths, i, j))


@dataclass
class DocumentReference:
    """Attention within each document on one device (rank 0): the exact fp64 result,
    plain attention and torch SDPA in the inputs' dtype, each computed document by
    document and concatenated, for the checked heads."""

    exact: list[torch.Tensor]
    plains: list[torch.Tensor]
    sdpas: list[torch.Tensor]
    lse_magnitude: float
    heads: tuple[slice, slice]
    dtype: torch.dtype

    @classmethod
    def of(cls, full, cu_seqlens, scale: float, heads: tuple[slice, slice], backward: bool) -> DocumentReference:
        q, k, v, dout = full
        q_heads, kv_heads = heads
        subset = (q[:, :, q_heads], k[:, :, kv_heads], v[:, :, kv_heads], dout[:, :, q_heads] if backward else None)
        exact, plains, sdpas, lse_magnitude = [], [], [], 0.0
        for start, end in itertools.pairwise(cu_seqlens):
            document = [None if tensor is None else tensor[:, start:end] for tensor in subset]
            truth, magnitude = chunked_attention(*document, True, scale, torch.float64)
            exact.append(truth)
            plains.append(chunked_attention(*document, True, scale, q.dtype)[0])
            sdpas.append(single_device_attention(*document, True, backward))
            lse_magnitude = max(lse_magnitude, magnitude)
        joined = [[torch.cat(parts, 1) for parts in zip(*results)] for results in (exact, plains, sdpas)]
        return cls(*joined, lse_magnitude, heads, q.dtype)

    def judge(self, gathered: list[torch.Tensor]) -> Accuracy:
        """accuracy_verdict of gathered [out] or [out, dq, dk, dv] (the whole sequence)."""
        q_heads, kv_heads = self.heads
        per_tensor = [q_heads, q_heads, kv_heads, kv_heads][: len(gathered)]
        ours = [tensor[:, :, h] for tensor, h in zip(gathered, per_tensor)]
        names = ["out", "dq", "dk", "dv"][: len(gathered)]
        return accuracy_verdict(ours, self.plains, self.sdpas, self.exact, self.lse_magnitude, names, self.dtype)


def measure_varlen(case: VarlenCase, ctx: Context, groups: dict) -> list[Row]:
    """The case's candidates checked, bytes counted, then timed side by side: the
    method's row and, for the ring, the layout row."""
    full = case.full_inputs(ctx)
    scale = 1.0 / math.sqrt(case.head_dim)
    grid_groups = groups.get(case.grid)
    attention = attention_function(case, grid_groups)
    layouts = ["balanced", "contiguous"] if case.compares_layouts else ["balanced"]
    plans = {layout: make_plan(case, layout, grid_groups) for layout in layouts}
    # The dense pieces are numbered as the plan's: i * U + j.
    piece = plans["balanced"].piece
    candidates = {"ours": candidate(case, ctx, full, plan_positions(plans["balanced"]), piece, attention,
                                    {"varlen": plans["balanced"]}),
                  "baseline": candidate(case, ctx, full, piece_positions(case, case.grid), piece, attention,
                                        {} if case.method == "ulysses" else {"layout": "zigzag"})}  # fmt: skip
    if case.compares_layouts:
        candidates[CONTIGUOUS_PLAN] = candidate(case, ctx, full, plan_positions(plans["contiguous"]), piece,
                                                attention, {"varlen": plans["contiguous"]})  # fmt: skip
    heads = checked_heads(ctx.on_gpu, case.heads, case.kv_heads)
    reference = DocumentReference.of(full, case.cu_seqlens, scale, heads, case.backward) if ctx.is_root else None
    verdicts, volumes = {}, {}
    for name, each in candidates.items():
        results = each.call()
        if name != "baseline":  # the dense sequence computes something else
            gathered = [gather_pieces(result, each.pieces, each.piece, ctx) for result in results]
            verdicts[name] = reference.judge(gathered) if ctx.is_root else None
        volumes[name] = measure_group_bytes(ctx, each.call, each.theory)
    timings = time_side_by_side({name: each.call for name, each in candidates.items()}, ctx)
    rows = [method_row(case, ctx, timings, verdicts["ours"], volumes, plans["balanced"])]
    if case.compares_layouts:
        rows.append(layout_row(case, ctx, timings, verdicts, volumes, plans))
    return rows


def documents_note(case: VarlenCase) -> str:
    lengths = [end - start for start, end in itertools.pairwise(case.cu_seqlens)]
    total = case.cu_seqlens[-1]
    share = sum(causal_work(length) for length in lengths) / causal_work(total)
    return (f"{case.documents} documents of {min(lengths)} to {max(lengths)} tokens, their causal work "
            f"{share:.1%} of the dense sequence's")  # fmt: skip


def plan_note(name: str, plan) -> str:
    return f"{name} plan: work imbalance {plan.work_imbalance:.3f}, token imbalance {plan.token_imbalance:.3f}"


def padding_note(plan) -> str:
    padding = plan.layout.padding_of_per_document_zigzag()
    return f"per-document zigzag would pad {padding} tokens ({padding / plan.total:.1%})"


def judged(accuracy: Accuracy | None) -> tuple[str, float | None, str]:
    """(check, error_vs_plain, errors) of a verdict; rank 0 alone has one."""
    if accuracy is None:
        return "(checked on rank 0)", None, ""
    return accuracy.check, accuracy.vs_plain, accuracy.detail


def bytes_fields(ours, baseline) -> dict:
    return {
        "bytes_sent_ours": ours.ulysses + ours.ring,
        "bytes_sent_theory": ours.theory_ulysses + ours.theory_ring,
        "volume_at_theory": ours.at_theory,
        "bytes_sent_baseline": baseline.ulysses + baseline.ring,
        "bytes_sent_ulysses_group": ours.ulysses,
        "bytes_sent_ring_group": ours.ring,
    }


def method_row(case: VarlenCase, ctx: Context, timings, accuracy, volumes, plan) -> Row:
    check, vs_plain, errors = judged(accuracy)
    dense = "zigzag" if case.method != "ulysses" else "contiguous"
    detail = "; ".join(part for part in (
        f"baseline: one dense causal sequence ({dense}), {case.grid.label}", documents_note(case),
        plan_note("balanced", plan), padding_note(plan), errors) if part)  # fmt: skip
    return timed_row(
        ctx, {"ours": timings["ours"], "baseline": timings["baseline"]},
        bench=case.bench, case=case.label(ctx.world_size), shape=case.shape(ctx.world_size),
        dtype=short_dtype(case.dtype), check=check, layout="balanced", error_vs_plain=vs_plain,
        ulysses_degree=case.grid.ulysses, ring_degree=case.grid.ring,
        **bytes_fields(volumes["ours"], volumes["baseline"]), detail=detail,
    )  # fmt: skip


def layout_row(case: VarlenCase, ctx: Context, timings, verdicts, volumes, plans) -> Row:
    check, vs_plain, errors = judged(verdicts["ours"])
    other_check, other_vs_plain, other_errors = judged(verdicts[CONTIGUOUS_PLAN])
    if check == "matches" and other_check != "matches":
        check = f"{other_check} (contiguous plan)"
    if vs_plain is not None and other_vs_plain is not None:
        vs_plain = max(vs_plain, other_vs_plain)
    detail = "; ".join(part for part in (
        "baseline: the contiguous plan", documents_note(case), plan_note("balanced", plans["balanced"]),
        plan_note("contiguous", plans["contiguous"]), padding_note(plans["balanced"]),
        f"balanced: {errors}" if errors else "", f"contiguous: {other_errors}" if other_errors else "",
    ) if part)  # fmt: skip
    return timed_row(
        ctx, {"ours": timings["ours"], "baseline": timings[CONTIGUOUS_PLAN]},
        bench=case.layout_bench, case=case.label(ctx.world_size), shape=case.shape(ctx.world_size),
        dtype=short_dtype(case.dtype), check=check, layout="balanced", error_vs_plain=vs_plain,
        ulysses_degree=case.grid.ulysses, ring_degree=case.grid.ring,
        **bytes_fields(volumes["ours"], volumes[CONTIGUOUS_PLAN]), detail=detail,
    )  # fmt: skip


def run(ctx: Context) -> list[Row]:
    ctx.log(BASELINE_NOTE)
    ctx.log(layout_table_text())
    # Group creation is collective over the world: every rank makes every hybrid's, in order.
    groups = {grid: make_usp_groups(grid.ulysses) for method, grid in methods_of(ctx.world_size) if method == "usp"}
    rows = []
    for case in varlen_cases(ctx):
        rows += run_case(ctx, None, measure_varlen, case, groups)
    return rows


FAMILY = Family(
    name="varlen",
    order=80,
    measures="packed documents (varlen=) through ring, Ulysses and USP against the same tokens as one dense sequence",
    run=run,
    sizes=SIZES,
    timed_share=0.84,
    work={"float": 0.2, "half": 0.42, "host": 0.38},
    metadata=lambda: {"varlen_baseline": BASELINE_NOTE, "varlen_layouts": layout_table_metadata()},
)
