// Index math shared by the CPU and CUDA block-copy kernels.
//
// A "block copy" moves data between strided tensors and one flat buffer made of
// blocks laid end to end. Block b is `tensor[t].narrow(split_dim[t], start, length)`
// stored in C order (row-major over the tensor's own dim order). Packing reads the
// strided blocks and writes the flat buffer (the all-to-all send buffer); unpacking
// reads the flat buffer and writes the strided blocks (straight into the output
// layout, which may be a permuted view such as (B, S, H, D) over (B, H, S, D) memory).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SEQPAR_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SEQPAR_HOST_DEVICE inline
#endif

namespace seqpar {

// Dims left after coalescing. Coalescing merges neighbouring dims that are
// contiguous with each other, so even non-contiguous inputs rarely need more than 4.
constexpr int kMaxDims = 10;
// q, k and v travel together in Ulysses; a reshard moves one tensor.
constexpr int kMaxTensors = 4;

// The layout of one strided tensor, in units of the copy (an element, or a
// vector of elements when the CUDA kernel copies 16 bytes at a time).
struct StridedLayout {
  int32_t ndim;
  int32_t split_dim;  // the dim the blocks narrow
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
};

// One block: which tensor, its range along split_dim, and where it lies in the buffer.
struct BlockDescriptor {
  int64_t tensor_index;
  int64_t start;        // first index along split_dim
  int64_t length;       // extent along split_dim
  int64_t flat_offset;  // first unit of the block in the flat buffer
  int64_t numel;        // units in the block
};

// Offset, in units, of the block's `linear_index`-th unit (C order over the block
// shape) inside its strided tensor, relative to the tensor's base pointer. Index is
// int64_t in general; the CUDA kernel uses int32_t when every offset fits, because
// 64-bit division costs several times the instructions of 32-bit division.
template <typename Index>
SEQPAR_HOST_DEVICE Index strided_offset(const StridedLayout& layout, const BlockDescriptor& block,
                                        Index linear_index) {
  Index offset = static_cast<Index>(block.start * layout.strides[layout.split_dim]);
  for (int dim = layout.ndim - 1; dim >= 0; --dim) {
    const Index extent =
        static_cast<Index>(dim == layout.split_dim ? block.length : layout.sizes[dim]);
    const Index index = linear_index % extent;
    linear_index /= extent;
    offset += index * static_cast<Index>(layout.strides[dim]);
  }
  return offset;
}

}  // namespace seqpar
