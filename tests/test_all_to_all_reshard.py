"""all_to_all_reshard, split_sequence, gather_sequence on 1-4 gloo ranks: bit-exact
against torch.tensor_split pieces of a full tensor, forward and backward."""

import itertools
import re

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import seqpar_kernels as sp
from seqpar_kernels.traffic import reshard_bytes

SHAPE = (3, 5, 7, 4)  # no dim divisible by 2, 3 or 4 except the last: uneven pieces
SMALL_SHAPE = (2, 1, 3, 5)  # dims smaller than the world: empty pieces on 2-4 ranks


def full_tensor(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * 10
    if dtype in (torch.uint8, torch.uint16, torch.uint32):
        values = values.abs()
    return values.to(dtype)


def same_bits(actual, expected):
    """Equal shapes and bytes (torch.equal has no float8 or uint16 kernel on CPU). An
    empty tensor counts as contiguous whatever its strides, so it has no byte view."""
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    if actual.shape != expected.shape:
        return False
    return actual.numel() == 0 or torch.equal(as_bytes(actual), as_bytes(expected))


def piece(tensor, dim):
    return tensor.tensor_split(dist.get_world_size(), dim=dim)[dist.get_rank()]


def with_layout(tensor, layout):
    """The same values as a new leaf tensor in another memory layout."""
    if layout == "contiguous":
        return tensor.clone()
    if layout == "channels_first":  # memory order of the dims reversed: (.., C, ..)
        reverse = list(range(tensor.dim()))[::-1]
        return tensor.permute(reverse).contiguous().permute(reverse)
    if layout == "sliced":  # every other element of a wider tensor, from offset 1
        wide = full_tensor((*tensor.shape[:-1], 2 * tensor.shape[-1] + 1), tensor.dtype, 99)
        wide[..., 1::2] = tensor
        return wide[..., 1::2]
    raise ValueError(layout)


def reshard_all_dim_pairs(dtype, layout):
    """Every (scatter, gather) pair of a 4-D tensor; returns the failures."""
    failures = []
    for seed, (scatter_dim, gather_dim) in enumerate(itertools.permutations(range(4), 2)):
        full = full_tensor(SHAPE, dtype, seed)
        local = piece(full, gather_dim)
        if layout == "channels_first":  # same values, memory order (.., C, ..) reversed
            local = local.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
        elif layout == "negative_dims":
            scatter_dim, gather_dim = scatter_dim - 4, gather_dim - 4
        out = sp.all_to_all_reshard(local, scatter_dim, gather_dim)
        if not (out.is_contiguous() and same_bits(out, piece(full, scatter_dim))):
            failures.append((scatter_dim, gather_dim))
    return failures


@pytest.mark.parametrize(
    "dtype,layout",
    [
        (torch.float32, "contiguous"),
        (torch.bfloat16, "channels_first"),
        (torch.float16, "negative_dims"),
        (torch.int64, "contiguous"),
        # gloo has no all_to_all of its own for these: the exchange moves bytes.
        (torch.int16, "channels_first"),
        (torch.uint16, "negative_dims"),
        (torch.float8_e4m3fn, "contiguous"),
    ],
)
def test_reshard_matches_tensor_split(ranks, dtype, layout):
    assert ranks.run(reshard_all_dim_pairs, dtype, layout) == [[]] * ranks.world_size


def reshard_uneven_and_empty():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {}
    # Arbitrary (not tensor_split) sizes along the gather dim, some empty.
    gather_sizes = [3, 0, 5, 1][:world_size]
    full = full_tensor((2, sum(gather_sizes), 6), torch.float32, 7)
    local = full.split(gather_sizes, dim=1)[rank]
    out = sp.all_to_all_reshard(local, scatter_dim=2, gather_dim=1)
    results["arbitrary gather sizes"] = torch.equal(out, piece(full, 2))
    out = sp.all_to_all_reshard(local, 2, 1, gather_sizes=gather_sizes)
    results["explicit gather sizes"] = torch.equal(out, piece(full, 2))
    # Scatter dim smaller than the world: some ranks get empty pieces.
    full = full_tensor((2, 8, 2), torch.float32, 8)
    out = sp.all_to_all_reshard(piece(full, 1), scatter_dim=2, gather_dim=1)
    results["empty pieces"] = out.shape == piece(full, 2).shape and torch.equal(out, piece(full, 2))
    # A stride-0 (expanded) input is read in place.
    base = full_tensor((1, 5, 3), torch.float32, 9)
    expanded_full = base.expand(4, 5, 3)
    out = sp.all_to_all_reshard(piece(expanded_full, 1), scatter_dim=0, gather_dim=1)
    results["expanded input"] = torch.equal(out, piece(expanded_full, 0))
    return results


def test_reshard_uneven_and_empty(ranks):
    for results in ranks.run(reshard_uneven_and_empty):
        assert all(results.values()), results


def reshard_backward(dtype):
    """Every (scatter, gather) pair of a 4-D tensor, contiguous and strided inputs and
    upstream gradients, uneven and empty pieces; returns the failures."""
    failures = []
    for shape, layout in itertools.product((SHAPE, SMALL_SHAPE), ("contiguous", "channels_first", "sliced")):
        for seed, (scatter_dim, gather_dim) in enumerate(itertools.permutations(range(4), 2)):
            full = full_tensor(shape, dtype, 2 * seed)
            full_grad = full_tensor(shape, dtype, 2 * seed + 1)
            local = with_layout(piece(full, gather_dim), layout).requires_grad_()
            out = sp.all_to_all_reshard(local, scatter_dim, gather_dim)
            out.backward(with_layout(piece(full_grad, scatter_dim), layout))
            # The gradient of this rank's piece is the piece of the whole gradient.
            if not (
                same_bits(out.detach(), piece(full, scatter_dim))
                and local.grad is not None
                and same_bits(local.grad, piece(full_grad, gather_dim))
            ):
                failures.append((shape, layout, scatter_dim, gather_dim))
    return failures


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshard_backward_is_reverse_reshard(ranks, dtype):
    assert ranks.run(reshard_backward, dtype) == [[]] * ranks.world_size


def batch_one_switch_copies_once():
    """A DSP switch of a batch-1 video tensor (1, T, S, C): one side of the exchange is
    the tensor's own memory, so only the other side runs a kernel."""
    from seqpar_kernels.comm import exchange

    calls = []
    originals = {name: getattr(exchange, name) for name in ("pack_blocks", "unpack_blocks")}
    for name, kernel in originals.items():
        setattr(exchange, name, lambda *args, _kernel=kernel, _name=name: calls.append(_name) or _kernel(*args))
    try:
        results = {}
        full = full_tensor((1, 9, 7, 4), torch.bfloat16, 16)  # T=9: every rank keeps 2+ frames
        full_grad = full_tensor((1, 9, 7, 4), torch.bfloat16, 17)
        for name, scatter_dim, gather_dim, kernels in [
            ("S->T", 1, 2, ["unpack_blocks"]),
            ("T->S", 2, 1, ["pack_blocks"]),
        ]:
            calls.clear()
            local = piece(full, gather_dim).contiguous().requires_grad_()  # a rank's own tensor
            out = sp.all_to_all_reshard(local, scatter_dim, gather_dim)
            results[f"{name} kernels {calls}"] = calls == kernels
            results[f"{name} values"] = out.is_contiguous() and torch.equal(out, piece(full, scatter_dim))
            out.backward(piece(full_grad, scatter_dim))
            results[f"{name} gradient"] = torch.equal(local.grad, piece(full_grad, gather_dim))
    finally:  # the workers are reused: later tests (torch.compile ones too) get the real kernels
        for name, kernel in originals.items():
            setattr(exchange, name, kernel)
    return results


def test_batch_one_switch_copies_once(ranks):
    for results in ranks.run(batch_one_switch_copies_once):
        assert all(results.values()), results


def split_and_gather(dtype, shape, dim, layout):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {}
    full = with_layout(full_tensor(shape, dtype, 13), layout).requires_grad_()
    local = sp.split_sequence(full, dim=dim)
    results["split is the tensor_split piece"] = same_bits(local.detach(), piece(full.detach(), dim))
    results["split is a view"] = local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    if layout != "contiguous" and local.numel() > 0:
        results["gather input is strided"] = not local.is_contiguous()
    other_sign_dim = dim - len(shape) if dim >= 0 else dim + len(shape)
    gathered = sp.gather_sequence(local, dim=other_sign_dim)  # the strided split view itself
    results["gather restores the whole"] = same_bits(gathered.detach(), full.detach())
    # Backward of gather keeps this rank's piece of the (replicated) gradient; backward
    # of split gathers every rank's piece gradient into the whole.
    grad = full_tensor(shape, dtype, 14)
    gathered.backward(with_layout(grad * (rank + 1), layout))
    expected = torch.cat([part * (r + 1) for r, part in enumerate(grad.tensor_split(world_size, dim))], dim=dim)
    results["split backward gathers the piece gradients"] = full.grad is not None and same_bits(full.grad, expected)
    return results


@pytest.mark.parametrize(
    "dtype,shape,dim,layout",
    [
        (torch.float32, (2, 11, 3), 1, "contiguous"),
        (torch.float16, (2, 11, 3), 1, "contiguous"),
        (torch.bfloat16, (2, 11, 3), 1, "channels_first"),
        # Pieces along dims smaller than the world are empty on some ranks.
        (torch.bfloat16, (5, 3, 2), -1, "sliced"),
        (torch.float16, (3, 4, 6), 0, "channels_first"),
        (torch.float32, (4, 2, 5), -2, "sliced"),
    ],
)
def test_split_and_gather_sequence(ranks, dtype, shape, dim, layout):
    for results in ranks.run(split_and_gather, dtype, shape, dim, layout):
        assert all(results.values()), results


class OpRecorder(TorchDispatchMode):
    """Records every op that reaches the dispatcher (aten, seqpar, c10d) with its tensor
    arguments; the ops a custom op runs inside its kernel are not seen."""

    def __init__(self):
        super().__init__()
        self.ops = []  # (name, tensor arguments)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        self.ops.append((str(func), tensors))
        return func(*args, **(kwargs or {}))

    def names(self):
        return [name for name, _ in self.ops]


COPY_OPS = re.compile(r"copy|clone|\bcat\b|contiguous|stack")  # copy_, _to_copy, clone, cat


def strided_input_read_in_place():
    """A strided input goes to the pack kernel as it is: no op copies it first."""
    results = {}
    world_size = dist.get_world_size()
    full = full_tensor((2, 6, 5, 4), torch.bfloat16, 19)
    sizes = [len(part) for part in torch.arange(6).tensor_split(world_size)]

    def reshard(x):
        return sp.all_to_all_reshard(x, scatter_dim=2, gather_dim=1)

    def gather(x):
        return sp.gather_sequence(x, 1, sizes=sizes)

    calls = {  # name: (strided input, call, expected output)
        "reshard channels_first": (with_layout(piece(full, 1), "channels_first"), reshard, piece(full, 2)),
        "reshard sliced": (with_layout(piece(full, 1), "sliced").requires_grad_(), reshard, piece(full, 2)),
        "gather sliced": (with_layout(piece(full, 1), "sliced"), gather, full),
    }
    for name, (local, call, expected) in calls.items():
        with OpRecorder() as recorder:
            out = call(local)
        ops = recorder.names()
        seqpar_ops = [op.split(".")[1] for op in ops if op.startswith("seqpar.")]
        packed = [tensors[0] for op, tensors in recorder.ops if op.startswith("seqpar.pack_blocks")]
        results[f"{name}: input is strided"] = not local.is_contiguous()
        results[f"{name}: ops {ops}"] = seqpar_ops == ["pack_blocks", "all_to_all_single", "unpack_blocks"] and not any(
            COPY_OPS.search(op) for op in ops
        )
        results[f"{name}: the pack reads the input's memory"] = (
            len(packed) == 1
            and packed[0].data_ptr() == local.data_ptr()
            and packed[0].stride()[-local.dim() :] == local.stride()
        )
        results[f"{name}: values"] = same_bits(out.detach(), expected)
    # The recorder sees a copy where there is one.
    with OpRecorder() as recorder:
        calls["reshard sliced"][0].contiguous()
    results[f"contiguous() is seen: {recorder.names()}"] = any(COPY_OPS.search(op) for op in recorder.names())
    return results


def test_strided_input_is_read_in_place(ranks):
    for results in ranks.run(strided_input_read_in_place):
        assert all(results.values()), results


def bytes_sent_of_reshard():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    full = full_tensor((2, 12, 24, 8), torch.bfloat16, 15)  # 12 and 24 divide by 1-4
    local = piece(full, 1)
    with sp.comm_stats() as stats:
        sp.all_to_all_reshard(local, scatter_dim=2, gather_dim=1, gather_sizes=[local.shape[1]] * world_size)
    return stats.bytes_sent, reshard_bytes(local.shape, 2, rank, world_size, local.element_size())


def test_bytes_sent_equals_theory(ranks):
    for measured, theory in ranks.run(bytes_sent_of_reshard):
        assert measured == theory


def opcheck_all_to_all():
    world_size = dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    send = [2 * (rank + 1) for rank in range(world_size)]
    recv = [2 * (dist.get_rank() + 1)] * world_size
    buffer = torch.randn(sum(send), requires_grad=True)
    torch.library.opcheck(torch.ops.seqpar.all_to_all_single.default, (buffer, recv, send, group_name))
    return True


def test_opcheck_all_to_all_single(ranks):
    assert all(ranks.run(opcheck_all_to_all))


def compiled_matches_eager(batch):
    """split -> reshard -> reshard back -> gather of a video (B, T, S, C), eager and
    compiled with fullgraph=True. T=12 divides by 1-4 (its sizes may go unpassed: under
    torch.compile they are assumed equal); S=10 does not on 3 and 4 ranks, so its sizes
    are passed. Batch 1: each switch has one side that is the tensor's own memory."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shape = (batch, 12, 10, 4)
    full = full_tensor(shape, torch.float32, 16)
    upstream_base = full_tensor(shape, torch.float32, 18)
    upstream = upstream_base * (rank + 1)  # differs by rank
    space_sizes = [len(part) for part in torch.arange(shape[2]).tensor_split(world_size)]

    def dsp(video):
        spatial = sp.split_sequence(video, dim=2)  # a strided view
        temporal = sp.all_to_all_reshard(spatial, scatter_dim=1, gather_dim=2, gather_sizes=space_sizes)
        spatial = sp.all_to_all_reshard(temporal.sin(), 2, 1)
        return sp.gather_sequence(spatial * 2, dim=-2, sizes=space_sizes)

    results = {}
    whole = full.clone().requires_grad_()
    eager = dsp(whole)
    eager.backward(upstream)
    eager_grad, whole.grad = whole.grad, None
    # The eager run itself is right: the whole function is 2 sin(x), and the gradient
    # gathers each rank's piece of its own upstream gradient times 2 cos(x).
    results["eager values"] = torch.allclose(eager, 2 * full.sin())
    own_pieces = torch.cat([part * (r + 1) for r, part in enumerate(upstream_base.tensor_split(world_size, 2))], dim=2)
    results["eager gradient"] = torch.allclose(eager_grad, 2 * full.cos() * own_pieces)
    torch._dynamo.reset()
    compiled = torch.compile(dsp, fullgraph=True, backend="aot_eager")(whole)
    compiled.backward(upstream)
    results["compiled values"] = torch.equal(eager, compiled)
    results["compiled gradient"] = torch.equal(eager_grad, whole.grad)
    return results


@pytest.mark.parametrize("batch", [2, 1])
def test_compile_fullgraph_matches_eager(ranks, batch):
    for results in ranks.run(compiled_matches_eager, batch):
        assert all(results.values()), results


def bad_inputs():
    rank = dist.get_rank()
    messages = []
    good = torch.zeros(2, 3, 4)
    for call in (
        lambda: sp.all_to_all_reshard(good, 1, 1),
        lambda: sp.all_to_all_reshard(good, 3, 1),
        lambda: sp.all_to_all_reshard(good, 0, -4),
        lambda: sp.all_to_all_reshard(torch.tensor(1.0), 0, 0),
        lambda: sp.all_to_all_reshard(good, 0, 1, gather_sizes=[99] * dist.get_world_size()),
        lambda: sp.gather_sequence(good, 5),
        lambda: sp.all_to_all_reshard(good, 1.0, 0),
    ):
        try:
            call()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    # Ranks that disagree on the shape: every rank raises (after one metadata exchange).
    if dist.get_world_size() > 1:
        mismatched = torch.zeros(2, 3 + rank, 4)
        try:
            sp.all_to_all_reshard(mismatched, 1, 2)
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    # The ranks are still in step: a good call works.
    full = full_tensor((4, 6), torch.float32, 17)
    still_works = torch.equal(sp.all_to_all_reshard(piece(full, 0), 1, 0), piece(full, 1))
    return messages, still_works


def test_bad_inputs_raise_on_every_rank(ranks):
    for messages, still_works in ranks.run(bad_inputs):
        assert still_works
        assert None not in messages, messages
        assert "(2, 3, 4)" in messages[0] and "same dim" in messages[0]
        assert "out of range" in messages[1] and "out of range" in messages[2]
        assert "scatter_dim must be an int" in messages[6] and "(2, 3, 4)" in messages[6]
