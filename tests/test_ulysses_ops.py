"""ulysses_attention's ops and entry point on 1-4 gloo ranks: opcheck of every op as
Ulysses calls it, torch.compile(fullgraph=True) against eager, and argument checks."""

from __future__ import annotations

import re

import pytest
import torch
from on_ranks import backward_on_every_rank, on_every_rank, rank_and_world, timeout_group
from ulysses_cases import UNEVEN, failures_over, full_inputs, lengths_for, make_case

from seqpar_kernels import ulysses_attention
from tools import reference

NAMES = ("out", "dq", "dk", "dv")


# ----------------------------------------------------------------------------------
# opcheck of the ops as Ulysses calls them
# ----------------------------------------------------------------------------------


class _RecordSeqparOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op, args) of every torch.ops.seqpar call, tensors cloned."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "seqpar":
            clone = lambda t: t.detach().clone()
            copied = torch.utils._pytree.tree_map_only(torch.Tensor, clone, (args, kwargs))
            self.calls.append((func, copied))
        return func(*args, **kwargs)


@on_every_rank
def run_opcheck(case):
    rank, world = rank_and_world()
    sizes = lengths_for(case["S"], world)
    case = dict(case, S_total=sum(sizes))
    q, k, v, _ = full_inputs(case)
    q, k, v = (reference.contiguous_piece(t, sizes, rank).float() for t in (q, k, v))
    recorder = _RecordSeqparOps()
    with recorder:
        ulysses_attention(q, k, v, causal=case["causal"], seq_lens=sizes)
    names = [func.name() for func, _ in recorder.calls]
    # Two exchanges (q, k, v out; the output back), each pack, all_to_all_single,
    # unpack, except that a side whose ranges are a tensor's own memory in order
    # skips its kernel (a rank with one local row, or one head: exchange.py).
    sequence = "".join(f"{name.removeprefix('seqpar::')} " for name in names)
    assert re.fullmatch(r"((pack_blocks )?all_to_all_single (unpack_blocks )?){2}", sequence), names
    checked = []
    for func, (args, kwargs) in recorder.calls:
        # Floating inputs require grad so that opcheck exercises the autograd formula.
        args = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.requires_grad_() if t.is_floating_point() else t, args
        )
        result = torch.library.opcheck(func, args, kwargs, raise_exception=True)
        assert all(outcome == "SUCCESS" for outcome in result.values()), (func, result)
        checked.append(func.name())
    return names, checked


@pytest.mark.parametrize(
    "case",
    [
        make_case("gqa-6-2-uneven", H=6, H_kv=2, D=16, S=UNEVEN, causal=True),
    ],
    ids=lambda case: case["id"],
)
def test_opcheck_ops_as_called_by_ulysses(ranks, case):
    results = ranks.run(run_opcheck, case)
    for names, checked in results:
        assert checked == names  # opcheck ran on every op ulysses called
    assert len(results[0][0]) == 6  # rank 0 (4+ rows, 2+ heads) runs both kernels twice


# ----------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------


def _compile_backend(world_size):
    # Inductor's cold start costs about a minute per process on a 2-core machine, so
    # it runs on one world size (2: a real exchange); the others use aot_eager, which
    # still traces with dynamo (fullgraph) and AOTAutograd through the fake kernels and
    # the registered autograd of every op.
    return "inductor" if world_size == 2 else "aot_eager"


@on_every_rank
def run_compile_vs_eager(case, pass_seq_lens):
    """fullgraph torch.compile of a function around ulysses_attention vs eager, forward
    and gradients. Returns {name: max abs difference}."""
    rank, world = rank_and_world()
    torch._dynamo.reset()
    sizes = lengths_for(case["S"], world)
    case = dict(case, S_total=sum(sizes))
    q, k, v, dout = (reference.contiguous_piece(t, sizes, rank).float() for t in full_inputs(case, seed=4))
    group = timeout_group()
    seq_lens = sizes if pass_seq_lens else None

    def block(q, k, v):
        # Something before and after, so the graph is more than the op alone.
        out = ulysses_attention(q * 0.5, k, v, causal=case["causal"], seq_lens=seq_lens, group=group)
        return out.float() * 2.0

    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend=_compile_backend(world))):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        backward_on_every_rank(out, dout)
        results.append((out.detach(), *(leaf.grad for leaf in leaves)))
    eager, compiled = results
    return [("compile", {name: reference.max_error(c, e) for name, c, e in zip(NAMES, compiled, eager)})]


COMPILE_CASE = make_case("gqa-6-2", H=6, H_kv=2, D=16, S=8, causal=True)


def test_compile_fullgraph_matches_eager(ranks):
    # Lengths differing by rank (one empty on P=3), passed as seq_lens.
    per_rank = ranks.run(run_compile_vs_eager, dict(COMPILE_CASE, S=UNEVEN), True)
    failures = failures_over(per_rank, 1e-6)
    assert not failures, "\n".join(failures)


def test_compile_fullgraph_equal_lengths_without_seq_lens(ranks):
    # Equal lengths: the documented case in which seq_lens may be left out.
    per_rank = ranks.run(run_compile_vs_eager, dict(COMPILE_CASE, S=4 * ranks.world_size), False)
    failures = failures_over(per_rank, 1e-6)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# bad inputs: ValueError naming the shapes, on every rank
# ----------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def bad_input_cases(world):
    """(name, (q, k, v), kwargs, indices of the tensors whose shapes the message must name)."""
    S, Q, KV = 4, (0,), (1, 2)
    return [
        ("dtypes", (_t(1, S, 4, 16), *(_t(1, S, 4, 16, dtype=torch.float16),) * 2), {}, Q),
        ("fp64", (_t(1, S, 4, 16, dtype=torch.float64),) * 3, {}, Q),
        ("head-dims", (_t(1, S, 4, 16), _t(1, S, 4, 8), _t(1, S, 4, 8)), {}, Q + KV),
        ("head-dim>256", (_t(1, S, 2, 264),) * 3, {}, Q),
        ("H%H_kv", (_t(1, S, 5, 16), _t(1, S, 2, 16), _t(1, S, 2, 16)), {}, Q + KV),
        ("q-3d", (_t(1, S, 64), _t(1, S, 4, 16), _t(1, S, 4, 16)), {}, Q),
        ("k-5d", (_t(1, S, 4, 16), _t(1, S, 4, 16, 1), _t(1, S, 4, 16)), {}, (1,)),
        ("kv-shapes", (_t(1, S, 4, 16), _t(1, S, 2, 16), _t(1, S, 1, 16)), {}, KV),
        ("batch", (_t(2, S, 4, 16), _t(1, S, 4, 16), _t(1, S, 4, 16)), {}, Q + KV),
        ("seq", (_t(1, S, 4, 16), _t(1, S + 1, 4, 16), _t(1, S + 1, 4, 16)), {}, Q + KV),
        ("seq_lens-length", (_t(1, S, 4, 16),) * 3, {"seq_lens": [S] * (world + 1)}, Q),
        ("seq_lens-mine", (_t(1, S, 4, 16),) * 3, {"seq_lens": [S + 1] * world}, Q),
    ]


@on_every_rank
def run_bad_inputs():
    """Every bad call (the same on every rank) must raise ValueError naming the shapes;
    then ranks that disagree on shapes raise together; then a good call (default group,
    seq_lens exchanged) still matches the reference. One bad rank among good ones:
    tests/test_bad_inputs.py."""
    rank, world = rank_and_world()
    torch.manual_seed(5)
    messages = {}
    for name, (q, k, v), kwargs, must_name in bad_input_cases(world):
        try:
            ulysses_attention(q, k, v, **kwargs)
        except ValueError as error:
            message = str(error)
        else:
            shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            raise AssertionError(f"{name}: no error for {shapes}")
        for index in must_name:
            shape = str(tuple((q, k, v)[index].shape))
            assert shape in message, f"{name}: message does not name {'qkv'[index]} {shape}: {message!r}"
        messages[name] = message

    if world > 1:
        # Ranks disagree (the last rank has 2 heads, the others 4): every rank raises
        # from the size exchange instead of some entering the all-to-all.
        heads = 2 if rank == world - 1 else 4
        q = _t(1, 4, heads, 16)
        try:
            ulysses_attention(q, q, q)
        except ValueError as error:
            messages["ranks-disagree"] = str(error)
        else:
            raise AssertionError("ranks with different head counts: no error")

    # The ranks are still in step: a good call with the default group and exchanged
    # seq_lens works and matches the reference.
    sizes = lengths_for(UNEVEN, world)
    case = make_case("after", H=4, H_kv=2, D=16, S=UNEVEN, causal=True, S_total=sum(sizes))
    q, k, v, _ = full_inputs(case, seed=6)
    expected = reference.contiguous_piece(reference.attention(q, k, v, causal=True)[0], sizes, rank)
    out = ulysses_attention(*(reference.contiguous_piece(t, sizes, rank).float() for t in (q, k, v)), causal=True)
    return messages, reference.max_error(out, expected)


def test_bad_inputs_raise_on_every_rank_then_ranks_still_work(ranks):
    per_rank = ranks.run(run_bad_inputs)
    expected_names = {name for name, *_ in bad_input_cases(ranks.world_size)}
    if ranks.world_size > 1:
        expected_names.add("ranks-disagree")
    for rank, (messages, error_after) in enumerate(per_rank):
        assert set(messages) == expected_names, (rank, sorted(messages))
        assert error_after <= reference.FP32_TOLERANCE, f"rank {rank}: a good call afterwards is off by {error_after}"
