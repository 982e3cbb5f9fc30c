"""USP (seqpar_kernels/parallel/usp.py) on gloo grids of ranks (one file, over 500 lines:
every check shares the grids and their rank pools): usp_attention against
fp64 attention, degree 1 against ulysses_attention and ring_attention bit for bit, the
bytes against the per-group formulas, torch.compile, the layouts of usp_split and
usp_gather, make_usp_groups, and bad inputs on every rank (the README's example: tests/test_readme_example.py).

Grids are (R ring slots) x (U Ulysses ranks): world 4 as 1x4, 2x2 (Ulysses groups
consecutive, strided, and from a DeviceMesh whose dims are named in the other order) and
4x1; world 3 as 1x3 and 3x1; world 6 as 2x3 and 3x2. Every rank builds the same full
q/k/v/dout from a seed, takes its piece as this file defines the layouts (independently
of the library), and compares its piece of out, lse and the gradients with the
reference on the same rank (tools/reference.py). Rank functions run many cases per
call: every pool.run is a round trip to all ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import pool_for
from on_ranks import COLLECTIVE_TIMEOUT, backward_on_every_rank, on_every_rank, timeout_group
from test_ring_schedule import RingPieces, causal_schedule, global_positions

import seqpar_kernels as sp
from seqpar_kernels.layouts import usp_piece_segments
from seqpar_kernels.traffic import usp_bytes
from tools import reference

NAMES = ("out", "lse", "dq", "dk", "dv")

# (grid kind, U) per world size; R = world / U. "inner": make_usp_groups(U), Ulysses
# groups of consecutive ranks; "outer": make_usp_groups(U, ulysses_inner=False);
# "mesh": init_device_mesh with dims ("ulysses", "ring"), the layout of "outer".
GRIDS = {
    3: [("inner", 3), ("inner", 1)],
    4: [("inner", 4), ("inner", 2), ("outer", 2), ("mesh", 2), ("inner", 1)],
    6: [("inner", 3), ("outer", 2)],
}

# ----------------------------------------------------------------------------------
# grids and layouts, inside the ranks
# ----------------------------------------------------------------------------------

_grids: dict = {}
_grids_world = None


def usp_groups(kind: str, ulysses_degree: int) -> dict:
    """The keyword arguments that name a grid (mesh=, or the two groups), made once per
    rank (group creation is collective: every rank makes them in the same order). After
    a failed call on_every_rank replaces the short-timeout world group; the grids go
    too, since a gloo group whose collective timed out is unusable."""
    global _grids_world
    if _grids_world is not timeout_group():
        _grids.clear()
        _grids_world = timeout_group()
    key = (kind, ulysses_degree)
    if key not in _grids:
        if kind == "mesh":
            from torch.distributed.device_mesh import init_device_mesh

            shape = (ulysses_degree, dist.get_world_size() // ulysses_degree)
            _grids[key] = dict(mesh=init_device_mesh("cpu", shape, mesh_dim_names=("ulysses", "ring")))
        else:
            ulysses_group, ring_group = sp.make_usp_groups(
                ulysses_degree, ulysses_inner=kind == "inner", timeout=COLLECTIVE_TIMEOUT
            )
            _grids[key] = dict(ulysses_group=ulysses_group, ring_group=ring_group)
    return _grids[key]


def position(groups: dict) -> tuple[int, int, int, int]:
    """(i, j, R, U): this rank's ring index and Ulysses index, and the degrees."""
    if "mesh" in groups:
        ulysses, ring = groups["mesh"].get_group("ulysses"), groups["mesh"].get_group("ring")
    else:
        ulysses, ring = groups["ulysses_group"], groups["ring_group"]
    return dist.get_rank(ring), dist.get_rank(ulysses), dist.get_world_size(ring), dist.get_world_size(ulysses)


def usp_piece(x, layout, i, j, ring_size, ulysses_size, lengths=None, dim=1):
    """Piece i*U + j of the full sequence x (along dim), as docs/usp.md defines the
    layouts. contiguous: torch.tensor_split into R*U, or lengths[p] consecutive rows for
    piece p; zigzag: chunks i and 2R-1-i of tensor_split into 2R, then piece j of that
    slot's tensor_split into U."""
    if layout == "zigzag":
        chunks = torch.tensor_split(x, 2 * ring_size, dim)
        slot = torch.cat([chunks[i], chunks[2 * ring_size - 1 - i]], dim)
        return torch.tensor_split(slot, ulysses_size, dim)[j]
    if lengths is None:
        return torch.tensor_split(x, ring_size * ulysses_size, dim)[i * ulysses_size + j]
    return reference.contiguous_piece(x, lengths, i * ulysses_size + j, dim)


def piece_lengths(total, layout, ring_size, ulysses_size, lengths=None):
    """Every piece's length, in piece order."""
    rows = torch.arange(total)
    return [
        usp_piece(rows, layout, i, j, ring_size, ulysses_size, lengths, dim=0).numel()
        for i in range(ring_size) for j in range(ulysses_size)
    ]  # fmt: skip


# ----------------------------------------------------------------------------------
# accuracy
# ----------------------------------------------------------------------------------


def _case(id, H, H_kv, D, causal, layout, B=1, **extra):
    """extra: total(pieces) (the full length, split as the layout says) or
    lengths(pieces) (contiguous, every piece's length); scale; lse (return_lse);
    pass_seq_lens; packed (q, k, v passed as head slices of one tensor)."""
    return dict(id=id, H=H, H_kv=H_kv, D=D, causal=causal, layout=layout, B=B, **extra)


def _with_empty_piece(pieces):
    """Lengths that differ by piece, one of them empty: [2, 0, 3, 1, 4, 2][:pieces]."""
    return [(3 * piece + 2) % 5 for piece in range(pieces)]


# Full lengths for `pieces` pieces (module-level: the pool pickles cases by reference).
def _three_each_and_one(pieces):
    return 3 * pieces + 1  # tensor_split pieces of two lengths


def _four_each_and_three(pieces):
    return 4 * pieces + 3  # zigzag chunks of two lengths


def _one_more_than_pieces(pieces):
    return pieces + 1  # fewer rows than zigzag chunks


def _two_each(pieces):
    return 2 * pieces


# A table: one case a line.
# fmt: off
CASES = [
    _case("mha-causal-tensor-split", H=4, H_kv=4, D=32, causal=True, layout="contiguous", B=2,
          total=_three_each_and_one, lse=True),
    # Heads that no U > 1 tested divides; lengths that differ, one empty, passed.
    _case("heads5-full-uneven", H=5, H_kv=5, D=16, causal=False, layout="contiguous",
          lengths=_with_empty_piece, pass_seq_lens=True),
    # GQA, kv heads fewer than U = 3, 4; on U = 3 and 4 a rank's q heads [2, 4) or [2, 3)
    # start inside a kv group: two rings (uniform runs) on that rank's ring group.
    _case("gqa-6-2-causal-uneven", H=6, H_kv=2, D=32, causal=True, layout="contiguous", B=2,
          lengths=_with_empty_piece, lse=True),
    # MQA, zigzag over a length 2R does not divide, a negative scale; on U = 4 a rank
    # without q heads.
    _case("mqa-3-1-zigzag-causal", H=3, H_kv=1, D=16, causal=True, layout="zigzag",
          total=_four_each_and_three, scale=-0.4, lse=True),
    # Fewer rows than zigzag chunks: empty chunks and pieces.
    _case("gqa-4-2-zigzag-short", H=4, H_kv=2, D=16, causal=True, layout="zigzag",
          total=_one_more_than_pieces, pass_seq_lens=True),
    _case("D256-zigzag-full", H=2, H_kv=1, D=256, causal=False, layout="zigzag",
          total=_two_each, lse=True),
    # q, k, v as head slices of one packed tensor: strided views.
    _case("packed-gqa-6-3-causal", H=6, H_kv=3, D=16, causal=True, layout="contiguous",
          total=_three_each_and_one, packed=True),
]
# fmt: on


def full_inputs(case, total, dtype, seed):
    """The same full q, k, v, dout (B, total, heads, D) on every rank: fp64 draws cast
    to dtype."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda heads: torch.randn(case["B"], total, heads, case["D"], generator=gen, dtype=torch.float64)  # noqa: E731
    return [draw(heads).to(dtype) for heads in (case["H"], case["H_kv"], case["H_kv"], case["H"])]


def run_case(case, groups, dtype, seed):
    """One case on this rank's grid. Returns (errors, yardsticks) as the ring tests do:
    max error of each of our pieces against fp64 attention, and of plain attention in
    dtype (the yardstick of the accuracy rule), and the reference pieces' magnitude."""
    i, j, ring_size, ulysses_size = position(groups)
    pieces = ring_size * ulysses_size
    lengths = case["lengths"](pieces) if "lengths" in case else None
    total = sum(lengths) if lengths else case["total"](pieces)
    layout, causal = case["layout"], case["causal"]
    scale = case.get("scale", case["D"] ** -0.5)
    piece = lambda x, dim=1: usp_piece(x, layout, i, j, ring_size, ulysses_size, lengths, dim)  # noqa: E731
    seq_lens = piece_lengths(total, layout, ring_size, ulysses_size, lengths) if case.get("pass_seq_lens") else None
    inputs = full_inputs(case, total, dtype, seed)
    attention = lambda q, k, v: reference.attention(q, k, v, causal, scale)  # noqa: E731
    exact = reference.with_grads(attention, [t.double() for t in inputs[:3]], inputs[3].double())
    plain = reference.with_grads(attention, inputs[:3], inputs[3]) if dtype != torch.float32 else None

    def ours(q, k, v):
        return sp.usp_attention(
            q, k, v, causal=causal, softmax_scale=case.get("scale"), layout=layout, seq_lens=seq_lens,
            return_lse=case.get("lse", False), **groups,
        )  # fmt: skip

    make_inputs = None
    if case.get("packed"):
        # (B, S_p, H + 2 H_kv, D), sliced along the heads: no slice is contiguous.
        heads = [case["H"], case["H_kv"], case["H_kv"]]
        make_inputs = lambda q, k, v: torch.cat([q, k, v], dim=2).split(heads, dim=2)  # noqa: E731
    got = reference.with_grads(ours, [piece(t) for t in inputs[:3]], piece(inputs[3]), make_inputs)
    errors, yardsticks = {}, {"plain": {}, "magnitude": {}}
    for name, want, have, yardstick in zip(NAMES, exact, got, plain or exact):
        if have is None:  # no lse asked for
            continue
        dim = 2 if name == "lse" else 1
        want = piece(want, dim)
        assert have.shape == want.shape, (case["id"], name, have.shape, want.shape)
        assert have.dtype == (torch.float32 if name == "lse" else dtype), (case["id"], name, have.dtype)
        errors[name] = reference.max_error(have, want)
        yardsticks["plain"][name] = reference.max_error(piece(yardstick, dim), want)
        yardsticks["magnitude"][name] = reference.magnitude(want)
    return errors, yardsticks


@on_every_rank
def run_grid_cases(grids, cases, dtype):
    """Every case on every grid: a list of (grid, case id, errors, yardsticks)."""
    return [
        (f"{kind} U={ulysses_degree}", case["id"], *run_case(case, usp_groups(kind, ulysses_degree), dtype, seed))
        for kind, ulysses_degree in grids for seed, case in enumerate(cases)
    ]  # fmt: skip


def failures_of(per_rank, limit_for):
    return [
        f"rank {rank} {grid} {case_id} {name}: err {err:.3g} > {limit_for(name, yardsticks):.3g}"
        for rank, results in enumerate(per_rank)
        for grid, case_id, errors, yardsticks in results
        for name, err in errors.items()
        if not err <= limit_for(name, yardsticks)  # NaN fails too
    ]


@pytest.mark.parametrize("world_size", [3, 4, 6], ids=lambda size: f"P{size}")
def test_fp32_forward_backward_match_fp64_reference(world_size):
    per_rank = pool_for(world_size).run(run_grid_cases, GRIDS[world_size], CASES, torch.float32)
    assert all(len(results) == len(GRIDS[world_size]) * len(CASES) for results in per_rank)
    failures = failures_of(per_rank, lambda name, yardsticks: reference.FP32_TOLERANCE)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_twice_plain_torch_error(dtype):
    # The accuracy rule (tools/reference.py) on the 2x2 grid of world 4.
    cases = [CASES[2], CASES[3]]
    per_rank = pool_for(4).run(run_grid_cases, [("inner", 2)], cases, dtype)

    def limit(name, yardsticks):
        return reference.error_bound(dtype, yardsticks["plain"][name], yardsticks["magnitude"][name])

    failures = failures_of(per_rank, limit)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# degree 1: the one-dimensional algorithms, bit for bit
# ----------------------------------------------------------------------------------


@on_every_rank
def run_degree_one():
    """usp_attention on the 1xP grid against ulysses_attention, and on the Px1 grid
    against ring_attention, both on the world: {what: outputs and gradients equal}."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lengths = _with_empty_piece(world_size)
    gen = torch.Generator().manual_seed(9)
    q, k, v, dout = (torch.randn(2, lengths[rank], heads, 16, generator=gen) for heads in (6, 2, 2, 6))
    equal = {}
    for layout in ("contiguous", "zigzag"):  # zigzag over one ring slot is the contiguous layout
        ours = reference.with_grads(
            lambda q, k, v: sp.usp_attention(q, k, v, causal=True, layout=layout, **usp_groups("inner", world_size)),
            (q, k, v), dout,
        )  # fmt: skip
        theirs = reference.with_grads(
            lambda q, k, v: sp.ulysses_attention(q, k, v, causal=True, group=timeout_group()), (q, k, v), dout
        )
        equal[f"ulysses {layout}"] = all(torch.equal(a, b) for a, b in zip(ours, theirs) if a is not None)
    zigzag = torch.tensor_split(torch.arange(4 * world_size + 1), 2 * world_size)
    zigzag_length = len(zigzag[rank]) + len(zigzag[2 * world_size - 1 - rank])
    for layout, length in (("contiguous", lengths[rank]), ("zigzag", zigzag_length)):
        q, k, v, dout = (torch.randn(1, length, heads, 16, generator=gen) for heads in (4, 1, 1, 4))
        options = dict(causal=True, layout=layout, return_lse=True)
        ours = reference.with_grads(
            lambda q, k, v: sp.usp_attention(q, k, v, **options, **usp_groups("inner", 1)), (q, k, v), dout
        )
        theirs = reference.with_grads(
            lambda q, k, v: sp.ring_attention(q, k, v, **options, group=timeout_group()), (q, k, v), dout
        )
        equal[f"ring {layout}"] = all(torch.equal(a, b) for a, b in zip(ours, theirs))
    return equal


@pytest.mark.parametrize("world_size", [3, 4], ids=lambda size: f"P{size}")
def test_degree_one_is_ulysses_or_ring_bit_for_bit(world_size):
    for rank, equal in enumerate(pool_for(world_size).run(run_degree_one)):
        assert all(equal.values()), f"rank {rank}: {equal}"


# ----------------------------------------------------------------------------------
# bytes
# ----------------------------------------------------------------------------------

BYTES_CASES = [
    # On U = 3 the middle Ulysses rank's q heads [2, 4) read both kv heads: two rings.
    _case(
        "gqa-6-2-uneven-lse",
        H=6,
        H_kv=2,
        D=16,
        causal=True,
        layout="contiguous",
        B=2,
        lengths=_with_empty_piece,
        lse=True,
        dtype=torch.float32,
    ),
    _case(
        "mqa-3-1-zigzag-bf16",
        H=3,
        H_kv=1,
        D=16,
        causal=True,
        layout="zigzag",
        total=_four_each_and_three,
        dtype=torch.bfloat16,
    ),
]


def expected_usp_bytes(case, i, j, ulysses_size, lengths):
    """(forward, backward) bytes of the rank at (i, j), both groups together, by
    traffic.usp_bytes: ulysses_attention's over this slot's pieces (with return_lse, the
    fp32 lse of this rank's q heads back too), ring_attention's over the slots with the
    kv heads this Ulysses index receives. lengths: every piece's, in piece order."""
    ulysses, ring = usp_bytes(
        lengths, i, j, ulysses_size=ulysses_size, batch=case["B"], num_heads=case["H"], num_kv_heads=case["H_kv"],
        head_dim=case["D"], element_size=torch.empty((), dtype=case["dtype"]).element_size(),
        return_lse=case.get("lse", False),
    )  # fmt: skip
    return ulysses.forward + ring.forward, ulysses.backward + ring.backward


@on_every_rank
def run_bytes(grids):
    """Per grid and case: (grid, case id, forward bytes, backward bytes, formulas)."""
    results = []
    for kind, ulysses_degree in grids:
        groups = usp_groups(kind, ulysses_degree)
        i, j, ring_size, ulysses_size = position(groups)
        for case in BYTES_CASES:
            pieces = ring_size * ulysses_size
            lengths = case["lengths"](pieces) if "lengths" in case else None
            total = sum(lengths) if lengths else case["total"](pieces)
            all_lengths = piece_lengths(total, case["layout"], ring_size, ulysses_size, lengths)
            q, k, v, dout = (
                usp_piece(t, case["layout"], i, j, ring_size, ulysses_size, lengths).detach().requires_grad_()
                for t in full_inputs(case, total, case["dtype"], seed=3)
            )
            with sp.comm_stats() as forward:
                out = sp.usp_attention(
                    q, k, v, causal=case["causal"], layout=case["layout"], return_lse=case.get("lse", False),
                    **groups,
                )  # fmt: skip
            out = out[0] if isinstance(out, tuple) else out
            with sp.comm_stats() as backward:
                backward_on_every_rank(out, dout)
            expected = expected_usp_bytes(case, i, j, ulysses_size, all_lengths)
            grid = f"{kind} U={ulysses_degree}"
            results.append((grid, case["id"], forward.bytes_sent, backward.bytes_sent, expected))
    return results


@pytest.mark.parametrize("world_size", [4, 6], ids=lambda size: f"P{size}")
def test_bytes_match_the_per_group_formulas(world_size):
    failures = []
    for rank, results in enumerate(pool_for(world_size).run(run_bytes, GRIDS[world_size])):
        for grid, case_id, forward, backward, (want_forward, want_backward) in results:
            if (forward, backward) != (want_forward, want_backward):
                failures.append(
                    f"rank {rank} {grid} {case_id}: sent {forward} B forward, {backward} B backward; "
                    f"formulas {want_forward} B, {want_backward} B"
                )
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------


@on_every_rank
def run_compiled_against_eager():
    """fullgraph torch.compile (aot_eager: the same kernels as eager) of a block around
    usp_attention on the 2x2 grid, lengths that differ by rank passed as seq_lens:
    {name: max abs difference from eager}."""
    rank = dist.get_rank()
    torch._dynamo.reset()
    lengths = [3, 0, 4, 2]
    groups = usp_groups("inner", 2)
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(1, lengths[rank], heads, 16, generator=gen) for heads in (6, 2, 2, 6))

    def block(q, k, v):
        # Something before and after, so the graph is more than the call alone.
        out, lse = sp.usp_attention(q * 0.5, k, v, causal=True, seq_lens=lengths, return_lse=True, **groups)
        return out * 2.0, lse

    eager = reference.with_grads(block, (q, k, v), dout)
    compiled = reference.with_grads(torch.compile(block, fullgraph=True, backend="aot_eager"), (q, k, v), dout)
    return {name: reference.max_error(a, b) for name, a, b in zip(NAMES, compiled, eager)}


def test_compile_fullgraph_matches_eager():
    for rank, errors in enumerate(pool_for(4).run(run_compiled_against_eager)):
        assert all(error == 0.0 for error in errors.values()), f"rank {rank}: {errors}"


# ----------------------------------------------------------------------------------
# usp_split / usp_gather and the zigzag schedule
# ----------------------------------------------------------------------------------


@on_every_rank
def run_split_and_gather(grids):
    """usp_split gives this file's pieces, usp_gather the full tensor back, and each is
    the other's backward; for lengths 2R*U divides, does not, and fewer rows than
    pieces. Returns the names of what failed."""
    failed = []
    gen = torch.Generator().manual_seed(11)
    for kind, ulysses_degree in grids:
        groups = usp_groups(kind, ulysses_degree)
        i, j, ring_size, ulysses_size = position(groups)
        pieces = ring_size * ulysses_size
        for layout in ("contiguous", "zigzag"):
            for total, dim in ((4 * pieces, 1), (4 * pieces + 3, -2), (pieces - 1, 1)):
                case = f"{kind} U={ulysses_degree} {layout} N={total} dim {dim}"
                full = torch.randn(2, total, 3, generator=gen)
                weights = torch.randn(full.shape, generator=gen)
                piece = lambda x: usp_piece(x, layout, i, j, ring_size, ulysses_size, dim=dim % 3)  # noqa: E731
                x = full.clone().requires_grad_()
                mine = sp.usp_split(x, dim, layout=layout, **groups)
                (mine * piece(weights)).sum().backward()
                leaf = mine.detach().requires_grad_()
                gathered = sp.usp_gather(leaf, dim, layout=layout, **groups)
                (gathered * weights).sum().backward()
                checks = {
                    "split": torch.equal(mine, piece(full)),
                    "split backward gathers": torch.equal(x.grad, weights),
                    "gather": torch.equal(gathered, full),
                    "gather backward keeps the piece": torch.equal(leaf.grad, piece(weights)),
                }
                failed += [f"{case}: {name}" for name, ok in checks.items() if not ok]
    return failed


@pytest.mark.parametrize("world_size", [4, 6], ids=lambda size: f"P{size}")
def test_split_and_gather_follow_the_layouts(world_size):
    for rank, failed in enumerate(pool_for(world_size).run(run_split_and_gather, GRIDS[world_size])):
        assert not failed, f"rank {rank}: {failed}"


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4], ids=lambda size: f"R{size}")
def test_zigzag_slots_are_the_rings_zigzag_pieces_with_equal_causal_work(ring_size):
    # A ring slot gathered over its Ulysses group holds exactly the rows the ring's
    # zigzag layout gives ring rank i, so the ring over the slots runs the zigzag
    # schedule: equal causal work on every ring rank at every step when 2R divides the
    # length (to a row otherwise, tests/test_ring_schedule.py).
    for ulysses_size in (1, 2, 3):
        for total in (0, 1, 2 * ring_size * ulysses_size, 4 * ring_size * ulysses_size, 4 * ring_size * 3 + 5):
            slots = [
                [start + row for j in range(ulysses_size)
                 for start, length in usp_piece_segments(total, ulysses_size, ring_size, i, j, True)
                 for row in range(length)]
                for i in range(ring_size)
            ]  # fmt: skip
            pieces = RingPieces.of([len(slot) for slot in slots], True)
            assert slots == [global_positions(i, pieces) for i in range(ring_size)], (ulysses_size, total)
            if total % (2 * ring_size) == 0:
                work, _ = causal_schedule(pieces)
                assert all(len(set(per_rank)) == 1 for per_rank in work), (ulysses_size, total, work)


# ----------------------------------------------------------------------------------
# make_usp_groups
# ----------------------------------------------------------------------------------


def message_of(call) -> str | None:
    """The message of the ValueError that call() raises, or None if it raises none."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


@on_every_rank
def run_make_usp_groups():
    """The global ranks of this rank's (Ulysses group, ring group) for several degrees,
    orders and `group`s; and the messages of bad arguments (None: nothing raised)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ranks = lambda group: tuple(dist.get_process_group_ranks(group))  # noqa: E731
    members = {}
    for degree in (1, 2, world_size):
        for inner in (True, False):
            members[degree, inner, "world"] = tuple(map(ranks, sp.make_usp_groups(degree, ulysses_inner=inner)))
    # Two replicas (data parallelism): {0, 1} and {2, 3}, each a 1x2 grid.
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    members[2, True, "half"] = tuple(map(ranks, sp.make_usp_groups(2, group=halves[rank // 2])))
    bad = {
        "degree not dividing": lambda: sp.make_usp_groups(3),
        "degrees differ": lambda: sp.make_usp_groups(2 if rank == 1 else 4),
        "degree 0": lambda: sp.make_usp_groups(0) if rank == 2 else sp.make_usp_groups(2),
        "groups overlap": lambda: sp.make_usp_groups(1, group=halves[0] if rank < 2 else None),
    }
    return members, {name: message_of(call) for name, call in bad.items()}


def test_make_usp_groups_lays_out_the_grid_and_raises_on_every_rank():
    for rank, (members, messages) in enumerate(pool_for(4).run(run_make_usp_groups)):
        # Ulysses inner: Ulysses groups of consecutive ranks, ring groups striding.
        assert members[1, True, "world"] == ((rank,), (0, 1, 2, 3))
        assert members[2, True, "world"] == ((rank - rank % 2, rank - rank % 2 + 1), (rank % 2, rank % 2 + 2))
        assert members[4, True, "world"] == ((0, 1, 2, 3), (rank,))
        # Swapped.
        assert members[2, False, "world"] == ((rank % 2, rank % 2 + 2), (rank - rank % 2, rank - rank % 2 + 1))
        assert members[4, False, "world"] == members[4, True, "world"]
        assert members[2, True, "half"] == ((rank - rank % 2, rank - rank % 2 + 1), (rank,))
        missing = [name for name, message in messages.items() if message is None]
        assert not missing, f"rank {rank}: no ValueError for {missing}"
        assert "must divide" in messages["degree not dividing"], messages["degree not dividing"]
        assert "overlap" in messages["groups overlap"], messages["groups overlap"]


# ----------------------------------------------------------------------------------
# bad inputs: ValueError on every rank, before any data moves
# ----------------------------------------------------------------------------------


def _qkv(heads=4, kv_heads=2, length=3, dtype=torch.float32):
    return (torch.randn(1, length, heads, 8, dtype=dtype),
            *(torch.randn(1, length, kv_heads, 8, dtype=dtype) for _ in "kv"))  # fmt: skip


@on_every_rank
def run_bad_inputs():
    """Bad calls on the 2x2 grid of world 4: {(name, bad rank): message or None}. The
    same call on every rank (bad rank "all") or a bad input on one rank. Then a good
    call still matches the reference: the ranks stayed in step."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    groups = usp_groups("inner", 2)
    row, column = groups["ulysses_group"], groups["ring_group"]
    # Ulysses groups {0, 1}, {2, 3} with ring groups {0, 3}, {1, 2}: every Ulysses group
    # is one ring slot, but the rows meet the ring groups in opposite orders.
    crossed = [dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT) for ranks in ([0, 3], [1, 2])]
    crossed_ring = crossed[0] if rank in (0, 3) else crossed[1]
    wrong_names = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    q, k, v = _qkv()
    calls = {
        "mesh without the named dims": lambda: sp.usp_attention(q, k, v, mesh=wrong_names),
        "mesh and groups": lambda: sp.usp_attention(q, k, v, mesh=wrong_names, **groups),
        "one group": lambda: sp.usp_attention(q, k, v, ulysses_group=row),
        "step_backend": lambda: sp.usp_attention(q, k, v, step_backend="cudnn", **groups),
        "the Ulysses group as both": lambda: sp.usp_attention(q, k, v, ulysses_group=row, ring_group=row),
        "the ring group as both": lambda: sp.usp_attention(q, k, v, ulysses_group=column, ring_group=column),
        "not a grid": lambda: sp.usp_attention(q, k, v, ulysses_group=row, ring_group=crossed_ring),
        "layout": lambda: sp.usp_attention(q, k, v, layout="striped", **groups),
        "seq_lens of 2 ranks": lambda: sp.usp_attention(q, k, v, seq_lens=[3, 3], **groups),
        # Contiguous lengths that are no zigzag layout of their sum (slots of 4 and 10).
        "zigzag lengths": lambda: sp.usp_attention(*_qkv(length=[1, 3, 4, 6][rank]), layout="zigzag", **groups),
        "usp_gather zigzag lengths": lambda: sp.usp_gather(
            torch.randn(2, [1, 3, 4, 6][rank]), 1, layout="zigzag", **groups
        ),
        "usp_split not a grid": lambda: sp.usp_split(torch.randn(2, 8), 1, ulysses_group=row, ring_group=crossed_ring),
    }
    one_bad_rank = {
        "dtype": (lambda: sp.usp_attention(*_qkv(), **groups),
                  lambda: sp.usp_attention(*_qkv(dtype=torch.float64), **groups)),
        "causal": (lambda: sp.usp_attention(q, k, v, causal=True, **groups),
                   lambda: sp.usp_attention(q, k, v, causal=False, **groups)),
        "step_backend": (lambda: sp.usp_attention(q, k, v, **groups),
                         lambda: sp.usp_attention(q, k, v, step_backend="aten", **groups)),
        "usp_split shape": (lambda: sp.usp_split(torch.randn(2, 8), 1, **groups),
                            lambda: sp.usp_split(torch.randn(2, 9), 1, **groups)),
    }  # fmt: skip
    raised = {(name, "all"): message_of(call) for name, call in calls.items()}
    for name, (good, bad) in one_bad_rank.items():
        for bad_rank in range(4):
            raised[name, bad_rank] = message_of(bad if rank == bad_rank else good)
    # Still in step: a good call with the seq_lens exchanged.
    lengths = _with_empty_piece(4)
    case = _case("after", H=4, H_kv=2, D=8, causal=True, layout="contiguous")
    full = full_inputs(case, sum(lengths), torch.float64, seed=6)
    expected = reference.contiguous_piece(reference.attention(*full[:3], causal=True)[0], lengths, rank)
    local = [reference.contiguous_piece(t, lengths, rank).float() for t in full[:3]]
    error_after = reference.max_error(sp.usp_attention(*local, causal=True, **groups), expected)
    return raised, error_after


def test_bad_inputs_raise_on_every_rank_then_ranks_still_work():
    failures = []
    for rank, (raised, error_after) in enumerate(pool_for(4).run(run_bad_inputs)):
        for (name, bad_rank), message in raised.items():
            if message is None:
                failures.append(f"rank {rank}: {name} (bad on rank {bad_rank}) raised nothing")
            elif name == "dtype" and rank != bad_rank and "bad input on rank(s)" not in message:
                failures.append(f"rank {rank}: {name} (bad on rank {bad_rank}) names no bad rank: {message}")
        assert "grid" in (raised["not a grid", "all"] or ""), raised["not a grid", "all"]
        assert error_after <= reference.FP32_TOLERANCE, f"rank {rank}: a good call afterwards errs by {error_after}"
    assert not failures, "\n".join(failures)
