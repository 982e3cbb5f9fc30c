"""Inference over a KV cache sharded across ranks against one process holding the whole
cache: the time to the first token against the prompt's length, the time of a decode
step against the cache's length, the KV cache a rank holds and the bytes a call sends
(seqpar_kernels/parallel/inference.py; generate over a sharded cache:
seqpar_kernels/integrations/transformers/generation.py).

Rows (bench column), one per case and candidate. Ours runs on every rank; the baseline
is one process: rank 0 alone, on CPU with every core, while the other ranks wait at the
next round's barrier (as the transformers family's single process):
  inference-prefill  the attention of a first prompt of S tokens, causal: ours
                     ring_attention (zigzag: what generate's prefill runs) and
                     prefill_attention over an empty cache (method "auto": pass-KV for
                     a first prompt), every rank S / P rows; baseline torch SDPA over
                     the whole prompt
  inference-decode   one decode step's attention, the newest query of each sequence
                     over a cache of L tokens: ours decode_attention over every rank's
                     L / P (contiguous pieces); baseline torch SDPA over the whole cache
  inference-turn     a next turn: a chunk of C new tokens (every rank C / P) over a cache
                     of L (every rank L / P) and over itself: ours prefill_attention with
                     method pass-KV and pass-Q (a row each, auto's choice and its bytes
                     in the detail); baseline torch SDPA of the whole chunk over the
                     whole cache and the chunk (causal from the bottom right)
  generate-ttft      model.generate(max_new_tokens=1) of a small random Llama (the prompt's
                     prefill and its first token): ours after
                     sp_transformers.apply(model, "ring", layout="balanced") on every
                     rank; baseline the same model's generate in one process
  generate-decode    a decode step of generate: per round, (generate of 1 + N new tokens -
                     generate of 1) / N, both timed in the same round, both sides; its
                     detail (and check) also gives the cache bytes every rank holds after
                     generate over a left-padded batch of 3 unequal prompts against the
                     share, ceil(total / P) + 1 slots (total: batch x cached columns)
The generate rows need transformers 5 (skipped, with the reason, without it); the op rows
run without it. speedup = one process / ours: on CPU ranks sharing the cores (4 gloo
ranks on 2 here) the ranks' total work against one process's, not a parallel speedup
(bench/README.md, "Transformers training step").

Bytes (rank 0; volume_at_theory: measured = formula on every rank):
  bytes_sent_ours      comm_stats around one call
  bytes_sent_theory    seqpar_kernels.traffic's formula:
      prefill   ring_bytes (forward); prefill_attention_bytes (pass-KV)
      decode    decode_attention_bytes: (P-1) x batch x heads x (head_dim + 1) x 4, at any L
      turn      prefill_attention_bytes of the row's method
      generate  ttft: layers x ring_bytes of the prompt's varlen plan (balanced); decode:
                per step, (the 1 + N tokens' bytes - the 1 token's) / N against layers x
                decode_attention_bytes
  kv_bytes_per_rank    the keys and values the largest rank holds: its cache shard (and
                       chunk piece); generate: its ShardedCache's tensors (packed)
  kv_bytes_whole       the one process's: the whole cache (and chunk); generate: its cache's

check: the op rows' outputs (gathered to rank 0 in sequence order) against an exact fp64
result by the tests' accuracy rule (tools/reference.py: at most 2x the error of plain
torch in the same dtype, or SDPA's, plus a unit of roundoff), "matches" or "MISMATCH
..."; a turn row's check also asks that method="auto" sent the bytes of the method the
rule picks. The generate rows: the greedy tokens equal to the one process's and every
step's scores within SCORE_ATOL (the generation tests' tolerance).

Sizes: bf16 ops, H = 8 query / 2 kv heads of 64 (the ring family's GQA); a decode step
on a batch of DECODE_BATCH sequences, a prompt and a turn on one; the model the
transformers family's Llama (hidden 256, 4 layers, 8 / 2 heads of 32, fp32), one
sequence, greedy. --quick: a prompt of 64, a cache of 256, turns of 16 over 256 and 256
over 16, a tiny Llama's 32-token prompt; the default: prompts of 256 and 1K, caches of 2K
and 16K, turns of 64 over 4K and 1K over 256, generate of a 512-token prompt (4 steps);
--full: prompts of 1K and 4K, caches of 4K, 32K and 128K, turns of 128 over 8K, 256 over
64K and 2K over 512, generate of 256, 1K and 2000-token prompts (16 steps).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.families.shared.baselines import sdpa
from bench.families.transformers import (
    FULL_MODEL,
    QUICK_MODEL,
    ModelSize,
    build_model,
    every_rank,
    transformers_unavailable,
)
from bench.runner.cases import run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import (
    GENERATE_DECODE_BENCH,
    GENERATE_TTFT_BENCH,
    INFERENCE_DECODE_BENCH,
    INFERENCE_PREFILL_BENCH,
    INFERENCE_TURN_BENCH,
    Row,
)
from bench.runner.timing import Timing, time_side_by_side
from bench.runner.verify import Volume, accuracy_verdict, checked_heads, judge_attention, volume_against_theory
from seqpar_kernels import (
    comm_stats,
    decode_attention,
    gather_sequence,
    prefill_attention,
    ring_attention,
    zigzag_gather,
)
from seqpar_kernels.parallel.varlen import varlen_plan
from seqpar_kernels.traffic import (
    PASS_KV,
    PASS_Q,
    decode_attention_bytes,
    prefill_attention_bytes,
    prefill_attention_method,
    ring_bytes,
)
from tools.reference import masked_attention, ring_piece, visible_at

BASELINE_NOTE = (
    "inference: ours = a KV cache sharded across the ranks (ring_attention / prefill_attention of a prompt, "
    "decode_attention of a step, prefill_attention pass-KV / pass-Q of a next turn, generate after "
    "sp_transformers.apply(model, 'ring')); baseline = one process holding the whole cache (rank 0 alone; "
    "torch SDPA, or the model's own generate; on CPU with every core); x = one process / ours (on CPU ranks "
    "sharing cores: total work, not a parallel speedup); bytes: comm_stats against seqpar_kernels.traffic, "
    "KV cache per rank against the whole"
)

SINGLE = "one process"
DTYPE = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
PREFILL_LAYOUT = "zigzag"  # the ring's layout for a causal prompt
DECODE_BATCH = 4  # sequences decoded together (a prompt and a turn: one sequence)
# The generation tests' tolerance on generate's scores (fp32 model; merged partials
# round differently from one softmax).
SCORE_ATOL = 2e-4
# Per case: every candidate ran once before timing (the check, the bytes), so one
# warm-up round; the op cases take milliseconds to a second and fill 1.5 s with rounds,
# a generate round (four generates) takes seconds, so its case stops at 3 rounds.
REPETITIONS = dict(warmup=1, reps=5, max_reps=30, seconds_per_case=1.5)
GENERATE_REPETITIONS = dict(warmup=1, reps=3, max_reps=10, seconds_per_case=4.0)


@dataclass(frozen=True)
class Turn:
    """A next turn: `chunk` new tokens a sequence over `cached` cached ones."""

    cached: int
    chunk: int


@dataclass(frozen=True)
class Shapes:
    """What one size runs: prompt lengths, cache lengths, turns, the model, its prompts."""

    prompts: tuple[int, ...]  # inference-prefill: tokens of the first prompt
    caches: tuple[int, ...]  # inference-decode: cached tokens a sequence
    turns: tuple[Turn, ...]  # inference-turn
    model: ModelSize  # generate-*
    model_prompts: tuple[int, ...]  # generate-*: prompt tokens
    new_tokens: int  # generate-decode: N decode steps timed (1 + N new tokens)


QUICK = Shapes(prompts=(64,), caches=(256,), turns=(Turn(256, 16), Turn(16, 256)), model=QUICK_MODEL,
               model_prompts=(32,), new_tokens=2)  # fmt: skip
# Turns: a short follow-up over a long conversation (pass-Q sends less) and a long
# document after a short one (pass-KV). CPU time sets the lengths: prefill_attention's
# chunk over itself costs 7x SDPA's at 1K (its masked partials), a generate round seconds.
# The Llama has 2048 positions: a prompt and its 1 + N new tokens fit in them.
DEFAULT = Shapes(prompts=(256, 1024), caches=(2048, 16384), turns=(Turn(4096, 64), Turn(256, 1024)),
                 model=FULL_MODEL, model_prompts=(512,), new_tokens=4)  # fmt: skip
FULL = Shapes(prompts=(1024, 4096), caches=(4096, 32768, 131072),
              turns=(Turn(8192, 128), Turn(65536, 256), Turn(512, 2048)), model=FULL_MODEL,
              model_prompts=(256, 1024, 2000), new_tokens=16)  # fmt: skip


def shapes(ctx: Context) -> Shapes:
    return QUICK if ctx.quick else (FULL if ctx.full else DEFAULT)


def _lengths(values) -> str:
    return ", ".join(f"{value // 1024}K" if value >= 1024 and value % 1024 == 0 else str(value) for value in values)


SIZES = Sizes(
    quick=Size("prompt 64, cache 256, two turns; a tiny Llama's generate of a 32-token prompt", 6),
    default=Size(
        f"prefill of {_lengths(DEFAULT.prompts)} tokens, decode over {_lengths(DEFAULT.caches)}, turns "
        f"{', '.join(f'{_lengths([t.chunk])} over {_lengths([t.cached])}' for t in DEFAULT.turns)}; the Llama's "
        f"generate of {_lengths(DEFAULT.model_prompts)}-token prompts (first token, {DEFAULT.new_tokens} steps)",
        21,
    ),
    full=Size(
        f"prefill of {_lengths(FULL.prompts)}, decode over {_lengths(FULL.caches)}, {len(FULL.turns)} turns; "
        f"generate of {_lengths(FULL.model_prompts)}-token prompts ({FULL.new_tokens} steps)",
        168,
    ),
)


def generate_unavailable() -> str | None:
    """Why the generate rows cannot run (transformers missing, or older than 5), or None."""
    reason = transformers_unavailable()
    if reason is not None:
        return reason
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return f"transformers {transformers.__version__}: generate over a sharded cache needs transformers 5"
    return None


# ----------------------------------------------------------------------------------
# What the cases share
# ----------------------------------------------------------------------------------


def kv_bytes(ctx: Context, *tensors: torch.Tensor) -> int:
    """The bytes of `tensors` on the rank holding the most (collective)."""
    held = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    return int(ctx.reduce_over_ranks(torch.tensor([held], dtype=torch.int64)).item())


def one_process(ctx: Context, fn):
    """fn as the one process: on rank 0 with every core; nothing elsewhere."""

    def call():
        if ctx.is_root:
            with ctx.every_core():
                return fn()
        return None

    return call


def with_bytes(fn) -> tuple[object, int]:
    """(fn(), the bytes seqpar's collectives sent from this rank during it)."""
    with comm_stats() as sent:
        result = fn()
    return result, sent.bytes_sent


def in_sequence_order(local: torch.Tensor, layout: str) -> torch.Tensor:
    """The ranks' pieces (B, S_l, ...) of `layout` gathered into sequence order (collective)."""
    return (zigzag_gather if layout == "zigzag" else gather_sequence)(local.contiguous(), 1)


def check_over_cache(q, k, v, q_positions, ours, baseline) -> tuple[str, str]:
    """(check, detail) of ours against the exact fp64 attention of q (B, Tq, H, D) at
    q_positions (B, Tq) over k, v (B, S, H_kv, D) at positions 0..S-1, causal, by the
    accuracy rule (plain attention in q's dtype and the baseline's SDPA the yardsticks).
    A q head at a time: the scores of a long chunk over its cache in fp64 are large."""
    keep = visible_at(q_positions, torch.arange(k.shape[1]).expand(k.shape[0], -1), causal=True).unsqueeze(1)
    group = q.shape[2] // k.shape[2]
    exact, plain, lse_magnitude = [], [], 0.0
    for head in range(q.shape[2]):
        one = (q[:, :, head : head + 1], k[:, :, head // group : head // group + 1],
               v[:, :, head // group : head // group + 1])  # fmt: skip
        out, lse = masked_attention(*(t.double() for t in one), keep)
        exact.append(out)
        plain.append(masked_attention(*one, keep)[0])
        lse_magnitude = max(lse_magnitude, lse[torch.isfinite(lse)].abs().max().item())
    accuracy = accuracy_verdict([ours], [torch.cat(plain, 2)], [baseline], [torch.cat(exact, 2)], lse_magnitude,
                                ["out"], q.dtype)  # fmt: skip
    return accuracy.check, accuracy.detail


# ----------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpCase:
    """One op case: kind "prefill" (a prompt of `tokens`), "decode" (a cache of `tokens`
    a sequence) or "turn" (`turn`)."""

    kind: str
    tokens: int = 0
    turn: Turn | None = None

    @property
    def dtype(self) -> torch.dtype:
        return DTYPE

    @property
    def batch(self) -> int:
        return DECODE_BATCH if self.kind == "decode" else 1

    @property
    def label(self) -> str:
        if self.kind == "turn":
            return f"C={self.turn.chunk} over L={self.turn.cached}"
        return f"{'S' if self.kind == 'prefill' else 'L'}={self.tokens}"

    @property
    def shape(self) -> str:
        what = {"prefill": f"prompt S={self.tokens}", "decode": f"cache L={self.tokens}, 1 query",
                "turn": f"cache L={self.turn.cached}, chunk C={self.turn.chunk}" if self.turn else ""}  # fmt: skip
        return f"B={self.batch} {what[self.kind]} H={HEADS} H_kv={KV_HEADS} D={HEAD_DIM}"


def op_cases(ctx: Context) -> list[OpCase]:
    sizes = shapes(ctx)
    return ([OpCase("prefill", tokens) for tokens in sizes.prompts]
            + [OpCase("decode", tokens) for tokens in sizes.caches]
            + [OpCase("turn", turn=turn) for turn in sizes.turns])  # fmt: skip


def whole_sequence(ctx: Context, batch: int, queries: int, keys: int):
    """q (B, Tq, H, D) and k, v (B, S, H_kv, D), the same on every rank (seeded)."""
    return (ctx.random((batch, queries, HEADS, HEAD_DIM), DTYPE, 20),
            ctx.random((batch, keys, KV_HEADS, HEAD_DIM), DTYPE, 21),
            ctx.random((batch, keys, KV_HEADS, HEAD_DIM), DTYPE, 22))  # fmt: skip


def cache_shard(ctx: Context, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> dict:
    """This rank's contiguous piece of the cache k, v (B, L, H_kv, D) as
    decode_attention and prefill_attention take it; positions from `start`."""
    rows = torch.tensor_split(torch.arange(k.shape[1]), ctx.world_size)[ctx.rank]
    batch = k.shape[0]
    return dict(k_cache=k[:, rows].contiguous(), v_cache=v[:, rows].contiguous(),
                cache_positions=(start + rows).expand(batch, -1).contiguous().to(ctx.device),
                cache_lengths=torch.full((batch,), rows.numel(), dtype=torch.int64, device=ctx.device))  # fmt: skip


def sizes_of(case: OpCase) -> dict:
    return dict(batch=case.batch, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                element_size=DTYPE.itemsize)  # fmt: skip


def measure_prefill(case: OpCase, ctx: Context) -> list[Row]:
    """The first prompt's attention: ring_attention (zigzag) and prefill_attention over an
    empty cache (contiguous pieces) against SDPA over the whole prompt."""
    world_size, length = ctx.world_size, case.tokens
    q, k, v = whole_sequence(ctx, 1, length, length)
    ring_local = [ring_piece(t, PREFILL_LAYOUT, ctx.rank, world_size).contiguous() for t in (q, k, v)]
    seq_lens = [ring_piece(q, PREFILL_LAYOUT, rank, world_size).shape[1] for rank in range(world_size)]
    chunk = [ring_piece(t, "contiguous", ctx.rank, world_size).contiguous() for t in (q, k, v)]
    chunk_lens = [ring_piece(q, "contiguous", rank, world_size).shape[1] for rank in range(world_size)]
    start = sum(chunk_lens[: ctx.rank])
    positions = torch.arange(start, start + chunk_lens[ctx.rank], device=ctx.device)[None]
    empty = dict(k_cache=chunk[1][:, :0], v_cache=chunk[2][:, :0], cache_positions=positions[:, :0],
                 cache_lengths=torch.zeros(1, dtype=torch.int64, device=ctx.device))  # fmt: skip
    cache_lens = [0] * world_size
    method = prefill_attention_method(cache_lens, chunk_lens, **sizes_of(case))

    def ring():
        return ring_attention(*ring_local, causal=True, layout=PREFILL_LAYOUT, seq_lens=seq_lens)

    def prefill():
        return prefill_attention(*chunk, **empty, q_positions=positions, method=method, check_ranks=False,
                                 chunk_seq_lens=chunk_lens, cache_seq_lens=cache_lens)  # fmt: skip

    candidates = {"ring_attention": (ring, PREFILL_LAYOUT, ring_bytes(seq_lens, ctx.rank, batch=1,
                                     num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                     element_size=DTYPE.itemsize).forward),
                  f"prefill_attention {method}": (prefill, "contiguous", prefill_attention_bytes(
                      cache_lens, chunk_lens, ctx.rank, method=method, **sizes_of(case)))}  # fmt: skip
    single = one_process(ctx, lambda: sdpa(q, k, v, True))
    with torch.no_grad():
        expected = single()
        results = {}
        for name, (fn, layout, theory) in candidates.items():
            out, sent = with_bytes(fn)
            results[name] = (volume_against_theory(ctx, sent, theory), in_sequence_order(out, layout))
        verdicts = {}
        for name, (_, whole) in results.items():
            if ctx.is_root:
                heads = checked_heads(ctx.on_gpu, HEADS, KV_HEADS)
                accuracy = judge_attention([whole], [expected], (q, k, v, None), True, HEAD_DIM**-0.5, heads)
                verdicts[name] = (accuracy.check, accuracy.detail)
            else:
                verdicts[name] = ("", "")
        timings = time_side_by_side({SINGLE: single, **{name: fn for name, (fn, _, _) in candidates.items()}},
                                    timing_context(ctx))  # fmt: skip
    kv_whole = 2 * k.numel() * k.element_size()
    kv_rank = kv_bytes(ctx, chunk[1], chunk[2])
    rows = []
    for name, (_, layout, _) in candidates.items():
        volume = results[name][0]
        check, accuracy = verdicts[name]
        detail = (f"{name} on every rank's {layout} piece ({seq_lens if layout == PREFILL_LAYOUT else chunk_lens} "
                  f"rows); one process: torch SDPA over the whole prompt; {accuracy}")  # fmt: skip
        rows.append(op_row(ctx, case, timings, name, volume, kv_rank, kv_whole, check, detail, layout=layout))
    return rows


def measure_decode(case: OpCase, ctx: Context) -> list[Row]:
    """One decode step: the newest query of each sequence over the cache, decode_attention
    over the ranks' contiguous pieces against SDPA over the whole cache."""
    length, batch = case.tokens, case.batch
    q, k, v = whole_sequence(ctx, batch, 1, length)
    q_positions = torch.full((batch, 1), length - 1, dtype=torch.int64, device=ctx.device)
    shard = cache_shard(ctx, k, v)

    def ours():
        return decode_attention(q, **shard, q_positions=q_positions, check_ranks=False)

    single = one_process(ctx, lambda: sdpa(q, k, v, False))
    theory = decode_attention_bytes([ctx.world_size], batch=batch, num_queries=1, num_heads=HEADS, head_dim=HEAD_DIM)
    with torch.no_grad():
        out, sent = with_bytes(ours)
        volume = volume_against_theory(ctx, sent, theory)
        expected = single()
        check, accuracy = check_over_cache(q, k, v, q_positions, out, expected) if ctx.is_root else ("", "")
        timings = time_side_by_side({SINGLE: single, "decode_attention": ours}, timing_context(ctx))
    kv_rank = kv_bytes(ctx, shard["k_cache"], shard["v_cache"])
    detail = (f"decode_attention over every rank's contiguous L/P rows (check_ranks=False, as generate calls it); "
              f"one process: torch SDPA over the whole cache; sent at any L: (P-1) x B x H x (D+1) x 4; "
              f"{accuracy}")  # fmt: skip
    return [op_row(ctx, case, timings, "decode_attention", volume, kv_rank, 2 * k.numel() * k.element_size(), check,
                   detail)]  # fmt: skip


def turn_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The chunk's queries q (B, C, H, D), the last C of the sequence, over k, v (B, L + C,
    H_kv, D): torch SDPA with the causal mask from the bottom right; (B, C, H, D)."""
    keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril(k.shape[1] - q.shape[1])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep,
                                         enable_gqa=True)  # fmt: skip
    return out.transpose(1, 2)


def measure_turn(case: OpCase, ctx: Context) -> list[Row]:
    """A next turn: the chunk's pieces over the cache's pieces and the chunk, by pass-KV and
    by pass-Q, against SDPA of the whole chunk over the whole cache and chunk."""
    cached, chunk_len, batch = case.turn.cached, case.turn.chunk, case.batch
    q, k, v = whole_sequence(ctx, batch, chunk_len, cached + chunk_len)
    shard = cache_shard(ctx, k[:, :cached], v[:, :cached])
    pieces = torch.tensor_split(torch.arange(cached, cached + chunk_len), ctx.world_size)
    rows, chunk_lens = pieces[ctx.rank], [piece.numel() for piece in pieces]
    local = (q[:, rows - cached].contiguous(), k[:, rows].contiguous(), v[:, rows].contiguous())
    positions = rows.expand(batch, -1).contiguous().to(ctx.device)
    cache_lens = [piece.numel() for piece in torch.tensor_split(torch.arange(cached), ctx.world_size)]
    sizes = sizes_of(case)
    chosen = prefill_attention_method(cache_lens, chunk_lens, **sizes)

    def call(method):
        return lambda: prefill_attention(*local, **shard, q_positions=positions, method=method, check_ranks=False,
                                         chunk_seq_lens=chunk_lens, cache_seq_lens=cache_lens)  # fmt: skip

    methods = {method: call(method) for method in (PASS_KV, PASS_Q)}
    single = one_process(ctx, lambda: turn_baseline(q, k, v))
    formulas = {method: prefill_attention_bytes(cache_lens, chunk_lens, ctx.rank, method=method, **sizes)
                for method in (*methods, chosen)}  # fmt: skip
    with torch.no_grad():
        expected = single()
        results = {}
        for method, fn in methods.items():
            out, sent = with_bytes(fn)
            results[method] = (volume_against_theory(ctx, sent, formulas[method]),
                               in_sequence_order(out, "contiguous"))  # fmt: skip
        _, auto_sent = with_bytes(call("auto"))
        auto = volume_against_theory(ctx, auto_sent, formulas[chosen])
        q_positions = torch.arange(cached, cached + chunk_len).expand(batch, -1)
        verdicts = {method: check_over_cache(q, k, v, q_positions, whole, expected) if ctx.is_root else ("", "")
                    for method, (_, whole) in results.items()}  # fmt: skip
        timings = time_side_by_side({SINGLE: single, **methods}, timing_context(ctx))
    totals = {method: every_rank_sum(ctx, formulas[method]) for method in methods}
    kv_rank = kv_bytes(ctx, shard["k_cache"], shard["v_cache"], local[1], local[2])
    rows = []
    for method in methods:
        volume = results[method][0]
        check, accuracy = verdicts[method]
        if not auto.at_theory:
            check = f"MISMATCH auto sent {auto.measured} B, {chosen}'s formula {auto.theory} B"
        other = PASS_Q if method == PASS_KV else PASS_KV
        detail = (f"prefill_attention method={method!r}, every rank C/P new rows over its L/P cached ones; auto chose "
                  f"{chosen} (sent {auto.measured} B on rank 0, its formula's: {auto.at_theory}); all ranks send "
                  f"{totals[method]} B by {method}, {totals[other]} B by {other}; one process: torch SDPA of the "
                  f"chunk over the cache and itself; {accuracy}")  # fmt: skip
        rows.append(op_row(ctx, case, timings, method, volume, kv_rank, 2 * k.numel() * k.element_size(), check,
                           detail))  # fmt: skip
    return rows


def every_rank_sum(ctx: Context, value: int) -> int:
    """value summed over the ranks (collective)."""
    return int(ctx.reduce_over_ranks(torch.tensor([value], dtype=torch.int64), op=dist.ReduceOp.SUM).item())


def timing_context(ctx: Context, repetitions: dict = REPETITIONS) -> Context:
    return ctx if ctx.quick else dataclasses.replace(ctx, **repetitions)


OP_BENCHES = {"prefill": INFERENCE_PREFILL_BENCH, "decode": INFERENCE_DECODE_BENCH, "turn": INFERENCE_TURN_BENCH}


def op_row(ctx: Context, case: OpCase, timings: dict[str, Timing], name: str, volume: Volume, kv_rank: int,
           kv_whole: int, check: str, detail: str, layout: str = "contiguous") -> Row:  # fmt: skip
    return timed_row(
        ctx, {"ours": timings[name], "baseline": timings[SINGLE]},
        bench=OP_BENCHES[case.kind], case=f"{name} {case.label}", shape=case.shape, dtype="bf16", check=check,
        layout=layout, bytes_sent_ours=volume.measured, bytes_sent_theory=volume.theory,
        volume_at_theory=volume.at_theory, kv_bytes_per_rank=kv_rank, kv_bytes_whole=kv_whole, detail=detail,
    )  # fmt: skip


MEASURE = {"prefill": measure_prefill, "decode": measure_decode, "turn": measure_turn}


def measure_op(case: OpCase, ctx: Context) -> list[Row]:
    return MEASURE[case.kind](case, ctx)


# ----------------------------------------------------------------------------------
# generate
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateCase:
    model: ModelSize
    prompt: int  # tokens of the one sequence's prompt
    new_tokens: int  # N: decode steps timed (1 + N new tokens)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def label(self) -> str:
        return f"S={self.prompt}"

    @property
    def shape(self) -> str:
        return f"{self.model.label}; B=1 prompt S={self.prompt}, greedy"


def generate_cases(ctx: Context) -> list[GenerateCase]:
    sizes = shapes(ctx)
    return [GenerateCase(sizes.model, prompt, sizes.new_tokens) for prompt in sizes.model_prompts]


def generate(model, ids: torch.Tensor, new_tokens: int, attention_mask: torch.Tensor | None = None):
    """Greedy generate of exactly new_tokens tokens (no early end), its cache and scores."""
    attention_mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    return model.generate(ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, use_cache=True,
                          return_dict_in_generate=True, output_scores=True)  # fmt: skip


def unequal_prompts(prompt: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of 3 prompts of `prompt`, about a half and a quarter as many
    tokens: ids (3, prompt) and their attention mask."""
    ids = torch.randint(3, vocab, (3, prompt), generator=torch.Generator().manual_seed(prompt + 1))
    mask = torch.ones_like(ids)
    for row, pads in ((1, prompt // 2), (2, prompt - prompt // 4 - 1)):
        ids[row, :pads], mask[row, :pads] = 0, 0
    return ids.to(device), mask.to(device)


def batch_cache_against_share(ctx: Context, model, case: GenerateCase, steps: int) -> tuple[str, str]:
    """(check, detail): generate over a left-padded batch of unequal prompts, the cache
    bytes every rank holds against its share, ceil(total / P) + 1 slots a layer (total:
    batch x the columns one process caches, padding included)."""
    ids, mask = unequal_prompts(case.prompt, case.model.vocab, ctx.device)
    cache = generate(model, ids, steps, attention_mask=mask).cache
    held = [int(each) for each in every_rank(ctx, sum(t.numel() * t.element_size() for t in cache_tensors(cache)))]
    slot_bytes = case.model.layers * 2 * case.model.kv_heads * case.model.head_dim * 4  # fp32 K and V, every layer
    total = ids.shape[0] * (ids.shape[1] + steps - 1)
    share = (-(-total // ctx.world_size) + 1) * slot_bytes
    lengths = mask.sum(1).tolist()
    detail = (f"a left-padded batch of prompts of {lengths} tokens, {steps} new: every rank holds {held} cache "
              f"bytes, its share ceil({total} / {ctx.world_size}) + 1 slots = {share} bytes; one process "
              f"{total * slot_bytes}")  # fmt: skip
    return ("matches" if max(held) <= share else "MISMATCH cache over its share"), detail


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every layer's keys and values a generate's cache holds."""
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]


def compare_generate(ours, theirs) -> tuple[str, str]:
    """(check, detail) of ours' tokens and scores against the one process's: the same
    tokens, -inf at the same places (min_new_tokens masks the end token), the finite
    scores within SCORE_ATOL."""
    if not torch.equal(ours.sequences, theirs.sequences):
        return "MISMATCH tokens", f"tokens {ours.sequences.tolist()} != {theirs.sequences.tolist()}"
    error = 0.0
    for mine, expected in zip(ours.scores, theirs.scores):
        finite = torch.isfinite(expected)
        if not torch.equal(finite, torch.isfinite(mine)):
            return "MISMATCH scores", "scores finite at other places"
        error = max(error, (mine[finite] - expected[finite]).abs().max().item())
    check = "matches" if error <= SCORE_ATOL else "MISMATCH scores"
    return check, f"tokens equal; scores within {error:.1e} (tolerance {SCORE_ATOL:g})"


def per_step(steps: Timing, first: Timing, new_tokens: int) -> Timing:
    """A decode step's samples: each round's (1 + N tokens' time - 1 token's) / N."""
    return Timing(tuple((many - one) / new_tokens for many, one in zip(steps.samples_s, first.samples_s)))


def measure_generate(case: GenerateCase, ctx: Context) -> list[Row]:
    import seqpar_kernels.integrations.transformers as sp_transformers

    config = case.model
    reference = build_model(config, ctx.device).eval()
    model = copy.deepcopy(reference)
    sp_transformers.apply(model, "ring", layout="balanced")
    ids = torch.randint(3, config.vocab, (1, case.prompt), generator=torch.Generator().manual_seed(case.prompt))
    ids = ids.to(ctx.device)
    steps = 1 + case.new_tokens
    candidates = {
        f"{SINGLE}, 1 token": one_process(ctx, lambda: generate(reference, ids, 1)),
        f"{SINGLE}, {steps} tokens": one_process(ctx, lambda: generate(reference, ids, steps)),
        "ring, 1 token": lambda: generate(model, ids, 1),
        f"ring, {steps} tokens": lambda: generate(model, ids, steps),
    }
    names = list(candidates)
    with torch.no_grad():
        first, first_sent = with_bytes(candidates[names[2]])
        many, many_sent = with_bytes(candidates[names[3]])
        expected_first, expected_many = candidates[names[0]](), candidates[names[1]]()
        timings = time_side_by_side(candidates, timing_context(ctx, GENERATE_REPETITIONS))
    # The prompt's prefill: every layer's ring over the varlen plan of one document.
    plan = varlen_plan([0, case.prompt], layout="balanced", device=ctx.device)
    ttft_theory = config.layers * ring_bytes(plan.seq_lens, ctx.rank, batch=1, num_kv_heads=config.kv_heads,
                                             head_dim=config.head_dim, element_size=4).forward  # fmt: skip
    step_theory = config.layers * decode_attention_bytes([ctx.world_size], batch=1, num_queries=1,
                                                         num_heads=config.heads, head_dim=config.head_dim)  # fmt: skip
    step_sent, remainder = divmod(many_sent - first_sent, case.new_tokens)
    volumes = {"ttft": volume_against_theory(ctx, first_sent, ttft_theory),
               "decode": volume_against_theory(ctx, step_sent if not remainder else -1, step_theory)}  # fmt: skip
    kv_rank = kv_bytes(ctx, *cache_tensors(many.cache))
    kv_whole = sum(t.numel() * t.element_size() for t in cache_tensors(expected_many.cache)) if ctx.is_root else 0
    verdicts = ({"ttft": compare_generate(first, expected_first), "decode": compare_generate(many, expected_many)}
                if ctx.is_root else {"ttft": ("", ""), "decode": ("", "")})  # fmt: skip
    held = int(many.cache.lengths.sum())
    tokens_held = every_rank(ctx, held)
    batch_check, batch_detail = batch_cache_against_share(ctx, model, case, steps)
    rows = []
    for kind, bench, ours, baseline in (
        ("ttft", GENERATE_TTFT_BENCH, timings[names[2]], timings[names[0]]),
        ("decode", GENERATE_DECODE_BENCH, per_step(timings[names[3]], timings[names[2]], case.new_tokens),
         per_step(timings[names[1]], timings[names[0]], case.new_tokens)),
    ):  # fmt: skip
        check, verdict = verdicts[kind]
        if kind == "decode" and batch_check != "matches":
            check = batch_check
        what = ("generate(max_new_tokens=1): the prompt's prefill and the first token" if kind == "ttft" else
                f"a decode step: (generate of {steps} tokens - of 1) / {case.new_tokens}, per round")  # fmt: skip
        detail = "; ".join([
            f"{what}; ours: apply(model, 'ring', layout='balanced') on every rank; one process: the model's own "
            "generate (sdpa, DynamicCache)",
            f"after {steps} tokens every rank holds [{', '.join(str(int(t)) for t in tokens_held)}] of "
            f"{case.prompt + case.new_tokens} cached tokens",
            verdict,
            *([batch_detail] if kind == "decode" else []),
        ])  # fmt: skip
        volume = volumes[kind]
        rows.append(timed_row(
            ctx, {"ours": ours, "baseline": baseline},
            bench=bench, case=f"ring {case.label}", shape=case.shape, dtype="fp32", check=check, layout="balanced",
            bytes_sent_ours=volume.measured, bytes_sent_theory=volume.theory, volume_at_theory=volume.at_theory,
            kv_bytes_per_rank=kv_rank, kv_bytes_whole=kv_whole or None, detail=detail,
        ))  # fmt: skip
    return rows


def run(ctx: Context) -> list[Row]:
    ctx.log(BASELINE_NOTE)
    ctx.log_every_core("inference")
    rows = []
    for case in op_cases(ctx):
        rows += run_case(ctx, OP_BENCHES[case.kind], measure_op, case)
    reason = generate_unavailable()
    if reason is not None:
        ctx.log(f"inference: generate rows skipped ({reason})")
        return rows
    for case in generate_cases(ctx):
        rows += run_case(ctx, GENERATE_TTFT_BENCH, measure_generate, case)
    return rows


FAMILY = Family(
    name="inference",
    order=160,
    measures="a KV cache sharded across the ranks (prefill, decode, a next turn, generate) against one process",
    run=run,
    sizes=SIZES,
    timed_share=0.71,
    work={"float": 0.46, "half": 0.09, "exchange": 0.01, "host": 0.44},
    fewest_share=0.67,  # 1 warm-up + 5 timed rounds a case: the fewest keep 4 of 6
    metadata=lambda: {"inference_baseline": BASELINE_NOTE, "inference_generate_skipped": generate_unavailable()},
)
