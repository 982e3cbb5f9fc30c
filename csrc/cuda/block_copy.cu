// CUDA kernels of seqpar::pack_blocks and seqpar::unpack_blocks.
//
// One grid row of CTAs (blockIdx.y) per block, so no thread searches for its block. A
// unit is 16 bytes whenever every tensor's innermost dim is contiguous and everything
// is 16-byte aligned (headdim 64/80/128 in bf16 always is). Each thread runs
// copy_block_rows (seqpar/block_copy.h, which tests also run on the host): the block
// is rows that are contiguous in the buffer and one stride apart in the tensor, a
// row's offset takes one division per outer dim and is found once per row (at most 16
// units per thread), and each thread loads 4 units into registers before it stores
// them, so 4 loads per thread wait on memory together.
//
// Why, in SASS instructions (cuobjdump -sass, nvcc 13.0; the 16-byte, int32-index,
// inline-list kernel; the same counts on sm_80 and sm_90a):
//   A unit per loop iteration, its offset found by a division and modulo per dim, one
//   load in flight per thread, was per unit: 95 with 2 dims, 128 (sm_80) / 129 (sm_90a)
//   with 3 dims (Ulysses' (B*S, H, D) pack), 161 / 163 with 4 (its unpack into
//   (B, H, S, D) memory).
//   Now the loop over whole passes is 31 instructions for 4 LDG.E.128 and 4 STG.E.128:
//   7.75 per unit. Each row (or 16-unit share of a row) adds 29, plus 31 per outer dim:
//   Ulysses' pack (1 outer dim, a row's 16 units per thread) is (29 + 31 + 4 x 31) / 16
//   = 11.5 per unit; its unpack into (B, H, S, D) memory (3 outer dims) 15.4.
// 64 registers per thread (no spills): 4 CTAs of 256 threads per SM, 16 KiB of loads in
// flight per CTA. The kernel's name keeps "block_copy": the ahead-of-time report finds
// it by that in the module's SASS.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/_to_copy.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "seqpar/block_copy.h"
#include "seqpar/block_copy_plan.h"

namespace seqpar {
namespace {

struct KernelLayouts {
  StridedLayout layouts[kMaxTensors];
  char* bases[kMaxTensors];
};

// Where the kernel finds the block list. Up to kInlineBlocks descriptors travel as a
// kernel argument (a Ulysses exchange of q, k and v over up to 21 ranks, a reshard over
// up to 64): the launch then needs no pinned host buffer and no host-to-device copy,
// and a CUDA graph that captures it keeps the list in its kernel node (a captured copy
// from a pinned buffer reads that host memory again at every replay, when the caching
// host allocator may have handed it to another call). Longer lists go through pinned
// and then device memory. 64 descriptors (2,560 B) plus the layouts (704 B) stay
// under the 4 KiB kernel-argument limit of every CUDA version.
constexpr int kInlineBlocks = 64;

struct InlineBlocks {
  BlockDescriptor blocks[kInlineBlocks];
  __device__ __forceinline__ BlockDescriptor operator[](unsigned index) const {
    return blocks[index];
  }
};

struct DeviceBlocks {
  const BlockDescriptor* blocks;
  __device__ __forceinline__ BlockDescriptor operator[](unsigned index) const {
    return blocks[index];
  }
};

// One grid row of CTAs (blockIdx.y) per block, so no thread searches for its block.
// What a thread copies is copy_block_rows (seqpar/block_copy.h), which tests also run
// on the host: index math once per row, kUnitsInFlight loads before the stores.
template <typename Unit, typename Index, typename BlockList>
__global__ void __launch_bounds__(kCudaThreadsPerCta)
    block_copy_kernel(KernelLayouts layouts, BlockList blocks, Unit* flat, bool to_flat) {
  const BlockDescriptor block = blocks[blockIdx.y];
  const StridedLayout& layout = layouts.layouts[block.tensor_index];
  Unit* strided = reinterpret_cast<Unit*>(layouts.bases[block.tensor_index]);
  const Index thread = static_cast<Index>(blockIdx.x * blockDim.x + threadIdx.x);
  const Index threads = static_cast<Index>(gridDim.x * blockDim.x);
  if (to_flat) copy_block_rows<true, Index>(layout, block, strided, flat, thread, threads);
  else copy_block_rows<false, Index>(layout, block, strided, flat, thread, threads);
}

template <typename Unit, typename BlockList>
void launch(const BlockCopyPlan& plan, const CudaBlockCopyLaunch& shape, const BlockList& blocks,
            char* flat, bool to_flat, cudaStream_t stream) {
  KernelLayouts layouts;
  for (int64_t t = 0; t < plan.num_tensors; ++t) {
    layouts.layouts[t] = plan.layouts[t];
    layouts.bases[t] = plan.bases[t];
  }
  const dim3 grid(static_cast<unsigned>(shape.ctas_per_block),
                  static_cast<unsigned>(plan.blocks.size()));
  if (shape.int32_index) {
    block_copy_kernel<Unit, int32_t><<<grid, kCudaThreadsPerCta, 0, stream>>>(
        layouts, blocks, reinterpret_cast<Unit*>(flat), to_flat);
  } else {
    block_copy_kernel<Unit, int64_t><<<grid, kCudaThreadsPerCta, 0, stream>>>(
        layouts, blocks, reinterpret_cast<Unit*>(flat), to_flat);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct alignas(16) Unit16 {
  uint4 value;
};

template <typename BlockList>
void launch_widest(const BlockCopyPlan& plan, const CudaBlockCopyLaunch& shape,
                   const BlockList& blocks, char* flat, bool to_flat, cudaStream_t stream) {
  switch (shape.unit_bytes) {
    case 16: return launch<Unit16>(plan, shape, blocks, flat, to_flat, stream);
    case 8: return launch<uint64_t>(plan, shape, blocks, flat, to_flat, stream);
    case 4: return launch<uint32_t>(plan, shape, blocks, flat, to_flat, stream);
    case 2: return launch<uint16_t>(plan, shape, blocks, flat, to_flat, stream);
    case 1: return launch<uint8_t>(plan, shape, blocks, flat, to_flat, stream);
    default: TORCH_CHECK(false, "seqpar block copy: unsupported element size ", shape.unit_bytes);
  }
}

void block_copy_cuda(const BlockCopyPlan& original_plan, char* flat, bool to_flat) {
  TORCH_CHECK(original_plan.blocks.size() <= 65535, "seqpar block copy: ",
              original_plan.blocks.size(), " blocks exceed the CUDA grid's y limit");
  BlockCopyPlan plan = original_plan;
  const CudaBlockCopyLaunch shape = plan_cuda_launch(plan, flat);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (plan.blocks.size() <= kInlineBlocks) {
    InlineBlocks blocks{};
    std::copy(plan.blocks.begin(), plan.blocks.end(), blocks.blocks);
    return launch_widest(plan, shape, blocks, flat, to_flat, stream);
  }
  // The long list travels to the device through pinned memory, asynchronously.
  const int64_t descriptor_bytes =
      static_cast<int64_t>(plan.blocks.size() * sizeof(BlockDescriptor));
  at::Tensor host_blocks = at::empty(
      {descriptor_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host_blocks.data_ptr(), plan.blocks.data(), descriptor_bytes);
  at::Tensor device_blocks = host_blocks.to(
      at::TensorOptions().device(at::kCUDA, c10::cuda::current_device()), /*non_blocking=*/true);
  const DeviceBlocks blocks{reinterpret_cast<const BlockDescriptor*>(device_blocks.data_ptr())};
  launch_widest(plan, shape, blocks, flat, to_flat, stream);
}

at::Tensor pack_blocks_cuda(at::TensorList inputs, at::IntArrayRef split_dims,
                            at::IntArrayRef starts, at::IntArrayRef lengths) {
  TORCH_CHECK(!inputs.empty(), "seqpar::pack_blocks: needs at least one input");
  const c10::cuda::CUDAGuard guard(inputs[0].device());
  return pack_blocks(inputs, split_dims, starts, lengths, block_copy_cuda);
}

std::vector<at::Tensor> unpack_blocks_cuda(const at::Tensor& buffer, at::IntArrayRef out_shapes,
                                           at::IntArrayRef out_dim_orders,
                                           at::IntArrayRef split_dims, at::IntArrayRef starts,
                                           at::IntArrayRef lengths) {
  const c10::cuda::CUDAGuard guard(buffer.device());
  return unpack_blocks(buffer, out_shapes, out_dim_orders, split_dims, starts, lengths,
                       block_copy_cuda);
}

}  // namespace

TORCH_LIBRARY_IMPL(seqpar, CUDA, m) {
  m.impl("pack_blocks", &pack_blocks_cuda);
  m.impl("unpack_blocks", &unpack_blocks_cuda);
}

}  // namespace seqpar
