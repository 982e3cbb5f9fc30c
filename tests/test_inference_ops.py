"""Inference over a KV cache sharded across ranks (seqpar_kernels/parallel/inference.py):
decode_attention, prefill_attention (pass-KV and pass-Q), and the engines' entry
(decode_attention_partial, merge_attention_partials), on 1-4 gloo ranks and a 2 x 2 USP
grid, against attention written out in fp64 over the whole cache (tools/reference.py
masked_attention, the mask from the positions by its definitions).

Every rank draws the same sequences from a seed: keys and values by position, each
sequence's cached tokens dealt to the ranks (scattered in random order with padding rows
of NaN, contiguous, or none on the last rank), so shards of every size, empty ones
included, and per-sequence lengths that differ. Each call's bytes are compared with
seqpar_kernels.traffic's formulas (comm_stats).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from conftest import pool_for
from on_ranks import on_every_rank, raises, rank_and_world, timeout_group
from test_usp import position as grid_position
from test_usp import usp_groups

import seqpar_kernels as sp
from seqpar_kernels.engine.decode import PartialAttention, attend_keys_
from seqpar_kernels.engine.steps import StepSpec
from seqpar_kernels.traffic import (
    PASS_KV,
    PASS_Q,
    decode_attention_bytes,
    prefill_attention_bytes,
    prefill_attention_method,
)
from tools import reference

NEG_INF = float("-inf")


def case(id, kind, *, cached=(9, 4), Tq=1, chunk=5, H=4, H_kv=2, D=8, causal=True, window=(-1, -1),
         attention_chunk=None, softcap=0.0, sinks=False, scale=None, layout="scattered", method="auto"):  # fmt: skip
    """kind "decode" (Tq queries, the last Tq cached positions) or "prefill" (a chunk of
    `chunk` new tokens after the cached ones); cached: each sequence's cached tokens over
    all ranks; layout: how they are dealt ("scattered", "contiguous", "last-empty")."""
    return dict(id=id, kind=kind, cached=cached, Tq=Tq, chunk=chunk, H=H, H_kv=H_kv, D=D, causal=causal,
                window=window, attention_chunk=attention_chunk, softcap=softcap, sinks=sinks, scale=scale,
                layout=layout, method=method)  # fmt: skip


# ----------------------------------------------------------------------------------
# The sequences, the same on every rank
# ----------------------------------------------------------------------------------


def deal(cached, world_size, layout, generator):
    """Per rank, per sequence, the positions of its cached tokens (a list of lists), and
    per rank its padding rows."""
    dealt = [[[] for _ in cached] for _ in range(world_size)]
    for b, total in enumerate(cached):
        if layout == "contiguous":
            for rank, piece in enumerate(torch.tensor_split(torch.arange(total), world_size)):
                dealt[rank][b] = piece.tolist()
            continue
        holders = world_size - 1 if layout == "last-empty" and world_size > 1 else world_size
        owner = torch.randint(holders, (total,), generator=generator)
        for position in torch.randperm(total, generator=generator).tolist():  # any order on a rank
            dealt[owner[position]][b].append(position)
    padding = [0 if layout == "contiguous" else int(torch.randint(3, (), generator=generator)) for _ in dealt]
    if layout == "last-empty":
        padding[-1] = 0
    return dealt, padding


def draw(one, world_size, seed, dtype):
    """The whole problem and every rank's share of it. Keys and values are drawn by
    position: K[b, p] is sequence b's key at position p."""
    generator = torch.Generator().manual_seed(seed)
    cached = list(one["cached"])
    batch, chunk = len(cached), one["chunk"] if one["kind"] == "prefill" else 0
    longest = max(cached) + chunk

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    K, V = randn(batch, longest, one["H_kv"], one["D"]), randn(batch, longest, one["H_kv"], one["D"])
    if one["kind"] == "decode":
        queries = one["Tq"]
        q_positions = torch.tensor([[total - queries + i for i in range(queries)] for total in cached])
    else:
        queries = chunk
        q_positions = torch.tensor([[total + i for i in range(chunk)] for total in cached])
    Q = randn(batch, queries, one["H"], one["D"])
    sinks = randn(one["H"]) if one["sinks"] else None
    dealt, padding = deal(cached, world_size, one["layout"], generator)
    shards = []
    for rank in range(world_size):
        rows = max(len(positions) for positions in dealt[rank]) + padding[rank]
        k_cache = torch.full((batch, rows, one["H_kv"], one["D"]), float("nan"), dtype=dtype)
        v_cache = k_cache.clone()
        cache_positions = torch.randint(-3, 2 * longest, (batch, rows), generator=generator)  # padding: anything
        for b, positions in enumerate(dealt[rank]):
            k_cache[b, : len(positions)] = K[b, positions].to(dtype)
            v_cache[b, : len(positions)] = V[b, positions].to(dtype)
            cache_positions[b, : len(positions)] = torch.tensor(positions, dtype=torch.long)
        lengths = torch.tensor([len(positions) for positions in dealt[rank]])
        shards.append(dict(k_cache=k_cache, v_cache=v_cache, cache_positions=cache_positions, cache_lengths=lengths))
    total = torch.tensor(cached) + chunk
    keep = reference.visible_at(q_positions, torch.arange(longest).expand(batch, longest), one["causal"],
                                one["window"], one["attention_chunk"])  # fmt: skip
    keep = (keep & (torch.arange(longest) < total[:, None])[:, None, :]).unsqueeze(1)  # (B, 1, Tq, keys)
    return dict(Q=Q, K=K, V=V, q_positions=q_positions, sinks=sinks, shards=shards, keep=keep)


def expected(one, problem, dtype):
    """(out, lse) over the whole cache: in fp64, and plain torch's in dtype."""
    options = dict(softcap=one["softcap"])
    scale = one["scale"]
    tensors = (problem["Q"], problem["K"], problem["V"])
    exact = reference.masked_attention(*tensors, problem["keep"], scale, sinks=problem["sinks"], **options)
    sinks = None if problem["sinks"] is None else problem["sinks"].to(dtype)
    plain = reference.masked_attention(*(t.to(dtype) for t in tensors), problem["keep"], scale, sinks=sinks, **options)
    return exact, plain


# ----------------------------------------------------------------------------------
# The ops on the ranks
# ----------------------------------------------------------------------------------


def options_of(one):
    return dict(causal=one["causal"], window_size=one["window"], attention_chunk_size=one["attention_chunk"],
                softcap=one["softcap"], softmax_scale=one["scale"])  # fmt: skip


def run_ops(one, problem, dtype, ranks):
    """(out, lse, bytes sent, bytes expected) of the case's op on this rank; ranks:
    dict(group=...) or a grid's keyword arguments."""
    rank, world_size = rank_and_world()
    shard = problem["shards"][rank]
    sinks = problem["sinks"]
    options = dict(options_of(one), sinks=None if sinks is None else sinks.float(), return_lse=True)
    batch, _, heads, head_dim = problem["Q"].shape
    if one["kind"] == "decode":
        q = problem["Q"].to(dtype)
        with sp.comm_stats() as stats:
            out, lse = sp.decode_attention(q, **shard, q_positions=problem["q_positions"], **ranks, **options)
        sizes = [world_size] if "group" in ranks else [2, 2]
        sent = decode_attention_bytes(sizes, batch=batch, num_queries=q.shape[1], num_heads=heads, head_dim=head_dim)
        return out, lse, stats.bytes_sent, sent, slice(None)
    pieces = torch.tensor_split(torch.arange(one["chunk"]), world_size)
    # The chunk's pieces in piece order: a grid's ring index i and Ulysses index j at i * U + j.
    i, j, _, ulysses_size = (rank, 0, world_size, 1) if "group" in ranks else grid_position(ranks)
    piece = pieces[i * ulysses_size + j]
    rows = slice(int(piece[0]), int(piece[0]) + len(piece)) if len(piece) else slice(0, 0)
    positions = problem["q_positions"][:, rows]
    index = positions[:, :, None, None].expand(-1, -1, one["H_kv"], one["D"])
    q = problem["Q"][:, rows].to(dtype)
    k, v = (torch.gather(problem[name], 1, index).to(dtype) for name in ("K", "V"))
    with sp.comm_stats() as stats:
        out, lse = sp.prefill_attention(q, k, v, **shard, q_positions=positions, method=one["method"], **ranks,
                                        **options)  # fmt: skip
    cache_rows = [each["k_cache"].shape[1] for each in problem["shards"]]
    chunk_rows = [len(piece) for piece in pieces]
    sizes = dict(batch=batch, num_heads=heads, num_kv_heads=one["H_kv"], head_dim=head_dim,
                 element_size=q.element_size())  # fmt: skip
    # A grid's ranks run pass-Q.
    method = one["method"]
    if method == "auto":
        method = prefill_attention_method(cache_rows, chunk_rows, **sizes) if ulysses_size == 1 else PASS_Q
    sent = prefill_attention_bytes(cache_rows, chunk_rows, i * ulysses_size + j, method=method,
                                   ulysses_size=ulysses_size, **sizes) if world_size > 1 else 0  # fmt: skip
    return out, lse, stats.bytes_sent, sent, rows


def error_of(got, want) -> float:
    """Largest error of the finite values (an lse holds -inf for rows that see no key);
    inf where -inf stands in one only."""
    empty = want == NEG_INF
    if not torch.equal(empty, got == NEG_INF):
        return math.inf
    return reference.max_error(got[~empty], want[~empty])


@on_every_rank
def run_cases(cases, dtype, grid=None, autocast=False):
    """Per case, what breaks: out or lse beyond the accuracy rule (fp32: 2e-5 of the
    magnitude; fp16/bf16: twice plain torch's error in the dtype, plus a unit of
    roundoff), or bytes other than the formula's. autocast: the ops run under
    torch.autocast in dtype (as a model's forward calls them), plain torch without it."""
    ranks = dict(group=timeout_group()) if grid is None else usp_groups(grid, 2)
    failures = []
    for seed, one in enumerate(cases):
        problem = draw(one, rank_and_world()[1], seed, dtype)
        exact, plain = expected(one, problem, dtype)
        with torch.autocast("cpu", dtype=dtype) if autocast else contextlib.nullcontext():
            out, lse, sent, formula, rows = run_ops(one, problem, dtype, ranks)
        if out.dtype != dtype or lse.dtype != torch.float32:
            failures.append(f"{one['id']}: out {out.dtype}, lse {lse.dtype}")
        for name, got, want, yardstick in zip(("out", "lse"), (out, lse), exact, plain):
            index = (slice(None), rows) if name == "out" else (slice(None), slice(None), rows)
            want, yardstick = want[index], yardstick[index]
            magnitude = reference.magnitude(want.nan_to_num(0.0, neginf=0.0))
            if dtype == torch.float32:
                bound = reference.FP32_TOLERANCE * max(magnitude, 1.0)
            else:
                bound = reference.error_bound(dtype, error_of(yardstick, want), magnitude)
            error = error_of(got, want)
            if not error <= bound:
                failures.append(f"{one['id']} {name}: error {error:.3g} > {bound:.3g}")
        if sent != formula:
            failures.append(f"{one['id']}: sent {sent} bytes, the formula says {formula}")
    return failures


# fmt: off
CASES = [
    case("decode-gqa", "decode", Tq=1),
    case("decode-mqa-window", "decode", Tq=3, H=3, H_kv=1, window=(4, -1), cached=(11, 6)),
    case("decode-two-sided-window", "decode", Tq=3, causal=False, window=(2, 2), layout="contiguous"),
    case("decode-chunks", "decode", Tq=3, attention_chunk=4, cached=(10, 7), layout="last-empty"),
    case("decode-softcap-sinks-no-cache", "decode", Tq=1, softcap=1.5, sinks=True, cached=(8, 0), scale=0.7),
    case("decode-all-negative-scale", "decode", Tq=3, H=4, H_kv=1, window=(5, -1), attention_chunk=6,
         softcap=2.0, sinks=True, scale=-0.4, cached=(13, 3)),
    case("prefill-pass-kv", "prefill", method=PASS_KV),
    case("prefill-pass-q", "prefill", method=PASS_Q, layout="last-empty"),
    case("prefill-pass-kv-window-softcap-sinks", "prefill", method=PASS_KV, window=(6, -1), softcap=1.5,
         sinks=True, chunk=2),
    case("prefill-pass-q-mqa-chunks-window-sinks", "prefill", method=PASS_Q, H=3, H_kv=1, attention_chunk=5,
         window=(7, -1), sinks=True, chunk=7, cached=(6, 0)),
    case("prefill-pass-q-two-sided", "prefill", method=PASS_Q, causal=False, window=(3, 3), layout="contiguous"),
    case("prefill-auto-first-prompt", "prefill", cached=(0, 0), chunk=9),
    case("prefill-auto-long-cache", "prefill", cached=(40, 33), chunk=2, H=8, H_kv=8),
]
GRID_CASES = [
    case("grid-decode-gqa", "decode", Tq=3, window=(6, -1), sinks=True),
    case("grid-decode-mqa-chunks-softcap", "decode", Tq=1, H=3, H_kv=1, attention_chunk=5, softcap=1.0,
         layout="last-empty"),
    case("grid-prefill-pass-q-window-sinks", "prefill", method=PASS_Q, window=(6, -1), sinks=True, chunk=7),
    case("grid-prefill-auto-chunks-softcap", "prefill", H=3, H_kv=1, attention_chunk=5, softcap=1.0, chunk=6,
         cached=(9, 0), layout="last-empty"),
]
LOW_PRECISION_CASES = [
    case("decode-low-window-softcap-sinks", "decode", Tq=3, window=(9, -1), softcap=2.0, sinks=True, D=32,
         cached=(24, 17)),
    case("prefill-kv-low", "prefill", method=PASS_KV, chunk=6, D=32, cached=(20, 9), sinks=True),
    case("prefill-q-low", "prefill", method=PASS_Q, chunk=6, D=32, cached=(20, 9), attention_chunk=8),
]
# fmt: on


def test_decode_and_prefill_match_fp64_attention_and_the_byte_formulas(ranks):
    failures = [failure for per_rank in ranks.run(run_cases, CASES, torch.float32) for failure in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("grid", ["inner", "mesh"])
def test_decode_and_prefill_on_a_usp_grid_over_both_groups(grid):
    failures = [failure for per_rank in pool_for(4).run(run_cases, GRID_CASES, torch.float32, grid)
                for failure in per_rank]  # fmt: skip
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("autocast", [False, True], ids=["", "autocast"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_plain_torch_error(dtype, autocast):
    """Also under torch.autocast (a model's generate under TRL's default bf16): the
    partials' matmuls stay fp32 and lse fp32, so the rule holds as without it."""
    failures = [failure for per_rank in pool_for(3).run(run_cases, LOW_PRECISION_CASES, dtype, None, autocast)
                for failure in per_rank]  # fmt: skip
    assert not failures, "\n".join(failures)


def test_auto_takes_pass_q_when_the_cache_dominates():
    sizes = dict(batch=2, num_heads=8, num_kv_heads=8, head_dim=8, element_size=4)
    assert prefill_attention_method([0, 0, 0], [3, 3, 3], **sizes) == PASS_KV  # a first prompt
    assert prefill_attention_method([25, 24, 24], [1, 1, 0], **sizes) == PASS_Q  # a long cache, a short chunk
    # A chunk of 6 after 9 cached tokens: pass-Q under MHA; with GQA 8 / 2 the K/V to pass are
    # a quarter of the heads, and pass-KV sends less.
    assert prefill_attention_method([3, 3, 3], [2, 2, 2], **sizes) == PASS_Q
    assert prefill_attention_method([3, 3, 3], [2, 2, 2], **dict(sizes, num_kv_heads=2)) == PASS_KV


def test_prefill_bytes_worked_out_by_hand():
    # P = 2, batch 1, 2 heads, 1 kv head, head dim 4, fp16. Rank 0: 3 cached rows, 2 new;
    # rank 1: 0 cached, 1 new.
    sizes = dict(batch=1, num_heads=2, num_kv_heads=1, head_dim=4, element_size=2)
    # pass-KV: rank 0 sends its own block: 5 rows x (K and V: 2 x 4 x 2 bytes + a position)
    # and its lengths.
    assert prefill_attention_bytes([3, 0], [2, 1], 0, method=PASS_KV, **sizes) == 5 * (16 + 8) + 8
    assert prefill_attention_bytes([3, 0], [2, 1], 1, method=PASS_KV, **sizes) == 1 * (16 + 8) + 8
    # pass-Q: rank 0 sends its 2 queries (2 x 4 x 2 bytes + a position each), and rank
    # 1's one query's fp32 partial back (2 heads x (4 + 1) x 4).
    assert prefill_attention_bytes([3, 0], [2, 1], 0, method=PASS_Q, **sizes) == 2 * (16 + 8) + 1 * 40
    assert decode_attention_bytes([2, 3], batch=2, num_queries=1, num_heads=2, head_dim=4) == 3 * 2 * 2 * 5 * 4


# ----------------------------------------------------------------------------------
# Bad inputs raise on every rank
# ----------------------------------------------------------------------------------


def _decode_inputs(rank):
    q = torch.randn(2, 1, 4, 8)
    k_cache = v_cache = torch.randn(2, 5, 2, 8)
    return q, dict(k_cache=k_cache, v_cache=v_cache, q_positions=torch.tensor([[9], [9]]),
                   cache_positions=torch.arange(5).expand(2, 5), cache_lengths=torch.tensor([5, 3]))  # fmt: skip


BAD_DECODE = {
    # An engine's global lengths where per-rank ones belong (rank 1 only).
    "global lengths": (lambda rank: dict(cache_lengths=torch.tensor([5, 12 if rank == 1 else 3])),
                       r"cache_lengths|\[1\]"),
    "one rank's Tq": (lambda rank: dict(q=torch.randn(2, 1 + (rank == 2), 4, 8),
                                         q_positions=torch.zeros(2, 1 + (rank == 2), dtype=torch.long)), "disagree"),
    "window of floats": (lambda rank: dict(window_size=(1.0, 0)), "window_size"),
    "one rank's softcap": (lambda rank: dict(softcap=1.0 if rank == 0 else 0.0), "disagree"),
    "sinks of the wrong shape": (lambda rank: dict(sinks=torch.zeros(3)), "sinks"),
    "float positions on rank 0": (lambda rank: dict(cache_positions=torch.zeros(2, 5) if rank == 0
                                                    else torch.zeros(2, 5, dtype=torch.long)), r"integer|\[0\]"),
    "kv heads not dividing": (lambda rank: dict(k_cache=torch.randn(2, 5, 3, 8), v_cache=torch.randn(2, 5, 3, 8)),
                              "multiple"),
}  # fmt: skip


@on_every_rank
def run_bad_inputs():
    """Per bad input, what went wrong on this rank (None: it raised as expected)."""
    rank, _ = rank_and_world()
    group = timeout_group()
    reports = []
    for what, (change, match) in BAD_DECODE.items():
        q, inputs = _decode_inputs(rank)
        inputs = {**inputs, "q": q, **change(rank)}
        reports.append((what, raises(lambda: sp.decode_attention(**inputs, group=group), match)))
    q, inputs = _decode_inputs(rank)
    chunk = dict(q=torch.randn(2, 1, 4, 8), k=torch.randn(2, 1, 2, 8), v=torch.randn(2, 1, 2, 8))
    cache = {name: value for name, value in inputs.items() if name != "q_positions"}
    bad_prefill = {
        "a method of one rank": (dict(method="pass-x" if rank == 1 else "auto"), "method"),
        "a query requiring grad": (dict(q=torch.randn(2, 1, 4, 8, requires_grad=rank == 0)), "inference"),
    }
    for what, (change, match) in bad_prefill.items():
        arguments = dict(chunk, **cache, q_positions=torch.tensor([[9], [9]]), group=group, **change)
        reports.append((what, raises(lambda: sp.prefill_attention(**arguments), match)))
    return [f"{what}: {report}" for what, report in reports if report is not None]


def test_bad_inputs_raise_on_every_rank():
    failures = [failure for per_rank in pool_for(3).run(run_bad_inputs) for failure in per_rank]
    assert not failures, "\n".join(failures)


@on_every_rank
def run_bad_grid_prefill():
    """On a 2 x 2 grid: pass-KV, and a method bad on one rank, raise on every rank."""
    rank, _ = rank_and_world()
    q, inputs = _decode_inputs(rank)
    chunk = dict(q=torch.randn(2, 1, 4, 8), k=torch.randn(2, 1, 2, 8), v=torch.randn(2, 1, 2, 8))
    cache = {name: value for name, value in inputs.items() if name != "q_positions"}
    reports = []
    for what, method, match in (("pass-kv", PASS_KV, "one group"),
                                ("a method of one rank", "pass-x" if rank == 3 else "auto", "method")):  # fmt: skip
        arguments = dict(chunk, **cache, q_positions=torch.tensor([[9], [9]]), method=method, **usp_groups("mesh", 2))
        reports.append((what, raises(lambda: sp.prefill_attention(**arguments), match)))
    return [f"{what}: {report}" for what, report in reports if report is not None]


def test_bad_grid_prefill_raises_on_every_rank():
    failures = [failure for per_rank in pool_for(4).run(run_bad_grid_prefill) for failure in per_rank]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# The engines' entry, in one process
# ----------------------------------------------------------------------------------


def _one_process_problem(seed=0, cached=(12, 0, 7), H=4, H_kv=2, D=8, Tq=2):
    one = case("local", "decode", cached=cached, Tq=Tq, H=H, H_kv=H_kv, D=D, window=(8, -1), softcap=1.0)
    return one, draw(one, 3, seed, torch.float32)


def test_partials_merge_into_the_attention_over_every_shard_in_any_order():
    one, problem = _one_process_problem()
    (exact_out, exact_lse), _ = expected(one, problem, torch.float32)
    partials = [sp.decode_attention_partial(problem["Q"].float(), **shard, q_positions=problem["q_positions"],
                                            **options_of(one)) for shard in problem["shards"]]  # fmt: skip
    # A sequence a shard holds none of: out exactly 0, lse -inf (the neutral partial).
    for (out, lse), shard in zip(partials, problem["shards"]):
        empty = shard["cache_lengths"] == 0
        assert torch.all(out[empty] == 0) and torch.all(lse[empty] == NEG_INF)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    exact_sinks = reference.masked_attention(problem["Q"], problem["K"], problem["V"], problem["keep"],
                                             softcap=1.0, sinks=sinks.double())  # fmt: skip
    for order in ([0, 1, 2], [2, 0, 1]):
        outs = torch.stack([partials[i][0] for i in order])  # (P, B, Tq, H, D): what an all-gather gives
        lses = torch.stack([partials[i][1] for i in order])
        out, lse = sp.merge_attention_partials(outs, lses)
        assert out.dtype == lse.dtype == torch.float32
        assert reference.max_error(out, exact_out) < 2e-6
        # Natural log: what logsumexp over the whole cache's scores gives.
        assert error_of(lse, exact_lse.float()) < 2e-6
        out, lse = sp.merge_attention_partials([outs[i] for i in range(3)], list(lses), sinks=sinks)
        assert reference.max_error(out, exact_sinks[0]) < 2e-6 and error_of(lse, exact_sinks[1].float()) < 2e-6
    # The second sequence has no cached key anywhere: out 0, lse -inf; with sinks lse is the sink.
    assert torch.all(out[1] == 0) and torch.equal(lse[1], sinks[:, None].expand(-1, one["Tq"]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_partials_and_their_merge_under_autocast_are_the_fp32_ones(dtype):
    """Under torch.autocast a matmul of fp32 operands returns dtype: the partial and the
    merge compute as without autocast (bit for bit), fp32 (out, lse) on dtype inputs."""
    one, problem = _one_process_problem(seed=2)
    inputs = [dict(shard, q_positions=problem["q_positions"], **options_of(one)) for shard in problem["shards"]]
    q = problem["Q"].to(dtype)
    low = [{**each, "k_cache": each["k_cache"].to(dtype), "v_cache": each["v_cache"].to(dtype)} for each in inputs]
    results = []
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            partials = [sp.decode_attention_partial(q, **each) for each in low]
            merged = sp.merge_attention_partials([out for out, _ in partials], [lse for _, lse in partials],
                                                 sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))  # fmt: skip
            decoded = sp.decode_attention(q, **low[0], return_lse=True)
        results.append([tensor for pair in (*partials, merged, decoded) for tensor in pair])
    plain, autocast = results
    assert [t.dtype for t in autocast] == [t.dtype for t in plain] and autocast[-1].dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in autocast[:-2])
    assert all(torch.equal(a, b) for a, b in zip(autocast, plain))


def test_merge_rejects_a_base_2_or_low_precision_lse():
    out, lse = torch.zeros(1, 1, 2, 4), torch.zeros(1, 2, 1)
    assert raises(lambda: sp.merge_attention_partials([out], [lse.half()]), "fp32") is None
    assert raises(lambda: sp.merge_attention_partials([out], [lse.transpose(1, 2)]), r"\(batch, nheads, Tq\)") is None
    assert raises(lambda: sp.merge_attention_partials([out, out], [lse]), "one lse per out") is None


def test_tiles_of_keys_and_queries_give_the_same_partial():
    one, problem = _one_process_problem(seed=1, cached=(30, 25, 17), Tq=5)
    shard = problem["shards"][0]
    q = problem["Q"].float()
    mask = sp.AttentionMask.checked(True, (8, -1))
    spec = StepSpec(0.3, 1.0)
    partials = []
    for tile_elements in (1 << 24, 16):  # one tile, and tiles of one query row and one key
        partial = PartialAttention.empty(*q.shape, q.device)
        attend_keys_(partial, q, problem["q_positions"], shard["k_cache"], shard["v_cache"], shard["cache_positions"],
                     shard["cache_lengths"], mask, spec, tile_elements=tile_elements)  # fmt: skip
        partials.append(partial)
    # Two orders of merging a row's keys (at most 9 in the window): each within about a unit
    # of fp32 roundoff of the magnitude per key merged, so twice that apart.
    for got, want in [(partials[1].out, partials[0].out), (partials[1].lse, partials[0].lse)]:
        finite = want[want.isfinite()]
        assert error_of(got, want) <= 2 * 9 * 2.0**-24 * reference.magnitude(finite)
    assert not partials[0].packed.isnan().any()  # padding rows hold NaN: never read into the result


def test_one_process_needs_no_torch_distributed():
    one, problem = _one_process_problem(cached=(5, 3))
    shard = problem["shards"][0]
    inputs = dict(shard, q_positions=problem["q_positions"], **options_of(one))
    out = sp.decode_attention(problem["Q"].float(), **inputs)
    partial, _ = sp.decode_attention_partial(problem["Q"].float(), **inputs)
    assert torch.equal(out, partial)
