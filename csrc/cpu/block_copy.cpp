// CPU kernels of seqpar::pack_blocks and seqpar::unpack_blocks.
//
// Work is split into rows: a row is one run of the innermost coalesced dim of a block.
// Rows whose innermost stride is 1 are one memcpy each (the common case: headdim is
// innermost); other rows copy element by element.
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

void block_copy_cpu(const BlockCopyPlan& plan, char* flat, bool to_flat) {
  const int64_t num_blocks = static_cast<int64_t>(plan.blocks.size());
  // rows_before[b]: rows of all blocks before b, so a flat row index finds its block.
  std::vector<int64_t> rows_before(num_blocks + 1, 0);
  std::vector<int64_t> row_length(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const BlockDescriptor& block = plan.blocks[b];
    const StridedLayout& layout = plan.layouts[block.tensor_index];
    const int inner = layout.ndim - 1;
    row_length[b] = inner == layout.split_dim ? block.length : layout.sizes[inner];
    rows_before[b + 1] = rows_before[b] + block.numel / row_length[b];
  }
  int64_t total_units = 0;
  for (const BlockDescriptor& block : plan.blocks) total_units += block.numel;
  const int64_t total_rows = rows_before[num_blocks];
  const int64_t mean_row_bytes = std::max<int64_t>(1, total_units * plan.element_size / total_rows);
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / mean_row_bytes);
  at::parallel_for(0, total_rows, grain, [&](int64_t row_begin, int64_t row_end) {
    int64_t b = std::upper_bound(rows_before.begin(), rows_before.end(), row_begin) -
                rows_before.begin() - 1;
    for (int64_t row = row_begin; row < row_end; ++row) {
      while (row >= rows_before[b + 1]) ++b;
      const BlockDescriptor& block = plan.blocks[b];
      const StridedLayout& layout = plan.layouts[block.tensor_index];
      const int64_t first = (row - rows_before[b]) * row_length[b];
      const int64_t offset = strided_offset(layout, block, first);
      copy_row(plan.bases[block.tensor_index] + offset * plan.element_size,
               layout.strides[layout.ndim - 1],
               flat + (block.flat_offset + first) * plan.element_size, row_length[b],
               plan.element_size, to_flat);
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
