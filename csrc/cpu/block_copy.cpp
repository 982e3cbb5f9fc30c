// CPU kernels of seqpar::pack_blocks and seqpar::unpack_blocks.
//
// Work is split into rows (see BlockRows): a row is the longest run of a block that is
// contiguous in the strided tensor, one memcpy; rows with a non-unit innermost stride
// copy element by element.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
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

struct alignas(16) Bytes16 {
  char bytes[16];
};

void copy_row(char* strided, int64_t stride, char* flat, int64_t count, int64_t element_size,
              bool to_flat) {
  if (stride == 1) {
    const size_t bytes = static_cast<size_t>(count * element_size);
    if (to_flat) std::memcpy(flat, strided, bytes);
    else std::memcpy(strided, flat, bytes);
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

// A block seen as rows: the trailing dims that are contiguous in the strided tensor
// (the split dim included, with the block's extent) form one row, copied with one
// memcpy; the remaining outer dims are walked with an odometer. Measured on a 2-core
// Xeon, Ulysses' q pack (B*S, H, D): one memcpy per (token, head) row plus index
// division per row made the kernel 1.45x slower than permute().contiguous(); rows of
// (heads of one rank) x D elements and no division per row remove that.
struct BlockRows {
  int64_t row_length;    // units per row
  int64_t inner_stride;  // stride between a row's units (1 when merged)
  int outer_ndim;
  int64_t outer_extents[kMaxDims];
  int64_t outer_strides[kMaxDims];
  int64_t start_offset;  // offset of the block's first unit in the strided tensor
  int64_t rows;
};

BlockRows block_rows(const StridedLayout& layout, const BlockDescriptor& block) {
  BlockRows rows{};
  int dim = layout.ndim - 1;
  auto extent = [&](int d) { return d == layout.split_dim ? block.length : layout.sizes[d]; };
  rows.row_length = extent(dim);
  rows.inner_stride = layout.strides[dim];
  if (rows.inner_stride == 1) {
    while (dim > 0 && layout.strides[dim - 1] == rows.row_length) {
      --dim;
      rows.row_length *= extent(dim);
    }
  }
  rows.outer_ndim = dim;
  rows.rows = 1;
  for (int d = 0; d < dim; ++d) {
    rows.outer_extents[d] = extent(d);
    rows.outer_strides[d] = layout.strides[d];
    rows.rows *= extent(d);
  }
  rows.start_offset = block.start * layout.strides[layout.split_dim];
  return rows;
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
      char* strided = plan.bases[block.tensor_index];
      // The odometer starts at this task's first row of the block: one division per
      // dim here, none per row below.
      int64_t index[kMaxDims];
      int64_t offset = shape.start_offset;
      int64_t remainder = row - rows_before[b];
      for (int d = shape.outer_ndim - 1; d >= 0; --d) {
        index[d] = remainder % shape.outer_extents[d];
        remainder /= shape.outer_extents[d];
        offset += index[d] * shape.outer_strides[d];
      }
      const int64_t last_row = std::min(row_end, rows_before[b + 1]);
      char* packed = flat + (block.flat_offset + (row - rows_before[b]) * shape.row_length) * element_size;
      for (; row < last_row; ++row) {
        copy_row(strided + offset * element_size, shape.inner_stride, packed, shape.row_length,
                 element_size, to_flat);
        packed += shape.row_length * element_size;
        for (int d = shape.outer_ndim - 1; d >= 0; --d) {
          offset += shape.outer_strides[d];
          if (++index[d] < shape.outer_extents[d]) break;
          offset -= index[d] * shape.outer_strides[d];
          index[d] = 0;
        }
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
