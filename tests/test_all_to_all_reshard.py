"""all_to_all_reshard, split_sequence, gather_sequence on 1-4 gloo ranks: bit-exact
against torch.tensor_split pieces of a full tensor, forward and backward."""

import itertools

import pytest
import torch
import torch.distributed as dist

import seqpar_kernels as sp

SHAPE = (3, 5, 7, 4)  # no dim divisible by 2, 3 or 4 except the last: uneven pieces


def full_tensor(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * 10
    if dtype in (torch.uint8, torch.uint16, torch.uint32):
        values = values.abs()
    return values.to(dtype)


def same_bits(actual, expected):
    """Equal shapes and bytes (torch.equal has no float8 or uint16 kernel on CPU)."""
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    return actual.shape == expected.shape and torch.equal(as_bytes(actual), as_bytes(expected))


def piece(tensor, dim):
    return tensor.tensor_split(dist.get_world_size(), dim=dim)[dist.get_rank()]


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
    [(torch.float32, "contiguous"), (torch.bfloat16, "channels_first"),
     (torch.float16, "negative_dims"), (torch.int64, "contiguous"),
     # gloo has no all_to_all of its own for these: the exchange moves bytes.
     (torch.int16, "channels_first"), (torch.uint16, "negative_dims"),
     (torch.float8_e4m3fn, "contiguous")],
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
    failures = []
    for scatter_dim, gather_dim in [(1, 2), (2, 1), (0, 3)]:
        full = full_tensor(SHAPE, dtype, 11)
        full_grad = full_tensor(SHAPE, dtype, 12)
        local = piece(full, gather_dim).requires_grad_()
        out = sp.all_to_all_reshard(local, scatter_dim, gather_dim)
        out.backward(piece(full_grad, scatter_dim))
        if not torch.equal(local.grad, piece(full_grad, gather_dim)):
            failures.append((scatter_dim, gather_dim))
    return failures


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshard_backward_is_reverse_reshard(ranks, dtype):
    assert ranks.run(reshard_backward, dtype) == [[]] * ranks.world_size


def batch_one_switch_copies_once():
    """A DSP switch of a batch-1 video tensor (1, T, S, C): one side of the exchange is
    the tensor's own memory, so only the other side runs a kernel."""
    from seqpar_kernels.parallel import exchange

    calls = []
    for name in ("pack_blocks", "unpack_blocks"):
        kernel = getattr(exchange, name)
        setattr(exchange, name, lambda *args, _kernel=kernel, _name=name: calls.append(_name) or _kernel(*args))
    results = {}
    full = full_tensor((1, 9, 7, 4), torch.bfloat16, 16)  # T=9: every rank keeps 2+ frames
    full_grad = full_tensor((1, 9, 7, 4), torch.bfloat16, 17)
    for name, scatter_dim, gather_dim, kernels in [("S->T", 1, 2, ["unpack_blocks"]),
                                                   ("T->S", 2, 1, ["pack_blocks"])]:
        calls.clear()
        local = piece(full, gather_dim).contiguous().requires_grad_()  # a rank's own tensor
        out = sp.all_to_all_reshard(local, scatter_dim, gather_dim)
        results[f"{name} kernels {calls}"] = calls == kernels
        results[f"{name} values"] = out.is_contiguous() and torch.equal(out, piece(full, scatter_dim))
        out.backward(piece(full_grad, scatter_dim))
        results[f"{name} gradient"] = torch.equal(local.grad, piece(full_grad, gather_dim))
    return results


def test_batch_one_switch_copies_once(ranks):
    for results in ranks.run(batch_one_switch_copies_once):
        assert all(results.values()), results


def split_and_gather(dtype):
    rank = dist.get_rank()
    results = {}
    full = full_tensor((2, 11, 3), dtype, 13).requires_grad_()
    local = sp.split_sequence(full, dim=1)
    results["split is the tensor_split piece"] = torch.equal(local, piece(full.detach(), 1))
    gathered = sp.gather_sequence(local * 1, dim=-2)
    results["gather restores the whole"] = torch.equal(gathered, full.detach())
    # Backward of gather keeps this rank's piece of the (replicated) gradient; backward
    # of split gathers every rank's piece gradient into the whole.
    grad = full_tensor((2, 11, 3), dtype, 14)
    gathered.backward(grad * (rank + 1))
    expected = torch.cat(
        [part * (r + 1) for r, part in enumerate(grad.tensor_split(dist.get_world_size(), 1))], dim=1
    )
    results["split backward gathers the piece gradients"] = torch.equal(full.grad, expected)
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_and_gather_sequence(ranks, dtype):
    for results in ranks.run(split_and_gather, dtype):
        assert all(results.values()), results


def bytes_sent_of_reshard():
    world_size = dist.get_world_size()
    full = full_tensor((2, 12, 24, 8), torch.bfloat16, 15)  # 12 and 24 divide by 1-4
    local = piece(full, 1)
    with sp.comm_stats() as stats:
        sp.all_to_all_reshard(local, scatter_dim=2, gather_dim=1, gather_sizes=[local.shape[1]] * world_size)
    theory = (world_size - 1) * local.numel() * local.element_size() // world_size
    return stats.bytes_sent, theory


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
    # Batch 1: each switch has one side that is the tensor's own memory (no kernel).
    world_size = dist.get_world_size()
    full = full_tensor((batch, 8, 12, 4), torch.float32, 16)

    def switch_twice(local):  # DSP: spatial -> temporal -> spatial
        temporal = sp.all_to_all_reshard(local, scatter_dim=2, gather_dim=1, gather_sizes=[8 // world_size] * world_size if 8 % world_size == 0 else None)
        return sp.all_to_all_reshard(temporal.sin(), 1, 2, gather_sizes=[len(p) for p in torch.arange(12).tensor_split(world_size)])

    if 8 % world_size:  # the compiled path assumes even gather sizes unless told
        return True
    local = piece(full, 1).requires_grad_()
    eager = switch_twice(local)
    eager.sum().backward()
    eager_grad, local.grad = local.grad, None
    torch._dynamo.reset()
    compiled = torch.compile(switch_twice, fullgraph=True, backend="aot_eager")(local)
    compiled.sum().backward()
    return torch.equal(eager, compiled) and torch.equal(eager_grad, local.grad)


@pytest.mark.parametrize("batch", [2, 1])
def test_compile_fullgraph_matches_eager(ranks, batch):
    assert all(ranks.run(compiled_matches_eager, batch))


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
