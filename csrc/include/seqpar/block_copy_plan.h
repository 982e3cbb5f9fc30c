// Host-side planning of a block copy, shared by the CPU and CUDA implementations of
// seqpar::pack_blocks and seqpar::unpack_blocks. Planning validates the arguments,
// coalesces each tensor's dims, and lists the blocks in buffer order; the device
// kernels only move bytes.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/FunctionRef.h>

#include <vector>

#include "seqpar/block_copy.h"

namespace seqpar {

struct BlockCopyPlan {
  StridedLayout layouts[kMaxTensors];  // in elements
  char* bases[kMaxTensors];            // data pointers of the strided tensors
  int64_t num_tensors = 0;
  std::vector<BlockDescriptor> blocks;  // in buffer order, empty blocks dropped
  int64_t element_size = 0;
};

// Moves data between the strided tensors and the flat buffer: to_flat is packing.
using BlockCopyKernel = c10::function_ref<void(const BlockCopyPlan& plan, char* flat, bool to_flat)>;

// How the CUDA kernel runs a plan, decided on the host (and decided the same way by
// the host run of its loop that the tests use).
struct CudaBlockCopyLaunch {
  int64_t unit_bytes;      // bytes per load and store: 16 whenever the plan allows
  bool int32_index;        // every unit index and offset fits in int32
  int64_t ctas_per_block;  // gridDim.x; gridDim.y is the number of blocks
};

// Turns `plan` into units of the widest copy it allows (in place) and sizes the grid.
CudaBlockCopyLaunch plan_cuda_launch(BlockCopyPlan& plan, const char* flat);

// seqpar::pack_blocks: buffer order is destination-major, then tensor.
at::Tensor pack_blocks(at::TensorList inputs, at::IntArrayRef split_dims,
                       at::IntArrayRef starts, at::IntArrayRef lengths,
                       BlockCopyKernel kernel);

// seqpar::unpack_blocks: the inverse layout; overlapping ranges are summed (the
// adjoint of packing overlapping ranges, as Ulysses does for shared GQA kv heads).
std::vector<at::Tensor> unpack_blocks(const at::Tensor& buffer, at::IntArrayRef out_shapes,
                                      at::IntArrayRef out_dim_orders,
                                      at::IntArrayRef split_dims, at::IntArrayRef starts,
                                      at::IntArrayRef lengths, BlockCopyKernel kernel);

}  // namespace seqpar
