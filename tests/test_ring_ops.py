"""ring_attention's ops and entry points on 1-4 gloo ranks: opcheck of the two ring ops,
torch.compile(fullgraph=True) against eager, the CPU paths without Triton, argument
checks, and the zigzag layout's split and gather."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from on_ranks import rank_and_world

import seqpar_kernels as sp
from seqpar_kernels.engine.step_backends import AUTO
from seqpar_kernels.layouts import zigzag_piece_lengths
from seqpar_kernels.ops.cuda_graphs import UNCAPTURABLE_TAGS, refuse_capture
from seqpar_kernels.parallel import checks as checks_module
from tools import reference

NAMES = ("out", "lse", "dq", "dk", "dv")


def _full_inputs(heads, kv_heads, head_dim, local_length, world_size, seed):
    """The same full q, k, v, dout (1, local_length x P, heads, head_dim) on every rank."""
    gen = torch.Generator().manual_seed(seed)
    total = local_length * world_size
    return [torch.randn(1, total, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads, heads)]


# ----------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------


def compiled_ring_matches_eager():
    """fullgraph torch.compile (aot_eager) of a function around ring_attention (zigzag,
    causal, return_lse) vs eager: {name: max abs difference} of out, lse and grads."""
    rank, world_size = rank_and_world()
    torch._dynamo.reset()
    q, k, v, dout = (
        reference.ring_piece(t, "zigzag", rank, world_size) for t in _full_inputs(4, 2, 16, 4, world_size, seed=5)
    )

    def block(q, k, v):
        # Something before and after, so the graph is more than the op alone.
        out, lse = sp.ring_attention(q * 0.5, k, v, causal=True, layout="zigzag", return_lse=True)
        return out * 2.0, lse

    return _compiled_matches_eager(block, q, k, v, dout)


def compiled_uneven_ring_matches_eager():
    """As compiled_ring_matches_eager, with local lengths that differ by rank (an empty
    one from P = 2 on), passed as seq_lens (compiled code cannot gather them)."""
    rank, world_size = rank_and_world()
    torch._dynamo.reset()
    lengths = [5, 0, 3, 1][:world_size]
    q, k, v, dout = (reference.contiguous_piece(t, lengths, rank)
                     for t in _full_inputs(4, 2, 16, sum(lengths), 1, seed=6))  # fmt: skip

    def block(q, k, v):
        out, lse = sp.ring_attention(q * 0.5, k, v, causal=True, seq_lens=lengths, return_lse=True)
        return out * 2.0, lse

    return _compiled_matches_eager(block, q, k, v, dout)


def _compiled_matches_eager(block, q, k, v, dout):
    results = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        out.backward(dout)
        results.append((out.detach(), lse, *(leaf.grad for leaf in leaves)))
    eager, compiled = results
    return {name: reference.max_error(c, e) for name, c, e in zip(NAMES, compiled, eager)}


@pytest.mark.parametrize("lengths", ["equal", "uneven"])
def test_compile_fullgraph_matches_eager(ranks, lengths):
    # aot_eager runs the same kernels as eager: the results must agree exactly.
    run = compiled_ring_matches_eager if lengths == "equal" else compiled_uneven_ring_matches_eager
    for rank, errors in enumerate(ranks.run(run)):
        assert all(err == 0.0 for err in errors.values()), f"rank {rank}: compiled differs from eager: {errors}"


# ----------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------


def opcheck_ops():
    rank, world_size = rank_and_world()
    group_name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(rank)
    results = []
    for causal, zigzag in ((True, True), (False, False), (True, False)):
        # Zigzag: the pieces of 4P + 1 rows; contiguous: lengths that differ by rank.
        seq_lens = (
            zigzag_piece_lengths(4 * world_size + 1, world_size) if zigzag else [2 + r % 3 for r in range(world_size)]
        )
        q = torch.randn(1, seq_lens[rank], 2, 16, generator=gen, requires_grad=True)
        k = torch.randn(1, seq_lens[rank], 1, 16, generator=gen, requires_grad=True)
        v = torch.randn(1, seq_lens[rank], 1, 16, generator=gen, requires_grad=True)
        args = (q, k, v, causal, 0.25, zigzag, group_name, AUTO, seq_lens)
        torch.library.opcheck(torch.ops.seqpar.ring_attention_forward.default, args)
        out, lse = torch.ops.seqpar.ring_attention_forward(*(t.detach() if torch.is_tensor(t) else t for t in args))
        dout = torch.randn(out.shape, generator=gen)
        backward_args = (
            dout,
            q.detach(),
            k.detach(),
            v.detach(),
            out,
            lse,
            causal,
            0.25,
            zigzag,
            group_name,
            AUTO,
            seq_lens,
        )
        torch.library.opcheck(torch.ops.seqpar.ring_attention_backward.default, backward_args)
        results.append(True)
    return results


def test_opcheck(ranks):
    assert ranks.run(opcheck_ops) == [[True] * 3] * ranks.world_size


def test_opcheck_single_process():
    # Without torch.distributed: the group of one process (group name "").
    q = torch.randn(2, 6, 4, 32, requires_grad=True)
    k = torch.randn(2, 6, 2, 32, requires_grad=True)
    v = torch.randn(2, 6, 2, 32, requires_grad=True)
    torch.library.opcheck(torch.ops.seqpar.ring_attention_forward.default, (q, k, v, True, 0.2, True, "", AUTO, [6]))
    out, lse = sp.ring_attention(q, k, v, causal=True, return_lse=True)
    expected, expected_lse = reference.attention(q.double(), k.double(), v.double(), True, 32**-0.5)
    assert (
        reference.max_error(out, expected) <= reference.FP32_TOLERANCE
        and reference.max_error(lse, expected_lse) <= reference.FP32_TOLERANCE
    )


PYTHON_OPS = ("ring_attention_forward", "ring_attention_backward", "local_attention_forward",
              "local_attention_backward", "all_to_all_single")  # fmt: skip


@pytest.mark.skipif(not UNCAPTURABLE_TAGS, reason="this torch has no cudagraph_unsafe tag")
def test_python_ops_stay_out_of_cuda_graphs():
    # torch.compile(mode="reduce-overhead") leaves a graph with a cudagraph_unsafe op out
    # of CUDA graphs: inductor's own test finds the ring's op in a traced call.
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    for name in PYTHON_OPS:
        assert torch._C.Tag.cudagraph_unsafe in getattr(torch.ops.seqpar, name).default.tags, name
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    graph = torch.fx.experimental.proxy_tensor.make_fx(lambda q, k, v: sp.ring_attention(q, k, v, causal=True))(q, k, v)
    node = get_first_incompatible_cudagraph_node(graph)
    assert node is not None and "ring_attention_forward" in str(node.target), node


def test_capture_of_a_python_op_raises_naming_it(monkeypatch):
    # What captures an op all the same (torch without the tag, torch.cuda.graph by hand)
    # gets an error naming it; CPU tensors are never asked about.
    class CudaTensor:
        is_cuda, device = True, torch.device("cuda", 0)

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    refuse_capture("seqpar::ring_attention_forward", torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"seqpar::ring_attention_forward cannot be captured in a CUDA graph"):
        refuse_capture("seqpar::ring_attention_forward", CudaTensor())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    refuse_capture("seqpar::ring_attention_forward", CudaTensor())


def test_cpu_paths_need_no_triton():
    # CPU-only torch wheels do not ship Triton: importing the package and running the
    # CPU ring (forward and backward) and Ulysses must not import it.
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, seqpar_kernels as sp\n"
        "q = torch.randn(1, 6, 4, 16, requires_grad=True)\n"
        "k = torch.randn(1, 6, 2, 16, requires_grad=True)\n"
        "sp.ring_attention(q, k, k, causal=True).sum().backward()\n"
        "sp.ulysses_attention(q, k, k).sum().backward()\n"
        "assert q.grad is not None and 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n"
        "print('no triton: ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "no triton: ok" in result.stdout


# ----------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------


def _qkv(shape_q=(1, 4, 2, 16), shape_kv=(1, 4, 2, 16), dtype=torch.float32):
    return torch.randn(shape_q).to(dtype), torch.randn(shape_kv).to(dtype), torch.randn(shape_kv).to(dtype)


def bad_inputs_raise_everywhere():
    """Bad inputs raise ValueError on every rank (and nobody hangs); the ranks are usable
    afterwards. Returns the messages."""
    rank, world_size = rank_and_world()
    q, k, v = _qkv()
    bad = {
        "3-D q": lambda: sp.ring_attention(q[0], k, v),
        "int dtype": lambda: sp.ring_attention(*_qkv(dtype=torch.int32)),
        "fp64": lambda: sp.ring_attention(*_qkv(dtype=torch.float64)),
        "mixed dtypes": lambda: sp.ring_attention(q, k.half(), v),
        "k/v shapes": lambda: sp.ring_attention(q, k, v[:, :, :1]),
        "seqlen q != kv": lambda: sp.ring_attention(q, k[:, :2], v[:, :2]),
        "batch q != kv": lambda: sp.ring_attention(q, torch.cat([k, k]), torch.cat([v, v])),
        "head dims": lambda: sp.ring_attention(q, k[..., :8], v[..., :8]),
        "head dim 512": lambda: sp.ring_attention(*_qkv((1, 4, 2, 512), (1, 4, 2, 512))),
        "heads % kv heads": lambda: sp.ring_attention(*_qkv((1, 4, 3, 16), (1, 4, 2, 16))),
        "devices": lambda: sp.ring_attention(q.to("meta"), k, v),
        "meta device": lambda: sp.ring_attention(*(t.to("meta") for t in (q, k, v))),
        "layout": lambda: sp.ring_attention(q, k, v, layout="striped"),
        "step_backend": lambda: sp.ring_attention(q, k, v, step_backend="cudnn"),
        "softmax_scale": lambda: sp.ring_attention(q, k, v, softmax_scale=float("nan")),
        "seq_lens of other ranks": lambda: sp.ring_attention(q, k, v, seq_lens=[4] * (world_size + 1)),
        "seq_lens without this rank's": lambda: sp.ring_attention(q, k, v, seq_lens=[5] * world_size),
        "zigzag_split dim": lambda: sp.zigzag_split(torch.randn(2, 2 * world_size + 1), dim=2),
        "zigzag_gather dim": lambda: sp.zigzag_gather(torch.randn(3, 2), dim=-3),
    }
    if world_size > 1:
        # Each rank alone is fine; together they disagree. The metadata all_gather makes
        # every rank raise.
        length = 1 if rank == 0 else 6  # never the zigzag pieces of their sum
        bad["zigzag lengths"] = lambda: sp.ring_attention(
            *_qkv((1, length, 2, 16), (1, length, 2, 16)), layout="zigzag"
        )
        bad["ranks disagree on causal"] = lambda: sp.ring_attention(q, k, v, causal=rank == 0)
        bad["ranks disagree on step_backend"] = lambda: sp.ring_attention(
            q, k, v, step_backend="aten" if rank == 0 else "auto"
        )
        bad["ranks disagree on heads"] = lambda: sp.ring_attention(
            *_qkv((1, 4, 2 + 2 * (rank == 0), 16), (1, 4, 2, 16))
        )
        bad["zigzag_gather unequal"] = lambda: sp.zigzag_gather(torch.randn(2 + 2 * (rank == 0), 3), dim=0)
    bad["check_ranks"] = lambda: sp.ring_attention(q, k, v, check_ranks=None)
    messages = {}
    for name, call in bad.items():
        try:
            call()
        except ValueError as error:
            messages[name] = str(error)
        else:
            messages[name] = None
    # Still usable: a valid call runs and is right.
    out = sp.ring_attention(q, k, v, causal=True)
    return messages, tuple(out.shape)


def test_bad_inputs_raise_on_every_rank(ranks):
    for rank, (messages, shape) in enumerate(ranks.run(bad_inputs_raise_everywhere)):
        missing = [name for name, message in messages.items() if message is None]
        assert not missing, f"rank {rank}: no ValueError for {missing}"
        assert shape == (1, 4, 2, 16)
        assert "(1, 4, 2, 16)" in messages["k/v shapes"]  # messages name the shapes


def ring_without_rank_check():
    """check_ranks=False runs no metadata all_gather and gives the same result."""
    rank, _ = rank_and_world()
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 4, 2, 16, generator=gen) for _ in range(3))
    checked = sp.ring_attention(q, k, v, causal=True, layout="zigzag")
    gathers = []
    original = checks_module.all_gather_ints
    checks_module.all_gather_ints = lambda *args: gathers.append(args) or original(*args)
    try:
        unchecked = sp.ring_attention(q, k, v, causal=True, layout="zigzag", check_ranks=False)
        sp.ring_attention(q, k, v, causal=True, layout="zigzag")
    finally:
        checks_module.all_gather_ints = original
    return torch.equal(checked, unchecked), len(gathers)


def test_check_ranks_false_skips_the_metadata_gather(ranks):
    expected_gathers = 1 if ranks.world_size > 1 else 0  # only the checked call's
    assert ranks.run(ring_without_rank_check) == [(True, expected_gathers)] * ranks.world_size


# ----------------------------------------------------------------------------------
# zigzag_split / zigzag_gather
# ----------------------------------------------------------------------------------


def zigzag_round_trip():
    rank, world_size = rank_and_world()
    gen = torch.Generator().manual_seed(11)
    results = {}
    # A length 2P divides, one it does not (chunks of two lengths), fewer rows than chunks.
    for total, dim in ((4 * world_size, 1), (4 * world_size, -2), (4 * world_size + 3, 1), (world_size + 1, -2)):
        full = torch.randn(2, total, 3, generator=gen)
        weights = torch.randn(full.shape, generator=gen)
        case = f"N={total} dim {dim}"
        x = full.clone().requires_grad_()
        piece = sp.zigzag_split(x, dim)
        results[f"split {case}"] = torch.equal(piece, reference.ring_piece(full, "zigzag", rank, world_size))
        # split's backward gathers: x.grad is the full gradient, the same on every rank.
        (piece * reference.ring_piece(weights, "zigzag", rank, world_size)).sum().backward()
        results[f"split grad {case}"] = torch.equal(x.grad, weights)
        leaf = piece.detach().requires_grad_()
        gathered = sp.zigzag_gather(leaf, dim)
        results[f"gather {case}"] = torch.equal(gathered, full)
        (gathered * weights).sum().backward()
        results[f"gather grad {case}"] = torch.equal(
            leaf.grad, reference.ring_piece(weights, "zigzag", rank, world_size)
        )
        sizes = zigzag_piece_lengths(total, world_size)
        results[f"gather with sizes {case}"] = torch.equal(sp.zigzag_gather(piece.detach(), dim, sizes=sizes), full)
    # End to end: zigzag pieces of full q/k/v -> causal ring attention -> gathered out
    # equals attention over the full sequence (2P dividing the length or not).
    for seqlen_local in (4, 3):
        q, k, v, _ = _full_inputs(2, 1, 64, seqlen_local, world_size, seed=3)
        out = sp.ring_attention(*(sp.zigzag_split(t, 1) for t in (q, k, v)), causal=True, layout="zigzag")
        expected, _ = reference.attention(q.double(), k.double(), v.double(), True, 64**-0.5)
        error = reference.max_error(sp.zigzag_gather(out, 1), expected)
        results[f"end to end N={q.shape[1]}"] = error <= reference.FP32_TOLERANCE
    return results


def test_zigzag_split_and_gather(ranks):
    for rank, results in enumerate(ranks.run(zigzag_round_trip)):
        failed = [name for name, ok in results.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"
