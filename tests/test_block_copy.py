"""seqpar::pack_blocks / seqpar::unpack_blocks against plain-PyTorch references.

Data movement must match exactly. On a machine with a GPU the same cases run on the
CUDA kernels and are compared with the CPU kernels too.
"""

import itertools

import pytest
import torch

import seqpar_kernels  # noqa: F401
from seqpar_kernels.ops import pack_blocks, unpack_blocks

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def make(shape, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * 50
    if dtype == torch.bool:
        return (values > 0).to(device)
    if dtype == torch.complex64:
        return torch.complex(values, -values).to(device)
    return values.to(dtype).to(device)


def reference_pack(tensors, split_dims, starts, lengths):
    pieces = []
    for index, (start, length) in enumerate(zip(starts, lengths)):
        tensor_index = index % len(tensors)
        block = tensors[tensor_index].narrow(split_dims[tensor_index], start, length)
        pieces.append(block.contiguous().flatten())
    return torch.cat(pieces)


def reference_unpack(buffer, out_shapes, split_dims, starts, lengths):
    """Sums where ranges overlap in rank order, in fp32 for fp16/bf16 (op-math), as the op does."""
    wide = {torch.float16: torch.float32, torch.bfloat16: torch.float32}.get(buffer.dtype, buffer.dtype)
    outputs = [torch.zeros(shape, dtype=wide, device=buffer.device) for shape in out_shapes]
    offset = 0
    for index, (start, length) in enumerate(zip(starts, lengths)):
        t = index % len(out_shapes)
        block_shape = list(out_shapes[t])
        block_shape[split_dims[t]] = length
        numel = int(torch.Size(block_shape).numel())
        block = buffer[offset : offset + numel].view(block_shape).to(wide)
        outputs[t].narrow(split_dims[t], start, length).add_(block)
        offset += numel
    return [out.to(buffer.dtype) for out in outputs]


def views(tensor, kind):
    """The same logical values under different memory layouts."""
    if kind == "contiguous":
        return tensor
    if kind == "transposed":  # memory (.., D, H) read as (.., H, D)
        return tensor.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "sliced":  # every other element of a larger tensor
        wide = torch.zeros(*tensor.shape[:-1], tensor.shape[-1] * 2, dtype=tensor.dtype, device=tensor.device)
        wide[..., ::2] = tensor
        return wide[..., ::2]
    raise AssertionError(kind)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_matches_narrow_and_cat(device, dtype):
    shape = (2, 7, 5, 6)
    for split_dim, layout, world_size in itertools.product(range(4), ["contiguous", "transposed", "sliced"], [1, 3, 4]):
        tensor = views(make(shape, dtype, device), layout)
        sizes = [len(piece) for piece in torch.arange(shape[split_dim]).tensor_split(world_size)]
        starts = [sum(sizes[:rank]) for rank in range(world_size)]
        packed = pack_blocks([tensor], [split_dim], starts, sizes)
        expected = reference_pack([tensor], [split_dim], starts, sizes)
        assert torch.equal(packed, expected), (split_dim, layout, world_size)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_qkv_overlapping_kv_ranges_and_empty_blocks(device):
    # Ulysses with GQA: 6 q heads over 4 ranks [2,2,1,1], kv heads (2) overlap between ranks.
    q = make((2, 3, 6, 80), torch.bfloat16, device, 1)
    k = make((2, 3, 2, 80), torch.bfloat16, device, 2)
    v = views(make((2, 3, 2, 80), torch.bfloat16, device, 3), "transposed")
    q_starts, q_lengths = [0, 2, 4, 5], [2, 2, 1, 1]
    kv_starts, kv_lengths = [0, 0, 1, 1], [1, 2, 1, 1]
    starts = [s for rank in zip(q_starts, kv_starts, kv_starts) for s in rank]
    lengths = [n for rank in zip(q_lengths, kv_lengths, kv_lengths) for n in rank]
    packed = pack_blocks([q, k, v], [2, 2, 2], starts, lengths)
    assert torch.equal(packed, reference_pack([q, k, v], [2, 2, 2], starts, lengths))
    # Empty blocks (a rank with no heads) take no room.
    packed = pack_blocks([q], [2], [0, 6, 0], [6, 0, 0])
    assert torch.equal(packed, q.flatten())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_is_inverse_of_pack(device, dtype):
    shape = (3, 5, 4, 8)
    for split_dim, order in itertools.product(range(4), [(0, 1, 2, 3), (0, 2, 1, 3), (3, 2, 1, 0)]):
        tensor = make(shape, dtype, device)
        sizes = [len(piece) for piece in torch.arange(shape[split_dim]).tensor_split(3)]
        starts = [sum(sizes[:rank]) for rank in range(3)]
        buffer = pack_blocks([tensor], [split_dim], starts, sizes)
        (out,) = unpack_blocks(buffer, [shape], [split_dim], starts, sizes, [order])
        assert torch.equal(out, tensor), (split_dim, order)
        # The memory order is the one asked for.
        expected_strides = torch.empty([shape[d] for d in order]).permute([order.index(d) for d in range(4)]).stride()
        assert out.stride() == expected_strides


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpack_sums_overlapping_ranges_and_zeroes_gaps(device, dtype):
    # Backward of the GQA exchange: a kv head that went to several ranks gets the sum.
    shape = (2, 3, 4, 16)
    starts, lengths = [0, 1, 1, 3], [2, 2, 1, 1]  # heads 1 covered 3x, 0 and 3 once, 2 once
    buffer = make((2 * 3 * 16 * sum(lengths),), dtype, device)
    (out,) = unpack_blocks(buffer, [shape], [2], starts, lengths)
    (expected,) = reference_unpack(buffer, [shape], [2], starts, lengths)
    assert torch.equal(out, expected)
    # A gap (head 2 uncovered) reads zero.
    buffer = make((2 * 3 * 16 * 3,), dtype, device)
    (out,) = unpack_blocks(buffer, [shape], [2], [0, 3], [2, 1])
    (expected,) = reference_unpack(buffer, [shape], [2], [0, 3], [2, 1])
    assert torch.equal(out, expected)
    assert torch.count_nonzero(out[:, :, 2]) == 0


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"threads{n}")
def cpu_threads(request):
    """The CPU kernels split rows across torch's intra-op threads: task boundaries fall
    inside blocks and inside the outer dims, and 3 threads cut them unevenly."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("destinations", [3, 4, 70])
@pytest.mark.parametrize("k_layout", ["contiguous", "transposed"])
def test_ulysses_sized_pack_and_unpack_on_threads(cpu_threads, destinations, k_layout):
    # Big enough for several tasks per thread. With contiguous q and k, 3 and 4
    # destinations copy the rows of all blocks token by token (the heads split inside
    # rows); 70 destinations x (q, k) copy in visits of 51 rows (80-byte rows, the
    # last visit of a task partial); a transposed k has rows of one element: those
    # copy block by block.
    heads = 70 if destinations == 70 else 12
    q = make((2, 1001, heads, 40), torch.bfloat16, "cpu", 7)
    k = views(make((2, 1001, heads, 40), torch.bfloat16, "cpu", 8), k_layout)
    sizes = [len(piece) for piece in torch.arange(heads).tensor_split(destinations)]
    head_starts = [sum(sizes[:rank]) for rank in range(destinations)]
    starts = [s for s in head_starts for _ in range(2)]
    lengths = [n for n in sizes for _ in range(2)]
    packed = pack_blocks([q, k], [2, 2], starts, lengths)
    assert torch.equal(packed, reference_pack([q, k], [2, 2], starts, lengths))
    shapes = [tuple(q.shape), tuple(k.shape)]
    unpacked = unpack_blocks(packed, shapes, [2, 2], starts, lengths, [(0, 1, 2, 3), (0, 2, 1, 3)])
    assert torch.equal(unpacked[0], q) and torch.equal(unpacked[1], k)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_large_copies_with_whole_and_partial_cache_lines(cpu_threads, dtype):
    # Over 1 MiB in all: the CPU kernels write rows of whole, line-aligned cache lines
    # with streaming stores and other rows with plain ones. q's rows are whole lines
    # (D = 64), k's start anywhere in a line (D = 67: also the q blocks after them), v's
    # are strided; tasks split blocks.
    q = make((2, 1500, 8, 64), dtype, "cpu", 11)
    k = make((2, 1500, 6, 67), dtype, "cpu", 12)
    v = views(make((2, 1500, 3, 9), dtype, "cpu", 13), "transposed")
    starts = [0, 0, 0, 2, 1, 1, 4, 3, 2, 5, 5, 2]  # rank-major: (q, k, v) per rank
    lengths = [2, 1, 1, 2, 2, 1, 1, 2, 1, 3, 1, 1]
    packed = pack_blocks([q, k, v], [2, 2, 2], starts, lengths)
    assert packed.numel() * packed.element_size() >= 1 << 20
    assert torch.equal(packed, reference_pack([q, k, v], [2, 2, 2], starts, lengths))
    # Split along the sequence, each output in (B, H, S, D) memory, as Ulysses unpacks.
    seq_starts = [s for s in [0, 333, 1000, 1001] for _ in range(3)]
    seq_lengths = [n for n in [333, 667, 1, 499] for _ in range(3)]
    buffer = reference_pack([q, k, v], [1, 1, 1], seq_starts, seq_lengths)
    shapes = [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    unpacked = unpack_blocks(buffer, shapes, [1, 1, 1], seq_starts, seq_lengths, [(0, 2, 1, 3)] * 3)
    assert all(torch.equal(out, tensor) for out, tensor in zip(unpacked, [q, k, v]))


def test_unpack_rejects_wrong_buffer_size():
    with pytest.raises(RuntimeError, match="blocks hold"):
        unpack_blocks(torch.zeros(10), [(2, 3)], [0], [0, 1], [1, 1])
    with pytest.raises(RuntimeError, match="outside its dim"):
        pack_blocks([torch.zeros(2, 3)], [0], [0, 1], [1, 2])


def test_gradients_are_adjoint():
    # pack's backward is unpack (summing overlaps) and vice versa: gradcheck in fp64.
    q = torch.randn(2, 3, 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    starts, lengths = [0, 0, 2, 0, 4, 1], [2, 1, 2, 2, 2, 1]
    assert torch.autograd.gradcheck(lambda a, b: pack_blocks([a, b], [2, 2], starts, lengths), (q, k))
    buffer = pack_blocks([q, k], [2, 2], starts, lengths).detach().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda flat: unpack_blocks(
            flat, [(2, 3, 6, 4), (2, 3, 2, 4)], [2, 2], starts, lengths, [(0, 2, 1, 3), (0, 1, 2, 3)]
        ),
        (buffer,),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    q = make((2, 5, 6, 8), torch.float32, device).requires_grad_()
    k = make((2, 5, 2, 8), torch.float32, device).requires_grad_()
    starts, lengths = [0, 0, 3, 1], [3, 1, 3, 1]
    torch.library.opcheck(torch.ops.seqpar.pack_blocks.default, ([q, k], [2, 2], starts, lengths))
    buffer = torch.ops.seqpar.pack_blocks([q, k], [2, 2], starts, lengths).detach().requires_grad_()
    torch.library.opcheck(
        torch.ops.seqpar.unpack_blocks.default,
        (buffer, [2, 5, 6, 8, 2, 5, 2, 8], [0, 2, 1, 3, 0, 1, 2, 3], [2, 2], starts, lengths),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_cuda_kernels_match_cpu_kernels(dtype):
    # Large enough to use many CTAs and the 16-byte path, plus an unaligned head dim.
    for head_dim in (128, 80, 7):
        q = make((2, 256, 12, head_dim), dtype, "cpu", 4)
        k = views(make((2, 256, 4, head_dim), dtype, "cpu", 5), "transposed")
        starts = [0, 0, 5, 1, 9, 3]
        lengths = [5, 2, 4, 2, 3, 1]
        cpu = pack_blocks([q, k], [2, 2], starts, lengths)
        gpu = pack_blocks([q.cuda(), k.cuda()], [2, 2], starts, lengths)
        assert torch.equal(gpu.cpu(), cpu)
        shapes = [(2, 256, 12, head_dim), (2, 256, 4, head_dim)]
        orders = [(0, 2, 1, 3), (0, 1, 2, 3)]
        seq_starts, seq_lengths = [0, 0, 100, 100, 200, 200], [100, 100, 100, 100, 56, 56]
        buffer = make((sum(cpu.numel() for cpu in [q, k]),), dtype, "cpu", 6)
        expected = unpack_blocks(buffer, shapes, [1, 1], seq_starts, seq_lengths, orders)
        actual = unpack_blocks(buffer.cuda(), shapes, [1, 1], seq_starts, seq_lengths, orders)
        for want, got in zip(expected, actual):
            assert got.stride() == want.stride() and torch.equal(got.cpu(), want)
    # The first output's ranges overlap along its innermost dim, so it is summed outside
    # the kernel; its blocks (6 elements) still take room in the buffer, and the second
    # output's blocks then start at element 6 and 20: not whole 16-byte units.
    buffer = make((2 * (2 * 3 + 8),), dtype, "cpu", 7)
    arguments = ([(2, 8), (2, 8)], [1, 0], [0, 0, 2, 1], [3, 1, 3, 1], [(0, 1), (0, 1)])
    expected = unpack_blocks(buffer, *arguments)
    actual = unpack_blocks(buffer.cuda(), *arguments)
    assert torch.equal(expected[1], buffer.view(2, 14)[:, 6:])
    for want, got in zip(expected, actual):
        assert torch.equal(got.cpu(), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("destinations", [21, 22])
def test_cuda_block_list_inline_and_in_device_memory(destinations):
    # q, k and v over 21 destinations is 63 blocks, passed as a kernel argument; over
    # 22 it is 66 blocks, which go through pinned and device memory.
    qkv = [make((2, 33, 44, 64), torch.bfloat16, "cpu", seed) for seed in (1, 2, 3)]
    sizes = [len(piece) for piece in torch.arange(44).tensor_split(destinations)]
    starts = [sum(sizes[:rank]) for rank in range(destinations) for _ in range(3)]
    lengths = [size for size in sizes for _ in range(3)]
    packed = pack_blocks([t.cuda() for t in qkv], [2, 2, 2], starts, lengths)
    assert torch.equal(packed.cpu(), reference_pack(qkv, [2, 2, 2], starts, lengths))
    shapes = [tuple(t.shape) for t in qkv]
    unpacked = unpack_blocks(packed, shapes, [2] * 3, starts, lengths, [(0, 2, 1, 3)] * 3)
    for got, want in zip(unpacked, qkv):
        assert torch.equal(got.cpu(), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_pack_replays_in_a_cuda_graph():
    # The block list is part of the captured launch: replays after other packs (which
    # reuse host and device buffers) still copy the captured ranges.
    source = make((2, 64, 8, 128), torch.bfloat16, "cuda", 1)
    starts, lengths = [0, 3, 5], [3, 2, 3]
    warmup = torch.cuda.Stream()
    with torch.cuda.stream(warmup):
        pack_blocks([source], [2], starts, lengths)
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        packed = pack_blocks([source], [2], starts, lengths)
    for seed in (2, 3):
        pack_blocks([make((4, 8, 16), torch.bfloat16, "cuda", seed)], [1], [4, 0], [4, 4])
        source.copy_(make(tuple(source.shape), torch.bfloat16, "cuda", seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(packed.cpu(), reference_pack([source.cpu()], [2], starts, lengths))


# ---- The CUDA kernel's loop, run on the host ----
#
# seqpar_testing::pack_blocks_cuda_loop / unpack_blocks_cuda_loop run copy_block_rows
# (csrc/include/seqpar/block_copy.h), the loop that every thread of the CUDA kernel
# runs, for every thread of the grid the CUDA launch would use, on CPU tensors, with the
# launch's unit width and index type. They raise on an access outside a block, on a unit
# written twice and on a unit not written; these tests compare the values with the CPU
# kernel. So the CUDA kernel's row arithmetic is checked on a machine without a GPU.


def cuda_loop_pack(tensors, split_dims, starts, lengths, **options):
    return torch.ops.seqpar_testing.pack_blocks_cuda_loop(
        list(tensors), list(split_dims), list(starts), list(lengths), **options
    )


def cuda_loop_unpack(buffer, out_shapes, split_dims, starts, lengths, out_dim_orders=None, **options):
    ndim = len(out_shapes[0])
    orders = out_dim_orders or [list(range(ndim))] * len(out_shapes)
    return torch.ops.seqpar_testing.unpack_blocks_cuda_loop(
        buffer,
        [size for shape in out_shapes for size in shape],
        [dim for order in orders for dim in order],
        list(split_dims),
        list(starts),
        list(lengths),
        **options,
    )


def padded(tensor, width):
    """The same values in the first columns of a wider tensor: rows of exactly
    tensor.shape[-1] contiguous elements that do not merge with the next dim."""
    wide = torch.zeros(*tensor.shape[:-1], width, dtype=tensor.dtype, device=tensor.device)
    wide[..., : tensor.shape[-1]] = tensor
    return wide[..., : tensor.shape[-1]]


def even_ranges(extent, world_size):
    sizes = [len(piece) for piece in torch.arange(extent).tensor_split(world_size)]
    return [sum(sizes[:rank]) for rank in range(world_size)], sizes


# (shape, dtype, layout, split dim, world size): what the CUDA launch makes of it.
CUDA_LOOP_CASES = {
    # 16-byte units; rows shorter than the 4 units a thread loads at once (each thread
    # then takes 4 rows): 1336 rows a block, so that one CTA's 256 threads go round twice.
    "rows_of_1_unit": ((4, 1000, 8), torch.bfloat16, ("padded", 16), 1, 3),
    "rows_of_3_units": ((4, 1000, 24), torch.bfloat16, ("padded", 32), 1, 3),
    # One thread per row, a whole pass then a partial one.
    "rows_of_5_units": ((3, 9, 40), torch.bfloat16, ("padded", 48), 0, 2),
    # Ulysses' heads of one rank (3, 3, 2 heads of 128 bf16): rows of 48 and 32 units,
    # 4 and 2 threads per row.
    "heads_of_a_rank": ((2, 64, 8, 128), torch.bfloat16, "contiguous", 2, 3),
    # Blocks that are one row of 8200 and of 4100 units: 32 threads per row, segments
    # of 512 units, the last one partial; then rows of 600 units, 2 segments.
    "one_long_row": ((3, 4100, 4), torch.float32, "contiguous", 0, 2),
    "rows_of_600_units": ((5, 4, 2400), torch.float32, "contiguous", 1, 4),
    # 8-byte units (rows of 6 and 3 units), 4-byte, 2-byte (an odd head dim), 1-byte.
    "8_byte_units": ((4, 6, 6), torch.float32, "contiguous", 1, 4),
    "4_byte_units": ((5, 3, 12), torch.uint8, "contiguous", 1, 2),
    "2_byte_units": ((3, 5, 7), torch.bfloat16, "contiguous", 1, 3),
    "1_byte_units": ((3, 5, 7), torch.uint8, "contiguous", 2, 3),
    # The split dim innermost: 16-element ranges are rows of 2 units; 22 and 21 are
    # rows of elements.
    "split_innermost_units": ((6, 64), torch.bfloat16, "contiguous", 1, 4),
    "split_innermost_elements": ((6, 64), torch.bfloat16, "contiguous", 1, 3),
    # Strided rows: element units with an innermost stride of 2 (rows of 24, 2 threads
    # each) or 5 (a transposed layout: rows of 6, or of 2 when the ranges split them).
    "strided_rows": ((4, 5, 24), torch.bfloat16, "sliced", 1, 3),
    "transposed": ((2, 7, 5, 6), torch.bfloat16, "transposed", 2, 3),
    "transposed_split_innermost": ((2, 7, 5, 6), torch.bfloat16, "transposed", 3, 3),
    # 16-byte elements with a strided innermost dim: rows of 5, and of 3 and 2.
    "complex128_transposed": ((3, 4, 5), torch.complex128, "transposed", 1, 2),
    "complex128_transposed_split_innermost": ((3, 4, 5), torch.complex128, "transposed", 2, 2),
}

CUDA_LOOP_OPTIONS = {
    "launch": {},
    "int64": {"index_bits": 64},
    "one_cta": {"ctas": 1},  # every thread loops over many rows and segments
    "int64_two_ctas": {"index_bits": 64, "ctas": 2},
}


def cuda_loop_case_tensor(name, seed=0, device="cpu"):
    shape, dtype, layout, _, _ = CUDA_LOOP_CASES[name]
    tensor = make(shape, dtype, device, seed)
    if isinstance(layout, tuple):
        return padded(tensor, layout[1])
    return views(tensor, layout)


@pytest.mark.parametrize("options", CUDA_LOOP_OPTIONS.values(), ids=CUDA_LOOP_OPTIONS.keys())
@pytest.mark.parametrize("case", CUDA_LOOP_CASES.keys())
def test_cuda_loop_on_host_packs_and_unpacks_like_cpu_kernel(case, options):
    shape, _, _, split_dim, world_size = CUDA_LOOP_CASES[case]
    tensor = cuda_loop_case_tensor(case)
    starts, lengths = even_ranges(shape[split_dim], world_size)
    packed = cuda_loop_pack([tensor], [split_dim], starts, lengths, **options)
    assert torch.equal(packed, pack_blocks([tensor], [split_dim], starts, lengths))
    assert torch.equal(packed, reference_pack([tensor], [split_dim], starts, lengths))
    for order in (list(range(len(shape))), list(reversed(range(len(shape))))):
        (out,) = cuda_loop_unpack(packed, [shape], [split_dim], starts, lengths, [order], **options)
        (expected,) = unpack_blocks(packed, [shape], [split_dim], starts, lengths, [order])
        assert out.stride() == expected.stride() and torch.equal(out, expected), order
        assert torch.equal(out, tensor)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", CUDA_LOOP_CASES.keys())
def test_cuda_kernels_match_cpu_kernels_in_every_layout_family(case):
    # Each layout family of the CUDA launch above (unit widths of 16 to 1 bytes, rows
    # shorter and longer than a thread's loads, strided and transposed rows, the split
    # dim innermost), laid out alike on the GPU: the CUDA kernels against the CPU
    # kernels, bit for bit, both ways, and the unpacked strides.
    shape, _, _, split_dim, world_size = CUDA_LOOP_CASES[case]
    tensor, on_gpu = cuda_loop_case_tensor(case), cuda_loop_case_tensor(case, device="cuda")
    assert on_gpu.stride() == tensor.stride()
    starts, lengths = even_ranges(shape[split_dim], world_size)
    packed = pack_blocks([tensor], [split_dim], starts, lengths)
    packed_on_gpu = pack_blocks([on_gpu], [split_dim], starts, lengths)
    assert packed_on_gpu.is_cuda and torch.equal(packed_on_gpu.cpu(), packed)
    for order in (list(range(len(shape))), list(reversed(range(len(shape))))):
        (out,) = unpack_blocks(packed, [shape], [split_dim], starts, lengths, [order])
        (out_on_gpu,) = unpack_blocks(packed_on_gpu, [shape], [split_dim], starts, lengths, [order])
        assert out_on_gpu.stride() == out.stride() and torch.equal(out_on_gpu.cpu(), out), order


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_loop_on_host_over_layouts_split_dims_and_world_sizes(dtype):
    shape = (2, 7, 5, 8)
    for split_dim, layout, world_size, options in itertools.product(
        range(4), ["contiguous", "transposed", "sliced"], [1, 3, 4], [{}, {"ctas": 1, "index_bits": 64}]
    ):
        tensor = views(make(shape, dtype, "cpu"), layout)
        starts, lengths = even_ranges(shape[split_dim], world_size)
        packed = cuda_loop_pack([tensor], [split_dim], starts, lengths, **options)
        assert torch.equal(packed, reference_pack([tensor], [split_dim], starts, lengths)), (split_dim, layout)
        for order in [(0, 1, 2, 3), (0, 2, 1, 3), (3, 2, 1, 0)]:
            (out,) = cuda_loop_unpack(packed, [shape], [split_dim], starts, lengths, [order], **options)
            assert torch.equal(out, tensor), (split_dim, layout, world_size, order)


@pytest.mark.parametrize("destinations", [3, 21, 22, 70])
def test_cuda_loop_on_host_ulysses_qkv_many_blocks(destinations):
    # q, k and v over up to 70 destinations: up to 210 blocks (the CUDA launch passes
    # more than 64 through device memory), 1 to 24 heads per destination, and a
    # transposed v (element units: a head's 64 values are a row of stride 70).
    heads = 70
    q = make((2, 37, heads, 64), torch.bfloat16, "cpu", 1)
    k = make((2, 37, heads, 64), torch.bfloat16, "cpu", 2)
    v = views(make((2, 37, heads, 64), torch.bfloat16, "cpu", 3), "transposed")
    head_starts, sizes = even_ranges(heads, destinations)
    starts = [s for s in head_starts for _ in range(3)]
    lengths = [n for n in sizes for _ in range(3)]
    packed = cuda_loop_pack([q, k, v], [2, 2, 2], starts, lengths)
    assert torch.equal(packed, reference_pack([q, k, v], [2, 2, 2], starts, lengths))
    # Unpack into (B, S, H, D) outputs laid out as (B, H, S, D), then split along S.
    shapes = [tuple(q.shape)] * 3
    orders = [(0, 2, 1, 3)] * 3
    unpacked = cuda_loop_unpack(packed, shapes, [2] * 3, starts, lengths, orders)
    for got, want in zip(unpacked, (q, k, v)):
        assert torch.equal(got, want)
    seq_starts, seq_lengths = even_ranges(37, destinations)
    starts = [s for s in seq_starts for _ in range(3)]
    lengths = [n for n in seq_lengths for _ in range(3)]
    packed = pack_blocks([q, k, v], [1, 1, 1], starts, lengths)
    unpacked = cuda_loop_unpack(packed, shapes, [1] * 3, starts, lengths, orders, ctas=1)
    for got, want in zip(unpacked, (q, k, v)):
        assert torch.equal(got, want)


def test_cuda_loop_on_host_empty_blocks_overlaps_and_unaligned_flat_offsets():
    q = make((2, 3, 6, 80), torch.bfloat16, "cpu", 1)
    # Ranks with no heads take no room; one rank has all of them.
    packed = cuda_loop_pack([q], [2], [0, 6, 0, 2], [6, 0, 0, 0])
    assert torch.equal(packed, q.flatten())
    # The first output's ranges overlap, so it is summed outside the kernel; its blocks
    # (6 elements) still take room in the buffer, and the second output's blocks start
    # at elements 6 and 20: not whole 16-byte units.
    for dtype in (torch.bfloat16, torch.float32, torch.uint8):
        buffer = make((2 * (2 * 3 + 8),), dtype, "cpu", 7)
        arguments = ([(2, 8), (2, 8)], [1, 0], [0, 0, 2, 1], [3, 1, 3, 1])
        expected = unpack_blocks(buffer, *arguments, [(0, 1), (0, 1)])
        actual = cuda_loop_unpack(buffer, *arguments, [(0, 1), (0, 1)])
        assert torch.equal(expected[1], buffer.view(2, 14)[:, 6:])
        for want, got in zip(expected, actual):
            assert torch.equal(got, want)
    # A gap (head 2 of 4 uncovered) is zero-filled before the kernel writes the rest.
    buffer = make((2 * 3 * 16 * 3,), torch.float32, "cpu", 8)
    (out,) = cuda_loop_unpack(buffer, [(2, 3, 4, 16)], [2], [0, 3], [2, 1])
    (expected,) = unpack_blocks(buffer, [(2, 3, 4, 16)], [2], [0, 3], [2, 1])
    assert torch.equal(out, expected) and torch.count_nonzero(out[:, :, 2]) == 0


def test_cuda_loop_on_host_rejects_bad_options():
    tensor = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="index_bits"):
        cuda_loop_pack([tensor], [0], [0, 2], [2, 2], index_bits=32)
    with pytest.raises(RuntimeError, match="ctas"):
        cuda_loop_pack([tensor], [0], [0, 2], [2, 2], ctas=70000)
