"""Packed variable-length sequences (seqpar_kernels/parallel/varlen.py; one file, over
500 lines: the plan and every op with varlen= share the document mixes and cases): varlen_plan's
layouts, split/gather, position_ids and balance, and ring_attention, ulysses_attention
and usp_attention with varlen=plan on gloo ranks (world 1-4 and 2x2 grids) against
per-document attention in one process by the accuracy rule of tools/reference.py,
forward and backward.

Every rank builds the same full sequence from a seed, takes its tokens with the plan
(the layout tests below check split against the plan's ranges independently), and
compares its tokens of out and of the gradients with the per-document reference.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import pool_for
from on_ranks import on_every_rank, timeout_group
from test_usp import usp_groups
from triton_interpreter import runs_triton_on

import seqpar_kernels as sp
from seqpar_kernels.attention_mask import AttentionMask
from seqpar_kernels.engine.step_masks import step_masks_of
from seqpar_kernels.layouts import VarlenLayout
from seqpar_kernels.testing import ring_attention_with_step_kernels
from tools import reference

NAMES = ("out", "dq", "dk", "dv")


# ----------------------------------------------------------------------------------
# document lengths
# ----------------------------------------------------------------------------------


def bounds_of(lengths) -> list[int]:
    return [0, *np.cumsum(lengths).tolist()]


def random_lengths(rng: random.Random, total: int, largest: int) -> list[int]:
    """Document lengths from 1 to `largest` summing to `total`, short ones common."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(total - sum(lengths), max(1, int(rng.paretovariate(0.8)) % largest + 1)))
    return lengths


def long_tailed_lengths(seed: int, total: int) -> list[int]:
    """Log-normal document lengths between 1 and the whole sequence, summing to total."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(np.clip(np.exp(rng.normal(6.0, 2.0)), 1, total)), total - sum(lengths)))
    return lengths


# Lengths families of the attention tests (total tokens small: the ranks share 2 cores).
LENGTHS = {
    "one document": [45],
    "lengths 1": [1, 1, 3, 1, 20, 1, 1, 9, 1],
    "spanning ranks": [3, 70, 2, 5],
    "mixed": random_lengths(random.Random(3), 61, 40),
    "hundreds tiny": [1 + (index * 7) % 3 for index in range(200)],
}


# ----------------------------------------------------------------------------------
# The plan alone (no ranks)
# ----------------------------------------------------------------------------------


def tokens_of(layout: VarlenLayout) -> list[list[int]]:
    return [
        [position for start, length in piece for position in range(start, start + length)] for piece in layout.pieces
    ]


@pytest.mark.parametrize("layout_name", ["contiguous", "balanced"])
@pytest.mark.parametrize("ring_size, ulysses_size", [(1, 1), (2, 1), (3, 1), (4, 1), (8, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("family", sorted(LENGTHS))
def test_every_token_is_held_once_in_global_order_per_slot(family, ring_size, ulysses_size, layout_name):
    lengths = LENGTHS[family]
    layout = VarlenLayout(bounds_of(lengths), ring_size=ring_size, ulysses_size=ulysses_size, layout=layout_name)
    pieces = tokens_of(layout)
    assert sorted(position for piece in pieces for position in piece) == list(range(sum(lengths)))
    assert layout.seq_lens == [len(piece) for piece in pieces]
    for slot in range(ring_size):
        slot_tokens = [p for piece in pieces[slot * ulysses_size : (slot + 1) * ulysses_size] for p in piece]
        assert slot_tokens == sorted(slot_tokens)
        # The Ulysses pieces of a slot are torch.tensor_split of its tokens.
        assert [
            len(piece) for piece in pieces[slot * ulysses_size : (slot + 1) * ulysses_size]
        ] == reference.even_lengths(len(slot_tokens), ulysses_size)
    if layout_name == "contiguous":
        assert layout.seq_lens == reference.even_lengths(sum(lengths), ring_size * ulysses_size)
        assert layout.in_global_order


def _imbalances(lengths, ring_size, layout_name):
    layout = VarlenLayout(bounds_of(lengths), ring_size=ring_size, layout=layout_name)
    return layout.work_imbalance, layout.token_imbalance


@pytest.mark.parametrize("seed", range(6))
def test_balanced_layout_evens_work_and_tokens_of_a_long_tailed_mix(seed):
    lengths = long_tailed_lengths(seed, 65536)
    work, tokens = _imbalances(lengths, 8, "balanced")
    assert isinstance(work, float) and isinstance(tokens, float)
    assert work <= 1.05 and tokens <= 1.05, (work, tokens, len(lengths), max(lengths))
    contiguous_work, contiguous_tokens = _imbalances(lengths, 8, "contiguous")
    assert contiguous_tokens <= 1.0 + 1e-9  # tensor_split: to a token
    assert work <= contiguous_work


@pytest.mark.parametrize("ring_size", [2, 3, 8])
@pytest.mark.parametrize(
    "lengths",
    [[65536], [1] * 4096, [3, 5, 7] * 700, [30000, 1, 1, 35534]],
    ids=["one document", "4096 of length 1", "2100 short", "two long and two of length 1"],
)
def test_balanced_layout_of_single_and_uniform_documents(lengths, ring_size):
    work, tokens = _imbalances(lengths, ring_size, "balanced")
    assert work <= 1.05 and tokens <= 1.05, (work, tokens)


def test_work_imbalance_counts_causal_pairs():
    # One document over 2 slots, contiguous: slot 0 attends 1 + ... + 4 = 10 pairs,
    # slot 1 5 + ... + 8 = 26; mean 18.
    layout = VarlenLayout([0, 8], ring_size=2, layout="contiguous")
    assert layout.work_imbalance == pytest.approx(26 / 18)
    assert layout.token_imbalance == 1.0


def test_position_ids_count_from_each_document_start():
    layout = VarlenLayout([0, 3, 4, 10], ring_size=2, layout="contiguous")
    assert layout.position_ids(0).tolist() == [[0, 1, 2, 0, 0]]
    assert layout.position_ids(1).tolist() == [[1, 2, 3, 4, 5]]


def test_padding_of_per_document_zigzag():
    # Degree 2: documents padded to multiples of 4.
    assert VarlenLayout([0, 1, 5, 11], ring_size=2, layout="contiguous").padding_of_per_document_zigzag() == 3 + 0 + 2


@pytest.mark.parametrize(
    "cu_seqlens, message",
    [
        ([1, 4, 9], "start at 0"),
        ([0, 4, 4, 9], "strictly increasing"),
        ([0, 5, 3], "strictly increasing"),
        ([0], "at least one document"),
        ([0, 2.5], "hold ints"),
        (torch.tensor([0.0, 3.0]), "integer tensor"),
        (torch.tensor([[0, 3]]), "1-D"),
    ],
)
def test_bad_cu_seqlens_raise(cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        sp.varlen_plan(cu_seqlens)


def test_single_process_plan_splits_and_gathers():
    plan = sp.varlen_plan(torch.tensor([0, 3, 10]), layout="balanced")
    x = torch.randn(2, 10, 3)
    assert torch.equal(plan.split(x, 1), x)
    assert torch.equal(plan.gather(x, -2), x)
    with pytest.raises(ValueError, match="documents hold 10"):
        plan.split(torch.randn(2, 9, 3), 1)
    assert plan.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]]


# ----------------------------------------------------------------------------------
# Attention on the ranks
# ----------------------------------------------------------------------------------


def _per_document(fn, q, k, v, bounds, causal):
    """fn applied to every document's rows (B = 1), outputs concatenated."""
    outs = [
        fn(q[:, start:end], k[:, start:end], v[:, start:end], causal)[0] for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, 1)


def _inputs(case):
    generator = torch.Generator().manual_seed(case["seed"])
    total, heads, kv_heads, head_dim = sum(case["lengths"]), case["heads"], case["kv_heads"], case["head_dim"]
    q = torch.randn(1, total, heads, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(1, total, kv_heads, head_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(1, total, kv_heads, head_dim, generator=generator, dtype=torch.float64)
    dout = torch.randn(1, total, heads, head_dim, generator=generator, dtype=torch.float64)
    return q, k, v, dout


def _call(case, plan, q, k, v):
    method, causal = case["method"], case["causal"]
    if method == "ring-triton":  # the GPU path's kernels, in the Triton interpreter
        return sp.ring_attention(q, k, v, group=timeout_group(), causal=causal, varlen=plan, step_backend="triton")
    if method == "ring":
        return sp.ring_attention(q, k, v, group=timeout_group(), causal=causal, varlen=plan)
    if method.startswith("ring with "):  # step kernels by name (tests/test_step_backends.py)
        return ring_attention_with_step_kernels(
            q, k, v, method.removeprefix("ring with "), group=timeout_group(), causal=causal, varlen=plan
        )  # fmt: skip
    if method == "ulysses":
        return sp.ulysses_attention(q, k, v, group=timeout_group(), causal=causal, varlen=plan)
    return sp.usp_attention(q, k, v, causal=causal, varlen=plan, **usp_groups("inner", case["ulysses"]))


def _plan(case):
    bounds = bounds_of(case["lengths"])
    if case["method"] == "usp":
        return sp.varlen_plan(bounds, layout=case["layout"], **usp_groups("inner", case["ulysses"]))
    return sp.varlen_plan(bounds, group=timeout_group(), layout=case["layout"])


@on_every_rank
def run_varlen_cases(cases):
    failures = []
    for case in cases:
        dtype, causal = case["dtype"], case["causal"]
        bounds = bounds_of(case["lengths"])
        q, k, v, dout = _inputs(case)
        exact = reference.with_grads(
            lambda q, k, v: _per_document(reference.attention, q, k, v, bounds, causal), [q, k, v], dout
        )
        rounded = [t.to(dtype) for t in (q, k, v, dout)]
        plain = reference.with_grads(
            lambda q, k, v: _per_document(reference.sdpa, q, k, v, bounds, causal), rounded[:3], rounded[3]
        )
        plan = _plan(case)
        local = [plan.split(t, 1) for t in rounded]
        ours = reference.with_grads(lambda q, k, v: _call(case, plan, q, k, v), local[:3], local[3])
        exact = [exact[0], *exact[2:]]
        plain = [plain[0], *plain[2:]]
        ours = [ours[0], *ours[2:]]
        for name, exact_full, plain_full, mine in zip(NAMES, exact, plain, ours):
            bound = reference.error_bound(
                dtype, reference.max_error(plain_full, exact_full), reference.magnitude(exact_full)
            )
            error = reference.max_error(mine, plan.split(exact_full, 1))
            if not error <= bound:
                failures.append(f"{case['id']} {name}: error {error:.3g} > {bound:.3g}")
    return failures


def _case(
    method,
    lengths_name,
    *,
    dtype=torch.float32,
    causal=True,
    layout="balanced",
    heads=4,
    kv_heads=2,
    head_dim=64,
    ulysses=1,
    seed=0,
):
    case = dict(
        method=method,
        lengths=LENGTHS[lengths_name],
        dtype=dtype,
        causal=causal,
        layout=layout,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ulysses=ulysses,
        seed=seed,
    )
    case["id"] = (
        f"{method} {lengths_name} {str(dtype)[6:]} {'causal' if causal else 'full'} {layout} "
        f"h{heads}/{kv_heads} d{head_dim} u{ulysses}"
    )
    return case


def _cases(method):
    cases = []
    # Each lengths set causal and not, in alternating layouts: every (causal, layout) pair
    # runs, on half the sets each.
    for index, lengths_name in enumerate(sorted(LENGTHS)):
        for causal in (True, False):
            layout = ("balanced", "contiguous")[(index + causal) % 2]
            cases.append(_case(method, lengths_name, causal=causal, layout=layout, seed=index))
    cases += [
        _case(method, "mixed", dtype=torch.bfloat16, head_dim=80, heads=5, kv_heads=1),
        _case(method, "spanning ranks", dtype=torch.float16, head_dim=128, heads=3, kv_heads=3, causal=False),
        _case(method, "lengths 1", dtype=torch.bfloat16, heads=6, kv_heads=2, layout="contiguous"),
        _case(method, "spanning ranks", head_dim=256, heads=2, kv_heads=1),
    ]
    return cases


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_attention_stays_inside_documents(ranks, method):
    failures = [failure for per_rank in ranks.run(run_varlen_cases, _cases(method)) for failure in per_rank]
    assert not failures, "\n".join(failures)


@runs_triton_on("cpu")
def test_triton_step_kernels_keep_attention_inside_documents(ranks):
    if ranks.world_size != 3:
        pytest.skip("the interpreter is slow: one world size, whose ring has every kind of step")
    # Two fp32 cases (causal and not, both layouts, documents of one token and documents
    # spanning ranks) and one bf16.
    cases = [
        _case("ring-triton", "mixed", causal=True, layout="balanced"),
        _case("ring-triton", "lengths 1", causal=False, layout="contiguous", seed=1),
    ]
    cases.append(_case("ring-triton", "spanning ranks", dtype=torch.bfloat16, heads=3, kv_heads=1, head_dim=80))
    failures = [failure for per_rank in ranks.run(run_varlen_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("ulysses", [2, 1, 4])
def test_hybrid_attention_stays_inside_documents(ulysses):
    cases = []
    for index, lengths_name in enumerate(sorted(LENGTHS)):
        for causal in (True, False):
            layout = ("balanced", "contiguous")[index % 2]
            cases.append(_case("usp", lengths_name, causal=causal, layout=layout, ulysses=ulysses, seed=index))
    cases.append(_case("usp", "mixed", dtype=torch.bfloat16, heads=3, kv_heads=1, head_dim=80, ulysses=ulysses))
    failures = [failure for per_rank in pool_for(4).run(run_varlen_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# One document is the dense sequence; non-contiguous inputs; compile; opcheck
# ----------------------------------------------------------------------------------


@on_every_rank
def run_one_document_against_dense(causal):
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 37, heads, 32, generator=generator) for heads in (4, 2, 2))
    plan = sp.varlen_plan([0, 37], group=timeout_group())
    local = [plan.split(t, 1) for t in (q, k, v)]
    ours = sp.ring_attention(*local, group=timeout_group(), causal=causal, varlen=plan)
    dense = sp.ring_attention(*local, group=timeout_group(), causal=causal)
    # Non-contiguous inputs: heads-major storage, as a model's transposed projections.
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in local]
    ours_strided = sp.ulysses_attention(*strided, group=timeout_group(), causal=causal, varlen=plan)
    dense_ulysses = sp.ulysses_attention(*local, group=timeout_group(), causal=causal)
    return torch.equal(ours, dense), reference.max_error(ours_strided, dense_ulysses), rank


@pytest.mark.parametrize("causal", [True, False])
def test_one_document_equals_the_dense_path(ranks, causal):
    for ring_equal, ulysses_error, rank in ranks.run(run_one_document_against_dense, causal):
        assert ring_equal, rank  # the same aten calls on the same blocks: bit for bit
        assert ulysses_error <= reference.FP32_TOLERANCE, (rank, ulysses_error)


@on_every_rank
def run_compiled(method):
    generator = torch.Generator().manual_seed(11)
    lengths = [5, 1, 17, 2, 9]
    total = sum(lengths)
    q, k, v, dout = (torch.randn(1, total, heads, 16, generator=generator) for heads in (4, 2, 2, 4))
    group = timeout_group()
    if method == "usp":
        groups = usp_groups("inner", 2)
        plan = sp.varlen_plan(bounds_of(lengths), layout="balanced", **groups)
        call = lambda q, k, v: sp.usp_attention(q, k, v, causal=True, varlen=plan, **groups)  # noqa: E731
    else:
        plan = sp.varlen_plan(bounds_of(lengths), group=group, layout="balanced")
        attention = sp.ring_attention if method == "ring" else sp.ulysses_attention
        call = lambda q, k, v: attention(q, k, v, group=group, causal=True, varlen=plan)  # noqa: E731
    local = [plan.split(t, 1) for t in (q, k, v, dout)]
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    eager = reference.with_grads(call, local[:3], local[3])
    traced = reference.with_grads(compiled, local[:3], local[3])
    return [reference.max_error(a, b) for a, b in zip(eager, traced) if a is not None]


@pytest.mark.parametrize("method", ["ring", "ulysses", "usp"])
def test_compiled_with_the_plan_built_outside(method):
    pool = pool_for(4 if method == "usp" else 3)
    for errors in pool.run(run_compiled, method):
        assert max(errors) == 0.0, errors


def test_opcheck_of_the_local_and_ring_ops_with_documents():
    generator = torch.Generator().manual_seed(0)
    bounds = torch.tensor([0, 3, 4, 11], dtype=torch.int64)
    q = torch.randn(1, 11, 4, 16, generator=generator, requires_grad=True)
    k = torch.randn(1, 11, 2, 16, generator=generator, requires_grad=True)
    v = torch.randn(1, 11, 2, 16, generator=generator, requires_grad=True)
    for causal in (True, False):
        torch.library.opcheck(torch.ops.seqpar.local_attention_forward.default, (q, k, v, causal, 0.25, bounds))
        out, lse = torch.ops.seqpar.local_attention_forward(q.detach(), k.detach(), v.detach(), causal, 0.25, bounds)
        dout = torch.randn(out.shape, generator=generator)
        torch.library.opcheck(
            torch.ops.seqpar.local_attention_backward.default,
            (dout, q.detach(), k.detach(), v.detach(), out, lse, causal, 0.25, bounds),
        )
        # The ring ops with documents, one process (group name ""): one slot holding all.
        plan = sp.varlen_plan(bounds)
        args = (q, k, v, causal, 0.25, False, "", "auto", [11], plan.cu_seqlens_tensor, plan.segments_tensor)
        torch.library.opcheck(torch.ops.seqpar.ring_attention_forward.default, args)


# ----------------------------------------------------------------------------------
# Bad inputs raise on every rank
# ----------------------------------------------------------------------------------


@on_every_rank
def run_bad_plan(kind):
    rank = torch.distributed.get_rank()
    bounds = [0, 4, 9, 12]
    if kind == "differs" and rank == 1:
        bounds = [0, 5, 9, 12]
    if kind == "not from 0" and rank == 1:
        bounds = [1, 4, 9, 12]
    if kind == "not increasing" and rank == 0:
        bounds = [0, 4, 4, 12]
    try:
        sp.varlen_plan(bounds, group=timeout_group())
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("kind", ["differs", "not from 0", "not increasing"])
def test_bad_cu_seqlens_raise_on_every_rank(kind):
    messages = pool_for(3).run(run_bad_plan, kind)
    assert all(message is not None for message in messages), messages


@on_every_rank
def run_bad_calls():
    group = timeout_group()
    plan = sp.varlen_plan([0, 4, 9, 12], group=group)
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(2, 12, 2, 8, generator=generator)
    local = plan.split(full[:1], 1)
    messages = []
    for attention in (sp.ring_attention, sp.ulysses_attention):
        for bad in ("batch", "length", "zigzag"):
            q = local
            kwargs = dict(group=group, causal=True, varlen=plan)
            if bad == "batch":
                q = plan.split(full, 1)
            elif bad == "length":
                q = local[:, : max(local.shape[1] - 1, 0)] if torch.distributed.get_rank() == 0 else local
            elif attention is sp.ring_attention:
                kwargs["layout"] = "zigzag"
            else:
                continue
            try:
                attention(q, q, q, **kwargs)
                messages.append(None)
            except ValueError as error:
                messages.append(str(error))
    try:
        plan.split(full[:, :11], 1)
        messages.append(None)
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_bad_attention_calls_raise_on_every_rank():
    for messages in pool_for(2).run(run_bad_calls):
        assert all(message is not None for message in messages), messages


# ----------------------------------------------------------------------------------
# Step masks: pairs and intervals against the definition
# ----------------------------------------------------------------------------------


def step_mask(layout, q_slot, k_slot, causal):
    """The ring's StepMask of slot q_slot's queries against slot k_slot's keys."""
    return step_masks_of(AttentionMask(causal, cu_seqlens=layout.cu_seqlens), layout.slots).step(q_slot, k_slot)


def _mask_by_definition(layout, q_slot, k_slot, causal):
    """(q rows x key rows) bool: same document, and key position <= query position if causal."""

    def positions(slot):
        return [position for start, length in layout.slots[slot] for position in range(start, start + length)]

    bounds = torch.tensor(layout.cu_seqlens)
    q_positions, k_positions = torch.tensor(positions(q_slot)), torch.tensor(positions(k_slot))
    q_documents = torch.searchsorted(bounds, q_positions, right=True)
    k_documents = torch.searchsorted(bounds, k_positions, right=True)
    mask = q_documents[:, None] == k_documents[None, :]
    if causal:
        mask &= k_positions[None, :] <= q_positions[:, None]
    return mask


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout_name", ["contiguous", "balanced"])
@pytest.mark.parametrize("family", sorted(LENGTHS))
def test_step_masks_select_exactly_the_document_pairs(family, layout_name, causal):
    layout = VarlenLayout(bounds_of(LENGTHS[family]), ring_size=3, layout=layout_name)
    for q_slot in range(3):
        for k_slot in range(3):
            expected = _mask_by_definition(layout, q_slot, k_slot, causal)
            step = step_mask(layout, q_slot, k_slot, causal)
            if step is None:
                assert not expected.any()
                continue
            from_pairs = torch.zeros_like(expected)
            for pair in step.pairs:
                block = torch.ones(pair.q_len, pair.kv_len, dtype=torch.bool)
                if pair.causal:
                    block = block.tril()
                rows = slice(pair.q_start, pair.q_start + pair.q_len)
                columns = slice(pair.kv_start, pair.kv_start + pair.kv_len)
                assert not from_pairs[rows, columns].any(), "pairs overlap"
                from_pairs[rows, columns] = block
            assert torch.equal(from_pairs, expected)
            row_start, row_end, col_start, col_end = step.intervals(torch.device("cpu"))
            columns = torch.arange(expected.shape[1])
            rows = torch.arange(expected.shape[0])
            by_rows = (columns[None, :] >= row_start[:, None]) & (columns[None, :] < row_end[:, None])
            by_columns = (rows[:, None] >= col_start[None, :]) & (rows[:, None] < col_end[None, :])
            assert torch.equal(by_rows, expected) and torch.equal(by_columns, expected)


def test_a_step_without_a_common_document_has_no_mask():
    # Documents aligned with the contiguous pieces: every rank's queries see only its own.
    layout = VarlenLayout([0, 4, 8, 12], ring_size=3, layout="contiguous")
    for q_slot in range(3):
        for k_slot in range(3):
            assert (step_mask(layout, q_slot, k_slot, False) is None) == (q_slot != k_slot)
    # Causal: keys of a later rank's piece of one document are never seen.
    layout = VarlenLayout([0, 12], ring_size=3, layout="contiguous")
    assert step_mask(layout, 0, 2, True) is None and step_mask(layout, 2, 0, True) is not None
