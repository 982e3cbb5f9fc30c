"""Randomized differential test of the public functions on 1-5 gloo ranks.

Each case is drawn from a seed: a function (ring_attention, ulysses_attention,
all_to_all_reshard, split/gather_sequence, zigzag_split/gather), shapes (uneven and
empty pieces, GQA/MQA, heads not divisible by the ranks, head dims 1 to 256), a dtype,
the layouts real models hand over (slices of a fused qkv projection, (B, H, S, D)
storage, a last dim that is not contiguous, expanded views), causal or not, the
softmax scale (zero and negative ones too), the attention variants (a sliding window,
chunks, softcapped scores, sinks), and now and then torch.compile. Every rank
draws the same cases, runs its piece, and compares forward and backward with a
single-process fp64 answer: data movement bit for bit, attention by the accuracy rule
(tools/reference.py).

CI runs fixed seeds only (tests/data/randomized_seeds.json): one at every world size
from 1 to 4, and every seed that ever found a defect, at the world size it found it at, so that CI says
the same thing every day. New seeds are explored (at 1-5 ranks) by a command of their own,
`bash scripts/fuzz.sh [COUNT [FIRST]]` (test_explore below, SEQPAR_FUZZ_SEEDS), which a
developer runs every session; each finding becomes a fixed seed in that file and a fix.
A failure prints one line per failing case that replays it alone:

    SEQPAR_REPLAY='{...}' python -m pytest tests/test_randomized.py::test_replay
"""

from __future__ import annotations

import json
import os
import random
import traceback

import pytest
import torch
from conftest import WORLD_SIZES, pool_for
from on_ranks import on_every_rank, rank_and_world, timeout_group

import seqpar_kernels as sp
from seqpar_kernels.layouts import zigzag_piece_lengths
from tools import reference

# CI's fixed seeds run at the suite's world sizes (1-4); the exploration adds 5.
EXPLORED_WORLD_SIZES = (*WORLD_SIZES, 5)
ATTENTION_CASES_PER_RUN = 24
MOVEMENT_CASES_PER_RUN = 24
COMPILE_CASES_PER_RUN = 1


SEEDS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "randomized_seeds.json")


def fixed_runs() -> list[tuple[int, int]]:
    """(seed, world size) of every fixed run: the seeds run at every world size, and
    each seed that found a defect at the world size it was found at."""
    with open(SEEDS_FILE) as file:
        seeds = json.load(file)
    runs = [(seed, world_size) for seed in seeds["every_world_size"] for world_size in WORLD_SIZES]
    return runs + [(finding["seed"], finding["world_size"]) for finding in seeds["findings"]]


def exploration_runs() -> list[tuple[int, int]]:
    """(seed, world size) of the exploration SEQPAR_FUZZ_SEEDS asks for: "FIRST:COUNT"
    (COUNT seeds from FIRST) or seeds separated by commas, each at every world size
    (SEQPAR_FUZZ_WORLD_SIZES, commas, narrows them)."""
    spec = os.environ.get("SEQPAR_FUZZ_SEEDS", "")
    if ":" in spec:
        first, count = (int(part) for part in spec.split(":"))
        seeds = range(first, first + count)
    else:
        seeds = [int(seed) for seed in spec.split(",") if seed.strip()]
    sizes = os.environ.get("SEQPAR_FUZZ_WORLD_SIZES")
    world_sizes = [int(size) for size in sizes.split(",")] if sizes else EXPLORED_WORLD_SIZES
    return [(seed, world_size) for seed in seeds for world_size in world_sizes]


# ----------------------------------------------------------------------------------
# drawing cases (plain dicts, so that a case prints as JSON and replays from it)
# ----------------------------------------------------------------------------------

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
HEAD_DIMS = (1, 2, 3, 5, 8, 16, 24, 40, 64, 80, 96, 128, 160, 256)
TENSOR_LAYOUTS = ("contiguous", "heads-major", "last-dim-transposed", "head-dim-strided", "batch-expanded")


def draw_attention_case(rng: random.Random, world_size: int) -> dict:
    function = rng.choice(("ring", "ulysses"))
    kv_heads = rng.randint(1, 3)
    case = dict(
        function=function,
        world_size=world_size,
        batch=rng.randint(1, 3),
        heads=kv_heads * rng.choice((1, 1, 2, 3)),
        kv_heads=kv_heads,
        head_dim=rng.choice(HEAD_DIMS),
        causal=rng.random() < 0.6,
        dtype=rng.choice(FLOAT_DTYPES),
        scale=rng.choice((None, None, "ordinary", "ordinary", "large", 0.0, "negative")),
        fused_qkv=rng.random() < 0.2,
        layouts={name: rng.choice(TENSOR_LAYOUTS) for name in ("q", "k", "v", "dout")},
        seed=rng.randrange(2**31),
    )
    if case["scale"] == "ordinary":
        case["scale"] = round(rng.uniform(0.05, 1.5), 4)
    elif case["scale"] == "large":
        case["scale"] = round(rng.uniform(3.0, 12.0), 3)
    elif case["scale"] == "negative":
        case["scale"] = -round(rng.uniform(0.05, 1.5), 4)
    case["lengths"] = [rng.choice((0, 1, 2, 3, 4, 5, 7)) for _ in range(world_size)]
    # The variants from a generator of their own: the draws above stay those of every
    # earlier release of this test.
    variant_rng = random.Random(case["seed"])
    if variant_rng.random() < 0.4:
        case["variants"] = dict(
            window_size=[variant_rng.choice((-1, 0, 1, 2, 5)), variant_rng.choice((-1, -1, 0, 1, 3))],
            softcap=variant_rng.choice((0.0, 0.0, round(variant_rng.uniform(0.5, 5.0), 3))),
            attention_chunk_size=variant_rng.choice((None, None, variant_rng.randint(1, 8))),
            sinks=variant_rng.random() < 0.3,
        )
    if function == "ring":
        case["layout"] = rng.choice(("contiguous", "zigzag"))
        if case["layout"] == "zigzag":  # the zigzag pieces of a sequence of any length
            case["lengths"] = zigzag_piece_lengths(rng.randint(0, 6 * world_size), world_size)
        case["pass_seq_lens"] = rng.random() < 0.3
    return case


MOVEMENT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool")
MOVEMENT_LAYOUTS = ("contiguous", "permuted", "sliced", "expanded")


def draw_movement_case(rng: random.Random, world_size: int) -> dict:
    function = rng.choice(("reshard", "split-gather", "zigzag"))
    ndim = rng.randint(2 if function == "reshard" else 1, 4)
    case = dict(
        function=function,
        world_size=world_size,
        shape=[rng.randint(0, 4) for _ in range(ndim)],
        dtype=rng.choice(MOVEMENT_DTYPES),
        layout=rng.choice(MOVEMENT_LAYOUTS),
        pass_sizes=rng.random() < 0.5,
        negative_dims=rng.random() < 0.3,
        seed=rng.randrange(2**31),
    )
    dims = rng.sample(range(ndim), 2 if function == "reshard" else 1)
    case["dims"] = dims
    if function == "reshard":
        case["gather_sizes"] = [rng.randint(0, 4) for _ in range(world_size)]
    elif function == "zigzag":
        case["shape"][dims[0]] = rng.randint(0, 4 * world_size + 3)
    return case


def draw_cases(seed: int, world_size: int) -> list[dict]:
    rng = random.Random(f"{seed}/{world_size}")
    cases = [draw_attention_case(rng, world_size) for _ in range(ATTENTION_CASES_PER_RUN)]
    cases += [draw_movement_case(rng, world_size) for _ in range(MOVEMENT_CASES_PER_RUN)]
    for case in rng.sample(cases, COMPILE_CASES_PER_RUN):
        case["compile"] = True
    return cases


def reproducer(case: dict) -> str:
    return f"SEQPAR_REPLAY='{json.dumps(case, sort_keys=True)}' python -m pytest tests/test_randomized.py::test_replay"


# ----------------------------------------------------------------------------------
# layouts: same values, other strides (all differentiable)
# ----------------------------------------------------------------------------------


def tensor_layout(name: str, x: torch.Tensor, batch: int) -> torch.Tensor:
    """x (B or 1, S, H, D) -> the (batch, S, H, D) tensor handed over, in layout `name`."""
    if name == "batch-expanded":
        return x.expand(batch, *x.shape[1:])
    if name == "heads-major":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if name == "last-dim-transposed":
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if name == "head-dim-strided":
        return torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0]
    assert name == "contiguous", name
    return x


def leaf_batch(layout: str, batch: int) -> int:
    return 1 if layout == "batch-expanded" else batch


def attention_inputs(case: dict, q, k, v):
    """The q, k, v handed to the function from the leaves q, k, v."""
    if case["fused_qkv"]:  # head slices of one (B, S, H + 2 H_kv, D) projection
        fused = torch.cat([q, k, v], dim=2)
        heads, kv_heads = q.shape[2], k.shape[2]
        return fused[:, :, :heads], fused[:, :, heads : heads + kv_heads], fused[:, :, heads + kv_heads :]
    layouts, batch = case["layouts"], case["batch"]
    return tuple(tensor_layout(layouts[name], t, batch) for name, t in zip("qkv", (q, k, v)))


def movement_layout(name: str, x: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """The same values as x in another layout: permuted memory, a strided slice of a
    bigger tensor, or (where x has a dim of size 1) an expanded view."""
    if name == "permuted" and x.dim() > 1:
        order = list(range(x.dim()))
        rng.shuffle(order)
        inverse = [order.index(d) for d in range(x.dim())]
        return x.permute(order).contiguous().permute(inverse)
    if name == "sliced":
        return torch.stack([x, x], dim=-1)[..., 0]
    if name == "expanded":
        ones = [d for d, size in enumerate(x.shape) if size == 1]
        if ones:
            return x.narrow(ones[0], 0, 1).expand(x.shape)
    return x


# ----------------------------------------------------------------------------------
# evaluating one case on this rank
# ----------------------------------------------------------------------------------


def _rows(case: dict, x: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's rows of a full-sequence tensor, by hand."""
    if case.get("layout") == "zigzag":
        return reference.zigzag_piece(x, rank, case["world_size"])
    return reference.contiguous_piece(x, case["lengths"], rank)


def _draw(generator, shape, dtype=torch.float64):
    return torch.randn(*shape, generator=generator, dtype=dtype)


def run_attention_case(case: dict, rank: int) -> dict:
    """Returns {name: (error, plain PyTorch's error, |exact| max, |exact lse| max)} for out,
    dq, dk, dv of this rank's piece (the lse's over the whole sequence)."""
    dtype = getattr(torch, case["dtype"])
    generator = torch.Generator().manual_seed(case["seed"])
    batch, total, head_dim = case["batch"], sum(case["lengths"]), case["head_dim"]
    layouts = (
        case["layouts"]
        if not case["fused_qkv"]
        else dict(case["layouts"], q="contiguous", k="contiguous", v="contiguous")
    )
    leaves = [
        _draw(generator, (leaf_batch(layouts[name], batch), total, heads, head_dim))
        for name, heads in (("q", case["heads"]), ("k", case["kv_heads"]), ("v", case["kv_heads"]))
    ]
    dout_full = tensor_layout(
        layouts["dout"], _draw(generator, (leaf_batch(layouts["dout"], batch), total, case["heads"], head_dim)), batch
    )
    causal, scale = case["causal"], case["scale"]
    make_inputs = lambda q, k, v: attention_inputs(case, q, k, v)  # noqa: E731
    variants = dict(case.get("variants", {}))
    if variants.get("sinks"):
        variants["sinks"] = _draw(generator, (case["heads"],))
    else:
        variants.pop("sinks", None)
    window = tuple(variants.get("window_size", (-1, -1)))
    reference_variants = dict(
        window_size=window, softcap=variants.get("softcap", 0.0), chunk_size=variants.get("attention_chunk_size")
    )

    def exact_fn(q, k, v, dtype=torch.float64):
        sinks = variants.get("sinks")
        sinks = None if sinks is None else sinks.to(dtype)
        return reference.attention(q, k, v, causal, scale, sinks=sinks, **reference_variants)

    exact = reference.with_grads(exact_fn, leaves, dout_full, make_inputs)
    low = [t.to(dtype) for t in leaves]
    plain = reference.with_grads(
        lambda q, k, v: exact_fn(q, k, v, dtype), low, dout_full.to(dtype), make_inputs
    )  # fmt: skip
    # SDPA takes windows and chunks as a mask, as models hand them to it, and sinks as one
    # more key of value 0; softcapped scores not: there plain attention alone is the
    # yardstick. (SDPA's fused backward takes rowsum(dout * out) from the rounded out, as
    # every flash-style backward does; plain attention's softmax backward does not, and is
    # the more accurate of the two where one key takes nearly all of a row's weight.)
    attn_mask = None
    if variants and not variants.get("softcap"):
        attn_mask = reference.visible(total, causal, window, variants.get("attention_chunk_size"))
    low_sinks = variants["sinks"].to(dtype) if "sinks" in variants else None
    fused = plain if variants.get("softcap") else reference.with_grads(
        lambda q, k, v: reference.sdpa(q, k, v, causal, scale, attn_mask, sinks=low_sinks), low, dout_full.to(dtype),
        make_inputs,
    )  # fmt: skip

    group = timeout_group()
    ours_variants = dict(variants, window_size=window)
    if "sinks" in ours_variants:
        ours_variants["sinks"] = ours_variants["sinks"].to(dtype)

    def ours_fn(q, k, v):
        if case["function"] == "ring":
            # Compiled code cannot gather the lengths: it is given them.
            seq_lens = case["lengths"] if case.get("pass_seq_lens") or case.get("compile") else None
            return sp.ring_attention(
                q, k, v, causal=causal, softmax_scale=scale, layout=case["layout"], group=group, seq_lens=seq_lens,
                **ours_variants,
            )  # fmt: skip
        return sp.ulysses_attention(
            q, k, v, causal=causal, softmax_scale=scale, seq_lens=case["lengths"], group=group, **ours_variants
        )  # fmt: skip

    local_leaves = [_rows(case, t, rank).to(dtype) for t in leaves]
    dout_local = _rows(case, dout_full, rank).to(dtype)
    ours = reference.with_grads(ours_fn, local_leaves, dout_local, make_inputs)
    if case.get("compile"):
        torch._dynamo.reset()  # a fresh compile, as a model's: not a recompile of the last case's ours_fn
        compiled = reference.with_grads(
            torch.compile(ours_fn, fullgraph=True, backend=_compile_backend(case)),
            local_leaves,
            dout_local,
            make_inputs,
        )
        for c, e in zip(compiled[:1] + compiled[2:], ours[:1] + ours[2:]):
            mismatch = reference.max_error(c, e)
            assert mismatch <= 1e-6 * max(1.0, reference.magnitude(e)), (
                f"torch.compile differs from eager by {mismatch:.3g}"
            )

    # Two more errors that any implementation in the dtype makes, measured at the inputs
    # rounded to it (exact otherwise): the inputs' own rounding (the exact answer of the
    # rounded inputs; plain attention's error can cancel it by chance), and for dq and dk
    # a flash-style backward's rowsum(dout * out) of the rounded out, which plain
    # attention's softmax backward does not take.
    rounded = [t.to(dtype).double() for t in leaves]
    rounded_dout = dout_full.to(dtype).double()

    rounded_sinks = variants["sinks"].to(dtype).double() if "sinks" in variants else None

    def rounded_fn(q, k, v):
        return reference.attention(q, k, v, causal, scale, sinks=rounded_sinks, **reference_variants)

    of_rounded = reference.with_grads(rounded_fn, rounded, rounded_dout, make_inputs)
    flash_error = reference.rounded_out_error(rounded_fn, rounded, rounded_dout, dtype, make_inputs)
    q_full, k_full, v_full = leaves
    effective_scale = 1.0 if scale == 0 else head_dim**-0.5 if scale is None else scale
    backward_rounding = reference.delta_rounding(
        head_dim, effective_scale, reference.magnitude(dout_full), reference.magnitude(v_full),
        max(reference.magnitude(q_full), reference.magnitude(k_full)),
    )  # fmt: skip
    results = {}
    for index, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        expected = _rows(case, exact[index], rank)
        got = ours[index]
        assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
        assert got.dtype == dtype, f"{name}: dtype {got.dtype}"
        error = reference.max_error(got, expected)
        yardstick = max(
            reference.max_error(_rows(case, plain[index], rank), expected),
            reference.max_error(_rows(case, fused[index], rank), expected),
            reference.max_error(_rows(case, of_rounded[index], rank), expected),
            reference.magnitude(_rows(case, flash_error[index - 2], rank)) if name in ("dq", "dk") else 0.0,
        )
        results[name] = (
            error,
            yardstick,
            reference.magnitude(expected),
            reference.magnitude(exact[1]),
            backward_rounding if name in ("dq", "dk") else 0.0,
        )
    return results


def _compile_backend(case: dict) -> str:
    # Inductor's cold start costs about a minute per rank process on 2 cores: it runs
    # on world size 2 only; elsewhere aot_eager traces through the same fake kernels.
    return "inductor" if case["world_size"] == 2 else "aot_eager"


def _movement_full(case: dict, generator) -> torch.Tensor:
    dtype = getattr(torch, case["dtype"])
    values = _draw(generator, case["shape"]) * 8
    if dtype == torch.bool:
        return values > 0
    return values.to(dtype)


def run_movement_case(case: dict, rank: int) -> None:
    """Asserts that this rank's result and gradient equal the expected data bit for bit."""
    world_size, function = case["world_size"], case["function"]
    shared = torch.Generator().manual_seed(case["seed"])  # the same draws on every rank
    own = torch.Generator().manual_seed(case["seed"] + 1 + rank)  # this rank's draws
    layout_rng = random.Random(case["seed"])
    dims = case["dims"]
    ndim = len(case["shape"])
    arg_dims = [d - ndim if case["negative_dims"] else d for d in dims]
    differentiable = getattr(torch, case["dtype"]).is_floating_point
    group = timeout_group()

    if function == "reshard":
        scatter, gather = dims
        shape = list(case["shape"])
        shape[gather] = sum(case["gather_sizes"])
        full = _movement_full(dict(case, shape=shape), shared)
        start = sum(case["gather_sizes"][:rank])
        local = full.narrow(gather, start, case["gather_sizes"][rank])
        # Under torch.compile sizes cannot be discovered: compiled cases pass them.
        sizes = case["gather_sizes"] if case["pass_sizes"] or case.get("compile") else None
        fn = lambda x: sp.all_to_all_reshard(x, arg_dims[0], arg_dims[1], group, gather_sizes=sizes)  # noqa: E731
        expected = full.tensor_split(world_size, dim=scatter)[rank]
        # Every rank's gradient is its scatter piece of one full gradient; the backward
        # brings back this rank's gather piece of it.
        dout_full = _movement_full(dict(case, shape=shape), shared)
        dout = dout_full.tensor_split(world_size, dim=scatter)[rank]
        expected_grad = dout_full.narrow(gather, start, case["gather_sizes"][rank])
    elif function == "split-gather":
        (dim,) = dims
        full = _movement_full(case, shared)
        _check_split(full, dim, arg_dims[0], world_size, rank, group, differentiable, _movement_full(case, shared))
        lengths = [piece.shape[dim] for piece in full.tensor_split(world_size, dim=dim)]
        local = full.tensor_split(world_size, dim=dim)[rank]
        sizes = lengths if case["pass_sizes"] or case.get("compile") else None
        fn = lambda x: sp.gather_sequence(x, arg_dims[0], group, sizes=sizes)  # noqa: E731
        expected = full
        # Each rank's gradient of the gathered tensor is its own; it keeps its piece.
        dout = _movement_full(case, own)
        expected_grad = dout.tensor_split(world_size, dim=dim)[rank]
    else:
        (dim,) = dims
        full = _movement_full(case, shared)
        local = reference.zigzag_piece(full, rank, world_size, dim)
        _assert_same(sp.zigzag_split(full, arg_dims[0], group), local, "zigzag_split")
        # Compiled code cannot gather the lengths: it is given them.
        sizes = zigzag_piece_lengths(full.shape[dim], world_size) if case["pass_sizes"] or case.get("compile") else None
        fn = lambda x: sp.zigzag_gather(x, arg_dims[0], group, sizes=sizes)  # noqa: E731
        expected = full
        dout = _movement_full(case, own)
        expected_grad = reference.zigzag_piece(dout, rank, world_size, dim)

    x = movement_layout(case["layout"], local, layout_rng)
    if differentiable:
        leaf = local.clone().requires_grad_()
        x = movement_layout(case["layout"], leaf, layout_rng)
    out = fn(x)
    _assert_same(out, expected, function)
    if case.get("compile"):
        torch._dynamo.reset()  # a fresh compile, as in run_attention_case
        compiled = torch.compile(fn, fullgraph=True, backend=_compile_backend(case))
        _assert_same(compiled(x.detach() if differentiable else x), expected, f"compiled {function}")
    if differentiable:
        out.backward(dout)
        _assert_same(leaf.grad, expected_grad, f"{function} backward")


def _check_split(full, dim, arg_dim, world_size, rank, group, differentiable, dout_full):
    """split_sequence of the full tensor gives this rank's piece; its backward gathers
    every rank's piece of the (same) full gradient into that full gradient."""
    expected = full.tensor_split(world_size, dim=dim)[rank]
    if not differentiable:
        _assert_same(sp.split_sequence(full, arg_dim, group), expected, "split_sequence")
        return
    leaf = full.clone().requires_grad_()
    piece = sp.split_sequence(leaf, arg_dim, group)
    _assert_same(piece, expected, "split_sequence")
    piece.backward(dout_full.tensor_split(world_size, dim=dim)[rank].contiguous())
    _assert_same(leaf.grad, dout_full, "split_sequence backward")


def _assert_same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}"
    same = torch.equal(got.view(torch.uint8) if got.dtype == torch.bool else got, expected) if got.numel() else True
    assert same, f"{what}: values differ"


@on_every_rank
def run_cases(cases: list[dict]) -> list:
    """Every case on this rank: ("attention", case, results) or ("movement", case, None).
    A case that raises raises again with its reproducer line."""
    rank, _ = rank_and_world()
    outcomes = []
    for case in cases:
        try:
            if case["function"] in ("ring", "ulysses"):
                outcomes.append(("attention", case, run_attention_case(case, rank)))
            else:
                run_movement_case(case, rank)
                outcomes.append(("movement", case, None))
        except Exception as error:
            raise AssertionError(f"{reproducer(case)}\n{traceback.format_exc()}") from error
    return outcomes


# ----------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------


def attention_failures(per_rank: list) -> list[str]:
    """The accuracy rule on the whole tensor: the largest error over every rank's piece
    against the largest error of plain PyTorch over the same pieces. (Compared piece by
    piece, two results dominated by rounding, at large logits, differ by chance.)"""
    failures = []
    for index, (kind, case, _) in enumerate(per_rank[0]):
        if kind != "attention":
            continue
        results = [outcomes[index][2] for outcomes in per_rank]
        for name in ("out", "dq", "dk", "dv"):
            error, yardstick, exact_magnitude, lse_magnitude, backward_rounding = (
                max(result[name][i] for result in results) for i in range(5)
            )
            bound = reference.error_bound(
                getattr(torch, case["dtype"]), yardstick, exact_magnitude, lse_magnitude, backward_rounding
            )
            if not error <= bound:  # NaN fails too
                failures.append(
                    f"{case['function']} {name}: error {error:.3g} > bound {bound:.3g} "
                    f"(plain PyTorch {yardstick:.3g})\n  {reproducer(case)}"
                )
    return failures


def run_and_check(cases: list[dict], world_size: int, what: str) -> None:
    per_rank = pool_for(world_size).run(run_cases, cases)
    failures = attention_failures(per_rank)
    assert not failures, f"{what}:\n" + "\n".join(failures)


def _parametrized_runs(runs: list[tuple[int, int]]) -> list:
    return [pytest.param(seed, world_size, id=f"{seed}-P{world_size}") for seed, world_size in runs]


@pytest.mark.parametrize("seed, world_size", _parametrized_runs(fixed_runs()))
def test_fixed_seed(seed, world_size):
    run_and_check(draw_cases(seed, world_size), world_size, f"seed {seed} at world size {world_size}")


EXPLORATION_OFF = [pytest.param(None, None, id="off")]


@pytest.mark.parametrize("seed, world_size", _parametrized_runs(exploration_runs()) or EXPLORATION_OFF)
def test_explore(seed, world_size):
    """New seeds, run by scripts/fuzz.sh; a finding is to be added to the fixed seeds."""
    if seed is None:
        pytest.skip("explores new seeds when SEQPAR_FUZZ_SEEDS is set (bash scripts/fuzz.sh)")
    finding = json.dumps(dict(seed=seed, world_size=world_size, found="<what it found>"))
    run_and_check(draw_cases(seed, world_size), world_size, f"seed {seed} at world size {world_size}; once fixed, "
                  f"add to the findings of tests/data/randomized_seeds.json:\n  {finding}")  # fmt: skip


def test_replay():
    """Runs one case printed by a failure: SEQPAR_REPLAY='<its JSON>'."""
    if "SEQPAR_REPLAY" not in os.environ:
        pytest.skip("replays a case printed by a failing run (SEQPAR_REPLAY)")
    case = json.loads(os.environ["SEQPAR_REPLAY"])
    run_and_check([case], case["world_size"], "replayed case")


def test_fuzz_command_draws_the_seeds_it_is_asked_for():
    """scripts/fuzz.sh COUNT FIRST runs test_explore for COUNT seeds from FIRST at every
    world size asked for (collected, not run: each run is minutes)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = dict(os.environ, SEQPAR_FUZZ_WORLD_SIZES="2,3")
    result = subprocess.run(
        ["bash", "scripts/fuzz.sh", "2", "700", "--collect-only"],
        cwd=root, env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    collected = sorted(line.split("::")[-1] for line in result.stdout.splitlines() if "::test_explore[" in line)
    assert collected == [f"test_explore[{seed}-P{size}]" for seed in (700, 701) for size in (2, 3)], result.stdout
