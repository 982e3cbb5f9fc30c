// CPU kernels of seqpar::pack_blocks and seqpar::unpack_blocks.
//
// Work is split into rows (BlockRows in seqpar/block_copy.h, which the CUDA kernel
// shares): a row is the longest run of a block that is contiguous in the strided
// tensor, one memcpy; rows with a non-unit innermost stride copy element by element.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <climits>
#include <vector>

#include "seqpar/block_copy.h"
#include "seqpar/block_copy_plan.h"

namespace seqpar {
namespace {

// Below this many bytes a thread's share is not worth the fork (at::parallel_for grain).
constexpr int64_t kBytesPerTask = 64 * 1024;

template <typename Unit>
void copy_strided_row(char* strided, int64_t stride, char* flat, int64_t count, bool to_flat) {
  auto* strided_units = reinterpret_cast<Unit*>(strided);
  auto* flat_units = reinterpret_cast<Unit*>(flat);
  if (to_flat) {
    for (int64_t i = 0; i < count; ++i) flat_units[i] = strided_units[i * stride];
  } else {
    for (int64_t i = 0; i < count; ++i) strided_units[i * stride] = flat_units[i];
  }
}

// Rows up to this size are copied by an inlined loop of 16-byte moves rather than a
// memcpy call: Ulysses with many ranks cuts rows of one head (128 bytes for D=64 in
// bf16), where the call costs as much as the copy. Measured on a 2-core Xeon, pack of
// 32 destinations x (q, k, v) with 128-byte rows, one thread: 2.6 ms -> 2.0 ms.
constexpr size_t kInlineCopyBytes = 512;

struct alignas(16) Bytes16 {
  char bytes[16];
};

void copy_row(char* strided, int64_t stride, char* flat, int64_t count, int64_t element_size,
              bool to_flat) {
  if (stride == 1) {
    const size_t bytes = static_cast<size_t>(count * element_size);
    char* destination = to_flat ? flat : strided;
    const char* source = to_flat ? strided : flat;
    if (bytes <= kInlineCopyBytes && bytes % 16 == 0) {
      for (size_t i = 0; i < bytes; i += 16) std::memcpy(destination + i, source + i, 16);
    } else {
      std::memcpy(destination, source, bytes);
    }
    return;
  }
  switch (element_size) {
    case 1: return copy_strided_row<uint8_t>(strided, stride, flat, count, to_flat);
    case 2: return copy_strided_row<uint16_t>(strided, stride, flat, count, to_flat);
    case 4: return copy_strided_row<uint32_t>(strided, stride, flat, count, to_flat);
    case 8: return copy_strided_row<uint64_t>(strided, stride, flat, count, to_flat);
    case 16: return copy_strided_row<Bytes16>(strided, stride, flat, count, to_flat);
    default:
      for (int64_t i = 0; i < count; ++i) {
        char* element = strided + i * stride * element_size;
        char* packed = flat + i * element_size;
        if (to_flat) std::memcpy(packed, element, element_size);
        else std::memcpy(element, packed, element_size);
      }
  }
}

// A block is copied as rows (BlockRows, shared with the CUDA kernel): each row one
// memcpy, the outer dims walked with an odometer. Measured on a 2-core Xeon, Ulysses'
// q pack (B*S, H, D): one memcpy per (token, head) row plus index division per row
// made the kernel 1.45x slower than permute().contiguous(); rows of (heads of one
// rank) x D elements and no division per row remove that.

// Walks a block's outer dims in C order and keeps the strided offset of the current
// row (relative to the block's start): row_offset's divisions to start, none per step.
struct RowOdometer {
  int outer_ndim;
  int64_t index[kMaxDims];
  int64_t extents[kMaxDims];
  int64_t strides[kMaxDims];
  int64_t offset;

  void start(const StridedLayout& layout, const BlockDescriptor& block, const BlockRows& shape,
             int64_t row) {
    outer_ndim = shape.outer_ndim;
    for (int d = 0; d < outer_ndim; ++d) {
      extents[d] = block_extent(layout, block, d);
      strides[d] = layout.strides[d];
    }
    offset = row_offset<int64_t>(layout, block, outer_ndim, row, index);
  }

  void step() {
    for (int d = outer_ndim - 1; d >= 0; --d) {
      offset += strides[d];
      if (++index[d] < extents[d]) return;
      offset -= index[d] * strides[d];
      index[d] = 0;
    }
  }
};

// Row-interleaved traversal: when every block's split dim lies inside its rows (the
// blocks of a tensor then share their outer dims, e.g. Ulysses' per-destination head
// groups of one token), walk the outer index once and copy that row of every block.
// The strided side is then read (or written) in its own memory order, and the flat
// side as one sequential stream per block. Within a row the blocks go tensor by
// tensor, so each strided tensor's row is read front to back.
//
// With many blocks the flat side's streams outnumber what the prefetchers track, so
// above kMaxRowStreams blocks a visit covers several rows: each block then moves
// kVisitBytes or more of its flat stream at a time (one page), while the visit's
// strided rows stay in L2 for the next block. Measured on a 2-core Xeon, one thread,
// bf16 pack of Ulysses' q, k, v; median ms of 5 runs of the permute().contiguous()
// baseline, of the simpler alternative ("simple": row by row up to 64 blocks, block by
// block above) and of this traversal ("visits"):
//   blocks  case                        baseline  simple  visits
//   12      P=4  H=16   D=128 S=2048    6.0       4.9     4.9
//   24      P=8  H=32/8 D=128 S=2048    5.5       5.9     5.8
//   48      P=16 H=32/8 D=64  S=2048    6.7       4.7     3.5
//   96      P=32 H=32   D=128 S=1024    7.1       10.7    5.6
//   96      P=32 H=32   D=64  S=2048    7.5       13.2    5.8  (row by row: 19)
//   192     P=64 H=64/8 D=64  S=1024    10.8      8.8     6.5
// Visits of 4 rows at 12 blocks cost 6.6 ms: row by row stays below the threshold.
constexpr size_t kMaxRowStreams = 64;
constexpr int64_t kVisitBytes = 4096;
constexpr int64_t kMaxRowsPerVisit = 64;

bool rows_interleave(const BlockCopyPlan& plan, const std::vector<BlockRows>& shapes) {
  int outer_ndim[kMaxTensors];
  std::fill(outer_ndim, outer_ndim + kMaxTensors, -1);
  for (size_t b = 0; b < shapes.size(); ++b) {
    const int64_t t = plan.blocks[b].tensor_index;
    if (plan.layouts[t].split_dim < shapes[b].outer_ndim || shapes[b].rows != shapes[0].rows) {
      return false;
    }
    // The blocks of one tensor then share its outer dims (all before the split dim).
    if (outer_ndim[t] < 0) outer_ndim[t] = shapes[b].outer_ndim;
    if (outer_ndim[t] != shapes[b].outer_ndim) return false;
  }
  return true;
}

void block_copy_interleaved(const BlockCopyPlan& plan, const std::vector<BlockRows>& shapes,
                            char* flat, bool to_flat) {
  const int64_t num_blocks = static_cast<int64_t>(plan.blocks.size());
  const int64_t element_size = plan.element_size;
  const int64_t rows = shapes[0].rows;
  int64_t row_bytes_all = 0;
  int64_t shortest_row_bytes = INT64_MAX;
  for (const BlockRows& shape : shapes) {
    row_bytes_all += shape.row_length * element_size;
    shortest_row_bytes = std::min(shortest_row_bytes, shape.row_length * element_size);
  }
  const int64_t rows_per_visit =
      shapes.size() <= kMaxRowStreams
          ? 1
          : std::clamp<int64_t>(kVisitBytes / std::max<int64_t>(1, shortest_row_bytes), 1,
                                kMaxRowsPerVisit);
  const int64_t grain =
      std::max<int64_t>(rows_per_visit, kBytesPerTask / std::max<int64_t>(1, row_bytes_all));
  // Blocks in tensor order (stable: each tensor's blocks keep their order along the
  // split dim, which is their order in the strided row).
  std::vector<int64_t> visit_order(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) visit_order[b] = b;
  std::stable_sort(visit_order.begin(), visit_order.end(), [&](int64_t a, int64_t b) {
    return plan.blocks[a].tensor_index < plan.blocks[b].tensor_index;
  });
  // The first block of each tensor carries its outer dims.
  std::vector<int64_t> first_block(plan.num_tensors, -1);
  for (int64_t b = 0; b < num_blocks; ++b) {
    auto& first = first_block[plan.blocks[b].tensor_index];
    if (first < 0) first = b;
  }
  at::parallel_for(0, rows, grain, [&](int64_t row_begin, int64_t row_end) {
    RowOdometer odometers[kMaxTensors];
    // visit_offsets[t][i]: offset of the visit's i-th row in tensor t (the odometer's
    // reading, taken once per row and tensor rather than once per row and block).
    int64_t visit_offsets[kMaxTensors][kMaxRowsPerVisit];
    for (int64_t t = 0; t < plan.num_tensors; ++t) {
      const int64_t b = first_block[t];
      if (b >= 0) odometers[t].start(plan.layouts[t], plan.blocks[b], shapes[b], row_begin);
    }
    for (int64_t visit_begin = row_begin; visit_begin < row_end; visit_begin += rows_per_visit) {
      const int64_t visit_rows = std::min(rows_per_visit, row_end - visit_begin);
      for (int64_t t = 0; t < plan.num_tensors; ++t) {
        if (first_block[t] < 0) continue;
        for (int64_t i = 0; i < visit_rows; ++i) {
          visit_offsets[t][i] = odometers[t].offset;
          odometers[t].step();
        }
      }
      for (const int64_t b : visit_order) {
        const BlockDescriptor& block = plan.blocks[b];
        const BlockRows& shape = shapes[b];
        const int64_t row_bytes = shape.row_length * element_size;
        char* strided = plan.bases[block.tensor_index] + shape.start_offset * element_size;
        char* packed = flat + (block.flat_offset + visit_begin * shape.row_length) * element_size;
        const int64_t* offsets = visit_offsets[block.tensor_index];
        for (int64_t i = 0; i < visit_rows; ++i, packed += row_bytes) {
          copy_row(strided + offsets[i] * element_size, shape.inner_stride, packed,
                   shape.row_length, element_size, to_flat);
        }
      }
    }
  });
}

void block_copy_cpu(const BlockCopyPlan& plan, char* flat, bool to_flat) {
  const int64_t num_blocks = static_cast<int64_t>(plan.blocks.size());
  const int64_t element_size = plan.element_size;
  std::vector<BlockRows> shapes(num_blocks);
  // rows_before[b]: rows of all blocks before b, so a flat row index finds its block.
  std::vector<int64_t> rows_before(num_blocks + 1, 0);
  for (int64_t b = 0; b < num_blocks; ++b) {
    shapes[b] = block_rows(plan.layouts[plan.blocks[b].tensor_index], plan.blocks[b]);
    rows_before[b + 1] = rows_before[b] + shapes[b].rows;
  }
  if (rows_interleave(plan, shapes)) return block_copy_interleaved(plan, shapes, flat, to_flat);
  int64_t total_units = 0;
  for (const BlockDescriptor& block : plan.blocks) total_units += block.numel;
  const int64_t total_rows = rows_before[num_blocks];
  const int64_t mean_row_bytes = std::max<int64_t>(1, total_units * element_size / total_rows);
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / mean_row_bytes);
  at::parallel_for(0, total_rows, grain, [&](int64_t row_begin, int64_t row_end) {
    int64_t b = std::upper_bound(rows_before.begin(), rows_before.end(), row_begin) -
                rows_before.begin() - 1;
    int64_t row = row_begin;
    while (row < row_end) {
      const BlockDescriptor& block = plan.blocks[b];
      const BlockRows& shape = shapes[b];
      char* strided = plan.bases[block.tensor_index] + shape.start_offset * element_size;
      // The odometer starts at this task's first row of the block.
      RowOdometer odometer;
      odometer.start(plan.layouts[block.tensor_index], block, shape, row - rows_before[b]);
      const int64_t last_row = std::min(row_end, rows_before[b + 1]);
      char* packed = flat + (block.flat_offset + (row - rows_before[b]) * shape.row_length) * element_size;
      for (; row < last_row; ++row) {
        copy_row(strided + odometer.offset * element_size, shape.inner_stride, packed,
                 shape.row_length, element_size, to_flat);
        packed += shape.row_length * element_size;
        odometer.step();
      }
      ++b;
    }
  });
}

at::Tensor pack_blocks_cpu(at::TensorList inputs, at::IntArrayRef split_dims,
                           at::IntArrayRef starts, at::IntArrayRef lengths) {
  return pack_blocks(inputs, split_dims, starts, lengths, block_copy_cpu);
}

std::vector<at::Tensor> unpack_blocks_cpu(const at::Tensor& buffer, at::IntArrayRef out_shapes,
                                          at::IntArrayRef out_dim_orders,
                                          at::IntArrayRef split_dims, at::IntArrayRef starts,
                                          at::IntArrayRef lengths) {
  return unpack_blocks(buffer, out_shapes, out_dim_orders, split_dims, starts, lengths,
                       block_copy_cpu);
}

}  // namespace

TORCH_LIBRARY_IMPL(seqpar, CPU, m) {
  m.impl("pack_blocks", &pack_blocks_cpu);
  m.impl("unpack_blocks", &unpack_blocks_cpu);
}

}  // namespace seqpar
