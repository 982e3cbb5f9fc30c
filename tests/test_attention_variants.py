"""Sliding windows, chunked attention, softcapping and attention sinks under sequence
parallelism: ring_attention (contiguous and zigzag), ulysses_attention and usp_attention,
dense and with packed documents, on 1-4 gloo ranks against attention written out in full
in fp64 (tools/reference.py: the mask, the cap and the sinks from their definitions).

Every rank holds the same full q, k, v, dout; the op runs on this rank's piece (made by
the package's own split functions, whose backward gathers the gradient), so out and the
gradients come back whole on every rank. sinks.grad is each rank's share: summed over the
ranks it is the gradient. Also: the arguments' checks, the ring that stops where a window
ends (bytes against the formula), and the Triton step kernels in the interpreter.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from on_ranks import on_every_rank, rank_and_world, timeout_group
from test_usp import usp_groups
from triton_interpreter import runs_triton_on

import seqpar_kernels as sp
from seqpar_kernels.testing import ring_attention_with_step_kernels
from seqpar_kernels.traffic import ring_bytes, window_ring_steps
from tools import reference

NAMES = ("out", "dq", "dk", "dv", "dsinks")


def case(id, mode, *, H=4, H_kv=2, D=16, B=1, per_rank=5, causal=True, layout="contiguous", window=(-1, -1),
         softcap=0.0, sinks=False, chunk=None, documents=None, grid=None, step_kernels=None,
         Dv=None):  # fmt: skip
    """A case: mode "ring", "ulysses" or "usp" (grid: its Ulysses degree), the sequence
    per_rank x P rows (documents: their lengths as fractions of it, packed: varlen); Dv:
    v's head dim (None: D)."""
    return dict(id=id, mode=mode, H=H, H_kv=H_kv, D=D, Dv=Dv or D, B=B, per_rank=per_rank, causal=causal, layout=layout,
                window=window, softcap=softcap, sinks=sinks, chunk=chunk, documents=documents, grid=grid,
                step_kernels=step_kernels)  # fmt: skip


def _bounds(case, total):
    """The documents' cu_seqlens over `total` rows, or None."""
    if case["documents"] is None:
        return None
    cuts = sorted({max(1, min(total - 1, round(fraction * total))) for fraction in case["documents"]})
    return [0, *[cut for cut in cuts if 0 < cut < total], total]


def _run(case, dtype, seed, autocast=False):
    """(ours, exact, plain): out, dq, dk, dv, dsinks of the op on this rank's piece
    (gathered whole), of fp64 attention and of plain attention in dtype. autocast: ours
    forward and backward under torch.autocast in dtype."""
    rank, world_size = rank_and_world()
    group = timeout_group()
    total = case["per_rank"] * world_size
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, dout = draw(case["B"], total, case["H"], case["D"]), draw(case["B"], total, case["H"], case["Dv"])
    k, v = draw(case["B"], total, case["H_kv"], case["D"]), draw(case["B"], total, case["H_kv"], case["Dv"])
    sinks = draw(case["H"]) if case["sinks"] else None
    cu_seqlens = _bounds(case, total)
    variants = dict(window_size=case["window"], softcap=case["softcap"], chunk_size=case["chunk"])

    def exact_fn(q, k, v, *sinks):
        return reference.attention(q, k, v, case["causal"], **variants, sinks=sinks[0] if sinks else None,
                                   cu_seqlens=cu_seqlens)  # fmt: skip

    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    exact = reference.with_grads(exact_fn, leaves, dout)
    plain = reference.with_grads(exact_fn, [t.to(dtype) for t in leaves], dout.to(dtype))

    options = dict(causal=case["causal"], window_size=case["window"], softcap=case["softcap"],
                   attention_chunk_size=case["chunk"])  # fmt: skip
    mode = case["mode"]
    if mode == "usp":
        grid = usp_groups("mesh", case["grid"])
        split = lambda x: sp.usp_split(x, 1, layout=case["layout"], **grid)  # noqa: E731
        gather = lambda x: sp.usp_gather(x, 1, layout=case["layout"], **grid)  # noqa: E731
    elif case["layout"] == "zigzag":
        split = lambda x: sp.zigzag_split(x, 1, group)  # noqa: E731
        gather = lambda x: sp.zigzag_gather(x, 1, group)  # noqa: E731
    else:
        split = lambda x: sp.split_sequence(x, 1, group)  # noqa: E731
        gather = lambda x: sp.gather_sequence(x, 1, group)  # noqa: E731
    if cu_seqlens is not None:
        grid_kwargs = usp_groups("mesh", case["grid"]) if mode == "usp" else dict(group=group)
        plan = sp.varlen_plan(cu_seqlens, layout=case["layout"], **grid_kwargs)
        split, gather = (lambda x: plan.split(x, 1)), (lambda x: plan.gather(x, 1))
        options["varlen"] = plan

    def ours_fn(q, k, v, *sinks):
        local = [split(t) for t in (q, k, v)]
        more = dict(options, sinks=sinks[0] if sinks else None)
        if mode == "ring":
            if cu_seqlens is None:
                more["layout"] = case["layout"]
            if case["step_kernels"] is not None:
                return gather(ring_attention_with_step_kernels(*local, case["step_kernels"], group=group, **more))
            return gather(sp.ring_attention(*local, group=group, **more))
        if mode == "ulysses":
            return gather(sp.ulysses_attention(*local, group=group, **more))
        if cu_seqlens is None:
            more["layout"] = case["layout"]
        return gather(sp.usp_attention(*local, **usp_groups("mesh", case["grid"]), **more))

    with torch.autocast("cpu", dtype=dtype) if autocast else contextlib.nullcontext():
        ours = list(reference.with_grads(ours_fn, [t.to(dtype) for t in leaves], dout.to(dtype)))
    if sinks is not None:  # every rank's share summed: the gradient
        # Zeros, not None, on a rank whose heads never see them (or that holds no heads).
        assert ours[-1] is not None, f"{case['id']}: sinks.grad is None on rank {rank}"
        dist.all_reduce(ours[-1], group=group)
    drop_lse = lambda result: [result[0], *result[2:]]  # noqa: E731
    return drop_lse(ours), drop_lse(exact), drop_lse(plain)


@on_every_rank
def run_cases(cases, dtype, autocast=False):
    """Per case: the names whose error breaks the rule (fp32: 2e-5 of the magnitude;
    fp16/bf16: twice plain attention's error in the dtype, plus a unit of roundoff).
    autocast: ours under torch.autocast in dtype, which must also give what it gives
    without autocast, bit for bit (its fp32 statistics never rounded to dtype)."""
    failures = []
    for seed, one in enumerate(cases):
        ours, exact, plain = _run(one, dtype, seed, autocast)
        if autocast:
            without, _, _ = _run(one, dtype, seed)
            failures += [f"{one['id']} {name}: differs under autocast by {reference.max_error(got, want):.3g}"
                         for name, got, want in zip(NAMES, ours, without) if not torch.equal(got, want)]  # fmt: skip
        for name, got, want, yardstick in zip(NAMES, ours, exact, plain):
            error, magnitude = reference.max_error(got, want), reference.magnitude(want)
            if dtype == torch.float32:
                bound = reference.FP32_TOLERANCE * max(magnitude, 1.0)
            else:
                bound = reference.error_bound(dtype, reference.max_error(yardstick, want), magnitude)
            if not error <= bound:
                failures.append(f"{one['id']} {name}: error {error:.3g} > {bound:.3g}")
    return failures


# fmt: off
DENSE_CASES = [
    # A causal window shorter than a rank's piece (the ring stops after one step), one
    # spanning several pieces, a two-sided window, chunks, and all together with sinks.
    case("ring-window-short", "ring", window=(2, -1)),
    case("ring-window-spanning", "ring", window=(8, -1), H=3, H_kv=1),
    case("ring-window-two-sided", "ring", causal=False, window=(3, 4)),
    case("ring-chunks", "ring", chunk=4, H=2, H_kv=2),
    case("ring-softcap-sinks", "ring", softcap=1.5, sinks=True, D=32),
    case("ring-zigzag-all", "ring", layout="zigzag", window=(6, 0), softcap=2.0, sinks=True, chunk=7, B=2),
    case("ulysses-all", "ulysses", window=(4, -1), softcap=1.0, sinks=True, chunk=6, H=6, H_kv=3),
    case("ulysses-window-full", "ulysses", causal=False, window=(2, 2), H=3, H_kv=3),
    # Fewer heads than ranks at 3 and 4: a rank with no heads gets zeros in sinks.grad.
    case("ulysses-fewer-heads-sinks", "ulysses", window=(3, -1), sinks=True, H=2, H_kv=1),
]
DOCUMENT_CASES = [
    case("ring-docs-window-chunks", "ring", layout="balanced", window=(3, -1), chunk=5, sinks=True,
         documents=(0.2, 0.55, 0.6)),
    case("ring-docs-softcap", "ring", softcap=1.0, window=(4, 1), causal=False, documents=(0.5,)),
    case("ulysses-docs-all", "ulysses", window=(3, -1), softcap=2.0, sinks=True, chunk=4, documents=(0.3, 0.7)),
]
GRID_CASES = [
    case("usp-window-sinks", "usp", grid=2, window=(3, -1), sinks=True, H=4, H_kv=2),
    case("usp-zigzag-softcap-chunks", "usp", grid=2, layout="zigzag", softcap=1.5, chunk=5, window=(5, 2)),
    case("usp-docs-window", "usp", grid=2, layout="balanced", window=(2, -1), documents=(0.4,), sinks=True),
    case("usp-fewer-heads-sinks", "usp", grid=2, window=(3, -1), sinks=True, H=1, H_kv=1),
]
LOW_PRECISION_CASES = [
    case("ring-bf16-window-softcap-sinks", "ring", window=(5, -1), softcap=2.0, sinks=True, per_rank=8, D=32),
    case("ulysses-bf16-chunks-sinks", "ulysses", chunk=6, sinks=True, per_rank=8, H=4, H_kv=1, D=32),
]
# Under torch.autocast also USP's grid, with softcapped scores (the steps' plain torch matmuls).
AUTOCAST_GRID_CASES = [case("usp-softcap-window", "usp", grid=2, softcap=1.5, window=(5, -1), per_rank=4, D=32)]
# fmt: on


def test_every_variant_matches_fp64_attention(ranks):
    cases = DENSE_CASES + DOCUMENT_CASES + (GRID_CASES if ranks.world_size == 4 else [])
    failures = [failure for per_rank in ranks.run(run_cases, cases, torch.float32) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_usp_grids_of_six_ranks():
    # 2 x 3 and 3 x 2: grids whose degrees are not powers of two.
    from conftest import pool_for

    cases = [
        case("usp-3x2-window-sinks", "usp", grid=3, window=(3, -1), sinks=True, H=6, H_kv=3, per_rank=3),
        case("usp-2x3-zigzag-chunks-softcap", "usp", grid=2, layout="zigzag", chunk=4, softcap=1.0, per_rank=4),
    ]
    failures = [failure for per_rank in pool_for(6).run(run_cases, cases, torch.float32) for failure in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_plain_torch_error(dtype):
    from conftest import pool_for

    failures = [failure for per_rank in pool_for(3).run(run_cases, LOW_PRECISION_CASES, dtype) for failure in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_under_autocast_as_without(dtype):
    """ring_attention, ulysses_attention and usp_attention forward and backward under
    torch.autocast (a model's forward under TRL's default bf16): the accuracy rule, and
    what they give without autocast."""
    from conftest import pool_for

    failures = [failure for per_rank in pool_for(3).run(run_cases, LOW_PRECISION_CASES, dtype, True)
                for failure in per_rank]  # fmt: skip
    failures += [failure for per_rank in pool_for(4).run(run_cases, AUTOCAST_GRID_CASES, dtype, True)
                 for failure in per_rank]  # fmt: skip
    assert not failures, "\n".join(failures)


FP32_UNDER_AUTOCAST = [("ring_attention", dict(softcap=1.5)), ("ulysses_attention", {}),
                      ("ulysses_attention", dict(window_size=(3, -1)))]  # fmt: skip


@pytest.mark.parametrize(("function", "variants"), FP32_UNDER_AUTOCAST, ids=str)
def test_fp32_inputs_under_autocast_compute_in_fp32(function, variants):
    """In one process: fp32 q, k, v under a bf16 autocast give the fp32 result (out in
    q's dtype, the same bits), as the ops compute in their inputs' dtypes."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, heads, 16, generator=gen) for heads in (4, 2, 2))
    without = getattr(sp, function)(q, k, v, causal=True, **variants)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = getattr(sp, function)(q, k, v, causal=True, **variants)
    assert under.dtype == torch.float32 and torch.equal(under, without)


@runs_triton_on("cpu")
def test_triton_step_kernels_take_every_variant():
    # The GPU path's kernels in the interpreter: windows and chunks reach them as per-row
    # key intervals, on a ring that stops where the window ends; softcap inside the kernels,
    # sinks at the merge.
    from conftest import pool_for

    cases = [
        case("triton-window", "ring", window=(3, -1), per_rank=6, step_kernels="triton"),
        case("triton-chunks-docs", "ring", chunk=4, documents=(0.5,), step_kernels="triton", H=2, H_kv=1),
        case("triton-softcap-sinks", "ring", softcap=1.5, sinks=True, step_kernels="triton", H=2, H_kv=1),
        case("triton-cap-zigzag", "ring", softcap=2.0, window=(4, 0), layout="zigzag", step_kernels="triton"),
    ]
    failures = [failure for per_rank in pool_for(2).run(run_cases, cases, torch.float32) for failure in per_rank]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# The ring stops where the window ends
# ----------------------------------------------------------------------------------


@on_every_rank
def run_bytes(window, per_rank):
    """(forward bytes, backward bytes) of this rank for a causal window over equal pieces."""
    rank, world_size = rank_and_world()
    q, k, v = (torch.randn(1, per_rank, heads, 8, requires_grad=True) for heads in (2, 1, 1))
    with sp.comm_stats() as forward:
        out = sp.ring_attention(q, k, v, group=timeout_group(), causal=True, window_size=window,
                                seq_lens=[per_rank] * world_size)  # fmt: skip
    with sp.comm_stats() as backward:
        out.backward(torch.ones_like(out))
    return forward.bytes_sent, backward.bytes_sent


@pytest.mark.parametrize(("window", "blocks"), [((3, -1), 1), ((9, -1), 2), ((-1, -1), None)], ids=str)
def test_a_window_shortens_the_ring(ranks, window, blocks):
    # Pieces of 5 rows: a window of 3 keys back reaches one block, of 9 two, none all.
    world_size, per_rank = ranks.world_size, 5
    steps = window_ring_steps(window[0], per_rank, world_size)
    assert steps == min(world_size - 1, blocks if blocks is not None else world_size)
    for rank, sent in enumerate(ranks.run(run_bytes, window, per_rank)):
        expected = ring_bytes([per_rank] * world_size, rank, batch=1, num_kv_heads=1, head_dim=8, element_size=4,
                              steps=steps)  # fmt: skip
        assert tuple(sent) == expected, (window, world_size, rank, sent, expected)


# ----------------------------------------------------------------------------------
# Bad arguments raise on every rank
# ----------------------------------------------------------------------------------


@on_every_rank
def run_bad(function_name, what):
    rank, _ = rank_and_world()
    q, k, v = (torch.randn(1, 4, heads, 8) for heads in (2, 1, 1))
    function = getattr(sp, function_name)
    try:
        function(q, k, v, group=timeout_group(), causal=True, **BAD[what](rank))
    except ValueError as error:
        return str(error)
    return None


BAD = {
    "window of three": lambda rank: dict(window_size=(1, 2, 3)),
    "window below -1": lambda rank: dict(window_size=(-2, 0)),
    "window of floats": lambda rank: dict(window_size=(1.0, 0)),
    "negative softcap": lambda rank: dict(softcap=-1.0),
    "sinks of the wrong shape": lambda rank: dict(sinks=torch.zeros(3)),
    "chunk of zero": lambda rank: dict(attention_chunk_size=0),
    "one rank's window": lambda rank: dict(window_size=(2, -1) if rank == 1 else (-1, -1)),
    "one rank's softcap": lambda rank: dict(softcap=1.0 if rank == 0 else 0.0),
}


@pytest.mark.parametrize("function_name", ["ring_attention", "ulysses_attention"])
def test_bad_variant_arguments_raise_on_every_rank(function_name):
    from conftest import pool_for

    for what in BAD:
        messages = pool_for(2).run(run_bad, function_name, what)
        assert all(message is not None for message in messages), (what, messages)


# ----------------------------------------------------------------------------------
# The ops: opcheck, torch.compile
# ----------------------------------------------------------------------------------


def test_opcheck_of_the_ops_with_every_variant():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, 4, 16, generator=generator, requires_grad=True)
    k = torch.randn(2, 9, 2, 16, generator=generator, requires_grad=True)
    v = torch.randn(2, 9, 2, 16, generator=generator, requires_grad=True)
    sinks = torch.randn(4, generator=generator, requires_grad=True)
    variants = dict(window_left=3, window_right=1, chunk_size=5, softcap=1.5, sinks=sinks)
    # One process (group name ""): the ring of one rank, and the local attention.
    ring_args = (q, k, v, True, 0.25, False, "", "auto", [9])
    torch.library.opcheck(torch.ops.seqpar.ring_attention_forward.default, ring_args, variants)
    torch.library.opcheck(torch.ops.seqpar.local_attention_forward.default, (q, k, v, True, 0.25), variants)
    detached = dict(variants, sinks=sinks.detach())
    out, lse = torch.ops.seqpar.local_attention_forward(q.detach(), k.detach(), v.detach(), True, 0.25, **detached)
    dout = torch.randn(out.shape, generator=generator)
    torch.library.opcheck(
        torch.ops.seqpar.local_attention_backward.default,
        (dout, q.detach(), k.detach(), v.detach(), out, lse, True, 0.25),
        detached,
    )  # fmt: skip


@on_every_rank
def run_compiled(mode):
    generator = torch.Generator().manual_seed(5)
    rank, world_size = rank_and_world()
    q, k, v, dout = (torch.randn(1, 4 * world_size, heads, 16, generator=generator) for heads in (4, 2, 2, 4))
    sinks = torch.randn(4, generator=generator)
    group = timeout_group()
    attention = sp.ring_attention if mode == "ring" else sp.ulysses_attention

    def call(q, k, v, sinks):
        return attention(q, k, v, group=group, causal=True, window_size=(3, -1), softcap=2.0, sinks=sinks,
                         attention_chunk_size=6, seq_lens=[4] * world_size)  # fmt: skip

    local = [sp.split_sequence(t, 1, group).detach() for t in (q, k, v, dout)]
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    eager = reference.with_grads(call, [*local[:3], sinks], local[3])
    traced = reference.with_grads(compiled, [*local[:3], sinks], local[3])
    return [reference.max_error(a, b) for a, b in zip(eager, traced) if a is not None]


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_compiled_fullgraph_matches_eager(mode):
    from conftest import pool_for

    for errors in pool_for(2).run(run_compiled, mode):
        assert max(errors) == 0.0, errors
